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

	"github.com/kvpersist/kvpersist/engine/jobs"
	"github.com/kvpersist/kvpersist/engine/layout"
	"github.com/kvpersist/kvpersist/engine/store"
	"github.com/kvpersist/kvpersist/engine/vfs"
	"github.com/kvpersist/kvpersist/internal/kvgen"
	"github.com/kvpersist/kvpersist/internal/testutil"
)

// Pages in the store model: verify re-hashes every page file and checks
// its key and what page manifests name; collect keeps every page and
// removes only stale temp files under pages/, under the exclusive lock.

func verifyRoot(t *testing.T, target string, grace time.Duration) *jobs.VerifyReport {
	t.Helper()
	r, err := jobs.VerifyStore(context.Background(), noSync(), &jobs.VerifySpec{Target: target, TempGrace: grace})
	if err != nil {
		t.Fatal(err)
	}
	return r
}

type kindPath struct{ kind, path string }

func problemsOf(r *jobs.VerifyReport) []kindPath {
	out := []kindPath{}
	for _, p := range r.Problems {
		out = append(out, kindPath{p.Kind, p.Path})
	}
	return out
}

// TestVerifyStorePages: a page manifest's attachments and every page file
// of the namespace (named by a manifest or a prefix-cache entry) are
// re-hashed; a flipped byte of a page tensor, a truncated page, a page
// stored under another key's name, a page a manifest names that is gone,
// and a stale temp file under pages/ are each reported, once, at their
// path.
func TestVerifyStorePages(t *testing.T) {
	root := t.TempDir()
	nsDir := filepath.Join(root, "ns")
	c := kvgen.NewCache(kvgen.Tiny, 300, true, nil)
	toks := seqTokens(300, 5)
	w := cacheSpec(t, c, filepath.Join(nsDir, "turn-1"), layout.Pages, 0)
	w.Identity, w.Tokens, w.PageTokens = "tiny", toks, 64
	mustWrite(t, noSync(), w)
	keys, _, _ := layout.PageChain("tiny", 64, toks) // 4 full pages and a leaf of 44 tokens
	cv := newConv(seqTokens(100, 6), pTensors, pHeads, pDim, 128)
	res := savePrefix(t, noSync(), nsDir, cv, 100, 64) // a cache entry no manifest names: 2 pages

	nCache := 2 * kvgen.Tiny.Layers
	wantBytes := int64(nCache*kvgen.Tiny.TensorBytes(300) + 300*kvgen.IDSize + pTensors*pHeads*100*pDim*2)
	r := verifyRoot(t, root, 0)
	if len(r.Problems) != 0 || r.Checked.Pages != len(keys)+len(res.Keys) || r.Checked.Snapshots != 1 ||
		r.Checked.Tensors != len(keys)*nCache+1+len(res.Keys)*pTensors || r.Checked.Blocks != 0 || r.Checked.Bytes != wantBytes {
		t.Fatalf("clean store: %+v, problems %v", r.Checked, r.Problems)
	}
	// The snapshot alone: its attachment and its pages.
	if r := verifyRoot(t, filepath.Join(nsDir, "turn-1"), 0); len(r.Problems) != 0 || r.Checked.Pages != len(keys) ||
		r.Checked.Tensors != len(keys)*nCache+1 || r.Checked.Bytes != int64(nCache*kvgen.Tiny.TensorBytes(300)+300*kvgen.IDSize) {
		t.Fatalf("snapshot target: %+v, problems %v", r.Checked, r.Problems)
	}

	// A flipped byte in tensor 1 of page 1 of the manifest.
	p1 := testutil.PagePath(nsDir, keys[1])
	snap, err := layout.Load(vfs.Default, p1)
	if err != nil {
		t.Fatal(err)
	}
	flipByte(t, p1, int64(snap.DataStart)+snap.Header.Caches[0].Tensors[1].Off+7)
	// The prefix entry's leaf, truncated by 1 byte.
	leaf := testutil.PagePath(nsDir, res.Keys[1])
	if fi, err := os.Stat(leaf); err != nil || os.Truncate(leaf, fi.Size()-1) != nil {
		t.Fatal(err)
	}
	// Page 2's file copied under a key it does not hold (same fan-out).
	k2 := keys[2].String()
	wrongName := filepath.Join(filepath.Dir(testutil.PagePath(nsDir, keys[2])), k2[:2]+strings.Repeat("0", 62))
	testutil.CopyFile(t, testutil.PagePath(nsDir, keys[2]), wrongName)
	// The manifest's leaf page, removed.
	gone := testutil.PagePath(nsDir, keys[4])
	if err := os.Remove(gone); err != nil {
		t.Fatal(err)
	}
	// A crash leftover under pages/.
	tmp := testutil.WriteFile(t, layout.TempPath(testutil.PagePath(nsDir, keys[3])), "partial page")

	r = verifyRoot(t, root, -1)
	want := []kindPath{
		{jobs.ProblemUnreadable, leaf},
		{jobs.ProblemCorruptTensor, p1},
		{jobs.ProblemCorruptPage, wrongName},
		{jobs.ProblemMissingPage, gone},
		{jobs.ProblemStaleTemp, tmp},
	}
	if got := problemsOf(r); !slices.Equal(got, want) {
		t.Fatalf("problems:\n got %v\nwant %v", got, want)
	}
	if d := r.Problems[1].Detail; !strings.Contains(d, snap.Header.SlotName(1)) {
		t.Errorf("corrupt-tensor detail %q does not name the slot", d)
	}
	// A young temp file is not reported with the default grace.
	r = verifyRoot(t, root, 0)
	if got := problemsOf(r); !slices.Equal(got, want[:4]) {
		t.Fatalf("default grace: %v", got)
	}
}

