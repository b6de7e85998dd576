package jobs

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"path/filepath"
	"slices"
	"sync/atomic"
	"time"

	"github.com/kvpersist/kvpersist/engine/gather"
	"github.com/kvpersist/kvpersist/engine/layout"
	"github.com/kvpersist/kvpersist/engine/store"
	"github.com/kvpersist/kvpersist/engine/vfs"
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
	// load stopped for another reason), or whose fan-out directory
	// (pages/<xx>) is not a directory (then Stop says so too). The engine
	// drops it from its index.
	Missing *layout.PageKey
	// Stop, for a load, is why the prefix ended before a missing page or
	// the end of the tokens: a page that failed verification or is not
	// what its file name says (ErrCorrupt: another key, identity, page
	// size or token ids, or tensors unlike the pages before it), did not
	// decode, or could not be opened or read, or whose fan-out directory
	// is not a directory. The pages before it are loaded and counted in
	// Tokens. nil otherwise.
	Stop error
	// Failed, for a save: the keys of the pages it could not store
	// because their fan-out directory's path (pages/<xx>) is not a
	// directory (a stray file or symlink there, never replaced nor
	// followed), a per-page failure: the save's other pages are written
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

// SavePrefix stores the token pages of req.Tokens in the prefix cache of
// the namespace <cfg.Root>/<req.Namespace>: one page file per PageTokens
// tokens, and the partial last page as a leaf. Keys come from the token
// ids alone, so a page already stored costs no gather, no hash and no
// write: its file is reused when its header verifies and is the header
// this save would write apart from the tensor hashes (so it holds this
// key, parent, identity, token ids, dtypes and shapes: one read of the
// header, storedPage); any other file under the page's name is rewritten.
// Each new page is gathered (zero-copy where the view allows), hashed and
// written as a single file (layout.FormatPage) to a temp file, then
// fdatasynced and renamed by the save's syncers (as blocks are); then
// every fan-out directory holding a page of the save, pages/ and the
// namespace directory are fsynced (those of reused pages while the new pages are written), except
// the directory of a reused page that cfg.Durable knows durable with the
// FileID the save's lstat found (see DurablePages; ARCHITECTURE.md,
// "Known-durable pages"); on success every page is marked there. When
// SavePrefix returns nil, every page of the tokens is durable under its
// key.
//
// On error (including ctx's) no temp file is left; pages already renamed
// stay (each is complete and valid on its own, and reachable by a lookup
// only through its stored parents). The caller's views are not touched
// after SavePrefix returns.
//
// Errors: ErrInvalidRequest (nil request, no Config.Root, identity, page
// size, no tokens, a bad view or dtype, too few tokens on axis -2),
// layout.ErrBadName (namespace), store.ErrNamespace (a namespace that is a
// symlink or not a directory), ctx's error, or an I/O error naming the
// operation and path.
func SavePrefix(ctx context.Context, cfg *Config, req *SavePrefixRequest) (*PrefixResult, Metrics, error) {
	start := time.Now()
	if req == nil {
		return nil, Metrics{}, fmt.Errorf("%w: nil *SavePrefixRequest", ErrInvalidRequest)
	}
	ns, err := cfg.namespace(req.Namespace)
	if err != nil {
		return nil, Metrics{}, fmt.Errorf("jobs: save prefix: %w", err)
	}
	pl, err := PlanPrefixSave(req)
	if err != nil {
		return nil, Metrics{}, err
	}
	return savePlanned(ctx, cfg, ns, pl, start)
}

// SavePlannedPrefix is SavePrefix of the request pl was planned for
// (PlanPrefixSave), without keying and checking it again: the engine plans
// a save to reserve room for its new pages, then runs it with this. The
// request must not have changed since it was planned. Errors as
// SavePrefix's (the checks PlanPrefixSave made are not repeated); a nil pl
// is ErrInvalidRequest.
func SavePlannedPrefix(ctx context.Context, cfg *Config, pl *PagePlan) (*PrefixResult, Metrics, error) {
	start := time.Now()
	if pl == nil || pl.req == nil {
		return nil, Metrics{}, fmt.Errorf("%w: nil or empty *PagePlan", ErrInvalidRequest)
	}
	ns, err := cfg.namespace(pl.req.Namespace)
	if err != nil {
		return nil, Metrics{}, fmt.Errorf("jobs: save prefix: %w", err)
	}
	return savePlanned(ctx, cfg, ns, pl, start)
}

