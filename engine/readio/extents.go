// Package readio reads runs of bytes of files (extents) into caller
// memory, contiguous or strided (gather.View), with many requests in
// flight, O_DIRECT where the file system allows it and the file is not in
// the page cache, Linux AIO where the kernel has it (AsyncReads), and each
// extent's hash (XXH3-64 or SHA-256) streamed over its pieces as they
// arrive. It is the read engine of package jobs (snapshot reads, prefix
// loads); it knows files and extents, not snapshots, pages or namespaces.
package readio

import (
	"context"
	"encoding/hex"
	"errors"
	"fmt"
	"hash"
	"io"
	"io/fs"
	"log/slog"
	"os"
	"reflect"
	"runtime/debug"
	"sync"
	"sync/atomic"
	"syscall"
	"unsafe"

	"github.com/kvpersist/kvpersist/engine/gather"
	"github.com/kvpersist/kvpersist/engine/layout"
	"github.com/kvpersist/kvpersist/engine/vfs"
	"github.com/kvpersist/kvpersist/internal/scratch"
	"github.com/kvpersist/kvpersist/internal/xxh3s"
	"github.com/minio/sha256-simd"
	"golang.org/x/sys/unix"
)

// DefaultReadDepth is how many read requests (preads of up to ReadChunkBytes)
// one read keeps in flight when Config.ReadDepth is 0: cold reads gained up
// to 16 in flight and no more beyond it on the project's VM
// (BenchmarkReadDepth). Deeper costs only blocked goroutines (and, for
// unaligned destinations, one staging buffer of up to 2 MiB each).
const DefaultReadDepth = 16

// ReadChunkBytes is the size in bytes of one read request: an extent is read
// (and hashed) in pieces of this size, each hashed right after its pread
// while it is hot in cache.
const ReadChunkBytes = 1 << 20

// Verify says how Read checks an extent's bytes.
type Verify uint8

const (
	// VerifyNone reads without checking.
	VerifyNone Verify = iota
	// VerifyXXH3 checks XXH3-64 (seed 0) of the extent's bytes against
	// Extent.XXH3 (a single-file tensor's or a page's hash, or a block's
	// xxh3 in a formatVersion 8 manifest).
	VerifyXXH3
	// VerifySHA256 checks SHA-256 of the extent's bytes against
	// Extent.SHA256 (a block's name).
	VerifySHA256
)

// Extent is one run of bytes to read: Bytes() bytes at byte offset Off of
// Src into Dst (or View), checked as Verify says.
type Extent struct {
	Src *Source
	Off int64
	// Dst receives the bytes, unless View is set.
	Dst []byte
	// View, when non-nil, is a strided destination used instead of Dst:
	// the extent's View.Bytes() bytes are its elements in logical
	// (row-major) order, written into their places in View.Base (the
	// inverse of a gather: a page tensor into its token range of a
	// capacity-padded KV buffer). It must be valid with no overlapping
	// elements (gather.View.CheckNoOverlap), else the extent fails before
	// any byte of it is written. Contiguous runs of at least
	// MinRunBytes are read straight into (several at once per request:
	// preadv); a view of shorter runs is read through a staging buffer and
	// scattered, one request after the other.
	View *gather.View
	// Group: once an extent fails, the extents after it with the same
	// Group >= 0 are not read (their error is ErrSkipped): the rest of a
	// tensor whose first block is bad need not be read. -1: no group.
	Group  int
	Verify Verify
	XXH3   uint64
	SHA256 [32]byte
}

// Bytes is the extent's length in bytes: len(Dst), or View.Bytes().
func (x *Extent) Bytes() int {
	if x.View != nil {
		return x.View.Bytes()
	}
	return len(x.Dst)
}

// MinRunBytes: a strided destination (Extent.View) whose contiguous runs
// are at least this many bytes is read straight into them; one of shorter
// runs (a token-major cache: one head row of 128 to 512 bytes per run) goes
// through a staging buffer and a scatter.
const MinRunBytes = 16 << 10

// ErrSkipped: an extent was not read because an earlier one of its Group
// failed (see Extent.Group).
var ErrSkipped = errors.New("not read: an earlier extent of its group failed")

// Source is a file opened for Read: with O_DIRECT when its file
// system supports it (statx STATX_DIOALIGN reports an alignment and the
// O_DIRECT open succeeds) and the file is not wholly in the page cache
// (cachestat), else buffered. A direct source still reads the ranges of
// a request found in the page cache buffered (cachestat, see readBufs): a
// mostly cached file reads at page-cache speed and only its missing
// ranges go to the disk. Make it with OpenSource or AdoptSource and close
// it with Close.
type Source struct {
	path    string
	f       vfs.File
	size    int64
	regular bool
	align   int64 // O_DIRECT offset and length alignment in bytes; 0: buffered
	mem     int64 // O_DIRECT memory alignment in bytes
	mode    *DirectMode
	own     bool // Close closes f
	mu      sync.Mutex
	retired []vfs.File // descriptors replaced by fallBack, closed by Close
	// cachedF is a buffered descriptor of a direct source's file, for its
	// ranges found in the page cache, opened on first need (cachedTried:
	// asked for, so that a failed open is not retried; a cold file, read
	// all direct, never holds a second descriptor); under mu; closed by
	// Close.
	cachedF     vfs.File
	cachedTried bool
	// lazy: f is opened on first use and closed after the last of uses
	// extents (every block of a manifest: see openBlocks; the pages of a
	// prefix load naming more than maxHeldBlocks).
	lazy bool
	uses atomic.Int64
}

// Path is the path the source was opened with.
func (s *Source) Path() string { return s.path }

// Size is the file's size in bytes when it was opened.
func (s *Source) Size() int64 { return s.size }

// Direct reports whether the source reads with O_DIRECT.
func (s *Source) Direct() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.align > 0
}

