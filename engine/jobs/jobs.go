// Package jobs holds kvpersist's jobs as plain synchronous functions: Write
// (single-file or block layout), Read (verified, into caller-owned buffers),
// Collect (garbage collection of unreferenced blocks), Delete, Verify (a
// hash-only re-read, for tools) and Migrate (of stores written by the Bun
// worker). What a store, a namespace and their entries are, where blocks
// live, the namespace lock and the sync policy are package store's: no job
// lists a directory or builds a block path itself. They start no CPU goroutines of
// their own: a job that can use more cores hands tasks to Config.Spawn (the
// engine's bounded pool) and does the rest itself, so a job makes progress
// even when the pool is full. The exceptions wait on the disk, not the
// CPU: a block Write runs up to 32 fdatasync waiters (and as many directory
// fsync waiters), and a Read tops the pool's helpers up with goroutines of
// its own to keep Config.ReadDepth requests in flight (readio.Read); both
// are joined before the job returns. The engine (package engine) schedules
// them; tools and tests may call them directly, with the same request types
// (WriteRequest, ReadRequest, ...; request.go), naming snapshots by Ref
// under Config.Root.
package jobs

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"runtime/debug"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvpersist/kvpersist/engine/layout"
	"github.com/kvpersist/kvpersist/engine/readio"
	"github.com/kvpersist/kvpersist/engine/store"
	"github.com/kvpersist/kvpersist/engine/vfs"
	"github.com/kvpersist/kvpersist/internal/scratch"
)

// Spawn runs fn on another goroutine if one is free now and reports whether
// it did; it must never block waiting for one. nil means no helpers.
type Spawn func(fn func()) bool

// Config is what every job needs from its caller.
type Config struct {
	// Root is the store's root directory: each directory directly under it
	// is a namespace. Requests name snapshots under it (Ref); Collect
	// collects it; Migrate writes into it.
	Root string
	// FS is the file system; nil means vfs.Default.
	FS vfs.FS
	// NoSync turns off every fsync (file and directory). Only for tests
	// and tmpfs: a published snapshot may then vanish in a power cut.
	// (store.Options.NoSync: the store applies it.)
	NoSync bool
	// NoLock turns off the per-namespace advisory lock (flock) that keeps a
	// collect in another process away from this job's blocks
	// (store.Options.NoLock).
	NoLock bool
	// Spawn lends the job more goroutines (bounded by the pool); nil = none.
	Spawn Spawn
	// Helpers caps how many extra goroutines one job asks Spawn for; 0
	// means 1 (so two goroutines work on a job).
	Helpers int
	// Yield, when non-nil, is asked by helper goroutines between tasks;
	// true makes a helper hand its goroutine back (the job's own goroutine
	// carries on), so a waiting job can start, e.g. a read behind a big write.
	Yield func() bool
	// Logger receives debug events; nil means slog.Default().
	Logger *slog.Logger
	// ReadDepth is how many read requests one read keeps in flight (see
	// readio.Read); 0 means readio.DefaultReadDepth, at most
	// readio.MaxReadDepth.
	ReadDepth int
	// NoDirect turns O_DIRECT reads off (buffered reads only).
	NoDirect bool
	// Async, when non-nil, issues the O_DIRECT reads of readio.Read
	// asynchronously (Linux AIO: a goroutine waiting for the disk holds
	// no P, so hashing gets every core); its owner closes it after the
	// last read. nil: preads.
	Async *readio.AsyncReads
	// Durable, when non-nil, remembers the page files known durable, so
	// that a prefix save that reuses one does not fsync its directory
	// again (see DurablePages); nil: every reused page's directory is
	// fsynced.
	Durable DurablePages
	// Admission, when non-nil, is told the pages of a page save
	// (SavePrefix, a Write in the Pages layout) before any of their files
	// is created, so that room is made for them (see Admission); nil:
	// none.
	Admission Admission
}

