// Package store owns kvpersist's store model: what a store root, a
// namespace, a snapshot file or manifest, a block, a page, a temp file and
// the namespace lock are, and where each lives on disk. Every job of
// engine/jobs and every command of cmd/kvpersist goes through it: none of
// them lists a namespace, classifies an entry or builds a block path by
// itself.
//
// The layout it owns (docs/format/store-layout.md):
//
//	<root>/                       the operator's directory; may be (or sit below) a symlink
//	  <namespace>/                a real directory, layout.ValidName
//	    .lock                     the namespace lock (flock)
//	    <name>                    a snapshot file or manifest
//	    .<name>.tmp-<16 hex>      a temp file (layout.TempPath)
//	    blocks/<h[0:2]>/<h>       a block (kvpersist: 256-way fan-out)
//	    blocks/<h>                a block (the Bun worker: flat)
//	    pages/<k[0:2]>/<k>        a page of the prefix page cache
//
// Nothing below the root is followed: a symlinked namespace, blocks/,
// fan-out, block or page is refused or skipped, never followed.
//
// The store also owns the sync policy: Options.NoSync is decided here once
// (SyncDir, StartWriteback and PublishOptions obey it), so no job tests it.
package store

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"time"

	"github.com/kvpersist/kvpersist/engine/layout"
	"github.com/kvpersist/kvpersist/engine/vfs"
)

// ErrRoot: a store root does not exist, is not a directory, or is a
// namespace directory (it holds blocks/, pages/, a .lock or a snapshot)
// rather than the directory above namespaces.
var ErrRoot = errors.New("invalid store root")

// ErrNamespace: a namespace directory is a symlink or not a directory.
// Nothing below a store root is followed.
var ErrNamespace = errors.New("invalid namespace directory")

// DefaultTempGrace is how old a temp file must be before collect removes it
// (and verify reports it): younger ones may belong to a writer that is still
// running, in this or another process.
const DefaultTempGrace = 10 * time.Minute

// NoTempGrace is the temp-file grace that keeps none back: every temp file
// is stale whatever its age, so only for a store no writer can be using.
// It is the explicit form of "no grace", since a grace of 0 means
// DefaultTempGrace; any negative grace means the same.
const NoTempGrace time.Duration = -1

// Options are the policies of a Store.
type Options struct {
	// FS is the file system; nil means vfs.Default.
	FS vfs.FS
	// NoSync turns off every fsync (file and directory) and write-back
	// hint. Only for tests and tmpfs: a published file may then vanish in
	// a power cut.
	NoSync bool
	// NoLock turns the namespace lock into a no-op (see Namespace.Lock):
	// a collect in another process may then sweep a write's blocks.
	NoLock bool
}

// Store is a store root and its policies. It is a small value, safe for
// concurrent use; methods never cache what they find on disk.
type Store struct {
	fs     vfs.FS
	root   string
	noSync bool
	noLock bool
}

// At returns the store rooted at root without looking at the disk; jobs
// handed a snapshot path use it through NamespaceOf. Open and Create check
// the root.
func At(root string, o Options) *Store {
	fsys := o.FS
	if fsys == nil {
		fsys = vfs.Default
	}
	return &Store{fs: fsys, root: filepath.Clean(root), noSync: o.NoSync, noLock: o.NoLock}
}

// Open opens an existing store root. The root may be a symlink, or sit
// below symlinked directories (the operator's choice). It fails with
// ErrRoot when root does not exist, is not a directory, or is a namespace
// directory (ProbeDir says KindNamespace).
func Open(root string, o Options) (*Store, error) {
	s, err := OpenSource(root, o)
	if err != nil {
		return nil, err
	}
	kind, why, err := s.probe(s.root)
	if err != nil {
		return nil, fmt.Errorf("store: root %s: %w", root, err)
	}
	if kind == DirNamespace {
		return nil, fmt.Errorf("%w: %s %s: it is a namespace; pass the directory above it (%s)", ErrRoot, root, why, filepath.Dir(s.root))
	}
	return s, nil
}

