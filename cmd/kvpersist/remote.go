package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"

	"github.com/kvpersist/kvpersist/engine/layout"
	"github.com/kvpersist/kvpersist/engine/remote"
	"github.com/kvpersist/kvpersist/engine/store"
	"github.com/kvpersist/kvpersist/engine/vfs"
)

// The --remote forms of ls, du, verify and gc: the same questions asked of
// the object-store tier (engine/remote) instead of a local ROOT. The
// positional arguments are then namespaces (none: every namespace under
// --prefix). Credentials come from the environment or the AWS shared
// credentials file, never from a flag (a flag would show in ps and shell
// history).

// remoteFlags are the flags every --remote command shares.
type remoteFlags struct {
	on                       bool
	endpoint, bucket, prefix string
	insecure                 bool
}

// remoteOnly are the flags that mean nothing without --remote.
var remoteOnly = []string{"endpoint", "bucket", "prefix", "insecure"}

func addRemoteFlags(fs *pflag.FlagSet) *remoteFlags {
	r := &remoteFlags{}
	fs.BoolVar(&r.on, "remote", false, "work on the object-store tier (S3) instead of a local ROOT: the arguments are then namespaces, none meaning every namespace under --prefix")
	fs.StringVar(&r.endpoint, "endpoint", "", "with --remote: the S3 endpoint, host[:port] (HTTPS) or https://host[:port]")
	fs.StringVar(&r.bucket, "bucket", "", "with --remote: the bucket (it must exist)")
	fs.StringVar(&r.prefix, "prefix", "", "with --remote: the prefix of kvpersist's objects in the bucket ('/'-separated elements of [A-Za-z0-9._-])")
	fs.BoolVar(&r.insecure, "insecure", false, "with --remote: plain HTTP; refused unless the endpoint is a loopback address (a local test server)")
	return r
}

// args is the positional-argument rule: ROOT, or with --remote any number
// of namespaces.
func (r *remoteFlags) args(local cobra.PositionalArgs) cobra.PositionalArgs {
	return func(cmd *cobra.Command, args []string) error {
		if r.on {
			return nil
		}
		return local(cmd, args)
	}
}

// check returns a usage problem: a remote flag without --remote, a local
// flag (of localOnly) with it, or --remote without its endpoint or bucket.
func (r *remoteFlags) check(cmd *cobra.Command, localOnly ...string) string {
	fs := cmd.Flags()
	if !r.on {
		for _, f := range remoteOnly {
			if fs.Changed(f) {
				return "--" + f + " needs --remote"
			}
		}
		return ""
	}
	for _, f := range localOnly {
		if fs.Changed(f) {
			return "--" + f + " applies to a local ROOT, not with --remote"
		}
	}
	if r.endpoint == "" || r.bucket == "" {
		return "--remote needs --endpoint and --bucket"
	}
	if r.insecure && strings.Contains(r.endpoint, "://") {
		return "--insecure with an endpoint URL: give host:port, or an http:// URL without --insecure"
	}
	return ""
}

// open connects to the store the flags name (no request is sent yet).
func (r *remoteFlags) open() (*remote.Store, error) {
	ep := r.endpoint
	if r.insecure {
		ep = "http://" + ep
	}
	return remote.New(remote.ConfigFromEnv(ep, r.bucket, r.prefix))
}

// target names the store in reports: "s3://bucket/prefix".
func (r *remoteFlags) target() string {
	t := "s3://" + r.bucket
	if r.prefix != "" {
		t += "/" + r.prefix
	}
	return t
}

// namespaces are the namespaces a command works on: args, or every one
// under the prefix (with the objects skipped because they are not in a
// namespace).
func (c *cli) remoteNamespaces(ctx context.Context, s *remote.Store, args []string) (names, skipped []string, err error) {
	if len(args) > 0 {
		for _, a := range args {
			if _, err := s.NamespacePrefix(a); err != nil {
				return nil, nil, err
			}
		}
		return args, nil, nil
	}
	return s.Namespaces(ctx)
}

