package jobs_test

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/kvpersist/kvpersist/engine/gather"
	"github.com/kvpersist/kvpersist/engine/jobs"
	"github.com/kvpersist/kvpersist/engine/layout"
	"github.com/kvpersist/kvpersist/engine/vfs"
	"github.com/kvpersist/kvpersist/internal/kvgen"
	"github.com/kvpersist/kvpersist/internal/testutil"
)

func collect(t *testing.T, root string, req *jobs.CollectRequest) *jobs.CollectMetrics {
	t.Helper()
	m, err := collectAt(context.Background(), noSync(), root, req)
	if err != nil {
		t.Fatalf("Collect: %v", err)
	}
	return m.Collect
}

func TestCollectDeletesExactlyUnreferenced(t *testing.T) {
	root := t.TempDir()
	ns := filepath.Join(root, "ns")
	c1 := kvgen.NewCache(kvgen.Tiny, 1100, true, nil)
	c2 := kvgen.NewCache(kvgen.Tiny, 1300, true, nil)
	ha, _ := mustWrite(t, noSync(), cacheSpec(t, c1, filepath.Join(ns, "a"), layout.Blocks, 4096))
	hb, _ := mustWrite(t, noSync(), cacheSpec(t, c2, filepath.Join(ns, "b"), layout.Blocks, 4096))
	before := blockFiles(t, ns)

	// Nothing is unreferenced while both manifests exist.
	if cm := collect(t, root, &jobs.CollectRequest{}); len(cm.Deleted) != 0 || cm.BlocksKept != int64(len(before)) || cm.ManifestsScanned != 2 {
		t.Fatalf("with both manifests: %+v", cm)
	}
	if err := os.Remove(filepath.Join(ns, "a")); err != nil {
		t.Fatal(err)
	}
	// Expected victims: blocks of a minus blocks of b (the 8 row tails and
	// the token-id tail of the 1100-token save).
	setB := blockSet(hb)
	var gone []string
	var freed int64
	for h, n := range blockSet(ha) {
		if _, ok := setB[h]; !ok {
			gone = append(gone, h)
			freed += n
		}
	}
	want := blockPaths(ns, gone)
	if len(want) != 9 {
		t.Fatalf("%d blocks only in a, want 9", len(want))
	}

	dry := collect(t, root, &jobs.CollectRequest{DryRun: true})
	if !slices.Equal(dry.Deleted, want) || dry.BlocksDeleted != 9 || dry.BytesFreed != freed {
		t.Fatalf("dry run: deleted %v (%d, %d bytes), want %v (%d bytes)", dry.Deleted, dry.BlocksDeleted, dry.BytesFreed, want, freed)
	}
	if after := blockFiles(t, ns); len(after) != len(before) {
		t.Fatalf("dry run deleted %d files", len(before)-len(after))
	}

	real := collect(t, root, &jobs.CollectRequest{})
	if !slices.Equal(real.Deleted, dry.Deleted) || real.BlocksDeleted != 9 || real.BytesFreed != freed ||
		real.BlocksKept != int64(len(setB)) || real.ManifestsScanned != 1 || real.Namespaces != 1 {
		t.Fatalf("collect: %+v", real)
	}
	if after := blockFiles(t, ns); !slices.Equal(sortedKeys(after), sortedKeys(setB)) {
		t.Fatalf("%d block files left, want exactly b's %d", len(after), len(setB))
	}
	got, _, _, err := readBack(t, noSync(), filepath.Join(ns, "b"), true)
	if err != nil {
		t.Fatal(err)
	}
	mustEqualExpected(t, got, expectedAll(c2))
	if again := collect(t, root, &jobs.CollectRequest{}); len(again.Deleted) != 0 {
		t.Fatalf("second collect deleted %v", again.Deleted)
	}
}

func mkdir(t *testing.T, path string) string {
	t.Helper()
	if err := os.MkdirAll(path, 0o755); err != nil {
		t.Fatal(err)
	}
	return path
}

