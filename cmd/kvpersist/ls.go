package main

import (
	"context"
	"encoding/json"
	"fmt"
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

// listNamespace lists and decodes one namespace of st (store.Namespace.List).
func listNamespace(st *store.Store, name string) (*store.Listing, error) {
	ns, err := st.Namespace(name)
	if err != nil {
		return nil, err
	}
	return ns.List(true)
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

type lsReport struct {
	Root      string   `json:"root"`
	Snapshots []lsRow  `json:"snapshots"`
	Skipped   []string `json:"skipped"`
}

func (c *cli) lsCommand() *cobra.Command {
	cmd := c.command("ls ROOT", "list every snapshot of a store: namespace, name, layout, tensors, logical bytes, modified time", `One row per snapshot file or manifest directly under ROOT/<namespace>/.
LOGICAL is the sum of the snapshot's tensor bytes (what a restore fills);
MODIFIED is the file's modification time. A file that does not decode is
listed with its error. Entries kvpersist does not recognise are listed as
skipped. Exit status: 0, 1 when some file is unreadable, 2 on usage or I/O
errors.`, "kvpersist ls /var/lib/kvcache\nkvpersist ls --json /var/lib/kvcache | jq '.snapshots[] | select(.error != null)'", cobra.ExactArgs(1))
	fs := cmd.Flags()
	asJSON := fs.Bool("json", false, "print a JSON report: {root, snapshots: [{namespace, name, path, layout, legacy, tensors, logicalBytes, fileBytes, modified, error}], skipped}")
	runs(cmd, func(ctx context.Context, args []string) int { return c.runLs(ctx, args[0], *asJSON) })
	return cmd
}

func (c *cli) runLs(ctx context.Context, root string, asJSON bool) int {
	st, names, skipped, err := openStore(root)
	if err != nil {
		return c.fail("ls: %s", quote(err.Error()))
	}
	rep := lsReport{Root: root, Snapshots: []lsRow{}, Skipped: skipped}
	bad := 0
	for _, n := range names {
		if err := ctx.Err(); err != nil {
			return c.fail("ls: %v", err)
		}
		ns, err := listNamespace(st, n)
		if err != nil {
			return c.fail("ls: %s", quote(err.Error()))
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
	}
	if asJSON {
		if err := c.writeJSON(rep); err != nil {
			return c.fail("writing JSON: %v", err)
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
		for _, s := range rep.Skipped {
			fmt.Fprintf(c.stdout, "skipped (not a kvpersist file): %s\n", quote(s))
		}
	}
	if bad > 0 {
		return exitProblems
	}
	return exitOK
}