// OpenSource opens an existing root of a store that is only read, such as
// the Bun worker's store being migrated: like Open (ErrRoot when root is
// missing or not a directory, symlinks at or above it followed) but it
// does not refuse a root holding a directory named blocks: the Bun worker
// accepted that as a namespace name.
func OpenSource(root string, o Options) (*Store, error) {
	s := At(root, o)
	st, err := s.fs.Stat(root)
	if err != nil {
		return nil, fmt.Errorf("%w: %s: %w", ErrRoot, root, err)
	}
	if !st.IsDir() {
		return nil, fmt.Errorf("%w: %s is not a directory", ErrRoot, root)
	}
	return s, nil
}

// Create opens the store root, creating it (and missing parents) first,
// durably: each directory whose entries changed is fsynced, and the root's
// own entry in its parent is always synced (a process that created it may
// have died before syncing). Symlinks at or above the root are followed.
// Errors as Open.
func Create(root string, o Options) (*Store, error) {
	s := At(root, o)
	if err := s.mkdirParents(s.root); err != nil {
		return nil, fmt.Errorf("%w: %s: %w", ErrRoot, root, err)
	}
	if err := s.SyncDir(filepath.Dir(s.root)); err != nil {
		return nil, fmt.Errorf("store: fsync the parent of root %s: %w", root, err)
	}
	return Open(root, o)
}

// mkdirParents creates dir and its missing parents, following symlinks (the
// root's ancestors are the operator's), and fsyncs every parent whose
// entries changed.
func (s *Store) mkdirParents(dir string) error {
	st, err := s.fs.Stat(dir)
	if err == nil {
		if !st.IsDir() {
			return fmt.Errorf("%s is not a directory", dir)
		}
		return nil
	}
	if !vfs.IsNotExist(err) {
		return err
	}
	parent := filepath.Dir(dir)
	if parent != dir {
		if err := s.mkdirParents(parent); err != nil {
			return err
		}
	}
	if err := s.fs.MkdirAll(dir, layout.DirPerm); err != nil {
		return err
	}
	return s.SyncDir(parent)
}

// Root is the store's root directory, cleaned, as given (not resolved).
func (s *Store) Root() string { return s.root }

// FS is the store's file system.
func (s *Store) FS() vfs.FS { return s.fs }

// Durable reports whether the store fsyncs (Options.NoSync is false).
func (s *Store) Durable() bool { return !s.noSync }

// SyncDir fsyncs a directory, making its entries durable; a no-op when the
// store does not sync.
func (s *Store) SyncDir(dir string) error {
	if s.noSync {
		return nil
	}
	return s.fs.SyncDir(dir)
}

// StartWriteback starts the write-back of [off, off+n) of f
// (vfs.File.StartWriteback; n = 0: to the end); a no-op when the store does
// not sync (nothing will wait for it).
func (s *Store) StartWriteback(f vfs.File, off, n int64) error {
	if s.noSync {
		return nil
	}
	return f.StartWriteback(off, n)
}

// PublishOptions are layout.PublishOptions under the store's sync policy:
// the file is fdatasynced before its rename, and with syncDir its
// directory after it. size > 0 preallocates.
func (s *Store) PublishOptions(syncDir bool, size int64) layout.PublishOptions {
	return layout.PublishOptions{Sync: !s.noSync, SyncDir: syncDir, Size: size}
}

// Namespace returns the namespace name of this store after validating the
// name (layout.ErrBadName). It does not touch the disk.
func (s *Store) Namespace(name string) (*Namespace, error) {
	if err := layout.ValidName("namespace", name); err != nil {
		return nil, err
	}
	return &Namespace{st: s, name: name, dir: filepath.Join(s.root, name)}, nil
}

