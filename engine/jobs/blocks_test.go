package jobs_test

import (
	"context"
	"errors"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/kvpersist/kvpersist/engine/gather"
	"github.com/kvpersist/kvpersist/engine/jobs"
	"github.com/kvpersist/kvpersist/engine/layout"
	"github.com/kvpersist/kvpersist/engine/vfs"
	"github.com/kvpersist/kvpersist/internal/kvgen"
	"github.com/kvpersist/kvpersist/internal/testutil"
)

func TestDedupGrownCache(t *testing.T) {
	const bb = 4096
	ns := filepath.Join(t.TempDir(), "ns")
	c1 := kvgen.NewCache(kvgen.Tiny, 1100, true, nil)
	c2 := kvgen.NewCache(kvgen.Tiny, 1300, true, nil)

	h1, m1 := mustWrite(t, withHelpers(1), cacheSpec(t, c1, filepath.Join(ns, "a"), layout.Blocks, bb))
	// First save: per K/V head row 1100*16*2 = 35200 bytes = 8 blocks of
	// 4096 + a 2432-byte tail, 9 blocks; 2 layers x (K, V) x 2 heads = 8 rows
	// = 72 blocks; token ids 1100*4 = 4400 bytes = 4096 + 304, 2 blocks.
	if m1.BlocksWritten != 74 || m1.BlocksReused != 0 || m1.ReusedBytes != 0 {
		t.Fatalf("first save: %+v", m1)
	}

	h2, m2 := mustWrite(t, withHelpers(1), cacheSpec(t, c2, filepath.Join(ns, "b"), layout.Blocks, bb))
	// Grown to 1300 tokens: a head row is 1300*16*2 = 41600 bytes = 10 full
	// blocks + a 640-byte tail (11 blocks, 8 rows = 88) and the token ids
	// 5200 bytes = 4096 + 1104 (2 blocks): 90 blocks. Reused: the 8 full
	// blocks of the first 1100 tokens of every row (8 rows x 8 x 4096 =
	// 262144 bytes; the old 2432-byte tail is not a block of the new cut)
	// and the first token-id block (4096 bytes, ids 0..1023).
	const wantReused = 8*8*4096 + 4096 // 266240
	if m2.ReusedBytes != wantReused || m2.BlocksReused != 65 || m2.BlocksWritten != 90-65 {
		t.Fatalf("grown save: ReusedBytes %d (want %d), BlocksReused %d (want 65), BlocksWritten %d (want 25)",
			m2.ReusedBytes, wantReused, m2.BlocksReused, m2.BlocksWritten)
	}
	st, _ := os.Stat(filepath.Join(ns, "b"))
	if want := int64(kvgen.Tiny.CacheBytes(1300)) - wantReused + st.Size(); m2.WrittenBytes != want {
		t.Fatalf("grown save WrittenBytes %d, want %d", m2.WrittenBytes, want)
	}
	// The shared blocks are the same refs in both manifests.
	s1, s2 := h1.Slots(), h2.Slots()
	for i := range s1 {
		per1, per2, rows := 9, 11, 2
		if i == len(s1)-1 {
			per1, per2, rows = 2, 2, 1
		}
		shared := 0
		for r := 0; r < rows; r++ {
			for j := 0; j < per1-1; j++ {
				if s1[i].Blocks[r*per1+j] != s2[i].Blocks[r*per2+j] {
					t.Fatalf("slot %d row %d block %d differs", i, r, j)
				}
				shared++
			}
		}
		if i < len(s1)-1 && shared != 16 {
			t.Fatalf("slot %d: %d shared", i, shared)
		}
	}
	if n := len(blockFiles(t, ns)); n != 74+25 {
		t.Fatalf("%d block files, want 99", n)
	}
	for _, c := range []struct {
		name string
		c    *kvgen.Cache
	}{{"a", c1}, {"b", c2}} {
		got, _, _, err := readBack(t, noSync(), filepath.Join(ns, c.name), true)
		if err != nil {
			t.Fatal(err)
		}
		mustEqualExpected(t, got, expectedAll(c.c))
	}
}

