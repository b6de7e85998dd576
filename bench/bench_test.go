package bench

import (
	"bytes"
	"context"
	"crypto/rand"
	cryptosha256 "crypto/sha256"
	"encoding/hex"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvpersist/kvpersist/engine"
	"github.com/kvpersist/kvpersist/engine/jobs"
	"github.com/kvpersist/kvpersist/engine/layout"
	"github.com/kvpersist/kvpersist/internal/kvgen"
	"github.com/kvpersist/kvpersist/internal/testutil"
	"github.com/minio/sha256-simd"
	"github.com/zeebo/xxh3"
)

// benchTokens are the cache sizes of the save and restore rows: about 256
// MiB and 1 GiB of Llama-3.1-8B KV cache ($KVPERSIST_BENCH_TOKENS, a
// comma-separated list, replaces them: 256 is a 32 MiB cache, for a quick
// check that the rows run).
var benchTokens = envInts("KVPERSIST_BENCH_TOKENS", []int{2048, 8192})

// envInts is the comma-separated positive integers in environment
// variable name, or def.
func envInts(name string, def []int) []int {
	s := os.Getenv(name)
	if s == "" {
		return def
	}
	var out []int
	for _, f := range strings.Split(s, ",") {
		n, err := strconv.Atoi(strings.TrimSpace(f))
		if err != nil || n <= 0 {
			panic(fmt.Sprintf("%s=%q: want positive integers separated by commas", name, s))
		}
		out = append(out, n)
	}
	return out
}

var benchModel = kvgen.Llama31_8B

// forTokens runs fn as one sub-benchmark per size, named T=<tokens>.
func forTokens(b *testing.B, fn func(b *testing.B, w *workload)) {
	for _, t := range benchTokens {
		b.Run(fmt.Sprintf("T=%d", t), func(b *testing.B) { fn(b, getWorkload(b, benchModel, t)) })
	}
}

// BenchmarkSave: saves of the workload, each beside its limit:
//   - single: the single-file layout, against a raw write of the same
//     bytes from one contiguous buffer into a new file + fdatasync; target
//     x-limit >= 0.9;
//   - blocks-first: the block layout (1 MiB blocks, SHA-256 names) into an
//     empty store (removed between iterations), against the same raw write
//     and fdatasync; target >= 0.8;
//   - blocks-dedup: the block layout with every block already stored,
//     against SHA-256 of the same bytes on every core (what a dedup save
//     cannot avoid); target >= 0.85. A save also records each block's
//     xxh3-64 in its manifest: x-sha256-xxh3 is against SHA-256 then
//     xxh3 of the same bytes on every core (timed apart, in the same
//     iterations), the limit of that work;
//   - blocks-grow: the cache grown by 256 tokens after a save of it;
//     SetBytes and the raw-write limit count only the bytes newly written
//     (new blocks and the manifest). Reported, no target.
func BenchmarkSave(b *testing.B) {
	b.Run("single", func(b *testing.B) { forTokens(b, benchSaveSingle) })
	b.Run("blocks-first", func(b *testing.B) { forTokens(b, benchSaveBlocksFirst) })
	b.Run("blocks-dedup", func(b *testing.B) { forTokens(b, benchSaveBlocksDedup) })
	b.Run("blocks-grow", func(b *testing.B) { forTokens(b, benchSaveBlocksGrow) })
}

func benchSaveSingle(b *testing.B, w *workload) {
	root, lim := mkdir(b, "save-single"), mkdir(b, "save-single-limit")
	e := newEngine(b, root, false)
	defer closeEngine(b, e)
	var req *engine.WriteRequest
	b.SetBytes(int64(w.logical))
	b.ReportAllocs()
	settle(b, root)
	m := alternate(b, steps{
		prepOurs: func(i int) {
			req = w.request(engine.Ref{Namespace: "ns", Name: fmt.Sprintf("s%d", i)}, layout.Single, w.tokens)
		},
		ours: func(int) {
			if res := do(b, e, req); res.Metrics.LogicalBytes != int64(w.logical) {
				b.Fatalf("saved %d logical bytes, want %d", res.Metrics.LogicalBytes, w.logical)
			}
		},
		limit: func(i int) {
			if err := rawWrite(filepath.Join(lim, fmt.Sprintf("raw%d", i)), w.contig); err != nil {
				b.Fatal(err)
			}
		},
		cleanup: func(i int) {
			removeAll(b, filepath.Join(root, "ns", fmt.Sprintf("s%d", i)))
			removeAll(b, filepath.Join(lim, fmt.Sprintf("raw%d", i)))
			settle(b, root)
		},
	})
	m.report(b, int64(w.logical))
}

