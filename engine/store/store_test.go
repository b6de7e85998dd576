package store_test

import (
	"context"
	"errors"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/kvpersist/kvpersist/engine/layout"
	"github.com/kvpersist/kvpersist/engine/store"
	"github.com/kvpersist/kvpersist/internal/testutil"
)

func TestPaths(t *testing.T) {
	st := store.At("/r", store.Options{})
	ns, err := st.Namespace("ns")
	if err != nil {
		t.Fatal(err)
	}
	h := strings.Repeat("ab", 32)
	k, err := layout.ParsePageKey(h)
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct{ got, want string }{
		{ns.Dir(), "/r/ns"},
		{ns.LockPath(), "/r/ns/.lock"},
		{ns.BlocksDir(), "/r/ns/blocks"},
		{ns.PagesDir(), "/r/ns/pages"},
		{ns.BlockPath(h, false), "/r/ns/blocks/ab/" + h},
		{ns.BlockPath(h, true), "/r/ns/blocks/" + h},
		{ns.PagePath(k), "/r/ns/pages/ab/" + h},
	} {
		if c.got != c.want {
			t.Errorf("got %q, want %q", c.got, c.want)
		}
	}
	if p, err := ns.Path("s"); err != nil || p != "/r/ns/s" {
		t.Errorf("Path = %q, %v", p, err)
	}
	for _, bad := range []string{"..", "a/b", "blocks", "pages", ".lock", ""} {
		if _, err := st.Namespace(bad); !errors.Is(err, layout.ErrBadName) {
			t.Errorf("Namespace(%q): %v, want ErrBadName", bad, err)
		}
		if _, err := ns.Path(bad); !errors.Is(err, layout.ErrBadName) {
			t.Errorf("Path(%q): %v, want ErrBadName", bad, err)
		}
	}
	got, name := store.NamespaceOf("/r/ns/snap", store.Options{})
	if got.Dir() != "/r/ns" || got.Name() != "ns" || name != "snap" || got.Store().Root() != "/r" {
		t.Errorf("NamespaceOf = %q %q %q root %q", got.Dir(), got.Name(), name, got.Store().Root())
	}
}

