package jobs

import (
	"context"
	"encoding/hex"
	"errors"
	"fmt"
	"hash"
	"os"
	"path/filepath"
	"runtime/debug"
	"sort"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvpersist/kvpersist/engine/gather"
	"github.com/kvpersist/kvpersist/engine/layout"
	"github.com/kvpersist/kvpersist/engine/store"
	"github.com/kvpersist/kvpersist/engine/vfs"
	"github.com/kvpersist/kvpersist/internal/scratch"
	"github.com/kvpersist/kvpersist/internal/xxh3s"
	"github.com/minio/sha256-simd"
)

// writeSpec is a write request with its resolved path: the snapshot file
// (<root>/<namespace>/<name>); blocks go to <root>/<namespace>/blocks/.
type writeSpec struct {
	Path string
	*WriteRequest
}

type slotIn struct {
	t    *TensorSpec
	view gather.View // t.View with its ItemSize from the dtype
	out  *layout.Tensor
	name string
}

// buildHeader validates every view and returns the header skeleton (hash
// placeholders) and the slots in file order.
func buildHeader(spec *writeSpec, version int) (*layout.Header, []slotIn, error) {
	h := &layout.Header{FormatVersion: version, Meta: spec.Meta}
	build := func(in []EntrySpec) []layout.Entry {
		out := make([]layout.Entry, len(in))
		for i, e := range in {
			out[i] = layout.Entry{Meta: e.Meta, Tensors: make([]layout.Tensor, len(e.Tensors))}
		}
		return out
	}
	h.Caches = build(spec.Caches)
	if spec.Attachments != nil {
		h.Attachments = build(spec.Attachments)
	}
	var slots []slotIn
	for gi, group := range [][]EntrySpec{spec.Caches, spec.Attachments} {
		entries := h.Caches
		if gi == 1 {
			entries = h.Attachments
		}
		for i := range group {
			for j := range group[i].Tensors {
				t := &group[i].Tensors[j]
				slots = append(slots, slotIn{t: t, out: &entries[i].Tensors[j]})
			}
		}
	}
	if len(slots) == 0 {
		return nil, nil, fmt.Errorf("%w: %s: no tensors", ErrInvalidRequest, spec.Path)
	}
	names := h.SlotIndex() // O(1) per slot: SlotName walks the entries
	for i := range slots {
		s := &slots[i]
		s.name = names.Name(i)
		size, err := layout.ItemSize(s.t.DType)
		if err != nil {
			return nil, nil, fmt.Errorf("%w: %s %s: %w", ErrInvalidRequest, spec.Path, s.name, err)
		}
		s.view = s.t.View // a copy: the caller's request is never modified
		if s.view.ItemSize == 0 {
			s.view.ItemSize = size
		}
		if s.view.ItemSize != size {
			return nil, nil, fmt.Errorf("%w: %s %s: view itemsize %d bytes, dtype %s has %d", ErrInvalidRequest, spec.Path, s.name, s.view.ItemSize, s.t.DType, size)
		}
		if len(s.view.Shape) > layout.MaxRank {
			return nil, nil, fmt.Errorf("%w: %s %s: %d axes (readers accept at most %d)", ErrInvalidRequest, spec.Path, s.name, len(s.view.Shape), layout.MaxRank)
		}
		if err := s.view.Validate(); err != nil {
			return nil, nil, fmt.Errorf("%w: %s %s: %v", ErrInvalidRequest, spec.Path, s.name, err)
		}
		shape := make([]int64, len(s.view.Shape))
		for k, d := range s.view.Shape {
			shape[k] = int64(d)
		}
		if s.t.Plan != nil {
			if spec.Layout != layout.Blocks {
				return nil, nil, fmt.Errorf("%w: %s %s: a block plan is only for the block layout", ErrInvalidRequest, spec.Path, s.name)
			}
			if err := s.t.Plan.Fits(s.view.Shape, s.view.ItemSize); err != nil {
				return nil, nil, fmt.Errorf("%w: %s %s: %v", ErrInvalidRequest, spec.Path, s.name, err)
			}
		}
		*s.out = layout.Tensor{Bytes: int64(s.view.Bytes()), DType: s.t.DType, Shape: shape, Meta: s.t.Meta}
	}
	// Readers refuse a snapshot past layout.MaxSnapshotBytes: never write one.
	if _, err := h.TotalBytes(); err != nil {
		return nil, nil, fmt.Errorf("%w: %s: %w", ErrInvalidRequest, spec.Path, err)
	}
	return h, slots, nil
}

