package jobs

import (
	"bytes"
	"cmp"
	"context"
	"errors"
	"fmt"
	"path/filepath"
	"slices"
	"sync/atomic"
	"time"

	"github.com/kvpersist/kvpersist/engine/layout"
	"github.com/kvpersist/kvpersist/engine/store"
	"github.com/kvpersist/kvpersist/engine/vfs"
	"github.com/zeebo/xxh3"
)

// SavePrefix stores the token pages of req.Tokens in the prefix cache of
// the namespace <cfg.Root>/<req.Namespace>: one page file per PageTokens
// tokens, and the partial last page as a leaf. Keys come from the token
// ids alone, so a page already stored costs no gather, no hash and no
// write: its file is reused when its header verifies and is the header
// this save would write apart from the tensor hashes (so it holds this
// key, parent, identity, token ids, dtypes and shapes: one read of the
// header, storedPage; not even that for a file cfg.Durable marked with
// the same FileID and header, see DurablePages); any other file under the
// page's name is rewritten.
// Each new page is gathered (zero-copy where the view allows), hashed and
// written as a single file (layout.FormatPage) to a temp file, then
// fdatasynced and renamed by the save's syncers (as blocks are); then
// every fan-out directory holding a page of the save, pages/, the
// namespace directory and the root are fsynced (those of reused pages
// while the new pages are written, the others at the end), except the
// directory of a reused page that cfg.Durable knows durable with the
// FileID the save's lstat found (see DurablePages; ARCHITECTURE.md,
// "Known-durable pages"); on success every page is marked there. When
// SavePrefix returns nil, every page of the tokens is durable under its
// key, except those of PrefixResult.Failed (a stray entry at a fan-out
// directory's or a page's path: those pages alone are not stored).
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
	var m Metrics
	if req == nil {
		return nil, m, fmt.Errorf("%w: nil *SavePrefixRequest", ErrInvalidRequest)
	}
	ns, err := cfg.namespace(req.Namespace)
	if err != nil {
		return nil, m, fmt.Errorf("jobs: save prefix: %w", err)
	}
	if len(req.Tokens) == 0 {
		return nil, m, fmt.Errorf("%w: save prefix %s: no tokens", ErrInvalidRequest, req.Namespace)
	}
	if err := checkPrefixTensors(req.Tensors, len(req.Tokens), ErrInvalidRequest, "tensor", false); err != nil {
		return nil, m, fmt.Errorf("save prefix %s: %w", req.Namespace, err)
	}
	ps, err := planPageSave(ns, req.Identity, pageTokens(req.PageTokens), req.Tokens, resolveTensors(req.Tensors))
	if err != nil {
		return nil, m, fmt.Errorf("save prefix %s: %w", req.Namespace, err)
	}
	// The namespace directory (never a symlink); room for the new pages
	// (cfg.Admission); the directory, durably (the root synced in any
	// case, as for Write, but with the save's other directories at the
	// end: savePages); then its lock, shared: collect may not sweep
	// meanwhile, and no engine evicts the pages the admission found
	// stored (confirmed under it).
	if err := ns.Check(); err != nil {
		return nil, m, fmt.Errorf("jobs: save prefix %s: %w", ns.Dir(), err)
	}
	if err := ps.admit(ctx, cfg, ns); err != nil {
		return nil, m, err
	}
	if err := ns.CreateLeavingRoot(); err != nil {
		return nil, m, fmt.Errorf("jobs: save prefix %s: %w", ns.Dir(), err)
	}
	ps.syncRoot = true
	unlock, err := ns.Lock(ctx, false)
	if err != nil {
		return nil, m, fmt.Errorf("jobs: save prefix %s: %w", ns.Dir(), err)
	}
	if unlock, err = ps.confirm(ctx, cfg, ns, unlock); err != nil {
		return nil, m, err
	}
	defer unlock()
	res := &PrefixResult{Keys: ps.keys, Tokens: len(req.Tokens)}
	err = savePages(ctx, cfg, ns, ps, res, &m, req.Progress)
	m.Elapsed = time.Since(start)
	return res, m, err
}

