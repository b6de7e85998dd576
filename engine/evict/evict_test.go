package evict

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"sync"
	"testing"
)

// chain adds pages k[0] ← k[1] ← ... to ns (each the parent of the next),
// each of bytes, with accesses at[i].
func chain(t testing.TB, c *Cache, ns string, keys []Key, bytes int64, at []int64) {
	t.Helper()
	for i, k := range keys {
		p := Page{Namespace: ns, Key: k, Bytes: bytes, Access: at[i]}
		if i > 0 {
			p.Parent, p.HasParent = keys[i-1], true
		}
		if err := c.Add(p); err != nil {
			t.Fatal(err)
		}
	}
}

func victimKeys(vs []Victim) []Key {
	out := make([]Key, len(vs))
	for i, v := range vs {
		out[i] = v.Key
	}
	return out
}

// TestSharedPrefixOutlivesTails: three conversations share a two-page
// system prompt, which was used first (least recently) of all. Plain LRU
// would evict the prompt first; the policy evicts every tail, leaves
// before their parents, and the prompt last.
func TestSharedPrefixOutlivesTails(t *testing.T) {
	c, err := New(Config{CapacityBytes: 8 * 4096})
	if err != nil {
		t.Fatal(err)
	}
	sys0, sys1 := key(1), key(2)
	chain(t, c, "ns", []Key{sys0, sys1}, 4096, []int64{1, 2})
	tails := [][]Key{{key(10), key(11)}, {key(20), key(21)}, {key(30), key(31)}}
	for i, tail := range tails {
		base := int64(10 * (i + 1)) // every tail is newer than the prompt
		if err := c.Add(Page{Namespace: "ns", Key: tail[0], Parent: sys1, HasParent: true, Bytes: 4096, Access: base}); err != nil {
			t.Fatal(err)
		}
		if err := c.Add(Page{Namespace: "ns", Key: tail[1], Parent: tail[0], HasParent: true, Bytes: 4096, Access: base + 1}); err != nil {
			t.Fatal(err)
		}
	}
	if u := c.Usage(); u.UsedBytes != 8*4096 || u.Pages != 8 {
		t.Fatalf("usage %+v, want 8 pages of 4096 bytes", u)
	}
	// A save of 6 pages must evict 6: all six tail pages, leaf before
	// parent, oldest conversation first; the system prompt stays.
	r, err := c.Reserve(Want{Namespace: "ns", Bytes: 6 * 4096, AvailBytes: -1})
	if err != nil {
		t.Fatal(err)
	}
	want := []Key{key(11), key(10), key(21), key(20), key(31), key(30)}
	if got := victimKeys(r.Victims); !slices.Equal(got, want) {
		t.Fatalf("victims %v, want %v", got, want)
	}
	for _, v := range r.Victims {
		if v.Reason != ReasonCapacity || v.Bytes != 4096 || v.Namespace != "ns" {
			t.Fatalf("victim %+v", v)
		}
	}
	// One more page: now the prompt's leaf (sys1), then sys0.
	r2, err := c.Reserve(Want{Namespace: "ns", Bytes: 4096, AvailBytes: -1})
	if err != nil {
		t.Fatal(err)
	}
	if got := victimKeys(r2.Victims); !slices.Equal(got, []Key{sys1}) {
		t.Fatalf("next victim %v, want the prompt's second page", got)
	}
}

