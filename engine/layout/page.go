package layout

import (
	"bytes"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"sync"
	"unsafe"
)

// Token pages: the prefix cache's unit of storage (docs/format/page.md).
// A page holds the KV of PageTokens consecutive tokens for every
// tensor of a cache, and is named by a chained SHA-256 over the token ids of
// every page up to and including it, so a page's key determines the whole
// prefix that produced its KV.

// FormatPage is the formatVersion of a page file: a single-file snapshot
// (same prefix, data alignment and tensor hashes) whose header also carries
// the "page" object.
const FormatPage = 6

// Page size bounds, in tokens.
const (
	MinPageTokens     = 16
	MaxPageTokens     = 4096
	DefaultPageTokens = 256
	// MaxIdentityBytes caps the identity string, in bytes.
	MaxIdentityBytes = 4096
)

// pageKeyDomain starts the root of every key chain (version 1 of the rule).
const pageKeyDomain = "kvpersist/page/v1\n"

// Sentinel errors of pages, usable with errors.Is.
var (
	// ErrPageTokens: PageTokens is not a power of two from 16 to 4096.
	ErrPageTokens = errors.New("invalid page size")
	// ErrIdentity: the identity is empty or longer than MaxIdentityBytes.
	ErrIdentity = errors.New("invalid identity")
)

// CheckPageTokens validates a page size in tokens: a power of two from
// MinPageTokens (16) to MaxPageTokens (4096).
func CheckPageTokens(p int) error {
	if p < MinPageTokens || p > MaxPageTokens || p&(p-1) != 0 {
		return fmt.Errorf("%w: %d tokens (want a power of two from %d to %d)", ErrPageTokens, p, MinPageTokens, MaxPageTokens)
	}
	return nil
}

// CheckIdentity validates an identity: 1 to MaxIdentityBytes bytes (any
// bytes; the caller decides what it names).
func CheckIdentity(id string) error {
	if len(id) == 0 || len(id) > MaxIdentityBytes {
		return fmt.Errorf("%w: %d bytes (want 1 to %d)", ErrIdentity, len(id), MaxIdentityBytes)
	}
	return nil
}

// PageKey is a page's key: 32 bytes of SHA-256.
type PageKey [32]byte

// String is the key as 64 lowercase hex digits: the page file's name.
func (k PageKey) String() string { return hex.EncodeToString(k[:]) }

// ParsePageKey parses 64 lowercase hex digits (ValidBlockHash's rule).
func ParsePageKey(s string) (PageKey, error) {
	var k PageKey
	if !ValidBlockHash(s) {
		return k, fmt.Errorf("%w: page key %s is not 64 lowercase hex digits", ErrInvalidHeader, quoteCapped(s))
	}
	_, _ = hex.Decode(k[:], []byte(s))
	return k, nil
}

// pageBuf is the scratch in which a chain step's input is laid out: 32
// bytes of parent key and up to MaxPageTokens token ids (or a root's
// domain, identity and page size). Pooled: zeroing 16 KiB of stack on
// every call cost more than the hash.
type pageBuf [32 + 4*MaxPageTokens]byte

var pageBufs = sync.Pool{New: func() any { return new(pageBuf) }}

// nativeLittleEndian: token ids in memory are already the chain's u32 LE
// bytes (amd64, arm64), copied in one memmove instead of one store per id,
// which shows in a lookup's CPU profile beside the hash itself.
var nativeLittleEndian = binary.NativeEndian.Uint16([]byte{1, 0}) == 1

// PageRoot returns k_0 = SHA-256("kvpersist/page/v1\n" ‖ u32 LE
// len(identity) ‖ identity ‖ u32 LE pageTokens), the parent of a chain's
// first page. Arguments are not validated (see CheckIdentity,
// CheckPageTokens); it does not allocate for an identity of at most
// MaxIdentityBytes.
func PageRoot(identity string, pageTokens int) PageKey {
	pb := pageBufs.Get().(*pageBuf)
	defer pageBufs.Put(pb)
	buf := pb[:0]
	buf = append(buf, pageKeyDomain...)
	buf = binary.LittleEndian.AppendUint32(buf, uint32(len(identity)))
	buf = append(buf, identity...)
	buf = binary.LittleEndian.AppendUint32(buf, uint32(pageTokens))
	return sha256.Sum256(buf)
}

