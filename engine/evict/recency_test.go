package evict

import (
	"errors"
	"math/rand/v2"
	"slices"
	"testing"
)

// drain returns the order in which the cache evicts every evictable page
// (Shrink to 0, each victim removed as it goes).
func drain(c *Cache) []Victim {
	vs, _ := c.Shrink(0, nil)
	for _, v := range vs {
		c.Removed(v.Namespace, v.Key)
	}
	return vs
}

// TestRestartPreservesEvictionOrder: an engine's cache sees writes and then
// touches in random order; a restart rebuilds the pages from the "disk"
// (Access = mtime, the write time) and applies the checkpoint written at
// Close. The rebuilt cache evicts in exactly the order the original would
// have; without the checkpoint (mtimes only) the order differs.
func TestRestartPreservesEvictionOrder(t *testing.T) {
	rng := rand.New(rand.NewPCG(3, 4))
	orig, _ := New(Config{})
	type onDisk struct {
		p     Page
		mtime int64
	}
	var disk []onDisk
	now := int64(1_700_000_000_000_000_000)
	nss := []string{"a", "b"}
	for conv := range 40 {
		ns := nss[conv%2]
		var parent Key
		for i := range 1 + rng.IntN(5) {
			now += 1000
			k := Key{byte(conv), byte(i), 0x42}
			p := Page{Namespace: ns, Key: k, Bytes: 4096, Access: now}
			if i > 0 {
				p.Parent, p.HasParent = parent, true
			}
			if err := orig.Add(p); err != nil {
				t.Fatal(err)
			}
			disk = append(disk, onDisk{p, now})
			parent = k
		}
	}
	for range 300 { // loads touch random pages later
		now += 1000
		d := disk[rng.IntN(len(disk))]
		orig.Touch(d.p.Namespace, d.p.Key, now)
	}
	// Close: one checkpoint per namespace (engine/pagecache tests the
	// same through the file format).
	files := map[string][]Record{}
	for _, ns := range nss {
		files[ns] = orig.Checkpoint(ns, nil)
	}
	// A restart lists the files (key, bytes, mtime: no open); with a
	// checkpoint each page's parent comes from it, without one from the
	// page's header.
	rebuild := func(withCheckpoint bool) *Cache {
		c, _ := New(Config{})
		recs := map[string][]Record{}
		parents := map[Key]Record{}
		if withCheckpoint {
			for _, ns := range nss {
				r := files[ns]
				recs[ns] = r
				for _, rec := range r {
					parents[rec.Key] = rec
				}
			}
		}
		for _, i := range rng.Perm(len(disk)) { // readdir order is arbitrary
			d := disk[i]
			p := Page{Namespace: d.p.Namespace, Key: d.p.Key, Bytes: d.p.Bytes, Access: d.mtime}
			if rec, ok := parents[p.Key]; ok {
				p.Parent, p.HasParent = rec.Parent, rec.HasParent
			} else {
				if withCheckpoint {
					t.Fatalf("page %s not in the checkpoint", p.Key)
				}
				p.Parent, p.HasParent = d.p.Parent, d.p.HasParent // read from the header
			}
			if err := c.Add(p); err != nil {
				t.Fatal(err)
			}
		}
		for ns, r := range recs {
			if n := c.ApplyCheckpoint(ns, r, now); n != len(r) {
				t.Fatalf("applied %d of %d records", n, len(r))
			}
		}
		return c
	}
	restarted, mtimesOnly := rebuild(true), rebuild(false)
	want := drain(orig)
	if len(want) != len(disk) {
		t.Fatalf("drained %d of %d pages", len(want), len(disk))
	}
	if got := drain(restarted); !slices.Equal(got, want) {
		t.Fatalf("eviction order after a restart with the checkpoint differs:\n got %v\nwant %v", victimKeys(got), victimKeys(want))
	}
	if got := drain(mtimesOnly); slices.Equal(got, want) {
		t.Fatal("mtimes alone gave the same order: the test does not show the checkpoint's effect")
	}
}

