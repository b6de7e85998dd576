package vfs_test

import (
	"bytes"
	"context"
	"errors"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/kvpersist/kvpersist/engine/vfs"
	"go.uber.org/goleak"
	"golang.org/x/sys/unix"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// TestLockExclusionAndCancel: a shared lock excludes an exclusive one (even
// in one process: flock locks belong to open file descriptions), the waiting
// Lock returns ctx's cause when ctx ends, and gets the lock once the holder
// releases it.
func TestLockExclusionAndCancel(t *testing.T) {
	name := filepath.Join(t.TempDir(), ".lock")
	fsys := vfs.Default
	unlockShared, err := fsys.Lock(context.Background(), name, false, true)
	if err != nil {
		t.Fatal(err)
	}
	unlock2, err := fsys.Lock(context.Background(), name, false, false)
	if err != nil {
		t.Fatalf("second shared lock: %v", err)
	}
	unlock2()
	ctx, cancel := context.WithTimeoutCause(context.Background(), 30*time.Millisecond, errors.New("gave up waiting"))
	defer cancel()
	if _, err := fsys.Lock(ctx, name, true, false); !errors.Is(err, context.Cause(ctx)) {
		t.Fatalf("exclusive lock while a shared one is held: %v, want the ctx cause", err)
	}
	done := make(chan error, 1)
	go func() {
		unlock, err := fsys.Lock(context.Background(), name, true, false)
		if err == nil {
			unlock()
		}
		done <- err
	}()
	time.Sleep(10 * time.Millisecond) // the goroutine is polling
	if err := unlockShared(); err != nil {
		t.Fatal(err)
	}
	if err := <-done; err != nil {
		t.Fatalf("exclusive lock after release: %v", err)
	}
	if _, err := fsys.Lock(context.Background(), filepath.Join(t.TempDir(), "missing"), false, false); !errors.Is(err, fs.ErrNotExist) {
		t.Fatalf("lock of a missing file without create: %v, want fs.ErrNotExist", err)
	}
}

// TestLockAndOpenRegularRefuseSpecialFiles: Lock (with and without create)
// and OpenRegular neither block on a FIFO nor follow a symlink nor take a
// directory: each fails at once with an error naming the path (ErrNotRegular
// for the FIFO and the directory, ELOOP for the symlink), and the
// symlink's target is left as it was. SyncDir of a FIFO or of a symlink to
// a file fails at once with ENOTDIR.
func TestLockAndOpenRegularRefuseSpecialFiles(t *testing.T) {
	dir := t.TempDir()
	target := filepath.Join(dir, "target")
	if err := os.WriteFile(target, []byte("x"), 0o600); err != nil {
		t.Fatal(err)
	}
	fifo, link, sub := filepath.Join(dir, "fifo"), filepath.Join(dir, "link"), filepath.Join(dir, "dir")
	if err := syscall.Mkfifo(fifo, 0o600); err != nil {
		t.Skipf("mkfifo: %v", err)
	}
	if err := os.Symlink(target, link); err != nil {
		t.Fatal(err)
	}
	if err := os.Mkdir(sub, 0o700); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		path string
		want error
	}{{fifo, vfs.ErrNotRegular}, {link, syscall.ELOOP}, {sub, vfs.ErrNotRegular}} {
		for _, op := range []string{"lock", "lock-create", "open", "syncdir"} {
			want := tc.want
			if op == "syncdir" {
				if tc.path == sub {
					continue // a directory: what SyncDir is for
				}
				want = syscall.ENOTDIR // O_DIRECTORY (a symlink is followed, to a file)
			}
			if tc.path == sub && op == "lock-create" {
				want = syscall.EISDIR // open(O_CREAT) of a directory
			}
			done := make(chan error, 1)
			go func() {
				var err error
				switch op {
				case "syncdir":
					err = vfs.Default.SyncDir(tc.path)
				case "open":
					var f vfs.File
					if f, err = vfs.OpenRegular(vfs.Default, tc.path); err == nil {
						f.Close()
					}
				default:
					var unlock func() error
					if unlock, err = vfs.Default.Lock(context.Background(), tc.path, true, op == "lock-create"); err == nil {
						unlock()
					}
				}
				done <- err
			}()
			select {
			case err := <-done:
				if !errors.Is(err, want) || !strings.Contains(err.Error(), tc.path) {
					t.Errorf("%s %s: %v, want an error wrapping %v naming the path", op, tc.path, err, want)
				}
			case <-time.After(10 * time.Second): // a hang detector
				w, _ := os.OpenFile(fifo, os.O_WRONLY|syscall.O_NONBLOCK, 0) // unblock it
				<-done
				w.Close()
				t.Fatalf("%s %s blocked", op, tc.path)
			}
		}
	}
	if b, err := os.ReadFile(target); err != nil || string(b) != "x" {
		t.Fatalf("symlink target: %q %v", b, err)
	}
	f, err := vfs.OpenRegular(vfs.Default, target)
	if err != nil {
		t.Fatalf("OpenRegular of a regular file: %v", err)
	}
	f.Close()
}

