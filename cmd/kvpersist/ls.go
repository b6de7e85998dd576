package main

import (
	"context"
	"encoding/json"
	"fmt"
	"strconv"
	"text/tabwriter"
	"time"

	"github.com/kvpersist/kvpersist/engine/layout"
	"github.com/kvpersist/kvpersist/engine/store"
	"github.com/spf13/cobra"
)

// openStore opens a store root for ls, du and gc: what a root and a
// namespace are is the store package's (a namespace directory given as the
// root is refused, a symlinked root accepted), and so is what each entry
// of a namespace is.
func openStore(root string) (st *store.Store, names, skipped []string, err error) {
	st, err = store.Open(root, store.Options{})
	if err != nil {
		return nil, nil, nil, err
	}
	names, skipped, err = st.Namespaces(false)
	return st, names, skipped, err
}

// listNamespace lists and decodes one namespace of st
// (store.Namespace.List), its page headers too (Listing.DecodePages).
func listNamespace(st *store.Store, name string) (*store.Listing, error) {
	ns, err := st.Namespace(name)
	if err != nil {
		return nil, err
	}
	l, err := ns.List(true)
	if err != nil {
		return nil, err
	}
	l.DecodePages()
	return l, nil
}

// logicalBytes is the sum of a snapshot's tensor bytes.
func logicalBytes(h *layout.Header) int64 {
	var n int64
	for _, t := range h.Slots() {
		n += t.Bytes
	}
	return n
}

// nounCount is "1 block", "2 blocks".
func nounCount(n int, noun string) string {
	if n == 1 {
		return "1 " + noun
	}
	return fmt.Sprintf("%d %ss", n, noun)
}

// writeJSON prints v as indented JSON.
func (c *cli) writeJSON(v any) error {
	enc := json.NewEncoder(c.stdout)
	enc.SetIndent("", "  ")
	return enc.Encode(v)
}

type lsRow struct {
	Namespace    string    `json:"namespace"`
	Name         string    `json:"name"`
	Path         string    `json:"path"`
	Layout       string    `json:"layout,omitempty"` // "single" or "blocks"
	Legacy       bool      `json:"legacy,omitempty"` // written by the Bun worker
	Tensors      int       `json:"tensors"`
	LogicalBytes int64     `json:"logicalBytes"`
	FileBytes    int64     `json:"fileBytes"`
	Modified     time.Time `json:"modified"`
	Error        *string   `json:"error"`
}

// lsPages is one namespace's prefix page cache (store.PageUsage).
type lsPages struct {
	Namespace    string `json:"namespace"`
	Pages        int    `json:"pages"`
	Unreadable   int    `json:"unreadable"`
	Tokens       int64  `json:"tokens"`       // token ids stored, summed over readable pages
	LogicalBytes int64  `json:"logicalBytes"` // tensor bytes of readable pages
	FileBytes    int64  `json:"fileBytes"`    // page file sizes
	// Files is every page file, with --pages.
	Files []lsPage `json:"files,omitempty"`
}

// lsPage is one page file (--pages).
type lsPage struct {
	Key  string `json:"key"` // the file's name
	Path string `json:"path"`
	// Parent is the parent page's key, "" for a first page (its parent is
	// the chain's root key, not a page).
	Parent     string    `json:"parent"`
	Identity   string    `json:"identity"`
	PageTokens int       `json:"pageTokens"`
	Tokens     int       `json:"tokens"` // token ids in this page
	FileBytes  int64     `json:"fileBytes"`
	Modified   time.Time `json:"modified"`
	Error      *string   `json:"error"`
}

type lsReport struct {
	Root      string    `json:"root"`
	Snapshots []lsRow   `json:"snapshots"`
	Pages     []lsPages `json:"pages,omitempty"` // namespaces holding pages/
	Skipped   []string  `json:"skipped"`
}

