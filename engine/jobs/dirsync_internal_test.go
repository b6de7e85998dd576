package jobs

import (
	"context"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/kvpersist/kvpersist/engine/gather"
	"github.com/kvpersist/kvpersist/engine/layout"
	"github.com/kvpersist/kvpersist/engine/vfs"
)

// countSyncFS counts SyncDir calls per directory.
type countSyncFS struct {
	vfs.FS
	mu sync.Mutex
	n  map[string]int
}

func (c *countSyncFS) SyncDir(name string) error {
	c.mu.Lock()
	c.n[name]++
	c.mu.Unlock()
	return c.FS.SyncDir(name)
}

func (c *countSyncFS) take() map[string]int {
	c.mu.Lock()
	defer c.mu.Unlock()
	n := c.n
	c.n = map[string]int{}
	return n
}

// TestReuseSkipsOnlyProvablyDurableDirectories: a save whose blocks all exist
// skips the fsync of a fan-out directory only when every reused block there
// was renamed in before that directory's last fsync; a block renamed in
// afterwards (say by another process that has not synced yet) makes the next
// manifest reusing it fsync its directory again.
func TestReuseSkipsOnlyProvablyDurableDirectories(t *testing.T) {
	old := dirSyncMargin
	dirSyncMargin = 50 * time.Millisecond
	defer func() { dirSyncMargin = old }()
	root := t.TempDir()
	fsys := &countSyncFS{FS: vfs.Default, n: map[string]int{}}
	cfg := &Config{FS: fsys}
	buf := make([]byte, 3*4096)
	for i := range buf {
		buf[i] = byte(i*31 + i>>12)
	}
	save := func(name string, b []byte) *layout.Header {
		t.Helper()
		h, _, err := Write(context.Background(), cfg, &WriteSpec{
			Path: filepath.Join(root, "ns", name), Layout: layout.Blocks, BlockBytes: 4096,
			Caches: []EntrySpec{{Tensors: []TensorSpec{{DType: "uint8",
				View: gather.View{Base: b, Shape: []int{len(b)}, Strides: []int{1}, ItemSize: 1}}}}}})
		if err != nil {
			t.Fatal(err)
		}
		return h
	}
	h := save("a", buf)
	fanout := func(hash string) string { return filepath.Dir(layout.BlockPath(filepath.Join(root, "ns"), hash)) }
	first := fsys.take()
	for _, b := range h.Slots()[0].Blocks {
		if first[fanout(b.Hash)] == 0 {
			t.Fatalf("first save did not fsync %s, which it wrote a block into", fanout(b.Hash))
		}
	}
	// The first save renamed its blocks in just before it synced their
	// directories: within the margin, so a re-save right away cannot prove
	// them durable and syncs again; that sync, later than the margin after
	// the renames, proves them for every save after it.
	time.Sleep(2 * dirSyncMargin)
	save("b", buf)
	fsys.take()
	save("b2", buf)
	again := fsys.take()
	for _, b := range h.Slots()[0].Blocks {
		if n := again[fanout(b.Hash)]; n != 0 {
			t.Fatalf("re-save of durable blocks fsynced %s %d times, want 0", fanout(b.Hash), n)
		}
	}
	if again[layout.BlocksDir(filepath.Join(root, "ns"))] != 1 {
		t.Fatalf("blocks/ not fsynced once before the manifest: %v", again)
	}

	// Another writer renames a block into place without syncing: rewrite the
	// first block's file through a rename now (new ctime).
	p := layout.BlockPath(filepath.Join(root, "ns"), h.Slots()[0].Blocks[0].Hash)
	data, err := os.ReadFile(p)
	if err != nil {
		t.Fatal(err)
	}
	tmp := p + ".other-writer"
	if err := os.WriteFile(tmp, data, 0o640); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(tmp, p); err != nil {
		t.Fatal(err)
	}
	save("c", buf)
	third := fsys.take()
	if third[fanout(h.Slots()[0].Blocks[0].Hash)] != 1 {
		t.Fatalf("reuse of a block renamed in after the last sync did not fsync its directory: %v", third)
	}
}
