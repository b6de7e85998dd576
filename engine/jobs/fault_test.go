package jobs_test

// Fault injection: every file-system call a job makes is failed in turn
// (ENOSPC, EIO, EDQUOT, short writes) through testutil.FaultFS, and after
// each failure the store must be as safe as before: the error names the
// operation and path, no temp file is left, the previous snapshot still
// reads back and verifies, no block a published manifest names is missing,
// no file was fsynced twice, and the next job succeeds.

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io/fs"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/kvpersist/kvpersist/engine/gather"
	"github.com/kvpersist/kvpersist/engine/jobs"
	"github.com/kvpersist/kvpersist/engine/layout"
	"github.com/kvpersist/kvpersist/engine/vfs"
	"github.com/kvpersist/kvpersist/internal/kvgen"
	"github.com/kvpersist/kvpersist/internal/testutil"
)

// fxSpec is the write request of cache c as kvpersist's callers build it
// (see cmd/kvpersist cacheRequest): one entry per layer with K and V, one
// "tokens" attachment, model metadata.
func fxSpec(c *kvgen.Cache, path string, lay layout.Layout, blockBytes int) *wreq {
	views, dtypes := c.Views(), c.DTypes()
	tokens := []byte(strconv.Itoa(c.Tokens))
	spec := &wreq{path, &jobs.WriteRequest{Layout: lay, BlockBytes: blockBytes,
		Meta: layout.Meta{"model": []byte(strconv.Quote(c.Model.Name)), "tokens": tokens}}}
	for l := 0; l < c.Model.Layers; l++ {
		spec.Caches = append(spec.Caches, jobs.EntrySpec{
			Meta: layout.Meta{"type": []byte(`"KVCache"`), "offset": tokens},
			Tensors: []jobs.TensorSpec{
				{DType: dtypes[2*l], View: views[2*l]},
				{DType: dtypes[2*l+1], View: views[2*l+1]},
			},
		})
	}
	n := len(views) - 1
	spec.Attachments = []jobs.EntrySpec{{Meta: layout.Meta{"name": []byte(`"tokens"`)},
		Tensors: []jobs.TensorSpec{{DType: dtypes[n], View: views[n]}}}}
	return spec
}

// fxExpected is every slot's Expected bytes.
func fxExpected(c *kvgen.Cache) [][]byte {
	out := make([][]byte, c.Slots())
	for i := range out {
		out[i] = c.Expected(i)
	}
	return out
}

// fxWrite writes c at path with the real FS and no fsync.
func fxWrite(t testing.TB, c *kvgen.Cache, path string, lay layout.Layout) *layout.Header {
	t.Helper()
	h, _, err := writeAt(context.Background(), &jobs.Config{NoSync: true}, fxSpec(c, path, lay, 4<<10))
	if err != nil {
		t.Fatalf("write %s: %v", path, err)
	}
	return h
}

const guardLen = 64

// guarded is a destination buffer that sits inside a larger guard buffer
// filled with a pattern: Dest is buf[guardLen:guardLen+n] (its capacity
// reaches into the trailing guard, so a write past len(Dest) would land
// there).
type guarded struct {
	buf []byte
	n   int
}

func guardPattern(i int) byte { return byte(0xA5 ^ i*7) }

func newGuarded(n int) guarded {
	g := guarded{buf: make([]byte, n+2*guardLen), n: n}
	for i := range g.buf {
		g.buf[i] = guardPattern(i)
	}
	return g
}

func (g guarded) Dest() []byte { return g.buf[guardLen : guardLen+g.n] }

// intact reports the first guard byte that changed, or -1.
func (g guarded) intact() int {
	for i := range g.buf {
		if (i < guardLen || i >= guardLen+g.n) && g.buf[i] != guardPattern(i) {
			return i
		}
	}
	return -1
}

// untouched reports whether the destination itself still holds the pattern.
func (g guarded) untouched() bool {
	for i := guardLen; i < guardLen+g.n; i++ {
		if g.buf[i] != guardPattern(i) {
			return false
		}
	}
	return true
}

