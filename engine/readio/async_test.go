package readio_test

import (
	"bytes"
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"sync"
	"sync/atomic"
	"testing"
	"unsafe"

	"github.com/kvpersist/kvpersist/engine/readio"
	"github.com/kvpersist/kvpersist/engine/vfs"
	"github.com/kvpersist/kvpersist/internal/testutil"
	"github.com/zeebo/xxh3"
)

// pageAligned is n bytes at a 4 KiB-aligned address.
func pageAligned(n int) []byte {
	b := make([]byte, n+4096)
	skip := (4096 - int(uintptr(unsafe.Pointer(&b[0])))%4096) % 4096
	return b[skip : skip+n : skip+n]
}

// TestReadAsync: a cold file read with Config.Async: extents
// straight into aligned destinations (whole pieces, several per extent),
// into misaligned ones and at unaligned offsets (through staging), up to
// the end of the file, and into strided views of every KV layout, at
// depths 1 and 16: every byte equals the file's (guards and the views'
// other bytes untouched), each extent verifies against a hash computed
// here, and every direct byte was read asynchronously.
func TestReadAsync(t *testing.T) {
	dir := testutil.DirectDir(t)
	rng := rand.New(rand.NewPCG(41, 42))
	path, data := randomFile(t, rng, dir, "f", 6*readio.ReadChunkBytes+777)
	for _, depth := range []int{1, 16} {
		testutil.EvictTree(t, dir)
		cfg := &readio.Config{ReadDepth: depth, Async: testutil.AsyncReads(t)}
		src, err := readio.OpenSource(cfg, path)
		if err != nil {
			t.Fatal(err)
		}
		if !src.Direct() {
			t.Fatal("cold source not opened with O_DIRECT")
		}
		exts, gs := guardedExtents(rng, src, data, 12)
		// Straight into the destination: aligned memory, offset and length.
		aligned := pageAligned(3*readio.ReadChunkBytes + 8192)
		exts = append(exts, readio.Extent{Src: src, Off: 4096, Dst: aligned, Group: -1,
			Verify: readio.VerifySHA256, SHA256: sha256.Sum256(data[4096 : 4096+len(aligned)])})
		var views []viewDst
		var viewExt []int
		for range 8 {
			d := randomViewDst(rng)
			n := d.view.Bytes()
			off := rng.IntN(len(data)-n+1) &^ 4095
			viewExt = append(viewExt, len(exts))
			views = append(views, d)
			exts = append(exts, readio.Extent{Src: src, Off: int64(off), View: &views[len(views)-1].view, Group: -1,
				Verify: readio.VerifyXXH3, XXH3: xxh3.Hash(data[off : off+n])})
		}
		errs, st, err := readio.Read(context.Background(), cfg, exts, nil)
		if err != nil {
			t.Fatal(err)
		}
		var total int64
		for k, x := range exts {
			if errs[k] != nil {
				t.Fatalf("depth %d, extent %d: %v", depth, k, errs[k])
			}
			total += int64(x.Bytes())
		}
		for k, g := range gs {
			x := exts[k]
			if !bytes.Equal(x.Dst, data[x.Off:x.Off+int64(len(x.Dst))]) {
				t.Fatalf("depth %d, extent %d: bytes differ from the file's", depth, k)
			}
			for i, b := range g.buf {
				if (i < g.start || i >= g.end) && b != dstGuardByte {
					t.Fatalf("depth %d, extent %d: guard byte %d written", depth, k, i)
				}
			}
		}
		if !bytes.Equal(aligned, data[4096:4096+len(aligned)]) {
			t.Fatalf("depth %d: the aligned extent differs from the file's bytes", depth)
		}
		for j, d := range views {
			x := exts[viewExt[j]]
			checkView(t, fmt.Sprintf("depth %d, view %d", depth, j), d, data[x.Off:x.Off+int64(x.Bytes())])
		}
		if st.Bytes != total || st.DirectBytes != total || st.AsyncBytes != total {
			t.Fatalf("depth %d: stats %+v, want %d bytes read, all direct and asynchronous", depth, st, total)
		}
		if n := readio.AsyncInFlight(cfg.Async); n != 0 {
			t.Fatalf("depth %d: %d reads in flight after Read returned", depth, n)
		}
		src.Close()
	}
}