// pagesRow renders a namespace's pages for ls.
func pagesRow(l *store.Listing, files bool) lsPages {
	u := l.PageUsage()
	r := lsPages{Namespace: l.Namespace.Name(), Pages: u.Pages, Unreadable: u.Unreadable, Tokens: u.Tokens,
		LogicalBytes: u.LogicalBytes, FileBytes: u.FileBytes}
	if !files {
		return r
	}
	r.Files = []lsPage{}
	for _, p := range l.Pages {
		f := lsPage{Key: p.Key, Path: p.Path, FileBytes: p.Size, Modified: p.ModTime}
		if p.Err != nil || p.Snap == nil || p.Snap.Page == nil {
			msg := "not a page file"
			if p.Err != nil {
				msg = p.Err.Error()
			}
			f.Error = &msg
		} else {
			pg := p.Snap.Page
			if !pg.FirstPage() {
				f.Parent = pg.Parent.String()
			}
			f.Identity, f.PageTokens, f.Tokens = pg.Identity, pg.PageTokens, len(pg.Tokens)
		}
		r.Files = append(r.Files, f)
	}
	return r
}

func (c *cli) lsCommand() *cobra.Command {
	cmd := c.command("ls ROOT | ls --remote [NAMESPACE...]", "list every snapshot of a store: namespace, name, layout, tensors, logical bytes, modified time", `One row per snapshot file or manifest directly under ROOT/<namespace>/.
LOGICAL is the sum of the snapshot's tensor bytes (what a restore fills);
MODIFIED is the file's modification time. A file that does not decode is
listed with its error.

A namespace holding a prefix page cache (ROOT/<namespace>/pages/) gets a
line after the table: its page files, the token ids they hold, their tensor
bytes (logical) and file sizes (on disk). --pages lists every page file:
KEY (the file's name, first 16 of 64 hex digits), PARENT (the parent page's
key, or "-" for a first page), TOKENS (token ids in the page / the page size),
BYTES (file size) and the identity. Entries kvpersist does not recognise are listed as
skipped. Exit status: 0, 1 when some file is unreadable, 2 on usage or I/O
errors.

With --remote, ls lists the object-store tier instead (one LIST request
per 1,000 objects, nothing fetched): each namespace's manifests (name,
object bytes, the store's modification time) and a line with its page
count and bytes (--pages: every page's key, bytes and modification time).
The arguments are then namespaces; none means every namespace under
--prefix. Credentials come from AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY
(AWS_SESSION_TOKEN, AWS_REGION) or the AWS shared credentials file
(AWS_PROFILE).`, "kvpersist ls /var/lib/kvcache\nkvpersist ls --json /var/lib/kvcache | jq '.snapshots[] | select(.error != null)'\nkvpersist ls --remote --endpoint s3.example.com --bucket kvcache --prefix fleet-a", nil)
	fs := cmd.Flags()
	rf := addRemoteFlags(fs)
	cmd.Args = rf.args(cobra.ExactArgs(1))
	asJSON := fs.Bool("json", false, "print a JSON report: {root, snapshots: [{namespace, name, path, layout, legacy, tensors, logicalBytes, fileBytes, modified, error}], pages: [{namespace, pages, unreadable, tokens, logicalBytes, fileBytes, files}], skipped}")
	pages := fs.Bool("pages", false, "also list every page file of the prefix page cache: key (first 16 hex digits), parent, tokens, bytes, identity")
	runs(cmd, func(ctx context.Context, args []string) error {
		if rf.on {
			return c.runRemoteLs(ctx, cmd, rf, args, *asJSON, *pages)
		}
		if msg := rf.check(cmd); msg != "" {
			return usage(cmd, "%s", msg)
		}
		return c.runLs(ctx, args[0], *asJSON, *pages)
	})
	return cmd
}

