package bench

import (
	cryptorand "crypto/rand"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"sync"
	"testing"

	"github.com/kvpersist/kvpersist/engine"
	"github.com/kvpersist/kvpersist/engine/gather"
	"github.com/kvpersist/kvpersist/engine/jobs"
	"github.com/kvpersist/kvpersist/engine/layout"
	"github.com/kvpersist/kvpersist/engine/pageindex"
	"github.com/kvpersist/kvpersist/engine/store"
	"github.com/kvpersist/kvpersist/engine/vfs"
	"github.com/kvpersist/kvpersist/internal/kvgen"
	"github.com/kvpersist/kvpersist/internal/testutil"
	"github.com/zeebo/xxh3"
	"golang.org/x/sys/unix"
)

// The prefix cache's rows: saves and loads of token pages at
// Llama-3.1-8B geometry, 8,192 tokens, P = 256; the index's lookup and
// rebuild.

// prefixTokens is the size of the prefix rows' cache.
const prefixTokens = 8192

const prefixIdentity = "llama-3.1-8b/bf16/tp0"

// tokenIDs returns n token ids of conversation seed.
func tokenIDs(n int, seed uint32) []uint32 {
	out := make([]uint32, n)
	for i := range out {
		out[i] = (seed*2654435761 + uint32(i)*40503) % 128256
	}
	return out
}

// kvSpecs is the K and V tensors of the first tokens tokens of c (the token
// ids attachment left out: the page holds them in its header).
func kvSpecs(c *kvgen.Cache, tokens int) []jobs.TensorSpec {
	views := c.ViewsAt(tokens)
	out := make([]jobs.TensorSpec, 2*c.Model.Layers)
	for i := range out {
		out[i] = jobs.TensorSpec{DType: c.Model.DType, View: views[i]}
	}
	return out
}

func savePrefixReq(c *kvgen.Cache, toks []uint32) *engine.SavePrefixRequest {
	return &engine.SavePrefixRequest{Namespace: "ns", Identity: prefixIdentity, Tokens: toks, Tensors: kvSpecs(c, len(toks))}
}

// BenchmarkPrefix: the prefix cache's save and load rows, each beside its
// limit in the same run:
//   - save-empty: 8,192 tokens into an empty store (32 pages), against a raw
//     write + fdatasync of the same number of bytes; target x-limit >= 0.9;
//   - save-grow: the conversation grown by 256 tokens after a save of
//     8,192: one new page; against a raw write + fdatasync of only that
//     page's bytes; target >= 0.8;
//   - load-warm-verified: 8,192 tokens loaded, verified, into fresh
//     capacity-padded views (8,448 tokens), page files in the page cache;
//     against pread + xxh3-64 of the same extents on every core into
//     contiguous buffers; target >= 0.75;
//   - load-warm-noverify: the same warm load with NoVerify (no xxh3-64 of
//     the tensors), against pread alone of the same extents on every
//     core: with load-warm-verified it tells what verification costs;
//   - load-cold-verified: the same load with the page files evicted from
//     the page cache before each iteration (as BenchmarkRestoreCold),
//     against O_DIRECT reads of the same page tensor extents at the best
//     of queue depths 1, 4, 16 and 32 (target >= 0.8, as a cold
//     single-file restore's).
func BenchmarkPrefix(b *testing.B) {
	w := getWorkload(b, benchModel, prefixTokens)
	local := func(root string) *engine.Engine { return newEngine(b, root, false) }
	b.Run("save-empty", func(b *testing.B) { benchPrefixSaveEmpty(b, w, local) })
	b.Run("save-grow", func(b *testing.B) { benchPrefixSaveGrow(b, w, local) })
	b.Run("load-warm-verified", func(b *testing.B) { benchPrefixLoad(b, w, false, true) })
	b.Run("load-warm-noverify", func(b *testing.B) { benchPrefixLoad(b, w, false, false) })
	b.Run("load-cold-verified", func(b *testing.B) { benchPrefixLoad(b, w, true, true) })
}

