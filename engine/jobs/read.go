package jobs

import (
	"context"
	"encoding/hex"
	"errors"
	"fmt"
	"io/fs"
	"path/filepath"
	"slices"
	"sort"
	"strings"
	"syscall"
	"time"

	"github.com/kvpersist/kvpersist/engine/gather"
	"github.com/kvpersist/kvpersist/engine/layout"
	"github.com/kvpersist/kvpersist/engine/readio"
	"github.com/kvpersist/kvpersist/engine/store"
	"github.com/kvpersist/kvpersist/engine/vfs"
	"github.com/kvpersist/kvpersist/internal/bunhash"
)

// readSpec is a read request with its resolved path.
type readSpec struct {
	Path string
	*ReadRequest
}

// SlotError is one tensor that failed during a read.
type SlotError struct {
	Slot int
	Name string // e.g. "cache 3 tensor 1 (slot 7)"
	Err  error
}

// ReadError lists every tensor a read could not restore. It wraps each
// slot's error, so errors.Is(err, ErrCorrupt) and the like work.
type ReadError struct {
	Path  string
	Slots []SlotError
}

func (e *ReadError) Error() string {
	var b strings.Builder
	fmt.Fprintf(&b, "jobs: read %s: %d tensor(s) failed:", e.Path, len(e.Slots))
	for i, s := range e.Slots {
		if i == 8 {
			fmt.Fprintf(&b, " ... and %d more", len(e.Slots)-i)
			break
		}
		fmt.Fprintf(&b, " [%s: %v]", s.Name, s.Err)
	}
	return b.String()
}

func (e *ReadError) Unwrap() []error {
	out := make([]error, len(e.Slots))
	for i, s := range e.Slots {
		out[i] = s.Err
	}
	return out
}

// CheckDest makes every check that can be made before a destination is
// touched: slot count, each buffer's length, no two buffers sharing a byte
// of memory (disjointBuffers), and (with expect) dtypes and shapes. Errors
// wrap ErrDestination or ErrMismatch.
func CheckDest(snap *layout.Snapshot, dest [][]byte, expect *layout.Header) error {
	slots := snap.Header.Slots()
	if len(dest) != len(slots) {
		return fmt.Errorf("%w: %s has %d tensors, got %d destination buffers", ErrDestination, snap.Path, len(slots), len(dest))
	}
	for i, t := range slots {
		if int64(len(dest[i])) != t.Bytes {
			return fmt.Errorf("%w: %s %s has %d bytes, its destination %d", ErrDestination, snap.Path, snap.Header.SlotName(i), t.Bytes, len(dest[i]))
		}
	}
	if i, j, overlap := disjointBuffers(dest); overlap {
		return fmt.Errorf("%w: %s: the destinations of %s and %s share bytes of memory", ErrDestination, snap.Path, snap.Header.SlotName(i), snap.Header.SlotName(j))
	}
	if expect != nil {
		want := expect.Slots()
		if len(want) != len(slots) {
			return fmt.Errorf("%w: %s has %d tensors, expected %d", ErrMismatch, snap.Path, len(slots), len(want))
		}
		for i, t := range slots {
			if t.DType != want[i].DType || !slices.Equal(t.Shape, want[i].Shape) {
				return fmt.Errorf("%w: %s %s is %s%v, expected %s%v", ErrMismatch, snap.Path, snap.Header.SlotName(i), t.DType, t.Shape, want[i].DType, want[i].Shape)
			}
		}
	}
	return nil
}

// disjointBuffers reports the first two of bufs (i < j) that share a byte
// of memory, by gather.CheckDisjoint (the check a prefix load makes of its
// strided destinations) of each buffer as a one-axis view.
func disjointBuffers(bufs [][]byte) (i, j int, overlap bool) {
	views := make([]gather.View, len(bufs))
	shapes := make([]int, len(bufs))
	one := []int{1}
	for k, b := range bufs {
		shapes[k] = len(b)
		views[k] = gather.View{Base: b, Shape: shapes[k : k+1 : k+1], Strides: one, ItemSize: 1}
	}
	i, j, err := gather.CheckDisjoint(views)
	return i, j, err != nil
}

