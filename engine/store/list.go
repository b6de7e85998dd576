package store

import (
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"time"

	"github.com/kvpersist/kvpersist/engine/layout"
	"github.com/kvpersist/kvpersist/engine/vfs"
)

// Snapshot is a file of a namespace that starts with a kvpersist or
// Bun-worker magic: a snapshot file or manifest, whatever its name (the Bun
// worker accepted any name).
type Snapshot struct {
	Name, Path string
	Size       int64 // file size in bytes
	ModTime    time.Time
	// Magic is the file's first bytes (at most len(layout.Magic)).
	Magic string
	// Snap is the decoded header (List with decode); nil when Err != nil.
	Snap *layout.Snapshot
	// Err is the file's decoding or I/O error (List with decode).
	Err error
}

// Legacy reports whether the file starts with the Bun worker's magic.
func (s *Snapshot) Legacy() bool { return s.Magic == layout.LegacyMagic }

// Block is a block file found under blocks/.
type Block struct {
	Hash, Path string
	Size       int64 // bytes
	ModTime    time.Time
	// Flat: blocks/<hash> (the Bun worker's place), not blocks/<2 hex>/<hash>.
	Flat bool
}

// Page is a page file of the prefix page cache, pages/<k[0:2]>/<k>.
type Page struct {
	Key, Path string
	Size      int64 // bytes; 0 from ListPages (names only) until DecodePages
	ModTime   time.Time
	// Snap is the decoded page file (Listing.DecodePages; Snap.Page holds
	// key, parent, identity, page size and token ids); nil when Err != nil
	// or not decoded.
	Snap *layout.Snapshot
	// Err is the page's decoding or I/O error (Listing.DecodePages).
	Err error
}

// Temp is a kvpersist temp file (layout.IsTemp) in the namespace, in
// blocks/ or in pages/.
type Temp struct {
	Path    string
	Size    int64
	ModTime time.Time
}

// Stale reports whether a temp file is older than grace at now: no writer
// can still be writing it (a writer finishes a temp file well within the
// grace; DefaultTempGrace when grace is 0, every temp file when grace < 0).
func (t *Temp) Stale(now time.Time, grace time.Duration) bool {
	return grace < 0 || now.Sub(t.ModTime) >= Grace(grace)
}

// Grace is the temp-file grace period a setting means: DefaultTempGrace
// for 0, none (0) for a negative one, else itself.
func Grace(grace time.Duration) time.Duration {
	switch {
	case grace == 0:
		return DefaultTempGrace
	case grace < 0:
		return 0
	}
	return grace
}

// Listing is one namespace as found on disk, every entry classified. An
// entry that vanished between the directory listing and its lstat (renamed
// into place or removed by a writer) is left out.
type Listing struct {
	Namespace *Namespace
	HasLock   bool // .lock exists
	// HasRecency: the page cache's recency checkpoint, .recency, exists
	// (the engine's; never a snapshot, never deleted, not listed as
	// skipped).
	HasRecency bool
	// HasUploads: the remote tier's uploads journal, .uploads, exists
	// (layout.UploadsName).
	HasUploads bool
	// HasBlocksDir, HasPagesDir: blocks/ and pages/ exist as directories.
	HasBlocksDir, HasPagesDir bool
	Snapshots                 []Snapshot // sorted by name
	Blocks                    []Block    // sorted by path
	Pages                     []Page     // sorted by path
	Temps                     []Temp     // sorted by path
	// namesOnly: pages are classified from their directory entries alone
	// (ListPages), without an lstat each.
	namesOnly bool
	// Skipped lists, sorted by path, the entries kvpersist does not
	// recognise (never deleted): files that do not start with a magic,
	// empty files (kvpersist never publishes one), symlinks, misplaced
	// names, other directories.
	Skipped []Skip
}

// Skip is an entry the store model does not recognise, and why.
type Skip struct{ Path, Why string }

// SkippedPaths lists the paths of l.Skipped.
func (l *Listing) SkippedPaths() []string {
	out := make([]string, len(l.Skipped))
	for i, s := range l.Skipped {
		out[i] = s.Path
	}
	return out
}

func (l *Listing) skip(path, why string) { l.Skipped = append(l.Skipped, Skip{path, why}) }

// whyUnknown describes an entry that is not what its place calls for.
func whyUnknown(e os.DirEntry) string {
	switch {
	case e.IsDir():
		return "a directory"
	case e.Type()&os.ModeSymlink != 0:
		return "not a regular file (a symlink, never followed)"
	case !e.Type().IsRegular():
		return "not a regular file"
	}
	return "a name kvpersist does not use here"
}

