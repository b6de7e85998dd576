package jobs

import (
	"context"
	"errors"
	"fmt"
	"path/filepath"
	"slices"
	"time"

	"github.com/kvpersist/kvpersist/engine/gather"
	"github.com/kvpersist/kvpersist/engine/layout"
	"github.com/kvpersist/kvpersist/engine/readio"
	"github.com/kvpersist/kvpersist/engine/store"
	"github.com/kvpersist/kvpersist/engine/vfs"
)

// foundPage is a page file a load opened and checked.
type foundPage struct {
	src  *readio.Source
	snap *layout.Snapshot
	lo   int // first token of the page in the prompt
}

// openPage opens the page file at path and decodes it: an open error is
// returned as is (vfs.IsNotExist for a missing page); a file that does not
// decode, or is not a page, wraps ErrCorrupt. The page is returned as a
// Source for ReadExtents (O_DIRECT when its file system allows and it is
// not in the page cache; see OpenSource), which the caller closes.
func openPage(cfg *Config, path string) (*readio.Source, *layout.Snapshot, error) {
	f, err := cfg.fs().Open(path)
	if err != nil {
		return nil, nil, err
	}
	snap, err := layout.Decode(f, path)
	if err == nil && snap.Page == nil {
		err = fmt.Errorf("%w: %s is not a page file (formatVersion %d)", layout.ErrInvalidHeader, path, snap.Header.FormatVersion)
	}
	if err != nil {
		f.Close()
		return nil, nil, fmt.Errorf("%w: page %s: %w", ErrCorrupt, path, err)
	}
	src, err := ownSource(cfg, f)
	if err != nil {
		f.Close()
		return nil, nil, err
	}
	return src, snap, nil
}

// pageExtent is the extent of tensor t of a page (stored at off from the
// page's data start) into dst, the destination's view of the page's token
// range; verified by the tensor's xxh3-64 with verify.
func pageExtent(fp *foundPage, t *layout.Tensor, dst *gather.View, group int, verify bool) readio.Extent {
	x := readio.Extent{Src: fp.src, Off: int64(fp.snap.DataStart) + t.Off, View: dst, Group: group}
	if verify {
		x.Verify = readio.VerifyXXH3
		x.XXH3 = layout.HashValue(t.Hash) // validated by Decode: 16 hex digits
	}
	return x
}

// LoadPrefix loads the longest stored prefix of req.Tokens from the prefix
// cache of <cfg.Root>/<req.Namespace> into req.Dest and reports its length
// in tokens (PrefixResult.Tokens, a multiple of PageTokens unless the
// prompt's last, partial page was stored as a leaf with exactly the
// prompt's remaining tokens).
//
// Order of work: (1) the request is checked: namespace, identity, page
// size, at least one token, every destination's dtype, itemsize, rank,
// validity, no overlapping elements within a destination or between two
// of them (gather.CheckDisjoint), and room for len(Tokens) tokens on axis
// -2; (2) the page files of the prefix are opened in chain order until one
// is missing (a miss, never an error: PrefixResult.Missing) or fails to
// open or decode (the prefix ends there: PrefixResult.Stop); each opened
// page is checked against the request: its key, identity, page size and
// token ids (a page that differs is corrupt: Stop wraps ErrCorrupt), and
// each tensor's dtype and shape (the destination's, axis -2 aside:
// ErrMismatch naming the tensor and what differs, for the first page; for
// a later one, whose tensors then disagree with the pages before it, Stop
// wraps ErrCorrupt); (3) only then are the destinations written, by
// ReadExtents: every tensor of every page found is one extent into the
// destination's token range, read with cfg.ReadDepth requests in flight
// across pages (O_DIRECT where the file system allows and the page is not
// in the page cache), straight into each contiguous run of the view (one
// preadv per request) when runs are at least MinRunBytes, else through
// staging and a scatter; with Verify each tensor is hashed (xxh3-64) as it
// streams in.
//
// What a destination holds afterwards, in its elements on axis -2 (every
// other byte of the caller's buffers is never written):
//   - error from step 1 or 2 (ErrInvalidRequest, ErrDestination,
//     ErrMismatch): nothing was written;
//   - success with Tokens = t: tokens [0, t) hold the stored KV; tokens
//     [t, capacity) hold what they held before, except that when Stop is
//     set (a page j failed verification or its read failed) tokens from
//     j's first token up to the end of the pages that were found may have
//     been overwritten with stored or partial data;
//   - ctx's error or ErrPanic: tokens [0, end of the pages found) are
//     undefined, the rest untouched.
//
// Files are opened without following symlinks; the load holds the
// namespace's lock shared (when the lock file exists). Destinations are
// not touched after LoadPrefix returns.
func LoadPrefix(ctx context.Context, cfg *Config, req *LoadPrefixRequest) (*PrefixResult, Metrics, error) {
	return LoadPrefixVerified(ctx, cfg, req, nil)
}

