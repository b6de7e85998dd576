package bench

import (
	"bytes"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"
	"unsafe"

	"github.com/kvpersist/kvpersist/engine"
	"github.com/kvpersist/kvpersist/engine/layout"
	"github.com/kvpersist/kvpersist/engine/readio"
	"github.com/kvpersist/kvpersist/internal/testutil"
	"golang.org/x/sys/unix"
)

// directDepths are the queue depths at which the cold limit reads the same
// bytes with O_DIRECT; the limit is the fastest of them.
var directDepths = []int{1, 4, 16, 32}

// directRequestBytes is the size in bytes of one request of the cold
// limit (and of the engine: readio.ReadChunkBytes).
const directRequestBytes = readio.ReadChunkBytes

// extent is a run of bytes of a file: the unit the limits read.
type extent struct {
	path     string
	off, len int64
}

// snapshotFiles returns the files a snapshot's restore reads and the
// extents of its tensor bytes: for a single file, the tensors' extents of
// the file; for a manifest, every block file it names (whole, once per
// reference, as the engine reads them), and the manifest itself.
func snapshotFiles(snap *layout.Snapshot, path string) (files []string, exts []extent) {
	files = []string{path}
	if snap.Layout == layout.Single {
		for _, t := range snap.Header.Slots() {
			if t.Bytes > 0 {
				exts = append(exts, extent{path, int64(snap.DataStart) + t.Off, t.Bytes})
			}
		}
		return files, exts
	}
	seen := map[string]bool{}
	for _, t := range snap.Header.Slots() {
		for _, ref := range t.Blocks {
			p := testutil.BlockPath(filepath.Dir(path), ref.Hash)
			exts = append(exts, extent{p, 0, ref.Bytes})
			if !seen[p] {
				seen[p] = true
				files = append(files, p)
			}
		}
	}
	return files, exts
}

// evict drops files from the page cache: fdatasync (a dirty page cannot
// be dropped), then posix_fadvise(POSIX_FADV_DONTNEED) over the whole file.
// Unlike writing to /proc/sys/vm/drop_caches (possible here as root), it
// leaves the rest of a machine shared with other work alone.
func evict(files []string) error {
	return parallelFor(len(files), func(i int) error {
		fd, err := unix.Open(files[i], unix.O_RDONLY|unix.O_CLOEXEC, 0)
		if err != nil {
			return fmt.Errorf("evict %s: %w", files[i], err)
		}
		defer unix.Close(fd)
		if err := unix.Fdatasync(fd); err != nil {
			return fmt.Errorf("evict %s: fdatasync: %w", files[i], err)
		}
		if err := unix.Fadvise(fd, 0, 0, unix.FADV_DONTNEED); err != nil {
			return fmt.Errorf("evict %s: fadvise: %w", files[i], err)
		}
		return nil
	})
}

// residentPages counts the pages of files in the page cache (mincore of a
// mapping): the check that evict worked.
func residentPages(files []string) (int, error) {
	n := 0
	for _, p := range files {
		f, err := os.Open(p)
		if err != nil {
			return 0, err
		}
		st, err := f.Stat()
		if err != nil || st.Size() == 0 {
			f.Close()
			if err != nil {
				return 0, err
			}
			continue
		}
		m, err := unix.Mmap(int(f.Fd()), 0, int(st.Size()), unix.PROT_READ, unix.MAP_SHARED)
		f.Close()
		if err != nil {
			return 0, err
		}
		r, err := residentIn(m)
		unix.Munmap(m)
		if err != nil {
			return 0, fmt.Errorf("%s: %w", p, err)
		}
		n += r
	}
	return n, nil
}

// residentIn counts the resident pages of m, a page-aligned mapping
// (mincore).
func residentIn(m []byte) (int, error) {
	vec := make([]byte, (len(m)+pageBytes-1)/pageBytes)
	_, _, errno := unix.Syscall(unix.SYS_MINCORE, uintptr(unsafe.Pointer(&m[0])), uintptr(len(m)), uintptr(unsafe.Pointer(&vec[0])))
	if errno != 0 {
		return 0, fmt.Errorf("mincore: %w", errno)
	}
	n := 0
	for _, v := range vec {
		n += int(v & 1)
	}
	return n, nil
}

