// Package pageindex is the prefix cache's in-memory index: per namespace,
// the set of page keys stored on disk. It answers "how many tokens of this
// prompt are stored?" without touching the disk: the keys of the prompt's
// pages are derived from its token ids (layout.PageChain) and looked up in
// chain order until one is absent.
//
// The index is a cache of the disk, not its authority: it is built from
// the disk when the engine starts (Build) and kept current by the engine's
// own saves (Add) and removals (Remove). A page removed behind its back (by
// another process) is found missing when it is loaded; a load is never
// failed by it (jobs.LoadPrefix reports a miss, and the engine then removes
// the key).
package pageindex

import (
	"encoding/hex"
	"errors"
	"fmt"
	"sync"

	"github.com/kvpersist/kvpersist/engine/layout"
	"github.com/kvpersist/kvpersist/engine/store"
	"github.com/kvpersist/kvpersist/engine/vfs"
)

// Index holds the stored page keys of each namespace, and the pages known
// durable (see DurableID). It is safe for concurrent use; lookups share a
// read lock.
type Index struct {
	mu sync.RWMutex
	ns map[string]map[layout.PageKey]struct{}
	// durable: per namespace, the mark of each page file made known
	// durable by this process's saves (MarkDurable); a separate map, so
	// that Lookup's set stays small. Forgotten with the key.
	durable map[string]map[layout.PageKey]mark
}

// mark is a page's durable mark: the FileID of its file and the sum of
// the header it was found to hold (or was written with).
type mark struct {
	id     vfs.FileID
	header uint64
}

// New returns an empty index.
func New() *Index {
	return &Index{ns: map[string]map[layout.PageKey]struct{}{}, durable: map[string]map[layout.PageKey]mark{}}
}

// DurableID returns the FileID recorded by MarkDurable for page key of
// namespace ns, or the zero FileID when none is.
func (x *Index) DurableID(ns string, key layout.PageKey) vfs.FileID {
	id, _ := x.DurableMark(ns, key)
	return id
}

// DurableMark returns the FileID and header sum recorded by MarkDurable
// for page key of namespace ns, or zero values when none is. A save
// compares the FileID with the lstat of the page file it finds
// (jobs.DurablePages): equal means the file is the one that was durable
// under its name when it was marked, so its directory need not be
// fsynced again; and when the header sum also equals that of the header
// the save would write, the file holds that header, so it need not be
// read again.
func (x *Index) DurableMark(ns string, key layout.PageKey) (vfs.FileID, uint64) {
	x.mu.RLock()
	defer x.mu.RUnlock()
	m := x.durable[ns][key]
	return m.id, m.header
}

// MarkDurable records ids[i] as the FileID of page keys[i] of namespace
// ns, known durable, and headers[i] as the sum of the header its file
// holds (0: unknown): the caller has made the page's directory entry, and
// its fan-out directory's entry in pages/, durable after an lstat that
// gave ids[i] (see ARCHITECTURE.md, "Known-durable pages"). A zero id
// forgets the key's mark. len(ids) and len(headers) must equal len(keys).
func (x *Index) MarkDurable(ns string, keys []layout.PageKey, ids []vfs.FileID, headers []uint64) {
	x.mu.Lock()
	defer x.mu.Unlock()
	m := x.durable[ns]
	for i, k := range keys {
		if ids[i] == (vfs.FileID{}) {
			delete(m, k)
			continue
		}
		if m == nil {
			m = make(map[layout.PageKey]mark, len(keys))
			x.durable[ns] = m
		}
		m[k] = mark{id: ids[i], header: headers[i]}
	}
	if m != nil && len(m) == 0 {
		delete(x.durable, ns)
	}
}

// forgetDurable drops key's durable mark; x.mu held for writing.
func (x *Index) forgetDurable(ns string, key layout.PageKey) {
	if m := x.durable[ns]; m != nil {
		delete(m, key)
		if len(m) == 0 {
			delete(x.durable, ns)
		}
	}
}

// Add records keys as stored in namespace ns.
func (x *Index) Add(ns string, keys ...layout.PageKey) {
	if len(keys) == 0 {
		return
	}
	x.mu.Lock()
	defer x.mu.Unlock()
	set := x.ns[ns]
	if set == nil {
		set = make(map[layout.PageKey]struct{}, len(keys))
		x.ns[ns] = set
	}
	for _, k := range keys {
		set[k] = struct{}{}
	}
}