// buildCheckedHeader is buildHeader that also encodes the header once to
// check the caller's metadata (reserved keys, valid JSON) before any byte
// is written: the block layout encodes only after its blocks. (A page,
// whose plan encodes it at once, planSingle, needs no such check.)
func buildCheckedHeader(spec *writeSpec, version int) (*layout.Header, []slotIn, error) {
	h, slots, err := buildHeader(spec, version)
	if err != nil {
		return nil, nil, err
	}
	if _, err := h.Encode(); err != nil {
		return nil, nil, fmt.Errorf("%w: %s: %w", ErrInvalidRequest, spec.Path, err)
	}
	return h, slots, nil
}

// Write saves req as the snapshot <cfg.Root>/<req.Namespace>/<req.Name>
// and returns its header as published (offsets, hashes, block lists). The
// previous snapshot of that name, if any, stays intact and readable until
// the new one, fully written and fdatasynced, is renamed over it; on any
// error (including ctx's) no temp file is left, and on any error but one
// nothing is published. The exception: if the rename succeeded but the
// final fsync of the directory failed, the error is returned and the path
// already holds the new, complete snapshot (it is readable and verifies, but
// the rename may not survive a power cut); at no time can a reader see a mix
// of versions. The caller's views are not touched after Write returns.
//
// Errors: ErrInvalidRequest (bad view, dtype (wrapping
// layout.ErrUnknownDType for a dtype ItemSize does not know), metadata, rank over
// layout.MaxRank, no Config.Root; wrapping layout.ErrSnapshotTooLarge for
// tensors past layout.MaxSnapshotBytes), layout.ErrBadName, ErrBlockBytes,
// ctx's error, or an I/O error naming the operation and path (wrapping the
// errno: errors.Is(err, syscall.ENOSPC)).
func Write(ctx context.Context, cfg *Config, req *WriteRequest) (*layout.Header, Metrics, error) {
	path, err := cfg.snapshotPath(req.Ref)
	if err != nil {
		return nil, Metrics{}, fmt.Errorf("jobs: write %s: %w", req.Ref, err)
	}
	return write(ctx, cfg, &writeSpec{Path: path, WriteRequest: req})
}

