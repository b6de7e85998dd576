package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"text/tabwriter"
	"time"

	"github.com/kvpersist/kvpersist/engine/layout"
	"github.com/kvpersist/kvpersist/engine/vfs"
)

func init() {
	register(&command{
		name: "ls", args: "ROOT",
		summary: "list every snapshot of a store: namespace, name, layout, tensors, logical bytes, modified time",
		example: "kvpersist ls /var/lib/kvcache\n  kvpersist ls --json /var/lib/kvcache | jq '.snapshots[] | select(.error != null)'",
		run:     runLs,
	})
}

// This file also holds the store walker shared by ls, du and verify. It
// classifies directory entries exactly as jobs.Collect does, so that what
// these commands call a snapshot, a block, a temp file or an unrecognised
// entry is what gc acts on:
//
//	ROOT/<namespace>/            a directory with a valid name (layout.ValidName)
//	  .lock                      the namespace lock (ignored)
//	  .<name>.tmp-<16 hex>       a temp file (layout.IsTemp)
//	  <name>                     a snapshot file or manifest (regular file, valid name)
//	  blocks/<2 hex>/<64 hex>    a block (kvpersist)
//	  blocks/<64 hex>            a block (Bun worker, flat)
//	  blocks/[<2 hex>/].*.tmp-*  a temp file
//
// Anything else is "skipped": listed, never touched.

// scanSnap is one snapshot file or manifest found in a namespace.
type scanSnap struct {
	Name, Path string
	Size       int64 // file size in bytes
	ModTime    time.Time
	Snap       *layout.Snapshot // nil when Err != nil (or not decoded)
	Err        error            // decoding or I/O error of this file
}

// scanBlock is one block file found under a namespace's blocks/.
type scanBlock struct {
	Hash, Path string
	Size       int64 // file size in bytes
	Flat       bool  // blocks/<hash> (the Bun worker's place), not blocks/<2 hex>/<hash>
}

// scanTemp is one temp file (layout.IsTemp) in a namespace or its blocks/.
type scanTemp struct {
	Path    string
	Size    int64
	ModTime time.Time
}

// scanNS is one namespace directory as found on disk.
type scanNS struct {
	Name, Dir string
	Snaps     []scanSnap  // sorted by name
	Blocks    []scanBlock // sorted by path
	Temps     []scanTemp
	Skipped   []string // unrecognised entries
	Err       error    // the directory (or its blocks/) could not be listed
}

// unreadable counts the snapshots that did not decode.
func (ns *scanNS) unreadable() int {
	n := 0
	for _, s := range ns.Snaps {
		if s.Err != nil {
			n++
		}
	}
	return n
}

// scanRootDir lists the namespaces of a store root. Like jobs.Collect it
// refuses a namespace directory (one holding blocks/) given as the root.
// Entries of the root that are not namespace directories are returned as
// skipped.
func scanRootDir(fsys vfs.FS, root string) (names, skipped []string, err error) {
	st, err := fsys.Lstat(root)
	if err != nil {
		return nil, nil, fmt.Errorf("store root %s: %w", root, err)
	}
	if !st.IsDir() {
		return nil, nil, fmt.Errorf("store root %s is not a directory", root)
	}
	if bst, err := fsys.Lstat(layout.BlocksDir(root)); err == nil && bst.IsDir() {
		return nil, nil, fmt.Errorf("%s holds a blocks/ directory: it is a namespace; pass the store root above it (%s)", root, filepath.Dir(root))
	}
	ents, err := fsys.ReadDir(root)
	if err != nil {
		return nil, nil, fmt.Errorf("store root %s: %w", root, err)
	}
	for _, e := range ents {
		if e.IsDir() && layout.ValidName("namespace", e.Name()) == nil {
			names = append(names, e.Name())
		} else {
			skipped = append(skipped, filepath.Join(root, e.Name()))
		}
	}
	sort.Strings(names)
	return names, skipped, nil
}

