package bench

import (
	"bytes"
	"fmt"
	"os"
	"testing"
	"unsafe"

	"github.com/kvpersist/kvpersist/engine"
	"github.com/kvpersist/kvpersist/engine/layout"
	"github.com/zeebo/xxh3"
	"golang.org/x/sys/unix"
)

// partialTokens is the cache size of BenchmarkRestorePartlyCached
// ($KVPERSIST_BENCH_PARTIAL_TOKENS, default 8192: about 1 GiB; 256 makes a
// 32 MiB file for a quick check that the row runs).
var partialTokens = envInt("KVPERSIST_BENCH_PARTIAL_TOKENS", 8192)

// partialChunkBytes is the unit the row evicts, in bytes: the kernel
// drops a large folio (up to 2 MiB) only whole, so ranges of this size on
// its boundaries leave the page cache exactly.
const partialChunkBytes = 2 << 20

// partialEvictEvery: the row evicts one chunk in every partialEvictEvery
// (8.3% of the file's pages), spread over the whole file as memory
// pressure leaves a file.
const partialEvictEvery = 12

// partialProbeBytes is the unit in bytes (aligned in the file) in which
// the limit asks the page cache which way to read: the engine's
// (jobs' cacheProbeBytes).
const partialProbeBytes = 256 << 10

// partialDepth is the limit's reads in flight: the engine's default depth
// (jobs.DefaultReadDepth), which the O_DIRECT ranges need on a disk that
// rewards depth; the cached ranges are bound by the cores either way.
const partialDepth = 16

// BenchmarkRestorePartlyCached: a warm verified single-file restore of a
// snapshot whose file is in the page cache except one 2 MiB range in
// every 12 (missing/file: the fraction of its pages missing when the
// restore starts, from cachestat), as memory pressure leaves a file,
// into the warm rows' buffers. Before each side runs, the file is read
// whole (buffered: every page cached) and the same ranges are evicted
// again. The limit (x-limit, target >= 0.85) reads the same extents, 16
// tensors in flight, each range the faster way: a buffered pread where
// cachestat says every page of a 256 KiB part of the file is cached,
// else an O_DIRECT pread, in requests of up to 1 MiB of one kind; then
// xxh3.Hash of each tensor on the goroutine that read it. alldirect is the same reads all with O_DIRECT (what a reader
// that decides per file does with a file not wholly cached; x-alldirect).
// direct/read is the part of the engine's bytes read with O_DIRECT
// (Metrics.DirectReadBytes; about missing/file when it decides per
// range). Size: $KVPERSIST_BENCH_PARTIAL_TOKENS.
func BenchmarkRestorePartlyCached(b *testing.B) {
	b.Run(fmt.Sprintf("single/T=%d", partialTokens), func(b *testing.B) {
		benchRestorePartlyCached(b, getWorkload(b, benchModel, partialTokens))
	})
}

func benchRestorePartlyCached(b *testing.B, w *workload) {
	s := getRestoreStore(b, w, layout.Single)
	e := newEngine(b, s.root, false)
	defer closeEngine(b, e)
	snap, path := snapshotAt(b, e, s.ref)
	pl, err := openPartialLimit(path, snap, w.dest)
	if err != nil {
		b.Fatal(err)
	}
	defer pl.close()
	if pl.dio == nil {
		b.Skipf("%s: O_DIRECT refused: the row compares page-cache and O_DIRECT reads", path)
	}
	req := &engine.ReadRequest{Ref: s.ref, Dest: w.dest, Expect: snap.Header}
	var missing float64 // the part of the file's pages missing, at the last prep
	prep := func(int) {
		m, err := pl.prepare()
		if err != nil {
			b.Fatal(err)
		}
		missing = m
	}
	// The engine, the limit and alldirect each read the saved bytes.
	prep(0)
	warmRead(b, e, w, req)
	for _, all := range []bool{false, true} {
		clear(w.destMem.mem)
		prep(0)
		if _, err := pl.read(all); err != nil {
			b.Fatal(err)
		}
		for i := range w.dest {
			if !bytes.Equal(w.dest[i], w.slots[i]) {
				b.Fatalf("limit (all direct: %v): slot %d differs from the saved bytes", all, i)
			}
		}
	}
	var direct, read, limitDirect int64
	b.SetBytes(int64(w.logical))
	b.ReportAllocs()
	m := alternate(b, steps{
		prepOurs: prep,
		ours: func(int) {
			res := do(b, e, req)
			direct, read = res.Metrics.DirectReadBytes, res.Metrics.ReadBytes
		},
		prepLimit: prep,
		limit: func(int) {
			d, err := pl.read(false)
			if err != nil {
				b.Fatal(err)
			}
			limitDirect = d
		},
		extra: []side{{name: "alldirect", prep: prep, run: func(int) {
			if _, err := pl.read(true); err != nil {
				b.Fatal(err)
			}
		}}},
	})
	if missing == 0 {
		b.Fatal("no page of the file was missing: the eviction did not work")
	}
	m.report(b, int64(w.logical))
	m.reportExtra(b, int64(w.logical))
	b.ReportMetric(missing, "missing/file")
	b.ReportMetric(float64(direct)/float64(max(read, 1)), "direct/read")
	b.ReportMetric(float64(limitDirect)/float64(w.logical), "limit-direct/read")
}

