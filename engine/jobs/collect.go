package jobs

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"sync"
	"time"

	"github.com/kvpersist/kvpersist/engine/layout"
	"github.com/kvpersist/kvpersist/engine/vfs"
)

// DefaultTempGrace is how old a temp file must be before collect removes it:
// younger ones may belong to a writer that is still running (in this or
// another process).
const DefaultTempGrace = 10 * time.Minute

// ErrRoot: the collect root does not exist, is not a directory, or is a
// namespace directory rather than the root above namespaces.
var ErrRoot = errors.New("invalid store root")

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
// sweeps the block files no manifest names. It holds the namespace's lock
// exclusively while it works (writers and readers hold it shared), so a
// block of a snapshot being written is never swept. Its report is the
// returned Metrics.Collect (never nil). A root that is missing, not a
// directory, or a namespace itself is ErrRoot.
func Collect(ctx context.Context, cfg *Config, req *CollectRequest) (Metrics, error) {
	spec := &collectSpec{Root: cfg.Root, CollectRequest: req}
	start := time.Now()
	cm := &CollectMetrics{}
	m := Metrics{Collect: cm}
	fsys := cfg.fs()
	st, err := fsys.Lstat(spec.Root)
	if err != nil {
		return m, fmt.Errorf("%w: %s: %w", ErrRoot, spec.Root, err)
	}
	if !st.IsDir() {
		return m, fmt.Errorf("%w: %s is not a directory", ErrRoot, spec.Root)
	}
	if bst, err := fsys.Lstat(layout.BlocksDir(spec.Root)); err == nil && bst.IsDir() {
		return m, fmt.Errorf("%w: %s holds a blocks/ directory: it is a namespace; pass the directory above it", ErrRoot, spec.Root)
	} else if err != nil && !vfs.IsNotExist(err) {
		return m, fmt.Errorf("jobs: collect: %w", err)
	}
	if _, err := fsys.Lstat(filepath.Join(spec.Root, layout.LockName)); err == nil {
		return m, fmt.Errorf("%w: %s holds a %s file: it is a namespace; pass the directory above it", ErrRoot, spec.Root, layout.LockName)
	} else if !vfs.IsNotExist(err) {
		return m, fmt.Errorf("jobs: collect: %w", err)
	}
	names := spec.Namespaces
	if names == nil {
		ents, err := fsys.ReadDir(spec.Root)
		if err != nil {
			return m, fmt.Errorf("jobs: collect: %w", err)
		}
		for _, e := range ents {
			switch {
			case e.IsDir() && layout.ValidName("namespace", e.Name()) == nil:
				names = append(names, e.Name())
			default:
				cm.Skipped = append(cm.Skipped, filepath.Join(spec.Root, e.Name()))
			}
		}
	}
	now := spec.Now
	if now.IsZero() {
		now = time.Now()
	}
	c := &collector{cfg: cfg, spec: spec, cm: cm, now: now}
	for _, ns := range names {
		if err := ctx.Err(); err != nil {
			return m, err
		}
		if err := layout.ValidName("namespace", ns); err != nil {
			return m, err
		}
		if err := c.namespace(ctx, filepath.Join(spec.Root, ns)); err != nil {
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

func (c *collector) tempGrace() time.Duration {
	switch {
	case c.spec.TempGrace == 0:
		return DefaultTempGrace
	case c.spec.TempGrace < 0:
		return 0
	}
	return c.spec.TempGrace
}

type victim struct {
	path  string
	bytes int64
	block bool
}

func (c *collector) namespace(ctx context.Context, nsDir string) error {
	fsys := c.cfg.fs()
	st, err := fsys.Lstat(nsDir)
	if err != nil && !vfs.IsNotExist(err) {
		return fmt.Errorf("jobs: collect %s: %w", nsDir, err)
	}
	if err != nil || !st.IsDir() {
		c.cm.Skipped = append(c.cm.Skipped, nsDir)
		return nil
	}
	// Only a directory with blocks/ has anything to sweep, and only such a
	// directory gets a lock file: a collect pointed one level too high must
	// not litter unrelated directories with .lock files.
	if _, err := fsys.Lstat(layout.BlocksDir(nsDir)); err == nil {
		unlock, err := lockNamespace(ctx, c.cfg, nsDir, true, true)
		if err != nil {
			return err
		}
		defer unlock()
	} else if !vfs.IsNotExist(err) {
		return fmt.Errorf("jobs: collect %s: %w", nsDir, err)
	}
	ents, err := fsys.ReadDir(nsDir)
	if err != nil {
		return fmt.Errorf("jobs: collect %s: %w", nsDir, err)
	}
	live := map[string]struct{}{}
	unreadable := false
	var victims []victim
	hasBlocks := false
	for _, e := range ents {
		name, path := e.Name(), filepath.Join(nsDir, e.Name())
		switch {
		case name == layout.LockName:
		case layout.IsTemp(name):
			if v, ok := c.staleTemp(path, e); ok {
				victims = append(victims, v)
			}
		case name == layout.BlocksDirName && e.IsDir():
			hasBlocks = true
		case e.Type().IsRegular():
			// Any regular file may be a manifest, whatever its name (the
			// Bun worker accepted any name): decode it. A file that does
			// not start with a magic is not ours: skipped, never deleted.
			snap, err := layout.Load(fsys, path)
			if errors.Is(err, layout.ErrBadMagic) {
				c.cm.Skipped = append(c.cm.Skipped, path)
				continue
			}
			if err != nil {
				c.cm.Unreadable = append(c.cm.Unreadable, err.Error())
				unreadable = true
				continue
			}
			c.cm.ManifestsScanned++
			for _, t := range snap.Header.Slots() {
				for _, b := range t.Blocks {
					live[b.Hash] = struct{}{}
				}
			}
		default:
			c.cm.Skipped = append(c.cm.Skipped, path)
		}
	}
	if hasBlocks {
		bv, err := c.sweepList(nsDir, live)
		if err != nil {
			return err
		}
		if unreadable {
			c.cm.UnsweptNamespaces = append(c.cm.UnsweptNamespaces, nsDir)
			// Keep every block; still clear stale temp files.
			for _, v := range bv {
				if !v.block {
					victims = append(victims, v)
				} else {
					c.cm.BlocksKept++
				}
			}
		} else {
			victims = append(victims, bv...)
		}
	}
	return c.remove(ctx, victims)
}

func (c *collector) staleTemp(path string, e os.DirEntry) (victim, bool) {
	info, err := e.Info()
	if vfs.IsNotExist(err) {
		return victim{}, false // renamed into place (or removed) by its writer since the listing
	}
	if err != nil || !info.Mode().IsRegular() {
		c.cm.Skipped = append(c.cm.Skipped, path)
		return victim{}, false
	}
	if c.now.Sub(info.ModTime()) < c.tempGrace() {
		return victim{}, false
	}
	return victim{path: path, bytes: info.Size()}, true
}

// sweepList lists block files to delete: unreferenced and older than
// BlockGrace. Blocks live in blocks/<2 hex>/<64 hex> (and, for stores of
// the Bun worker, blocks/<64 hex>).
func (c *collector) sweepList(nsDir string, live map[string]struct{}) ([]victim, error) {
	fsys := c.cfg.fs()
	blocksDir := layout.BlocksDir(nsDir)
	var out []victim
	consider := func(dir string, e os.DirEntry) {
		name, path := e.Name(), filepath.Join(dir, e.Name())
		if layout.IsTemp(name) {
			if v, ok := c.staleTemp(path, e); ok {
				out = append(out, v)
			}
			return
		}
		if !layout.ValidBlockHash(name) || !e.Type().IsRegular() {
			c.cm.Skipped = append(c.cm.Skipped, path)
			return
		}
		if _, ok := live[name]; ok {
			c.cm.BlocksKept++
			return
		}
		info, err := e.Info()
		if vfs.IsNotExist(err) {
			return // removed since the listing: nothing to sweep
		}
		if err != nil {
			c.cm.Skipped = append(c.cm.Skipped, path)
			return
		}
		if c.spec.BlockGrace > 0 && c.now.Sub(info.ModTime()) < c.spec.BlockGrace {
			c.cm.BlocksKept++
			return
		}
		out = append(out, victim{path: path, bytes: info.Size(), block: true})
	}
	ents, err := fsys.ReadDir(blocksDir)
	if err != nil {
		return nil, fmt.Errorf("jobs: collect %s: %w", blocksDir, err)
	}
	for _, e := range ents {
		name := e.Name()
		if e.IsDir() && isFanout(name) {
			dir := filepath.Join(blocksDir, name)
			sub, err := fsys.ReadDir(dir)
			if err != nil {
				return nil, fmt.Errorf("jobs: collect %s: %w", dir, err)
			}
			for _, s := range sub {
				if layout.ValidBlockHash(s.Name()) && s.Name()[:2] != name {
					c.cm.Skipped = append(c.cm.Skipped, filepath.Join(dir, s.Name()))
					continue
				}
				consider(dir, s)
			}
			continue
		}
		consider(blocksDir, e)
	}
	return out, nil
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

// isFanout reports whether name is a fan-out directory: 2 lowercase hex digits.
func isFanout(name string) bool {
	return len(name) == 2 && isLowerHex(name[0]) && isLowerHex(name[1])
}

func isLowerHex(c byte) bool { return c >= '0' && c <= '9' || c >= 'a' && c <= 'f' }