// TestListClassifiesEveryEntry: each kind of entry lands in its place;
// an empty file, a file without a magic, a symlink, a misplaced block and
// an unknown directory are skipped with a reason, never taken for data.
func TestListClassifiesEveryEntry(t *testing.T) {
	root := t.TempDir()
	nsDir := filepath.Join(root, "ns")
	h1, h2, k := strings.Repeat("a1", 32), strings.Repeat("b2", 32), strings.Repeat("c3", 32)
	snap := testutil.WriteFile(t, filepath.Join(nsDir, "snap"), layout.Magic+"rest-of-a-torn-file-of-ours")
	legacy := testutil.WriteFile(t, filepath.Join(nsDir, "old.mlxkv"), layout.LegacyMagic+"x")
	short := testutil.WriteFile(t, filepath.Join(nsDir, "torn"), "KVP") // a prefix of the magic: ours, torn
	empty := testutil.WriteFile(t, filepath.Join(nsDir, "empty"), "")
	junk := testutil.WriteFile(t, filepath.Join(nsDir, "notes.txt"), "hello")
	testutil.WriteFile(t, filepath.Join(nsDir, ".lock"), "")
	testutil.WriteFile(t, filepath.Join(nsDir, layout.RecencyName), "KVPLRU1\n not a snapshot")
	tmp := testutil.WriteFile(t, layout.TempPath(filepath.Join(nsDir, "w")), "partial")
	b1 := testutil.WriteFile(t, filepath.Join(nsDir, "blocks", h1[:2], h1), "block one")
	flat := testutil.WriteFile(t, filepath.Join(nsDir, "blocks", h2), "flat block")
	misplaced := testutil.WriteFile(t, filepath.Join(nsDir, "blocks", "ff", h1), "wrong fan-out")
	btmp := testutil.WriteFile(t, layout.TempPath(filepath.Join(nsDir, "blocks", h2[:2], h2)), "x")
	page := testutil.WriteFile(t, filepath.Join(nsDir, "pages", k[:2], k), "page")
	ptmp := testutil.WriteFile(t, layout.TempPath(filepath.Join(nsDir, "pages", k[:2], k)), "p")
	flatPage := testutil.WriteFile(t, filepath.Join(nsDir, "pages", k), "pages are never flat")
	sub := filepath.Join(nsDir, "sub")
	if err := os.Mkdir(sub, 0o750); err != nil {
		t.Fatal(err)
	}
	link := filepath.Join(nsDir, "link")
	if err := os.Symlink("snap", link); err != nil {
		t.Fatal(err)
	}
	l, err := store.NamespaceAt(nsDir, store.Options{}).List(true)
	if err != nil {
		t.Fatal(err)
	}
	if !l.HasLock || !l.HasBlocksDir || !l.HasPagesDir || !l.HasRecency {
		t.Errorf("lock %v blocks %v pages %v recency %v", l.HasLock, l.HasBlocksDir, l.HasPagesDir, l.HasRecency)
	}
	var snaps []string
	for _, s := range l.Snapshots {
		snaps = append(snaps, s.Path)
		if s.Snap != nil || s.Err == nil || !layout.IsDecodeError(s.Err) {
			t.Errorf("%s: decoded %v, err %v; want a decoding error", s.Path, s.Snap, s.Err)
		}
	}
	if want := []string{legacy, snap, short}; !slices.Equal(snaps, want) {
		t.Errorf("snapshots %q, want %q", snaps, want)
	}
	if len(l.Blocks) != 2 || l.Blocks[0].Path != b1 || l.Blocks[0].Flat || l.Blocks[0].Size != 9 ||
		l.Blocks[1].Path != flat || !l.Blocks[1].Flat || l.Blocks[1].Hash != h2 {
		t.Errorf("blocks %+v", l.Blocks)
	}
	if len(l.Pages) != 1 || l.Pages[0].Path != page || l.Pages[0].Key != k {
		t.Errorf("pages %+v", l.Pages)
	}
	var temps []string
	for _, x := range l.Temps {
		temps = append(temps, x.Path)
	}
	if want := []string{tmp, btmp, ptmp}; !slices.Equal(sorted(temps), sorted(want)) {
		t.Errorf("temps %q, want %q", temps, want)
	}
	why := map[string]string{}
	for _, s := range l.Skipped {
		why[s.Path] = s.Why
	}
	for p, w := range map[string]string{
		empty: "empty file", junk: "magic", misplaced: "a name kvpersist does not use", flatPage: "a name kvpersist does not use",
		sub: "directory", link: "symlink",
	} {
		if !strings.Contains(why[p], w) {
			t.Errorf("%s: skipped as %q, want %q", p, why[p], w)
		}
	}
	if len(why) != 6 {
		t.Errorf("skipped %v", why)
	}
}

// TestListPagesNamesOnly: ListPages classifies pages/ as List does (pages,
// temp files, the rest skipped: a flat page, another fan-out's key, a
// symlink named like a page, a directory) from directory entries alone,
// and a namespace without pages/ (or with a pages/ that is a symlink) has
// no page.
func TestListPagesNamesOnly(t *testing.T) {
	root := t.TempDir()
	nsDir := filepath.Join(root, "ns")
	k, k2 := strings.Repeat("c3", 32), strings.Repeat("d4", 32)
	page := testutil.WriteFile(t, filepath.Join(nsDir, "pages", k[:2], k), "page")
	ptmp := testutil.WriteFile(t, layout.TempPath(filepath.Join(nsDir, "pages", k[:2], k)), "p")
	flatPage := testutil.WriteFile(t, filepath.Join(nsDir, "pages", k), "pages are never flat")
	wrongFan := testutil.WriteFile(t, filepath.Join(nsDir, "pages", k[:2], k2), "another fan-out's key")
	link := filepath.Join(nsDir, "pages", k[:2], strings.Repeat("c3", 31)+"ee")
	if err := os.Symlink(page, link); err != nil {
		t.Fatal(err)
	}
	dir := filepath.Join(nsDir, "pages", k[:2], strings.Repeat("c3", 31)+"ff")
	if err := os.Mkdir(dir, 0o750); err != nil {
		t.Fatal(err)
	}
	testutil.WriteFile(t, filepath.Join(nsDir, "snap"), layout.Magic+"not listed by ListPages")
	l, err := store.NamespaceAt(nsDir, store.Options{}).ListPages()
	if err != nil {
		t.Fatal(err)
	}
	if !l.HasPagesDir || len(l.Pages) != 1 || l.Pages[0].Path != page || l.Pages[0].Key != k || l.Pages[0].Size != 0 ||
		len(l.Temps) != 1 || l.Temps[0].Path != ptmp || len(l.Snapshots) != 0 || len(l.Blocks) != 0 {
		t.Fatalf("listing %+v", l)
	}
	if got, want := l.SkippedPaths(), sorted([]string{flatPage, wrongFan, link, dir}); !slices.Equal(got, want) {
		t.Fatalf("skipped %q, want %q", got, want)
	}
	// No pages/: an empty listing. A pages/ that is a symlink: skipped.
	other := filepath.Join(root, "other")
	if l, err := store.NamespaceAt(other, store.Options{}).ListPages(); err != nil || l.HasPagesDir || len(l.Pages) != 0 {
		t.Fatalf("missing namespace: %+v %v", l, err)
	}
	if err := os.MkdirAll(other, 0o750); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(filepath.Join(nsDir, "pages"), filepath.Join(other, "pages")); err != nil {
		t.Fatal(err)
	}
	l, err = store.NamespaceAt(other, store.Options{}).ListPages()
	if err != nil || l.HasPagesDir || len(l.Pages) != 0 || !slices.Equal(l.SkippedPaths(), []string{filepath.Join(other, "pages")}) {
		t.Fatalf("symlinked pages/: %+v %v", l, err)
	}
}

