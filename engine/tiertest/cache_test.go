package tiertest

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"net/http"
	"os"
	"runtime"
	"strconv"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/kvpersist/kvpersist/engine"
	"github.com/kvpersist/kvpersist/engine/layout"
	"github.com/kvpersist/kvpersist/engine/metrics"
	"github.com/kvpersist/kvpersist/internal/faultproxy"
	"github.com/kvpersist/kvpersist/internal/testutil"
)

// The remote tier and the bounded page cache: pages fetched by a load's
// read-through are reserved against CapacityBytes like a save's, evict
// least recently used leaves first to make room, are accounted with their
// st_blocks, stay pinned until the load that fetched them ends, and are
// evictable afterwards.

// allocBytes is the allocated bytes (st_blocks × 512) of the file path.
func allocBytes(t *testing.T, path string) int64 {
	t.Helper()
	var st syscall.Stat_t
	if err := syscall.Lstat(path, &st); err != nil {
		t.Fatal(err)
	}
	return st.Blocks * 512
}

// fullPageAlloc saves nothing: it returns the allocated bytes of the page
// files of keys under root, failing unless they are all equal (full pages
// of this geometry have one length).
func fullPageAlloc(t *testing.T, root string, keys []layout.PageKey) int64 {
	t.Helper()
	p := allocBytes(t, pagePath(root, keys[0]))
	for _, k := range keys[1:] {
		if b := allocBytes(t, pagePath(root, k)); b != p {
			t.Fatalf("full pages of %d and %d allocated bytes: the test needs one size", p, b)
		}
	}
	if p == 0 {
		t.Fatal("a page file allocates no blocks")
	}
	return p
}

// checkUsageIsDisk fails unless e's accounting equals a walk of root's
// page tree (st_blocks of every page file), with no temp file left, and
// stays within the capacity.
func checkUsageIsDisk(t *testing.T, e *engine.Engine, root string, capacity int64) engine.Usage {
	t.Helper()
	u := e.Usage()
	pb, tb, pages, temps := testutil.PageTree(t, root, ns)
	if u.UsedBytes != pb || u.Pages != pages || temps != 0 || tb != 0 || u.ReservedBytes != 0 || u.EvictingBytes != 0 {
		t.Fatalf("usage %d bytes in %d pages (reserved %d, evicting %d); the disk holds %d bytes in %d pages and %d temp files",
			u.UsedBytes, u.Pages, u.ReservedBytes, u.EvictingBytes, pb, pages, temps)
	}
	if u.UsedBytes > capacity {
		t.Fatalf("usage %d bytes above the capacity %d", u.UsedBytes, capacity)
	}
	return u
}

// checkStored fails unless exactly the pages present of keys are on disk
// under root.
func checkStored(t *testing.T, root, what string, keys []layout.PageKey, present []bool) {
	t.Helper()
	for i, k := range keys {
		_, err := os.Lstat(pagePath(root, k))
		switch {
		case present[i] && err != nil:
			t.Fatalf("%s page %d was evicted (lstat: %v)", what, i, err)
		case !present[i] && !os.IsNotExist(err):
			t.Fatalf("%s page %d is stored, want it evicted (lstat: %v)", what, i, err)
		}
	}
}

func bools(n int, f func(i int) bool) []bool {
	out := make([]bool, n)
	for i := range out {
		out[i] = f(i)
	}
	return out
}

// fatalRecorder is a testutil.TB for a goroutine: Fatal records the
// message and ends the goroutine.
type fatalRecorder struct {
	mu  sync.Mutex
	msg []any
}

func (f *fatalRecorder) Helper() {}
func (f *fatalRecorder) Fatal(args ...any) {
	f.mu.Lock()
	f.msg = args
	f.mu.Unlock()
	runtime.Goexit()
}

// watchTree walks root's page tree again and again until stop is called
// and returns the largest allocated bytes (page and temp files) it saw.
func watchTree(t *testing.T, root string) (stop func() int64) {
	var peak atomic.Int64
	done := make(chan struct{})
	quit := make(chan struct{})
	rec := &fatalRecorder{}
	go func() {
		defer close(done)
		for {
			select {
			case <-quit:
				return
			default:
			}
			pb, tb, _, _ := testutil.PageTree(rec, root, ns)
			if d := pb + tb; d > peak.Load() {
				peak.Store(d)
			}
		}
	}()
	return func() int64 {
		close(quit)
		<-done
		if rec.msg != nil {
			t.Fatal(rec.msg...)
		}
		return peak.Load()
	}
}

