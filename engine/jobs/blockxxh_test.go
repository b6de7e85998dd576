package jobs_test

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/kvpersist/kvpersist/engine/jobs"
	"github.com/kvpersist/kvpersist/engine/layout"
	"github.com/kvpersist/kvpersist/engine/vfs"
	"github.com/kvpersist/kvpersist/internal/testutil"
)

// slotErr returns the error a *ReadError gives slot, or fails.
func slotErr(t *testing.T, err error, slot int) error {
	t.Helper()
	var re *jobs.ReadError
	if !errors.As(err, &re) {
		t.Fatalf("%v: not a *ReadError", err)
	}
	for _, s := range re.Slots {
		if s.Slot == slot {
			return s.Err
		}
	}
	t.Fatalf("%v: slot %d did not fail", err, slot)
	return nil
}

// A block save records each block's xxh3-64 in a formatVersion 8
// manifest, and a verified restore checks the blocks by it: the bytes
// read back equal those saved, cold (O_DIRECT where the file system has
// it) or warm; a byte flipped in a block file is ErrCorrupt from the xxh3
// check (not SHA-256), naming the block file in its namespace and the
// block of the tensor.
func TestBlockRestoreVerifiesXXH3(t *testing.T) {
	s := newHsStore(t)
	if s.header.FormatVersion != layout.FormatBlocksXXH3 {
		t.Fatalf("a block save wrote formatVersion %d, want %d", s.header.FormatVersion, layout.FormatBlocksXXH3)
	}
	checkBlockRefs(t, s.header, s.want, 4<<10) // names and xxh3s of the caller's bytes
	// And the block files hold the bytes the xxh3s were computed from.
	for i, tn := range s.header.Slots() {
		for k, r := range tn.Blocks {
			b, err := os.ReadFile(testutil.BlockPath(s.nsDir, r.Hash))
			if err != nil {
				t.Fatal(err)
			}
			if got := xxhHex(b); got != r.XXH3 {
				t.Fatalf("slot %d block %d: file hashes to %s, manifest says %s", i, k, got, r.XXH3)
			}
		}
	}
	for _, cold := range []bool{false, true} {
		if cold {
			testutil.EvictTree(t, s.nsDir)
		}
		got, _, m, err := readBack(t, noSync(), s.blocks, true)
		if err != nil {
			t.Fatalf("cold=%v: %v", cold, err)
		}
		mustEqualExpected(t, got, s.want)
		if m.ReadBytes != totalBytes(s.header) {
			t.Fatalf("cold=%v: read %d bytes, want %d", cold, m.ReadBytes, totalBytes(s.header))
		}
	}

	ref := s.header.Slots()[1].Blocks[2]
	path := testutil.BlockPath(s.nsDir, ref.Hash)
	flipByte(t, path, ref.Bytes/2)
	for _, cold := range []bool{false, true} {
		if cold {
			testutil.EvictTree(t, s.nsDir)
		}
		_, _, _, err := readBack(t, noSync(), s.blocks, true)
		if !errors.Is(err, jobs.ErrCorrupt) {
			t.Fatalf("cold=%v: a flipped block byte: %v, want ErrCorrupt", cold, err)
		}
		e := slotErr(t, err, 1).Error()
		if !strings.Contains(e, "block 2: ") || !strings.Contains(e, path) || !strings.Contains(e, "xxh3") || strings.Contains(e, "SHA-256") {
			t.Fatalf("cold=%v: slot 1's error %q should name block 2, its file %s and the xxh3", cold, e, path)
		}
	}
	// Unverified, the same read succeeds with the flipped byte.
	got, _, _, err := readBack(t, noSync(), s.blocks, false)
	if err != nil {
		t.Fatal(err)
	}
	at := s.header.Slots()[1].Blocks[0].Bytes + s.header.Slots()[1].Blocks[1].Bytes + ref.Bytes/2
	if got[1][at] != s.want[1][at]^0x10 {
		t.Fatal("the unverified read did not return the file's bytes")
	}
}

func totalBytes(h *layout.Header) int64 {
	n, _ := h.TotalBytes()
	return n
}

