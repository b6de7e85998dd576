package jobs

import (
	"context"
	"encoding/hex"
	"errors"
	"fmt"
	"hash"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvpersist/kvpersist/engine/layout"
	"github.com/kvpersist/kvpersist/engine/store"
	"github.com/kvpersist/kvpersist/engine/vfs"
	"github.com/kvpersist/kvpersist/internal/bunhash"
	"github.com/kvpersist/kvpersist/internal/xxh3s"
	"github.com/minio/sha256-simd"
	"github.com/zeebo/xxh3"
)

// Kinds of problem VerifyStore reports (VerifyProblem.Kind).
const (
	// ProblemIO: something could not be read (path: what).
	ProblemIO = "io-error"
	// ProblemUnreadable: a snapshot file or manifest does not decode.
	ProblemUnreadable = "unreadable"
	// ProblemCorruptTensor: a single-file tensor's hash differs (detail names the slot).
	ProblemCorruptTensor = "corrupt-tensor"
	// ProblemCorruptBlock: a block's SHA-256 differs from its name.
	ProblemCorruptBlock = "corrupt-block"
	// ProblemBlockXXH3: a formatVersion 8 manifest records an XXH3-64
	// for a block that differs from the block's bytes, which match the
	// block's name (SHA-256): a verified restore of that manifest, which
	// checks the xxh3, fails with ErrCorrupt. The manifest is at fault,
	// not the block (other manifests may name it rightly), so the path is
	// the manifest's, one problem per manifest; the detail names the slot,
	// the block and the block file (and counts further blocks the same
	// manifest gets wrong). The repair is to remove or re-save the
	// manifest, never the block.
	ProblemBlockXXH3 = "block-xxh3"
	// ProblemMissingBlock: a block a manifest names does not exist (path: where it should be).
	ProblemMissingBlock = "missing-block"
	// ProblemBlockSize: a block's size differs from its manifest entry, or
	// manifests disagree on it.
	ProblemBlockSize = "block-size"
	// ProblemStaleTemp: a temp file older than the grace period (collect removes it).
	ProblemStaleTemp = "stale-temp"
	// ProblemOrphanBlock: a block no manifest names (collect deletes it).
	ProblemOrphanBlock = "orphan-block"
	// ProblemMissingPage: a page a page manifest names does not exist
	// (path: where it should be).
	ProblemMissingPage = "missing-page"
	// ProblemCorruptPage: a file under pages/ that decodes but is not the
	// page its name says (not a page file, or its key is not its name).
	// A page whose header, or whose key against the chain from its parent
	// and token ids, fails to validate is ProblemUnreadable; a page
	// tensor whose hash differs is ProblemCorruptTensor.
	ProblemCorruptPage = "corrupt-page"
	// ProblemFanout: a file or symlink where a fan-out directory belongs
	// (pages/<xx> or blocks/<xx>, two lowercase hex digits): no page or
	// block whose key starts with those digits can be saved or loaded
	// until it is removed (path: the entry).
	ProblemFanout = "not-a-directory"
)

// problemRank orders a report: data that cannot be restored first, then
// what collect cleans up.
var problemRank = map[string]int{ProblemIO: 0, ProblemUnreadable: 1, ProblemCorruptTensor: 2, ProblemCorruptBlock: 3,
	ProblemBlockXXH3: 4, ProblemCorruptPage: 5, ProblemMissingBlock: 6, ProblemMissingPage: 7, ProblemFanout: 8,
	ProblemBlockSize: 9, ProblemStaleTemp: 10, ProblemOrphanBlock: 11}

// maxRefs is how many referrers a problem names; the rest are counted.
const maxRefs = 4

// maxXXH3Refs is how many manifest blocks recording one XXH3-64 value for
// a block are kept by name (each wrong one is a ProblemBlockXXH3 of its
// manifest); the rest are counted, in a note. A constant, so a block named
// by a million agreeing manifests costs the same as by five.
const maxXXH3Refs = 64

// xxh3Pool holds streaming XXH3-64 hashers for VerifyStore.
var xxh3Pool = sync.Pool{New: func() any { return xxh3.New() }}

// sha256Pool holds SHA-256 hashers for VerifyStore's blocks.
var sha256Pool = sync.Pool{New: func() any { return sha256.New() }}

// verifyPiece is the unit, in bytes, in which VerifyStore reads and hashes.
const verifyPiece = 256 << 10

// VerifyProblem is one problem VerifyStore found.
type VerifyProblem struct {
	Kind   string `json:"kind"`
	Path   string `json:"path"`
	Detail string `json:"detail"`
}

