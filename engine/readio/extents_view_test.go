package readio_test

import (
	"bytes"
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"math/rand/v2"
	"testing"

	"github.com/kvpersist/kvpersist/engine/gather"
	"github.com/kvpersist/kvpersist/engine/readio"
	"github.com/kvpersist/kvpersist/internal/testutil"
	"github.com/zeebo/xxh3"
)

const viewFill = 0x5a

// viewDst is a strided destination over its own buffer, filled with
// viewFill, and the element offsets the test computes on its own.
type viewDst struct {
	buf  []byte
	view gather.View
}

// elementOffsets lists, for each logical (row-major) element of v, the byte
// offset in v.Base of its first byte, by the multi-index: the test's own
// reference, independent of package gather's walk.
func elementOffsets(v gather.View) []int {
	n := 1
	for _, d := range v.Shape {
		n *= d
	}
	offs := make([]int, n)
	for e := range n {
		rem, o := e, 0
		for a := len(v.Shape) - 1; a >= 0; a-- {
			o += (rem % v.Shape[a]) * v.Strides[a]
			rem /= v.Shape[a]
		}
		offs[e] = v.Offset + o*v.ItemSize
	}
	return offs
}

// randomViewDst makes a destination of a [1, heads, tokens, dim] tensor of
// itemsize 2 in one of the layouts a KV cache has: capacity-padded
// head-major (runs of tokens*dim elements, >= MinRunBytes or not),
// token-major (runs of one head row), or a reversed token axis (runs of
// one row, negative stride); sometimes at an odd address.
func randomViewDst(rng *rand.Rand) viewDst {
	heads, dim := 1+rng.IntN(6), []int{8, 64, 128}[rng.IntN(3)]
	tokens := 1 + rng.IntN(2000)
	capT := tokens + rng.IntN(300)
	mis := 0
	if rng.IntN(3) == 0 {
		mis = 1 + rng.IntN(511)
	}
	buf := bytes.Repeat([]byte{viewFill}, mis+heads*capT*dim*2)
	v := gather.View{Base: buf, Offset: mis, Shape: []int{1, heads, tokens, dim}, ItemSize: 2}
	switch rng.IntN(4) {
	case 0, 1: // head-major, capacity-padded
		v.Strides = []int{heads * capT * dim, capT * dim, dim, 1}
	case 2: // token-major
		v.Strides = []int{heads * capT * dim, dim, heads * dim, 1}
	default: // tokens reversed
		v.Strides = []int{heads * capT * dim, capT * dim, -dim, 1}
		v.Offset += (tokens - 1) * dim * 2
	}
	return viewDst{buf: buf, view: v}
}

// checkView: the view's elements hold want (its logical bytes) and every
// other byte of its buffer still holds viewFill.
func checkView(t *testing.T, name string, d viewDst, want []byte) {
	t.Helper()
	exp := bytes.Repeat([]byte{viewFill}, len(d.buf))
	for e, o := range elementOffsets(d.view) {
		copy(exp[o:o+2], want[2*e:2*e+2])
	}
	if !bytes.Equal(d.buf, exp) {
		for i := range exp {
			if d.buf[i] != exp[i] {
				t.Fatalf("%s: byte %d of the destination buffer is %#x, want %#x", name, i, d.buf[i], exp[i])
			}
		}
	}
}

// TestReadIntoViews: random extents of a file are read into strided
// destinations of every layout a KV cache has (the inverse of a gather),
// with O_DIRECT (cold file) and buffered, at several depths: each
// element holds the file's bytes in logical order (the test's own
// element-by-element reference), no other byte of a buffer is written, and
// each extent verifies against a hash computed here.
func TestReadIntoViews(t *testing.T) {
	dir := testutil.DirectDir(t)
	rng := rand.New(rand.NewPCG(21, 22))
	path, data := randomFile(t, rng, dir, "f", 5*readio.ReadChunkBytes+333)
	for _, tc := range []struct {
		noDirect bool
		depth    int
	}{{false, 1}, {false, 16}, {true, 4}} {
		testutil.EvictTree(t, dir)
		cfg := &readio.Config{ReadDepth: tc.depth, NoDirect: tc.noDirect}
		src, err := readio.OpenSource(cfg, path)
		if err != nil {
			t.Fatal(err)
		}
		var exts []readio.Extent
		var dsts []viewDst
		for k := range 24 {
			d := randomViewDst(rng)
			n := d.view.Bytes()
			if n > len(data) {
				continue
			}
			off := rng.IntN(len(data) - n + 1)
			if k%2 == 0 {
				off &^= 4095
			}
			x := readio.Extent{Src: src, Off: int64(off), View: &d.view, Group: -1}
			if k%3 == 0 {
				x.Verify, x.SHA256 = readio.VerifySHA256, sha256.Sum256(data[off:off+n])
			} else {
				x.Verify, x.XXH3 = readio.VerifyXXH3, xxh3.Hash(data[off:off+n])
			}
			exts = append(exts, x)
			dsts = append(dsts, d)
		}
		errs, st, err := readio.Read(context.Background(), cfg, exts, nil)
		if err != nil {
			t.Fatal(err)
		}
		var total int64
		for k, x := range exts {
			name := fmt.Sprintf("direct=%v depth %d extent %d (shape %v strides %v)", !tc.noDirect, tc.depth, k, x.View.Shape, x.View.Strides)
			if errs[k] != nil {
				t.Fatalf("%s: %v", name, errs[k])
			}
			checkView(t, name, dsts[k], data[x.Off:x.Off+int64(x.Bytes())])
			total += int64(x.Bytes())
		}
		if st.Bytes != total || (tc.noDirect && st.DirectBytes != 0) || (!tc.noDirect && st.DirectBytes == 0) {
			t.Fatalf("direct=%v: stats %+v for %d bytes", !tc.noDirect, st, total)
		}
		if err := src.Close(); err != nil {
			t.Fatal(err)
		}
	}
}