// openRemote runs check, open and remoteNamespaces; the command goes on
// when err is nil.
func (c *cli) openRemote(ctx context.Context, cmd *cobra.Command, r *remoteFlags, args []string, localOnly ...string) (s *remote.Store, names, skipped []string, err error) {
	if msg := r.check(cmd, localOnly...); msg != "" {
		return nil, nil, nil, usage(cmd, "%s", msg)
	}
	s, err = r.open()
	if err != nil {
		return nil, nil, nil, fmt.Errorf("%s --remote: %s", cmd.Name(), quote(err.Error()))
	}
	names, skipped, err = c.remoteNamespaces(ctx, s, args)
	if err != nil {
		s.Close()
		return nil, nil, nil, fmt.Errorf("%s --remote: %s", cmd.Name(), quote(err.Error()))
	}
	return s, names, skipped, nil
}

// ls --remote

type remoteLsManifest struct {
	Namespace string    `json:"namespace"`
	Name      string    `json:"name"`
	Object    string    `json:"object"`
	Bytes     int64     `json:"bytes"`
	Modified  time.Time `json:"modified"`
}

type remoteLsPage struct {
	Key      string    `json:"key"`
	Object   string    `json:"object"`
	Bytes    int64     `json:"bytes"`
	Modified time.Time `json:"modified"`
}

type remoteLsPages struct {
	Namespace string         `json:"namespace"`
	Pages     int            `json:"pages"`
	Bytes     int64          `json:"bytes"`
	Files     []remoteLsPage `json:"files,omitempty"` // with --pages
}

type remoteLsReport struct {
	Target    string             `json:"target"`
	Manifests []remoteLsManifest `json:"manifests"`
	Pages     []remoteLsPages    `json:"pages"`
	Skipped   []string           `json:"skipped"` // objects kvpersist does not write: never touched
}

func (c *cli) runRemoteLs(ctx context.Context, cmd *cobra.Command, r *remoteFlags, args []string, asJSON, pageFiles bool) error {
	s, names, skipped, err := c.openRemote(ctx, cmd, r, args)
	if err != nil {
		return err
	}
	defer s.Close()
	rep := remoteLsReport{Target: r.target(), Manifests: []remoteLsManifest{}, Pages: []remoteLsPages{}, Skipped: nonNil(skipped)}
	for _, ns := range names {
		objs, err := s.List(ctx, ns)
		if err != nil {
			return fmt.Errorf("ls --remote: %s", quote(err.Error()))
		}
		pr := remoteLsPages{Namespace: ns}
		if pageFiles {
			pr.Files = []remoteLsPage{}
		}
		for _, o := range objs {
			switch o.Kind {
			case remote.Manifest:
				rep.Manifests = append(rep.Manifests, remoteLsManifest{Namespace: ns, Name: o.Key, Object: o.Name, Bytes: o.Size, Modified: o.ModTime})
			case remote.Page:
				pr.Pages++
				pr.Bytes += o.Size
				if pageFiles {
					pr.Files = append(pr.Files, remoteLsPage{Key: o.Key, Object: o.Name, Bytes: o.Size, Modified: o.ModTime})
				}
			default:
				rep.Skipped = append(rep.Skipped, o.Name)
			}
		}
		if pr.Pages > 0 {
			rep.Pages = append(rep.Pages, pr)
		}
	}
	if asJSON {
		if err := c.writeJSON(rep); err != nil {
			return fmt.Errorf("writing JSON: %w", err)
		}
		return nil
	}
	tw := tabwriter.NewWriter(c.stdout, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "NAMESPACE\tMANIFEST\tBYTES\tMODIFIED")
	for _, m := range rep.Manifests {
		fmt.Fprintf(tw, "%s\t%s\t%d\t%s\n", m.Namespace, quote(m.Name), m.Bytes, m.Modified.Local().Format("2006-01-02 15:04:05"))
	}
	tw.Flush()
	fmt.Fprintf(c.stdout, "%s in %s at %s\n", nounCount(len(rep.Manifests), "manifest"), nounCount(len(names), "namespace"), quote(rep.Target))
	for _, p := range rep.Pages {
		fmt.Fprintf(c.stdout, "%s: %s, %s\n", p.Namespace, nounCount(p.Pages, "page"), humanBytes(p.Bytes))
		if p.Files == nil {
			continue
		}
		tw := tabwriter.NewWriter(c.stdout, 0, 0, 2, ' ', 0)
		fmt.Fprintln(tw, "  KEY\tBYTES\tMODIFIED")
		for _, f := range p.Files {
			fmt.Fprintf(tw, "  %s\t%d\t%s\n", f.Key[:16], f.Bytes, f.Modified.Local().Format("2006-01-02 15:04:05"))
		}
		tw.Flush()
	}
	for _, sk := range rep.Skipped {
		fmt.Fprintf(c.stdout, "skipped (not a kvpersist object): %s\n", quote(sk))
	}
	return nil
}