// A manifest recording an xxh3 that differs from its block's bytes, whose
// SHA-256 matches the block's name, fails a verified restore with
// ErrCorrupt: the restore checks the xxh3, not the name. VerifyStore
// reports it as ProblemBlockXXH3 of the MANIFEST (removing the problem's
// path must not delete a correct block that good manifests name), naming
// the slot, the block and the block file, and the block as not corrupt;
// one problem per manifest at fault, however many of its blocks are wrong.
func TestBlockRestoreManifestXXH3Differs(t *testing.T) {
	s := newHsStore(t)
	bad := filepath.Join(s.nsDir, "bad")
	ref := s.header.Slots()[0].Blocks[1]
	flip := func(x string) string { return x[:15] + string("10"[x[15]&1]) } // the last digit's low bit flipped
	wrongXX := flip(ref.XXH3)
	rewrite(t, s.blocks, bad, func(h *layout.Header) { h.Slots()[0].Blocks[1].XXH3 = wrongXX })
	_, _, _, err := readBack(t, noSync(), bad, true)
	if !errors.Is(err, jobs.ErrCorrupt) {
		t.Fatalf("a manifest's wrong xxh3: %v, want ErrCorrupt", err)
	}
	if e := slotErr(t, err, 0).Error(); !strings.Contains(e, "block 1: ") || !strings.Contains(e, "expected "+wrongXX) || !strings.Contains(e, testutil.BlockPath(s.nsDir, ref.Hash)) {
		t.Fatalf("slot 0's error %q should name block 1, its file and the manifest's xxh3 %s", e, wrongXX)
	}
	// The other manifest naming the same block still restores.
	got, _, _, err := readBack(t, noSync(), s.blocks, true)
	if err != nil {
		t.Fatal(err)
	}
	mustEqualExpected(t, got, s.want)

	blockFile := testutil.BlockPath(s.nsDir, ref.Hash)
	r, err := jobs.VerifyStore(context.Background(), noSync(), &jobs.VerifySpec{Target: s.nsDir})
	if err != nil {
		t.Fatal(err)
	}
	if len(r.Problems) != 1 {
		t.Fatalf("problems %+v, want the one block-xxh3", r.Problems)
	}
	p := r.Problems[0]
	if p.Kind != jobs.ProblemBlockXXH3 || p.Path != bad ||
		!strings.Contains(p.Detail, "cache 0 tensor 0 (slot 0) block 1 records xxh3 "+wrongXX+", but its block file "+blockFile) ||
		!strings.Contains(p.Detail, "hashes to "+ref.XXH3) || !strings.Contains(p.Detail, "never the block") || strings.Contains(p.Detail, "blocks-snap") {
		t.Fatalf("problem %+v, want %s of the manifest %s naming slot 0 block 1 and %s", p, jobs.ProblemBlockXXH3, bad, blockFile)
	}
	// The block is correct and stays named: removing the problem's path
	// removes the manifest, and verify is then clean.
	if err := os.Remove(p.Path); err != nil {
		t.Fatal(err)
	}
	if r, err := jobs.VerifyStore(context.Background(), noSync(), &jobs.VerifySpec{Target: s.nsDir}); err != nil || len(r.Problems) != 0 {
		t.Fatalf("after removing %s: %v %+v", p.Path, err, r)
	}

	// Two manifests at fault, one of them for two blocks: one problem
	// each, at the manifest's path; the one wrong twice counts both.
	ref2 := s.header.Slots()[2].Blocks[0]
	rewrite(t, s.blocks, bad, func(h *layout.Header) {
		h.Slots()[0].Blocks[1].XXH3 = wrongXX
		h.Slots()[2].Blocks[0].XXH3 = flip(ref2.XXH3)
	})
	bad2 := filepath.Join(s.nsDir, "bad2")
	rewrite(t, s.blocks, bad2, func(h *layout.Header) { h.Slots()[0].Blocks[1].XXH3 = wrongXX })
	r, err = jobs.VerifyStore(context.Background(), noSync(), &jobs.VerifySpec{Target: s.nsDir})
	if err != nil {
		t.Fatal(err)
	}
	if len(r.Problems) != 2 {
		t.Fatalf("problems %+v, want one block-xxh3 per manifest at fault", r.Problems)
	}
	for i, want := range []string{bad, bad2} {
		p := r.Problems[i]
		if p.Kind != jobs.ProblemBlockXXH3 || p.Path != want || !strings.Contains(p.Detail, "(slot 0) block 1 records xxh3 "+wrongXX) {
			t.Fatalf("problem %d %+v, want %s of %s naming slot 0 block 1", i, p, jobs.ProblemBlockXXH3, want)
		}
	}
	if d := r.Problems[0].Detail; !strings.Contains(d, "(slot 2) block 0 records xxh3 "+flip(ref2.XXH3)+", but its block file "+testutil.BlockPath(s.nsDir, ref2.Hash)) {
		t.Fatalf("detail %q should also name slot 2 block 0", d)
	}
	if d := r.Problems[1].Detail; strings.Contains(d, "slot 2") {
		t.Fatalf("detail %q names a block bad2 records rightly", d)
	}
}

// More manifests recording one wrong xxh3 for a block than VerifyStore
// keeps by name (64): each named one is a ProblemBlockXXH3 of its
// manifest, and a note counts the rest and says to verify again.
func TestVerifyBlockXXH3ManyManifests(t *testing.T) {
	s := newHsStore(t)
	ref := s.header.Slots()[1].Blocks[0]
	wrongXX := ref.XXH3[:15] + string("10"[ref.XXH3[15]&1])
	const n = 66
	for i := range n {
		rewrite(t, s.blocks, filepath.Join(s.nsDir, fmt.Sprintf("bad%02d", i)), func(h *layout.Header) { h.Slots()[1].Blocks[0].XXH3 = wrongXX })
	}
	r, err := jobs.VerifyStore(context.Background(), noSync(), &jobs.VerifySpec{Target: s.nsDir})
	if err != nil {
		t.Fatal(err)
	}
	if len(r.Problems) != 64 {
		t.Fatalf("%d problems, want 64 (one per named manifest)", len(r.Problems))
	}
	seen := map[string]bool{}
	for _, p := range r.Problems {
		if p.Kind != jobs.ProblemBlockXXH3 || !strings.HasPrefix(filepath.Base(p.Path), "bad") || filepath.Dir(p.Path) != s.nsDir || seen[p.Path] {
			t.Fatalf("problem %+v: want one block-xxh3 per badNN manifest", p)
		}
		seen[p.Path] = true
	}
	want := fmt.Sprintf("block %s: %d more manifest blocks record xxh3 %s", testutil.BlockPath(s.nsDir, ref.Hash), n-64, wrongXX)
	if len(r.Notes) != 1 || !strings.Contains(r.Notes[0], want) {
		t.Fatalf("notes %q, want one saying %q", r.Notes, want)
	}
}