// VerifyChecked counts what VerifyStore checked.
type VerifyChecked struct {
	Namespaces int   `json:"namespaces"`
	Snapshots  int   `json:"snapshots"` // decoded snapshot files and manifests
	Tensors    int   `json:"tensors"`   // single-file and page tensors re-hashed
	Pages      int   `json:"pages"`     // page files decoded (key chain checked)
	Blocks     int   `json:"blocks"`    // distinct block files re-hashed
	Bytes      int64 `json:"bytes"`     // bytes re-hashed
}

// VerifyReport is the outcome of VerifyStore.
type VerifyReport struct {
	Target string
	// Problems, sorted by kind (ProblemIO, ProblemUnreadable,
	// ProblemCorruptTensor, ProblemCorruptBlock, ProblemBlockXXH3,
	// ProblemCorruptPage,
	// ProblemMissingBlock, ProblemMissingPage, ProblemFanout,
	// ProblemBlockSize, ProblemStaleTemp, ProblemOrphanBlock), then path.
	// At most one problem per kind and path.
	Problems []VerifyProblem
	Checked  VerifyChecked
	// Notes say what was not checked and why.
	Notes []string
	// Skipped lists entries the store model does not recognise (sorted per
	// namespace; never touched).
	Skipped []string
}

// VerifySpec describes a verification.
type VerifySpec struct {
	// Target is a store root (every namespace), a namespace directory, or
	// a snapshot file or manifest. A directory is a namespace when it holds
	// blocks/, pages/, a .lock or a snapshot file (store.ProbeDir), whether
	// or not it has blocks/.
	Target string
	// TempGrace: temp files older than this are reported stale (root and
	// namespace targets); 0 means DefaultTempGrace, NoTempGrace (any
	// negative value) every temp file.
	TempGrace time.Duration
	// Now is the clock for TempGrace; zero means time.Now().
	Now time.Time
	// OnPlan, when non-nil, is called once before re-hashing with the
	// bytes to re-hash; OnProgress with each piece re-hashed (from the
	// hashing goroutines, concurrently). Neither is called after VerifyStore
	// returns.
	OnPlan     func(totalBytes int64)
	OnProgress func(bytes int64)
	// OnLockWait, when non-nil, is called when a namespace's lock is not
	// granted at once (a write or collect is running) and VerifyStore waits.
	OnLockWait func(nsDir string)
}

// verifyTask is one file region to re-hash.
type verifyTask struct {
	path  string
	off   int64 // byte offset in the file
	size  int64 // bytes to hash
	want  string
	block bool      // SHA-256 of a whole block file (want is its name)
	xxh3  *xxh3Refs // block: the XXH3-64s manifests record for it, checked in the same pass
	page  bool      // a whole page file: decoded, then each tensor (size: the file's)
	bun   bool      // Bun.hash of a legacy single-file tensor
	slot  string    // tensor: slot name
	refs  *refs     // block: who names it
}

// refs names the first maxRefs referrers of a block and counts the rest,
// so a block named by a million manifests costs the same as by five.
type refs struct {
	first []string
	n     int
}

func (r *refs) add(s string) {
	if len(r.first) < maxRefs {
		r.first = append(r.first, s)
	}
	r.n++
}

func (r *refs) String() string {
	if r == nil || r.n == 0 {
		return "no readable manifest"
	}
	s := strings.Join(r.first, ", ")
	if r.n > len(r.first) {
		s += fmt.Sprintf(" and %d more", r.n-len(r.first))
	}
	return s
}

// blockUse is a block path named by manifests of one namespace.
type blockUse struct {
	hash     string
	bytes    int64
	refs     refs
	conflict bool // manifests disagree on its size: reported once
	xxh3     xxh3Refs
}

// xxh3Refs are the XXH3-64 values FormatBlocksXXH3 manifests record for
// one block, each with who records it: the first value inline, others (a
// wrong manifest) in a map made only then, so the common case, every
// manifest agreeing, costs no map per block.
type xxh3Refs struct {
	sum   uint64
	who   xxh3Who // who records sum; who.n == 0: no manifest records an xxh3
	other map[uint64]*xxh3Who
}

// xxh3Ref is one manifest's block recording an xxh3.
type xxh3Ref struct {
	manifest string // the manifest's path
	slot     string // its slot's name (layout.SlotIndex.Name)
	block    int    // index in the slot's blocks
}

// xxh3Who names the first maxXXH3Refs manifest blocks recording one value
// and counts the rest.
type xxh3Who struct {
	first []xxh3Ref
	n     int
}

