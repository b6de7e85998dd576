package jobs_test

import (
	"context"
	"path/filepath"
	"sync"
	"syscall"
	"testing"

	"github.com/kvpersist/kvpersist/engine/gather"
	"github.com/kvpersist/kvpersist/engine/jobs"
	"github.com/kvpersist/kvpersist/engine/layout"
	"github.com/kvpersist/kvpersist/engine/vfs"
	"github.com/kvpersist/kvpersist/internal/testutil"
)

// syncRecFS records every SyncDir path (after the inner FS ran it).
type syncRecFS struct {
	vfs.FS
	mu    sync.Mutex
	syncs []string
}

func (s *syncRecFS) SyncDir(name string) error {
	err := s.FS.SyncDir(name)
	s.mu.Lock()
	s.syncs = append(s.syncs, name)
	s.mu.Unlock()
	return err
}

func (s *syncRecFS) count(dir string) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	n := 0
	for _, d := range s.syncs {
		if d == dir {
			n++
		}
	}
	return n
}

// The namespace directory's entry in the root is fsynced only by the write
// that creates the directory (store.Namespace.Create). If that fsync fails (or the
// process dies between mkdir and the fsync, or another process's write
// created the directory and has not synced it yet), every later write sees
// the directory, never syncs the root, and acks snapshots whose namespace
// directory entry may not survive a power cut.
func TestReviewNamespaceDirEntryNeverSyncedAfterFailedFsync(t *testing.T) {
	for _, lay := range []layout.Layout{layout.Single, layout.Blocks} {
		t.Run(lay.String(), func(t *testing.T) {
			root := t.TempDir()
			ffs := testutil.NewFaultFS(vfs.Default)
			ffs.Inject(testutil.Fault{Op: testutil.OpSyncDir, Glob: root, Nth: 1, Err: syscall.EIO})
			rec := &syncRecFS{FS: ffs}
			cfg := &jobs.Config{FS: rec}
			v := gather.View{Base: make([]byte, 8192), Shape: []int{4096}, Strides: []int{1}, ItemSize: 2}
			spec := func(name string) *jobs.WriteSpec {
				return &jobs.WriteSpec{Path: filepath.Join(root, "ns", name), Layout: lay, BlockBytes: 4096,
					Caches: []jobs.EntrySpec{{Tensors: []jobs.TensorSpec{{DType: "bfloat16", View: v}}}}}
			}
			if _, _, err := jobs.Write(context.Background(), cfg, spec("a")); err == nil {
				t.Fatalf("first write: want the injected fsync failure of the root")
			}
			before := rec.count(root)
			if _, _, err := jobs.Write(context.Background(), cfg, spec("b")); err != nil {
				t.Fatalf("second write: %v", err)
			}
			if rec.count(root) == before {
				t.Fatalf("second write acked a durable snapshot in %s/ns, but %s was never fsynced after the failed fsync (the ns directory entry is not durable)", root, root)
			}
		})
	}
}
