package pagecache_test

import (
	"bytes"
	"context"
	"errors"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/kvpersist/kvpersist/engine/evict"
	"github.com/kvpersist/kvpersist/engine/jobs"
	"github.com/kvpersist/kvpersist/engine/layout"
	"github.com/kvpersist/kvpersist/engine/pagecache"
	"github.com/kvpersist/kvpersist/engine/pageindex"
	"github.com/kvpersist/kvpersist/engine/store"
	"github.com/kvpersist/kvpersist/internal/kvgen"
	"github.com/kvpersist/kvpersist/internal/testutil"
)

// The page cache without an engine: a store, the page index, jobs' prefix
// save as the write that Reserve covers.

func TestMain(m *testing.M) { goleak.VerifyTestMain(m, goleak.IgnoreCurrent()) }

const (
	pTokens   = 64  // tokens per page
	maxTokens = 512 // tokens of the test cache
)

var discard = slog.New(slog.DiscardHandler)

// rig is one cache on a fresh root.
type rig struct {
	root  string
	st    *store.Store
	index *pageindex.Index
	pc    *pagecache.Cache
	jcfg  *jobs.Config
	kv    *kvgen.Cache
}

func newRig(t *testing.T, root string, lim pagecache.Limits, sink pagecache.Sink) *rig {
	t.Helper()
	return openRig(t, root, pagecache.Options{Limits: lim, Sink: sink})
}

// openRig is newRig with o (its Store, Index and Logger set here).
func openRig(t *testing.T, root string, o pagecache.Options) *rig {
	t.Helper()
	st, err := store.Create(root, store.Options{NoSync: true})
	if err != nil {
		t.Fatal(err)
	}
	index, _, err := pageindex.Build(st)
	if err != nil {
		t.Fatal(err)
	}
	o.Store, o.Index, o.Logger = st, index, discard
	pc, err := pagecache.Open(o)
	if err != nil {
		t.Fatal(err)
	}
	r := &rig{root: root, st: st, index: index, pc: pc, kv: kvgen.NewCache(kvgen.Tiny, maxTokens, true, nil),
		jcfg: &jobs.Config{Root: root, NoSync: true, Logger: discard}}
	t.Cleanup(func() { _ = pc.Close() })
	return r
}

// waitFor polls cond every millisecond for up to a minute.
func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	guard := time.After(time.Minute)
	for !cond() {
		select {
		case <-guard:
			t.Fatalf("timed out waiting for %s", what)
		case <-time.After(time.Millisecond):
		}
	}
}

// convTokens are own tokens of conversation conv.
func convTokens(own int, conv uint32) []uint32 {
	out := make([]uint32, own)
	for i := range out {
		out[i] = conv<<20 + uint32(i)
	}
	return out
}

// admission is a save's jobs.Admission through Reserve, as the engine's.
type admission struct {
	pc     *pagecache.Cache
	a      *pagecache.Admission
	admits int
	// admitted, when set, runs after the first Admit; saved runs once the
	// save returned, before its Settle.
	admitted, saved func()
}

func (ad *admission) Admit(ctx context.Context, n *store.Namespace, keys, parents []layout.PageKey, fileBytes []int64) error {
	if ad.a != nil { // Confirm failed: admitted again
		ad.a.Settle(pagecache.ErrPinLost)
		ad.a = nil
	}
	a, err := ad.pc.Reserve(ctx, n, keys, parents, func(i int) (int64, error) { return fileBytes[i], nil }, false)
	if err != nil {
		a.Release()
		return err
	}
	ad.a = a
	if ad.admits++; ad.admits == 1 && ad.admitted != nil {
		ad.admitted()
	}
	return nil
}

func (ad *admission) Confirm(*store.Namespace) bool { return ad.a == nil || ad.a.Confirm() }

// save saves toks to ns through Reserve (jobs.SavePrefix's admission), as
// the engine does, settles, and indexes the pages.
func (r *rig) save(ns string, toks []uint32) ([]layout.PageKey, error) {
	return r.saveWith(ns, toks, &admission{pc: r.pc})
}

