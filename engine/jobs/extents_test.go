package jobs_test

import (
	"bytes"
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"syscall"
	"testing"

	"github.com/kvpersist/kvpersist/engine/gather"
	"github.com/kvpersist/kvpersist/engine/jobs"
	"github.com/kvpersist/kvpersist/engine/layout"
	"github.com/kvpersist/kvpersist/engine/vfs"
	"github.com/kvpersist/kvpersist/internal/kvgen"
	"github.com/kvpersist/kvpersist/internal/testutil"
	"github.com/zeebo/xxh3"
)

// directDir is a directory on a file system that supports O_DIRECT (the
// test's temp directory on the project's ext4); the test is skipped, saying
// so, where there is none.
func directDir(t *testing.T) string {
	t.Helper()
	dir := t.TempDir()
	p := filepath.Join(dir, "probe")
	if err := os.WriteFile(p, []byte("x"), 0o640); err != nil {
		t.Fatal(err)
	}
	f, err := vfs.Default.Open(p)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if a, err := vfs.DirectAlignment(f); err != nil || a.Offset == 0 {
		t.Skipf("%s: no O_DIRECT alignment reported (%v): this test needs a file system with O_DIRECT", dir, err)
	}
	return dir
}

// evictFiles drops every file under root from the page cache, so the next
// read is cold (testutil.EvictTree).
func evictFiles(t *testing.T, root string) {
	t.Helper()
	testutil.EvictTree(t, root)
}

// randomFile writes n random bytes to dir/name, evicts it from the page
// cache and returns them.
func randomFile(t *testing.T, rng *rand.Rand, dir, name string, n int) (string, []byte) {
	t.Helper()
	b := make([]byte, n)
	for i := range b {
		b[i] = byte(rng.Uint32())
	}
	p := filepath.Join(dir, name)
	if err := os.WriteFile(p, b, 0o640); err != nil {
		t.Fatal(err)
	}
	evictFiles(t, p)
	return p, b
}

// guardedDst is a destination cut from a larger buffer, between guard bytes.
type guardedDst struct {
	buf        []byte
	start, end int // the destination is buf[start:end]
}

const dstGuardByte = 0xA5

// guardedExtents makes count random extents of data (offsets and lengths
// at any byte, some up to the end of the file, some longer than a read
// piece), each into its own destination cut from a larger buffer at a
// random misalignment and surrounded by guard bytes, verified by XXH3 or
// SHA-256 computed here independently.
func guardedExtents(rng *rand.Rand, src *jobs.Source, data []byte, count int) ([]jobs.Extent, []guardedDst) {
	const guard = 64
	var exts []jobs.Extent
	var gs []guardedDst
	for k := range count {
		n := 1 + rng.IntN(3*jobs.ReadChunkBytes/2)
		if k%4 == 0 {
			n = 1 + rng.IntN(5000)
		}
		n = min(n, len(data))
		off := rng.IntN(len(data) - n + 1)
		if k%5 == 0 {
			off = len(data) - n // up to the end of the file
		}
		if k%3 == 0 {
			off &^= 4095 // aligned start
		}
		mis := 0
		if k%2 == 0 {
			mis = 1 + rng.IntN(511)
		}
		g := guardedDst{buf: bytes.Repeat([]byte{dstGuardByte}, guard+mis+n+guard), start: guard + mis, end: guard + mis + n}
		x := jobs.Extent{Src: src, Off: int64(off), Dst: g.buf[g.start:g.end:g.end], Group: -1}
		if k%2 == 0 {
			x.Verify, x.XXH3 = jobs.VerifyXXH3, xxh3.Hash(data[off:off+n])
		} else {
			x.Verify, x.SHA256 = jobs.VerifySHA256, sha256.Sum256(data[off:off+n])
		}
		exts = append(exts, x)
		gs = append(gs, g)
	}
	return exts, gs
}

