package jobs_test

import (
	"context"
	"errors"
	"path/filepath"
	"syscall"
	"testing"

	"github.com/kvpersist/kvpersist/engine/jobs"
	"github.com/kvpersist/kvpersist/engine/pageindex"
	"github.com/kvpersist/kvpersist/engine/vfs"
	"github.com/kvpersist/kvpersist/internal/testutil"
)

// TestPrefixGrownSaveTouchesOnlyItsNewPage: a save of a conversation
// grown by one page, whose stored pages this process made durable
// (Config.Durable), neither opens nor reads any of them (one lstat of
// each: it is still there, and the same file) and fsyncs only what it
// wrote: the new page's file, its fan-out directory, pages/, the
// namespace directory and the root, each once. Without marks (another
// process's pages, a fresh engine), or with marks from a save of another
// tensor layout, every reused page's header is read as before.
func TestPrefixGrownSaveTouchesOnlyItsNewPage(t *testing.T) {
	const p, base = 64, 8
	ns := filepath.Join(t.TempDir(), "ns")
	ffs := testutil.NewFaultFS(nil)
	cfg := &jobs.Config{FS: ffs, Durable: pageindex.New()}
	c := newConv(seqTokens((base+1)*p, 41), pTensors, pHeads, pDim, (base+1)*p)
	first := savePrefix(t, cfg, ns, c, base*p, p)

	ffs.Reset()
	res := savePrefix(t, cfg, ns, c, (base+1)*p, p)
	if res.PagesWritten != 1 || res.PagesReused != base {
		t.Fatalf("grown save: %d pages written, %d reused; want 1 and %d", res.PagesWritten, res.PagesReused, base)
	}
	if n, r := ffs.Count(testutil.OpOpen), ffs.Count(testutil.OpReadAt); n != 0 || r != 0 {
		t.Fatalf("grown save opened %d files and read %d times; its stored pages are known durable", n, r)
	}
	for i, k := range first.Keys {
		if n := ffs.CountPath(testutil.OpLstat, testutil.PagePath(ns, k)); n != 1 {
			t.Fatalf("stored page %d lstat'ed %d times, want 1", i, n)
		}
	}
	if n := ffs.Count(testutil.OpSync); n != 1 {
		t.Fatalf("grown save fsynced %d files, want 1 (its new page)", n)
	}
	newDir := filepath.Dir(testutil.PagePath(ns, res.Keys[base]))
	dirs := []string{newDir, testutil.PagesDir(ns), ns, filepath.Dir(ns)}
	for _, d := range dirs {
		if n := ffs.CountPath(testutil.OpSyncDir, d); n != 1 {
			t.Fatalf("directory %s fsynced %d times, want 1", d, n)
		}
	}
	if n := ffs.Count(testutil.OpSyncDir); n != len(dirs) {
		t.Fatalf("grown save fsynced %d directories, want %d: %v", n, len(dirs), dirs)
	}

	// Without marks: each stored page's header is read once.
	fresh := &jobs.Config{FS: ffs, Durable: pageindex.New()}
	ffs.Reset()
	res = savePrefix(t, fresh, ns, c, (base+1)*p, p)
	if res.PagesReused != base+1 || ffs.Count(testutil.OpOpen) != base+1 {
		t.Fatalf("save without marks: %d reused, %d files opened; want %d and %d", res.PagesReused, ffs.Count(testutil.OpOpen), base+1, base+1)
	}

	// Marks of another layout of the same header length (float16 in
	// another tensor): each page is read, found unlike this save's, and
	// replaced; then known.
	saveF16 := func(tensor int) *jobs.PrefixResult {
		ts := c.views((base + 1) * p)
		ts[tensor].DType = "float16"
		r, _, err := savePrefixAt(context.Background(), cfg, ns, &jobs.SavePrefixRequest{
			Identity: "tiny/bf16", Tokens: c.tokens[:(base+1)*p], Tensors: ts, PageTokens: p,
		})
		if err != nil {
			t.Fatal(err)
		}
		return r
	}
	if r := saveF16(0); r.PagesReplaced != base+1 {
		t.Fatalf("save with tensor 0 in float16: %d pages replaced, want %d", r.PagesReplaced, base+1)
	}
	ffs.Reset()
	if r := saveF16(1); r.PagesReplaced != base+1 || ffs.Count(testutil.OpOpen) != base+1 {
		t.Fatalf("save with tensor 1 in float16 over marks of tensor 0's: %d replaced, %d files opened; want %d and %d", r.PagesReplaced, ffs.Count(testutil.OpOpen), base+1, base+1)
	}
	ffs.Reset()
	if r := saveF16(1); r.PagesReused != base+1 || ffs.Count(testutil.OpOpen) != 0 || ffs.Count(testutil.OpSync) != 0 {
		t.Fatalf("the same save again: %d reused, %d files opened, %d fsynced; want %d, 0, 0", r.PagesReused, ffs.Count(testutil.OpOpen), ffs.Count(testutil.OpSync), base+1)
	}
}