// TestNoSpaceChangesNothing: when every page is pinned or an ancestor of a
// pinned page, Reserve fails with ErrNoSpace (a *NoSpaceError naming the
// capacity), chooses no victim, and a later Reserve after Unpin succeeds.
func TestNoSpaceChangesNothing(t *testing.T) {
	c, _ := New(Config{CapacityBytes: 3 * 100})
	chain(t, c, "ns", []Key{key(1), key(2), key(3)}, 100, []int64{1, 2, 3})
	if !c.Pin("ns", key(3)) {
		t.Fatal("pin failed")
	}
	before := c.Usage()
	_, err := c.Reserve(Want{Namespace: "ns", Bytes: 50, AvailBytes: -1})
	var nse *NoSpaceError
	if !errors.Is(err, ErrNoSpace) || !errors.As(err, &nse) || nse.Limit != ReasonCapacity || nse.NeedBytes != 50 || nse.FoundBytes != 0 {
		t.Fatalf("Reserve with everything pinned: %v", err)
	}
	if after := c.Usage(); !slicesEqualUsage(before, after) {
		t.Fatalf("usage changed by a failed Reserve: %+v -> %+v", before, after)
	}
	if err := c.Unpin("ns", key(3)); err != nil {
		t.Fatal(err)
	}
	r, err := c.Reserve(Want{Namespace: "ns", Bytes: 150, AvailBytes: -1})
	if err != nil {
		t.Fatal(err)
	}
	if got := victimKeys(r.Victims); !slices.Equal(got, []Key{key(3), key(2)}) {
		t.Fatalf("victims %v, want leaf then parent", got)
	}
	// A victim cannot be pinned (a load treats it as a miss), nor committed.
	if c.Pin("ns", key(3)) {
		t.Fatal("Pin of a victim succeeded")
	}
	if err := r.Commit(Page{Namespace: "ns", Key: key(3), Bytes: 100}); !errors.Is(err, ErrInvalid) {
		t.Fatalf("Commit of a victim: %v", err)
	}
	// A save bigger than the capacity fails at once.
	if _, err := c.Reserve(Want{Namespace: "ns", Bytes: 301, AvailBytes: -1}); !errors.As(err, &nse) || nse.Limit != ReasonCapacity {
		t.Fatalf("Reserve above capacity: %v", err)
	}
}

func slicesEqualUsage(a, b Usage) bool {
	return fmt.Sprint(a) == fmt.Sprint(b)
}

// TestQuotaIsolation: tenant "small" has a quota; "big" has none. A save in
// big can never evict small's pages (it fails instead), while a save in
// small that exceeds its quota evicts its own pages, and one that exceeds
// the capacity may evict big's.
func TestQuotaIsolation(t *testing.T) {
	c, _ := New(Config{CapacityBytes: 1000, Quotas: map[string]int64{"small": 300}})
	for i := range 3 {
		c.Add(Page{Namespace: "small", Key: key(i), Bytes: 100, Access: int64(i)}) // the oldest pages
	}
	for i := range 7 {
		c.Add(Page{Namespace: "big", Key: key(100 + i), Bytes: 100, Access: int64(100 + i)})
	}
	for i := range 7 {
		c.Pin("big", key(100+i))
	}
	_, err := c.Reserve(Want{Namespace: "big", Bytes: 100, AvailBytes: -1})
	if !errors.Is(err, ErrNoSpace) {
		t.Fatalf("save in big with its pages pinned: %v, want ErrNoSpace (small's pages are protected)", err)
	}
	for i := range 7 {
		c.Unpin("big", key(100+i))
	}
	// small at its quota: its save evicts its own oldest page (quota).
	r, err := c.Reserve(Want{Namespace: "small", Bytes: 100, AvailBytes: -1})
	if err != nil {
		t.Fatal(err)
	}
	if len(r.Victims) != 1 || r.Victims[0] != (Victim{Namespace: "small", Key: key(0), Bytes: 100, Reason: ReasonQuota}) {
		t.Fatalf("victims %+v, want small's oldest for its quota", r.Victims)
	}
	// The cache is full (1000 = 900 used + 100 reserved): a save in big
	// evicts big's oldest, never small's older pages.
	r2, err := c.Reserve(Want{Namespace: "big", Bytes: 100, AvailBytes: -1})
	if err != nil {
		t.Fatal(err)
	}
	if len(r2.Victims) != 1 || r2.Victims[0].Namespace != "big" || r2.Victims[0].Key != key(100) {
		t.Fatalf("victims %+v, want big's oldest", r2.Victims)
	}
}