func benchSaveBlocksFirst(b *testing.B, w *workload) {
	root, lim := mkdir(b, "save-first"), mkdir(b, "save-first-limit")
	e := newEngine(b, root, false)
	defer closeEngine(b, e)
	req := w.request(engine.Ref{Namespace: "ns", Name: "snap"}, layout.Blocks, w.tokens)
	var blocks int64
	b.SetBytes(int64(w.logical))
	b.ReportAllocs()
	settle(b, root)
	m := alternate(b, steps{
		ours: func(int) {
			res := do(b, e, req)
			if res.Metrics.BlocksReused != 0 {
				b.Fatalf("first save reused %d blocks", res.Metrics.BlocksReused)
			}
			blocks = res.Metrics.BlocksWritten
		},
		limit: func(i int) {
			if err := rawWrite(filepath.Join(lim, fmt.Sprintf("raw%d", i)), w.contig); err != nil {
				b.Fatal(err)
			}
		},
		cleanup: func(i int) {
			removeAll(b, filepath.Join(root, "ns"))
			removeAll(b, filepath.Join(lim, fmt.Sprintf("raw%d", i)))
			settle(b, root)
		},
	})
	m.report(b, int64(w.logical))
	b.ReportMetric(float64(m.objects)/float64(m.n)/float64(blocks), "allocs/block")
}

func benchSaveBlocksDedup(b *testing.B, w *workload) {
	root := mkdir(b, "save-dedup")
	e := newEngine(b, root, false)
	defer closeEngine(b, e)
	base := do(b, e, w.request(engine.Ref{Namespace: "ns", Name: "base"}, layout.Blocks, w.tokens))
	offs, lens := blockCuts(base.Header)
	sums := make([][32]byte, len(offs))
	checkSums(b, base.Header, w.contig, offs, lens, sums)
	req := w.request(engine.Ref{Namespace: "ns", Name: "again"}, layout.Blocks, w.tokens)
	xsums := make([]uint64, len(offs))
	checkXXH3Sums(b, base.Header, w.contig, offs, lens, xsums)
	var bothTime time.Duration // SHA-256 and xxh3 of the same bytes, timed apart
	b.SetBytes(int64(w.logical))
	b.ReportAllocs()
	settle(b, root)
	m := alternate(b, steps{
		ours: func(int) {
			res := do(b, e, req)
			if res.Metrics.BlocksWritten != 0 || res.Metrics.BlocksReused != int64(len(offs)) {
				b.Fatalf("dedup save wrote %d blocks and reused %d, want 0 and %d", res.Metrics.BlocksWritten, res.Metrics.BlocksReused, len(offs))
			}
		},
		limit: func(i int) {
			t0 := time.Now()
			shaXXH3Limit(w.contig, offs, lens, sums, xsums)
			if i >= 0 {
				bothTime += time.Since(t0)
			}
			shaLimit(w.contig, offs, lens, sums)
		},
		cleanup: func(int) {
			removeAll(b, filepath.Join(root, "ns", "again"))
			settle(b, root)
		},
	})
	// m.limit timed both limits: x-limit is against SHA-256 alone.
	m.limit -= bothTime
	m.report(b, int64(w.logical))
	b.ReportMetric(float64(m.objects)/float64(m.n)/float64(len(offs)), "allocs/block")
	b.ReportMetric(float64(bothTime)/float64(m.ours), "x-sha256-xxh3")
}