// TestCollectPastUnreadableManifests: a manifest that does not decode stops
// the sweep of its own namespace only; unknown entries are reported and
// left alone.
func TestCollectPastUnreadableManifests(t *testing.T) {
	root := t.TempDir()
	keep := kvgen.NewCache(kvgen.Tiny, 300, true, nil)
	gone := kvgen.NewCache(kvgen.Tiny, 40, true, nil)
	names := []string{"bad-hash", "bad-json", "good", "short"}
	orphans := map[string][]string{}
	liveSets := map[string]*layout.Header{}
	for _, ns := range names {
		dir := filepath.Join(root, ns)
		hk, _ := mustWrite(t, noSync(), cacheSpec(t, keep, filepath.Join(dir, "keep"), layout.Blocks, 4096))
		hg, _ := mustWrite(t, noSync(), cacheSpec(t, gone, filepath.Join(dir, "gone"), layout.Blocks, 4096))
		if err := os.Remove(filepath.Join(dir, "gone")); err != nil {
			t.Fatal(err)
		}
		live := blockSet(hk)
		liveSets[ns] = hk
		for h := range blockSet(hg) {
			if _, ok := live[h]; !ok {
				orphans[ns] = append(orphans[ns], h)
			}
		}
	}
	manifest, err := os.ReadFile(filepath.Join(root, "good", "keep"))
	if err != nil {
		t.Fatal(err)
	}
	flipped := slices.Clone(manifest)
	flipped[40] ^= 0x01
	badJS := []byte(`{"caches":[{]}`)
	testutil.WriteFile(t, filepath.Join(root, "bad-hash", "broken"), string(flipped))
	testutil.WriteFile(t, filepath.Join(root, "bad-json", "broken"), string(append(layout.EncodePrefix(badJS, uint32(26+len(badJS))), badJS...)))
	testutil.WriteFile(t, filepath.Join(root, "short", "broken"), string(manifest[:20]))
	// An unreadable namespace still loses its stale temp files.
	staleTemp := testutil.WriteFile(t, layout.TempPath(testutil.BlockPath(filepath.Join(root, "bad-json"), orphans["bad-json"][0])), "partial")
	old := time.Now().Add(-time.Hour)
	if err := os.Chtimes(staleTemp, old, old); err != nil {
		t.Fatal(err)
	}

	good := filepath.Join(root, "good")
	gb := testutil.BlocksDir(good)
	hash := orphans["good"][0]
	foreign := "ff" + hash[2:]
	if hash[:2] == "ff" {
		foreign = "00" + hash[2:]
	}
	wantSkipped := []string{
		mkdir(t, filepath.Join(root, ".hidden")),
		testutil.WriteFile(t, filepath.Join(root, "stray.txt"), "x"),
		testutil.WriteFile(t, filepath.Join(good, "-not-a-name"), "x"),
		mkdir(t, filepath.Join(good, "olddir")),
		mkdir(t, filepath.Join(gb, "notes")),
		mkdir(t, filepath.Join(gb, strings.Repeat("e", 64))),
		testutil.WriteFile(t, filepath.Join(gb, "README"), "x"),
		testutil.WriteFile(t, filepath.Join(gb, hash[:2], "README"), "x"),
		testutil.WriteFile(t, filepath.Join(gb, hash[:2], strings.ToUpper(hash)), "x"),
		testutil.WriteFile(t, filepath.Join(gb, "zz", foreign), "x"),     // not a fan-out dir: skipped whole
		testutil.WriteFile(t, filepath.Join(gb, foreign[:2], hash), "x"), // a block name in the wrong fan-out dir
	}
	wantSkipped[len(wantSkipped)-2] = filepath.Join(gb, "zz")
	testutil.WriteFile(t, filepath.Join(gb, "notes", "n.txt"), "x")
	before := map[string]map[string]int64{}
	for _, ns := range names {
		before[ns] = blockFiles(t, filepath.Join(root, ns))
	}

	cm := collect(t, root, &jobs.CollectRequest{})

	wantUnswept := []string{filepath.Join(root, "bad-hash"), filepath.Join(root, "bad-json"), filepath.Join(root, "short")}
	if !slices.Equal(cm.UnsweptNamespaces, wantUnswept) {
		t.Fatalf("UnsweptNamespaces %v, want %v", cm.UnsweptNamespaces, wantUnswept)
	}
	if len(cm.Unreadable) != 3 {
		t.Fatalf("Unreadable %v", cm.Unreadable)
	}
	for i, want := range []struct{ path, why string }{
		{filepath.Join(root, "bad-hash", "broken"), "header hash mismatch"},
		{filepath.Join(root, "bad-json", "broken"), "invalid header"},
		{filepath.Join(root, "short", "broken"), "truncated"},
	} {
		if !strings.Contains(cm.Unreadable[i], want.path) || !strings.Contains(cm.Unreadable[i], want.why) {
			t.Errorf("Unreadable[%d] = %q, want %s: %s", i, cm.Unreadable[i], want.path, want.why)
		}
	}
	wantDeleted := append(blockPaths(good, orphans["good"]), staleTemp)
	slices.Sort(wantDeleted)
	gotDeleted := slices.Sorted(slices.Values(cm.Deleted))
	if !slices.Equal(gotDeleted, wantDeleted) || cm.BlocksDeleted != int64(len(orphans["good"])) || cm.TempRemoved != 1 {
		t.Fatalf("deleted %v, want %v", cm.Deleted, wantDeleted)
	}
	slices.Sort(wantSkipped)
	if got := slices.Sorted(slices.Values(cm.Skipped)); !slices.Equal(got, wantSkipped) {
		t.Fatalf("Skipped\n %v\nwant\n %v", got, wantSkipped)
	}
	for _, p := range wantSkipped {
		if _, err := os.Lstat(p); err != nil {
			t.Fatalf("skipped entry %s was touched: %v", p, err)
		}
	}
	if _, err := os.Lstat(staleTemp); !os.IsNotExist(err) {
		t.Fatal("stale temp in an unswept namespace kept")
	}
	for _, ns := range names {
		after := blockFiles(t, filepath.Join(root, ns))
		switch ns {
		case "good":
			for _, h := range orphans[ns] {
				if _, err := os.Lstat(testutil.BlockPath(good, h)); !os.IsNotExist(err) {
					t.Fatalf("good: orphan block %s kept", h)
				}
			}
			for h := range blockSet(liveSets[ns]) {
				if _, err := os.Lstat(testutil.BlockPath(good, h)); err != nil {
					t.Fatalf("good: live block %s: %v", h, err)
				}
			}
		default:
			if !slices.Equal(sortedKeys(after), sortedKeys(before[ns])) {
				t.Fatalf("%s: blocks deleted in an unswept namespace", ns)
			}
		}
		got, _, _, err := readBack(t, noSync(), filepath.Join(root, ns, "keep"), true)
		if err != nil {
			t.Fatalf("%s: %v", ns, err)
		}
		mustEqualExpected(t, got, expectedAll(keep))
	}
	if cm.Namespaces != 4 || cm.ManifestsScanned != 4 {
		t.Fatalf("namespaces %d, manifests %d", cm.Namespaces, cm.ManifestsScanned)
	}
}

