package jobs_test

import (
	"context"
	"os"
	"path/filepath"
	"testing"

	"github.com/kvpersist/kvpersist/engine/gather"
	"github.com/kvpersist/kvpersist/engine/jobs"
	"github.com/kvpersist/kvpersist/engine/layout"
	"github.com/kvpersist/kvpersist/engine/vfs"
)

// noAllocFS is the real file system on one without fallocate: vfs.File.Allocate
// documents that "a file system without fallocate is not an error (it is a
// hint)", and osFile.Allocate returns nil on EOPNOTSUPP (e.g. some FUSE, NFSv3,
// older ZFS).
type noAllocFS struct{ vfs.FS }
type noAllocFile struct{ vfs.File }

func (f noAllocFile) Allocate(int64) error { return nil }
func (n noAllocFS) Create(name string, perm os.FileMode) (vfs.File, error) {
	f, err := n.FS.Create(name, perm)
	if err != nil {
		return nil, err
	}
	return noAllocFile{f}, nil
}

// A single-file snapshot whose last slot has zero bytes (an empty token
// attachment, an unfilled cache) gets off(last) = roundup(previous end, 4096).
// The file's size then depends on fallocate having extended it: without
// fallocate the file ends at the previous tensor's end, and the reader's
// check dataStart+off+bytes <= size refuses the file that Write just acked.
func TestReviewSingleTrailingEmptyTensorWithoutFallocate(t *testing.T) {
	root := t.TempDir()
	path := filepath.Join(root, "ns", "snap")
	k := gather.View{Base: make([]byte, 100), Shape: []int{50}, Strides: []int{1}, ItemSize: 2}
	empty := gather.View{Base: nil, Shape: []int{0}, Strides: []int{1}, ItemSize: 4}
	spec := &wreq{path, &jobs.WriteRequest{Layout: layout.Single,
		Caches:      []jobs.EntrySpec{{Tensors: []jobs.TensorSpec{{DType: "bfloat16", View: k}}}},
		Attachments: []jobs.EntrySpec{{Tensors: []jobs.TensorSpec{{DType: "int32", View: empty}}}}}}
	cfg := &jobs.Config{NoSync: true, FS: noAllocFS{vfs.Default}}
	if _, _, err := writeAt(context.Background(), cfg, spec); err != nil {
		t.Fatalf("Write: %v", err)
	}
	if _, err := layout.Load(vfs.Default, path); err != nil {
		t.Fatalf("Write acked, but the snapshot it published does not load: %v", err)
	}
}
