package jobs_test

import (
	"context"
	"encoding/binary"
	"errors"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/kvpersist/kvpersist/engine/gather"
	"github.com/kvpersist/kvpersist/engine/jobs"
	"github.com/kvpersist/kvpersist/engine/layout"
	"github.com/kvpersist/kvpersist/engine/vfs"
	"github.com/kvpersist/kvpersist/internal/kvgen"
	"github.com/kvpersist/kvpersist/internal/testutil"
)

// hookFS calls onCreate after each file it creates and onWrite after each
// WriteAt, so that a test can act (cancel a context) mid-write.
type hookFS struct {
	vfs.FS
	onCreate func(name string)
	onWrite  func(name string)
}

type hookFile struct {
	vfs.File
	onWrite func(name string)
}

func (h hookFS) Create(name string, perm os.FileMode) (vfs.File, error) {
	f, err := h.FS.Create(name, perm)
	if err != nil {
		return nil, err
	}
	if h.onCreate != nil {
		h.onCreate(name)
	}
	return hookFile{File: f, onWrite: h.onWrite}, nil
}

func (f hookFile) WriteAt(p []byte, off int64) (int, error) {
	n, err := f.File.WriteAt(p, off)
	if f.onWrite != nil {
		f.onWrite(f.Name())
	}
	return n, err
}

// Two Writes of the same path at once (the original used one fixed
// "<path>.tmp" for both) both succeed; the result is one whole version.
func TestConcurrentWritesSamePath(t *testing.T) {
	c40 := kvgen.NewCache(kvgen.Tiny, 40, true, nil)
	c48 := kvgen.NewCache(kvgen.Tiny, 48, true, nil)
	want := map[int64][][]byte{40: expectedAll(c40), 48: expectedAll(c48)}
	for _, lay := range []layout.Layout{layout.Single, layout.Blocks} {
		root := t.TempDir()
		path := filepath.Join(root, "ns", "snap")
		seen := map[int64]bool{}
		for round := 0; round < 6; round++ {
			var wg sync.WaitGroup
			errs := make([]error, 2)
			for i, c := range []*kvgen.Cache{c40, c48} {
				wg.Add(1)
				go func() {
					defer wg.Done()
					_, _, errs[i] = writeAt(context.Background(), withHelpers(1), cacheSpec(t, c, path, lay, 4096))
				}()
			}
			wg.Wait()
			for i, err := range errs {
				if err != nil {
					t.Fatalf("%v round %d: write %d: %v", lay, round, i, err)
				}
			}
			got, snap, _, err := readBack(t, noSync(), path, true)
			if err != nil {
				t.Fatalf("%v round %d: %v", lay, round, err)
			}
			T := snap.Header.Slots()[0].Shape[2]
			if want[T] == nil {
				t.Fatalf("unexpected T %d", T)
			}
			seen[T] = true
			mustEqualExpected(t, got, want[T])
			if tmp := temps(t, root); len(tmp) != 0 {
				t.Fatalf("%v round %d: temp files %v", lay, round, tmp)
			}
		}
		t.Logf("%v: final versions seen: %v", lay, seen)
	}
}

func TestInvalidRequestWritesNothing(t *testing.T) {
	c := kvgen.NewCache(kvgen.Tiny, 40, true, nil)
	cases := []struct {
		name string
		mut  func(s *wreq)
		msg  string
		also error // a second sentinel the error must wrap, if any
	}{
		{"itemsize disagrees with dtype", func(s *wreq) { s.Caches[1].Tensors[0].DType = "float32" }, "cache 1 tensor 0 (slot 2): view itemsize 2 bytes, dtype float32 has 4", nil},
		{"unknown dtype", func(s *wreq) { s.Attachments[0].Tensors[0].DType = "int31" }, "attachment 0 tensor 0 (slot 4)", layout.ErrUnknownDType},
		{"view out of bounds", func(s *wreq) {
			v := &s.Caches[0].Tensors[1].View
			v.Base = v.Base[:len(v.Base)/2] // cuts into head 1's tokens
		}, "cache 0 tensor 1 (slot 1)", nil},
		{"rank mismatch", func(s *wreq) { s.Caches[0].Tensors[0].View.Strides = []int{1} }, "slot 0", nil},
		{"no tensors", func(s *wreq) { s.Caches, s.Attachments = nil, nil }, "no tensors", nil},
	}
	for _, lay := range []layout.Layout{layout.Single, layout.Blocks} {
		for _, tc := range cases {
			root := t.TempDir()
			path := filepath.Join(root, "ns", "snap")
			spec := cacheSpec(t, c, path, lay, 0)
			tc.mut(spec)
			_, _, err := writeAt(context.Background(), noSync(), spec)
			if !errors.Is(err, jobs.ErrInvalidRequest) || !strings.Contains(err.Error(), tc.msg) {
				t.Fatalf("%v %s: got %v, want ErrInvalidRequest naming %q", lay, tc.name, err, tc.msg)
			}
			if tc.also != nil && !errors.Is(err, tc.also) {
				t.Fatalf("%v %s: got %v, want it to wrap %v too", lay, tc.name, err, tc.also)
			}
			if _, err := os.Lstat(path); !os.IsNotExist(err) {
				t.Fatalf("%v %s: snapshot exists", lay, tc.name)
			}
			if _, err := os.Lstat(testutil.BlocksDir(filepath.Dir(path))); !os.IsNotExist(err) {
				t.Fatalf("%v %s: blocks directory created", lay, tc.name)
			}
			if tmp := temps(t, root); len(tmp) != 0 {
				t.Fatalf("%v %s: temp files %v", lay, tc.name, tmp)
			}
		}
	}
	_, _, err := writeAt(context.Background(), noSync(), cacheSpec(t, c, filepath.Join(t.TempDir(), "ns", "s"), layout.Layout(9), 0))
	if !errors.Is(err, jobs.ErrInvalidRequest) {
		t.Fatalf("unknown layout: %v", err)
	}
}