// directLimit reads every extent with O_DIRECT, depth requests of
// directRequestBytes in flight (depth goroutines taking the next request),
// into per-goroutine aligned buffers (mmap'd: not Go heap); each file is
// opened once. It returns the bytes read.
func directLimit(exts []extent, depth int, bufs [][]byte) (int64, error) {
	type req struct {
		fd       int
		off, len int64
	}
	fds := map[string]int{}
	defer func() {
		for _, fd := range fds {
			unix.Close(fd)
		}
	}()
	var reqs []req
	for _, e := range exts {
		fd, ok := fds[e.path]
		if !ok {
			var err error
			if fd, err = unix.Open(e.path, unix.O_RDONLY|unix.O_DIRECT|unix.O_CLOEXEC, 0); err != nil {
				return 0, fmt.Errorf("O_DIRECT open %s: %w", e.path, err)
			}
			fds[e.path] = fd
		}
		for o := int64(0); o < e.len; o += directRequestBytes {
			reqs = append(reqs, req{fd, e.off + o, min(directRequestBytes, e.len-o)})
		}
	}
	var next, total atomic.Int64
	var wg sync.WaitGroup
	var mu sync.Mutex
	var first error
	for g := range depth {
		wg.Go(func() {
			buf := bufs[g]
			for {
				i := int(next.Add(1) - 1)
				if i >= len(reqs) {
					return
				}
				r := reqs[i]
				// Whole sectors: round the length up (the tail of a file
				// reads short at its end).
				n := (r.len + 4095) &^ 4095
				got, err := unix.Pread(r.fd, buf[:n], r.off)
				if err == nil && int64(got) < r.len {
					err = io.ErrUnexpectedEOF
				}
				if err != nil {
					mu.Lock()
					first = cmpOr(first, fmt.Errorf("O_DIRECT pread of %d bytes at %d: %w", n, r.off, err))
					mu.Unlock()
					return
				}
				total.Add(r.len)
			}
		})
	}
	wg.Wait()
	return total.Load(), first
}