func TestPackedMatchesSegmented(t *testing.T) {
	const bb = 4096
	ns := filepath.Join(t.TempDir(), "ns")
	c := kvgen.NewCache(kvgen.Tiny, 300, true, nil)
	want := expectedAll(c)

	hs, ms := mustWrite(t, noSync(), cacheSpec(t, c, filepath.Join(ns, "seg"), layout.Blocks, bb))
	// Segmented from a padded view: every block lies inside one head row,
	// which is one contiguous run of the buffer: nothing is copied.
	if ms.CopiedBytes != 0 || ms.ScratchPeak != 0 {
		t.Fatalf("segmented: CopiedBytes %d ScratchPeak %d, want 0", ms.CopiedBytes, ms.ScratchPeak)
	}
	spec := cacheSpec(t, c, filepath.Join(ns, "packed"), layout.Blocks, bb)
	spec.Packed = true
	hp, mp := mustWrite(t, noSync(), spec)
	// Packed gathers every non-contiguous tensor whole: the 4 K/V tensors
	// (2 layers) of 2*300*16*2 = 19200 bytes; the token ids are contiguous.
	if mp.CopiedBytes != 4*19200 {
		t.Fatalf("packed: CopiedBytes %d, want %d", mp.CopiedBytes, 4*19200)
	}
	if mp.BlocksWritten != 0 || mp.ReusedBytes != mp.LogicalBytes {
		t.Fatalf("packed after segmented: %+v (every block should be reused)", mp)
	}
	a, b := hs.Slots(), hp.Slots()
	for i := range a {
		if !slices.Equal(a[i].Blocks, b[i].Blocks) {
			t.Fatalf("slot %d: packed blocks differ from segmented", i)
		}
	}
	checkBlockRefs(t, hp, want, bb)
	got, _, _, err := readBack(t, noSync(), filepath.Join(ns, "packed"), true)
	if err != nil {
		t.Fatal(err)
	}
	mustEqualExpected(t, got, want)

	// A contiguous cache, packed: nothing to gather.
	cc := kvgen.NewCache(kvgen.Tiny, 300, false, nil)
	spec = cacheSpec(t, cc, filepath.Join(ns, "packed-contiguous"), layout.Blocks, bb)
	spec.Packed = true
	hc, mc := mustWrite(t, noSync(), spec)
	if mc.CopiedBytes != 0 {
		t.Fatalf("packed contiguous: CopiedBytes %d", mc.CopiedBytes)
	}
	for i, s := range hc.Slots() {
		if !slices.Equal(a[i].Blocks, s.Blocks) {
			t.Fatalf("slot %d: contiguous packed blocks differ", i)
		}
	}
}

// writeTiny writes Tiny padded at T=300 (blocks of 4096: K/V rows of
// 4096+4096+1408 bytes) and returns the header.
func writeTiny(t *testing.T, path string, lay layout.Layout) (*kvgen.Cache, *layout.Header) {
	t.Helper()
	c := kvgen.NewCache(kvgen.Tiny, 300, true, nil)
	h, _ := mustWrite(t, noSync(), cacheSpec(t, c, path, lay, 4096))
	return c, h
}

func flipByte(t *testing.T, path string, off int64) {
	t.Helper()
	testutil.FlipByte(t, path, off)
}

func readErr(t *testing.T, err error) *jobs.ReadError {
	t.Helper()
	var re *jobs.ReadError
	if !errors.As(err, &re) {
		t.Fatalf("error %v is not a *jobs.ReadError", err)
	}
	return re
}