// write is Write of a resolved path (also migrate's, whose destination
// names come from a legacy store).
func write(ctx context.Context, cfg *Config, spec *writeSpec) (*layout.Header, Metrics, error) {
	start := time.Now()
	var m Metrics
	var err error
	// Validate the whole request before anything is created on disk.
	version, bb := layout.FormatSingle, 0
	switch spec.Layout {
	case layout.Single:
	case layout.Blocks:
		version, bb = layout.FormatBlocksXXH3, spec.BlockBytes
		if bb == 0 {
			bb = DefaultBlockBytes
		}
		if err = CheckBlockBytes(bb); err != nil {
			return nil, m, fmt.Errorf("jobs: %s: %w", spec.Path, err)
		}
	case layout.Pages:
		version = layout.FormatPages
	default:
		return nil, m, fmt.Errorf("%w: %s: unknown layout %v", ErrInvalidRequest, spec.Path, spec.Layout)
	}
	if spec.Identity != "" {
		req := *spec.WriteRequest // a copy: the caller's request is never modified
		if req.Meta, err = layout.WithIdentity(spec.Meta, spec.Identity); err != nil {
			return nil, m, fmt.Errorf("%w: %s: %w", ErrInvalidRequest, spec.Path, err)
		}
		spec = &writeSpec{Path: spec.Path, WriteRequest: &req}
	}
	h, slots, err := buildCheckedHeader(spec, version)
	if err != nil {
		return nil, m, err
	}
	ns, _ := store.NamespaceOf(spec.Path, cfg.storeOptions())
	var pages *pageSave
	if spec.Layout == layout.Pages {
		if err = checkPagesSpec(spec, slots); err != nil {
			return nil, m, err
		}
		// Laid out, and room made for the new pages (cfg.Admission),
		// before any file is created.
		if pages, err = planPagesWrite(ns, spec, h, slots); err != nil {
			return nil, m, fmt.Errorf("%s: %w", spec.Path, err)
		}
		if err = pages.admit(ctx, cfg, ns); err != nil {
			return nil, m, err
		}
	}
	// The namespace directory, durably, and the root synced in any case:
	// the namespace's entry must be durable before a snapshot in it is
	// acked, even if the write that created it died before syncing.
	if err = ns.Create(); err != nil {
		return nil, m, fmt.Errorf("jobs: write %s: %w", spec.Path, err)
	}
	unlock, err := ns.Lock(ctx, false)
	if err != nil {
		return nil, m, fmt.Errorf("jobs: write %s: %w", spec.Path, err)
	}
	if unlock, err = pages.confirm(ctx, cfg, ns, unlock); err != nil {
		return nil, m, err
	}
	defer unlock()
	if spec.Layout == layout.Single {
		err = writeSingle(ctx, cfg, ns, spec, h, slots, &m)
	} else if spec.Layout == layout.Pages {
		err = writePages(ctx, cfg, ns, spec, h, slots, pages, &m)
	} else {
		err = writeBlocks(ctx, cfg, ns, spec, h, slots, bb, &m)
	}
	m.Elapsed = time.Since(start)
	if err != nil {
		return nil, m, err
	}
	return h, m, nil
}

// writeSingle writes the single-file snapshot of the validated header h
// (slots from buildHeader), filling in offsets and hashes.
func writeSingle(ctx context.Context, cfg *Config, ns *store.Namespace, spec *writeSpec, h *layout.Header, slots []slotIn, m *Metrics) error {
	js, dataStart, end, err := planSingle(spec.Path, h, slots)
	if err != nil {
		return err
	}
	jsLen := len(js)
	for _, s := range slots {
		m.LogicalBytes += s.out.Bytes
	}
	var copied, peak atomic.Int64
	st := ns.Store()
	err = layout.Publish(st.FS(), spec.Path, st.PublishOptions(true, dataStart+end),
		func(f vfs.File) error {
			return fillSingle(ctx, cfg, st, spec.Path, h, slots, jsLen, dataStart, f, &copied, &peak)
		})
	m.CopiedBytes, m.ScratchPeak = copied.Load(), peak.Load()
	if err != nil {
		return err
	}
	m.WrittenBytes = dataStart + end
	return nil
}

// planSingle lays out a single file (also a page file): tensors in slot
// order at 4 KiB-aligned offsets, an empty tensor at off 0 (it occupies
// nothing), hash placeholders of the final length. It returns the header
// JSON's length, the data start and the end of the last non-empty tensor
// relative to it (the file's size is dataStart+end, whether or not
// fallocate is supported), all in bytes. js is the header as planned
// (every hash a placeholder of 16 zeros).
func planSingle(path string, h *layout.Header, slots []slotIn) (js []byte, dataStart, end int64, err error) {
	var next int64
	for _, s := range slots {
		s.out.Hash = "0000000000000000" // same length as every real hash
		if s.out.Bytes == 0 {
			s.out.Off = 0
			continue
		}
		s.out.Off = next
		end = next + s.out.Bytes
		next = layout.AlignUp(end, layout.TensorAlign)
	}
	js, err = h.Encode()
	if err != nil {
		return nil, 0, 0, fmt.Errorf("%w: %s: %w", ErrInvalidRequest, path, err)
	}
	if len(js) > layout.MaxHeaderLen {
		return nil, 0, 0, fmt.Errorf("%w: %s: header of %d bytes exceeds %d", ErrInvalidRequest, path, len(js), layout.MaxHeaderLen)
	}
	return js, layout.AlignUp(int64(layout.PrefixLen+len(js)), layout.DataAlign), end, nil
}