// Remove forgets keys of namespace ns, and their durable marks (absent
// keys are ignored).
func (x *Index) Remove(ns string, keys ...layout.PageKey) {
	x.mu.Lock()
	defer x.mu.Unlock()
	set := x.ns[ns]
	for _, k := range keys {
		delete(set, k)
		x.forgetDurable(ns, k)
	}
	if set != nil && len(set) == 0 {
		delete(x.ns, ns)
	}
}

// RemoveIfGone forgets key of namespace ns when gone() reports its file
// absent. gone runs under the index's write lock, so a save that publishes
// the page and then Adds its key cannot be overtaken: either gone sees the
// file, or the Add comes after the removal. This is how a load's miss is
// applied (a plain Remove could forget a page a concurrent save has just
// stored and indexed). gone must be quick (one lstat).
func (x *Index) RemoveIfGone(ns string, key layout.PageKey, gone func() bool) {
	x.mu.Lock()
	defer x.mu.Unlock()
	set := x.ns[ns]
	if _, ok := set[key]; !ok || !gone() {
		return
	}
	delete(set, key)
	x.forgetDurable(ns, key)
	if len(set) == 0 {
		delete(x.ns, ns)
	}
}

// Present returns how many of keys, from the first, are recorded in
// namespace ns (len(keys) when all are): Lookup for a caller that has the
// prompt's page keys already (layout.PageChain), without hashing.
func (x *Index) Present(ns string, keys []layout.PageKey) int {
	x.mu.RLock()
	defer x.mu.RUnlock()
	set := x.ns[ns]
	for i, k := range keys {
		if _, ok := set[k]; !ok {
			return i
		}
	}
	return len(keys)
}

// Has reports whether key is recorded in namespace ns.
func (x *Index) Has(ns string, key layout.PageKey) bool {
	x.mu.RLock()
	defer x.mu.RUnlock()
	_, ok := x.ns[ns][key]
	return ok
}

// Len returns the number of keys recorded in namespace ns.
func (x *Index) Len(ns string) int {
	x.mu.RLock()
	defer x.mu.RUnlock()
	return len(x.ns[ns])
}

// Lookup returns the length, in tokens, of the longest prefix of tokens
// whose pages are recorded in namespace ns for identity and pageTokens (P):
// the full pages in chain order up to the first absent one, then, when
// every full page is present and len(tokens) is not a multiple of P, the
// leaf over the remaining tokens if it is recorded (a leaf is used only
// when it covers exactly the prompt's remaining tokens). So the result is
// a multiple of P, or len(tokens).
//
// Errors: layout.ErrIdentity, layout.ErrPageTokens. Lookup does not
// allocate; it hashes 32+4P bytes per page it examines (SHA-256).
func (x *Index) Lookup(ns, identity string, pageTokens int, tokens []uint32) (int, error) {
	n, _, err := x.LookupDeepest(ns, identity, pageTokens, tokens)
	return n, err
}

// LookupDeepest is Lookup that also returns the key of the last page the
// prefix covers (the deepest page found; the zero key when the result is
// 0): the engine records an access to it (its ancestors cannot be evicted
// before it). It does not allocate.
func (x *Index) LookupDeepest(ns, identity string, pageTokens int, tokens []uint32) (int, layout.PageKey, error) {
	var last layout.PageKey
	if err := layout.CheckIdentity(identity); err != nil {
		return 0, last, err
	}
	if err := layout.CheckPageTokens(pageTokens); err != nil {
		return 0, last, err
	}
	x.mu.RLock()
	defer x.mu.RUnlock()
	set := x.ns[ns]
	if len(set) == 0 {
		return 0, last, nil
	}
	k := layout.PageRoot(identity, pageTokens)
	full := len(tokens) / pageTokens
	for i := range full {
		k = layout.PageNext(k, tokens[i*pageTokens:(i+1)*pageTokens])
		if _, ok := set[k]; !ok {
			return i * pageTokens, last, nil
		}
		last = k
	}
	if rest := tokens[full*pageTokens:]; len(rest) > 0 {
		if leaf := layout.PageNext(k, rest); func() bool { _, ok := set[leaf]; return ok }() {
			return len(tokens), leaf, nil
		}
	}
	return full * pageTokens, last, nil
}

// ErrKeys: the page keys a caller passed (LookupFrom) cover more full
// pages than its tokens hold.
var ErrKeys = errors.New("pageindex: more page keys than full pages of tokens")