// PageNext returns k_i = SHA-256(k_{i-1} as 32 raw bytes ‖ each token id of
// page i as u32 LE). len(tokens) must be at most MaxPageTokens (it panics
// otherwise, like an out-of-range index). It does not allocate.
func PageNext(parent PageKey, tokens []uint32) PageKey {
	pb := pageBufs.Get().(*pageBuf)
	defer pageBufs.Put(pb)
	copy(pb[:32], parent[:])
	b := pb[32 : 32+4*len(tokens)]
	if nativeLittleEndian { // the ids' memory is already u32 LE: one copy
		copy(b, unsafe.Slice((*byte)(unsafe.Pointer(unsafe.SliceData(tokens))), len(b)))
	} else {
		for i, t := range tokens {
			binary.LittleEndian.PutUint32(b[4*i:], t)
		}
	}
	return sha256.Sum256(pb[:32+4*len(tokens)])
}

// PageChain returns the keys of the pages of tokens: one per full page of
// pageTokens tokens, then, when len(tokens) is not a multiple of pageTokens,
// the key of the partial last page (a leaf: chained over its fewer tokens).
// full is the number of full pages. Errors: ErrIdentity, ErrPageTokens.
func PageChain(identity string, pageTokens int, tokens []uint32) (keys []PageKey, full int, err error) {
	if err := CheckIdentity(identity); err != nil {
		return nil, 0, err
	}
	if err := CheckPageTokens(pageTokens); err != nil {
		return nil, 0, err
	}
	full = len(tokens) / pageTokens
	n := (len(tokens) + pageTokens - 1) / pageTokens
	keys = make([]PageKey, n)
	k := PageRoot(identity, pageTokens)
	for i := range n {
		k = PageNext(k, tokens[i*pageTokens:min(len(tokens), (i+1)*pageTokens)])
		keys[i] = k
	}
	return keys, full, nil
}

// Page is the "page" object of a page file's header.
type Page struct {
	Key      PageKey // SHA-256(Parent ‖ Tokens as u32 LE)
	Parent   PageKey // the previous page's key, or PageRoot for a first page
	Identity string
	// PageTokens is P, the chain's page size in tokens.
	PageTokens int
	// Tokens are the page's token ids: PageTokens of them for a full page,
	// 1 to PageTokens-1 for a leaf (a partial last page).
	Tokens []uint32
}

// Leaf reports whether the page is a partial last page (never a parent).
func (p *Page) Leaf() bool { return len(p.Tokens) < p.PageTokens }

// pageJSON is the wire form of Page.
type pageJSON struct {
	Key        string   `json:"key"`
	Parent     string   `json:"parent"`
	Identity   string   `json:"identity"`
	PageTokens int      `json:"pageTokens"`
	TokenCount int      `json:"tokenCount"`
	Tokens     []uint32 `json:"tokens"`
}

var pageFields = []string{"key", "parent", "identity", "pageTokens", "tokenCount", "tokens"}

// MetaJSON is the "page" object as compact JSON, keys in the order key,
// parent, identity, pageTokens, tokenCount, tokens.
func (p *Page) MetaJSON() json.RawMessage {
	b, _ := json.Marshal(pageJSON{
		Key: p.Key.String(), Parent: p.Parent.String(), Identity: p.Identity,
		PageTokens: p.PageTokens, TokenCount: len(p.Tokens), Tokens: p.Tokens,
	})
	return b
}

// Check validates a page's fields: identity, page size, token count (1 to
// PageTokens), and that Key is the chain step from Parent over Tokens.
// Errors wrap ErrInvalidHeader.
func (p *Page) Check() error {
	if err := CheckIdentity(p.Identity); err != nil {
		return fmt.Errorf("%w: page: %w", ErrInvalidHeader, err)
	}
	if err := CheckPageTokens(p.PageTokens); err != nil {
		return fmt.Errorf("%w: page: %w", ErrInvalidHeader, err)
	}
	if len(p.Tokens) < 1 || len(p.Tokens) > p.PageTokens {
		return fmt.Errorf("%w: page holds %d tokens (want 1 to %d)", ErrInvalidHeader, len(p.Tokens), p.PageTokens)
	}
	if got := PageNext(p.Parent, p.Tokens); got != p.Key {
		return fmt.Errorf("%w: page key %s is not the chain of its parent %s and tokens (%s)", ErrInvalidHeader, p.Key, p.Parent, got)
	}
	return nil
}