// LoadPrefixVerified is LoadPrefix for a caller that has just verified
// some pages' bytes itself: with req.Verify, a page whose key verified
// reports true is read without hashing its tensors again (its header, key,
// parent, identity, page size, token ids, dtypes and shapes are still
// checked as for any page). The engine's remote tier passes the pages its
// read-through fetched in the same job: each was verified (every tensor's
// xxh3-64, the key chain) from the temp file it then renamed into place.
// verified nil is LoadPrefix.
func LoadPrefixVerified(ctx context.Context, cfg *Config, req *LoadPrefixRequest, verified func(layout.PageKey) bool) (*PrefixResult, Metrics, error) {
	return LoadPrefixChain(ctx, cfg, req, nil, verified)
}

// LoadPrefixChain is LoadPrefixVerified given the prompt's page keys,
// keys = layout.PageChain(req.Identity, P, req.Tokens), which a caller that
// has already computed them (the engine: for its pins and its remote
// tier's read-through) passes so that the chain is hashed once per load;
// nil computes them. Keys of another length than the prompt's pages are
// ErrInvalidRequest; keys of the right length but not the prompt's chain
// are the caller's bug: a page stored under such a key is not loaded
// unless its header names the prompt's token ids (checkPage), but the
// prefix then reported may be shorter than the stored one.
func LoadPrefixChain(ctx context.Context, cfg *Config, req *LoadPrefixRequest, keys []layout.PageKey, verified func(layout.PageKey) bool) (*PrefixResult, Metrics, error) {
	return LoadPrefixScattered(ctx, cfg, req, keys, verified, nil)
}

// loadCheck is a prefix load's request after step 1: its namespace, page
// size in tokens, page keys and destinations (itemsizes resolved).
type loadCheck struct {
	ns    *store.Namespace
	p     int
	keys  []layout.PageKey
	dests []TensorSpec
}

// checkLoad is step 1 of a prefix load (see LoadPrefix): the request is
// checked, and keys computed when nil (else their count checked). Errors:
// ErrInvalidRequest, ErrDestination, or the namespace's.
func checkLoad(cfg *Config, req *LoadPrefixRequest, keys []layout.PageKey) (*loadCheck, error) {
	if req == nil {
		return nil, fmt.Errorf("%w: nil *LoadPrefixRequest", ErrInvalidRequest)
	}
	ns, err := cfg.namespace(req.Namespace)
	if err != nil {
		return nil, fmt.Errorf("jobs: load prefix %s: %w", req.Namespace, err)
	}
	p := pageTokens(req.PageTokens)
	n := len(req.Tokens)
	if n == 0 {
		return nil, fmt.Errorf("%w: load prefix %s: no tokens", ErrInvalidRequest, ns.Dir())
	}
	if keys == nil {
		keys, _, err = layout.PageChain(req.Identity, p, req.Tokens)
	} else if err = layout.CheckIdentity(req.Identity); err == nil {
		err = layout.CheckPageTokens(p)
	}
	if err != nil {
		return nil, fmt.Errorf("%w: load prefix %s: %w", ErrInvalidRequest, ns.Dir(), err)
	}
	if want := (n + p - 1) / p; len(keys) != want {
		return nil, fmt.Errorf("%w: load prefix %s: %d page keys given for %d pages of tokens", ErrInvalidRequest, ns.Dir(), len(keys), want)
	}
	if err := checkPrefixTensors(req.Dest, n, ErrDestination, "destination", true); err != nil {
		return nil, fmt.Errorf("load prefix %s: %w", ns.Dir(), err)
	}
	return &loadCheck{ns: ns, p: p, keys: keys, dests: resolveTensors(req.Dest)}, nil
}