// benchPrefixSaveEmpty is the save-empty row of an engine on root made
// by newE (closed by the row).
func benchPrefixSaveEmpty(b *testing.B, w *workload, newE func(root string) *engine.Engine) {
	root, lim := mkdir(b, "prefix-save"), mkdir(b, "prefix-save-limit")
	e := newE(root)
	defer closeEngine(b, e)
	req := savePrefixReq(w.cache, tokenIDs(prefixTokens, 1))
	var written int64
	b.ReportAllocs()
	settle(b, root)
	m := alternate(b, steps{
		ours: func(int) {
			res := do(b, e, req)
			if res.Prefix.PagesWritten != prefixTokens/layout.DefaultPageTokens || res.Prefix.PagesReused != 0 {
				b.Fatalf("save into an empty store: %+v", res.Prefix)
			}
			written = res.Prefix.BytesWritten
		},
		limit:   rawSaveLimit(b, w, lim, &written),
		cleanup: cleanSave(b, root, lim),
	})
	b.SetBytes(written)
	m.report(b, written)
}

// rawSaveLimit is a save row's limit: a raw write + fdatasync of as many
// bytes as the save just wrote (*written), into lim.
func rawSaveLimit(b *testing.B, w *workload, lim string, written *int64) func(int) {
	return func(i int) {
		if err := rawWriteN(filepath.Join(lim, fmt.Sprintf("raw%d", i)), w.contig, *written); err != nil {
			b.Fatal(err)
		}
	}
}

// cleanSave removes a save row's namespace and its limit's file.
func cleanSave(b *testing.B, root, lim string) func(int) {
	return func(i int) {
		removeAll(b, filepath.Join(root, "ns"))
		removeAll(b, filepath.Join(lim, fmt.Sprintf("raw%d", i)))
		settle(b, root)
	}
}

// benchPrefixSaveGrow is the save-grow row of an engine on root made by
// newE (closed by the row).
func benchPrefixSaveGrow(b *testing.B, w *workload, newE func(root string) *engine.Engine) {
	root, lim := mkdir(b, "prefix-grow"), mkdir(b, "prefix-grow-limit")
	e := newE(root)
	defer closeEngine(b, e)
	toks := tokenIDs(prefixTokens+growTokens, 2)
	base, grown := savePrefixReq(w.cache, toks[:prefixTokens]), savePrefixReq(w.cache, toks)
	var written int64
	b.ReportAllocs()
	m := alternate(b, steps{
		prepOurs: func(int) {
			removeAll(b, filepath.Join(root, "ns"))
			do(b, e, base)
			settle(b, root)
		},
		ours: func(int) {
			res := do(b, e, grown)
			if res.Prefix.PagesWritten != 1 || res.Prefix.PagesReused != prefixTokens/layout.DefaultPageTokens {
				b.Fatalf("grown save: %+v", res.Prefix)
			}
			written = res.Prefix.BytesWritten
		},
		limit:   rawSaveLimit(b, w, lim, &written),
		cleanup: cleanSave(b, root, lim),
	})
	b.SetBytes(written)
	m.report(b, written)
}

// pageExtent is one tensor of one page file: where its bytes are.
type pageExtent struct {
	path  string
	off   int64
	bytes int
	hash  string
}

