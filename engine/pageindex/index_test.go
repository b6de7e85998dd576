package pageindex_test

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"slices"
	"testing"

	"github.com/kvpersist/kvpersist/engine/gather"
	"github.com/kvpersist/kvpersist/engine/jobs"
	"github.com/kvpersist/kvpersist/engine/layout"
	"github.com/kvpersist/kvpersist/engine/pageindex"
	"github.com/kvpersist/kvpersist/engine/store"
	"github.com/kvpersist/kvpersist/engine/vfs"
)

func toks(n int, seed uint32) []uint32 {
	out := make([]uint32, n)
	for i := range out {
		out[i] = seed*7919 + uint32(i)*31
	}
	return out
}

// save stores the pages of tokens (one tiny tensor, P = 16) with jobs.
func save(t *testing.T, nsDir, identity string, tokens []uint32) {
	t.Helper()
	buf := make([]byte, len(tokens)*4*2)
	v := gather.View{Base: buf, Shape: []int{1, len(tokens), 4}, Strides: []int{len(tokens) * 4, 4, 1}, ItemSize: 2}
	_, _, err := jobs.SavePrefix(context.Background(), &jobs.Config{NoSync: true, Root: filepath.Dir(nsDir)}, &jobs.SavePrefixRequest{
		Namespace: filepath.Base(nsDir), Identity: identity, Tokens: tokens, PageTokens: 16,
		Tensors: []jobs.TensorSpec{{DType: "bfloat16", View: v}},
	})
	if err != nil {
		t.Fatal(err)
	}
}

func load(t *testing.T, nsDir, identity string, tokens []uint32) int {
	t.Helper()
	buf := make([]byte, len(tokens)*4*2)
	v := gather.View{Base: buf, Shape: []int{1, len(tokens), 4}, Strides: []int{len(tokens) * 4, 4, 1}, ItemSize: 2}
	res, _, err := jobs.LoadPrefix(context.Background(), &jobs.Config{Root: filepath.Dir(nsDir), NoSync: true}, &jobs.LoadPrefixRequest{
		Namespace: filepath.Base(nsDir), Identity: identity, Tokens: tokens, PageTokens: 16,
		Dest: []jobs.TensorSpec{{DType: "bfloat16", View: v}},
	}, nil)
	if err != nil {
		t.Fatal(err)
	}
	return res.Tokens
}