// fillSingle writes the tensors of a planned single file into f (every
// tensor a task: chunks gathered zero-copy or into scratch, hashed,
// pwritten, write-back started), then its real header at offset 0. copied
// and peak collect the scratch metrics.
func fillSingle(ctx context.Context, cfg *Config, st *store.Store, path string, h *layout.Header, slots []slotIn, jsLen int, dataStart int64, f vfs.File, copied, peak *atomic.Int64) error {
	err := parallel(ctx, cfg, len(slots), ChunkBytes, func(i int, scratch []byte) error {
		s := slots[i]
		var hs xxh3s.Digest // hashes each chunk in place, no copy
		v := s.view
		n := v.Elements()
		chunk := max(1, ChunkBytes/v.ItemSize)
		run := v.RunElements()
		wbFrom := dataStart + s.out.Off // start of the bytes whose write-back is not started
		for e := 0; e < n; {
			if e > 0 {
				if err := ctx.Err(); err != nil {
					return err
				}
			}
			count := min(chunk, n-e)
			// Stop at the end of a long contiguous run so the chunk
			// is a zero-copy slice of the caller's memory.
			if run*v.ItemSize >= 64<<10 {
				count = min(count, (e/run+1)*run-e)
			}
			b, wasCopied, err := v.GatherRange(e, count, scratch)
			if err != nil {
				return fmt.Errorf("jobs: %s %s: %w", path, s.name, err)
			}
			if wasCopied {
				copied.Add(int64(len(b)))
				maxInt64(peak, int64(len(b)))
			}
			hs.Write(b)
			at := dataStart + s.out.Off + int64(e)*int64(v.ItemSize)
			if err := layout.WriteFull(f, b, at); err != nil {
				return err
			}
			e += count
			// Start write-back now so the final fdatasync finds most
			// of the file already on its way, in ranges of at least
			// writebackBytes (or the tensor's end): a write-back
			// started per 64 KiB chunk (a page's head rows) made the
			// disk take small requests and ran slower (measured in
			// the issue-12 review).
			if end := at + int64(len(b)); end-wbFrom >= writebackBytes || e == n {
				if err := st.StartWriteback(f, wbFrom, end-wbFrom); err != nil {
					return err
				}
				wbFrom = end
			}
		}
		s.out.Hash = layout.TensorHash(hs.Sum64())
		return nil
	})
	if err != nil {
		return err
	}
	js, err := h.Encode()
	if err != nil {
		return err
	}
	if len(js) != jsLen {
		return fmt.Errorf("jobs: %s: header length changed from %d to %d bytes while hashing", path, jsLen, len(js))
	}
	return layout.WriteFull(f, layout.EncodePrefix(js, uint32(dataStart)), 0)
}

// writebackBytes is the least range, in bytes, whose write-back a single
// file's (or page's) writer starts at once (sync_file_range), except at a
// tensor's end. Measured on the development VM: 32 page files of 32 MiB
// written in 64 KiB chunks took 1.4-2.9 s with the write-back of each
// chunk started alone, 0.7-1.2 s with ranges of 512 KiB to 4 MiB.
const writebackBytes = 1 << 20

// blockTask locates one block: the slot and the block's index in its plan.
type blockSlot struct {
	view  gather.View
	plan  gather.Plan
	refs  []layout.BlockRef
	first int // global index of the slot's first block
}