// checkSums runs the SHA-256 limit once and checks it hashes exactly the
// engine's blocks (the limit works on the same bytes).
func checkSums(b *testing.B, h *layout.Header, contig []byte, offs, lens []int, sums [][32]byte) {
	b.Helper()
	shaLimit(contig, offs, lens, sums)
	k := 0
	for _, t := range h.Slots() {
		for _, ref := range t.Blocks {
			if got := hex.EncodeToString(sums[k][:]); got != ref.Hash {
				b.Fatalf("limit block %d: SHA-256 %s, the manifest says %s", k, got, ref.Hash)
			}
			k++
		}
	}
}

// checkXXH3Sums runs the xxh3 limit once and checks it hashes exactly the
// engine's blocks, as the manifest records them (formatVersion 8).
func checkXXH3Sums(b *testing.B, h *layout.Header, contig []byte, offs, lens []int, sums []uint64) {
	b.Helper()
	xxh3Limit(contig, offs, lens, sums)
	k := 0
	for _, t := range h.Slots() {
		for _, ref := range t.Blocks {
			if got := layout.TensorHash(sums[k]); got != ref.XXH3 {
				b.Fatalf("limit block %d: xxh3 %s, the manifest says %q", k, got, ref.XXH3)
			}
			k++
		}
	}
}

func benchSaveBlocksGrow(b *testing.B, w *workload) {
	root, lim := mkdir(b, "save-grow"), mkdir(b, "save-grow-limit")
	e := newEngine(b, root, false)
	defer closeEngine(b, e)
	baseReq := w.request(engine.Ref{Namespace: "ns", Name: "base"}, layout.Blocks, w.tokens)
	grownReq := w.request(engine.Ref{Namespace: "ns", Name: "grown"}, layout.Blocks, w.tokens+growTokens)
	prepOurs := func(int) {
		removeAll(b, filepath.Join(root, "ns"))
		do(b, e, baseReq)
		settle(b, root)
	}
	cleanup := func(int) {
		removeAll(b, filepath.Join(root, "ns"))
		settle(b, root)
	}
	// The limit writes the bytes the grown save writes, and alternate may
	// run it before any timed save (every other iteration, and in every
	// run after the process's first of this row): they come from one
	// untimed grown save per process and row.
	g := grownOnce(b, func() grownSave {
		prepOurs(-1)
		res := do(b, e, grownReq)
		cleanup(-1)
		return grownSave{res.Metrics.WrittenBytes, res.Metrics.LogicalBytes, res.Metrics.BlocksWritten}
	})
	written, logical, blocks := g.written, g.logical, g.blocks
	b.ReportAllocs()
	m := alternate(b, steps{
		prepOurs: prepOurs,
		ours: func(int) {
			res := do(b, e, grownReq)
			if got := (grownSave{res.Metrics.WrittenBytes, res.Metrics.LogicalBytes, res.Metrics.BlocksWritten}); got != g {
				b.Fatalf("grown save wrote %+v, the first one %+v: the limit would write another amount", got, g)
			}
		},
		limit: func(i int) {
			if err := rawWriteN(filepath.Join(lim, fmt.Sprintf("raw%d", i)), w.contig, written); err != nil {
				b.Fatal(err)
			}
		},
		cleanup: func(i int) {
			cleanup(i)
			removeAll(b, filepath.Join(lim, fmt.Sprintf("raw%d", i)))
		},
	})
	b.SetBytes(written)
	m.report(b, written)
	b.ReportMetric(float64(written)/float64(logical), "new/logical")
	b.ReportMetric(float64(blocks), "new-blocks")
}

// grownSave is what a blocks-grow save wrote: bytes newly written (new
// blocks and the manifest), the cache's logical bytes, new blocks.
type grownSave struct{ written, logical, blocks int64 }

// grownSaves holds, per benchmark name, the grownSave of its first grown
// save in this process.
var grownSaves sync.Map

// grownOnce returns b's grownSave, measured by probe the first time the
// row runs in this process.
func grownOnce(b *testing.B, probe func() grownSave) grownSave {
	if g, ok := grownSaves.Load(b.Name()); ok {
		return g.(grownSave)
	}
	g := probe()
	if g.written == 0 {
		b.Fatalf("the grown save reported no bytes written: %+v", g)
	}
	grownSaves.Store(b.Name(), g)
	return g
}

