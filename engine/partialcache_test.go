package engine

import (
	"path/filepath"
	"testing"

	"github.com/kvpersist/kvpersist/engine/layout"
	"github.com/kvpersist/kvpersist/engine/vfs"
	"github.com/kvpersist/kvpersist/internal/kvgen"
	"github.com/kvpersist/kvpersist/internal/testutil"
)

// skipWithoutDirect skips t unless the file system of dir reports an
// O_DIRECT alignment.
func skipWithoutDirect(t *testing.T, dir string) {
	t.Helper()
	probe := filepath.Join(dir, "probe")
	if f, err := vfs.Default.Create(probe, 0o644); err == nil {
		a, aerr := vfs.DirectAlignment(f)
		f.Close()
		if aerr != nil || a.Offset == 0 {
			t.Skipf("%s: no O_DIRECT here", dir)
		}
	}
}

// TestRestorePartlyCachedFile: a single-file snapshot whose file is in the
// page cache except one 2 MiB range is restored with only that range
// read with O_DIRECT (Stats.BytesReadDirect grows by exactly its tensor
// bytes, though tensors straddle its edges; the rest is read from the
// page cache),
// and the restore holds the saved bytes. Twice: O_DIRECT reads do not
// fill the page cache, so the second restore finds the same ranges.
func TestRestorePartlyCachedFile(t *testing.T) {
	root := t.TempDir()
	skipWithoutDirect(t, root)
	m, tokens := kvgen.Llama31_8B, 64 // 64 tensors of 128 KiB: an 8 MiB file
	c, _ := cacheOf(m, tokens, false)
	e := newEngine(t, Config{Root: root, Workers: 2})
	ref := refOf("warm", "single")
	mustDo(t, e, writeReq(ref, c, layout.Single, 0))
	snap, err := e.Stat(ref)
	if err != nil {
		t.Fatal(err)
	}
	path, err := e.Path(ref)
	if err != nil {
		t.Fatal(err)
	}
	const lo, hi = 2 << 20, 4 << 20 // the range evicted: 2 MiB on a large folio's boundaries
	var wantDirect int64            // the tensor bytes in the evicted range
	for _, s := range snap.Header.Slots() {
		off := int64(snap.DataStart) + s.Off
		wantDirect += max(0, min(hi, off+s.Bytes)-max(lo, off))
	}
	if wantDirect == 0 || wantDirect >= int64(m.CacheBytes(tokens)) {
		t.Fatalf("%d of %d bytes touch the evicted range: the test needs some, not all", wantDirect, m.CacheBytes(tokens))
	}
	readBack(t, e, ref, m, tokens) // every page cached
	for round := range 2 {
		testutil.EvictRange(t, path, lo, hi-lo)
		f, err := vfs.Default.Open(path)
		if err != nil {
			t.Fatal(err)
		}
		gone, known := vfs.Cached(f, lo, hi-lo)
		rest, _ := vfs.Cached(f, hi, 0)
		f.Close()
		if !known {
			t.Skip("cachestat(2) unavailable")
		}
		if gone || !rest {
			t.Skipf("after posix_fadvise: evicted range cached=%v, the rest cached=%v: the kernel did not drop exactly the range asked", gone, rest)
		}
		before := e.Stats().BytesReadDirect
		readBack(t, e, ref, m, tokens)
		if got := e.Stats().BytesReadDirect - before; got != wantDirect {
			t.Fatalf("round %d: %d bytes read with O_DIRECT, want %d (the tensor bytes in the evicted range)", round, got, wantDirect)
		}
	}
}
