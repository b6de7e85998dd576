package testutil

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/kvpersist/kvpersist/engine/readio"
	"github.com/kvpersist/kvpersist/engine/vfs"
)

// DirectDir is a directory on a file system that supports O_DIRECT (the
// test's temp directory on the project's ext4); the test is skipped, saying
// so, where there is none.
func DirectDir(t *testing.T) string {
	t.Helper()
	dir := t.TempDir()
	p := filepath.Join(dir, "probe")
	if err := os.WriteFile(p, []byte("x"), 0o640); err != nil {
		t.Fatal(err)
	}
	f, err := vfs.Default.Open(p)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if a, err := vfs.DirectAlignment(f); err != nil || a.Offset == 0 {
		t.Skipf("%s: no O_DIRECT alignment reported (%v): this test needs a file system with O_DIRECT", dir, err)
	}
	return dir
}

// AsyncReads sets up the asynchronous O_DIRECT reads for a test (closed
// at its end), skipping the test where the kernel has no AIO.
func AsyncReads(t *testing.T) *readio.AsyncReads {
	t.Helper()
	probe, err := vfs.NewAsyncReader(1)
	if err != nil {
		t.Skipf("no Linux AIO here: %v", err)
	}
	probe.Close()
	a := readio.NewAsyncReads(nil)
	t.Cleanup(func() {
		if err := a.Close(); err != nil {
			t.Error(err)
		}
	})
	return a
}
