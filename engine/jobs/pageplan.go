package jobs

import (
	"fmt"

	"github.com/kvpersist/kvpersist/engine/layout"
)

// PagePlan is a prefix save checked and keyed before it runs, so that the
// engine can account for its new pages (reserve room in the page cache)
// before SavePrefix creates any file, and then run it without keying it
// again (SavePlannedPrefix). It holds the request and its views: use it
// only while the request is valid (until the save's ack).
type PagePlan struct {
	// Keys are the save's page keys in chain order (the leaf last);
	// Parents[i] is page i's parent key (Parents[0] is the chain's root
	// key k_0, which is no page).
	Keys, Parents []layout.PageKey
	// PageTokens is P, resolved (never 0).
	PageTokens int

	req     *SavePrefixRequest
	tensors []TensorSpec // the request's, each with its itemsize (resolveTensors)
	shapes  [][]int
}

// PlanPrefixSave checks r exactly as SavePrefix does before touching the
// disk (identity, page size, at least one token, every view and dtype,
// enough tokens on axis -2: ErrInvalidRequest naming the problem) and
// returns its plan. It does no I/O. A nil r is ErrInvalidRequest.
func PlanPrefixSave(r *SavePrefixRequest) (*PagePlan, error) {
	if r == nil {
		return nil, fmt.Errorf("%w: nil *SavePrefixRequest", ErrInvalidRequest)
	}
	p := pageTokens(r.PageTokens)
	if len(r.Tokens) == 0 {
		return nil, fmt.Errorf("%w: save prefix %s: no tokens", ErrInvalidRequest, r.Namespace)
	}
	keys, _, err := layout.PageChain(r.Identity, p, r.Tokens)
	if err != nil {
		return nil, fmt.Errorf("%w: save prefix %s: %w", ErrInvalidRequest, r.Namespace, err)
	}
	if err := checkPrefixTensors(r.Tensors, len(r.Tokens), ErrInvalidRequest, "tensor", false); err != nil {
		return nil, fmt.Errorf("save prefix %s: %w", r.Namespace, err)
	}
	pl := &PagePlan{Keys: keys, Parents: make([]layout.PageKey, len(keys)), PageTokens: p,
		req: r, tensors: resolveTensors(r.Tensors)}
	pl.Parents[0] = layout.PageRoot(r.Identity, p)
	copy(pl.Parents[1:], keys)
	pl.shapes = make([][]int, len(pl.tensors))
	for i, t := range pl.tensors {
		pl.shapes[i] = make([]int, len(t.View.Shape))
	}
	return pl, nil
}

// FileBytes is the length in bytes of page i's file (prefix, header,
// alignment and tensor data) as SavePrefix writes it: the same planner
// (hashes have a fixed length, so the length is known before any byte is
// gathered). Errors: ErrInvalidRequest for an out-of-range i or a view
// that cannot be sliced.
func (pl *PagePlan) FileBytes(i int) (int64, error) {
	if i < 0 || i >= len(pl.Keys) {
		return 0, fmt.Errorf("%w: page %d of a save of %d pages", ErrInvalidRequest, i, len(pl.Keys))
	}
	lo, hi := i*pl.PageTokens, min(len(pl.req.Tokens), (i+1)*pl.PageTokens)
	page := &layout.Page{Key: pl.Keys[i], Parent: pl.Parents[i], Identity: pl.req.Identity, PageTokens: pl.PageTokens, Tokens: pl.req.Tokens[lo:hi]}
	pp, err := planPage(pl.tensors, pl.shapes, page, lo, pl.Keys[i].String())
	if err != nil {
		return 0, err
	}
	return pp.size, nil
}
