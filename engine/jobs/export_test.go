package jobs

import "bytes"

// SetMaxHeldBlocks lowers how many block files a read keeps open (tests of
// the reopen path); it returns a function that restores the old value.
func SetMaxHeldBlocks(n int) (restore func()) {
	old := maxHeldBlocks
	maxHeldBlocks = n
	return func() { maxHeldBlocks = old }
}

// BlockSums is blockSums: a block's SHA-256 and XXH3-64 in one pass.
func BlockSums(data []byte) ([32]byte, uint64) { return blockSums(data) }

// PlanPageHeads plans a page save of tokens in namespace under root
// (planPageSave) and compares each page's planned header, data start,
// size and tensor bytes with those of the page's full plan (planPage):
// it returns the first page that differs (-1 when none does) and how
// many pages planPageSave planned fully.
func PlanPageHeads(root, namespace, identity string, p int, tokens []uint32, tensors []TensorSpec) (differs, full int, err error) {
	ns, err := (&Config{Root: root}).namespace(namespace)
	if err != nil {
		return 0, 0, err
	}
	ts := resolveTensors(tensors)
	ps, err := planPageSave(ns, identity, p, tokens, ts)
	if err != nil {
		return 0, 0, err
	}
	for _, pl := range ps.pages {
		if pl != nil {
			full++
		}
	}
	fresh := &pageSave{ns: ns, identity: identity, p: p, tokens: tokens, tensors: ts, keys: ps.keys, parents: ps.parents,
		heads: make([]pageHead, len(ps.keys)), pages: make([]*plannedPage, len(ps.keys))}
	for i, got := range ps.heads {
		pl, err := fresh.plan(i)
		if err != nil {
			return 0, 0, err
		}
		if !bytes.Equal(got.js, pl.js) || got.dataStart != pl.dataStart || got.size != pl.size || got.tensorBytes != pl.tensorBytes {
			return i, full, nil
		}
	}
	return -1, full, nil
}