func sorted(s []string) []string { s = slices.Clone(s); slices.Sort(s); return s }

// TestRootsAndNamespaces: a symlinked root and a root below a symlinked
// parent are opened (and created); a namespace directory, with or without
// blocks/, is not a root; nothing below the root is followed.
func TestRootsAndNamespaces(t *testing.T) {
	dir := t.TempDir()
	real := filepath.Join(dir, "real")
	if err := os.Mkdir(real, 0o750); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(real, filepath.Join(dir, "link")); err != nil {
		t.Fatal(err)
	}
	for _, root := range []string{filepath.Join(dir, "link"), filepath.Join(dir, "link", "below", "root")} {
		if _, err := store.Create(root, store.Options{}); err != nil {
			t.Fatalf("Create(%s): %v", root, err)
		}
		if _, err := store.Open(root, store.Options{}); err != nil {
			t.Fatalf("Open(%s): %v", root, err)
		}
	}
	if _, err := os.Stat(filepath.Join(real, "below", "root")); err != nil {
		t.Fatalf("the root below a symlinked parent was not created: %v", err)
	}
	if _, err := store.Open(filepath.Join(dir, "missing"), store.Options{}); !errors.Is(err, store.ErrRoot) || !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("missing root: %v", err)
	}
	// Namespaces: one with blocks/, one with only a .lock, one with only a
	// snapshot file; a directory holding an empty file or junk is a root.
	root := filepath.Join(dir, "store")
	testutil.WriteFile(t, filepath.Join(root, "withblocks", "blocks", "x"), "")
	testutil.WriteFile(t, filepath.Join(root, "lockonly", ".lock"), "")
	testutil.WriteFile(t, filepath.Join(root, "snaponly", "s"), layout.Magic)
	testutil.WriteFile(t, filepath.Join(root, "emptyfile", "e"), "")
	for _, c := range []struct {
		name string
		want store.DirKind
	}{{"withblocks", store.DirNamespace}, {"lockonly", store.DirNamespace}, {"snaponly", store.DirNamespace}, {"emptyfile", store.DirRoot}} {
		p := filepath.Join(root, c.name)
		kind, why, err := store.ProbeDir(nil, p)
		if err != nil || kind != c.want {
			t.Errorf("ProbeDir(%s) = %v %q %v, want %v", c.name, kind, why, err, c.want)
		}
		_, err = store.Open(p, store.Options{})
		if (c.want == store.DirNamespace) != errors.Is(err, store.ErrRoot) {
			t.Errorf("Open(%s): %v", c.name, err)
		}
	}
	st, err := store.Open(root, store.Options{})
	if err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(filepath.Join(root, "lockonly"), filepath.Join(root, "nslink")); err != nil {
		t.Fatal(err)
	}
	names, skipped, err := st.Namespaces(false)
	if err != nil {
		t.Fatal(err)
	}
	if want := []string{"emptyfile", "lockonly", "snaponly", "withblocks"}; !slices.Equal(names, want) {
		t.Errorf("namespaces %q, want %q", names, want)
	}
	if !slices.Equal(skipped, []string{filepath.Join(root, "nslink")}) {
		t.Errorf("skipped %q", skipped)
	}
	ns, _ := st.Namespace("nslink")
	if _, err := ns.List(false); !errors.Is(err, store.ErrNamespace) {
		t.Errorf("listing a symlinked namespace: %v, want ErrNamespace", err)
	}
	if err := ns.Create(); !errors.Is(err, store.ErrNamespace) {
		t.Errorf("creating in a symlinked namespace: %v, want ErrNamespace", err)
	}
}

