package store

import (
	"context"
	"fmt"
	"os"
	"path/filepath"

	"github.com/kvpersist/kvpersist/engine/layout"
	"github.com/kvpersist/kvpersist/engine/vfs"
)

// Namespace is one namespace directory of a store: <root>/<name>.
type Namespace struct {
	st   *Store
	name string
	dir  string
}

// Store is the store the namespace belongs to.
func (n *Namespace) Store() *Store { return n.st }

// Name is the namespace's name (its directory's base name).
func (n *Namespace) Name() string { return n.name }

// Dir is the namespace directory, <root>/<name>.
func (n *Namespace) Dir() string { return n.dir }

// Path is the path of the snapshot file or manifest name after validating
// the name (layout.ErrBadName).
func (n *Namespace) Path(name string) (string, error) {
	if err := layout.ValidName("snapshot name", name); err != nil {
		return "", err
	}
	return filepath.Join(n.dir, name), nil
}

// Entry is the path of the entry name of the namespace directory, without
// validating name: for reporting files kvpersist did not name (a legacy
// store's), never for creating one (use Path).
func (n *Namespace) Entry(name string) string { return filepath.Join(n.dir, name) }

// LockPath is the namespace's lock file, <dir>/.lock.
func (n *Namespace) LockPath() string { return filepath.Join(n.dir, layout.LockName) }

// RecencyPath is the page cache's recency checkpoint, <dir>/.recency
// (layout.RecencyName).
func (n *Namespace) RecencyPath() string { return filepath.Join(n.dir, layout.RecencyName) }

// UploadsPath is the remote tier's uploads journal, <dir>/.uploads
// (layout.UploadsName).
func (n *Namespace) UploadsPath() string { return filepath.Join(n.dir, layout.UploadsName) }

// BlocksDir is <dir>/blocks.
func (n *Namespace) BlocksDir() string { return filepath.Join(n.dir, layout.BlocksDirName) }

// PagesDir is <dir>/pages, the prefix page cache's directory.
func (n *Namespace) PagesDir() string { return filepath.Join(n.dir, layout.PagesDirName) }

// BlockPath is where a block of SHA-256 hash (64 lowercase hex digits,
// layout.ValidBlockHash) is stored: blocks/<hash[:2]>/<hash> (kvpersist's
// 256-way fan-out), or blocks/<hash> when flat (stores of the Bun worker,
// whose manifests have snap.Legacy set).
func (n *Namespace) BlockPath(hash string, flat bool) string {
	if flat {
		return filepath.Join(n.dir, layout.BlocksDirName, hash)
	}
	return filepath.Join(n.dir, layout.BlocksDirName, hash[:2], hash)
}

// SnapshotBlockPath is where the blocks of snap (a manifest of this
// namespace) live: flat for a Bun-worker manifest, fanned out otherwise.
func (n *Namespace) SnapshotBlockPath(snap *layout.Snapshot, hash string) string {
	return n.BlockPath(hash, snap.Legacy)
}

// PagePath is where the page of key k is stored: pages/<h[0:2]>/<h>, h
// the key as 64 lowercase hex digits (a 256-way fan-out, as blocks). Page
// files are never flat.
func (n *Namespace) PagePath(k layout.PageKey) string {
	h := k.String()
	return filepath.Join(n.dir, layout.PagesDirName, h[:2], h)
}

// Check fails with ErrNamespace when the namespace directory exists but is
// a symlink or not a directory. A missing directory is not an error here.
func (n *Namespace) Check() error {
	return n.st.CheckRealDir(n.dir)
}

// CheckRealDir fails with ErrNamespace when dir exists and is a symlink or
// not a directory (nothing below a root is followed); a missing dir is not
// an error (the open that follows reports it).
func (s *Store) CheckRealDir(dir string) error {
	st, err := s.fs.Lstat(dir)
	if err != nil {
		if vfs.IsNotExist(err) {
			return nil
		}
		return err
	}
	if st.Mode()&os.ModeSymlink != 0 || !st.IsDir() {
		return fmt.Errorf("%w: %s is a symlink or not a directory; refusing to follow it", ErrNamespace, dir)
	}
	return nil
}

