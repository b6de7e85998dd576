package remote_test

import (
	"bytes"
	"context"
	"errors"
	"slices"
	"strings"
	"testing"

	"github.com/kvpersist/kvpersist/engine/remote"
	"github.com/kvpersist/kvpersist/internal/testutil"
)

func union(keys map[string][]string) map[string]bool {
	out := map[string]bool{}
	for _, ks := range keys {
		for _, k := range ks {
			out[k] = true
		}
	}
	return out
}

// TestVerifyAndLivePages: kvpersist's page files and page manifests, as
// uploaded, verify clean (every page fetched and re-hashed, every manifest
// decoded, every byte counted); LivePages names exactly the pages the
// manifests name; each kind of damage (a flipped tensor byte, a page
// under another key's name, a truncated page, a missing page, a manifest
// that does not decode) is reported once, naming its object, and an
// unreadable manifest makes LivePages, and so Collect, fail.
func TestVerifyAndLivePages(t *testing.T) {
	root := t.TempDir()
	keys := testutil.PageManifests(t, root, "ns")
	s := newStore(t, nil)
	ctx := context.Background()
	objs := testutil.UploadNamespace(t, s, root, "ns")
	all := union(keys)
	if len(all) != 6 || len(objs) != 6+2 {
		t.Fatalf("%d distinct pages, %d objects; want 6 pages (5 + turn-2's leaf) and 2 manifests", len(all), len(objs))
	}
	var total int64
	for _, b := range objs {
		total += int64(len(b))
	}
	var seen []string
	rep, err := s.Verify(ctx, "ns", remote.VerifyOptions{Workers: 2, OnObject: func(n string, _ int64) { seen = append(seen, n) }})
	if err != nil || len(rep.Problems) != 0 || rep.Pages != 6 || rep.Manifests != 2 || rep.Bytes != total || len(seen) != 8 {
		t.Fatalf("clean namespace: %+v, %v; want 6 pages, 2 manifests, %d bytes, no problem", rep, err, total)
	}
	live, err := s.LivePages(ctx, listed(t, s, remote.Manifest))
	if err != nil || len(live) != len(all) {
		t.Fatalf("LivePages = %d keys, %v; want %d", len(live), err, len(all))
	}
	for k := range all {
		if !live[k] {
			t.Fatalf("LivePages misses %s", k)
		}
	}

	replace := func(name string, b []byte) {
		t.Helper()
		if err := s.Delete(ctx, name); err != nil {
			t.Fatal(err)
		}
		if b != nil {
			if _, err := s.Put(ctx, name, bytes.NewReader(b), int64(len(b))); err != nil {
				t.Fatal(err)
			}
		}
	}
	page := func(k string) string { return pageName(t, s, "ns", k) }
	flipped := page(keys["turn-1"][1])
	b := slices.Clone(objs[flipped])
	b[len(b)-100] ^= 0x40 // in the last tensor's bytes
	replace(flipped, b)
	wrongKey := page(keys["turn-1"][2])
	replace(wrongKey, objs[page(keys["turn-1"][3])])
	truncated := page(keys["turn-1"][4])
	replace(truncated, objs[truncated][:len(objs[truncated])-10])
	missing := page(keys["turn-2"][3]) // turn-2's own leaf
	replace(missing, nil)
	man2, _ := s.ManifestName("ns", "turn-2")
	mb := slices.Clone(objs[man2])
	mb[40] ^= 1 // in the header JSON: the header hash fails
	replace(man2, mb)

	rep, err = s.Verify(ctx, "ns", remote.VerifyOptions{})
	if err != nil {
		t.Fatal(err)
	}
	type pk struct{ kind, name, detail string }
	want := []pk{
		{remote.ProblemCorruptPage, flipped, "xxh3"},
		{remote.ProblemCorruptPage, wrongKey, "holds the page of key " + keys["turn-1"][3]},
		{remote.ProblemCorruptPage, truncated, ""},
		{remote.ProblemUnreadable, man2, "header"},
	}
	if len(rep.Problems) != len(want) {
		t.Fatalf("problems %+v, want %d", rep.Problems, len(want))
	}
	for _, w := range want {
		found := false
		for _, p := range rep.Problems {
			found = found || (p.Kind == w.kind && p.Name == w.name && strings.Contains(p.Detail, w.detail))
		}
		if !found {
			t.Errorf("no %s problem for %s (%q) in %+v", w.kind, w.name, w.detail, rep.Problems)
		}
	}
	if rep.Pages != 5 || rep.Manifests != 2 {
		t.Fatalf("checked %d pages, %d manifests; want 5 and 2", rep.Pages, rep.Manifests)
	}
	if _, err := s.LivePages(ctx, listed(t, s, remote.Manifest)); !errors.Is(err, remote.ErrCorrupt) {
		t.Fatalf("LivePages with an unreadable manifest: %v, want ErrCorrupt", err)
	}

	// With the manifest repaired, the page it names that is gone is a
	// missing-page problem of that manifest.
	replace(man2, objs[man2])
	rep, err = s.Verify(ctx, "ns", remote.VerifyOptions{})
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	for _, p := range rep.Problems {
		if p.Kind == remote.ProblemMissingPage {
			n++
			if p.Name != man2 || !strings.Contains(p.Detail, "page 3 ("+missing+")") {
				t.Fatalf("missing-page problem %+v", p)
			}
		}
	}
	if n != 1 || len(rep.Problems) != 4 {
		t.Fatalf("problems %+v; want the 3 corrupt pages and turn-2's missing leaf", rep.Problems)
	}
}

func listed(t *testing.T, s *remote.Store, kind remote.Kind) []remote.Listed {
	t.Helper()
	l, err := s.List(context.Background(), "ns")
	if err != nil {
		t.Fatal(err)
	}
	var out []remote.Listed
	for _, o := range l {
		if o.Kind == kind {
			out = append(out, o)
		}
	}
	return out
}

// TestNamespaces: the namespaces under a prefix are its first name
// elements that are valid namespace names; an object directly under the
// prefix is skipped.
func TestNamespaces(t *testing.T) {
	s := newStore(t, nil)
	ctx := context.Background()
	for _, ns := range []string{"b-ns", "a-ns"} {
		n := pageName(t, s, ns, key(ns))
		if _, err := s.Put(ctx, n, strings.NewReader("x"), 1); err != nil {
			t.Fatal(err)
		}
	}
	p, _ := s.NamespacePrefix("a-ns")
	stray := strings.TrimSuffix(p, "a-ns/") + "stray-object"
	if _, err := s.Put(ctx, stray, strings.NewReader("x"), 1); err != nil {
		t.Fatal(err)
	}
	names, skipped, err := s.Namespaces(ctx)
	if err != nil || !slices.Equal(names, []string{"a-ns", "b-ns"}) || !slices.Equal(skipped, []string{stray}) {
		t.Fatalf("Namespaces = %v, skipped %v, %v", names, skipped, err)
	}
}
