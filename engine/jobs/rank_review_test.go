package jobs_test

import (
	"context"
	"path/filepath"
	"testing"

	"github.com/kvpersist/kvpersist/engine/gather"
	"github.com/kvpersist/kvpersist/engine/jobs"
	"github.com/kvpersist/kvpersist/engine/layout"
	"github.com/kvpersist/kvpersist/engine/vfs"
)

// A write of a view with more than layout.MaxRank axes is accepted and
// published, but every reader refuses the file (ErrInvalidHeader: too many
// axes), and collect then treats the namespace as holding an unreadable
// manifest: no block of the namespace is ever swept again.
func TestReviewWriteRankAboveMaxRankIsUnreadable(t *testing.T) {
	for _, lay := range []layout.Layout{layout.Single, layout.Blocks} {
		t.Run(lay.String(), func(t *testing.T) {
			root := t.TempDir()
			path := filepath.Join(root, "ns", "snap")
			shape := make([]int, layout.MaxRank+1)
			for i := range shape {
				shape[i] = 1
			}
			shape[len(shape)-1] = 4
			v := gather.View{Base: make([]byte, 8), Shape: shape, Strides: gather.RowMajor(shape), ItemSize: 2}
			spec := &wreq{path, &jobs.WriteRequest{Layout: lay, Caches: []jobs.EntrySpec{{Tensors: []jobs.TensorSpec{{DType: "bfloat16", View: v}}}}}}
			_, _, werr := writeAt(context.Background(), &jobs.Config{NoSync: true}, spec)
			_, lerr := layout.Load(vfs.Default, path)
			if werr == nil && lerr != nil {
				// Also show the collateral damage: the namespace is no longer swept.
				m, _ := collectAt(context.Background(), &jobs.Config{NoSync: true}, root, &jobs.CollectRequest{})
				t.Fatalf("Write succeeded but the published file does not load: %v (collect: unswept=%v)", lerr, m.Collect.UnsweptNamespaces)
			}
		})
	}
}