func guardedDests(sizes []int) ([]guarded, [][]byte) {
	gs := make([]guarded, len(sizes))
	dest := make([][]byte, len(sizes))
	for i, n := range sizes {
		gs[i] = newGuarded(n)
		dest[i] = gs[i].Dest()
	}
	return gs, dest
}

func checkGuards(t testing.TB, gs []guarded) {
	t.Helper()
	for i, g := range gs {
		if k := g.intact(); k >= 0 {
			t.Fatalf("destination %d (%d bytes): guard byte %d was overwritten", i, g.n, k)
		}
	}
}

// fxReadVerify reads path with verification into guarded buffers sized as
// want and fails unless it reads back exactly want.
func fxReadVerify(t testing.TB, path string, want [][]byte) {
	t.Helper()
	sizes := make([]int, len(want))
	for i := range want {
		sizes[i] = len(want[i])
	}
	gs, dest := guardedDests(sizes)
	if _, _, err := readAt(context.Background(), &jobs.Config{NoSync: true}, path, &jobs.ReadRequest{Dest: dest}); err != nil {
		t.Fatalf("read %s: %v", path, err)
	}
	checkGuards(t, gs)
	for i := range want {
		if !bytes.Equal(dest[i], want[i]) {
			t.Fatalf("read %s: slot %d differs from the expected bytes", path, i)
		}
	}
}

// fxCheckReferenced decodes every snapshot file of every namespace under
// root and fails if a block one of them names is missing or has the wrong
// size. It returns the set of referenced block paths.
func fxCheckReferenced(t testing.TB, root string) map[string]bool {
	t.Helper()
	refs := map[string]bool{}
	nss, err := os.ReadDir(root)
	if err != nil {
		t.Fatal(err)
	}
	for _, ns := range nss {
		if !ns.IsDir() {
			continue
		}
		nsDir := filepath.Join(root, ns.Name())
		ents, err := os.ReadDir(nsDir)
		if err != nil {
			t.Fatal(err)
		}
		for _, e := range ents {
			if !e.Type().IsRegular() || layout.ValidName("snapshot", e.Name()) != nil {
				continue
			}
			snap, err := layout.Load(vfs.Default, filepath.Join(nsDir, e.Name()))
			if err != nil {
				t.Fatalf("published snapshot %s does not decode: %v", e.Name(), err)
			}
			for _, tn := range snap.Header.Slots() {
				for _, ref := range tn.Blocks {
					p := testutil.BlockPath(nsDir, ref.Hash)
					st, err := os.Lstat(p)
					if err != nil || !st.Mode().IsRegular() || st.Size() != ref.Bytes {
						t.Fatalf("%s names block %s (%d bytes): %v", e.Name(), p, ref.Bytes, err)
					}
					refs[p] = true
				}
			}
		}
	}
	return refs
}

