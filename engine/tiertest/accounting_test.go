package tiertest

import (
	"context"
	"testing"

	"github.com/kvpersist/kvpersist/engine"
	"github.com/kvpersist/kvpersist/internal/testutil"
)

// TestFetchedPagesAccountedWhenTheLoadFails: B fetches A's pages for a
// load whose destination is invalid (one tensor where the pages hold two).
// The load fails, but the fetched, verified pages stay in B's local tier:
// the page cache's accounting must count them (they did not before the
// fetch went through the page cache's admission).
func TestFetchedPagesAccountedWhenTheLoadFails(t *testing.T) {
	prefix, _, conv, _ := uploadedConv(t, 5000, 4*ptoks)
	rootB := t.TempDir()

	b := newEngine(t, rootB, prefix, newRecorder(t), nil)
	c := newKV(len(conv))
	res := b.Do(context.Background(), &engine.LoadPrefixRequest{Namespace: ns, Identity: ident, Tokens: conv, PageTokens: ptoks, Dest: c.specs(len(conv))[:1]})
	if res.Err == nil {
		t.Fatalf("a load into one tensor of two succeeded")
	}
	alloc, _, pages, _ := testutil.PageTree(t, rootB)
	u := b.Usage()
	if u.UsedBytes != alloc || u.Pages != pages {
		t.Fatalf("B's usage %d bytes in %d pages; its disk holds %d bytes in %d page files", u.UsedBytes, u.Pages, alloc, pages)
	}
}
