package remote_test

import (
	"bytes"
	"context"
	"errors"
	"testing"
	"time"

	"github.com/kvpersist/kvpersist/engine/remote"
)

// TestCollect: only pages that no manifest names and that are older than
// the grace period (by the store's clock) are deleted; live pages, young
// pages, manifests and unknown names stay.
func TestCollect(t *testing.T) {
	defer remote.SetMinGrace(time.Second)()
	s := newStore(t, nil)
	ctx := context.Background()
	put := func(name string, b []byte) {
		t.Helper()
		if _, err := s.Put(ctx, name, bytes.NewReader(b), int64(len(b))); err != nil {
			t.Fatal(err)
		}
	}
	live, old := key("live"), key("old")
	put(pageName(t, s, "ns", live), []byte("live page"))
	put(pageName(t, s, "ns", old), []byte("old unreferenced page"))
	man, err := s.ManifestName("ns", "conv-1")
	if err != nil {
		t.Fatal(err)
	}
	put(man, []byte(live))
	p, _ := s.NamespacePrefix("ns")
	unknown := p + "pages/zz/not-a-key"
	put(unknown, []byte("?"))
	time.Sleep(3500 * time.Millisecond) // 3 s older than young at 1 s mtime resolution
	young := key("young")
	youngName := pageName(t, s, "ns", young)
	put(youngName, []byte("young unreferenced page"))

	var sawManifests []string
	opts := remote.CollectOptions{Namespace: "ns",
		Live: func(ctx context.Context, ms []remote.Listed) (map[string]bool, error) {
			liveSet := map[string]bool{}
			for _, m := range ms {
				sawManifests = append(sawManifests, m.Key)
				var dst memFile
				if _, err := s.Fetch(ctx, m.Name, &dst, nil); err != nil {
					return nil, err
				}
				liveSet[string(dst.b)] = true
			}
			return liveSet, nil
		}}
	dry := opts
	dry.DryRun = true
	dry.Grace = graceKeepingYoung(t, s, youngName)
	rep, err := s.Collect(ctx, dry)
	if err != nil || rep.Deleted != 1 {
		t.Fatalf("dry run: %+v, %v", rep, err)
	}
	if _, err := s.Stat(ctx, pageName(t, s, "ns", old)); err != nil {
		t.Fatalf("dry run deleted: %v", err)
	}
	opts.Grace = graceKeepingYoung(t, s, youngName)
	rep, err = s.Collect(ctx, opts)
	if err != nil {
		t.Fatal(err)
	}
	if rep.Pages != 3 || rep.Manifests != 1 || rep.Live != 1 || rep.Young != 1 || rep.Deleted != 1 ||
		rep.DeletedBytes != int64(len("old unreferenced page")) || len(rep.Unknown) != 1 || rep.Unknown[0] != unknown {
		t.Fatalf("report %+v", rep)
	}
	if len(sawManifests) != 2 || sawManifests[0] != "conv-1" {
		t.Fatalf("Live saw manifests %v", sawManifests)
	}
	if _, err := s.Stat(ctx, pageName(t, s, "ns", old)); !errors.Is(err, remote.ErrNotFound) {
		t.Fatalf("old page: %v, want deleted", err)
	}
	for _, n := range []string{pageName(t, s, "ns", live), pageName(t, s, "ns", young), man, unknown} {
		if _, err := s.Stat(ctx, n); err != nil {
			t.Fatalf("%s: %v, want kept", n, err)
		}
	}
	// Refresh renews an old page's mtime (same bytes), so the next
	// collect finds it young.
	old2 := pageName(t, s, "ns", key("old2"))
	put(old2, []byte("refreshed page"))
	before, err := s.Stat(ctx, old2)
	if err != nil {
		t.Fatal(err)
	}
	time.Sleep(3500 * time.Millisecond) // young is now 3 s older than old2's refresh
	after, err := s.Refresh(ctx, old2, before.ETag)
	if err != nil {
		t.Fatal(err)
	}
	if !after.ModTime.After(before.ModTime) || after.Size != before.Size {
		t.Fatalf("Refresh: %+v -> %+v", before, after)
	}
	opts.Grace = graceKeepingYoung(t, s, old2)
	rep, err = s.Collect(ctx, opts)
	if err != nil || rep.Deleted != 1 || rep.Young != 1 || rep.Live != 1 {
		t.Fatalf("collect after Refresh: %+v, %v (want the refreshed page kept, the now old unreferenced page deleted)", rep, err)
	}
	if _, err := s.Stat(ctx, pageName(t, s, "ns", young)); !errors.Is(err, remote.ErrNotFound) {
		t.Fatalf("the aged unreferenced page: %v, want deleted", err)
	}
	var got memFile
	if _, err := s.Fetch(ctx, old2, &got, nil); err != nil || string(got.b) != "refreshed page" {
		t.Fatalf("refreshed page bytes %q, %v", got.b, err)
	}
	if _, err := s.Refresh(ctx, old2, "0123456789abcdef0123456789abcdef"); err == nil {
		t.Fatal("Refresh with another ETag succeeded")
	}

	failing := opts
	failing.Live = func(context.Context, []remote.Listed) (map[string]bool, error) {
		return nil, errors.New("manifest unreadable")
	}
	if _, err := s.Collect(ctx, failing); err == nil {
		t.Fatal("Collect with a failing Live succeeded")
	}
	if _, err := s.Collect(ctx, remote.CollectOptions{Namespace: "ns", Grace: time.Millisecond, Live: opts.Live}); !errors.Is(err, remote.ErrConfig) {
		t.Fatalf("grace under the minimum: %v", err)
	}
}