func (w *xxh3Who) add(manifest string, names *layout.SlotIndex, slot, block int) {
	if len(w.first) < maxXXH3Refs {
		w.first = append(w.first, xxh3Ref{manifest, names.Name(slot), block})
	}
	w.n++
}

// add records that block block of slot of manifest says the block's xxh3
// is hexSum (16 hex digits, validated by the decode); names names the
// slot of a referrer kept by name.
func (x *xxh3Refs) add(hexSum, manifest string, names *layout.SlotIndex, slot, block int) {
	v := layout.HashValue(hexSum)
	switch {
	case x.who.n == 0 || v == x.sum:
		x.sum = v
		x.who.add(manifest, names, slot, block)
	default:
		if x.other == nil {
			x.other = map[uint64]*xxh3Who{}
		}
		w := x.other[v]
		if w == nil {
			w = &xxh3Who{}
			x.other[v] = w
		}
		w.add(manifest, names, slot, block)
	}
}

// recorded reports whether any manifest records an xxh3 for the block.
func (x *xxh3Refs) recorded() bool { return x != nil && x.who.n > 0 }

// wrong calls f for each recorded value other than got, with who records it.
func (x *xxh3Refs) wrong(got uint64, f func(sum uint64, w *xxh3Who)) {
	if x.sum != got {
		f(x.sum, &x.who)
	}
	for v, w := range x.other {
		if v != got {
			f(v, w)
		}
	}
}

// xxh3Fault gathers the blocks one manifest records a wrong xxh3 for: one
// ProblemBlockXXH3 of the manifest.
type xxh3Fault struct {
	first []string // the first maxRefs, described
	n     int
}

// blockXXH3 records that r's manifest says the block file at path (whose
// bytes match its name and hash to got) has xxh3 recorded.
func (v *verifier) blockXXH3(r xxh3Ref, path string, recorded, got uint64) {
	v.mu.Lock()
	defer v.mu.Unlock()
	if v.xxh3Faults == nil {
		v.xxh3Faults = map[string]*xxh3Fault{}
	}
	f := v.xxh3Faults[r.manifest]
	if f == nil {
		f = &xxh3Fault{}
		v.xxh3Faults[r.manifest] = f
	}
	if len(f.first) < maxRefs {
		f.first = append(f.first, fmt.Sprintf("%s block %d records xxh3 %s, but its block file %s (whose SHA-256 matches its name) hashes to %s",
			r.slot, r.block, layout.TensorHash(recorded), path, layout.TensorHash(got)))
	}
	f.n++
}

// reportXXH3Faults turns the gathered xxh3 faults into one
// ProblemBlockXXH3 per manifest.
func (v *verifier) reportXXH3Faults() {
	for m, f := range v.xxh3Faults {
		more := ""
		if f.n > len(f.first) {
			more = fmt.Sprintf("; and %d more blocks", f.n-len(f.first))
		}
		v.rep.Problems = append(v.rep.Problems, VerifyProblem{Kind: ProblemBlockXXH3, Path: m,
			Detail: strings.Join(f.first, "; ") + more + ": a verified restore of this snapshot fails; remove or re-save this manifest, never the block"})
	}
}

type verifier struct {
	cfg  *Config
	spec *VerifySpec
	now  time.Time

	mu         sync.Mutex
	rep        VerifyReport
	xxh3Faults map[string]*xxh3Fault // by manifest path: ProblemBlockXXH3
}

