package evict

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"reflect"
	"slices"
	"sort"
	"testing"
)

// model is a naive reference of the policy: plain maps, and every victim
// found by scanning all pages. It shares no code with the Cache.
type model struct {
	capacity int64
	quotas   map[string]int64
	pages    map[mKey]*mPage // tracked pages (victims included)
	pins     map[mKey]int    // pins, also of pages no longer tracked
	res      map[int]*mRes
	nextRes  int
}

type mKey struct {
	ns  string
	key Key
}

type mPage struct {
	parent    Key
	hasParent bool
	bytes     int64
	access    int64
	evicting  bool
	pending   bool // SetPending; a page removed and added again is not
}

type mRes struct {
	ns   string
	left int64
	done bool
}

func newModel(capacity int64) *model {
	return &model{capacity: capacity, quotas: map[string]int64{}, pages: map[mKey]*mPage{}, pins: map[mKey]int{}, res: map[int]*mRes{}}
}

func (m *model) nsBytes(ns string) (used, evicting, reserved int64, pages int) {
	for k, p := range m.pages {
		if k.ns == ns {
			used += p.bytes
			pages++
			if p.evicting {
				evicting += p.bytes
			}
		}
	}
	for _, r := range m.res {
		if r.ns == ns && !r.done {
			reserved += r.left
		}
	}
	return
}

func (m *model) totals() (used, evicting, reserved int64, pages int) {
	for _, p := range m.pages {
		used += p.bytes
		pages++
		if p.evicting {
			evicting += p.bytes
		}
	}
	for _, r := range m.res {
		if !r.done {
			reserved += r.left
		}
	}
	return
}

// evictable: tracked, not a victim, not pinned, and no tracked page that
// is not a victim names it as parent.
func (m *model) evictable(k mKey) bool {
	p := m.pages[k]
	if p == nil || p.evicting || m.pins[k] > 0 {
		return false
	}
	for ck, c := range m.pages {
		if ck.ns == k.ns && !c.evicting && c.hasParent && c.parent == k.key {
			return false
		}
	}
	return true
}

// ownAncestor: adding p would close a cycle of parent links (walking up
// from p's parent through tracked pages, victims included, reaches p).
func (m *model) ownAncestor(p Page) bool {
	if !p.HasParent {
		return false
	}
	k := p.Parent
	for range len(m.pages) + 1 {
		if k == p.Key {
			return true
		}
		q := m.pages[mKey{p.Namespace, k}]
		if q == nil || !q.hasParent {
			return false
		}
		k = q.parent
	}
	return true
}

// shared: other namespaces may evict ns's pages.
func (m *model) shared(ns string) bool {
	q := m.quotas[ns]
	used, evicting, _, _ := m.nsBytes(ns)
	return q == 0 || used-evicting > q
}

// oldest scans for the first evictable page among the namespaces
// accepted by in, in the order (pending, access, namespace, key): pages
// not pending first.
func (m *model) oldest(in func(ns string) bool) (mKey, bool) {
	var best mKey
	found := false
	for k, p := range m.pages {
		if !in(k.ns) || !m.evictable(k) {
			continue
		}
		if !found {
			best, found = k, true
			continue
		}
		b := m.pages[best]
		if p.pending != b.pending {
			if !p.pending {
				best = k
			}
			continue
		}
		if p.access != b.access {
			if p.access < b.access {
				best = k
			}
			continue
		}
		if k.ns != best.ns {
			if k.ns < best.ns {
				best = k
			}
			continue
		}
		if string(k.key[:]) < string(best.key[:]) {
			best = k
		}
	}
	return best, found
}

