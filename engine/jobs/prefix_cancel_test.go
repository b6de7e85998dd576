package jobs_test

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/kvpersist/kvpersist/engine/jobs"
	"github.com/kvpersist/kvpersist/engine/vfs"
	"github.com/kvpersist/kvpersist/internal/testutil"
)

// cancelFS cancels a context when a given path is lstat'ed, and holds
// every rename into pages/ until that context is done.
type cancelFS struct {
	vfs.FS
	ctx    context.Context
	cancel context.CancelFunc
	at     string
}

func (f *cancelFS) Lstat(name string) (os.FileInfo, error) {
	if name == f.at {
		f.cancel()
	}
	return f.FS.Lstat(name)
}

func (f *cancelFS) Rename(oldname, newname string) error {
	if strings.Contains(newname, string(filepath.Separator)+"pages"+string(filepath.Separator)) {
		<-f.ctx.Done()
	}
	return f.FS.Rename(oldname, newname)
}

// TestSavePrefixCancelledAfterLastPage: a save whose context ends after its
// last page was handed to the syncers, while some of its new pages still
// wait there, must not succeed: those pages are dropped (never renamed
// in). The syncers skip them without an error of their own; a store that
// syncs then fails in its final directory fsyncs (ctx's error), but a
// NoSync store skipped those and acked a save whose pages were missing.
func TestSavePrefixCancelledAfterLastPage(t *testing.T) {
	const p, pages = 16, 34 // more new pages than the 32 syncers, then a reused one
	ns := filepath.Join(t.TempDir(), "ns")
	c := newConv(seqTokens(pages*p, 31), pTensors, pHeads, pDim, pages*p)
	first := savePrefix(t, noSync(), ns, c, pages*p, p)
	for _, k := range first.Keys[:pages-1] {
		if err := os.Remove(testutil.PagePath(ns, k)); err != nil {
			t.Fatal(err)
		}
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	fsys := &cancelFS{FS: vfs.Default, ctx: ctx, cancel: cancel, at: testutil.PagePath(ns, first.Keys[pages-1])}
	res, _, err := savePrefixAt(ctx, &jobs.Config{FS: fsys, NoSync: true}, ns, &jobs.SavePrefixRequest{
		Identity: "tiny/bf16", Tokens: c.tokens[:pages*p], Tensors: c.views(pages * p), PageTokens: p,
	})
	var missing int
	for _, k := range first.Keys {
		if _, serr := os.Lstat(testutil.PagePath(ns, k)); serr != nil {
			missing++
		}
	}
	if err == nil && missing > 0 {
		t.Fatalf("save acked (%d written, %d reused) with %d of its %d pages missing", res.PagesWritten, res.PagesReused, missing, pages)
	}
	if err != nil && !errors.Is(err, context.Canceled) {
		t.Fatalf("cancelled save: %v, want context.Canceled", err)
	}
	if missing == 0 {
		t.Fatal("every page was published: the test did not reach the case it is for")
	}
}