// savePlanned runs a checked, keyed save into ns.
func savePlanned(ctx context.Context, cfg *Config, ns *store.Namespace, pl *PagePlan, start time.Time) (*PrefixResult, Metrics, error) {
	var m Metrics
	req, keys, tensors, n := pl.req, pl.Keys, pl.tensors, len(pl.req.Tokens)
	// The namespace directory (never a symlink), durably (the root synced
	// in any case, as for Write), then its lock, shared: collect may not
	// sweep meanwhile.
	if err := ns.Check(); err != nil {
		return nil, m, fmt.Errorf("jobs: save prefix %s: %w", ns.Dir(), err)
	}
	if err := ns.Create(); err != nil {
		return nil, m, fmt.Errorf("jobs: save prefix %s: %w", ns.Dir(), err)
	}
	unlock, err := ns.Lock(ctx, false)
	if err != nil {
		return nil, m, fmt.Errorf("jobs: save prefix %s: %w", ns.Dir(), err)
	}
	defer unlock()
	res := &PrefixResult{Keys: keys, Tokens: n}
	err = savePages(ctx, cfg, ns, req.Identity, pl.PageTokens, req.Tokens, tensors, keys, res, &m, req.Progress)
	m.Elapsed = time.Since(start)
	return res, m, err
}

