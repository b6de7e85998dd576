package layout_test

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"testing"

	"github.com/kvpersist/kvpersist/engine/gather"
	"github.com/kvpersist/kvpersist/engine/jobs"
	"github.com/kvpersist/kvpersist/engine/layout"
	"github.com/kvpersist/kvpersist/engine/vfs"
	"github.com/kvpersist/kvpersist/internal/testutil"
)

// seedPage saves a leaf page of 20 tokens (P = 16: one full page and a
// leaf of 4) of two small tensors with jobs.SavePrefix and returns the
// leaf's file bytes and its decoded snapshot.
func seedPage(tb testing.TB, dir string) ([]byte, *layout.Snapshot) {
	tb.Helper()
	toks := vecTokens()[:20]
	buf := make([]byte, 2*20*8*2)
	for i := range buf {
		buf[i] = byte(i * 7)
	}
	v := func(off int) gather.View {
		return gather.View{Base: buf, Offset: off, Shape: []int{2, 20, 8}, Strides: []int{160, 8, 1}, ItemSize: 2}
	}
	ns := filepath.Join(dir, "ns")
	res, _, err := jobs.SavePrefix(context.Background(), &jobs.Config{NoSync: true, Root: dir}, &jobs.SavePrefixRequest{
		Namespace: "ns", Identity: vecIdentity, Tokens: toks, PageTokens: vecP,
		Tensors: []jobs.TensorSpec{{DType: "bfloat16", View: v(0)}, {DType: "float16", View: v(0)}},
	})
	if err != nil {
		tb.Fatal(err)
	}
	path := testutil.PagePath(ns, res.Keys[1])
	raw, err := os.ReadFile(path)
	if err != nil {
		tb.Fatal(err)
	}
	snap, err := layout.Load(vfs.Default, path)
	if err != nil {
		tb.Fatal(err)
	}
	return raw, snap
}

// The page file written by SavePrefix decodes to the documented fields.
func TestPageFileDecodes(t *testing.T) {
	_, snap := seedPage(t, t.TempDir())
	pg := snap.Page
	hand := handChain(vecIdentity, vecP, vecTokens()[:20])
	if pg == nil || pg.Key.String() != hand[2] || pg.Parent.String() != vecK1 || pg.Identity != vecIdentity || pg.PageTokens != vecP || len(pg.Tokens) != 4 || pg.Tokens[0] != 1016 || !pg.Leaf() {
		t.Fatalf("page %+v", pg)
	}
	if snap.Layout != layout.Single || snap.Header.FormatVersion != layout.FormatPage || len(snap.Header.Meta) != 0 {
		t.Fatalf("snapshot: layout %v version %d meta %v", snap.Layout, snap.Header.FormatVersion, snap.Header.Meta)
	}
	ts := snap.Header.Caches[0].Tensors
	if len(ts) != 2 || ts[0].Shape[1] != 4 || ts[1].DType != "float16" || ts[1].Off != layout.TensorAlign {
		t.Fatalf("tensors %+v", ts)
	}
}

// FuzzPageHeader: any header JSON in a page file's place either fails to
// decode with a documented sentinel, or decodes to a page whose key is the
// chain step of its parent and tokens and whose tensors hold its tokens on
// axis -2.
func FuzzPageHeader(f *testing.F) {
	raw, snap := seedPage(f, f.TempDir())
	data := raw[snap.DataStart:]
	f.Add(snap.JSON)
	f.Add([]byte(`{"page":{"key":"x"},"caches":[],"formatVersion":6}`))
	f.Add([]byte(`{"page":null,"caches":[{"tensors":[]}],"formatVersion":6}`))
	f.Fuzz(func(t *testing.T, js []byte) {
		if len(js) > 1<<16 {
			return
		}
		ds := layout.AlignUp(int64(layout.PrefixLen+len(js)), layout.DataAlign)
		file := append(layout.EncodePrefix(js, uint32(ds)), data...)
		s, _, err := decodeMem(file)
		if err != nil {
			for _, e := range decodeSentinels {
				if errors.Is(err, e) {
					return
				}
			}
			t.Fatalf("undocumented error %v", err)
		}
		if s.Header.FormatVersion != layout.FormatPage {
			return // a valid snapshot of another version
		}
		pg := s.Page
		if pg == nil {
			t.Fatal("a page file decoded without its page")
		}
		if err := pg.Check(); err != nil || layout.PageNext(pg.Parent, pg.Tokens) != pg.Key {
			t.Fatalf("decoded page fails its own check: %v", err)
		}
		for i, tt := range s.Header.Caches[0].Tensors {
			if len(tt.Shape) < 2 || tt.Shape[len(tt.Shape)-2] != int64(len(pg.Tokens)) {
				t.Fatalf("tensor %d shape %v, page of %d tokens", i, tt.Shape, len(pg.Tokens))
			}
		}
	})
}