// saveWith is save through adm.
func (r *rig) saveWith(ns string, toks []uint32, adm *admission) ([]layout.PageKey, error) {
	vs := r.kv.Views()
	ts := make([]jobs.TensorSpec, 2*r.kv.Model.Layers)
	for i := range ts {
		ts[i] = jobs.TensorSpec{DType: r.kv.Model.DType, View: vs[i]}
	}
	ctx := context.Background()
	cfg := *r.jcfg
	cfg.Admission = adm
	res, _, err := jobs.SavePrefix(ctx, &cfg, &jobs.SavePrefixRequest{Namespace: ns, Identity: "tiny", Tokens: toks, Tensors: ts, PageTokens: pTokens})
	if adm.saved != nil {
		adm.saved()
	}
	if adm.a != nil {
		adm.a.Settle(err)
	}
	if err != nil {
		return nil, err
	}
	keys := res.Stored()
	r.index.Add(ns, keys...)
	return keys, nil
}

func (r *rig) mustSave(t *testing.T, ns string, toks []uint32) []layout.PageKey {
	t.Helper()
	keys, err := r.save(ns, toks)
	if err != nil {
		t.Fatalf("save of %d tokens to %s: %v", len(toks), ns, err)
	}
	return keys
}

// checkDisk requires Usage to equal the page files on disk (st_blocks),
// nothing reserved or evicting.
func (r *rig) checkDisk(t *testing.T) {
	t.Helper()
	pb, tb, pages, temps := testutil.PageTree(t, r.root)
	u := r.pc.Usage()
	if u.UsedBytes != pb || u.Pages != pages || temps != 0 || tb != 0 || u.ReservedBytes != 0 || u.EvictingBytes != 0 {
		t.Fatalf("usage %+v; the disk %d bytes in %d pages, %d temp files of %d bytes", u, pb, pages, temps, tb)
	}
}

// TestLimitsCheck: each limit out of range is ErrLimits naming the field,
// from Check, Open and SetQuota.
func TestLimitsCheck(t *testing.T) {
	bad := map[string]pagecache.Limits{
		"CapacityBytes":   {CapacityBytes: -1},
		"HeadroomBytes":   {HeadroomBytes: evict.MaxBytes + 1},
		"QuotaBytes":      {QuotaBytes: map[string]int64{"../x": 1}},
		"namespace \"a\"": {QuotaBytes: map[string]int64{"a": -5}},
	}
	for field, l := range bad {
		err := l.Check()
		if !errors.Is(err, pagecache.ErrLimits) || !strings.Contains(err.Error(), field) {
			t.Errorf("%s: %v, want ErrLimits naming it", field, err)
		}
	}
	if err := (pagecache.Limits{CapacityBytes: evict.MaxBytes, QuotaBytes: map[string]int64{"a": 0}}).Check(); err != nil {
		t.Errorf("limits in range: %v", err)
	}
	st, err := store.Create(t.TempDir(), store.Options{NoSync: true})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := pagecache.Open(pagecache.Options{Limits: bad["CapacityBytes"], Store: st, Index: &pageindex.Index{}}); !errors.Is(err, pagecache.ErrLimits) {
		t.Errorf("Open with a negative capacity: %v", err)
	}
	r := newRig(t, t.TempDir(), pagecache.Limits{}, nil)
	if err := r.pc.SetQuota("a/b", 1); !errors.Is(err, pagecache.ErrLimits) {
		t.Errorf("SetQuota of an invalid namespace: %v", err)
	}
	if err := r.pc.SetQuota("a", evict.MaxBytes+1); !errors.Is(err, pagecache.ErrLimits) {
		t.Errorf("SetQuota above 2^53: %v", err)
	}
}

// removals records SetOnRemoved's calls.
type removals struct {
	mu   sync.Mutex
	keys []layout.PageKey
}

func (rm *removals) removed(ns string, k layout.PageKey) {
	rm.mu.Lock()
	rm.keys = append(rm.keys, k)
	rm.mu.Unlock()
}