func (m *model) reserve(ns string, bytes, avail, headroom int64) ([]Victim, Reason, int) {
	used, evicting, reserved, _ := m.totals()
	nsUsed, nsEvicting, nsReserved, _ := m.nsBytes(ns)
	q := m.quotas[ns]
	if q > 0 && bytes > q {
		return nil, ReasonQuota, 0
	}
	if m.capacity > 0 && bytes > m.capacity {
		return nil, ReasonCapacity, 0
	}
	var needQ, needC, needH int64
	if q > 0 {
		needQ = nsUsed - nsEvicting + nsReserved + bytes - q
	}
	if m.capacity > 0 {
		needC = used - evicting + reserved + bytes - m.capacity
	}
	if avail >= 0 && headroom > 0 {
		needH = headroom + bytes + reserved - avail - evicting
	}
	var victims []Victim
	var freed int64
	undo := func() {
		for _, v := range victims {
			m.pages[mKey{v.Namespace, v.Key}].evicting = false
		}
	}
	take := func(k mKey, r Reason) {
		p := m.pages[k]
		p.evicting = true
		freed += p.bytes
		victims = append(victims, Victim{Namespace: k.ns, Key: k.key, Bytes: p.bytes, Reason: r, Pending: p.pending})
	}
	for freed < needQ {
		k, ok := m.oldest(func(n string) bool { return n == ns })
		if !ok {
			undo()
			return nil, ReasonQuota, 0
		}
		take(k, ReasonQuota)
	}
	for _, lim := range []struct {
		want int64
		r    Reason
	}{{needC, ReasonCapacity}, {needH, ReasonHeadroom}} {
		for freed < lim.want {
			k, ok := m.oldest(func(n string) bool { return n == ns || m.shared(n) })
			if !ok {
				undo()
				return nil, lim.r, 0
			}
			take(k, lim.r)
		}
	}
	m.nextRes++
	m.res[m.nextRes] = &mRes{ns: ns, left: bytes}
	return victims, 0, m.nextRes
}

func (m *model) shrink(target int64, ns string) ([]Victim, bool) {
	var victims []Victim
	for {
		var used, evicting int64
		if ns == "" {
			used, evicting, _, _ = m.totals()
		} else {
			used, evicting, _, _ = m.nsBytes(ns)
		}
		if used-evicting <= target {
			return victims, true
		}
		in := m.shared
		if ns != "" {
			in = func(n string) bool { return n == ns }
		}
		k, ok := m.oldest(in)
		if !ok {
			return victims, false
		}
		p := m.pages[k]
		p.evicting = true
		victims = append(victims, Victim{Namespace: k.ns, Key: k.key, Bytes: p.bytes, Reason: ReasonShrink, Pending: p.pending})
	}
}

func (m *model) usage() Usage {
	used, evicting, reserved, pages := m.totals()
	u := Usage{CapacityBytes: m.capacity, UsedBytes: used, ReservedBytes: reserved, EvictingBytes: evicting, Pages: pages}
	names := map[string]bool{}
	for k := range m.pages {
		names[k.ns] = true
	}
	for _, r := range m.res {
		names[r.ns] = true
	}
	for n := range m.quotas {
		names[n] = true
	}
	for n := range names {
		nu := NamespaceUsage{Name: n, QuotaBytes: m.quotas[n]}
		nu.UsedBytes, nu.EvictingBytes, nu.ReservedBytes, nu.Pages = m.nsBytes(n)
		u.Namespaces = append(u.Namespaces, nu)
	}
	return normUsage(u)
}

// normUsage drops namespaces with nothing in them (the Cache may keep an
// empty one while a placeholder or a pin lives) and sorts.
func normUsage(u Usage) Usage {
	var out []NamespaceUsage
	for _, n := range u.Namespaces {
		if n != (NamespaceUsage{Name: n.Name}) {
			out = append(out, n)
		}
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Name < out[j].Name })
	u.Namespaces = out
	return u
}

func key(i int) Key { return Key{byte(i), byte(i >> 8), 0xa5} }

// TestPolicyAgainstModel runs random operations on the Cache and on the
// naive model and requires the same victims, in the same order, the same
// errors and the same accounting after every operation; after every
// successful Reserve the capacity and quota bound holds.
func TestPolicyAgainstModel(t *testing.T) {
	seeds := 60
	steps := 400
	if testing.Short() {
		seeds = 15
	}
	for seed := range seeds {
		t.Run(fmt.Sprint(seed), func(t *testing.T) { runModel(t, uint64(seed), steps) })
	}
}