func benchPrefixLoad(b *testing.B, w *workload, cold, verify bool) {
	root := mkdir(b, "prefix-load")
	e := newEngine(b, root, false)
	defer closeEngine(b, e)
	toks := tokenIDs(prefixTokens, 3)
	saved := do(b, e, savePrefixReq(w.cache, toks))
	// The limit's extents: every tensor of every page, read into the
	// workload's contiguous restore buffers (page p of tensor t at its
	// logical place in slot t).
	var ext []pageExtent
	var dst [][]byte
	var files []string
	var cext []extent
	nsDir := filepath.Join(root, "ns")
	pageBytes := w.model.TensorBytes(layout.DefaultPageTokens)
	for p, k := range saved.Prefix.Keys {
		snap, err := layout.Load(vfs.Default, testutil.PagePath(nsDir, k))
		if err != nil {
			b.Fatal(err)
		}
		files = append(files, snap.Path)
		for t, tt := range snap.Header.Caches[0].Tensors {
			ext = append(ext, pageExtent{snap.Path, int64(snap.DataStart) + tt.Off, int(tt.Bytes), tt.Hash})
			cext = append(cext, extent{snap.Path, int64(snap.DataStart) + tt.Off, tt.Bytes})
			dst = append(dst, w.dest[t][p*pageBytes:(p+1)*pageBytes])
		}
	}
	// Destinations: capacity-padded (8,448 tokens), mmap'd.
	capT := kvgen.Capacity(prefixTokens)
	tb := w.model.TensorBytes(capT)
	mem, err := newArena(2 * w.model.Layers * alignPage(tb))
	if err != nil {
		b.Fatal(err)
	}
	defer func() { _ = mem.free() }()
	dest := make([]jobs.TensorSpec, 2*w.model.Layers)
	m := w.model
	for i := range dest {
		dest[i] = jobs.TensorSpec{DType: m.DType, View: gather.View{
			Base: mem.alloc(tb), Shape: []int{1, m.KVHeads, capT, m.HeadDim},
			Strides: []int{m.KVHeads * capT * m.HeadDim, capT * m.HeadDim, m.HeadDim, 1}, ItemSize: m.ItemSize,
		}}
	}
	req := &engine.LoadPrefixRequest{Namespace: "ns", Identity: prefixIdentity, Tokens: toks, Dest: dest, NoVerify: !verify}
	logical := int64(2 * m.Layers * m.TensorBytes(prefixTokens))
	var c *coldState
	var direct, async, read int64
	s := steps{
		ours: func(int) {
			res := do(b, e, req)
			if res.Prefix.Tokens != prefixTokens || res.Prefix.Stop != nil {
				b.Fatalf("load: %+v", res.Prefix)
			}
			direct, async, read = res.Metrics.DirectReadBytes, res.Metrics.AsyncReadBytes, res.Metrics.ReadBytes
		},
		limit: func(int) {
			if err := preadHashLimit(ext, dst, verify); err != nil {
				b.Fatal(err)
			}
		},
	}
	if !cold {
		// Warm means warm for both sides: on this shared machine other
		// work may drop the page cache between iterations, and a page
		// file not wholly cached is read with O_DIRECT by the engine
		// (and from the disk by the limit). Untimed.
		s.prepOurs = func(int) { warmFiles(b, files) }
		s.prepLimit = s.prepOurs
	}
	if cold {
		c = coldStateOf(b, files, cext, logical)
		c.evict(b)
		if n, err := residentPages(files); err != nil || n > len(files) {
			b.Fatalf("after evicting: %d pages of the page files still cached (%v)", n, err)
		}
		s.prepOurs = func(int) { c.evict(b) }
		s.limit = func(i int) { c.limit(b, i >= 0) }
	}
	b.SetBytes(logical)
	b.ReportAllocs()
	mm := alternate(b, s)
	b.StopTimer() // the checks below are not the load's time
	if cold {
		mm.limit, _ = c.best()
	}
	mm.report(b, logical)
	if cold {
		c.report(b, mm.n)
		_, qd := c.best()
		b.ReportMetric(float64(qd), "best-qd")
	}
	b.ReportMetric(float64(direct)/float64(max(read, 1)), "direct/read")
	b.ReportMetric(float64(async)/float64(max(read, 1)), "async/read")
	checkLoaded(b, w, dest, capT, prefixTokens)
	b.StartTimer()
}

// warmFiles reads every file that is not wholly in the page cache
// (mincore), so that it is.
func warmFiles(b *testing.B, files []string) {
	for _, p := range files {
		if n, err := residentPages([]string{p}); err != nil {
			b.Fatal(err)
		} else if fi, err := os.Stat(p); err != nil {
			b.Fatal(err)
		} else if int64(n) < (fi.Size()+pageBytes-1)/pageBytes {
			f, err := os.Open(p)
			if err != nil {
				b.Fatal(err)
			}
			_, err = io.CopyBuffer(io.Discard, struct{ io.Reader }{f}, make([]byte, 1<<20)) // not the heap's peak: 1 MiB
			f.Close()
			if err != nil {
				b.Fatal(err)
			}
		}
	}
}

