// Package vfs is the file-system seam of kvpersist: every file operation of
// engine/layout and engine/jobs goes through an FS, so that tests can inject
// faults (ENOSPC, EIO, short writes, failed fsyncs) at any point, the way
// cockroachdb/pebble's vfs.FS does. Default is the real operating system.
package vfs

import (
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// File is an open file. Offsets and lengths are in bytes.
type File interface {
	// ReadAt reads len(p) bytes at off (pread). It follows io.ReaderAt.
	ReadAt(p []byte, off int64) (int, error)
	// WriteAt writes len(p) bytes at off (pwrite). It follows io.WriterAt: a
	// short write returns a non-nil error.
	WriteAt(p []byte, off int64) (int, error)
	// Sync flushes the file's data and size to stable storage (fdatasync).
	// A failed Sync must never be retried on the same file: Linux marks the
	// failed pages clean, so a second Sync can succeed with the data lost.
	Sync() error
	// Allocate reserves size bytes from offset 0 (fallocate); a file system
	// without fallocate is not an error (it is a hint).
	Allocate(size int64) error
	// StartWriteback asks the kernel to start writing the byte range
	// [off, off+n) to disk without waiting (sync_file_range
	// SYNC_FILE_RANGE_WRITE; n = 0 means to the end of the file). It makes no
	// durability promise: only Sync does. Unsupported is not an error.
	StartWriteback(off, n int64) error
	// Stat describes the open file.
	Stat() (os.FileInfo, error)
	// Name is the path the file was opened with.
	Name() string
	Close() error
}

// FS is the set of file-system operations kvpersist uses. Paths are OS paths.
// Errors are *os.PathError / *os.LinkError (or wrap them), so errors.Is works
// with fs.ErrNotExist, fs.ErrExist and syscall errnos such as syscall.ENOSPC.
type FS interface {
	// Create makes a new file exclusively (O_CREAT|O_EXCL|O_WRONLY,
	// O_NOFOLLOW) with the given permission bits.
	Create(name string, perm os.FileMode) (File, error)
	// Open opens an existing file read-only without following a symlink
	// in its last element (O_NOFOLLOW), and without blocking on a FIFO
	// (O_NONBLOCK).
	Open(name string) (File, error)
	// OpenAppend opens name for appending (O_WRONLY|O_APPEND), creating
	// it with perm when missing (O_CREAT), without following a symlink in
	// its last element (O_NOFOLLOW) and without blocking on a FIFO
	// (O_NONBLOCK: one without a reader fails with ENXIO). Every Write
	// lands at the file's end at the time of the write, also when other
	// processes append to it (the remote tier's uploads journal). The
	// caller checks with Stat that it is a regular file.
	OpenAppend(name string, perm os.FileMode) (AppendFile, error)
	Rename(oldname, newname string) error
	Remove(name string) error
	MkdirAll(name string, perm os.FileMode) error
	ReadDir(name string) ([]os.DirEntry, error)
	// Lstat describes a path without following a final symlink.
	Lstat(name string) (os.FileInfo, error)
	// Stat describes a path following symlinks. kvpersist uses it only for
	// a store root, which the operator may place behind a symlink; nothing
	// below a root is ever followed.
	Stat(name string) (os.FileInfo, error)
	// SyncDir makes a directory's entries (creates, renames, removes)
	// durable: open it and fsync it.
	SyncDir(name string) error
	// Lock takes an advisory lock (flock) on the file name: shared when
	// exclusive is false. It creates the file when create is true; otherwise
	// a missing file is an fs.ErrNotExist error. It waits until the lock is
	// granted or ctx is done (then ctx's error). It never follows a symlink
	// nor blocks on a FIFO: a name that is not a regular file fails with an
	// error wrapping ErrNotRegular (a symlink: syscall.ELOOP). The returned
	// unlock releases it.
	Lock(ctx context.Context, name string, exclusive, create bool) (unlock func() error, err error)
	// Statfs describes the file system that holds name (statvfs): the
	// page cache's disk headroom is measured with it.
	Statfs(name string) (FSStat, error)
}

// AppendFile is a file opened by FS.OpenAppend: Write appends len(p)
// bytes in one write(2) (a short write returns a non-nil error, as
// io.Writer says); Sync, Stat, Name and Close are File's.
type AppendFile interface {
	Write(p []byte) (int, error)
	Sync() error
	Stat() (os.FileInfo, error)
	Name() string
	Close() error
}

// FSStat describes a file system (statvfs(3)). Bytes are bytes; the block
// counts of statvfs are multiplied by its fragment size f_frsize (f_bsize
// when the kernel reports none).
type FSStat struct {
	// BlockBytes is the fundamental block size (f_frsize), in bytes.
	BlockBytes int64
	// TotalBytes is the file system's size (f_blocks × BlockBytes).
	TotalBytes int64
	// FreeBytes is free space including the part reserved for root
	// (f_bfree × BlockBytes).
	FreeBytes int64
	// AvailBytes is free space available to unprivileged users (f_bavail ×
	// BlockBytes): what kvpersist's files can still take.
	AvailBytes int64
}

// AllocatedBytes is the space a file takes on disk, in bytes: st_blocks ×
// 512 (st_blocks counts 512-byte units whatever the file system's block
// size). It is what the page cache accounts against its capacity; a file
// with holes takes less than its length, one with preallocated blocks more.
// fi must come from Lstat, Stat or File.Stat on Linux; otherwise 0, false.
func AllocatedBytes(fi os.FileInfo) (int64, bool) {
	if fi == nil {
		return 0, false
	}
	st, ok := fi.Sys().(*syscall.Stat_t)
	if !ok {
		return 0, false
	}
	return st.Blocks * 512, true
}

// Default is the real operating system.
var Default FS = osFS{}

type osFS struct{}

type osFile struct{ *os.File }

func (f osFile) control(fn func(fd int) error) error {
	rc, err := f.File.SyscallConn()
	if err != nil {
		return err
	}
	var inner error
	if err := rc.Control(func(fd uintptr) { inner = fn(int(fd)) }); err != nil {
		return err
	}
	return inner
}

func (f osFile) Sync() error {
	err := f.control(func(fd int) error {
		for {
			err := unix.Fdatasync(fd)
			if err != syscall.EINTR {
				return err
			}
		}
	})
	if err != nil {
		return &os.PathError{Op: "fdatasync", Path: f.Name(), Err: err}
	}
	return nil
}

func (f osFile) Allocate(size int64) error {
	if size <= 0 {
		return nil
	}
	err := f.control(func(fd int) error { return unix.Fallocate(fd, 0, 0, size) })
	if errors.Is(err, syscall.EOPNOTSUPP) || errors.Is(err, syscall.ENOSYS) {
		return nil // a hint only: tmpfs and some file systems lack it
	}
	if err != nil {
		return &os.PathError{Op: "fallocate", Path: f.Name(), Err: err}
	}
	return nil
}

func (f osFile) StartWriteback(off, n int64) error {
	err := f.control(func(fd int) error { return unix.SyncFileRange(fd, off, n, unix.SYNC_FILE_RANGE_WRITE) })
	if errors.Is(err, syscall.ENOSYS) || errors.Is(err, syscall.EINVAL) || errors.Is(err, syscall.ESPIPE) {
		return nil
	}
	if err != nil {
		return &os.PathError{Op: "sync_file_range", Path: f.Name(), Err: err}
	}
	return nil
}

func (osFS) Create(name string, perm os.FileMode) (File, error) {
	f, err := os.OpenFile(name, os.O_CREATE|os.O_EXCL|os.O_WRONLY|syscall.O_NOFOLLOW|syscall.O_CLOEXEC, perm)
	if err != nil {
		return nil, err
	}
	return osFile{f}, nil
}

func (osFS) Open(name string) (File, error) { return openRead(name, 0) }

func (osFS) OpenAppend(name string, perm os.FileMode) (AppendFile, error) {
	f, err := os.OpenFile(name, os.O_WRONLY|os.O_APPEND|os.O_CREATE|syscall.O_NOFOLLOW|syscall.O_CLOEXEC|syscall.O_NONBLOCK, perm)
	if err != nil {
		return nil, err
	}
	return osFile{f}, nil
}

// openRead opens name read-only with the extra flags. O_NONBLOCK: a FIFO
// named like a snapshot or block must not hang the open (callers then refuse
// it as not a regular file); it has no effect on regular files.
func openRead(name string, extra int) (File, error) {
	f, err := os.OpenFile(name, os.O_RDONLY|syscall.O_NOFOLLOW|syscall.O_CLOEXEC|syscall.O_NONBLOCK|extra, 0)
	if err != nil {
		return nil, refuseSymlink(name, err)
	}
	return osFile{f}, nil
}

// refuseSymlink turns the ELOOP of an O_NOFOLLOW open of a symlink into an
// error saying so; other errors are returned as they are.
func refuseSymlink(name string, err error) error {
	if errors.Is(err, syscall.ELOOP) {
		return &os.PathError{Op: "open", Path: name, Err: fmt.Errorf("refusing to follow a symlink: %w", syscall.ELOOP)}
	}
	return err
}

// ErrNotRegular is wrapped by the errors of OpenRegular and FS.Lock for a
// path that is not a regular file (a FIFO, a socket, a device, a
// directory): kvpersist reads, locks and appends to regular files only.
var ErrNotRegular = errors.New("not a regular file")

// checkRegular fails with an *os.PathError wrapping ErrNotRegular, naming
// f's path and type, unless f (fstat, so no race with a rename) is a
// regular file.
func checkRegular(f interface {
	Stat() (os.FileInfo, error)
	Name() string
}) error {
	fi, err := f.Stat()
	if err != nil {
		return err
	}
	if !fi.Mode().IsRegular() {
		return &os.PathError{Op: "open", Path: f.Name(), Err: fmt.Errorf("%w (type %v); refusing it", ErrNotRegular, fi.Mode().Type())}
	}
	return nil
}

// OpenRegular opens name with fsys.Open (read-only, no symlink followed,
// no blocking on a FIFO) and keeps it only if the open file is a regular
// file: otherwise it is closed and the error wraps ErrNotRegular and names
// the path and its type.
func OpenRegular(fsys FS, name string) (File, error) {
	f, err := fsys.Open(name)
	if err != nil {
		return nil, err
	}
	if err := checkRegular(f); err != nil {
		f.Close()
		return nil, err
	}
	return f, nil
}

func (osFS) Rename(oldname, newname string) error         { return os.Rename(oldname, newname) }
func (osFS) Remove(name string) error                     { return os.Remove(name) }
func (osFS) MkdirAll(name string, perm os.FileMode) error { return os.MkdirAll(name, perm) }
func (osFS) ReadDir(name string) ([]os.DirEntry, error)   { return os.ReadDir(name) }
func (osFS) Lstat(name string) (os.FileInfo, error)       { return os.Lstat(name) }
func (osFS) Stat(name string) (os.FileInfo, error)        { return os.Stat(name) }
func (osFS) SyncDir(name string) error {
	// O_DIRECTORY: anything else (a FIFO put where a directory was, which
	// a plain open would block on) fails at once with ENOTDIR.
	d, err := os.OpenFile(name, os.O_RDONLY|syscall.O_DIRECTORY|syscall.O_NONBLOCK|syscall.O_CLOEXEC, 0)
	if err != nil {
		return err
	}
	err = d.Sync()
	if cerr := d.Close(); err == nil {
		err = cerr
	}
	return err
}

func (osFS) Lock(ctx context.Context, name string, exclusive, create bool) (func() error, error) {
	// O_NONBLOCK: a FIFO at the lock's path must not hang the open (and
	// with it every job of the namespace, beyond the reach of ctx); it is
	// then refused as not a regular file.
	flag := os.O_RDONLY | syscall.O_NOFOLLOW | syscall.O_CLOEXEC | syscall.O_NONBLOCK
	if create {
		flag |= os.O_CREATE
	}
	f, err := os.OpenFile(name, flag, 0o640)
	if err != nil {
		return nil, refuseSymlink(name, err)
	}
	if err := checkRegular(f); err != nil {
		f.Close()
		return nil, err
	}
	how := unix.LOCK_SH
	if exclusive {
		how = unix.LOCK_EX
	}
	// Poll with LOCK_NB so that ctx can interrupt a wait for a lock held by
	// another process (a long gc, say): a blocking flock cannot be cancelled.
	wait := 100 * time.Microsecond
	for {
		err = unix.Flock(int(f.Fd()), how|unix.LOCK_NB)
		if err == nil {
			return func() error { return f.Close() }, nil // closing drops the flock
		}
		if err != syscall.EWOULDBLOCK && err != syscall.EINTR {
			f.Close()
			return nil, &os.PathError{Op: "flock", Path: name, Err: err}
		}
		t := time.NewTimer(wait)
		select {
		case <-ctx.Done():
			t.Stop()
			f.Close()
			return nil, fmt.Errorf("vfs: waiting for lock %s: %w", name, context.Cause(ctx))
		case <-t.C:
		}
		wait = min(2*wait, 20*time.Millisecond)
	}
}

func (osFS) Statfs(name string) (FSStat, error) {
	var st unix.Statfs_t
	for {
		err := unix.Statfs(name, &st)
		if err == nil {
			break
		}
		if err != syscall.EINTR {
			return FSStat{}, &os.PathError{Op: "statfs", Path: name, Err: err}
		}
	}
	return fsStat(&st), nil
}

// fsStat converts a statfs(2) result: Linux reports the block counts in
// units of f_frsize (glibc's statvfs uses f_bsize when f_frsize is 0).
func fsStat(st *unix.Statfs_t) FSStat {
	bs := st.Frsize
	if bs <= 0 {
		bs = st.Bsize
	}
	b := int64(bs)
	return FSStat{BlockBytes: b, TotalBytes: int64(st.Blocks) * b, FreeBytes: int64(st.Bfree) * b, AvailBytes: int64(st.Bavail) * b}
}

// IsNotExist reports whether err says a file does not exist.
func IsNotExist(err error) bool { return errors.Is(err, fs.ErrNotExist) }

// DirectOpener is an FS that can open a file for O_DIRECT reads. It is an
// optional interface (use OpenDirect), so other FS implementations need not
// know about it.
type DirectOpener interface {
	// OpenDirect is Open with O_DIRECT: reads bypass the page cache and
	// must use offsets, lengths and memory aligned as DirectAlignment of
	// the open file says. A file system that refuses O_DIRECT fails with
	// an error wrapping syscall.EINVAL.
	OpenDirect(name string) (File, error)
}

// OpenDirect opens name for O_DIRECT reads when fsys implements
// DirectOpener; otherwise it fails with an error wrapping
// errors.ErrUnsupported (callers then read through Open).
func OpenDirect(fsys FS, name string) (File, error) {
	d, ok := fsys.(DirectOpener)
	if !ok {
		return nil, &os.PathError{Op: "open O_DIRECT", Path: name, Err: errors.ErrUnsupported}
	}
	return d.OpenDirect(name)
}

// Alignment is what O_DIRECT needs of a file, from statx(STATX_DIOALIGN):
// Mem is the alignment in bytes of the memory address, Offset that of file
// offsets and lengths. Offset 0 means O_DIRECT is not supported (tmpfs
// reports 0 although it accepts the flag; so does a kernel older than 6.1).
// Device identifies the file system (st_dev), so a choice can be made once
// per file system.
type Alignment struct {
	Mem, Offset uint32
	Device      uint64
}

// Aligner is a File that can report its Alignment. Optional: use
// DirectAlignment.
type Aligner interface {
	DirectAlignment() (Alignment, error)
}

// DirectAlignment reports f's O_DIRECT alignment (statx on the open file,
// not on its directory: ext4 reports it only there). A File that does not
// implement Aligner reports Alignment{} and no error: no O_DIRECT.
func DirectAlignment(f File) (Alignment, error) {
	a, ok := f.(Aligner)
	if !ok {
		return Alignment{}, nil
	}
	return a.DirectAlignment()
}

func (f osFile) DirectAlignment() (Alignment, error) {
	var st unix.Statx_t
	err := f.control(func(fd int) error {
		return unix.Statx(fd, "", unix.AT_EMPTY_PATH, unix.STATX_DIOALIGN, &st)
	})
	if err != nil {
		return Alignment{}, &os.PathError{Op: "statx", Path: f.Name(), Err: err}
	}
	a := Alignment{Device: unix.Mkdev(st.Dev_major, st.Dev_minor)}
	if st.Mask&unix.STATX_DIOALIGN != 0 {
		a.Mem, a.Offset = st.Dio_mem_align, st.Dio_offset_align
	}
	return a, nil
}

func (osFS) OpenDirect(name string) (File, error) { return openRead(name, syscall.O_DIRECT) }

// VectorReader is a File that can read one byte range of the file into
// several buffers with one call (preadv(2)). Optional: use ReadvAt.
type VectorReader interface {
	// ReadvAt fills bufs, in order, from the bytes at off: like ReadAt of
	// their concatenation, it returns n < the total only with an error
	// (io.EOF at the end of the file).
	ReadvAt(bufs [][]byte, off int64) (n int, err error)
}

// ReadvAt fills bufs, in order, with f's bytes from offset off (their
// concatenation is read as by ReadAt): with one preadv(2) per 1,024
// buffers when f is a VectorReader, else one ReadAt per buffer. n < the
// total comes with an error (io.EOF at the end of the file).
func ReadvAt(f File, bufs [][]byte, off int64) (n int, err error) {
	if v, ok := f.(VectorReader); ok {
		return v.ReadvAt(bufs, off)
	}
	for _, b := range bufs {
		k, err := f.ReadAt(b, off+int64(n))
		n += k
		if err != nil {
			return n, err
		}
	}
	return n, nil
}

// maxIovecs is IOV_MAX on Linux: the most buffers one preadv takes.
const maxIovecs = 1024

func (f osFile) ReadvAt(bufs [][]byte, off int64) (int, error) {
	total := 0
	for len(bufs) > 0 {
		batch := bufs[:min(len(bufs), maxIovecs)]
		want := 0
		for _, b := range batch {
			want += len(b)
		}
		var n int
		err := f.control(func(fd int) error {
			for {
				k, err := unix.Preadv(fd, batch, off)
				if err == syscall.EINTR {
					continue
				}
				n = k
				return err
			}
		})
		if err != nil {
			return total, &os.PathError{Op: "preadv", Path: f.Name(), Err: err}
		}
		total += n
		if n < want {
			if n == 0 {
				return total, io.EOF
			}
			// A short read (the end of the file, or a signal): carry on
			// from the first byte not read.
			off += int64(n)
			for n >= len(bufs[0]) {
				n -= len(bufs[0])
				bufs = bufs[1:]
			}
			rest := make([][]byte, len(bufs))
			copy(rest, bufs)
			rest[0] = rest[0][n:]
			bufs = rest
			continue
		}
		off += int64(n)
		bufs = bufs[len(batch):]
	}
	return total, nil
}

// SameFile reports whether a and b are the same file (device and inode).
func SameFile(a, b File) (bool, error) {
	sa, err := a.Stat()
	if err != nil {
		return false, err
	}
	sb, err := b.Stat()
	if err != nil {
		return false, err
	}
	return os.SameFile(sa, sb), nil
}

// DirectClearer is a File opened with O_DIRECT that can switch itself to
// buffered reads (fcntl F_SETFL without O_DIRECT) without a new open.
// Optional: use ClearDirect.
type DirectClearer interface {
	ClearDirect() error
}

// ClearDirect switches f, opened by OpenDirect, to buffered (page cache)
// reads in place; a File that cannot (no DirectClearer) fails with an error
// wrapping errors.ErrUnsupported, and the caller reopens the file instead.
func ClearDirect(f File) error {
	c, ok := f.(DirectClearer)
	if !ok {
		return &os.PathError{Op: "clear O_DIRECT", Path: f.Name(), Err: errors.ErrUnsupported}
	}
	return c.ClearDirect()
}

func (f osFile) ClearDirect() error {
	return f.control(func(fd int) error {
		fl, err := unix.FcntlInt(uintptr(fd), unix.F_GETFL, 0)
		if err != nil {
			return err
		}
		_, err = unix.FcntlInt(uintptr(fd), unix.F_SETFL, fl&^unix.O_DIRECT)
		return err
	})
}

// CacheReporter is a File that can tell whether a byte range of it is in
// the page cache. Optional: use Cached.
type CacheReporter interface {
	// Cached reports whether every page of [off, off+n) (n = 0: to the
	// end of the file) is in the page cache.
	Cached(off, n int64) (bool, error)
}

// Cached reports whether every page of f's byte range [off, off+n) (n = 0:
// to the end of the file) is in the page cache, and whether that is known
// (false when f cannot tell: no CacheReporter, or a kernel before 6.5
// without cachestat(2)). It starts no I/O.
func Cached(f File, off, n int64) (cached, known bool) {
	c, ok := f.(CacheReporter)
	if !ok {
		return false, false
	}
	cached, err := c.Cached(off, n)
	return cached, err == nil
}

func (f osFile) Cached(off, n int64) (bool, error) {
	if n == 0 {
		st, err := f.File.Stat()
		if err != nil {
			return false, err
		}
		n = st.Size() - off
	}
	cached, pages, err := f.CachedPages(off, n)
	return err == nil && cached >= pages, err
}

// CacheCounter is a File that can count the pages of a byte range of it
// in the page cache. Optional: use CachedPages.
type CacheCounter interface {
	// CachedPages returns how many of the pages [off, off+n) touches are
	// in the page cache, and how many it touches (n > 0).
	CachedPages(off, n int64) (cached, pages int64, err error)
}

// CachedPages returns how many pages of f's byte range [off, off+n) (n >
// 0) are in the page cache, how many pages the range touches, and whether
// that is known (false when f cannot tell: no CacheCounter, or a kernel
// before 6.5 without cachestat(2)). It starts no I/O.
func CachedPages(f File, off, n int64) (cached, pages int64, known bool) {
	c, ok := f.(CacheCounter)
	if !ok || n <= 0 {
		return 0, 0, false
	}
	cached, pages, err := c.CachedPages(off, n)
	return cached, pages, err == nil
}

func (f osFile) CachedPages(off, n int64) (cached, pages int64, err error) {
	if n <= 0 {
		return 0, 0, nil
	}
	page := int64(os.Getpagesize())
	pages = (off+n+page-1)/page - off/page
	var st unix.Cachestat_t
	err = f.control(func(fd int) error {
		return unix.Cachestat(uint(fd), &unix.CachestatRange{Off: uint64(off), Len: uint64(n)}, &st, 0)
	})
	if err != nil {
		return 0, pages, &os.PathError{Op: "cachestat", Path: f.Name(), Err: err}
	}
	return min(int64(st.Cache), pages), pages, nil
}

// FileID is one incarnation of a file at a path, from an lstat: device,
// inode number, size in bytes and status-change time (ctime, in
// nanoseconds since the epoch). A file replaced at the path (another
// inode: a rename over it, a remove and a new create), written, truncated,
// renamed, linked, chmodded or chowned gets another FileID, because each of
// these changes the inode or sets its ctime. The exception is an inode
// number freed and reused, for a file of the same size, within one tick of
// the file system's timestamp clock: that needs an unlink, a new file of
// the same size at the same name and its rename, all within one tick and
// before the new writer's own directory fsync, and the prefix cache lives
// with it (a directory fsync per reused page per save would cost more). The zero FileID
// means unknown and equals no file's.
type FileID struct {
	Dev, Ino uint64
	Size     int64
	CtimeNs  int64
}

// IDOf returns the FileID of a regular file's lstat (or stat) result; the
// zero FileID when fi is not a regular file or does not carry a
// *syscall.Stat_t (an FS that is not the operating system's).
func IDOf(fi os.FileInfo) FileID {
	if fi == nil || !fi.Mode().IsRegular() {
		return FileID{}
	}
	st, ok := fi.Sys().(*syscall.Stat_t)
	if !ok || st == nil {
		return FileID{}
	}
	return FileID{Dev: uint64(st.Dev), Ino: st.Ino, Size: st.Size, CtimeNs: st.Ctim.Nano()}
}