// TestLockIfExistsNeverCreates: a read or dry run takes the lock only if
// its file exists; the lock excludes as flock does.
func TestLockIfExistsNeverCreates(t *testing.T) {
	root := t.TempDir()
	st := store.At(root, store.Options{})
	ns, _ := st.Namespace("ns")
	if err := os.Mkdir(ns.Dir(), 0o750); err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	unlock, locked, err := ns.LockIfExists(ctx, true)
	if err != nil || locked {
		t.Fatalf("LockIfExists without a lock file: locked %v, %v", locked, err)
	}
	unlock()
	if _, err := os.Lstat(ns.LockPath()); !os.IsNotExist(err) {
		t.Fatalf("LockIfExists created %s (%v)", ns.LockPath(), err)
	}
	shared, err := ns.Lock(ctx, false)
	if err != nil {
		t.Fatal(err)
	}
	tctx, cancel := context.WithTimeout(ctx, 20*time.Millisecond)
	defer cancel()
	if _, _, err := ns.LockIfExists(tctx, true); !errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("exclusive beside a shared lock: %v, want DeadlineExceeded", err)
	}
	shared()
	ex, locked, err := ns.LockIfExists(ctx, true)
	if err != nil || !locked {
		t.Fatalf("exclusive after release: locked %v, %v", locked, err)
	}
	ex()
	noLock, _ := store.At(root, store.Options{NoLock: true}).Namespace("other")
	if _, locked, err := noLock.LockIfExists(ctx, true); err != nil || !locked {
		t.Errorf("NoLock: locked %v, %v; want a no-op that counts as held", locked, err)
	}
}

// TestSyncPolicy: NoSync turns every directory fsync and write-back into a
// no-op in one place; Create still creates durably otherwise.
func TestSyncPolicy(t *testing.T) {
	root := t.TempDir()
	ffs := testutil.NewFaultFS(nil)
	st := store.At(root, store.Options{FS: ffs, NoSync: true})
	ns, _ := st.Namespace("ns")
	if err := ns.Create(); err != nil {
		t.Fatal(err)
	}
	if err := ns.CreateBlocksDir(); err != nil {
		t.Fatal(err)
	}
	if n := ffs.Count(testutil.OpSyncDir); n != 0 {
		t.Errorf("NoSync: %d directory fsyncs", n)
	}
	if o := st.PublishOptions(true, 5); o.Sync || !o.SyncDir || o.Size != 5 {
		t.Errorf("NoSync publish options %+v", o)
	}
	ffs2 := testutil.NewFaultFS(nil)
	st2 := store.At(root, store.Options{FS: ffs2})
	ns2, _ := st2.Namespace("ns2")
	if err := ns2.Create(); err != nil {
		t.Fatal(err)
	}
	if err := ns2.Create(); err != nil { // exists: the root is synced all the same
		t.Fatal(err)
	}
	// The new directory's entry, then the root in each Create.
	if n := ffs2.Count(testutil.OpSyncDir); n != 3 {
		t.Errorf("%d directory fsyncs, want 3 (all of the root)", n)
	}
}

// TestListSnapshotsShallow: ListSnapshots is List of the namespace
// directory alone: snapshots, temps, lock and checkpoint as List has them,
// blocks/ and pages/ reported present but not walked.
func TestListSnapshotsShallow(t *testing.T) {
	nsDir := filepath.Join(t.TempDir(), "ns")
	k := strings.Repeat("c3", 32)
	snap := testutil.WriteFile(t, filepath.Join(nsDir, "snap"), layout.Magic+"torn")
	testutil.WriteFile(t, filepath.Join(nsDir, layout.RecencyName), "x")
	testutil.WriteFile(t, filepath.Join(nsDir, "pages", k[:2], k), "page")
	testutil.WriteFile(t, filepath.Join(nsDir, "blocks", k[:2], k), "block")
	testutil.WriteFile(t, filepath.Join(nsDir, "pages", "zz", "junk"), "not walked")
	l, err := store.NamespaceAt(nsDir, store.Options{}).ListSnapshots(false)
	if err != nil {
		t.Fatal(err)
	}
	if len(l.Snapshots) != 1 || l.Snapshots[0].Path != snap || !l.HasPagesDir || !l.HasBlocksDir || !l.HasRecency ||
		len(l.Pages) != 0 || len(l.Blocks) != 0 || len(l.Skipped) != 0 {
		t.Fatalf("listing %+v", l)
	}
}