// Unreadable counts the snapshots whose Err is set.
func (l *Listing) Unreadable() int {
	n := 0
	for _, s := range l.Snapshots {
		if s.Err != nil {
			n++
		}
	}
	return n
}

// List lists and classifies the namespace's entries (see the package doc);
// with decode it also decodes every snapshot's header (layout.Decode:
// prefix, header hash, validation; no tensor data). It takes no lock: hold
// the namespace's lock around it when the listing must not change (a
// collect). Errors are those of listing a directory (a missing namespace
// directory wraps fs.ErrNotExist); ErrNamespace when it is a symlink.
func (n *Namespace) List(decode bool) (*Listing, error) {
	return n.list(decode, true)
}

// ListSnapshots is List without descending into blocks/ and pages/ (their
// presence is still reported: HasBlocksDir, HasPagesDir): the namespace's
// snapshot files and manifests, temp files, lock and recency checkpoint,
// at the cost of one directory read and an lstat and magic read per entry,
// whatever the number of blocks and pages.
func (n *Namespace) ListSnapshots(decode bool) (*Listing, error) {
	return n.list(decode, false)
}

func (n *Namespace) list(decode, deep bool) (*Listing, error) {
	if err := n.Check(); err != nil {
		return nil, err
	}
	fsys := n.st.fs
	l := &Listing{Namespace: n}
	ents, err := fsys.ReadDir(n.dir)
	if err != nil {
		return nil, fmt.Errorf("store: list namespace %s: %w", n.dir, err)
	}
	for _, e := range ents {
		name, path := e.Name(), filepath.Join(n.dir, e.Name())
		switch {
		case name == layout.LockName:
			l.HasLock = true
		case name == layout.RecencyName && e.Type().IsRegular():
			l.HasRecency = true
		case name == layout.UploadsName && e.Type().IsRegular():
			l.HasUploads = true
		case layout.IsTemp(name):
			l.temp(path, e)
		case name == layout.BlocksDirName && e.IsDir():
			l.HasBlocksDir = true
			if !deep {
				continue
			}
			if err := l.listBlocks(fsys, path); err != nil {
				return nil, err
			}
		case name == layout.PagesDirName && e.IsDir():
			l.HasPagesDir = true
			if !deep {
				continue
			}
			if err := l.listPages(fsys, path); err != nil {
				return nil, err
			}
		case e.Type().IsRegular():
			l.file(fsys, name, path, e, decode)
		default:
			l.skip(path, whyUnknown(e))
		}
	}
	sort.Slice(l.Snapshots, func(i, j int) bool { return l.Snapshots[i].Name < l.Snapshots[j].Name })
	sort.Slice(l.Blocks, func(i, j int) bool { return l.Blocks[i].Path < l.Blocks[j].Path })
	sort.Slice(l.Pages, func(i, j int) bool { return l.Pages[i].Path < l.Pages[j].Path })
	sort.Slice(l.Temps, func(i, j int) bool { return l.Temps[i].Path < l.Temps[j].Path })
	sort.Slice(l.Skipped, func(i, j int) bool { return l.Skipped[i].Path < l.Skipped[j].Path })
	return l, nil
}

// ListPages lists and classifies pages/ alone (Pages, Temps and Skipped of
// the Listing; HasPagesDir) from the directory entries only: no file is
// opened or lstat'd (a page's Size and ModTime are left 0), so the page
// index is built from it at a directory read per fan-out directory. A namespace without pages/ gives an empty Listing; a
// pages/ that is a symlink or not a directory is skipped, never followed.
// Like List it takes no lock. Errors are those of listing a directory.
func (n *Namespace) ListPages() (*Listing, error) {
	if err := n.Check(); err != nil {
		return nil, err
	}
	fsys := n.st.fs
	l := &Listing{Namespace: n, namesOnly: true}
	dir := n.PagesDir()
	fi, err := fsys.Lstat(dir)
	switch {
	case vfs.IsNotExist(err):
		return l, nil
	case err != nil:
		return nil, fmt.Errorf("store: list %s: %w", dir, err)
	case !fi.IsDir():
		l.skip(dir, "not a directory (a symlink is never followed)")
		return l, nil
	}
	l.HasPagesDir = true
	if err := l.listPages(fsys, dir); err != nil {
		return nil, err
	}
	sort.Slice(l.Pages, func(i, j int) bool { return l.Pages[i].Path < l.Pages[j].Path })
	sort.Slice(l.Temps, func(i, j int) bool { return l.Temps[i].Path < l.Temps[j].Path })
	sort.Slice(l.Skipped, func(i, j int) bool { return l.Skipped[i].Path < l.Skipped[j].Path })
	return l, nil
}