// Close closes the file (unless it was adopted with AdoptSource and the
// same file is still in use buffered).
func (s *Source) Close() error {
	if s == nil {
		return nil
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, f := range s.retired {
		f.Close()
	}
	s.retired = nil
	if s.cachedF != nil {
		s.cachedF.Close()
	}
	s.cachedF, s.cachedTried = nil, false
	if !s.own || s.f == nil {
		return nil
	}
	err := s.f.Close()
	s.f = nil
	return err
}

// MakeLazy closes s's file; it is opened again on first use and closed
// after uses extents have been read from it (see Read).
func (s *Source) MakeLazy(uses int64) {
	s.Close()
	s.lazy = true
	s.uses.Store(uses)
}

// done is called after each extent read from s: a lazy source is closed
// after its last one.
func (s *Source) done() {
	if s.lazy && s.uses.Add(-1) == 0 {
		s.Close()
	}
}

// DirectMode is the O_DIRECT decision for one file system (device) of one
// vfs.FS: made once, logged once.
type DirectMode struct {
	align   vfs.Alignment
	refused atomic.Bool // an O_DIRECT open or read said EINVAL
	logged  atomic.Bool
}

type directKey struct {
	fs  any
	dev uint64
}

var directModes sync.Map // directKey -> *DirectMode

// DirectModeFor returns the O_DIRECT decision for the file system holding f (an
// open file of it), or nil for buffered reads: cfg.NoDirect, an FS without
// statx, or a file system that reports no alignment (tmpfs). It logs the
// decision the first time it is made for a file system.
func DirectModeFor(cfg *Config, f vfs.File) *DirectMode {
	if cfg.NoDirect {
		return nil
	}
	a, err := vfs.DirectAlignment(f)
	if err != nil || a.Offset == 0 || a.Mem == 0 || a.Offset&(a.Offset-1) != 0 || a.Mem&(a.Mem-1) != 0 {
		k, cacheable := keyFor(cfg.fs(), a.Device)
		reason := "file system reports no O_DIRECT alignment"
		if err != nil {
			reason = err.Error()
		}
		if cacheable {
			if _, loaded := directModes.LoadOrStore(k, &DirectMode{}); loaded {
				return nil
			}
		}
		cfg.logger().Info("kvpersist: buffered reads on this file system", "device", devName(a.Device), "file", f.Name(), "reason", reason)
		return nil
	}
	k, cacheable := keyFor(cfg.fs(), a.Device)
	if !cacheable {
		return &DirectMode{align: a}
	}
	v, _ := directModes.LoadOrStore(k, &DirectMode{align: a})
	m := v.(*DirectMode)
	if m.align.Offset == 0 || m.refused.Load() {
		return nil
	}
	if m.logged.CompareAndSwap(false, true) {
		cfg.logger().Info("kvpersist: O_DIRECT reads on this file system", "device", devName(a.Device),
			"offset-align-bytes", a.Offset, "mem-align-bytes", a.Mem)
	}
	return m
}

// refuse records that the file system refused O_DIRECT and logs it once.
func (m *DirectMode) refuse(cfg *Config, path string, err error) {
	if m.refused.CompareAndSwap(false, true) {
		cfg.logger().Warn("kvpersist: O_DIRECT refused; buffered reads on this file system from now on", "device", devName(m.align.Device), "file", path, "err", err)
	}
}

func keyFor(fsys vfs.FS, dev uint64) (directKey, bool) {
	if !reflect.TypeOf(fsys).Comparable() {
		return directKey{}, false
	}
	return directKey{fsys, dev}, true
}

func devName(dev uint64) string { return fmt.Sprintf("%d:%d", unix.Major(dev), unix.Minor(dev)) }

// isRefusal reports whether err says "O_DIRECT is not possible here".
func isRefusal(err error) bool {
	return errors.Is(err, syscall.EINVAL) || errors.Is(err, errors.ErrUnsupported) || errors.Is(err, syscall.EOPNOTSUPP)
}

// OpenSource opens path for Read: O_DIRECT when the file system
// allows it (decided once per file system and vfs.FS, logged) and the file
// is not wholly in the page cache, else buffered. The file is opened without following a symlink and must be a
// regular file (else ErrInvalidRequest). A missing file is an error
// satisfying vfs.IsNotExist. This is how a page load opens a page file.
func OpenSource(cfg *Config, path string) (*Source, error) {
	f, err := cfg.fs().Open(path)
	if err != nil {
		return nil, err
	}
	s, err := OwnSource(cfg, f)
	if err != nil {
		f.Close()
		return nil, err
	}
	return s, nil
}

// OwnSource is AdoptSource of f, an open file, after which the Source owns
// f: its Close closes f, or f is closed now if the Source reads through
// another descriptor (O_DIRECT). On error f is left open.
func OwnSource(cfg *Config, f vfs.File) (*Source, error) {
	s, err := AdoptSource(cfg, f)
	if err != nil {
		return nil, err
	}
	s.own = true
	if s.f != f {
		f.Close()
	}
	return s, nil
}

// AdoptSource makes a Source of f, a file already open (and, for a snapshot,
// already decoded): with O_DIRECT it opens f's path again with O_DIRECT and
// uses that descriptor only if it is the same file (else the file was
// replaced since f was opened, and f is read buffered). Close the Source
// and, separately, f.
func AdoptSource(cfg *Config, f vfs.File) (*Source, error) {
	fi, err := f.Stat()
	if err != nil {
		return nil, err
	}
	s := sourceFrom(f, fi, nil)
	if !s.regular {
		return nil, fmt.Errorf("%w: %s is not a regular file", ErrNotRegular, f.Name())
	}
	s.own = false
	d := goDirect(cfg, DirectModeFor(cfg, f), f, fi)
	if d == nil {
		return s, nil
	}
	s.f, s.own, s.mode = d.f, true, d.mode
	s.align, s.mem = d.align, d.mem
	return s, nil
}

// goDirect opens f's path again with O_DIRECT and returns it as a source,
// or nil to read f buffered: when m is nil or refused, when every page of f
// is in the page cache already (a warm read: the page cache is faster than
// the disk, and O_DIRECT would ignore it), or when the second open fails or
// finds another file (one renamed over the path since f was opened). fi is
// f's Stat. It costs a cold file three system calls (cachestat, open,
// fstat), a warm one one (cachestat).
func goDirect(cfg *Config, m *DirectMode, f vfs.File, fi os.FileInfo) *Source {
	if m == nil || m.refused.Load() {
		return nil
	}
	if fi.Size() == 0 {
		return nil // nothing to read; and Cached's length 0 means "to the end"
	}
	if cached, known := vfs.Cached(f, 0, fi.Size()); cached && known {
		return nil
	}
	d, err := vfs.OpenDirect(cfg.fs(), f.Name())
	if err != nil {
		if isRefusal(err) {
			m.refuse(cfg, f.Name(), err)
		}
		return nil
	}
	di, err := d.Stat()
	if err != nil || !os.SameFile(fi, di) {
		d.Close()
		return nil
	}
	return sourceFrom(d, di, m)
}

// openSourceWith opens path with the decision m already made for its file
// system (a manifest's blocks, a prefix's pages): when m allows O_DIRECT,
// opened with it once (openDirectFirst); else, or when that cannot decide,
// buffered, then with O_DIRECT instead when m allows it and the file is not
// wholly in the page cache (see goDirect).
func openSourceWith(cfg *Config, m *DirectMode, path string) (*Source, error) {
	if m != nil && !m.refused.Load() {
		if s, err := openDirectFirst(cfg, m, path); s != nil || err != nil {
			return s, err
		}
	}
	f, err := cfg.fs().Open(path)
	if err != nil {
		return nil, err
	}
	fi, err := f.Stat()
	if err != nil {
		f.Close()
		return nil, err
	}
	s := sourceFrom(f, fi, nil)
	if !s.regular {
		return s, nil
	}
	if d := goDirect(cfg, m, f, fi); d != nil {
		f.Close()
		return d, nil
	}
	return s, nil
}

// openDirectFirst opens path with O_DIRECT and, when every page of it is in
// the page cache already, switches that descriptor to buffered reads
// (vfs.ClearDirect): three system calls for a cold file (open, fstat,
// cachestat), five for a warm one (and two fcntl), where opening buffered
// first costs a cold file six (open, fstat, cachestat, open, fstat, close);
// a restore of 512 block files spends about 8 ms less CPU (bench: the cold
// 256 MiB block row). It returns (nil, nil) to let the caller open path
// buffered: an FS without O_DIRECT opens (vfs.DirectOpener), O_DIRECT
// refused (m is then refused, logged), a file that is not regular or is
// empty, or a warm file that cannot be switched. Errors
// are the open's or fstat's (a missing file satisfies vfs.IsNotExist, a
// symlink is ELOOP), as a buffered open would report them.
func openDirectFirst(cfg *Config, m *DirectMode, path string) (*Source, error) {
	if _, ok := cfg.fs().(vfs.DirectOpener); !ok {
		// No O_DIRECT open at all (a wrapping FS, say): the buffered path
		// decides, refusing only for a cold file, as before.
		return nil, nil
	}
	d, err := vfs.OpenDirect(cfg.fs(), path)
	if err != nil {
		if isRefusal(err) {
			m.refuse(cfg, path, err)
			return nil, nil
		}
		return nil, err
	}
	fi, err := d.Stat()
	if err != nil {
		d.Close()
		return nil, err
	}
	if !fi.Mode().IsRegular() || fi.Size() == 0 {
		d.Close()
		return nil, nil
	}
	if cached, known := vfs.Cached(d, 0, fi.Size()); cached && known {
		if vfs.ClearDirect(d) != nil {
			d.Close()
			return nil, nil
		}
		return sourceFrom(d, fi, nil), nil
	}
	return sourceFrom(d, fi, m), nil
}

// LazySource is a Source of the file at path, which a caller has checked
// (by Lstat) to be a regular file of size bytes, not opened yet: it is
// opened (openSourceWith, with m) by the first read from it, checked again
// to be a regular file of that size, and closed after uses extents were
// read from it (see Source.file and Source.done).
func LazySource(m *DirectMode, path string, size, uses int64) *Source {
	s := &Source{path: path, size: size, regular: true, mode: m, lazy: true}
	s.uses.Store(uses)
	return s
}

// sourceFrom makes a Source of f, whose Stat is fi (closed by the Source's
// Close); it is not checked to be a regular file (Source.regular says).
func sourceFrom(f vfs.File, fi os.FileInfo, m *DirectMode) *Source {
	s := &Source{path: f.Name(), f: f, size: fi.Size(), regular: fi.Mode().IsRegular(), own: true, mode: m}
	if m != nil {
		s.align, s.mem = int64(m.align.Offset), int64(m.align.Mem)
	}
	return s
}

// fallBack turns a direct source into a buffered one after O_DIRECT failed
// with EINVAL on a read (a file on another file system than the one the
// decision was made for, say): it reopens the path buffered, and checks it
// is the same file.
func (s *Source) fallBack(cfg *Config, cause error) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.align == 0 {
		return nil
	}
	if s.mode != nil {
		s.mode.refuse(cfg, s.path, cause)
	}
	f, err := cfg.fs().Open(s.path)
	if err != nil {
		return err
	}
	if same, err := vfs.SameFile(f, s.f); err != nil || !same {
		f.Close()
		return fmt.Errorf("%w: %s was replaced while it was read", ErrCorrupt, s.path)
	}
	if s.own {
		// Other goroutines may be reading from it right now.
		s.retired = append(s.retired, s.f)
	}
	s.f, s.align, s.mem = f, 0, 0
	s.own = true
	return nil
}

