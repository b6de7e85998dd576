package engine

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/kvpersist/kvpersist/engine/jobs"
	"github.com/kvpersist/kvpersist/engine/layout"
	"github.com/kvpersist/kvpersist/internal/kvgen"
	"github.com/kvpersist/kvpersist/internal/testutil"
)

// A page whose data went bad (its header intact, so a save would reuse it)
// is found by a verified load: the load stops there, the page file is
// removed (under the namespace's exclusive lock) and dropped from the
// index, and the next save writes it again, after which the whole prompt
// loads. Before the repair existed the corrupt page stayed on disk and in
// the index for good: every save reused it and every load stopped at it.
func TestEnginePrefixCorruptPageIsRemovedAndRewritten(t *testing.T) {
	root := t.TempDir()
	e := newEngine(t, Config{Root: root, Workers: 2})
	m := kvgen.Tiny
	c, _ := cacheOf(m, 300, true)
	toks := prefixTokens(300, 7)
	save := &SavePrefixRequest{Namespace: "p", Identity: "tiny", Tokens: toks, Tensors: kvTensors(c), PageTokens: 64}
	mustDo(t, e, save)
	keys, _, err := layout.PageChain("tiny", 64, toks)
	if err != nil {
		t.Fatal(err)
	}
	path := testutil.PagePath(filepath.Join(root, "p"), keys[2])
	flipLastByte(t, path)

	bufs, dest := paddedDest(m, 320, func(n int) []byte { return make([]byte, n) })
	r := mustDo(t, e, &LoadPrefixRequest{Namespace: "p", Identity: "tiny", Tokens: toks, Dest: dest, PageTokens: 64})
	if r.Prefix.Tokens != 128 || r.Prefix.Stop == nil {
		t.Fatalf("load over the corrupt page: %+v", r.Prefix)
	}
	if _, err := os.Stat(path); !os.IsNotExist(err) {
		t.Fatalf("the corrupt page is still on disk: %v", err)
	}
	if got, _ := e.Lookup("p", "tiny", 64, toks); got != 128 {
		t.Fatalf("Lookup after the corrupt page: %d, want 128", got)
	}
	res := mustDo(t, e, save)
	if res.Prefix.PagesWritten != 1 || res.Prefix.PagesReused != len(keys)-1 {
		t.Fatalf("save after the removal: %+v, want page 2 written again", res.Prefix)
	}
	bufs, dest = paddedDest(m, 320, func(n int) []byte { return make([]byte, n) })
	r = mustDo(t, e, &LoadPrefixRequest{Namespace: "p", Identity: "tiny", Tokens: toks, Dest: dest, PageTokens: 64})
	if r.Prefix.Tokens != 300 || r.Prefix.Stop != nil {
		t.Fatalf("load after the repair: %+v", r.Prefix)
	}
	checkLoaded(t, c, bufs, 320, 300)
	if got, _ := e.Lookup("p", "tiny", 64, toks); got != 300 {
		t.Fatalf("Lookup after the repair: %d", got)
	}
}

// RemoveCorruptPage keeps a page that verifies (a save rewrote it since the
// load looked) and a page that is missing, and removes only a corrupt one.
func TestRemoveCorruptPageKeepsWholePages(t *testing.T) {
	root := t.TempDir()
	e := newEngine(t, Config{Root: root, Workers: 1})
	c, _ := cacheOf(kvgen.Tiny, 128, true)
	toks := prefixTokens(128, 8)
	res := mustDo(t, e, &SavePrefixRequest{Namespace: "p", Identity: "tiny", Tokens: toks, Tensors: kvTensors(c), PageTokens: 64})
	cfg := &jobs.Config{Root: root}
	removed, err := jobs.RemoveCorruptPage(bg, cfg, "p", res.Prefix.Keys[0])
	if err != nil || removed {
		t.Fatalf("a whole page: removed %v, %v", removed, err)
	}
	if _, err := os.Stat(testutil.PagePath(filepath.Join(root, "p"), res.Prefix.Keys[0])); err != nil {
		t.Fatal(err)
	}
	var absent layout.PageKey
	if removed, err := jobs.RemoveCorruptPage(bg, cfg, "p", absent); err != nil || removed {
		t.Fatalf("a missing page: removed %v, %v", removed, err)
	}
	// Page 1's file replaced by page 0's: it holds another key.
	raw, err := os.ReadFile(testutil.PagePath(filepath.Join(root, "p"), res.Prefix.Keys[0]))
	if err != nil {
		t.Fatal(err)
	}
	p1 := testutil.PagePath(filepath.Join(root, "p"), res.Prefix.Keys[1])
	if err := os.WriteFile(p1, raw, 0o640); err != nil {
		t.Fatal(err)
	}
	if removed, err := jobs.RemoveCorruptPage(bg, cfg, "p", res.Prefix.Keys[1]); err != nil || !removed {
		t.Fatalf("a page holding another key: removed %v, %v", removed, err)
	}
	if _, err := os.Stat(p1); !os.IsNotExist(err) {
		t.Fatalf("still there: %v", err)
	}
}