// writeBlocks stores the blocks of the validated header h (slots from
// buildHeader) in blocks of bb bytes and publishes its manifest.
func writeBlocks(ctx context.Context, cfg *Config, ns *store.Namespace, spec *writeSpec, h *layout.Header, slots []slotIn, bb int, m *Metrics) error {
	if err := ns.CreateBlocksDir(); err != nil {
		return fmt.Errorf("jobs: %s: %w", spec.Path, err)
	}
	w := &blockWriter{cfg: cfg, ns: ns, st: ns.Store(), spec: spec}
	bs := make([]blockSlot, len(slots))
	var off int64
	total := 0
	for i, s := range slots {
		var p gather.Plan
		if s.t.Plan != nil {
			p = *s.t.Plan // checked by buildHeader
		} else {
			var err error
			p, err = gather.NewPlan(s.view.Shape, s.view.ItemSize, bb)
			if err != nil {
				return fmt.Errorf("%w: %s %s: %v", ErrInvalidRequest, spec.Path, s.name, err)
			}
		}
		bs[i] = blockSlot{view: s.view, plan: p, refs: make([]layout.BlockRef, p.Len()), first: total}
		total += p.Len()
		s.out.Off = off
		off += s.out.Bytes
		m.LogicalBytes += s.out.Bytes
	}
	if spec.Packed {
		for i := range bs {
			if err := w.packed(ctx, &bs[i], slots[i].name); err != nil {
				return err
			}
		}
	} else if err := w.run(ctx, bs, total); err != nil {
		return err
	}
	for i, s := range slots {
		s.out.Blocks = bs[i].refs
	}
	return w.publishManifest(ctx, h, m)
}

// publishManifest publishes the manifest h once every block it names is
// durable: each fan-out directory that holds one of them is fsynced (also
// for reused blocks: a writer may have renamed one there without syncing
// yet), then the blocks directory, then the manifest is published (temp,
// fdatasync, rename, directory fsync). It fills m's write metrics.
func (w *blockWriter) publishManifest(ctx context.Context, h *layout.Header, m *Metrics) error {
	path := w.spec.Path
	if w.st.Durable() {
		var dirs []string
		for d := range w.needSync.Range {
			dirs = append(dirs, d.(string))
		}
		sort.Strings(dirs)
		if err := syncDirs(ctx, w.st, dirs, path); err != nil {
			return err
		}
		if err := w.st.SyncDir(w.ns.BlocksDir()); err != nil {
			return fmt.Errorf("jobs: %s: fsync directory %s: %w", path, w.ns.BlocksDir(), err)
		}
	}
	js, err := h.Encode()
	if err != nil {
		return fmt.Errorf("jobs: %s: %w", path, err)
	}
	if len(js) > layout.MaxHeaderLen {
		return fmt.Errorf("%w: %s: manifest of %d bytes exceeds %d", ErrInvalidRequest, path, len(js), layout.MaxHeaderLen)
	}
	buf := layout.EncodePrefix(js, uint32(layout.PrefixLen+len(js)))
	if err := ctx.Err(); err != nil {
		return err
	}
	if err := layout.Publish(w.st.FS(), path, w.st.PublishOptions(true, 0),
		func(f vfs.File) error { return layout.WriteFull(f, buf, 0) }); err != nil {
		return err
	}
	m.WrittenBytes = w.written.Load() + int64(len(buf))
	m.ReusedBytes = w.reused.Load()
	m.BlocksWritten, m.BlocksReused = w.nWritten.Load(), w.nReused.Load()
	m.CopiedBytes = w.copied.Load()
	m.ScratchPeak = w.peak.Load()
	return nil
}

type blockWriter struct {
	cfg               *Config
	ns                *store.Namespace
	st                *store.Store
	spec              *writeSpec
	dirs              sync.Map // fan-out dir -> *dirOnce (created this save)
	needSync          sync.Map // fan-out dir -> struct{}: fsync before the manifest
	written, reused   atomic.Int64
	nWritten, nReused atomic.Int64
	copied, peak      atomic.Int64
}