// rawWriteN is rawWrite of n bytes taken from buf, cycling over it when n
// exceeds len(buf) (the bytes' values do not matter to ext4).
func rawWriteN(path string, buf []byte, n int64) error {
	if n <= int64(len(buf)) {
		return rawWrite(path, buf[:n])
	}
	f, err := os.OpenFile(path, os.O_CREATE|os.O_EXCL|os.O_WRONLY, 0o640)
	if err != nil {
		return err
	}
	for left := n; left > 0; {
		k := min(left, int64(len(buf)))
		if _, err := f.Write(buf[:k]); err != nil {
			f.Close()
			return err
		}
		left -= k
	}
	if err := f.Sync(); err != nil { // fsync: the same as fdatasync for a new file's data and size
		f.Close()
		return err
	}
	return f.Close()
}

// restoreStore is a snapshot saved once per process for the restore rows.
type restoreStore struct {
	root string
	ref  engine.Ref
}

var (
	restoreMu     sync.Mutex
	restoreStores = map[string]restoreStore{}
)

func getRestoreStore(b *testing.B, w *workload, lay layout.Layout) restoreStore {
	b.Helper()
	restoreMu.Lock()
	defer restoreMu.Unlock()
	key := fmt.Sprintf("restore-%s-%d", lay, w.tokens)
	if s, ok := restoreStores[key]; ok {
		return s
	}
	s := restoreStore{root: mkdir(b, key), ref: engine.Ref{Namespace: "ns", Name: "snap"}}
	e := newEngine(b, s.root, false)
	defer closeEngine(b, e)
	do(b, e, w.request(s.ref, lay, w.tokens))
	restoreStores[key] = s
	return s
}

// BenchmarkRestore: warm (page cache) restores with verification into
// caller buffers:
//   - single: against pread of the same file extents into the same buffers
//     then xxh3.Hash of each, on every core (one pass of each: what a
//     verified read cannot avoid); target >= 0.85;
//   - blocks: against open + pread of every block file into the same
//     buffers then SHA-256 of each, on every core (x-limit: the original
//     limit); target >= 0.85. The restore verifies the blocks of the
//     formatVersion 8 manifests it saves by their xxh3-64, so it is also
//     measured against the same opens and preads then xxh3.Hash of each
//     block, on every core: the physical limit of that path
//     (pread-xxh3-MB/s, x-pread-xxh3 = that limit's time / ours). The
//     limit runs alternate with the restores; the two limits of one
//     iteration run one after the other, each timed alone.
//
// BenchmarkRestoreCold (cold_test.go) has the same rows with the files
// evicted from the page cache.
func BenchmarkRestore(b *testing.B) {
	b.Run("single", func(b *testing.B) { forTokens(b, benchRestoreSingle) })
	b.Run("blocks", func(b *testing.B) { forTokens(b, benchRestoreBlocks) })
}

// warmRead restores the snapshot once (warming the page cache) and checks
// every destination against the bytes saved.
func warmRead(b *testing.B, e *engine.Engine, w *workload, req *engine.ReadRequest) {
	b.Helper()
	clear(w.destMem.mem) // a read that writes nothing cannot pass
	do(b, e, req)
	for i := range w.dest {
		if !bytes.Equal(w.dest[i], w.slots[i]) {
			b.Fatalf("restored slot %d differs from the saved bytes", i)
		}
	}
}

