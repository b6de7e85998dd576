package jobs_test

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"testing"

	"github.com/kvpersist/kvpersist/engine/gather"
	"github.com/kvpersist/kvpersist/engine/jobs"
	"github.com/kvpersist/kvpersist/engine/layout"
)

// A collect run one level above the store root (e.g. `kvpersist gc /srv`
// instead of `/srv/kvstore`) treats the store root as a namespace and creates
// /srv/kvstore/.lock (lockNamespace with create=true). From then on every
// collect of the real root fails with ErrRoot ("holds a .lock file: it is a
// namespace; pass the directory above it"), which sends the operator back to
// the wrong directory. It also drops a .lock into every directory under the
// wrong root.
func TestReviewCollectAboveRootBreaksLaterCollects(t *testing.T) {
	parent := t.TempDir()
	store := filepath.Join(parent, "kvstore")
	v := gather.View{Base: make([]byte, 8192), Shape: []int{4096}, Strides: []int{1}, ItemSize: 2}
	spec := &wreq{filepath.Join(store, "conv-1", "turn-1"), &jobs.WriteRequest{Layout: layout.Blocks, BlockBytes: 4096,
		Caches: []jobs.EntrySpec{{Tensors: []jobs.TensorSpec{{DType: "bfloat16", View: v}}}}}}
	if _, _, err := writeAt(context.Background(), noSync(), spec); err != nil {
		t.Fatal(err)
	}
	if _, err := collectAt(context.Background(), noSync(), store, &jobs.CollectRequest{}); err != nil {
		t.Fatalf("collect of the store root: %v", err)
	}
	// The operator's slip: one directory too high. It "succeeds".
	if _, err := collectAt(context.Background(), noSync(), parent, &jobs.CollectRequest{}); err != nil {
		t.Logf("collect of the parent: %v", err)
	}
	_, statErr := os.Lstat(filepath.Join(store, layout.LockName))
	_, err := collectAt(context.Background(), noSync(), store, &jobs.CollectRequest{})
	if errors.Is(err, jobs.ErrRoot) {
		t.Fatalf("after one collect of the parent (which created %s/.lock: %v), collect of the real root fails: %v", store, statErr == nil, err)
	}
}