// checkExtents: every extent read exactly its bytes, and no guard byte
// around a destination changed.
func checkExtents(t *testing.T, exts []jobs.Extent, gs []guardedDst, data []byte, errs []error) {
	t.Helper()
	for k, x := range exts {
		if errs[k] != nil {
			t.Fatalf("extent %d (%d bytes at %d): %v", k, len(x.Dst), x.Off, errs[k])
		}
		if !bytes.Equal(x.Dst, data[x.Off:x.Off+int64(len(x.Dst))]) {
			t.Fatalf("extent %d (%d bytes at %d) read wrong bytes", k, len(x.Dst), x.Off)
		}
		g := gs[k]
		for i, b := range g.buf {
			if (i < g.start || i >= g.end) && b != dstGuardByte {
				t.Fatalf("extent %d: guard byte %d of its buffer overwritten", k, i)
			}
		}
	}
}

// TestReadExtentsDirect: on a file system with O_DIRECT, random extents
// (unaligned offsets, lengths and destinations, tails at the end of the
// file) are read exactly, verified against independently computed hashes,
// mostly with O_DIRECT, at every queue depth.
func TestReadExtentsDirect(t *testing.T) {
	dir := directDir(t)
	rng := rand.New(rand.NewPCG(5, 6))
	path, data := randomFile(t, rng, dir, "f", 3*jobs.ReadChunkBytes+777)
	for _, depth := range []int{1, 4, 32} {
		cfg := &jobs.Config{ReadDepth: depth}
		src, err := jobs.OpenSource(cfg, path)
		if err != nil {
			t.Fatal(err)
		}
		if !src.Direct() || src.Size() != int64(len(data)) {
			t.Fatalf("source direct=%v size %d, want O_DIRECT and %d bytes", src.Direct(), src.Size(), len(data))
		}
		exts, gs := guardedExtents(rng, src, data, 40)
		errs, st, err := jobs.ReadExtents(context.Background(), cfg, exts)
		if err != nil {
			t.Fatal(err)
		}
		checkExtents(t, exts, gs, data, errs)
		var total int64
		for _, x := range exts {
			total += int64(len(x.Dst))
		}
		if st.Bytes != total || st.DirectBytes == 0 || st.DirectBytes > total {
			t.Fatalf("depth %d: stats %+v, want %d bytes, some of them direct", depth, st, total)
		}
		if err := src.Close(); err != nil {
			t.Fatal(err)
		}
	}
}

// TestReadExtentsVerifyAndGroups: a wrong expected hash is ErrCorrupt for
// that extent only; the later extents of its group are ErrSkipped and not
// read; other groups are read.
func TestReadExtentsVerifyAndGroups(t *testing.T) {
	rng := rand.New(rand.NewPCG(7, 8))
	path, data := randomFile(t, rng, t.TempDir(), "f", 300_000)
	cfg := &jobs.Config{ReadDepth: 1} // in order: the skip is deterministic
	src, err := jobs.OpenSource(cfg, path)
	if err != nil {
		t.Fatal(err)
	}
	defer src.Close()
	mk := func(off, n, group int, sum uint64) jobs.Extent {
		return jobs.Extent{Src: src, Off: int64(off), Dst: make([]byte, n), Group: group, Verify: jobs.VerifyXXH3, XXH3: sum}
	}
	exts := []jobs.Extent{
		mk(0, 1000, 0, xxh3.Hash(data[:1000])),
		mk(1000, 1000, 0, xxh3.Hash(data[1000:2000])^1), // wrong
		mk(2000, 1000, 0, xxh3.Hash(data[2000:3000])),
		mk(3000, 5000, 1, xxh3.Hash(data[3000:8000])),
		mk(299_000, 2000, 2, 0), // past the end of the file
	}
	errs, _, err := jobs.ReadExtents(context.Background(), cfg, exts)
	if err != nil {
		t.Fatal(err)
	}
	if errs[0] != nil || errs[3] != nil || !bytes.Equal(exts[3].Dst, data[3000:8000]) {
		t.Fatalf("good extents: %v, %v", errs[0], errs[3])
	}
	if !errors.Is(errs[1], jobs.ErrCorrupt) || !errors.Is(errs[2], jobs.ErrSkipped) || !errors.Is(errs[4], jobs.ErrBlockSize) {
		t.Fatalf("errors %v, want ErrCorrupt, ErrSkipped, ErrBlockSize", errs)
	}
	if !bytes.Equal(exts[2].Dst, make([]byte, 1000)) {
		t.Fatal("a skipped extent was read")
	}
}

