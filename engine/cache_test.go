package engine

import (
	"bytes"
	"errors"
	"log/slog"
	"maps"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/kvpersist/kvpersist/engine/evict"
	"github.com/kvpersist/kvpersist/engine/layout"
	"github.com/kvpersist/kvpersist/engine/metrics/labels"
	"github.com/kvpersist/kvpersist/engine/vfs"
	"github.com/kvpersist/kvpersist/internal/kvgen"
	"github.com/kvpersist/kvpersist/internal/testutil"
)

// The bounded page cache through the engine: accounting against the disk,
// the capacity bound under concurrent saves, leaves before ancestors,
// pins, quotas, a full disk, headroom, recency across a restart.

const (
	cP   = 64  // tokens per page in these tests
	cMax = 512 // tokens of the shared test cache
)

func pageTree(t testing.TB, root string) (alloc int64, pages, temps int) {
	t.Helper()
	pb, tb, pages, temps := testutil.PageTree(t, root)
	return pb + tb, pages, temps
}

// convTokens: sys tokens of a system prompt shared by every conversation,
// then own tokens of conversation conv.
func convTokens(sys, own int, conv uint32) []uint32 {
	out := make([]uint32, 0, sys+own)
	for i := range sys {
		out = append(out, 7_000_000+uint32(i))
	}
	for i := range own {
		out = append(out, conv<<20+uint32(i))
	}
	return out
}

func savePages(e *Engine, ns string, toks []uint32) Result {
	c, _ := cacheOf(kvgen.Tiny, cMax, true)
	return e.Do(bg, &SavePrefixRequest{Namespace: ns, Identity: "tiny", Tokens: toks, Tensors: kvTensors(c), PageTokens: cP})
}

func mustSavePages(t testing.TB, e *Engine, ns string, toks []uint32) Result {
	t.Helper()
	r := savePages(e, ns, toks)
	if r.Err != nil {
		t.Fatalf("save of %d tokens to %s: %v", len(toks), ns, r.Err)
	}
	return r
}

// loadPages loads toks from ns into fresh padded destinations, verified,
// checks every loaded byte against the cache, and returns the tokens
// loaded.
func loadPages(t testing.TB, e *Engine, ns string, toks []uint32) int {
	t.Helper()
	c, _ := cacheOf(kvgen.Tiny, cMax, true)
	bufs, dest := paddedDest(kvgen.Tiny, cMax, func(n int) []byte { return make([]byte, n) })
	r := e.Do(bg, &LoadPrefixRequest{Namespace: ns, Identity: "tiny", Tokens: toks, Dest: dest, PageTokens: cP})
	if r.Err != nil || r.Prefix.Stop != nil {
		t.Fatalf("load of %d tokens from %s: %v (stop %v)", len(toks), ns, r.Err, r.Prefix.Stop)
	}
	if tt, ok := t.(*testing.T); ok {
		checkLoaded(tt, c, bufs, cMax, r.Prefix.Tokens)
	}
	return r.Prefix.Tokens
}

// pageBytes is the allocated bytes of one full page of these tests,
// measured on disk.
func pageBytes(t testing.TB) int64 {
	t.Helper()
	root := t.TempDir()
	e := newEngine(t, Config{Root: root, Workers: 1})
	mustSavePages(t, e, "m", convTokens(0, cP, 1))
	alloc, pages, _ := pageTree(t, root)
	if pages != 1 || alloc <= 0 {
		t.Fatalf("one page: %d pages, %d bytes", pages, alloc)
	}
	return alloc
}

// checkAccounting asserts Usage equals the page files on disk: bytes and
// pages, in total and per namespace, nothing reserved or evicting.
func checkAccounting(t testing.TB, e *Engine, root string) {
	t.Helper()
	u := e.Usage()
	alloc, _, pages, _ := testutil.PageTree(t, root)
	if u.UsedBytes != alloc || u.Pages != pages || u.ReservedBytes != 0 || u.EvictingBytes != 0 {
		t.Fatalf("usage %d bytes in %d pages (reserved %d, evicting %d); the disk holds %d bytes in %d page files",
			u.UsedBytes, u.Pages, u.ReservedBytes, u.EvictingBytes, alloc, pages)
	}
	for _, n := range u.Namespaces {
		a, _, p, _ := testutil.PageTree(t, root, n.Name)
		if n.UsedBytes != a || n.Pages != p {
			t.Fatalf("namespace %s: usage %d bytes in %d pages; the disk holds %d bytes in %d", n.Name, n.UsedBytes, n.Pages, a, p)
		}
	}
}