func TestCollectRootErrors(t *testing.T) {
	root := t.TempDir()
	c := kvgen.NewCache(kvgen.Tiny, 40, true, nil)
	mustWrite(t, noSync(), cacheSpec(t, c, filepath.Join(root, "ns", "s"), layout.Blocks, 0))
	file := testutil.WriteFile(t, filepath.Join(root, "file"), "x")
	for _, r := range []string{filepath.Join(root, "missing"), file, filepath.Join(root, "ns")} {
		_, err := collectAt(context.Background(), noSync(), r, &jobs.CollectRequest{})
		if !errors.Is(err, jobs.ErrRoot) || !strings.Contains(err.Error(), r) {
			t.Fatalf("root %s: %v, want ErrRoot naming it", r, err)
		}
	}
	if len(blockFiles(t, filepath.Join(root, "ns"))) != 9 {
		t.Fatal("blocks deleted")
	}
	_, err := collectAt(context.Background(), noSync(), root, &jobs.CollectRequest{Namespaces: []string{"../x"}})
	if !errors.Is(err, layout.ErrBadName) {
		t.Fatalf("namespace ../x: %v", err)
	}
}

func TestCollectTempGrace(t *testing.T) {
	root := t.TempDir()
	ns := filepath.Join(root, "ns")
	c := kvgen.NewCache(kvgen.Tiny, 40, true, nil)
	h, _ := mustWrite(t, noSync(), cacheSpec(t, c, filepath.Join(ns, "snap"), layout.Blocks, 0))
	block := testutil.BlockPath(ns, h.Slots()[0].Blocks[0].Hash)
	old := time.Now().Add(-time.Hour)
	var stale, fresh []string
	for _, target := range []string{filepath.Join(ns, "snap"), block, filepath.Join(testutil.BlocksDir(ns), "x")} {
		s := testutil.WriteFile(t, layout.TempPath(target), "partial")
		if err := os.Chtimes(s, old, old); err != nil {
			t.Fatal(err)
		}
		stale = append(stale, s)
		fresh = append(fresh, testutil.WriteFile(t, layout.TempPath(target), "in progress"))
	}
	// Looks like a temp file but the random part is not hex: not ours.
	foreign := testutil.WriteFile(t, filepath.Join(ns, ".snap.tmp-ZZZZZZZZZZZZZZZZ"), "x")
	if err := os.Chtimes(foreign, old, old); err != nil {
		t.Fatal(err)
	}

	cm := collect(t, root, &jobs.CollectRequest{})
	slices.Sort(stale)
	if got := slices.Sorted(slices.Values(cm.Deleted)); !slices.Equal(got, stale) || cm.TempRemoved != 3 || cm.BlocksDeleted != 0 {
		t.Fatalf("deleted %v, want the stale temps %v", cm.Deleted, stale)
	}
	for _, p := range stale {
		if _, err := os.Lstat(p); !os.IsNotExist(err) {
			t.Fatalf("stale temp %s kept", p)
		}
	}
	for _, p := range append(fresh, foreign) {
		if _, err := os.Lstat(p); err != nil {
			t.Fatalf("%s removed: %v", p, err)
		}
	}
	if !slices.Contains(cm.Skipped, foreign) {
		t.Fatalf("foreign file not reported: %v", cm.Skipped)
	}
	// A negative grace removes every temp file.
	cm = collect(t, root, &jobs.CollectRequest{TempGrace: -1})
	if cm.TempRemoved != 3 {
		t.Fatalf("TempRemoved %d, want 3", cm.TempRemoved)
	}
	if tmp := temps(t, root); len(tmp) != 1 || tmp[0] != foreign {
		t.Fatalf("left %v", tmp)
	}
	got, _, _, err := readBack(t, noSync(), filepath.Join(ns, "snap"), true)
	if err != nil {
		t.Fatal(err)
	}
	mustEqualExpected(t, got, expectedAll(c))
}