// restoreBoth writes a tiny cache in both layouts under dir, evicts the
// files from the page cache, and returns the two paths and the expected
// slot bytes.
func restoreBoth(t *testing.T, dir string) (single, blocks string, want [][]byte) {
	t.Helper()
	c := kvgen.NewCache(kvgen.Tiny, 700, true, nil)
	single, blocks = filepath.Join(dir, "ns", "single"), filepath.Join(dir, "ns", "manifest")
	mustWrite(t, noSync(), cacheSpec(t, c, single, layout.Single, 0))
	mustWrite(t, noSync(), cacheSpec(t, c, blocks, layout.Blocks, jobs.MinBlockBytes))
	evictFiles(t, dir)
	return single, blocks, expectedAll(c)
}

// TestReadFallsBackWhenDirectRefused: a file system that refuses O_DIRECT
// opens with EINVAL (the fault FS) still restores both layouts exactly,
// with no byte counted as direct; the refusal is remembered, so a second
// read does not ask again.
func TestReadFallsBackWhenDirectRefused(t *testing.T) {
	dir := directDir(t)
	single, blocks, want := restoreBoth(t, dir)
	ffs := testutil.NewFaultFS(nil)
	ffs.Inject(testutil.Fault{Op: testutil.OpOpenDirect, Err: syscall.EINVAL})
	cfg := &jobs.Config{FS: ffs, ReadDepth: 4}
	for round := range 2 {
		evictFiles(t, dir) // cold: O_DIRECT would be worth asking for
		for _, p := range []string{single, blocks} {
			got, _, m, err := readBack(t, cfg, p, true)
			if err != nil {
				t.Fatalf("round %d, %s: %v", round, p, err)
			}
			mustEqualExpected(t, got, want)
			if m.DirectReadBytes != 0 || m.ReadBytes != m.LogicalBytes {
				t.Fatalf("round %d, %s: %d bytes direct, %d read of %d", round, p, m.DirectReadBytes, m.ReadBytes, m.LogicalBytes)
			}
		}
		// The single file's read asks first and is refused; nothing asks
		// again on this file system.
		if n := ffs.Count(testutil.OpOpenDirect); n != 1 {
			t.Fatalf("round %d: %d O_DIRECT opens, want 1", round, n)
		}
	}
	if n := len(ffs.Injected()); n != 1 {
		t.Fatalf("%d refusals injected, want 1", n)
	}
}

