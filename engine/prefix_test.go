package engine

import (
	"bytes"
	"context"
	"errors"
	"os"
	"path/filepath"
	"sync"
	"testing"

	"github.com/kvpersist/kvpersist/engine/gather"
	"github.com/kvpersist/kvpersist/engine/jobs"
	"github.com/kvpersist/kvpersist/engine/layout"
	"github.com/kvpersist/kvpersist/internal/kvgen"
	"github.com/kvpersist/kvpersist/internal/testutil"
	"golang.org/x/sys/unix"
)

// prefixTokens returns n token ids; conversations differ by seed.
func prefixTokens(n int, seed uint32) []uint32 {
	out := make([]uint32, n)
	for i := range out {
		out[i] = seed*100003 + uint32(i)
	}
	return out
}

// kvTensors is the K and V views of a testutil cache (the token ids
// attachment left out).
func kvTensors(c *kvgen.Cache) []jobs.TensorSpec {
	vs := c.Views()
	out := make([]jobs.TensorSpec, 2*c.Model.Layers)
	for i := range out {
		out[i] = jobs.TensorSpec{DType: c.Model.DType, View: vs[i]}
	}
	return out
}

// paddedDest allocates capacity-padded destinations of capT tokens (with
// alloc), filled with 0x5a.
func paddedDest(m kvgen.Model, capT int, alloc func(int) []byte) ([][]byte, []jobs.TensorSpec) {
	bufs := make([][]byte, 2*m.Layers)
	ts := make([]jobs.TensorSpec, len(bufs))
	for i := range bufs {
		bufs[i] = alloc(m.KVHeads * capT * m.HeadDim * m.ItemSize)
		for k := range bufs[i] {
			bufs[i][k] = 0x5a
		}
		ts[i] = jobs.TensorSpec{DType: m.DType, View: gather.View{
			Base: bufs[i], Shape: []int{1, m.KVHeads, capT, m.HeadDim},
			Strides: []int{m.KVHeads * capT * m.HeadDim, capT * m.HeadDim, m.HeadDim, 1}, ItemSize: m.ItemSize,
		}}
	}
	return bufs, ts
}

// checkLoaded asserts tokens [0, n) of every destination equal the cache's
// expected bytes (testutil.Expected, computed element by element) and every
// other byte is still 0x5a.
func checkLoaded(t *testing.T, c *kvgen.Cache, bufs [][]byte, capT, n int) {
	t.Helper()
	m := c.Model
	row := m.HeadDim * m.ItemSize
	for i, b := range bufs {
		want := c.Expected(i) // [1, heads, c.Tokens, dim]
		for h := range m.KVHeads {
			for tok := range capT {
				got := b[(h*capT+tok)*row:][:row]
				if tok < n {
					if exp := want[(h*c.Tokens+tok)*row:][:row]; !bytes.Equal(got, exp) {
						t.Fatalf("tensor %d head %d token %d differs", i, h, tok)
					}
				} else if !bytes.Equal(got, bytes.Repeat([]byte{0x5a}, row)) {
					t.Fatalf("tensor %d head %d token %d (past the %d loaded) was written", i, h, tok, n)
				}
			}
		}
	}
}