// cachedFile returns a buffered descriptor of the direct source s, to
// read its ranges found in the page cache with: the path opened again on
// first need and checked to be the same file (else nil from then on:
// every range is read with O_DIRECT).
func (s *Source) cachedFile(cfg *Config) vfs.File {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.cachedF != nil || s.cachedTried || s.f == nil {
		return s.cachedF
	}
	s.cachedTried = true
	c, err := cfg.fs().Open(s.path)
	if err != nil {
		return nil
	}
	if same, err := vfs.SameFile(c, s.f); err != nil || !same {
		c.Close()
		return nil
	}
	s.cachedF = c
	return c
}

// file returns the descriptor and alignment to read with now.
func (s *Source) file(cfg *Config) (vfs.File, int64, int64, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.f == nil && s.lazy {
		o, err := openSourceWith(cfg, s.mode, s.path)
		if err != nil {
			return nil, 0, 0, err
		}
		if !o.regular || o.size != s.size {
			o.Close()
			return nil, 0, 0, fmt.Errorf("%w: %s changed since it was checked: %d bytes", ErrShort, s.path, o.size)
		}
		s.f, s.align, s.mem, s.own = o.f, o.align, o.mem, true
	}
	if s.f == nil {
		return nil, 0, 0, fmt.Errorf("readio: read %s: %w", s.path, fs.ErrClosed)
	}
	return s.f, s.align, s.mem, nil
}