// Read restores the snapshot <cfg.Root>/<req.Namespace>/<req.Name> into
// req.Dest. It decodes and validates the file first (layout.Decode), checks
// the destinations (CheckDest) and, for a manifest, checks every block it
// names (Lstat: a regular file of the manifest's size; see openBlocks), all
// before any byte of a destination is written; it never writes past a destination's length. The data is read
// by readio.Read: cfg.ReadDepth requests in flight, O_DIRECT where the file
// system supports it and the file is not in the page cache. A name that is
// not one valid path element is layout.ErrBadName.
//
// What a destination holds after a failure:
//   - an error from decoding, CheckDest (ErrDestination, ErrMismatch), the
//     lock, or checking the blocks (ErrMissingBlock, ErrBlockSize, a
//     symlinked block (ELOOP) or directory, an I/O error: a *ReadError
//     naming every tensor with such a block): no destination has been
//     touched;
//   - a *ReadError from reading (ErrCorrupt, an I/O error, a block that
//     cannot be opened to be read or is no longer a regular file of its
//     size: ErrBlockSize): the tensors it names hold unspecified bytes (a mix of their old contents and the
//     file's); every other tensor was read completely (and verified, unless
//     NoVerify);
//   - ctx's error: every destination holds unspecified bytes.
//
// The destinations are not touched after Read returns.
func Read(ctx context.Context, cfg *Config, req *ReadRequest) (*layout.Snapshot, Metrics, error) {
	path, err := cfg.snapshotPath(req.Ref)
	if err != nil {
		return nil, Metrics{}, fmt.Errorf("jobs: read %s: %w", req.Ref, err)
	}
	return read(ctx, cfg, &readSpec{Path: path, ReadRequest: req})
}

// read is Read of a resolved path (also migrate's, reading a legacy store).
func read(ctx context.Context, cfg *Config, spec *readSpec) (*layout.Snapshot, Metrics, error) {
	start := time.Now()
	var m Metrics
	fsys := cfg.fs()
	ns, _ := store.NamespaceOf(spec.Path, cfg.storeOptions())
	unlock, _, err := ns.LockIfExists(ctx, false)
	if err != nil {
		return nil, m, fmt.Errorf("jobs: read %s: %w", spec.Path, err)
	}
	defer unlock()
	if err := ns.Check(); err != nil {
		return nil, m, fmt.Errorf("%w: read %s: %w", ErrInvalidRequest, spec.Path, err)
	}
	f, err := fsys.Open(spec.Path)
	if err != nil {
		return nil, m, fmt.Errorf("jobs: read: %w", err)
	}
	defer f.Close()
	snap, err := layout.Decode(f, spec.Path)
	if err != nil {
		return nil, m, err
	}
	if err := CheckDest(snap, spec.Dest, spec.Expect); err != nil {
		return snap, m, err
	}
	if err := checkIdentity(snap, spec.Identity); err != nil {
		return snap, m, err
	}
	slots := snap.Header.Slots()
	for _, t := range slots {
		m.LogicalBytes += t.Bytes
	}
	var exts []readio.Extent
	var pageErr error // Pages: a page missing or unlike the manifest
	paged := 0        // Pages: extents of page tensors, before the attachments'
	switch snap.Layout {
	case layout.Single:
		src, err := adoptSource(cfg, f)
		if err != nil {
			return snap, m, fmt.Errorf("jobs: read %s: %w", spec.Path, err)
		}
		defer src.Close()
		exts = tensorExtents(snap, src, spec.Dest, !spec.NoVerify)
	case layout.Pages:
		pr, err := pagedExtents(cfg, f, snap, spec.Dest, !spec.NoVerify)
		defer pr.close()
		if err != nil {
			return snap, m, fmt.Errorf("jobs: read %s: %w", spec.Path, err)
		}
		exts, pageErr, paged = pr.exts, pr.pageErr, pr.paged
	default:
		blocks, err := openBlocks(ctx, cfg, f, snap)
		defer blocks.close()
		if err != nil {
			return snap, m, err
		}
		exts = blocks.extents(snap, spec.Dest, !spec.NoVerify)
	}
	errs, st, err := readio.Read(ctx, cfg.reads(), exts, nil)
	m.addReads(st)
	if err == nil && snap.Legacy && snap.Layout == layout.Single && !spec.NoVerify {
		// Bun.hash has no streaming form here: hash each tensor once read.
		for k, x := range exts {
			if t := slots[x.Group]; errs[k] == nil && bunhash.Hex(x.Dst) != t.Hash {
				errs[k] = fmt.Errorf("%w: Bun.hash %s, header says %s", ErrCorrupt, bunhash.Hex(x.Dst), t.Hash)
			}
		}
	}
	m.Elapsed = time.Since(start)
	if err != nil {
		return snap, m, err
	}
	failures := map[int]SlotError{}
	var names *layout.SlotIndex // built at the first failure: O(1) per failed slot
	for k, e := range errs {
		if e == nil || errors.Is(e, readio.ErrSkipped) {
			continue
		}
		slot := exts[k].Group
		if _, dup := failures[slot]; !dup {
			switch {
			case snap.Layout == layout.Blocks:
				e = fmt.Errorf("block %d: %w", blockIndex(snap, exts, k), e)
			case k < paged:
				e = fmt.Errorf("page %s: %w", exts[k].Src.Path(), e)
			}
			if names == nil {
				names = snap.Header.SlotIndex()
			}
			failures[slot] = SlotError{Slot: slot, Name: names.Name(slot), Err: e}
		}
	}
	if pageErr != nil {
		if names == nil {
			names = snap.Header.SlotIndex()
		}
		for slot := range cacheSlots(snap.Header) {
			failures[slot] = SlotError{Slot: slot, Name: names.Name(slot), Err: pageErr}
		}
	}
	if len(failures) > 0 {
		return snap, m, &ReadError{Path: spec.Path, Slots: sortedFailures(failures)}
	}
	return snap, m, nil
}