// VerifyStore re-reads and re-hashes a store, a namespace or one snapshot (see
// VerifySpec.Target) without writing anything: every header (decode and
// validation, as Read), every single-file tensor (xxh3-64, or Bun.hash for
// the Bun worker's files) and every block a manifest names (present, its
// size, its SHA-256 equal to its name, and, in the same pass, its XXH3-64
// equal to the one each FormatBlocksXXH3 manifest records for it; each
// distinct block once per namespace), the pages a page manifest names (present), and, for a root
// or namespace, every page file under pages/ (its header decoded, which
// checks its key against the chain from its parent and token ids; the
// key equal to its file name; each tensor's xxh3-64), orphan blocks (named by no
// readable manifest: what Collect deletes; none reported in a namespace
// holding an unreadable manifest, as Collect does not sweep it) and stale
// temp files. It streams: memory is one 256 KiB buffer per goroutine
// (plus, for a Bun worker's single-file tensor, the tensor: Bun.hash has no
// streaming form) and the list of blocks to check.
//
// A namespace is listed and planned under its exclusive lock, taken only
// if the lock file exists (a write in progress finishes first, so its
// blocks are not taken for orphans); re-hashing runs without it. Problems
// found are in the report; the error is for a target that is neither a
// store root, a namespace nor a snapshot file (store.ErrRoot,
// store.ErrNamespace, fs.ErrNotExist), and for ctx's.
func VerifyStore(ctx context.Context, cfg *Config, spec *VerifySpec) (*VerifyReport, error) {
	v := &verifier{cfg: cfg, spec: spec, now: spec.Now}
	if v.now.IsZero() {
		v.now = time.Now()
	}
	v.rep.Target = spec.Target
	fsys := cfg.fs()
	fi, err := fsys.Lstat(spec.Target)
	if err != nil {
		return nil, fmt.Errorf("jobs: verify: %w", err)
	}
	var tasks []verifyTask
	switch {
	case fi.Mode().IsRegular():
		tasks, err = v.planSnapshot(ctx, spec.Target)
	default:
		tasks, err = v.planDir(ctx, fi)
	}
	if err != nil {
		return nil, err
	}
	if err := v.run(ctx, tasks); err != nil {
		return nil, err
	}
	v.reportXXH3Faults()
	r := &v.rep
	sort.SliceStable(r.Problems, func(i, j int) bool {
		a, b := r.Problems[i], r.Problems[j]
		if ra, rb := problemRank[a.Kind], problemRank[b.Kind]; ra != rb {
			return ra < rb
		}
		return a.Path < b.Path
	})
	return r, nil
}

// planDir plans a store root or a namespace directory.
func (v *verifier) planDir(ctx context.Context, fi os.FileInfo) ([]verifyTask, error) {
	target := v.spec.Target
	kind, _, err := store.ProbeDir(v.cfg.fs(), target)
	if err != nil {
		return nil, fmt.Errorf("jobs: verify: %w: %s: %w", store.ErrRoot, target, err)
	}
	if kind == store.DirNamespace {
		if fi.Mode()&os.ModeSymlink != 0 {
			return nil, fmt.Errorf("jobs: verify: %w: %s is a symlink", store.ErrNamespace, target)
		}
		return v.planNamespace(ctx, store.NamespaceAt(target, v.cfg.storeOptions()))
	}
	st, err := store.Open(target, v.cfg.storeOptions())
	if err != nil {
		return nil, fmt.Errorf("jobs: verify: %w", err)
	}
	names, skipped, err := st.Namespaces(false)
	if err != nil {
		return nil, fmt.Errorf("jobs: verify: %w", err)
	}
	v.rep.Skipped = append(v.rep.Skipped, skipped...)
	var tasks []verifyTask
	for _, name := range names {
		if err := ctx.Err(); err != nil {
			return nil, err
		}
		ns, err := st.Namespace(name)
		if err != nil {
			return nil, err
		}
		t, err := v.planNamespace(ctx, ns)
		if err != nil {
			return nil, err
		}
		tasks = append(tasks, t...)
	}
	return tasks, nil
}

func (v *verifier) problem(kind, path, format string, a ...any) {
	p := VerifyProblem{Kind: kind, Path: path, Detail: fmt.Sprintf(format, a...)}
	v.mu.Lock()
	v.rep.Problems = append(v.rep.Problems, p)
	v.mu.Unlock()
}

// note adds a note to the report (safe from the hashing goroutines).
func (v *verifier) note(format string, a ...any) {
	v.mu.Lock()
	v.rep.Notes = append(v.rep.Notes, fmt.Sprintf(format, a...))
	v.mu.Unlock()
}

func (v *verifier) unreadable(path string, err error) {
	if layout.IsDecodeError(err) {
		msg := strings.TrimPrefix(err.Error(), "layout: "+path+": ")
		v.problem(ProblemUnreadable, path, "%s check failed: %s", FailedCheck(err), msg)
	} else {
		v.problem(ProblemIO, path, "%v", err)
	}
}

// FailedCheck names the check of layout.Decode an error comes from
// ("magic", "header hash", ...; "read" for an I/O error).
func FailedCheck(err error) string {
	switch {
	case errors.Is(err, layout.ErrBadMagic):
		return "magic"
	case errors.Is(err, layout.ErrHeaderTooLarge):
		return "header length"
	case errors.Is(err, layout.ErrHeaderHash):
		return "header hash"
	case errors.Is(err, layout.ErrFormatVersion):
		return "format version"
	case errors.Is(err, layout.ErrTruncated):
		return "file length (truncated)"
	case errors.Is(err, layout.ErrInvalidHeader), errors.Is(err, layout.ErrUnknownDType):
		return "header validation"
	}
	return "read"
}

