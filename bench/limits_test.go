package bench

import (
	"bytes"
	cryptosha256 "crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/kvpersist/kvpersist/engine"
	"github.com/kvpersist/kvpersist/engine/layout"
	"github.com/kvpersist/kvpersist/internal/kvgen"
	"github.com/kvpersist/kvpersist/internal/testutil"
)

// The limits are only fair if they handle the same bytes as the engine:
// these tests check each against the engine on a small cache.

const limitTokens = 300

// TestWorkloadBytes: the workload's contiguous copy holds every slot's
// logical bytes, as computed independently of the views by kvgen.
// TestArenaResident: an arena is resident and zero when made (warmMem), so
// a timed step writing into it pays no first-touch fault.
func TestArenaResident(t *testing.T) {
	const pages = 64
	a, err := newArena(pages*pageBytes - 100)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = a.free() }()
	n, err := residentIn(a.mem)
	if err != nil {
		t.Fatal(err)
	}
	if n != pages {
		t.Fatalf("%d of %d arena pages resident after newArena", n, pages)
	}
	if b := a.alloc(3 * pageBytes); !bytes.Equal(b, make([]byte, len(b))) {
		t.Fatal("a fresh arena's bytes are not zero")
	}
}

func TestWorkloadBytes(t *testing.T) {
	w := getWorkload(t, kvgen.Tiny, limitTokens)
	c := kvgen.NewCache(kvgen.Tiny, limitTokens, false, nil)
	if got, want := w.logical, kvgen.Tiny.CacheBytes(limitTokens); got != want {
		t.Fatalf("workload has %d logical bytes, want %d", got, want)
	}
	for i := range w.slots {
		if !bytes.Equal(w.slots[i], c.Expected(i)) {
			t.Fatalf("contiguous slot %d differs from kvgen.Expected", i)
		}
	}
}

// TestRawWriteLimit: rawWrite and rawWriteN (cycling past the buffer) leave
// exactly the bytes asked for.
func TestRawWriteLimit(t *testing.T) {
	dir := t.TempDir()
	buf := []byte("0123456789")
	if err := rawWrite(filepath.Join(dir, "a"), buf); err != nil {
		t.Fatal(err)
	}
	if err := rawWriteN(filepath.Join(dir, "b"), buf, 25); err != nil {
		t.Fatal(err)
	}
	for name, want := range map[string]string{"a": "0123456789", "b": "0123456789012345678901234"} {
		got, err := os.ReadFile(filepath.Join(dir, name))
		if err != nil {
			t.Fatal(err)
		}
		if string(got) != want {
			t.Errorf("%s holds %q, want %q", name, got, want)
		}
	}
	if err := rawWrite(filepath.Join(dir, "a"), buf); !errors.Is(err, fs.ErrExist) {
		t.Errorf("rawWrite over an existing file: %v, want fs.ErrExist", err)
	}
}

