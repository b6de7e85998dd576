package jobs

import (
	"context"
	"errors"
	"fmt"
	"sort"
	"sync"
	"time"

	"github.com/kvpersist/kvpersist/engine/store"
	"github.com/kvpersist/kvpersist/engine/vfs"
)

// DefaultTempGrace is how old a temp file must be before collect removes it:
// younger ones may belong to a writer that is still running (in this or
// another process). See store.DefaultTempGrace.
const DefaultTempGrace = store.DefaultTempGrace

// NoTempGrace, as a TempGrace, makes every temp file stale whatever its
// age (collect removes them, verify reports them): see store.NoTempGrace.
const NoTempGrace = store.NoTempGrace

// ErrRoot: the collect root does not exist, is not a directory, or is a
// namespace directory rather than the root above namespaces (store.ErrRoot).
var ErrRoot = store.ErrRoot

// collectSpec is a collect request with its root.
type collectSpec struct {
	Root string
	*CollectRequest
}

// CollectMetrics reports what a collect found and did.
type CollectMetrics struct {
	Namespaces       int
	ManifestsScanned int   // snapshot files and manifests decoded
	BlocksKept       int64 // referenced (or within BlockGrace) block files
	PagesKept        int64 // page files of the prefix page cache (all kept for now)
	BlocksDeleted    int64 // unreferenced block files deleted (or to delete)
	BytesFreed       int64 // their bytes
	TempRemoved      int64 // stale temp files removed (or to remove)
	// Unreadable lists files in a namespace that did not decode as a
	// snapshot or manifest (with the reason). Their blocks cannot be known,
	// so that namespace's blocks are not swept at all: an operator can still
	// repair or remove the file (kvpersist verify names it). Other
	// manifests and namespaces are collected as usual.
	Unreadable []string
	// UnsweptNamespaces lists namespaces whose sweep was skipped.
	UnsweptNamespaces []string
	// Skipped lists entries whose names kvpersist does not recognise; they
	// are never deleted.
	Skipped []string
	// Deleted lists every path deleted (or, with DryRun, to delete).
	Deleted []string
}

// Collect marks, for each namespace under cfg.Root (those of
// req.Namespaces, or all), every block named by a decodable manifest, and
// sweeps the block files no manifest names and the stale temp files. Its
// report is the returned Metrics.Collect (never nil). A root that is
// missing, not a directory, or a namespace itself is ErrRoot.
//
// Safe by construction: it takes the namespace's lock exclusively before it
// lists anything (writers, readers and deletes hold it shared, in this and
// other processes), sweeps only what that listing shows, and deletes only
// while it holds the lock. The lock file is created when the namespace
// holds blocks/ or pages/; a namespace with neither and no lock file has
// never had a writer that takes the lock (every writer creates it before
// its first file), and nothing in it is deleted. A dry run never creates a
// file: it takes the lock only if the lock file exists. Pages of the prefix
// page cache are always kept (for now).
func Collect(ctx context.Context, cfg *Config, req *CollectRequest) (Metrics, error) {
	spec := &collectSpec{Root: cfg.Root, CollectRequest: req}
	start := time.Now()
	cm := &CollectMetrics{}
	m := Metrics{Collect: cm}
	st, err := store.Open(spec.Root, cfg.storeOptions())
	if err != nil {
		return m, fmt.Errorf("jobs: collect: %w", err)
	}
	names := spec.Namespaces
	if names == nil {
		var skipped []string
		if names, skipped, err = st.Namespaces(false); err != nil {
			return m, fmt.Errorf("jobs: collect: %w", err)
		}
		cm.Skipped = append(cm.Skipped, skipped...)
	}
	now := spec.Now
	if now.IsZero() {
		now = time.Now()
	}
	c := &collector{cfg: cfg, spec: spec, cm: cm, now: now}
	for _, name := range names {
		if err := ctx.Err(); err != nil {
			return m, err
		}
		ns, err := st.Namespace(name)
		if err != nil {
			return m, err
		}
		if err := c.namespace(ctx, ns); err != nil {
			return m, err
		}
		cm.Namespaces++
	}
	m.Elapsed = time.Since(start)
	return m, nil
}

type collector struct {
	cfg  *Config
	spec *collectSpec
	cm   *CollectMetrics
	now  time.Time
}

