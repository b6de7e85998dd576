package bench

import (
	"bytes"
	"context"
	"encoding/hex"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"runtime"
	"runtime/metrics"
	"runtime/pprof"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/kvpersist/kvpersist/engine"
	"github.com/kvpersist/kvpersist/engine/gather"
	"github.com/kvpersist/kvpersist/engine/layout"
	"github.com/kvpersist/kvpersist/internal/kvgen"
	"github.com/kvpersist/kvpersist/internal/testutil"
	"github.com/minio/sha256-simd"
	"github.com/zeebo/xxh3"
	"go.uber.org/goleak"
	"golang.org/x/sys/unix"
)

// tmpfsMagic is the f_type statfs(2) reports for tmpfs (TMPFS_MAGIC).
const tmpfsMagic = 0x01021994

// growTokens is how many tokens the "grown" save adds: one mlx-lm step.
const growTokens = kvgen.Step

// benchRoot is the directory every benchmark and test of this package works
// in: a fresh subdirectory of diskDir(), removed by TestMain.
var benchRoot string

func TestMain(m *testing.M) {
	leaks := goleak.IgnoreCurrent() // ants' default pool, started at import
	flag.Parse()
	base, err := diskDir()
	if err != nil {
		fmt.Fprintln(os.Stderr, "bench:", err)
		os.Exit(2)
	}
	benchRoot, err = os.MkdirTemp(base, "kvpersist-bench-")
	if err != nil {
		fmt.Fprintln(os.Stderr, "bench:", err)
		os.Exit(2)
	}
	if f := flag.Lookup("test.bench"); f != nil && f.Value.String() != "" {
		// A configuration line of the benchmark output (benchstat keeps it;
		// the same in every run, so it does not split benchstat's tables).
		fmt.Printf("kvpersist-bench-dir: %s (%s)\n", base, fsName(base))
	}
	code := m.Run()
	freeWorkloads()
	if collectTpl.v != nil {
		_ = collectTpl.v.mem.free()
	}
	if evictTpl.v != nil {
		_ = evictTpl.v.mem.free()
	}
	if err := os.RemoveAll(benchRoot); err != nil {
		fmt.Fprintln(os.Stderr, "bench: cleanup:", err)
		code = max(code, 1)
	}
	if code == 0 {
		// zmq4's PUB socket (Config.Events) never stops its writer.
		if err := goleak.Find(leaks, goleak.IgnoreAnyFunction("github.com/go-zeromq/zmq4.(*pubMWriter).run")); err != nil {
			fmt.Fprintln(os.Stderr, "bench: goroutine leak:", err)
			code = 1
		}
	}
	os.Exit(code)
}

// isTmpfs reports whether dir lives on tmpfs.
func isTmpfs(dir string) (bool, error) {
	var st unix.Statfs_t
	if err := unix.Statfs(dir, &st); err != nil {
		return false, fmt.Errorf("statfs %s: %w", dir, err)
	}
	return st.Type == tmpfsMagic, nil
}

// fsName names the file system holding dir (by its statfs magic).
func fsName(dir string) string {
	var st unix.Statfs_t
	if err := unix.Statfs(dir, &st); err != nil {
		return "unknown: " + err.Error()
	}
	switch uint64(st.Type) {
	case 0xEF53:
		return "ext2/3/4"
	case 0x58465342:
		return "xfs"
	case 0x9123683E:
		return "btrfs"
	case 0x2FC12FC1:
		return "zfs"
	case tmpfsMagic:
		return "tmpfs"
	case 0x794C7630:
		return "overlayfs"
	}
	return fmt.Sprintf("statfs magic %#x", st.Type)
}

// diskDir picks the directory to benchmark in: $KVPERSIST_BENCH_DIR (created
// if missing; refused if tmpfs), else the first of os.TempDir() and the
// package directory that is not tmpfs.
func diskDir() (string, error) {
	if d := os.Getenv("KVPERSIST_BENCH_DIR"); d != "" {
		if err := os.MkdirAll(d, 0o750); err != nil {
			return "", err
		}
		tmp, err := isTmpfs(d)
		if err != nil {
			return "", err
		}
		if tmp {
			return "", fmt.Errorf("KVPERSIST_BENCH_DIR=%s is tmpfs: the suite measures a real disk", d)
		}
		return d, nil
	}
	wd, err := os.Getwd()
	if err != nil {
		return "", err
	}
	for _, d := range []string{os.TempDir(), wd} {
		if tmp, err := isTmpfs(d); err == nil && !tmp {
			return d, nil
		}
	}
	return "", fmt.Errorf("both %s and %s are tmpfs: set KVPERSIST_BENCH_DIR to a directory on a disk", os.TempDir(), wd)
}

