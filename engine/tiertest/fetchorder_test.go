package tiertest

import (
	"net/http"
	"os"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvpersist/kvpersist/engine/layout"
	"github.com/kvpersist/kvpersist/engine/tier"
)

// TestFetchedPagesAnnouncedParentsFirst: a load's read-through fetches
// its pages in parallel, yet OnFetched (the engine's BlockStored) is told
// of them in chain order, parents first (a router drops a page whose
// parent it does not know). The GET of the first page is held until every
// later page is published locally (or one of them is announced): they
// complete first, and must still wait for it. Each page is announced once,
// before it is indexed, and the load gets every page.
func TestFetchedPagesAnnouncedParentsFirst(t *testing.T) {
	const pages = 4
	const n = pages * ptoks
	prefix := bucketPrefix(t)
	tokens := seq(3000, n)

	keys := uploadedByTier(t, prefix, tokens)
	if len(keys) != pages {
		t.Fatalf("saved %d pages, want %d", len(keys), pages)
	}

	rootB := t.TempDir()
	var mu sync.Mutex
	var order []layout.PageKey
	indexedFirst := 0
	announced := make(chan struct{}, pages)
	var b *tierRig
	// Held until pages 1.. are published (their files exist), or one of
	// them is announced: either shows the completion order the test needs.
	var held atomic.Bool
	hook := &hookRT{next: http.DefaultTransport.(*http.Transport).Clone(), match: getOf(keys[0]), hook: func() {
		deadline := time.Now().Add(20 * time.Second)
		for time.Now().Before(deadline) {
			select {
			case <-announced:
				held.Store(true)
				return
			default:
			}
			all := true
			for _, k := range keys[1:] {
				if _, err := os.Stat(pagePath(rootB, k)); err != nil {
					all = false
					break
				}
			}
			if all {
				held.Store(true)
				return
			}
			time.Sleep(time.Millisecond)
		}
	}}
	b = openTierRigCfg(t, rootB, prefix, func(_ string, pg *layout.Page) {
		mu.Lock()
		defer mu.Unlock()
		order = append(order, pg.Key)
		if b.index.Has(ns, pg.Key) {
			indexedFirst++
		}
		announced <- struct{}{}
	}, func(c *tier.Config) {
		c.Store.Transport = hook
		c.FetchPages = pages
	})
	lres, rep, dst := b.loadThrough(t, tokens)
	if !held.Load() {
		t.Fatal("the later pages were neither published nor announced while page 0's GET was held")
	}
	if rep == nil || rep.Err != nil || rep.PagesFetched != pages || lres.Tokens != n {
		t.Fatalf("loaded %d tokens, report %+v; want %d tokens, %d pages fetched", lres.Tokens, rep, n, pages)
	}
	dst.checkLoaded(t, tokens, n)
	mu.Lock()
	defer mu.Unlock()
	if len(order) != pages {
		t.Fatalf("OnFetched told of %d pages, want %d", len(order), pages)
	}
	for pos, k := range order {
		if k != keys[pos] {
			t.Errorf("announcement %d is of page %s, want page %d (%s): a child before its parent", pos, k, pos, keys[pos])
		}
	}
	if indexedFirst > 0 {
		t.Errorf("%d pages indexed before they were announced", indexedFirst)
	}
	b.closeTier(t)
}
