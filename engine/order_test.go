package engine

import (
	"slices"
	"strings"
	"testing"

	"github.com/kvpersist/kvpersist/engine/layout"
	"github.com/kvpersist/kvpersist/internal/kvgen"
)

// The ordering rules, each observed deterministically: testHook holds a job
// inside the pool, and a later job that is allowed to run (it enters the
// hook and is acked) proves the dispatcher has already passed over the jobs
// that must wait. No sleeps: every wait is for an event.

// A read submitted after a write of the same path waits for it and sees it:
// its destinations are sized for the new version (64 tokens), so reading the
// old one (40 tokens) would fail with jobs.ErrDestination.
func TestOrderReadAfterWrite(t *testing.T) {
	h := installHook(t)
	e := newEngine(t, Config{Workers: 4})
	m := kvgen.Tiny
	c40, _ := cacheOf(m, 40, true)
	c64, want64 := cacheOf(m, 64, true)
	p, other := refOf("a", "p"), refOf("a", "other")
	mustDo(t, e, writeReq(p, c40, layout.Single, 0))
	mustDo(t, e, writeReq(other, c40, layout.Single, 0))

	release := h.hold(t, "write a/p")
	w := mustSubmit(t, e, bg, writeReq(p, c64, layout.Blocks, 4096))
	h.await(t, "enter write a/p", 2)
	dest := destOf(m, 64)
	r := mustSubmit(t, e, bg, &ReadRequest{Ref: p, Dest: dest})
	// A read submitted later, of another path, runs now: by then the
	// dispatcher has considered the read of a/p and left it waiting.
	ackOK(t, mustSubmit(t, e, bg, &ReadRequest{Ref: other, Dest: destOf(m, 40)}))
	if n := h.count("enter read a/p"); n != 0 {
		t.Fatalf("the read of a/p started while the write before it was held")
	}
	release()
	ackOK(t, w)
	ackOK(t, r)
	equalSlots(t, "read after write", dest, want64)
	h.before(t, "exit write a/p", 2, "enter read a/p", 1)
}

// Two writes of one path publish in submission order: the second waits for
// the first, and the final file is the second one's.
func TestOrderWritesPublishInOrder(t *testing.T) {
	h := installHook(t)
	e := newEngine(t, Config{Workers: 4})
	m := kvgen.Tiny
	c40, _ := cacheOf(m, 40, false)
	c64, _ := cacheOf(m, 64, true)
	p := refOf("a", "p")

	release := h.hold(t, "write a/p")
	w1 := mustSubmit(t, e, bg, writeReq(p, c64, layout.Single, 0))
	h.await(t, "enter write a/p", 1)
	w2 := mustSubmit(t, e, bg, writeReq(p, c40, layout.Blocks, 4096))
	ackOK(t, mustSubmit(t, e, bg, writeReq(refOf("a", "q"), c40, layout.Single, 0)))
	if n := h.count("enter write a/p"); n != 1 {
		t.Fatalf("the second write of a/p started while the first was held")
	}
	release()
	r1, r2 := ackOK(t, w1), ackOK(t, w2)
	h.before(t, "exit write a/p", 1, "enter write a/p", 2)
	snap, err := e.Stat(p)
	if err != nil {
		t.Fatal(err)
	}
	if snap.Layout != layout.Blocks || snap.Header.Caches[0].Tensors[0].Shape[2] != 40 {
		t.Fatalf("final snapshot: %v layout, %v tokens; want the second write's (blocks, 40)", snap.Layout, snap.Header.Caches[0].Tensors[0].Shape)
	}
	if got, want := mustEncode(t, snap.Header), mustEncode(t, r2.Header); got != want {
		t.Fatalf("published header differs from the second write's Result.Header")
	}
	if r1.Header.FormatVersion != layout.FormatSingle {
		t.Fatalf("first write's header: format %d", r1.Header.FormatVersion)
	}
	readBack(t, e, p, m, 40)
}