// scanNamespace lists one namespace; with decode it also decodes every
// snapshot's header (layout.Load: prefix, header hash, validation; no
// tensor data is read).
func scanNamespace(fsys vfs.FS, root, name string, decode bool) *scanNS {
	ns := &scanNS{Name: name, Dir: filepath.Join(root, name)}
	ents, err := fsys.ReadDir(ns.Dir)
	if err != nil {
		ns.Err = err
		return ns
	}
	temp := func(path string, e os.DirEntry) {
		info, err := e.Info()
		if err != nil || !info.Mode().IsRegular() {
			ns.Skipped = append(ns.Skipped, path)
			return
		}
		ns.Temps = append(ns.Temps, scanTemp{Path: path, Size: info.Size(), ModTime: info.ModTime()})
	}
	block := func(dir string, e os.DirEntry, flat bool) {
		path := filepath.Join(dir, e.Name())
		info, err := e.Info()
		if err != nil || !info.Mode().IsRegular() {
			ns.Skipped = append(ns.Skipped, path)
			return
		}
		ns.Blocks = append(ns.Blocks, scanBlock{Hash: e.Name(), Path: path, Size: info.Size(), Flat: flat})
	}
	for _, e := range ents {
		n, path := e.Name(), filepath.Join(ns.Dir, e.Name())
		switch {
		case n == layout.LockName:
		case layout.IsTemp(n):
			temp(path, e)
		case n == layout.BlocksDirName && e.IsDir():
			bents, err := fsys.ReadDir(path)
			if err != nil {
				ns.Err = errors.Join(ns.Err, err)
				continue
			}
			for _, b := range bents {
				bn, bpath := b.Name(), filepath.Join(path, b.Name())
				switch {
				case b.IsDir() && isFanoutDir(bn):
					sub, err := fsys.ReadDir(bpath)
					if err != nil {
						ns.Err = errors.Join(ns.Err, err)
						continue
					}
					for _, s := range sub {
						switch sn := s.Name(); {
						case layout.IsTemp(sn):
							temp(filepath.Join(bpath, sn), s)
						case layout.ValidBlockHash(sn) && sn[:2] == bn:
							block(bpath, s, false)
						default:
							ns.Skipped = append(ns.Skipped, filepath.Join(bpath, sn))
						}
					}
				case layout.IsTemp(bn):
					temp(bpath, b)
				case layout.ValidBlockHash(bn):
					block(path, b, true)
				default:
					ns.Skipped = append(ns.Skipped, bpath)
				}
			}
		case e.Type().IsRegular():
			// As collect: any regular file starting with a magic is a
			// snapshot or manifest, whatever its name; others are skipped.
			if ok, err := layout.HasMagic(fsys, path); err == nil && !ok {
				ns.Skipped = append(ns.Skipped, path)
				continue
			}
			s := scanSnap{Name: n, Path: path}
			info, err := e.Info()
			if err != nil {
				s.Err = err
			} else {
				s.Size, s.ModTime = info.Size(), info.ModTime()
				if decode {
					s.Snap, s.Err = layout.Load(fsys, path)
				}
			}
			ns.Snaps = append(ns.Snaps, s)
		default:
			ns.Skipped = append(ns.Skipped, path)
		}
	}
	sort.Slice(ns.Snaps, func(i, j int) bool { return ns.Snaps[i].Name < ns.Snaps[j].Name })
	sort.Slice(ns.Blocks, func(i, j int) bool { return ns.Blocks[i].Path < ns.Blocks[j].Path })
	sort.Slice(ns.Temps, func(i, j int) bool { return ns.Temps[i].Path < ns.Temps[j].Path })
	sort.Strings(ns.Skipped)
	return ns
}

// isFanoutDir reports whether name is a block fan-out directory: 2 lowercase hex digits.
func isFanoutDir(name string) bool {
	hex := func(c byte) bool { return c >= '0' && c <= '9' || c >= 'a' && c <= 'f' }
	return len(name) == 2 && hex(name[0]) && hex(name[1])
}

// isDecodeError reports whether err is the store's content at fault (a
// layout decoding sentinel) rather than the I/O system.
func isDecodeError(err error) bool {
	for _, s := range []error{layout.ErrBadMagic, layout.ErrTruncated, layout.ErrHeaderTooLarge,
		layout.ErrHeaderHash, layout.ErrFormatVersion, layout.ErrInvalidHeader, layout.ErrUnknownDType} {
		if errors.Is(err, s) {
			return true
		}
	}
	return false
}

// logicalBytes is the sum of a snapshot's tensor bytes.
func logicalBytes(h *layout.Header) int64 {
	var n int64
	for _, t := range h.Slots() {
		n += t.Bytes
	}
	return n
}

// lockNamespace takes a namespace's advisory lock (shared, or exclusive as
// collect does) through the vfs seam, without creating the lock file: a
// namespace no kvpersist writer ever touched has none, and then there is
// nothing to wait for. ctx (Ctrl-C) interrupts a wait for a long write.
func lockNamespace(ctx context.Context, c *cli, nsDir string, exclusive bool) (func(), error) {
	lockPath := filepath.Join(nsDir, layout.LockName)
	if _, err := vfs.Default.Lstat(lockPath); errors.Is(err, os.ErrNotExist) {
		return func() {}, nil
	}
	waitCtx, cancel := context.WithTimeout(ctx, 50*time.Millisecond)
	unlock, err := vfs.Default.Lock(waitCtx, lockPath, exclusive, false)
	cancel()
	if err != nil && ctx.Err() == nil && errors.Is(err, context.DeadlineExceeded) {
		c.log.Warn("waiting for the namespace lock (a write or collect is running)", "namespace", nsDir)
		unlock, err = vfs.Default.Lock(ctx, lockPath, exclusive, false)
	}
	if errors.Is(err, os.ErrNotExist) {
		return func() {}, nil
	}
	if err != nil {
		return nil, fmt.Errorf("lock namespace %s: %w", nsDir, err)
	}
	return func() { _ = unlock() }, nil
}