// nsUsage is namespace ns's part of e's Usage.
func nsUsage(e *Engine, ns string) NamespaceUsage {
	for _, n := range e.Usage().Namespaces {
		if n.Name == ns {
			return n
		}
	}
	return NamespaceUsage{Name: ns}
}

// waitFor polls cond (the background goroutine's work) until it holds or
// the guard fires.
func waitFor(t testing.TB, what string, cond func() bool) {
	t.Helper()
	guard := guardTimer()
	for !cond() {
		select {
		case <-guard:
			t.Fatalf("timed out waiting for %s", what)
		case <-time.After(time.Millisecond):
		}
	}
}

// sink is a MetricsSink that records the page cache's calls.
type sink struct {
	NopMetrics
	mu       sync.Mutex
	evicted  map[evict.Reason][2]int64
	refused  map[evict.Reason]int
	hit, mis int64
	jobs     map[labels.Kind]int
}

func newSink() *sink {
	return &sink{evicted: map[evict.Reason][2]int64{}, refused: map[evict.Reason]int{}, jobs: map[labels.Kind]int{}}
}
func (s *sink) Job(k labels.Kind, o labels.Outcome, d time.Duration, ran bool) {
	s.mu.Lock()
	s.jobs[k]++
	s.mu.Unlock()
}
func (s *sink) Bytes(w, r, rd int64) {}
func (s *sink) DirectRead(n int64)   {}
func (s *sink) AsyncRead(n int64)    {}
func (s *sink) Lookup(h, m int64) {
	s.mu.Lock()
	s.hit += h
	s.mis += m
	s.mu.Unlock()
}
func (s *sink) Evicted(r evict.Reason, pages, bytes int64) {
	s.mu.Lock()
	v := s.evicted[r]
	s.evicted[r] = [2]int64{v[0] + pages, v[1] + bytes}
	s.mu.Unlock()
}
func (s *sink) evictedOf(r evict.Reason) [2]int64 {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.evicted[r]
}

func (s *sink) Refused(l evict.Reason) {
	s.mu.Lock()
	s.refused[l]++
	s.mu.Unlock()
}

// TestCacheAccountingEqualsDisk: Usage equals a walk of the page files'
// st_blocks after saves, a named pages write, a restart with a capacity
// (background eviction), a page removed behind the engine's back and a
// collect, and another restart.
func TestCacheAccountingEqualsDisk(t *testing.T) {
	pb := pageBytes(t)
	root := t.TempDir()
	e := newEngine(t, Config{Root: root, Workers: 2})
	for c := range uint32(3) {
		mustSavePages(t, e, "a", convTokens(128, 128, c+1))
	}
	mustSavePages(t, e, "b", convTokens(0, 256, 9))
	mustDo(t, e, namedPages("b", "named", convTokens(0, 320, 10)))
	checkAccounting(t, e, root)
	if u := nsUsage(e, "a"); u.Pages != 8 || u.UsedBytes != 8*pb {
		t.Fatalf("namespace a: %+v, want 8 pages of %d bytes", u, pb)
	}
	if err := e.Close(bg); err != nil {
		t.Fatal(err)
	}
	// Restart with room for 12 pages: 8 + 4 + 5 = 17 are stored; the 5 of
	// the named snapshot are pinned; 5 of the others go, leaves first and
	// least recently used first: the tails of conversations 1 and 2 and the
	// leaf of 3. The system prompt's 2 pages, the oldest, stay.
	s := newSink()
	e2 := newEngine(t, Config{Root: root, Workers: 2, CapacityBytes: 12 * pb, Metrics: s})
	waitFor(t, "background eviction", func() bool { return s.evictedOf(evict.ReasonShrink)[0] == 5 })
	checkAccounting(t, e2, root)
	if got := s.evictedOf(evict.ReasonShrink); got != [2]int64{5, 5 * pb} {
		t.Fatalf("evicted (shrink): %v, want 5 pages, %d bytes", got, 5*pb)
	}
	for c, want := range []int{128, 128, 192} {
		if n, _ := e2.Lookup("a", "tiny", cP, convTokens(128, 128, uint32(c+1))); n != want {
			t.Fatalf("conversation %d after the shrink: %d tokens, want %d", c+1, n, want)
		}
	}
	dest := destOf(kvgen.Tiny, 320)
	mustDo(t, e2, &ReadRequest{Ref: refOf("b", "named"), Dest: dest})
	// A page removed behind the engine's back; a collect resyncs.
	keys, _, _ := layout.PageChain("tiny", cP, convTokens(128, 128, 1))
	if err := os.Remove(testutil.PagePath(filepath.Join(root, "a"), keys[0])); err != nil {
		t.Fatal(err)
	}
	mustDo(t, e2, &CollectRequest{})
	checkAccounting(t, e2, root)
	if err := e2.Close(bg); err != nil {
		t.Fatal(err)
	}
	e3 := newEngine(t, Config{Root: root, Workers: 1})
	checkAccounting(t, e3, root)
}