func mustEncode(t testing.TB, h *layout.Header) string {
	t.Helper()
	b, err := h.Encode()
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

// Two writes of different paths (one namespace) run at the same time: both
// are inside the pool before either is let go. Reads of one path, too.
func TestOrderParallel(t *testing.T) {
	h := installHook(t)
	e := newEngine(t, Config{Workers: 2})
	m := kvgen.Tiny
	c, _ := cacheOf(m, 40, true)
	rp := h.hold(t, "write a/p")
	rq := h.hold(t, "write a/q")
	wp := mustSubmit(t, e, bg, writeReq(refOf("a", "p"), c, layout.Single, 0))
	wq := mustSubmit(t, e, bg, writeReq(refOf("a", "q"), c, layout.Blocks, 4096))
	h.await(t, "enter write a/p", 1)
	h.await(t, "enter write a/q", 1)
	if h.count("exit write a/p")+h.count("exit write a/q") != 0 {
		t.Fatal("a held write left the hook")
	}
	rp()
	rq()
	ackOK(t, wp)
	ackOK(t, wq)

	rr := h.hold(t, "read a/p")
	d1, d2 := destOf(m, 40), destOf(m, 40)
	r1 := mustSubmit(t, e, bg, &ReadRequest{Ref: refOf("a", "p"), Dest: d1})
	r2 := mustSubmit(t, e, bg, &ReadRequest{Ref: refOf("a", "p"), Dest: d2})
	h.await(t, "enter read a/p", 2)
	rr()
	ackOK(t, r1)
	ackOK(t, r2)
	_, want := cacheOf(m, 40, false)
	equalSlots(t, "read 1", d1, want)
	equalSlots(t, "read 2", d2, want)
}

// A collect runs alone in its namespace: it waits for the write already
// running there, and a write submitted after it waits for it; jobs in other
// namespaces run meanwhile.
func TestOrderCollectAlone(t *testing.T) {
	h := installHook(t)
	e := newEngine(t, Config{Workers: 4, BlockBytes: 4096})
	m := kvgen.Tiny
	c, _ := cacheOf(m, 40, false)
	mustDo(t, e, writeReq(refOf("a", "x"), c, layout.Blocks, 0))

	rw := h.hold(t, "write a/p1")
	w1 := mustSubmit(t, e, bg, writeReq(refOf("a", "p1"), c, layout.Blocks, 0))
	h.await(t, "enter write a/p1", 1)
	rc := h.hold(t, "collect")
	col := mustSubmit(t, e, bg, &CollectRequest{Namespaces: []string{"a"}})
	w2 := mustSubmit(t, e, bg, writeReq(refOf("a", "p2"), c, layout.Blocks, 0))
	ackOK(t, mustSubmit(t, e, bg, writeReq(refOf("b", "q"), c, layout.Blocks, 0)))
	if h.count("enter collect") != 0 || h.count("enter write a/p2") != 0 {
		t.Fatalf("collect or later write started beside a running write; events: %v", h.snapshot())
	}
	rw()
	ackOK(t, w1)
	h.await(t, "enter collect", 1)
	ackOK(t, mustSubmit(t, e, bg, writeReq(refOf("b", "r"), c, layout.Single, 0)))
	if h.count("enter write a/p2") != 0 {
		t.Fatalf("a write submitted after the collect started beside it")
	}
	rc()
	cr := ackOK(t, col)
	ackOK(t, w2)
	h.before(t, "exit write a/p1", 1, "enter collect", 1)
	h.before(t, "exit collect", 1, "enter write a/p2", 1)
	// The collect saw exactly the two manifests published before it (x, p1),
	// all of whose blocks it kept (they share every block).
	if cm := cr.Metrics.Collect; cm.Namespaces != 1 || cm.ManifestsScanned != 2 || cm.BlocksKept != 9 || cm.BlocksDeleted != 0 {
		t.Fatalf("collect: %+v", cm)
	}
	readBack(t, e, refOf("a", "p2"), m, 40)
}

// A collect of every namespace waits for jobs in any namespace, and every
// later job waits for it. A collect of an empty namespace list scopes
// nothing and runs beside anything.
func TestOrderCollectAll(t *testing.T) {
	h := installHook(t)
	e := newEngine(t, Config{Workers: 4})
	m := kvgen.Tiny
	c, _ := cacheOf(m, 40, false)
	mustDo(t, e, writeReq(refOf("z", "x"), c, layout.Single, 0))
	rr := h.hold(t, "read z/x")
	r := mustSubmit(t, e, bg, &ReadRequest{Ref: refOf("z", "x"), Dest: destOf(m, 40)})
	h.await(t, "enter read z/x", 1)
	empty := ackOK(t, mustSubmit(t, e, bg, &CollectRequest{Namespaces: []string{}}))
	if cm := empty.Metrics.Collect; cm.Namespaces != 0 || len(cm.Deleted) != 0 {
		t.Fatalf("collect of no namespace: %+v", cm)
	}
	rc := h.hold(t, "collect")
	col := mustSubmit(t, e, bg, &CollectRequest{})
	w := mustSubmit(t, e, bg, writeReq(refOf("y", "new"), c, layout.Single, 0))
	rr()
	ackOK(t, r)
	h.await(t, "enter collect", 2)
	if h.count("enter write y/new") != 0 {
		t.Fatalf("a write submitted after a collect of all started beside it; events: %v", h.snapshot())
	}
	rc()
	if cm := ackOK(t, col).Metrics.Collect; cm.Namespaces != 1 || cm.ManifestsScanned != 1 {
		t.Fatalf("collect of all: %+v", cm)
	}
	ackOK(t, w)
	h.before(t, "exit read z/x", 1, "enter collect", 2)
	h.before(t, "exit collect", 2, "enter write y/new", 1)
}

// When reads and a write both wait for a worker, reads go first, but after
// readBurst reads in a row the write gets its turn (no starvation). One
// worker makes the start order the hook's enter order.
func TestOrderReadPriority(t *testing.T) {
	h := installHook(t)
	e := newEngine(t, Config{Workers: 1, Mailbox: 32})
	m := kvgen.Tiny
	c, _ := cacheOf(m, 40, true)
	const nReads = readBurst + 3
	var names []string
	for i := range nReads {
		n := "r" + string(rune('a'+i))
		names = append(names, n)
		mustDo(t, e, writeReq(refOf("a", n), c, layout.Single, 0))
	}
	release := h.hold(t, "write a/hold")
	hold := mustSubmit(t, e, bg, writeReq(refOf("a", "hold"), c, layout.Single, 0))
	h.await(t, "enter write a/hold", 1)
	start := len(h.snapshot())
	w := mustSubmit(t, e, bg, writeReq(refOf("a", "w"), c, layout.Single, 0)) // submitted first
	var reads []*Job
	for _, n := range names {
		reads = append(reads, mustSubmit(t, e, bg, &ReadRequest{Ref: refOf("a", n), Dest: destOf(m, 40)}))
	}
	if s := e.Stats(); s.Queued != nReads+1 || s.Running != 1 {
		t.Fatalf("Stats while held: %+v", s)
	}
	release()
	ackOK(t, hold)
	ackOK(t, w)
	for _, r := range reads {
		ackOK(t, r)
	}
	var got []string
	for _, ev := range h.snapshot()[start:] {
		if k, ok := strings.CutPrefix(ev, "enter "); ok {
			got = append(got, k)
		}
	}
	var want []string
	for i, n := range names {
		if i == readBurst {
			want = append(want, "write a/w")
		}
		want = append(want, "read a/"+n)
	}
	if !slices.Equal(got, want) {
		t.Fatalf("start order\n got %v\nwant %v", got, want)
	}
}