// A formatVersion 5 manifest (no xxh3s: kvpersist's before formatVersion
// 8, and the Bun worker's) still restores, verified by SHA-256 against the
// block names: a flipped byte is ErrCorrupt from the SHA-256 check.
// VerifyStore checks it clean, then reports the flipped block as corrupt,
// once (not as a block-xxh3 of the formatVersion 8 manifest beside it).
func TestBlockRestoreFormat5VerifiesSHA256(t *testing.T) {
	s := newHsStore(t)
	old := filepath.Join(s.nsDir, "old")
	rewrite(t, s.blocks, old, func(h *layout.Header) { *h = *testutil.AsFormatBlocks(h) })
	snap, err := layout.Load(vfs.Default, old)
	if err != nil || snap.Header.FormatVersion != 5 {
		t.Fatalf("formatVersion 5 manifest: %v", err)
	}
	for _, cold := range []bool{false, true} {
		if cold {
			testutil.EvictTree(t, s.nsDir)
		}
		got, _, _, err := readBack(t, noSync(), old, true)
		if err != nil {
			t.Fatalf("cold=%v: %v", cold, err)
		}
		mustEqualExpected(t, got, s.want)
	}
	r, err := jobs.VerifyStore(context.Background(), noSync(), &jobs.VerifySpec{Target: s.nsDir})
	if err != nil || len(r.Problems) != 0 {
		t.Fatalf("verify: %v %+v", err, r)
	}

	ref := s.header.Slots()[2].Blocks[0]
	path := testutil.BlockPath(s.nsDir, ref.Hash)
	flipByte(t, path, 0)
	_, _, _, err = readBack(t, noSync(), old, true)
	if !errors.Is(err, jobs.ErrCorrupt) {
		t.Fatalf("a flipped block byte: %v, want ErrCorrupt", err)
	}
	if e := slotErr(t, err, 2).Error(); !strings.Contains(e, "block 0: ") || !strings.Contains(e, path) || !strings.Contains(e, "SHA-256") {
		t.Fatalf("slot 2's error %q should name block 0, its file and the SHA-256", e)
	}
	r, err = jobs.VerifyStore(context.Background(), noSync(), &jobs.VerifySpec{Target: s.nsDir})
	if err != nil {
		t.Fatal(err)
	}
	if len(r.Problems) != 1 || r.Problems[0].Kind != jobs.ProblemCorruptBlock || r.Problems[0].Path != path {
		t.Fatalf("problems %+v, want one corrupt-block of %s", r.Problems, path)
	}
}

// A manifest whose block xxh3 is malformed is refused when it is decoded
// (ErrInvalidHeader naming the block), before any block is opened or any
// destination written.
func TestBlockRestoreMalformedXXH3(t *testing.T) {
	s := newHsStore(t)
	path := filepath.Join(s.nsDir, "evil")
	for _, bad := range []string{"", "0123", "0123456789ABCDEF", "0123456789abcdefff", "../../../etc/pas", "0123456789abcde\x00"} {
		rewrite(t, s.blocks, path, func(h *layout.Header) { h.Slots()[3].Blocks[1].XXH3 = bad })
		ffs := testutil.NewFaultFS(nil)
		gs, _, err := readGuarded(&jobs.Config{FS: ffs, NoLock: true}, path, sizesOf(s.want), true, nil)
		if bad == "" {
			// Encode leaves an empty xxh3 out: the block object lacks the key.
			if !errors.Is(err, layout.ErrInvalidHeader) || !strings.Contains(err.Error(), `caches[1].tensors[1].blocks[1] must be exactly`) {
				t.Fatalf("xxh3 %q: %v, want ErrInvalidHeader naming the block", bad, err)
			}
		} else if !errors.Is(err, layout.ErrInvalidHeader) || !strings.Contains(err.Error(), "cache 1 tensor 1 (slot 3) block 1 xxh3") {
			t.Fatalf("xxh3 %q: %v, want ErrInvalidHeader naming slot 3 block 1", bad, err)
		}
		if n := ffs.Count(testutil.OpOpen); n != 1 {
			t.Fatalf("xxh3 %q: %d files opened, want only the manifest", bad, n)
		}
		for i, g := range gs {
			if !g.untouched() || g.intact() >= 0 {
				t.Fatalf("xxh3 %q: destination %d written by a rejected read", bad, i)
			}
		}
	}
}