// LoadPrefixScattered is LoadPrefixChain after sc (from NewPrefixScatter
// for the same req and keys; nil: none) scattered the first sc.Pages()
// pages of the prefix into the destinations: those pages are not opened
// or read again (they count as loaded: PrefixResult.Keys and Tokens
// include them, Metrics their bytes), and the load goes on from the page
// after them exactly as LoadPrefix would (a page there whose tensors
// differ from the destinations is corrupt, as any page after the first).
// When the scatter's read of a page failed (its tokens may hold partial
// data), the load reads nothing: the prefix is the pages before it and
// Stop says why, as when a load's own read fails; when it ended with
// ctx's error or ErrPanic, that is the load's error. So every outcome
// leaves the destinations as LoadPrefix documents. A failure of the
// namespace's lock or directory checks after pages were scattered ends
// the prefix after them (Stop) instead of failing the load (ctx's error
// still fails it). sc must not be used after this call.
func LoadPrefixScattered(ctx context.Context, cfg *Config, req *LoadPrefixRequest, keys []layout.PageKey, verified func(layout.PageKey) bool, sc *PrefixScatter) (*PrefixResult, Metrics, error) {
	start := time.Now()
	var m Metrics
	lc, err := checkLoad(cfg, req, keys)
	if err != nil {
		return nil, m, err
	}
	ns, p, keys, dests := lc.ns, lc.p, lc.keys, lc.dests
	n := len(req.Tokens)
	res := &PrefixResult{}
	first := 0 // the first page to open: those before it were scattered
	if sc != nil && (sc.req != req || len(sc.keys) != len(keys)) {
		return nil, m, fmt.Errorf("%w: load prefix %s: the scatter was made for another request", ErrInvalidRequest, ns.Dir())
	}
	if sc != nil {
		if sc.fatal != nil {
			return nil, m, sc.fatal
		}
		first = sc.done
		res.Keys = append(res.Keys, keys[:first]...)
		res.Tokens = min(n, first*p)
		m.LogicalBytes = sc.logical
		m.addReads(sc.read)
		if sc.stop != nil || first == len(keys) {
			res.Stop = sc.stop
			m.Elapsed = time.Since(start)
			return res, m, nil
		}
	}
	// scattered turns an error of the lock or directory checks into the
	// end of the prefix when pages were scattered (their tokens hold the
	// stored KV: the load succeeds with them); ctx's error stays an error.
	scattered := func(err error) (*PrefixResult, Metrics, error) {
		if first == 0 || ctx.Err() != nil {
			return nil, m, err
		}
		res.Stop = err
		m.Elapsed = time.Since(start)
		return res, m, nil
	}
	fsys := cfg.fs()
	unlock, _, err := ns.LockIfExists(ctx, false)
	if err != nil {
		return scattered(fmt.Errorf("jobs: load prefix %s: %w", ns.Dir(), err))
	}
	defer unlock()
	for _, d := range []string{ns.Dir(), ns.PagesDir()} {
		if err := checkDir(fsys, d); err != nil {
			return scattered(fmt.Errorf("jobs: load prefix %s: %w", ns.Dir(), err))
		}
	}
	// Step 2: open and check every page of the prefix.
	var found []foundPage
	defer func() {
		for _, fp := range found {
			fp.src.Close()
		}
	}()
	checked := map[string]error{}
	for i := first; i < len(keys); i++ {
		key := keys[i]
		if err := ctx.Err(); err != nil {
			return nil, m, err
		}
		path := ns.PagePath(key)
		dir := filepath.Dir(path)
		derr, ok := checked[dir]
		if !ok {
			derr = checkDir(fsys, dir)
			checked[dir] = derr
		}
		if derr != nil {
			return scattered(fmt.Errorf("jobs: load prefix: %w", derr))
		}
		src, snap, err := openPage(cfg, path)
		if err != nil {
			if vfs.IsNotExist(err) {
				k := key
				res.Missing = &k
			} else if errors.Is(err, ErrCorrupt) {
				res.Stop = err
			} else {
				res.Stop = fmt.Errorf("jobs: load prefix: open page %s: %w", path, err)
			}
			break
		}
		lo := i * p
		if err := checkPage(snap, key, req, lo, min(n, lo+p)); err != nil {
			src.Close()
			// A page that is not what its file name says (key, identity,
			// P, token ids) is corrupt, and so is one whose tensors
			// disagree with the pages before it (which matched the
			// destinations): the prefix ends there. Only the first page's
			// tensors meet the destinations alone, so a mismatch there is
			// the request's (ErrMismatch), and nothing is written.
			if !errors.Is(err, ErrCorrupt) {
				if i == 0 {
					return nil, m, err
				}
				err = fmt.Errorf("%w: %w", ErrCorrupt, err)
			}
			res.Stop = err
			break
		}
		found = append(found, foundPage{src: src, snap: snap, lo: lo})
	}
	// Step 3: read every tensor of every page found into its destination:
	// one extent each, in page order, all in one group (a failure skips
	// what follows it: those pages are past the prefix's end anyway).
	nt := len(dests)
	if len(found) > maxHeldBlocks {
		for _, fp := range found {
			fp.src.MakeLazy(int64(nt))
		}
	}
	exts, err := loadExtents(found, dests, req.Verify, verified)
	if err != nil {
		return nil, m, err
	}
	errs, st, err := readio.Read(ctx, cfg.reads(), exts, readio.Progress(exts, req.Progress))
	m.addReads(st)
	m.Elapsed = time.Since(start)
	if err != nil {
		return nil, m, err
	}
	loaded := len(found)
	for k, e := range errs {
		if e == nil {
			continue
		}
		// The first error in extent order is the first failed page's: an
		// extent is skipped only after an earlier one failed.
		loaded = k / nt
		res.Stop = pageReadError(found[loaded].snap.Path, k%nt, e)
		res.Missing = nil
		break
	}
	for _, fp := range found[:loaded] {
		res.Keys = append(res.Keys, fp.snap.Page.Key)
		res.Tokens = fp.lo + len(fp.snap.Page.Tokens)
		m.LogicalBytes += pageTensorBytes(fp.snap)
	}
	return res, m, nil
}

