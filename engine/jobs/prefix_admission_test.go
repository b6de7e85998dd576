package jobs_test

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"slices"
	"testing"

	"github.com/kvpersist/kvpersist/engine/jobs"
	"github.com/kvpersist/kvpersist/engine/layout"
	"github.com/kvpersist/kvpersist/engine/store"
)

// recordAdmission is a jobs.Admission that records what a save told it
// and answers err.
type recordAdmission struct {
	calls         int
	ns            string
	keys, parents []layout.PageKey
	fileBytes     []int64
	nsExisted     bool // the namespace directory existed when Admit ran
	err           error
	unconfirmed   int // Confirm reports false this many times
	confirms      int
}

func (a *recordAdmission) Confirm(*store.Namespace) bool {
	a.confirms++
	return a.confirms > a.unconfirmed
}

func (a *recordAdmission) Admit(_ context.Context, ns *store.Namespace, keys, parents []layout.PageKey, fileBytes []int64) error {
	a.calls++
	a.ns = ns.Name()
	a.keys, a.parents, a.fileBytes = keys, parents, fileBytes
	_, err := os.Lstat(ns.Dir())
	a.nsExisted = err == nil
	return a.err
}

// A save tells its Admission, once and before the namespace exists, the
// keys, parents and file lengths of exactly the page files it then
// writes (the page cache reserves from them); an Admission's error fails
// the save with nothing created; a request the save refuses is refused
// before the Admission is asked.
func TestPrefixSaveAdmission(t *testing.T) {
	ctx := context.Background()
	ns := filepath.Join(t.TempDir(), "ns")
	const n, p = 600, 256 // two full pages and a leaf of 88 tokens
	c := newConv(seqTokens(n, 11), pTensors, pHeads, pDim, 768)
	req := &jobs.SavePrefixRequest{Identity: "tiny/bf16", Tokens: c.tokens, Tensors: c.views(n), PageTokens: p}

	refused := &recordAdmission{err: errors.New("no room")}
	cfg := *noSync()
	cfg.Admission = refused
	if _, _, err := savePrefixAt(ctx, &cfg, ns, req); !errors.Is(err, refused.err) {
		t.Fatalf("save refused by its admission: %v", err)
	}
	if _, err := os.Lstat(ns); !os.IsNotExist(err) || refused.calls != 1 || refused.nsExisted {
		t.Fatalf("after a refused admission: namespace %v, %d calls, existed at Admit: %v", err, refused.calls, refused.nsExisted)
	}

	adm := &recordAdmission{}
	cfg.Admission = adm
	res, _, err := savePrefixAt(ctx, &cfg, ns, req)
	if err != nil {
		t.Fatal(err)
	}
	keys, _, _ := layout.PageChain("tiny/bf16", p, c.tokens)
	if adm.calls != 1 || adm.ns != "ns" || !slices.Equal(adm.keys, keys) || !slices.Equal(res.Keys, keys) ||
		adm.parents[0] != layout.PageRoot("tiny/bf16", p) || adm.parents[1] != keys[0] || adm.parents[2] != keys[1] {
		t.Fatalf("admission: %d calls, namespace %q, keys %v, parents %v", adm.calls, adm.ns, adm.keys, adm.parents)
	}
	files := pageFiles(t, ns)
	for i, k := range keys {
		if adm.fileBytes[i] != files[k.String()] {
			t.Fatalf("page %d: admitted %d bytes, the file has %d", i, adm.fileBytes[i], files[k.String()])
		}
	}
	for name, r := range map[string]*jobs.SavePrefixRequest{
		"no tokens":  {Identity: "x", Tensors: c.views(0)},
		"identity":   {Tokens: c.tokens, Tensors: c.views(n)},
		"page size":  {Identity: "x", Tokens: c.tokens, Tensors: c.views(n), PageTokens: 48},
		"few tokens": {Identity: "x", Tokens: c.tokens, Tensors: c.views(n - 1)},
	} {
		before := adm.calls
		if _, _, err := savePrefixAt(ctx, &cfg, ns, r); !errors.Is(err, jobs.ErrInvalidRequest) || adm.calls != before {
			t.Fatalf("%s: %v, admission asked %d times", name, err, adm.calls-before)
		}
	}
}

// A save whose admission is not confirmed under the namespace's lock (a
// page it found stored was evicted meanwhile) admits again and confirms
// again, up to 4 admissions; then it goes on unconfirmed. Either way it
// writes every page.
func TestPrefixSaveAdmitsAgainUntilConfirmed(t *testing.T) {
	ctx := context.Background()
	const n, p = 600, 256
	c := newConv(seqTokens(n, 11), pTensors, pHeads, pDim, 768)
	req := &jobs.SavePrefixRequest{Identity: "tiny/bf16", Tokens: c.tokens, Tensors: c.views(n), PageTokens: p}
	keys, _, _ := layout.PageChain("tiny/bf16", p, c.tokens)
	for _, tc := range []struct{ unconfirmed, admits, confirms int }{
		{0, 1, 1}, {2, 3, 3}, {10, 4, 3},
	} {
		ns := filepath.Join(t.TempDir(), "ns")
		adm := &recordAdmission{unconfirmed: tc.unconfirmed}
		cfg := *noSync()
		cfg.Admission = adm
		res, _, err := savePrefixAt(ctx, &cfg, ns, req)
		if err != nil {
			t.Fatal(err)
		}
		if adm.calls != tc.admits || adm.confirms != tc.confirms || !slices.Equal(adm.keys, keys) {
			t.Fatalf("%d unconfirmed: %d admissions, %d confirmations, keys %v; want %d, %d, %v", tc.unconfirmed, adm.calls, adm.confirms, adm.keys, tc.admits, tc.confirms, keys)
		}
		if files := pageFiles(t, ns); res.PagesWritten != len(keys) || len(files) != len(keys) {
			t.Fatalf("%d unconfirmed: %d pages written, %d files; want %d", tc.unconfirmed, res.PagesWritten, len(files), len(keys))
		}
	}
}