func TestEnginePrefixSaveLookupLoad(t *testing.T) {
	root := t.TempDir()
	e := newEngine(t, Config{Root: root, Workers: 2})
	m := kvgen.Tiny
	c, _ := cacheOf(m, 300, true)
	toks := prefixTokens(300, 1)
	res := mustDo(t, e, &SavePrefixRequest{Namespace: "p", Identity: "tiny", Tokens: toks, Tensors: kvTensors(c), PageTokens: 64})
	if res.Kind != KindSavePrefix || res.Prefix == nil || res.Prefix.PagesWritten != 5 || res.Ref.Namespace != "p" {
		t.Fatalf("save: %+v", res)
	}
	if st := e.Stats(); st.BytesWritten != res.Prefix.BytesWritten {
		t.Fatalf("stats %d bytes written, result %d", st.BytesWritten, res.Prefix.BytesWritten)
	}
	for _, tc := range []struct {
		prompt []uint32
		want   int
	}{
		{toks, 300}, {toks[:256], 256}, {toks[:290], 256}, {toks[:100], 64}, {prefixTokens(300, 2), 0},
	} {
		got, err := e.Lookup("p", "tiny", 64, tc.prompt)
		if err != nil || got != tc.want {
			t.Fatalf("Lookup of %d tokens: %d %v, want %d", len(tc.prompt), got, err, tc.want)
		}
		bufs, dest := paddedDest(m, 320, func(n int) []byte { return make([]byte, n) })
		r := mustDo(t, e, &LoadPrefixRequest{Namespace: "p", Identity: "tiny", Tokens: tc.prompt, Dest: dest, PageTokens: 64})
		if r.Kind != KindLoadPrefix || r.Prefix.Tokens != tc.want {
			t.Fatalf("load of %d tokens: %+v", len(tc.prompt), r.Prefix)
		}
		checkLoaded(t, c, bufs, 320, tc.want)
	}
	// A second engine on the same root builds its index from the disk.
	e2 := newEngine(t, Config{Root: root, Workers: 1})
	if got, _ := e2.Lookup("p", "tiny", 64, toks); got != 300 {
		t.Fatalf("rebuilt index: %d", got)
	}
	// A page removed behind the index's back: Lookup still says 300, the
	// load finds 128 without error, and the index learns it.
	keys, _, _ := layout.PageChain("tiny", 64, toks)
	if err := os.Remove(testutil.PagePath(filepath.Join(root, "p"), keys[2])); err != nil {
		t.Fatal(err)
	}
	if got, _ := e2.Lookup("p", "tiny", 64, toks); got != 300 {
		t.Fatalf("stale index: %d", got)
	}
	bufs, dest := paddedDest(m, 320, func(n int) []byte { return make([]byte, n) })
	r := mustDo(t, e2, &LoadPrefixRequest{Namespace: "p", Identity: "tiny", Tokens: toks, Dest: dest, PageTokens: 64})
	if r.Prefix.Tokens != 128 || r.Prefix.Missing == nil {
		t.Fatalf("load after removal: %+v", r.Prefix)
	}
	checkLoaded(t, c, bufs, 320, 128)
	if got, _ := e2.Lookup("p", "tiny", 64, toks); got != 128 {
		t.Fatalf("index after the miss: %d", got)
	}
	// Invalid requests fail at Submit.
	if _, err := e.Submit(bg, &SavePrefixRequest{Namespace: "../x", Identity: "tiny", Tokens: toks, Tensors: kvTensors(c)}); !errors.Is(err, ErrPath) {
		t.Fatalf("bad namespace: %v", err)
	}
	if _, err := e.Lookup("p", "", 64, toks); !errors.Is(err, layout.ErrIdentity) {
		t.Fatalf("Lookup without identity: %v", err)
	}
	if r := e.Do(bg, &SavePrefixRequest{Namespace: "p", Identity: "tiny", Tensors: kvTensors(c)}); !errors.Is(r.Err, jobs.ErrInvalidRequest) {
		t.Fatalf("save without tokens: %v", r.Err)
	}
}

// A collect of the namespace never runs beside a prefix job: it waits for
// an earlier save, and a later load waits for it.
func TestEnginePrefixOrderedAgainstCollect(t *testing.T) {
	h := installHook(t)
	e := newEngine(t, Config{Workers: 4})
	m := kvgen.Tiny
	c, _ := cacheOf(m, 128, true)
	toks := prefixTokens(128, 3)
	release := h.hold(t, "save-prefix p/")
	sj := mustSubmit(t, e, bg, &SavePrefixRequest{Namespace: "p", Identity: "tiny", Tokens: toks, Tensors: kvTensors(c), PageTokens: 64})
	h.await(t, "enter save-prefix p/", 1)
	cj := mustSubmit(t, e, bg, &CollectRequest{Namespaces: []string{"p"}})
	_, dest := paddedDest(m, 128, func(n int) []byte { return make([]byte, n) })
	lj := mustSubmit(t, e, bg, &LoadPrefixRequest{Namespace: "p", Identity: "tiny", Tokens: toks, Dest: dest, PageTokens: 64})
	// Another namespace's save is not held back.
	oj := mustSubmit(t, e, bg, &SavePrefixRequest{Namespace: "q", Identity: "tiny", Tokens: toks, Tensors: kvTensors(c), PageTokens: 64})
	ackOK(t, oj)
	if h.count("enter collect") != 0 {
		t.Fatal("collect started beside a save of its namespace")
	}
	release()
	ackOK(t, sj)
	ackOK(t, cj)
	l := ackOK(t, lj)
	h.before(t, "exit save-prefix p/", 1, "enter collect", 1)
	h.before(t, "exit collect", 1, "enter load-prefix p/", 1)
	if l.Prefix.Tokens != 128 {
		t.Fatalf("load after collect: %+v (collect must keep every page)", l.Prefix)
	}
}