// namedPages is a layout.Pages write of the first tokens of toks as ns/name.
func namedPages(ns, name string, toks []uint32) *WriteRequest {
	c, _ := cacheOf(kvgen.Tiny, len(toks), false)
	req := writeReq(refOf(ns, name), c, layout.Pages, 0)
	req.Identity, req.Tokens, req.PageTokens = "tiny", toks, cP
	return req
}

// TestCacheConcurrentSavesBound: four saves in flight at a time, into a
// cache with room for 10 pages, never take the page tree (page and temp
// files, st_blocks measured by a walk beside them) past CapacityBytes + S×P
// (S = 4 saves in flight, P one page), the bound stated on
// Config.CapacityBytes. Without reservations the tree grows to 96 pages.
func TestCacheConcurrentSavesBound(t *testing.T) {
	pb := pageBytes(t)
	root := t.TempDir()
	const capPages, savers, convs = 10, 4, 6
	e := newEngine(t, Config{Root: root, Workers: 2, CapacityBytes: capPages * pb})
	var stop atomic.Bool
	var peak atomic.Int64
	sampled := make(chan struct{})
	go func() {
		defer close(sampled)
		for !stop.Load() {
			a, _, _ := pageTree(t, root)
			if a > peak.Load() {
				peak.Store(a)
			}
		}
	}()
	var wg sync.WaitGroup
	errs := make(chan error, savers*convs)
	for s := range savers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for c := range convs {
				if r := savePages(e, "p", convTokens(0, 4*cP, uint32(100*s+c))); r.Err != nil {
					errs <- r.Err
				}
			}
		}()
	}
	wg.Wait()
	stop.Store(true)
	<-sampled
	close(errs)
	for err := range errs {
		t.Fatalf("save: %v", err)
	}
	if bound := capPages*pb + savers*pb; peak.Load() > bound {
		t.Fatalf("the page tree reached %d bytes, above capacity %d + %d saves × %d", peak.Load(), capPages*pb, savers, pb)
	}
	waitFor(t, "evictions", func() bool { return e.Usage().EvictingBytes == 0 })
	checkAccounting(t, e, root)
	if u := e.Usage(); u.UsedBytes > capPages*pb {
		t.Fatalf("used %d > capacity %d", u.UsedBytes, capPages*pb)
	}
	t.Logf("peak %d bytes = %.2f pages (capacity %d pages)", peak.Load(), float64(peak.Load())/float64(pb), capPages)
}

// TestCacheLeavesBeforeAncestors: conversations sharing a 2-page system
// prompt, saved one after another into room for 7 pages: evictions take
// the oldest conversations' tails, never the system prompt, though its
// pages are the oldest (plain LRU would evict them first).
func TestCacheLeavesBeforeAncestors(t *testing.T) {
	pb := pageBytes(t)
	root := t.TempDir()
	e := newEngine(t, Config{Root: root, Workers: 1, CapacityBytes: 7 * pb})
	convs := make([][]uint32, 5)
	for c := range convs {
		convs[c] = convTokens(2*cP, 2*cP, uint32(c+1))
		mustSavePages(t, e, "p", convs[c])
	}
	// 2 + 5×2 = 12 pages written; 5 evicted: the tails of 1 and 2, then
	// the last page of 3 (the oldest leaf).
	want := []int{2 * cP, 2 * cP, 3 * cP, 4 * cP, 4 * cP}
	for c, w := range want {
		if n, _ := e.Lookup("p", "tiny", cP, convs[c]); n != w {
			t.Fatalf("conversation %d: %d tokens stored, want %d", c+1, n, w)
		}
		if n := loadPages(t, e, "p", convs[c]); n != w {
			t.Fatalf("conversation %d: %d tokens loaded, want %d", c+1, n, w)
		}
	}
	checkAccounting(t, e, root)
}