// The index built from a store answers what a load of the store finds.
func TestBuildLookupAgreesWithLoad(t *testing.T) {
	root := t.TempDir()
	a := toks(100, 1) // 6 full pages and a leaf of 4
	b := append(slices.Clone(a[:40]), toks(37, 2)...)
	save(t, filepath.Join(root, "ns1"), "m", a)
	save(t, filepath.Join(root, "ns1"), "m", b)
	save(t, filepath.Join(root, "ns2"), "m", a[:50])
	// Entries that are not pages are skipped, temp files ignored.
	junk := filepath.Join(root, "ns1", "pages", "zz")
	if err := os.MkdirAll(junk, 0o750); err != nil {
		t.Fatal(err)
	}
	fan := filepath.Join(root, "ns1", "pages", "ab")
	if err := os.MkdirAll(fan, 0o750); err != nil {
		t.Fatal(err)
	}
	for _, n := range []string{"cd00000000000000000000000000000000000000000000000000000000000000", "README", ".x.tmp-0123456789abcdef"} {
		if err := os.WriteFile(filepath.Join(fan, n), nil, 0o640); err != nil {
			t.Fatal(err)
		}
	}
	x, st, err := pageindex.Build(store.At(root, store.Options{}))
	if err != nil {
		t.Fatal(err)
	}
	// a: 7 pages; b: pages 0-1 shared, 2 more full + leaf of 13; ns2: 3 full + leaf of 2.
	if st.Namespaces != 2 || st.Pages != 7+3+4 || x.Len("ns1") != 10 || x.Len("ns2") != 4 || len(st.Skipped) != 3 {
		t.Fatalf("build: %+v, ns1 %d ns2 %d", st, x.Len("ns1"), x.Len("ns2"))
	}
	prompts := [][]uint32{a, b, a[:96], a[:97], a[:50], a[:40], a[:45], b[:60], toks(50, 9), append(slices.Clone(a), 1, 2, 3)}
	for _, ns := range []string{"ns1", "ns2", "ns3"} {
		for i, p := range prompts {
			got, err := x.Lookup(ns, "m", 16, p)
			if err != nil {
				t.Fatal(err)
			}
			if want := load(t, filepath.Join(root, ns), "m", p); got != want {
				t.Fatalf("%s prompt %d (%d tokens): lookup %d, load %d", ns, i, len(p), got, want)
			}
		}
	}
	if got, _ := x.Lookup("ns1", "m", 16, a); got != 100 {
		t.Fatalf("whole conversation: %d", got)
	}
	if got, _ := x.Lookup("ns1", "other", 16, a); got != 0 {
		t.Fatalf("another identity: %d", got)
	}
	// Removing page 2 of a (behind no one's back) shortens its prefix.
	keys, _, _ := layout.PageChain("m", 16, a)
	x.Remove("ns1", keys[2])
	if got, _ := x.Lookup("ns1", "m", 16, a); got != 32 {
		t.Fatalf("after removing page 2: %d", got)
	}
	keys50, _, _ := layout.PageChain("m", 16, a[:50])
	x.Remove("ns2", keys50...)
	if x.Len("ns2") != 0 {
		t.Fatalf("ns2 still has %d keys", x.Len("ns2"))
	}
	if _, err := x.Lookup("ns1", "", 16, a); !errors.Is(err, layout.ErrIdentity) {
		t.Fatal(err)
	}
	if _, err := x.Lookup("ns1", "m", 12, a); !errors.Is(err, layout.ErrPageTokens) {
		t.Fatal(err)
	}
}

func TestLookupNoAlloc(t *testing.T) {
	if raceEnabled {
		t.Skip("the race detector makes sync.Pool drop items: allocations are not meaningful")
	}
	x := pageindex.New()
	p := toks(4096+100, 3)
	keys, _, _ := layout.PageChain("m", 256, p)
	x.Add("ns", keys...)
	n := testing.AllocsPerRun(50, func() {
		if got, _ := x.Lookup("ns", "m", 256, p); got != len(p) {
			panic(got)
		}
	})
	if n != 0 {
		t.Fatalf("Lookup allocates %v times", n)
	}
}

func TestBuildMissingRoot(t *testing.T) {
	x, st, err := pageindex.Build(store.At(filepath.Join(t.TempDir(), "none"), store.Options{}))
	if err != nil || st.Pages != 0 || x.Len("x") != 0 {
		t.Fatalf("%+v %v", st, err)
	}
}

// RemoveIfGone forgets a key only when gone reports its file absent, and
// does not ask about a key it does not hold.
func TestRemoveIfGone(t *testing.T) {
	x := pageindex.New()
	keys, _, err := layout.PageChain("id", 16, make([]uint32, 32))
	if err != nil {
		t.Fatal(err)
	}
	x.Add("ns", keys...)
	asked := 0
	x.RemoveIfGone("ns", keys[0], func() bool { asked++; return false })
	if !x.Has("ns", keys[0]) || asked != 1 {
		t.Fatalf("present file: key dropped (%v) or gone asked %d times", !x.Has("ns", keys[0]), asked)
	}
	x.RemoveIfGone("ns", keys[0], func() bool { asked++; return true })
	if x.Has("ns", keys[0]) || !x.Has("ns", keys[1]) || asked != 2 {
		t.Fatalf("absent file: has %v %v, asked %d", x.Has("ns", keys[0]), x.Has("ns", keys[1]), asked)
	}
	x.RemoveIfGone("ns", keys[0], func() bool { asked++; return true })
	x.RemoveIfGone("other", keys[1], func() bool { asked++; return true })
	if asked != 2 {
		t.Fatalf("gone asked about keys not held: %d", asked)
	}
}