// DurablePages remembers, per namespace (by name) and page key, the
// vfs.FileID of a page file whose name was made durable (the page's
// directory entry and its fan-out directory's entry in pages/ fsynced
// after an lstat that gave that FileID), and the sum of the header the
// file holds. A prefix save (SavePrefix, a layout.Pages write) that
// finds a stored page with the same FileID skips its directory's fsync;
// when the header sum is also that of the header the save would write, it
// reuses the file without reading it (the FileID changes with any write
// to the file). It marks every page whose name it made durable once it
// has succeeded. The rule and why it is safe: ARCHITECTURE.md,
// "Known-durable pages". engine/pageindex.Index implements it. Both
// methods must be safe for concurrent use.
type DurablePages interface {
	// DurableMark is the FileID and header sum marked for key in
	// namespace ns, or zero values.
	DurableMark(ns string, key layout.PageKey) (vfs.FileID, uint64)
	// MarkDurable marks keys[i] with ids[i] and header sum headers[i]
	// (a zero id forgets the mark).
	MarkDurable(ns string, keys []layout.PageKey, ids []vfs.FileID, headers []uint64)
}

func (c *Config) fs() vfs.FS {
	if c.FS == nil {
		return vfs.Default
	}
	return c.FS
}

// storeOptions are the store policies of this job's configuration: the
// store package decides what NoSync and NoLock mean.
func (c *Config) storeOptions() store.Options {
	return store.Options{FS: c.fs(), NoSync: c.NoSync, NoLock: c.NoLock}
}

// reads is the configuration of this job's reads (package readio).
func (c *Config) reads() *readio.Config {
	return &readio.Config{FS: c.FS, ReadDepth: c.ReadDepth, NoDirect: c.NoDirect, Async: c.Async,
		Spawn: c.Spawn, Helpers: c.Helpers, Logger: c.Logger}
}

// addReads adds st's counts to m's read counters.
func (m *Metrics) addReads(st readio.Stats) {
	m.ReadBytes += st.Bytes
	m.DirectReadBytes += st.DirectBytes
	m.AsyncReadBytes += st.AsyncBytes
}

func (c *Config) helpers() int {
	if c.Helpers <= 0 {
		return 1
	}
	return c.Helpers
}

// Metrics of one job. Bytes are always bytes; counts are counts. Fields not
// meaningful for a job's kind stay zero. The first four carry the original
// worker's meanings.
type Metrics struct {
	// WrittenBytes: tensor or block bytes newly written, plus the header or
	// manifest bytes written.
	WrittenBytes int64
	// ReusedBytes: bytes of blocks that were already stored (dedup).
	ReusedBytes int64
	// CopiedBytes: bytes that had to be gathered into scratch because they
	// were not one contiguous run of the caller's view.
	CopiedBytes int64
	// ScratchPeak: the largest scratch buffer one task used, in bytes.
	ScratchPeak int64
	// Elapsed is the job's wall time.
	Elapsed time.Duration

	// LogicalBytes: the snapshot's tensor bytes (sum of every slot's bytes).
	LogicalBytes int64
	// ReadBytes: bytes read from disk into destinations (reads).
	ReadBytes int64
	// DirectReadBytes: the part of ReadBytes read with O_DIRECT, past the
	// page cache (0 on a file system without O_DIRECT: buffered fallback).
	DirectReadBytes int64
	// AsyncReadBytes: the part of DirectReadBytes read asynchronously
	// (Config.Async); 0 when the AIO setup failed (preads instead).
	AsyncReadBytes int64
	// BlocksWritten / BlocksReused count blocks (block layout).
	BlocksWritten, BlocksReused int64

	// Collect is a collect's report (nil for other kinds).
	Collect *CollectMetrics
	// Migrate is a migrate's per-snapshot report (nil for other kinds).
	Migrate *MigrateReport
}

// Sentinel errors of the jobs, usable with errors.Is. Returned errors wrap
// one of them (or a layout/gather/vfs error) and name the path and tensor.
var (
	// ErrInvalidRequest: a write or read request is malformed (no tensors,
	// a bad view, a dtype whose itemsize disagrees with the view's, ...).
	ErrInvalidRequest = errors.New("invalid request")
	// ErrBlockBytes: blockBytes is not a power of two in [MinBlockBytes, MaxBlockBytes].
	ErrBlockBytes = errors.New("invalid block size")
	// ErrDestination: the destinations do not match the snapshot: wrong
	// count, or a buffer whose length differs from its tensor's bytes.
	ErrDestination = errors.New("destination does not match snapshot")
	// ErrMismatch: the snapshot's dtype or shape differs from what the
	// caller expected (see ReadRequest.Expect).
	ErrMismatch = errors.New("snapshot differs from expected")
	// ErrCorrupt: a tensor or block failed verification.
	ErrCorrupt = readio.ErrCorrupt
	// ErrMissingBlock: a block named by a manifest does not exist.
	ErrMissingBlock = errors.New("missing block")
	// ErrBlockSize: a block file's size differs from its manifest entry
	// (truncated, or with trailing bytes).
	ErrBlockSize = readio.ErrShort
	// ErrPanic: a job panicked; the panic was recovered.
	ErrPanic = readio.ErrPanic
)

