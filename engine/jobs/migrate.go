package jobs

import (
	"context"
	"errors"
	"fmt"
	"path/filepath"
	"sort"
	"strings"
	"time"

	"github.com/kvpersist/kvpersist/engine/gather"
	"github.com/kvpersist/kvpersist/engine/layout"
	"github.com/kvpersist/kvpersist/engine/store"
	"github.com/kvpersist/kvpersist/engine/vfs"
)

// Sentinel errors of Migrate, usable with errors.Is.
var (
	// ErrDestinationExists: a migration's destination already holds a file
	// that is not this snapshot's migration (other tensors or metadata, or a
	// file that does not decode). It is left alone unless MigrateRequest.Force.
	ErrDestinationExists = errors.New("destination holds another snapshot")
	// ErrUnsupported: a legacy snapshot uses something kvpersist's format
	// cannot carry unchanged (per-tensor metadata keys in a single-file
	// snapshot or a re-cut manifest, a dtype kvpersist does not know).
	ErrUnsupported = errors.New("legacy snapshot cannot be migrated unchanged")
)

// migrateSpec is a migrate request with its destination root.
type migrateSpec struct {
	DstRoot string
	*MigrateRequest
}

// MigrateStatus says what Migrate did with one legacy snapshot.
type MigrateStatus int

// Migration outcomes.
const (
	// StatusMigrated: read with verification and written at its destination.
	StatusMigrated MigrateStatus = iota + 1
	// StatusSkipped: the destination already holds this snapshot's
	// migration (same layout, tensors, metadata and, for a manifest whose
	// boundaries were kept, the same block list with every block present).
	StatusSkipped
	// StatusFailed: not migrated; MigrateItem.Err says why. The source is
	// unchanged and the destination untouched.
	StatusFailed
)

func (s MigrateStatus) String() string {
	switch s {
	case StatusMigrated:
		return "migrated"
	case StatusSkipped:
		return "skipped"
	case StatusFailed:
		return "failed"
	}
	return fmt.Sprintf("MigrateStatus(%d)", int(s))
}

// MigrateItem reports one legacy snapshot.
type MigrateItem struct {
	Namespace, Name string
	Src, Dst        string        // file paths
	Layout          layout.Layout // the source's (and destination's); 0 if undecodable
	Status          MigrateStatus
	// LogicalBytes is the snapshot's tensor bytes (sum of every slot).
	LogicalBytes int64
	// SourceBlockBytes is the largest block of a legacy manifest, in bytes
	// (the original's blockBytes when some row was at least that long).
	SourceBlockBytes int64
	// Recut is true when the manifest was re-cut at MigrateRequest.BlockBytes
	// and its block boundaries differ from the source's.
	Recut bool
	// Metrics of the read and write (ReadBytes of the read; WrittenBytes,
	// ReusedBytes, Blocks* of the write); zero unless migrated.
	Metrics Metrics
	Err     error // StatusFailed only
}

// Ref is "namespace/name".
func (it *MigrateItem) Ref() string { return it.Namespace + "/" + it.Name }

// IgnoredEntry is a file or directory in a source namespace that is not a
// legacy snapshot and was left alone.
type IgnoredEntry struct {
	Path string
	Why  string
}

// MigrateReport is the outcome of a migration.
type MigrateReport struct {
	// Items has one entry per legacy snapshot found, namespaces in the
	// order scanned (sorted when listed from SrcRoot), names sorted.
	Items                     []MigrateItem
	Migrated, Skipped, Failed int
	// Ignored lists entries of the scanned namespaces (and, when
	// MigrateRequest.Namespaces is nil, of SrcRoot) that are not legacy
	// snapshots: kvpersist files, temp files of the original worker
	// (<name>.tmp), other files, directories and symlinks. The blocks/
	// directory and kvpersist's .lock are expected and not listed.
	Ignored []IgnoredEntry
}

// MigrateError lists the snapshots a migration could not migrate. It
// unwraps to each one's error, so errors.Is(err, ErrCorrupt) and the like
// work.
type MigrateError struct {
	Total  int           // legacy snapshots found
	Failed []MigrateItem // StatusFailed items, in report order
}

func (e *MigrateError) Error() string {
	var b strings.Builder
	fmt.Fprintf(&b, "jobs: migrate: %d of %d legacy snapshot(s) failed:", len(e.Failed), e.Total)
	for i, it := range e.Failed {
		if i == 8 {
			fmt.Fprintf(&b, " ... and %d more", len(e.Failed)-i)
			break
		}
		fmt.Fprintf(&b, " [%s: %v]", it.Ref(), it.Err)
	}
	return b.String()
}