// Stats are what Read did, in bytes.
type Stats struct {
	// Bytes read into destinations; DirectBytes of them with O_DIRECT,
	// AsyncBytes of those asynchronously (Config.Async).
	Bytes, DirectBytes, AsyncBytes int64
}

// Add adds st's counts to x.
func (x *Stats) Add(st Stats) {
	x.Bytes += st.Bytes
	x.DirectBytes += st.DirectBytes
	x.AsyncBytes += st.AsyncBytes
}

// Progress is the progress callback of Read that reports
// each extent of exts read whole and without error to p, in bytes; nil
// when p is nil.
func Progress(exts []Extent, p func(bytes int64)) func(int, error) {
	if p == nil {
		return nil
	}
	return func(k int, err error) {
		if b := exts[k].Bytes(); err == nil && b > 0 {
			p(int64(b))
		}
	}
}

// Read reads every extent into its Dst (or View) with up to
// cfg.ReadDepth (default DefaultReadDepth) requests in flight: that many
// goroutines, started and joined here, each taking the next request. A
// request is a piece of an extent of up to ReadChunkBytes, so the pieces of
// one long extent are read at once, and the requests of many short extents
// (the tensors of many pages) are in flight together. Each extent's hash is
// streamed over its pieces in order as they arrive, by whichever goroutine
// completes the next piece in order, right after its read while it is hot
// in cache (xxh3s: without copying). A source read with O_DIRECT reads
// aligned pieces straight into the destination and the unaligned rest (an
// unaligned destination, the tail of an extent whose length is not a
// multiple of the alignment, a piece of short runs of a View) through an
// aligned staging buffer; a read refused with EINVAL falls back to buffered
// reads of that file. A buffered read of a View's runs is one preadv per
// piece (vfs.ReadvAt). A View of runs shorter than MinRunBytes is read one
// piece after the other by one goroutine, through staging and a scatter.
//
// errs[i] is extent i's error: nil, ErrSkipped (see Extent.Group), an
// error wrapping ErrCorrupt (hash mismatch), ErrShort (the file ended
// early), a gather error (an invalid View) or an I/O error. The returned
// error is ctx's when it ended (then some extents may be unread and errs[i]
// nil). Read never writes outside the destinations and does not
// touch them after it returns.
//
// done, when non-nil, is called with (i, err) once extent i is finished:
// read (and verified) with err nil, or failed with err = errs[i] (Progress
// makes one that counts bytes). It is called from any of the reading
// goroutines, at most once per extent, never after Read returns; an extent
// not finished when ctx ends gets no call.
func Read(ctx context.Context, cfg *Config, exts []Extent, done func(i int, err error)) ([]error, Stats, error) {
	rd := &extentRead{exts: exts, errs: make([]error, len(exts)), st: make([]extentState, len(exts)), onDone: done}
	if len(exts) == 0 {
		return rd.errs, Stats{}, ctx.Err()
	}
	rd.plan()
	readers := make(chan *extentReader, cfg.Depth())
	err := InFlight(ctx, cfg, cfg.Depth(), len(rd.work), func(w int) {
		var r *extentReader
		select {
		case r = <-readers:
		default:
			r = &extentReader{cfg: cfg}
		}
		defer func() { readers <- r }()
		rd.run(ctx, r, rd.work[w])
	})
	close(readers)
	var async int64
	for r := range readers {
		async += r.asyncBytes
		r.release()
	}
	return rd.errs, Stats{Bytes: rd.bytes.Load(), DirectBytes: rd.direct.Load(), AsyncBytes: async}, err
}

// extentRead is one Read call's shared state.
type extentRead struct {
	exts          []Extent
	errs          []error
	st            []extentState // per extent
	work          []workItem    // the requests, in extent and piece order
	done          []bool        // per piece (extentState.first + k): read or given up; under its extent's mu
	failed        sync.Map      // group -> index of the first extent of it that failed
	bytes, direct atomic.Int64
	onDone        func(i int, err error)
}

// workItem is one request: piece of extent ext, or the whole extent when
// piece is -1 (a View of short runs).
type workItem struct{ ext, piece int32 }

// extentState is one extent's progress.
type extentState struct {
	n      int // bytes
	pieceB int // bytes per piece (a whole number of the View's runs when they fit)
	first  int // index in extentRead.done of piece 0
	pieces int
	whole  bool // read and hashed by one goroutine (readWhole)
	failed atomic.Bool
	mu     sync.Mutex
	// Under mu: the hash cursor (pieces before next are hashed or given
	// up; hashing: a goroutine is advancing it), the first error, whether
	// the extent is finished.
	next     int
	hashing  bool
	finished bool
	err      error
	h        *extentHash // owned by the goroutine advancing the cursor
}

