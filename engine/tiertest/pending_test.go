package tiertest

import (
	"net/http"
	"sync"
	"testing"

	"github.com/kvpersist/kvpersist/engine"
	"github.com/kvpersist/kvpersist/engine/layout"
)

// gateRT holds every HEAD and PUT (an upload's requests: StatFirst HEADs
// the object, then PUTs it) while the gate is shut, until it opens or the
// request's context ends; other requests, and all once open, pass.
type gateRT struct {
	next http.RoundTripper
	mu   sync.Mutex
	open chan struct{} // closed while the gate is open
}

func newGate() *gateRT {
	g := &gateRT{next: http.DefaultTransport.(*http.Transport).Clone(), open: make(chan struct{})}
	close(g.open)
	return g
}

func (g *gateRT) shut() {
	g.mu.Lock()
	defer g.mu.Unlock()
	select {
	case <-g.open:
		g.open = make(chan struct{})
	default:
	}
}

func (g *gateRT) reopen() {
	g.mu.Lock()
	defer g.mu.Unlock()
	select {
	case <-g.open:
	default:
		close(g.open)
	}
}

func (g *gateRT) RoundTrip(r *http.Request) (*http.Response, error) {
	if r.Method == http.MethodHead || r.Method == http.MethodPut {
		g.mu.Lock()
		open := g.open
		g.mu.Unlock()
		select {
		case <-open:
		case <-r.Context().Done():
			return nil, r.Context().Err()
		}
	}
	return g.next.RoundTrip(r)
}

func (g *gateRT) CloseIdleConnections() {
	if c, ok := g.next.(interface{ CloseIdleConnections() }); ok {
		c.CloseIdleConnections()
	}
}

// uploadsEnded is how many uploads ended (any result).
func uploadsEnded(ops map[string]uint64) uint64 {
	var n uint64
	for _, res := range []string{"ok", "existed", "corrupt", "error", "abandoned"} {
		n += ops["upload/"+res]
	}
	return n
}

// TestPendingUploadsEvictedLastThenPlainLRU: a bounded cache (5 pages)
// whose uploads are held at the store's door. A (uploaded) is loaded
// after B is saved with its upload held, so B is the least recently
// used; saving C evicts A's leaf, not B's (plain LRU would); saving D
// evicts A's root and then, nothing else evictable, B's leaf, the least
// recently used pending page, rather than failing with ErrNoSpace: counted
// by kvpersist_remote_upload_evicted_pages_total, and its upload, once
// the store answers, ends as an error (the file is gone) and the object is
// never created. Once every upload has settled the order is plain LRU
// again: F, saved and uploaded last, outlives the older C and D, which a
// stale pending mark would have kept instead.
func TestPendingUploadsEvictedLastThenPlainLRU(t *testing.T) {
	prefix, root := bucketPrefix(t), t.TempDir()
	A, B, C, D := seq(70000, 2*ptoks), seq(71000, 2*ptoks), seq(72000, 2*ptoks), seq(73000, 2*ptoks)
	F, G := seq(74000, ptoks), seq(75000, ptoks)
	kA, kB, kC, kD, kF := keysOf(t, A), keysOf(t, B), keysOf(t, C), keysOf(t, D), keysOf(t, F)

	a := newEngine(t, root, prefix, newRecorder(t), nil)
	save(t, a, A)
	closeEngine(t, a) // A uploaded: its journal entries settled
	page := fullPageAlloc(t, root, kA)
	capacity := 5 * page

	gate := newGate()
	rec := newRecorder(t)
	// One upload worker: B's root is the upload in flight (its attempt has
	// the file open, so an eviction would not stop it), B's leaf the first
	// queued.
	e := newEngineCfg(t, root, prefix, rec, func(rt *engine.RemoteTier) { rt.Store.Transport, rt.UploadWorkers = gate, 1 },
		func(c *engine.Config) { c.CapacityBytes = capacity })
	gate.shut()
	save(t, e, B) // held: pending
	if res, _ := load(t, e, A); res.Prefix.Tokens != len(A) {
		t.Fatalf("loaded %d tokens of A, want %d", res.Prefix.Tokens, len(A))
	}
	save(t, e, C) // 4 + 2 pages: one evicted
	checkStored(t, root, "A", kA, []bool{true, false})
	checkStored(t, root, "B", kB, []bool{true, true})
	save(t, e, D) // 5 + 2 pages: two evicted
	checkStored(t, root, "A", kA, []bool{false, false})
	checkStored(t, root, "B", kB, []bool{true, false})
	checkStored(t, root, "C", kC, []bool{true, true})
	checkStored(t, root, "D", kD, []bool{true, true})
	checkUsageIsDisk(t, e, root, capacity)
	if n := rec.Snapshot().Remote.UploadEvictedPages; n != 1 {
		t.Fatalf("%d pages evicted with their upload pending, want 1 (B's leaf)", n)
	}

	gate.reopen()
	waitFor(t, "the 6 uploads of B, C and D to end", func() bool { return uploadsEnded(snapshotOps(rec)) == 6 })
	if ops := snapshotOps(rec); ops["upload/error"] != 1 || ops["upload/ok"] != 5 {
		t.Fatalf("upload results %v, want 5 ok and 1 error (B's evicted leaf)", ops)
	}
	st := openStore(t, prefix)
	objs := objects(t, st)
	for _, c := range []struct {
		what string
		k    layout.PageKey
		want bool
	}{{"B's root", kB[0], true}, {"B's leaf", kB[1], false}, {"C's leaf", kC[1], true}, {"D's leaf", kD[1], true}} {
		name, err := st.PageName(ns, c.k.String())
		if err != nil {
			t.Fatal(err)
		}
		if _, ok := objs[name]; ok != c.want {
			t.Fatalf("%s stored remotely: %v, want %v", c.what, ok, c.want)
		}
	}

	// Settled: plain LRU. F (uploaded, the newest) evicts B's root, the
	// oldest; G then evicts C's leaf, not F.
	save(t, e, F)
	waitFor(t, "F's upload to end", func() bool { return uploadsEnded(snapshotOps(rec)) == 7 })
	save(t, e, G)
	checkStored(t, root, "B", kB, []bool{false, false})
	checkStored(t, root, "C", kC, []bool{true, false})
	checkStored(t, root, "D", kD, []bool{true, true})
	checkStored(t, root, "F", kF, []bool{true})
	checkUsageIsDisk(t, e, root, capacity)
	if n := rec.Snapshot().Remote.UploadEvictedPages; n != 1 {
		t.Fatalf("%d pages evicted with their upload pending, want still 1", n)
	}
}