// du --remote and gc --remote: both are a remote collect, du's always a
// dry run.

// remoteGCRow is one namespace's remote collect. Bytes are object sizes.
type remoteGCRow struct {
	Namespace     string `json:"namespace"`
	Manifests     int    `json:"manifests"`
	ManifestBytes int64  `json:"manifestBytes"`
	Pages         int    `json:"pages"`
	PageBytes     int64  `json:"pageBytes"`
	// Live: pages a manifest names; Young: unreferenced pages within the
	// grace period (maybe being uploaded for a manifest to come).
	Live       int   `json:"live"`
	LiveBytes  int64 `json:"liveBytes"`
	Young      int   `json:"young"`
	YoungBytes int64 `json:"youngBytes"`
	// Reclaimable / ReclaimableBytes: pages deleted (gc --delete) or that
	// would be (du, gc's dry run).
	Reclaimable      int      `json:"reclaimable"`
	ReclaimableBytes int64    `json:"reclaimableBytes"`
	Deleted          []string `json:"deleted"` // object names, gc only
	// Refreshed: pages old in the listing but younger than the grace when
	// re-read just before their delete (an uploader renewed them): kept.
	Refreshed int `json:"refreshed"`
	// Error: why the namespace was not collected (an unreadable manifest:
	// the pages it names cannot be known), "" when it was.
	Error string `json:"error"`
}

type remoteGCReport struct {
	Target string        `json:"target"`
	DryRun bool          `json:"dryRun"`
	Grace  string        `json:"grace"`
	Rows   []remoteGCRow `json:"namespaces"`
	// ServerNow is the store's clock (its Date header) at the last listing.
	ServerNow time.Time `json:"serverNow"`
	Skipped   []string  `json:"skipped"`
}

// remoteCollect runs a remote collect of every namespace. A namespace
// whose manifests cannot all be read is reported and not collected; any
// other failure ends the run with an error.
func remoteCollect(ctx context.Context, s *remote.Store, names []string, grace time.Duration, dryRun bool) (*remoteGCReport, error) {
	rep := &remoteGCReport{DryRun: dryRun, Grace: grace.String(), Rows: []remoteGCRow{}}
	for _, ns := range names {
		cr, err := s.Collect(ctx, remote.CollectOptions{Namespace: ns, Grace: grace, Live: s.LivePages, DryRun: dryRun})
		row := remoteGCRow{Namespace: ns, Manifests: cr.Manifests, ManifestBytes: cr.ManifestBytes, Pages: cr.Pages, PageBytes: cr.PageBytes,
			Live: cr.Live, LiveBytes: cr.LiveBytes, Young: cr.Young, YoungBytes: cr.YoungBytes,
			Reclaimable: cr.Deleted, ReclaimableBytes: cr.DeletedBytes, Deleted: nonNil(cr.DeletedNames), Refreshed: cr.Refreshed}
		switch {
		case err == nil:
		case errors.Is(err, remote.ErrCorrupt) || errors.Is(err, remote.ErrTooLarge):
			row.Error = err.Error()
		default:
			return rep, err
		}
		rep.Skipped = append(rep.Skipped, cr.Unknown...)
		rep.ServerNow = cr.ServerNow
		rep.Rows = append(rep.Rows, row)
	}
	rep.Skipped = nonNil(rep.Skipped)
	return rep, nil
}