// plan cuts every extent into its pieces.
func (rd *extentRead) plan() {
	total := 0
	for i := range rd.exts {
		x, s := &rd.exts[i], &rd.st[i]
		s.n = x.Bytes()
		s.pieceB = ReadChunkBytes
		if v := x.View; v != nil {
			runB := v.RunElements() * v.ItemSize
			if runB < MinRunBytes && runB < s.n {
				s.whole, s.pieces = true, 1
				total++
				continue
			}
			if runB > 0 && runB <= ReadChunkBytes {
				s.pieceB = ReadChunkBytes / runB * runB
			} else if v.ItemSize > 0 {
				s.pieceB -= ReadChunkBytes % v.ItemSize
			}
		}
		s.pieces = max(1, (s.n+s.pieceB-1)/s.pieceB)
		total += s.pieces
	}
	rd.work = make([]workItem, 0, total)
	rd.done = make([]bool, total)
	for i := range rd.exts {
		s := &rd.st[i]
		s.first = len(rd.work)
		if s.whole {
			rd.work = append(rd.work, workItem{int32(i), -1})
			continue
		}
		for k := range s.pieces {
			rd.work = append(rd.work, workItem{int32(i), int32(k)})
		}
	}
}

// run reads one request and passes it to the extent's hash cursor.
func (rd *extentRead) run(ctx context.Context, r *extentReader, w workItem) {
	i := int(w.ext)
	x, s := &rd.exts[i], &rd.st[i]
	var err error
	switch {
	case s.failed.Load(): // an earlier piece failed: the extent is lost anyway
	case rd.skipped(x.Group, i):
		err = ErrSkipped
	default:
		var n, d int64
		if w.piece < 0 {
			n, d, err = r.readWhole(ctx, x)
		} else {
			n, d, err = r.readPiece(x, s, int(w.piece))
		}
		rd.bytes.Add(n)
		rd.direct.Add(d)
	}
	if err != nil && ctx.Err() != nil {
		return // ended by ctx: Read returns ctx's error
	}
	if w.piece < 0 {
		s.finished = true
		rd.finish(i, err)
		return
	}
	rd.pieceDone(i, int(w.piece), err)
}

// skipped reports whether an extent before i of group failed.
func (rd *extentRead) skipped(group, i int) bool {
	if group < 0 {
		return false
	}
	j, bad := rd.failed.Load(group)
	return bad && j.(int) < i
}

func (rd *extentRead) failGroup(group, i int) {
	if group >= 0 {
		rd.failed.LoadOrStore(group, i)
	}
}

// pieceDone records piece k of extent i as read (err nil) or given up, and
// advances the extent's hash cursor over every piece done in order, unless
// another goroutine is doing so (it then sees this piece too). The
// goroutine that moves the cursor past the last piece finishes the extent.
func (rd *extentRead) pieceDone(i, k int, err error) {
	x, s := &rd.exts[i], &rd.st[i]
	s.mu.Lock()
	if err != nil && s.err == nil {
		s.err = err
		s.failed.Store(true)
		if !errors.Is(err, ErrSkipped) {
			rd.failGroup(x.Group, i)
		}
	}
	rd.done[s.first+k] = true
	if s.hashing {
		s.mu.Unlock()
		return
	}
	s.hashing = true
	for s.next < s.pieces && rd.done[s.first+s.next] {
		p := s.next
		s.next++
		if s.err == nil && x.Verify != VerifyNone {
			s.mu.Unlock()
			s.hashPiece(x, p)
			s.mu.Lock()
		}
	}
	s.hashing = false
	last := s.next == s.pieces && !s.finished
	s.finished = s.finished || last
	err = s.err
	s.mu.Unlock()
	if last {
		rd.finish(i, err)
	}
}

// finish ends extent i: checks its streamed hash (a piecewise read without
// error), records its error, and tells its source and onDone.
func (rd *extentRead) finish(i int, err error) {
	x, s := &rd.exts[i], &rd.st[i]
	if err == nil && !s.whole && x.Verify != VerifyNone {
		err = s.hasher(x).check(x)
	}
	if s.h != nil {
		extentHashPool.Put(s.h)
		s.h = nil
	}
	if err != nil {
		rd.errs[i] = err
		if !errors.Is(err, ErrSkipped) {
			rd.failGroup(x.Group, i)
		}
	}
	x.Src.done()
	if rd.onDone != nil {
		rd.onDone(i, err)
	}
}

// extentHash is the streaming hash of one extent read in pieces.
type extentHash struct {
	xx  xxh3s.Digest
	sha hash.Hash
}

var extentHashPool = sync.Pool{New: func() any { return &extentHash{} }}

// hasher returns the extent's hash state, taking and resetting one first.
func (s *extentState) hasher(x *Extent) *extentHash {
	if s.h == nil {
		s.h = extentHashPool.Get().(*extentHash)
		s.h.reset(x.Verify)
	}
	return s.h
}

func (h *extentHash) reset(v Verify) {
	switch v {
	case VerifyXXH3:
		h.xx.Reset()
	case VerifySHA256:
		if h.sha == nil {
			h.sha = sha256.New()
		}
		h.sha.Reset()
	}
}

func (h *extentHash) write(v Verify, b []byte) {
	if v == VerifyXXH3 {
		h.xx.Write(b)
	} else {
		h.sha.Write(b)
	}
}

// check compares the hash of everything written with the extent's.
func (h *extentHash) check(x *Extent) error {
	switch x.Verify {
	case VerifyXXH3:
		return checkXXH3(x, h.xx.Sum64())
	case VerifySHA256:
		var sum [sha256.Size]byte
		h.sha.Sum(sum[:0])
		return checkSHA256(x, sum)
	}
	return nil
}

func checkXXH3(x *Extent, got uint64) error {
	if got != x.XXH3 {
		return fmt.Errorf("%w: %s at %d: xxh3 %s, expected %s", ErrCorrupt, x.Src.path, x.Off, layout.TensorHash(got), layout.TensorHash(x.XXH3))
	}
	return nil
}