// TestAdmitKeepsCapacity: saves into a cache of 4 pages evict the least
// recently used leaves; the page files on disk never exceed the capacity
// and equal the accounting; each evicted page leaves the index and is
// reported to SetOnRemoved; a save that needs pinned pages evicted is
// ErrNoSpace and writes nothing.
func TestAdmitKeepsCapacity(t *testing.T) {
	probe := newRig(t, t.TempDir(), pagecache.Limits{}, nil)
	probe.mustSave(t, "m", convTokens(pTokens, 99))
	pb := probe.pc.Usage().UsedBytes
	if pb <= 0 {
		t.Fatalf("one page: %d bytes", pb)
	}
	r := newRig(t, t.TempDir(), pagecache.Limits{CapacityBytes: 4 * pb}, nil)
	var rm removals
	r.pc.SetOnRemoved(rm.removed)
	first := r.mustSave(t, "p", convTokens(2*pTokens, 1))
	r.mustSave(t, "p", convTokens(2*pTokens, 2))
	third := r.mustSave(t, "p", convTokens(2*pTokens, 3)) // evicts conversation 1
	r.checkDisk(t)
	if u := r.pc.Usage(); u.UsedBytes > 4*pb {
		t.Fatalf("used %d bytes, capacity %d", u.UsedBytes, 4*pb)
	}
	if !slices.Contains(rm.keys, first[1]) || !slices.Contains(rm.keys, first[0]) || len(rm.keys) != 2 {
		t.Fatalf("removed %v, want conversation 1's two pages (its leaf, then its root)", rm.keys)
	}
	if r.index.Has("p", first[1]) || !r.index.Has("p", third[1]) {
		t.Fatal("the index does not follow the evictions")
	}
	// Every page pinned by loads: no room.
	pins := r.pc.PinChain("p", third)
	pins2 := r.pc.PinChain("p", r.mustKeys(t, convTokens(2*pTokens, 2)))
	before, _, n, _ := testutil.PageTree(t, r.root)
	if _, err := r.save("p", convTokens(pTokens, 4)); !errors.Is(err, evict.ErrNoSpace) {
		t.Fatalf("a save needing pinned pages evicted: %v, want ErrNoSpace", err)
	}
	if after, _, n2, _ := testutil.PageTree(t, r.root); after != before || n2 != n {
		t.Fatalf("the refused save changed the disk: %d bytes in %d pages, then %d in %d", before, n, after, n2)
	}
	pins.Done(nil, false)
	pins2.Done(nil, false)
	r.mustSave(t, "p", convTokens(pTokens, 4))
	r.checkDisk(t)
}

// mustKeys is toks's chain of page keys.
func (r *rig) mustKeys(t *testing.T, toks []uint32) []layout.PageKey {
	t.Helper()
	keys, _, err := layout.PageChain("tiny", pTokens, toks)
	if err != nil {
		t.Fatal(err)
	}
	return keys
}

// TestCheckpointAcrossRestart: Close writes each changed namespace's
// recency checkpoint in engine/recency's format, with every tracked page's
// access and parent; a cache opened on the same root gets the same
// accesses back (not the files' mtimes) and the same eviction order.
func TestCheckpointAcrossRestart(t *testing.T) {
	root := t.TempDir()
	r := newRig(t, root, pagecache.Limits{}, nil)
	c1 := r.mustSave(t, "p", convTokens(2*pTokens, 1))
	c2 := r.mustSave(t, "p", convTokens(2*pTokens, 2))
	// A load of conversation 1 after conversation 2 was written: it is
	// now the most recently used.
	pins := r.pc.PinChain("p", c1)
	pins.Done(c1, true)
	want := map[layout.PageKey]evict.Page{}
	for _, k := range append(slices.Clone(c1), c2...) {
		p, ok := r.pc.Tracked("p", k)
		if !ok {
			t.Fatalf("page %s not tracked", k)
		}
		want[k] = p
	}
	if a1, a2 := want[c1[1]].Access, want[c2[1]].Access; a1 <= a2 {
		t.Fatalf("conversation 1's leaf access %d is not after conversation 2's %d", a1, a2)
	}
	if err := r.pc.Close(); err != nil {
		t.Fatal(err)
	}
	n, _ := r.st.Namespace("p")
	recs, err := n.ReadRecency()
	if err != nil || len(recs) != 4 {
		t.Fatalf("checkpoint: %d records, %v; want 4", len(recs), err)
	}
	for _, rec := range recs {
		w := want[rec.Key]
		if rec.Access != w.Access || rec.HasParent != w.HasParent || (rec.HasParent && rec.Parent != layout.PageKey(w.Parent)) {
			t.Fatalf("record %s: %+v, want access %d parent %v", rec.Key, rec, w.Access, w.HasParent)
		}
	}
	r2 := newRig(t, root, pagecache.Limits{}, nil)
	for k, w := range want {
		if p, ok := r2.pc.Tracked("p", k); !ok || p.Access != w.Access || p.Bytes != w.Bytes {
			t.Fatalf("page %s after the restart: %+v %v, want %+v", k, p, ok, w)
		}
	}
	// One page over a quota: conversation 2's leaf, the least recently
	// used, goes.
	if err := r2.pc.SetQuota("p", r2.pc.Usage().UsedBytes-1); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "the background shrink", func() bool { return r2.pc.Usage().Pages == 3 })
	if _, ok := r2.pc.Tracked("p", c2[1]); ok {
		t.Fatal("conversation 2's leaf survived the shrink")
	}
	r2.checkDisk(t)
}

