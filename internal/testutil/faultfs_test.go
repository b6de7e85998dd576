package testutil

import (
	"bytes"
	"context"
	"errors"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"

	"github.com/kvpersist/kvpersist/engine/vfs"
)

// writeFile creates name through fsys and writes b at 0, returning the
// first error.
func writeFile(fsys vfs.FS, name string, b []byte) error {
	f, err := fsys.Create(name, 0o640)
	if err != nil {
		return err
	}
	if _, err := f.WriteAt(b, 0); err != nil {
		f.Close()
		return err
	}
	return f.Close()
}

func TestFaultFSCountsEveryOp(t *testing.T) {
	dir := t.TempDir()
	fs := NewFaultFS(nil)
	a, b := filepath.Join(dir, "a"), filepath.Join(dir, "sub", "b")
	if err := fs.MkdirAll(filepath.Dir(b), 0o750); err != nil {
		t.Fatal(err)
	}
	f, err := fs.Create(a, 0o640)
	if err != nil {
		t.Fatal(err)
	}
	if err := f.Allocate(8); err != nil {
		t.Fatal(err)
	}
	if err := f.StartWriteback(0, 0); err != nil {
		t.Fatal(err)
	}
	for i := 0; i < 3; i++ {
		if _, err := f.WriteAt([]byte("xy"), int64(2*i)); err != nil {
			t.Fatal(err)
		}
	}
	if err := f.Sync(); err != nil {
		t.Fatal(err)
	}
	if err := f.Close(); err != nil {
		t.Fatal(err)
	}
	if err := fs.Rename(a, b); err != nil {
		t.Fatal(err)
	}
	if err := fs.SyncDir(dir); err != nil {
		t.Fatal(err)
	}
	r, err := fs.Open(b)
	if err != nil {
		t.Fatal(err)
	}
	got := make([]byte, 6)
	if n, err := r.ReadAt(got, 0); err != nil || n != 6 || string(got) != "xyxyxy" {
		t.Fatalf("ReadAt: %d %q %v", n, got, err)
	}
	r.Close()
	if _, err := fs.ReadDir(dir); err != nil {
		t.Fatal(err)
	}
	if _, err := fs.Lstat(b); err != nil {
		t.Fatal(err)
	}
	unlock, err := fs.Lock(context.Background(), filepath.Join(dir, ".lock"), true, true)
	if err != nil {
		t.Fatal(err)
	}
	unlock()
	if err := fs.Remove(b); err != nil {
		t.Fatal(err)
	}
	want := map[Op]int{
		OpMkdirAll: 1, OpCreate: 1, OpAllocate: 1, OpStartWriteback: 1, OpWriteAt: 3, OpSync: 1, OpClose: 2,
		OpRename: 1, OpSyncDir: 1, OpOpen: 1, OpReadAt: 1, OpReadDir: 1, OpLstat: 1, OpLock: 1, OpRemove: 1,
	}
	got2 := fs.Counts()
	for _, op := range Ops() {
		if got2[op] != want[op] || fs.Count(op) != want[op] {
			t.Errorf("%s: counted %d (Count %d), want %d", op, got2[op], fs.Count(op), want[op])
		}
	}
	if len(got2) != len(want) {
		t.Errorf("counts %v has ops beyond %v", got2, want)
	}
	if n := len(fs.Injected()); n != 0 {
		t.Fatalf("%d injections without faults", n)
	}
	if sc := fs.SyncCounts(); len(sc) != 1 || sc[a] != 1 {
		t.Fatalf("SyncCounts %v, want {%s: 1}", sc, a)
	}
}

func TestFaultFSFailNth(t *testing.T) {
	for _, errno := range []syscall.Errno{syscall.ENOSPC, syscall.EIO, syscall.EDQUOT} {
		t.Run(errno.Error(), func(t *testing.T) {
			dir := t.TempDir()
			fs := NewFaultFS(nil)
			fs.FailNth(OpCreate, 2, errno)
			var errs []error
			for _, n := range []string{"a", "b", "c"} {
				errs = append(errs, writeFile(fs, filepath.Join(dir, n), []byte(n)))
			}
			if errs[0] != nil || errs[2] != nil {
				t.Fatalf("calls 1 and 3 failed: %v", errs)
			}
			var pe *os.PathError
			if !errors.Is(errs[1], errno) || !errors.As(errs[1], &pe) || pe.Op != "create" || pe.Path != filepath.Join(dir, "b") {
				t.Fatalf("call 2: %#v, want *os.PathError{create, %s, %v}", errs[1], filepath.Join(dir, "b"), errno)
			}
			if _, err := os.Lstat(filepath.Join(dir, "b")); !os.IsNotExist(err) {
				t.Fatalf("the failed create made the file: %v", err)
			}
			inj := fs.Injected()
			if len(inj) != 1 || inj[0].Op != OpCreate || inj[0].Call != 2 || inj[0].Path != filepath.Join(dir, "b") || inj[0].Err != errs[1] {
				t.Fatalf("Injected %v", inj)
			}
			if fs.Count(OpCreate) != 3 {
				t.Fatalf("Count(create) %d, want 3 (failed calls count)", fs.Count(OpCreate))
			}
		})
	}
}

