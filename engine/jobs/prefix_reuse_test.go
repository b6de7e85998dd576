package jobs_test

import (
	"bytes"
	"context"
	"os"
	"path/filepath"
	"testing"

	"github.com/kvpersist/kvpersist/engine/jobs"
	"github.com/kvpersist/kvpersist/engine/layout"
	"github.com/kvpersist/kvpersist/engine/vfs"
	"github.com/kvpersist/kvpersist/internal/testutil"
)

// A file under a page's name that is not that page, but has the page's
// size, is not reused by a save: it is rewritten (PagesReplaced), and the
// page then decodes, is what its name says and loads verified. Cases: the
// header zeroed (a torn or wiped file), one byte of the header JSON
// changed (its header hash fails), another page of the same size copied
// under the name (a valid header with another key), and a stored page of
// another dtype under the same identity (valid, the right key, but not
// the header this save would write). A page whose data alone is corrupt
// keeps a valid header and is reused: a verified load finds it.
func TestPrefixSaveReplacesWrongPageFiles(t *testing.T) {
	cases := map[string]func(t *testing.T, path, other string){
		"zeroed header": func(t *testing.T, path, _ string) {
			overwrite(t, path, 0, make([]byte, 4096))
		},
		"header byte": func(t *testing.T, path, _ string) {
			b := fileBytesAt(t, path, layout.PrefixLen+10, 1)
			overwrite(t, path, layout.PrefixLen+10, []byte{b[0] ^ 1})
		},
		"another page": func(t *testing.T, path, other string) {
			raw, err := os.ReadFile(other)
			if err != nil {
				t.Fatal(err)
			}
			if err := os.WriteFile(path, raw, 0o640); err != nil {
				t.Fatal(err)
			}
		},
	}
	for name, spoil := range cases {
		t.Run(name, func(t *testing.T) {
			ns := filepath.Join(t.TempDir(), "ns")
			c := newConv(seqTokens(600, 21), pTensors, pHeads, pDim, 768)
			first := savePrefix(t, noSync(), ns, c, 600, 256)
			path := testutil.PagePath(ns, first.Keys[1])
			before, err := os.Stat(path)
			if err != nil {
				t.Fatal(err)
			}
			spoil(t, path, testutil.PagePath(ns, first.Keys[0]))
			if fi, err := os.Stat(path); err != nil || fi.Size() != before.Size() {
				t.Fatalf("the spoiled page must keep its size: %v %v", fi, err)
			}
			res := savePrefix(t, noSync(), ns, c, 600, 256)
			if res.PagesWritten != 1 || res.PagesReplaced != 1 || res.PagesReused != 2 || res.BytesWritten != before.Size() {
				t.Fatalf("second save: %+v; want page 1 (%d bytes) replaced, the others reused", res, before.Size())
			}
			f, err := vfs.Default.Open(path)
			if err != nil {
				t.Fatal(err)
			}
			snap, err := layout.Decode(f, path)
			f.Close()
			if err != nil || snap.Page.Key != first.Keys[1] {
				t.Fatalf("rewritten page: %v", err)
			}
			bufs, dest := c.dests(768)
			lr := loadPrefix(t, noSync(), ns, c.tokens, dest, 256, true)
			if lr.Tokens != 600 || lr.Stop != nil {
				t.Fatalf("load after the repair: %d tokens, stop %v", lr.Tokens, lr.Stop)
			}
			c.checkDest(t, bufs, 768, 600)
		})
	}
	t.Run("another dtype", func(t *testing.T) {
		ns := filepath.Join(t.TempDir(), "ns")
		c := newConv(seqTokens(512, 22), pTensors, pHeads, pDim, 768)
		savePrefix(t, noSync(), ns, c, 512, 256)
		views := c.views(512)
		for i := range views {
			views[i].DType = "float16" // same itemsize, so the same file size
		}
		res, _, err := savePrefixAt(context.Background(), noSync(), ns, &jobs.SavePrefixRequest{Identity: "tiny/bf16", Tokens: c.tokens[:512], Tensors: views, PageTokens: 256})
		if err != nil {
			t.Fatal(err)
		}
		if res.PagesWritten != 2 || res.PagesReplaced != 2 || res.PagesReused != 0 {
			t.Fatalf("save of other dtypes over the stored pages: %+v", res)
		}
	})
	t.Run("data only", func(t *testing.T) {
		ns := filepath.Join(t.TempDir(), "ns")
		c := newConv(seqTokens(512, 23), pTensors, pHeads, pDim, 768)
		first := savePrefix(t, noSync(), ns, c, 512, 256)
		path := testutil.PagePath(ns, first.Keys[1])
		fi, err := os.Stat(path)
		if err != nil {
			t.Fatal(err)
		}
		b := fileBytesAt(t, path, fi.Size()-1, 1)
		overwrite(t, path, fi.Size()-1, []byte{b[0] ^ 0xff})
		if res := savePrefix(t, noSync(), ns, c, 512, 256); res.PagesReused != 2 || res.PagesWritten != 0 {
			t.Fatalf("a page with a valid header is reused: %+v", res)
		}
	})
}

func fileBytesAt(t *testing.T, path string, off int64, n int) []byte {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	b := make([]byte, n)
	if _, err := f.ReadAt(b, off); err != nil {
		t.Fatal(err)
	}
	return b
}

func overwrite(t *testing.T, path string, off int64, b []byte) {
	t.Helper()
	f, err := os.OpenFile(path, os.O_WRONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if _, err := f.WriteAt(b, off); err != nil {
		t.Fatal(err)
	}
	if got := fileBytesAt(t, path, off, len(b)); !bytes.Equal(got, b) {
		t.Fatal("overwrite did not take")
	}
}