func nonNil(s []string) []string {
	if s == nil {
		return []string{}
	}
	return s
}

// checkGrace refuses a grace period under the library's minimum.
func (c *cli) checkGrace(cmd *cobra.Command, grace time.Duration) error {
	if grace < time.Minute {
		return usage(cmd, "--grace %v: the minimum is 1m (machines may be uploading pages for a manifest to come)", grace)
	}
	return nil
}

func (c *cli) runRemoteDu(ctx context.Context, cmd *cobra.Command, r *remoteFlags, args []string, grace time.Duration, asJSON, exact bool) error {
	if err := c.checkGrace(cmd, grace); err != nil {
		return err
	}
	s, names, skipped, err := c.openRemote(ctx, cmd, r, args)
	if err != nil {
		return err
	}
	defer s.Close()
	rep, err := remoteCollect(ctx, s, names, grace, true)
	if err != nil {
		return fmt.Errorf("du --remote: %s", quote(err.Error()))
	}
	rep.Target, rep.Skipped = r.target(), append(skipped, rep.Skipped...)
	rep.Skipped = nonNil(rep.Skipped)
	bad := 0
	for _, row := range rep.Rows {
		if row.Error != "" {
			bad++
		}
	}
	if asJSON {
		if err := c.writeJSON(rep); err != nil {
			return fmt.Errorf("writing JSON: %w", err)
		}
	} else {
		size := humanBytes
		if exact {
			size = func(n int64) string { return strconv.FormatInt(n, 10) }
		}
		tw := tabwriter.NewWriter(c.stdout, 0, 0, 2, ' ', tabwriter.AlignRight)
		fmt.Fprintln(tw, "NAMESPACE\tMANIFESTS\tMANIFEST BYTES\tPAGES\tPAGE BYTES\tLIVE\tYOUNG\tRECLAIMABLE\t")
		for _, row := range rep.Rows {
			live, young, recl := size(row.LiveBytes), size(row.YoungBytes), size(row.ReclaimableBytes)
			if row.Error != "" { // which pages are live is not known
				live, young, recl = "?", "?", "?"
			}
			fmt.Fprintf(tw, "%s\t%d\t%s\t%d\t%s\t%s\t%s\t%s\t\n", row.Namespace, row.Manifests, size(row.ManifestBytes), row.Pages,
				size(row.PageBytes), live, young, recl)
		}
		tw.Flush()
		for _, row := range rep.Rows {
			if row.Error != "" {
				fmt.Fprintf(c.stdout, "not collectable (a manifest is unreadable; see 'kvpersist verify --remote'): %s: %s\n", row.Namespace, quote(row.Error))
			}
		}
		for _, sk := range rep.Skipped {
			fmt.Fprintf(c.stdout, "skipped (not a kvpersist object, not counted): %s\n", quote(sk))
		}
	}
	if bad > 0 {
		return errProblems
	}
	return nil
}

