package engine

import (
	"errors"
	"os"
	"path/filepath"
	"syscall"
	"testing"

	"github.com/kvpersist/kvpersist/engine/layout"
	"github.com/kvpersist/kvpersist/engine/vfs"
	"github.com/kvpersist/kvpersist/internal/testutil"
)

// newSyncedEngine opens an engine that fsyncs (unlike newEngine) on root
// through fsys, closed when the test ends.
func newSyncedEngine(t *testing.T, root string, fsys *testutil.FaultFS) *Engine {
	t.Helper()
	e, err := New(Config{Root: root, Workers: 2, FS: fsys, Logger: newEngineLogger()})
	if err != nil {
		t.Fatalf("New: %v", err)
	}
	t.Cleanup(func() { _ = e.Close(bg) })
	return e
}

// dirSyncs runs save and returns how many times it fsynced each directory.
func dirSyncs(t *testing.T, ffs *testutil.FaultFS, dirs []string, save func()) map[string]int {
	t.Helper()
	before := map[string]int{}
	for _, d := range dirs {
		before[d] = ffs.CountPath(testutil.OpSyncDir, d)
	}
	save()
	out := map[string]int{}
	for _, d := range dirs {
		out[d] = ffs.CountPath(testutil.OpSyncDir, d) - before[d]
	}
	return out
}