// Unreferenced blocks younger than BlockGrace are kept.
func TestCollectBlockGrace(t *testing.T) {
	root := t.TempDir()
	ns := filepath.Join(root, "ns")
	c := kvgen.NewCache(kvgen.Tiny, 40, true, nil)
	mustWrite(t, noSync(), cacheSpec(t, c, filepath.Join(ns, "snap"), layout.Blocks, 0))
	if err := os.Remove(filepath.Join(ns, "snap")); err != nil {
		t.Fatal(err)
	}
	cm := collect(t, root, &jobs.CollectRequest{BlockGrace: time.Hour})
	if cm.BlocksDeleted != 0 || cm.BlocksKept != 9 {
		t.Fatalf("within grace: %+v", cm)
	}
	cm = collect(t, root, &jobs.CollectRequest{BlockGrace: time.Hour, Now: time.Now().Add(2 * time.Hour)})
	if cm.BlocksDeleted != 9 || len(blockFiles(t, ns)) != 0 {
		t.Fatalf("past grace: %+v", cm)
	}
}

// TestCollectTakesAnEmptyFileForNotOurs: kvpersist never publishes an
// empty file, so one in a namespace is skipped and reported, and the
// namespace is swept as usual (it does not block the sweep the way an
// unreadable manifest does).
func TestCollectTakesAnEmptyFileForNotOurs(t *testing.T) {
	root := t.TempDir()
	ns := filepath.Join(root, "ns")
	mustWrite(t, noSync(), cacheSpec(t, kvgen.NewCache(kvgen.Tiny, 1100, true, nil), filepath.Join(ns, "a"), layout.Blocks, 4096))
	mustWrite(t, noSync(), cacheSpec(t, kvgen.NewCache(kvgen.Tiny, 700, false, nil), filepath.Join(ns, "b"), layout.Blocks, 4096))
	kept := blockFiles(t, ns)
	if err := os.Remove(filepath.Join(ns, "b")); err != nil {
		t.Fatal(err)
	}
	empty := testutil.WriteFile(t, filepath.Join(ns, "empty"), "")
	cm := collect(t, root, &jobs.CollectRequest{})
	if len(cm.Unreadable) != 0 || len(cm.UnsweptNamespaces) != 0 || !slices.Contains(cm.Skipped, empty) {
		t.Fatalf("unreadable %q, unswept %q, skipped %q; want the empty file skipped", cm.Unreadable, cm.UnsweptNamespaces, cm.Skipped)
	}
	if cm.BlocksDeleted == 0 || int(cm.BlocksKept+cm.BlocksDeleted) != len(kept) {
		t.Fatalf("kept %d, deleted %d of %d blocks: the namespace was not swept", cm.BlocksKept, cm.BlocksDeleted, len(kept))
	}
	if _, err := os.Lstat(empty); err != nil {
		t.Fatalf("the empty file was touched: %v", err)
	}
	got, _, _, err := readBack(t, noSync(), filepath.Join(ns, "a"), true)
	if err != nil {
		t.Fatal(err)
	}
	mustEqualExpected(t, got, expectedAll(kvgen.NewCache(kvgen.Tiny, 1100, true, nil)))
}

