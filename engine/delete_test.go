package engine_test

import (
	"context"
	"errors"
	"io/fs"
	"os"
	"path/filepath"
	"testing"

	"github.com/kvpersist/kvpersist/engine"
	"github.com/kvpersist/kvpersist/engine/gather"
	"github.com/kvpersist/kvpersist/engine/jobs"
	"github.com/kvpersist/kvpersist/engine/layout"
)

// TestDelete: a delete ordered after a write of the same path removes the
// snapshot the write published (not an older state), a later read of the
// path fails with fs.ErrNotExist, a collect then frees its blocks, and a
// file that is not a snapshot is refused and left in place.
func TestDelete(t *testing.T) {
	ctx := context.Background()
	root := t.TempDir()
	e, err := engine.New(engine.Config{Root: root, NoSync: true})
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close(ctx)
	ref := engine.Ref{Namespace: "ns", Name: "snap"}
	v := make([]byte, 8192)
	for i := range v {
		v[i] = byte(i*7 + i>>12) // two distinct 4 KiB blocks
	}
	w, err := e.Submit(ctx, tinyWrite(ref, v))
	if err != nil {
		t.Fatal(err)
	}
	del, err := e.Submit(ctx, &engine.DeleteRequest{Ref: ref})
	if err != nil {
		t.Fatal(err)
	}
	if r := <-w.Ack; r.Err != nil {
		t.Fatal(r.Err)
	}
	if r := <-del.Ack; r.Err != nil || r.Kind != engine.KindDelete {
		t.Fatalf("delete: kind %v, err %v", r.Kind, r.Err)
	}
	if _, err := os.Stat(filepath.Join(root, "ns", "snap")); !errors.Is(err, fs.ErrNotExist) {
		t.Fatalf("snapshot still there after delete: %v", err)
	}
	if _, err := e.Stat(ref); !errors.Is(err, fs.ErrNotExist) {
		t.Fatalf("Stat after delete: %v, want fs.ErrNotExist", err)
	}
	if r := e.Do(ctx, &engine.DeleteRequest{Ref: ref}); !errors.Is(r.Err, fs.ErrNotExist) {
		t.Fatalf("second delete: %v, want fs.ErrNotExist", r.Err)
	}
	col := e.Do(ctx, &engine.CollectRequest{})
	if col.Err != nil || col.Metrics.Collect.BlocksDeleted != 2 || col.Metrics.Collect.BlocksKept != 0 {
		t.Fatalf("collect after delete: %+v, err %v; want the 2 blocks of the deleted manifest freed", col.Metrics.Collect, col.Err)
	}
	stray := filepath.Join(root, "ns", "notes")
	if err := os.WriteFile(stray, []byte("operator's notes"), 0o644); err != nil {
		t.Fatal(err)
	}
	if r := e.Do(ctx, &engine.DeleteRequest{Ref: engine.Ref{Namespace: "ns", Name: "notes"}}); !errors.Is(r.Err, layout.ErrBadMagic) {
		t.Fatalf("delete of a non-snapshot: %v, want layout.ErrBadMagic", r.Err)
	}
	if _, err := os.Stat(stray); err != nil {
		t.Fatalf("non-snapshot file removed: %v", err)
	}
}

// tinyWrite saves one 4096-element bf16 tensor of buf in 4 KiB blocks.
func tinyWrite(ref engine.Ref, buf []byte) *engine.WriteRequest {
	return &engine.WriteRequest{Ref: ref, Layout: layout.Blocks, BlockBytes: 4096,
		Caches: []jobs.EntrySpec{{Tensors: []jobs.TensorSpec{{DType: "bfloat16",
			View: gather.View{Base: buf, Shape: []int{len(buf) / 2}, Strides: []int{1}, ItemSize: 2}}}}}}
}
