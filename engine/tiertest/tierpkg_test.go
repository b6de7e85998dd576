package tiertest

import (
	"context"
	"log/slog"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/kvpersist/kvpersist/engine/jobs"
	"github.com/kvpersist/kvpersist/engine/layout"
	"github.com/kvpersist/kvpersist/engine/pagecache"
	"github.com/kvpersist/kvpersist/engine/pageindex"
	"github.com/kvpersist/kvpersist/engine/store"
	"github.com/kvpersist/kvpersist/engine/tier"
)

// The tier (engine/tier) without an engine: a store, an index and a page
// cache of its own, jobs' prefix save and load around it, wired through
// tier.Deps as the engine wires them; the test caches of helpers_test.go.

// tierRig is one tier on a root of its own.
type tierRig struct {
	st    *store.Store
	index *pageindex.Index
	pc    *pagecache.Cache
	tr    *tier.Tier
	jcfg  jobs.Config
}

func openTierRig(t *testing.T, root, prefix string, onFetched func(string, *layout.Page)) *tierRig {
	t.Helper()
	st, err := store.Create(root, store.Options{NoSync: true})
	if err != nil {
		t.Fatal(err)
	}
	index, _, err := pageindex.Build(st)
	if err != nil {
		t.Fatal(err)
	}
	log := slog.New(slog.DiscardHandler)
	pc, err := pagecache.Open(pagecache.Options{Store: st, Index: index, Logger: log})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = pc.Close() })
	r := &tierRig{st: st, index: index, pc: pc, jcfg: jobs.Config{Root: root, NoSync: true, Logger: log}}
	cfg := tier.Config{Store: storeConfig(prefix), UploadBackoffMin: 20 * time.Millisecond, UploadBackoffMax: 300 * time.Millisecond}
	r.tr, err = tier.New(cfg, tier.Deps{Store: st, Index: index, Cache: pc, OnFetched: onFetched,
		RemoveCorruptPage: func(ns string, k layout.PageKey) { t.Errorf("page %s of %s found corrupt", k, ns) },
		ForgetIfGone:      func(ns string, k layout.PageKey) { t.Errorf("page %s of %s found gone", k, ns) }})
	if err != nil {
		t.Fatal(err)
	}
	pc.SetOnRemoved(r.tr.Forget)
	r.tr.Resume()
	return r
}

// closeTier closes the tier, its uploads done (a minute at most).
func (r *tierRig) closeTier(t *testing.T) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if err := r.tr.Close(ctx); err != nil {
		t.Fatalf("closing the tier: %v", err)
	}
}

// TestTierWithoutEngine: pages saved on root A and handed to A's tier
// (Saved) are uploaded by Close; B's tier, on an empty root, fetches them
// for a prefix load through its LoadSource: the load gets the saved
// bytes, the Report counts every page, OnFetched is told of each page
// (its parent and token ids the chain's) before it enters the index, and
// every page is indexed and known stored afterwards.
func TestTierWithoutEngine(t *testing.T) {
	const n = 4 * ptoks
	prefix := bucketPrefix(t)
	ctx := context.Background()
	tokens := seq(1000, n)

	// A's save needs no admission: A's page cache has no limit.
	a := openTierRig(t, t.TempDir(), prefix, nil)
	src := newKV(n)
	src.fill(tokens)
	res, _, err := jobs.SavePrefix(ctx, &a.jcfg, &jobs.SavePrefixRequest{Namespace: ns, Identity: ident, Tokens: tokens, Tensors: src.specs(n), PageTokens: ptoks})
	if err != nil {
		t.Fatal(err)
	}
	keys := res.Stored()
	if len(keys) != n/ptoks {
		t.Fatalf("saved %d pages, want %d", len(keys), n/ptoks)
	}
	a.index.Add(ns, keys...)
	a.tr.Saved(ns, keys)
	a.closeTier(t)

	var mu sync.Mutex
	type fetched struct {
		pg      *layout.Page
		indexed bool
	}
	got := map[layout.PageKey]fetched{}
	var b *tierRig
	b = openTierRig(t, t.TempDir(), prefix, func(gotNS string, pg *layout.Page) {
		if gotNS != ns {
			t.Errorf("OnFetched for namespace %q, want %q", gotNS, ns)
		}
		mu.Lock()
		defer mu.Unlock()
		got[pg.Key] = fetched{pg: pg, indexed: b.index.Has(ns, pg.Key)}
	})
	dst := newKV(n)
	ls := tier.NewLoadSource(b.pc, b.tr)
	lres, _, err := jobs.LoadPrefix(ctx, &b.jcfg, &jobs.LoadPrefixRequest{Namespace: ns, Identity: ident, Tokens: tokens, Dest: dst.specs(n), PageTokens: ptoks}, ls)
	var loaded []layout.PageKey
	if lres != nil {
		loaded = lres.Keys
	}
	rep := ls.Finish(loaded, err == nil)
	if err != nil {
		t.Fatal(err)
	}
	if rep == nil || rep.Err != nil || rep.PagesAsked != len(keys) || rep.PagesFound != len(keys) || rep.PagesFetched != len(keys) || rep.BytesFetched <= 0 {
		t.Fatalf("report %+v, want %d pages asked, found and fetched, no error", rep, len(keys))
	}
	if lres.Tokens != n {
		t.Fatalf("loaded %d tokens, want %d", lres.Tokens, n)
	}
	dst.checkLoaded(t, tokens, n)
	mu.Lock()
	defer mu.Unlock()
	if len(got) != len(keys) {
		t.Fatalf("OnFetched told of %d pages, want %d", len(got), len(keys))
	}
	for pos, k := range keys {
		f, ok := got[k]
		switch {
		case !ok:
			t.Errorf("page %d: OnFetched not told", pos)
		case f.indexed:
			t.Errorf("page %d: indexed before OnFetched", pos)
		case pos > 0 && f.pg.Parent != keys[pos-1], pos == 0 && f.pg.Parent != layout.PageRoot(ident, ptoks):
			t.Errorf("page %d: parent %s, not the chain's", pos, f.pg.Parent)
		case !slices.Equal(f.pg.Tokens, tokens[pos*ptoks:(pos+1)*ptoks]):
			t.Errorf("page %d: other token ids than the prompt's", pos)
		}
		if !b.index.Has(ns, k) {
			t.Errorf("page %d: not indexed after the load", pos)
		}
	}
	if kp := b.tr.KnownPages(); kp != len(keys) {
		t.Errorf("B knows %d pages stored, want %d", kp, len(keys))
	}
	b.closeTier(t)
}