// TestReadAndHashLimits: preadLimit restores a single-file snapshot's
// tensors exactly, and shaLimit computes the block manifest's hashes.
func TestReadAndHashLimits(t *testing.T) {
	w := getWorkload(t, kvgen.Tiny, limitTokens)
	root := mkdir(t, "limits")
	defer removeAll(t, root)
	e := newEngine(t, root, true)
	defer closeEngine(t, e)

	single := engine.Ref{Namespace: "ns", Name: "single"}
	do(t, e, w.request(single, layout.Single, w.tokens))
	snap, err := e.Stat(single)
	if err != nil {
		t.Fatal(err)
	}
	path, err := e.Path(single)
	if err != nil {
		t.Fatal(err)
	}
	var offs []int64
	dest := make([][]byte, len(w.slots))
	for i, s := range snap.Header.Slots() {
		offs = append(offs, int64(snap.DataStart)+s.Off)
		dest[i] = make([]byte, s.Bytes)
	}
	if err := preadLimit(path, dest, offs); err != nil {
		t.Fatal(err)
	}
	for i := range dest {
		if !bytes.Equal(dest[i], w.slots[i]) {
			t.Fatalf("pread limit: slot %d differs from the bytes saved", i)
		}
	}

	// pread + xxh3: the same bytes, and the header's hashes (it checks).
	clear(dest[0])
	if err := preadXXH3Limit(path, dest, offs, snap.Header); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(dest[0], w.slots[0]) {
		t.Fatal("pread+xxh3 limit: slot 0 differs from the bytes saved")
	}
	// A wrong hash in the header is caught: the limit hashes what it read.
	badHeader := *snap.Header
	badHeader.Caches = slices.Clone(snap.Header.Caches)
	badHeader.Caches[0].Tensors = slices.Clone(snap.Header.Caches[0].Tensors)
	badHeader.Caches[0].Tensors[1].Hash = "0000000000000000"
	if err := preadXXH3Limit(path, dest, offs, &badHeader); err == nil {
		t.Fatal("pread+xxh3 limit accepted a wrong hash")
	}

	blocks := do(t, e, w.request(engine.Ref{Namespace: "ns", Name: "blk"}, layout.Blocks, w.tokens))
	blkSnap, err := e.Stat(engine.Ref{Namespace: "ns", Name: "blk"})
	if err != nil {
		t.Fatal(err)
	}
	blkPath, err := e.Path(engine.Ref{Namespace: "ns", Name: "blk"})
	if err != nil {
		t.Fatal(err)
	}
	for i := range dest {
		clear(dest[i])
	}
	if err := preadSHALimit(blkSnap, blkPath, dest); err != nil {
		t.Fatal(err)
	}
	for i := range dest {
		if !bytes.Equal(dest[i], w.slots[i]) {
			t.Fatalf("pread+SHA-256 limit: slot %d differs from the bytes saved", i)
		}
	}
	// The cold limit reads every byte of both snapshots with O_DIRECT at
	// every depth, after an eviction that leaves no page cached.
	for _, sp := range []struct {
		snap *layout.Snapshot
		path string
	}{{snap, path}, {blkSnap, blkPath}} {
		files, exts := snapshotFiles(sp.snap, sp.path)
		if err := evict(files); err != nil {
			t.Fatal(err)
		}
		if n, err := residentPages(files); err != nil || n != 0 {
			t.Fatalf("%s: %d pages cached after evict (%v)", sp.path, n, err)
		}
		mem, err := newArena(32 * (directRequestBytes + pageBytes))
		if err != nil {
			t.Fatal(err)
		}
		bufs := make([][]byte, 32)
		for i := range bufs {
			bufs[i] = mem.alloc(directRequestBytes + pageBytes)
		}
		for _, qd := range directDepths {
			n, err := directLimit(exts, qd, bufs)
			if err != nil || n != int64(w.logical) {
				t.Fatalf("%s: O_DIRECT limit at depth %d read %d bytes, want %d: %v", sp.path, qd, n, w.logical, err)
			}
		}
		mem.free()
	}
	bo, bl := blockCuts(blocks.Header)
	if len(bo) != int(blocks.Metrics.BlocksWritten) || len(bo) == 0 {
		t.Fatalf("%d block extents, the save wrote %d blocks", len(bo), blocks.Metrics.BlocksWritten)
	}
	sums := make([][32]byte, len(bo))
	shaLimit(w.contig, bo, bl, sums)
	k := 0
	for _, s := range blocks.Header.Slots() {
		for _, ref := range s.Blocks {
			want := cryptosha256.Sum256(w.contig[bo[k] : bo[k]+bl[k]])
			if sums[k] != want || hex.EncodeToString(sums[k][:]) != ref.Hash {
				t.Fatalf("block %d: limit %x, crypto/sha256 %x, manifest %s", k, sums[k], want, ref.Hash)
			}
			k++
		}
	}
}

// TestUnlinkLimit: on two copies of the same store, collect and the unlink
// limit leave exactly the same files.
func TestUnlinkLimit(t *testing.T) {
	const blocks = 40
	tpl, err := buildCollectTemplate(filepath.Join(benchRoot, "unlink-template"), blocks)
	if err != nil {
		t.Fatal(err)
	}
	defer tpl.mem.free()
	if len(tpl.victims) != blocks/2 {
		t.Fatalf("template has %d unreferenced blocks, want %d", len(tpl.victims), blocks/2)
	}
	root, lim := mkdir(t, "unlink"), mkdir(t, "unlink-limit")
	defer removeAll(t, root)
	defer removeAll(t, lim)
	tpl.materialize(t, filepath.Join(root, "ns"))
	tpl.materialize(t, filepath.Join(lim, "ns"))
	e := newEngine(t, root, true)
	defer closeEngine(t, e)
	res := do(t, e, &engine.CollectRequest{Namespaces: []string{"ns"}})
	if got := res.Metrics.Collect.BlocksDeleted; got != blocks/2 {
		t.Fatalf("collect deleted %d blocks, want %d", got, blocks/2)
	}
	n, err := unlinkLimit(testutil.BlocksDir(filepath.Join(lim, "ns")), tpl.victims)
	if err != nil || n != blocks/2 {
		t.Fatalf("unlink limit removed %d files (want %d): %v", n, blocks/2, err)
	}
	a, b := listFiles(t, filepath.Join(root, "ns")), listFiles(t, filepath.Join(lim, "ns"))
	if !slices.Equal(a, b) || len(a) != blocks/2+2 {
		t.Fatalf("after collect: %d files %v\nafter the limit: %d files %v", len(a), a, len(b), b)
	}
}

// listFiles returns the regular files under dir, relative, sorted.
func listFiles(t *testing.T, dir string) []string {
	t.Helper()
	var out []string
	err := filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() {
			return err
		}
		rel, _ := filepath.Rel(dir, p)
		out = append(out, rel)
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	slices.Sort(out)
	return out
}

