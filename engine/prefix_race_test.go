package engine

import (
	"sync"
	"sync/atomic"
	"testing"

	"github.com/kvpersist/kvpersist/internal/kvgen"
)

// A load that finds a page missing must not make the index forget that
// page when a save of the same namespace stored it meanwhile: the load
// decides "missing" before it reads (its Progress runs after that), the
// save publishes and indexes the page, then the load acks. Lookup must
// still find the page that is on disk.
func TestEnginePrefixMissBesideSaveKeepsIndex(t *testing.T) {
	e := newEngine(t, Config{Workers: 4})
	m := kvgen.Tiny
	c, _ := cacheOf(m, 128, true)
	toks := prefixTokens(128, 5)
	mustDo(t, e, &SavePrefixRequest{Namespace: "p", Identity: "tiny", Tokens: toks[:64], Tensors: kvTensors(c), PageTokens: 64})
	started, saved := make(chan struct{}), make(chan struct{})
	var first atomic.Bool // only the first call blocks: the others must not hold the load's helpers
	_, dest := paddedDest(m, 128, func(n int) []byte { return make([]byte, n) })
	lj := mustSubmit(t, e, bg, &LoadPrefixRequest{
		Namespace: "p", Identity: "tiny", Tokens: toks, Dest: dest, PageTokens: 64,
		Progress: func(int64) {
			if first.CompareAndSwap(false, true) {
				close(started)
				<-saved
			}
		},
	})
	<-started // page 1 was found missing; page 0 is being read
	s := mustDo(t, e, &SavePrefixRequest{Namespace: "p", Identity: "tiny", Tokens: toks, Tensors: kvTensors(c), PageTokens: 64})
	if s.Prefix.PagesWritten != 1 || s.Prefix.PagesReused != 1 {
		t.Fatalf("save: %+v", s.Prefix)
	}
	close(saved)
	l := ackOK(t, lj)
	if l.Prefix.Tokens != 64 || l.Prefix.Missing == nil {
		t.Fatalf("load: %+v", l.Prefix)
	}
	if got, err := e.Lookup("p", "tiny", 64, toks); err != nil || got != 128 {
		t.Fatalf("Lookup after the save: %d tokens %v, want 128 (both pages are on disk)", got, err)
	}
}

// Two conversations sharing their first 128 tokens are saved at growing
// lengths by four goroutines at once, beside collects of the namespace,
// Lookups and loads (run with -race): no job fails, no load stops early,
// and afterwards Lookup and a load agree on the full length and the loaded
// bytes are the saved ones.
func TestEnginePrefixConcurrentOverlappingSaves(t *testing.T) {
	e := newEngine(t, Config{Workers: 4})
	m := kvgen.Tiny
	shared := prefixTokens(128, 7)
	convs := make([][]uint32, 2)
	caches := make([]*kvgen.Cache, 2)
	for i := range convs {
		convs[i] = append(append([]uint32{}, shared...), prefixTokens(172, uint32(20+i))...)
		caches[i], _ = cacheOf(m, 300, true)
	}
	var wg sync.WaitGroup
	for g := range 4 {
		wg.Go(func() {
			ci := g % 2
			for _, n := range []int{64, 130, 200, 256, 300} {
				if r := e.Do(bg, &SavePrefixRequest{Namespace: "p", Identity: "tiny", Tokens: convs[ci][:n], Tensors: kvTensors(caches[ci]), PageTokens: 64}); r.Err != nil {
					t.Errorf("save %d tokens: %v", n, r.Err)
				}
			}
		})
	}
	wg.Go(func() {
		for range 3 {
			if r := e.Do(bg, &CollectRequest{Namespaces: []string{"p"}}); r.Err != nil {
				t.Errorf("collect: %v", r.Err)
			}
		}
	})
	wg.Go(func() {
		for i := range 50 {
			if _, err := e.Lookup("p", "tiny", 64, convs[i%2]); err != nil {
				t.Errorf("lookup: %v", err)
			}
		}
	})
	wg.Go(func() {
		for i := range 6 {
			_, dest := paddedDest(m, 320, func(n int) []byte { return make([]byte, n) })
			if r := e.Do(bg, &LoadPrefixRequest{Namespace: "p", Identity: "tiny", Tokens: convs[i%2], Dest: dest, PageTokens: 64}); r.Err != nil || r.Prefix.Stop != nil {
				t.Errorf("load: %v %+v", r.Err, r.Prefix)
			}
		}
	})
	wg.Wait()
	for ci := range convs {
		if got, err := e.Lookup("p", "tiny", 64, convs[ci]); err != nil || got != 300 {
			t.Fatalf("conversation %d: Lookup %d %v, want 300", ci, got, err)
		}
		bufs, dest := paddedDest(m, 320, func(n int) []byte { return make([]byte, n) })
		r := mustDo(t, e, &LoadPrefixRequest{Namespace: "p", Identity: "tiny", Tokens: convs[ci], Dest: dest, PageTokens: 64})
		if r.Prefix.Tokens != 300 {
			t.Fatalf("conversation %d: loaded %+v", ci, r.Prefix)
		}
		checkLoaded(t, caches[ci], bufs, 320, 300)
	}
}
