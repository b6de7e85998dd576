package jobs

import (
	"context"

	"github.com/kvpersist/kvpersist/engine/layout"
	"github.com/kvpersist/kvpersist/engine/store"
	"github.com/kvpersist/kvpersist/engine/vfs"
)

// PageChain is a prefix load's chain as its PageSource sees it: the
// request checked, its namespace resolved and its page keys computed, all
// once, by LoadPrefix.
type PageChain struct {
	// NS is the load's namespace (checked: a real directory or absent).
	NS *store.Namespace
	// Identity, PageTokens (P, never 0) and Tokens are the request's.
	Identity   string
	PageTokens int
	Tokens     []uint32
	// Keys are the prompt's page keys, layout.PageChain(Identity,
	// PageTokens, Tokens): page i holds tokens [i*P, min(len(Tokens),
	// (i+1)*P)).
	Keys []layout.PageKey
}

// Parent is page i's parent key: the chain's root key for page 0.
func (c *PageChain) Parent(i int) layout.PageKey {
	if i == 0 {
		return layout.PageRoot(c.Identity, c.PageTokens)
	}
	return c.Keys[i-1]
}

// SourcePage is a page a PageSource hands to a load.
type SourcePage struct {
	// File, when non-nil, is a read-only descriptor of the page's file,
	// now the load's (it closes it): a page the source has just fetched
	// and published. nil: the load opens the page's local file
	// (NS.PagePath) itself, and a missing file ends the prefix there
	// (PrefixResult.Missing).
	File vfs.File
	// Head, when non-nil, is File's header as the source decoded it from
	// the very bytes it wrote (layout.Decode's result): the load checks it
	// as it checks a header it decodes, without reading and decoding it
	// again. nil: the load decodes File's header.
	Head *layout.Snapshot
	// Verified says the source verified File's bytes (its header, its key
	// against the chain, every tensor's xxh3-64): the load does not hash
	// its tensors again.
	Verified bool
	// Err, when non-nil (File nil), says why the source could not make
	// the page local although it had it (a fetched page that verified but
	// whose publish failed): the prefix ends before the page, and
	// PrefixResult.Stop wraps Err.
	Err error
}

// PageSource yields the pages of a prefix load's chain, in chain order,
// to LoadPrefix: the local page files, or pages a remote tier fetches and
// publishes while the load reads the pages before them (engine: the one
// fetcher of its object-store tier). A nil PageSource is the local page
// files alone.
type PageSource interface {
	// Start is called once per load, after the request was checked and
	// before the load takes the namespace's lock or asks for a page; the
	// source may create the namespace's directories and start fetching.
	// It is not called for a request that fails its checks.
	Start(ctx context.Context, ch *PageChain)
	// Page hands over page i of the chain: i is 0 on the first call and
	// one more on each call after. ready false (only with wait false)
	// means page i is still on its way: the load reads the pages it holds
	// first (and releases the namespace's lock), then asks again with
	// wait true, which returns once the page is there or known not to
	// come (then a zero SourcePage: the load looks for the local file),
	// or ctx has ended. The load holds the namespace's shared lock while
	// it asks with wait false, never while it waits.
	Page(ctx context.Context, i int, wait bool) (pg SourcePage, ready bool)
}
