package jobs

import (
	"context"
	"encoding/hex"
	"errors"
	"fmt"
	"hash"
	"path/filepath"
	"slices"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvpersist/kvpersist/engine/layout"
	"github.com/kvpersist/kvpersist/engine/store"
	"github.com/kvpersist/kvpersist/engine/vfs"
	"github.com/kvpersist/kvpersist/internal/bunhash"
	"github.com/minio/sha256-simd"
	"github.com/zeebo/xxh3"
)

// readSpec is a read request with its resolved path.
type readSpec struct {
	Path string
	*ReadRequest
}

// SlotError is one tensor that failed during a read.
type SlotError struct {
	Slot int
	Name string // e.g. "cache 3 tensor 1 (slot 7)"
	Err  error
}

// ReadError lists every tensor a read could not restore. It wraps each
// slot's error, so errors.Is(err, ErrCorrupt) and the like work.
type ReadError struct {
	Path  string
	Slots []SlotError
}

func (e *ReadError) Error() string {
	var b strings.Builder
	fmt.Fprintf(&b, "jobs: read %s: %d tensor(s) failed:", e.Path, len(e.Slots))
	for i, s := range e.Slots {
		if i == 8 {
			fmt.Fprintf(&b, " ... and %d more", len(e.Slots)-i)
			break
		}
		fmt.Fprintf(&b, " [%s: %v]", s.Name, s.Err)
	}
	return b.String()
}

func (e *ReadError) Unwrap() []error {
	out := make([]error, len(e.Slots))
	for i, s := range e.Slots {
		out[i] = s.Err
	}
	return out
}

// CheckDest makes every check that can be made before a destination is
// touched: slot count, each buffer's length, and (with expect) dtypes and
// shapes. Errors wrap ErrDestination or ErrMismatch.
func CheckDest(snap *layout.Snapshot, dest [][]byte, expect *layout.Header) error {
	slots := snap.Header.Slots()
	if len(dest) != len(slots) {
		return fmt.Errorf("%w: %s has %d tensors, got %d destination buffers", ErrDestination, snap.Path, len(slots), len(dest))
	}
	for i, t := range slots {
		if int64(len(dest[i])) != t.Bytes {
			return fmt.Errorf("%w: %s %s has %d bytes, its destination %d", ErrDestination, snap.Path, snap.Header.SlotName(i), t.Bytes, len(dest[i]))
		}
	}
	if expect != nil {
		want := expect.Slots()
		if len(want) != len(slots) {
			return fmt.Errorf("%w: %s has %d tensors, expected %d", ErrMismatch, snap.Path, len(slots), len(want))
		}
		for i, t := range slots {
			if t.DType != want[i].DType || !slices.Equal(t.Shape, want[i].Shape) {
				return fmt.Errorf("%w: %s %s is %s%v, expected %s%v", ErrMismatch, snap.Path, snap.Header.SlotName(i), t.DType, t.Shape, want[i].DType, want[i].Shape)
			}
		}
	}
	return nil
}

// Read restores the snapshot <cfg.Root>/<req.Namespace>/<req.Name> into
// req.Dest. It decodes and validates the file first (layout.Decode) and
// checks the destinations (CheckDest) before any byte of them is written; it
// never writes past a destination's length. A failure found later (a hash
// mismatch, a missing or wrong-sized block) is a *ReadError naming every
// tensor affected; the destinations' contents are then undefined. The
// destinations are not touched after Read returns. A name that is not one
// valid path element is layout.ErrBadName.
func Read(ctx context.Context, cfg *Config, req *ReadRequest) (*layout.Snapshot, Metrics, error) {
	path, err := cfg.snapshotPath(req.Ref)
	if err != nil {
		return nil, Metrics{}, fmt.Errorf("jobs: read %s: %w", req.Ref, err)
	}
	return read(ctx, cfg, &readSpec{Path: path, ReadRequest: req})
}