// TestHeadroom: with the capacity far away, a file system short of free
// bytes makes the save evict (reason headroom) and, when not enough can go,
// fail with a NoSpaceError naming the headroom.
func TestHeadroom(t *testing.T) {
	c, _ := New(Config{})
	chain(t, c, "ns", []Key{key(1), key(2)}, 4096, []int64{1, 2})
	// avail 10,000, headroom 8,192, save 4,096: 2,288 must go: one page.
	r, err := c.Reserve(Want{Namespace: "ns", Bytes: 4096, AvailBytes: 10000, HeadroomBytes: 8192})
	if err != nil {
		t.Fatal(err)
	}
	if len(r.Victims) != 1 || r.Victims[0].Key != key(2) || r.Victims[0].Reason != ReasonHeadroom {
		t.Fatalf("victims %+v", r.Victims)
	}
	// Another: avail still 10,000 (nothing unlinked yet); reserved 4,096
	// and evicting 4,096 count: 8192+4096+4096-10000-4096 = 2,288: key(1).
	r2, err := c.Reserve(Want{Namespace: "ns", Bytes: 4096, AvailBytes: 10000, HeadroomBytes: 8192})
	if err != nil || len(r2.Victims) != 1 || r2.Victims[0].Key != key(1) {
		t.Fatalf("second: %+v %v", r2, err)
	}
	var nse *NoSpaceError
	if _, err := c.Reserve(Want{Namespace: "ns", Bytes: 4096, AvailBytes: 10000, HeadroomBytes: 8192}); !errors.As(err, &nse) || nse.Limit != ReasonHeadroom {
		t.Fatalf("third: %v, want no space for the headroom", err)
	}
}

func TestBytesToEvict(t *testing.T) {
	b := Budget{CapacityBytes: 1000, UsedBytes: 700, ReservedBytes: 200, QuotaBytes: 400, NamespaceUsedBytes: 350,
		NamespaceReservedBytes: 0, AvailBytes: 5000, HeadroomBytes: 4000, EvictingBytes: 100}
	got := BytesToEvict(b, 150)
	want := Need{QuotaBytes: 100, CapacityBytes: 50, HeadroomBytes: 4000 + 150 + 200 - 5000 - 100 + 0}
	if want.HeadroomBytes < 0 {
		want.HeadroomBytes = 0
	}
	if got != want || got.Total() != 100 {
		t.Fatalf("BytesToEvict = %+v (total %d), want %+v (total 100)", got, got.Total(), want)
	}
	if got := BytesToEvict(Budget{AvailBytes: -1, HeadroomBytes: 1 << 40}, 1<<30); got != (Need{}) {
		t.Fatalf("unbounded, unknown free space: %+v", got)
	}
	if got := BytesToEvict(Budget{AvailBytes: 100, HeadroomBytes: 1000}, 50); got.HeadroomBytes != 950 {
		t.Fatalf("headroom: %+v", got)
	}
}

// TestConcurrentReservationsBound runs savers on several goroutines against
// a simulated disk: each reserves, unlinks its victims (then Removed),
// writes its pages (at most what it reserved, sometimes failing halfway and
// deleting what it wrote), commits them and releases. Every change of the
// simulated disk is checked against the stated bound:
//
//	disk ≤ Used + Reserved   and   disk ≤ Capacity + Evicting
func TestConcurrentReservationsBound(t *testing.T) {
	const capacity = 64 * 4096
	c, _ := New(Config{CapacityBytes: capacity})
	var diskMu sync.Mutex
	var disk int64
	var violations []string
	change := func(d int64) {
		diskMu.Lock()
		defer diskMu.Unlock()
		disk += d
		u := c.Usage()
		if disk > u.UsedBytes+u.ReservedBytes || disk > capacity+u.EvictingBytes {
			violations = append(violations, fmt.Sprintf("disk %d, usage %+v", disk, u))
		}
	}
	var wg sync.WaitGroup
	var refused sync.Map
	for g := range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			rng := rand.New(rand.NewPCG(uint64(g), 7))
			ns := fmt.Sprint("ns", g%3)
			var prev Key
			has := false
			for i := range 300 {
				pages := 1 + rng.IntN(6)
				r, err := c.Reserve(Want{Namespace: ns, Bytes: int64(pages) * 4096, AvailBytes: -1})
				if err != nil {
					if !errors.Is(err, ErrNoSpace) {
						t.Error(err)
						return
					}
					refused.Store(g, true)
					continue
				}
				for _, v := range r.Victims {
					change(-v.Bytes) // unlink
					c.Removed(v.Namespace, v.Key)
				}
				fail := rng.IntN(10) == 0
				var written int64
				for p := range pages {
					k := Key{byte(g), byte(i), byte(i >> 8), byte(p)}
					if fail && p == pages/2 {
						change(-written) // the failed save removes its files
						break
					}
					change(4096)
					written += 4096
					pg := Page{Namespace: ns, Key: k, Bytes: 4096, Access: int64(i*10 + p)}
					if has && p > 0 {
						pg.Parent, pg.HasParent = prev, true
					}
					if !fail {
						if err := r.Commit(pg); err != nil {
							t.Error(err)
						}
					}
					prev, has = k, true
				}
				r.Release()
			}
		}()
	}
	wg.Wait()
	if len(violations) > 0 {
		t.Fatalf("%d violations of the bound, first: %s", len(violations), violations[0])
	}
	u := c.Usage()
	if u.UsedBytes != disk || u.ReservedBytes != 0 || u.EvictingBytes != 0 || disk > capacity {
		t.Fatalf("at rest: usage %+v, disk %d (capacity %d)", u, disk, capacity)
	}
}