// TestDurableMarks: a mark (FileID and header sum) is returned as
// recorded, per namespace; a zero
// FileID forgets it; Remove and RemoveIfGone forget a key's mark with the
// key (a page removed and written again must earn its mark again), and
// RemoveIfGone keeps both while the file is there.
func TestDurableMarks(t *testing.T) {
	x := pageindex.New()
	k1, k2 := layout.PageKey{1}, layout.PageKey{2}
	id1 := vfs.FileID{Dev: 8, Ino: 11, Size: 4096, CtimeNs: 1}
	id2 := vfs.FileID{Dev: 8, Ino: 12, Size: 4096, CtimeNs: 2}
	x.Add("a", k1, k2)
	x.MarkDurable("a", []layout.PageKey{k1, k2}, []vfs.FileID{id1, id2}, []uint64{101, 102})
	if x.DurableID("a", k1) != id1 || x.DurableID("a", k2) != id2 || x.DurableID("b", k1) != (vfs.FileID{}) {
		t.Fatalf("marks: %v %v %v", x.DurableID("a", k1), x.DurableID("a", k2), x.DurableID("b", k1))
	}
	if id, h := x.DurableMark("a", k2); id != id2 || h != 102 {
		t.Fatalf("DurableMark of k2: %v %d; want %v 102", id, h, id2)
	}
	if id, h := x.DurableMark("b", k2); id != (vfs.FileID{}) || h != 0 {
		t.Fatalf("DurableMark of an unmarked key: %v %d; want zero values", id, h)
	}
	x.MarkDurable("a", []layout.PageKey{k2}, []vfs.FileID{{}}, []uint64{102})
	if x.DurableID("a", k2) != (vfs.FileID{}) || x.DurableID("a", k1) != id1 {
		t.Fatalf("a zero id did not forget only k2's mark")
	}
	if _, h := x.DurableMark("a", k2); h != 0 {
		t.Fatalf("a forgotten mark kept header sum %d", h)
	}
	x.MarkDurable("a", []layout.PageKey{k2}, []vfs.FileID{id2}, []uint64{103})
	if _, h := x.DurableMark("a", k2); h != 103 {
		t.Fatalf("a new mark of k2 kept header sum %d, want 103", h)
	}
	x.RemoveIfGone("a", k2, func() bool { return false })
	if x.DurableID("a", k2) != id2 {
		t.Fatalf("RemoveIfGone of a present file forgot its mark")
	}
	x.RemoveIfGone("a", k2, func() bool { return true })
	x.Remove("a", k1)
	if x.DurableID("a", k1) != (vfs.FileID{}) || x.DurableID("a", k2) != (vfs.FileID{}) {
		t.Fatalf("removed keys kept their marks")
	}
}

// TestPresent: Present counts the leading keys recorded (Lookup's walk
// without the hashing), stopping at the first absent one.
func TestPresent(t *testing.T) {
	x := pageindex.New()
	keys, _, err := layout.PageChain("id", 16, toks(16*4+3, 1))
	if err != nil {
		t.Fatal(err)
	}
	if n := x.Present("a", keys); n != 0 {
		t.Fatalf("empty index: %d", n)
	}
	x.Add("a", keys[0], keys[1], keys[3], keys[4])
	if n := x.Present("a", keys); n != 2 {
		t.Fatalf("keys 0, 1, 3 and the leaf recorded: Present %d, want 2", n)
	}
	x.Add("a", keys[2])
	if n, l := x.Present("a", keys), len(keys); n != l {
		t.Fatalf("every key recorded: Present %d, want %d", n, l)
	}
	if n, _ := x.Lookup("a", "id", 16, toks(16*4+3, 1)); n != 16*4+3 {
		t.Fatalf("Lookup disagrees: %d", n)
	}
	if n := x.Present("b", keys); n != 0 {
		t.Fatalf("another namespace: %d", n)
	}
}