// TestCacheNoSpace: a save that cannot make room fails with ErrNoSpace
// naming the limit, writes nothing and leaves every page intact: larger
// than the capacity, and everything pinned by a named snapshot. Deleting
// the snapshot releases its pages.
func TestCacheNoSpace(t *testing.T) {
	pb := pageBytes(t)
	root := t.TempDir()
	s := newSink()
	e := newEngine(t, Config{Root: root, Workers: 1, CapacityBytes: 5 * pb, Metrics: s})
	r := savePages(e, "p", convTokens(0, 6*cP, 1))
	var nse *evict.NoSpaceError
	if !errors.Is(r.Err, ErrNoSpace) || !errors.As(r.Err, &nse) || nse.Limit != evict.ReasonCapacity || nse.Namespace != "p" || nse.RequestBytes != 6*pb {
		t.Fatalf("a save larger than the capacity: %v", r.Err)
	}
	if _, pages, temps := pageTree(t, root); pages+temps != 0 {
		t.Fatalf("a refused save left %d pages, %d temp files", pages, temps)
	}
	// A named snapshot of 4 pages pins them; a save of 2 new pages finds
	// 1 page of room and nothing evictable.
	mustDo(t, e, namedPages("p", "named", convTokens(0, 4*cP, 2)))
	before := testutil.TreeDigest(t, root)
	r = savePages(e, "p", convTokens(0, 2*cP, 3))
	if !errors.As(r.Err, &nse) || nse.Limit != evict.ReasonCapacity {
		t.Fatalf("a save with every page pinned: %v", r.Err)
	}
	if after := testutil.TreeDigest(t, root); !maps.Equal(after, before) {
		t.Fatalf("a refused save changed the store")
	}
	if s.refused[evict.ReasonCapacity] != 2 || s.jobs[labels.KindSave] != 2 {
		t.Fatalf("metrics: refused %v, save jobs %d", s.refused, s.jobs[labels.KindSave])
	}
	dest := destOf(kvgen.Tiny, 4*cP)
	mustDo(t, e, &ReadRequest{Ref: refOf("p", "named"), Dest: dest})
	// Without the snapshot its pages may go.
	mustDo(t, e, &DeleteRequest{Ref: refOf("p", "named")})
	mustSavePages(t, e, "p", convTokens(0, 2*cP, 3))
	if got := s.evictedOf(evict.ReasonCapacity); got[0] != 1 {
		t.Fatalf("evicted for capacity: %v, want 1 page", got)
	}
	checkAccounting(t, e, root)
}

// TestCacheLoadPinsPages: while a load holds its pages pinned, a save
// that needs them evicted fails; once the load is done it succeeds.
func TestCacheLoadPinsPages(t *testing.T) {
	pb := pageBytes(t)
	root := t.TempDir()
	e := newEngine(t, Config{Root: root, Workers: 1, CapacityBytes: 2 * pb})
	toks := convTokens(0, 2*cP, 1)
	mustSavePages(t, e, "p", toks)
	keys, _, _ := layout.PageChain("tiny", cP, toks)
	done := e.pc.PinChain("p", keys).Done
	if r := savePages(e, "p", convTokens(0, cP, 2)); !errors.Is(r.Err, ErrNoSpace) {
		t.Fatalf("a save needing a page a load holds: %v", r.Err)
	}
	done(keys, true)
	mustSavePages(t, e, "p", convTokens(0, cP, 2))
	if n, _ := e.Lookup("p", "tiny", cP, toks); n != cP {
		t.Fatalf("after the load: %d tokens of the first conversation stored, want %d (its leaf evicted)", n, cP)
	}
	checkAccounting(t, e, root)
}

