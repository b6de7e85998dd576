package jobs

import (
	"context"
	"fmt"
	"path/filepath"

	"github.com/kvpersist/kvpersist/engine/layout"
	"github.com/kvpersist/kvpersist/engine/vfs"
	"github.com/kvpersist/kvpersist/internal/scratch"
)

// RemoveCorruptPage removes the page file of key from the prefix cache of
// the namespace <cfg.Root>/<namespace> if, checked again under the
// namespace's exclusive lock, it is still corrupt: its header does not
// decode, it holds another key than its name, or a tensor fails its
// xxh3-64 (the checks of kvpersist verify). A save reuses a stored page
// whose header is right without reading its data, so a page whose data
// went bad is only found by a verified load; removing it lets the next
// save write it again. The engine calls it after a load whose prefix
// ended at a corrupt page (PrefixResult.Stop wrapping ErrCorrupt).
//
// The lock is waited for until ctx ends (the engine bounds the wait);
// while it is held no save or load of the namespace, in any process, runs,
// so a page rewritten by a save since the load looked is found whole and
// kept. removed reports whether the file was removed; a missing file, a
// namespace without a lock file (no kvpersist writer ever ran there) and
// a page that now verifies are not errors. Errors: layout.ErrBadName,
// ErrInvalidRequest (no Config.Root), ctx's error, or an I/O error (the
// file is then left in place).
func RemoveCorruptPage(ctx context.Context, cfg *Config, namespace string, key layout.PageKey) (removed bool, err error) {
	ns, err := cfg.namespace(namespace)
	if err != nil {
		return false, fmt.Errorf("jobs: remove corrupt page: %w", err)
	}
	if err := ns.Check(); err != nil {
		return false, fmt.Errorf("jobs: remove corrupt page %s: %w", ns.Dir(), err)
	}
	unlock, locked, err := ns.LockIfExists(ctx, true)
	if err != nil {
		return false, fmt.Errorf("jobs: remove corrupt page %s: %w", ns.Dir(), err)
	}
	defer unlock()
	if !locked {
		return false, nil
	}
	fsys := cfg.fs()
	path := ns.PagePath(key)
	for _, d := range []string{ns.PagesDir(), filepath.Dir(path)} {
		if err := checkDir(fsys, d); err != nil {
			if vfs.IsNotExist(err) {
				return false, nil
			}
			return false, fmt.Errorf("jobs: remove corrupt page: %w", err)
		}
	}
	v := &verifier{cfg: cfg, spec: &VerifySpec{}}
	buf := scratch.Get(verifyPiece)
	defer scratch.Put(buf)
	_, nt, err := v.checkPage(ctx, &verifyTask{path: path, want: key.String(), page: true}, *buf)
	if err != nil {
		return false, fmt.Errorf("jobs: remove corrupt page: %w", err)
	}
	if nt < 0 || len(v.rep.Problems) == 0 {
		return false, nil // gone, or whole again (rewritten by a save)
	}
	for _, p := range v.rep.Problems {
		if p.Kind == ProblemIO {
			return false, fmt.Errorf("jobs: remove corrupt page %s: %s", p.Path, p.Detail)
		}
	}
	if err := fsys.Remove(path); err != nil {
		if vfs.IsNotExist(err) {
			return false, nil
		}
		return false, fmt.Errorf("jobs: remove corrupt page: %w", err)
	}
	if err := ns.Store().SyncDir(filepath.Dir(path)); err != nil {
		return true, fmt.Errorf("jobs: remove corrupt page: fsync directory %s: %w", filepath.Dir(path), err)
	}
	return true, nil
}