// settle flushes every dirty page and journal entry of dir's file system
// (syncfs), so that the write-back of one iteration's files (or of their
// deletion) does not run into the next timed region.
func settle(tb testing.TB, dir string) {
	tb.Helper()
	fd, err := unix.Open(dir, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		tb.Fatalf("settle: open %s: %v", dir, err)
	}
	defer unix.Close(fd)
	if err := unix.Syncfs(fd); err != nil {
		tb.Fatalf("settle: syncfs %s: %v", dir, err)
	}
}

// mkdir makes a fresh directory under benchRoot.
func mkdir(tb testing.TB, name string) string {
	tb.Helper()
	d := filepath.Join(benchRoot, name)
	if err := os.RemoveAll(d); err != nil {
		tb.Fatal(err)
	}
	if err := os.MkdirAll(d, 0o750); err != nil {
		tb.Fatal(err)
	}
	return d
}

// arena is anonymous mmap'd memory handed out in page-aligned pieces: the
// cache, the contiguous copy and the restore buffers live outside the Go
// heap, as pinned host memory does next to a real inference server, so the
// heap figures measure the engine alone. Like pinned memory it is resident
// and warm from the start: newArena has the kernel write every byte once
// and then reads it once from user space (untimed), so no timed step pays
// the first-touch cost of fresh memory: on a VM it is paid for the first
// kernel write into a page (a pread into it) and again for the first user
// read, whatever touched the page before (a user write of every byte does
// not remove it), and it slowed a verified prefix load into fresh memory
// several-fold.
type arena struct {
	mem []byte
	off int
}

const pageBytes = 4096

func alignPage(n int) int { return (n + pageBytes - 1) &^ (pageBytes - 1) }