// savePages stores the pages keys (PageChain of tokens) of tensors in
// ns's pages/ (paths and directories from engine/store), the namespace
// already created and locked: stored pages are reused (storedPage), new
// ones written and committed by the fsync waiters, which meanwhile fsync
// the fan-out directories of the reused pages not known durable (a
// concurrent writer, or one that died, may have renamed one in without
// syncing: cfg.Durable, "Known-durable pages" in ARCHITECTURE.md); then
// each new page is lstat'ed and the fan-out directories of the new pages,
// pages/ and the namespace directory are fsynced; on success every page is marked durable with
// the FileID of the lstat that preceded its directory's fsync (or of the
// mark it matched). It fills res's counts and m's
// write metrics, and tells progress (when non-nil), on this goroutine,
// each page's tensor bytes once the page is reused or published.
func savePages(ctx context.Context, cfg *Config, ns *store.Namespace, identity string, p int, tokens []uint32, tensors []TensorSpec, keys []layout.PageKey, res *PrefixResult, m *Metrics, progress func(int64)) error {
	st := ns.Store()
	n := len(tokens)
	pagesDir := ns.PagesDir()
	if err := ns.CreatePagesDir(); err != nil {
		return fmt.Errorf("jobs: save pages %s: %w", ns.Dir(), err)
	}
	var err error
	c := newCommitter(ctx, st, pagesDir, len(keys))
	var copied, peak atomic.Int64
	// Progress: a new page's tensor bytes count once its commit succeeded
	// (published, added by the syncer), and are told here, on the save's
	// goroutine, between pages and at the end: never for a page that then
	// fails to publish.
	var published atomic.Int64
	var told int64
	tell := func() {
		if d := published.Load() - told; d > 0 && progress != nil {
			told += d
			progress(d)
		}
	}
	made := map[string]bool{}     // fan-out directories created or checked
	badDirs := map[string]error{} // fan-out paths that are not directories
	// newDirs: fan-out directories fsynced at the end: of new pages, and of
	// reused ones found after their early fsync was handed.
	newDirs := map[string]bool{}
	early := map[string]bool{} // fan-out directories of reused pages: fsynced by the committer
	shapes := make([][]int, len(tensors))
	for i, t := range tensors {
		shapes[i] = make([]int, len(t.View.Shape))
	}
	var hdr []byte // scratch for storedPage
	// ids[i]: the FileID of page i's file from an lstat made before its
	// directory's fsync (reused pages: storedPage's; new pages: after the
	// commits), or the mark it matched; the zero FileID when unknown.
	ids := make([]vfs.FileID, len(keys))
	var fresh []int // positions of the pages this save publishes
	marks := cfg.Durable
	if !st.Durable() {
		marks = nil // nothing is fsynced: nothing is known durable
	}
	parent := layout.PageRoot(identity, p)
	for i, key := range keys {
		tell()
		if c.failed() {
			break
		}
		if err = ctx.Err(); err != nil {
			break
		}
		lo, hi := i*p, min(n, (i+1)*p)
		page := &layout.Page{Key: key, Parent: parent, Identity: identity, PageTokens: p, Tokens: tokens[lo:hi]}
		parent = key
		path := ns.PagePath(key)
		dir := filepath.Dir(path)
		if !made[dir] {
			if err = ns.CreateFanout(dir); errors.Is(err, store.ErrNamespace) {
				// Not a directory: this fan-out's pages fail, the others
				// are still written (see PrefixResult.Failed).
				badDirs[dir], err = fmt.Errorf("jobs: save prefix: page directory %s: %w", dir, err), nil
			} else if err != nil { // synced below
				err = fmt.Errorf("jobs: save prefix: page directory %s: %w", dir, err)
				break
			}
			made[dir] = true
		}
		if berr := badDirs[dir]; berr != nil {
			res.Failed = append(res.Failed, key)
			if res.FailedErr == nil {
				res.FailedErr = berr
			}
			continue
		}
		var pl *plannedPage
		if pl, err = planPage(tensors, shapes, page, lo, path); err != nil {
			break
		}
		m.LogicalBytes += pl.size - pl.dataStart
		var reuse, exists bool
		var id vfs.FileID
		if reuse, exists, id, hdr, err = storedPage(st.FS(), path, pl, hdr); err != nil {
			break
		}
		if reuse {
			res.PagesReused++
			res.BytesReused += pl.size
			ids[i] = id
			known := marks != nil && id != (vfs.FileID{}) && marks.DurableID(ns.Name(), key) == id
			switch {
			case !st.Durable() || known:
			case !early[dir]:
				// fsynced by the committer, after this lstat
				early[dir] = true
				c.hand(stagedBlock{dir: dir})
			default:
				// An earlier page's fsync of dir may have run before
				// this page's lstat: fsync dir again at the end.
				newDirs[dir] = true
			}
			if progress != nil {
				progress(pl.tensorBytes)
			}
			continue
		}
		if exists {
			res.PagesReplaced++
		}
		newDirs[dir] = true
		fresh = append(fresh, i)
		tb := pl.tensorBytes
		if err = stagePage(ctx, cfg, st, c, pl, &copied, &peak, func() { published.Add(tb) }); err != nil {
			break
		}
	}
	syncErr := c.stop(err != nil)
	if err == nil {
		err = syncErr
	}
	tell() // pages published since the last call, whatever the outcome
	if err == nil && st.Durable() {
		// The new pages' FileIDs, each from an lstat before its
		// directory's fsync below: whatever file that lstat saw (ours,
		// or one a concurrent writer renamed over it) is durable under
		// the name once the fsync returns.
		if marks != nil {
			for _, i := range fresh {
				if fi, lerr := st.FS().Lstat(ns.PagePath(keys[i])); lerr == nil {
					ids[i] = vfs.IDOf(fi)
				}
			}
		}
		// The fan-out directories, pages/ (which holds their entries)
		// and the namespace directory (which holds pages/'s: CreatePagesDir
		// syncs it only when it made pages/, and another process may have
		// made it and died before its fsync) at once: each must be durable
		// before the ack, in no order.
		dirs := make([]string, 0, len(newDirs)+2)
		for d := range newDirs {
			dirs = append(dirs, d)
		}
		slices.Sort(dirs)
		dirs = append(dirs, pagesDir, ns.Dir())
		err = syncDirs(ctx, st, dirs, pagesDir)
		if err == nil && marks != nil {
			marks.MarkDurable(ns.Name(), keys, ids)
		}
	}
	res.PagesWritten = int(c.files.Load())
	res.BytesWritten = c.written.Load()
	m.WrittenBytes, m.ReusedBytes = res.BytesWritten, res.BytesReused
	m.BlocksWritten, m.BlocksReused = int64(res.PagesWritten), int64(res.PagesReused)
	m.CopiedBytes, m.ScratchPeak = copied.Load(), peak.Load()
	return err
}

// plannedPage is a page file laid out before any byte is gathered: its
// header with placeholder hashes (js), data start and size in bytes
// (hashes have a fixed length, so the size is known up front), and the
// sum of its tensors' bytes.
type plannedPage struct {
	ws              *writeSpec
	h               *layout.Header
	slots           []slotIn
	js              []byte
	dataStart, size int64
	tensorBytes     int64
}