// TestReadAsyncShortAndCorrupt: through the asynchronous reads, a file cut
// short after it was opened is ErrBlockSize (the read ends early: a short
// read, then end of file), and a byte changed on disk is ErrCorrupt; the
// other extents are read exactly.
func TestReadAsyncShortAndCorrupt(t *testing.T) {
	dir := testutil.DirectDir(t)
	rng := rand.New(rand.NewPCG(43, 44))
	cfg := &readio.Config{ReadDepth: 4, Async: testutil.AsyncReads(t)}
	path, data := randomFile(t, rng, dir, "short", 3*readio.ReadChunkBytes)
	src, err := readio.OpenSource(cfg, path)
	if err != nil {
		t.Fatal(err)
	}
	defer src.Close()
	if err := os.Truncate(path, 2*readio.ReadChunkBytes+1000); err != nil {
		t.Fatal(err)
	}
	head := pageAligned(readio.ReadChunkBytes)
	tail := pageAligned(readio.ReadChunkBytes)
	exts := []readio.Extent{
		{Src: src, Off: 0, Dst: head, Group: -1, Verify: readio.VerifyXXH3, XXH3: xxh3.Hash(data[:len(head)])},
		{Src: src, Off: 2 * readio.ReadChunkBytes, Dst: tail, Group: -1, Verify: readio.VerifyXXH3, XXH3: xxh3.Hash(data[2*readio.ReadChunkBytes:])},
	}
	errs, st, err := readio.Read(context.Background(), cfg, exts, nil)
	if err != nil || errs[0] != nil || !bytes.Equal(head, data[:len(head)]) {
		t.Fatalf("whole extent: %v, %v", err, errs[0])
	}
	if !errors.Is(errs[1], readio.ErrShort) {
		t.Fatalf("extent past the new end of the file: %v, want ErrBlockSize", errs[1])
	}
	if st.AsyncBytes == 0 {
		t.Fatalf("stats %+v: nothing read asynchronously", st)
	}

	path, data = randomFile(t, rng, dir, "corrupt", 2*readio.ReadChunkBytes)
	f, err := os.OpenFile(path, os.O_WRONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := f.WriteAt([]byte{data[readio.ReadChunkBytes+5] ^ 0xFF}, readio.ReadChunkBytes+5); err != nil {
		t.Fatal(err)
	}
	f.Close()
	testutil.EvictTree(t, path)
	src2, err := readio.OpenSource(cfg, path)
	if err != nil {
		t.Fatal(err)
	}
	defer src2.Close()
	dst := pageAligned(len(data))
	exts = []readio.Extent{{Src: src2, Dst: dst, Group: -1, Verify: readio.VerifySHA256, SHA256: sha256.Sum256(data)}}
	errs, st, err = readio.Read(context.Background(), cfg, exts, nil)
	if err != nil || !errors.Is(errs[0], readio.ErrCorrupt) {
		t.Fatalf("corrupt file: %v, %v; want ErrCorrupt", err, errs[0])
	}
	if st.AsyncBytes != int64(len(data)) {
		t.Fatalf("stats %+v: want every byte read asynchronously", st)
	}
}

// TestReadAsyncCancelLeavesNothingInFlight: a read cancelled while many
// requests are in flight returns ctx's error only once each of them has
// completed: no asynchronous read into the destination is left in flight
// when Read returns (so none can write into it later), and after
// the context is closed the destination still holds what it held then.
// The same holds when the goroutine finishing the first extent panics
// (Read then fails with ErrPanic): the other goroutines' requests
// are waited for all the same.
func TestReadAsyncCancelLeavesNothingInFlight(t *testing.T) {
	dir := testutil.DirectDir(t)
	rng := rand.New(rand.NewPCG(45, 46))
	path, data := randomFile(t, rng, dir, "f", 32*readio.ReadChunkBytes)
	a := testutil.AsyncReads(t)
	cfg := &readio.Config{ReadDepth: 32, Async: a}
	const rounds = 4 // the last one panics
	for round := range rounds {
		testutil.EvictTree(t, path)
		src, err := readio.OpenSource(cfg, path)
		if err != nil {
			t.Fatal(err)
		}
		var exts []readio.Extent
		for k := range 32 {
			off := k * readio.ReadChunkBytes
			exts = append(exts, readio.Extent{Src: src, Off: int64(off), Dst: pageAligned(readio.ReadChunkBytes), Group: -1,
				Verify: readio.VerifyXXH3, XXH3: xxh3.Hash(data[off : off+readio.ReadChunkBytes])})
		}
		ctx, cancel := context.WithCancel(context.Background())
		var once sync.Once
		stop, want := func() { once.Do(cancel) }, context.Canceled
		if round == rounds-1 {
			stop, want = func() { panic("an extent's hook panics") }, readio.ErrPanic
		}
		_, _, err = readio.Read(ctx, cfg, exts, func(int, error) { stop() })
		cancel()
		if !errors.Is(err, want) {
			t.Fatalf("round %d: %v, want %v", round, err, want)
		}
		if n := readio.AsyncInFlight(a); n != 0 {
			t.Fatalf("round %d: %d asynchronous reads still in flight after Read returned", round, n)
		}
		snap := make([][]byte, len(exts))
		for k, x := range exts {
			snap[k] = bytes.Clone(x.Dst)
		}
		src.Close()
		// Any request still owned by the kernel would land by now: Close
		// waits for every one.
		if round == rounds-1 {
			if err := a.Close(); err != nil {
				t.Fatal(err)
			}
		}
		for k, x := range exts {
			if !bytes.Equal(x.Dst, snap[k]) {
				t.Fatalf("round %d: extent %d written after Read returned", round, k)
			}
		}
	}
}

// TestReadAsyncConcurrentFirstReads: six cold reads starting at once on
// an AsyncReads not set up yet set it up once (the others wait for that
// setup, then share it) and read every byte right, all of them
// asynchronously; after Close a read still returns the file's bytes,
// with O_DIRECT preads (no byte asynchronous) and no new setup.
func TestReadAsyncConcurrentFirstReads(t *testing.T) {
	dir := testutil.DirectDir(t)
	rng := rand.New(rand.NewPCG(47, 48))
	const regions = 6
	path, data := randomFile(t, rng, dir, "f", regions*2*readio.ReadChunkBytes)
	var setups atomic.Int32
	a := readio.NewAsyncReadsWith(nil, func(depth int) (*vfs.AsyncReader, error) {
		setups.Add(1)
		return vfs.NewAsyncReader(depth)
	})
	defer a.Close()
	// read reads region g (two pieces, one at an unaligned offset) and
	// checks its bytes; it returns the read's stats.
	read := func(g int) (readio.Stats, error) {
		cfg := &readio.Config{ReadDepth: 4, Async: a}
		src, err := readio.OpenSource(cfg, path)
		if err != nil {
			return readio.Stats{}, err
		}
		defer src.Close()
		base := g * 2 * readio.ReadChunkBytes
		exts := []readio.Extent{
			{Src: src, Off: int64(base), Dst: pageAligned(readio.ReadChunkBytes), Group: -1},
			{Src: src, Off: int64(base + readio.ReadChunkBytes + 100), Dst: make([]byte, readio.ReadChunkBytes-200), Group: -1},
		}
		errs, st, err := readio.Read(context.Background(), cfg, exts, nil)
		if err = errors.Join(append(errs, err)...); err != nil {
			return st, err
		}
		for _, x := range exts {
			if !bytes.Equal(x.Dst, data[x.Off:x.Off+int64(len(x.Dst))]) {
				return st, fmt.Errorf("region %d: bytes at %d differ from the file's", g, x.Off)
			}
		}
		return st, nil
	}
	start := make(chan struct{})
	var wg sync.WaitGroup
	errs := make([]error, regions)
	for g := range regions {
		wg.Go(func() {
			<-start
			st, err := read(g)
			if err == nil && (st.DirectBytes != st.Bytes || st.AsyncBytes != st.Bytes) {
				err = fmt.Errorf("region %d: stats %+v, want every byte direct and asynchronous", g, st)
			}
			errs[g] = err
		})
	}
	close(start)
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		t.Fatal(err)
	}
	if n := setups.Load(); n != 1 {
		t.Fatalf("%d AIO setups for %d concurrent first reads, want 1", n, regions)
	}
	if err := a.Close(); err != nil {
		t.Fatal(err)
	}
	testutil.EvictTree(t, path)
	st, err := read(0)
	if err != nil {
		t.Fatalf("after Close: %v", err)
	}
	if st.Bytes == 0 || st.DirectBytes != st.Bytes || st.AsyncBytes != 0 || setups.Load() != 1 {
		t.Fatalf("after Close: stats %+v, %d setups; want every byte direct, none asynchronous, no new setup", st, setups.Load())
	}
}