// pageReadError is the Stop of a load (or a scatter) whose read of tensor
// t of page file name failed with e: ErrBlockSize (the file is shorter
// than its header says) is also ErrCorrupt.
func pageReadError(name string, t int, e error) error {
	if errors.Is(e, ErrBlockSize) {
		e = fmt.Errorf("%w: %w", ErrCorrupt, e)
	}
	return fmt.Errorf("page %s tensor %d: %w", name, t, e)
}

// pageTensorBytes is the tensor bytes of a decoded page file (its one
// cache entry's tensors; header and alignment not counted).
func pageTensorBytes(snap *layout.Snapshot) int64 {
	var n int64
	for _, t := range snap.Header.Caches[0].Tensors {
		n += t.Bytes
	}
	return n
}

// loadExtents is one extent per tensor of every page found, in page then
// tensor order, each into its destination's view of the page's token range
// (axis -2), all of group 0; with verify, hashed unless verified says the
// page's key was verified already (nil: none was).
func loadExtents(found []foundPage, dests []TensorSpec, verify bool, verified func(layout.PageKey) bool) ([]readio.Extent, error) {
	nt := len(dests)
	exts := make([]readio.Extent, 0, len(found)*nt)
	views := make([]gather.View, len(found)*nt)
	rank := 0
	for _, d := range dests {
		rank += len(d.View.Shape)
	}
	shapes := make([]int, len(found)*rank) // every view's shape, back to back
	for pi := range found {
		fp := &found[pi]
		pv := verify && (verified == nil || !verified(fp.snap.Page.Key))
		for ti, t := range fp.snap.Header.Caches[0].Tensors {
			d := dests[ti].View
			k := pi*nt + ti
			shp := shapes[:len(d.Shape)]
			shapes = shapes[len(d.Shape):]
			v, err := d.SliceAxis(len(d.Shape)-2, fp.lo, fp.lo+len(fp.snap.Page.Tokens), shp)
			if err != nil { // checked: each destination holds every token
				return nil, fmt.Errorf("%w: load prefix: destination %d: %v", ErrDestination, ti, err)
			}
			views[k] = v
			exts = append(exts, pageExtent(fp, &t, &views[k], 0, pv))
		}
	}
	return exts, nil
}

