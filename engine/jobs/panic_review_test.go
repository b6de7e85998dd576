package jobs

// Found by a review of the block writer's fsync waiters: panics in a syncer
// or between Stage and the hand-off must fail the job, not the process, and
// leave no temp file. Each test fails when the problem it names is present.

import (
	"context"
	"encoding/binary"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"

	"github.com/kvpersist/kvpersist/engine/gather"
	"github.com/kvpersist/kvpersist/engine/layout"
	"github.com/kvpersist/kvpersist/engine/vfs"
	"github.com/kvpersist/kvpersist/internal/testutil"
)

const zzBlock = 4096

func zzSpec(path string, b []byte) *WriteSpec {
	return &WriteSpec{Path: path, Layout: layout.Blocks, BlockBytes: zzBlock,
		Caches: []EntrySpec{{Tensors: []TensorSpec{{DType: "uint8",
			View: gather.View{Base: b, Shape: []int{len(b)}, Strides: []int{1}, ItemSize: 1}}}}}}
}

// zzMany returns n distinct blocks' worth of bytes (covers ~all 256 fan-outs).
func zzMany(n int, seed byte) []byte {
	buf := make([]byte, n*zzBlock)
	for i := 0; i < n; i++ {
		binary.LittleEndian.PutUint64(buf[i*zzBlock:], uint64(i))
		buf[i*zzBlock+8] = seed
	}
	return buf
}

// panicFS panics in Rename of a block temp file (a bug in a vfs.FS, or in
// Commit). It must fail the job with ErrPanic, not kill the process.
type panicFS struct{ vfs.FS }

func (p panicFS) Rename(o, n string) error {
	if strings.Contains(o, string(filepath.Separator)+layout.BlocksDirName+string(filepath.Separator)) {
		panic("zz: rename panicked")
	}
	return p.FS.Rename(o, n)
}

// A panic in a syncer goroutine is recovered: the job fails with ErrPanic.
func TestZZSyncerPanicKillsProcess(t *testing.T) {
	if os.Getenv("ZZ_CHILD") == "1" {
		_, _, err := Write(context.Background(), &Config{FS: panicFS{vfs.Default}}, zzSpec(filepath.Join(os.Getenv("ZZ_ROOT"), "ns", "a"), zzMany(4, 4)))
		if !errors.Is(err, ErrPanic) {
			t.Fatalf("want ErrPanic, got %v", err)
		}
		return
	}
	cmd := exec.Command(os.Args[0], "-test.run=^TestZZSyncerPanicKillsProcess$", "-test.count=1")
	cmd.Env = append(os.Environ(), "ZZ_CHILD=1", "ZZ_ROOT="+t.TempDir())
	out, err := cmd.CombinedOutput()
	if err != nil && strings.Contains(string(out), "panic: zz: rename panicked") {
		t.Fatalf("BUG: a panic in Commit inside a syncer crashed the whole process instead of failing the job with ErrPanic:\n%.600s", out)
	}
	if err != nil {
		t.Fatalf("child: %v\n%s", err, out)
	}
}

// wbPanicFS panics in StartWriteback (between Stage and the hand-off).
type wbPanicFS struct{ vfs.FS }
type wbPanicFile struct{ vfs.File }

func (w wbPanicFS) Create(name string, perm os.FileMode) (vfs.File, error) {
	f, err := w.FS.Create(name, perm)
	if err != nil {
		return nil, err
	}
	return wbPanicFile{f}, nil
}
func (wbPanicFile) StartWriteback(off, n int64) error { panic("zz: writeback panicked") }

// A panic between Stage and the hand-off to the syncers leaves no temp file.
func TestZZPanicInPutLeavesTempFile(t *testing.T) {
	root := t.TempDir()
	_, _, err := Write(context.Background(), &Config{FS: wbPanicFS{vfs.Default}}, zzSpec(filepath.Join(root, "ns", "a"), zzMany(4, 5)))
	if !errors.Is(err, ErrPanic) {
		t.Fatalf("want ErrPanic, got %v", err)
	}
	var temps []string
	filepath.WalkDir(root, func(p string, d os.DirEntry, _ error) error {
		if d != nil && layout.IsTemp(d.Name()) {
			temps = append(temps, p)
		}
		return nil
	})
	if len(temps) > 0 {
		t.Fatalf("BUG (pre-existing): %d temp files left after a panic in put: %v", len(temps), temps[0])
	}
}

// countSyncFS counts SyncDir calls per directory.
type countSyncFS struct {
	vfs.FS
	mu sync.Mutex
	n  map[string]int
}

func (c *countSyncFS) SyncDir(name string) error {
	c.mu.Lock()
	c.n[name]++
	c.mu.Unlock()
	return c.FS.SyncDir(name)
}

// TestReusedBlocksDirectoriesAreSynced: a save whose blocks all exist still
// fsyncs every fan-out directory holding one of them before its manifest
// (another writer may have renamed a block in without syncing yet).
func TestReusedBlocksDirectoriesAreSynced(t *testing.T) {
	root := t.TempDir()
	buf := zzMany(6, 9)
	if _, _, err := Write(context.Background(), &Config{}, zzSpec(filepath.Join(root, "ns", "a"), buf)); err != nil {
		t.Fatal(err)
	}
	fsys := &countSyncFS{FS: vfs.Default, n: map[string]int{}}
	h, m, err := Write(context.Background(), &Config{FS: fsys}, zzSpec(filepath.Join(root, "ns", "b"), buf))
	if err != nil {
		t.Fatal(err)
	}
	if m.BlocksReused != 6 || m.BlocksWritten != 0 {
		t.Fatalf("second save reused %d, wrote %d blocks; want 6 and 0", m.BlocksReused, m.BlocksWritten)
	}
	for _, b := range h.Slots()[0].Blocks {
		dir := filepath.Dir(testutil.BlockPath(filepath.Join(root, "ns"), b.Hash))
		if fsys.n[dir] != 1 {
			t.Fatalf("fan-out %s of a reused block fsynced %d times before the manifest, want 1", dir, fsys.n[dir])
		}
	}
}