// syncDirs fsyncs every directory in dirs, with up to blockSyncers
// goroutines that only wait on the disk (an fsync of a directory with
// nothing dirty returns in a fraction of a millisecond, but 256 of them one
// after another add up), joined before it returns. First error wins.
func syncDirs(ctx context.Context, st *store.Store, dirs []string, forPath string) error {
	var (
		next  atomic.Int64
		wg    sync.WaitGroup
		mu    sync.Mutex
		first error
	)
	for range min(blockSyncers, len(dirs)) {
		wg.Go(func() {
			for {
				i := int(next.Add(1) - 1)
				if i >= len(dirs) || ctx.Err() != nil {
					return
				}
				if err := st.SyncDir(dirs[i]); err != nil {
					mu.Lock()
					if first == nil {
						first = fmt.Errorf("jobs: %s: fsync directory %s: %w", forPath, dirs[i], err)
					}
					mu.Unlock()
					return
				}
			}
		})
	}
	wg.Wait()
	if first != nil {
		return first
	}
	return ctx.Err()
}

type dirOnce struct {
	once sync.Once
	err  error
}

// ensureDir creates a fan-out directory once per save.
func (w *blockWriter) ensureDir(dir string) error {
	v, _ := w.dirs.LoadOrStore(dir, &dirOnce{})
	d := v.(*dirOnce)
	d.once.Do(func() {
		d.err = w.ns.CreateFanout(dir) // synced with the others before the manifest
	})
	return d.err
}

// blockSyncers is how many goroutines of one block save wait in fdatasync
// at once. Block files are written by the CPU tasks and handed over
// (write-back already started); these goroutines fdatasync, close and rename
// them. Many syncs in flight let the file system batch them into few journal
// commits: measured here, 2 in flight ran at 0.6 of the raw disk write, 32 at
// about 1.0. They are I/O waiters, not CPU work, so they are not taken from
// the pool; each save starts and joins its own.
const blockSyncers = 32

// blockState is one CPU goroutine's state in a block save: its scratch.
type blockState struct{ scratch []byte }

// stagedBlock is a written file (a block or a page) waiting for its
// fdatasync and rename; done, when set, runs after a successful commit.
// An item with s nil and dir set is a directory to fsync instead (a page
// save makes the directories of the pages it reuses durable this way while
// it writes the others).
type stagedBlock struct {
	s    *layout.Staged
	n    int64
	done func()
	dir  string
}

func (w *blockWriter) run(ctx context.Context, bs []blockSlot, total int) error {
	maxBlock := 0
	for _, b := range bs {
		maxBlock = max(maxBlock, b.plan.MaxBlockBytes())
	}
	c := newCommitter(ctx, w.st, w.spec.Path, total)
	err := parallelWith(ctx, w.cfg, total,
		func() *blockState { return &blockState{scratch: *scratch.Get(maxBlock)} },
		func(g int, st *blockState) error {
			if c.failed() {
				return errSyncerFailed
			}
			i := sort.Search(len(bs), func(i int) bool { return bs[i].first+bs[i].plan.Len() > g })
			s := &bs[i]
			data, copied, err := s.view.Block(s.plan, g-s.first, st.scratch)
			if err != nil {
				return fmt.Errorf("jobs: %s: block %d of slot %d: %w", w.spec.Path, g-s.first, i, err)
			}
			if copied {
				w.copied.Add(int64(len(data)))
				maxInt64(&w.peak, int64(len(data)))
			}
			ref, err := w.put(data, c)
			s.refs[g-s.first] = ref
			return err
		},
		func(st *blockState, _ bool) error {
			scratch.Put(&st.scratch)
			return nil
		})
	syncErr := c.stop(err != nil) // on error the syncers discard what is still queued
	w.written.Add(c.written.Load())
	w.nWritten.Add(c.files.Load())
	if syncErr != nil && (err == nil || err == errSyncerFailed) {
		return syncErr
	}
	return err
}

// committer fdatasyncs, closes and renames staged files (blocks, pages) on
// up to blockSyncers goroutines that only wait on the disk, owned by the
// save that made it and joined by stop. Many syncs in flight let the file
// system batch them into few journal commits.
type committer struct {
	ctx     context.Context
	st      *store.Store // the sync policy
	forPath string       // for error messages: the snapshot or namespace saved
	staged  chan stagedBlock
	wg      sync.WaitGroup
	abort   atomic.Bool
	mu      sync.Mutex
	err     error
	// written and files count what was committed: bytes and files.
	written, files atomic.Int64
}