// snapshotAt returns the snapshot ref names in e and its file's path.
func snapshotAt(b *testing.B, e *engine.Engine, ref engine.Ref) (*layout.Snapshot, string) {
	b.Helper()
	snap, err := e.Stat(ref)
	if err != nil {
		b.Fatal(err)
	}
	path, err := e.Path(ref)
	if err != nil {
		b.Fatal(err)
	}
	return snap, path
}

// partialLimit is the limit of BenchmarkRestorePartlyCached: the snapshot
// file opened buffered and with O_DIRECT, the tensors' extents, and an
// aligned staging buffer per goroutine for requests that are not aligned.
type partialLimit struct {
	path     string
	buf, dio *os.File // dio nil: O_DIRECT refused
	size     int64
	dest     [][]byte
	offs     []int64
	hashes   []string // layout.TensorHash of each slot
	staging  *arena
}

func openPartialLimit(path string, snap *layout.Snapshot, dest [][]byte) (*partialLimit, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	fi, err := f.Stat()
	if err != nil {
		f.Close()
		return nil, err
	}
	pl := &partialLimit{path: path, buf: f, size: fi.Size(), dest: dest}
	for _, t := range snap.Header.Slots() {
		pl.offs = append(pl.offs, int64(snap.DataStart)+t.Off)
		pl.hashes = append(pl.hashes, t.Hash)
	}
	if d, err := os.OpenFile(path, os.O_RDONLY|unix.O_DIRECT, 0); err == nil {
		pl.dio = d
	}
	if pl.staging, err = newArena(partialDepth * (directRequestBytes + 2*pageBytes)); err != nil {
		pl.close()
		return nil, err
	}
	return pl, nil
}

func (pl *partialLimit) close() {
	pl.buf.Close()
	if pl.dio != nil {
		pl.dio.Close()
	}
	if pl.staging != nil {
		_ = pl.staging.free()
	}
}

// prepare reads the file whole, buffered (every page cached), then evicts
// one partialChunkBytes range in every partialEvictEvery from the page
// cache (fdatasync, posix_fadvise DONTNEED), and returns the part of the
// file's pages then missing (cachestat).
func (pl *partialLimit) prepare() (float64, error) {
	fd := int(pl.buf.Fd())
	chunk := make([]byte, 1<<20)
	for off := int64(0); off < pl.size; off += int64(len(chunk)) {
		if err := preadFull(fd, chunk[:min(int64(len(chunk)), pl.size-off)], off); err != nil {
			return 0, fmt.Errorf("warm %s: %w", pl.path, err)
		}
	}
	if err := unix.Fdatasync(fd); err != nil {
		return 0, err
	}
	for k := int64(0); k*partialChunkBytes < pl.size; k++ {
		if k%partialEvictEvery == partialEvictEvery/2 {
			if err := unix.Fadvise(fd, k*partialChunkBytes, partialChunkBytes, unix.FADV_DONTNEED); err != nil {
				return 0, fmt.Errorf("evict %s: %w", pl.path, err)
			}
		}
	}
	var st unix.Cachestat_t
	if err := unix.Cachestat(uint(fd), &unix.CachestatRange{Off: 0, Len: uint64(pl.size)}, &st, 0); err != nil {
		return 0, fmt.Errorf("cachestat %s: %w", pl.path, err)
	}
	pages := (pl.size + pageBytes - 1) / pageBytes
	return float64(pages-int64(st.Cache)) / float64(pages), nil
}