func checkSHA256(x *Extent, sum [sha256.Size]byte) error {
	if sum != x.SHA256 {
		return fmt.Errorf("%w: %s has SHA-256 %s, expected %s", ErrCorrupt, x.Src.path, hex.EncodeToString(sum[:]), hex.EncodeToString(x.SHA256[:]))
	}
	return nil
}

// pieceRange is piece k's byte range [lo, hi) of the extent.
func (s *extentState) pieceRange(k int) (lo, hi int) {
	lo = k * s.pieceB
	return lo, min(s.n, lo+s.pieceB)
}

// hashPiece adds piece k, already read into the destination, to the
// extent's hash.
func (s *extentState) hashPiece(x *Extent, k int) {
	h := s.hasher(x)
	lo, hi := s.pieceRange(k)
	if x.View == nil {
		h.write(x.Verify, x.Dst[lo:hi])
		return
	}
	item := x.View.ItemSize
	// The view was walked without error by the piece's read.
	_ = x.View.RunsRange(lo/item, (hi-lo)/item, func(b []byte) error {
		h.write(x.Verify, b)
		return nil
	})
}

// inFlight runs fn(i) for i in [0, n) on up to depth goroutines: the
// caller's, helpers lent by cfg.Spawn (the engine's pool, which bounds CPU
// work), and as many more of its own as it takes to reach depth: I/O
// goroutines, which mostly wait on the disk. All are joined before it
// returns. It stops taking indices when ctx ends and returns ctx's error
// then; a panic in fn is recovered and returned as ErrPanic.
func InFlight(ctx context.Context, cfg *Config, depth, n int, fn func(i int)) error {
	var (
		next     atomic.Int64
		wg       sync.WaitGroup
		panicked atomic.Pointer[error]
	)
	work := func() {
		defer func() {
			if p := recover(); p != nil {
				e := fmt.Errorf("%w: %v\n%s", ErrPanic, p, debug.Stack())
				panicked.CompareAndSwap(nil, &e)
			}
		}()
		for ctx.Err() == nil && panicked.Load() == nil {
			i := int(next.Add(1) - 1)
			if i >= n {
				return
			}
			fn(i)
		}
	}
	depth = max(1, min(depth, n))
	started := 1 // the caller's goroutine
	if cfg.Spawn != nil {
		for started < depth && started-1 < cfg.helpers() {
			wg.Add(1)
			if !cfg.Spawn(func() { defer wg.Done(); work() }) {
				wg.Done()
				break
			}
			started++
		}
	}
	for ; started < depth; started++ {
		wg.Go(work)
	}
	work()
	wg.Wait()
	if p := panicked.Load(); p != nil {
		return *p
	}
	return ctx.Err()
}

// Depth is the read requests one Read keeps in flight: ReadDepth, or
// DefaultReadDepth when it is 0, at most MaxReadDepth.
func (c *Config) Depth() int {
	if c.ReadDepth <= 0 {
		return DefaultReadDepth
	}
	return min(c.ReadDepth, MaxReadDepth)
}

// MaxReadDepth bounds Config.ReadDepth.
const MaxReadDepth = 256

func (c *Config) logger() *slog.Logger {
	if c.Logger == nil {
		return slog.Default()
	}
	return c.Logger
}

// extentReader is one goroutine's state: its hashers and buffers.
type extentReader struct {
	cfg     *Config
	xx      xxh3s.Digest // readWhole's
	sha     hash.Hash    // readWhole's
	staging *[]byte      // aligned, for O_DIRECT heads, tails and short runs; on demand
	chunk   *[]byte      // readWhole's piece before its scatter; on demand
	iov     [][]byte     // a piece's destination runs
	part    [][]byte     // a part of iov read one way (readBufs)
	one     [1][]byte    // staged's
	// asyncReads counts the reads made through cfg.Async; asyncBytes the
	// destination bytes of the pieces read that way.
	asyncReads int
	asyncBytes int64
}

func (r *extentReader) release() {
	if r.sha != nil {
		sha256Pool.Put(r.sha)
	}
	if r.staging != nil {
		scratch.Put(r.staging)
	}
	if r.chunk != nil {
		scratch.Put(r.chunk)
	}
}

// inFile checks that the extent lies inside its source file.
func inFile(x *Extent, n int) error {
	if x.Off < 0 || x.Off+int64(n) > x.Src.size {
		return fmt.Errorf("%w: %s has %d bytes, the extent ends at %d", ErrShort, x.Src.path, x.Src.size, x.Off+int64(n))
	}
	return nil
}

// readPiece reads piece k of extent x into its destination; it returns
// the bytes read and those read direct.
func (r *extentReader) readPiece(x *Extent, s *extentState, k int) (n, direct int64, err error) {
	if err := inFile(x, s.n); err != nil {
		return 0, 0, err
	}
	lo, hi := s.pieceRange(k)
	r.iov = r.iov[:0]
	if x.View == nil {
		r.iov = append(r.iov, x.Dst[lo:hi])
	} else {
		item := x.View.ItemSize
		if err := x.View.RunsRange(lo/item, (hi-lo)/item, func(b []byte) error {
			r.iov = append(r.iov, b)
			return nil
		}); err != nil {
			return 0, 0, fmt.Errorf("readio: destination view: %w", err)
		}
	}
	d, err := r.readBufs(x.Src, r.iov, x.Off+int64(lo))
	clear(r.iov) // no reference to the caller's memory stays behind
	if err != nil {
		return 0, d, err
	}
	return int64(hi - lo), d, nil
}