// TestWriteModes: both write modes of BenchmarkWriteModes leave exactly the
// bytes given, as one file or as 1 MiB files in order.
func TestWriteModes(t *testing.T) {
	arena, err := newArena(3<<20 + 8192)
	if err != nil {
		t.Fatal(err)
	}
	defer arena.free()
	data := arena.alloc(3<<20 + 8192)
	for i := range data {
		data[i] = byte(i * 31 / 7)
	}
	dir := mkdir(t, "writemodes-test")
	defer removeAll(t, dir)
	for _, direct := range []bool{false, true} {
		p := filepath.Join(dir, fmt.Sprintf("single-%v", direct))
		if err := writeSingleFile(p, data, direct); err != nil {
			t.Fatal(err)
		}
		if got, err := os.ReadFile(p); err != nil || !bytes.Equal(got, data) {
			t.Fatalf("direct=%v: single file differs (%v)", direct, err)
		}
		p = filepath.Join(dir, fmt.Sprintf("blocks-%v", direct))
		if err := writeBlockFiles(p, data, direct); err != nil {
			t.Fatal(err)
		}
		var all []byte
		for k := range 4 {
			b, err := os.ReadFile(filepath.Join(p, fmt.Sprintf("%06d", k)))
			if err != nil {
				t.Fatal(err)
			}
			all = append(all, b...)
		}
		if !bytes.Equal(all, data) {
			t.Fatalf("direct=%v: block files differ", direct)
		}
	}
}

// TestFetchWriteLimits: getWriteAll and writeAll (BenchmarkRemoteFetch's
// local-write limits) leave exactly each object's bytes in its own file
// and no temp file; a body shorter or longer than its size fails and
// leaves neither its file nor its temp file.
func TestFetchWriteLimits(t *testing.T) {
	rnd := func(seed byte, n int) []byte {
		b := make([]byte, n)
		_, _ = rand.NewChaCha8([32]byte{seed}).Read(b) // never fails
		return b
	}
	objs := [][]byte{rnd(1, 3<<20+17), rnd(2, 300<<10), {}, rnd(3, writePieceBytes)}
	sizes := make([]int64, len(objs))
	for i, o := range objs {
		sizes[i] = int64(len(o))
	}
	bodies := func(data [][]byte) func(i int) (io.ReadCloser, error) {
		return func(i int) (io.ReadCloser, error) { return io.NopCloser(bytes.NewReader(data[i])), nil }
	}
	// check: dir holds exactly the files of objs named by keep, with their bytes.
	check := func(dir string, keep []int) {
		t.Helper()
		ents, err := os.ReadDir(dir)
		if err != nil {
			t.Fatal(err)
		}
		var got, want []string
		for _, e := range ents {
			got = append(got, e.Name())
		}
		for _, i := range keep {
			want = append(want, fetchFileName(i))
			b, err := os.ReadFile(filepath.Join(dir, fetchFileName(i)))
			if err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(b, objs[i]) {
				t.Errorf("%s: %d bytes differ from the object's %d", fetchFileName(i), len(b), len(objs[i]))
			}
		}
		if !slices.Equal(got, want) {
			t.Errorf("%s holds %q, want %q", dir, got, want)
		}
	}
	all := []int{0, 1, 2, 3}
	dir := t.TempDir()
	if err := getWriteAll(bodies(objs), dir, sizes); err != nil {
		t.Fatal(err)
	}
	check(dir, all)
	dir = t.TempDir()
	if err := writeAll(dir, objs); err != nil {
		t.Fatal(err)
	}
	check(dir, all)

	for _, tc := range []struct {
		name string
		body []byte
	}{{"short", objs[1][:len(objs[1])-1]}, {"long", append(slices.Clone(objs[1]), 0)}} {
		dir := t.TempDir()
		data := slices.Clone(objs)
		data[1] = tc.body
		err := getWriteAll(bodies(data), dir, sizes)
		if err == nil || !strings.Contains(err.Error(), fmt.Sprintf("%d bytes, want %d", len(tc.body), len(objs[1]))) {
			t.Fatalf("%s body: err %v, want one naming its size", tc.name, err)
		}
		// The other objects may or may not have been written (the first
		// error stops the workers that see it); object 1 is absent.
		if _, err := os.Lstat(filepath.Join(dir, fetchFileName(1))); !errors.Is(err, fs.ErrNotExist) {
			t.Errorf("%s body: its file exists (%v)", tc.name, err)
		}
		if _, err := os.Lstat(filepath.Join(dir, fetchFileName(1)+".tmp")); !errors.Is(err, fs.ErrNotExist) {
			t.Errorf("%s body: its temp file was left (%v)", tc.name, err)
		}
	}
}