// info is e's lstat; ok false when it vanished since the listing.
func (l *Listing) info(path string, e os.DirEntry) (os.FileInfo, bool) {
	info, err := e.Info()
	if vfs.IsNotExist(err) {
		return nil, false
	}
	if err != nil {
		l.skip(path, err.Error())
		return nil, false
	}
	if !info.Mode().IsRegular() {
		l.skip(path, whyUnknown(e))
		return nil, false
	}
	return info, true
}

func (l *Listing) temp(path string, e os.DirEntry) {
	if info, ok := l.info(path, e); ok {
		l.Temps = append(l.Temps, Temp{Path: path, Size: info.Size(), ModTime: info.ModTime()})
	}
}

func (l *Listing) file(fsys vfs.FS, name, path string, e os.DirEntry, decode bool) {
	info, ok := l.info(path, e)
	if !ok {
		return
	}
	if info.Size() == 0 {
		l.skip(path, "an empty file (kvpersist never publishes one)")
		return
	}
	s := Snapshot{Name: name, Path: path, Size: info.Size(), ModTime: info.ModTime()}
	f, err := fsys.Open(path)
	if vfs.IsNotExist(err) {
		return
	}
	if err != nil {
		s.Err = err
		l.Snapshots = append(l.Snapshots, s)
		return
	}
	defer f.Close()
	var b [len(layout.Magic)]byte
	k, err := f.ReadAt(b[:], 0)
	if err != nil && !errors.Is(err, io.EOF) {
		s.Err = err
		l.Snapshots = append(l.Snapshots, s)
		return
	}
	s.Magic = string(b[:k])
	if k == 0 || !isMagicPrefix(s.Magic) {
		l.skip(path, fmt.Sprintf("does not start with a kvpersist or Bun-worker magic (starts with %q)", s.Magic))
		return
	}
	if decode {
		s.Snap, s.Err = layout.Decode(f, path)
	}
	l.Snapshots = append(l.Snapshots, s)
}

// listBlocks classifies blocks/: fan-out directories of blocks, flat blocks
// (the Bun worker's), temp files.
func (l *Listing) listBlocks(fsys vfs.FS, dir string) error {
	return l.listTree(fsys, dir,
		func(path, h string, info os.FileInfo, flat bool) {
			l.Blocks = append(l.Blocks, Block{Hash: h, Path: path, Size: info.Size(), ModTime: info.ModTime(), Flat: flat})
		}, true)
}

// listPages classifies pages/: fan-out directories of pages and temp files
// (pages are never flat).
func (l *Listing) listPages(fsys vfs.FS, dir string) error {
	return l.listTree(fsys, dir,
		func(path, k string, info os.FileInfo, _ bool) {
			pg := Page{Key: k, Path: path}
			if info != nil {
				pg.Size, pg.ModTime = info.Size(), info.ModTime()
			}
			l.Pages = append(l.Pages, pg)
		}, false)
}

// listTree classifies a content-addressed tree (blocks/ or pages/): its
// fan-out directories (listFanout), temp files, and, when flatOK, files
// named by 64 lowercase hex digits directly in it (found with flat true).
func (l *Listing) listTree(fsys vfs.FS, dir string, found func(path, name string, info os.FileInfo, flat bool), flatOK bool) error {
	ents, err := fsys.ReadDir(dir)
	if err != nil {
		return fmt.Errorf("store: list %s: %w", dir, err)
	}
	for _, e := range ents {
		name, path := e.Name(), filepath.Join(dir, e.Name())
		switch {
		case e.IsDir() && isFanout(name):
			err := l.listFanout(fsys, path, name, func(p, h string, info os.FileInfo) { found(p, h, info, false) })
			if err != nil {
				return err
			}
		case layout.IsTemp(name):
			l.temp(path, e)
		case flatOK && layout.ValidBlockHash(name):
			if info, ok := l.info(path, e); ok {
				found(path, name, info, true)
			}
		default:
			l.skip(path, whyUnknown(e))
		}
	}
	return nil
}

