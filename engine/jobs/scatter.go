package jobs

import (
	"context"

	"github.com/kvpersist/kvpersist/engine/layout"
	"github.com/kvpersist/kvpersist/engine/vfs"
)

// PrefixScatter writes pages of a prefix load into its destinations
// before the load runs, in chain order from the first page, from page
// files a caller has just verified itself: the engine's remote tier
// scatters each fetched page while later pages are still being fetched
// (ARCHITECTURE.md, "Read-through (LoadPrefix)"), and LoadPrefixScattered
// then opens only the pages after them.
//
// The pages scattered are always a prefix of the chain, [0, Pages()), each
// page checked before any byte of it is written exactly as the load checks
// a page (checkPage: key, identity, page size, token ids, every tensor's
// dtype and shape against its destination), so the destinations hold what
// LoadPrefix would have written for those pages. A page that fails a
// check is not written, and no later page is. A read that fails leaves
// that page's tokens partly written; the scatter then ends, and the load
// reports it as its own read failure (Stop) and reads nothing more, so
// whatever happens the destinations end as LoadPrefix documents.
//
// A PrefixScatter is used by one goroutine (Page calls one after another)
// and handed to LoadPrefixScattered, which ends it. Every Page call returns
// only once its writes are done: nothing of the caller's destinations is
// touched after it returns.
type PrefixScatter struct {
	cfg   *Config
	req   *LoadPrefixRequest
	keys  []layout.PageKey
	dests []TensorSpec
	p     int

	done    int         // pages [0, done) are in the destinations
	ended   bool        // no later page may be scattered
	stop    error       // the read of page done failed: the prefix ends there (Stop)
	fatal   error       // ctx's error or ErrPanic during a read: the load's error
	logical int64       // tensor bytes of pages [0, done)
	last    int64       // tensor bytes of page done-1
	read    ExtentStats // what the scatter read
}

// NewPrefixScatter checks req as LoadPrefix's step 1 does (keys as for
// LoadPrefixChain: the prompt's chain, or nil to compute it) and returns a
// PrefixScatter for it. A request that fails the checks gets the error
// LoadPrefix would return (ErrInvalidRequest, ErrDestination, the
// namespace's) and no scatter: the caller then loads without one, and the
// load reports the error, nothing written. req must not change until the
// load that takes the scatter returns.
func NewPrefixScatter(cfg *Config, req *LoadPrefixRequest, keys []layout.PageKey) (*PrefixScatter, error) {
	lc, err := checkLoad(cfg, req, keys)
	if err != nil {
		return nil, err
	}
	return &PrefixScatter{cfg: cfg, req: req, keys: lc.keys, dests: lc.dests, p: lc.p}, nil
}

// Pages returns how many pages, from the first, are in the destinations.
func (s *PrefixScatter) Pages() int { return s.done }

// Page scatters page i of the chain, which must be Pages() (else nothing
// is done and it returns false), from f, an open read-only file of that
// page whose bytes the caller verified and no one writes any more (the
// engine: a fetched page checked, every tensor's xxh3-64, its header and
// key chain, from the bytes it wrote; the tensors are not hashed again).
// name names the page in errors. It decodes f's header, checks the page
// as the load would (key, identity, page size, token ids, tensors against
// the destinations) and only then reads every tensor into its
// destination's token range (ReadExtents: cfg.ReadDepth requests in
// flight, buffered when f is in the page cache), calling req.Progress as
// the load does. It returns true when page i is in the destinations. On
// false no later page may be scattered: the page failed a check (nothing
// of it written; the load checks it again from its own file) or its read
// failed (the load's Stop, or ctx's error / ErrPanic as the load's error).
// f is not closed.
//
// head, when not nil, is f's header already decoded by the caller
// (layout.Decode's result for the same bytes: the engine passes the one its
// remote.PageStream decoded from the very bytes it wrote to f), and f's
// header is not read nor decoded again (a page's header is a JSON of a few
// KiB: decoding it allocates about 2,300 objects); it is checked exactly as
// a decoded one. nil: Page decodes f's header itself.
func (s *PrefixScatter) Page(ctx context.Context, i int, name string, f vfs.File, head *layout.Snapshot) bool {
	if s.ended || i != s.done || i >= len(s.keys) {
		return false
	}
	s.ended = true // until page i is in
	snap := head
	if snap == nil {
		var err error
		if snap, err = layout.DecodePage(f, name); err != nil {
			return false
		}
	}
	if snap.Page == nil {
		return false
	}
	n := len(s.req.Tokens)
	lo := i * s.p
	if checkPage(snap, s.keys[i], s.req, lo, min(n, lo+s.p)) != nil {
		return false
	}
	src, err := AdoptSource(s.cfg, f)
	if err != nil {
		return false
	}
	defer src.Close()
	found := []foundPage{{src: src, snap: snap, lo: lo}}
	exts, err := loadExtents(found, s.dests, false, nil)
	if err != nil {
		return false
	}
	errs, st, err := readExtents(ctx, s.cfg, exts, extentProgress(exts, s.req.Progress))
	s.read.add(st)
	if err != nil {
		s.fatal = err
		return false
	}
	for k, e := range errs {
		if e != nil {
			s.stop = pageReadError(name, k, e)
			return false
		}
	}
	s.last = pageTensorBytes(snap)
	s.logical += s.last
	s.done++
	s.ended = false
	return true
}

// Retract ends the scatter at page i, the last page scattered (Pages()-1;
// any other i does nothing), when the caller learns after Page that it
// may not count as loaded (the engine: the page verified and was
// scattered beside its publish, which then failed): the load's prefix
// ends before page i, and Stop is err (page i's tokens hold its verified
// stored KV, which LoadPrefix's Stop clause allows); no later page is
// scattered.
func (s *PrefixScatter) Retract(i int, err error) {
	if i != s.done-1 || s.stop != nil || s.fatal != nil {
		return
	}
	s.done--
	s.logical -= s.last
	s.ended = true
	s.stop = err
}
