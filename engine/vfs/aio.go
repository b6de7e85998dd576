package vfs

import (
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"runtime"
	"sync"
	"sync/atomic"
	"syscall"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
)

// AsyncReader issues reads of O_DIRECT files through Linux AIO (io_submit)
// and waits for them without holding a Go scheduler P: a goroutine blocked
// in a pread keeps its P until the runtime's monitor retakes it (20 µs to
// 10 ms later), which starves the goroutines that hash what was read; one
// waiting on a channel gives its P back at once. Every request names a
// nonblocking eventfd (IOCB_FLAG_RESFD); one reaper goroutine waits for it
// in Go's netpoller, reaps the completions with io_getevents (timeout zero)
// and hands each to the goroutine waiting for it.
//
// Linux AIO rather than io_uring: for O_DIRECT reads of regular files
// (ext4, xfs, btrfs) it is truly asynchronous, and its ABI is four system
// calls and two fixed structs, with nothing shared in memory between the
// kernel and Go (io_uring's rings need memory-ordered access to mmapped
// queues). On a buffered file io_submit reads synchronously, so
// AsyncReader is meant for O_DIRECT files only.
//
// Invariant: a read's buffer is never written after ReadAt returns. ReadAt
// returns only once every request it submitted has completed (whatever
// happens: an error, a short read); Linux cannot cancel an O_DIRECT read
// (io_cancel fails with EINVAL for it), so none is abandoned. Close waits
// for every ReadAt in progress, stops the reaper and destroys the context.
//
// An AsyncReader is safe for concurrent use; at most Depth requests are in
// flight at once (ReadAt waits for a free slot, without a P).
type AsyncReader struct {
	ctx    uintptr  // aio_context_t
	efd    *os.File // the eventfd, in the netpoller
	slots  []asyncSlot
	free   chan int // indices of slots not in flight
	closed atomic.Bool
	// inFlight counts requests submitted and not yet handed back to
	// their ReadAt.
	inFlight atomic.Int64
	reaped   chan struct{} // closed when the reaper has returned
	once     sync.Once
	err      error // Close's
}

// asyncSlot is one request's place: its iocb (which the kernel reads
// during io_submit) and the channel its completion is sent on.
type asyncSlot struct {
	cb   iocb
	done chan int64 // the completion's res: bytes read, or -errno
	buf  []byte     // the buffer being read into; keeps it alive and off the stack
	// events is where this slot's ReadAt reaps completions that are
	// ready (reapReady) before it waits for its own.
	events [8]ioEvent
}

// iocb is struct iocb of <linux/aio_abi.h> (64 bytes on every
// architecture; aio_key and aio_rw_flags, whose order depends on the
// byte order, are both zero here).
type iocb struct {
	data      uint64 // aio_data: the slot's index
	keyFlags  uint64 // aio_key, aio_rw_flags
	opcode    uint16 // aio_lio_opcode
	reqprio   int16
	fildes    uint32
	buf       uint64
	nbytes    uint64
	offset    int64
	reserved2 uint64
	flags     uint32
	resfd     uint32
}

// ioEvent is struct io_event of <linux/aio_abi.h>.
type ioEvent struct {
	data uint64
	obj  uint64
	res  int64
	res2 int64
}

const (
	iocbCmdPread = 0
	iocbFlagRes  = 1 // IOCB_FLAG_RESFD
)

// asyncSetup is the io_setup of NewAsyncReader (tests replace it to
// inject a setup failure).
var asyncSetup = func(nr int, ctx *uintptr) error {
	_, _, e := unix.Syscall(unix.SYS_IO_SETUP, uintptr(nr), uintptr(unsafe.Pointer(ctx)), 0)
	if e != 0 {
		return e
	}
	return nil
}