func TestVerifyCatchesFlippedBlockByte(t *testing.T) {
	path := filepath.Join(t.TempDir(), "ns", "snap")
	c, h := writeTiny(t, path, layout.Blocks)
	ref := h.Slots()[3].Blocks[1] // cache 1 tensor 1, bytes 4096..8192
	flipByte(t, testutil.BlockPath(filepath.Dir(path), ref.Hash), 100)

	_, _, _, err := readBack(t, noSync(), path, true)
	if !errors.Is(err, jobs.ErrCorrupt) {
		t.Fatalf("got %v, want ErrCorrupt", err)
	}
	if !strings.Contains(err.Error(), "cache 1 tensor 1 (slot 3)") || !strings.Contains(err.Error(), ref.Hash) {
		t.Fatalf("error %q does not name the slot and block", err)
	}
	re := readErr(t, err)
	if len(re.Slots) != 1 || re.Slots[0].Slot != 3 || re.Slots[0].Name != "cache 1 tensor 1 (slot 3)" {
		t.Fatalf("failed slots %+v", re.Slots)
	}
	// Without verification the flipped byte is what comes back.
	got, _, _, err := readBack(t, noSync(), path, false)
	if err != nil {
		t.Fatal(err)
	}
	want := expectedAll(c)
	want[3][4096+100] ^= 0x10
	mustEqualExpected(t, got, want)
}

func TestVerifyCatchesFlippedSingleByte(t *testing.T) {
	path := filepath.Join(t.TempDir(), "ns", "snap")
	c, h := writeTiny(t, path, layout.Single)
	snapDS := func() int64 {
		_, s, _, err := readBack(t, noSync(), path, true)
		if err != nil {
			t.Fatal(err)
		}
		return int64(s.DataStart)
	}()
	tn := h.Slots()[2]
	flipByte(t, path, snapDS+tn.Off+1234)

	_, _, _, err := readBack(t, noSync(), path, true)
	if !errors.Is(err, jobs.ErrCorrupt) || !strings.Contains(err.Error(), "cache 1 tensor 0 (slot 2)") {
		t.Fatalf("got %v, want ErrCorrupt naming slot 2", err)
	}
	if re := readErr(t, err); len(re.Slots) != 1 || re.Slots[0].Slot != 2 {
		t.Fatalf("failed slots %+v", re.Slots)
	}
	got, _, _, err := readBack(t, noSync(), path, false)
	if err != nil {
		t.Fatal(err)
	}
	want := expectedAll(c)
	want[2][1234] ^= 0x10
	mustEqualExpected(t, got, want)
}

func TestBlockFileSizeMismatch(t *testing.T) {
	path := filepath.Join(t.TempDir(), "ns", "snap")
	_, h := writeTiny(t, path, layout.Blocks)
	ns := filepath.Dir(path)
	long := testutil.BlockPath(ns, h.Slots()[0].Blocks[0].Hash)
	short := testutil.BlockPath(ns, h.Slots()[4].Blocks[0].Hash) // token ids, 1200 bytes
	f, err := os.OpenFile(long, os.O_WRONLY|os.O_APPEND, 0)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := f.Write([]byte{0}); err != nil {
		t.Fatal(err)
	}
	f.Close()
	if err := os.Truncate(short, 1199); err != nil {
		t.Fatal(err)
	}
	for _, verify := range []bool{false, true} {
		_, _, _, err := readBack(t, noSync(), path, verify)
		if !errors.Is(err, jobs.ErrBlockSize) || errors.Is(err, jobs.ErrCorrupt) {
			t.Fatalf("verify=%v: got %v, want ErrBlockSize", verify, err)
		}
		re := readErr(t, err)
		if len(re.Slots) != 2 || re.Slots[0].Slot != 0 || re.Slots[1].Slot != 4 {
			t.Fatalf("verify=%v: failed slots %+v", verify, re.Slots)
		}
		for _, s := range []string{"cache 0 tensor 0 (slot 0)", "attachment 0 tensor 0 (slot 4)", "4097 bytes", "1199 bytes"} {
			if !strings.Contains(err.Error(), s) {
				t.Fatalf("error %q does not name %q", err, s)
			}
		}
	}
	// A missing block is its own error.
	if err := os.Remove(short); err != nil {
		t.Fatal(err)
	}
	_, _, _, err = readBack(t, noSync(), path, false)
	if !errors.Is(err, jobs.ErrMissingBlock) || !strings.Contains(err.Error(), "slot 4") {
		t.Fatalf("missing block: %v", err)
	}
}