// lock takes ns's lock if its file exists, telling OnLockWait when it has
// to wait.
func (v *verifier) lock(ctx context.Context, ns *store.Namespace, exclusive bool) (func(), error) {
	if v.spec.OnLockWait != nil {
		wctx, cancel := context.WithTimeout(ctx, 50*time.Millisecond)
		unlock, _, err := ns.LockIfExists(wctx, exclusive)
		cancel()
		if err == nil || ctx.Err() != nil || !errors.Is(err, context.DeadlineExceeded) {
			return unlock, err
		}
		v.spec.OnLockWait(ns.Dir())
	}
	unlock, _, err := ns.LockIfExists(ctx, exclusive)
	return unlock, err
}

// planSnapshot plans the checks of one snapshot file or manifest, under
// its namespace's shared lock.
func (v *verifier) planSnapshot(ctx context.Context, path string) ([]verifyTask, error) {
	ns, name := store.NamespaceOf(path, v.cfg.storeOptions())
	unlock, err := v.lock(ctx, ns, false)
	if err != nil {
		return nil, fmt.Errorf("jobs: verify: %w", err)
	}
	defer unlock()
	snap, err := layout.Load(v.cfg.fs(), path)
	if err != nil {
		v.unreadable(path, err)
		return nil, nil
	}
	v.rep.Checked.Snapshots++
	uses := map[string]*blockUse{}
	tasks := v.planSnap(ns, snap, name, uses)
	if snap.Pages != nil {
		fsys := v.cfg.fs()
		for _, k := range snap.Pages.Keys {
			p := ns.PagePath(k)
			if st, err := fsys.Lstat(p); err == nil && st.Mode().IsRegular() {
				tasks = append(tasks, verifyTask{path: p, size: st.Size(), want: k.String(), page: true})
			}
		}
	}
	return append(tasks, v.planBlocks(uses, nil)...), nil
}

// planSnap adds a decoded snapshot: tensor tasks for a single file and for
// a page manifest's attachments (its slots with a hash; its cache tensors
// live in pages, checked here for presence and re-hashed with the pages of
// the namespace), block uses (by path) for a manifest. Manifests that
// disagree on a block's size make one problem per block, naming at most
// maxRefs of them.
func (v *verifier) planSnap(ns *store.Namespace, snap *layout.Snapshot, name string, uses map[string]*blockUse) []verifyTask {
	var tasks []verifyTask
	if snap.Pages != nil {
		v.planPageList(ns, snap, name)
	}
	names := snap.Header.SlotIndex() // O(1) per slot name
	for i, t := range snap.Header.Slots() {
		if snap.Layout == layout.Single || (snap.Layout == layout.Pages && t.Hash != "") {
			tasks = append(tasks, verifyTask{path: snap.Path, off: int64(snap.DataStart) + t.Off, size: t.Bytes,
				want: t.Hash, bun: snap.Legacy, slot: names.Name(i)})
			continue
		}
		for b, ref := range t.Blocks {
			p := ns.SnapshotBlockPath(snap, ref.Hash)
			u := uses[p]
			if u == nil {
				u = &blockUse{hash: ref.Hash, bytes: ref.Bytes}
				uses[p] = u
			}
			if u.bytes != ref.Bytes && !u.conflict {
				u.conflict = true
				v.problem(ProblemBlockSize, p, "manifests disagree on its size: %d bytes (%s) and %d bytes (%s slot %d block %d)",
					u.bytes, u.refs.String(), ref.Bytes, name, i, b)
			}
			u.refs.add(fmt.Sprintf("%s slot %d block %d", name, i, b))
			if ref.XXH3 != "" {
				u.xxh3.add(ref.XXH3, snap.Path, names, i, b)
			}
		}
	}
	return tasks
}

// planPageList reports the pages a page manifest names that are not
// regular files in ns's pages/. The pages themselves are re-hashed as page
// files of the namespace (a root or namespace target), or here for a
// snapshot target.
func (v *verifier) planPageList(ns *store.Namespace, snap *layout.Snapshot, name string) {
	fsys := v.cfg.fs()
	for i, k := range snap.Pages.Keys {
		p := ns.PagePath(k)
		st, err := fsys.Lstat(p)
		switch {
		case err != nil && os.IsNotExist(err):
			v.problem(ProblemMissingPage, p, "page %d of %s", i, name)
		case err != nil:
			v.problem(ProblemIO, p, "%v", err)
		case !st.Mode().IsRegular():
			v.problem(ProblemCorruptPage, p, "not a regular file (%v); page %d of %s", st.Mode().Type(), i, name)
		}
	}
}

