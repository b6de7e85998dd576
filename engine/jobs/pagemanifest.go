package jobs

import (
	"context"
	"errors"
	"fmt"
	"path/filepath"

	"github.com/kvpersist/kvpersist/engine/gather"
	"github.com/kvpersist/kvpersist/engine/layout"
	"github.com/kvpersist/kvpersist/engine/readio"
	"github.com/kvpersist/kvpersist/engine/store"
	"github.com/kvpersist/kvpersist/engine/vfs"
)

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

// planPagesWrite lays out the pages of a Pages write (its cache tensors,
// in slot order, are the pages' tensors; checked by checkPagesSpec).
func planPagesWrite(ns *store.Namespace, spec *writeSpec, h *layout.Header, slots []slotIn) (*pageSave, error) {
	nc := cacheSlots(h)
	tensors := make([]TensorSpec, nc)
	for i, s := range slots[:nc] {
		tensors[i] = TensorSpec{DType: s.t.DType, View: s.view}
	}
	return planPageSave(ns, spec.Identity, pageTokens(spec.PageTokens), spec.Tokens, tensors)
}

// writePages writes a named snapshot in the Pages layout (the namespace
// created and locked by Write, the pages laid out and admitted:
// planPagesWrite): the cache tensors are saved as token pages
// (savePages: pages already stored are reused, shared with the prefix
// cache), then, once every page is durable, the page manifest is published
// like a single file whose data region holds only the attachments.
func writePages(ctx context.Context, cfg *Config, ns *store.Namespace, spec *writeSpec, h *layout.Header, slots []slotIn, ps *pageSave, m *Metrics) error {
	p, keys := ps.p, ps.keys
	nc := cacheSlots(h)
	for _, s := range slots[:nc] {
		m.LogicalBytes += s.out.Bytes
	}
	res := &PrefixResult{Keys: keys}
	var pm Metrics
	if err := savePages(ctx, cfg, ns, ps, res, &pm, nil); err != nil {
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
	srcs  []*readio.Source // the pages', then the manifest's
	exts  []readio.Extent
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
			fp.src.MakeLazy(int64(nc))
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
	pr.exts = make([]readio.Extent, 0, len(pages)*nc+len(slots)-nc)
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
		src, err := adoptSource(cfg, f)
		if err != nil {
			return pr, err
		}
		pr.srcs = append(pr.srcs, src)
		for i := nc; i < len(slots); i++ {
			t := slots[i]
			x := readio.Extent{Src: src, Off: int64(snap.DataStart) + t.Off, Dst: dest[i], Group: i}
			if verify {
				x.Verify = readio.VerifyXXH3
				x.XXH3 = layout.HashValue(t.Hash) // validated by Decode: 16 hex digits
			}
			pr.exts = append(pr.exts, x)
		}
	}
	return pr, nil
}