// planPage builds a page's header (layout.FormatPage) and file layout from
// the save's tensors sliced to tokens [lo, lo+len(page.Tokens)) of axis
// -2. shapes are per-tensor shape buffers, overwritten.
func planPage(ts []TensorSpec, shapes [][]int, page *layout.Page, lo int, path string) (*plannedPage, error) {
	sliced := make([]TensorSpec, len(ts))
	for i, t := range ts {
		v, err := t.View.SliceAxis(len(t.View.Shape)-2, lo, lo+len(page.Tokens), shapes[i])
		if err != nil {
			return nil, fmt.Errorf("%w: save prefix %s tensor %d: %v", ErrInvalidRequest, path, i, err)
		}
		sliced[i] = TensorSpec{DType: t.DType, View: v}
	}
	pl := &plannedPage{ws: &writeSpec{Path: path, WriteRequest: &WriteRequest{Layout: layout.Single, Meta: layout.Meta{"page": page.MetaJSON()}, Caches: []EntrySpec{{Tensors: sliced}}}}}
	var err error
	if pl.h, pl.slots, err = buildHeader(pl.ws, layout.FormatPage); err != nil {
		return nil, err
	}
	var end int64
	if pl.js, pl.dataStart, end, err = planSingle(path, pl.h, pl.slots); err != nil {
		return nil, err
	}
	if len(pl.js) > layout.MaxPageHeaderLen { // no reader would take it
		return nil, fmt.Errorf("%w: save prefix %s: page header of %d bytes exceeds %d", ErrInvalidRequest, path, len(pl.js), layout.MaxPageHeaderLen)
	}
	pl.size = pl.dataStart + end
	for _, t := range pl.h.Caches[0].Tensors {
		pl.tensorBytes += t.Bytes
	}
	return pl, nil
}

// hashPlaceholder is how a planned header's tensor hash reads (planSingle).
var hashPlaceholder = []byte(`"hash":"0000000000000000"`)

// storedPage decides whether the file at path is the planned page, so that
// a save may reuse it: a regular file of the planned size whose prefix
// (magic, header length, data start) and header hash verify and whose
// header JSON equals the planned one byte for byte, except that each
// tensor hash may be any 16 lowercase hex digits. One read of the header
// (about 10 KiB at Llama-3.1-8B geometry, into buf, grown as needed and
// returned): no JSON is decoded, and the page's data is not read (a load
// with verification finds a corrupt tensor). exists reports whether
// anything is at path (to be replaced when not reusable; a directory is an
// error). A file that cannot be opened or read whole is not reusable. id
// is the FileID of the lstat that found the file (vfs.IDOf), taken before
// the file is opened.
func storedPage(fsys vfs.FS, path string, pl *plannedPage, buf []byte) (reuse, exists bool, id vfs.FileID, _ []byte, err error) {
	fi, err := fsys.Lstat(path)
	if err != nil {
		if vfs.IsNotExist(err) {
			return false, false, id, buf, nil
		}
		return false, false, id, buf, fmt.Errorf("jobs: save prefix: stat page %s: %w", path, err)
	}
	if fi.IsDir() {
		return false, true, id, buf, fmt.Errorf("jobs: save prefix: page path %s is a directory", path)
	}
	if !fi.Mode().IsRegular() || fi.Size() != pl.size {
		return false, true, id, buf, nil
	}
	id = vfs.IDOf(fi)
	f, err := fsys.Open(path) // no symlink followed, no FIFO blocks
	if err != nil {
		return false, !vfs.IsNotExist(err), id, buf, nil
	}
	defer f.Close()
	n := layout.PrefixLen + len(pl.js)
	if cap(buf) < n {
		buf = make([]byte, n)
	}
	buf = buf[:n]
	if layout.ReadFull(f, buf, 0) != nil {
		return false, true, id, buf, nil
	}
	return sameHeader(buf, pl.js, pl.dataStart), true, id, buf, nil
}

// sameHeader reports whether file (a file's first PrefixLen+len(js)
// bytes) is a kvpersist prefix and header whose hash verifies, whose data
// starts at dataStart, and whose JSON equals js except that the 16 digits
// of each tensor hash placeholder of js may be any lowercase hex digits.
func sameHeader(file, js []byte, dataStart int64) bool {
	p, err := layout.ParsePrefix(file[:layout.PrefixLen])
	if err != nil || p.Legacy || int(p.HeaderLen) != len(js) || int64(p.DataStart) != dataStart {
		return false
	}
	stored := file[layout.PrefixLen:]
	if p.ComputeHeaderHash(stored) != p.HeaderHash {
		return false
	}
	at := 0
	for {
		j := bytes.Index(js[at:], hashPlaceholder)
		if j < 0 {
			return bytes.Equal(stored[at:], js[at:])
		}
		digits := at + j + len(`"hash":"`)
		if !bytes.Equal(stored[at:digits], js[at:digits]) {
			return false
		}
		for _, c := range stored[digits : digits+16] {
			if (c < '0' || c > '9') && (c < 'a' || c > 'f') {
				return false
			}
		}
		at = digits + 16
	}
}