// pageTasks plans the re-hashing of page files: one task per file, which
// decodes it and hashes its tensors (check), so that memory does not grow
// with the tensors of every page.
func pageTasks(pages []store.Page) []verifyTask {
	tasks := make([]verifyTask, 0, len(pages))
	for _, pg := range pages {
		tasks = append(tasks, verifyTask{path: pg.Path, size: pg.Size, want: pg.Key, page: true})
	}
	return tasks
}

// planBlocks checks the blocks named by manifests against the files on disk
// (presence, size) and plans re-hashing those that are there. onDisk, when
// non-nil, is the namespace's block files by path (from its listing); nil
// means look each one up.
func (v *verifier) planBlocks(uses map[string]*blockUse, onDisk map[string]store.Block) []verifyTask {
	paths := make([]string, 0, len(uses))
	for p, u := range uses {
		if !u.conflict {
			paths = append(paths, p)
		}
	}
	sort.Strings(paths)
	fsys := v.cfg.fs()
	var tasks []verifyTask
	for _, p := range paths {
		u := uses[p]
		size, found := int64(0), false
		if onDisk != nil {
			var b store.Block
			b, found = onDisk[p]
			size = b.Size
		}
		if !found {
			st, err := fsys.Lstat(p)
			switch {
			case err != nil && os.IsNotExist(err):
				v.problem(ProblemMissingBlock, p, "named by %s", u.refs.String())
				continue
			case err != nil:
				v.problem(ProblemIO, p, "%v", err)
				continue
			case !st.Mode().IsRegular():
				v.problem(ProblemBlockSize, p, "not a regular file (%v); named by %s", st.Mode().Type(), u.refs.String())
				continue
			}
			size = st.Size()
		}
		if size != u.bytes {
			v.problem(ProblemBlockSize, p, "%d bytes, the manifest says %d; named by %s", size, u.bytes, u.refs.String())
			continue
		}
		tasks = append(tasks, verifyTask{path: p, size: size, want: u.hash, block: true, refs: &u.refs, xxh3: &u.xxh3})
	}
	return tasks
}

// fanouts reports each skipped entry of ns's pages/ or blocks/ named as a
// fan-out directory (two lowercase hex digits) that is not a directory:
// the listing skips it, but it stops every page or block of its fan-out.
func (v *verifier) fanouts(ns *store.Namespace, skipped []store.Skip) {
	for _, s := range skipped {
		dir, name := filepath.Split(s.Path)
		dir = filepath.Clean(dir)
		if (dir != ns.PagesDir() && dir != ns.BlocksDir()) || len(name) != 2 || strings.Trim(name, "0123456789abcdef") != "" {
			continue
		}
		v.problem(ProblemFanout, s.Path, "%s where the fan-out directory of keys starting with %s belongs: no page or block there can be saved or loaded; remove it", s.Why, name)
	}
}

// planNamespace lists and decodes one namespace under its exclusive lock
// (if the lock file exists) and plans its checks.
func (v *verifier) planNamespace(ctx context.Context, ns *store.Namespace) ([]verifyTask, error) {
	unlock, err := v.lock(ctx, ns, true)
	if err != nil {
		return nil, fmt.Errorf("jobs: verify: %w", err)
	}
	defer unlock()
	v.rep.Checked.Namespaces++
	l, err := ns.List(true)
	if err != nil {
		v.problem(ProblemIO, ns.Dir(), "listing the namespace: %v", err)
		return nil, nil
	}
	v.rep.Skipped = append(v.rep.Skipped, l.SkippedPaths()...)
	v.fanouts(ns, l.Skipped)
	grace := v.spec.TempGrace
	for _, t := range l.Temps {
		if t.Stale(v.now, grace) {
			v.problem(ProblemStaleTemp, t.Path, "temp file of an interrupted write, %s old (grace %s), %d bytes; gc removes it",
				v.now.Sub(t.ModTime).Round(time.Second), store.Grace(grace), t.Size)
		}
	}
	uses := map[string]*blockUse{}
	live := map[string]bool{}
	var tasks []verifyTask
	var bad []string
	for _, s := range l.Snapshots {
		if s.Err != nil {
			v.unreadable(s.Path, s.Err)
			bad = append(bad, s.Name)
			continue
		}
		v.rep.Checked.Snapshots++
		tasks = append(tasks, v.planSnap(ns, s.Snap, s.Name, uses)...)
		for _, t := range s.Snap.Header.Slots() {
			for _, b := range t.Blocks {
				live[b.Hash] = true
			}
		}
	}
	onDisk := make(map[string]store.Block, len(l.Blocks))
	for _, b := range l.Blocks {
		onDisk[b.Path] = b
	}
	tasks = append(tasks, v.planBlocks(uses, onDisk)...)
	// Every page file, named by a manifest or not (a cache entry): gc
	// keeps them all, so none is an orphan.
	tasks = append(tasks, pageTasks(l.Pages)...)
	// Blocks no manifest names at their path. As Collect: a block is live
	// when a readable manifest names its hash (wherever it lies), and
	// nothing is an orphan in a namespace holding an unreadable manifest.
	unnamed := 0
	for _, b := range l.Blocks {
		if _, ok := uses[b.Path]; ok {
			continue
		}
		if live[b.Hash] || len(bad) > 0 {
			unnamed++
			tasks = append(tasks, verifyTask{path: b.Path, size: b.Size, want: b.Hash, block: true})
			continue
		}
		v.problem(ProblemOrphanBlock, b.Path, "%d bytes, named by no manifest; gc deletes it", b.Size)
	}
	if len(bad) > 0 {
		v.rep.Notes = append(v.rep.Notes, fmt.Sprintf("namespace %s: orphan blocks not reported: %d unreadable manifest(s) (%s) may name them, so gc will not sweep this namespace until they are repaired or removed; %d unnamed block(s) were re-hashed against their names",
			ns.Dir(), len(bad), strings.Join(bad, ", "), unnamed))
	}
	return tasks, nil
}