// TestLookupFromEqualsLookup: LookupFrom with the keys of any number of a
// prompt's first full pages answers what the full-hash LookupDeepest
// answers (tokens and deepest key), over indexes holding a prefix of the
// chain, a chain with a hole, the leaf or not, and an empty namespace;
// its chain is layout.PageChain's full-page keys, appended in place when
// keys has the capacity.
func TestLookupFromEqualsLookup(t *testing.T) {
	const P = 16
	for _, total := range []int{0, 5, P, 3 * P, 5*P + 7} {
		prompt := toks(total, 9)
		all, full, err := layout.PageChain("id", P, prompt)
		if err != nil {
			t.Fatal(err)
		}
		stored := map[string][]layout.PageKey{"none": nil, "all": all}
		for j := 0; j <= len(all); j++ {
			stored["first-"+string(rune('0'+j))] = all[:j]
		}
		if len(all) > 2 {
			stored["hole"] = append(slices.Clone(all[:1]), all[2:]...)
		}
		if full < len(all) {
			stored["no-leaf"] = all[:full]
		}
		for name, keys := range stored {
			x := pageindex.New()
			x.Add("ns", keys...)
			wantN, wantLast, err := x.LookupDeepest("ns", "id", P, prompt)
			if err != nil {
				t.Fatal(err)
			}
			for known := 0; known <= full; known++ {
				held := make([]layout.PageKey, known, full)
				copy(held, all[:known])
				n, last, chain, err := x.LookupFrom("ns", "id", P, held, prompt)
				if err != nil {
					t.Fatalf("%d tokens, %s, %d keys known: %v", total, name, known, err)
				}
				if n != wantN || last != wantLast {
					t.Fatalf("%d tokens, %s, %d keys known: %d tokens, deepest %s; LookupDeepest %d, %s", total, name, known, n, last, wantN, wantLast)
				}
				if !slices.Equal(chain, all[:full]) {
					t.Fatalf("%d tokens, %s, %d keys known: chain %v, want the full pages' keys %v", total, name, known, chain, all[:full])
				}
				if full > 0 && &chain[0] != &held[:1][0] {
					t.Fatalf("%d tokens, %s: the chain was not appended to the keys' array", total, name)
				}
			}
		}
	}
}

// TestLookupFromErrors: more keys than full pages is ErrKeys, a bad
// identity or page size their layout errors; no chain with them.
func TestLookupFromErrors(t *testing.T) {
	x := pageindex.New()
	prompt := toks(40, 2)
	keys, _, _ := layout.PageChain("id", 16, prompt) // 2 full pages and a leaf
	for _, tc := range []struct {
		identity string
		p        int
		keys     []layout.PageKey
		want     error
	}{
		{"id", 16, keys, pageindex.ErrKeys},
		{"", 16, nil, layout.ErrIdentity},
		{"id", 0, nil, layout.ErrPageTokens},
	} {
		n, _, chain, err := x.LookupFrom("ns", tc.identity, tc.p, tc.keys, prompt)
		if !errors.Is(err, tc.want) || n != 0 || chain != nil {
			t.Fatalf("%q, P %d, %d keys: %d, %v, %v; want %v", tc.identity, tc.p, len(tc.keys), n, chain, err, tc.want)
		}
	}
}

// TestLookupFromNoAlloc: with the capacity for the new keys, LookupFrom
// does not allocate.
func TestLookupFromNoAlloc(t *testing.T) {
	if raceEnabled {
		t.Skip("the race detector makes sync.Pool drop items: allocations are not meaningful")
	}
	x := pageindex.New()
	p := toks(4096+256+100, 3)
	keys, full, _ := layout.PageChain("m", 256, p)
	x.Add("ns", keys...)
	held := make([]layout.PageKey, 16, full)
	n := testing.AllocsPerRun(50, func() {
		copy(held, keys)
		if got, _, _, _ := x.LookupFrom("ns", "m", 256, held[:16], p); got != len(p) {
			panic(got)
		}
	})
	if n != 0 {
		t.Fatalf("LookupFrom allocates %v times", n)
	}
}