// Admission lets the caller account a page save's new pages before any
// of their files is created (Config.Admission): the engine's bounded page
// cache reserves room for them, evicting victims first.
type Admission interface {
	// Admit is called once by a page save (SavePrefix, a Write in the
	// Pages layout) after the request was checked and every page file
	// laid out, before the save creates or locks the namespace: ns is the
	// save's namespace, keys its pages in chain order, parents[i] page i's
	// parent key (parents[0] the chain's root key, which is no page),
	// fileBytes[i] the length in bytes of page i's file as the save
	// writes it (prefix, header, alignment and tensor data). It returns
	// once room is made for the pages not stored yet; its error fails the
	// save before anything is written. The caller settles what it
	// reserved once the save has returned. Called again after Confirm
	// reported false, it replaces the admission.
	Admit(ctx context.Context, ns *store.Namespace, keys, parents []layout.PageKey, fileBytes []int64) error
	// Confirm is called once the save holds ns's shared lock, which it
	// keeps until its write ends: it reports whether the pages Admit found
	// stored (and reserved no room for) are still there; another engine
	// on the root may have evicted one meanwhile. On false the save
	// releases the lock, calls Admit again and locks again, at most
	// maxAdmits admissions in all; after the last it goes on unconfirmed.
	Confirm(ns *store.Namespace) bool
}

// maxAdmits bounds the admissions of one page save (Admission.Confirm).
const maxAdmits = 4

// confirm confirms ps's admission (Admission.Confirm) under ns's shared
// lock, held by unlock: while a page the admission found stored is gone,
// it unlocks, admits again and locks again. It returns the lock's unlock,
// held, or an error with the lock released. A nil ps (no page save) holds
// nothing to confirm.
func (ps *pageSave) confirm(ctx context.Context, cfg *Config, ns *store.Namespace, unlock func()) (func(), error) {
	if ps == nil || cfg.Admission == nil {
		return unlock, nil
	}
	for attempt := 1; attempt < maxAdmits && !cfg.Admission.Confirm(ns); attempt++ {
		unlock()
		if err := ps.admit(ctx, cfg, ns); err != nil {
			return nil, err
		}
		var err error
		if unlock, err = ns.Lock(ctx, false); err != nil {
			return nil, fmt.Errorf("jobs: save pages %s: %w", ns.Dir(), err)
		}
	}
	return unlock, nil
}

// pageSave is a page save laid out before the disk is touched: the pages'
// keys and parents in chain order and each page's planned header
// (pageHead); the full plan of a page's file (planPage) is made when the
// page is to be written (plan).
type pageSave struct {
	ns            *store.Namespace
	identity      string
	p             int
	tokens        []uint32
	tensors       []TensorSpec
	keys, parents []layout.PageKey
	heads         []pageHead
	pages         []*plannedPage // full plans, made by plan
	// syncRoot: savePages fsyncs the root with its other directories
	// (the namespace was made by store.Namespace.CreateLeavingRoot).
	syncRoot bool
}

// pageHead is a page file's header as planned (hash placeholders), its
// data start and size and the sum of its tensors' bytes: what a save
// needs of a page it may reuse.
type pageHead struct {
	js              []byte
	dataStart, size int64
	tensorBytes     int64
}

// pageTemplate is the planned header of every page of one token count:
// page i's header is pre + its "page" metadata (layout.Page.MetaJSON) +
// post, as Header.Encode writes it (the page metadata is the only part
// of a page header that differs between pages of one save and token
// count). end is the data region's length in bytes.
type pageTemplate struct {
	pre, post   []byte
	end         int64
	tensorBytes int64
}

// planPageSave keys the pages of tokens (identity, p tokens per page) and
// plans each page's header for tensors (checked by the caller, itemsizes
// resolved) in ns: the first page of each token count fully (planPage),
// the others from its header (pageTemplate). Errors: ErrInvalidRequest
// (identity, page size, a view that cannot be sliced).
func planPageSave(ns *store.Namespace, identity string, p int, tokens []uint32, tensors []TensorSpec) (*pageSave, error) {
	keys, _, err := layout.PageChain(identity, p, tokens)
	if err != nil {
		return nil, fmt.Errorf("%w: %w", ErrInvalidRequest, err)
	}
	ps := &pageSave{ns: ns, identity: identity, p: p, tokens: tokens, tensors: tensors, keys: keys,
		parents: make([]layout.PageKey, len(keys)), heads: make([]pageHead, len(keys)), pages: make([]*plannedPage, len(keys))}
	ps.parents[0] = layout.PageRoot(identity, p)
	copy(ps.parents[1:], keys)
	templates := map[int]*pageTemplate{} // by token count; nil: none
	for i := range keys {
		page, _ := ps.page(i)
		n := len(page.Tokens)
		if tpl := templates[n]; tpl != nil {
			var ok bool
			if ps.heads[i], ok = tpl.head(page.MetaJSON()); ok {
				continue
			}
		}
		pl, err := ps.plan(i)
		if err != nil {
			return nil, err
		}
		if _, seen := templates[n]; !seen {
			templates[n] = newPageTemplate(pl)
		}
	}
	return ps, nil
}

