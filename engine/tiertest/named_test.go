package tiertest

import (
	"bytes"
	"context"
	"errors"
	"os"
	"path/filepath"
	"testing"

	"github.com/kvpersist/kvpersist/engine"
	"github.com/kvpersist/kvpersist/internal/testutil"
)

// readNamed reads the named snapshot name of tokens' geometry (written by
// writePages), verified, into fresh buffers and returns the result and
// the buffers (K then V, row-major [1, heads, tokens, headDim]).
func readNamed(e *engine.Engine, name string, tokens int) (engine.Result, [][]byte) {
	n := heads * tokens * headDim * item
	dest := [][]byte{make([]byte, n), make([]byte, n)}
	res := e.Do(context.Background(), &engine.ReadRequest{Ref: engine.Ref{Namespace: ns, Name: name}, Dest: dest})
	return res, dest
}

// checkNamed fails unless dest holds tokens' KV, computed independently
// of any store (fill).
func checkNamed(t *testing.T, dest [][]byte, tokens []uint32) {
	t.Helper()
	want := newKV(len(tokens))
	want.fill(tokens)
	if !bytes.Equal(dest[0], want.k) || !bytes.Equal(dest[1], want.v) {
		t.Fatal("named read: bytes read back differ from the KV written")
	}
}

// TestNamedReadThroughOnB: A writes a named snapshot in the Pages layout
// (4 full pages and a leaf) and uploads it. B, with its own root and the
// same bucket, reads the name: the manifest and every page are fetched,
// verified and published locally (byte-identical to A's files), and the
// bytes read back equal the bytes written. A second read on B is local
// (the tier is not asked: Result.Remote is nil). C
// holds A's manifest but none of its pages: its read fetches the pages.
func TestNamedReadThroughOnB(t *testing.T) {
	prefix := bucketPrefix(t)
	rootA, rootB, rootC := t.TempDir(), t.TempDir(), t.TempDir()
	conv := seq(21000, 4*ptoks+9)
	keys := keysOf(t, conv)
	a := newEngine(t, rootA, prefix, newRecorder(t), nil)
	writePages(t, a, "conv-1", conv)
	closeEngine(t, a)
	var pageBytes int64
	for _, k := range keys {
		pageBytes += int64(len(readFile(t, pagePath(rootA, k))))
	}

	b := newEngine(t, rootB, prefix, newRecorder(t), nil)
	res, dest := readNamed(b, "conv-1", len(conv))
	if res.Err != nil {
		t.Fatalf("read on B: %v (remote %+v)", res.Err, res.Remote)
	}
	checkNamed(t, dest, conv)
	if r := res.Remote; r == nil || r.Err != nil || r.PagesFetched != len(keys) || r.BytesFetched != pageBytes {
		t.Fatalf("remote report %+v; want %d pages, %d bytes fetched, no error", r, len(keys), pageBytes)
	}
	if !bytes.Equal(readFile(t, filepath.Join(rootB, ns, "conv-1")), readFile(t, filepath.Join(rootA, ns, "conv-1"))) {
		t.Fatal("B's manifest differs from A's")
	}
	for _, k := range keys {
		if !bytes.Equal(readFile(t, pagePath(rootB, k)), readFile(t, pagePath(rootA, k))) {
			t.Fatalf("B's page %s differs from A's", k)
		}
	}
	checkUsageIsDisk(t, b, rootB, 1<<40) // the fetched pages are accounted by the page cache
	res, dest = readNamed(b, "conv-1", len(conv))
	if res.Err != nil || res.Remote != nil {
		t.Fatalf("second read on B: %v, remote %+v; want local, the tier not asked", res.Err, res.Remote)
	}
	checkNamed(t, dest, conv)
	if tmp := testutil.TempFiles(t, rootB); len(tmp) > 0 {
		t.Fatalf("temp files left: %v", tmp)
	}

	// C: the manifest is local, its pages are not.
	if err := os.MkdirAll(filepath.Join(rootC, ns), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(rootC, ns, "conv-1"), readFile(t, filepath.Join(rootA, ns, "conv-1")), 0o644); err != nil {
		t.Fatal(err)
	}
	c := newEngine(t, rootC, prefix, newRecorder(t), nil)
	res, dest = readNamed(c, "conv-1", len(conv))
	if res.Err != nil || res.Remote.PagesFetched != len(keys) {
		t.Fatalf("read on C: %v, remote %+v; want %d pages fetched", res.Err, res.Remote, len(keys))
	}
	checkNamed(t, dest, conv)

	// A name in neither tier is not found, as without a remote tier.
	res, _ = readNamed(b, "conv-none", len(conv))
	if !errors.Is(res.Err, engine.ErrNotFound) || res.Remote.Err != nil {
		t.Fatalf("read of a missing name: %v, remote %+v; want not found, no remote error", res.Err, res.Remote)
	}
}

