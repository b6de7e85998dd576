package testutil

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"syscall"

	"github.com/kvpersist/kvpersist/engine/vfs"
)

// Op names one operation of vfs.FS or vfs.File that a FaultFS counts and can
// fail. Its string value is also the Op of the *os.PathError an injected
// fault returns ("create", "writeat", ...).
type Op string

// The operations a FaultFS intercepts. OpAny in a Fault matches every one.
const (
	OpAny    Op = ""
	OpCreate Op = "create"
	OpOpen   Op = "open"
	// OpOpenAppend is vfs.FS.OpenAppend; the appended file's Write is
	// OpWriteAt, its Sync OpSync, its Close OpClose.
	OpOpenAppend Op = "openappend"
	// OpOpenDirect is vfs.OpenDirect (an O_DIRECT open); inject
	// syscall.EINVAL to play a file system that refuses O_DIRECT.
	OpOpenDirect Op = "opendirect"
	// OpDirectAlignment is vfs.DirectAlignment (statx STATX_DIOALIGN).
	OpDirectAlignment Op = "directalignment"
	OpWriteAt         Op = "writeat"
	OpReadAt          Op = "readat"
	OpSync            Op = "sync"
	OpAllocate        Op = "allocate"
	// OpStartWriteback is vfs.File.StartWriteback (sync_file_range).
	OpStartWriteback Op = "startwriteback"
	OpClose          Op = "close"
	OpRename         Op = "rename"
	OpRemove         Op = "remove"
	OpMkdirAll       Op = "mkdirall"
	OpReadDir        Op = "readdir"
	OpLstat          Op = "lstat"
	OpStat           Op = "stat"
	OpSyncDir        Op = "syncdir"
	OpLock           Op = "lock"
	OpStatfs         Op = "statfs"
)

// Ops lists every intercepted operation (not OpAny), in a fixed order.
func Ops() []Op {
	return []Op{OpCreate, OpOpen, OpOpenAppend, OpOpenDirect, OpDirectAlignment, OpWriteAt, OpReadAt, OpSync, OpAllocate, OpStartWriteback, OpClose,
		OpRename, OpRemove, OpMkdirAll, OpReadDir, OpLstat, OpStat, OpSyncDir, OpLock, OpStatfs}
}

// Fault describes calls to fail. A call matches when its operation is Op (or
// Op is OpAny) and its path matches Path and Glob (each ignored when empty).
// For file methods (WriteAt, ReadAt, Sync, Allocate, StartWriteback, Close)
// the path is the name the file was created or opened with; a Rename matches
// on either its old or its new path.
type Fault struct {
	Op Op
	// Path, when not empty, must be a substring of the call's path.
	Path string
	// Glob, when not empty, must match (filepath.Match) the whole path or
	// its last element.
	Glob string
	// Nth, when > 0, fails only the Nth (1-based) call matching this Fault,
	// counted from when the Fault was injected; 0 fails every matching call.
	Nth int
	// Persist, with Nth > 0, fails the Nth matching call and every later
	// one (a disk that stays full).
	Persist bool
	// Err is the error number to return; nil means syscall.EIO. It is
	// wrapped in an *os.PathError{Op: string(op), Path: path} (an
	// *os.LinkError for Rename, as os.Rename returns), so errors.Is(err,
	// syscall.ENOSPC) and the like work on whatever wraps it.
	Err error
	// Short, for WriteAt, writes the first half of the buffer to the
	// underlying file and then returns (len/2, error): a short write.
	Short bool
}

// Injection records one fault that fired.
type Injection struct {
	Op   Op
	Path string
	// Call is the call's 1-based index among all calls of Op on this FS
	// since the counts were last reset.
	Call int
	Err  error // the error returned
}

// FaultFS is a vfs.FS that wraps another (usually vfs.Default), counts every
// call per operation, records per-file Sync counts and fails the calls that
// match its injected Faults. It is safe for concurrent use; with concurrent
// callers the order of calls (hence which one is the Nth) is theirs.
//
// An injected failure skips the underlying operation, except a Close, which
// still closes the underlying file (as close(2) releases the descriptor even
// when it reports an error) and a short write, which writes half.
type FaultFS struct {
	inner vfs.FS

	mu       sync.Mutex
	counts   map[Op]int
	byPath   map[Op]map[string]int // calls per operation and (first) path
	faults   []*faultState
	injected []Injection
	files    []*faultFile // every file handle opened, for Sync counts
	// availLimit, when ≥ 0, caps the free bytes Statfs reports (a nearly
	// full disk); -1: the real figures.
	availLimit int64
}

type faultState struct {
	Fault
	seen int // matching calls so far
}