// THE ACK INVARIANT for prefix jobs: every view of a save and every
// destination of a load is its own mapping, made PROT_NONE the moment the
// job's ack arrives; some jobs are cancelled. A later touch kills the test.
func TestEnginePrefixAckInvariant(t *testing.T) {
	a := newArena(t)
	e := newEngine(t, Config{Workers: 2, Mailbox: 4})
	m := kvgen.Tiny
	var wg sync.WaitGroup
	for g := range 4 {
		wg.Go(func() {
			for i := range 12 {
				toks := prefixTokens(100+40*(i%4), uint32(g%2))
				ctx, cancel := context.WithCancel(bg)
				r := &region{}
				var req Request
				if i%3 == 2 {
					_, dest := paddedDest(m, 256, func(n int) []byte { return a.alloc(r, n) })
					req = &LoadPrefixRequest{Namespace: "p", Identity: "tiny", Tokens: toks, Dest: dest, PageTokens: 32}
				} else {
					c := kvgen.NewCache(m, len(toks), true, func(n int) []byte { return a.alloc(r, n) })
					req = &SavePrefixRequest{Namespace: "p", Identity: "tiny", Tokens: toks, Tensors: kvTensors(c), PageTokens: 32}
				}
				j, err := e.Submit(ctx, req)
				if err != nil {
					t.Errorf("submit: %v", err)
					cancel()
					return
				}
				if i%5 == 4 {
					cancel()
				}
				res := <-j.Ack
				if err := r.protect(unix.PROT_NONE); err != nil {
					t.Errorf("protect: %v", err)
				}
				cancel()
				if res.Err != nil && !errors.Is(res.Err, context.Canceled) {
					t.Errorf("job %d: %v", res.ID, res.Err)
				}
			}
		})
	}
	wg.Wait()
}