// TestFetchedPagesAdmittedToBoundedCache: engine B, whose page cache holds
// 8 pages, has saved a conversation Y of 6 pages, then loads a
// conversation X of 6 pages saved on engine A. The fetch makes room as a
// save does: Y's 4 last pages are evicted, leaves first, and X is loaded
// bit-exact; B's accounting equals a walk of its page tree (st_blocks) and
// the tree never exceeded the capacity plus one page per admission in
// flight (FetchPages 2: 2 pages). The fetched pages are then ordinary
// cache pages: a save of 4 new pages evicts Y's 2 remaining pages (older)
// and then X's 2 last pages, leaves first.
func TestFetchedPagesAdmittedToBoundedCache(t *testing.T) {
	prefix := bucketPrefix(t)
	rootA, rootB := t.TempDir(), t.TempDir()
	x, y, z := seq(20000, 6*ptoks), seq(30000, 6*ptoks), seq(40000, 4*ptoks)
	kx, ky, kz := keysOf(t, x), keysOf(t, y), keysOf(t, z)
	a := newEngine(t, rootA, prefix, newRecorder(t), nil)
	save(t, a, x)
	closeEngine(t, a)
	page := fullPageAlloc(t, rootA, kx)
	capacity := 8 * page

	const fetchPages = 2
	b := newEngineCfg(t, rootB, prefix, newRecorder(t), func(rt *engine.RemoteTier) { rt.FetchPages = fetchPages },
		func(c *engine.Config) { c.CapacityBytes = capacity })
	save(t, b, y)
	checkUsageIsDisk(t, b, rootB, capacity)

	stop := watchTree(t, rootB)
	res, c := load(t, b, x)
	peak := stop()
	if res.Prefix.Tokens != len(x) {
		t.Fatalf("B loaded %d tokens, want %d (remote report %+v)", res.Prefix.Tokens, len(x), res.Remote)
	}
	c.checkLoaded(t, x, len(x))
	if r := res.Remote; r.Err != nil || r.PagesFetched != len(kx) {
		t.Fatalf("remote report %+v; want %d pages fetched, no error", r, len(kx))
	}
	if bound := capacity + fetchPages*page; peak > bound {
		t.Fatalf("the page tree reached %d bytes during the fetch, above capacity %d + %d admissions × %d", peak, capacity, fetchPages, page)
	}
	u := checkUsageIsDisk(t, b, rootB, capacity)
	if u.Pages != 8 {
		t.Fatalf("%d pages accounted, want 8", u.Pages)
	}
	checkStored(t, rootB, "Y", ky, bools(6, func(i int) bool { return i < 2 }))
	checkStored(t, rootB, "X", kx, bools(6, func(int) bool { return true }))
	for _, k := range kx {
		if !bytes.Equal(readFile(t, pagePath(rootB, k)), readFile(t, pagePath(rootA, k))) {
			t.Fatalf("fetched page %s differs from A's file", k)
		}
	}

	save(t, b, z)
	checkUsageIsDisk(t, b, rootB, capacity)
	checkStored(t, rootB, "Y", ky, bools(6, func(int) bool { return false }))
	checkStored(t, rootB, "X", kx, bools(6, func(i int) bool { return i < 4 }))
	checkStored(t, rootB, "Z", kz, bools(4, func(int) bool { return true }))
	// What is left of X loads from the local tier.
	res, c = load(t, b, x)
	if res.Prefix.Tokens < 4*ptoks {
		t.Fatalf("loaded %d tokens of X, want at least the 4 pages kept", res.Prefix.Tokens)
	}
	c.checkLoaded(t, x, res.Prefix.Tokens)
}