// NewFaultFS wraps inner; nil means vfs.Default.
func NewFaultFS(inner vfs.FS) *FaultFS {
	if inner == nil {
		inner = vfs.Default
	}
	return &FaultFS{inner: inner, counts: map[Op]int{}, byPath: map[Op]map[string]int{}, availLimit: -1}
}

// LimitAvail makes Statfs report at most bytes free (AvailBytes and
// FreeBytes), as on a nearly full disk; a negative value restores the real
// figures. Writes are not limited by it: inject ENOSPC faults for that.
func (f *FaultFS) LimitAvail(bytes int64) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.availLimit = bytes
}

// Inject adds a fault. Faults are checked in the order injected; the first
// one that fires decides the error.
func (f *FaultFS) Inject(fault Fault) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.faults = append(f.faults, &faultState{Fault: fault})
}

// FailNth fails the nth (1-based) call of op with errno.
func (f *FaultFS) FailNth(op Op, n int, errno syscall.Errno) {
	f.Inject(Fault{Op: op, Nth: n, Err: errno})
}

// FailPath fails every call of op (OpAny: of any operation) whose path
// contains substr, with errno.
func (f *FaultFS) FailPath(op Op, substr string, errno syscall.Errno) {
	f.Inject(Fault{Op: op, Path: substr, Err: errno})
}

// ClearFaults removes every fault; counts and records stay.
func (f *FaultFS) ClearFaults() {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.faults = nil
}

// Reset removes every fault, zeroes every count and record and lifts
// LimitAvail.
func (f *FaultFS) Reset() {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.faults, f.injected, f.files = nil, nil, nil
	f.counts, f.byPath = map[Op]int{}, map[Op]map[string]int{}
	f.availLimit = -1
}

// Count returns how many calls of op were made (failed ones included).
func (f *FaultFS) Count(op Op) int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.counts[op]
}

// CountPath returns how many calls of op were made on path (the old path
// of a Rename; failed calls included), e.g. the fsyncs of one directory.
func (f *FaultFS) CountPath(op Op, path string) int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.byPath[op][path]
}

// Counts returns a copy of the per-operation call counts.
func (f *FaultFS) Counts() map[Op]int {
	f.mu.Lock()
	defer f.mu.Unlock()
	out := make(map[Op]int, len(f.counts))
	for k, v := range f.counts {
		out[k] = v
	}
	return out
}

// Injected returns the faults that fired, in order.
func (f *FaultFS) Injected() []Injection {
	f.mu.Lock()
	defer f.mu.Unlock()
	return append([]Injection(nil), f.injected...)
}

// SyncCounts returns, per file name, the largest number of Sync calls made
// on any one handle opened with that name (failed calls included). A value
// above 1 means a Sync was retried on the same file.
func (f *FaultFS) SyncCounts() map[string]int {
	f.mu.Lock()
	defer f.mu.Unlock()
	out := map[string]int{}
	for _, h := range f.files {
		if n := h.syncs; n > 0 && n > out[h.name] {
			out[h.name] = n
		}
	}
	return out
}

// RepeatedSyncs lists (sorted) the names of files that had Sync called
// more than once on the same handle.
func (f *FaultFS) RepeatedSyncs() []string {
	var out []string
	for name, n := range f.SyncCounts() {
		if n > 1 {
			out = append(out, name)
		}
	}
	sort.Strings(out)
	return out
}

func (fl *Fault) matches(op Op, paths ...string) bool {
	if fl.Op != OpAny && fl.Op != op {
		return false
	}
	if fl.Path == "" && fl.Glob == "" {
		return true
	}
	for _, p := range paths {
		if fl.Path != "" && !strings.Contains(p, fl.Path) {
			continue
		}
		if fl.Glob != "" {
			full, _ := filepath.Match(fl.Glob, p)
			base, _ := filepath.Match(fl.Glob, filepath.Base(p))
			if !full && !base {
				continue
			}
		}
		return true
	}
	return false
}

// check counts a call and returns the fault to apply, if any (nil error
// means proceed normally).
func (f *FaultFS) check(op Op, paths ...string) (*Fault, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.counts[op]++
	call := f.counts[op]
	if f.byPath[op] == nil {
		f.byPath[op] = map[string]int{}
	}
	f.byPath[op][paths[0]]++
	var hit *faultState
	for _, s := range f.faults {
		if !s.matches(op, paths...) {
			continue
		}
		s.seen++
		if hit != nil {
			continue // still count this call for the later faults
		}
		if s.Nth == 0 || s.seen == s.Nth || (s.Persist && s.seen > s.Nth) {
			hit = s
		}
	}
	if hit == nil {
		return nil, nil
	}
	errno := hit.Err
	if errno == nil {
		errno = syscall.EIO
	}
	var err error
	if op == OpRename && len(paths) == 2 {
		err = &os.LinkError{Op: string(op), Old: paths[0], New: paths[1], Err: errno}
	} else {
		err = &os.PathError{Op: string(op), Path: paths[0], Err: errno}
	}
	f.injected = append(f.injected, Injection{Op: op, Path: paths[0], Call: call, Err: err})
	return &hit.Fault, err
}