// parsePage extracts and strictly validates the "page" object of a page
// file's header h (FormatPage), removing it from h.Meta. A page file holds
// exactly one cache entry and no attachments, no caller metadata at any
// level, and every tensor has at least 2 axes with axis -2 (tokens) equal
// to the page's token count.
func parsePage(h *Header) (*Page, error) {
	raw, ok := h.Meta["page"]
	if !ok || isNull(raw) {
		return nil, fmt.Errorf("%w: page file without a \"page\" object", ErrInvalidHeader)
	}
	var obj map[string]json.RawMessage
	if err := json.Unmarshal(raw, &obj); err != nil || obj == nil {
		return nil, fmt.Errorf("%w: \"page\" is not an object", ErrInvalidHeader)
	}
	if len(obj) != len(pageFields) {
		return nil, fmt.Errorf("%w: \"page\" must have exactly the keys %v", ErrInvalidHeader, pageFields)
	}
	var w pageJSON
	dsts := []any{&w.Key, &w.Parent, &w.Identity, &w.PageTokens, &w.TokenCount, &w.Tokens}
	for i, k := range pageFields {
		v, ok := obj[k]
		if !ok || isNull(v) {
			return nil, fmt.Errorf("%w: page.%s is missing or null", ErrInvalidHeader, k)
		}
		d := json.NewDecoder(bytes.NewReader(v))
		if err := d.Decode(dsts[i]); err != nil {
			return nil, fmt.Errorf("%w: page.%s: %v", ErrInvalidHeader, k, err)
		}
	}
	delete(h.Meta, "page")
	if len(h.Meta) != 0 {
		return nil, fmt.Errorf("%w: a page file carries no caller metadata (found %d keys)", ErrInvalidHeader, len(h.Meta))
	}
	var p Page
	var err error
	if p.Key, err = ParsePageKey(w.Key); err != nil {
		return nil, err
	}
	if p.Parent, err = ParsePageKey(w.Parent); err != nil {
		return nil, err
	}
	p.Identity, p.PageTokens, p.Tokens = w.Identity, w.PageTokens, w.Tokens
	if w.TokenCount != len(w.Tokens) {
		return nil, fmt.Errorf("%w: page.tokenCount %d but %d token ids", ErrInvalidHeader, w.TokenCount, len(w.Tokens))
	}
	if err := p.Check(); err != nil {
		return nil, err
	}
	if len(h.Caches) != 1 || h.Attachments != nil {
		return nil, fmt.Errorf("%w: a page file has exactly one cache entry and no attachments", ErrInvalidHeader)
	}
	if len(h.Caches[0].Meta) != 0 {
		return nil, fmt.Errorf("%w: a page file's entry carries no metadata", ErrInvalidHeader)
	}
	if len(h.Caches[0].Tensors) == 0 {
		return nil, fmt.Errorf("%w: a page file holds at least one tensor", ErrInvalidHeader)
	}
	for i, t := range h.Caches[0].Tensors {
		if len(t.Meta) != 0 {
			return nil, fmt.Errorf("%w: page tensor %d carries metadata", ErrInvalidHeader, i)
		}
		if len(t.Shape) < 2 || t.Shape[len(t.Shape)-2] != int64(len(p.Tokens)) {
			return nil, fmt.Errorf("%w: page tensor %d has shape %v; axis -2 must be the page's %d tokens", ErrInvalidHeader, i, t.Shape, len(p.Tokens))
		}
	}
	return &p, nil
}

// IdentityKey is the top-level header key under which a snapshot or
// manifest written with an identity carries it, as a JSON string (caller
// metadata otherwise: older files may use the key for anything).
const IdentityKey = "identity"

// Identity returns the identity a snapshot was written with: the
// top-level "identity" metadata when it is a JSON string; ok is false
// when there is none (or it is not a string).
func (h *Header) Identity() (id string, ok bool) {
	raw, present := h.Meta[IdentityKey]
	if !present {
		return "", false
	}
	if err := json.Unmarshal(raw, &id); err != nil || isNull(raw) {
		return "", false
	}
	return id, true
}

// WithIdentity returns a copy of meta carrying identity under IdentityKey
// (meta itself is not modified). Errors: ErrIdentity for an invalid
// identity, ErrInvalidHeader when meta already has the key.
func WithIdentity(meta Meta, identity string) (Meta, error) {
	if err := CheckIdentity(identity); err != nil {
		return nil, err
	}
	if _, ok := meta[IdentityKey]; ok {
		return nil, fmt.Errorf("%w: metadata already has the key %q and an identity was given", ErrInvalidHeader, IdentityKey)
	}
	out := make(Meta, len(meta)+1)
	for k, v := range meta {
		out[k] = v
	}
	b, _ := json.Marshal(identity)
	out[IdentityKey] = b
	return out, nil
}