// A request whose tensors sum past layout.MaxSnapshotBytes (1 TiB), here a
// broadcast view (stride 0) of 2^41 int32 elements over 4 bytes of memory,
// is refused before anything is created: readers would refuse the snapshot.
// The context is cancelled so that a writer that did not check could not
// fill the disk: it fails with the context's error instead.
func TestWriteRefusesSnapshotPastSizeLimit(t *testing.T) {
	c := kvgen.NewCache(kvgen.Tiny, 40, true, nil)
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	for _, lay := range []layout.Layout{layout.Single, layout.Blocks} {
		root := t.TempDir()
		spec := cacheSpec(t, c, filepath.Join(root, "ns", "snap"), lay, 0)
		spec.Attachments[0].Tensors[0] = jobs.TensorSpec{DType: "int32",
			View: gather.View{Base: make([]byte, 4), Shape: []int{1 << 41}, Strides: []int{0}, ItemSize: 4}}
		_, _, err := writeAt(ctx, noSync(), spec)
		if !errors.Is(err, layout.ErrSnapshotTooLarge) || !errors.Is(err, jobs.ErrInvalidRequest) {
			t.Fatalf("%v: got %v, want ErrSnapshotTooLarge and ErrInvalidRequest", lay, err)
		}
		if _, err := os.Lstat(filepath.Join(root, "ns")); !os.IsNotExist(err) {
			t.Fatalf("%v: namespace directory created (%v)", lay, err)
		}
	}
}

// A context cancelled in the middle of a write fails it with the context's
// error, leaves no temp file, and the previous snapshot still reads back.
func TestCancelMidWrite(t *testing.T) {
	cOld := kvgen.NewCache(kvgen.Tiny, 300, true, nil)
	cNew := kvgen.NewCache(kvgen.Tiny, 348, true, nil)
	for _, lay := range []layout.Layout{layout.Single, layout.Blocks} {
		t.Run(lay.String(), func(t *testing.T) {
			root := t.TempDir()
			path := filepath.Join(root, "ns", "snap")
			mustWrite(t, noSync(), cacheSpec(t, cOld, path, lay, 4096))
			before := blockFiles(t, filepath.Dir(path))

			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			var creates, writes atomic.Int64
			fsys := hookFS{FS: vfs.Default}
			if lay == layout.Single {
				// Cancel once the first tensor chunk is in the temp file.
				fsys.onWrite = func(string) {
					if writes.Add(1) == 1 {
						cancel()
					}
				}
			} else {
				// Cancel after the third new block file is created.
				fsys.onCreate = func(string) {
					if creates.Add(1) == 3 {
						cancel()
					}
				}
			}
			_, _, err := writeAt(ctx, &jobs.Config{FS: fsys, NoSync: true}, cacheSpec(t, cNew, path, lay, 4096))
			if !errors.Is(err, context.Canceled) {
				t.Fatalf("got %v, want context.Canceled", err)
			}
			if writes.Load()+creates.Load() == 0 {
				t.Fatal("the hook never ran: the write was not interrupted mid-way")
			}
			if tmp := temps(t, root); len(tmp) != 0 {
				t.Fatalf("temp files %v", tmp)
			}
			if lay == layout.Blocks {
				// One goroutine: no block after the third was started (the
				// save needed 8 new row tails + 1 token-id block = 9); the
				// three staged ones are either published whole or removed.
				if added := len(blockFiles(t, filepath.Dir(path))) - len(before); added > 3 {
					t.Fatalf("%d new blocks after the cancel", added)
				}
			}
			got, snap, _, err := readBack(t, noSync(), path, true)
			if err != nil {
				t.Fatal(err)
			}
			if snap.Header.Slots()[0].Shape[2] != 300 {
				t.Fatalf("the snapshot at %s changed", path)
			}
			mustEqualExpected(t, got, expectedAll(cOld))
		})
	}
}