type victim struct {
	path  string
	bytes int64
	block bool
}

func (c *collector) namespace(ctx context.Context, ns *store.Namespace) error {
	fsys := c.cfg.fs()
	fi, err := fsys.Lstat(ns.Dir())
	if err != nil && !vfs.IsNotExist(err) {
		return fmt.Errorf("jobs: collect %s: %w", ns.Dir(), err)
	}
	if err != nil || !fi.IsDir() {
		c.cm.Skipped = append(c.cm.Skipped, ns.Dir())
		return nil
	}
	// Lock first, list after: whatever the namespace held when collect
	// first looked, what it sweeps comes from a listing made under the
	// exclusive lock. The first look only decides whether the lock file
	// may be created (not in a directory holding no kvpersist data).
	hasData := false
	for _, d := range []string{ns.BlocksDir(), ns.PagesDir()} {
		if _, err := fsys.Lstat(d); err == nil {
			hasData = true
		} else if !vfs.IsNotExist(err) {
			return fmt.Errorf("jobs: collect %s: %w", ns.Dir(), err)
		}
	}
	var unlock func()
	locked := false
	if hasData && !c.spec.DryRun {
		unlock, err = ns.Lock(ctx, true)
		locked = true
	} else {
		unlock, locked, err = ns.LockIfExists(ctx, true)
	}
	if err != nil {
		return fmt.Errorf("jobs: collect: %w", err)
	}
	defer unlock()
	l, err := ns.List(true)
	if err != nil {
		return fmt.Errorf("jobs: collect: %w", err)
	}
	c.cm.Skipped = append(c.cm.Skipped, l.SkippedPaths()...)
	// Without the lock nothing may be deleted; a dry run predicts the real
	// run, which creates the lock file when blocks/ or pages/ exist.
	mayDelete := locked || (c.spec.DryRun && (l.HasBlocksDir || l.HasPagesDir))
	live := map[string]struct{}{}
	unreadable := false
	for _, s := range l.Snapshots {
		if s.Err != nil {
			c.cm.Unreadable = append(c.cm.Unreadable, s.Err.Error())
			unreadable = true
			continue
		}
		c.cm.ManifestsScanned++
		for _, t := range s.Snap.Header.Slots() {
			for _, b := range t.Blocks {
				live[b.Hash] = struct{}{}
			}
		}
	}
	if unreadable {
		c.cm.UnsweptNamespaces = append(c.cm.UnsweptNamespaces, ns.Dir())
	}
	var victims []victim
	for _, b := range l.Blocks {
		_, isLive := live[b.Hash]
		young := c.spec.BlockGrace > 0 && c.now.Sub(b.ModTime) < c.spec.BlockGrace
		if isLive || young || unreadable || !mayDelete {
			c.cm.BlocksKept++
			continue
		}
		victims = append(victims, victim{path: b.Path, bytes: b.Size, block: true})
	}
	c.cm.PagesKept += int64(len(l.Pages))
	if mayDelete {
		for _, t := range l.Temps {
			if t.Stale(c.now, c.spec.TempGrace) {
				victims = append(victims, victim{path: t.Path, bytes: t.Size})
			}
		}
	}
	return c.remove(ctx, victims)
}
func (c *collector) remove(ctx context.Context, victims []victim) error {
	sort.Slice(victims, func(i, j int) bool { return victims[i].path < victims[j].path })
	for _, v := range victims {
		c.cm.Deleted = append(c.cm.Deleted, v.path)
		if v.block {
			c.cm.BlocksDeleted++
			c.cm.BytesFreed += v.bytes
		} else {
			c.cm.TempRemoved++
		}
	}
	if c.spec.DryRun {
		return nil
	}
	fsys := c.cfg.fs()
	var mu sync.Mutex
	var errs []error
	err := parallel(ctx, c.cfg, len(victims), 0, func(i int, _ []byte) error {
		if err := fsys.Remove(victims[i].path); err != nil && !vfs.IsNotExist(err) {
			mu.Lock()
			errs = append(errs, err)
			mu.Unlock()
		}
		return nil
	})
	if err != nil {
		return err
	}
	if len(errs) > 0 {
		return fmt.Errorf("jobs: collect: %d deletions failed: %w", len(errs), errors.Join(errs...))
	}
	return nil
}