func (c *cli) runRemoteGC(ctx context.Context, cmd *cobra.Command, r *remoteFlags, args []string, grace time.Duration, del, asJSON bool) error {
	if err := c.checkGrace(cmd, grace); err != nil {
		return err
	}
	if del && cmd.Flags().Changed("dry-run") {
		return usage(cmd, "--delete and --dry-run contradict each other")
	}
	s, names, skipped, err := c.openRemote(ctx, cmd, r, args, "temp-grace", "block-grace")
	if err != nil {
		return err
	}
	defer s.Close()
	rep, err := remoteCollect(ctx, s, names, grace, !del)
	if rep != nil && !asJSON { // what was deleted before an error is printed too
		verb := "would delete"
		if del {
			verb = "deleted"
		}
		for _, row := range rep.Rows {
			for _, d := range row.Deleted {
				fmt.Fprintf(c.stdout, "%s %s\n", verb, quote(d))
			}
		}
	}
	if err != nil {
		return fmt.Errorf("gc --remote: %s", quote(err.Error()))
	}
	rep.Target, rep.Skipped = r.target(), nonNil(append(skipped, rep.Skipped...))
	if asJSON {
		if err := c.writeJSON(rep); err != nil {
			return fmt.Errorf("writing JSON: %w", err)
		}
	}
	bad := 0
	var t remoteGCRow
	for _, row := range rep.Rows {
		if row.Error != "" {
			bad++
			if !asJSON {
				fmt.Fprintf(c.stdout, "not collected (a manifest is unreadable; see 'kvpersist verify --remote'): %s: %s\n", row.Namespace, quote(row.Error))
			}
			continue
		}
		t.Manifests += row.Manifests
		t.Pages += row.Pages
		t.Live += row.Live
		t.Young += row.Young
		t.Reclaimable += row.Reclaimable
		t.ReclaimableBytes += row.ReclaimableBytes
		t.Refreshed += row.Refreshed
	}
	if !asJSON {
		verb, freed := "deleted", "freed"
		if !del {
			verb, freed = "would delete", "would free"
		}
		fmt.Fprintf(c.stdout, "gc %s: %d of %s collected, %d manifests, %d pages: %d live, %d younger than %v kept; %s %d pages, %s %s (%d bytes)\n",
			quote(rep.Target), len(rep.Rows)-bad, nounCount(len(rep.Rows), "namespace"), t.Manifests, t.Pages, t.Live, t.Young, grace, verb,
			t.Reclaimable, freed, humanBytes(t.ReclaimableBytes), t.ReclaimableBytes)
		if t.Refreshed > 0 {
			fmt.Fprintf(c.stdout, "kept %d pages an uploader renewed after the listing\n", t.Refreshed)
		}
		if !del {
			fmt.Fprintln(c.stdout, "dry run: nothing was deleted (pass --delete to delete)")
		}
		for _, sk := range rep.Skipped {
			fmt.Fprintf(c.stdout, "skipped (not a kvpersist object, never deleted): %s\n", quote(sk))
		}
	}
	if bad > 0 {
		return errProblems
	}
	return nil
}

// verify --remote

type remoteVerifyProblem struct {
	Namespace string `json:"namespace"`
	remote.Problem
}

type remoteVerifyReport struct {
	Target   string                `json:"target"`
	Clean    bool                  `json:"clean"`
	Problems []remoteVerifyProblem `json:"problems"`
	Checked  struct {
		Namespaces int   `json:"namespaces"`
		Manifests  int   `json:"manifests"`
		Pages      int   `json:"pages"`
		Bytes      int64 `json:"bytes"`
	} `json:"checked"`
	// Vanished: objects deleted between the listing and their fetch (a
	// remote gc meanwhile); not problems.
	Vanished []string `json:"vanished"`
	Skipped  []string `json:"skipped"`
	// Repaired: with --repair-from, each corrupt page object and what
	// became of it.
	Repaired []remoteRepair `json:"repaired,omitempty"`
}

// remoteRepair is one corrupt page object that --repair-from tried to
// replace with the local page at From.
type remoteRepair struct {
	Object   string `json:"object"`
	From     string `json:"from"`
	Replaced bool   `json:"replaced"`
	Err      string `json:"error,omitempty"`
}