// LookupFrom is LookupDeepest for a caller that holds the keys of the
// first len(keys) full pages of tokens already (a previous LookupFrom's
// chain, or a save's or load's keys without a leaf): it hashes only the
// full pages after them (SHA-256 of 32+4P bytes each) and the leaf, not
// the whole chain, so a prompt grown by a few pages since costs a few
// hashes and one index probe per page. keys are trusted: keys that are
// not the chain of tokens' first pages give the answer for those keys.
//
// chain is the keys of every full page of tokens, in chain order (the
// leaf, never a parent, left out): keys, then the keys of the pages after
// them, appended to keys (reusing its capacity), ready for the next
// call. It allocates only when keys lacks the capacity.
//
// Errors: layout.ErrIdentity, layout.ErrPageTokens, ErrKeys (more keys
// than len(tokens)/pageTokens), with chain nil.
func (x *Index) LookupFrom(ns, identity string, pageTokens int, keys []layout.PageKey, tokens []uint32) (n int, last layout.PageKey, chain []layout.PageKey, err error) {
	if err := layout.CheckIdentity(identity); err != nil {
		return 0, last, nil, err
	}
	if err := layout.CheckPageTokens(pageTokens); err != nil {
		return 0, last, nil, err
	}
	full := len(tokens) / pageTokens
	if len(keys) > full {
		return 0, last, nil, fmt.Errorf("%w: %d keys, %d tokens hold %d full pages of %d", ErrKeys, len(keys), len(tokens), full, pageTokens)
	}
	chain = keys
	k := layout.PageRoot(identity, pageTokens)
	if len(keys) > 0 {
		k = keys[len(keys)-1]
	}
	for i := len(keys); i < full; i++ {
		k = layout.PageNext(k, tokens[i*pageTokens:(i+1)*pageTokens])
		chain = append(chain, k)
	}
	var leaf layout.PageKey
	rest := tokens[full*pageTokens:]
	if len(rest) > 0 {
		leaf = layout.PageNext(k, rest)
	}
	x.mu.RLock()
	defer x.mu.RUnlock()
	set := x.ns[ns]
	if len(set) == 0 {
		return 0, last, chain, nil
	}
	for i, k := range chain {
		if _, ok := set[k]; !ok {
			return i * pageTokens, last, chain, nil
		}
		last = k
	}
	if len(rest) > 0 {
		if _, ok := set[leaf]; ok {
			return len(tokens), leaf, chain, nil
		}
	}
	return full * pageTokens, last, chain, nil
}

// BuildStats reports what Build found.
type BuildStats struct {
	Namespaces int // namespaces with a pages/ directory
	Pages      int // page files recorded
	// Skipped lists entries under pages/ that are not page files by name
	// (temp files excepted): never recorded.
	Skipped []string
}

// Build records each page file of every namespace of st (the store lists
// the namespaces and classifies pages/: engine/store.Namespace.ListPages),
// by name: <ns>/pages/<2 hex>/<64 hex> whose first two digits are its
// directory's. No page file is opened: a torn or corrupt page is recorded
// and found out when loaded. Temp files are ignored; a missing root is an
// empty store.
func Build(st *store.Store) (*Index, BuildStats, error) {
	x := New()
	var bs BuildStats
	names, _, err := st.Namespaces(false)
	if err != nil {
		if vfs.IsNotExist(err) {
			return x, bs, nil
		}
		return nil, bs, fmt.Errorf("pageindex: %w", err)
	}
	for _, name := range names {
		ns, err := st.Namespace(name)
		if err != nil {
			return nil, bs, fmt.Errorf("pageindex: %w", err)
		}
		l, err := ns.ListPages()
		if err != nil {
			if vfs.IsNotExist(err) { // removed since the root was listed
				continue
			}
			return nil, bs, fmt.Errorf("pageindex: %w", err)
		}
		bs.Skipped = append(bs.Skipped, l.SkippedPaths()...)
		if !l.HasPagesDir {
			continue
		}
		keys := make([]layout.PageKey, 0, len(l.Pages))
		for _, pg := range l.Pages {
			var k layout.PageKey
			_, _ = hex.Decode(k[:], []byte(pg.Key)) // 64 lowercase hex digits: the store checked
			keys = append(keys, k)
		}
		x.Add(name, keys...)
		bs.Namespaces++
		bs.Pages += len(keys)
	}
	return x, bs, nil
}