// writeTemp leaves a temp page file of b bytes in namespace ns's fan-out
// directory of key k, as a save killed before its rename does, last
// modified at mtime.
func (r *rig) writeTemp(t *testing.T, ns string, k layout.PageKey, b int, mtime time.Time) string {
	t.Helper()
	n, _ := r.st.Namespace(ns)
	page := n.PagePath(k)
	path := filepath.Join(filepath.Dir(page), "."+filepath.Base(page)+".tmp-0123456789abcdef")
	if err := os.MkdirAll(filepath.Dir(path), 0o750); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(path, bytes.Repeat([]byte{7}, b), 0o640); err != nil {
		t.Fatal(err)
	}
	if err := os.Chtimes(path, mtime, mtime); err != nil {
		t.Fatal(err)
	}
	return path
}

// TestTempPageFilesSweptAndCounted: temp page files left by a killed
// writer are removed at Open when older than the grace; the younger ones
// count in Usage (TempBytes, inside UsedBytes), so a save into a full
// cache evicts pages to make room for them and pages and temp files
// together stay within the capacity; the background sweep removes them
// once they are older than the grace, and Usage drops them.
func TestTempPageFilesSweptAndCounted(t *testing.T) {
	probe := newRig(t, t.TempDir(), pagecache.Limits{}, nil)
	probe.mustSave(t, "m", convTokens(pTokens, 99))
	pb := probe.pc.Usage().UsedBytes

	root := t.TempDir()
	r := newRig(t, root, pagecache.Limits{}, nil)
	keys := r.mustSave(t, "p", convTokens(4*pTokens, 1))
	if err := r.pc.Close(); err != nil {
		t.Fatal(err)
	}
	old := r.writeTemp(t, "p", keys[0], int(pb), time.Now().Add(-time.Hour))
	young := r.writeTemp(t, "p", keys[1], 2*int(pb), time.Now())

	const grace = 1500 * time.Millisecond
	r2 := openRig(t, root, pagecache.Options{Limits: pagecache.Limits{CapacityBytes: 6 * pb}, TempGrace: grace})
	pc := r2.pc
	if _, err := os.Lstat(old); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("the temp file older than the grace is still there after Open: %v", err)
	}
	_, tb, _, temps := testutil.PageTree(t, root)
	if u := pc.Usage(); temps != 1 || u.TempBytes != tb || u.UsedBytes != 4*pb+tb {
		t.Fatalf("usage %+v; the disk: 4 pages of %d bytes and %d temp files of %d bytes", u, pb, temps, tb)
	}
	// 4 pages + the young temp file (at least 2 pages' worth) + 2 new
	// pages: above 6, so the save evicts.
	r2.mustSave(t, "p", convTokens(2*pTokens, 2))
	if pages, tbytes, _, _ := testutil.PageTree(t, root); pages+tbytes > 6*pb {
		t.Fatalf("page files %d bytes and temp files %d bytes, above the capacity %d", pages, tbytes, 6*pb)
	}
	waitFor(t, "the background sweep", func() bool {
		_, err := os.Lstat(young)
		return errors.Is(err, os.ErrNotExist) && pc.Usage().TempBytes == 0
	})
	r2.checkDisk(t)
}