// repairPages replaces each corrupt page object of rep (corrupt-page
// problems) with the page of the same key under root, when that local
// page verifies and the object still does not (remote.Store.RepairPage).
func repairPages(ctx context.Context, s *remote.Store, root string, rep *remoteVerifyReport) error {
	st, err := store.Open(root, store.Options{})
	if err != nil {
		return err
	}
	for _, p := range rep.Problems {
		if p.Kind != remote.ProblemCorruptPage {
			continue
		}
		r := remoteRepair{Object: p.Name}
		k, kerr := layout.ParsePageKey(path.Base(p.Name))
		n, nerr := st.Namespace(p.Namespace)
		if err := errors.Join(kerr, nerr); err != nil {
			r.Err = err.Error()
			rep.Repaired = append(rep.Repaired, r)
			continue
		}
		r.From = n.PagePath(k)
		f, err := vfs.OpenRegular(vfs.Default, r.From)
		if err == nil {
			var fi os.FileInfo
			if fi, err = f.Stat(); err == nil {
				r.Replaced, err = s.RepairPage(ctx, p.Namespace, k.String(), f, fi.Size())
			}
			f.Close()
		}
		if err != nil {
			r.Err = err.Error()
		} else if !r.Replaced {
			r.Err = "the stored object verifies now: kept"
		}
		rep.Repaired = append(rep.Repaired, r)
	}
	return nil
}

func (c *cli) runRemoteVerify(ctx context.Context, cmd *cobra.Command, r *remoteFlags, args []string, workers int, asJSON bool, repairFrom string) error {
	s, names, skipped, err := c.openRemote(ctx, cmd, r, args, "temp-grace", "no-lock")
	if err != nil {
		return err
	}
	defer s.Close()
	rep := remoteVerifyReport{Target: r.target(), Problems: []remoteVerifyProblem{}, Vanished: []string{}, Skipped: nonNil(skipped)}
	for _, ns := range names {
		vr, err := s.Verify(ctx, ns, remote.VerifyOptions{Workers: workers})
		if err != nil {
			return fmt.Errorf("verify --remote: %s", quote(err.Error()))
		}
		rep.Checked.Namespaces++
		rep.Checked.Manifests += vr.Manifests
		rep.Checked.Pages += vr.Pages
		rep.Checked.Bytes += vr.Bytes
		for _, p := range vr.Problems {
			rep.Problems = append(rep.Problems, remoteVerifyProblem{Namespace: ns, Problem: p})
		}
		rep.Vanished = append(rep.Vanished, vr.Vanished...)
		rep.Skipped = append(rep.Skipped, vr.Unknown...)
	}
	rep.Clean = len(rep.Problems) == 0
	if repairFrom != "" && !rep.Clean {
		if err := repairPages(ctx, s, repairFrom, &rep); err != nil {
			return fmt.Errorf("verify --remote --repair-from: %s", quote(err.Error()))
		}
	}
	if asJSON {
		if err := c.writeJSON(rep); err != nil {
			return fmt.Errorf("writing JSON: %w", err)
		}
	} else {
		w := c.stdout
		fmt.Fprintf(w, "verify %s: %s, %s and %s fetched and checked (%s)\n", quote(rep.Target), nounCount(rep.Checked.Namespaces, "namespace"),
			nounCount(rep.Checked.Manifests, "manifest"), nounCount(rep.Checked.Pages, "page"), humanBytes(rep.Checked.Bytes))
		for _, v := range rep.Vanished {
			fmt.Fprintf(w, "vanished while verifying (deleted by a remote gc): %s\n", quote(v))
		}
		for _, sk := range rep.Skipped {
			fmt.Fprintf(w, "skipped (not a kvpersist object, not checked): %s\n", quote(sk))
		}
		if rep.Clean {
			fmt.Fprintln(w, "clean: no problems found")
		} else {
			fmt.Fprintf(w, "%s:\n", nounCount(len(rep.Problems), "problem"))
			for _, p := range rep.Problems {
				fmt.Fprintf(w, "  %-14s %s\n      %s\n", p.Kind, quote(p.Name), quote(p.Detail))
			}
		}
		for _, rp := range rep.Repaired {
			if rp.Replaced {
				fmt.Fprintf(w, "repaired %s from %s\n", quote(rp.Object), quote(rp.From))
			} else {
				fmt.Fprintf(w, "not repaired %s: %s\n", quote(rp.Object), quote(rp.Err))
			}
		}
	}
	if !rep.Clean {
		return errProblems
	}
	return nil
}