// replacePage puts a copy of the page file at path under its name as
// another process's save would: a new file (another inode) renamed over it.
func replacePage(t *testing.T, path string) {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	tmp := path + ".other"
	if err := os.WriteFile(tmp, b, 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(tmp, path); err != nil {
		t.Fatal(err)
	}
}

// TestKnownDurablePages: a save that reuses a page this engine made
// durable does not fsync its directory again; a page replaced since (a new
// inode renamed over it, as by another process that may have died before
// its directory fsync) is fsynced again, once, and then known durable; an
// engine that starts on a store knows no page durable until it has
// fsynced its directory once. See ARCHITECTURE.md, "Known-durable pages".
func TestKnownDurablePages(t *testing.T) {
	root := t.TempDir()
	ffs := testutil.NewFaultFS(nil)
	e := newSyncedEngine(t, root, ffs)
	toks := convTokens(0, 5*cP, 1)
	base := mustSavePages(t, e, "p", toks[:4*cP]).Prefix.Keys // 4 new pages
	nsDir := filepath.Join(root, "p")
	pagesDir := testutil.PagesDir(nsDir)
	dirOf := func(k layout.PageKey) string { return filepath.Dir(testutil.PagePath(nsDir, k)) }
	var all []layout.PageKey
	save := func(want [2]int) func() { // want: pages written, reused
		return func() {
			r := mustSavePages(t, e, "p", toks)
			if got := [2]int{r.Prefix.PagesWritten, r.Prefix.PagesReused}; got != want {
				t.Fatalf("save: %d written, %d reused; want %v", got[0], got[1], want)
			}
			all = r.Prefix.Keys
		}
	}
	dirs := []string{pagesDir}
	for _, k := range base {
		dirs = append(dirs, dirOf(k))
	}
	newKeys, _, _ := layout.PageChain("tiny", cP, toks)
	newDir := dirOf(newKeys[4])
	dirs = append(dirs, newDir)

	// 1. Grown by one page: only the new page's directory and pages/.
	got := dirSyncs(t, ffs, dirs, save([2]int{1, 4}))
	if got[pagesDir] != 1 || got[newDir] != 1 {
		t.Fatalf("grown save: pages/ fsynced %d times, the new page's directory %d; want 1 and 1", got[pagesDir], got[newDir])
	}
	for _, k := range base {
		if d := dirOf(k); d != newDir && got[d] != 0 {
			t.Fatalf("grown save fsynced the directory of known-durable page %s %d times", k, got[d])
		}
	}

	// 2. Page 1 replaced behind the engine's back: its directory is
	// fsynced again by the next save that reuses it, and only then.
	replacePage(t, testutil.PagePath(nsDir, all[1]))
	got = dirSyncs(t, ffs, dirs, save([2]int{0, 5}))
	if d := dirOf(all[1]); got[d] != 1 {
		t.Fatalf("the directory of a replaced page was fsynced %d times, want 1", got[d])
	}
	for i, k := range all {
		if d := dirOf(k); i != 1 && d != dirOf(all[1]) && got[d] != 0 {
			t.Fatalf("page %d's directory fsynced %d times after only page 1 was replaced", i, got[d])
		}
	}
	got = dirSyncs(t, ffs, dirs, save([2]int{0, 5}))
	if d := dirOf(all[1]); got[d] != 0 {
		t.Fatalf("the replaced page, fsynced once since, had its directory fsynced %d more times", got[d])
	}

	// 3. A new engine on the store: every reused page's directory is
	// fsynced by its first save, by none after.
	if err := e.Close(bg); err != nil {
		t.Fatal(err)
	}
	e = newSyncedEngine(t, root, ffs)
	got = dirSyncs(t, ffs, dirs, save([2]int{0, 5}))
	for i, k := range all {
		if d := dirOf(k); got[d] < 1 {
			t.Fatalf("after a restart, page %d's directory was not fsynced", i)
		}
	}
	got = dirSyncs(t, ffs, dirs, save([2]int{0, 5}))
	for i, k := range all {
		if d := dirOf(k); got[d] != 0 {
			t.Fatalf("second save after a restart fsynced page %d's directory %d times", i, got[d])
		}
	}
}

// TestPagesDirOfDeadWriterSynced: pages/ made by another process that died
// before it fsynced the namespace directory (the mkdir is not durable) is
// made durable by the next save into it: the namespace directory is
// fsynced before the save is acked. Without that, the acked pages (and the
// marks of "Known-durable pages") sit in a directory a power cut can take
// away. The same for the fetch path, which creates pages/ the same way.
func TestPagesDirOfDeadWriterSynced(t *testing.T) {
	root := t.TempDir()
	nsDir := filepath.Join(root, "p")
	pagesDir := testutil.PagesDir(nsDir)
	if err := os.MkdirAll(pagesDir, 0o755); err != nil { // never fsynced
		t.Fatal(err)
	}
	ffs := testutil.NewFaultFS(nil)
	e := newSyncedEngine(t, root, ffs)
	toks := convTokens(0, 2*cP, 1)
	got := dirSyncs(t, ffs, []string{nsDir}, func() { mustSavePages(t, e, "p", toks) })
	if got[nsDir] < 1 {
		t.Fatalf("a save into a pages/ another process made (not durable) fsynced the namespace directory %d times, want at least 1", got[nsDir])
	}
}

// allDirsSynced fails unless every page's fan-out directory in got was
// fsynced at least once.
func allDirsSynced(t *testing.T, what string, nsDir string, keys []layout.PageKey, got map[string]int) {
	t.Helper()
	for i, k := range keys {
		if d := filepath.Dir(testutil.PagePath(nsDir, k)); got[d] < 1 {
			t.Fatalf("%s: page %d's directory %s was not fsynced", what, i, d)
		}
	}
}

// pageDirs lists pages/ and the fan-out directory of every key.
func pageDirs(nsDir string, keys []layout.PageKey) []string {
	dirs := []string{testutil.PagesDir(nsDir)}
	for _, k := range keys {
		dirs = append(dirs, filepath.Dir(testutil.PagePath(nsDir, k)))
	}
	return dirs
}

// TestKnownDurableFailedSaveMarksNothing: a save whose final fsync fails
// (after every page was renamed in) marks no page, so the next save that
// reuses them fsyncs their directories; a failed early fsync of a reused
// page's directory likewise leaves it unmarked.
func TestKnownDurableFailedSaveMarksNothing(t *testing.T) {
	root := t.TempDir()
	ffs := testutil.NewFaultFS(nil)
	e := newSyncedEngine(t, root, ffs)
	nsDir := filepath.Join(root, "p")
	toks := convTokens(0, 4*cP, 1)
	keys, _, _ := layout.PageChain("tiny", cP, toks)
	ffs.Inject(testutil.Fault{Op: testutil.OpSyncDir, Glob: "pages", Nth: 1})
	if r := savePages(e, "p", toks); r.Err == nil || !errors.Is(r.Err, syscall.EIO) {
		t.Fatalf("save with a failing fsync of pages/: %v, want EIO", r.Err)
	}
	ffs.ClearFaults()
	for i, k := range keys {
		if _, err := os.Lstat(testutil.PagePath(nsDir, k)); err != nil {
			t.Fatalf("page %d not renamed in by the failed save: %v", i, err)
		}
		if id := e.pages.DurableID("p", k); id != (vfs.FileID{}) {
			t.Fatalf("the failed save marked page %d durable: %+v", i, id)
		}
	}
	got := dirSyncs(t, ffs, pageDirs(nsDir, keys), func() {
		if r := mustSavePages(t, e, "p", toks); r.Prefix.PagesReused != len(keys) {
			t.Fatalf("save after the failed one reused %d pages, want %d", r.Prefix.PagesReused, len(keys))
		}
	})
	allDirsSynced(t, "save after a failed one", nsDir, keys, got)

	// Page 0 replaced behind the engine's back, and the early fsync of
	// its directory fails: no mark, so the next save fsyncs it again.
	replacePage(t, testutil.PagePath(nsDir, keys[0]))
	d0 := filepath.Dir(testutil.PagePath(nsDir, keys[0]))
	ffs.Inject(testutil.Fault{Op: testutil.OpSyncDir, Path: d0, Nth: 1})
	if r := savePages(e, "p", toks); r.Err == nil {
		t.Fatal("save with a failing fsync of a replaced page's directory succeeded")
	}
	ffs.ClearFaults()
	if id := e.pages.DurableID("p", keys[0]); id != (vfs.FileID{}) {
		fi, _ := os.Lstat(testutil.PagePath(nsDir, keys[0]))
		if id == vfs.IDOf(fi) {
			t.Fatalf("page 0's replacement is marked durable though its directory's fsync failed")
		}
	}
	got = dirSyncs(t, ffs, []string{d0}, func() { mustSavePages(t, e, "p", toks) })
	if got[d0] < 1 {
		t.Fatal("the replaced page whose directory fsync failed was not fsynced by the next save")
	}
}

// TestKnownDurableRecreatedInPlace: a page removed and written again in
// place (no rename: a new inode, a new ctime) by another process that did
// not fsync is fsynced again by the next save that reuses it; a chmod
// (ctime) likewise.
func TestKnownDurableRecreatedInPlace(t *testing.T) {
	root := t.TempDir()
	ffs := testutil.NewFaultFS(nil)
	e := newSyncedEngine(t, root, ffs)
	nsDir := filepath.Join(root, "p")
	toks := convTokens(0, 3*cP, 1)
	keys := mustSavePages(t, e, "p", toks).Prefix.Keys
	dirs := pageDirs(nsDir, keys)
	got := dirSyncs(t, ffs, dirs, func() { mustSavePages(t, e, "p", toks) })
	for i, k := range keys {
		if d := filepath.Dir(testutil.PagePath(nsDir, k)); got[d] != 0 {
			t.Fatalf("page %d's directory fsynced again though known durable", i)
		}
	}
	p1 := testutil.PagePath(nsDir, keys[1])
	b, err := os.ReadFile(p1)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.Remove(p1); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(p1, b, 0o644); err != nil {
		t.Fatal(err)
	}
	got = dirSyncs(t, ffs, dirs, func() { mustSavePages(t, e, "p", toks) })
	if d := filepath.Dir(p1); got[d] < 1 {
		t.Fatal("a page removed and written again in place was not fsynced by the next save")
	}
	p2 := testutil.PagePath(nsDir, keys[2])
	if err := os.Chmod(p2, 0o600); err != nil {
		t.Fatal(err)
	}
	got = dirSyncs(t, ffs, dirs, func() { mustSavePages(t, e, "p", toks) })
	if d := filepath.Dir(p2); got[d] < 1 {
		t.Fatal("a chmodded page (new ctime) was not fsynced by the next save")
	}
}

// TestKnownDurableNoSyncAndEvict: a store that does not sync marks
// nothing; a page the page cache evicts loses its mark.
func TestKnownDurableNoSyncAndEvict(t *testing.T) {
	ns := newEngine(t, Config{Workers: 1})
	keys := mustSavePages(t, ns, "p", convTokens(0, 2*cP, 1)).Prefix.Keys
	for i, k := range keys {
		if id := ns.pages.DurableID("p", k); id != (vfs.FileID{}) {
			t.Fatalf("NoSync store marked page %d durable", i)
		}
	}

	pb := pageBytes(t)
	root := t.TempDir()
	e, err := New(Config{Root: root, Workers: 1, FS: testutil.NewFaultFS(nil), Logger: newEngineLogger(), CapacityBytes: 4 * pb})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = e.Close(bg) })
	nsDir := filepath.Join(root, "p")
	first := mustSavePages(t, e, "p", convTokens(0, 3*cP, 1)).Prefix.Keys
	for i, k := range first {
		if e.pages.DurableID("p", k) == (vfs.FileID{}) {
			t.Fatalf("synced save did not mark page %d", i)
		}
	}
	mustSavePages(t, e, "p", convTokens(0, 3*cP, 2)) // evicts some of first
	gone := 0
	for i, k := range first {
		if _, err := os.Lstat(testutil.PagePath(nsDir, k)); errors.Is(err, os.ErrNotExist) {
			gone++
			if id := e.pages.DurableID("p", k); id != (vfs.FileID{}) {
				t.Fatalf("evicted page %d still marked durable: %+v", i, id)
			}
		}
	}
	if gone == 0 {
		t.Fatal("nothing evicted: the test proves nothing")
	}
}