// read is Read of a resolved path (also migrate's, reading a legacy store).
func read(ctx context.Context, cfg *Config, spec *readSpec) (*layout.Snapshot, Metrics, error) {
	start := time.Now()
	var m Metrics
	fsys := cfg.fs()
	ns, _ := store.NamespaceOf(spec.Path, cfg.storeOptions())
	unlock, _, err := ns.LockIfExists(ctx, false)
	if err != nil {
		return nil, m, fmt.Errorf("jobs: read %s: %w", spec.Path, err)
	}
	defer unlock()
	if err := ns.Check(); err != nil {
		return nil, m, fmt.Errorf("%w: read %s: %w", ErrInvalidRequest, spec.Path, err)
	}
	f, err := fsys.Open(spec.Path)
	if err != nil {
		return nil, m, fmt.Errorf("jobs: read: %w", err)
	}
	defer f.Close()
	snap, err := layout.Decode(f, spec.Path)
	if err != nil {
		return nil, m, err
	}
	if err := CheckDest(snap, spec.Dest, spec.Expect); err != nil {
		return snap, m, err
	}
	slots := snap.Header.Slots()
	for _, t := range slots {
		m.LogicalBytes += t.Bytes
	}
	var read atomic.Int64
	var mu sync.Mutex
	var failures []SlotError
	fail := func(slot int, err error) {
		mu.Lock()
		failures = append(failures, SlotError{Slot: slot, Name: snap.Header.SlotName(slot), Err: err})
		mu.Unlock()
	}
	if snap.Layout == layout.Single {
		err = parallel(ctx, cfg, len(slots), 0, func(i int, _ []byte) error {
			if err := readTensor(ctx, f, snap, slots[i], spec.Dest[i], spec.Verify, &read); err != nil {
				if ctx.Err() != nil {
					return ctx.Err()
				}
				fail(i, err)
			}
			return nil
		})
	} else {
		type task struct{ slot, block int }
		var tasks []task
		offs := make([][]int64, len(slots))
		for i, t := range slots {
			offs[i] = make([]int64, len(t.Blocks))
			var o int64
			for b, ref := range t.Blocks {
				offs[i][b] = o
				o += ref.Bytes
				tasks = append(tasks, task{i, b})
			}
		}
		var bad sync.Map  // slot -> struct{}: skip the rest of a failed tensor
		var dirs sync.Map // directory -> error of checkDir, checked once per read
		err = parallel(ctx, cfg, len(tasks), 0, func(k int, _ []byte) error {
			tk := tasks[k]
			if _, skip := bad.Load(tk.slot); skip {
				return nil
			}
			ref := slots[tk.slot].Blocks[tk.block]
			dst := spec.Dest[tk.slot][offs[tk.slot][tk.block]:][:ref.Bytes:ref.Bytes]
			if err := readBlock(ns, snap, ref, dst, spec.Verify, &dirs); err != nil {
				if _, dup := bad.LoadOrStore(tk.slot, struct{}{}); !dup {
					fail(tk.slot, fmt.Errorf("block %d: %w", tk.block, err))
				}
				return nil
			}
			read.Add(ref.Bytes)
			return nil
		})
	}
	m.ReadBytes = read.Load()
	m.Elapsed = time.Since(start)
	if err != nil {
		return snap, m, err
	}
	if len(failures) > 0 {
		sort.Slice(failures, func(i, j int) bool { return failures[i].Slot < failures[j].Slot })
		return snap, m, &ReadError{Path: spec.Path, Slots: failures}
	}
	return snap, m, nil
}