// TestFetchWithEverythingPinnedIsAMiss: B's cache (4 pages) is full of
// pages a page manifest pins. A load of a conversation stored remotely
// finds it (2 pages) but cannot get room: a miss, reported as ErrNoSpace in
// the remote report, not an error of the load; nothing is written (no page
// file, no temp file), every stored page is intact, and the accounting is
// unchanged.
func TestFetchWithEverythingPinnedIsAMiss(t *testing.T) {
	prefix := bucketPrefix(t)
	rootA, rootB := t.TempDir(), t.TempDir()
	x, y := seq(50000, 2*ptoks), seq(60000, 4*ptoks)
	kx, ky := keysOf(t, x), keysOf(t, y)
	b, rec, capacity, before := fullOfPinned(t, prefix, rootA, rootB, kx, y, func(a *engine.Engine) { save(t, a, x) })
	stored := map[layout.PageKey][]byte{}
	for _, k := range ky {
		stored[k] = readFile(t, pagePath(rootB, k))
	}

	res, c := load(t, b, x)
	if res.Prefix.Tokens != 0 {
		t.Fatalf("loaded %d tokens, want 0 (no room for the remote pages)", res.Prefix.Tokens)
	}
	c.checkLoaded(t, x, 0)
	if r := res.Remote; r == nil || !errors.Is(r.Err, engine.ErrNoSpace) || r.PagesFound != len(kx) || r.PagesFetched != 0 || r.BytesFetched != 0 {
		t.Fatalf("remote report %+v; want %d pages found, none fetched, ErrNoSpace", r, len(kx))
	}
	checkNothingFetched(t, b, rootB, rec, capacity, before, kx)
	for k, want := range stored {
		if !bytes.Equal(readFile(t, pagePath(rootB, k)), want) {
			t.Fatalf("stored page %s changed", k)
		}
	}
}

// fullOfPinned stores with put, on an engine A (root rootA), what a test
// fetches later (keys, full pages), then opens B (root rootB, metrics
// rec) with a cache of 4 such pages, filled by a page manifest "keep" of
// y (4 pages, pinned). before is B's usage then.
func fullOfPinned(t *testing.T, prefix, rootA, rootB string, keys []layout.PageKey, y []uint32, put func(*engine.Engine)) (b *engine.Engine, rec *metrics.Recorder, capacity int64, before engine.Usage) {
	t.Helper()
	a := newEngine(t, rootA, prefix, newRecorder(t), nil)
	put(a)
	closeEngine(t, a)
	capacity = 4 * fullPageAlloc(t, rootA, keys)
	rec = newRecorder(t)
	b = newEngineCfg(t, rootB, prefix, rec, nil, func(c *engine.Config) { c.CapacityBytes = capacity })
	writePages(t, b, "keep", y)
	return b, rec, capacity, checkUsageIsDisk(t, b, rootB, capacity)
}

// checkNothingFetched fails if e (root, metrics rec) sent a fetch, if its
// accounting (equal to its disk) moved from before, or if a page of keys
// is stored.
func checkNothingFetched(t *testing.T, e *engine.Engine, root string, rec *metrics.Recorder, capacity int64, before engine.Usage, keys []layout.PageKey) {
	t.Helper()
	if n := snapshotOps(rec)["fetch/ok"] + snapshotOps(rec)["fetch/error"]; n != 0 {
		t.Fatalf("%d fetches sent without room: %v", n, snapshotOps(rec))
	}
	after := checkUsageIsDisk(t, e, root, capacity)
	if after.UsedBytes != before.UsedBytes || after.Pages != before.Pages {
		t.Fatalf("usage changed from %d bytes in %d pages to %d in %d", before.UsedBytes, before.Pages, after.UsedBytes, after.Pages)
	}
	checkStored(t, root, "fetched", keys, bools(len(keys), func(int) bool { return false }))
}

// nthRT calls hook before the n-th request matching match is sent (the
// request waits for it), then forwards every request.
type nthRT struct {
	next  http.RoundTripper
	match func(*http.Request) bool
	n     int64
	hook  func()
	seen  atomic.Int64
}

func (h *nthRT) RoundTrip(r *http.Request) (*http.Response, error) {
	if h.match(r) && h.seen.Add(1) == h.n {
		h.hook()
	}
	return h.next.RoundTrip(r)
}

func (h *nthRT) CloseIdleConnections() {
	if c, ok := h.next.(interface{ CloseIdleConnections() }); ok {
		c.CloseIdleConnections()
	}
}