func benchRestoreSingle(b *testing.B, w *workload) {
	s := getRestoreStore(b, w, layout.Single)
	e := newEngine(b, s.root, false)
	defer closeEngine(b, e)
	snap, path := snapshotAt(b, e, s.ref)
	offs := make([]int64, 0, len(w.dest))
	for _, t := range snap.Header.Slots() {
		offs = append(offs, int64(snap.DataStart)+t.Off)
	}
	req := &engine.ReadRequest{Ref: s.ref, Dest: w.dest, Expect: snap.Header}
	warmRead(b, e, w, req)
	// The limit reads the same extents into the same buffers and hashes
	// them as the header does: check it once.
	clear(w.destMem.mem)
	if err := preadXXH3Limit(path, w.dest, offs, snap.Header); err != nil {
		b.Fatal(err)
	}
	for i := range w.dest {
		if !bytes.Equal(w.dest[i], w.slots[i]) {
			b.Fatalf("pread limit: slot %d differs from the saved bytes", i)
		}
	}
	b.SetBytes(int64(w.logical))
	b.ReportAllocs()
	m := alternate(b, steps{
		ours: func(int) { do(b, e, req) },
		limit: func(int) {
			if err := preadXXH3Limit(path, w.dest, offs, snap.Header); err != nil {
				b.Fatal(err)
			}
		},
	})
	m.report(b, int64(w.logical))
}

func benchRestoreBlocks(b *testing.B, w *workload) {
	s := getRestoreStore(b, w, layout.Blocks)
	e := newEngine(b, s.root, false)
	defer closeEngine(b, e)
	snap, err := e.Stat(s.ref)
	if err != nil {
		b.Fatal(err)
	}
	offs, _ := blockCuts(snap.Header)
	path, err := e.Path(s.ref)
	if err != nil {
		b.Fatal(err)
	}
	req := &engine.ReadRequest{Ref: s.ref, Dest: w.dest, Expect: snap.Header}
	warmRead(b, e, w, req)
	// The limits read the same block files into the same buffers and
	// hash them: check them once.
	for _, limit := range []func(*layout.Snapshot, string, [][]byte) error{preadSHALimit, preadXXH3BlocksLimit} {
		clear(w.destMem.mem)
		if err := limit(snap, path, w.dest); err != nil {
			b.Fatal(err)
		}
		for i := range w.dest {
			if !bytes.Equal(w.dest[i], w.slots[i]) {
				b.Fatalf("block limit: slot %d differs from the saved bytes", i)
			}
		}
	}
	var xxTime time.Duration // pread + xxh3 of the same blocks, timed apart
	b.SetBytes(int64(w.logical))
	b.ReportAllocs()
	m := alternate(b, steps{
		ours: func(int) { do(b, e, req) },
		limit: func(i int) {
			t0 := time.Now()
			if err := preadXXH3BlocksLimit(snap, path, w.dest); err != nil {
				b.Fatal(err)
			}
			if i >= 0 {
				xxTime += time.Since(t0)
			}
			if err := preadSHALimit(snap, path, w.dest); err != nil {
				b.Fatal(err)
			}
		},
	})
	// m.limit timed both limits: x-limit is against pread + SHA-256 alone,
	// the original limit.
	m.limit -= xxTime
	m.report(b, int64(w.logical))
	b.ReportMetric(float64(m.objects)/float64(m.n)/float64(len(offs)), "allocs/block")
	b.ReportMetric(float64(w.logical)*float64(m.n)/xxTime.Seconds()/1e6, "pread-xxh3-MB/s")
	b.ReportMetric(float64(xxTime)/float64(m.ours), "x-pread-xxh3")
}

// collectBlocks is the size of the collect store: collectBlocks block files,
// half of them named by a manifest, half unreferenced.
const (
	collectBlocks     = 10000
	collectBlockBytes = jobs.MinBlockBytes // 4 KiB: the store stays small
)