func (e *MigrateError) Unwrap() []error {
	out := make([]error, len(e.Failed))
	for i, it := range e.Failed {
		out[i] = it.Err
	}
	return out
}

// CheckMigrateRoots checks that src and dst are set, differ, and that
// neither contains the other (a migration must never write into its
// source). Errors wrap ErrInvalidRequest.
func CheckMigrateRoots(src, dst string) error {
	if src == "" || dst == "" {
		return fmt.Errorf("%w: migrate needs a source and a destination root", ErrInvalidRequest)
	}
	as, err := filepath.Abs(src)
	if err != nil {
		return fmt.Errorf("%w: source root %s: %v", ErrInvalidRequest, src, err)
	}
	ad, err := filepath.Abs(dst)
	if err != nil {
		return fmt.Errorf("%w: destination root %s: %v", ErrInvalidRequest, dst, err)
	}
	// Compare resolved paths: a symlinked root (or parent) is the same
	// directory under another name.
	as, ad = resolvePath(as), resolvePath(ad)
	within := func(a, b string) bool { // a is b or inside b
		rel, err := filepath.Rel(b, a)
		return err == nil && rel != ".." && !strings.HasPrefix(rel, ".."+string(filepath.Separator))
	}
	if within(as, ad) || within(ad, as) {
		return fmt.Errorf("%w: source root %s and destination root %s are the same or nested", ErrInvalidRequest, src, dst)
	}
	return nil
}

// resolvePath resolves the symlinks of the longest existing prefix of an
// absolute path and appends the rest (which does not exist yet).
func resolvePath(p string) string {
	for q := p; ; q = filepath.Dir(q) {
		if r, err := filepath.EvalSymlinks(q); err == nil {
			rel, err := filepath.Rel(q, p)
			if err != nil {
				return p
			}
			return filepath.Join(r, rel)
		}
		if filepath.Dir(q) == q {
			return p
		}
	}
}

// SourceNamespaces lists the directories directly under root, sorted, not
// following symlinks: the namespaces Migrate scans when
// MigrateRequest.Namespaces is nil. Names kvpersist does not accept are
// included (Migrate reports their snapshots as failed). root must be a
// store root (store.OpenSource).
func SourceNamespaces(fsys vfs.FS, root string) ([]string, error) {
	st, err := store.OpenSource(root, store.Options{FS: fsys})
	if err != nil {
		return nil, fmt.Errorf("jobs: migrate: source root: %w", err)
	}
	names, _, err := st.Namespaces(true)
	if err != nil {
		return nil, fmt.Errorf("jobs: migrate: source root: %w", err)
	}
	return names, nil
}

// migrateCandidate is one legacy file found by the scan.
type migrateCandidate struct {
	ns, name, src, dst string
	lay                layout.Layout
	bytes              int64
	err                error // found but not migratable: reported as failed
}

// Migrate rewrites every legacy snapshot found under req.SrcRoot in
// kvpersist's format under cfg.Root (see MigrateRequest), one snapshot at a
// time: decode and validate the legacy header, skip it if the destination
// already holds it, restore every tensor into memory with verification
// (Read verifies: Bun.hash per tensor, SHA-256 per block), write it with
// its caller metadata unchanged (Write for a single file or a re-cut
// manifest; for a manifest with its boundaries kept, the source's blocks are
// stored under kvpersist's fan-out and the manifest published after them,
// with Write's durability rules). Memory: one snapshot's tensor bytes.
//
// A snapshot that fails (corrupt, missing blocks, a destination conflict)
// is reported and the others still migrate; the error is then a
// *MigrateError. Other errors: ErrInvalidRequest (roots, BlockBytes, a
// namespace that is not a plain name), a failure to list SrcRoot or a
// namespace, and ctx's error (Migrate stops between snapshots and tensors;
// the report holds what was done). The report, Metrics.Migrate, is never
// nil.
func Migrate(ctx context.Context, cfg *Config, req *MigrateRequest) (Metrics, error) {
	rep, m, err := migrate(ctx, cfg, &migrateSpec{DstRoot: cfg.Root, MigrateRequest: req})
	m.Migrate = rep
	return m, err
}