// TestCollectKeepsPageRefreshedAfterListing: an uploader that finds an
// old unreferenced page present refreshes it (Store.Refresh) and then
// names it in a manifest. If that happens after a collector listed the
// namespace, the listing's mtime is stale; Collect re-reads the page's
// mtime (one HEAD) before deleting it and keeps it, because it is now
// younger than the grace. Live stands in for the race: it runs between
// the listing and the deletes.
func TestCollectKeepsPageRefreshedAfterListing(t *testing.T) {
	defer remote.SetMinGrace(time.Second)()
	s := newStore(t, nil)
	ctx := context.Background()
	refreshed, old := pageName(t, s, "ns", key("refreshed")), pageName(t, s, "ns", key("old"))
	for _, n := range []string{refreshed, old} {
		if _, err := s.Put(ctx, n, bytes.NewReader([]byte(n)), int64(len(n))); err != nil {
			t.Fatal(err)
		}
	}
	time.Sleep(3500 * time.Millisecond) // older than a 2 s grace at 1 s mtime resolution
	rep, err := s.Collect(ctx, remote.CollectOptions{Namespace: "ns", Grace: 2 * time.Second,
		Live: func(ctx context.Context, _ []remote.Listed) (map[string]bool, error) {
			o, err := s.Stat(ctx, refreshed)
			if err != nil {
				return nil, err
			}
			if _, err := s.Refresh(ctx, refreshed, o.ETag); err != nil {
				return nil, err
			}
			return map[string]bool{}, nil
		}})
	if err != nil {
		t.Fatal(err)
	}
	if rep.Deleted != 1 || len(rep.DeletedNames) != 1 || rep.DeletedNames[0] != old || rep.Refreshed != 1 {
		t.Fatalf("report %+v; want the old page deleted and the refreshed one kept", rep)
	}
	if _, err := s.Stat(ctx, refreshed); err != nil {
		t.Fatalf("the page refreshed after the listing: %v, want kept", err)
	}
	if _, err := s.Stat(ctx, old); !errors.Is(err, remote.ErrNotFound) {
		t.Fatalf("the old page: %v, want deleted", err)
	}
}