// readWhole reads an extent whose View has runs shorter than MinRunBytes:
// piece by piece into a chunk buffer, hashed there, then scattered into
// the view. It returns the bytes read and those read direct.
func (r *extentReader) readWhole(ctx context.Context, x *Extent) (n, direct int64, err error) {
	v := x.View
	if err := v.CheckNoOverlap(); err != nil {
		return 0, 0, fmt.Errorf("readio: destination view: %w", err)
	}
	total := v.Bytes()
	if err := inFile(x, total); err != nil {
		return 0, 0, err
	}
	switch x.Verify {
	case VerifyXXH3:
		r.xx.Reset()
	case VerifySHA256:
		if r.sha == nil {
			r.sha = sha256Pool.Get().(hash.Hash)
		}
		r.sha.Reset()
	}
	step := ReadChunkBytes - ReadChunkBytes%v.ItemSize
	if r.chunk == nil {
		r.chunk = scratch.Get(step + directBufAlign)
	}
	buf := alignedSlice(*r.chunk, directBufAlign)
	for o := 0; o < total; o += step {
		if o > 0 && ctx.Err() != nil {
			return n, direct, ctx.Err()
		}
		b := buf[:min(step, total-o)]
		r.iov = append(r.iov[:0], b)
		d, err := r.readBufs(x.Src, r.iov, x.Off+int64(o))
		direct += d
		if err != nil {
			return n, direct, err
		}
		switch x.Verify {
		case VerifyXXH3:
			r.xx.Write(b)
		case VerifySHA256:
			r.sha.Write(b)
		}
		if err := v.ScatterRange(o/v.ItemSize, len(b)/v.ItemSize, b); err != nil {
			return n, direct, fmt.Errorf("readio: destination view: %w", err)
		}
		n += int64(len(b))
	}
	switch x.Verify {
	case VerifyXXH3:
		return n, direct, checkXXH3(x, r.xx.Sum64())
	case VerifySHA256:
		var sum [sha256.Size]byte
		r.sha.Sum(sum[:0])
		return n, direct, checkSHA256(x, sum)
	}
	return n, direct, nil
}

// directRunBytes: with O_DIRECT, a piece made of several destination runs
// shorter than this is read as one request through staging and copied
// into them, rather than as one request per run.
const directRunBytes = 256 << 10

// cacheProbeBytes: a request of a direct source only partly in the page
// cache is cut at file offsets that are multiples of this many bytes, and
// each part is read the faster way (runs of parts that go the same way
// together): the page cache holds what is left of a file in large folios
// (up to 2 MiB), so a missing range rarely ends on a request's edge, and
// a part this size is still a large O_DIRECT read.
const cacheProbeBytes = 256 << 10

// readBufs fills bufs, in order, from src at off; it returns how many
// bytes it read with O_DIRECT. A direct source reads a range buffered
// (Source.cachedFile) when every page of it is in the page cache
// (cachestat of the range: one system call), and a range partly in it
// in parts (cacheProbeBytes), each buffered when all of its pages are
// cached, else with O_DIRECT: the page cache is several times faster
// than the disk and O_DIRECT would ignore it.
func (r *extentReader) readBufs(src *Source, bufs [][]byte, off int64) (direct int64, err error) {
	f, align, mem, err := src.file(r.cfg)
	if err != nil {
		return 0, err
	}
	if align == 0 {
		return 0, readvFull(f, bufs, off)
	}
	before := r.asyncReads
	defer func() {
		if r.asyncReads != before {
			r.asyncBytes += direct
		}
	}()
	n := int64(iovBytes(bufs))
	cached, pages, known := vfs.CachedPages(f, off, n)
	var c vfs.File
	if known && cached > 0 {
		c = src.cachedFile(r.cfg)
	}
	switch {
	case c == nil:
		return r.readBufsDirect(src, f, align, mem, bufs, off)
	case cached == pages:
		return 0, readvFull(c, bufs, off)
	}
	inCache := func(lo, hi int64) bool {
		k, p, ok := vfs.CachedPages(f, off+lo, hi-lo)
		return ok && k == p
	}
	next := func(lo int64) int64 { return min(n, (off+lo)/cacheProbeBytes*cacheProbeBytes+cacheProbeBytes-off) }
	for lo := int64(0); lo < n; {
		hi := next(lo)
		buffered := inCache(lo, hi)
		for hi < n && inCache(hi, next(hi)) == buffered {
			hi = next(hi)
		}
		part := r.iovRange(bufs, lo, hi)
		if buffered {
			err = readvFull(c, part, off+lo)
		} else {
			var d int64
			d, err = r.readBufsDirect(src, f, align, mem, part, off+lo)
			direct += d
		}
		clear(r.part) // no reference to the caller's memory stays behind
		if err != nil {
			return direct, err
		}
		lo = hi
	}
	return direct, nil
}

// iovRange returns bytes [lo, hi) of bufs, in order, as slices of them in
// r.part.
func (r *extentReader) iovRange(bufs [][]byte, lo, hi int64) [][]byte {
	r.part = r.part[:0]
	var at int64
	for _, b := range bufs {
		end := at + int64(len(b))
		if end > lo && at < hi {
			r.part = append(r.part, b[max(lo, at)-at:min(hi, end)-at])
		}
		at = end
	}
	return r.part
}

// readBufsDirect fills bufs, in order, from src's O_DIRECT descriptor f
// (alignments align and mem) at off; it returns how many bytes it read
// with O_DIRECT (a refusal reads the rest buffered).
func (r *extentReader) readBufsDirect(src *Source, f vfs.File, align, mem int64, bufs [][]byte, off int64) (direct int64, err error) {
	if len(bufs) > 1 && len(bufs[0]) < directRunBytes {
		err := r.stagedv(f, align, bufs, off)
		if err == nil || !isRefusal(err) {
			return int64(iovBytes(bufs)), err
		}
		return r.refused(src, err, bufs, off)
	}
	for j, b := range bufs {
		d, err := r.readDirect(f, align, mem, b, off)
		if err != nil && isRefusal(err) {
			d2, err := r.refused(src, err, bufs[j:], off)
			return direct + d2, err
		}
		if err != nil {
			return direct, err
		}
		direct += d
		off += int64(len(b))
	}
	return direct, nil
}

// refused switches src to buffered reads after O_DIRECT was refused
// (cause) and reads bufs buffered.
func (r *extentReader) refused(src *Source, cause error, bufs [][]byte, off int64) (int64, error) {
	if ferr := src.fallBack(r.cfg, cause); ferr != nil {
		return 0, ferr
	}
	f, _, _, err := src.file(r.cfg)
	if err != nil {
		return 0, err
	}
	return 0, readvFull(f, bufs, off)
}