// fxBlockFiles lists every block file (by path) under root.
func fxBlockFiles(t testing.TB, root string) map[string]bool {
	t.Helper()
	out := map[string]bool{}
	err := filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.Type().IsRegular() && layout.ValidBlockHash(d.Name()) {
			out[p] = true
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return out
}

// checkInjectedError fails unless err carries the injected error number
// (errors.Is) and names the failed call's path.
func checkInjectedError(t testing.TB, err error, inj testutil.Injection) {
	t.Helper()
	if err == nil {
		t.Fatalf("injected %v, the job succeeded", inj)
	}
	var errno syscall.Errno
	if !errors.As(inj.Err, &errno) {
		t.Fatalf("injection without an errno: %v", inj.Err)
	}
	if !errors.Is(err, errno) {
		t.Fatalf("injected %v, the job's error does not wrap %v: %v", inj, errno, err)
	}
	if !strings.Contains(err.Error(), inj.Path) && !strings.Contains(err.Error(), string(inj.Op)) {
		t.Fatalf("injected %v, the error names neither the path nor the operation: %v", inj, err)
	}
}

// faultPoint is one injection: the Nth call of Op, failed with Err (a short
// write for WriteAt when Short).
type faultPoint struct {
	Op    testutil.Op
	N     int
	Err   syscall.Errno
	Short bool
}

func (p faultPoint) String() string {
	names := map[syscall.Errno]string{syscall.ENOSPC: "ENOSPC", syscall.EIO: "EIO", syscall.EDQUOT: "EDQUOT"}
	s := fmt.Sprintf("%s-%d-%s", p.Op, p.N, names[p.Err])
	if p.Short {
		s += "-short"
	}
	return s
}

// faultPoints enumerates every call counted in a clean run: each with one of
// ENOSPC, EIO, EDQUOT in turn; each WriteAt also as a short write.
func faultPoints(counts map[testutil.Op]int) []faultPoint {
	errnos := []syscall.Errno{syscall.ENOSPC, syscall.EIO, syscall.EDQUOT}
	var out []faultPoint
	k := 0
	for _, op := range testutil.Ops() {
		for n := 1; n <= counts[op]; n++ {
			out = append(out, faultPoint{Op: op, N: n, Err: errnos[k%len(errnos)]})
			k++
			if op == testutil.OpWriteAt {
				out = append(out, faultPoint{Op: op, N: n, Err: syscall.ENOSPC, Short: true})
			}
		}
	}
	return out
}

// faultKind is one job whose injection points are enumerated.
type faultKind struct {
	name string
	// setup builds the store the job starts from (real FS, no fsync).
	setup func(t *testing.T, root string)
	// job runs the job under test with cfg (fsync on, one goroutine).
	job func(cfg *jobs.Config, root string) (jobs.Metrics, error)
	// check asserts the outcome of one injection beyond the common checks.
	check func(t *testing.T, root string, inj testutil.Injection, m jobs.Metrics, err error)
	// nextLayout is the layout of the clean write that follows each fault.
	nextLayout layout.Layout
	// plantedTemps: the setup leaves temp files the job may not get to
	// remove (collect); then the temp check runs after a clean collect.
	plantedTemps bool
}

// faultRoot is a fresh store root for one enumeration run. The enumeration
// keeps fsync on (Sync and SyncDir are injection points), so on ext4 each
// run pays for some 40 real fsyncs: the whole enumeration took 25 s there
// against 3.5 s on tmpfs, where fsync returns at once but every call still
// goes through the FaultFS. So it runs on tmpfs (/dev/shm) when there is
// one, and on the test's temp directory (a real disk) otherwise or with
// KVPERSIST_SOAK=long.
func faultRoot(t testing.TB) string {
	t.Helper()
	if os.Getenv("KVPERSIST_SOAK") != "long" {
		if st, err := os.Stat("/dev/shm"); err == nil && st.IsDir() {
			if dir, err := os.MkdirTemp("/dev/shm", "kvpersist-fault-"); err == nil {
				t.Cleanup(func() { os.RemoveAll(dir) })
				return dir
			}
		}
	}
	return t.TempDir()
}

func TestFaultInjection(t *testing.T) {
	prev := kvgen.NewCache(kvgen.Tiny, 256, true, nil) // the snapshot already stored
	next := kvgen.NewCache(kvgen.Tiny, 300, true, nil) // the one being written
	old := kvgen.NewCache(kvgen.Tiny, 100, true, nil)  // a deleted snapshot's blocks
	wantPrev, wantNext := fxExpected(prev), fxExpected(next)
	ctx := context.Background()
	snapPath := func(root string) string { return filepath.Join(root, "ns", "snap") }

	// A write fails cleanly: the old snapshot stays, except when only the
	// final directory fsync failed: layout.Publish documents that the new
	// file is then in place (renamed) but may not survive a power cut.
	writeCheck := func(t *testing.T, root string, inj testutil.Injection, _ jobs.Metrics, err error) {
		checkInjectedError(t, err, inj)
		nsDir := filepath.Join(root, "ns")
		if inj.Op == testutil.OpSyncDir && inj.Path == nsDir {
			fxReadVerify(t, snapPath(root), wantNext)
		} else {
			fxReadVerify(t, snapPath(root), wantPrev)
		}
	}
	writeKind := func(lay layout.Layout) faultKind {
		return faultKind{
			name:       "write-" + lay.String(),
			nextLayout: lay,
			setup: func(t *testing.T, root string) {
				fxWrite(t, prev, snapPath(root), lay)
			},
			job: func(cfg *jobs.Config, root string) (jobs.Metrics, error) {
				_, m, err := writeAt(ctx, cfg, fxSpec(next, snapPath(root), lay, 4<<10))
				return m, err
			},
			check: writeCheck,
		}
	}

	collectReq := func() *jobs.CollectRequest {
		return &jobs.CollectRequest{Now: time.Now().Add(time.Hour)} // planted temps are stale
	}
	var cleanDeleted []string
	collectKind := faultKind{
		name:         "collect",
		nextLayout:   layout.Blocks,
		plantedTemps: true,
		setup: func(t *testing.T, root string) {
			nsDir := filepath.Join(root, "ns")
			fxWrite(t, prev, snapPath(root), layout.Blocks)
			fxWrite(t, prev, filepath.Join(nsDir, "single"), layout.Single)
			fxWrite(t, old, filepath.Join(nsDir, "old"), layout.Blocks)
			if err := os.Remove(filepath.Join(nsDir, "old")); err != nil { // its blocks are garbage now
				t.Fatal(err)
			}
			// Stale temp files of a crashed writer: one beside the
			// snapshots, one in a fan-out directory.
			blocks := slices.Sorted(maps.Keys(fxBlockFiles(t, root)))
			tmps := []string{
				filepath.Join(nsDir, ".snap.tmp-0123456789abcdef"),
				filepath.Join(filepath.Dir(blocks[0]), "."+filepath.Base(blocks[0])+".tmp-fedcba9876543210"),
			}
			for _, p := range tmps {
				if err := os.WriteFile(p, []byte("torn"), 0o600); err != nil {
					t.Fatal(err)
				}
			}
		},
		job: func(cfg *jobs.Config, root string) (jobs.Metrics, error) {
			return collectAt(ctx, cfg, root, collectReq())
		},
		check: func(t *testing.T, root string, inj testutil.Injection, m jobs.Metrics, err error) {
			nsDir := filepath.Join(root, "ns")
			snapshotFile := filepath.Dir(inj.Path) == nsDir && layout.ValidName("snapshot", filepath.Base(inj.Path)) == nil
			switch {
			case inj.Op == testutil.OpClose && snapshotFile:
				// Closing a file opened read-only cannot lose data: the
				// error is ignored and the collect completes.
				if err != nil || !slices.Equal(relPaths(root, m.Collect.Deleted), cleanDeleted) {
					t.Fatalf("failed close of %s: err %v, deleted %v, want the clean run's %v", inj.Path, err, m.Collect.Deleted, cleanDeleted)
				}
			case (inj.Op == testutil.OpOpen || inj.Op == testutil.OpReadAt) && snapshotFile:
				// Documented (CollectMetrics.Unreadable): a snapshot that
				// cannot be read is reported and its namespace's blocks are
				// all kept.
				if err != nil {
					t.Fatalf("unreadable %s failed the collect: %v", inj.Path, err)
				}
				cm := m.Collect
				if len(cm.Unreadable) != 1 || !strings.Contains(cm.Unreadable[0], inj.Err.Error()) {
					t.Fatalf("Unreadable %q, want the injected %v", cm.Unreadable, inj)
				}
				if !slices.Equal(cm.UnsweptNamespaces, []string{nsDir}) || cm.BlocksDeleted != 0 {
					t.Fatalf("unswept %v, %d blocks deleted; want %s unswept and none deleted", cm.UnsweptNamespaces, cm.BlocksDeleted, nsDir)
				}
			default:
				checkInjectedError(t, err, inj)
			}
			fxReadVerify(t, snapPath(root), wantPrev)
			fxReadVerify(t, filepath.Join(nsDir, "single"), wantPrev)
		},
	}

	readKind := func(lay layout.Layout) faultKind {
		name := "r-" + lay.String()
		return faultKind{
			name:       "read-" + lay.String(),
			nextLayout: lay,
			setup: func(t *testing.T, root string) {
				fxWrite(t, prev, filepath.Join(root, "ns", name), lay)
			},
			job: func(cfg *jobs.Config, root string) (jobs.Metrics, error) {
				gs, dest := guardedDests(sizesOf(wantPrev))
				_, m, err := readAt(ctx, cfg, filepath.Join(root, "ns", name), &jobs.ReadRequest{Dest: dest})
				for i, g := range gs {
					if k := g.intact(); k >= 0 {
						return m, fmt.Errorf("destination %d: guard byte %d overwritten", i, k)
					}
					if err == nil && !bytes.Equal(dest[i], wantPrev[i]) {
						return m, fmt.Errorf("slot %d read back wrong without an error", i)
					}
				}
				return m, err
			},
			check: func(t *testing.T, root string, inj testutil.Injection, _ jobs.Metrics, err error) {
				switch inj.Op {
				case testutil.OpClose:
					// A read-only file's close error is ignored; the read
					// itself completed (and was compared above).
					if err != nil {
						t.Fatalf("failed close of %s: %v", inj.Path, err)
					}
				case testutil.OpDirectAlignment, testutil.OpOpenDirect:
					// O_DIRECT is an optimisation: when asking for it
					// fails, the read falls back to buffered reads and
					// succeeds (its bytes were compared above).
					if err != nil {
						t.Fatalf("failed %s of %s: the read failed: %v", inj.Op, inj.Path, err)
					}
				default:
					checkInjectedError(t, err, inj)
				}
				fxReadVerify(t, filepath.Join(root, "ns", name), wantPrev)
			},
		}
	}

	kinds := []faultKind{writeKind(layout.Single), writeKind(layout.Blocks), collectKind, readKind(layout.Single), readKind(layout.Blocks)}
	for _, k := range kinds {
		t.Run(k.name, func(t *testing.T) {
			start := time.Now()
			// The clean run: count the injection points.
			clean := testutil.NewFaultFS(nil)
			root := faultRoot(t)
			k.setup(t, root)
			m, err := k.job(&jobs.Config{FS: clean}, root)
			if err != nil {
				t.Fatalf("clean run: %v", err)
			}
			if k.name == "collect" {
				cleanDeleted = relPaths(root, m.Collect.Deleted)
				if m.Collect.BlocksDeleted == 0 || m.Collect.TempRemoved != 2 {
					t.Fatalf("clean collect deleted %d blocks and %d temps; the setup should leave garbage of both kinds", m.Collect.BlocksDeleted, m.Collect.TempRemoved)
				}
			}
			if k.name == "write-blocks" && (m.BlocksReused == 0 || m.BlocksWritten == 0) {
				t.Fatalf("clean block write reused %d and wrote %d blocks: both paths must be covered", m.BlocksReused, m.BlocksWritten)
			}
			points := faultPoints(clean.Counts())
			for _, p := range points {
				t.Run(p.String(), func(t *testing.T) {
					root := faultRoot(t)
					k.setup(t, root)
					ffs := testutil.NewFaultFS(nil)
					ffs.Inject(testutil.Fault{Op: p.Op, Nth: p.N, Err: p.Err, Short: p.Short})
					m, err := k.job(&jobs.Config{FS: ffs}, root)
					inj := ffs.Injected()
					if len(inj) != 1 {
						t.Fatalf("%d injections fired, want exactly 1 (the run is not deterministic?): %v", len(inj), inj)
					}
					if r := ffs.RepeatedSyncs(); len(r) > 0 {
						t.Fatalf("Sync called more than once on %v", r)
					}
					k.check(t, root, inj[0], m, err)
					refs := fxCheckReferenced(t, root)
					if !k.plantedTemps {
						if tmp := testutil.TempFiles(t, root); len(tmp) > 0 {
							t.Fatalf("temp files left after %v: %v", inj[0], tmp)
						}
					}
					// The next jobs succeed: a clean collect (which leaves
					// exactly the referenced blocks and no temp file), then
					// a clean write and its read-back.
					cm, err := collectAt(ctx, &jobs.Config{NoSync: true}, root, collectReq())
					if err != nil {
						t.Fatalf("collect after the fault: %v", err)
					}
					if tmp := testutil.TempFiles(t, root); len(tmp) > 0 {
						t.Fatalf("temp files left after a clean collect: %v", tmp)
					}
					if files := fxBlockFiles(t, root); len(files) != len(refs) {
						t.Fatalf("after a clean collect %d block files, %d referenced (collect %+v)", len(files), len(refs), cm.Collect)
					}
					p := filepath.Join(root, "ns", "after")
					if _, _, err := writeAt(ctx, &jobs.Config{NoSync: true}, fxSpec(next, p, k.nextLayout, 4<<10)); err != nil {
						t.Fatalf("clean write after the fault: %v", err)
					}
					fxReadVerify(t, p, wantNext)
				})
			}
			t.Logf("%s: %d injection points (%d calls in a clean run: %v) in %v", k.name, len(points), total(clean.Counts()), clean.Counts(), time.Since(start).Round(time.Millisecond))
		})
	}
}

// relPaths makes paths relative to root.
func relPaths(root string, paths []string) []string {
	out := make([]string, len(paths))
	for i, p := range paths {
		r, err := filepath.Rel(root, p)
		if err != nil {
			r = p
		}
		out[i] = r
	}
	return out
}

func sizesOf(bs [][]byte) []int {
	out := make([]int, len(bs))
	for i := range bs {
		out[i] = len(bs[i])
	}
	return out
}

func total(m map[testutil.Op]int) int {
	n := 0
	for _, v := range m {
		n += v
	}
	return n
}

// TestFaultSyncThenRemoveFails: an fsync fails and so does the removal of
// the temp file. The error reports both; the temp file is left (it cannot
// be helped) but no snapshot is published, and collect removes the temp
// file once it is stale.
func TestFaultSyncThenRemoveFails(t *testing.T) {
	ctx := context.Background()
	c := kvgen.NewCache(kvgen.Tiny, 40, true, nil)
	for _, lay := range []layout.Layout{layout.Single, layout.Blocks} {
		t.Run(lay.String(), func(t *testing.T) {
			root := t.TempDir()
			path := filepath.Join(root, "ns", "snap")
			ffs := testutil.NewFaultFS(nil)
			ffs.FailNth(testutil.OpSync, 1, syscall.EIO)
			ffs.FailNth(testutil.OpRemove, 1, syscall.EROFS)
			_, _, err := writeAt(ctx, &jobs.Config{FS: ffs}, fxSpec(c, path, lay, 4<<10))
			if !errors.Is(err, syscall.EIO) || !errors.Is(err, syscall.EROFS) || !strings.Contains(err.Error(), "removing temp file") {
				t.Fatalf("error %v, want the fsync's EIO and the removal's EROFS", err)
			}
			if r := ffs.RepeatedSyncs(); len(r) > 0 {
				t.Fatalf("Sync retried on %v", r)
			}
			if _, err := os.Lstat(path); !os.IsNotExist(err) {
				t.Fatalf("snapshot published after a failed fsync: %v", err)
			}
			tmp := testutil.TempFiles(t, root)
			if len(tmp) != 1 {
				t.Fatalf("temp files %v, want the one that could not be removed", tmp)
			}
			m, err := collectAt(ctx, &jobs.Config{}, root, &jobs.CollectRequest{TempGrace: -1})
			if err != nil || !slices.Contains(m.Collect.Deleted, tmp[0]) {
				t.Fatalf("collect: %v, deleted %v, want %s", err, m.Collect.Deleted, tmp[0])
			}
			if tmp := testutil.TempFiles(t, root); len(tmp) != 0 {
				t.Fatalf("temp files left after collect: %v", tmp)
			}
		})
	}
}

// TestFaultConcurrentBlockWrite: with helper goroutines writing blocks in
// parallel, every fsync of a block fails (a disk that went bad). The write
// fails with EIO, waits for its helpers, leaves no temp file, never retries
// an fsync, and publishes nothing.
func TestFaultConcurrentBlockWrite(t *testing.T) {
	ctx := context.Background()
	c := kvgen.NewCache(kvgen.Tiny, 300, true, nil)
	for _, op := range []testutil.Op{testutil.OpSync, testutil.OpWriteAt, testutil.OpRename, testutil.OpCreate} {
		t.Run(string(op), func(t *testing.T) {
			root := t.TempDir()
			path := filepath.Join(root, "ns", "snap")
			ffs := testutil.NewFaultFS(nil)
			ffs.Inject(testutil.Fault{Op: op, Path: "/blocks/", Nth: 3, Persist: true, Err: syscall.EIO})
			cfg := &jobs.Config{FS: ffs, Helpers: 3, Spawn: func(fn func()) bool { go fn(); return true }}
			_, _, err := writeAt(ctx, cfg, fxSpec(c, path, layout.Blocks, 4<<10))
			inj := ffs.Injected()
			if len(inj) == 0 {
				t.Fatal("no fault fired")
			}
			checkInjectedError(t, err, inj[0])
			if r := ffs.RepeatedSyncs(); len(r) > 0 {
				t.Fatalf("Sync retried on %v", r)
			}
			if tmp := testutil.TempFiles(t, root); len(tmp) > 0 {
				t.Fatalf("temp files left: %v", tmp)
			}
			if _, err := os.Lstat(path); !os.IsNotExist(err) {
				t.Fatalf("manifest published: %v", err)
			}
		})
	}
}

// TestWriteSyncsTheRootEvenWhenTheNamespaceExists: every write fsyncs the
// store root once its namespace directory exists, so the namespace's entry
// is durable before a snapshot in it is acked, even when the write that
// created the directory failed to sync the root (or died before it, or is
// another process's that has not synced yet).
func TestWriteSyncsTheRootEvenWhenTheNamespaceExists(t *testing.T) {
	for _, lay := range []layout.Layout{layout.Single, layout.Blocks} {
		t.Run(lay.String(), func(t *testing.T) {
			root := t.TempDir()
			ffs := testutil.NewFaultFS(vfs.Default)
			ffs.Inject(testutil.Fault{Op: testutil.OpSyncDir, Glob: root, Nth: 1, Err: syscall.EIO})
			cfg := &jobs.Config{FS: ffs}
			v := gather.View{Base: make([]byte, 8192), Shape: []int{4096}, Strides: []int{1}, ItemSize: 2}
			spec := func(name string) *wreq {
				return &wreq{filepath.Join(root, "ns", name), &jobs.WriteRequest{Layout: lay, BlockBytes: 4096,
					Caches: []jobs.EntrySpec{{Tensors: []jobs.TensorSpec{{DType: "bfloat16", View: v}}}}}}
			}
			if _, _, err := writeAt(context.Background(), cfg, spec("a")); err == nil {
				t.Fatalf("first write: want the injected fsync failure of the root")
			}
			before := ffs.CountPath(testutil.OpSyncDir, root)
			if _, _, err := writeAt(context.Background(), cfg, spec("b")); err != nil {
				t.Fatalf("second write: %v", err)
			}
			if ffs.CountPath(testutil.OpSyncDir, root) == before {
				t.Fatalf("the second write acked a snapshot in %s/ns without fsyncing %s after the first one's fsync of it failed", root, root)
			}
		})
	}
}