func migrate(ctx context.Context, cfg *Config, spec *migrateSpec) (*MigrateReport, Metrics, error) {
	start := time.Now()
	rep := &MigrateReport{}
	var m Metrics
	if err := CheckMigrateRoots(spec.SrcRoot, spec.DstRoot); err != nil {
		return rep, m, err
	}
	if spec.BlockBytes != 0 {
		if err := CheckBlockBytes(spec.BlockBytes); err != nil {
			return rep, m, fmt.Errorf("jobs: migrate: %w", err)
		}
	}
	fsys := cfg.fs()
	cands, err := scanLegacy(fsys, spec, rep)
	if err != nil {
		return rep, m, err
	}
	var total int64
	for _, c := range cands {
		total += c.bytes
	}
	if spec.OnPlan != nil {
		spec.OnPlan(len(cands), total)
	}
	if len(cands) > 0 {
		if err := fsys.MkdirAll(spec.DstRoot, layout.DirPerm); err != nil {
			return rep, m, fmt.Errorf("jobs: migrate: destination root: %w", err)
		}
	}
	var failed []MigrateItem
	for _, c := range cands {
		if err := ctx.Err(); err != nil {
			m.Elapsed = time.Since(start)
			return rep, m, err
		}
		it := MigrateItem{Namespace: c.ns, Name: c.name, Src: c.src, Dst: c.dst, Layout: c.lay, LogicalBytes: c.bytes, Err: c.err}
		if it.Err == nil {
			migrateOne(ctx, cfg, spec, &it)
		} else {
			it.Status = StatusFailed
		}
		switch it.Status {
		case StatusMigrated:
			rep.Migrated++
			im := &it.Metrics
			m.LogicalBytes += im.LogicalBytes
			m.ReadBytes += im.ReadBytes
			m.WrittenBytes += im.WrittenBytes
			m.ReusedBytes += im.ReusedBytes
			m.CopiedBytes += im.CopiedBytes
			m.ScratchPeak = max(m.ScratchPeak, im.ScratchPeak)
			m.BlocksWritten += im.BlocksWritten
			m.BlocksReused += im.BlocksReused
		case StatusSkipped:
			rep.Skipped++
		default:
			rep.Failed++
			failed = append(failed, it)
		}
		rep.Items = append(rep.Items, it)
		if spec.OnItem != nil {
			spec.OnItem(it)
		}
	}
	m.Elapsed = time.Since(start)
	if err := ctx.Err(); err != nil {
		return rep, m, err
	}
	if len(failed) > 0 {
		return rep, m, &MigrateError{Total: len(cands), Failed: failed}
	}
	return rep, m, nil
}

// scanLegacy lists the legacy files of the namespaces to migrate and decodes
// their headers (to size the work); everything else goes to rep.Ignored.
// The source is only read: no lock is taken and no file is created there.
func scanLegacy(fsys vfs.FS, spec *migrateSpec, rep *MigrateReport) ([]migrateCandidate, error) {
	src, err := store.OpenSource(spec.SrcRoot, store.Options{FS: fsys})
	if err != nil {
		return nil, fmt.Errorf("jobs: migrate: source root: %w", err)
	}
	names := spec.Namespaces
	if names == nil {
		var skipped []string
		if names, skipped, err = src.Namespaces(true); err != nil {
			return nil, fmt.Errorf("jobs: migrate: source root: %w", err)
		}
		for _, p := range skipped {
			rep.Ignored = append(rep.Ignored, IgnoredEntry{p, "not a namespace directory"})
		}
	}
	var out []migrateCandidate
	for _, name := range names {
		ns, err := src.AnyNamespace(name)
		if err != nil {
			return nil, fmt.Errorf("%w: %w", ErrInvalidRequest, err)
		}
		st, err := fsys.Lstat(ns.Dir())
		if err != nil {
			return nil, fmt.Errorf("jobs: migrate: namespace %s: %w", ns.Dir(), err)
		}
		if !st.IsDir() {
			return nil, fmt.Errorf("%w: namespace %s is not a directory (symlinks are not followed)", ErrInvalidRequest, ns.Dir())
		}
		nsErr := layout.ValidName("namespace", name)
		dst, _ := store.At(spec.DstRoot, store.Options{FS: fsys}).AnyNamespace(name) // name checked above
		l, err := ns.List(false)
		if err != nil {
			return nil, fmt.Errorf("jobs: migrate: namespace %s: %w", ns.Dir(), err)
		}
		for _, sk := range l.Skipped {
			if filepath.Dir(sk.Path) == ns.Dir() { // what lies in blocks/ or pages/ is not reported
				rep.Ignored = append(rep.Ignored, IgnoredEntry{sk.Path, "not a snapshot of the original worker: " + sk.Why})
			}
		}
		for _, t := range l.Temps {
			if filepath.Dir(t.Path) == ns.Dir() {
				rep.Ignored = append(rep.Ignored, IgnoredEntry{t.Path, "temp file of kvpersist"})
			}
		}
		for _, f := range l.Snapshots {
			c := migrateCandidate{ns: name, name: f.Name, src: f.Path, dst: dst.Entry(f.Name)}
			switch {
			case f.Err != nil:
				c.err = fmt.Errorf("jobs: migrate: %w", f.Err)
				out = append(out, c)
				continue
			case f.Magic == layout.Magic:
				rep.Ignored = append(rep.Ignored, IgnoredEntry{f.Path, "already in kvpersist's format"})
				continue
			case f.Magic != layout.LegacyMagic:
				rep.Ignored = append(rep.Ignored, IgnoredEntry{f.Path, fmt.Sprintf("not a snapshot of the original worker (starts with %q)", f.Magic)})
				continue
			case strings.HasSuffix(f.Name, ".tmp"):
				rep.Ignored = append(rep.Ignored, IgnoredEntry{f.Path, "temp file of the original worker (never published)"})
				continue
			}
			if nsErr != nil {
				c.err = nsErr
			} else if err := layout.ValidName("snapshot name", f.Name); err != nil {
				c.err = err
			} else if snap, err := layout.Load(fsys, f.Path); err != nil {
				c.err = err
			} else {
				c.lay = snap.Layout
				for _, t := range snap.Header.Slots() {
					c.bytes += t.Bytes
				}
			}
			out = append(out, c)
		}
	}
	sort.Slice(rep.Ignored, func(i, j int) bool { return rep.Ignored[i].Path < rep.Ignored[j].Path })
	return out, nil
}