// Block size bounds, in bytes.
const (
	MinBlockBytes     = 4 << 10
	MaxBlockBytes     = 64 << 20
	DefaultBlockBytes = 1 << 20 // as the original
	// ChunkBytes is the unit, in bytes, in which single-file writes and reads
	// stream a tensor: gather, hash and pwrite (or pread and hash) a chunk at
	// a time, so that scratch stays bounded and data is hot in cache.
	ChunkBytes = 4 << 20
)

// CheckBlockBytes validates a block size: a power of two between
// MinBlockBytes (4 KiB) and MaxBlockBytes (64 MiB). The original accepted 0
// and then made one file per element.
func CheckBlockBytes(n int) error {
	if n < MinBlockBytes || n > MaxBlockBytes || n&(n-1) != 0 {
		return fmt.Errorf("%w: %d bytes (want a power of two from %d to %d)", ErrBlockBytes, n, MinBlockBytes, MaxBlockBytes)
	}
	return nil
}

// parallel runs fn(i) for i in [0, n): the calling goroutine works through
// the indices itself, helped by up to cfg.helpers() goroutines that Spawn
// grants right now. It returns when every started goroutine has finished
// (so no goroutine touches caller memory afterwards), with the first error.
// It stops taking new indices after an error or when ctx is done. A panic in
// a helper is recovered and returned as ErrPanic. Each goroutine gets its own
// scratch of scratchBytes (nil when 0).
func parallel(ctx context.Context, cfg *Config, n, scratchBytes int, fn func(i int, scratch []byte) error) error {
	return parallelWith(ctx, cfg, n,
		func() []byte {
			if scratchBytes == 0 {
				return nil
			}
			return *scratch.Get(scratchBytes)
		},
		fn,
		func(buf []byte, _ bool) error {
			if buf != nil {
				scratch.Put(&buf)
			}
			return nil
		})
}

// parallelWith is parallel with per-goroutine state: each participating
// goroutine makes its state with newW, runs fn for the indices it takes, and
// calls done(w, failed) once at the end (also after a panic of fn), where
// failed says whether the whole run has failed (then done should discard
// rather than finish its work). done's error counts as the run's.
func parallelWith[W any](ctx context.Context, cfg *Config, n int, newW func() W, fn func(i int, w W) error, done func(w W, failed bool) error) error {
	if n == 0 {
		return nil
	}
	var (
		next   atomic.Int64
		failed atomic.Bool
		mu     sync.Mutex
		first  error
		wg     sync.WaitGroup
	)
	record := func(err error) {
		mu.Lock()
		if first == nil {
			first = err
		}
		mu.Unlock()
		failed.Store(true)
	}
	work := func(helper bool) {
		w := newW()
		defer func() {
			if r := recover(); r != nil {
				record(fmt.Errorf("%w: %v\n%s", ErrPanic, r, debug.Stack()))
			}
			if err := done(w, failed.Load()); err != nil {
				record(err)
			}
		}()
		for !failed.Load() {
			if helper && cfg.Yield != nil && cfg.Yield() {
				return
			}
			i := int(next.Add(1) - 1)
			if i >= n {
				return
			}
			if err := ctx.Err(); err != nil {
				record(err)
				return
			}
			if err := fn(i, w); err != nil {
				record(err)
				return
			}
		}
	}
	if cfg.Spawn != nil {
		for h := 0; h < min(cfg.helpers(), n-1); h++ {
			wg.Add(1)
			ok := cfg.Spawn(func() {
				defer wg.Done()
				defer func() {
					if r := recover(); r != nil { // a panic in done itself
						record(fmt.Errorf("%w: in a helper task: %v\n%s", ErrPanic, r, debug.Stack()))
					}
				}()
				work(true)
			})
			if !ok {
				wg.Done()
				break
			}
		}
	}
	func() {
		defer func() {
			if r := recover(); r != nil {
				record(fmt.Errorf("%w: %v\n%s", ErrPanic, r, debug.Stack()))
			}
		}()
		work(false)
	}()
	wg.Wait()
	return first
}

func maxInt64(a *atomic.Int64, v int64) {
	for {
		old := a.Load()
		if v <= old || a.CompareAndSwap(old, v) {
			return
		}
	}
}
