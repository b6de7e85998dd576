package store_test

import (
	"context"
	"os"
	"path/filepath"
	"syscall"
	"testing"
	"time"

	"github.com/kvpersist/kvpersist/engine/jobs"
	"github.com/kvpersist/kvpersist/engine/layout"
	"github.com/kvpersist/kvpersist/engine/recency"
	"github.com/kvpersist/kvpersist/engine/store"
	"github.com/kvpersist/kvpersist/internal/kvgen"
)

// TestCacheStatsRecency: Listing.CacheStats counts a namespace's pages as
// the engine accounts them (allocated bytes = st_blocks × 512 from
// stat(2), tokens, tensor bytes, temp files apart), and their last access
// as the engine rebuilds it at start: the mtime, moved forward (never
// back) to the checkpoint's record, clamped to now.
func TestCacheStatsRecency(t *testing.T) {
	root := t.TempDir()
	nsDir := filepath.Join(root, "ns")
	m := kvgen.Tiny
	c := kvgen.NewCache(m, 100, true, nil)
	views := c.ViewsAt(100)
	tensors := make([]jobs.TensorSpec, 2*m.Layers)
	for i := range tensors {
		tensors[i] = jobs.TensorSpec{DType: m.DType, View: views[i]}
	}
	toks := make([]uint32, 100)
	for i := range toks {
		toks[i] = uint32(7 + i)
	}
	if err := os.MkdirAll(nsDir, 0o750); err != nil {
		t.Fatal(err)
	}
	res, _, err := jobs.SavePrefix(context.Background(), &jobs.Config{NoSync: true, Root: root},
		&jobs.SavePrefixRequest{Namespace: "ns", Identity: "id", Tokens: toks, Tensors: tensors, PageTokens: 16})
	if err != nil {
		t.Fatal(err)
	}
	keys := res.Keys // 6 full pages and a leaf of 4 tokens
	if len(keys) != 7 {
		t.Fatalf("%d keys", len(keys))
	}
	st := store.At(root, store.Options{})
	ns, err := st.Namespace("ns")
	if err != nil {
		t.Fatal(err)
	}
	base := time.Date(2026, 11, 1, 0, 0, 0, 0, time.UTC)
	var alloc int64
	for i, k := range keys {
		p := ns.PagePath(k)
		at := base.Add(time.Duration(i) * time.Hour)
		if err := os.Chtimes(p, at, at); err != nil {
			t.Fatal(err)
		}
		var sb syscall.Stat_t
		if err := syscall.Stat(p, &sb); err != nil {
			t.Fatal(err)
		}
		alloc += sb.Blocks * 512
	}
	tmp := layout.TempPath(ns.PagePath(keys[0]))
	if err := os.WriteFile(tmp, make([]byte, 5000), 0o640); err != nil {
		t.Fatal(err)
	}
	l, err := ns.List(false)
	if err != nil {
		t.Fatal(err)
	}
	l.DecodePages()
	now := base.Add(100 * time.Hour)

	s := l.CacheStats(nil, now)
	if s.Pages != 7 || s.Unreadable != 0 || s.AllocatedBytes != alloc || s.Tokens != 100 || s.LogicalBytes != 100*int64(2*m.Layers*m.TensorBytes(1)) ||
		s.TempFiles != 1 || s.TempAllocatedBytes < 5000 || s.CheckpointPages != 0 {
		t.Fatalf("stats %+v; want 7 pages, %d allocated bytes, 100 tokens, one temp file", s, alloc)
	}
	if !s.OldestAccess.Equal(base) || !s.NewestAccess.Equal(base.Add(6*time.Hour)) {
		t.Fatalf("access %v to %v; want the mtimes %v to %v", s.OldestAccess, s.NewestAccess, base, base.Add(6*time.Hour))
	}

	// The checkpoint: page 0 accessed later than every mtime, page 6 in
	// the future (clamped to now), page 3 before its mtime (ignored), and
	// a page that is gone.
	rec := func(k layout.PageKey, at time.Time) recency.Record {
		return recency.Record{Key: k, Access: at.UnixNano()}
	}
	recs := []recency.Record{rec(keys[0], base.Add(50*time.Hour)), rec(keys[3], base.Add(-time.Hour)),
		rec(keys[6], base.Add(1000*time.Hour)), {Key: layout.PageKey{1}, Access: base.UnixNano()}}
	s = l.CacheStats(recs, now)
	if s.CheckpointPages != 3 || !s.OldestAccess.Equal(base.Add(time.Hour)) || !s.NewestAccess.Equal(now) {
		t.Fatalf("with a checkpoint: %d pages from it, access %v to %v; want 3, %v to %v", s.CheckpointPages, s.OldestAccess, s.NewestAccess, base.Add(time.Hour), now)
	}
}