// Create makes the namespace directory if it is missing, durably: the
// directories it creates are fsynced into their parents, and the root is
// fsynced in any case, so that the namespace's entry is durable even if
// the write that created it died before syncing (in this or another
// process). A clean directory syncs in microseconds. ErrNamespace when the
// directory is a symlink or not a directory.
func (n *Namespace) Create() error {
	if err := n.st.mkdirSynced(n.dir, n.st.root, true); err != nil {
		return fmt.Errorf("store: namespace %s: %w", n.dir, err)
	}
	if err := n.st.SyncDir(n.st.root); err != nil {
		return fmt.Errorf("store: fsync directory %s: %w", n.st.root, err)
	}
	return nil
}

// CreateLeavingRoot is Create without the root's fsync when the namespace
// directory exists already: for a writer that fsyncs the root (Root) itself
// with its other directories, before it reports anything in the
// namespace durable. ErrNamespace when the directory is a symlink or not a
// directory.
func (n *Namespace) CreateLeavingRoot() error {
	if err := n.st.mkdirSynced(n.dir, n.st.root, true); err != nil {
		return fmt.Errorf("store: namespace %s: %w", n.dir, err)
	}
	return nil
}

// CreateBlocksDir makes blocks/ if it is missing and fsyncs the namespace
// directory when it did (under the sync policy).
func (n *Namespace) CreateBlocksDir() error {
	if err := n.st.mkdirSynced(n.BlocksDir(), n.dir, true); err != nil {
		return fmt.Errorf("store: %w", err)
	}
	return nil
}

// CreatePagesDir makes pages/ if it is missing and fsyncs the namespace
// directory when it did (under the sync policy). ErrNamespace when pages/
// is a symlink or not a directory.
func (n *Namespace) CreatePagesDir() error {
	if err := n.st.mkdirSynced(n.PagesDir(), n.dir, true); err != nil {
		return fmt.Errorf("store: %w", err)
	}
	return nil
}

// CreateFanout makes the fan-out directory dir (the parent of a BlockPath
// or PagePath) if it is missing, and does not sync: a writer syncs every
// fan-out directory it used, once, before it publishes (see SyncDirs).
func (n *Namespace) CreateFanout(dir string) error {
	return n.st.mkdirSynced(dir, filepath.Dir(dir), false)
}

// Lock takes the namespace's advisory lock (flock on .lock, created if
// missing): shared for writers, readers and deletes, exclusive for collect.
// It waits until granted or ctx ends (ctx's error). With Options.NoLock it
// is a no-op. unlock releases it.
func (n *Namespace) Lock(ctx context.Context, exclusive bool) (unlock func(), err error) {
	if n.st.noLock {
		return func() {}, nil
	}
	u, err := n.st.fs.Lock(ctx, n.LockPath(), exclusive, true)
	if err != nil {
		return nil, fmt.Errorf("store: lock namespace %s: %w", n.dir, err)
	}
	return func() { _ = u() }, nil
}

// LockIfExists takes the lock only if the lock file exists, and never
// creates a file: for reads, dry runs and read-only stores. locked reports
// whether the lock is held (always true with Options.NoLock, whose lock is
// a no-op); when no lock file exists no kvpersist writer has ever started
// in the namespace (every writer creates it before its first file).
func (n *Namespace) LockIfExists(ctx context.Context, exclusive bool) (unlock func(), locked bool, err error) {
	if n.st.noLock {
		return func() {}, true, nil
	}
	u, err := n.st.fs.Lock(ctx, n.LockPath(), exclusive, false)
	if err != nil {
		if vfs.IsNotExist(err) {
			return func() {}, false, nil
		}
		return nil, false, fmt.Errorf("store: lock namespace %s: %w", n.dir, err)
	}
	return func() { _ = u() }, true, nil
}
