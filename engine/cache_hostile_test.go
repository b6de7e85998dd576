package engine

import (
	"os"
	"path/filepath"
	"syscall"
	"testing"

	"github.com/kvpersist/kvpersist/engine/layout"
	"github.com/kvpersist/kvpersist/internal/kvgen"
	"github.com/kvpersist/kvpersist/internal/testutil"
)

// The bounded page cache where it meets hostile files and the corrupt-page
// repair: the accounting (Usage) must stay equal to the page files on disk.

// flipLastByte corrupts the last data byte of the file at path (its header
// stays intact, so a save would reuse the page; a verified load finds it).
func flipLastByte(t testing.TB, path string) {
	t.Helper()
	f, err := os.OpenFile(path, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		t.Fatal(err)
	}
	b := make([]byte, 1)
	if _, err := f.ReadAt(b, fi.Size()-1); err != nil {
		t.Fatal(err)
	}
	if _, err := f.WriteAt([]byte{b[0] ^ 0xff}, fi.Size()-1); err != nil {
		t.Fatal(err)
	}
}

// TestCacheCorruptPageRemovedOnSecondLoad: a corrupt page whose first
// removal failed (the unlink refused) is dropped from the index but stays
// on disk and in the page cache's accounting; the next load that meets it
// removes it, and the accounting must follow the disk then too. Before the
// fix the policy kept counting the removed page (its key was no longer in
// the index, and only the index's RemoveIfGone told the policy).
func TestCacheCorruptPageRemovedOnSecondLoad(t *testing.T) {
	root := t.TempDir()
	ffs := testutil.NewFaultFS(nil)
	e := newEngine(t, Config{Root: root, Workers: 2, FS: ffs})
	toks := convTokens(0, 4*cP, 1)
	mustSavePages(t, e, "p", toks)
	keys, _, _ := layout.PageChain("tiny", cP, toks)
	path := testutil.PagePath(filepath.Join(root, "p"), keys[2])
	flipLastByte(t, path)

	load := func() int {
		_, dest := paddedDest(kvgen.Tiny, cMax, func(n int) []byte { return make([]byte, n) })
		r := mustDo(t, e, &LoadPrefixRequest{Namespace: "p", Identity: "tiny", Tokens: toks, Dest: dest, PageTokens: cP, Verify: true})
		return r.Prefix.Tokens
	}
	ffs.Inject(testutil.Fault{Op: testutil.OpRemove, Path: keys[2].String(), Nth: 1, Err: syscall.EIO})
	if n := load(); n != 2*cP {
		t.Fatalf("first load: %d tokens, want %d", n, 2*cP)
	}
	if _, err := os.Stat(path); err != nil {
		t.Fatalf("the unlink was refused, the page should still be there: %v", err)
	}
	checkAccounting(t, e, root)
	if n := load(); n != 2*cP {
		t.Fatalf("second load: %d tokens, want %d", n, 2*cP)
	}
	if _, err := os.Stat(path); !os.IsNotExist(err) {
		t.Fatalf("the corrupt page is still on disk after the second load: %v", err)
	}
	checkAccounting(t, e, root)
}

// TestCacheManifestDeletedByAnotherEngine: pins do not cross processes,
// and neither do unpins. The evicting engine found a page manifest at
// start (its pages pinned); another engine deletes it. A save that needs
// those pages evicted must find the manifest gone and evict them rather
// than fail with ErrNoSpace for as long as the engine runs.
func TestCacheManifestDeletedByAnotherEngine(t *testing.T) {
	pb := pageBytes(t)
	root := t.TempDir()
	writer := newEngine(t, Config{Root: root, Workers: 1})
	named := convTokens(0, 4*cP, 1)
	mustDo(t, writer, namedPages("p", "keep", named))
	evictor := newEngine(t, Config{Root: root, Workers: 1, CapacityBytes: 4 * pb})
	mustDo(t, writer, &DeleteRequest{Ref: refOf("p", "keep")})
	r := savePages(evictor, "p", convTokens(0, 2*cP, 2))
	if r.Err != nil {
		t.Fatalf("a save needing the pages of a deleted manifest: %v", r.Err)
	}
	if n, _ := evictor.Lookup("p", "tiny", cP, named); n != 2*cP {
		t.Fatalf("the unpinned conversation: %d tokens left, want %d", n, 2*cP)
	}
	checkAccounting(t, evictor, root)
}