// TestScratchBounded: scratch stays within one chunk (single file) or one
// block (block layout) however large the tensors, and is exactly that much
// when every byte must be gathered. (The padded Llama cache at T=512, whose
// rows are long contiguous runs, is checked in TestRoundTripAllGeometries:
// nothing copied, scratch within the bounds.)
func TestScratchBounded(t *testing.T) {
	t.Run("single-file-small-rows", func(t *testing.T) {
		t.Parallel()
		// [1, 256, 1000, 16] bf16 in a capacity-1024 buffer: runs of 32000
		// bytes, a tensor of 8192000 bytes: copied in chunks of ChunkBytes.
		const H, T, C, D = 256, 1000, 1024, 16
		base := make([]byte, H*C*D*2)
		rand.NewChaCha8([32]byte{2}).Read(base)
		v := gather.View{Base: base, Shape: []int{1, H, T, D}, Strides: []int{H * C * D, C * D, D, 1}, ItemSize: 2}
		want := make([]byte, 0, H*T*D*2)
		for h := 0; h < H; h++ {
			want = append(want, base[h*C*D*2:h*C*D*2+T*D*2]...)
		}
		path := filepath.Join(t.TempDir(), "ns", "s")
		h, m := mustWrite(t, withHelpers(1), &wreq{path, &jobs.WriteRequest{Layout: layout.Single,
			Caches: []jobs.EntrySpec{{Tensors: []jobs.TensorSpec{{DType: "bfloat16", View: v}}}}}})
		if m.ScratchPeak != jobs.ChunkBytes || m.CopiedBytes != int64(len(want)) {
			t.Fatalf("ScratchPeak %d (want %d), CopiedBytes %d (want %d)", m.ScratchPeak, jobs.ChunkBytes, m.CopiedBytes, len(want))
		}
		if h.Slots()[0].Hash != xxhHex(want) {
			t.Fatal("tensor hash differs from xxh3 of the logical bytes")
		}
		got, _, _, err := readBack(t, noSync(), path, true)
		if err != nil {
			t.Fatal(err)
		}
		mustEqualExpected(t, got, [][]byte{want})
	})
	t.Run("blocks-token-major", func(t *testing.T) {
		t.Parallel()
		// [1, 4, 1024, 64] bf16 stored token-major ([T][H][D] in memory):
		// runs of one 128-byte head vector, so every 4096-byte block is
		// gathered into scratch of exactly one block.
		const H, T, D, bb = 4, 1024, 64, 4096
		base := make([]byte, T*H*D*2)
		rand.NewChaCha8([32]byte{3}).Read(base)
		v := gather.View{Base: base, Shape: []int{1, H, T, D}, Strides: []int{T * H * D, D, H * D, 1}, ItemSize: 2}
		want := make([]byte, 0, len(base))
		for h := 0; h < H; h++ {
			for tk := 0; tk < T; tk++ {
				o := (tk*H + h) * D * 2
				want = append(want, base[o:o+D*2]...)
			}
		}
		ns := filepath.Join(t.TempDir(), "ns")
		spec := func(name string, packed bool) *wreq {
			return &wreq{filepath.Join(ns, name), &jobs.WriteRequest{Layout: layout.Blocks, BlockBytes: bb, Packed: packed,
				Caches: []jobs.EntrySpec{{Tensors: []jobs.TensorSpec{{DType: "bfloat16", View: v}}}}}}
		}
		h, m := mustWrite(t, withHelpers(1), spec("seg", false))
		if m.ScratchPeak != bb || m.CopiedBytes != int64(len(want)) {
			t.Fatalf("ScratchPeak %d (want %d), CopiedBytes %d (want %d)", m.ScratchPeak, bb, m.CopiedBytes, len(want))
		}
		checkBlockRefs(t, h, [][]byte{want}, bb)
		got, _, _, err := readBack(t, noSync(), filepath.Join(ns, "seg"), true)
		if err != nil {
			t.Fatal(err)
		}
		mustEqualExpected(t, got, [][]byte{want})
		// Packed copies the tensor once, whole, and names the same blocks.
		hp, mp := mustWrite(t, noSync(), spec("packed", true))
		if mp.CopiedBytes != int64(len(want)) || mp.BlocksWritten != 0 {
			t.Fatalf("packed: %+v", mp)
		}
		if !slices.Equal(h.Slots()[0].Blocks, hp.Slots()[0].Blocks) {
			t.Fatal("packed blocks differ")
		}
	})
}