func TestFaultFSPersistAndDefaultErr(t *testing.T) {
	dir := t.TempDir()
	fs := NewFaultFS(nil)
	fs.Inject(Fault{Op: OpMkdirAll, Nth: 2, Persist: true})
	var got []bool
	for _, n := range []string{"a", "b", "c", "d"} {
		err := fs.MkdirAll(filepath.Join(dir, n), 0o750)
		got = append(got, err != nil)
		if err != nil && !errors.Is(err, syscall.EIO) {
			t.Fatalf("default error %v, want EIO", err)
		}
	}
	if !slices.Equal(got, []bool{false, true, true, true}) {
		t.Fatalf("failed calls %v, want 2nd onwards", got)
	}
}

func TestFaultFSPathAndGlob(t *testing.T) {
	dir := t.TempDir()
	fs := NewFaultFS(nil)
	if err := fs.MkdirAll(filepath.Join(dir, "blocks", "ab"), 0o750); err != nil {
		t.Fatal(err)
	}
	fs.FailPath(OpAny, "/blocks/", syscall.ENOSPC)   // any op under blocks/
	fs.Inject(Fault{Op: OpCreate, Glob: ".*.tmp-*"}) // hidden temp files, by base name
	fs.Inject(Fault{Op: OpLstat, Glob: dir + "/x?"}) // by full path
	cases := []struct {
		name  string
		call  func() error
		errno syscall.Errno
	}{
		{"create under blocks", func() error { return writeFile(fs, filepath.Join(dir, "blocks", "ab", "f"), nil) }, syscall.ENOSPC},
		{"lstat under blocks", func() error { _, err := fs.Lstat(filepath.Join(dir, "blocks", "ab")); return err }, syscall.ENOSPC},
		{"temp by glob", func() error { return writeFile(fs, filepath.Join(dir, ".snap.tmp-0123"), nil) }, syscall.EIO},
		{"plain create", func() error { return writeFile(fs, filepath.Join(dir, "snap"), nil) }, 0},
		{"lstat full glob", func() error { _, err := fs.Lstat(filepath.Join(dir, "xy")); return err }, syscall.EIO},
		{"lstat not matching", func() error { _, err := fs.Lstat(filepath.Join(dir, "snap")); return err }, 0},
		{"rename into blocks", func() error {
			return fs.Rename(filepath.Join(dir, "snap"), filepath.Join(dir, "blocks", "snap"))
		}, syscall.ENOSPC},
	}
	for _, c := range cases {
		err := c.call()
		if c.errno == 0 {
			if err != nil {
				t.Errorf("%s: %v, want success", c.name, err)
			}
			continue
		}
		if !errors.Is(err, c.errno) {
			t.Errorf("%s: %v, want %v", c.name, err, c.errno)
		}
	}
	// The rename failed as an *os.LinkError naming both paths, and did not
	// happen.
	inj := fs.Injected()
	last := inj[len(inj)-1]
	var le *os.LinkError
	if last.Op != OpRename || !errors.As(last.Err, &le) || le.Old != filepath.Join(dir, "snap") || le.New != filepath.Join(dir, "blocks", "snap") {
		t.Fatalf("rename injection %v", last)
	}
	if _, err := os.Lstat(filepath.Join(dir, "snap")); err != nil {
		t.Fatalf("failed rename moved the file: %v", err)
	}
	fs.ClearFaults()
	if err := writeFile(fs, filepath.Join(dir, "blocks", "ab", "f"), []byte("ok")); err != nil {
		t.Fatalf("after ClearFaults: %v", err)
	}
}

func TestFaultFSShortWrite(t *testing.T) {
	dir := t.TempDir()
	fs := NewFaultFS(nil)
	fs.Inject(Fault{Op: OpWriteAt, Nth: 2, Short: true, Err: syscall.ENOSPC})
	p := filepath.Join(dir, "f")
	f, err := fs.Create(p, 0o640)
	if err != nil {
		t.Fatal(err)
	}
	if n, err := f.WriteAt([]byte("0123"), 0); n != 4 || err != nil {
		t.Fatalf("first write %d %v", n, err)
	}
	n, err := f.WriteAt([]byte("abcdefg"), 4)
	var pe *os.PathError
	if n != 3 || !errors.Is(err, syscall.ENOSPC) || !errors.As(err, &pe) || pe.Op != "writeat" || pe.Path != p {
		t.Fatalf("short write: n=%d err=%v, want 3 and writeat ENOSPC on %s", n, err, p)
	}
	if err := f.Close(); err != nil {
		t.Fatal(err)
	}
	got, err := os.ReadFile(p)
	if err != nil || string(got) != "0123abc" {
		t.Fatalf("file holds %q (%v), want the first half of the short write only", got, err)
	}
}

