package jobs

import (
	"fmt"
	"slices"

	"github.com/kvpersist/kvpersist/engine/gather"
	"github.com/kvpersist/kvpersist/engine/layout"
)

// The prefix cache's jobs: SavePrefix stores the token pages of a cache
// (only those not stored yet), LoadPrefix loads the longest stored prefix
// of a token sequence into strided destinations. See ARCHITECTURE.md,
// "Token pages".

// PrefixResult reports a prefix save or load. Counts are pages, sizes
// bytes of page files (header and data), tokens tokens.
type PrefixResult struct {
	// Keys: a save's page keys in chain order (every page of the tokens,
	// the leaf last); a load's keys of the pages it loaded.
	Keys []layout.PageKey
	// Tokens: saved (len(Tokens)) or loaded (the prefix's length).
	Tokens int
	// PagesWritten, BytesWritten: pages a save wrote (published:
	// fdatasynced and renamed). PagesReused, BytesReused: pages a save
	// found stored (no gather, hash or write).
	PagesWritten, PagesReused int
	BytesWritten, BytesReused int64
	// PagesReplaced, for a save: how many of PagesWritten replaced a file
	// that already had the page's name but was not that page as this save
	// would write it (a header that does not verify, or differs from the
	// save's own apart from the tensor hashes: torn, corrupt, another
	// page's, another writer's encoding): see ARCHITECTURE.md, "Token
	// pages", Save.
	PagesReplaced int
	// Missing, for a load, is the first page key it looked for and found
	// no file for (nil when every page it looked for was found, or the
	// load stopped for another reason). The engine drops it from its index.
	Missing *layout.PageKey
	// Stop, for a load, is why the prefix ended before a missing page or
	// the end of the tokens: a page that failed verification or is not
	// what its file name says (ErrCorrupt: another key, identity, page
	// size or token ids, or tensors unlike the pages before it), did not
	// decode, or could not be opened or read, or that the load's page
	// source had but could not make local (jobs.SourcePage.Err). The
	// pages before it are loaded and counted in Tokens. nil otherwise.
	Stop error
	// Failed, for a save: the keys of the pages it could not store
	// because their fan-out directory's path (pages/<xx>) is not a
	// directory (a stray file or symlink there, never replaced nor
	// followed), or a directory is at the page file's path (never
	// replaced), a per-page failure: the save's other pages are written
	// and counted, and Keys still lists every page. FailedErr names the
	// first such path. Both nil when every page was stored.
	Failed    []layout.PageKey
	FailedErr error
}

// Stored is a save's keys without Failed: the pages on disk after it.
func (r *PrefixResult) Stored() []layout.PageKey {
	if len(r.Failed) == 0 {
		return r.Keys
	}
	out := make([]layout.PageKey, 0, len(r.Keys)-len(r.Failed))
	for _, k := range r.Keys {
		if !slices.Contains(r.Failed, k) {
			out = append(out, k)
		}
	}
	return out
}

func pageTokens(p int) int {
	if p == 0 {
		return layout.DefaultPageTokens
	}
	return p
}

// checkPrefixTensors validates the views of a save (kind ErrInvalidRequest)
// or the destinations of a load (ErrDestination): dtype and itemsize,
// rank 2 to layout.MaxRank, valid view, at least tokens on axis -2, and for
// a load no overlapping elements.
func checkPrefixTensors(ts []TensorSpec, tokens int, kind error, what string, write bool) error {
	if len(ts) == 0 {
		return fmt.Errorf("%w: no %s", kind, what)
	}
	for i, t := range ts {
		v := t.View
		size, err := layout.ItemSize(t.DType)
		if err != nil {
			return fmt.Errorf("%w: %s %d: %v", kind, what, i, err)
		}
		if v.ItemSize == 0 {
			v.ItemSize = size // resolveTensors fills it in the copy the job uses
		}
		if v.ItemSize != size {
			return fmt.Errorf("%w: %s %d: view itemsize %d bytes, dtype %s has %d", kind, what, i, v.ItemSize, t.DType, size)
		}
		if len(v.Shape) < 2 || len(v.Shape) > layout.MaxRank {
			return fmt.Errorf("%w: %s %d: %d axes (want 2 to %d; axis -2 is tokens)", kind, what, i, len(v.Shape), layout.MaxRank)
		}
		if err := v.Validate(); err != nil {
			return fmt.Errorf("%w: %s %d: %v", kind, what, i, err)
		}
		if write {
			if err := v.CheckNoOverlap(); err != nil {
				return fmt.Errorf("%w: %s %d: %v", kind, what, i, err)
			}
		}
		if c := v.Shape[len(v.Shape)-2]; c < tokens {
			return fmt.Errorf("%w: %s %d holds %d tokens on axis -2, %d are needed", kind, what, i, c, tokens)
		}
	}
	if write {
		if err := checkDisjointViews(ts, kind, what); err != nil {
			return err
		}
	}
	return nil
}

// checkDisjointViews fails (kind) when two of ts's views address a common
// byte (gather.CheckDisjoint), naming the two: two destinations written
// at once would leave it holding either's bytes.
func checkDisjointViews(ts []TensorSpec, kind error, what string) error {
	views := make([]gather.View, len(ts))
	for i, t := range ts {
		views[i] = t.View
		if views[i].ItemSize == 0 {
			views[i].ItemSize, _ = layout.ItemSize(t.DType)
		}
	}
	if i, j, err := gather.CheckDisjoint(views); err != nil {
		return fmt.Errorf("%w: %s %d and %s %d share bytes of memory: %v", kind, what, i, what, j, err)
	}
	return nil
}

// resolveTensors returns a copy of ts whose views carry their dtype's
// itemsize (a TensorSpec may leave View.ItemSize 0); the caller's request
// is never modified. Unknown dtypes were refused by checkPrefixTensors.
func resolveTensors(ts []TensorSpec) []TensorSpec {
	out := make([]TensorSpec, len(ts))
	for i, t := range ts {
		out[i] = t
		if out[i].View.ItemSize == 0 {
			out[i].View.ItemSize, _ = layout.ItemSize(t.DType)
		}
	}
	return out
}