// layout.Pages: a named save whose cache is stored as token pages shared
// with the prefix cache; resume by name and lookup by prompt find the same
// pages.
func TestEnginePagesLayout(t *testing.T) {
	root := t.TempDir()
	e := newEngine(t, Config{Root: root, Workers: 2})
	m := kvgen.Tiny
	const T = 300
	c, want := cacheOf(m, T, true)
	toks := prefixTokens(T, 9)
	ref := refOf("conv", "turn-1")
	req := writeReq(ref, c, layout.Pages, 0)
	req.Identity, req.Tokens, req.PageTokens = "tiny", toks, 64
	w := mustDo(t, e, req)
	if w.Metrics.BlocksWritten != 5 || w.Metrics.BlocksReused != 0 {
		t.Fatalf("pages write: %+v", w.Metrics)
	}
	snap, err := e.Stat(ref)
	if err != nil {
		t.Fatal(err)
	}
	keys, _, _ := layout.PageChain("tiny", 64, toks)
	if snap.Layout != layout.Pages || snap.Pages == nil || len(snap.Pages.Keys) != 5 || snap.Pages.Keys[4] != keys[4] || snap.Pages.Tokens != T {
		t.Fatalf("manifest: layout %v pages %+v", snap.Layout, snap.Pages)
	}
	if id, ok := snap.Header.Identity(); !ok || id != "tiny" {
		t.Fatalf("identity %q", id)
	}
	// Resume by name: every slot (the token ids attachment too) reads back.
	dest := destOf(m, T)
	mustDo(t, e, &ReadRequest{Ref: ref, Dest: dest, Identity: "tiny"})
	equalSlots(t, "pages read", dest, want)
	// The prefix cache sees the same pages.
	if n, _ := e.Lookup("conv", "tiny", 64, toks); n != T {
		t.Fatalf("lookup after a named save: %d", n)
	}
	s := mustDo(t, e, &SavePrefixRequest{Namespace: "conv", Identity: "tiny", Tokens: toks, Tensors: kvTensors(c), PageTokens: 64})
	if s.Prefix.PagesWritten != 0 || s.Prefix.PagesReused != 5 {
		t.Fatalf("prefix save after a named save: %+v", s.Prefix)
	}
	bufs, pd := paddedDest(m, 320, func(n int) []byte { return make([]byte, n) })
	if r := mustDo(t, e, &LoadPrefixRequest{Namespace: "conv", Identity: "tiny", Tokens: toks, Dest: pd, PageTokens: 64}); r.Prefix.Tokens != T {
		t.Fatalf("prefix load: %+v", r.Prefix)
	}
	checkLoaded(t, c, bufs, 320, T)
	// Collect keeps the pages; the snapshot still reads back.
	mustDo(t, e, &CollectRequest{Namespaces: []string{"conv"}})
	dest = destOf(m, T)
	mustDo(t, e, &ReadRequest{Ref: ref, Dest: dest})
	equalSlots(t, "pages read after collect", dest, want)
	// A page gone: every cache slot fails with ErrMissingPage; the
	// attachment is still read.
	if err := os.Remove(testutil.PagePath(filepath.Join(root, "conv"), keys[3])); err != nil {
		t.Fatal(err)
	}
	dest = destOf(m, T)
	r := e.Do(bg, &ReadRequest{Ref: ref, Dest: dest})
	var re *jobs.ReadError
	if !errors.As(r.Err, &re) || !errors.Is(r.Err, jobs.ErrMissingPage) || len(re.Slots) != 2*m.Layers {
		t.Fatalf("read with a page missing: %v", r.Err)
	}
	if last := len(dest) - 1; !bytes.Equal(dest[last], want[last]) {
		t.Fatal("the attachment was not read")
	}
	// Invalid pages writes.
	for name, edit := range map[string]func(*WriteRequest){
		"no identity": func(r *WriteRequest) { r.Identity = "" },
		"no tokens":   func(r *WriteRequest) { r.Tokens = nil },
		"token count": func(r *WriteRequest) { r.Tokens = toks[:T-1] },
		"page size":   func(r *WriteRequest) { r.PageTokens = 100 },
	} {
		bad := writeReq(refOf("conv", "bad"), c, layout.Pages, 0)
		bad.Identity, bad.Tokens, bad.PageTokens = "tiny", toks, 64
		edit(bad)
		if r := e.Do(bg, bad); !errors.Is(r.Err, jobs.ErrInvalidRequest) {
			t.Fatalf("%s: %v", name, r.Err)
		}
	}
}

// TestEnginePrefixSymlinkedNamespace: a prefix save or load whose
// namespace directory is a symlink (it could lead outside the root) is
// accepted at Submit (the name is valid) and acked with ErrPath, nothing
// written through the link.
func TestEnginePrefixSymlinkedNamespace(t *testing.T) {
	e := newEngine(t, Config{Workers: 1})
	m := kvgen.Tiny
	c, _ := cacheOf(m, 128, false)
	toks := prefixTokens(128, 7)
	outside := t.TempDir()
	if err := os.Symlink(outside, filepath.Join(e.Root(), "link")); err != nil {
		t.Fatal(err)
	}
	bg := context.Background()
	if r := e.Do(bg, &SavePrefixRequest{Namespace: "link", Identity: "tiny", Tokens: toks, Tensors: kvTensors(c), PageTokens: 64}); !errors.Is(r.Err, ErrPath) {
		t.Fatalf("save into a symlinked namespace: %v, want ErrPath", r.Err)
	}
	bufs, dest := paddedDest(m, 128, func(n int) []byte { return make([]byte, n) })
	if r := e.Do(bg, &LoadPrefixRequest{Namespace: "link", Identity: "tiny", Tokens: toks, Dest: dest, PageTokens: 64}); !errors.Is(r.Err, ErrPath) {
		t.Fatalf("load from a symlinked namespace: %v, want ErrPath", r.Err)
	}
	checkLoaded(t, c, bufs, 128, 0)
	if ents, err := os.ReadDir(outside); err != nil || len(ents) != 0 {
		t.Fatalf("the link's target holds %d entries (%v), want none", len(ents), err)
	}
}
