package remote

import (
	"strings"
	"testing"

	"github.com/kvpersist/kvpersist/engine/layout"
)

// TestCheckChain: the chain check of Verify on a manifest's page list and
// the pages found: each rule it states is broken once and reported, and a
// consistent chain passes. (A real page's key is its chain step, so these
// cases are reached by manifests that disagree with valid pages.)
func TestCheckChain(t *testing.T) {
	s := &Store{}
	toks := make([]uint32, 150)
	for i := range toks {
		toks[i] = uint32(i * 3)
	}
	keys, _, err := layout.PageChain("id", 64, toks) // 2 full pages and a leaf of 22
	if err != nil {
		t.Fatal(err)
	}
	pl := &layout.PageList{Identity: "id", PageTokens: 64, Tokens: 150, Keys: keys}
	good := func() (map[string]bool, map[string]pageInfo) {
		stored, infos := map[string]bool{}, map[string]pageInfo{}
		parent := layout.PageRoot("id", 64)
		for i, k := range keys {
			stored[k.String()] = true
			infos[k.String()] = pageInfo{parent: parent, identity: "id", pageTokens: 64, tokens: min(64, 150-64*i)}
			parent = k
		}
		return stored, infos
	}
	stored, infos := good()
	if p := checkChain(s, "ns", "m", pl, stored, infos); len(p) != 0 {
		t.Fatalf("consistent chain: %+v", p)
	}
	for _, c := range []struct {
		what, kind, detail string
		breakIt            func(stored map[string]bool, infos map[string]pageInfo, pl *layout.PageList)
	}{
		{"missing", ProblemMissingPage, "page 1", func(st map[string]bool, _ map[string]pageInfo, _ *layout.PageList) { delete(st, keys[1].String()) }},
		{"parent", ProblemBrokenChain, "page 2", func(_ map[string]bool, in map[string]pageInfo, _ *layout.PageList) {
			i := in[keys[2].String()]
			i.parent = keys[0]
			in[keys[2].String()] = i
		}},
		{"identity", ProblemBrokenChain, "identity", func(_ map[string]bool, in map[string]pageInfo, _ *layout.PageList) {
			i := in[keys[0].String()]
			i.identity = "other"
			in[keys[0].String()] = i
		}},
		{"partial middle", ProblemBrokenChain, "only the last may be partial", func(_ map[string]bool, in map[string]pageInfo, _ *layout.PageList) {
			i := in[keys[1].String()]
			i.tokens = 10
			in[keys[1].String()] = i
		}},
		{"token sum", ProblemBrokenChain, "hold 150 tokens, the manifest says 151", func(_ map[string]bool, _ map[string]pageInfo, pl *layout.PageList) { pl.Tokens = 151 }},
	} {
		st, in := good()
		l := *pl
		c.breakIt(st, in, &l)
		p := checkChain(s, "ns", "m", &l, st, in)
		if len(p) != 1 || p[0].Kind != c.kind || p[0].Name != "m" || !strings.Contains(p[0].Detail, c.detail) {
			t.Errorf("%s: %+v, want one %s naming %q", c.what, p, c.kind, c.detail)
		}
	}
}
