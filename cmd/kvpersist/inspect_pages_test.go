package main

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/kvpersist/kvpersist/engine/jobs"
	"github.com/kvpersist/kvpersist/engine/layout"
	"github.com/kvpersist/kvpersist/internal/kvgen"
	"github.com/kvpersist/kvpersist/internal/testutil"
)

// inspect of a page manifest names its format and shows its page list
// (identity, page size, tokens, page count with the partial last page,
// first and last key; every key in --json); inspect of a page file says
// "page" (not "single") and, when its header fails its check, still shows
// the page's key, parent and tokens, marked unverified.
func TestInspectPageManifestAndDamagedPage(t *testing.T) {
	root := t.TempDir()
	c := kvgen.NewCache(kvgen.Tiny, 40, false, nil)
	caches, atts, meta := kvgen.CacheRequest(c, 40)
	toks := make([]uint32, 40)
	for i := range toks {
		toks[i] = uint32(1000 + 7*i)
	}
	const id = "tiny/bf16/tp0"
	_, _, err := jobs.Write(context.Background(), &jobs.Config{Root: root, NoSync: true}, &jobs.WriteRequest{
		Ref: jobs.Ref{Namespace: "ns", Name: "turn-1"}, Layout: layout.Pages, Meta: meta, Caches: caches, Attachments: atts,
		Identity: id, Tokens: toks, PageTokens: 16,
	})
	if err != nil {
		t.Fatal(err)
	}
	keys, _, err := layout.PageChain(id, 16, toks)
	if err != nil {
		t.Fatal(err)
	}
	manifest := filepath.Join(root, "ns", "turn-1")
	out := mustRun(t, exitOK, "inspect", manifest)
	for _, want := range []string{
		"format       7 (pages)\n",
		"pages        3 of 16 tokens, the last a partial page of 8, 40 tokens in all\n",
		"identity     \"" + id + "\"\n",
		"first page   " + keys[0].String() + "\n",
		"last page    " + keys[2].String() + "\n",
		"3 pages",
	} {
		if !strings.Contains(out, want) {
			t.Errorf("inspect of a page manifest lacks %q:\n%s", want, out)
		}
	}
	var js struct {
		Layout string `json:"layout"`
		Pages  struct {
			Identity   string   `json:"identity"`
			PageTokens int      `json:"pageTokens"`
			Tokens     int      `json:"tokens"`
			Keys       []string `json:"keys"`
			LeafTokens int      `json:"leafTokens"`
		} `json:"pages"`
		Meta map[string]any `json:"meta"`
	}
	runJSON(t, exitOK, &js, "inspect", manifest)
	p := js.Pages
	if js.Layout != "pages" || p.Identity != id || p.PageTokens != 16 || p.Tokens != 40 || p.LeafTokens != 8 || len(p.Keys) != 3 ||
		p.Keys[0] != keys[0].String() || p.Keys[1] != keys[1].String() || p.Keys[2] != keys[2].String() {
		t.Fatalf("inspect --json of a page manifest: %+v", js)
	}
	if _, ok := js.Meta["pages"]; ok {
		t.Fatalf("the page list is shown as caller metadata: %v", js.Meta)
	}

	// A page file: "6 (page)"; then its header damaged (one digit of a
	// token id changed: still JSON, the header hash fails).
	page := testutil.PagePath(filepath.Join(root, "ns"), keys[1])
	out = mustRun(t, exitOK, "inspect", page)
	if !strings.Contains(out, "format       6 (page)\n") || !strings.Contains(out, "page key     "+keys[1].String()+" (key matches chain)") {
		t.Fatalf("inspect of a page file:\n%s", out)
	}
	raw, err := os.ReadFile(page)
	if err != nil {
		t.Fatal(err)
	}
	at := strings.Index(string(raw), fmt.Sprintf("[%d,", toks[16]))
	if at < 0 {
		t.Fatal("the page header holds no token list")
	}
	raw[at+1] = '9' // 1112 -> 9112
	if err := os.WriteFile(page, raw, 0o640); err != nil {
		t.Fatal(err)
	}
	out = strings.Join(strings.Fields(mustRun(t, exitProblems, "inspect", page)), " ") // the columns widen
	for _, want := range []string{
		"format 6 (page)",
		"page key " + keys[1].String() + " (UNVERIFIED: the header failed its check) (key DOES NOT match the chain",
		"parent " + keys[0].String() + " ",
		"token count 16; token ids 9112 ... " + fmt.Sprint(toks[31]) + " ",
		"CHECK FAILED header hash",
	} {
		if !strings.Contains(out, want) {
			t.Errorf("inspect of a damaged page lacks %q:\n%s", want, out)
		}
	}
}
