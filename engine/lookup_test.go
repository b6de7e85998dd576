package engine

import (
	"errors"
	"slices"
	"testing"

	"github.com/kvpersist/kvpersist/engine/layout"
)

// TestLookupFromFollowsAConversation: a scheduler that keeps the keys a
// save returned (its full pages) and then the chain each LookupFrom
// returns gets, turn after turn, what Lookup answers for the whole
// prompt, and a chain equal to layout.PageChain's full pages.
func TestLookupFromFollowsAConversation(t *testing.T) {
	e := newEngine(t, Config{Workers: 1})
	turn1 := convTokens(0, 2*cP+10, 1)
	r := mustSavePages(t, e, "p", turn1)
	held := r.Prefix.Keys[:r.Prefix.Tokens/cP] // the leaf left out
	turn2 := append(slices.Clone(turn1), convTokens(0, cP+20, 2)...)
	turn3 := append(slices.Clone(turn2), convTokens(0, 2*cP, 3)...)
	for i, tc := range []struct {
		tokens []uint32
		save   bool // saved after its lookup
		want   int
	}{
		{turn1, false, len(turn1)},
		{turn2, true, 2 * cP}, // page 3 is new
		{turn2, false, len(turn2)},
		{turn3, false, 3 * cP}, // the leaf of turn 2 is not a parent
	} {
		full, _, err := layout.PageChain("tiny", cP, tc.tokens)
		if err != nil {
			t.Fatal(err)
		}
		want, err := e.Lookup("p", "tiny", cP, tc.tokens)
		if err != nil || want != tc.want {
			t.Fatalf("turn %d: Lookup %d, %v; want %d", i, want, err, tc.want)
		}
		n, chain, err := e.LookupFrom("p", "tiny", cP, held, tc.tokens)
		if err != nil || n != want {
			t.Fatalf("turn %d: LookupFrom %d, %v; Lookup %d", i, n, err, want)
		}
		if !slices.Equal(chain, full[:len(tc.tokens)/cP]) {
			t.Fatalf("turn %d: chain of %d keys, not the %d full pages' keys", i, len(chain), len(tc.tokens)/cP)
		}
		if tc.save {
			mustSavePages(t, e, "p", tc.tokens)
		}
		held = chain
	}
	if _, _, err := e.LookupFrom("p", "tiny", cP, held, turn1); !errors.Is(err, ErrInvalidRequest) {
		t.Fatalf("more keys than full pages: %v, want ErrInvalidRequest", err)
	}
	if _, _, err := e.LookupFrom("../p", "tiny", cP, nil, turn1); !errors.Is(err, ErrPath) {
		t.Fatalf("bad namespace: %v, want ErrPath", err)
	}
}

// TestLookupFromNoAlloc: Engine.LookupFrom with capacity for the new
// keys, its touch of the page cache included, does not allocate.
func TestLookupFromNoAlloc(t *testing.T) {
	if raceEnabled {
		t.Skip("the race detector makes sync.Pool drop items: allocations are not meaningful")
	}
	e := newEngine(t, Config{Workers: 1})
	toks := convTokens(0, 4*cP, 1)
	r := mustSavePages(t, e, "p", toks)
	held := make([]layout.PageKey, 3, 4)
	n := testing.AllocsPerRun(50, func() {
		copy(held, r.Prefix.Keys)
		if got, _, _ := e.LookupFrom("p", "tiny", cP, held[:3], toks); got != len(toks) {
			panic(got)
		}
	})
	if n != 0 {
		t.Fatalf("LookupFrom allocates %v times", n)
	}
}
