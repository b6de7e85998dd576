package jobs_test

import (
	"errors"
	"path/filepath"
	"testing"

	"github.com/kvpersist/kvpersist/engine/jobs"
	"github.com/kvpersist/kvpersist/engine/layout"
)

// PlanPrefixSave gives the keys, parents and file lengths of exactly the
// page files SavePrefix writes (the page cache reserves from them before
// any file exists), and refuses what SavePrefix refuses.
func TestPlanPrefixSaveFileBytes(t *testing.T) {
	ns := filepath.Join(t.TempDir(), "ns")
	const n, p = 600, 256 // two full pages and a leaf of 88 tokens
	c := newConv(seqTokens(n, 11), pTensors, pHeads, pDim, 768)
	plan, err := jobs.PlanPrefixSave(&jobs.SavePrefixRequest{Namespace: "ns", Identity: "tiny/bf16", Tokens: c.tokens, Tensors: c.views(n), PageTokens: p})
	if err != nil {
		t.Fatal(err)
	}
	keys, _, _ := layout.PageChain("tiny/bf16", p, c.tokens)
	if len(plan.Keys) != 3 || plan.Keys[2] != keys[2] || plan.Parents[0] != layout.PageRoot("tiny/bf16", p) || plan.Parents[2] != keys[1] {
		t.Fatalf("plan keys %v parents %v", plan.Keys, plan.Parents)
	}
	savePrefix(t, noSync(), ns, c, n, p)
	files := pageFiles(t, ns)
	for i, k := range plan.Keys {
		got, err := plan.FileBytes(i)
		if err != nil || got != files[k.String()] {
			t.Fatalf("page %d: planned %d bytes (%v), the file has %d", i, got, err, files[k.String()])
		}
	}
	if _, err := plan.FileBytes(3); !errors.Is(err, jobs.ErrInvalidRequest) {
		t.Fatalf("page 3 of 3: %v", err)
	}
	for name, r := range map[string]*jobs.SavePrefixRequest{
		"no tokens":  {Namespace: "ns", Identity: "x", Tensors: c.views(0)},
		"identity":   {Namespace: "ns", Tokens: c.tokens, Tensors: c.views(n)},
		"page size":  {Namespace: "ns", Identity: "x", Tokens: c.tokens, Tensors: c.views(n), PageTokens: 48},
		"few tokens": {Namespace: "ns", Identity: "x", Tokens: c.tokens, Tensors: c.views(n - 1)},
	} {
		if _, err := jobs.PlanPrefixSave(r); !errors.Is(err, jobs.ErrInvalidRequest) {
			t.Fatalf("%s: %v", name, err)
		}
	}
}