// TestCollectAboveTheRootLeavesTheStoreUsable: a collect run one level
// above the store root (`kvpersist gc /srv` for /srv/kvstore) takes the
// store root for a namespace, and creates no lock file in it (it holds no
// blocks/ or pages/ of its own): later collects of the real root still
// take it for a root.
func TestCollectAboveTheRootLeavesTheStoreUsable(t *testing.T) {
	parent := t.TempDir()
	store := filepath.Join(parent, "kvstore")
	v := gather.View{Base: make([]byte, 8192), Shape: []int{4096}, Strides: []int{1}, ItemSize: 2}
	spec := &wreq{filepath.Join(store, "conv-1", "turn-1"), &jobs.WriteRequest{Layout: layout.Blocks, BlockBytes: 4096,
		Caches: []jobs.EntrySpec{{Tensors: []jobs.TensorSpec{{DType: "bfloat16", View: v}}}}}}
	if _, _, err := writeAt(context.Background(), noSync(), spec); err != nil {
		t.Fatal(err)
	}
	if _, err := collectAt(context.Background(), noSync(), store, &jobs.CollectRequest{}); err != nil {
		t.Fatalf("collect of the store root: %v", err)
	}
	// The operator's slip: one directory too high. It "succeeds".
	if _, err := collectAt(context.Background(), noSync(), parent, &jobs.CollectRequest{}); err != nil {
		t.Logf("collect of the parent: %v", err)
	}
	if _, err := os.Lstat(filepath.Join(store, layout.LockName)); !os.IsNotExist(err) {
		t.Errorf("the collect of the parent created %s/.lock (%v)", store, err)
	}
	_, err := collectAt(context.Background(), noSync(), store, &jobs.CollectRequest{})
	if errors.Is(err, jobs.ErrRoot) {
		t.Fatalf("after one collect of the parent, collect of the real root fails: %v", err)
	}
}

// TestCollectKeepsBlocksOfALegacyManifestWhateverItsName: collect decodes
// every file that starts with a magic, whatever its name (the Bun worker
// accepted any, e.g. "turn 2.mlxkv" with a space), and keeps the blocks it
// names.
func TestCollectKeepsBlocksOfALegacyManifestWhateverItsName(t *testing.T) {
	root := t.TempDir()
	ns := filepath.Join(root, "bun")
	testutil.CopyTree(t, filepath.Join(testutil.BunFixtures, "blocks"), ns)
	if err := os.Rename(filepath.Join(ns, "grown.mlxkv"), filepath.Join(ns, "turn 2.mlxkv")); err != nil {
		t.Fatal(err)
	}
	if err := os.Remove(filepath.Join(ns, "snapshot.mlxkv")); err != nil {
		t.Fatal(err)
	}
	snap, err := layout.Load(vfs.Default, filepath.Join(ns, "turn 2.mlxkv"))
	if err != nil {
		t.Fatal(err)
	}
	m, err := collectAt(context.Background(), noSync(), root, &jobs.CollectRequest{})
	if err != nil {
		t.Fatal(err)
	}
	missing := 0
	for _, tn := range snap.Header.Slots() {
		for _, b := range tn.Blocks {
			if _, err := os.Lstat(testutil.LegacyBlockPath(ns, b.Hash)); err != nil {
				missing++
			}
		}
	}
	if missing > 0 {
		t.Fatalf("collect deleted %d blocks named by the published manifest %q (skipped: %v)", missing, "turn 2.mlxkv", m.Collect.Skipped)
	}
}