// TestCollectPagesKeepsPagesSweepsStaleTemps: collect keeps every page
// file (named by a manifest or not) and removes the stale temp files of
// pages/ (at its top and in fan-out directories), keeping young ones; a
// collect that cannot get the exclusive lock (a save holds it shared)
// deletes nothing.
func TestCollectPagesKeepsPagesSweepsStaleTemps(t *testing.T) {
	root := t.TempDir()
	nsDir := filepath.Join(root, "ns")
	cv := newConv(seqTokens(300, 7), pTensors, pHeads, pDim, 320)
	res := savePrefix(t, noSync(), nsDir, cv, 300, 64)
	before := pageFiles(t, nsDir)
	old := []string{
		testutil.WriteFile(t, layout.TempPath(testutil.PagePath(nsDir, res.Keys[0])), "torn page"),
		testutil.WriteFile(t, layout.TempPath(filepath.Join(testutil.PagesDir(nsDir), "x")), "torn"),
	}
	hourAgo := time.Now().Add(-time.Hour)
	for _, p := range old {
		if err := os.Chtimes(p, hourAgo, hourAgo); err != nil {
			t.Fatal(err)
		}
	}
	young := testutil.WriteFile(t, layout.TempPath(testutil.PagePath(nsDir, res.Keys[1])), "being written")

	// While a save holds the namespace lock shared, collect waits and
	// deletes nothing.
	st := store.At(root, store.Options{})
	ns, err := st.Namespace("ns")
	if err != nil {
		t.Fatal(err)
	}
	unlock, err := ns.Lock(context.Background(), false)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	_, err = collectAt(ctx, noSync(), root, &jobs.CollectRequest{})
	cancel()
	unlock()
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("collect under a shared lock: %v", err)
	}
	for _, p := range append(old, young) {
		if _, err := os.Lstat(p); err != nil {
			t.Fatalf("collect without the lock removed %s: %v", p, err)
		}
	}

	m, err := collectAt(context.Background(), noSync(), root, &jobs.CollectRequest{})
	if err != nil {
		t.Fatal(err)
	}
	slices.Sort(old)
	if got := m.Collect.Deleted; !slices.Equal(got, old) || m.Collect.TempRemoved != 2 || m.Collect.PagesKept != int64(len(res.Keys)) || m.Collect.BlocksDeleted != 0 {
		t.Fatalf("collect: deleted %v, %+v; want %v", got, m.Collect, old)
	}
	if _, err := os.Lstat(young); err != nil {
		t.Fatalf("young temp file: %v", err)
	}
	after := pageFiles(t, nsDir)
	delete(after, filepath.Base(young))
	if len(after) != len(before) {
		t.Fatalf("pages before %v, after %v", before, after)
	}
	for k, n := range before {
		if after[k] != n {
			t.Fatalf("page %s: %d bytes, was %d", k, after[k], n)
		}
	}
	bufs, dest := cv.dests(320)
	if r := loadPrefix(t, noSync(), nsDir, cv.tokens, dest, 64, true); r.Tokens != 300 {
		t.Fatalf("load after collect: %d tokens", r.Tokens)
	}
	cv.checkDest(t, bufs, 320, 300)
}
