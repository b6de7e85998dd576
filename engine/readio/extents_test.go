package readio_test

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
	"github.com/kvpersist/kvpersist/engine/readio"
	"github.com/kvpersist/kvpersist/engine/vfs"
	"github.com/kvpersist/kvpersist/internal/testutil"
	"github.com/zeebo/xxh3"
)

// openRefusingDirect opens path with O_DIRECT through a fault FS set as
// cfg.FS, whose first direct ReadAt then fails with EINVAL (the refusal
// some file systems give); the source is closed at the test's end.
func openRefusingDirect(t *testing.T, cfg *readio.Config, path string) (*readio.Source, *testutil.FaultFS) {
	t.Helper()
	ffs := testutil.NewFaultFS(nil)
	cfg.FS = ffs
	src, err := readio.OpenSource(cfg, path)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { src.Close() })
	if !src.Direct() {
		t.Fatal("source not opened with O_DIRECT")
	}
	ffs.Inject(testutil.Fault{Op: testutil.OpReadAt, Nth: 1, Err: syscall.EINVAL})
	return src, ffs
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
	testutil.EvictTree(t, p)
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
func guardedExtents(rng *rand.Rand, src *readio.Source, data []byte, count int) ([]readio.Extent, []guardedDst) {
	const guard = 64
	var exts []readio.Extent
	var gs []guardedDst
	for k := range count {
		n := 1 + rng.IntN(3*readio.ReadChunkBytes/2)
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
		x := readio.Extent{Src: src, Off: int64(off), Dst: g.buf[g.start:g.end:g.end], Group: -1}
		if k%2 == 0 {
			x.Verify, x.XXH3 = readio.VerifyXXH3, xxh3.Hash(data[off:off+n])
		} else {
			x.Verify, x.SHA256 = readio.VerifySHA256, sha256.Sum256(data[off:off+n])
		}
		exts = append(exts, x)
		gs = append(gs, g)
	}
	return exts, gs
}

// checkExtents: every extent read exactly its bytes, and no guard byte
// around a destination changed.
func checkExtents(t *testing.T, exts []readio.Extent, gs []guardedDst, data []byte, errs []error) {
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

// TestReadDirect: on a file system with O_DIRECT, random extents
// (unaligned offsets, lengths and destinations, tails at the end of the
// file) are read exactly, verified against independently computed hashes,
// mostly with O_DIRECT, at every queue depth.
func TestReadDirect(t *testing.T) {
	dir := testutil.DirectDir(t)
	rng := rand.New(rand.NewPCG(5, 6))
	path, data := randomFile(t, rng, dir, "f", 3*readio.ReadChunkBytes+777)
	for _, depth := range []int{1, 4, 32} {
		cfg := &readio.Config{ReadDepth: depth}
		src, err := readio.OpenSource(cfg, path)
		if err != nil {
			t.Fatal(err)
		}
		if !src.Direct() || src.Size() != int64(len(data)) {
			t.Fatalf("source direct=%v size %d, want O_DIRECT and %d bytes", src.Direct(), src.Size(), len(data))
		}
		exts, gs := guardedExtents(rng, src, data, 40)
		errs, st, err := readio.Read(context.Background(), cfg, exts, nil)
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

// TestReadVerifyAndGroups: a wrong expected hash is ErrCorrupt for
// that extent only; the later extents of its group are ErrSkipped and not
// read; other groups are read.
func TestReadVerifyAndGroups(t *testing.T) {
	rng := rand.New(rand.NewPCG(7, 8))
	path, data := randomFile(t, rng, t.TempDir(), "f", 300_000)
	cfg := &readio.Config{ReadDepth: 1} // in order: the skip is deterministic
	src, err := readio.OpenSource(cfg, path)
	if err != nil {
		t.Fatal(err)
	}
	defer src.Close()
	mk := func(off, n, group int, sum uint64) readio.Extent {
		return readio.Extent{Src: src, Off: int64(off), Dst: make([]byte, n), Group: group, Verify: readio.VerifyXXH3, XXH3: sum}
	}
	exts := []readio.Extent{
		mk(0, 1000, 0, xxh3.Hash(data[:1000])),
		mk(1000, 1000, 0, xxh3.Hash(data[1000:2000])^1), // wrong
		mk(2000, 1000, 0, xxh3.Hash(data[2000:3000])),
		mk(3000, 5000, 1, xxh3.Hash(data[3000:8000])),
		mk(299_000, 2000, 2, 0), // past the end of the file
	}
	errs, _, err := readio.Read(context.Background(), cfg, exts, nil)
	if err != nil {
		t.Fatal(err)
	}
	if errs[0] != nil || errs[3] != nil || !bytes.Equal(exts[3].Dst, data[3000:8000]) {
		t.Fatalf("good extents: %v, %v", errs[0], errs[3])
	}
	if !errors.Is(errs[1], readio.ErrCorrupt) || !errors.Is(errs[2], readio.ErrSkipped) || !errors.Is(errs[4], readio.ErrShort) {
		t.Fatalf("errors %v, want ErrCorrupt, ErrSkipped, ErrBlockSize", errs)
	}
	if !bytes.Equal(exts[2].Dst, make([]byte, 1000)) {
		t.Fatal("a skipped extent was read")
	}
}

// TestReadFallsBackWhenDirectReadRefused: an O_DIRECT pread refused with
// EINVAL (a file on a file system other than the one the decision was made
// for) is read again buffered, and the source reads buffered from then
// on: the extent is read exactly.
func TestReadFallsBackWhenDirectReadRefused(t *testing.T) {
	dir := testutil.DirectDir(t)
	rng := rand.New(rand.NewPCG(9, 10))
	path, data := randomFile(t, rng, dir, "f", 2*readio.ReadChunkBytes+4096)
	cfg := &readio.Config{}
	src, ffs := openRefusingDirect(t, cfg, path)
	x := []readio.Extent{{Src: src, Dst: make([]byte, len(data)), Group: -1, Verify: readio.VerifySHA256, SHA256: sha256.Sum256(data)}}
	errs, st, err := readio.Read(context.Background(), cfg, x, nil)
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
	dir := testutil.DirectDir(t)
	rng := rand.New(rand.NewPCG(11, 12))
	const mib = 1 << 20 // = readio.ReadChunkBytes: one read piece
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
				cfg := &readio.Config{FS: ffs, ReadDepth: depth}
				var src *readio.Source
				var held vfs.File
				var err error
				if adopt {
					if held, err = ffs.Open(path); err != nil {
						t.Fatal(err)
					}
					src, err = readio.AdoptSource(cfg, held)
				} else {
					src, err = readio.OpenSource(cfg, path)
				}
				if err != nil {
					t.Fatal(err)
				}
				if !src.Direct() {
					t.Fatalf("adopt=%v: a partly cached file's source is not direct", adopt)
				}
				want := data[tc.off:]
				x := []readio.Extent{{Src: src, Off: tc.off, Group: -1}}
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
				x[0].Verify, x[0].XXH3 = readio.VerifyXXH3, xxh3.Hash(want)
				errs, st, err := readio.Read(context.Background(), cfg, x, nil)
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
