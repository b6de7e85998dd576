package engine

import (
	"testing"

	"github.com/kvpersist/kvpersist/engine/layout"
	"github.com/kvpersist/kvpersist/internal/kvgen"
)

// TestCollectEmptyNamespaceListThroughEngine: through the engine too, a
// CollectRequest with an empty, non-nil Namespaces collects nothing (the
// job's namespace scope is empty, not "all"), while nil collects every
// namespace.
func TestCollectEmptyNamespaceListThroughEngine(t *testing.T) {
	e := newEngine(t, Config{Workers: 2, BlockBytes: 4096})
	c64, _ := cacheOf(kvgen.Tiny, 64, false)
	c40, _ := cacheOf(kvgen.Tiny, 40, false)
	ref := refOf("gc", "conv")
	mustDo(t, e, writeReq(ref, c64, layout.Blocks, 0))
	mustDo(t, e, writeReq(ref, c40, layout.Blocks, 0)) // 9 blocks of the first save are now unreferenced
	if cm := mustDo(t, e, &CollectRequest{Namespaces: []string{}}).Metrics.Collect; cm.Namespaces != 0 || cm.BlocksDeleted != 0 || cm.ManifestsScanned != 0 {
		t.Fatalf("empty namespace list: %+v, want nothing scanned or deleted", cm)
	}
	if cm := mustDo(t, e, &CollectRequest{}).Metrics.Collect; cm.Namespaces != 1 || cm.BlocksDeleted != 9 {
		t.Fatalf("nil namespace list: %+v, want 1 namespace, 9 blocks deleted", cm)
	}
}
