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
	"github.com/kvpersist/kvpersist/engine/vfs"
)

// foundPage is a page file a load opened and checked.
type foundPage struct {
	src  *readio.Source
	snap *layout.Snapshot
	lo   int // first token of the page in the prompt
	// handed: the page's file was handed over by a PageSource (src reads
	// it, not its path); verified: its bytes were verified by the source
	// (its tensors are not hashed again).
	handed, verified bool
}

// openPage opens the page file at path and decodes it: an open error is
// returned as is (vfs.IsNotExist for a missing page); a file that does not
// decode, or is not a page, wraps ErrCorrupt. The page is returned as a
// Source for readio.Read (O_DIRECT when its file system allows and it is
// not in the page cache; see readio.OpenSource), which the caller closes.
func openPage(cfg *Config, path string) (*readio.Source, *layout.Snapshot, error) {
	f, err := cfg.fs().Open(path)
	if err != nil {
		return nil, nil, err
	}
	snap, err := layout.DecodePage(f, path)
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
// The pages come from src (nil: the local page files alone; see
// PageSource): the engine's remote tier hands over pages it fetches while
// the load reads the ones before them.
//
// Order of work: (1) the request is checked, once: namespace (resolved
// once, a real directory or absent), identity, page
// size, at least one token, every destination's dtype, itemsize, rank,
// validity, no overlapping elements within a destination or between two
// of them (gather.CheckDisjoint), and room for len(Tokens) tokens on axis
// -2; the page keys are computed and handed to src (Start); (2) the page
// files of the prefix are opened in chain order until one
// is missing (a miss, never an error: PrefixResult.Missing) or fails to
// open or decode (the prefix ends there: PrefixResult.Stop); each opened
// page is checked against the request: its key, identity, page size and
// token ids (a page that differs is corrupt: Stop wraps ErrCorrupt), and
// each tensor's dtype and shape (the destination's, axis -2 aside:
// ErrMismatch naming the tensor and what differs, for the first page; for
// a later one, whose tensors then disagree with the pages before it, Stop
// wraps ErrCorrupt); (3) only then are the destinations written, by
// readio.Read: every tensor of every page found is one extent into the
// destination's token range, read with cfg.ReadDepth requests in flight
// across pages (O_DIRECT where the file system allows and the page is not
// in the page cache), straight into each contiguous run of the view (one
// preadv per request) when runs are at least readio.MinRunBytes, else through
// staging and a scatter; with Verify each tensor is hashed (xxh3-64) as it
// streams in, except those of a page src verified itself. Steps 2 and 3
// run on the pages src holds ready, under the namespace's shared lock,
// then again on the next pages once src hands them over (a page fetched
// from the remote tier is read as soon as it is published, while the
// pages after it are still being fetched); a batch after the first that
// cannot take the lock or check the directories ends the prefix there
// (Stop) instead of failing the load.
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
// namespace's lock shared (when the lock file exists) while it opens and
// reads pages, never while it waits for src. Destinations are not touched
// after LoadPrefix returns; every File src handed over is closed.
func LoadPrefix(ctx context.Context, cfg *Config, req *LoadPrefixRequest, src PageSource) (*PrefixResult, Metrics, error) {
	start := time.Now()
	ch, dests, err := checkLoad(cfg, req)
	if err != nil {
		return nil, Metrics{}, err
	}
	if src != nil {
		src.Start(ctx, ch)
	}
	l := &prefixLoad{cfg: cfg, req: req, ch: ch, dests: dests, src: src, res: &PrefixResult{}}
	defer l.closeHanded()
	err = l.run(ctx)
	l.m.Elapsed = time.Since(start)
	if err != nil {
		return nil, l.m, err
	}
	return l.res, l.m, nil
}

// checkLoad is step 1 of a prefix load (see LoadPrefix): the request is
// checked, its namespace resolved and checked, its keys computed; it
// returns the chain and the destinations (itemsizes resolved). Errors:
// ErrInvalidRequest, ErrDestination, or the namespace's (layout.ErrBadName,
// store.ErrNamespace).
func checkLoad(cfg *Config, req *LoadPrefixRequest) (*PageChain, []TensorSpec, error) {
	if req == nil {
		return nil, nil, fmt.Errorf("%w: nil *LoadPrefixRequest", ErrInvalidRequest)
	}
	ns, err := cfg.namespace(req.Namespace)
	if err == nil {
		err = ns.Check()
	}
	if err != nil {
		return nil, nil, fmt.Errorf("jobs: load prefix %s: %w", req.Namespace, err)
	}
	p := pageTokens(req.PageTokens)
	n := len(req.Tokens)
	if n == 0 {
		return nil, nil, fmt.Errorf("%w: load prefix %s: no tokens", ErrInvalidRequest, ns.Dir())
	}
	keys, _, err := layout.PageChain(req.Identity, p, req.Tokens)
	if err != nil {
		return nil, nil, fmt.Errorf("%w: load prefix %s: %w", ErrInvalidRequest, ns.Dir(), err)
	}
	if err := checkPrefixTensors(req.Dest, n, ErrDestination, "destination", true); err != nil {
		return nil, nil, fmt.Errorf("load prefix %s: %w", ns.Dir(), err)
	}
	ch := &PageChain{NS: ns, Identity: req.Identity, PageTokens: p, Tokens: req.Tokens, Keys: keys}
	return ch, resolveTensors(req.Dest), nil
}

// prefixLoad is one LoadPrefix after its checks: the pages loaded so far
// and what it reports.
type prefixLoad struct {
	cfg   *Config
	req   *LoadPrefixRequest
	ch    *PageChain
	dests []TensorSpec
	src   PageSource
	res   *PrefixResult
	m     Metrics
	next  int              // the next page to ask for
	ended bool             // the prefix ended (res says why, or the chain's end)
	dirs  bool             // the namespace's directories were checked
	fans  map[string]error // fan-out directories checked
	// handed: Files src handed over, closed when the load returns (a
	// Source adopted from one does not close it).
	handed []vfs.File
}

func (l *prefixLoad) closeHanded() {
	for _, f := range l.handed {
		f.Close()
	}
}

// page asks src for page l.next (wait: see PageSource.Page); without a
// source every page is local and ready.
func (l *prefixLoad) page(ctx context.Context, wait bool) (SourcePage, bool) {
	if l.src == nil {
		return SourcePage{}, true
	}
	pg, ready := l.src.Page(ctx, l.next, wait)
	if pg.File != nil {
		l.handed = append(l.handed, pg.File)
	}
	return pg, ready
}

// run loads the prefix batch by batch: it waits (holding no lock) for the
// next page, then, under the namespace's shared lock, opens and checks it
// and every later page src holds ready, and reads them all at once.
func (l *prefixLoad) run(ctx context.Context) error {
	for !l.ended && l.next < len(l.ch.Keys) {
		pg, _ := l.page(ctx, true)
		if err := ctx.Err(); err != nil {
			return err
		}
		if err := l.batch(ctx, pg); err != nil {
			return err
		}
	}
	return nil
}

// batch opens, checks and reads the pages from l.next on (the first is
// pg) under the namespace's shared lock, asking src for more as long as it
// holds them ready.
func (l *prefixLoad) batch(ctx context.Context, pg SourcePage) error {
	ns, fsys := l.ch.NS, l.cfg.fs()
	// fail ends the prefix before this batch when pages were loaded
	// (their tokens hold the stored KV), else fails the load; ctx's error
	// always fails it.
	fail := func(err error) error {
		if len(l.res.Keys) == 0 || ctx.Err() != nil {
			return err
		}
		l.res.Stop, l.ended = err, true
		return nil
	}
	unlock, _, err := ns.LockIfExists(ctx, false)
	if err != nil {
		return fail(fmt.Errorf("jobs: load prefix %s: %w", ns.Dir(), err))
	}
	defer unlock()
	if !l.dirs {
		for _, d := range []string{ns.Dir(), ns.PagesDir()} {
			if err := checkDir(fsys, d); err != nil {
				return fail(fmt.Errorf("jobs: load prefix %s: %w", ns.Dir(), err))
			}
		}
		l.dirs, l.fans = true, map[string]error{}
	}
	var found []foundPage
	defer func() {
		for _, fp := range found {
			fp.src.Close()
		}
	}()
	for {
		i := l.next
		if err := ctx.Err(); err != nil {
			return err
		}
		fp, err := l.open(i, pg)
		if err != nil {
			l.ended = true
			if i == 0 && errors.Is(err, ErrMismatch) {
				return err // the request's: nothing written
			}
			break
		}
		found = append(found, fp)
		l.next++
		if l.next == len(l.ch.Keys) {
			l.ended = true
			break
		}
		var ready bool
		if pg, ready = l.page(ctx, false); !ready {
			break
		}
	}
	// Read every tensor of every page found into its destination: one
	// extent each, in page order, all in one group (a failure skips what
	// follows it: those pages are past the prefix's end anyway).
	nt := len(l.dests)
	if len(found) > maxHeldBlocks {
		for _, fp := range found {
			if !fp.handed {
				fp.src.MakeLazy(int64(nt))
			}
		}
	}
	exts, err := loadExtents(found, l.dests, !l.req.NoVerify)
	if err != nil {
		return err
	}
	errs, st, err := readio.Read(ctx, l.cfg.reads(), exts, readio.Progress(exts, l.req.Progress))
	l.m.addReads(st)
	if err != nil {
		return err
	}
	loaded := len(found)
	for k, e := range errs {
		if e == nil {
			continue
		}
		// The first error in extent order is the first failed page's: an
		// extent is skipped only after an earlier one failed.
		loaded = k / nt
		l.res.Stop = pageReadError(found[loaded].snap.Path, k%nt, e)
		l.res.Missing = nil
		l.ended = true
		break
	}
	for _, fp := range found[:loaded] {
		l.res.Keys = append(l.res.Keys, fp.snap.Page.Key)
		l.res.Tokens = fp.lo + len(fp.snap.Page.Tokens)
		l.m.LogicalBytes += pageTensorBytes(fp.snap)
	}
	return nil
}

// open opens and checks page i (handed over as pg, or its local file):
// an error ends the prefix there, and is recorded in l.res unless it is
// the request's (ErrMismatch at page 0: the load fails).
func (l *prefixLoad) open(i int, pg SourcePage) (foundPage, error) {
	ns, key := l.ch.NS, l.ch.Keys[i]
	path := ns.PagePath(key)
	var fp foundPage
	var err error
	if pg.Err != nil {
		l.res.Stop = fmt.Errorf("page %s: %w", key, pg.Err)
		return fp, l.res.Stop
	}
	if pg.File != nil {
		fp, err = l.openHanded(path, pg)
	} else {
		dir := filepath.Dir(path)
		derr, ok := l.fans[dir]
		if !ok {
			derr = ns.Store().CheckRealDir(dir)
			l.fans[dir] = derr
		}
		if derr != nil {
			// Not a directory: no page of this fan-out can be stored
			// here, so the page is missing and the prefix ends.
			k := key
			l.res.Missing, l.res.Stop = &k, fmt.Errorf("jobs: load prefix: page %s: %w", key, derr)
			return fp, l.res.Stop
		}
		fp.src, fp.snap, err = openPage(l.cfg, path)
	}
	if err != nil {
		switch {
		case vfs.IsNotExist(err):
			k := key
			l.res.Missing = &k
		case errors.Is(err, ErrCorrupt):
			l.res.Stop = err
		default:
			l.res.Stop = fmt.Errorf("jobs: load prefix: open page %s: %w", path, err)
		}
		return fp, err
	}
	lo := i * l.ch.PageTokens
	fp.lo = lo
	if err := checkPage(fp.snap, key, l.req, lo, min(len(l.req.Tokens), lo+l.ch.PageTokens)); err != nil {
		fp.src.Close()
		// A page that is not what its file name says (key, identity,
		// P, token ids) is corrupt, and so is one whose tensors
		// disagree with the pages before it (which matched the
		// destinations): the prefix ends there. Only the first page's
		// tensors meet the destinations alone, so a mismatch there is
		// the request's (ErrMismatch), and nothing is written.
		if !errors.Is(err, ErrCorrupt) {
			if i == 0 {
				return fp, err
			}
			err = fmt.Errorf("%w: %w", ErrCorrupt, err)
		}
		l.res.Stop = err
		return fp, err
	}
	return fp, nil
}

// openHanded makes a page src handed over ready to read: its header
// (pg.Head, or decoded from pg.File: a file that does not decode or is
// not a page wraps ErrCorrupt) and a Source of pg.File (read buffered or
// O_DIRECT as any page; pg.File stays open until the load returns).
func (l *prefixLoad) openHanded(path string, pg SourcePage) (foundPage, error) {
	fp := foundPage{snap: pg.Head, handed: true, verified: pg.Verified}
	if fp.snap == nil {
		var err error
		if fp.snap, err = layout.DecodePage(pg.File, path); err != nil {
			return fp, fmt.Errorf("%w: page %s: %w", ErrCorrupt, path, err)
		}
	}
	if fp.snap.Page == nil {
		return fp, fmt.Errorf("%w: page %s: %w: not a page file (formatVersion %d)", ErrCorrupt, path, layout.ErrInvalidHeader, fp.snap.Header.FormatVersion)
	}
	src, err := adoptSource(l.cfg, pg.File)
	if err != nil {
		return fp, err
	}
	fp.src = src
	return fp, nil
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
// (axis -2), all of group 0; with verify, hashed unless the page's source
// verified it already (foundPage.verified).
func loadExtents(found []foundPage, dests []TensorSpec, verify bool) ([]readio.Extent, error) {
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
		pv := verify && !fp.verified
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
