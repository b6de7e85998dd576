package jobs_test

import (
	"bytes"
	"context"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"github.com/kvpersist/kvpersist/engine/jobs"
	"github.com/kvpersist/kvpersist/engine/layout"
	"github.com/kvpersist/kvpersist/engine/readio"
	"github.com/kvpersist/kvpersist/engine/vfs"
	"github.com/kvpersist/kvpersist/internal/kvgen"
	"github.com/kvpersist/kvpersist/internal/testutil"
)

// restoreBoth writes a tiny cache in both layouts under dir, evicts the
// files from the page cache, and returns the two paths and the expected
// slot bytes.
func restoreBoth(t *testing.T, dir string) (single, blocks string, want [][]byte) {
	t.Helper()
	c := kvgen.NewCache(kvgen.Tiny, 700, true, nil)
	single, blocks = filepath.Join(dir, "ns", "single"), filepath.Join(dir, "ns", "manifest")
	mustWrite(t, noSync(), cacheSpec(t, c, single, layout.Single, 0))
	mustWrite(t, noSync(), cacheSpec(t, c, blocks, layout.Blocks, jobs.MinBlockBytes))
	testutil.EvictTree(t, dir)
	return single, blocks, expectedAll(c)
}

// TestReadFallsBackWhenDirectRefused: a file system that refuses O_DIRECT
// opens with EINVAL (the fault FS) still restores both layouts exactly,
// with no byte counted as direct; the refusal is remembered, so a second
// read does not ask again.
func TestReadFallsBackWhenDirectRefused(t *testing.T) {
	dir := testutil.DirectDir(t)
	single, blocks, want := restoreBoth(t, dir)
	ffs := testutil.NewFaultFS(nil)
	ffs.Inject(testutil.Fault{Op: testutil.OpOpenDirect, Err: syscall.EINVAL})
	cfg := &jobs.Config{FS: ffs, ReadDepth: 4}
	for round := range 2 {
		testutil.EvictTree(t, dir) // cold: O_DIRECT would be worth asking for
		for _, p := range []string{single, blocks} {
			got, _, m, err := readBack(t, cfg, p, true)
			if err != nil {
				t.Fatalf("round %d, %s: %v", round, p, err)
			}
			mustEqualExpected(t, got, want)
			if m.DirectReadBytes != 0 || m.ReadBytes != m.LogicalBytes {
				t.Fatalf("round %d, %s: %d bytes direct, %d read of %d", round, p, m.DirectReadBytes, m.ReadBytes, m.LogicalBytes)
			}
		}
		// The single file's read asks first and is refused; nothing asks
		// again on this file system.
		if n := ffs.Count(testutil.OpOpenDirect); n != 1 {
			t.Fatalf("round %d: %d O_DIRECT opens, want 1", round, n)
		}
	}
	if n := len(ffs.Injected()); n != 1 {
		t.Fatalf("%d refusals injected, want 1", n)
	}
}

