package jobs_test

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/kvpersist/kvpersist/engine/jobs"
	"github.com/kvpersist/kvpersist/engine/layout"
	"github.com/kvpersist/kvpersist/internal/kvgen"
)

// TestCollectEmptyNamespaceList: a CollectRequest whose Namespaces is
// empty but not nil (a filter that matched nothing) collects nothing: no
// namespace is scanned and no unreferenced block is deleted. Only nil means
// every namespace of the root, which then does delete them.
func TestCollectEmptyNamespaceList(t *testing.T) {
	root := t.TempDir()
	ns := filepath.Join(root, "ns")
	c := kvgen.NewCache(kvgen.Tiny, 300, true, nil)
	h, _ := mustWrite(t, noSync(), cacheSpec(t, c, filepath.Join(ns, "a"), layout.Blocks, 4096))
	if err := os.Remove(filepath.Join(ns, "a")); err != nil {
		t.Fatal(err)
	}
	blocks := len(blockSet(h))
	if blocks == 0 || len(blockFiles(t, ns)) != blocks {
		t.Fatalf("%d block files for %d blocks", len(blockFiles(t, ns)), blocks)
	}
	cm := collect(t, root, &jobs.CollectRequest{Namespaces: []string{}})
	if cm.Namespaces != 0 || cm.BlocksDeleted != 0 || len(cm.Deleted) != 0 || cm.ManifestsScanned != 0 {
		t.Fatalf("empty namespace list: %+v, want nothing scanned or deleted", cm)
	}
	if n := len(blockFiles(t, ns)); n != blocks {
		t.Fatalf("empty namespace list left %d of %d block files", n, blocks)
	}
	cm = collect(t, root, &jobs.CollectRequest{})
	if cm.Namespaces != 1 || cm.BlocksDeleted != int64(blocks) {
		t.Fatalf("nil namespace list: %+v, want 1 namespace and %d blocks deleted", cm, blocks)
	}
}
