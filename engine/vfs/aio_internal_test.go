package vfs

import (
	"bytes"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"testing"
	"unsafe"

	"golang.org/x/sys/unix"
)

// TestAIOStructSizes: iocb and ioEvent have the sizes of <linux/aio_abi.h>'s
// struct iocb (64 bytes) and struct io_event (32), with aio_buf, aio_offset
// and aio_resfd at their offsets (24, 40 and 60).
func TestAIOStructSizes(t *testing.T) {
	var cb iocb
	if s := unsafe.Sizeof(cb); s != 64 {
		t.Fatalf("iocb is %d bytes, want 64", s)
	}
	if s := unsafe.Sizeof(ioEvent{}); s != 32 {
		t.Fatalf("io_event is %d bytes, want 32", s)
	}
	if o := [3]uintptr{unsafe.Offsetof(cb.buf), unsafe.Offsetof(cb.offset), unsafe.Offsetof(cb.resfd)}; o != [3]uintptr{24, 40, 60} {
		t.Fatalf("iocb offsets of aio_buf, aio_offset, aio_resfd: %v, want [24 40 60]", o)
	}
}

// TestAsyncReaderRetriesEINTR: a signal that interrupts a read sleeping
// inside io_submit makes Linux complete the request with -EINTR (fs/aio.c
// cannot restart the system call and turns ERESTARTSYS into EINTR), where
// a pread would have been restarted (Go installs its handlers with
// SA_RESTART and retries EINTR). ReadAt submits such a read again: the
// caller gets the bytes, not "interrupted system call". Shown with the
// read end of a FIFO opened blocking, whose read sleeps interruptibly
// until a writer writes (regular files on a local disk sleep
// uninterruptibly; network and FUSE file systems may not). Each round
// waits until the reading thread is in io_submit, signals it (SIGURG,
// which the Go runtime ignores), lets it leave the system call, then
// writes. Before the retry, a round failed with EINTR about one time in
// three (the others' reads had not slept yet), so eight rounds.
func TestAsyncReaderRetriesEINTR(t *testing.T) {
	fifo := filepath.Join(t.TempDir(), "fifo")
	if err := unix.Mkfifo(fifo, 0o600); err != nil {
		t.Skipf("no FIFO here: %v", err)
	}
	wfd, err := unix.Open(fifo, unix.O_RDWR|unix.O_CLOEXEC, 0) // never blocks on Linux
	if err != nil {
		t.Fatal(err)
	}
	w := os.NewFile(uintptr(wfd), fifo)
	defer w.Close()
	rfd, err := unix.Open(fifo, unix.O_RDONLY|unix.O_CLOEXEC, 0) // blocking: not in the netpoller
	if err != nil {
		t.Fatal(err)
	}
	r := osFile{os.NewFile(uintptr(rfd), fifo)}
	defer r.Close()
	a, err := NewAsyncReader(1)
	if err != nil {
		t.Skipf("no AIO here: %v", err)
	}
	defer a.Close()
	type result struct {
		n     int
		async bool
		err   error
	}
	for round := range 8 {
		tids, done := make(chan int, 1), make(chan result, 1)
		buf := make([]byte, 4096)
		go func() {
			runtime.LockOSThread() // ReadAt's io_submit runs on this thread
			defer runtime.UnlockOSThread()
			tids <- unix.Gettid()
			n, async, err := a.ReadAt(r, buf, 0)
			done <- result{n, async, err}
		}()
		tid := <-tids
		// inSubmit reports whether thread tid is in io_submit now
		// (/proc/self/task/<tid>/syscall starts with its number).
		inSubmit := func() bool {
			b, err := os.ReadFile(fmt.Sprintf("/proc/self/task/%d/syscall", tid))
			if err != nil {
				t.Skipf("no /proc/self/task/%d/syscall: %v", tid, err)
			}
			return strings.HasPrefix(string(b), strconv.Itoa(unix.SYS_IO_SUBMIT)+" ")
		}
		for !inSubmit() {
			runtime.Gosched()
		}
		if err := unix.Tgkill(os.Getpid(), tid, unix.SIGURG); err != nil {
			t.Fatal(err)
		}
		// Let the signal take the thread out of io_submit (it may be back
		// in it at once, submitting again): bounded, as the way out can
		// be missed between two looks.
		for k := 0; k < 1000 && inSubmit(); k++ {
			runtime.Gosched()
		}
		want := bytes.Repeat([]byte{byte('a' + round)}, len(buf))
		if _, err := w.Write(want); err != nil {
			t.Fatal(err)
		}
		res := <-done
		if res.err != nil || res.n != len(buf) || !res.async || !bytes.Equal(buf, want) {
			t.Fatalf("round %d, a read interrupted by a signal: %d bytes, async %v, err %v; want the %d bytes written, no error", round, res.n, res.async, res.err, len(want))
		}
	}
}