// TestReadDirectAndBuffered: on a file system with O_DIRECT both layouts,
// evicted from the page cache, are read with it (every byte direct); with
// NoDirect, none; once cached, none either (the page cache is faster); on
// tmpfs (alignment 0) no O_DIRECT open is even tried. Every file opened is
// closed.
func TestReadDirectAndBuffered(t *testing.T) {
	dirs := map[string]string{"disk": testutil.DirectDir(t)}
	if st, err := os.Stat("/dev/shm"); err == nil && st.IsDir() {
		d, err := os.MkdirTemp("/dev/shm", "kvpersist-direct-")
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { os.RemoveAll(d) })
		dirs["tmpfs"] = d
	}
	for name, dir := range dirs {
		single, blocks, want := restoreBoth(t, dir)
		for _, noDirect := range []bool{false, true} {
			ffs := testutil.NewFaultFS(nil)
			cfg := &jobs.Config{FS: ffs, NoDirect: noDirect}
			for _, p := range []string{single, blocks} {
				got, _, m, err := readBack(t, cfg, p, true)
				if err != nil {
					t.Fatalf("%s: %v", p, err)
				}
				mustEqualExpected(t, got, want)
				direct := name == "disk" && !noDirect
				if wantDirect := map[bool]int64{true: m.LogicalBytes}[direct]; m.DirectReadBytes != wantDirect {
					t.Fatalf("%s, %s, NoDirect=%v: %d bytes direct, want %d", name, filepath.Base(p), noDirect, m.DirectReadBytes, wantDirect)
				}
			}
			if n := ffs.Count(testutil.OpOpenDirect); (n > 0) != (name == "disk" && !noDirect) {
				t.Fatalf("%s, NoDirect=%v: %d O_DIRECT opens", name, noDirect, n)
			}
			if noDirect {
				// The buffered reads left every page cached: a read that
				// may use O_DIRECT now reads them from the page cache
				// (warm): the single file is not opened with O_DIRECT; each
				// block is opened once, with O_DIRECT, found cached and
				// switched to buffered reads (no second, buffered open).
				ffs.Reset()
				for _, p := range []string{single, blocks} {
					got, _, m, err := readBack(t, &jobs.Config{FS: ffs}, p, true)
					if err != nil {
						t.Fatalf("%s: %v", p, err)
					}
					mustEqualExpected(t, got, want)
					if m.DirectReadBytes != 0 {
						t.Fatalf("%s, warm %s: %d bytes read with O_DIRECT, want 0", name, filepath.Base(p), m.DirectReadBytes)
					}
				}
				snap, err := layout.Load(vfs.Default, blocks)
				if err != nil {
					t.Fatal(err)
				}
				set := blockSet(snap.Header)
				if n := ffs.CountPath(testutil.OpOpenDirect, single); n != 0 {
					t.Fatalf("%s, warm: the single file opened %d times with O_DIRECT", name, n)
				}
				wantBlockDirect := map[bool]int{true: 1}[name == "disk"]
				for h := range set {
					p := testutil.BlockPath(filepath.Dir(blocks), h)
					if o, d := ffs.CountPath(testutil.OpOpen, p), ffs.CountPath(testutil.OpOpenDirect, p); o+d != 1 || d != wantBlockDirect {
						t.Fatalf("%s, warm: block %s opened %d times buffered and %d with O_DIRECT, want once (with O_DIRECT: %v)", name, h, o, d, wantBlockDirect == 1)
					}
				}
			}
			if o, c := ffs.Count(testutil.OpOpen)+ffs.Count(testutil.OpOpenDirect), ffs.Count(testutil.OpClose); o != c {
				t.Fatalf("%s: %d files opened, %d closed", name, o, c)
			}
		}
	}
}

// TestReadOpensEachBlockOnce: a cold block restore opens each block file
// once to read it (with O_DIRECT, not buffered first: the file is not in
// the page cache) and checks the others by Lstat, however many blocks the manifest
// names; every descriptor is closed. Before, a manifest of more blocks than
// a read kept open (1,024; the 1 GiB benchmark snapshot names 1,025) had
// every block opened twice in each mode: once to check its size, once
// again to read it.
func TestReadOpensEachBlockOnce(t *testing.T) {
	dir := testutil.DirectDir(t)
	for _, held := range []int{3, 1 << 20} {
		restore := jobs.SetMaxHeldBlocks(held)
		_, blocks, want := restoreBoth(t, dir)
		snap, err := layout.Load(vfs.Default, blocks)
		if err != nil {
			t.Fatal(err)
		}
		set := blockSet(snap.Header)
		if len(set) <= 3 {
			t.Fatalf("only %d distinct blocks: the test needs more than 3", len(set))
		}
		ffs := testutil.NewFaultFS(nil)
		got, _, m, err := readBack(t, &jobs.Config{FS: ffs, ReadDepth: 4}, blocks, true)
		restore()
		if err != nil {
			t.Fatal(err)
		}
		mustEqualExpected(t, got, want)
		if m.DirectReadBytes != m.ReadBytes {
			t.Fatalf("held %d: %d of %d bytes read with O_DIRECT, want all (cold)", held, m.DirectReadBytes, m.ReadBytes)
		}
		nsDir := filepath.Dir(blocks)
		for h := range set {
			p := testutil.BlockPath(nsDir, h)
			if o, d := ffs.CountPath(testutil.OpOpen, p), ffs.CountPath(testutil.OpOpenDirect, p); o != 0 || d != 1 {
				t.Fatalf("held %d: block %s opened %d times buffered and %d with O_DIRECT, want once with O_DIRECT only", held, h, o, d)
			}
		}
		if o, c := ffs.Count(testutil.OpOpen)+ffs.Count(testutil.OpOpenDirect), ffs.Count(testutil.OpClose); o != c {
			t.Fatalf("held %d: %d opens, %d closes", held, o, c)
		}
		os.RemoveAll(filepath.Join(dir, "ns"))
	}
}