// Create implements vfs.FS.
func (f *FaultFS) Create(name string, perm os.FileMode) (vfs.File, error) {
	if _, err := f.check(OpCreate, name); err != nil {
		return nil, err
	}
	inner, err := f.inner.Create(name, perm)
	if err != nil {
		return nil, err
	}
	return f.track(inner, name), nil
}

// Open implements vfs.FS.
func (f *FaultFS) Open(name string) (vfs.File, error) {
	if _, err := f.check(OpOpen, name); err != nil {
		return nil, err
	}
	inner, err := f.inner.Open(name)
	if err != nil {
		return nil, err
	}
	return f.track(inner, name), nil
}

// OpenAppend implements vfs.FS.
func (f *FaultFS) OpenAppend(name string, perm os.FileMode) (vfs.AppendFile, error) {
	if _, err := f.check(OpOpenAppend, name); err != nil {
		return nil, err
	}
	inner, err := f.inner.OpenAppend(name, perm)
	if err != nil {
		return nil, err
	}
	return &faultAppendFile{fs: f, inner: inner}, nil
}

// faultAppendFile is an appended file of a FaultFS: its writes count and
// fail as OpWriteAt (a Short fault writes the first half), its syncs as
// OpSync, its close as OpClose.
type faultAppendFile struct {
	fs    *FaultFS
	inner vfs.AppendFile
}

func (h *faultAppendFile) Write(p []byte) (int, error) {
	fl, err := h.fs.check(OpWriteAt, h.inner.Name())
	if err == nil {
		return h.inner.Write(p)
	}
	if !fl.Short {
		return 0, err
	}
	n, werr := h.inner.Write(p[:len(p)/2])
	if werr != nil {
		return n, errors.Join(err, werr)
	}
	return n, err
}

func (h *faultAppendFile) Sync() error {
	if _, err := h.fs.check(OpSync, h.inner.Name()); err != nil {
		return err
	}
	return h.inner.Sync()
}

func (h *faultAppendFile) Stat() (os.FileInfo, error) { return h.inner.Stat() }
func (h *faultAppendFile) Name() string               { return h.inner.Name() }

func (h *faultAppendFile) Close() error {
	if _, err := h.fs.check(OpClose, h.inner.Name()); err != nil {
		h.inner.Close()
		return err
	}
	return h.inner.Close()
}

// OpenDirect implements vfs.DirectOpener (an inner FS without it fails
// with errors.ErrUnsupported, as vfs.OpenDirect does).
func (f *FaultFS) OpenDirect(name string) (vfs.File, error) {
	if _, err := f.check(OpOpenDirect, name); err != nil {
		return nil, err
	}
	inner, err := vfs.OpenDirect(f.inner, name)
	if err != nil {
		return nil, err
	}
	return f.track(inner, name), nil
}

func (f *FaultFS) track(inner vfs.File, name string) *faultFile {
	h := &faultFile{fs: f, inner: inner, name: name}
	f.mu.Lock()
	f.files = append(f.files, h)
	f.mu.Unlock()
	return h
}

// Rename implements vfs.FS.
func (f *FaultFS) Rename(oldname, newname string) error {
	if _, err := f.check(OpRename, oldname, newname); err != nil {
		return err
	}
	return f.inner.Rename(oldname, newname)
}

// Remove implements vfs.FS.
func (f *FaultFS) Remove(name string) error {
	if _, err := f.check(OpRemove, name); err != nil {
		return err
	}
	return f.inner.Remove(name)
}

// MkdirAll implements vfs.FS.
func (f *FaultFS) MkdirAll(name string, perm os.FileMode) error {
	if _, err := f.check(OpMkdirAll, name); err != nil {
		return err
	}
	return f.inner.MkdirAll(name, perm)
}

// ReadDir implements vfs.FS.
func (f *FaultFS) ReadDir(name string) ([]os.DirEntry, error) {
	if _, err := f.check(OpReadDir, name); err != nil {
		return nil, err
	}
	return f.inner.ReadDir(name)
}

// Lstat implements vfs.FS.
func (f *FaultFS) Lstat(name string) (os.FileInfo, error) {
	if _, err := f.check(OpLstat, name); err != nil {
		return nil, err
	}
	return f.inner.Lstat(name)
}