// TestWriteRefusesMoreAxesThanReadersAccept: a view of more than
// layout.MaxRank axes is refused (ErrInvalidRequest) before anything is
// published: readers would refuse the file, and collect would then never
// sweep its namespace again.
func TestWriteRefusesMoreAxesThanReadersAccept(t *testing.T) {
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
			if !errors.Is(werr, jobs.ErrInvalidRequest) {
				t.Fatalf("Write of %d axes: %v, want ErrInvalidRequest", len(shape), werr)
			}
			if _, err := os.Lstat(path); !os.IsNotExist(err) {
				t.Fatalf("a file was published at %s (%v)", path, err)
			}
		})
	}
}

// panicBlock is the block size, in bytes, of the writes of the panic tests.
const panicBlock = 4096

// oneTensorBlocks saves b as one uint8 tensor in blocks of panicBlock bytes.
func oneTensorBlocks(path string, b []byte) *wreq {
	return &wreq{path, &jobs.WriteRequest{Layout: layout.Blocks, BlockBytes: panicBlock,
		Caches: []jobs.EntrySpec{{Tensors: []jobs.TensorSpec{{DType: "uint8",
			View: gather.View{Base: b, Shape: []int{len(b)}, Strides: []int{1}, ItemSize: 1}}}}}}}
}

// distinctBlocks returns n distinct blocks' worth of bytes (covers ~all 256 fan-outs).
func distinctBlocks(n int, seed byte) []byte {
	buf := make([]byte, n*panicBlock)
	for i := 0; i < n; i++ {
		binary.LittleEndian.PutUint64(buf[i*panicBlock:], uint64(i))
		buf[i*panicBlock+8] = seed
	}
	return buf
}

// panicFS panics in Rename of a block temp file (a bug in a vfs.FS, or in
// Commit).
type panicFS struct{ vfs.FS }

func (p panicFS) Rename(o, n string) error {
	if strings.Contains(o, string(filepath.Separator)+layout.BlocksDirName+string(filepath.Separator)) {
		panic("test: rename panicked")
	}
	return p.FS.Rename(o, n)
}

// TestAPanicInABlockSyncerFailsTheWrite: a panic in a block's fsync waiter
// (here a vfs.FS whose Rename panics) is recovered and fails the write
// with ErrPanic; the process lives on. Run in a child process, so that a
// panic that escapes shows as the child's crash.
func TestAPanicInABlockSyncerFailsTheWrite(t *testing.T) {
	if os.Getenv("KVPERSIST_PANIC_CHILD") == "1" {
		_, _, err := writeAt(context.Background(), &jobs.Config{FS: panicFS{vfs.Default}}, oneTensorBlocks(filepath.Join(os.Getenv("KVPERSIST_PANIC_ROOT"), "ns", "a"), distinctBlocks(4, 4)))
		if !errors.Is(err, jobs.ErrPanic) {
			t.Fatalf("want ErrPanic, got %v", err)
		}
		return
	}
	cmd := exec.Command(os.Args[0], "-test.run=^TestAPanicInABlockSyncerFailsTheWrite$", "-test.count=1")
	cmd.Env = append(os.Environ(), "KVPERSIST_PANIC_CHILD=1", "KVPERSIST_PANIC_ROOT="+t.TempDir())
	out, err := cmd.CombinedOutput()
	if err != nil && strings.Contains(string(out), "panic: test: rename panicked") {
		t.Fatalf("a panic in a syncer's Commit crashed the process instead of failing the write with ErrPanic:\n%.600s", out)
	}
	if err != nil {
		t.Fatalf("child: %v\n%s", err, out)
	}
}

// wbPanicFS panics in StartWriteback (between Stage and the hand-off).
type wbPanicFS struct{ vfs.FS }
type wbPanicFile struct{ vfs.File }

func (w wbPanicFS) Create(name string, perm os.FileMode) (vfs.File, error) {
	f, err := w.FS.Create(name, perm)
	if err != nil {
		return nil, err
	}
	return wbPanicFile{f}, nil
}
func (wbPanicFile) StartWriteback(off, n int64) error { panic("test: writeback panicked") }

// TestAPanicWhileStoringABlockLeavesNoTempFile: a panic between a block's
// temp file being created and its hand-off to the fsync waiters fails the
// write with ErrPanic and leaves no temp file.
func TestAPanicWhileStoringABlockLeavesNoTempFile(t *testing.T) {
	root := t.TempDir()
	_, _, err := writeAt(context.Background(), &jobs.Config{FS: wbPanicFS{vfs.Default}}, oneTensorBlocks(filepath.Join(root, "ns", "a"), distinctBlocks(4, 5)))
	if !errors.Is(err, jobs.ErrPanic) {
		t.Fatalf("want ErrPanic, got %v", err)
	}
	if temps := testutil.TempFiles(t, root); len(temps) > 0 {
		t.Fatalf("%d temp files left after a panic while storing a block: %v", len(temps), temps[0])
	}
}