// checkPage checks an opened page against the load's request before any
// destination is touched: the key it is stored under, identity, page size
// and token ids [lo, hi) of the prompt (a page that differs is not what
// its file name says: ErrCorrupt), then each tensor's dtype and shape (the
// destination's, axis -2 aside: ErrMismatch naming what differs).
func checkPage(snap *layout.Snapshot, key layout.PageKey, req *LoadPrefixRequest, lo, hi int) error {
	pg := snap.Page
	switch {
	case pg.Key != key:
		return fmt.Errorf("%w: page %s holds key %s", ErrCorrupt, snap.Path, pg.Key)
	case pg.Identity != req.Identity:
		return fmt.Errorf("%w: page %s has identity %q, the load %q", ErrCorrupt, snap.Path, pg.Identity, req.Identity)
	case pg.PageTokens != pageTokens(req.PageTokens):
		return fmt.Errorf("%w: page %s has %d tokens per page, the load %d", ErrCorrupt, snap.Path, pg.PageTokens, pageTokens(req.PageTokens))
	case !slices.Equal(pg.Tokens, req.Tokens[lo:hi]):
		return fmt.Errorf("%w: page %s holds other token ids than the prompt's [%d, %d)", ErrCorrupt, snap.Path, lo, hi)
	}
	ts := snap.Header.Caches[0].Tensors
	if len(ts) != len(req.Dest) {
		return fmt.Errorf("%w: page %s has %d tensors, the load %d destinations", ErrMismatch, snap.Path, len(ts), len(req.Dest))
	}
	for i, t := range ts {
		d := req.Dest[i]
		if diff := tensorDiff(t.DType, t.Shape, d.DType, d.View.Shape); diff != "" {
			return fmt.Errorf("%w: page %s tensor %d is %s%v, destination %d is %s%v: %s", ErrMismatch, snap.Path, i, t.DType, t.Shape, i, d.DType, d.View.Shape, diff)
		}
	}
	return nil
}

// tensorDiff says what differs between a stored page tensor and a
// destination other than axis -2 (tokens: a page holds its own count, a
// destination its capacity), or "" when nothing does.
func tensorDiff(dtype string, shape []int64, ddtype string, dshape []int) string {
	if dtype != ddtype {
		return fmt.Sprintf("dtype %s in the page, %s in the destination", dtype, ddtype)
	}
	if len(shape) != len(dshape) {
		return fmt.Sprintf("%d axes in the page, %d in the destination", len(shape), len(dshape))
	}
	for a := range shape {
		if a != len(shape)-2 && shape[a] != int64(dshape[a]) {
			return fmt.Sprintf("axis %d (of %d) has %d elements in the page, %d in the destination (only axis -2, tokens, may differ)", a, len(shape), shape[a], dshape[a])
		}
	}
	return ""
}