func sortedFailures(failures map[int]SlotError) []SlotError {
	out := make([]SlotError, 0, len(failures))
	for _, f := range failures {
		out = append(out, f)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Slot < out[j].Slot })
	return out
}

// tensorExtents is one extent per non-empty tensor of a single-file
// snapshot, grouped by slot.
func tensorExtents(snap *layout.Snapshot, src *readio.Source, dest [][]byte, verify bool) []readio.Extent {
	var exts []readio.Extent
	for i, t := range snap.Header.Slots() {
		if t.Bytes == 0 {
			continue
		}
		x := readio.Extent{Src: src, Off: int64(snap.DataStart) + t.Off, Dst: dest[i], Group: i}
		if verify && !snap.Legacy {
			x.Verify = readio.VerifyXXH3
			x.XXH3 = layout.HashValue(t.Hash) // validated by Decode: 16 hex digits
		}
		exts = append(exts, x)
	}
	return exts
}

// blockIndex is the index within its tensor of the block that extent k
// reads (extents of a tensor's blocks are consecutive, in block order).
func blockIndex(snap *layout.Snapshot, exts []readio.Extent, k int) int {
	b := 0
	for j := k - 1; j >= 0 && exts[j].Group == exts[k].Group; j-- {
		b++
	}
	return b
}

// readBlocks are the block files of one manifest, opened and sized.
type readBlocks struct {
	srcs  map[string]*readio.Source // by hash
	paths map[string]string         // by hash
}

func (b *readBlocks) close() {
	for _, s := range b.srcs {
		s.Close()
	}
}

// blockPath is where a manifest's block lives: kvpersist's fan-out, or the
// Bun worker's flat blocks/.
func blockPath(snap *layout.Snapshot, hash string) string {
	ns, _ := store.NamespaceOf(snap.Path, store.Options{})
	return ns.SnapshotBlockPath(snap, hash)
}

// openBlocks checks every distinct block the manifest names, several at a
// time (cfg.ReadDepth): by Lstat, it must be a regular file (not a
// symlink) of exactly the manifest's count, and the directories between
// the namespace and the blocks must be real directories. Every failure is
// reported, per tensor, in a *ReadError, before any destination is touched:
// the read holds the namespace's shared lock, so collect cannot remove a
// block between this check and the read. No block is opened here: each is
// a lazy Source, opened by the first read from it (inside the reading
// goroutines, so the opens overlap the reads and the hashing), checked
// again to be a regular file of the manifest's count, and closed after its
// last reference is read: a read holds at most about cfg.ReadDepth block
// files open, whatever the manifest's size, and opens each once.
func openBlocks(ctx context.Context, cfg *Config, manifest vfs.File, snap *layout.Snapshot) (*readBlocks, error) {
	fsys := cfg.fs()
	nsDir := filepath.Dir(snap.Path)
	type want struct {
		hash  string
		bytes int64
		uses  int64 // references in the manifest
	}
	var uniq []want
	index := map[string]int{} // hash -> index in uniq
	b := &readBlocks{srcs: map[string]*readio.Source{}, paths: map[string]string{}}
	for _, t := range snap.Header.Slots() {
		for _, ref := range t.Blocks {
			if k, seen := index[ref.Hash]; seen {
				uniq[k].uses++
				continue
			}
			index[ref.Hash] = len(uniq)
			b.paths[ref.Hash] = blockPath(snap, ref.Hash)
			uniq = append(uniq, want{ref.Hash, ref.Bytes, 1})
		}
	}
	// The directories between the namespace and the blocks, once each.
	dirErr := map[string]error{}
	for _, w := range uniq {
		for d := filepath.Dir(b.paths[w.hash]); d != nsDir; d = filepath.Dir(d) {
			if _, done := dirErr[d]; !done {
				dirErr[d] = checkDir(fsys, d)
			}
		}
	}
	mode := readio.DirectModeFor(cfg.reads(), manifest)
	errs := make([]error, len(uniq))
	err := readio.InFlight(ctx, cfg.reads(), cfg.reads().Depth(), len(uniq), func(i int) {
		w := uniq[i]
		path := b.paths[w.hash]
		for d := filepath.Dir(path); d != nsDir; d = filepath.Dir(d) {
			if err := dirErr[d]; err != nil {
				errs[i] = err
				return
			}
		}
		fi, err := fsys.Lstat(path)
		switch {
		case vfs.IsNotExist(err):
			errs[i] = fmt.Errorf("%w: %s", ErrMissingBlock, path)
		case err != nil:
			errs[i] = err
		case fi.Mode()&fs.ModeSymlink != 0:
			// What the read's open (O_NOFOLLOW) would say.
			errs[i] = &fs.PathError{Op: "open", Path: path, Err: syscall.ELOOP}
		case !fi.Mode().IsRegular() || fi.Size() != w.bytes:
			errs[i] = fmt.Errorf("%w: %s has %d bytes (regular file: %v), the manifest says %d", ErrBlockSize, path, fi.Size(), fi.Mode().IsRegular(), w.bytes)
		}
	})
	if err != nil {
		return b, err
	}
	bad := map[string]error{}
	for i, e := range errs {
		if e != nil {
			bad[uniq[i].hash] = e
		}
	}
	if len(bad) == 0 {
		for _, w := range uniq {
			b.srcs[w.hash] = readio.LazySource(mode, b.paths[w.hash], w.bytes, w.uses)
		}
		return b, nil
	}
	failures := map[int]SlotError{}
	names := snap.Header.SlotIndex() // O(1) per failed slot
	for slot, t := range snap.Header.Slots() {
		for k, ref := range t.Blocks {
			if e := bad[ref.Hash]; e != nil {
				failures[slot] = SlotError{Slot: slot, Name: names.Name(slot), Err: fmt.Errorf("block %d: %w", k, e)}
				break
			}
		}
	}
	return b, &ReadError{Path: snap.Path, Slots: sortedFailures(failures)}
}

