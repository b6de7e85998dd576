package events

import (
	"context"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"testing"

	"github.com/kvpersist/kvpersist/engine/gather"
	"github.com/kvpersist/kvpersist/engine/jobs"
	"github.com/kvpersist/kvpersist/engine/layout"
	"github.com/kvpersist/kvpersist/engine/store"
)

// announced is what a subscriber learnt from BlockStored events: each
// hash's parent (0: none), tokens, and the order hashes came in.
type announced struct {
	parent map[uint64]uint64
	tokens map[uint64][]uint32
	order  []uint64
}

// collect reads batches until n pages were announced, checking that every
// parent was announced before its child and that no page comes twice.
func collect(t *testing.T, s *subscriber, n int, blockSize int) *announced {
	t.Helper()
	a := &announced{parent: map[uint64]uint64{}, tokens: map[uint64][]uint32{}}
	for len(a.order) < n {
		for _, raw := range decodeBatch(t, s.next().payload).Events {
			ev := stored(t, raw)
			if ev.BlockSize != blockSize || len(ev.TokenIDs) != blockSize*len(ev.BlockHashes) {
				t.Fatalf("event of %d hashes, %d tokens, block size %d", len(ev.BlockHashes), len(ev.TokenIDs), ev.BlockSize)
			}
			var parent uint64
			if ev.Parent != nil {
				parent = ev.Parent.(uint64)
				if _, ok := a.parent[parent]; !ok {
					t.Fatalf("parent %#x announced after its child", parent)
				}
			}
			for i, h := range ev.BlockHashes {
				hv := h.(uint64)
				if _, dup := a.parent[hv]; dup {
					t.Fatalf("hash %#x announced twice", hv)
				}
				a.parent[hv] = parent
				a.tokens[hv] = ev.TokenIDs[i*blockSize : (i+1)*blockSize]
				a.order = append(a.order, hv)
				parent = hv
			}
		}
	}
	return a
}

// A snapshot of a tree of chains, given shuffled, announces every full
// page reachable from a chain root once, each after its parent, with its
// tokens; leaves, duplicates and pages whose parent is missing (and their
// descendants) are not announced.
func TestSnapshotChainOrder(t *testing.T) {
	const P = 16
	p := newPub(t, Config{Topic: "t"})
	s := subscribe(t, p, "t")

	trunk := tokensOf(1, 6*P)
	a := chain(t, "id", P, trunk)                                                  // 6 pages
	b := chain(t, "id", P, append(slices.Clone(trunk[:2*P]), tokensOf(9, 3*P)...)) // shares a[0:2], 3 more
	c := chain(t, "id2", P, tokensOf(3, 2*P+3))                                    // 2 pages and a leaf
	orphaned := chain(t, "id", P, tokensOf(50, 4*P))                               // its first page is left out
	pages := slices.Concat(a, b[2:], c, orphaned[1:], a[3:4])                      // a[3] twice
	rand.New(rand.NewPCG(1, 2)).Shuffle(len(pages), func(i, j int) { pages[i], pages[j] = pages[j], pages[i] })

	st, err := p.Snapshot(context.Background(), "ns", pages)
	if err != nil {
		t.Fatal(err)
	}
	want := slices.Concat(a, b[2:], c[:2])
	if st.Pages != len(want) || st.Leaves != 1 || st.Duplicates != 1 || st.Orphans != 3 {
		t.Fatalf("stats %+v, want %d pages, 1 leaf, 1 duplicate, 3 orphans", st, len(want))
	}
	got := collect(t, s, len(want), P)
	for _, pg := range want {
		h := hash64(pg.Key)
		tok, ok := got.tokens[h]
		if !ok {
			t.Fatalf("page %s not announced", pg.Key)
		}
		if !slices.Equal(tok, pg.Tokens) {
			t.Fatalf("page %s announced with other tokens", pg.Key)
		}
		var wantParent uint64
		if !pg.FirstPage() {
			wantParent = hash64(pg.Parent)
		}
		if got.parent[h] != wantParent {
			t.Fatalf("page %s announced with parent %#x, want %#x", pg.Key, got.parent[h], wantParent)
		}
	}
	if len(got.order) != len(want) {
		t.Fatalf("%d pages announced, want %d", len(got.order), len(want))
	}
}