// migrateOne migrates one decodable candidate, filling in it.Status, Err,
// Metrics and the block fields.
func migrateOne(ctx context.Context, cfg *Config, spec *migrateSpec, it *MigrateItem) {
	start := time.Now()
	fail := func(err error) {
		it.Status, it.Err = StatusFailed, err
		it.Metrics = Metrics{}
	}
	fsys := cfg.fs()
	snap, err := layout.Load(fsys, it.Src)
	if err != nil {
		fail(err)
		return
	}
	if !snap.Legacy {
		fail(fmt.Errorf("%w: %s is no longer a file of the original worker", ErrUnsupported, it.Src))
		return
	}
	it.Layout = snap.Layout
	keep := snap.Layout == layout.Blocks && spec.BlockBytes == 0
	if err := migratable(snap, keep); err != nil {
		fail(err)
		return
	}
	slots := snap.Header.Slots()
	it.LogicalBytes = 0
	for _, t := range slots {
		it.LogicalBytes += t.Bytes
		for _, r := range t.Blocks {
			it.SourceBlockBytes = max(it.SourceBlockBytes, r.Bytes)
		}
	}
	if !spec.Force {
		done, err := alreadyMigrated(fsys, snap, it.Dst, keep)
		if err != nil {
			fail(err)
			return
		}
		if done {
			it.Status = StatusSkipped
			return
		}
	}
	if snap.Layout == layout.Blocks {
		// Every block must be there, with its size, before the snapshot's
		// bytes are allocated: a manifest's sizes are not bounded by its
		// own file's size.
		if err := checkLegacyBlocks(fsys, snap); err != nil {
			fail(err)
			return
		}
	}
	bufs := make([][]byte, len(slots))
	for i, t := range slots {
		bufs[i] = make([]byte, t.Bytes)
	}
	rsnap, rm, err := read(ctx, cfg, &readSpec{Path: it.Src, ReadRequest: &ReadRequest{Dest: bufs, Expect: snap.Header}})
	if err != nil {
		fail(err)
		return
	}
	if !rsnap.Legacy || rsnap.Layout != snap.Layout {
		fail(fmt.Errorf("%w: %s was replaced while being migrated", ErrUnsupported, it.Src))
		return
	}
	h, wm, err := writeRestored(ctx, cfg, it.Dst, rsnap, bufs, spec.BlockBytes, keep)
	if err == nil && snap.Layout == layout.Blocks {
		it.Recut = !layout.SameBoundaries(rsnap.Header, h)
	}
	if err == nil && keep {
		// The kept plans reproduce the source's cut and Read verified each
		// block's SHA-256 against its name: the manifest names the very
		// same blocks. Anything else is a bug, reported, not hidden.
		for i, t := range h.Slots() {
			if !layout.SameBlocks(t.Blocks, rsnap.Header.Slots()[i].Blocks) {
				err = fmt.Errorf("%w: %s %s: the restored bytes do not hash to the source's block names", ErrCorrupt, it.Dst, h.SlotName(i))
				break
			}
		}
	}
	if err != nil {
		fail(err)
		return
	}
	wm.ReadBytes = rm.ReadBytes
	wm.Elapsed = time.Since(start)
	it.Metrics = wm
	it.Status = StatusMigrated
}

