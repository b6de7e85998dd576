package engine

import (
	"errors"
	"fmt"

	"github.com/kvpersist/kvpersist/engine/layout"
	"github.com/kvpersist/kvpersist/engine/pageindex"
)

// LookupFrom is Lookup for a prompt whose first pages' keys the caller
// holds: keys are the keys of the first len(keys) full pages of tokens
// (a previous LookupFrom's chain; or a SavePrefix's or LoadPrefix's
// Result.Prefix.Keys cut to its tokens' full pages, Keys[:Tokens/P], the
// leaf left out), tokens the whole prompt. Only the pages after them are
// hashed, so a conversation grown by a turn costs the hash of its new
// pages and one index probe per page instead of hashing every page again.
// The answer is Lookup's for tokens when keys are the chain of tokens'
// first pages; keys are not checked against tokens (that would be the
// hashing this saves), so other keys give the answer for those keys.
//
// chain is the keys of every full page of tokens in chain order (keys,
// then the new pages' keys appended to keys: no allocation when keys has
// the capacity), to pass with the next turn's tokens. It runs on the
// caller's goroutine without I/O, records the access and the metrics as
// Lookup does.
//
// Errors: ErrPath (invalid namespace), layout.ErrIdentity,
// layout.ErrPageTokens, ErrInvalidRequest (more keys than tokens hold
// full pages), with chain nil.
func (e *Engine) LookupFrom(namespace, identity string, pageTokens int, keys []layout.PageKey, tokens []uint32) (n int, chain []layout.PageKey, err error) {
	pageTokens, start, err := e.lookupStart(namespace, pageTokens)
	if err != nil {
		return 0, nil, err
	}
	n, last, chain, err := e.pages.LookupFrom(namespace, identity, pageTokens, keys, tokens)
	if errors.Is(err, pageindex.ErrKeys) {
		err = fmt.Errorf("%w: %w", ErrInvalidRequest, err)
	}
	e.lookupDone(namespace, start, n, last, len(tokens), err)
	return n, chain, err
}