func TestFaultFSSyncAndClose(t *testing.T) {
	dir := t.TempDir()
	fs := NewFaultFS(nil)
	fs.FailNth(OpSync, 1, syscall.EIO)
	fs.FailNth(OpClose, 1, syscall.EIO)
	p := filepath.Join(dir, "f")
	f, err := fs.Create(p, 0o640)
	if err != nil {
		t.Fatal(err)
	}
	if err := f.Sync(); !errors.Is(err, syscall.EIO) {
		t.Fatalf("Sync: %v", err)
	}
	if err := f.Sync(); err != nil { // a retry (which kvpersist must never do) is recorded
		t.Fatal(err)
	}
	if got := fs.RepeatedSyncs(); !slices.Equal(got, []string{p}) {
		t.Fatalf("RepeatedSyncs %v, want [%s]", got, p)
	}
	if err := f.Close(); !errors.Is(err, syscall.EIO) {
		t.Fatalf("Close: %v", err)
	}
	// The failed Close still released the descriptor: the inner file is
	// closed, so writing through it fails with os.ErrClosed.
	if _, err := f.(*faultFile).inner.WriteAt([]byte("x"), 0); !errors.Is(err, os.ErrClosed) {
		t.Fatalf("inner file still open after a failed Close: %v", err)
	}
	fs.Reset()
	if len(fs.Counts()) != 0 || len(fs.Injected()) != 0 || len(fs.SyncCounts()) != 0 {
		t.Fatalf("Reset left %v %v %v", fs.Counts(), fs.Injected(), fs.SyncCounts())
	}
}

// TestFaultFSConcurrent: with many goroutines, every call is counted and an
// Nth fault fires exactly once (run with -race).
func TestFaultFSConcurrent(t *testing.T) {
	dir := t.TempDir()
	fs := NewFaultFS(nil)
	fs.FailNth(OpLstat, 50, syscall.EIO)
	const G, N = 8, 25
	var wg sync.WaitGroup
	var mu sync.Mutex
	failures := 0
	for g := 0; g < G; g++ {
		wg.Go(func() {
			for i := 0; i < N; i++ {
				if _, err := fs.Lstat(dir); err != nil {
					mu.Lock()
					failures++
					mu.Unlock()
				}
			}
		})
	}
	wg.Wait()
	if failures != 1 || fs.Count(OpLstat) != G*N {
		t.Fatalf("%d failures, %d calls; want 1 and %d", failures, fs.Count(OpLstat), G*N)
	}
	if inj := fs.Injected(); len(inj) != 1 || inj[0].Call != 50 || !strings.Contains(inj[0].String(), "lstat call 50") {
		t.Fatalf("Injected %v", inj)
	}
}

func TestFaultFSPassesThrough(t *testing.T) {
	dir := t.TempDir()
	fs := NewFaultFS(vfs.Default)
	p := filepath.Join(dir, "f")
	data := bytes.Repeat([]byte("kv"), 1000)
	if err := writeFile(fs, p, data); err != nil {
		t.Fatal(err)
	}
	// Create is exclusive and Open refuses a final symlink, as vfs.Default.
	if _, err := fs.Create(p, 0o640); !errors.Is(err, os.ErrExist) {
		t.Fatalf("second Create: %v", err)
	}
	if err := os.Symlink(p, filepath.Join(dir, "link")); err != nil {
		t.Fatal(err)
	}
	if _, err := fs.Open(filepath.Join(dir, "link")); !errors.Is(err, syscall.ELOOP) {
		t.Fatalf("Open of a symlink: %v", err)
	}
	f, err := fs.Open(p)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil || st.Size() != int64(len(data)) || f.Name() != p {
		t.Fatalf("Stat %v %v, Name %q", st, err, f.Name())
	}
}

// TestFaultFSStatfs: Statfs is counted and can fail like any op, and
// LimitAvail caps the free bytes it reports (a nearly full disk) until
// lifted.
func TestFaultFSStatfs(t *testing.T) {
	dir := t.TempDir()
	fs := NewFaultFS(nil)
	real, err := vfs.Default.Statfs(dir)
	if err != nil {
		t.Fatal(err)
	}
	fs.LimitAvail(12345)
	st, err := fs.Statfs(dir)
	if err != nil {
		t.Fatal(err)
	}
	if st.AvailBytes != min(12345, real.AvailBytes) || st.FreeBytes != min(12345, real.FreeBytes) || st.TotalBytes != real.TotalBytes {
		t.Fatalf("limited Statfs %+v (real %+v)", st, real)
	}
	fs.LimitAvail(-1)
	// Free space moves under other writers: with more than 1 MiB free the
	// lifted limit shows as more than 12,345 bytes.
	if st, err := fs.Statfs(dir); err != nil || st.TotalBytes != real.TotalBytes || (real.AvailBytes > 1<<20 && st.AvailBytes <= 12345) {
		t.Fatalf("unlimited Statfs %+v %v (real %+v)", st, err, real)
	}
	fs.FailNth(OpStatfs, 1, syscall.EIO)
	if _, err := fs.Statfs(dir); !errors.Is(err, syscall.EIO) {
		t.Fatalf("injected statfs failure: %v", err)
	}
	if n := fs.Count(OpStatfs); n != 3 {
		t.Fatalf("counted %d statfs calls, want 3", n)
	}
}