// migratable rejects what the destination format cannot carry unchanged:
// every dtype must be known; a manifest whose boundaries are kept must have
// the original's cut (legacyPlan); per-tensor metadata is kept only with
// the boundaries (a re-cut or a single file would have to decide where a
// tensor's keys go when its blocks change, and the format has no rule).
func migratable(snap *layout.Snapshot, keep bool) error {
	names := snap.Header.SlotIndex() // O(1) per slot: named for every slot when keep
	for i, t := range snap.Header.Slots() {
		if _, err := layout.ItemSize(t.DType); err != nil {
			return fmt.Errorf("%w: %s %s: %w", ErrUnsupported, snap.Path, snap.Header.SlotName(i), err)
		}
		if keep {
			if _, err := legacyPlan(t, snap.Path+" "+names.Name(i)); err != nil {
				return err
			}
		} else if len(t.Meta) > 0 {
			keys := make([]string, 0, len(t.Meta))
			for k := range t.Meta {
				keys = append(keys, k)
			}
			sort.Strings(keys)
			return fmt.Errorf("%w: %s %s has per-tensor metadata %v, which only a block manifest with its boundaries kept preserves", ErrUnsupported, snap.Path, snap.Header.SlotName(i), keys)
		}
	}
	return nil
}

// checkLegacyBlocks checks that every block a legacy manifest names exists
// as a regular file of its size (ErrMissingBlock, ErrBlockSize).
func checkLegacyBlocks(fsys vfs.FS, snap *layout.Snapshot) error {
	ns, _ := store.NamespaceOf(snap.Path, store.Options{FS: fsys})
	seen := map[string]bool{}
	for i, t := range snap.Header.Slots() {
		for b, r := range t.Blocks {
			if seen[r.Hash] {
				continue
			}
			seen[r.Hash] = true
			p := ns.SnapshotBlockPath(snap, r.Hash)
			st, err := fsys.Lstat(p)
			if vfs.IsNotExist(err) {
				return fmt.Errorf("%w: %s %s block %d: %s", ErrMissingBlock, snap.Path, snap.Header.SlotName(i), b, p)
			}
			if err != nil {
				return fmt.Errorf("jobs: migrate: %w", err)
			}
			if !st.Mode().IsRegular() || st.Size() != r.Bytes {
				return fmt.Errorf("%w: %s has %d bytes, %s says %d", ErrBlockSize, p, st.Size(), snap.Path, r.Bytes)
			}
		}
	}
	return nil
}

// writeRestored writes the restored tensors through Write: contiguous
// row-major views of bufs, the source's layout and caller metadata. With
// keep (a manifest), each tensor is cut by the plan that reproduces its
// legacy blocks (legacyPlan) and keeps its per-tensor metadata, so the
// manifest names exactly the source's blocks with every durability step of
// a save.
func writeRestored(ctx context.Context, cfg *Config, dst string, snap *layout.Snapshot, bufs [][]byte, blockBytes int, keep bool) (*layout.Header, Metrics, error) {
	h := snap.Header
	slot := 0
	specs := func(in []layout.Entry) ([]EntrySpec, error) {
		if in == nil {
			return nil, nil
		}
		out := make([]EntrySpec, len(in))
		for i, e := range in {
			out[i] = EntrySpec{Meta: e.Meta, Tensors: make([]TensorSpec, len(e.Tensors))}
			for j := range e.Tensors {
				t := &e.Tensors[j]
				size, err := layout.ItemSize(t.DType)
				if err != nil {
					return nil, fmt.Errorf("%w: %v", ErrUnsupported, err)
				}
				shape := make([]int, len(t.Shape))
				for k, d := range t.Shape {
					shape[k] = int(d) // Validate bounded the product by MaxInt64
				}
				ts := TensorSpec{DType: t.DType, View: gather.View{
					Base: bufs[slot], Shape: shape, Strides: gather.RowMajor(shape), ItemSize: size,
				}}
				if keep {
					p, err := legacyPlan(t, fmt.Sprintf("%s %s", dst, h.SlotName(slot)))
					if err != nil {
						return nil, err
					}
					ts.Plan, ts.Meta = &p, t.Meta
				}
				out[i].Tensors[j] = ts
				slot++
			}
		}
		return out, nil
	}
	caches, err := specs(h.Caches)
	if err != nil {
		return nil, Metrics{}, err
	}
	atts, err := specs(h.Attachments)
	if err != nil {
		return nil, Metrics{}, err
	}
	return write(ctx, cfg, &writeSpec{Path: dst, WriteRequest: &WriteRequest{
		Layout: snap.Layout, Meta: h.Meta, Caches: caches, Attachments: atts, BlockBytes: blockBytes,
	}})
}