// preadHashLimit is the load limit: pread of every extent into its
// contiguous buffer and, with hash, xxh3-64 of it, on every core; each
// hash is checked (the limit reads the bytes the engine reads).
func preadHashLimit(ext []pageExtent, dst [][]byte, hash bool) error {
	files := map[string]*os.File{}
	for _, x := range ext {
		if files[x.path] == nil {
			f, err := os.Open(x.path)
			if err != nil {
				return err
			}
			defer f.Close()
			files[x.path] = f
		}
	}
	return parallelFor(len(ext), func(i int) error {
		x := ext[i]
		fd := int(files[x.path].Fd())
		b, off := dst[i][:x.bytes], x.off
		for len(b) > 0 {
			n, err := unix.Pread(fd, b, off)
			if err == unix.EINTR {
				continue
			}
			if err != nil {
				return err
			}
			if n == 0 {
				return fmt.Errorf("%s: short file", x.path)
			}
			b, off = b[n:], off+int64(n)
		}
		if hash && layout.TensorHash(xxh3.Hash(dst[i][:x.bytes])) != x.hash {
			return fmt.Errorf("%s: hash differs", x.path)
		}
		return nil
	})
}

// BenchmarkPrefixLookup: the index's lookup of a 32,768-token prompt (128
// pages of 256 tokens, every one stored) among 1,000,000 indexed pages.
// Goals: < 100 µs, 0 allocs/op, <= 100 index bytes per page (B/page: the
// heap the index holds, measured when it is built, over its pages).
func BenchmarkPrefixLookup(b *testing.B) {
	prompt := tokenIDs(32768, 4)
	x, perPage := lookupIndex(b, prompt)
	b.ReportAllocs()
	b.ResetTimer()
	for b.Loop() {
		if n, err := x.Lookup("ns", prefixIdentity, layout.DefaultPageTokens, prompt); err != nil || n != len(prompt) {
			b.Fatalf("lookup: %d %v", n, err)
		}
	}
	b.ReportMetric(perPage, "B/page")
	runtime.KeepAlive(x)
}

// BenchmarkPrefixLookupFrom: the same index, the prompt grown by 256
// tokens (one page, stored too) looked up by a caller that holds the 128
// pages' keys from its last turn (pageindex.LookupFrom: one page hashed,
// 129 probed). Goals: < 10 µs, 0 allocs/op.
func BenchmarkPrefixLookupFrom(b *testing.B) {
	prompt := tokenIDs(32768+layout.DefaultPageTokens, 4)
	x, _ := lookupIndex(b, prompt)
	known, _, err := layout.PageChain(prefixIdentity, layout.DefaultPageTokens, prompt[:32768])
	if err != nil {
		b.Fatal(err)
	}
	held := make([]layout.PageKey, len(known), len(known)+1)
	copy(held, known)
	b.ReportAllocs()
	b.ResetTimer()
	for b.Loop() {
		n, _, chain, err := x.LookupFrom("ns", prefixIdentity, layout.DefaultPageTokens, held[:len(known)], prompt)
		if err != nil || n != len(prompt) || len(chain) != len(known)+1 {
			b.Fatalf("lookup: %d tokens, %d keys, %v", n, len(chain), err)
		}
	}
	runtime.KeepAlive(x)
}

// lookupIndex is an index of 1,000,000 pages of namespace "ns": the pages
// of prompt (P = 256) and random keys, added as saves add them, a few at a
// time; and the heap it holds per page, in bytes.
func lookupIndex(b *testing.B, prompt []uint32) (*pageindex.Index, float64) {
	const pages = 1_000_000
	chain, _, err := layout.PageChain(prefixIdentity, layout.DefaultPageTokens, prompt)
	if err != nil {
		b.Fatal(err)
	}
	keys := make([]layout.PageKey, pages-len(chain))
	for i := range keys {
		_, _ = cryptorand.Read(keys[i][:])
	}
	var m0, m1 runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&m0)
	x := pageindex.New()
	for i := 0; i < len(keys); i += 4096 {
		x.Add("ns", keys[i:min(len(keys), i+4096)]...)
	}
	x.Add("ns", chain...)
	runtime.GC()
	runtime.ReadMemStats(&m1)
	if x.Len("ns") != pages {
		b.Fatalf("index holds %d pages", x.Len("ns"))
	}
	return x, float64(m1.HeapAlloc-m0.HeapAlloc) / pages
}