// maxHeldBlocks is how many files a prefix load keeps open from the check
// of their sizes to their read; one naming more reopens each file when it
// reads it. (A snapshot read opens its blocks only to read them: see
// openBlocks.)
var maxHeldBlocks = 1024

// extents is one extent per block reference, in slot and block order,
// grouped by slot, each into its tensor's destination sub-slice. With
// verify, a block is checked by blockVerify.
func (b *readBlocks) extents(snap *layout.Snapshot, dest [][]byte, verify bool) []readio.Extent {
	var exts []readio.Extent
	for i, t := range snap.Header.Slots() {
		var o int64
		for _, ref := range t.Blocks {
			x := readio.Extent{Src: b.srcs[ref.Hash], Dst: dest[i][o:][:ref.Bytes:ref.Bytes], Group: i}
			if verify {
				blockVerify(&x, ref)
			}
			exts = append(exts, x)
			o += ref.Bytes
		}
	}
	return exts
}

// blockVerify sets how a read checks block ref's bytes: by the XXH3-64 the
// manifest records (a FormatBlocksXXH3 manifest: about 7 times cheaper
// than SHA-256 on this CPU, so a verified restore is no longer bound by
// hashing), or, for a FormatBlocks manifest (the Bun worker's, kvpersist's
// older ones), by SHA-256 against the block's name.
func blockVerify(x *readio.Extent, ref layout.BlockRef) {
	if ref.XXH3 != "" {
		x.Verify = readio.VerifyXXH3
		x.XXH3 = layout.HashValue(ref.XXH3) // validated by Decode: 16 hex digits
		return
	}
	x.Verify = readio.VerifySHA256
	hex.Decode(x.SHA256[:], []byte(ref.Hash)) // validated: 64 hex digits
}

// checkDir fails unless dir is a real directory (not a symlink to one;
// store.CheckRealDir). A missing directory is not an error here: the
// block's open reports it.
func checkDir(fsys vfs.FS, dir string) error {
	if err := store.At(filepath.Dir(dir), store.Options{FS: fsys}).CheckRealDir(dir); err != nil {
		return fmt.Errorf("%w: %w", ErrInvalidRequest, err)
	}
	return nil
}

// adoptSource is readio.AdoptSource of f with this job's read
// configuration; a file that is not regular is ErrInvalidRequest.
func adoptSource(cfg *Config, f vfs.File) (*readio.Source, error) {
	return checkedSource(readio.AdoptSource(cfg.reads(), f))
}

// ownSource is readio.OwnSource of f with this job's read configuration;
// a file that is not regular is ErrInvalidRequest.
func ownSource(cfg *Config, f vfs.File) (*readio.Source, error) {
	return checkedSource(readio.OwnSource(cfg.reads(), f))
}

func checkedSource(s *readio.Source, err error) (*readio.Source, error) {
	if errors.Is(err, readio.ErrNotRegular) {
		err = fmt.Errorf("%w: %w", ErrInvalidRequest, err)
	}
	return s, err
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