// TestCacheQuota: a tenant within its quota is never evicted for another
// namespace's save; a tenant above its quota evicts its own pages.
func TestCacheQuota(t *testing.T) {
	pb := pageBytes(t)
	root := t.TempDir()
	s := newSink()
	e := newEngine(t, Config{Root: root, Workers: 1, CapacityBytes: 8 * pb, QuotaBytes: map[string]int64{"a": 4 * pb}, Metrics: s})
	a1 := convTokens(0, 4*cP, 1)
	mustSavePages(t, e, "a", a1)
	mustSavePages(t, e, "b", convTokens(0, 4*cP, 2))
	// b needs 2 more pages: only b's own may go (a is within its quota,
	// though its pages are older).
	mustSavePages(t, e, "b", convTokens(0, 2*cP, 3))
	if n, _ := e.Lookup("a", "tiny", cP, a1); n != 4*cP {
		t.Fatalf("tenant a lost pages to b: %d tokens left", n)
	}
	if u := nsUsage(e, "b"); u.Pages != 4 {
		t.Fatalf("b: %d pages, want 4", u.Pages)
	}
	// a beyond its quota evicts its own oldest leaves.
	mustSavePages(t, e, "a", convTokens(0, 2*cP, 4))
	if u := nsUsage(e, "a"); u.UsedBytes != 4*pb || u.QuotaBytes != 4*pb {
		t.Fatalf("a: %+v", u)
	}
	if n, _ := e.Lookup("a", "tiny", cP, a1); n != 2*cP {
		t.Fatalf("a's first conversation: %d tokens, want %d", n, 2*cP)
	}
	if got := s.evictedOf(evict.ReasonQuota); got[0] != 2 {
		t.Fatalf("evicted for quota: %v", got)
	}
	checkAccounting(t, e, root)
}

// TestCacheFullDisk: a file system that refuses writes with ENOSPC fails
// the save cleanly (no temp file, nothing reserved, the accounting equal
// to the disk) and loads are still served.
func TestCacheFullDisk(t *testing.T) {
	root := t.TempDir()
	ffs := testutil.NewFaultFS(nil)
	e := newEngine(t, Config{Root: root, Workers: 2, FS: ffs})
	toks := convTokens(0, 3*cP, 1)
	mustSavePages(t, e, "p", toks)
	ffs.FailPath(testutil.OpWriteAt, "/pages/", syscall.ENOSPC)
	r := savePages(e, "p", convTokens(0, 3*cP, 2))
	if !errors.Is(r.Err, syscall.ENOSPC) {
		t.Fatalf("save on a full disk: %v", r.Err)
	}
	if _, _, temps := pageTree(t, root); temps != 0 {
		t.Fatalf("%d temp files left", temps)
	}
	checkAccounting(t, e, root)
	if n := loadPages(t, e, "p", toks); n != 3*cP {
		t.Fatalf("load on a full disk: %d tokens", n)
	}
	ffs.ClearFaults()
	mustSavePages(t, e, "p", convTokens(0, 3*cP, 2))
	checkAccounting(t, e, root)
}

// TestCacheHeadroom: below the headroom a save evicts first; when the
// victims cannot free enough, it fails with limit "headroom", evicting
// nothing.
func TestCacheHeadroom(t *testing.T) {
	pb := pageBytes(t)
	root := t.TempDir()
	ffs := testutil.NewFaultFS(nil)
	s := newSink()
	const headroom = 1 << 20
	e := newEngine(t, Config{Root: root, Workers: 1, FS: ffs, HeadroomBytes: headroom, Metrics: s})
	ffs.LimitAvail(headroom + 4*pb)
	c1, c2 := convTokens(0, 4*cP, 1), convTokens(0, 4*cP, 2)
	mustSavePages(t, e, "p", c1)
	// c1 took the 4 pages of free space above the headroom: c2 needs
	// c1's pages gone.
	ffs.LimitAvail(headroom)
	mustSavePages(t, e, "p", c2)
	if got := s.evictedOf(evict.ReasonHeadroom); got != [2]int64{4, 4 * pb} {
		t.Fatalf("evicted for headroom: %v", got)
	}
	if n, _ := e.Lookup("p", "tiny", cP, c1); n != 0 {
		t.Fatalf("c1: %d tokens left", n)
	}
	// No free space at all: 4 evictable pages cannot make 1 MiB + 4 pages.
	ffs.LimitAvail(0)
	before := testutil.TreeDigest(t, root)
	r := savePages(e, "p", convTokens(0, 4*cP, 3))
	var nse *evict.NoSpaceError
	if !errors.As(r.Err, &nse) || nse.Limit != evict.ReasonHeadroom {
		t.Fatalf("save below the headroom: %v", r.Err)
	}
	if !maps.Equal(testutil.TreeDigest(t, root), before) {
		t.Fatalf("a refused save changed the store")
	}
	if n := loadPages(t, e, "p", c2); n != 4*cP {
		t.Fatalf("c2 after the refusal: %d tokens", n)
	}
	checkAccounting(t, e, root)
}