// BenchmarkCollect: collect of a namespace of 10,000 block files, half
// unreferenced, against readdir of the same directories + unlink (on every
// core) of the same files. Target x-limit >= 0.5. SetBytes counts the bytes
// freed.
func BenchmarkCollect(b *testing.B) {
	tpl := getCollectTemplate(b)
	root, lim := mkdir(b, "collect"), mkdir(b, "collect-limit")
	e := newEngine(b, root, false)
	defer closeEngine(b, e)
	ns := func(i int) string { return fmt.Sprintf("c%d", i) }
	b.SetBytes(tpl.freed)
	b.ReportAllocs()
	m := alternate(b, steps{
		prepOurs: func(i int) {
			tpl.materialize(b, filepath.Join(root, ns(i)))
			settle(b, root)
		},
		ours: func(i int) {
			res := do(b, e, &engine.CollectRequest{Namespaces: []string{ns(i)}})
			if c := res.Metrics.Collect; c.BlocksDeleted != int64(len(tpl.victims)) || c.BlocksKept != int64(tpl.blocks-len(tpl.victims)) {
				b.Fatalf("collect deleted %d and kept %d blocks, want %d and %d", c.BlocksDeleted, c.BlocksKept, len(tpl.victims), tpl.blocks-len(tpl.victims))
			}
		},
		prepLimit: func(i int) {
			tpl.materialize(b, filepath.Join(lim, ns(i)))
			settle(b, lim)
		},
		limit: func(i int) {
			n, err := unlinkLimit(testutil.BlocksDir(filepath.Join(lim, ns(i))), tpl.victims)
			if err != nil || n != len(tpl.victims) {
				b.Fatalf("unlink limit removed %d files (want %d): %v", n, len(tpl.victims), err)
			}
		},
		cleanup: func(i int) {
			removeAll(b, filepath.Join(root, ns(i)))
			removeAll(b, filepath.Join(lim, ns(i)))
			settle(b, root)
		},
	})
	m.report(b, tpl.freed)
	if m.ours > 0 {
		b.ReportMetric(float64(len(tpl.victims))*float64(m.n)/m.ours.Seconds(), "unlinks/s")
	}
}

// collectTemplate is a namespace of collectBlocks real block files (written
// by the engine), half named by the manifest "live", half orphaned, kept in
// mmap'd memory so that each iteration can lay down a fresh copy.
type collectTemplate struct {
	files   []storeFile
	blocks  int             // block files
	victims map[string]bool // names of the unreferenced blocks
	freed   int64           // their bytes
	mem     *arena
}

type storeFile struct {
	rel  string // path under the namespace directory
	data []byte
}

// template is a value built once per process (a store laid out in
// memory), shared by every run of a benchmark.
type template[T any] struct {
	once sync.Once
	v    T
	err  error
}

// get builds the value the first time, and fails b if that failed.
func (t *template[T]) get(b *testing.B, build func() (T, error)) T {
	b.Helper()
	t.once.Do(func() { t.v, t.err = build() })
	if t.err != nil {
		b.Fatal(t.err)
	}
	return t.v
}

var collectTpl template[*collectTemplate]

func getCollectTemplate(b *testing.B) *collectTemplate {
	b.Helper()
	return collectTpl.get(b, func() (*collectTemplate, error) {
		return buildCollectTemplate(filepath.Join(benchRoot, "collect-template"), collectBlocks)
	})
}

// buildCollectTemplate saves, in a store at root, two snapshots of blocks/2
// distinct random blocks each (NoSync: it is set-up), deletes the second's
// manifest, reads the namespace back into memory and removes root.
func buildCollectTemplate(root string, blocks int) (*collectTemplate, error) {
	defer os.RemoveAll(root)
	e, err := engine.New(engine.Config{Root: root, NoSync: true, Logger: quietLogger})
	if err != nil {
		return nil, err
	}
	defer e.Close(context.Background())
	half := blocks / 2
	elems := collectBlockBytes / 2
	buf := make([]byte, half*collectBlockBytes)
	save := func(name string) (*layout.Header, error) {
		if _, err := rand.Read(buf); err != nil {
			return nil, err
		}
		v := viewOf(buf, []int{half, elems}, 2)
		res := e.Do(context.Background(), &engine.WriteRequest{
			Ref: engine.Ref{Namespace: "ns", Name: name}, Layout: layout.Blocks, BlockBytes: collectBlockBytes,
			Caches: []jobs.EntrySpec{{Tensors: []jobs.TensorSpec{{DType: "bfloat16", View: v}}}},
		})
		if res.Err != nil {
			return nil, res.Err
		}
		if res.Metrics.BlocksWritten != int64(half) {
			return nil, fmt.Errorf("collect template: %s wrote %d blocks, want %d", name, res.Metrics.BlocksWritten, half)
		}
		return res.Header, nil
	}
	if _, err := save("live"); err != nil {
		return nil, err
	}
	dead, err := save("dead")
	if err != nil {
		return nil, err
	}
	nsDir := filepath.Join(root, "ns")
	if err := os.Remove(filepath.Join(nsDir, "dead")); err != nil {
		return nil, err
	}
	t := &collectTemplate{blocks: 2 * half, victims: map[string]bool{}}
	for _, ref := range dead.Slots()[0].Blocks {
		t.victims[ref.Hash] = true
		t.freed += ref.Bytes
	}
	if t.files, t.mem, err = readTemplate(nsDir); err != nil {
		return nil, err
	}
	if len(t.files) != 2*half+2 { // + the manifest and the lock file
		return nil, fmt.Errorf("collect template: %d files, want %d", len(t.files), 2*half+2)
	}
	return t, nil
}