// TestReadDirectAndBuffered: on a file system with O_DIRECT both layouts,
// evicted from the page cache, are read with it (every byte direct); with
// NoDirect, none; once cached, none either (the page cache is faster); on
// tmpfs (alignment 0) no O_DIRECT open is even tried. Every file opened is
// closed.
func TestReadDirectAndBuffered(t *testing.T) {
	dirs := map[string]string{"disk": directDir(t)}
	if st, err := os.Stat("/dev/shm"); err == nil && st.IsDir() {
		d, err := os.MkdirTemp("/dev/shm", "kvpersist-direct-")
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { os.RemoveAll(d) })
		dirs["tmpfs"] = d
	}
	for name, dir := range dirs {
		single, blocks, want := restoreBoth(t, dir)
		for _, noDirect := range []bool{false, true} {
			ffs := testutil.NewFaultFS(nil)
			cfg := &jobs.Config{FS: ffs, NoDirect: noDirect}
			for _, p := range []string{single, blocks} {
				got, _, m, err := readBack(t, cfg, p, true)
				if err != nil {
					t.Fatalf("%s: %v", p, err)
				}
				mustEqualExpected(t, got, want)
				direct := name == "disk" && !noDirect
				if wantDirect := map[bool]int64{true: m.LogicalBytes}[direct]; m.DirectReadBytes != wantDirect {
					t.Fatalf("%s, %s, NoDirect=%v: %d bytes direct, want %d", name, filepath.Base(p), noDirect, m.DirectReadBytes, wantDirect)
				}
			}
			if n := ffs.Count(testutil.OpOpenDirect); (n > 0) != (name == "disk" && !noDirect) {
				t.Fatalf("%s, NoDirect=%v: %d O_DIRECT opens", name, noDirect, n)
			}
			if noDirect {
				// The buffered reads left every page cached: a read that
				// may use O_DIRECT now reads them from the page cache
				// (warm): the single file is not opened with O_DIRECT; each
				// block is opened once, with O_DIRECT, found cached and
				// switched to buffered reads (no second, buffered open).
				ffs.Reset()
				for _, p := range []string{single, blocks} {
					got, _, m, err := readBack(t, &jobs.Config{FS: ffs}, p, true)
					if err != nil {
						t.Fatalf("%s: %v", p, err)
					}
					mustEqualExpected(t, got, want)
					if m.DirectReadBytes != 0 {
						t.Fatalf("%s, warm %s: %d bytes read with O_DIRECT, want 0", name, filepath.Base(p), m.DirectReadBytes)
					}
				}
				snap, err := layout.Load(vfs.Default, blocks)
				if err != nil {
					t.Fatal(err)
				}
				set := blockSet(snap.Header)
				if n := ffs.CountPath(testutil.OpOpenDirect, single); n != 0 {
					t.Fatalf("%s, warm: the single file opened %d times with O_DIRECT", name, n)
				}
				wantBlockDirect := map[bool]int{true: 1}[name == "disk"]
				for h := range set {
					p := testutil.BlockPath(filepath.Dir(blocks), h)
					if o, d := ffs.CountPath(testutil.OpOpen, p), ffs.CountPath(testutil.OpOpenDirect, p); o+d != 1 || d != wantBlockDirect {
						t.Fatalf("%s, warm: block %s opened %d times buffered and %d with O_DIRECT, want once (with O_DIRECT: %v)", name, h, o, d, wantBlockDirect == 1)
					}
				}
			}
			if o, c := ffs.Count(testutil.OpOpen)+ffs.Count(testutil.OpOpenDirect), ffs.Count(testutil.OpClose); o != c {
				t.Fatalf("%s: %d files opened, %d closed", name, o, c)
			}
		}
	}
}

// TestReadOpensEachBlockOnce: a cold block restore opens each block file
// once to read it (with O_DIRECT, not buffered first: the file is not in
// the page cache) and checks the others by Lstat, however many blocks the manifest
// names; every descriptor is closed. Before, a manifest of more blocks than
// a read kept open (1,024; the 1 GiB benchmark snapshot names 1,025) had
// every block opened twice in each mode: once to check its size, once
// again to read it.
func TestReadOpensEachBlockOnce(t *testing.T) {
	dir := directDir(t)
	for _, held := range []int{3, 1 << 20} {
		restore := jobs.SetMaxHeldBlocks(held)
		_, blocks, want := restoreBoth(t, dir)
		snap, err := layout.Load(vfs.Default, blocks)
		if err != nil {
			t.Fatal(err)
		}
		set := blockSet(snap.Header)
		if len(set) <= 3 {
			t.Fatalf("only %d distinct blocks: the test needs more than 3", len(set))
		}
		ffs := testutil.NewFaultFS(nil)
		got, _, m, err := readBack(t, &jobs.Config{FS: ffs, ReadDepth: 4}, blocks, true)
		restore()
		if err != nil {
			t.Fatal(err)
		}
		mustEqualExpected(t, got, want)
		if m.DirectReadBytes != m.ReadBytes {
			t.Fatalf("held %d: %d of %d bytes read with O_DIRECT, want all (cold)", held, m.DirectReadBytes, m.ReadBytes)
		}
		nsDir := filepath.Dir(blocks)
		for h := range set {
			p := testutil.BlockPath(nsDir, h)
			if o, d := ffs.CountPath(testutil.OpOpen, p), ffs.CountPath(testutil.OpOpenDirect, p); o != 0 || d != 1 {
				t.Fatalf("held %d: block %s opened %d times buffered and %d with O_DIRECT, want once with O_DIRECT only", held, h, o, d)
			}
		}
		if o, c := ffs.Count(testutil.OpOpen)+ffs.Count(testutil.OpOpenDirect), ffs.Count(testutil.OpClose); o != c {
			t.Fatalf("held %d: %d opens, %d closes", held, o, c)
		}
		os.RemoveAll(filepath.Join(dir, "ns"))
	}
}

