package vfs_test

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"math/rand/v2"
	"os"
	"path/filepath"
	"runtime"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"unsafe"

	"github.com/kvpersist/kvpersist/engine/vfs"
)

// directFile writes size pseudo-random bytes to a new file, drops them
// from the page cache, and opens it with O_DIRECT (skipping the test where
// the file system refuses O_DIRECT or reports no alignment).
func directFile(t *testing.T, size int) ([]byte, vfs.File, vfs.Alignment) {
	t.Helper()
	want := make([]byte, size)
	rng := rand.New(rand.NewPCG(uint64(size), 7))
	for i := range want {
		want[i] = byte(rng.Uint32())
	}
	name := filepath.Join(t.TempDir(), "f")
	if err := os.WriteFile(name, want, 0o644); err != nil {
		t.Fatal(err)
	}
	f, err := vfs.OpenDirect(vfs.Default, name)
	if err != nil {
		t.Skipf("no O_DIRECT here: %v", err)
	}
	t.Cleanup(func() { f.Close() })
	a, err := vfs.DirectAlignment(f)
	if err != nil || a.Offset == 0 {
		t.Skipf("no O_DIRECT alignment here: %+v %v", a, err)
	}
	return want, f, a
}

// alignedBuf is n bytes at a 4 KiB-aligned address.
func alignedBuf(n int) []byte {
	b := make([]byte, n+4096)
	skip := (4096 - int(uintptr(unsafe.Pointer(&b[0])))%4096) % 4096
	return b[skip : skip+n : skip+n]
}