// TestNamedReadCorruptRemoteObject: a remote page (a flipped tensor byte)
// or a remote manifest (a flipped header byte) that fails verification fails the
// read with ErrRemoteCorrupt; neither it nor the manifest is published
// locally, no temp file is left, and nothing is loaded from it.
func TestNamedReadCorruptRemoteObject(t *testing.T) {
	for _, what := range []string{"page", "manifest"} {
		t.Run(what, func(t *testing.T) {
			prefix := bucketPrefix(t)
			rootA, rootB := t.TempDir(), t.TempDir()
			conv := seq(23000, 3*ptoks)
			keys := keysOf(t, conv)
			a := newEngine(t, rootA, prefix, newRecorder(t), nil)
			writePages(t, a, "conv-2", conv)
			closeEngine(t, a)
			st := openStore(t, prefix)
			name, _ := st.PageName(ns, keys[1].String())
			local := pagePath(rootA, keys[1])
			if what == "manifest" {
				name, _ = st.ManifestName(ns, "conv-2")
				local = filepath.Join(rootA, ns, "conv-2")
			}
			bad := bytes.Clone(readFile(t, local))
			off := len(bad) - 10 // a tensor byte of the last page's V
			if what == "manifest" {
				off = 40 // in the header JSON (a manifest's data region is only padding)
			}
			bad[off] ^= 0x40
			putObject(t, st, name, bad)

			b := newEngine(t, rootB, prefix, newRecorder(t), nil)
			res, _ := readNamed(b, "conv-2", len(conv))
			if !errors.Is(res.Err, engine.ErrRemoteCorrupt) || !errors.Is(res.Remote.Err, engine.ErrRemoteCorrupt) {
				t.Fatalf("read: %v (remote %+v); want ErrRemoteCorrupt", res.Err, res.Remote)
			}
			if _, err := os.Lstat(filepath.Join(rootB, ns, "conv-2")); !os.IsNotExist(err) {
				t.Fatalf("manifest published despite a corrupt object (lstat: %v)", err)
			}
			if _, err := os.Lstat(pagePath(rootB, keys[1])); !os.IsNotExist(err) {
				t.Fatalf("corrupt page published (lstat: %v)", err)
			}
			if tmp := testutil.TempFiles(t, rootB); len(tmp) > 0 {
				t.Fatalf("temp files left: %v", tmp)
			}
		})
	}
}

// TestNamedReadWithoutRoom: B's cache (4 pages) is full of pages a page
// manifest of its own pins. A named read of a 2-page snapshot stored only
// remotely finds no room: the read fails with ErrNoSpace (joined to the
// not-found of the manifest, which is not published), nothing is fetched
// or written, and B's pages and accounting are unchanged.
func TestNamedReadWithoutRoom(t *testing.T) {
	prefix := bucketPrefix(t)
	rootA, rootB := t.TempDir(), t.TempDir()
	x, y := seq(25000, 2*ptoks), seq(27000, 4*ptoks)
	kx, ky := keysOf(t, x), keysOf(t, y)
	b, rec, capacity, before := fullOfPinned(t, prefix, rootA, rootB, kx, y, func(a *engine.Engine) { writePages(t, a, "x", x) })
	res, _ := readNamed(b, "x", len(x))
	if !errors.Is(res.Err, engine.ErrNoSpace) || !errors.Is(res.Err, engine.ErrNotFound) || res.Remote.PagesFetched != 0 {
		t.Fatalf("read: %v (remote %+v); want ErrNoSpace and not found, nothing fetched", res.Err, res.Remote)
	}
	checkNothingFetched(t, b, rootB, rec, capacity, before, kx)
	checkStored(t, rootB, "Y", ky, bools(len(ky), func(int) bool { return true }))
	if _, err := os.Lstat(filepath.Join(rootB, ns, "x")); !os.IsNotExist(err) {
		t.Fatalf("manifest published without its pages (lstat: %v)", err)
	}
}