// TestCachesOnOneRootShareCapacityAndRecency: two caches on one root (as
// two engines or two processes), each with a capacity of 6 pages, save
// distinct conversations: the root's page files stay within 6 pages, not
// 6 each. The one that must evict chooses by the recency both made: a
// conversation the other cache loaded last survives, the other's
// conversation nobody used since its save goes. The other cache forgets
// the pages evicted for it (policy and index).
func TestCachesOnOneRootShareCapacityAndRecency(t *testing.T) {
	a, b, pb := twoCaches(t, 6)
	root := a.root
	c1 := a.mustSave(t, "p", convTokens(2*pTokens, 1))
	c2 := a.mustSave(t, "p", convTokens(2*pTokens, 2))
	c3 := b.mustSave(t, "p", convTokens(2*pTokens, 3))
	pins := a.pc.PinChain("p", c1) // a load of conversation 1, by a
	pins.Done(c1, true)
	c4 := b.mustSave(t, "p", convTokens(2*pTokens, 4))
	pages, temps, n, _ := testutil.PageTree(t, root)
	if pages+temps > 6*pb || n != 6 {
		t.Fatalf("the root holds %d pages, %d bytes (and %d of temp files); the capacity of each cache is 6 pages, %d bytes", n, pages, temps, 6*pb)
	}
	n0, _ := a.st.Namespace("p")
	exists := func(k layout.PageKey) bool {
		_, err := os.Lstat(n0.PagePath(k))
		return err == nil
	}
	for _, k := range append(append(slices.Clone(c1), c3...), c4...) {
		if !exists(k) {
			t.Fatalf("page %s evicted; want conversation 2's, the least recently used of both caches", k)
		}
	}
	if exists(c2[0]) || exists(c2[1]) {
		t.Fatal("conversation 2, used by nobody since its save, survived")
	}
	if u := b.pc.Usage(); u.Pages != 6 || u.UsedBytes != pages {
		t.Fatalf("the evicting cache's usage %+v, want the root's 6 pages, %d bytes", u, pages)
	}
	waitFor(t, "the other cache to forget the evicted pages", func() bool {
		_, tracked := a.pc.Tracked("p", c2[1])
		return !tracked && !a.index.Has("p", c2[1]) && a.pc.Usage().Pages == 6
	})
}

// twoCaches opens two caches on one fresh root, each bounded to pages
// pages of one full page's allocated bytes pb.
func twoCaches(t *testing.T, pages int64) (a, b *rig, pb int64) {
	t.Helper()
	probe := newRig(t, t.TempDir(), pagecache.Limits{}, nil)
	probe.mustSave(t, "m", convTokens(pTokens, 99))
	pb = probe.pc.Usage().UsedBytes
	root := t.TempDir()
	a = newRig(t, root, pagecache.Limits{CapacityBytes: pages * pb}, nil)
	b = openRig(t, root, pagecache.Options{Limits: pagecache.Limits{CapacityBytes: pages * pb}})
	return a, b, pb
}

// A save that reuses pages another cache on the root evicts between its
// admission and its lock finds them gone under the lock (Confirm), admits
// again, and so writes them again inside a reservation: the root's page
// files never exceed the capacity, not even before the settle's shrink.
func TestSaveAdmitsAgainWhenAnotherCacheEvictsItsPins(t *testing.T) {
	a, b, pb := twoCaches(t, 4)
	root := a.root
	c1 := a.mustSave(t, "p", convTokens(2*pTokens, 1))
	var diskAtSave int64
	adm := &admission{pc: a.pc,
		// a pinned c1 and reserved one page: 3 of 4. b, seeing c1 and
		// that reservation, makes room for its 2 pages by evicting c1's
		// leaf.
		admitted: func() { b.mustSave(t, "p", convTokens(2*pTokens, 2)) },
		saved: func() {
			pages, temps, _, _ := testutil.PageTree(t, root)
			diskAtSave = pages + temps
		},
	}
	grown, err := a.saveWith("p", convTokens(3*pTokens, 1), adm)
	if err != nil {
		t.Fatal(err)
	}
	if len(grown) != 3 || grown[0] != c1[0] || grown[1] != c1[1] {
		t.Fatalf("grown conversation's pages %v, want %v and one more", grown, c1)
	}
	if diskAtSave > 4*pb {
		t.Fatalf("%d bytes of page files when the save returned; the capacity is %d", diskAtSave, 4*pb)
	}
	if adm.admits != 2 {
		t.Fatalf("%d admissions; want 2 (the evicted page found under the lock)", adm.admits)
	}
	n, _ := a.st.Namespace("p")
	for _, k := range grown {
		if _, err := os.Lstat(n.PagePath(k)); err != nil {
			t.Fatalf("page %s of the save: %v", k, err)
		}
	}
}