// legacyPlan returns the block plan that reproduces a legacy tensor's
// blocks: the original cut every row (the last two axes) into
// floor(blockBytes/itemsize)-element blocks, so the first block's size is a
// block size that yields the same cut (exactly the original's when a row
// held more than one block). ErrUnsupported when no such plan matches.
func legacyPlan(t *layout.Tensor, name string) (gather.Plan, error) {
	size, err := layout.ItemSize(t.DType)
	if err != nil {
		return gather.Plan{}, fmt.Errorf("%w: %s: %w", ErrUnsupported, name, err)
	}
	shape := make([]int, len(t.Shape))
	for k, d := range t.Shape {
		shape[k] = int(d) // Validate bounded the product by MaxInt64
	}
	bb := size
	if len(t.Blocks) > 0 {
		bb = int(t.Blocks[0].Bytes)
	}
	p, err := gather.NewPlan(shape, size, bb)
	if err != nil {
		return gather.Plan{}, fmt.Errorf("%w: %s: %v", ErrUnsupported, name, err)
	}
	ok := p.Len() == len(t.Blocks)
	for b := 0; ok && b < p.Len(); b++ {
		_, count := p.Block(b)
		ok = int64(count)*int64(size) == t.Blocks[b].Bytes
	}
	if !ok {
		return gather.Plan{}, fmt.Errorf("%w: %s: its %d blocks are not the original worker's cut of shape %v (re-cut them with a block size)", ErrUnsupported, name, len(t.Blocks), t.Shape)
	}
	return p, nil
}

// alreadyMigrated reports whether dst holds src's migration: a kvpersist
// file of the same layout, tensors (dtype, shape, bytes) and metadata at
// every level, and, for a manifest with kept boundaries, the same block
// list; for any manifest every block present with its size (a missing one
// means: migrate again, which repairs it). A destination that exists and
// is something else is an ErrDestinationExists error.
func alreadyMigrated(fsys vfs.FS, src *layout.Snapshot, dst string, keep bool) (bool, error) {
	st, err := fsys.Lstat(dst)
	if vfs.IsNotExist(err) {
		return false, nil
	}
	if err != nil {
		return false, fmt.Errorf("jobs: migrate: %w", err)
	}
	if !st.Mode().IsRegular() {
		return false, fmt.Errorf("%w: %s is not a regular file", ErrDestinationExists, dst)
	}
	d, err := layout.Load(fsys, dst)
	if err != nil {
		return false, fmt.Errorf("%w: %s does not decode: %w", ErrDestinationExists, dst, err)
	}
	if d.Legacy {
		return false, fmt.Errorf("%w: %s is a file of the original worker", ErrDestinationExists, dst)
	}
	if src.Layout != d.Layout {
		return false, fmt.Errorf("%w: %s: layout %s, the source is %s", ErrDestinationExists, dst, d.Layout, src.Layout)
	}
	if why := layout.DiffHeaders(src.Header, d.Header, keep); why != "" {
		return false, fmt.Errorf("%w: %s: %s", ErrDestinationExists, dst, why)
	}
	if d.Layout == layout.Blocks {
		ns, _ := store.NamespaceOf(dst, store.Options{FS: fsys})
		for _, t := range d.Header.Slots() {
			for _, r := range t.Blocks {
				st, err := fsys.Lstat(ns.SnapshotBlockPath(d, r.Hash))
				if err != nil || !st.Mode().IsRegular() || st.Size() != r.Bytes {
					return false, nil
				}
			}
		}
	}
	return true, nil
}
