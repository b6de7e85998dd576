package evict

import (
	"errors"
	"slices"
	"testing"
)

// reserveVictims reserves bytes in ns (no headroom) and returns its
// victims, failing the test on an error.
func reserveVictims(t *testing.T, c *Cache, ns string, bytes int64) []Victim {
	t.Helper()
	r, err := c.Reserve(Want{Namespace: ns, Bytes: bytes, AvailBytes: -1})
	if err != nil {
		t.Fatalf("Reserve(%s, %d): %v", ns, bytes, err)
	}
	for _, v := range r.Victims {
		if !c.Removed(v.Namespace, v.Key) {
			t.Fatalf("victim %v not tracked", v)
		}
	}
	r.Release()
	return r.Victims
}

func setPending(t *testing.T, c *Cache, ns string, pending bool, keys ...Key) {
	t.Helper()
	for _, k := range keys {
		if !c.SetPending(ns, k, pending) {
			t.Fatalf("SetPending(%s, %s): not tracked", ns, k)
		}
	}
}

func checkVictims(t *testing.T, what string, got []Victim, want []Key, pending []bool) {
	t.Helper()
	if !slices.Equal(victimKeys(got), want) {
		t.Fatalf("%s: victims %v, want %v", what, victimKeys(got), want)
	}
	for i, v := range got {
		if v.Pending != pending[i] {
			t.Fatalf("%s: victim %d (%s) Pending = %v, want %v", what, i, v.Key, v.Pending, pending[i])
		}
	}
}

// TestPendingPagesEvictedLast (rule 6): pages marked pending (the engine's
// uploads waiting) are evicted after every evictable page that is not,
// whatever their recency; leaves still go first, so a non-pending parent
// of a pending leaf waits for that leaf; when only pending pages are
// evictable they are evicted (least recently used first) rather than the
// reservation failing; and an unmarked page is back in the plain LRU
// order. Plain LRU would evict a1, a0 first.
func TestPendingPagesEvictedLast(t *testing.T) {
	const pg = 4096
	c, err := New(Config{CapacityBytes: 9 * pg})
	if err != nil {
		t.Fatal(err)
	}
	a0, a1 := key(1), key(2)   // pending, the oldest
	b0, b1 := key(10), key(11) // not pending, the newest
	c0 := key(20)              // pending
	d0, d1 := key(30), key(31) // d0 not pending, its child d1 pending
	e0, f0 := key(40), key(41) // e0 pending (older), f0 not pending
	chain(t, c, "ns", []Key{a0, a1}, pg, []int64{1, 2})
	chain(t, c, "ns", []Key{b0, b1}, pg, []int64{50, 51})
	chain(t, c, "ns", []Key{c0}, pg, []int64{5})
	chain(t, c, "ns", []Key{d0, d1}, pg, []int64{6, 4})
	setPending(t, c, "ns", true, a0, a1, c0, d1)
	if c.SetPending("ns", key(99), true) || c.Pending("ns", key(99)) {
		t.Fatal("SetPending of a page not tracked reported it tracked")
	}
	if !c.Pending("ns", a0) || c.Pending("ns", b0) {
		t.Fatal("Pending does not report the marks")
	}

	// Each reservation below needs (used + bytes − capacity) pages evicted.
	// Two pages: the non-pending chain b, leaf first, although a is older.
	checkVictims(t, "first", reserveVictims(t, c, "ns", 4*pg), []Key{b1, b0}, []bool{false, false})
	// Only pending pages are evictable now (d0 has the child d1): the
	// least recently used of them, a1 (2), then a0 (1) — its leaf went
	// first — then d1 (4); d0 (6) is then a leaf and not pending, so it
	// goes before c0 (5).
	checkVictims(t, "pending", reserveVictims(t, c, "ns", 8*pg), []Key{a1, a0, d1, d0}, []bool{true, true, true, false})

	// Settled pages are back in the plain order: e0 older than f0.
	chain(t, c, "ns", []Key{e0}, pg, []int64{7})
	chain(t, c, "ns", []Key{f0}, pg, []int64{8})
	setPending(t, c, "ns", true, e0)
	checkVictims(t, "e0 pending", reserveVictims(t, c, "ns", 7*pg), []Key{f0}, []bool{false})
	chain(t, c, "ns", []Key{f0}, pg, []int64{8})
	setPending(t, c, "ns", false, e0)
	checkVictims(t, "e0 settled", reserveVictims(t, c, "ns", 7*pg), []Key{e0}, []bool{false})

	// A page removed loses its mark: added again, it is not pending.
	setPending(t, c, "ns", true, c0)
	if !c.Removed("ns", c0) {
		t.Fatal("c0 not tracked")
	}
	chain(t, c, "ns", []Key{c0}, pg, []int64{5})
	if c.Pending("ns", c0) {
		t.Fatal("a page removed and added again is still pending")
	}
}