// readTemplate reads every file under nsDir into mmap'd memory (paths
// relative to nsDir), for materialize.
func readTemplate(nsDir string) ([]storeFile, *arena, error) {
	var total int
	var rels []string
	err := filepath.WalkDir(nsDir, func(p string, d os.DirEntry, err error) error {
		if err != nil || d.IsDir() {
			return err
		}
		info, err := d.Info()
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(nsDir, p)
		rels = append(rels, rel)
		total += alignPage(int(info.Size()))
		return nil
	})
	if err != nil {
		return nil, nil, err
	}
	mem, err := newArena(total)
	if err != nil {
		return nil, nil, err
	}
	var files []storeFile
	for _, rel := range rels {
		data, err := os.ReadFile(filepath.Join(nsDir, rel))
		if err != nil {
			return nil, nil, err
		}
		dst := mem.alloc(len(data))
		copy(dst, data)
		files = append(files, storeFile{rel: rel, data: dst})
	}
	return files, mem, nil
}

// materialize writes a fresh copy of the template's namespace at nsDir.
func (t *collectTemplate) materialize(tb testing.TB, nsDir string) {
	tb.Helper()
	materialize(tb, t.files, nsDir)
}

// materialize writes files (relative to nsDir) under nsDir.
func materialize(tb testing.TB, files []storeFile, nsDir string) {
	tb.Helper()
	made := map[string]bool{}
	for _, f := range files {
		p := filepath.Join(nsDir, f.rel)
		if d := filepath.Dir(p); !made[d] {
			if err := os.MkdirAll(d, layout.DirPerm); err != nil {
				tb.Fatal(err)
			}
			made[d] = true
		}
		if err := os.WriteFile(p, f.data, layout.FilePerm); err != nil {
			tb.Fatal(err)
		}
	}
}

// BenchmarkDispatch: submit-to-ack of a job that does no I/O (a collect of
// an empty namespace list: two lstat calls, no lock, no directory read),
// against the same job called directly (jobs.Collect). Reports ns/op, the
// 99th percentile latency (p99-ns), the direct call's ns (direct-ns) and
// x-limit = direct time / engine time.
func BenchmarkDispatch(b *testing.B) {
	root := mkdir(b, "dispatch")
	e := newEngine(b, root, false)
	defer closeEngine(b, e)
	ctx := context.Background()
	req := &engine.CollectRequest{Namespaces: []string{}}
	jcfg := &jobs.Config{Root: root, Logger: quietLogger}
	spec := &jobs.CollectRequest{Namespaces: []string{}}
	direct := func() {
		if _, err := jobs.Collect(ctx, jcfg, spec); err != nil {
			b.Fatal(err)
		}
	}
	for range 100 { // warm the pool's workers and the channels
		do(b, e, req)
		direct()
	}
	lat := make([]time.Duration, b.N)
	var ours, limit time.Duration
	runOurs := func(from, to int) {
		for i := from; i < to; i++ {
			t0 := time.Now()
			res := e.Do(ctx, req)
			d := time.Since(t0)
			if res.Err != nil {
				b.Fatal(res.Err)
			}
			lat[i] = d
			ours += d
		}
	}
	runLimit := func(n int) {
		b.StopTimer()
		t0 := time.Now()
		for range n {
			direct()
		}
		limit += time.Since(t0)
		b.StartTimer()
	}
	b.ReportAllocs()
	b.ResetTimer()
	const chunk = 256 // amortise StopTimer/StartTimer (each reads MemStats)
	for i, c := 0, 0; i < b.N; c++ {
		k := min(chunk, b.N-i)
		if c%2 == 0 {
			runOurs(i, i+k)
			runLimit(k)
		} else {
			runLimit(k)
			runOurs(i, i+k)
		}
		i += k
	}
	b.StopTimer()
	slices.Sort(lat)
	b.ReportMetric(float64(lat[min(len(lat)-1, len(lat)*99/100)].Nanoseconds()), "p99-ns")
	b.ReportMetric(float64(limit.Nanoseconds())/float64(b.N), "direct-ns")
	b.ReportMetric(float64(limit)/float64(ours), "x-limit")
}