// cpuTime is the CPU time (user + system) the process has used so far
// (getrusage RUSAGE_SELF): every goroutine's, the runtime's included.
func cpuTime() time.Duration {
	var ru unix.Rusage
	if err := unix.Getrusage(unix.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

func cmpOr(a, b error) error {
	if a != nil {
		return a
	}
	return b
}

// coldState is what the cold rows keep between iterations.
type coldState struct {
	files []string
	exts  []extent
	bufs  *arena // directDepths' largest depth x one request, aligned
	perQD map[int]time.Duration
	// perQDCPU is the process's CPU time (user + system) during the timed
	// runs of each depth: what reading the bytes with O_DIRECT costs the
	// CPU (pinning pages, building and completing requests).
	perQDCPU map[int]time.Duration
	logical  int64
}

func newColdState(b *testing.B, snap *layout.Snapshot, path string, logical int64) *coldState {
	files, exts := snapshotFiles(snap, path)
	return coldStateOf(b, files, exts, logical)
}

// coldStateOf is the cold rows' state for reading exts (logical bytes in
// all) of files.
func coldStateOf(b *testing.B, files []string, exts []extent, logical int64) *coldState {
	var n int64
	for _, e := range exts {
		n += e.len
	}
	if n != logical {
		b.Fatalf("the limit's extents hold %d bytes, the snapshot %d", n, logical)
	}
	deepest := slices.Max(directDepths)
	mem, err := newArena(deepest * (directRequestBytes + pageBytes))
	if err != nil {
		b.Fatal(err)
	}
	return &coldState{files: files, exts: exts, bufs: mem, perQD: map[int]time.Duration{}, perQDCPU: map[int]time.Duration{}, logical: logical}
}

// best is the limit over the timed runs: the total time of the queue
// depth whose runs took least in all (the depth that maximises throughput
// on this disk over the benchmark), and that depth. Taking instead the
// fastest depth of each iteration (minLimit) compares one run of the
// engine against the best of four noisy runs, which favours the limit.
func (c *coldState) best() (time.Duration, int) {
	var best time.Duration
	qd := 0
	for _, d := range directDepths {
		if t := c.perQD[d]; t > 0 && (best == 0 || t < best) {
			best, qd = t, d
		}
	}
	return best, qd
}

// limit runs the O_DIRECT limit at every depth and returns the fastest
// run's time. Timed runs (count) add to the per-depth totals.
func (c *coldState) limit(b *testing.B, count bool) time.Duration {
	bufs := make([][]byte, slices.Max(directDepths))
	c.bufs.off = 0
	for i := range bufs {
		bufs[i] = c.bufs.alloc(directRequestBytes + pageBytes)
	}
	var best time.Duration
	for _, qd := range directDepths {
		c0 := cpuTime()
		t0 := time.Now()
		n, err := directLimit(c.exts, qd, bufs)
		d := time.Since(t0)
		cpu := cpuTime() - c0
		if err != nil {
			b.Fatal(err)
		}
		if n != c.logical {
			b.Fatalf("O_DIRECT limit read %d bytes, want %d", n, c.logical)
		}
		if count {
			c.perQD[qd] += d
			c.perQDCPU[qd] += cpu
		}
		if best == 0 || d < best {
			best = d
		}
	}
	return best
}

func (c *coldState) evict(b *testing.B) {
	if err := evict(c.files); err != nil {
		b.Fatal(err)
	}
}

// report adds per-depth throughputs of the limit (qdN-MB/s).
func (c *coldState) report(b *testing.B, n int) {
	for _, qd := range directDepths {
		if d := c.perQD[qd]; d > 0 {
			b.ReportMetric(float64(c.logical)*float64(n)/d.Seconds()/1e6, fmt.Sprintf("qd%d-MB/s", qd))
		}
	}
	_ = c.bufs.free()
}

// BenchmarkRestoreCold: the restore rows with the snapshot's files evicted
// from the page cache before each iteration (fdatasync + FADV_DONTNEED,
// see evict), verified, into the same buffers as the warm rows; the limit
// is O_DIRECT reads of the same bytes of the same files (the tensor extents
// of the single file; every block file of the manifest), 1 MiB requests, at
// queue depths 1, 4, 16 and 32 (each reported as qdN-MB/s), the depth with
// the least total time taken (best-qd; x-min-limit is against the fastest
// depth of each iteration instead). Targets: single file >= 0.8, blocks >=
// 0.7. Blocks also measure SHA-256 of the same bytes on every core in the
// same run (sha256-MB/s): a verified restore of a formatVersion 5 manifest
// (checked by SHA-256) cannot beat the slower of that and the disk, and
// x-bound is against it. Nor can it beat the CPU time of that hashing plus
// that of the O_DIRECT reads at the best depth (process CPU time,
// getrusage), spread over every core (cpu-bound-MB/s, bound-cpu-ms/op):
// x-cpu-bound is against the slowest of the three. The manifests the
// engine saves (formatVersion 8) are verified by each block's xxh3-64
// instead: xxh3-MB/s, x-bound-xxh3, cpu-bound-xxh3-MB/s, x-cpu-bound-xxh3
// and bound-xxh3-cpu-ms/op are the same bounds with xxh3.Hash of the same
// bytes, the bounds of the path this row runs. cpu-ms/op is the process's
// CPU time during each restore (the heap sampler's few reads included).
func BenchmarkRestoreCold(b *testing.B) {
	b.Run("single", func(b *testing.B) {
		forTokens(b, func(b *testing.B, w *workload) { benchRestoreCold(b, w, layout.Single, 0) })
	})
	b.Run("blocks", func(b *testing.B) {
		forTokens(b, func(b *testing.B, w *workload) { benchRestoreCold(b, w, layout.Blocks, 0) })
	})
}

// BenchmarkReadDepth: the cold single-file and block restores of 1 GiB at
// engine ReadDepths 1 to 32, each beside the same O_DIRECT limit: the
// measurement behind readio.DefaultReadDepth. Not part of make bench.
func BenchmarkReadDepth(b *testing.B) {
	w := getWorkload(b, benchModel, benchTokens[len(benchTokens)-1])
	for _, lay := range []layout.Layout{layout.Single, layout.Blocks} {
		for _, depth := range []int{1, 2, 4, 8, 16, 32} {
			b.Run(fmt.Sprintf("%s/depth=%d", lay, depth), func(b *testing.B) { benchRestoreCold(b, w, lay, depth) })
		}
	}
}

// benchPreads (KVPERSIST_BENCH_PREADS=1) runs the cold rows with
// engine.Config.NoAsyncReads: O_DIRECT preads, as before the asynchronous
// reads, for a comparison in one binary.
var benchPreads = os.Getenv("KVPERSIST_BENCH_PREADS") == "1"

func benchRestoreCold(b *testing.B, w *workload, lay layout.Layout, depth int) {
	s := getRestoreStore(b, w, lay)
	e, err := engine.New(engine.Config{Root: s.root, Logger: quietLogger, ReadDepth: depth, NoAsyncReads: benchPreads})
	if err != nil {
		b.Fatal(err)
	}
	defer closeEngine(b, e)
	snap, path := snapshotAt(b, e, s.ref)
	c := newColdState(b, snap, path, int64(w.logical))
	req := &engine.ReadRequest{Ref: s.ref, Dest: w.dest, Expect: snap.Header}
	c.evict(b)
	if n, err := residentPages(c.files); err != nil || n > len(c.files) {
		b.Fatalf("after evicting: %d pages of the snapshot still cached (%v)", n, err)
	}
	warmRead(b, e, w, req) // checks the bytes
	var direct, async, read int64
	var minLimit time.Duration // the fastest depth of each iteration, summed
	var shaTime time.Duration  // blocks: SHA-256 of the same bytes on every core
	var shaCPU time.Duration   // blocks: the CPU time of that hashing
	var xxTime time.Duration   // blocks: xxh3-64 of the same bytes on every core
	var xxCPU time.Duration    // blocks: the CPU time of that hashing
	var oursCPU time.Duration  // the process's CPU time during the restores
	var offs, lens []int
	var sums [][32]byte
	var xsums []uint64
	if lay == layout.Blocks {
		offs, lens = blockCuts(snap.Header)
		sums = make([][32]byte, len(offs))
		checkSums(b, snap.Header, w.contig, offs, lens, sums)
		xsums = make([]uint64, len(offs))
		checkXXH3Sums(b, snap.Header, w.contig, offs, lens, xsums)
	}
	b.SetBytes(int64(w.logical))
	b.ReportAllocs()
	m := alternate(b, steps{
		prepOurs: func(int) { c.evict(b) },
		ours: func(i int) {
			c0 := cpuTime()
			res := do(b, e, req)
			if i >= 0 {
				oursCPU += cpuTime() - c0
			}
			direct, async, read = res.Metrics.DirectReadBytes, res.Metrics.AsyncReadBytes, res.Metrics.ReadBytes
		},
		// One run per depth; no eviction needed: O_DIRECT bypasses the
		// page cache. Blocks: then the hashing bound.
		limit: func(i int) {
			if d := c.limit(b, i >= 0); i >= 0 {
				minLimit += d
			}
			if lay == layout.Blocks {
				c0, t0 := cpuTime(), time.Now()
				shaLimit(w.contig, offs, lens, sums)
				if i >= 0 {
					shaTime += time.Since(t0)
					shaCPU += cpuTime() - c0
				}
				c0, t0 = cpuTime(), time.Now()
				xxh3Limit(w.contig, offs, lens, xsums)
				if i >= 0 {
					xxTime += time.Since(t0)
					xxCPU += cpuTime() - c0
				}
			}
		},
	})
	best, qd := c.best()
	// m.limit timed the depths and the hashing together: the limit is the
	// best depth's total alone.
	m.limit = best
	b.StopTimer()
	for i := range w.dest {
		if !bytes.Equal(w.dest[i], w.slots[i]) {
			b.Fatalf("restored slot %d differs from the saved bytes", i)
		}
	}
	b.StartTimer()
	m.report(b, int64(w.logical))
	c.report(b, m.n)
	b.ReportMetric(float64(qd), "best-qd")
	b.ReportMetric(float64(minLimit)/float64(m.ours), "x-min-limit")
	b.ReportMetric(float64(direct)/float64(max(read, 1)), "direct/read")
	b.ReportMetric(float64(async)/float64(max(read, 1)), "async/read")
	b.ReportMetric(float64(oursCPU.Milliseconds())/float64(m.n), "cpu-ms/op")
	if shaTime > 0 {
		// A formatVersion 5 manifest's restore (SHA-256 of each block).
		h := hashBounds{w.logical, m.n, best, m.ours, c.perQDCPU[qd]}
		h.report(b, shaTime, shaCPU, "sha256-MB/s", "x-bound", "cpu-bound-MB/s", "x-cpu-bound", "bound-cpu-ms/op")
		// A formatVersion 8 manifest's, the one this row runs (xxh3-64
		// of each block).
		h.report(b, xxTime, xxCPU, "xxh3-MB/s", "x-bound-xxh3", "cpu-bound-xxh3-MB/s", "x-cpu-bound-xxh3", "bound-xxh3-cpu-ms/op")
	}
}

// hashBounds are the figures of a cold block restore row its hashing
// bounds are computed from: logical bytes per restore, restores, the
// O_DIRECT limit's time at its best depth (all runs), the restores' time
// and the CPU time of the limit's reads at that depth.
type hashBounds struct {
	logical    int
	n          int
	best, ours time.Duration
	directCPU  time.Duration
}

// report publishes the bounds of a verified restore whose hashing of the
// same bytes on every core took hashTime (wall) and hashCPU (CPU), under
// the given metric names. The restore cannot beat the slower of reading at
// the best depth and that hashing (rate: its MB/s; xBound: against the
// slower); nor the CPU time of both (the O_DIRECT reads at the best depth
// cost the CPU too: pinning pages, completing requests), spread over every
// core (cpuRate, cpuMs per restore; xCPU: against the slowest of the
// three).
func (h hashBounds) report(b *testing.B, hashTime, hashCPU time.Duration, rate, xBound, cpuRate, xCPU, cpuMs string) {
	bytes := float64(h.logical) * float64(h.n)
	b.ReportMetric(bytes/hashTime.Seconds()/1e6, rate)
	b.ReportMetric(float64(max(h.best, hashTime))/float64(h.ours), xBound)
	cpuBound := (hashCPU + h.directCPU) / time.Duration(runtime.GOMAXPROCS(0))
	b.ReportMetric(bytes/cpuBound.Seconds()/1e6, cpuRate)
	b.ReportMetric(float64(max(h.best, hashTime, cpuBound))/float64(h.ours), xCPU)
	b.ReportMetric(float64((hashCPU+h.directCPU).Milliseconds())/float64(h.n), cpuMs)
}