// TestCacheRecencySurvivesRestart: the checkpoint written at Close keeps
// the loads' recency: conversation 1, written first but loaded last,
// outlives conversation 2 when a restart with a smaller capacity evicts.
// A corrupt checkpoint is ignored with a log line, and the pages are then
// ordered by their mtimes (conversation 1 goes first).
func TestCacheRecencySurvivesRestart(t *testing.T) {
	pb := pageBytes(t)
	for _, corrupt := range []bool{false, true} {
		root := t.TempDir()
		e := newEngine(t, Config{Root: root, Workers: 1})
		convs := [][]uint32{convTokens(0, 2*cP, 1), convTokens(0, 2*cP, 2), convTokens(0, 2*cP, 3)}
		for _, c := range convs {
			mustSavePages(t, e, "p", c)
		}
		loadPages(t, e, "p", convs[0])
		if err := e.Close(bg); err != nil {
			t.Fatal(err)
		}
		// mtimes one second apart, in the order of the saves (the clock's
		// tick could give two saves the same mtime).
		base := time.Now().Add(-time.Hour)
		for i, c := range convs {
			keys, _, _ := layout.PageChain("tiny", cP, c)
			for _, k := range keys {
				at := base.Add(time.Duration(i) * time.Second)
				if err := os.Chtimes(testutil.PagePath(filepath.Join(root, "p"), k), at, at); err != nil {
					t.Fatal(err)
				}
			}
		}
		ckpt := filepath.Join(root, "p", layout.RecencyName)
		if corrupt {
			b, err := os.ReadFile(ckpt)
			if err != nil {
				t.Fatal(err)
			}
			b[20] ^= 1
			if err := os.WriteFile(ckpt, b, 0o640); err != nil {
				t.Fatal(err)
			}
		}
		var logs bytes.Buffer
		lg := slog.New(slog.NewTextHandler(&syncWriter{w: &logs}, &slog.HandlerOptions{Level: slog.LevelWarn}))
		e2 := newEngine(t, Config{Root: root, Workers: 1, CapacityBytes: 4 * pb, Logger: lg})
		waitFor(t, "background eviction", func() bool { return e2.Usage().UsedBytes <= 4*pb })
		gone := 1
		if corrupt {
			gone = 0
		}
		for i, c := range convs {
			want := 2 * cP
			if i == gone {
				want = 0
			}
			if n, _ := e2.Lookup("p", "tiny", cP, c); n != want {
				t.Fatalf("corrupt checkpoint %v: conversation %d has %d tokens, want %d", corrupt, i+1, n, want)
			}
		}
		if got := strings.Contains(logs.String(), "recency checkpoint ignored"); got != corrupt {
			t.Fatalf("corrupt checkpoint %v: log %q", corrupt, logs.String())
		}
	}
}

type syncWriter struct {
	mu sync.Mutex
	w  *bytes.Buffer
}

func (s *syncWriter) Write(b []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.w.Write(b)
}

// TestCacheLookupTouches: a lookup records an access to the deepest page
// it found (applied by the background goroutine, off the lookup's path),
// so the looked-up conversation is no longer the least recently used.
func TestCacheLookupTouches(t *testing.T) {
	root := t.TempDir()
	s := newSink()
	e := newEngine(t, Config{Root: root, Workers: 1, Metrics: s})
	c1, c2 := convTokens(0, 2*cP, 1), convTokens(0, 2*cP, 2)
	mustSavePages(t, e, "p", c1)
	mustSavePages(t, e, "p", c2)
	keys, _, _ := layout.PageChain("tiny", cP, c1)
	was, _ := e.pc.Tracked("p", keys[1])
	if n, err := e.Lookup("p", "tiny", cP, append(c1[:len(c1):len(c1)], 5, 6, 7)); n != 2*cP || err != nil {
		t.Fatalf("lookup: %d %v", n, err)
	}
	waitFor(t, "the lookup's touch", func() bool {
		p, _ := e.pc.Tracked("p", keys[1])
		return p.Access > was.Access
	})
	if s.hit != 2*cP || s.mis != 3 || s.jobs[labels.KindLookup] != 1 {
		t.Fatalf("lookup metrics: hit %d miss %d jobs %d", s.hit, s.mis, s.jobs[labels.KindLookup])
	}
	// One page over a quota: the background shrink evicts the least
	// recently used leaf, conversation 2's.
	u := e.Usage()
	if err := e.SetQuota("p", u.UsedBytes-1); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "the shrink", func() bool { return e.Usage().Pages == u.Pages-1 })
	if n, _ := e.Lookup("p", "tiny", cP, c2); n != cP {
		t.Fatalf("conversation 2 after the shrink: %d tokens stored, want %d (its leaf evicted)", n, cP)
	}
	if n, _ := e.Lookup("p", "tiny", cP, c1); n != 2*cP {
		t.Fatalf("conversation 1 after the shrink: %d tokens stored, want %d (touched by the lookup)", n, 2*cP)
	}
}