// readTensor preads one single-file tensor straight into dst, chunk by
// chunk, hashing each chunk while it is hot in cache.
func readTensor(ctx context.Context, f vfs.File, snap *layout.Snapshot, t *layout.Tensor, dst []byte, verify bool, read *atomic.Int64) error {
	base := int64(snap.DataStart) + t.Off
	if snap.Legacy {
		// Bun.hash has no streaming form here: read whole, then hash.
		if err := layout.ReadFull(f, dst, base); err != nil {
			return err
		}
		read.Add(int64(len(dst)))
		if verify && bunhash.Hex(dst) != t.Hash {
			return fmt.Errorf("%w: Bun.hash %s, header says %s", ErrCorrupt, bunhash.Hex(dst), t.Hash)
		}
		return nil
	}
	hs := hasherPool.Get().(*xxh3.Hasher)
	defer hasherPool.Put(hs)
	hs.Reset()
	for o := 0; o < len(dst); {
		if o > 0 && ctx.Err() != nil {
			return ctx.Err()
		}
		n := min(readChunk, len(dst)-o)
		if err := layout.ReadFull(f, dst[o:o+n], base+int64(o)); err != nil {
			return err
		}
		read.Add(int64(n))
		if verify {
			hs.Write(dst[o : o+n])
		}
		o += n
	}
	if verify {
		if got := layout.TensorHash(hs.Sum64()); got != t.Hash {
			return fmt.Errorf("%w: xxh3 %s, header says %s", ErrCorrupt, got, t.Hash)
		}
	}
	return nil
}

// readBlock reads one block file into dst (exactly its bytes), checking its
// size first and, with verify, its SHA-256.
func readBlock(ns *store.Namespace, snap *layout.Snapshot, ref layout.BlockRef, dst []byte, verify bool, dirs *sync.Map) error {
	fsys, nsDir := ns.Store().FS(), ns.Dir()
	path := ns.SnapshotBlockPath(snap, ref.Hash)
	// Blocks are opened without following a symlink in their last element;
	// the directories between the namespace and the block (blocks/ and the
	// fan-out) must be real directories too, checked once per read.
	for d := filepath.Dir(path); d != nsDir; d = filepath.Dir(d) {
		v, ok := dirs.Load(d)
		if !ok {
			var derr error
			if err := ns.Store().CheckRealDir(d); err != nil {
				derr = fmt.Errorf("%w: %w", ErrInvalidRequest, err)
			}
			v, _ = dirs.LoadOrStore(d, derr)
		}
		if v != nil {
			if err, _ := v.(error); err != nil {
				return err
			}
		}
	}
	bf, err := fsys.Open(path)
	if err != nil {
		if vfs.IsNotExist(err) {
			return fmt.Errorf("%w: %s", ErrMissingBlock, path)
		}
		return err
	}
	defer bf.Close()
	st, err := bf.Stat()
	if err != nil {
		return err
	}
	if !st.Mode().IsRegular() || st.Size() != ref.Bytes {
		return fmt.Errorf("%w: %s has %d bytes, the manifest says %d", ErrBlockSize, path, st.Size(), ref.Bytes)
	}
	// Read and hash in pieces that stay in L2 cache, so verification reads
	// what pread just wrote from cache rather than from memory.
	var h hash.Hash
	if verify {
		h = sha256Pool.Get().(hash.Hash)
		defer sha256Pool.Put(h)
		h.Reset()
	}
	for o := 0; o < len(dst); o += blockReadPiece {
		piece := dst[o:min(o+blockReadPiece, len(dst))]
		if err := layout.ReadFull(bf, piece, int64(o)); err != nil {
			if errors.Is(err, layout.ErrTruncated) {
				return fmt.Errorf("%w: %s: %v", ErrBlockSize, path, err)
			}
			return err
		}
		if verify {
			h.Write(piece)
		}
	}
	if verify {
		var sum [sha256.Size]byte
		if got := hex.EncodeToString(h.Sum(sum[:0])); got != ref.Hash {
			return fmt.Errorf("%w: %s has SHA-256 %s", ErrCorrupt, path, got)
		}
	}
	return nil
}

// blockReadPiece is the unit, in bytes, in which a block is read and hashed.
const blockReadPiece = 256 << 10

var sha256Pool = sync.Pool{New: func() any { return sha256.New() }}

// readChunk is the unit, in bytes, in which a single-file read preads and
// hashes a tensor (measured: 256 KiB to 4 MiB perform alike here).
const readChunk = 1 << 20