// Stat implements vfs.FS.
func (f *FaultFS) Stat(name string) (os.FileInfo, error) {
	if _, err := f.check(OpStat, name); err != nil {
		return nil, err
	}
	return f.inner.Stat(name)
}

// SyncDir implements vfs.FS.
func (f *FaultFS) SyncDir(name string) error {
	if _, err := f.check(OpSyncDir, name); err != nil {
		return err
	}
	return f.inner.SyncDir(name)
}

// Lock implements vfs.FS.
func (f *FaultFS) Lock(ctx context.Context, name string, exclusive, create bool) (func() error, error) {
	if _, err := f.check(OpLock, name); err != nil {
		return nil, err
	}
	return f.inner.Lock(ctx, name, exclusive, create)
}

// Statfs implements vfs.FS; LimitAvail caps what it reports.
func (f *FaultFS) Statfs(name string) (vfs.FSStat, error) {
	if _, err := f.check(OpStatfs, name); err != nil {
		return vfs.FSStat{}, err
	}
	st, err := f.inner.Statfs(name)
	if err != nil {
		return st, err
	}
	f.mu.Lock()
	limit := f.availLimit
	f.mu.Unlock()
	if limit >= 0 {
		st.AvailBytes = min(st.AvailBytes, limit)
		st.FreeBytes = min(st.FreeBytes, limit)
	}
	return st, nil
}

// faultFile is a file handle of a FaultFS.
type faultFile struct {
	fs    *FaultFS
	inner vfs.File
	name  string
	syncs int // guarded by fs.mu
}

func (h *faultFile) ReadAt(p []byte, off int64) (int, error) {
	if _, err := h.fs.check(OpReadAt, h.name); err != nil {
		return 0, err
	}
	return h.inner.ReadAt(p, off)
}

func (h *faultFile) WriteAt(p []byte, off int64) (int, error) {
	fl, err := h.fs.check(OpWriteAt, h.name)
	if err == nil {
		return h.inner.WriteAt(p, off)
	}
	if !fl.Short {
		return 0, err
	}
	n, werr := h.inner.WriteAt(p[:len(p)/2], off)
	if werr != nil {
		return n, errors.Join(err, werr)
	}
	return n, err
}

func (h *faultFile) Sync() error {
	h.fs.mu.Lock()
	h.syncs++
	h.fs.mu.Unlock()
	if _, err := h.fs.check(OpSync, h.name); err != nil {
		return err
	}
	return h.inner.Sync()
}

func (h *faultFile) Allocate(size int64) error {
	if _, err := h.fs.check(OpAllocate, h.name); err != nil {
		return err
	}
	return h.inner.Allocate(size)
}

func (h *faultFile) StartWriteback(off, n int64) error {
	if _, err := h.fs.check(OpStartWriteback, h.name); err != nil {
		return err
	}
	return h.inner.StartWriteback(off, n)
}

func (h *faultFile) Stat() (os.FileInfo, error) { return h.inner.Stat() }

// Cached implements vfs.CacheReporter (no fault: it is a hint).
func (h *faultFile) Cached(off, n int64) (bool, error) {
	c, ok := h.inner.(vfs.CacheReporter)
	if !ok {
		return false, errors.ErrUnsupported
	}
	return c.Cached(off, n)
}

// CachedPages implements vfs.CacheCounter (no fault: it is a hint).
func (h *faultFile) CachedPages(off, n int64) (cached, pages int64, err error) {
	c, ok := h.inner.(vfs.CacheCounter)
	if !ok {
		return 0, 0, errors.ErrUnsupported
	}
	return c.CachedPages(off, n)
}

// ClearDirect implements vfs.DirectClearer (no fault: a failure only
// makes the caller reopen the file).
func (h *faultFile) ClearDirect() error { return vfs.ClearDirect(h.inner) }

// DirectAlignment implements vfs.Aligner.
func (h *faultFile) DirectAlignment() (vfs.Alignment, error) {
	if _, err := h.fs.check(OpDirectAlignment, h.name); err != nil {
		return vfs.Alignment{}, err
	}
	return vfs.DirectAlignment(h.inner)
}

func (h *faultFile) Name() string { return h.name }

func (h *faultFile) Close() error {
	_, err := h.fs.check(OpClose, h.name)
	cerr := h.inner.Close() // always release the descriptor
	if err != nil {
		return err
	}
	return cerr
}

// String describes an injection for test messages.
func (i Injection) String() string {
	return fmt.Sprintf("%s call %d on %s: %v", i.Op, i.Call, i.Path, i.Err)
}