// TestReadViewPiecesVerify: an extent into a view that takes
// several requests (runs of 256 KiB, 2.5 MiB) streams its hash over its
// pieces in order however they complete: the right hash verifies, a wrong
// one is ErrCorrupt, and the later extent of its group is skipped.
func TestReadViewPiecesVerify(t *testing.T) {
	rng := rand.New(rand.NewPCG(23, 24))
	path, data := randomFile(t, rng, t.TempDir(), "f", 6*readio.ReadChunkBytes)
	const heads, tokens, dim = 10, 1024, 128 // runs of 256 KiB
	mk := func(off int, sum uint64, group int) (readio.Extent, viewDst) {
		buf := bytes.Repeat([]byte{viewFill}, heads*(tokens+64)*dim*2)
		d := viewDst{buf: buf, view: gather.View{Base: buf, Shape: []int{1, heads, tokens, dim},
			Strides: []int{heads * (tokens + 64) * dim, (tokens + 64) * dim, dim, 1}, ItemSize: 2}}
		return readio.Extent{Off: int64(off), View: &d.view, Group: group, Verify: readio.VerifyXXH3, XXH3: sum}, d
	}
	n := heads * tokens * dim * 2
	for _, depth := range []int{1, 3, 16} {
		cfg := &readio.Config{ReadDepth: depth}
		src, err := readio.OpenSource(cfg, path)
		if err != nil {
			t.Fatal(err)
		}
		good, gd := mk(4096, xxh3.Hash(data[4096:4096+n]), 0)
		bad, _ := mk(0, xxh3.Hash(data[:n])^1, 1)
		later, ld := mk(8192, xxh3.Hash(data[8192:8192+n]), 1)
		exts := []readio.Extent{good, bad, later}
		for i := range exts {
			exts[i].Src = src
		}
		errs, _, err := readio.Read(context.Background(), cfg, exts, nil)
		if err != nil {
			t.Fatal(err)
		}
		if errs[0] != nil || !errors.Is(errs[1], readio.ErrCorrupt) {
			t.Fatalf("depth %d: errors %v, want nil and ErrCorrupt", depth, errs)
		}
		checkView(t, "good extent", gd, data[4096:4096+n])
		// The later extent of the failed group is skipped, unless it was
		// read before the failure was known (depth > 1): then it is whole.
		if errs[2] == nil {
			checkView(t, "later extent", ld, data[8192:8192+n])
		} else if !errors.Is(errs[2], readio.ErrSkipped) || depth == 1 && !bytes.Equal(ld.buf, bytes.Repeat([]byte{viewFill}, len(ld.buf))) {
			t.Fatalf("depth %d: later extent: %v", depth, errs[2])
		}
		src.Close()
	}
}

// TestReadViewFallsBack: a read into views on a file system that
// refuses O_DIRECT reads (EINVAL from the fault FS's ReadAt on the direct
// descriptor) switches to buffered reads and restores every byte.
func TestReadViewFallsBack(t *testing.T) {
	dir := testutil.DirectDir(t)
	rng := rand.New(rand.NewPCG(25, 26))
	path, data := randomFile(t, rng, dir, "f", 3*readio.ReadChunkBytes)
	cfg := &readio.Config{ReadDepth: 1}
	src, ffs := openRefusingDirect(t, cfg, path)
	d := randomViewDst(rng)
	for d.view.Bytes() > len(data) || d.view.RunElements()*2 < readio.MinRunBytes {
		d = randomViewDst(rng)
	}
	x := []readio.Extent{{Src: src, View: &d.view, Group: -1, Verify: readio.VerifyXXH3, XXH3: xxh3.Hash(data[:d.view.Bytes()])}}
	errs, _, err := readio.Read(context.Background(), cfg, x, nil)
	if err != nil || errs[0] != nil {
		t.Fatalf("%v %v", err, errs[0])
	}
	if len(ffs.Injected()) == 0 {
		t.Fatal("the refusal was never injected")
	}
	checkView(t, "after the fallback", d, data[:d.view.Bytes()])
	if src.Direct() {
		t.Fatal("the source still reads with O_DIRECT after a refusal")
	}
}