// TestReadAsyncBothLayoutsAndPages: snapshots (single file, blocks) and a
// prefix load of page files, cold, through an engine-like Config with
// Async: the bytes restored equal the bytes saved, and every byte read
// went asynchronously (Metrics.AsyncReadBytes).
func TestReadAsyncBothLayoutsAndPages(t *testing.T) {
	dir := testutil.DirectDir(t)
	a := testutil.AsyncReads(t)
	single, blocks, want := restoreBoth(t, dir)
	for _, p := range []string{single, blocks} {
		got, _, m, err := readBack(t, &jobs.Config{Async: a, ReadDepth: 8}, p, true)
		if err != nil {
			t.Fatalf("%s: %v", p, err)
		}
		mustEqualExpected(t, got, want)
		if m.ReadBytes != m.LogicalBytes || m.DirectReadBytes != m.ReadBytes || m.AsyncReadBytes != m.ReadBytes {
			t.Fatalf("%s: %d bytes read of %d, %d direct, %d async; want all of them", filepath.Base(p), m.ReadBytes, m.LogicalBytes, m.DirectReadBytes, m.AsyncReadBytes)
		}
	}
	ns := filepath.Join(dir, "pages-ns")
	c := newConv(seqTokens(700, 3), pTensors, pHeads, pDim, 1024)
	savePrefix(t, noSync(), ns, c, 700, 256)
	testutil.EvictTree(t, ns)
	bufs, dest := c.dests(1024)
	cfg := inRoot(&jobs.Config{Async: a}, ns)
	res, m, err := jobs.LoadPrefix(context.Background(), cfg, &jobs.LoadPrefixRequest{
		Namespace: "pages-ns", Identity: "tiny/bf16", Tokens: c.tokens, Dest: dest, PageTokens: 256,
	}, nil)
	if err != nil || res.Tokens != 700 {
		t.Fatalf("load: %+v, %v", res, err)
	}
	c.checkDest(t, bufs, 1024, 700)
	if m.ReadBytes == 0 || m.DirectReadBytes != m.ReadBytes || m.AsyncReadBytes != m.ReadBytes {
		t.Fatalf("page load: %d bytes read, %d direct, %d async; want all of them", m.ReadBytes, m.DirectReadBytes, m.AsyncReadBytes)
	}
}

// TestReadAsyncSetupFailureFallsBack: when the AIO setup fails (ENOSYS,
// EPERM under seccomp, EAGAIN past aio-max-nr), reads use preads: still
// O_DIRECT, every byte right, none counted asynchronous; the setup is
// tried once and the fallback logged once, however many reads follow.
func TestReadAsyncSetupFailureFallsBack(t *testing.T) {
	dir := testutil.DirectDir(t)
	single, blocks, want := restoreBoth(t, dir)
	for _, e := range []syscall.Errno{syscall.ENOSYS, syscall.EPERM, syscall.EAGAIN} {
		var logBuf bytes.Buffer
		logger := slog.New(slog.NewTextHandler(&logBuf, nil))
		setups := 0
		a := readio.NewAsyncReadsWith(logger, func(int) (*vfs.AsyncReader, error) {
			setups++
			return nil, os.NewSyscallError("io_setup", e)
		})
		for round := range 2 {
			testutil.EvictTree(t, dir)
			for _, p := range []string{single, blocks} {
				got, _, m, err := readBack(t, &jobs.Config{Async: a, Logger: logger}, p, true)
				if err != nil {
					t.Fatalf("%v, round %d, %s: %v", e, round, p, err)
				}
				mustEqualExpected(t, got, want)
				if m.DirectReadBytes != m.LogicalBytes || m.AsyncReadBytes != 0 {
					t.Fatalf("%v, round %d, %s: %d bytes direct, %d async, of %d", e, round, filepath.Base(p), m.DirectReadBytes, m.AsyncReadBytes, m.LogicalBytes)
				}
			}
		}
		if setups != 1 {
			t.Fatalf("%v: setup tried %d times, want once", e, setups)
		}
		if n := strings.Count(logBuf.String(), "asynchronous O_DIRECT reads unavailable"); n != 1 || !strings.Contains(logBuf.String(), e.Error()) {
			t.Fatalf("%v: fallback logged %d times, want once naming the error:\n%s", e, n, logBuf.String())
		}
		if err := a.Close(); err != nil {
			t.Fatal(err)
		}
	}
}