// TestFetchedPageStaysPinnedUntilLoaded: B's cache holds 3 pages, one
// pinned by a page manifest. B loads X (2 pages, remote, fetched one at a
// time). While X's second page is being fetched and X's first page has
// been published and committed (the only page that could be evicted), a
// save of one page beside the load finds no room (ErrNoSpace) rather
// than evict it, and the load gets both pages bit-exact. Once the load
// ended the pin is gone: the same save succeeds, evicting X's leaf.
func TestFetchedPageStaysPinnedUntilLoaded(t *testing.T) {
	prefix := bucketPrefix(t)
	rootA, rootB := t.TempDir(), t.TempDir()
	x, y, z := seq(70000, 2*ptoks), seq(80000, ptoks), seq(90000, ptoks)
	kx := keysOf(t, x)
	a := newEngine(t, rootA, prefix, newRecorder(t), nil)
	save(t, a, x)
	closeEngine(t, a)
	capacity := 3 * fullPageAlloc(t, rootA, kx)

	var b *engine.Engine
	var beside engine.Result
	saveZ := func() engine.Result {
		cz := newKV(len(z))
		cz.fill(z)
		return b.Do(context.Background(), &engine.SavePrefixRequest{Namespace: ns, Identity: ident, Tokens: z, PageTokens: ptoks, Tensors: cz.specs(len(z))})
	}
	var hookErr error
	hook := &nthRT{next: http.DefaultTransport.(*http.Transport).Clone(), match: isRangedGet, n: 2, hook: func() {
		// The second page is being fetched; the first one's publish
		// may still be running (a GET token is given back once the
		// bytes are in): wait until it is committed (keep's page and
		// X's first).
		for wait := time.Now(); ; time.Sleep(2 * time.Millisecond) {
			_, err := os.Lstat(pagePath(rootB, kx[0]))
			if err == nil && b.Usage().Pages == 2 {
				break
			}
			if time.Since(wait) > 20*time.Second {
				hookErr = fmt.Errorf("X's first page not committed while the second is fetched: lstat %v, usage %+v", err, b.Usage())
				return
			}
		}
		done := make(chan engine.Result, 1)
		go func() { done <- saveZ() }()
		// The save either fails (no room) or has chosen a victim and
		// waits for the exclusive lock the fetch's shared lock holds off.
		for {
			select {
			case beside = <-done:
				return
			default:
			}
			if b.Usage().EvictingBytes > 0 {
				beside = engine.Result{Err: errors.New("the save beside the load chose a victim")}
				go func() { <-done }()
				return
			}
			time.Sleep(2 * time.Millisecond)
		}
	}}
	b = newEngineCfg(t, rootB, prefix, newRecorder(t), func(rt *engine.RemoteTier) {
		rt.Store.Transport = hook
		rt.FetchPages = 1
	}, func(c *engine.Config) { c.CapacityBytes = capacity })
	writePages(t, b, "keep", y)

	res, c := load(t, b, x)
	if hookErr != nil || hook.seen.Load() < 2 {
		t.Fatalf("the hook did not run between the two fetches (%d ranged GETs): %v", hook.seen.Load(), hookErr)
	}
	if !errors.Is(beside.Err, engine.ErrNoSpace) {
		t.Fatalf("save beside the load: %v; want ErrNoSpace (the fetched page is pinned, the other one by its manifest)", beside.Err)
	}
	if res.Prefix.Tokens != len(x) || res.Remote.PagesFetched != 2 {
		t.Fatalf("loaded %d tokens, fetched %d pages; want %d tokens, 2 pages (report %+v)", res.Prefix.Tokens, res.Remote.PagesFetched, len(x), res.Remote)
	}
	c.checkLoaded(t, x, len(x))
	checkUsageIsDisk(t, b, rootB, capacity)

	if r := saveZ(); r.Err != nil {
		t.Fatalf("save after the load: %v (the load's pins were not released)", r.Err)
	}
	checkStored(t, rootB, "X", kx, []bool{true, false})
	checkUsageIsDisk(t, b, rootB, capacity)
}