func (c *cli) runLs(ctx context.Context, root string, asJSON, pageFiles bool) error {
	st, names, skipped, err := openStore(root)
	if err != nil {
		return fmt.Errorf("ls: %s", quote(err.Error()))
	}
	rep := lsReport{Root: root, Snapshots: []lsRow{}, Skipped: skipped}
	bad := 0
	for _, n := range names {
		if err := ctx.Err(); err != nil {
			return fmt.Errorf("ls: %w", err)
		}
		ns, err := listNamespace(st, n)
		if err != nil {
			return fmt.Errorf("ls: %s", quote(err.Error()))
		}
		rep.Skipped = append(rep.Skipped, ns.SkippedPaths()...)
		for _, s := range ns.Snapshots {
			row := lsRow{Namespace: n, Name: s.Name, Path: s.Path, FileBytes: s.Size, Modified: s.ModTime}
			if s.Err != nil {
				msg := s.Err.Error()
				row.Error = &msg
				bad++
				c.log.Debug("unreadable snapshot", "path", s.Path, "err", s.Err)
			} else {
				row.Layout, row.Legacy = s.Snap.Layout.String(), s.Snap.Legacy
				row.Tensors = len(s.Snap.Header.Slots())
				row.LogicalBytes = logicalBytes(s.Snap.Header)
			}
			rep.Snapshots = append(rep.Snapshots, row)
		}
		if ns.HasPagesDir {
			pr := pagesRow(ns, pageFiles)
			bad += pr.Unreadable
			rep.Pages = append(rep.Pages, pr)
		}
	}
	if asJSON {
		if err := c.writeJSON(rep); err != nil {
			return fmt.Errorf("writing JSON: %w", err)
		}
	} else {
		tw := tabwriter.NewWriter(c.stdout, 0, 0, 2, ' ', 0)
		fmt.Fprintln(tw, "NAMESPACE\tNAME\tLAYOUT\tTENSORS\tLOGICAL\tMODIFIED")
		for _, r := range rep.Snapshots {
			mod := r.Modified.Local().Format("2006-01-02 15:04:05")
			if r.Error != nil {
				fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\tUNREADABLE: %s\n", r.Namespace, quote(r.Name), "?", "-", "-", mod, quote(*r.Error))
				continue
			}
			lay := r.Layout
			if r.Legacy {
				lay += " (bun)"
			}
			fmt.Fprintf(tw, "%s\t%s\t%s\t%d\t%s\t%s\n", r.Namespace, quote(r.Name), lay, r.Tensors, humanBytes(r.LogicalBytes), mod)
		}
		tw.Flush()
		fmt.Fprintf(c.stdout, "%s in %s", nounCount(len(rep.Snapshots), "snapshot"), nounCount(len(names), "namespace"))
		if bad > 0 {
			fmt.Fprintf(c.stdout, ", %d unreadable (run 'kvpersist inspect PATH' for details)", bad)
		}
		fmt.Fprintln(c.stdout)
		c.printPages(rep.Pages)
		for _, s := range rep.Skipped {
			fmt.Fprintf(c.stdout, "skipped (not a kvpersist file): %s\n", quote(s))
		}
	}
	if bad > 0 {
		return errProblems
	}
	return nil
}

// printPages prints ls's page cache lines (and --pages tables).
func (c *cli) printPages(rows []lsPages) {
	for _, r := range rows {
		fmt.Fprintf(c.stdout, "%s: %s (prefix page cache), %d tokens, %s logical, %s on disk", r.Namespace,
			nounCount(r.Pages, "page"), r.Tokens, humanBytes(r.LogicalBytes), humanBytes(r.FileBytes))
		if r.Unreadable > 0 {
			fmt.Fprintf(c.stdout, ", %d unreadable (run 'kvpersist inspect PATH' for details)", r.Unreadable)
		}
		fmt.Fprintln(c.stdout)
		if r.Files == nil {
			continue
		}
		tw := tabwriter.NewWriter(c.stdout, 0, 0, 2, ' ', 0)
		fmt.Fprintln(tw, "  KEY\tPARENT\tTOKENS\tBYTES\tIDENTITY")
		for _, f := range r.Files {
			if f.Error != nil {
				fmt.Fprintf(tw, "  %s\t?\t-\t%d\tUNREADABLE: %s\n", f.Key[:16], f.FileBytes, quote(*f.Error))
				continue
			}
			parent := "-"
			if f.Parent != "" {
				parent = f.Parent[:16]
			}
			fmt.Fprintf(tw, "  %s\t%s\t%d/%d\t%d\t%s\n", f.Key[:16], parent, f.Tokens, f.PageTokens, f.FileBytes, strconv.Quote(f.Identity))
		}
		tw.Flush()
	}
}