// TestAddRefusesOwnAncestor: pages whose parents (taken from a checkpoint
// at a restart) would form a cycle are refused (ErrInvalid) instead of
// becoming unevictable: with B→A refused after A→B, A is a leaf and a
// Reserve can evict it. Commit refuses the same.
func TestAddRefusesOwnAncestor(t *testing.T) {
	c, _ := New(Config{CapacityBytes: 100})
	a, b, r := key(1), key(2), key(3)
	for _, p := range []Page{
		{Namespace: "n", Key: r, Bytes: 10, Access: 9},
		{Namespace: "n", Key: a, Parent: b, HasParent: true, Bytes: 40, Access: 2},
	} {
		if err := c.Add(p); err != nil {
			t.Fatal(err)
		}
	}
	if err := c.Add(Page{Namespace: "n", Key: b, Parent: a, HasParent: true, Bytes: 40, Access: 3}); !errors.Is(err, ErrInvalid) {
		t.Fatalf("Add of B under A, with A under B: %v, want ErrInvalid", err)
	}
	if _, ok := c.Lookup("n", b); ok {
		t.Fatal("the refused page is tracked")
	}
	res, err := c.Reserve(Want{Namespace: "n", Bytes: 80})
	if err != nil {
		t.Fatalf("Reserve with A a leaf: %v", err)
	}
	if len(res.Victims) != 1 || res.Victims[0].Key != a {
		t.Fatalf("victims %v, want A (its parent B is not tracked)", res.Victims)
	}
	c.Removed("n", a)
	// A save's Commit: X under Y, then Y under X.
	x, y := key(5), key(6)
	if err := res.Commit(Page{Namespace: "n", Key: x, Parent: y, HasParent: true, Bytes: 10, Access: 4}); err != nil {
		t.Fatal(err)
	}
	if err := res.Commit(Page{Namespace: "n", Key: y, Parent: x, HasParent: true, Bytes: 10, Access: 5}); !errors.Is(err, ErrInvalid) {
		t.Fatalf("Commit of Y under X, with X under Y: %v, want ErrInvalid", err)
	}
	res.Release()
	if u := c.Usage(); u.Pages != 2 || u.UsedBytes != 20 {
		t.Fatalf("usage %+v, want R and X: 2 pages, 20 bytes", u)
	}
}

// TestApplyCheckpointClampsFutureAccess: a checkpoint written while the
// clock ran ahead records accesses after the restart's now; they count as
// now, so a page touched after the restart is newer and outlives it.
func TestApplyCheckpointClampsFutureAccess(t *testing.T) {
	const now = int64(1_000_000)
	c, _ := New(Config{})
	x, y := key(1), key(2)
	for _, p := range []Page{{Namespace: "n", Key: x, Bytes: 1, Access: 100}, {Namespace: "n", Key: y, Bytes: 1, Access: 200}} {
		if err := c.Add(p); err != nil {
			t.Fatal(err)
		}
	}
	recs := []Record{{Key: x, Access: now + 3_600_000_000_000}, {Key: y, Access: 150}} // x: an hour ahead
	if n := c.ApplyCheckpoint("n", recs, now); n != 2 {
		t.Fatalf("matched %d records, want 2", n)
	}
	if p, _ := c.Lookup("n", x); p.Access != now {
		t.Fatalf("x's access %d, want it clamped to now %d", p.Access, now)
	}
	if p, _ := c.Lookup("n", y); p.Access != 200 {
		t.Fatalf("y's access %d, want its mtime 200 (the record is older)", p.Access)
	}
	c.Touch("n", y, now+1)
	if got := drain(c); len(got) != 2 || got[0].Key != x || got[1].Key != y {
		t.Fatalf("eviction order %v, want x (clamped to now) before y (touched after now)", victimKeys(got))
	}
}