// stagePage writes a planned page to a temp file and hands it to c, which
// calls done once the page is published.
func stagePage(ctx context.Context, cfg *Config, st *store.Store, c *committer, pl *plannedPage, copied, peak *atomic.Int64, done func()) error {
	sf, err := layout.Stage(st.FS(), pl.ws.Path, pl.size)
	if err != nil {
		return fmt.Errorf("jobs: save prefix: %w", err)
	}
	handed := false
	defer func() {
		if !handed { // an error or a panic before the hand-off
			sf.Abort()
		}
	}()
	if err := fillSingle(ctx, cfg, st, pl.ws.Path, pl.h, pl.slots, len(pl.js), pl.dataStart, sf.File, copied, peak); err != nil {
		return err
	}
	c.hand(stagedBlock{s: sf, n: pl.size, done: done})
	handed = true
	return nil
}

// foundPage is a page file a load opened and checked.
type foundPage struct {
	src  *Source
	snap *layout.Snapshot
	lo   int // first token of the page in the prompt
}

// openPage opens the page file at path and decodes it: an open error is
// returned as is (vfs.IsNotExist for a missing page); a file that does not
// decode, or is not a page, wraps ErrCorrupt. The page is returned as a
// Source for ReadExtents (O_DIRECT when its file system allows and it is
// not in the page cache; see OpenSource), which the caller closes.
func openPage(cfg *Config, path string) (*Source, *layout.Snapshot, error) {
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
func pageExtent(fp *foundPage, t *layout.Tensor, dst *gather.View, group int, verify bool) Extent {
	x := Extent{Src: fp.src, Off: int64(fp.snap.DataStart) + t.Off, View: dst, Group: group}
	if verify {
		x.Verify = VerifyXXH3
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
			derr = ns.Store().CheckRealDir(dir)
			checked[dir] = derr
		}
		if derr != nil {
			// Not a directory: no page of this fan-out can be stored
			// here, so the page is missing and the prefix ends.
			k := key
			res.Missing, res.Stop = &k, fmt.Errorf("jobs: load prefix: page %s: %w", key, derr)
			break
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
			fp.src.makeLazy(int64(nt))
		}
	}
	exts, err := loadExtents(found, dests, req.Verify, verified)
	if err != nil {
		return nil, m, err
	}
	errs, st, err := readExtents(ctx, cfg, exts, extentProgress(exts, req.Progress))
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
func loadExtents(found []foundPage, dests []TensorSpec, verify bool, verified func(layout.PageKey) bool) ([]Extent, error) {
	nt := len(dests)
	exts := make([]Extent, 0, len(found)*nt)
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

// checkIdentity fails with ErrMismatch unless want is empty or equals the
// identity snap was written with.
func checkIdentity(snap *layout.Snapshot, want string) error {
	if want == "" {
		return nil
	}
	got, ok := snap.Header.Identity()
	if !ok {
		return fmt.Errorf("%w: %s was written without an identity, the read names %q", ErrMismatch, snap.Path, want)
	}
	if got != want {
		return fmt.Errorf("%w: %s has identity %q, the read names %q", ErrMismatch, snap.Path, got, want)
	}
	return nil
}

// ErrMissingPage: a page named by a page manifest does not exist.
var ErrMissingPage = errors.New("missing page")

// cacheSlots is the number of cache tensors of h (the first slots).
func cacheSlots(h *layout.Header) int {
	n := 0
	for _, e := range h.Caches {
		n += len(e.Tensors)
	}
	return n
}

// checkPagesSpec validates what the Pages layout adds to a write: an
// identity, a page size, at least one token, every cache tensor with at
// least 2 axes and exactly len(Tokens) tokens on axis -2, no caller
// metadata named "pages".
func checkPagesSpec(spec *writeSpec, slots []slotIn) error {
	if _, _, err := layout.PageChain(spec.Identity, pageTokens(spec.PageTokens), nil); err != nil {
		return fmt.Errorf("%w: %s: pages layout: %w", ErrInvalidRequest, spec.Path, err)
	}
	n := len(spec.Tokens)
	if n == 0 {
		return fmt.Errorf("%w: %s: pages layout without token ids", ErrInvalidRequest, spec.Path)
	}
	if _, ok := spec.Meta["pages"]; ok {
		return fmt.Errorf("%w: %s: metadata key \"pages\" is reserved in the pages layout", ErrInvalidRequest, spec.Path)
	}
	nc := 0
	for _, e := range spec.Caches {
		nc += len(e.Tensors)
	}
	if nc == 0 {
		return fmt.Errorf("%w: %s: pages layout without cache tensors", ErrInvalidRequest, spec.Path)
	}
	for _, s := range slots[:nc] {
		sh := s.t.View.Shape
		if len(sh) < 2 || sh[len(sh)-2] != n {
			return fmt.Errorf("%w: %s %s: shape %v; the pages layout needs axis -2 = the %d tokens", ErrInvalidRequest, spec.Path, s.name, sh, n)
		}
	}
	return nil
}

// writePages writes a named snapshot in the Pages layout (the namespace
// created and locked by Write): the cache tensors are saved as token pages
// (savePages: pages already stored are reused, shared with the prefix
// cache), then, once every page is durable, the page manifest is published
// like a single file whose data region holds only the attachments.
func writePages(ctx context.Context, cfg *Config, ns *store.Namespace, spec *writeSpec, h *layout.Header, slots []slotIn, m *Metrics) error {
	p := pageTokens(spec.PageTokens)
	nc := cacheSlots(h)
	keys, _, err := layout.PageChain(spec.Identity, p, spec.Tokens)
	if err != nil {
		return fmt.Errorf("%w: %s: %w", ErrInvalidRequest, spec.Path, err)
	}
	tensors := make([]TensorSpec, nc)
	for i, s := range slots[:nc] {
		tensors[i] = TensorSpec{DType: s.t.DType, View: s.view}
		m.LogicalBytes += s.out.Bytes
	}
	res := &PrefixResult{Keys: keys}
	var pm Metrics
	if err := savePages(ctx, cfg, ns, spec.Identity, p, spec.Tokens, tensors, keys, res, &pm, nil); err != nil {
		return err
	}
	if res.FailedErr != nil { // a manifest names every page: none may fail
		return res.FailedErr
	}
	list := &layout.PageList{Identity: spec.Identity, PageTokens: p, Tokens: len(spec.Tokens), Keys: keys}
	meta := make(layout.Meta, len(h.Meta)+1)
	for k, v := range h.Meta {
		meta[k] = v
	}
	meta["pages"] = list.MetaJSON()
	h.Meta = meta
	var am Metrics
	if err := writeSingle(ctx, cfg, ns, spec, h, slots[nc:], &am); err != nil {
		return err
	}
	m.LogicalBytes += am.LogicalBytes
	m.WrittenBytes = pm.WrittenBytes + am.WrittenBytes
	m.ReusedBytes = pm.ReusedBytes
	m.BlocksWritten, m.BlocksReused = pm.BlocksWritten, pm.BlocksReused
	m.CopiedBytes = pm.CopiedBytes + am.CopiedBytes
	m.ScratchPeak = max(pm.ScratchPeak, am.ScratchPeak)
	return nil
}

// pagedRead is the read plan of a page manifest: one extent per tensor of
// every page (the first paged of exts) and per attachment.
type pagedRead struct {
	srcs  []*Source // the pages', then the manifest's
	exts  []Extent
	paged int // extents of page tensors, before the attachments'
	// pageErr: a page is missing or unlike the manifest; every cache slot
	// fails with it, and none of them is read.
	pageErr error
}

func (pr *pagedRead) close() {
	for _, s := range pr.srcs {
		s.Close()
	}
}

// pagedExtents plans the read of a page manifest into dest (one buffer per
// slot, exactly its bytes, checked by Read): every page is opened and
// checked against the manifest first (key, identity, page size, token
// count, tensors' dtypes and shapes); a missing or mismatching page
// (ErrMissingPage, ErrCorrupt) is pageErr, and then only the attachments
// are planned. Else each page tensor is one extent into its token range of
// its slot (a row-major view of dest), grouped by slot, verified with the
// page's hash, and each attachment one extent from the manifest f. The
// error is one of making the manifest's Source; close the plan in any
// case.
func pagedExtents(cfg *Config, f vfs.File, snap *layout.Snapshot, dest [][]byte, verify bool) (*pagedRead, error) {
	fsys := cfg.fs()
	pl := snap.Pages
	slots := snap.Header.Slots()
	nc := cacheSlots(snap.Header)
	ns, _ := store.NamespaceOf(snap.Path, cfg.storeOptions())
	pr := &pagedRead{}
	pages := make([]foundPage, 0, len(pl.Keys))
	pr.pageErr = func() error {
		if err := checkDir(fsys, ns.PagesDir()); err != nil {
			return err
		}
		for i, k := range pl.Keys {
			path := ns.PagePath(k)
			if err := checkDir(fsys, filepath.Dir(path)); err != nil {
				return err
			}
			src, ps, err := openPage(cfg, path)
			if err != nil {
				if vfs.IsNotExist(err) {
					return fmt.Errorf("%w: %s", ErrMissingPage, path)
				}
				return err
			}
			pr.srcs = append(pr.srcs, src)
			lo := i * pl.PageTokens
			pages = append(pages, foundPage{src: src, snap: ps, lo: lo})
			pg := ps.Page
			if pg.Key != k || pg.Identity != pl.Identity || pg.PageTokens != pl.PageTokens || len(pg.Tokens) != min(pl.PageTokens, pl.Tokens-lo) || len(ps.Header.Caches[0].Tensors) != nc {
				return fmt.Errorf("%w: page %s does not match the manifest (key, identity, page size, tokens or tensor count)", ErrCorrupt, path)
			}
			for ti, t := range ps.Header.Caches[0].Tensors {
				want := slots[ti]
				same := t.DType == want.DType && len(t.Shape) == len(want.Shape)
				for a := 0; same && a < len(t.Shape); a++ {
					same = a == len(t.Shape)-2 || t.Shape[a] == want.Shape[a]
				}
				if !same {
					return fmt.Errorf("%w: page %s tensor %d is %s%v, the manifest's %s%v", ErrCorrupt, path, ti, t.DType, t.Shape, want.DType, want.Shape)
				}
			}
		}
		return nil
	}()
	if pr.pageErr != nil {
		pages = nil // read the attachments only
	}
	if len(pages) > maxHeldBlocks {
		for _, fp := range pages {
			fp.src.makeLazy(int64(nc))
		}
	}
	// The slots as row-major views of dest.
	whole := make([]gather.View, nc)
	for i := range nc {
		shape := make([]int, len(slots[i].Shape))
		for a, d := range slots[i].Shape {
			shape[a] = int(d)
		}
		size, _ := layout.ItemSize(slots[i].DType)
		whole[i] = gather.View{Base: dest[i], Shape: shape, Strides: gather.RowMajor(shape), ItemSize: size}
	}
	pr.exts = make([]Extent, 0, len(pages)*nc+len(slots)-nc)
	views := make([]gather.View, len(pages)*nc)
	for pi := range pages {
		fp := &pages[pi]
		for ti, t := range fp.snap.Header.Caches[0].Tensors {
			d := whole[ti]
			v, err := d.SliceAxis(len(d.Shape)-2, fp.lo, fp.lo+len(fp.snap.Page.Tokens), make([]int, len(d.Shape)))
			if err != nil { // the page's token range was checked against the manifest's
				return pr, fmt.Errorf("%w: page %s: %v", ErrCorrupt, fp.snap.Path, err)
			}
			views[pi*nc+ti] = v
			pr.exts = append(pr.exts, pageExtent(fp, &t, &views[pi*nc+ti], ti, verify))
		}
	}
	pr.paged = len(pr.exts)
	if len(slots) > nc {
		src, err := AdoptSource(cfg, f)
		if err != nil {
			return pr, err
		}
		pr.srcs = append(pr.srcs, src)
		for i := nc; i < len(slots); i++ {
			t := slots[i]
			x := Extent{Src: src, Off: int64(snap.DataStart) + t.Off, Dst: dest[i], Group: i}
			if verify {
				x.Verify = VerifyXXH3
				x.XXH3 = layout.HashValue(t.Hash) // validated by Decode: 16 hex digits
			}
			pr.exts = append(pr.exts, x)
		}
	}
	return pr, nil
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