// newCommitter starts min(blockSyncers, files) syncers (at least one).
func newCommitter(ctx context.Context, st *store.Store, forPath string, files int) *committer {
	c := &committer{ctx: ctx, st: st, forPath: forPath, staged: make(chan stagedBlock, blockSyncers)}
	for range max(1, min(blockSyncers, files)) {
		c.wg.Go(func() {
			for sb := range c.staged {
				c.commit(sb)
			}
		})
	}
	return c
}

func (c *committer) fail(err error) {
	c.mu.Lock()
	if c.err == nil {
		c.err = err
	}
	c.mu.Unlock()
	c.abort.Store(true)
}

// failed reports whether a commit failed (or stop discarded the queue).
func (c *committer) failed() bool { return c.abort.Load() }

func (c *committer) commit(sb stagedBlock) {
	defer func() {
		if r := recover(); r != nil { // a panicking FS must not kill the process
			if sb.s != nil {
				sb.s.Abort()
			}
			c.fail(fmt.Errorf("%w: committing a file of %s: %v\n%s", ErrPanic, c.forPath, r, debug.Stack()))
		}
	}()
	// Work skipped because ctx ended is the committer's failure (ctx's
	// error): a caller whose loop ended before ctx did, and that then
	// does nothing that checks ctx (a NoSync store's prefix save), must
	// not take the skipped files for published.
	if sb.s == nil { // a directory to fsync
		if c.abort.Load() {
			return
		}
		if err := c.ctx.Err(); err != nil {
			c.fail(err)
			return
		}
		if err := c.st.SyncDir(sb.dir); err != nil {
			c.fail(fmt.Errorf("jobs: %s: fsync directory %s: %w", c.forPath, sb.dir, err))
		}
		return
	}
	if c.abort.Load() {
		sb.s.Abort()
		return
	}
	if err := c.ctx.Err(); err != nil {
		sb.s.Abort()
		c.fail(err)
		return
	}
	if err := sb.s.Commit(c.st.PublishOptions(false, 0)); err != nil {
		c.fail(fmt.Errorf("jobs: %s: %w", c.forPath, err))
		return
	}
	if sb.done != nil {
		sb.done()
	}
	c.written.Add(sb.n)
	c.files.Add(1)
}

// hand queues a written file for its commit; it blocks while every syncer
// is busy (backpressure). The committer owns sb from then on.
func (c *committer) hand(sb stagedBlock) { c.staged <- sb }

// stop closes the queue and waits for the syncers; with discard, files
// still queued are removed instead of committed. It returns the first
// commit error.
func (c *committer) stop(discard bool) error {
	if discard {
		c.abort.Store(true)
	}
	close(c.staged)
	c.wg.Wait()
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.err
}

// errSyncerFailed stops the CPU tasks of a block save whose syncer failed;
// the syncer's own error is the one returned.
var errSyncerFailed = errors.New("jobs: a block fsync failed")

// packed gathers a whole non-contiguous tensor into pooled scratch (released
// when the tensor is done), then stores its blocks from that copy.
func (w *blockWriter) packed(ctx context.Context, s *blockSlot, name string) error {
	v := s.view
	if !v.IsContiguous() && v.Bytes() > 0 {
		buf := scratch.Get(v.Bytes())
		defer scratch.Put(buf)
		out, _, err := v.Gather(*buf)
		if err != nil {
			return fmt.Errorf("jobs: %s %s: %w", w.spec.Path, name, err)
		}
		w.copied.Add(int64(len(out)))
		maxInt64(&w.peak, int64(len(out)))
		v = gather.View{Base: out, Shape: v.Shape, Strides: gather.RowMajor(v.Shape), ItemSize: v.ItemSize}
	}
	one := []blockSlot{{view: v, plan: s.plan, refs: s.refs}}
	return w.run(ctx, one, s.plan.Len())
}