// Pages saved to disk are read back with their parents and tokens, and a
// snapshot of them (after the saving process is gone) announces exactly
// the full pages on disk.
func TestSnapshotFromDisk(t *testing.T) {
	const P = 16
	root := t.TempDir()
	const ns, id = "llama", "llama@sha:1/bf16"
	var want []layout.Page
	for i, n := range []int{5*P + 3, 3 * P, 2*P + 1} {
		toks := tokensOf(1000*i, n)
		if i == 2 { // shares its first page with the first save
			copy(toks, tokensOf(0, P))
		}
		savePrefix(t, root, ns, id, P, toks)
		for _, pg := range chain(t, id, P, toks) {
			if !pg.Leaf() && !slices.ContainsFunc(want, func(w layout.Page) bool { return w.Key == pg.Key }) {
				want = append(want, pg)
			}
		}
	}
	st, err := store.Open(root, store.Options{})
	if err != nil {
		t.Fatal(err)
	}
	n, err := st.Namespace(ns)
	if err != nil {
		t.Fatal(err)
	}
	// A file under a page's name that is not a page is skipped.
	bogus := layout.PageKey{0xab}
	if err := os.MkdirAll(filepath.Dir(n.PagePath(bogus)), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(n.PagePath(bogus), []byte("not a page"), 0o644); err != nil {
		t.Fatal(err)
	}
	pages, ds, err := PagesFromDisk(n, 2)
	if err != nil {
		t.Fatal(err)
	}
	if ds.Files != len(want)+2+1 || ds.Unreadable != 1 || ds.Vanished != 0 || len(pages) != len(want)+2 {
		t.Fatalf("disk stats %+v, %d pages; want %d files (2 leaves, 1 bogus), 1 unreadable", ds, len(pages), len(want)+3)
	}

	p := newPub(t, Config{Topic: "t"})
	s := subscribe(t, p, "t")
	ss, err := p.Snapshot(context.Background(), ns, pages)
	if err != nil {
		t.Fatal(err)
	}
	if ss.Pages != len(want) || ss.Leaves != 2 || ss.Orphans != 0 {
		t.Fatalf("snapshot stats %+v, want %d pages and 2 leaves", ss, len(want))
	}
	got := collect(t, s, len(want), P)
	var wantHashes []uint64
	for _, pg := range want {
		wantHashes = append(wantHashes, hash64(pg.Key))
		if !slices.Equal(got.tokens[hash64(pg.Key)], pg.Tokens) {
			t.Fatalf("page %s: tokens differ", pg.Key)
		}
	}
	slices.Sort(wantHashes)
	order := slices.Sorted(slices.Values(got.order))
	if !slices.Equal(order, wantHashes) {
		t.Fatalf("announced %d hashes, not the %d full pages on disk", len(order), len(wantHashes))
	}
}

// A snapshot of a namespace the topic does not cover announces nothing.
func TestSnapshotOtherNamespace(t *testing.T) {
	p := newPub(t, Config{Topic: "t", Namespace: "ns"})
	st, err := p.Snapshot(context.Background(), "other", chain(t, "id", 16, tokensOf(1, 64)))
	if err != nil || st != (SnapshotStats{}) {
		t.Fatalf("stats %+v, err %v; want nothing", st, err)
	}
	if err := p.Flush(context.Background()); err != nil {
		t.Fatal(err)
	}
	if n := p.Stats().Events; n != 0 {
		t.Fatalf("%d events sent", n)
	}
}

// savePrefix saves tokens' KV (one small bf16 tensor) as pages under root.
func savePrefix(t testing.TB, root, ns, id string, p int, tokens []uint32) {
	t.Helper()
	n := len(tokens)
	buf := make([]byte, 2*n*8)
	for i := range buf {
		buf[i] = byte(i * 13)
	}
	_, _, err := jobs.SavePrefix(context.Background(), &jobs.Config{NoSync: true, Root: root}, &jobs.SavePrefixRequest{
		Namespace: ns, Identity: id, Tokens: tokens, PageTokens: p,
		Tensors: []jobs.TensorSpec{{DType: "bfloat16", View: gather.View{Base: buf, Shape: []int{n, 8}, Strides: []int{8, 1}, ItemSize: 2}}},
	})
	if err != nil {
		t.Fatal(err)
	}
}

// SnapshotStore announces every namespace's pages, or Config.Namespace's
// alone.
func TestSnapshotStore(t *testing.T) {
	const P = 16
	root := t.TempDir()
	savePrefix(t, root, "a", "id", P, tokensOf(1, 3*P))
	savePrefix(t, root, "b", "id", P, tokensOf(2, 2*P))
	st, err := store.Open(root, store.Options{})
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		ns    string
		pages int
		names int
	}{{"", 5, 2}, {"b", 2, 1}} {
		p := newPub(t, Config{Topic: "t", Namespace: c.ns})
		s := subscribe(t, p, "t")
		ss, err := p.SnapshotStore(context.Background(), st, 1)
		if err != nil {
			t.Fatal(err)
		}
		if ss.Namespaces != c.names || ss.Snapshot.Pages != c.pages || ss.Disk.Files != c.pages {
			t.Fatalf("namespace %q: %+v, want %d namespaces, %d pages", c.ns, ss, c.names, c.pages)
		}
		got := collect(t, s, c.pages, P)
		for _, pg := range chain(t, "id", P, tokensOf(2, 2*P)) {
			if _, ok := got.tokens[hash64(pg.Key)]; !ok {
				t.Fatalf("namespace %q: b's page %s not announced", c.ns, pg.Key)
			}
		}
	}
}