var _ vfs.FS = (*testutil.FaultFS)(nil)

// TestCacheManifestOfAnotherEngine: pins do not cross processes (here two
// engines on one root, each its own policy, as two processes would be):
// the evicting engine finds, under its exclusive lock, the page manifest
// the other wrote after it started, and leaves its pages.
func TestCacheManifestOfAnotherEngine(t *testing.T) {
	pb := pageBytes(t)
	root := t.TempDir()
	writer := newEngine(t, Config{Root: root, Workers: 1})
	keep := convTokens(0, 4*cP, 1)
	mustSavePages(t, writer, "p", keep)
	evictor := newEngine(t, Config{Root: root, Workers: 1, CapacityBytes: 6 * pb})
	mustDo(t, writer, namedPages("p", "keep", keep))
	// The evictor's oldest pages are keep's; it needs 4 pages gone.
	mustSavePages(t, evictor, "p", convTokens(0, 2*cP, 2))
	r := savePages(evictor, "p", convTokens(0, 4*cP, 3))
	if !errors.Is(r.Err, ErrNoSpace) {
		t.Fatalf("a save needing the named pages evicted: %v", r.Err)
	}
	dest := destOf(kvgen.Tiny, 4*cP)
	mustDo(t, writer, &ReadRequest{Ref: refOf("p", "keep"), Dest: dest})
	checkAccounting(t, evictor, root)
}

// TestLookupNoAlloc: Engine.Lookup, its touch of the page cache included,
// does not allocate.
func TestLookupNoAlloc(t *testing.T) {
	if raceEnabled {
		t.Skip("the race detector makes sync.Pool drop items: allocations are not meaningful")
	}
	e := newEngine(t, Config{Workers: 1})
	toks := convTokens(0, 4*cP, 1)
	mustSavePages(t, e, "p", toks)
	n := testing.AllocsPerRun(50, func() {
		if got, _ := e.Lookup("p", "tiny", cP, toks); got != len(toks) {
			panic(got)
		}
	})
	if n != 0 {
		t.Fatalf("Lookup allocates %v times", n)
	}
}

// TestCacheCheckpointOnlyWhenChanged: Close writes a namespace's recency
// checkpoint when its pages were used or were found without one at start;
// an engine that only opened and closed the store writes nothing.
func TestCacheCheckpointOnlyWhenChanged(t *testing.T) {
	root := t.TempDir()
	ckpt := filepath.Join(root, "p", layout.RecencyName)
	e := newEngine(t, Config{Root: root, Workers: 1})
	mustSavePages(t, e, "p", convTokens(0, 2*cP, 1))
	if err := e.Close(bg); err != nil {
		t.Fatal(err)
	}
	before, err := os.Stat(ckpt)
	if err != nil {
		t.Fatalf("no checkpoint after a save: %v", err)
	}
	e2 := newEngine(t, Config{Root: root, Workers: 1})
	if err := e2.Close(bg); err != nil {
		t.Fatal(err)
	}
	if after, err := os.Stat(ckpt); err != nil || !os.SameFile(before, after) {
		t.Fatalf("an engine that changed nothing rewrote the checkpoint (%v)", err)
	}
	e3 := newEngine(t, Config{Root: root, Workers: 1})
	loadPages(t, e3, "p", convTokens(0, 2*cP, 1))
	if err := e3.Close(bg); err != nil {
		t.Fatal(err)
	}
	if after, err := os.Stat(ckpt); err != nil || os.SameFile(before, after) {
		t.Fatalf("a load's recency was not checkpointed (%v)", err)
	}
}