// blockSumPiece is the piece, in bytes, in which blockSums feeds a block
// to its two hashes: small enough that SHA-256 leaves it in the core's L2
// cache (1 MiB per core on this machine, 512 KiB on older EPYCs) for xxh3
// to read, large enough that the per-Write overhead vanishes; a multiple
// of both hashes' block sizes (64 and 1,024 bytes), so neither copies more
// than its last partial block into its own buffer.
const blockSumPiece = 64 << 10

// blockSums returns a block's SHA-256 (its name) and its XXH3-64 (seed 0;
// BlockRef.XXH3) in one pass over data: each blockSumPiece piece is hashed
// by SHA-256, then by xxh3 while it is still in cache. Neither hash copies
// data (xxh3s.Digest; sha256-simd hashes whole 64-byte blocks in place).
func blockSums(data []byte) (sum [sha256.Size]byte, xx uint64) {
	s := blockSumsPool.Get().(*blockSumState)
	defer blockSumsPool.Put(s)
	s.sha.Reset()
	s.xx.Reset()
	for o := 0; o < len(data); o += blockSumPiece {
		p := data[o:min(o+blockSumPiece, len(data))]
		s.sha.Write(p)
		s.xx.Write(p)
	}
	s.sha.Sum(s.sum[:0]) // into the pooled state: a local would escape
	return s.sum, s.xx.Sum64()
}

// blockSumState is blockSums' reusable state.
type blockSumState struct {
	sha hash.Hash
	xx  xxh3s.Digest
	sum [sha256.Size]byte
}

var blockSumsPool = sync.Pool{New: func() any { return &blockSumState{sha: sha256.New()} }}

// put stores one block unless a block file of that name and size exists.
// A file of that name but another size (torn, or foreign) is rewritten. The
// new block file is written, its write-back started, and handed to the
// syncers (which block put when they are all busy: backpressure).
func (w *blockWriter) put(data []byte, c *committer) (layout.BlockRef, error) {
	sum, xx := blockSums(data)
	name := hex.EncodeToString(sum[:])
	// A reused block's xxh3 too is computed from data, not read from the
	// file: a restore then checks the stored file against the caller's
	// bytes, as the SHA-256 name did.
	ref := layout.BlockRef{Hash: name, Bytes: int64(len(data)), XXH3: layout.TensorHash(xx)}
	path := w.ns.BlockPath(name, false)
	dir := filepath.Dir(path)
	if err := w.ensureDir(dir); err != nil {
		return ref, fmt.Errorf("jobs: %s: block directory %s: %w", w.spec.Path, dir, err)
	}
	fsys := w.st.FS()
	if fi, err := fsys.Lstat(path); err == nil && fi.Mode().IsRegular() && fi.Size() == int64(len(data)) {
		w.reused.Add(int64(len(data)))
		w.nReused.Add(1)
		// Its directory entry may not be durable yet (renamed in by a
		// writer that has not synced): its directory is synced too.
		w.needSync.Store(dir, struct{}{})
		return ref, nil
	} else if err != nil && !vfs.IsNotExist(err) {
		return ref, fmt.Errorf("jobs: %s: stat block %s: %w", w.spec.Path, path, err)
	} else if err == nil && fi.Mode()&os.ModeDir != 0 {
		return ref, fmt.Errorf("jobs: %s: block path %s is a directory", w.spec.Path, path)
	}
	w.needSync.Store(dir, struct{}{})
	s, err := layout.Stage(fsys, path, 0)
	if err != nil {
		return ref, fmt.Errorf("jobs: %s: %w", w.spec.Path, err)
	}
	handed := false
	defer func() {
		if !handed { // an error or a panic before the hand-off
			s.Abort()
		}
	}()
	if err := layout.WriteFull(s.File, data, 0); err != nil {
		return ref, fmt.Errorf("jobs: %s: %w", w.spec.Path, err)
	}
	if err := w.st.StartWriteback(s.File, 0, 0); err != nil {
		return ref, fmt.Errorf("jobs: %s: %w", w.spec.Path, err)
	}
	c.hand(stagedBlock{s: s, n: int64(len(data))})
	handed = true
	return ref, nil
}