// FormatPages is the formatVersion of a page manifest: a named snapshot
// whose cache tensors are stored as token pages (layout Pages).
const FormatPages = 7

// PageList is the "pages" object of a page manifest: the pages holding its
// cache tensors' bytes, in chain order (the leaf last when Tokens is not a
// multiple of PageTokens).
type PageList struct {
	Identity   string
	PageTokens int
	Tokens     int // the snapshot's token count: every cache tensor's axis -2
	Keys       []PageKey
}

type pageListJSON struct {
	Identity   string   `json:"identity"`
	PageTokens int      `json:"pageTokens"`
	Tokens     int      `json:"tokens"`
	Keys       []string `json:"keys"`
}

var pageListFields = []string{"identity", "pageTokens", "tokens", "keys"}

// MetaJSON is the "pages" object as compact JSON.
func (l *PageList) MetaJSON() json.RawMessage {
	w := pageListJSON{Identity: l.Identity, PageTokens: l.PageTokens, Tokens: l.Tokens, Keys: make([]string, len(l.Keys))}
	for i, k := range l.Keys {
		w.Keys[i] = k.String()
	}
	b, _ := json.Marshal(w)
	return b
}

// parsePageList extracts and strictly validates the "pages" object of a
// page manifest, removing it from h.Meta: identity and page size valid,
// tokens >= 1, exactly ceil(tokens/pageTokens) keys of 64 lowercase hex
// digits, and every cache tensor's axis -2 equal to tokens.
func parsePageList(h *Header) (*PageList, error) {
	raw, ok := h.Meta["pages"]
	if !ok || isNull(raw) {
		return nil, fmt.Errorf("%w: page manifest without a \"pages\" object", ErrInvalidHeader)
	}
	var obj map[string]json.RawMessage
	if err := json.Unmarshal(raw, &obj); err != nil || obj == nil || len(obj) != len(pageListFields) {
		return nil, fmt.Errorf("%w: \"pages\" must be an object with exactly the keys %v", ErrInvalidHeader, pageListFields)
	}
	var w pageListJSON
	dsts := []any{&w.Identity, &w.PageTokens, &w.Tokens, &w.Keys}
	for i, k := range pageListFields {
		v, ok := obj[k]
		if !ok || isNull(v) {
			return nil, fmt.Errorf("%w: pages.%s is missing or null", ErrInvalidHeader, k)
		}
		if err := json.Unmarshal(v, dsts[i]); err != nil {
			return nil, fmt.Errorf("%w: pages.%s: %v", ErrInvalidHeader, k, err)
		}
	}
	l := &PageList{Identity: w.Identity, PageTokens: w.PageTokens, Tokens: w.Tokens}
	if err := CheckIdentity(l.Identity); err != nil {
		return nil, fmt.Errorf("%w: pages: %w", ErrInvalidHeader, err)
	}
	if err := CheckPageTokens(l.PageTokens); err != nil {
		return nil, fmt.Errorf("%w: pages: %w", ErrInvalidHeader, err)
	}
	if l.Tokens < 1 {
		return nil, fmt.Errorf("%w: pages.tokens %d (want >= 1)", ErrInvalidHeader, l.Tokens)
	}
	if n := (l.Tokens + l.PageTokens - 1) / l.PageTokens; len(w.Keys) != n {
		return nil, fmt.Errorf("%w: %d page keys for %d tokens of %d per page (want %d)", ErrInvalidHeader, len(w.Keys), l.Tokens, l.PageTokens, n)
	}
	l.Keys = make([]PageKey, len(w.Keys))
	for i, s := range w.Keys {
		var err error
		if l.Keys[i], err = ParsePageKey(s); err != nil {
			return nil, err
		}
	}
	for ci, e := range h.Caches {
		for ti, t := range e.Tensors {
			if t.Shape[len(t.Shape)-2] != int64(l.Tokens) {
				return nil, fmt.Errorf("%w: cache %d tensor %d has shape %v; axis -2 must be the manifest's %d tokens", ErrInvalidHeader, ci, ti, t.Shape, l.Tokens)
			}
		}
	}
	delete(h.Meta, "pages")
	return l, nil
}

// FirstPage reports whether the page starts its chain: its parent is
// PageRoot(Identity, PageTokens), not another page.
func (p *Page) FirstPage() bool { return p.Parent == PageRoot(p.Identity, p.PageTokens) }