// NewAsyncReader sets up an AIO context for depth requests in flight (1
// to 4096) and starts its reaper goroutine; Close stops it. It fails with
// the setup's error, as an *os.SyscallError: ENOSYS (no AIO in this
// kernel), EPERM (forbidden by a seccomp filter), EAGAIN (the system-wide
// limit /proc/sys/fs/aio-max-nr reached), or the eventfd's. The caller
// then reads with preads (see readio.AsyncReads: decided once, logged).
func NewAsyncReader(depth int) (*AsyncReader, error) {
	if depth < 1 || depth > 4096 {
		return nil, fmt.Errorf("vfs: async reader depth %d (want 1 to 4096)", depth)
	}
	a := &AsyncReader{slots: make([]asyncSlot, depth), free: make(chan int, depth), reaped: make(chan struct{})}
	if err := asyncSetup(depth, &a.ctx); err != nil {
		return nil, os.NewSyscallError("io_setup", err)
	}
	efd, err := unix.Eventfd(0, unix.EFD_NONBLOCK|unix.EFD_CLOEXEC)
	if err != nil {
		ioDestroy(a.ctx)
		return nil, os.NewSyscallError("eventfd", err)
	}
	// Nonblocking: os.NewFile puts it in the netpoller.
	a.efd = os.NewFile(uintptr(efd), "aio-eventfd")
	for i := range a.slots {
		s := &a.slots[i]
		s.done = make(chan int64, 1)
		s.cb = iocb{data: uint64(i), opcode: iocbCmdPread, flags: iocbFlagRes, resfd: uint32(efd)}
		a.free <- i
	}
	go a.reap()
	return a, nil
}

// InFlight is how many requests are submitted and not yet completed and
// handed back to their ReadAt (0 for a nil AsyncReader).
func (a *AsyncReader) InFlight() int {
	if a == nil {
		return 0
	}
	return int(a.inFlight.Load())
}

// Depth is how many requests may be in flight at once (0 for a nil
// AsyncReader, which reads with preads).
func (a *AsyncReader) Depth() int {
	if a == nil {
		return 0
	}
	return len(a.slots)
}

func ioDestroy(ctx uintptr) error {
	_, _, e := unix.Syscall(unix.SYS_IO_DESTROY, ctx, 0, 0)
	if e != 0 {
		return os.NewSyscallError("io_destroy", e)
	}
	return nil
}

// reap delivers completions until the eventfd is closed (by Close, after
// every request has completed).
func (a *AsyncReader) reap() {
	defer close(a.reaped)
	var count [8]byte
	events := make([]ioEvent, len(a.slots))
	for {
		// Blocks in the netpoller until a completion bumps the counter.
		if _, err := a.efd.Read(count[:]); err != nil {
			if errors.Is(err, os.ErrClosed) {
				return
			}
			// An eventfd read has no other failure; try again rather
			// than abandon a waiter.
			time.Sleep(time.Millisecond)
			continue
		}
		a.reapReady(events)
	}
}

// zeroTimeout is io_getevents' timeout for "only what is ready now" (the
// kernel only reads it).
var zeroTimeout unix.Timespec

// reapReady takes every completion ready now (io_getevents, timeout zero)
// into events and sends each to its slot's ReadAt. Both the reaper and a
// ReadAt about to wait run it: the kernel hands each completion out once,
// and a slot has one request at a time, so its send never blocks. A
// ReadAt reaping before it waits matters when every P is busy hashing: Go
// polls the netpoller (where the reaper waits) only when a P runs out of
// work, or every 10 ms from its monitor, so a completion could otherwise
// sit unseen while the goroutine that would hash it waits.
func (a *AsyncReader) reapReady(events []ioEvent) {
	for {
		n, _, e := unix.Syscall6(unix.SYS_IO_GETEVENTS, a.ctx, 0, uintptr(len(events)),
			uintptr(unsafe.Pointer(&events[0])), uintptr(unsafe.Pointer(&zeroTimeout)), 0)
		if e == syscall.EINTR {
			continue
		}
		if e != 0 || n == 0 {
			// Nothing more now: completions after this bump the eventfd
			// again, and the reaper takes them. (io_getevents of a live
			// context has no other failure.)
			return
		}
		for _, ev := range events[:n] {
			a.slots[ev.data].done <- ev.res
		}
	}
}

// asyncFile is a File whose descriptor AsyncReader may read: the
// operating system's.
type asyncFile interface {
	control(fn func(fd int) error) error
}