// page is page i of ps as its header's "page" metadata describes it, and
// the index of its first token.
func (ps *pageSave) page(i int) (*layout.Page, int) {
	lo, hi := i*ps.p, min(len(ps.tokens), (i+1)*ps.p)
	return &layout.Page{Key: ps.keys[i], Parent: ps.parents[i], Identity: ps.identity, PageTokens: ps.p, Tokens: ps.tokens[lo:hi]}, lo
}

// plan returns the full plan of page i's file (planPage), made once; its
// header must be the one planned for the page (ps.heads[i], set here when
// not yet).
func (ps *pageSave) plan(i int) (*plannedPage, error) {
	if pl := ps.pages[i]; pl != nil {
		return pl, nil
	}
	page, lo := ps.page(i)
	// Each page its own shapes: its sliced views keep them.
	shapes := make([][]int, len(ps.tensors))
	for t, ts := range ps.tensors {
		shapes[t] = make([]int, len(ts.View.Shape))
	}
	pl, err := planPage(ps.tensors, shapes, page, lo, ps.ns.PagePath(ps.keys[i]))
	if err != nil {
		return nil, err
	}
	hd := pageHead{js: pl.js, dataStart: pl.dataStart, size: pl.size, tensorBytes: pl.tensorBytes}
	if old := ps.heads[i]; old.js == nil {
		ps.heads[i] = hd
	} else if !bytes.Equal(old.js, hd.js) || old.dataStart != hd.dataStart || old.size != hd.size || old.tensorBytes != hd.tensorBytes {
		return nil, fmt.Errorf("jobs: save page %s: its header differs from the one planned for it", pl.ws.Path)
	}
	ps.pages[i] = pl
	return pl, nil
}

// newPageTemplate cuts the header of pl (a page's full plan) around its
// "page" metadata; nil when that metadata is not found in it exactly once
// (the pages of its token count are then each planned fully).
func newPageTemplate(pl *plannedPage) *pageTemplate {
	meta := pl.ws.Meta["page"]
	at := bytes.Index(pl.js, meta)
	if len(meta) == 0 || at < 0 || bytes.Contains(pl.js[at+1:], meta) {
		return nil
	}
	return &pageTemplate{pre: pl.js[:at], post: pl.js[at+len(meta):], end: pl.size - pl.dataStart, tensorBytes: pl.tensorBytes}
}

// head is the planned header of the page whose "page" metadata is meta;
// ok is false when the header would be too long (planPage reports it).
func (tpl *pageTemplate) head(meta []byte) (hd pageHead, ok bool) {
	js := make([]byte, 0, len(tpl.pre)+len(meta)+len(tpl.post))
	js = append(append(append(js, tpl.pre...), meta...), tpl.post...)
	if len(js) > layout.MaxHeaderLen {
		return hd, false
	}
	ds := layout.AlignUp(int64(layout.PrefixLen+len(js)), layout.DataAlign)
	return pageHead{js: js, dataStart: ds, size: ds + tpl.end, tensorBytes: tpl.tensorBytes}, true
}

// admit asks cfg.Admission (when set) for room for the save's pages.
func (ps *pageSave) admit(ctx context.Context, cfg *Config, ns *store.Namespace) error {
	if cfg.Admission == nil {
		return nil
	}
	sizes := make([]int64, len(ps.heads))
	for i, hd := range ps.heads {
		sizes[i] = hd.size
	}
	return cfg.Admission.Admit(ctx, ns, ps.keys, ps.parents, sizes)
}