// A block file of the right name but the wrong size (a torn write) is not
// taken for the block: the next save rewrites it.
func TestTruncatedBlockIsRewritten(t *testing.T) {
	ns := filepath.Join(t.TempDir(), "ns")
	c, h := writeTiny(t, filepath.Join(ns, "a"), layout.Blocks)
	ref := h.Slots()[1].Blocks[2] // a 1408-byte tail
	bp := testutil.BlockPath(ns, ref.Hash)
	if ref.Bytes != 1408 {
		t.Fatalf("block size %d", ref.Bytes)
	}
	if err := os.Truncate(bp, 700); err != nil {
		t.Fatal(err)
	}
	if _, _, _, err := readBack(t, noSync(), filepath.Join(ns, "a"), true); !errors.Is(err, jobs.ErrBlockSize) {
		t.Fatalf("truncated block: %v, want ErrBlockSize", err)
	}
	total := 0
	for _, s := range h.Slots() {
		total += len(s.Blocks)
	}
	_, m := mustWrite(t, noSync(), cacheSpec(t, c, filepath.Join(ns, "b"), layout.Blocks, 4096))
	if m.BlocksWritten != 1 || m.BlocksReused != int64(total-1) || m.ReusedBytes != m.LogicalBytes-1408 {
		t.Fatalf("resave: %+v (want 1 block written, %d reused)", m, total-1)
	}
	if st, err := os.Stat(bp); err != nil || st.Size() != 1408 {
		t.Fatalf("block not rewritten: %v", err)
	}
	for _, name := range []string{"a", "b"} {
		got, _, _, err := readBack(t, noSync(), filepath.Join(ns, name), true)
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		mustEqualExpected(t, got, expectedAll(c))
	}
}

func TestBlockBytesValidation(t *testing.T) {
	// One 1.5 MiB uint8 row: the default 1 MiB cut gives 1 MiB + 512 KiB.
	data := make([]byte, 3<<19)
	rand.NewChaCha8([32]byte{1}).Read(data)
	spec := func(path string, bb int) *wreq {
		return &wreq{path, &jobs.WriteRequest{Layout: layout.Blocks, BlockBytes: bb, Caches: []jobs.EntrySpec{{
			Tensors: []jobs.TensorSpec{{DType: "uint8", View: gather.View{Base: data, Shape: []int{len(data)}, Strides: []int{1}, ItemSize: 1}}},
		}}}}
	}
	root := t.TempDir()
	h, _ := mustWrite(t, noSync(), spec(filepath.Join(root, "ok", "s"), 0))
	blocks := h.Slots()[0].Blocks
	if len(blocks) != 2 || blocks[0].Bytes != 1<<20 || blocks[1].Bytes != 1<<19 ||
		blocks[0].Hash != shaHex(data[:1<<20]) || blocks[1].Hash != shaHex(data[1<<20:]) {
		t.Fatalf("default block size: %+v", blocks)
	}
	got, _, _, err := readBack(t, noSync(), filepath.Join(root, "ok", "s"), true)
	if err != nil || !slices.Equal(got[0], data) {
		t.Fatalf("read back: %v", err)
	}
	for _, bb := range []int{1000, 3, 128 << 20, 2048, 4097, 3 << 12, -4096} {
		path := filepath.Join(root, "bad", "s")
		_, _, err := writeAt(context.Background(), noSync(), spec(path, bb))
		if !errors.Is(err, jobs.ErrBlockBytes) {
			t.Fatalf("blockBytes %d: %v, want ErrBlockBytes", bb, err)
		}
		if _, err := os.Lstat(path); !os.IsNotExist(err) {
			t.Fatalf("blockBytes %d: manifest exists", bb)
		}
		if _, err := os.Lstat(testutil.BlocksDir(filepath.Dir(path))); !os.IsNotExist(err) {
			t.Fatalf("blockBytes %d: blocks directory created", bb)
		}
	}
	for _, bb := range []int{jobs.MinBlockBytes, 1 << 20, jobs.MaxBlockBytes} {
		if err := jobs.CheckBlockBytes(bb); err != nil {
			t.Errorf("CheckBlockBytes(%d) = %v", bb, err)
		}
	}
}