// TestAsyncReaderReadsWhatWasWritten: many concurrent O_DIRECT reads
// through one AsyncReader (more readers than slots) return the file's
// bytes, and the read reaching past the end of the file returns what is
// there with io.EOF, as ReadAt does.
func TestAsyncReaderReadsWhatWasWritten(t *testing.T) {
	const size = 3<<20 + 12345 // not a multiple of the alignment
	want, f, _ := directFile(t, size)
	a, err := vfs.NewAsyncReader(4)
	if err != nil {
		t.Skipf("no AIO here: %v", err)
	}
	defer a.Close()
	const piece = 256 << 10
	var wg sync.WaitGroup
	errs := make(chan error, 64)
	for g := range 16 {
		wg.Go(func() {
			buf := alignedBuf(piece)
			for off := g * piece; off < size; off += 16 * piece {
				clear(buf)
				n, async, err := a.ReadAt(f, buf, int64(off))
				wantN := min(piece, size-off)
				if !async {
					errs <- errors.New("a read of an O_DIRECT file was not asynchronous")
					return
				}
				if n != wantN || (wantN < piece) != (err == io.EOF) || (err != nil && err != io.EOF) {
					errs <- &fs.PathError{Op: "read", Path: f.Name(), Err: errors.Join(err, errors.New("wrong count or error"))}
					return
				}
				if !bytes.Equal(buf[:n], want[off:off+n]) {
					errs <- errors.New("bytes read differ from the bytes written at " + f.Name())
					return
				}
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
}

// TestAsyncReaderErrors: a misaligned O_DIRECT read fails with EINVAL in
// an *fs.PathError, as a pread does; a read at the end of the file is
// io.EOF with nothing read; a read of a closed file fails as its ReadAt
// does, with an *fs.PathError wrapping fs.ErrClosed and nothing submitted
// (not the poller's bare "use of closed file", which errors.Is matches to
// no sentinel, nor async true).
func TestAsyncReaderErrors(t *testing.T) {
	_, f, al := directFile(t, 64<<10)
	a, err := vfs.NewAsyncReader(2)
	if err != nil {
		t.Skipf("no AIO here: %v", err)
	}
	defer a.Close()
	buf := alignedBuf(8192)
	_, async, err := a.ReadAt(f, buf, int64(al.Offset)/2+1)
	var pe *fs.PathError
	if !async || !errors.Is(err, syscall.EINVAL) || !errors.As(err, &pe) || pe.Path != f.Name() {
		t.Fatalf("misaligned read: async %v, err %v; want an *fs.PathError of %s wrapping EINVAL", async, err, f.Name())
	}
	n, _, err := a.ReadAt(f, buf, 64<<10)
	if n != 0 || err != io.EOF {
		t.Fatalf("read at the end: %d bytes, %v; want 0, io.EOF", n, err)
	}
	if err := f.Close(); err != nil {
		t.Fatal(err)
	}
	n, async, err = a.ReadAt(f, buf, 0)
	if n != 0 || async || !errors.Is(err, fs.ErrClosed) || !errors.As(err, &pe) || pe.Path != f.Name() {
		t.Fatalf("read of a closed file: %d bytes, async %v, err %v (%T); want 0, false, an *fs.PathError of %s wrapping fs.ErrClosed", n, async, err, err, f.Name())
	}
	if k := a.InFlight(); k != 0 {
		t.Fatalf("%d requests in flight after the reads returned", k)
	}
}

// TestAsyncReaderFallsBackToPread: a file that is not the operating
// system's, and any file after Close, is read with its own ReadAt (async
// false), still with the right bytes; a nil AsyncReader reads the same way
// (its Depth, InFlight and Close answer 0, 0, nil, without a panic).
func TestAsyncReaderFallsBackToPread(t *testing.T) {
	want, f, _ := directFile(t, 64<<10)
	a, err := vfs.NewAsyncReader(2)
	if err != nil {
		t.Skipf("no AIO here: %v", err)
	}
	buf := alignedBuf(32 << 10)
	wrapped := struct{ vfs.File }{f}
	for _, c := range []struct {
		name string
		a    *vfs.AsyncReader
		f    vfs.File
	}{{"wrapped file", a, wrapped}, {"nil reader", nil, f}} {
		clear(buf)
		n, async, err := c.a.ReadAt(c.f, buf, 4096)
		if async || err != nil || n != len(buf) || !bytes.Equal(buf, want[4096:4096+len(buf)]) {
			t.Fatalf("%s: async %v, %d bytes, %v", c.name, async, n, err)
		}
	}
	var none *vfs.AsyncReader // its methods answer, none panics
	if d, k, err := none.Depth(), none.InFlight(), none.Close(); d != 0 || k != 0 || err != nil || a.Depth() != 2 {
		t.Fatalf("nil reader: depth %d, %d in flight, Close %v; depth of a reader of 2 slots: %d", d, k, err, a.Depth())
	}
	if err := a.Close(); err != nil {
		t.Fatal(err)
	}
	clear(buf)
	n, async, err := a.ReadAt(f, buf, 0)
	if async || err != nil || n != len(buf) || !bytes.Equal(buf, want[:len(buf)]) {
		t.Fatalf("after Close: async %v, %d bytes, %v", async, n, err)
	}
	if err := a.Close(); err != nil {
		t.Fatalf("second Close: %v", err)
	}
}

// TestAsyncReaderSetupFailure: an io_setup refused (ENOSYS without AIO,
// EPERM under seccomp, EAGAIN past aio-max-nr) is NewAsyncReader's error,
// with no goroutine or descriptor left behind (goleak in TestMain).
func TestAsyncReaderSetupFailure(t *testing.T) {
	for _, e := range []syscall.Errno{syscall.ENOSYS, syscall.EPERM, syscall.EAGAIN} {
		restore := vfs.SetAsyncSetup(func(int, *uintptr) error { return e })
		a, err := vfs.NewAsyncReader(8)
		restore()
		if a != nil || !errors.Is(err, e) {
			t.Fatalf("setup failing with %v: reader %v, err %v", e, a, err)
		}
	}
	if _, err := vfs.NewAsyncReader(0); err == nil {
		t.Fatal("depth 0 accepted")
	}
}

// TestAsyncReaderCloseWhileReading: Close called while twelve goroutines
// read through two slots (some requests in flight, others waiting for a
// slot) returns once they are back; every read, before, during and after
// it, returns the file's bytes, and each read that starts after Close
// returned is a pread (async false). The reaper is gone afterwards
// (goleak in TestMain).
func TestAsyncReaderCloseWhileReading(t *testing.T) {
	const size, piece = 4 << 20, 64 << 10
	want, f, _ := directFile(t, size)
	a, err := vfs.NewAsyncReader(2)
	if err != nil {
		t.Skipf("no AIO here: %v", err)
	}
	var closed atomic.Bool
	var wg sync.WaitGroup
	errs := make(chan error, 12)
	for g := range 12 {
		wg.Go(func() {
			buf := alignedBuf(piece)
			for k := 0; ; k++ {
				after := closed.Load()
				off := (g*97 + k*piece) % (size - piece) &^ 4095
				clear(buf)
				n, async, err := a.ReadAt(f, buf, int64(off))
				if err != nil || n != piece || !bytes.Equal(buf, want[off:off+piece]) {
					errs <- fmt.Errorf("read at %d: %d bytes, %v, or bytes differ", off, n, err)
					return
				}
				if after {
					if async {
						errs <- fmt.Errorf("a read started after Close returned was asynchronous")
					}
					return
				}
			}
		})
	}
	for a.InFlight() == 0 {
		runtime.Gosched()
	}
	if err := a.Close(); err != nil {
		t.Fatal(err)
	}
	closed.Store(true)
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	if n := a.InFlight(); n != 0 {
		t.Fatalf("%d requests in flight after Close", n)
	}
}