// TestReadFallsBackWhenDirectReadRefused: an O_DIRECT pread refused with
// EINVAL (a file on a file system other than the one the decision was made
// for) is read again buffered, and the source reads buffered from then
// on: the extent is read exactly.
func TestReadFallsBackWhenDirectReadRefused(t *testing.T) {
	dir := directDir(t)
	rng := rand.New(rand.NewPCG(9, 10))
	path, data := randomFile(t, rng, dir, "f", 2*jobs.ReadChunkBytes+4096)
	ffs := testutil.NewFaultFS(nil)
	cfg := &jobs.Config{FS: ffs}
	src, err := jobs.OpenSource(cfg, path)
	if err != nil {
		t.Fatal(err)
	}
	defer src.Close()
	if !src.Direct() {
		t.Fatal("source not opened with O_DIRECT")
	}
	ffs.Inject(testutil.Fault{Op: testutil.OpReadAt, Nth: 1, Err: syscall.EINVAL})
	x := []jobs.Extent{{Src: src, Dst: make([]byte, len(data)), Group: -1, Verify: jobs.VerifySHA256, SHA256: sha256.Sum256(data)}}
	errs, st, err := jobs.ReadExtents(context.Background(), cfg, x)
	if err != nil || errs[0] != nil || !bytes.Equal(x[0].Dst, data) {
		t.Fatalf("%v, %v", err, errs[0])
	}
	// The refused read is read again buffered; reads already in flight
	// beside it (the other chunks) may still complete with O_DIRECT.
	if len(ffs.Injected()) != 1 || st.DirectBytes >= int64(len(data)) || src.Direct() {
		t.Fatalf("%d injections, %d of %d bytes direct, still direct: %v", len(ffs.Injected()), st.DirectBytes, len(data), src.Direct())
	}
}