// TestOpenRefusesSymlinkAndDoesNotBlockOnFIFO: Open does not follow a final
// symlink (ELOOP) and returns at once for a FIFO with no writer.
func TestOpenRefusesSymlinkAndDoesNotBlockOnFIFO(t *testing.T) {
	dir := t.TempDir()
	target := filepath.Join(dir, "target")
	if err := os.WriteFile(target, []byte("x"), 0o600); err != nil {
		t.Fatal(err)
	}
	link := filepath.Join(dir, "link")
	if err := os.Symlink(target, link); err != nil {
		t.Fatal(err)
	}
	if _, err := vfs.Default.Open(link); !errors.Is(err, syscall.ELOOP) {
		t.Fatalf("open of a symlink: %v, want ELOOP", err)
	}
	fifo := filepath.Join(dir, "fifo")
	if err := syscall.Mkfifo(fifo, 0o600); err != nil {
		t.Skipf("mkfifo: %v", err)
	}
	f, err := vfs.Default.Open(fifo) // would block forever without O_NONBLOCK
	if err != nil {
		t.Fatalf("open of a FIFO: %v", err)
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil || st.Mode().IsRegular() {
		t.Fatalf("FIFO stat: %v, regular %v", err, st.Mode().IsRegular())
	}
}

// TestCreateWriteSyncReadBack: Create is exclusive, the file has the mode
// asked for (umask permitting), and bytes written with WriteAt, Sync'd and
// StartWriteback'd read back with ReadAt.
func TestCreateWriteSyncReadBack(t *testing.T) {
	name := filepath.Join(t.TempDir(), "f")
	f, err := vfs.Default.Create(name, 0o640)
	if err != nil {
		t.Fatal(err)
	}
	want := []byte("kvpersist block bytes")
	if n, err := f.WriteAt(want, 4096); err != nil || n != len(want) {
		t.Fatalf("WriteAt: %d, %v", n, err)
	}
	if err := f.Allocate(8192); err != nil {
		t.Fatal(err)
	}
	if err := f.StartWriteback(0, 0); err != nil {
		t.Fatal(err)
	}
	if err := f.Sync(); err != nil {
		t.Fatal(err)
	}
	if err := f.Close(); err != nil {
		t.Fatal(err)
	}
	if _, err := vfs.Default.Create(name, 0o640); !errors.Is(err, fs.ErrExist) {
		t.Fatalf("second Create: %v, want fs.ErrExist", err)
	}
	r, err := vfs.Default.Open(name)
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	got := make([]byte, len(want))
	if _, err := r.ReadAt(got, 4096); err != nil || string(got) != string(want) {
		t.Fatalf("ReadAt: %q, %v", got, err)
	}
	st, _ := r.Stat()
	if st.Mode().Perm()&^0o640 != 0 {
		t.Fatalf("mode %v, want within 0640", st.Mode().Perm())
	}
	if err := vfs.Default.SyncDir(filepath.Dir(name)); err != nil {
		t.Fatal(err)
	}
}

// TestStatfs: the figures agree with an independent statfs(2) (the total
// and the block size exactly; free space changes under other writers, so
// only its order), and a missing path is an fs.ErrNotExist *os.PathError.
func TestStatfs(t *testing.T) {
	dir := t.TempDir()
	st, err := vfs.Default.Statfs(dir)
	if err != nil {
		t.Fatal(err)
	}
	var raw syscall.Statfs_t
	if err := syscall.Statfs(dir, &raw); err != nil {
		t.Fatal(err)
	}
	bs := raw.Frsize
	if bs == 0 {
		bs = raw.Bsize
	}
	if st.BlockBytes != int64(bs) || st.TotalBytes != int64(raw.Blocks)*int64(bs) {
		t.Fatalf("Statfs %+v; statfs(2) frsize %d bsize %d blocks %d", st, raw.Frsize, raw.Bsize, raw.Blocks)
	}
	if st.BlockBytes <= 0 || st.AvailBytes < 0 || st.AvailBytes > st.FreeBytes || st.FreeBytes > st.TotalBytes {
		t.Fatalf("Statfs %+v: want 0 ≤ avail ≤ free ≤ total", st)
	}
	_, err = vfs.Default.Statfs(filepath.Join(dir, "missing"))
	var pe *os.PathError
	if !errors.Is(err, fs.ErrNotExist) || !errors.As(err, &pe) || pe.Op != "statfs" {
		t.Fatalf("Statfs of a missing path: %v", err)
	}
}

// TestAllocatedBytes: st_blocks × 512, checked against stat(2): a written
// file takes at least its length, a sparse one nothing.
func TestAllocatedBytes(t *testing.T) {
	dir := t.TempDir()
	full, sparse := filepath.Join(dir, "full"), filepath.Join(dir, "sparse")
	if err := os.WriteFile(full, make([]byte, 10000), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(sparse, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Truncate(sparse, 1<<20); err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		name     string
		min, max int64
	}{{full, 10000, 1 << 20}, {sparse, 0, 0}} {
		fi, err := vfs.Default.Lstat(c.name)
		if err != nil {
			t.Fatal(err)
		}
		got, ok := vfs.AllocatedBytes(fi)
		var raw syscall.Stat_t
		if err := syscall.Stat(c.name, &raw); err != nil {
			t.Fatal(err)
		}
		if !ok || got != raw.Blocks*512 || got < c.min || got > c.max {
			t.Fatalf("%s: AllocatedBytes %d %v, stat blocks %d, want in [%d, %d]", c.name, got, ok, raw.Blocks, c.min, c.max)
		}
	}
	if _, ok := vfs.AllocatedBytes(nil); ok {
		t.Fatal("AllocatedBytes(nil) ok")
	}
}

// TestReadvAt: ReadvAt fills its buffers in order with the file's bytes
// from the offset, through preadv (also across more buffers than one
// preadv takes, and empty ones) and through the ReadAt fallback of a File
// that is not a VectorReader alike; a range past the end of the file
// returns what there is and io.EOF.
func TestReadvAt(t *testing.T) {
	data := make([]byte, 70_000)
	for i := range data {
		data[i] = byte(i*7 + i>>8)
	}
	p := filepath.Join(t.TempDir(), "f")
	if err := os.WriteFile(p, data, 0o640); err != nil {
		t.Fatal(err)
	}
	f, err := vfs.Default.Open(p)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if _, ok := f.(vfs.VectorReader); !ok {
		t.Fatal("the OS file is not a VectorReader")
	}
	type plain struct{ vfs.File } // hides ReadvAt: the ReadAt fallback
	for _, file := range []vfs.File{f, plain{f}} {
		for _, sizes := range [][]int{{1}, {5, 0, 17, 4096}, slices.Repeat([]int{3, 0, 50}, 700)} {
			bufs := make([][]byte, len(sizes))
			total := 0
			for i, n := range sizes {
				bufs[i] = make([]byte, n)
				total += n
			}
			off := int64(123)
			n, err := vfs.ReadvAt(file, bufs, off)
			if err != nil || n != total {
				t.Fatalf("%T, %d buffers: read %d of %d: %v", file, len(sizes), n, total, err)
			}
			if got := bytes.Join(bufs, nil); !bytes.Equal(got, data[off:off+int64(total)]) {
				t.Fatalf("%T, %d buffers: wrong bytes", file, len(sizes))
			}
		}
		// Past the end: what there is, then io.EOF.
		bufs := [][]byte{make([]byte, 10), make([]byte, 100)}
		n, err := vfs.ReadvAt(file, bufs, int64(len(data)-50))
		if n != 50 || !errors.Is(err, io.EOF) || !bytes.Equal(bytes.Join(bufs, nil)[:50], data[len(data)-50:]) {
			t.Fatalf("%T past the end: %d bytes, %v", file, n, err)
		}
	}
}

// TestIDOf: a file's FileID is stable while nothing changes it, differs
// once another file is renamed over its name (another inode) or it is
// rewritten, and is zero for a directory.
func TestIDOf(t *testing.T) {
	dir := t.TempDir()
	p := filepath.Join(dir, "page")
	if err := os.WriteFile(p, []byte("abcd"), 0o644); err != nil {
		t.Fatal(err)
	}
	id := func(name string) vfs.FileID {
		fi, err := vfs.Default.Lstat(name)
		if err != nil {
			t.Fatal(err)
		}
		return vfs.IDOf(fi)
	}
	a := id(p)
	if a == (vfs.FileID{}) || a.Size != 4 || a != id(p) {
		t.Fatalf("FileID %+v, again %+v", a, id(p))
	}
	if err := os.WriteFile(p+".tmp", []byte("abcd"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(p+".tmp", p); err != nil {
		t.Fatal(err)
	}
	if b := id(p); b == a || b.Ino == a.Ino {
		t.Fatalf("a file renamed over the name kept FileID %+v (was %+v)", b, a)
	}
	if d := id(dir); d != (vfs.FileID{}) {
		t.Fatalf("a directory's FileID is %+v, want zero", d)
	}
}

// TestClearDirect: a file opened with O_DIRECT refuses an unaligned read
// (EINVAL: the flag is in effect); after ClearDirect the same descriptor
// reads any range through the page cache, the file's exact bytes.
func TestClearDirect(t *testing.T) {
	path := filepath.Join(t.TempDir(), "f")
	data := make([]byte, 3*4096)
	for i := range data {
		data[i] = byte(i*7 + i>>8)
	}
	if err := os.WriteFile(path, data, 0o600); err != nil {
		t.Fatal(err)
	}
	f, err := vfs.OpenDirect(vfs.Default, path)
	if errors.Is(err, syscall.EINVAL) {
		t.Skipf("no O_DIRECT on %s: %v", filepath.Dir(path), err)
	}
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	buf := make([]byte, 100)
	if _, err := f.ReadAt(buf, 3); !errors.Is(err, syscall.EINVAL) {
		t.Skipf("an unaligned O_DIRECT read was not refused (%v): this file system ignores O_DIRECT", err)
	}
	if err := vfs.ClearDirect(f); err != nil {
		t.Fatal(err)
	}
	n, err := f.ReadAt(buf, 3)
	if err != nil || n != len(buf) || !bytes.Equal(buf, data[3:3+len(buf)]) {
		t.Fatalf("after ClearDirect: read %d bytes, %v; equal: %v", n, err, bytes.Equal(buf[:n], data[3:3+n]))
	}
}

// TestOpenAppend: two files opened by OpenAppend on one path (as two
// processes appending to one journal) never overwrite each other: every
// write lands at the end, and the file holds all of them in write order.
// A missing file is created with the mode asked; a symlink is refused
// (ELOOP) and a FIFO without a reader fails at once (ENXIO) instead of
// blocking.
func TestOpenAppend(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "journal")
	a, err := vfs.Default.OpenAppend(path, 0o640)
	if err != nil {
		t.Fatal(err)
	}
	defer a.Close()
	b, err := vfs.Default.OpenAppend(path, 0o640)
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	var want []byte
	for i := range 6 {
		f, p := a, []byte{'a', byte('0' + i)}
		if i%2 == 1 {
			f, p = b, []byte{'b', byte('0' + i), '!'}
		}
		if n, err := f.Write(p); err != nil || n != len(p) {
			t.Fatalf("write %d: %d, %v", i, n, err)
		}
		want = append(want, p...)
	}
	if err := a.Sync(); err != nil {
		t.Fatal(err)
	}
	got, err := os.ReadFile(path)
	if err != nil || !bytes.Equal(got, want) {
		t.Fatalf("file holds %q (%v), want %q", got, err, want)
	}
	if fi, err := a.Stat(); err != nil || !fi.Mode().IsRegular() || fi.Mode().Perm() != 0o640 || fi.Size() != int64(len(want)) {
		t.Fatalf("stat: %v, %v", fi, err)
	}
	link := filepath.Join(dir, "link")
	if err := os.Symlink(path, link); err != nil {
		t.Fatal(err)
	}
	if f, err := vfs.Default.OpenAppend(link, 0o640); !errors.Is(err, syscall.ELOOP) {
		if f != nil {
			f.Close()
		}
		t.Fatalf("symlink: %v, want ELOOP", err)
	}
	fifo := filepath.Join(dir, "fifo")
	if err := syscall.Mkfifo(fifo, 0o640); err != nil {
		t.Fatal(err)
	}
	if f, err := vfs.Default.OpenAppend(fifo, 0o640); !errors.Is(err, syscall.ENXIO) {
		if f != nil {
			f.Close()
		}
		t.Fatalf("FIFO without a reader: %v, want ENXIO", err)
	}
}

// TestCachedPages: a file just written is wholly in the page cache
// (CachedPages counts every page a range touches, Cached agrees); after
// posix_fadvise DONTNEED of its middle 2 MiB (fdatasync first: a dirty
// page is not dropped) that range counts none, a range across its edge
// some, and Cached of the whole file is false.
func TestCachedPages(t *testing.T) {
	const mib = 1 << 20
	p := filepath.Join(t.TempDir(), "f")
	if err := os.WriteFile(p, make([]byte, 6*mib+100), 0o640); err != nil {
		t.Fatal(err)
	}
	f, err := vfs.Default.Open(p)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	cached, pages, known := vfs.CachedPages(f, 10, 6*mib)
	if !known {
		t.Skip("cachestat(2) unavailable")
	}
	if want := int64(6*mib/4096 + 1); pages != want || cached != pages {
		t.Fatalf("just written: %d of %d pages cached, want %d of %d", cached, pages, want, want)
	}
	if c, ok := vfs.Cached(f, 0, 0); !c || !ok {
		t.Fatalf("just written: Cached %v, %v", c, ok)
	}
	fd, err := syscall.Open(p, syscall.O_RDONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer syscall.Close(fd)
	if err := syscall.Fdatasync(fd); err != nil {
		t.Fatal(err)
	}
	if err := unix.Fadvise(fd, 2*mib, 2*mib, unix.FADV_DONTNEED); err != nil {
		t.Fatal(err)
	}
	if c, n, _ := vfs.CachedPages(f, 2*mib, 2*mib); c != 0 || n != 2*mib/4096 {
		t.Skipf("after dropping [2, 4) MiB: %d of %d pages cached there: the kernel did not drop exactly the range asked", c, n)
	}
	if c, n, _ := vfs.CachedPages(f, mib, 2*mib); c != mib/4096 || n != 2*mib/4096 {
		t.Fatalf("[1, 3) MiB: %d of %d pages cached, want half", c, n)
	}
	if c, ok := vfs.Cached(f, 0, 0); c || !ok {
		t.Fatalf("partly evicted: Cached %v, %v", c, ok)
	}
}