// docFlags is c.flags with a longer description printed by --help between
// the summary and the flags.
func (c *cli) docFlags(cmd *command, doc string) *flag.FlagSet {
	fs := c.flags(cmd)
	fs.Usage = func() {
		fmt.Fprintf(c.stderr, "Usage: kvpersist %s [flags] %s\n\n%s\n\n%s\n\nFlags:\n", cmd.name, cmd.args, cmd.summary, doc)
		fs.PrintDefaults()
		fmt.Fprintf(c.stderr, "\nExample:\n  %s\n", cmd.example)
	}
	return fs
}

// nounCount is "1 block", "2 blocks".
func nounCount(n int, noun string) string {
	if n == 1 {
		return "1 " + noun
	}
	return fmt.Sprintf("%d %ss", n, noun)
}

// writeJSON prints v as indented JSON.
func (c *cli) writeJSON(v any) int {
	enc := json.NewEncoder(c.stdout)
	enc.SetIndent("", "  ")
	if err := enc.Encode(v); err != nil {
		return c.fail("writing JSON: %v", err)
	}
	return -1
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

func runLs(ctx context.Context, c *cli, args []string) int {
	cmd := commands["ls"]
	fs := c.docFlags(cmd, `One row per snapshot file or manifest directly under ROOT/<namespace>/.
LOGICAL is the sum of the snapshot's tensor bytes (what a restore fills);
MODIFIED is the file's modification time. A file that does not decode is
listed with its error. Entries kvpersist does not recognise are listed as
skipped. Exit status: 0, 1 when some file is unreadable, 2 on usage or I/O
errors.`)
	asJSON := fs.Bool("json", false, "print a JSON report: {root, snapshots: [{namespace, name, path, layout, legacy, tensors, logicalBytes, fileBytes, modified, error}], skipped}")
	root, code := c.parseOne(fs, args)
	if code >= 0 {
		return code
	}
	names, skipped, err := scanRootDir(vfs.Default, root)
	if err != nil {
		return c.fail("ls: %v", err)
	}
	rep := lsReport{Root: root, Snapshots: []lsRow{}, Skipped: skipped}
	bad := 0
	for _, n := range names {
		if err := ctx.Err(); err != nil {
			return c.fail("ls: %v", err)
		}
		ns := scanNamespace(vfs.Default, root, n, true)
		if ns.Err != nil {
			return c.fail("ls: namespace %s: %v", ns.Dir, ns.Err)
		}
		rep.Skipped = append(rep.Skipped, ns.Skipped...)
		for _, s := range ns.Snaps {
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
	if *asJSON {
		if code := c.writeJSON(rep); code >= 0 {
			return code
		}
	} else {
		tw := tabwriter.NewWriter(c.stdout, 0, 0, 2, ' ', 0)
		fmt.Fprintln(tw, "NAMESPACE\tNAME\tLAYOUT\tTENSORS\tLOGICAL\tMODIFIED")
		for _, r := range rep.Snapshots {
			mod := r.Modified.Local().Format("2006-01-02 15:04:05")
			if r.Error != nil {
				fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\tUNREADABLE: %s\n", r.Namespace, r.Name, "?", "-", "-", mod, *r.Error)
				continue
			}
			lay := r.Layout
			if r.Legacy {
				lay += " (bun)"
			}
			fmt.Fprintf(tw, "%s\t%s\t%s\t%d\t%s\t%s\n", r.Namespace, r.Name, lay, r.Tensors, humanBytes(r.LogicalBytes), mod)
		}
		tw.Flush()
		fmt.Fprintf(c.stdout, "%s in %s", nounCount(len(rep.Snapshots), "snapshot"), nounCount(len(names), "namespace"))
		if bad > 0 {
			fmt.Fprintf(c.stdout, ", %d unreadable (run 'kvpersist inspect PATH' for details)", bad)
		}
		fmt.Fprintln(c.stdout)
		for _, s := range rep.Skipped {
			fmt.Fprintf(c.stdout, "skipped (not a kvpersist file): %s\n", s)
		}
	}
	if bad > 0 {
		return exitProblems
	}
	return exitOK
}