// read reads every tensor into its destination, partialDepth goroutines
// each taking the next tensor, in requests of up to 1 MiB: the parts
// (partialProbeBytes) all of whose pages are cached (cachestat) with
// buffered preads, the others with O_DIRECT (all of them, in 1 MiB
// requests, when allDirect); each tensor is then hashed by
// xxh3.Hash on the goroutine that read it and checked against the header.
// It returns the bytes read with O_DIRECT.
func (pl *partialLimit) read(allDirect bool) (int64, error) {
	bfd, dfd := int(pl.buf.Fd()), int(pl.dio.Fd())
	stage := make([][]byte, partialDepth)
	pl.staging.off = 0
	for g := range stage {
		stage[g] = pl.staging.alloc(directRequestBytes + 2*pageBytes)
	}
	var direct [partialDepth]int64
	next := make(chan int, partialDepth)
	for g := range partialDepth {
		next <- g
	}
	err := parallelForK(len(pl.dest), partialDepth, func(i int) error {
		g := <-next // this goroutine's staging buffer and counter
		defer func() { next <- g }()
		dst, off := pl.dest[i], pl.offs[i]
		cached := func(at, end int64) (bool, error) {
			var st unix.Cachestat_t
			err := unix.Cachestat(uint(bfd), &unix.CachestatRange{Off: uint64(at), Len: uint64(end - at)}, &st, 0)
			return int64(st.Cache) >= (end+pageBytes-1)/pageBytes-at/pageBytes, err
		}
		partEnd := func(a, end int64) int64 { return min(end, a/partialProbeBytes*partialProbeBytes+partialProbeBytes) }
		// Requests of up to 1 MiB, each of one kind: cut where a part
		// (partialProbeBytes of the file, aligned) is cached and the one
		// before it is not, or the other way round.
		end := off + int64(len(dst))
		for at := off; at < end; {
			hi, buffered := min(end, at+directRequestBytes), false
			if !allDirect {
				var err error
				hi = partEnd(at, end)
				if buffered, err = cached(at, hi); err != nil {
					return err
				}
				for hi < end && hi-at < directRequestBytes {
					c, err := cached(hi, partEnd(hi, end))
					if err != nil {
						return err
					}
					if c != buffered {
						break
					}
					hi = min(partEnd(hi, end), at+directRequestBytes)
				}
			}
			p := dst[at-off : hi-off]
			if buffered {
				if err := preadFull(bfd, p, at); err != nil {
					return err
				}
			} else {
				if err := directInto(dfd, p, at, stage[g]); err != nil {
					return fmt.Errorf("O_DIRECT pread of %d bytes at %d: %w", len(p), at, err)
				}
				direct[g] += int64(len(p))
			}
			at = hi
		}
		if got := layout.TensorHash(xxh3.Hash(dst)); got != pl.hashes[i] {
			return fmt.Errorf("partial limit: slot %d hashes to %s, the header says %s", i, got, pl.hashes[i])
		}
		return nil
	})
	var n int64
	for _, d := range direct {
		n += d
	}
	return n, err
}

// directInto reads p from the O_DIRECT descriptor fd at off: straight into
// p when its address, offset and length are 4 KiB aligned (the engine's
// single files align tensors so), else the aligned range covering it into
// stage (page-aligned, one request plus two pages) and copied.
func directInto(fd int, p []byte, off int64, stage []byte) error {
	addr := uintptr(unsafe.Pointer(unsafe.SliceData(p)))
	if addr%pageBytes == 0 && off%pageBytes == 0 && len(p)%pageBytes == 0 {
		return preadFull(fd, p, off)
	}
	start := off &^ (pageBytes - 1)
	end := (off + int64(len(p)) + pageBytes - 1) &^ (pageBytes - 1)
	buf := stage[:end-start]
	n, err := unix.Pread(fd, buf, start)
	if err != nil {
		return err
	}
	if int64(n) < off+int64(len(p))-start {
		return fmt.Errorf("short read: %d bytes at %d", n, start)
	}
	copy(p, buf[off-start:])
	return nil
}