func newArena(bytes int) (*arena, error) {
	mem, err := unix.Mmap(-1, 0, max(alignPage(bytes), pageBytes), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	if err != nil {
		return nil, fmt.Errorf("mmap %d bytes: %w", bytes, err)
	}
	if err := warmMem(mem); err != nil {
		_ = unix.Munmap(mem)
		return nil, err
	}
	return &arena{mem: mem}, nil
}

// warmMem has the kernel write every byte of mem once (reads of /dev/zero,
// 1 MiB at a time), then reads every byte once from user space: see arena.
func warmMem(mem []byte) error {
	fd, err := unix.Open("/dev/zero", unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("warm arena: %w", err)
	}
	defer unix.Close(fd)
	for o := 0; o < len(mem); {
		n, err := unix.Read(fd, mem[o:min(len(mem), o+1<<20)])
		if err != nil || n <= 0 {
			return fmt.Errorf("warm arena: read /dev/zero: %d bytes, %v", n, err)
		}
		o += n
	}
	if i := bytes.IndexByte(mem, 1); i >= 0 { // and reads it once from user space
		return fmt.Errorf("warm arena: byte %d read from /dev/zero is 1", i)
	}
	return nil
}

// alloc returns n bytes (capacity n) at the next page boundary; it panics
// when the arena is exhausted (a sizing bug of this package).
func (a *arena) alloc(n int) []byte {
	off := alignPage(a.off)
	if off+n > len(a.mem) {
		panic(fmt.Sprintf("bench: arena of %d bytes exhausted (at %d, asked %d)", len(a.mem), off, n))
	}
	a.off = off + n
	return a.mem[off : off+n : off+n]
}

func (a *arena) free() error {
	if a == nil || a.mem == nil {
		return nil
	}
	err := unix.Munmap(a.mem)
	a.mem = nil
	return err
}

// cacheArenaBytes is the mmap size NewCache needs for model m at tokens
// tokens, padded, with every piece page-aligned.
func cacheArenaBytes(m kvgen.Model, tokens int) int {
	return 2*m.Layers*alignPage(m.TensorBytes(kvgen.Capacity(tokens))) + alignPage(tokens*kvgen.IDSize)
}

// workload is the benchmarked KV cache: model m at tokens tokens, held in a
// padded cache of tokens+growTokens tokens (so the grown save has its
// tokens), all mmap'd.
type workload struct {
	model   kvgen.Model
	tokens  int
	mem     *arena
	cache   *kvgen.Cache
	views   []gather.View // ViewsAt(tokens)
	logical int           // bytes of views
	// contig is the logical bytes of views, slot after slot (the bytes a
	// raw limit writes or hashes); slots[i] is slot i's part of it.
	contigMem *arena
	contig    []byte
	slots     [][]byte
	// dest is one restore buffer per slot (mmap'd, page-aligned).
	destMem *arena
	dest    [][]byte
}

var (
	workloadsMu sync.Mutex
	workloads   = map[string]*workload{}
)

// getWorkload builds (once per process) the workload of model m at tokens.
func getWorkload(tb testing.TB, m kvgen.Model, tokens int) *workload {
	tb.Helper()
	workloadsMu.Lock()
	defer workloadsMu.Unlock()
	key := m.Name + "/" + strconv.Itoa(tokens)
	if w := workloads[key]; w != nil {
		return w
	}
	w, err := newWorkload(m, tokens)
	if err != nil {
		tb.Fatal(err)
	}
	workloads[key] = w
	return w
}

func newWorkload(m kvgen.Model, tokens int) (w *workload, err error) {
	w = &workload{model: m, tokens: tokens}
	defer func() {
		if err != nil {
			w.free()
		}
	}()
	all := tokens + growTokens
	if w.mem, err = newArena(cacheArenaBytes(m, all)); err != nil {
		return nil, err
	}
	w.cache = kvgen.NewCache(m, all, true, w.mem.alloc)
	w.views = w.cache.ViewsAt(tokens)
	arenaBytes := 0
	for _, v := range w.views {
		w.logical += v.Bytes()
		arenaBytes += alignPage(v.Bytes())
	}
	if w.contigMem, err = newArena(w.logical); err != nil {
		return nil, err
	}
	w.contig = w.contigMem.alloc(w.logical)
	off := 0
	for _, v := range w.views {
		dst := w.contig[off : off+v.Bytes() : off+v.Bytes()]
		out, copied, err := v.Gather(dst)
		if err != nil {
			return nil, err
		}
		if !copied {
			copy(dst, out)
		}
		w.slots = append(w.slots, dst)
		off += v.Bytes()
	}
	if w.destMem, err = newArena(arenaBytes); err != nil {
		return nil, err
	}
	for _, v := range w.views {
		w.dest = append(w.dest, w.destMem.alloc(v.Bytes()))
	}
	return w, nil
}

func (w *workload) free() {
	for _, a := range []*arena{w.mem, w.contigMem, w.destMem} {
		_ = a.free()
	}
}

func freeWorkloads() {
	workloadsMu.Lock()
	defer workloadsMu.Unlock()
	for k, w := range workloads {
		w.free()
		delete(workloads, k)
	}
}

// request is the write request of the workload's cache at tokens tokens
// (see cacheRequest).
func (w *workload) request(ref engine.Ref, lay layout.Layout, tokens int) *engine.WriteRequest {
	return cacheRequest(w.cache, ref, lay, tokens)
}

// cacheRequest is the write request of the first tokens tokens of c, shaped
// as the CLI's synth and demo build it (cmd/kvpersist cacheRequest): per
// layer one entry {"type":"KVCache","offset":T} with K and V, one attachment
// {"name":"tokens"} with the int32 token ids, the model as metadata.
func cacheRequest(c *kvgen.Cache, ref engine.Ref, lay layout.Layout, tokens int) *engine.WriteRequest {
	caches, atts, meta := kvgen.CacheRequest(c, tokens)
	return &engine.WriteRequest{Ref: ref, Layout: lay, Meta: meta, Caches: caches, Attachments: atts}
}

// viewOf is a row-major view of buf.
func viewOf(buf []byte, shape []int, itemSize int) gather.View {
	return gather.View{Base: buf, Shape: shape, Strides: gather.RowMajor(shape), ItemSize: itemSize}
}

// quietLogger drops the engine's debug events (and keeps warnings).
var quietLogger = slog.New(slog.NewTextHandler(io.Discard, nil))

// newEngine opens an engine on root (fsync on unless noSync).
func newEngine(tb testing.TB, root string, noSync bool) *engine.Engine {
	tb.Helper()
	e, err := engine.New(engine.Config{Root: root, NoSync: noSync, Logger: quietLogger})
	if err != nil {
		tb.Fatal(err)
	}
	return e
}

func closeEngine(tb testing.TB, e *engine.Engine) {
	tb.Helper()
	if err := e.Close(context.Background()); err != nil {
		tb.Errorf("engine close: %v", err)
	}
}

// do runs req on e and fails tb on error.
func do(tb testing.TB, e *engine.Engine, req engine.Request) engine.Result {
	tb.Helper()
	res := e.Do(context.Background(), req)
	if res.Err != nil {
		tb.Fatalf("%T: %v", req, res.Err)
	}
	return res
}

// ---- the limits ----

// rawWrite is the write limit: b from one contiguous buffer into a new file
// at path, fdatasync, close.
func rawWrite(path string, b []byte) error {
	f, err := os.OpenFile(path, os.O_CREATE|os.O_EXCL|os.O_WRONLY|unix.O_CLOEXEC, 0o640)
	if err != nil {
		return err
	}
	if _, err := f.Write(b); err != nil {
		f.Close()
		return err
	}
	if err := fdatasync(f); err != nil {
		f.Close()
		return err
	}
	return f.Close()
}

// fdatasync makes f's data and size durable (retried on EINTR only).
func fdatasync(f *os.File) error {
	for {
		err := unix.Fdatasync(int(f.Fd()))
		if err == nil {
			return nil
		}
		if err != unix.EINTR {
			return fmt.Errorf("fdatasync %s: %w", f.Name(), err)
		}
	}
}

// parallelFor runs fn(i) for i in [0, n) on GOMAXPROCS goroutines, the
// limits' way of using every core, and returns the first error.
func parallelFor(n int, fn func(i int) error) error {
	return parallelForK(n, runtime.GOMAXPROCS(0), fn)
}

// parallelForK is parallelFor on k goroutines (joined before it returns).
func parallelForK(n, k int, fn func(i int) error) error {
	var next atomic.Int64
	var first error
	var once sync.Once
	var wg sync.WaitGroup
	for range min(k, n) {
		wg.Go(func() {
			for {
				i := int(next.Add(1) - 1)
				if i >= n {
					return
				}
				if err := fn(i); err != nil {
					once.Do(func() { first = err })
					return
				}
			}
		})
	}
	wg.Wait()
	return first
}

// blockCuts returns the extents (offset, length) in the contiguous logical
// bytes of every block a block manifest names, in order: the same bytes the
// engine hashed.
func blockCuts(h *layout.Header) (offs, lens []int) {
	off := 0
	for _, t := range h.Slots() {
		for _, b := range t.Blocks {
			offs = append(offs, off)
			lens = append(lens, int(b.Bytes))
			off += int(b.Bytes)
		}
	}
	return offs, lens
}

// shaLimit is the hashing limit: SHA-256 (minio/sha256-simd Sum256) of each
// extent of b on every core. sums receives the digests (len(offs)).
func shaLimit(b []byte, offs, lens []int, sums [][32]byte) {
	_ = parallelFor(len(offs), func(i int) error {
		sums[i] = sha256.Sum256(b[offs[i] : offs[i]+lens[i]])
		return nil
	})
}

// xxh3Limit is the hashing limit of a formatVersion 8 block restore:
// xxh3.Hash of each extent of b on every core. sums receives the hashes
// (len(offs)).
func xxh3Limit(b []byte, offs, lens []int, sums []uint64) {
	_ = parallelFor(len(offs), func(i int) error {
		sums[i] = xxh3.Hash(b[offs[i] : offs[i]+lens[i]])
		return nil
	})
}

// shaXXH3Limit is the hashing limit of a block save: SHA-256 (the block's
// name) then xxh3-64 (its manifest entry) of each extent of b, one pass
// each, on every core.
func shaXXH3Limit(b []byte, offs, lens []int, sums [][32]byte, xsums []uint64) {
	_ = parallelFor(len(offs), func(i int) error {
		ext := b[offs[i] : offs[i]+lens[i]]
		sums[i] = sha256.Sum256(ext)
		xsums[i] = xxh3.Hash(ext)
		return nil
	})
}

// preadLimit is the warm-read limit: pread of each extent of the file into
// dest[i] (file offset offs[i]) on every core, no hashing.
func preadLimit(path string, dest [][]byte, offs []int64) error {
	return preadEach(path, dest, offs, func(int) error { return nil })
}

// preadEach preads each extent of the file into dest[i] (file offset
// offs[i]) on every core, then runs after(i) on the same goroutine.
func preadEach(path string, dest [][]byte, offs []int64, after func(i int) error) error {
	f, err := os.Open(path)
	if err != nil {
		return err
	}
	defer f.Close()
	fd := int(f.Fd())
	return parallelFor(len(dest), func(i int) error {
		if err := preadFull(fd, dest[i], offs[i]); err != nil {
			return err
		}
		return after(i)
	})
}

// preadFull fills b from fd at off with pread.
func preadFull(fd int, b []byte, off int64) error {
	for len(b) > 0 {
		n, err := unix.Pread(fd, b, off)
		if err == unix.EINTR {
			continue
		}
		if err != nil {
			return err
		}
		if n == 0 {
			return io.ErrUnexpectedEOF
		}
		b, off = b[n:], off+int64(n)
	}
	return nil
}

// preadXXH3Limit is the warm single-file restore limit: preadLimit, each
// tensor then hashed by xxh3.Hash (one pass over it) on the goroutine that
// read it, every core; a hash that differs from the header's is an error.
func preadXXH3Limit(path string, dest [][]byte, offs []int64, h *layout.Header) error {
	slots := h.Slots()
	return preadEach(path, dest, offs, func(i int) error {
		if got := layout.TensorHash(xxh3.Hash(dest[i])); got != slots[i].Hash {
			return fmt.Errorf("pread+xxh3 limit: slot %d hashes to %s, the header says %s", i, got, slots[i].Hash)
		}
		return nil
	})
}

// preadSHALimit is the original warm block restore limit: for
// every block a manifest names, open its file, pread it whole into its
// place in dest, SHA-256 it (one pass) and close it, on every core; a
// digest that differs from the block's name is an error.
func preadSHALimit(snap *layout.Snapshot, path string, dest [][]byte) error {
	return preadBlocks(snap, path, dest, func(ref layout.BlockRef, b []byte) error {
		if sum := sha256.Sum256(b); hex.EncodeToString(sum[:]) != ref.Hash {
			return fmt.Errorf("pread+SHA-256 limit: block %s hashes to %x", ref.Hash, sum)
		}
		return nil
	})
}

// preadXXH3BlocksLimit is the physical limit of a verified restore of a
// formatVersion 8 manifest, which checks each block's XXH3-64: the same
// opens and preads as preadSHALimit, then xxh3.Hash of each block (one
// pass), on every core; a hash that differs from the manifest's is an
// error.
func preadXXH3BlocksLimit(snap *layout.Snapshot, path string, dest [][]byte) error {
	return preadBlocks(snap, path, dest, func(ref layout.BlockRef, b []byte) error {
		if got := layout.TensorHash(xxh3.Hash(b)); got != ref.XXH3 {
			return fmt.Errorf("pread+xxh3 limit: block %s hashes to %s, the manifest says %q", ref.Hash, got, ref.XXH3)
		}
		return nil
	})
}

// preadBlocks opens every block a manifest names, preads it whole into its
// place in dest, runs check on those bytes and closes it, on every core.
func preadBlocks(snap *layout.Snapshot, path string, dest [][]byte, check func(ref layout.BlockRef, b []byte) error) error {
	type blk struct {
		path string
		dst  []byte
		ref  layout.BlockRef
	}
	var blks []blk
	for i, t := range snap.Header.Slots() {
		var o int64
		for _, ref := range t.Blocks {
			blks = append(blks, blk{testutil.BlockPath(filepath.Dir(path), ref.Hash), dest[i][o : o+ref.Bytes], ref})
			o += ref.Bytes
		}
	}
	return parallelFor(len(blks), func(k int) error {
		f, err := os.Open(blks[k].path)
		if err != nil {
			return err
		}
		defer f.Close()
		if err := preadFull(int(f.Fd()), blks[k].dst, 0); err != nil {
			return err
		}
		return check(blks[k].ref, blks[k].dst)
	})
}

// unlinkLimit is the collect limit: readdir blocksDir and each of its
// fan-out directories, then unlink (on every core) every entry whose name is
// in victims. It returns how many files it removed.
func unlinkLimit(blocksDir string, victims map[string]bool) (int, error) {
	fan, err := os.ReadDir(blocksDir)
	if err != nil {
		return 0, err
	}
	var paths []string
	for _, d := range fan {
		if !d.IsDir() {
			continue
		}
		dir := filepath.Join(blocksDir, d.Name())
		ents, err := os.ReadDir(dir)
		if err != nil {
			return 0, err
		}
		for _, e := range ents {
			if victims[e.Name()] {
				paths = append(paths, filepath.Join(dir, e.Name()))
			}
		}
	}
	err = parallelFor(len(paths), func(i int) error { return unix.Unlink(paths[i]) })
	return len(paths), err
}

// ---- measuring ----

// allocCounts returns the cumulative heap objects and bytes allocated by
// the process. It uses runtime.ReadMemStats (a short stop-the-world), whose
// counts are exact: runtime/metrics' "/gc/heap/allocs:objects" counts a
// span's objects when a P caches the span, which makes it jump by hundreds.
func allocCounts() (objects, bytes uint64) {
	memStatsMu.Lock()
	defer memStatsMu.Unlock()
	runtime.ReadMemStats(&memStats)
	return memStats.Mallocs, memStats.TotalAlloc
}

var (
	memStatsMu sync.Mutex
	memStats   runtime.MemStats // package-level: 5 KiB that must not count as an allocation
)

// heapSampler records the largest Go heap (objects, in bytes) seen every
// millisecond between start and stop.
type heapSampler struct {
	stopc chan struct{}
	done  chan struct{}
	peak  uint64
}

func startHeapSampler() *heapSampler {
	s := &heapSampler{stopc: make(chan struct{}), done: make(chan struct{})}
	sample := []metrics.Sample{{Name: "/memory/classes/heap/objects:bytes"}}
	read := func() {
		metrics.Read(sample)
		s.peak = max(s.peak, sample[0].Value.Uint64())
	}
	read()
	go func() {
		defer close(s.done)
		t := time.NewTicker(time.Millisecond)
		defer t.Stop()
		for {
			select {
			case <-s.stopc:
				read()
				return
			case <-t.C:
				read()
			}
		}
	}()
	return s
}

// stop ends the sampling and returns the peak heap in bytes.
func (s *heapSampler) stop() uint64 {
	close(s.stopc)
	<-s.done
	return s.peak
}

// measured is what alternate accumulates over a benchmark's iterations.
type measured struct {
	ours, limit time.Duration
	peakHeap    uint64 // bytes, largest over every run of ours
	objects     uint64 // heap objects allocated during ours, summed
	allocBytes  uint64 // heap bytes allocated during ours, summed
	n           int
	// CPU time (user + system) spent while ours / limit ran, summed over
	// the iterations: of this process (getrusage), and of the server
	// (steps.serverCPU; zero without one).
	oursCPU, limitCPU       time.Duration
	oursSrvCPU, limitSrvCPU time.Duration
	// extra is what each of steps.extra took, in its order.
	extra []sideTimes
}

// sideTimes is one further limit's time and CPU times (as limit's),
// summed over the iterations.
type sideTimes struct {
	name           string
	d, cpu, srvCPU time.Duration
	noServer       bool // side.noServer
}

// steps are the parts of one benchmark iteration. Only ours runs with the
// benchmark timer on; limit is timed apart; the others are not timed.
type steps struct {
	prepOurs, prepLimit func(i int) // before ours / limit
	ours, limit         func(i int)
	// afterOurs, when set, runs right after ours (untimed), e.g. to remove
	// what ours wrote, so that the sides after it find the disk and page
	// cache as ours found them.
	afterOurs func(i int)
	cleanup   func(i int) // after every side
	// serverCPU, when set, returns the CPU time (user + system) a server
	// the benchmark talks to has used so far; alternate then sums it over
	// each side's runs (measured.oursSrvCPU, limitSrvCPU).
	serverCPU func() time.Duration
	// extra are further limits, each timed apart as limit is (its CPU
	// too) and run once per iteration, in the iteration's rotation with
	// ours and limit, before cleanup; measured.extra holds their times,
	// in this order.
	extra []side
}

// side is one further limit of steps: prep (untimed, may be nil), run
// (timed), then after (untimed, may be nil: e.g. removing what run wrote,
// so that the sides after it find the machine as it found it). name
// names its metrics and its profiles (startSideProfile).
type side struct {
	name             string
	prep, run, after func(i int)
	// noServer: run never talks to the server, so its server CPU (the
	// idle server's) is not reported.
	noServer bool
}

// sideProfiles numbers the side profiles of this process, so that the runs
// of -test.count > 1 do not overwrite each other's.
var sideProfiles atomic.Int64

// startSideProfile starts a CPU profile of one run of a side ("ours" or
// "limit") of iteration i when $KVPERSIST_BENCH_PROFILE_DIR is set, into
// <dir>/<benchmark>-<side>-<i>-<n>.pprof (the benchmark's name with '/'
// replaced by '_'; i is -1 for the warm-up; n counts the profiles of the
// process); the returned func stops it.
// `go tool pprof -top BIN DIR/*-ours-*.pprof` then shows where ours spent
// its CPU apart from the limit's and the untimed setup's (a profile of the
// whole run, -test.cpuprofile, mixes them). Without the variable it does
// nothing; a profile that cannot start (another one runs) fails b.
func startSideProfile(b *testing.B, side string, i int) func() {
	dir := os.Getenv("KVPERSIST_BENCH_PROFILE_DIR")
	if dir == "" {
		return func() {}
	}
	f, err := os.Create(filepath.Join(dir, fmt.Sprintf("%s-%s-%d-%d.pprof", strings.ReplaceAll(b.Name(), "/", "_"), side, i, sideProfiles.Add(1))))
	if err != nil {
		b.Fatal(err)
	}
	if err := pprof.StartCPUProfile(f); err != nil {
		f.Close()
		b.Fatalf("side profile (run without -test.cpuprofile): %v", err)
	}
	return func() {
		pprof.StopCPUProfile()
		if err := f.Close(); err != nil {
			b.Fatal(err)
		}
	}
}

// cpuMark is the CPU times at one moment: this process's, and the
// server's (zero without steps.serverCPU).
type cpuMark struct{ self, srv time.Duration }

func (s steps) cpuNow() cpuMark {
	m := cpuMark{self: cpuTime()}
	if s.serverCPU != nil {
		m.srv = s.serverCPU()
	}
	return m
}

// alternate runs one untimed warm-up iteration of s (index -1; only the
// first time a benchmark runs in the process), then b.N
// iterations, ours and limit (and steps.extra) in rotating order (ours
// first on every other iteration, counted across the process's runs of
// the benchmark, when there are no extras) so that drift on a
// noisy machine hits every side, sampling the heap while ours runs.
func alternate(b *testing.B, s steps) measured {
	var m measured
	runOurs := func(i int) {
		if s.prepOurs != nil {
			s.prepOurs(i)
		}
		hs := startHeapSampler()
		o0, a0 := allocCounts()
		c0 := s.cpuNow()
		b.StartTimer()
		t0 := time.Now()
		stopProf := startSideProfile(b, "ours", i)
		s.ours(i)
		stopProf()
		m.ours += time.Since(t0)
		b.StopTimer()
		c1 := s.cpuNow()
		m.oursCPU += c1.self - c0.self
		m.oursSrvCPU += c1.srv - c0.srv
		o1, a1 := allocCounts()
		m.objects += o1 - o0
		m.allocBytes += a1 - a0
		m.peakHeap = max(m.peakHeap, hs.stop())
		if s.afterOurs != nil {
			s.afterOurs(i)
		}
	}
	timeSide := func(name string, prep, run func(int), i int) sideTimes {
		if prep != nil {
			prep(i)
		}
		c0 := s.cpuNow()
		t0 := time.Now()
		stopProf := startSideProfile(b, name, i)
		run(i)
		stopProf()
		d := time.Since(t0)
		c1 := s.cpuNow()
		return sideTimes{d: d, cpu: c1.self - c0.self, srvCPU: c1.srv - c0.srv}
	}
	runLimit := func(i int) {
		t := timeSide("limit", s.prepLimit, s.limit, i)
		m.limit += t.d
		m.limitCPU += t.cpu
		m.limitSrvCPU += t.srvCPU
	}
	// The sides in their order: ours, limit, then the extra limits; an
	// iteration runs them rotated by how many iterations of this benchmark
	// the process ran before it (rotations: also across -test.count runs,
	// so that -benchtime 1x -count N rotates too), so that each side runs
	// first as often as the others over len(sides) consecutive iterations
	// (with ours and limit alone: ours first on every other one).
	m.extra = make([]sideTimes, len(s.extra))
	runs := []func(int){runOurs, runLimit}
	for k, x := range s.extra {
		m.extra[k].name, m.extra[k].noServer = x.name, x.noServer
		runs = append(runs, func(i int) {
			t := timeSide(x.name, x.prep, x.run, i)
			m.extra[k].d += t.d
			m.extra[k].cpu += t.cpu
			m.extra[k].srvCPU += t.srvCPU
			if x.after != nil {
				x.after(i)
			}
		})
	}
	// One untimed iteration first (index -1), once per benchmark and
	// process: on a VM, page-cache pages the guest has never used cost a
	// host fault on first touch, which would otherwise land on whichever
	// side of the first iteration runs first.
	b.StopTimer()
	b.ResetTimer()
	if _, done := warmed.LoadOrStore(b.Name(), true); !done {
		warmUp(s)
	}
	ctr, _ := rotations.LoadOrStore(b.Name(), new(atomic.Int64))
	for i := 0; i < b.N; i++ {
		r := int(ctr.(*atomic.Int64).Add(1) - 1)
		for k := range runs {
			runs[(r+k)%len(runs)](i)
		}
		if s.cleanup != nil {
			s.cleanup(i)
		}
	}
	m.n = b.N
	b.StartTimer()
	return m
}

// warmed holds the names of the benchmarks whose warm-up iteration ran.
var warmed sync.Map

// rotations holds, per benchmark name, the iterations alternate has run
// of it in this process (*atomic.Int64): the rotation of the next one.
var rotations sync.Map

// warmUp runs one untimed iteration of s, numbered -1.
func warmUp(s steps) {
	if s.prepOurs != nil {
		s.prepOurs(-1)
	}
	s.ours(-1)
	if s.afterOurs != nil {
		s.afterOurs(-1)
	}
	if s.prepLimit != nil {
		s.prepLimit(-1)
	}
	s.limit(-1)
	for _, x := range s.extra {
		if x.prep != nil {
			x.prep(-1)
		}
		x.run(-1)
		if x.after != nil {
			x.after(-1)
		}
	}
	if s.cleanup != nil {
		s.cleanup(-1)
	}
}

// report publishes x-limit (limit time / our time), the limit's own
// throughput in MB/s for limitBytes per iteration (0: not reported), and
// the peak heap in MiB.
func (m measured) report(b *testing.B, limitBytes int64) {
	if m.ours > 0 && m.limit > 0 {
		b.ReportMetric(float64(m.limit)/float64(m.ours), "x-limit")
	}
	if limitBytes > 0 && m.limit > 0 {
		b.ReportMetric(float64(limitBytes)*float64(m.n)/m.limit.Seconds()/1e6, "limit-MB/s")
	}
	b.ReportMetric(float64(m.peakHeap)/(1<<20), "peak-heap-MiB")
}

// reportCPU publishes the CPU seconds per GiB of bytes (the bytes each
// side moves per iteration) spent while ours ran ("cpu-s/GiB": this
// process; "srv-cpu-s/GiB": the server, when steps.serverCPU was set) and
// while the limit ran ("limit-cpu-s/GiB", "limit-srv-cpu-s/GiB").
func (m measured) reportCPU(b *testing.B, bytes int64) {
	if bytes <= 0 || m.n == 0 {
		return
	}
	gib := float64(bytes) * float64(m.n) / (1 << 30)
	b.ReportMetric(m.oursCPU.Seconds()/gib, "cpu-s/GiB")
	b.ReportMetric(m.limitCPU.Seconds()/gib, "limit-cpu-s/GiB")
	if m.oursSrvCPU > 0 || m.limitSrvCPU > 0 {
		b.ReportMetric(m.oursSrvCPU.Seconds()/gib, "srv-cpu-s/GiB")
		b.ReportMetric(m.limitSrvCPU.Seconds()/gib, "limit-srv-cpu-s/GiB")
	}
}

// reportExtra publishes, for each of steps.extra, its throughput in GB/s
// for bytes per iteration ("<name>-GB/s"), ours against it ("x-<name>":
// its time / our time, as x-limit) and its CPU seconds per GiB
// ("<name>-cpu-s/GiB"; "<name>-srv-cpu-s/GiB" with steps.serverCPU).
func (m measured) reportExtra(b *testing.B, bytes int64) {
	if bytes <= 0 || m.n == 0 {
		return
	}
	gib := float64(bytes) * float64(m.n) / (1 << 30)
	for _, x := range m.extra {
		if x.d > 0 {
			b.ReportMetric(float64(bytes)*float64(m.n)/x.d.Seconds()/1e9, x.name+"-GB/s")
			if m.ours > 0 {
				b.ReportMetric(float64(x.d)/float64(m.ours), "x-"+x.name)
			}
		}
		b.ReportMetric(x.cpu.Seconds()/gib, x.name+"-cpu-s/GiB")
		if x.srvCPU > 0 && !x.noServer {
			b.ReportMetric(x.srvCPU.Seconds()/gib, x.name+"-srv-cpu-s/GiB")
		}
	}
}

// removeAll removes path and fails tb on error. A directory that is not
// empty after its entries were removed is tried again a few times: the
// engine's background goroutine may write a namespace's recency
// checkpoint into it meanwhile (a save row removes its namespace behind
// the engine's back).
func removeAll(tb testing.TB, path string) {
	tb.Helper()
	var err error
	for range 5 {
		if err = os.RemoveAll(path); err == nil || errors.Is(err, os.ErrNotExist) || !errors.Is(err, syscall.ENOTEMPTY) {
			break
		}
	}
	if err != nil && !errors.Is(err, os.ErrNotExist) {
		tb.Fatal(err)
	}
}

// checkLoaded fails b unless each of dest's views (capacity-padded buffers
// of capT tokens, one per slot of w) holds the first tokens tokens of w's
// slot, head row by head row.
func checkLoaded(b *testing.B, w *workload, dest []engine.TensorSpec, capT, tokens int) {
	m := w.model
	row := m.HeadDim * m.ItemSize
	for i, d := range dest {
		want := w.slots[i]
		for h := range m.KVHeads {
			got := d.View.Base[h*capT*row:][:tokens*row]
			if !bytes.Equal(got, want[h*tokens*row:][:tokens*row]) {
				b.Fatalf("tensor %d head %d: loaded bytes differ from the cache's", i, h)
			}
		}
	}
}