// TestWriteTakesPrecomputedBlockPlans: a tensor's precomputed plan decides
// its block boundaries (here 3,000-byte blocks, not a power of two, as a
// Bun-worker store may have), its metadata round-trips, and a plan that
// does not fit its view, or a plan for a single file, is refused before
// anything is created.
func TestWriteTakesPrecomputedBlockPlans(t *testing.T) {
	root := t.TempDir()
	c := kvgen.NewCache(kvgen.Tiny, 300, true, nil)
	spec := cacheSpec(t, c, filepath.Join(root, "ns", "s"), layout.Blocks, 4096)
	k := &spec.Caches[0].Tensors[0]
	p, err := gather.NewPlan(k.View.Shape, k.View.ItemSize, 3000)
	if err != nil {
		t.Fatal(err)
	}
	k.Plan, k.Meta = &p, layout.Meta{"scale": rawJSON(t, 0.5)}
	h, _ := mustWrite(t, noSync(), spec)
	refs := h.Slots()[0].Blocks
	want := planSizes(h.Slots()[0].Shape, k.View.ItemSize, 3000)
	if len(refs) != len(want) {
		t.Fatalf("%d blocks, want %d", len(refs), len(want))
	}
	for i, r := range refs {
		if r.Bytes != want[i] {
			t.Fatalf("block %d: %d bytes, want %d", i, r.Bytes, want[i])
		}
	}
	snap, err := layout.Load(vfs.Default, spec.path)
	if err != nil {
		t.Fatal(err)
	}
	if got := snap.Header.Slots()[0].Meta; !layout.MetaEqual(got, layout.Meta{"scale": rawJSON(t, 0.5)}) {
		t.Errorf("tensor metadata %v", got)
	}
	got, _, _, err := readBack(t, noSync(), spec.path, true)
	if err != nil {
		t.Fatal(err)
	}
	mustEqualExpected(t, got, expectedAll(c))

	other, err := gather.NewPlan([]int{7}, k.View.ItemSize, 3000)
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name string
		lay  layout.Layout
		plan *gather.Plan
	}{{"plan of another shape", layout.Blocks, &other}, {"plan for a single file", layout.Single, &p}} {
		bad := cacheSpec(t, c, filepath.Join(root, "bad", "s"), tc.lay, 4096)
		bad.Caches[0].Tensors[0].Plan = tc.plan
		if _, _, err := writeAt(context.Background(), noSync(), bad); !errors.Is(err, jobs.ErrInvalidRequest) {
			t.Errorf("%s: %v, want ErrInvalidRequest", tc.name, err)
		}
		if _, err := os.Lstat(filepath.Join(root, "bad")); !os.IsNotExist(err) {
			t.Errorf("%s: the namespace was created (%v)", tc.name, err)
		}
	}
}

// TestReusedBlocksDirectoriesAreSynced: a save whose blocks all exist still
// fsyncs every fan-out directory holding one of them before its manifest
// (another writer may have renamed a block in without syncing yet).
func TestReusedBlocksDirectoriesAreSynced(t *testing.T) {
	root := t.TempDir()
	buf := distinctBlocks(6, 9)
	if _, _, err := writeAt(context.Background(), &jobs.Config{}, oneTensorBlocks(filepath.Join(root, "ns", "a"), buf)); err != nil {
		t.Fatal(err)
	}
	fsys := testutil.NewFaultFS(vfs.Default)
	h, m, err := writeAt(context.Background(), &jobs.Config{FS: fsys}, oneTensorBlocks(filepath.Join(root, "ns", "b"), buf))
	if err != nil {
		t.Fatal(err)
	}
	if m.BlocksReused != 6 || m.BlocksWritten != 0 {
		t.Fatalf("second save reused %d, wrote %d blocks; want 6 and 0", m.BlocksReused, m.BlocksWritten)
	}
	for _, b := range h.Slots()[0].Blocks {
		dir := filepath.Dir(testutil.BlockPath(filepath.Join(root, "ns"), b.Hash))
		if n := fsys.CountPath(testutil.OpSyncDir, dir); n != 1 {
			t.Fatalf("fan-out %s of a reused block fsynced %d times before the manifest, want 1", dir, n)
		}
	}
}