func runModel(t *testing.T, seed uint64, steps int) {
	rng := rand.New(rand.NewPCG(seed, 0x9e3779b9))
	nss := []string{"a", "b", "c"}
	capacity := int64(rng.IntN(3)) * 400 // 0 (unbounded), 400 or 800
	c, err := New(Config{CapacityBytes: capacity})
	if err != nil {
		t.Fatal(err)
	}
	m := newModel(capacity)
	if rng.IntN(2) == 0 {
		q := int64(150 + rng.IntN(200))
		if err := c.SetQuota("a", q); err != nil {
			t.Fatal(err)
		}
		m.quotas["a"] = q
	}
	resv := map[int]*Reservation{}
	var pending []int // reservations with victims not yet settled
	randPage := func(ns string) Page {
		p := Page{Namespace: ns, Key: key(rng.IntN(40)), Bytes: int64(1 + rng.IntN(60)), Access: int64(rng.IntN(60))}
		if rng.IntN(5) > 0 {
			p.Parent, p.HasParent = key(rng.IntN(40)), true
		}
		return p
	}
	addModel := func(p Page) {
		m.pages[mKey{p.Namespace, p.Key}] = &mPage{parent: p.Parent, hasParent: p.HasParent, bytes: p.Bytes, access: p.Access}
	}
	for step := range steps {
		ns := nss[rng.IntN(len(nss))]
		k := key(rng.IntN(40))
		mk := mKey{ns, k}
		var op string
		switch r := rng.IntN(100); {
		case r < 25:
			op = "add"
			p := randPage(ns)
			err := c.Add(p)
			mp := m.pages[mKey{ns, p.Key}]
			switch {
			case p.HasParent && p.Parent == p.Key:
				if !errors.Is(err, ErrInvalid) {
					t.Fatalf("step %d: Add of its own parent: %v", step, err)
				}
			case mp != nil:
				if !errors.Is(err, ErrExists) {
					t.Fatalf("step %d: Add of a tracked page: %v", step, err)
				}
			case m.ownAncestor(p):
				if !errors.Is(err, ErrInvalid) {
					t.Fatalf("step %d: Add of its own ancestor: %v", step, err)
				}
			default:
				if err != nil {
					t.Fatalf("step %d: Add: %v", step, err)
				}
				addModel(p)
			}
		case r < 35:
			op = "touch"
			at := int64(rng.IntN(80))
			got := c.Touch(ns, k, at)
			p := m.pages[mk]
			if got != (p != nil) {
				t.Fatalf("step %d: Touch = %v, tracked %v", step, got, p != nil)
			}
			if p != nil && at > p.access {
				p.access = at
			}
		case r < 39:
			op = "pending"
			want := rng.IntN(3) > 0
			got := c.SetPending(ns, k, want)
			p := m.pages[mk]
			if got != (p != nil) {
				t.Fatalf("step %d: SetPending = %v, tracked %v", step, got, p != nil)
			}
			if p != nil {
				p.pending = want
			}
			if c.Pending(ns, k) != (p != nil && want) {
				t.Fatalf("step %d: Pending = %v after SetPending(%v), tracked %v", step, !(p != nil && want), want, p != nil)
			}
		case r < 42:
			op = "pin"
			got := c.Pin(ns, k)
			p := m.pages[mk]
			want := p != nil && !p.evicting
			if got != want {
				t.Fatalf("step %d: Pin = %v, want %v", step, got, want)
			}
			if want {
				m.pins[mk]++
			}
		case r < 50:
			op = "unpin"
			err := c.Unpin(ns, k)
			if m.pins[mk] == 0 {
				if !errors.Is(err, ErrNotFound) {
					t.Fatalf("step %d: Unpin without a pin: %v", step, err)
				}
			} else {
				if err != nil {
					t.Fatalf("step %d: Unpin: %v", step, err)
				}
				m.pins[mk]--
			}
		case r < 65:
			op = "reserve"
			bytes := int64(rng.IntN(250))
			avail, headroom := int64(-1), int64(0)
			if rng.IntN(3) == 0 {
				avail, headroom = int64(rng.IntN(1000)), int64(rng.IntN(300))
			}
			wantV, wantLimit, id := m.reserve(ns, bytes, avail, headroom)
			res, err := c.Reserve(Want{Namespace: ns, Bytes: bytes, AvailBytes: avail, HeadroomBytes: headroom})
			if wantLimit != 0 {
				var nse *NoSpaceError
				if !errors.As(err, &nse) || !errors.Is(err, ErrNoSpace) || nse.Limit != wantLimit {
					t.Fatalf("step %d: Reserve(%s, %d): %v, want no space for %s", step, ns, bytes, err, wantLimit)
				}
				break
			}
			if err != nil {
				t.Fatalf("step %d: Reserve(%s, %d): %v, want victims %v", step, ns, bytes, err, wantV)
			}
			if !slices.Equal(res.Victims, wantV) {
				t.Fatalf("step %d: Reserve(%s, %d) victims\n got %v\nwant %v", step, ns, bytes, res.Victims, wantV)
			}
			resv[id] = res
			pending = append(pending, id)
			u := c.Usage()
			if capacity > 0 && u.UsedBytes-u.EvictingBytes+u.ReservedBytes > capacity {
				t.Fatalf("step %d: after Reserve %+v exceeds capacity %d", step, u, capacity)
			}
			for _, n := range u.Namespaces {
				if n.QuotaBytes > 0 && n.Name == ns && n.UsedBytes-n.EvictingBytes+n.ReservedBytes > n.QuotaBytes {
					t.Fatalf("step %d: after Reserve namespace %+v exceeds its quota", step, n)
				}
			}
		case r < 72 && len(pending) > 0:
			op = "settle"
			i := rng.IntN(len(pending))
			id := pending[i]
			pending = slices.Delete(pending, i, i+1)
			abandonFrom := len(resv[id].Victims)
			if rng.IntN(4) == 0 {
				abandonFrom = rng.IntN(abandonFrom + 1)
			}
			for j, v := range resv[id].Victims {
				vk := mKey{v.Namespace, v.Key}
				if j < abandonFrom {
					if !c.Removed(v.Namespace, v.Key) {
						t.Fatalf("step %d: Removed of victim %v: not tracked", step, v)
					}
					delete(m.pages, vk)
				} else {
					if err := c.Abandon(v.Namespace, v.Key); err != nil {
						t.Fatalf("step %d: Abandon of %v: %v", step, v, err)
					}
					m.pages[vk].evicting = false
				}
			}
		case r < 82 && len(resv) > 0:
			op = "commit"
			id := anyKey(rng, resv)
			res, mr := resv[id], m.res[id]
			p := randPage(mr.ns)
			err := res.Commit(p)
			mp := m.pages[mKey{mr.ns, p.Key}]
			switch {
			case p.HasParent && p.Parent == p.Key, mr.done, mp != nil && mp.evicting, mp == nil && m.ownAncestor(p):
				if !errors.Is(err, ErrInvalid) {
					t.Fatalf("step %d: Commit: %v, want ErrInvalid", step, err)
				}
			default:
				if err != nil {
					t.Fatalf("step %d: Commit: %v", step, err)
				}
				mr.left -= min(p.Bytes, mr.left)
				if mp != nil {
					mp.bytes, mp.access = p.Bytes, max(mp.access, p.Access)
				} else {
					addModel(p)
				}
			}
		case r < 88 && len(resv) > 0:
			op = "release"
			id := anyKey(rng, resv)
			resv[id].Release()
			m.res[id].done = true
			if !slices.Contains(pending, id) {
				delete(resv, id)
				delete(m.res, id)
			}
		case r < 93:
			op = "removed"
			got := c.Removed(ns, k)
			p := m.pages[mk]
			if got != (p != nil) {
				t.Fatalf("step %d: Removed = %v, tracked %v", step, got, p != nil)
			}
			if p != nil {
				delete(m.pages, mk)
				// Drop it from the pending victim lists: it is gone.
				for _, id := range pending {
					resv[id].Victims = slices.DeleteFunc(resv[id].Victims, func(v Victim) bool { return v.Namespace == ns && v.Key == k })
				}
			}
		case r < 96:
			op = "shrink"
			target := int64(rng.IntN(600))
			one := ""
			if rng.IntN(2) == 0 {
				one = ns
			}
			wantV, wantOK := m.shrink(target, one)
			var got []Victim
			var ok bool
			if one == "" {
				got, ok = c.Shrink(target, nil)
			} else {
				got, ok = c.ShrinkNamespace(one, target, nil)
			}
			if ok != wantOK || !slices.Equal(got, wantV) {
				t.Fatalf("step %d: Shrink(%d, %q) = %v %v, want %v %v", step, target, one, got, ok, wantV, wantOK)
			}
			// Settle them at once: removed.
			for _, v := range got {
				c.Removed(v.Namespace, v.Key)
				delete(m.pages, mKey{v.Namespace, v.Key})
			}
		default:
			op = "quota"
			q := int64(rng.IntN(3)) * 150
			if err := c.SetQuota(ns, q); err != nil {
				t.Fatal(err)
			}
			if q == 0 {
				delete(m.quotas, ns)
			} else {
				m.quotas[ns] = q
			}
		}
		if got, want := normUsage(c.Usage()), m.usage(); !reflect.DeepEqual(got, want) {
			t.Fatalf("step %d (%s): usage\n got %+v\nwant %+v", step, op, got, want)
		}
	}
}

func anyKey(rng *rand.Rand, m map[int]*Reservation) int {
	ids := make([]int, 0, len(m))
	for id := range m {
		ids = append(ids, id)
	}
	slices.Sort(ids)
	return ids[rng.IntN(len(ids))]
}

// FuzzPolicyAgainstModel explores more random operation sequences than the
// fixed seeds of TestPolicyAgainstModel (make fuzz).
func FuzzPolicyAgainstModel(f *testing.F) {
	for _, s := range []uint64{1, 2, 3} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, seed uint64) { runModel(t, seed, 300) })
}
