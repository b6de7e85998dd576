package jobs

import (
	"context"
	"encoding/hex"
	"errors"
	"fmt"
	"hash"
	"io"
	"io/fs"
	"log/slog"
	"reflect"
	"runtime/debug"
	"sync"
	"sync/atomic"
	"syscall"
	"unsafe"

	"github.com/kvpersist/kvpersist/engine/layout"
	"github.com/kvpersist/kvpersist/engine/vfs"
	"github.com/kvpersist/kvpersist/internal/xxh3s"
	"github.com/minio/sha256-simd"
	"golang.org/x/sys/unix"
)

// DefaultReadDepth is how many read requests (preads of up to ReadChunkBytes)
// one read keeps in flight when Config.ReadDepth is 0. Measured on the
// project's 2-core VM (bench BenchmarkReadDepth, cold 1 GiB single-file
// restore, a loaded machine, two runs): 0.43 GB/s at depth 1, 0.71-0.98 at
// 4, 0.78-1.06 at 8, 1.01-1.28 at 16, 1.12 at 32. Cold block restores
// were bound by SHA-256 on the busy CPU at every depth (0.26-0.45 GB/s).
// Deeper costs only blocked goroutines (and, for unaligned destinations,
// one staging buffer of up to 2 MiB each).
const DefaultReadDepth = 16

// ReadChunkBytes is the size in bytes of one read request: an extent is read
// (and hashed) in pieces of this size, each hashed right after its pread
// while it is hot in cache.
const ReadChunkBytes = 1 << 20

// Verify says how ReadExtents checks an extent's bytes.
type Verify uint8

const (
	// VerifyNone reads without checking.
	VerifyNone Verify = iota
	// VerifyXXH3 checks XXH3-64 (seed 0) of the extent's bytes against
	// Extent.XXH3 (a single-file tensor's or a page's hash).
	VerifyXXH3
	// VerifySHA256 checks SHA-256 of the extent's bytes against
	// Extent.SHA256 (a block's name).
	VerifySHA256
)

// Extent is one run of bytes to read: len(Dst) bytes at byte offset Off of
// Src into Dst, checked as Verify says.
type Extent struct {
	Src *Source
	Off int64
	Dst []byte
	// Group: once an extent fails, the extents after it with the same
	// Group >= 0 are not read (their error is ErrSkipped): the rest of a
	// tensor whose first block is bad need not be read. -1: no group.
	Group  int
	Verify Verify
	XXH3   uint64
	SHA256 [32]byte
}

// ErrSkipped: an extent was not read because an earlier one of its Group
// failed (see Extent.Group).
var ErrSkipped = errors.New("not read: an earlier extent of its group failed")

// Source is a file opened for ReadExtents: with O_DIRECT when its file
// system supports it (statx STATX_DIOALIGN reports an alignment and the
// O_DIRECT open succeeds) and the file is not wholly in the page cache
// (cachestat), else buffered. Make it with OpenSource or AdoptSource and
// close it with Close.
type Source struct {
	path    string
	f       vfs.File
	size    int64
	regular bool
	align   int64 // O_DIRECT offset and length alignment in bytes; 0: buffered
	mem     int64 // O_DIRECT memory alignment in bytes
	mode    *directMode
	own     bool // Close closes f
	mu      sync.Mutex
	retired []vfs.File // descriptors replaced by fallBack, closed by Close
	// lazy: f is opened on first use and closed after the last of uses
	// extents (a manifest with more blocks than maxHeldBlocks).
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
	if !s.own || s.f == nil {
		return nil
	}
	err := s.f.Close()
	s.f = nil
	return err
}