// NamespaceOf returns the namespace holding the snapshot file at path
// (<root>/<namespace>/<name>) and the snapshot's name. The store is
// <root> with options o; names are not validated (a reader may open any
// file it is pointed at).
func NamespaceOf(path string, o Options) (*Namespace, string) {
	path = filepath.Clean(path)
	return NamespaceAt(filepath.Dir(path), o), filepath.Base(path)
}

// NamespaceAt returns the namespace whose directory is nsDir; its store is
// nsDir's parent with options o. The name is not validated.
func NamespaceAt(nsDir string, o Options) *Namespace {
	nsDir = filepath.Clean(nsDir)
	return &Namespace{st: At(filepath.Dir(nsDir), o), name: filepath.Base(nsDir), dir: nsDir}
}

// DirKind says what a directory is in the store model.
type DirKind int

// Kinds of directories.
const (
	// DirRoot: a directory holding no namespace entry (possibly empty).
	DirRoot DirKind = iota + 1
	// DirNamespace: a directory holding blocks/, pages/, a .lock, or a
	// non-empty regular file that starts with a kvpersist or Bun-worker
	// magic.
	DirNamespace
)

// ProbeDir says whether dir is a store root or a namespace directory
// (following a symlink at dir itself), with the reason for a namespace.
func ProbeDir(fsys vfs.FS, dir string) (DirKind, string, error) {
	s := At(dir, Options{FS: fsys})
	st, err := s.fs.Stat(dir)
	if err != nil {
		return 0, "", err
	}
	if !st.IsDir() {
		return 0, "", fmt.Errorf("%s is not a directory", dir)
	}
	return s.probe(s.root)
}

func (s *Store) probe(dir string) (DirKind, string, error) {
	for _, n := range []string{layout.BlocksDirName, layout.PagesDirName} {
		if st, err := s.fs.Lstat(filepath.Join(dir, n)); err == nil && st.IsDir() {
			return DirNamespace, "holds a " + n + "/ directory", nil
		} else if err != nil && !vfs.IsNotExist(err) {
			return 0, "", err
		}
	}
	if _, err := s.fs.Lstat(filepath.Join(dir, layout.LockName)); err == nil {
		return DirNamespace, "holds a " + layout.LockName + " file", nil
	} else if !vfs.IsNotExist(err) {
		return 0, "", err
	}
	ents, err := s.fs.ReadDir(dir)
	if err != nil {
		return 0, "", err
	}
	for _, e := range ents {
		if !e.Type().IsRegular() {
			continue
		}
		magic, size, err := readMagic(s.fs, filepath.Join(dir, e.Name()))
		if err != nil {
			if vfs.IsNotExist(err) {
				continue
			}
			return 0, "", err
		}
		if size > 0 && isMagicPrefix(magic) {
			return DirNamespace, fmt.Sprintf("holds a snapshot file (%s)", e.Name()), nil
		}
	}
	return DirRoot, "", nil
}

// mkdirSynced creates dir and any missing parents up to (not including)
// stop, without following symlinks (a path element that is a symlink or
// not a directory is an ErrNamespace error), fsyncing each parent whose
// entries changed when sync is true.
func (s *Store) mkdirSynced(dir, stop string, sync bool) error {
	st, err := s.fs.Lstat(dir)
	if err == nil {
		if st.Mode()&os.ModeSymlink != 0 || !st.IsDir() {
			return fmt.Errorf("%w: %s is a symlink or not a directory", ErrNamespace, dir)
		}
		return nil
	}
	if !vfs.IsNotExist(err) {
		return err
	}
	parent := filepath.Dir(dir)
	if parent != dir && dir != stop && parent != stop {
		if err := s.mkdirSynced(parent, stop, sync); err != nil {
			return err
		}
	}
	if err := s.fs.MkdirAll(dir, layout.DirPerm); err != nil {
		return err
	}
	if sync {
		if err := s.SyncDir(parent); err != nil {
			return fmt.Errorf("store: fsync directory %s: %w", parent, err)
		}
	}
	return nil
}