// ReadAt fills p from f at off like f.ReadAt (n < len(p) only with an
// error, io.EOF at the end of the file), through AIO when f is a file of
// the operating system's FS: async then reports true. When f is not (a
// wrapping FS), a is nil or closed, f is closed (then the error wraps
// fs.ErrClosed), or the kernel refuses the submission (an fd that takes
// no AIO), it reads with f.ReadAt and async is false. f
// must be opened with O_DIRECT (else the read is synchronous inside
// io_submit: correct, but holding a P) and p, off and len(p) aligned as
// DirectAlignment says (else the read fails with EINVAL, as a pread
// would). An error is an *fs.PathError ("read", f's name, the errno); a
// request completed with EINTR (a signal interrupted it inside io_submit)
// is submitted again, as a pread would be restarted.
// When ReadAt returns, the kernel has finished writing into p.
func (a *AsyncReader) ReadAt(f File, p []byte, off int64) (n int, async bool, err error) {
	af, ok := f.(asyncFile)
	if a == nil || !ok || len(p) == 0 {
		n, err = f.ReadAt(p, off)
		return n, false, err
	}
	i := <-a.free
	defer func() { a.free <- i }()
	if a.closed.Load() {
		n, err = f.ReadAt(p, off)
		return n, false, err
	}
	s := &a.slots[i]
	var refused bool // the kernel refused the submission: the rest by pread
	var ran bool     // control ran the reads (false: f is closed)
	cerr := af.control(func(fd int) error {
		ran = true
		for n < len(p) {
			res, ok := a.read(s, fd, p[n:], off+int64(n))
			if !ok {
				refused = true
				return nil
			}
			if res == -int64(syscall.EINTR) {
				// A signal interrupted the read while it slept inside
				// io_submit: fs/aio.c completes it with EINTR, as it
				// cannot restart the system call; a pread would have
				// been restarted. Submit it again.
				continue
			}
			if res < 0 {
				return syscall.Errno(-res)
			}
			if res == 0 {
				return io.EOF
			}
			n += int(res)
		}
		return nil
	})
	if !ran {
		// No descriptor to read (f is closed): f.ReadAt says so as a
		// pread would, an *fs.PathError wrapping fs.ErrClosed, where
		// control's error is the poller's bare "use of closed file".
		n, err = f.ReadAt(p, off)
		return n, false, err
	}
	if refused {
		k, err := f.ReadAt(p[n:], off+int64(n))
		return n + k, n > 0, err
	}
	switch {
	case cerr == nil:
	case cerr == io.EOF:
		err = io.EOF
	default:
		if _, isErrno := cerr.(syscall.Errno); isErrno {
			err = &fs.PathError{Op: "read", Path: f.Name(), Err: cerr}
		} else {
			err = cerr
		}
	}
	return n, true, err
}

// read submits one pread of p at off through slot s and waits for its
// completion: res is the bytes read or -errno. ok is false when io_submit
// refused the request (nothing was submitted).
func (a *AsyncReader) read(s *asyncSlot, fd int, p []byte, off int64) (res int64, ok bool) {
	s.buf = p // escapes: p's memory is on the heap, and kept alive until done
	s.cb.fildes = uint32(fd)
	s.cb.buf = uint64(uintptr(unsafe.Pointer(unsafe.SliceData(p))))
	s.cb.nbytes = uint64(len(p))
	s.cb.offset = off
	cbs := [1]*iocb{&s.cb}
	a.inFlight.Add(1)
	for {
		_, _, e := unix.Syscall(unix.SYS_IO_SUBMIT, a.ctx, 1, uintptr(unsafe.Pointer(&cbs[0])))
		if e == syscall.EINTR {
			continue
		}
		if e != 0 {
			a.inFlight.Add(-1)
			s.buf = nil
			return 0, false
		}
		break
	}
	// Submitted: the one completion of this request always comes, and is
	// waited for whatever the caller's state. Before waiting, take the
	// completions that are ready (this one's, or others' whose ReadAts
	// then run without waiting for the netpoller).
	select {
	case res = <-s.done:
	default:
		a.reapReady(s.events[:])
		res = <-s.done
	}
	a.inFlight.Add(-1)
	runtime.KeepAlive(p)
	s.buf = nil
	return res, true
}

// Close waits for every ReadAt in progress to return, stops the reaper
// goroutine and destroys the AIO context (io_destroy waits for two RCU
// grace periods, which is why the engine keeps one context). ReadAt after Close reads with
// preads. Close is idempotent; a nil AsyncReader's Close does nothing.
func (a *AsyncReader) Close() error {
	if a == nil {
		return nil
	}
	a.once.Do(func() {
		a.closed.Store(true)
		// Every slot back: no request in flight, every completion taken.
		for range a.slots {
			<-a.free
		}
		a.efd.Close() // the reaper's Read returns os.ErrClosed
		<-a.reaped
		a.err = ioDestroy(a.ctx)
		for range a.slots {
			a.free <- 0 // ReadAt after Close: a slot, then preads
		}
	})
	return a.err
}