// run re-hashes every task with cfg's goroutines (the caller's and those
// Spawn lends; all joined before it returns). Mismatches and read failures
// become problems; the error is ctx's.
func (v *verifier) run(ctx context.Context, tasks []verifyTask) error {
	var total int64
	for _, t := range tasks {
		total += t.size
	}
	if v.spec.OnPlan != nil {
		v.spec.OnPlan(total)
	}
	var tensors, blocks, pages, hashed atomic.Int64
	err := parallel(ctx, v.cfg, len(tasks), verifyPiece, func(i int, buf []byte) error {
		t := &tasks[i]
		var n int64
		var err error
		if t.page {
			var nt int
			n, nt, err = v.checkPage(ctx, t, buf[:verifyPiece])
			if nt >= 0 {
				pages.Add(1)
				tensors.Add(int64(nt))
			}
		} else {
			n, err = v.check(ctx, t, buf[:verifyPiece])
		}
		hashed.Add(n)
		if err != nil {
			if ctx.Err() != nil {
				return ctx.Err()
			}
			v.problem(ProblemIO, t.path, "%v", err)
		}
		switch {
		case t.page:
		case t.block:
			blocks.Add(1)
		default:
			tensors.Add(1)
		}
		return nil
	})
	v.rep.Checked.Tensors += int(tensors.Load())
	v.rep.Checked.Blocks += int(blocks.Load())
	v.rep.Checked.Pages += int(pages.Load())
	v.rep.Checked.Bytes += hashed.Load()
	return err
}

// check re-hashes one task, reporting a mismatch as a problem. It returns
// the bytes hashed and an I/O error, if any.
func (v *verifier) check(ctx context.Context, t *verifyTask, buf []byte) (int64, error) {
	f, err := v.cfg.fs().Open(t.path)
	if err != nil {
		if t.block && os.IsNotExist(err) {
			v.problem(ProblemMissingBlock, t.path, "vanished while verifying; named by %s", t.refs.String())
			return 0, nil
		}
		return 0, err
	}
	defer f.Close()
	if t.block {
		st, err := f.Stat()
		if err != nil {
			return 0, err
		}
		if st.Size() != t.size {
			v.problem(ProblemBlockSize, t.path, "%d bytes, expected %d", st.Size(), t.size)
			return 0, nil
		}
	}
	return v.hash(ctx, t, f, buf)
}