// TestReadPartlyCachedFile: a file whose pages are in the page cache
// except some ranges is read with O_DIRECT only for those ranges, and
// buffered for the rest, also where a read piece straddles a range's edge
// (it is read in parts): DirectBytes counts exactly the missing bytes,
// the bytes equal what was written, the evicted ranges stay out of the
// page cache (O_DIRECT does not fill it), and every file opened is
// closed (the buffered descriptor for the cached ranges is opened on the
// first of them). Both ways a source is made: opened (OpenSource) and
// adopted from a caller's file (AdoptSource).
func TestReadPartlyCachedFile(t *testing.T) {
	dir := directDir(t)
	rng := rand.New(rand.NewPCG(11, 12))
	const mib = 1 << 20 // = jobs.ReadChunkBytes: one read piece
	data := make([]byte, 16*mib+777)
	for i := range data {
		data[i] = byte(rng.Uint32())
	}
	path := filepath.Join(dir, "f")
	if err := os.WriteFile(path, data, 0o640); err != nil {
		t.Fatal(err)
	}
	// The missing ranges, in MiB: 2 MiB each and 2 MiB aligned, since the
	// kernel drops a large folio (up to 2 MiB) only whole.
	missing := map[int64]bool{2: true, 3: true, 8: true, 9: true}
	mibCached := func(k int64) (cached, known bool) {
		f, err := vfs.Default.Open(path)
		if err != nil {
			t.Fatal(err)
		}
		defer f.Close()
		return vfs.Cached(f, k*mib, min(mib, int64(len(data))-k*mib))
	}
	// The extents: the whole file (pieces on MiB boundaries), the file
	// from 512 KiB on (pieces straddling them, half of four of them
	// cached), and capacity-padded head-major views from 512 KiB on
	// (heads x tokens x 64 bf16; opened one way, the read is the same):
	// runs of 24 KiB (read through staging with O_DIRECT) and of 384 KiB
	// (straight into them), cut where the page cache's ranges end. Only
	// the missing bytes go direct.
	cases := []struct {
		off           int64
		heads, tokens int // a view's; 0: a contiguous destination to the end of the file
	}{{0, 0, 0}, {mib / 2, 0, 0}, {mib / 2, 100, 192}, {mib / 2, 10, 3072}}
	missingIn := func(lo, hi int64) (n int64) {
		for k := range missing {
			n += max(0, min(hi, (k+1)*mib)-max(lo, k*mib))
		}
		return n
	}
	for _, adopt := range []bool{false, true} {
		for _, depth := range []int{1, 16} {
			for _, tc := range cases {
				if adopt && tc.heads > 0 {
					continue
				}
				// Every page cached (read through), then the missing
				// ranges dropped.
				if got, err := os.ReadFile(path); err != nil || !bytes.Equal(got, data) {
					t.Fatalf("read back: %v", err)
				}
				testutil.EvictRange(t, path, 2*mib, 2*mib)
				testutil.EvictRange(t, path, 8*mib, 2*mib)
				for k := int64(0); k <= 16; k++ {
					cached, known := mibCached(k)
					if !known {
						t.Skip("cachestat(2) unavailable: the page cache cannot be asked per range")
					}
					if cached == missing[k] {
						t.Skipf("MiB %d cached=%v after posix_fadvise: the kernel did not drop exactly the ranges asked", k, cached)
					}
				}
				ffs := testutil.NewFaultFS(nil)
				cfg := &jobs.Config{FS: ffs, ReadDepth: depth}
				var src *jobs.Source
				var held vfs.File
				var err error
				if adopt {
					if held, err = ffs.Open(path); err != nil {
						t.Fatal(err)
					}
					src, err = jobs.AdoptSource(cfg, held)
				} else {
					src, err = jobs.OpenSource(cfg, path)
				}
				if err != nil {
					t.Fatal(err)
				}
				if !src.Direct() {
					t.Fatalf("adopt=%v: a partly cached file's source is not direct", adopt)
				}
				want := data[tc.off:]
				x := []jobs.Extent{{Src: src, Off: tc.off, Group: -1}}
				var vd viewDst
				if tc.heads > 0 {
					const dim, capPad = 64, 64
					want = want[:tc.heads*tc.tokens*dim*2]
					capT := tc.tokens + capPad
					vd.buf = bytes.Repeat([]byte{viewFill}, tc.heads*capT*dim*2)
					vd.view = gather.View{Base: vd.buf, Shape: []int{1, tc.heads, tc.tokens, dim}, ItemSize: 2,
						Strides: []int{tc.heads * capT * dim, capT * dim, dim, 1}}
					x[0].View = &vd.view
				} else {
					x[0].Dst = make([]byte, len(want))
				}
				x[0].Verify, x[0].XXH3 = jobs.VerifyXXH3, xxh3.Hash(want)
				errs, st, err := jobs.ReadExtents(context.Background(), cfg, x)
				name := fmt.Sprintf("adopt=%v, depth %d, from %d, view %dx%d", adopt, depth, tc.off, tc.heads, tc.tokens)
				if err != nil || errs[0] != nil {
					t.Fatalf("%s: %v, %v", name, err, errs[0])
				}
				if tc.heads > 0 {
					checkView(t, name, vd, want)
				} else if !bytes.Equal(x[0].Dst, want) {
					t.Fatalf("%s: the bytes read differ from the file's", name)
				}
				wantDirect := missingIn(tc.off, tc.off+int64(len(want)))
				if st.Bytes != int64(len(want)) || st.DirectBytes != wantDirect {
					t.Fatalf("%s: %d bytes read, %d direct; want %d, %d direct (the missing ranges)", name, st.Bytes, st.DirectBytes, len(want), wantDirect)
				}
				for k := range missing {
					if cached, _ := mibCached(k); cached {
						t.Fatalf("%s: MiB %d is cached after the read: it was read buffered", name, k)
					}
				}
				if err := src.Close(); err != nil {
					t.Fatal(err)
				}
				if held != nil {
					held.Close()
				}
				if o, c := ffs.Count(testutil.OpOpen)+ffs.Count(testutil.OpOpenDirect), ffs.Count(testutil.OpClose); o != c {
					t.Fatalf("%s: %d files opened, %d closed", name, o, c)
				}
			}
		}
	}
}