// TestPendingWithPinsAndQuotas: a pinned page is never a victim, pending
// or not; a namespace's quota is met from its own pages, non-pending
// first; a save's capacity victims come from its namespace and the shared
// ones (rule 5), the non-pending of any of them before the pending of its
// own, and never from a namespace within its quota; when nothing but
// protected and pinned pages is left the reservation fails with
// ErrNoSpace, changing nothing.
func TestPendingWithPinsAndQuotas(t *testing.T) {
	const pg = 1000
	c, err := New(Config{CapacityBytes: 6 * pg, Quotas: map[string]int64{"q": 2 * pg}})
	if err != nil {
		t.Fatal(err)
	}
	chain(t, c, "x", []Key{key(1)}, pg, []int64{1}) // pending, oldest
	chain(t, c, "x", []Key{key(2)}, pg, []int64{2}) // not pending, pinned
	chain(t, c, "y", []Key{key(3)}, pg, []int64{9}) // not pending, shared (no quota)
	chain(t, c, "q", []Key{key(4)}, pg, []int64{6}) // within q's quota: protected; newer than key(5)
	chain(t, c, "q", []Key{key(5)}, pg, []int64{3}) // pending, q's own
	setPending(t, c, "x", true, key(1))
	setPending(t, c, "q", true, key(5))
	if !c.Pin("x", key(2)) {
		t.Fatal("pin")
	}
	// q's save beyond its quota: its own non-pending page first although
	// it is the newer (plain LRU would take the pending key(5)), though
	// q's pages are protected from others.
	checkVictims(t, "quota", reserveVictims(t, c, "q", pg), []Key{key(4)}, []bool{false})
	chain(t, c, "q", []Key{key(4)}, pg, []int64{6})
	checkVictims(t, "quota, pending", reserveVictims(t, c, "q", 2*pg), []Key{key(4), key(5)}, []bool{false, true})
	chain(t, c, "q", []Key{key(4)}, pg, []int64{6})
	chain(t, c, "q", []Key{key(5)}, pg, []int64{3})
	setPending(t, c, "q", true, key(5))

	// x's save of 3 pages (5 of 6 used: 2 to evict): y's page (shared, not pending,
	// newest) before x's own pending page; never x's pinned page nor q's.
	checkVictims(t, "capacity", reserveVictims(t, c, "x", 3*pg), []Key{key(3), key(1)}, []bool{false, true})
	// Nothing evictable is left for x: x's page is pinned, q is within its
	// quota.
	before := c.Usage()
	if _, err := c.Reserve(Want{Namespace: "x", Bytes: 4 * pg, AvailBytes: -1}); !errors.Is(err, ErrNoSpace) {
		t.Fatalf("Reserve with only pinned and protected pages: %v, want ErrNoSpace", err)
	}
	if after := c.Usage(); !slicesEqualUsage(before, after) || after.EvictingBytes != 0 {
		t.Fatalf("a failed Reserve changed the accounting: %+v, was %+v", after, before)
	}
	// Shrink keeps the order too: unpinned, x's page goes first, then
	// nothing else (q within its quota is not shared).
	if err := c.Unpin("x", key(2)); err != nil {
		t.Fatal(err)
	}
	setPending(t, c, "x", true, key(2))
	chain(t, c, "y", []Key{key(3)}, pg, []int64{9})
	vs, ok := c.Shrink(0, nil)
	if ok {
		t.Fatal("Shrink to 0 reached its target with q's pages protected")
	}
	checkVictims(t, "shrink", vs, []Key{key(3), key(2)}, []bool{false, true})
}