// makeLazy closes s's file; it is opened again on first use and closed
// after uses extents have been read from it (see ReadExtents).
func (s *Source) makeLazy(uses int64) {
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

// directMode is the O_DIRECT decision for one file system (device) of one
// vfs.FS: made once, logged once.
type directMode struct {
	align   vfs.Alignment
	refused atomic.Bool // an O_DIRECT open or read said EINVAL
	logged  atomic.Bool
}

type directKey struct {
	fs  any
	dev uint64
}

var directModes sync.Map // directKey -> *directMode

// directFor returns the O_DIRECT decision for the file system holding f (an
// open file of it), or nil for buffered reads: cfg.NoDirect, an FS without
// statx, or a file system that reports no alignment (tmpfs). It logs the
// decision the first time it is made for a file system.
func directFor(cfg *Config, f vfs.File) *directMode {
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
			if _, loaded := directModes.LoadOrStore(k, &directMode{}); loaded {
				return nil
			}
		}
		cfg.logger().Info("kvpersist: buffered reads on this file system", "device", devName(a.Device), "file", f.Name(), "reason", reason)
		return nil
	}
	k, cacheable := keyFor(cfg.fs(), a.Device)
	if !cacheable {
		return &directMode{align: a}
	}
	v, _ := directModes.LoadOrStore(k, &directMode{align: a})
	m := v.(*directMode)
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
func (m *directMode) refuse(cfg *Config, path string, err error) {
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

// OpenSource opens path for ReadExtents: O_DIRECT when the file system
// allows it (decided once per file system and vfs.FS, logged) and the file
// is not wholly in the page cache, else buffered. The file is opened without following a symlink and must be a
// regular file (else ErrInvalidRequest). A missing file is an error
// satisfying vfs.IsNotExist. This is how a page load opens a page file.
func OpenSource(cfg *Config, path string) (*Source, error) {
	f, err := cfg.fs().Open(path)
	if err != nil {
		return nil, err
	}
	s, err := AdoptSource(cfg, f)
	if err != nil {
		f.Close()
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
	s, err := sourceOf(f, nil)
	if err != nil {
		return nil, err
	}
	if !s.regular {
		return nil, fmt.Errorf("%w: %s is not a regular file", ErrInvalidRequest, f.Name())
	}
	s.own = false
	d := goDirect(cfg, directFor(cfg, f), f)
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
// finds another file (one renamed over the path since f was opened).
func goDirect(cfg *Config, m *directMode, f vfs.File) *Source {
	if m == nil || m.refused.Load() {
		return nil
	}
	if cached, known := vfs.Cached(f, 0, 0); cached && known {
		return nil
	}
	d, err := vfs.OpenDirect(cfg.fs(), f.Name())
	if err != nil {
		if isRefusal(err) {
			m.refuse(cfg, f.Name(), err)
		}
		return nil
	}
	s, err := sourceOf(d, m)
	if err != nil {
		d.Close()
		return nil
	}
	if same, err := vfs.SameFile(f, d); err != nil || !same {
		d.Close()
		return nil
	}
	return s
}

// openSourceWith opens path with the decision m already made for its file
// system (a manifest's blocks): buffered, then with O_DIRECT instead when
// m allows it and the file is not wholly in the page cache (see goDirect).
func openSourceWith(cfg *Config, m *directMode, path string) (*Source, error) {
	f, err := cfg.fs().Open(path)
	if err != nil {
		return nil, err
	}
	s, err := sourceOf(f, nil)
	if err != nil {
		f.Close()
		return nil, err
	}
	if !s.regular {
		return s, nil
	}
	if d := goDirect(cfg, m, f); d != nil {
		f.Close()
		return d, nil
	}
	return s, nil
}

// sourceOf makes a Source of f (closed by the Source's Close); it is not
// checked to be a regular file (Source.regular says).
func sourceOf(f vfs.File, m *directMode) (*Source, error) {
	st, err := f.Stat()
	if err != nil {
		return nil, err
	}
	s := &Source{path: f.Name(), f: f, size: st.Size(), regular: st.Mode().IsRegular(), own: true, mode: m}
	if m != nil {
		s.align, s.mem = int64(m.align.Offset), int64(m.align.Mem)
	}
	return s, nil
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
			return nil, 0, 0, fmt.Errorf("%w: %s changed since it was checked: %d bytes", ErrBlockSize, s.path, o.size)
		}
		s.f, s.align, s.mem, s.own = o.f, o.align, o.mem, true
	}
	if s.f == nil {
		return nil, 0, 0, fmt.Errorf("jobs: read %s: %w", s.path, fs.ErrClosed)
	}
	return s.f, s.align, s.mem, nil
}

// ExtentStats are what ReadExtents did, in bytes.
type ExtentStats struct {
	// Bytes read into destinations; DirectBytes of them with O_DIRECT.
	Bytes, DirectBytes int64
}

// ReadExtents reads every extent into its Dst, with up to cfg.ReadDepth
// (default DefaultReadDepth) requests in flight: that many goroutines,
// started and joined here, each taking the next extent and reading it in
// pieces of ReadChunkBytes, hashing each piece right after its pread while
// it is hot in cache (xxh3s: without copying). A source read with O_DIRECT
// reads aligned pieces straight into Dst and the unaligned rest (an
// unaligned Dst, the tail of an extent whose length is not a multiple of
// the alignment) through an aligned staging buffer of one piece; a read
// refused with EINVAL falls back to buffered reads of that file.
//
// errs[i] is extent i's error: nil, ErrSkipped (see Extent.Group), an
// error wrapping ErrCorrupt (hash mismatch), ErrBlockSize (the file ended
// early) or an I/O error. The returned error is ctx's when it ended (then
// some extents may be unread and errs[i] nil). ReadExtents never writes
// outside the Dsts and does not touch them after it returns.
func ReadExtents(ctx context.Context, cfg *Config, exts []Extent) (errs []error, st ExtentStats, err error) {
	errs = make([]error, len(exts))
	if len(exts) == 0 {
		return errs, st, ctx.Err()
	}
	var (
		bytes, direct atomic.Int64
		failed        sync.Map // group -> first failed extent index
		readers       = make(chan *extentReader, cfg.readDepth())
	)
	err = inFlight(ctx, cfg, cfg.readDepth(), len(exts), func(i int) {
		var r *extentReader
		select {
		case r = <-readers:
		default:
			r = &extentReader{cfg: cfg}
		}
		defer func() { readers <- r }()
		x := &exts[i]
		if x.Group >= 0 {
			if j, bad := failed.Load(x.Group); bad && j.(int) < i {
				errs[i] = ErrSkipped
				x.Src.done()
				return
			}
		}
		n, d, err := r.read(ctx, x)
		x.Src.done()
		bytes.Add(n)
		direct.Add(d)
		if err != nil && ctx.Err() == nil {
			errs[i] = err
			if x.Group >= 0 {
				failed.LoadOrStore(x.Group, i)
			}
		}
	})
	close(readers)
	for r := range readers {
		r.release()
	}
	return errs, ExtentStats{Bytes: bytes.Load(), DirectBytes: direct.Load()}, err
}

// inFlight runs fn(i) for i in [0, n) on up to depth goroutines: the
// caller's, helpers lent by cfg.Spawn (the engine's pool, which bounds CPU
// work), and as many more of its own as it takes to reach depth: I/O
// goroutines, which mostly wait on the disk. All are joined before it
// returns. It stops taking indices when ctx ends and returns ctx's error
// then; a panic in fn is recovered and returned as ErrPanic.
func inFlight(ctx context.Context, cfg *Config, depth, n int, fn func(i int)) error {
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

func (c *Config) readDepth() int {
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

// extentReader is one goroutine's state: its hashers and staging buffer.
type extentReader struct {
	cfg     *Config
	xx      xxh3s.Digest
	sha     hash.Hash
	staging *[]byte // aligned, ReadChunkBytes + 2 alignments; on demand
}

func (r *extentReader) release() {
	if r.sha != nil {
		sha256Pool.Put(r.sha)
	}
	if r.staging != nil {
		putScratch(r.staging)
	}
}

// read reads one extent; it returns the bytes read and those read direct.
func (r *extentReader) read(ctx context.Context, x *Extent) (n, direct int64, err error) {
	if x.Off < 0 || x.Off+int64(len(x.Dst)) > x.Src.size {
		return 0, 0, fmt.Errorf("%w: %s has %d bytes, the extent ends at %d", ErrBlockSize, x.Src.path, x.Src.size, x.Off+int64(len(x.Dst)))
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
	for o := 0; o < len(x.Dst); {
		if o > 0 && ctx.Err() != nil {
			return n, direct, ctx.Err()
		}
		piece := x.Dst[o:min(o+ReadChunkBytes, len(x.Dst))]
		d, err := r.readPiece(x.Src, piece, x.Off+int64(o))
		if err != nil {
			return n, direct, err
		}
		switch x.Verify {
		case VerifyXXH3:
			r.xx.Write(piece)
		case VerifySHA256:
			r.sha.Write(piece)
		}
		n += int64(len(piece))
		direct += d
		o += len(piece)
	}
	switch x.Verify {
	case VerifyXXH3:
		if got := r.xx.Sum64(); got != x.XXH3 {
			return n, direct, fmt.Errorf("%w: %s at %d: xxh3 %s, expected %s", ErrCorrupt, x.Src.path, x.Off, layout.TensorHash(got), layout.TensorHash(x.XXH3))
		}
	case VerifySHA256:
		var sum [sha256.Size]byte
		if r.sha.Sum(sum[:0]); sum != x.SHA256 {
			return n, direct, fmt.Errorf("%w: %s has SHA-256 %s, expected %s", ErrCorrupt, x.Src.path, hex.EncodeToString(sum[:]), hex.EncodeToString(x.SHA256[:]))
		}
	}
	return n, direct, nil
}

// readPiece fills dst from src at off; it returns how many bytes it read
// with O_DIRECT.
func (r *extentReader) readPiece(src *Source, dst []byte, off int64) (int64, error) {
	f, align, mem, err := src.file(r.cfg)
	if err != nil {
		return 0, err
	}
	if align == 0 {
		return 0, readFull(f, dst, off)
	}
	d, err := r.readDirect(f, align, mem, dst, off)
	if err != nil && isRefusal(err) {
		if ferr := src.fallBack(r.cfg, err); ferr != nil {
			return 0, ferr
		}
		if f, _, _, err = src.file(r.cfg); err != nil {
			return 0, err
		}
		return 0, readFull(f, dst, off)
	}
	return d, err
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
		if err := readFull(f, dst[head:head+body], off+head); err != nil {
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
// buffer: the aligned range covering [off, off+len(dst)), which may run
// past the end of the file (O_DIRECT then returns short; the bytes needed
// must be there).
func (r *extentReader) staged(f vfs.File, align int64, dst []byte, off int64) error {
	start := off &^ (align - 1)
	end := (off + int64(len(dst)) + align - 1) &^ (align - 1)
	need := int(end-start) + directBufAlign
	if r.staging != nil && len(*r.staging) < need {
		putScratch(r.staging)
		r.staging = nil
	}
	if r.staging == nil {
		// Sized by need: a head or tail needs one or two alignments, only
		// an unaligned destination a whole piece.
		r.staging = getScratch(need)
	}
	buf := alignedSlice(*r.staging, directBufAlign)
	want := off + int64(len(dst)) - start // bytes of buf that must be filled
	if _, err := readAtLeast(f, buf[:end-start], start, want); err != nil {
		return err
	}
	copy(dst, buf[off-start:want])
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

// readFull fills p from f at off; a file that ends first is ErrBlockSize.
func readFull(f vfs.File, p []byte, off int64) error {
	_, err := readAtLeast(f, p, off, int64(len(p)))
	return err
}

// readAtLeast reads into p at off until at least want bytes are in (or p is
// full); an end of file before want bytes is ErrBlockSize.
func readAtLeast(f vfs.File, p []byte, off, want int64) (int64, error) {
	var n int64
	for n < want {
		k, err := f.ReadAt(p[n:], off+n)
		n += int64(k)
		if n >= want {
			return n, nil
		}
		if err == io.EOF || (err == nil && k == 0) {
			return n, fmt.Errorf("%w: %s ends at %d, %d bytes needed at %d", ErrBlockSize, f.Name(), off+n, want, off)
		}
		if err != nil {
			return n, err
		}
	}
	return n, nil
}