// TestReadThroughSIGKILLKeepsTheBound: a process whose page cache holds
// 8 pages, full, loads conversations that only the object store holds (a
// read-through fetching FetchPages 4 pages at once, each GET slowed) and
// is SIGKILLed mid-fetch, again and again. Each kill leaves the temp page
// files of the fetches in flight; the next process removes those older
// than its TempGrace at start and counts the others, so the page files
// and temp page files together never exceed the capacity by more than
// the admissions in flight (4 pages), however many kills there were, and
// the reservations of a killed process do not outlive it.
func TestReadThroughSIGKILLKeepsTheBound(t *testing.T) {
	prefix := bucketPrefix(t)
	rootA, rootB := t.TempDir(), t.TempDir()
	a := newEngine(t, rootA, prefix, newRecorder(t), nil)
	var convs [][]uint32
	for i := range 4 {
		c := seq(60000+10000*i, 6*ptoks)
		save(t, a, c)
		convs = append(convs, c)
	}
	closeEngine(t, a)
	page := fullPageAlloc(t, rootA, keysOf(t, convs[0]))
	const fetchPages = 4
	capacity := 8 * page
	bound := capacity + fetchPages*page
	p := faultproxy.Start(t, srv.Endpoint)
	p.Set(faultproxy.Rule{Kinds: faultproxy.Get, Fault: faultproxy.Delay, Delay: 20 * time.Millisecond})
	rng := rand.New(rand.NewPCG(uint64(time.Now().UnixNano()), 24))
	// The cache full first: two whole loads of 6 pages each.
	full := startChild(t, rootB, prefix, p.Endpoint, strconv.FormatInt(capacity, 10), strconv.Itoa(fetchPages), "50ms")
	full.do("load %d %d", convs[0][0], len(convs[0]))
	full.do("load %d %d", convs[1][0], len(convs[1]))
	full.kill()
	if pb, _, _, _ := testutil.PageTree(t, rootB, ns); pb < capacity-page {
		t.Fatalf("the cache holds %d bytes after two loads, want about its capacity %d", pb, capacity)
	}
	tempsLeft, fetching := 0, 0
	for round := range 12 {
		c := startChild(t, rootB, prefix, p.Endpoint, strconv.FormatInt(capacity, 10), strconv.Itoa(fetchPages), "50ms")
		conv := convs[round%len(convs)]
		_, _, _, before := testutil.PageTree(t, rootB, ns)
		stop := watchTree(t, rootB)
		fmt.Fprintf(c.in, "load %d %d\n", conv[0], len(conv))
		if err := c.in.Flush(); err != nil {
			t.Fatal(err)
		}
		// Killed once a fetch has a new temp file open (or after 3 s), a
		// little later at random.
		for deadline := time.Now().Add(3 * time.Second); time.Now().Before(deadline); time.Sleep(time.Millisecond) {
			if _, _, _, n := testutil.PageTree(t, rootB, ns); n > before {
				fetching++
				break
			}
		}
		time.Sleep(time.Duration(5+rng.IntN(60)) * time.Millisecond)
		c.kill()
		peak := stop()
		pb, tb, pages, temps := testutil.PageTree(t, rootB, ns)
		tempsLeft += temps
		if peak > bound || pb+tb > bound {
			t.Fatalf("round %d: the page tree reached %d bytes (now %d in %d pages and %d in %d temp files), above capacity %d + %d admissions × %d",
				round, peak, pb, pages, tb, temps, capacity, fetchPages, page)
		}
	}
	t.Logf("12 kills, %d mid-fetch, left %d temp page files in all (summed over the rounds)", fetching, tempsLeft)
	if fetching == 0 {
		t.Fatal("no process was killed mid-fetch: the test shows nothing")
	}
	// The killed processes' reservations are dropped (they would otherwise
	// fill the cache and make every later fetch a miss): a new engine
	// fetches and loads a whole conversation.
	b := newEngineCfg(t, rootB, prefix, newRecorder(t), func(rt *engine.RemoteTier) { rt.FetchPages = fetchPages },
		func(c *engine.Config) { c.CapacityBytes = capacity })
	res, kv := load(t, b, convs[2])
	if res.Prefix.Tokens != len(convs[2]) || res.Remote.Err != nil {
		t.Fatalf("after the kills a load got %d of %d tokens (remote report %+v)", res.Prefix.Tokens, len(convs[2]), res.Remote)
	}
	kv.checkLoaded(t, convs[2], len(convs[2]))
	if pb, tb, _, _ := testutil.PageTree(t, rootB, ns); pb+tb > bound {
		t.Fatalf("after the last load the page tree holds %d bytes, above %d", pb+tb, bound)
	}
}