// BenchmarkHash: the block hash, SHA-256, over 1 MiB blocks of a 64 MiB
// buffer on one core and on every core:
//   - sha256: minio/sha256-simd (what the engine uses; the benchmark's
//     timer and MB/s) beside crypto/sha256 (timed apart, alternating) on the
//     same bytes; reports minio-GB/s, crypto-GB/s and x-crypto = crypto
//     time / minio time;
//   - xxh3: xxh3-64 (the single-file tensor hash), for scale; reports GB/s.
func BenchmarkHash(b *testing.B) {
	const blockBytes, total = 1 << 20, 64 << 20
	buf := make([]byte, total)
	if _, err := rand.Read(buf); err != nil {
		b.Fatal(err)
	}
	var sums [total / blockBytes][32]byte
	var xs [total / blockBytes]uint64
	hashAll := func(cores int, fn func(k int)) {
		if cores == 1 {
			for k := range total / blockBytes {
				fn(k)
			}
			return
		}
		_ = parallelFor(total/blockBytes, func(k int) error { fn(k); return nil })
	}
	block := func(k int) []byte { return buf[k*blockBytes : (k+1)*blockBytes] }
	minio := func(k int) { sums[k] = sha256.Sum256(block(k)) }
	crypto := func(k int) {
		if s := cryptosha256.Sum256(block(k)); s != sums[k] {
			panic("crypto/sha256 and sha256-simd disagree") // never: both are SHA-256
		}
	}
	for _, cores := range []int{1, runtime.GOMAXPROCS(0)} {
		b.Run(fmt.Sprintf("sha256/cores=%d", cores), func(b *testing.B) {
			hashAll(cores, minio) // crypto compares against these sums
			b.SetBytes(total)
			b.ReportAllocs()
			var ours, other time.Duration
			runMinio := func() {
				b.StartTimer()
				t0 := time.Now()
				hashAll(cores, minio)
				ours += time.Since(t0)
				b.StopTimer()
			}
			runCrypto := func() {
				t0 := time.Now()
				hashAll(cores, crypto)
				other += time.Since(t0)
			}
			b.ResetTimer()
			b.StopTimer()
			for i := 0; i < b.N; i++ {
				if i%2 == 0 {
					runMinio()
					runCrypto()
				} else {
					runCrypto()
					runMinio()
				}
			}
			b.StartTimer()
			b.ReportMetric(float64(total)*float64(b.N)/ours.Seconds()/1e9, "minio-GB/s")
			b.ReportMetric(float64(total)*float64(b.N)/other.Seconds()/1e9, "crypto-GB/s")
			b.ReportMetric(float64(other)/float64(ours), "x-crypto")
		})
		b.Run(fmt.Sprintf("xxh3/cores=%d", cores), func(b *testing.B) {
			b.SetBytes(total)
			b.ReportAllocs()
			for b.Loop() {
				hashAll(cores, func(k int) { xs[k] = xxh3.Hash(block(k)) })
			}
			b.ReportMetric(float64(total)*float64(b.N)/b.Elapsed().Seconds()/1e9, "GB/s")
		})
	}
}
