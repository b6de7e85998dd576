package readio

import (
	"log/slog"
	"sync"
	"sync/atomic"

	"github.com/kvpersist/kvpersist/engine/vfs"
)

// AsyncDepth is how many O_DIRECT reads one AsyncReads keeps in flight at
// most, over every read sharing it (MaxReadDepth: one read at its deepest).
// A read asking for more waits for a slot without holding a P.
const AsyncDepth = MaxReadDepth

// AsyncReads are the asynchronous O_DIRECT reads of one owner (the engine:
// New makes one, Close closes it; Config.Async): one vfs.AsyncReader (Linux
// AIO, completions through Go's netpoller, so a goroutine waiting for the
// disk gives its P to one that hashes), set up by the first O_DIRECT read
// that asks for it and shared by every read after it. It lives as long as
// its owner because destroying an AIO context costs about 30 ms (two RCU
// grace periods): not something to pay per restore.
//
// If the setup fails (ENOSYS: no AIO in the kernel; EPERM: a seccomp
// filter; EAGAIN: /proc/sys/fs/aio-max-nr reached), every read through
// this AsyncReads uses preads instead, as before it existed: decided once,
// logged once at warn, and visible in Metrics.AsyncReadBytes (0) beside
// DirectReadBytes. Buffered reads (no O_DIRECT on the file system, a warm
// file, Config.NoDirect) always use preads: AIO on a buffered file runs
// synchronously inside io_submit.
//
// A nil *AsyncReads is valid: preads only.
type AsyncReads struct {
	log   *slog.Logger
	setup func(depth int) (*vfs.AsyncReader, error)
	ready atomic.Pointer[vfs.AsyncReader]
	mu    sync.Mutex
	tried bool // setup attempted (successfully or not) or closed; under mu
	r     *vfs.AsyncReader
}

// NewAsyncReads returns asynchronous O_DIRECT reads not set up yet (no
// system call, no goroutine until the first O_DIRECT read); logger (nil:
// slog.Default()) receives the one warning of a failed setup. Close it.
func NewAsyncReads(logger *slog.Logger) *AsyncReads {
	return NewAsyncReadsWith(logger, vfs.NewAsyncReader)
}

// NewAsyncReadsWith is NewAsyncReads with its AIO setup replaced by setup
// (depth: the reads in flight at most; tests pass one that fails, for the
// fallback to preads).
func NewAsyncReadsWith(logger *slog.Logger, setup func(depth int) (*vfs.AsyncReader, error)) *AsyncReads {
	return &AsyncReads{log: logger, setup: setup}
}

// reader is the AsyncReader to read with, set up on first use; nil: preads
// (a nil a, a failed setup, or a closed a).
func (a *AsyncReads) reader() *vfs.AsyncReader {
	if a == nil {
		return nil
	}
	if r := a.ready.Load(); r != nil {
		return r
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.tried {
		return a.ready.Load()
	}
	a.tried = true
	r, err := a.setup(AsyncDepth)
	if err != nil {
		log := a.log
		if log == nil {
			log = slog.Default()
		}
		log.Warn("kvpersist: asynchronous O_DIRECT reads unavailable; preads from now on", "err", err)
		return nil
	}
	a.r = r
	a.ready.Store(r)
	return r
}

// InFlight is how many asynchronous reads are submitted to the kernel and
// not yet completed and handed back (0 before the setup, after a failed one
// and after Close). A read job returns only once its own reads are back:
// with no other read running, InFlight is 0 when a read's ack arrives.
func (a *AsyncReads) InFlight() int {
	if a == nil {
		return 0
	}
	a.mu.Lock()
	r := a.r
	a.mu.Unlock()
	return r.InFlight()
}

// Close waits for the reads in flight, stops the reaper goroutine and
// destroys the AIO context, if one was set up. Reads after Close use
// preads. Idempotent; a nil AsyncReads does nothing.
func (a *AsyncReads) Close() error {
	if a == nil {
		return nil
	}
	a.mu.Lock()
	a.tried = true
	r := a.r
	a.ready.Store(nil)
	a.mu.Unlock()
	return r.Close()
}