// savePages stores the pages of ps in
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
func savePages(ctx context.Context, cfg *Config, ns *store.Namespace, ps *pageSave, res *PrefixResult, m *Metrics, progress func(int64)) error {
	st := ns.Store()
	keys := ps.keys
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
	var hdr []byte             // scratch for storedPage
	// ids[i]: the FileID of page i's file from an lstat made before its
	// directory's fsync (reused pages: storedPage's; new pages: after the
	// commits), or the mark it matched; the zero FileID when unknown.
	// sums[i]: the sum of page i's planned header (headerSum), marked
	// with ids[i].
	ids := make([]vfs.FileID, len(keys))
	sums := make([]uint64, len(keys))
	var fresh []int // positions of the pages this save publishes
	marks := cfg.Durable
	if !st.Durable() {
		marks = nil // nothing is fsynced: nothing is known durable
	}
	for i, key := range keys {
		tell()
		if c.failed() {
			break
		}
		if err = ctx.Err(); err != nil {
			break
		}
		hd := &ps.heads[i]
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
		m.LogicalBytes += hd.size - hd.dataStart
		sums[i] = headerSum(hd.js)
		// The page's mark: a file found with its FileID was made durable
		// under the name and not written since; with its header sum
		// too, it holds the header this save would write (not read).
		var markID vfs.FileID
		var markSum uint64
		if marks != nil {
			markID, markSum = marks.DurableMark(ns.Name(), key)
		}
		holds := func(id vfs.FileID) bool {
			return id != (vfs.FileID{}) && id == markID && markSum == sums[i]
		}
		var reuse, exists bool
		var id vfs.FileID
		if reuse, exists, id, hdr, err = storedPage(st.FS(), path, hd, hdr, holds); errors.Is(err, errPageIsDir) {
			// Never replaced (it may hold anything): this page fails, the
			// others are still written (see PrefixResult.Failed).
			res.Failed = append(res.Failed, key)
			res.FailedErr, err = cmp.Or(res.FailedErr, err), nil
			m.LogicalBytes -= hd.size - hd.dataStart
			continue
		} else if err != nil {
			break
		}
		if reuse {
			res.PagesReused++
			res.BytesReused += hd.size
			ids[i] = id
			known := id != (vfs.FileID{}) && id == markID
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
				progress(hd.tensorBytes)
			}
			continue
		}
		if exists {
			res.PagesReplaced++
		}
		newDirs[dir] = true
		fresh = append(fresh, i)
		var pl *plannedPage
		if pl, err = ps.plan(i); err != nil {
			break
		}
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
		// made it and died before its fsync), and for SavePrefix the root
		// (which holds the namespace's), at once: each must be durable
		// before the ack, in no order.
		dirs := make([]string, 0, len(newDirs)+3)
		for d := range newDirs {
			dirs = append(dirs, d)
		}
		slices.Sort(dirs)
		dirs = append(dirs, pagesDir, ns.Dir())
		if ps.syncRoot {
			dirs = append(dirs, st.Root())
		}
		err = syncDirs(ctx, st, dirs, pagesDir)
		if err == nil && marks != nil {
			marks.MarkDurable(ns.Name(), keys, ids, sums)
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

// headerSum is the sum of a planned header (placeholder hashes) that a
// page's durable mark records (DurablePages): xxh3-64, never 0 (0 means
// unknown). Equal sums mean the stored header equals the planned one
// apart from the tensor hashes: the mark is set only for a file found so
// (storedPage) or written from that plan.
func headerSum(js []byte) uint64 {
	return max(1, xxh3.Hash(js))
}

// errPageIsDir: a directory is where a page file belongs; the save fails
// that page alone.
var errPageIsDir = errors.New("is a directory")

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
// the file is opened. A file whose FileID holds(id) approves is reused
// without being opened: the caller knows it holds the planned header
// (DurablePages).
func storedPage(fsys vfs.FS, path string, pl *pageHead, buf []byte, holds func(vfs.FileID) bool) (reuse, exists bool, id vfs.FileID, _ []byte, err error) {
	fi, err := fsys.Lstat(path)
	if err != nil {
		if vfs.IsNotExist(err) {
			return false, false, id, buf, nil
		}
		return false, false, id, buf, fmt.Errorf("jobs: save prefix: stat page %s: %w", path, err)
	}
	if fi.IsDir() {
		return false, true, id, buf, fmt.Errorf("jobs: save prefix: page path %s: %w", path, errPageIsDir)
	}
	if !fi.Mode().IsRegular() || fi.Size() != pl.size {
		return false, true, id, buf, nil
	}
	id = vfs.IDOf(fi)
	if holds(id) {
		return true, true, id, buf, nil
	}
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