// listFanout classifies one fan-out directory: regular files named by 64
// lowercase hex digits starting with the directory's two (found), temp
// files, and the rest (skipped).
func (l *Listing) listFanout(fsys vfs.FS, dir, prefix string, found func(path, name string, info os.FileInfo)) error {
	ents, err := fsys.ReadDir(dir)
	if err != nil {
		return fmt.Errorf("store: list %s: %w", dir, err)
	}
	for _, e := range ents {
		name, path := e.Name(), filepath.Join(dir, e.Name())
		switch {
		case layout.IsTemp(name):
			l.temp(path, e)
		case layout.ValidBlockHash(name) && strings.HasPrefix(name, prefix) && l.namesOnly:
			if e.Type().IsRegular() {
				found(path, name, nil)
			} else {
				l.skip(path, whyUnknown(e))
			}
		case layout.ValidBlockHash(name) && strings.HasPrefix(name, prefix):
			if info, ok := l.info(path, e); ok {
				found(path, name, info)
			}
		default:
			l.skip(path, whyUnknown(e))
		}
	}
	return nil
}

// isFanout reports whether name is a fan-out directory: 2 lowercase hex digits.
func isFanout(name string) bool {
	return len(name) == 2 && isLowerHex(name[0]) && isLowerHex(name[1])
}

func isLowerHex(c byte) bool { return c >= '0' && c <= '9' || c >= 'a' && c <= 'f' }

// isMagicPrefix reports whether b (non-empty) is a prefix of layout.Magic
// or layout.LegacyMagic.
func isMagicPrefix(b string) bool {
	return b != "" && (strings.HasPrefix(layout.Magic, b) || strings.HasPrefix(layout.LegacyMagic, b))
}

// readMagic returns a file's first bytes (at most len(layout.Magic)) and
// its size, without following a symlink.
func readMagic(fsys vfs.FS, path string) (string, int64, error) {
	f, err := fsys.Open(path)
	if err != nil {
		return "", 0, err
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return "", 0, err
	}
	var b [len(layout.Magic)]byte
	k, err := f.ReadAt(b[:], 0)
	if err != nil && !errors.Is(err, io.EOF) {
		return "", 0, err
	}
	return string(b[:k]), st.Size(), nil
}

// IsSnapshotFile reports whether the file at path (not followed if a
// symlink) is a snapshot file or manifest in the store model: non-empty,
// starting with a kvpersist or Bun-worker magic (or a prefix of one).
func IsSnapshotFile(fsys vfs.FS, path string) (bool, error) {
	magic, size, err := readMagic(fsys, path)
	if err != nil {
		return false, err
	}
	return size > 0 && isMagicPrefix(magic), nil
}

// Namespaces lists the namespaces of the store, sorted: the real
// directories directly under the root whose names are valid
// (layout.ValidName). Every other entry of the root is returned in skipped
// (sorted paths). With all, directories whose names kvpersist refuses are
// listed too (a legacy store being migrated may hold them).
func (s *Store) Namespaces(all bool) (names, skipped []string, err error) {
	ents, err := s.fs.ReadDir(s.root)
	if err != nil {
		return nil, nil, fmt.Errorf("store: list root %s: %w", s.root, err)
	}
	names = []string{}
	for _, e := range ents {
		if e.IsDir() && (all || layout.ValidName("namespace", e.Name()) == nil) {
			names = append(names, e.Name())
		} else if e.Name() != layout.PageLogName && !isPageLogTemp(e.Name()) {
			skipped = append(skipped, filepath.Join(s.root, e.Name()))
		}
	}
	sort.Strings(names)
	sort.Strings(skipped)
	return names, skipped, nil
}

// AnyNamespace returns the namespace directory name of this store without
// validating the name (for a legacy source being migrated, whose
// directories kvpersist may not accept). It refuses a name that is not one
// path element (ErrNamespace).
func (s *Store) AnyNamespace(name string) (*Namespace, error) {
	if name == "" || name == "." || name == ".." || strings.ContainsRune(name, filepath.Separator) || strings.ContainsRune(name, '/') {
		return nil, fmt.Errorf("%w: %q is not a plain directory name", ErrNamespace, name)
	}
	return &Namespace{st: s, name: name, dir: filepath.Join(s.root, name)}, nil
}

// isPageLogTemp reports whether name is a temp file of the page log's
// replacement (layout.TempPath of layout.PageLogName).
func isPageLogTemp(name string) bool {
	return layout.IsTemp(name) && strings.HasPrefix(name, "."+layout.PageLogName+".tmp-")
}