// TestPrefixPageHeadsFromTemplate: a page save plans one page of each
// token count fully and the others' headers from it; every page's header,
// data start, size and tensor bytes equal its own full plan's (full
// pages and a leaf; token ids of different widths in JSON).
func TestPrefixPageHeadsFromTemplate(t *testing.T) {
	for _, n := range []int{64, 100, 5*64 + 17, 8 * 64} {
		c := newConv(seqTokens(n, 43), pTensors, pHeads, pDim, n)
		toks := c.tokens[:n]
		toks[0], toks[n-1] = 7, 4_000_000_000 // header lengths differ between pages
		differs, full, err := jobs.PlanPageHeads(t.TempDir(), "ns", "tiny/bf16", 64, toks, c.views(n))
		if err != nil {
			t.Fatal(err)
		}
		if differs >= 0 {
			t.Fatalf("%d tokens: page %d's header planned from its template differs from its full plan", n, differs)
		}
		counts := 1
		if n > 64 && n%64 != 0 {
			counts = 2
		}
		if full != counts {
			t.Fatalf("%d tokens: %d pages planned fully, want %d (one per token count)", n, full, counts)
		}
	}
}

// TestPrefixSaveSyncsRootLast: a prefix save fsyncs the root with its
// other directories at the end, after its pages are written, not before
// (a serial fsync less before the first write); a root that cannot be
// fsynced fails the save, and leaves no page marked durable.
func TestPrefixSaveSyncsRootLast(t *testing.T) {
	const p = 64
	root := t.TempDir()
	ns := filepath.Join(root, "ns")
	ffs := testutil.NewFaultFS(nil)
	marks := pageindex.New()
	cfg := &jobs.Config{FS: ffs, Durable: marks}
	c := newConv(seqTokens(3*p, 47), pTensors, pHeads, pDim, 3*p)
	savePrefix(t, cfg, ns, c, p, p)
	ffs.Inject(testutil.Fault{Op: testutil.OpSyncDir, Glob: filepath.Base(root)})
	res, _, err := savePrefixAt(context.Background(), cfg, ns, &jobs.SavePrefixRequest{
		Identity: "tiny/bf16", Tokens: c.tokens[:3*p], Tensors: c.views(3 * p), PageTokens: p,
	})
	if !errors.Is(err, syscall.EIO) {
		t.Fatalf("save with the root's fsync failing: %v, want EIO", err)
	}
	if res == nil || res.PagesWritten != 2 {
		t.Fatalf("save with the root's fsync failing: %+v; want its 2 new pages written before the root's fsync", res)
	}
	for i, k := range res.Keys {
		if id := marks.DurableID("ns", k); i > 0 && id != (vfs.FileID{}) {
			t.Fatalf("page %d marked durable by a save that failed", i)
		}
	}
}
