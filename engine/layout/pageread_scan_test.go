package layout

import (
	"encoding/json"
	"slices"
	"testing"
)

// FuzzScanPageObject: whatever header scanPageObject accepts, encoding/json
// reads the same page object from it (key, parent, identity, page size,
// token count and ids), so the fast path never reads a page differently
// from Decode.
func FuzzScanPageObject(f *testing.F) {
	k := PageNext(PageRoot("id", 16), make([]uint32, 16))
	pg := Page{Key: k, Parent: PageRoot("id", 16), Identity: "id", PageTokens: 16, Tokens: make([]uint32, 16)}
	rest := `,"caches":[{"tensors":[]}],"formatVersion":6}`
	f.Add(`{"page":` + string(pg.MetaJSON()) + rest)
	pg.Identity, pg.Tokens = "é \u2028 x", []uint32{0, 9, 4294967295, 10}
	f.Add(`{"page":` + string(pg.MetaJSON()) + rest)
	f.Fuzz(func(t *testing.T, js string) {
		got, ok := scanPageObject([]byte(js))
		if !ok {
			return
		}
		// The page object is the value of "page": from its opening brace
		// to the "]}" that ends the token ids.
		start := len(`{"page":`)
		end := start
		for i := start; i+1 < len(js); i++ {
			if js[i] == ']' && js[i+1] == '}' {
				end = i + 2
				break
			}
		}
		var w pageJSON
		if err := json.Unmarshal([]byte(js[start:end]), &w); err != nil {
			t.Fatalf("accepted a page object encoding/json refuses: %v", err)
		}
		if w.Key != got.Key.String() || w.Parent != got.Parent.String() || w.Identity != got.Identity ||
			w.PageTokens != got.PageTokens || w.TokenCount != len(got.Tokens) || !slices.Equal(w.Tokens, got.Tokens) {
			t.Fatalf("scanned %+v, encoding/json read %+v", got, w)
		}
	})
}