// TestChainOps: PinPrefix pins a chain up to the first page not tracked or
// being evicted, TouchAll moves a chain's recency, UnpinAll releases.
func TestChainOps(t *testing.T) {
	c, _ := New(Config{CapacityBytes: 400})
	keys := []Key{key(1), key(2), key(3), key(4)}
	chain(t, c, "ns", keys[:3], 100, []int64{1, 2, 3}) // key(4) not stored
	if n := c.PinPrefix("ns", keys); n != 3 {
		t.Fatalf("PinPrefix pinned %d, want 3", n)
	}
	if _, err := c.Reserve(Want{Namespace: "ns", Bytes: 200, AvailBytes: -1}); !errors.Is(err, ErrNoSpace) {
		t.Fatalf("Reserve with the chain pinned: %v", err)
	}
	if err := c.UnpinAll("ns", keys); !errors.Is(err, ErrNotFound) {
		t.Fatalf("UnpinAll of a never-pinned key: %v", err)
	}
	if n := c.PinPrefix("other", keys); n != 0 {
		t.Fatalf("PinPrefix in an empty namespace: %d", n)
	}
	// Another chain, newer; then touching the first makes the second the
	// older one: its leaf goes first.
	chain(t, c, "ns", []Key{key(10)}, 100, []int64{5})
	if n := c.TouchAll("ns", keys, 50); n != 3 {
		t.Fatalf("TouchAll touched %d, want 3", n)
	}
	r, err := c.Reserve(Want{Namespace: "ns", Bytes: 200, AvailBytes: -1})
	if err != nil {
		t.Fatal(err)
	}
	if got := victimKeys(r.Victims); !slices.Equal(got, []Key{key(10), key(3)}) {
		t.Fatalf("victims %v, want the untouched chain's page, then the touched chain's leaf", got)
	}
	if p, ok := c.Lookup("ns", key(2)); !ok || p.Access != 50 || !p.HasParent || p.Parent != key(1) || p.Bytes != 100 {
		t.Fatalf("Lookup: %+v %v", p, ok)
	}
	// key(3) is a victim now: PinPrefix stops before it.
	if n := c.PinPrefix("ns", keys); n != 2 {
		t.Fatalf("PinPrefix over a victim pinned %d, want 2", n)
	}
}

