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