// BenchmarkPrefixIndexBuild: the index rebuilt at engine start from
// 100,000 page files (names only: empty files). Goal < 2 s.
func BenchmarkPrefixIndexBuild(b *testing.B) {
	const pages = 100_000
	root := getIndexStore(b, pages)
	b.ReportAllocs()
	b.ResetTimer()
	for b.Loop() {
		_, st, err := pageindex.Build(store.At(root, store.Options{}))
		if err != nil || st.Pages != pages {
			b.Fatalf("build: %+v %v", st, err)
		}
	}
	b.ReportMetric(float64(pages)*float64(b.N)/b.Elapsed().Seconds(), "pages/s")
}

var (
	indexStoreOnce sync.Once
	indexStoreRoot string
	indexStoreErr  error
)

// getIndexStore lays out (once per process) a store of n empty page files
// in one namespace.
func getIndexStore(b *testing.B, n int) string {
	indexStoreOnce.Do(func() {
		root := mkdir(b, "prefix-index")
		pagesDir := testutil.PagesDir(filepath.Join(root, "ns"))
		made := map[string]bool{}
		for range n {
			var k layout.PageKey
			_, _ = cryptorand.Read(k[:])
			p := testutil.PagePath(filepath.Dir(pagesDir), k)
			if d := filepath.Dir(p); !made[d] {
				if indexStoreErr = os.MkdirAll(d, 0o750); indexStoreErr != nil {
					return
				}
				made[d] = true
			}
			if indexStoreErr = os.WriteFile(p, nil, 0o640); indexStoreErr != nil {
				return
			}
		}
		indexStoreRoot = root
	})
	if indexStoreErr != nil {
		b.Fatal(indexStoreErr)
	}
	return indexStoreRoot
}

// TestPrefixSharedPrefixWritesNewPagesOnly: a second conversation sharing a
// 4,096-token prefix with the first writes exactly its non-shared pages:
// its bytes written equal the sizes of the page files it added, which are
// the pages of its own tokens past the shared 4,096, and the 16 shared
// pages are reused.
func TestPrefixSharedPrefixWritesNewPagesOnly(t *testing.T) {
	root := t.TempDir()
	e := newEngine(t, root, true)
	defer closeEngine(t, e)
	m := kvgen.Tiny
	shared := tokenIDs(4096, 5)
	a := append(slices.Clone(shared), tokenIDs(1000, 6)...)
	bt := append(slices.Clone(shared), tokenIDs(700, 7)...)
	c := kvgen.NewCache(m, 5096, true, nil)
	ra := do(t, e, &engine.SavePrefixRequest{Namespace: "ns", Identity: "tiny", Tokens: a, Tensors: kvSpecs(c, len(a))})
	before := listPages(t, filepath.Join(root, "ns"))
	rb := do(t, e, &engine.SavePrefixRequest{Namespace: "ns", Identity: "tiny", Tokens: bt, Tensors: kvSpecs(c, len(bt))})
	after := listPages(t, filepath.Join(root, "ns"))
	var added int64
	var addedKeys []string
	for k, sz := range after {
		if _, ok := before[k]; !ok {
			added += sz
			addedKeys = append(addedKeys, k)
		}
	}
	var own []string
	for _, k := range rb.Prefix.Keys[16:] {
		own = append(own, k.String())
	}
	slices.Sort(addedKeys)
	slices.Sort(own)
	if !slices.Equal(addedKeys, own) {
		t.Fatalf("added page files %v, want the second conversation's own pages %v", addedKeys, own)
	}
	var sharedBytes int64
	for i, k := range rb.Prefix.Keys[:16] {
		if k != ra.Prefix.Keys[i] {
			t.Fatalf("shared page %d has another key", i)
		}
		sharedBytes += after[k.String()]
	}
	if rb.Prefix.BytesWritten != added || rb.Prefix.PagesWritten != 3 || rb.Prefix.PagesReused != 16 || rb.Prefix.BytesReused != sharedBytes {
		t.Fatalf("second conversation: %+v; its new page files hold %d bytes, the shared pages %d", rb.Prefix, added, sharedBytes)
	}
}

func listPages(t *testing.T, nsDir string) map[string]int64 {
	t.Helper()
	out := map[string]int64{}
	err := filepath.WalkDir(testutil.PagesDir(nsDir), func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.Type().IsRegular() {
			fi, err := d.Info()
			if err != nil {
				return err
			}
			out[d.Name()] = fi.Size()
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return out
}