// hash re-hashes t's region of the open file f, reporting a mismatch or a
// short file as a problem. It returns the bytes hashed and an I/O error.
func (v *verifier) hash(ctx context.Context, t *verifyTask, f vfs.File, buf []byte) (int64, error) {
	progress := func(n int64) {
		if v.spec.OnProgress != nil {
			v.spec.OnProgress(n)
		}
	}
	if t.bun {
		// Bun.hash has no streaming form: the legacy tensor is read whole.
		data := make([]byte, t.size)
		if err := layout.ReadFull(f, data, t.off); err != nil {
			if errors.Is(err, layout.ErrTruncated) {
				v.problem(ProblemCorruptTensor, t.path, "%s: %v", t.slot, err)
				return 0, nil
			}
			return 0, err
		}
		progress(t.size)
		if got := bunhash.Hex(data); got != t.want {
			v.problem(ProblemCorruptTensor, t.path, "%s: Bun.hash %s, the header says %s", t.slot, got, t.want)
		}
		return t.size, nil
	}
	var h hash.Hash
	var xh *xxh3.Hasher
	var bx *xxh3s.Digest // a block's xxh3, when a manifest records one
	if t.block {
		h = sha256Pool.Get().(hash.Hash)
		defer sha256Pool.Put(h)
		h.Reset()
		if t.xxh3.recorded() {
			bx = new(xxh3s.Digest)
		}
	} else {
		xh = xxh3Pool.Get().(*xxh3.Hasher)
		defer xxh3Pool.Put(xh)
		xh.Reset()
		h = xh
	}
	var done int64
	for done < t.size {
		if err := ctx.Err(); err != nil {
			return done, err
		}
		n := min(int64(len(buf)), t.size-done)
		if err := layout.ReadFull(f, buf[:n], t.off+done); err != nil {
			if errors.Is(err, layout.ErrTruncated) {
				if t.block {
					v.problem(ProblemBlockSize, t.path, "shrank while verifying: %v", err)
				} else {
					v.problem(ProblemCorruptTensor, t.path, "%s: %v", t.slot, err)
				}
				return done, nil
			}
			return done, err
		}
		h.Write(buf[:n])
		if bx != nil {
			bx.Write(buf[:n]) // the same piece, hot in cache
		}
		done += n
		progress(n)
	}
	if t.block {
		var sum [32]byte
		if got := hex.EncodeToString(h.Sum(sum[:0])); got != t.want {
			v.problem(ProblemCorruptBlock, t.path, "SHA-256 %s differs from its name; named by %s", got, t.refs.String())
		} else if bx != nil {
			// The bytes are the block's: a manifest recording another
			// xxh3 is wrong (a corrupt block is reported once, above),
			// and reported as such, never the block.
			got := bx.Sum64()
			t.xxh3.wrong(got, func(sum uint64, w *xxh3Who) {
				for _, r := range w.first {
					v.blockXXH3(r, t.path, sum, got)
				}
				if w.n > len(w.first) {
					v.note("block %s: %d more manifest blocks record xxh3 %s for it (not named: verify names at most %d per value); verify again after repairing the manifests reported",
						t.path, w.n-len(w.first), layout.TensorHash(sum), maxXXH3Refs)
				}
			})
		}
		return done, nil
	}
	if got := layout.TensorHash(xh.Sum64()); got != t.want {
		v.problem(ProblemCorruptTensor, t.path, "%s: xxh3 %s, the header says %s", t.slot, got, t.want)
	}
	return done, nil
}

// checkPage verifies one page file: its header decodes (layout.Decode
// checks the key against the chain from its parent and token ids), it is
// a page whose key is its file name (t.want), and each tensor's xxh3-64
// equals the header's. Problems go to the report. It returns the bytes
// hashed, the tensors checked (-1 when the file vanished since it was
// listed: an eviction, not a problem) and an I/O error, if any.
func (v *verifier) checkPage(ctx context.Context, t *verifyTask, buf []byte) (int64, int, error) {
	f, err := v.cfg.fs().Open(t.path)
	if err != nil {
		if os.IsNotExist(err) {
			return 0, -1, nil
		}
		return 0, 0, err
	}
	defer f.Close()
	snap, err := layout.DecodePage(f, t.path)
	if err != nil {
		v.unreadable(t.path, err)
		return 0, 0, nil
	}
	if snap.Page == nil {
		v.problem(ProblemCorruptPage, t.path, "not a page file (formatVersion %d)", snap.Header.FormatVersion)
		return 0, 0, nil
	}
	if got := snap.Page.Key.String(); got != t.want {
		v.problem(ProblemCorruptPage, t.path, "holds the page of key %s, not of its name", got)
		return 0, 0, nil
	}
	var done int64
	nt := 0
	names := snap.Header.SlotIndex()
	for i, ts := range snap.Header.Slots() {
		tt := verifyTask{path: t.path, off: int64(snap.DataStart) + ts.Off, size: ts.Bytes, want: ts.Hash, slot: names.Name(i)}
		n, err := v.hash(ctx, &tt, f, buf)
		done += n
		nt++
		if err != nil {
			return done, nt, err
		}
	}
	if v.spec.OnProgress != nil && t.size > done {
		v.spec.OnProgress(t.size - done) // the header: planned with the file's size
	}
	return done, nt, nil
}