// TestCommitPinned: a page committed with CommitPinned is pinned from its
// commit on (a Reserve that needs its bytes fails rather than choose it),
// holds one pin (one Unpin frees it), and then is evicted like any page;
// CommitPinned of a page already tracked adds a pin to it too.
func TestCommitPinned(t *testing.T) {
	c, _ := New(Config{CapacityBytes: 200})
	r, err := c.Reserve(Want{Namespace: "ns", Bytes: 200, AvailBytes: -1})
	if err != nil {
		t.Fatal(err)
	}
	if err := r.CommitPinned(Page{Namespace: "ns", Key: key(1), Bytes: 100, Access: 1}); err != nil {
		t.Fatal(err)
	}
	if err := r.Commit(Page{Namespace: "ns", Key: key(2), Parent: key(1), HasParent: true, Bytes: 100, Access: 2}); err != nil {
		t.Fatal(err)
	}
	// key(2) tracked, unpinned; committing it again pinned pins it.
	if err := r.CommitPinned(Page{Namespace: "ns", Key: key(2), Parent: key(1), HasParent: true, Bytes: 100, Access: 3}); err != nil {
		t.Fatal(err)
	}
	r.Release()
	if _, err := c.Reserve(Want{Namespace: "ns", Bytes: 100, AvailBytes: -1}); !errors.Is(err, ErrNoSpace) {
		t.Fatalf("Reserve with both pages pinned at commit: %v, want ErrNoSpace", err)
	}
	if err := c.Unpin("ns", key(2)); err != nil {
		t.Fatal(err)
	}
	r2, err := c.Reserve(Want{Namespace: "ns", Bytes: 100, AvailBytes: -1})
	if err != nil {
		t.Fatal(err)
	}
	if got := victimKeys(r2.Victims); !slices.Equal(got, []Key{key(2)}) {
		t.Fatalf("victims %v, want the unpinned leaf only", got)
	}
	if err := c.Unpin("ns", key(1)); err != nil {
		t.Fatal(err)
	}
	if err := c.Unpin("ns", key(1)); !errors.Is(err, ErrNotFound) {
		t.Fatalf("a second Unpin of a page pinned once: %v, want ErrNotFound", err)
	}
	r2.Release()
}

// TestTempBytesCountAsUsed: temp files left by a dead writer count in Used
// (the cache's and their namespace's): a reservation evicts pages to make
// room for them, Usage reports them, they are never victims, and clearing
// them frees the room.
func TestTempBytesCountAsUsed(t *testing.T) {
	c, _ := New(Config{CapacityBytes: 100})
	for i := range 4 {
		if err := c.Add(Page{Namespace: "n", Key: key(i), Bytes: 20, Access: int64(i)}); err != nil {
			t.Fatal(err)
		}
	}
	if err := c.SetTempBytes("n", 30); err != nil {
		t.Fatal(err)
	}
	if u := c.Usage(); u.UsedBytes != 110 || u.TempBytes != 30 || u.Namespaces[0].TempBytes != 30 || u.Namespaces[0].UsedBytes != 110 {
		t.Fatalf("usage %+v, want 110 used of which 30 temp", u)
	}
	r, err := c.Reserve(Want{Namespace: "n", Bytes: 20})
	if err != nil {
		t.Fatal(err)
	}
	// 80 of pages + 30 of temp + 20 wanted: 30 over, two pages of 20.
	if len(r.Victims) != 2 || r.Victims[0].Key != key(0) || r.Victims[1].Key != key(1) {
		t.Fatalf("victims %v, want the two oldest pages", victimKeys(r.Victims))
	}
	for _, v := range r.Victims {
		c.Removed(v.Namespace, v.Key)
	}
	r.Release()
	// Temp bytes above what the pages can free: no room.
	if err := c.SetTempBytes("n", 95); err != nil {
		t.Fatal(err)
	}
	if _, err := c.Reserve(Want{Namespace: "n", Bytes: 20}); !errors.Is(err, ErrNoSpace) {
		t.Fatalf("reserve with 95 temp bytes of 100: %v, want ErrNoSpace", err)
	}
	if err := c.SetTempBytes("n", 0); err != nil {
		t.Fatal(err)
	}
	if u := c.Usage(); u.UsedBytes != 40 || u.TempBytes != 0 {
		t.Fatalf("usage after clearing: %+v, want the two pages' 40", u)
	}
	if err := c.SetTempBytes("n", -1); !errors.Is(err, ErrInvalid) {
		t.Fatalf("negative temp bytes: %v", err)
	}
}