func iovBytes(bufs [][]byte) int {
	n := 0
	for _, b := range bufs {
		n += len(b)
	}
	return n
}

// readvFull fills bufs, in order, from f at off (vfs.ReadvAt: one preadv
// where f allows); a file that ends first is ErrShort.
func readvFull(f vfs.File, bufs [][]byte, off int64) error {
	if len(bufs) == 1 {
		return readFull(f, bufs[0], off)
	}
	want := iovBytes(bufs)
	n, err := vfs.ReadvAt(f, bufs, off)
	if n >= want {
		return nil
	}
	if err == nil || err == io.EOF {
		return fmt.Errorf("%w: %s ends at %d, %d bytes needed at %d", ErrShort, f.Name(), off+int64(n), want, off)
	}
	return err
}

// readDirect reads dst from an O_DIRECT file: the aligned middle straight
// into dst when dst's address allows, the rest through staging.
func (r *extentReader) readDirect(f vfs.File, align, mem int64, dst []byte, off int64) (int64, error) {
	addr := int64(uintptr(unsafe.Pointer(unsafe.SliceData(dst))))
	head := (align - off%align) % align // bytes before the first aligned offset
	if addr%mem != 0 || (addr+head)%mem != 0 || head >= int64(len(dst)) {
		return int64(len(dst)), r.staged(f, align, dst, off)
	}
	if head > 0 {
		if err := r.staged(f, align, dst[:head], off); err != nil {
			return 0, err
		}
	}
	body := (int64(len(dst)) - head) &^ (align - 1)
	if body > 0 {
		if err := r.readFull(f, dst[head:head+body], off+head); err != nil {
			return head, err
		}
	}
	if tail := dst[head+body:]; len(tail) > 0 {
		if err := r.staged(f, align, tail, off+head+body); err != nil {
			return head + body, err
		}
	}
	return int64(len(dst)), nil
}

// staged reads dst (at most ReadChunkBytes) through the aligned staging
// buffer.
func (r *extentReader) staged(f vfs.File, align int64, dst []byte, off int64) error {
	r.one[0] = dst
	err := r.stagedv(f, align, r.one[:], off)
	r.one[0] = nil
	return err
}

// stagedv reads bufs (together at most ReadChunkBytes), in order, through
// the aligned staging buffer: the aligned range covering [off, off+their
// length), which may run past the end of the file (O_DIRECT then returns
// short; the bytes needed must be there), then copies into each.
func (r *extentReader) stagedv(f vfs.File, align int64, bufs [][]byte, off int64) error {
	n := int64(iovBytes(bufs))
	start := off &^ (align - 1)
	end := (off + n + align - 1) &^ (align - 1)
	need := int(end-start) + directBufAlign
	if r.staging != nil && len(*r.staging) < need {
		scratch.Put(r.staging)
		r.staging = nil
	}
	if r.staging == nil {
		// Sized by need: a head or tail needs one or two alignments, only
		// an unaligned destination or short runs a whole piece.
		r.staging = scratch.Get(need)
	}
	buf := alignedSlice(*r.staging, directBufAlign)
	want := off + n - start // bytes of buf that must be filled
	if _, err := r.readAtLeast(f, buf[:end-start], start, want); err != nil {
		return err
	}
	src := buf[off-start : want]
	for _, b := range bufs {
		src = src[copy(b, src):]
	}
	return nil
}

var sha256Pool = sync.Pool{New: func() any { return sha256.New() }}

// directBufAlign is the memory alignment in bytes of staging buffers: a
// page, more than any file system asks for.
const directBufAlign = 4096

func alignedSlice(b []byte, a int) []byte {
	p := int(uintptr(unsafe.Pointer(unsafe.SliceData(b))))
	skip := (a - p%a) % a
	return b[skip:]
}

// readFull fills p from f at off; a file that ends first is ErrShort.
func readFull(f vfs.File, p []byte, off int64) error {
	_, err := readAtLeast(f, p, off, int64(len(p)), nil)
	return err
}

// readFull is readFull of an O_DIRECT file: through r.cfg.Async when set.
func (r *extentReader) readFull(f vfs.File, p []byte, off int64) error {
	_, err := readAtLeast(f, p, off, int64(len(p)), r)
	return err
}

// readAtLeast is readAtLeast of an O_DIRECT file: through r.cfg.Async
// when set.
func (r *extentReader) readAtLeast(f vfs.File, p []byte, off, want int64) (int64, error) {
	return readAtLeast(f, p, off, want, r)
}

// readAt is one read of an O_DIRECT file: asynchronous (vfs.AsyncReader,
// waiting without a P) when r.cfg.Async is set up and f is the operating
// system's, else a pread. Either way it returns only once the kernel has
// finished writing into p.
func (r *extentReader) readAt(f vfs.File, p []byte, off int64) (int, error) {
	n, async, err := r.cfg.Async.reader().ReadAt(f, p, off)
	if async {
		r.asyncReads++
	}
	return n, err
}

// readAtLeast reads into p at off until at least want bytes are in (or p is
// full); an end of file before want bytes is ErrShort. With r non-nil
// (an O_DIRECT file) each read is r.readAt.
func readAtLeast(f vfs.File, p []byte, off, want int64, r *extentReader) (int64, error) {
	var n int64
	for n < want {
		var k int
		var err error
		if r != nil {
			k, err = r.readAt(f, p[n:], off+n)
		} else {
			k, err = f.ReadAt(p[n:], off+n)
		}
		n += int64(k)
		if n >= want {
			return n, nil
		}
		if err == io.EOF || (err == nil && k == 0) {
			return n, fmt.Errorf("%w: %s ends at %d, %d bytes needed at %d", ErrShort, f.Name(), off+n, want, off)
		}
		if err != nil {
			return n, err
		}
	}
	return n, nil
}
