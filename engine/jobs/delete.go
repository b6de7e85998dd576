package jobs

import (
	"context"
	"fmt"
	"time"

	"github.com/kvpersist/kvpersist/engine/layout"
	"github.com/kvpersist/kvpersist/engine/store"
)

// Delete removes the snapshot file or manifest req.Ref (under cfg.Root) and
// fsyncs its directory, so the removal survives a power cut. Its blocks stay
// until a collect finds them unreferenced. It holds the namespace's lock shared, like a write, so
// it never interleaves with a collect in another process. A missing file is
// an error wrapping fs.ErrNotExist; a file that does not start with a
// kvpersist or Bun-worker magic is refused (layout.ErrBadMagic), so Delete
// only removes what kvpersist would read as a snapshot.
func Delete(ctx context.Context, cfg *Config, req *DeleteRequest) (Metrics, error) {
	start := time.Now()
	var m Metrics
	path, err := cfg.snapshotPath(req.Ref)
	if err != nil {
		return m, fmt.Errorf("jobs: delete %s: %w", req.Ref, err)
	}
	ns, _ := store.NamespaceOf(path, cfg.storeOptions())
	st := ns.Store()
	if err := ns.Check(); err != nil {
		return m, fmt.Errorf("jobs: delete %s: %w", path, err)
	}
	unlock, _, err := ns.LockIfExists(ctx, false)
	if err != nil {
		return m, fmt.Errorf("jobs: delete %s: %w", path, err)
	}
	defer unlock()
	ok, err := store.IsSnapshotFile(st.FS(), path)
	if err != nil {
		return m, fmt.Errorf("jobs: delete: %w", err)
	}
	if !ok {
		return m, fmt.Errorf("jobs: delete %s: %w: not a snapshot or manifest; left alone", path, layout.ErrBadMagic)
	}
	if err := ctx.Err(); err != nil {
		return m, err
	}
	if err := st.FS().Remove(path); err != nil {
		return m, fmt.Errorf("jobs: delete: %w", err)
	}
	if err := st.SyncDir(ns.Dir()); err != nil {
		return m, fmt.Errorf("jobs: delete %s: fsync directory %s: %w", path, ns.Dir(), err)
	}
	m.Elapsed = time.Since(start)
	return m, nil
}
