package engine

import (
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
