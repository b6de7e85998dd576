package gather

import (
	"bytes"
	"errors"
	"math/rand/v2"
	"slices"
	"testing"
)

// refOverlaps reports whether two logical elements of v start at the same
// byte: the naive overlap test (every element has ItemSize bytes, so
// distinct starts mean disjoint bytes).
func refOverlaps(v View) bool {
	seen := map[int]bool{}
	for _, o := range refOffsets(v) {
		if seen[o] {
			return true
		}
		seen[o] = true
	}
	return false
}

// refScatter writes src into elements [start, start+count) of a copy of
// v.Base, element by element, and returns the copy.
func refScatter(v View, start, count int, src []byte) []byte {
	out := slices.Clone(v.Base)
	offs := refOffsets(v)
	for e := range count {
		copy(out[offs[start+e]:offs[start+e]+v.ItemSize], src[e*v.ItemSize:(e+1)*v.ItemSize])
	}
	return out
}

// TestScatterMatchesReference: on random views (padded, transposed,
// broadcast, reversed, arbitrary strides) and random ranges, ScatterRange
// writes exactly the bytes the element-by-element reference writes, and
// refuses every view whose elements overlap (and, conservatively, a few
// that do not).
func TestScatterMatchesReference(t *testing.T) {
	rng := rand.New(rand.NewPCG(12, 34))
	accepted, refusedDisjoint, overlapping := 0, 0, 0
	for iter := range 20000 {
		v := randomView(rng)
		if err := v.Validate(); err != nil {
			t.Fatalf("iter %d: randomView built an invalid view: %v", iter, err)
		}
		n := v.Elements()
		start := rng.IntN(n + 1)
		count := rng.IntN(n - start + 1)
		if rng.IntN(4) == 0 {
			start, count = 0, n
		}
		src := make([]byte, count*v.ItemSize)
		for i := range src {
			src[i] = byte(rng.Uint32())
		}
		want := refScatter(v, start, count, src)
		got := View{Base: slices.Clone(v.Base), Offset: v.Offset, Shape: v.Shape, Strides: v.Strides, ItemSize: v.ItemSize}
		err := got.ScatterRange(start, count, src)
		over := n > 0 && refOverlaps(v)
		switch {
		case over:
			overlapping++
			if !errors.Is(err, ErrOverlap) {
				t.Fatalf("iter %d: view %v/%v overlaps, ScatterRange returned %v", iter, v.Shape, v.Strides, err)
			}
			if !bytes.Equal(got.Base, v.Base) {
				t.Fatalf("iter %d: a refused scatter wrote to Base", iter)
			}
		case errors.Is(err, ErrOverlap):
			refusedDisjoint++ // conservative refusal: allowed, counted
			if !bytes.Equal(got.Base, v.Base) {
				t.Fatalf("iter %d: a refused scatter wrote to Base", iter)
			}
		case err != nil:
			t.Fatalf("iter %d: ScatterRange(%d, %d) on %v/%v: %v", iter, start, count, v.Shape, v.Strides, err)
		default:
			accepted++
			if !bytes.Equal(got.Base, want) {
				t.Fatalf("iter %d: ScatterRange(%d, %d) on shape %v strides %v item %d differs from the reference", iter, start, count, v.Shape, v.Strides, v.ItemSize)
			}
			// Round trip: gathering the range gives src back.
			back, _, err := got.GatherRange(start, count, make([]byte, len(src)))
			if err != nil || !bytes.Equal(back, src) {
				t.Fatalf("iter %d: gather after scatter: %v", iter, err)
			}
			// RunsRange pieces, filled in order from src, write the same.
			rv := View{Base: slices.Clone(v.Base), Offset: v.Offset, Shape: v.Shape, Strides: v.Strides, ItemSize: v.ItemSize}
			w := 0
			if err := rv.RunsRange(start, count, func(p []byte) error {
				if cap(p) != len(p) || len(p) == 0 {
					t.Fatalf("iter %d: piece len %d cap %d", iter, len(p), cap(p))
				}
				w += copy(p, src[w:])
				return nil
			}); err != nil {
				t.Fatalf("iter %d: RunsRange: %v", iter, err)
			}
			if w != len(src) || !bytes.Equal(rv.Base, want) {
				t.Fatalf("iter %d: RunsRange pieces cover %d of %d bytes or differ from the reference", iter, w, len(src))
			}
		}
	}
	if accepted < 10000 || overlapping < 500 {
		t.Fatalf("the random views exercised too little: %d accepted, %d overlapping, %d disjoint refused", accepted, overlapping, refusedDisjoint)
	}
	t.Logf("%d accepted, %d overlapping refused, %d disjoint refused (conservative)", accepted, overlapping, refusedDisjoint)
}

// A capacity-padded KV buffer [1, heads, cap, dim]: scattering a token
// range writes exactly those tokens of every head and nothing else, and
// RunsRange hands out one piece per head of the range's tokens.
func TestScatterPaddedTokens(t *testing.T) {
	const heads, capT, dim, item = 3, 10, 4, 2
	base := make([]byte, heads*capT*dim*item)
	for i := range base {
		base[i] = 0xee
	}
	full := View{Base: base, Shape: []int{1, heads, capT, dim}, Strides: RowMajor([]int{1, heads, capT, dim}), ItemSize: item}
	var shp [4]int
	sub, err := full.SliceAxis(2, 4, 7, shp[:])
	if err != nil {
		t.Fatal(err)
	}
	src := make([]byte, sub.Bytes())
	for i := range src {
		src[i] = byte(i)
	}
	if err := sub.Scatter(src); err != nil {
		t.Fatal(err)
	}
	for h := range heads {
		for tok := range capT {
			for d := range dim * item {
				got := base[(h*capT+tok)*dim*item+d]
				want := byte(0xee)
				if tok >= 4 && tok < 7 {
					want = byte(((h*3+tok-4)*dim*item + d))
				}
				if got != want {
					t.Fatalf("head %d token %d byte %d = %#x, want %#x", h, tok, d, got, want)
				}
			}
		}
	}
	var pieces []int
	if err := sub.RunsRange(0, sub.Elements(), func(p []byte) error { pieces = append(pieces, len(p)); return nil }); err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(pieces, []int{3 * dim * item, 3 * dim * item, 3 * dim * item}) {
		t.Fatalf("pieces %v, want one of %d bytes per head", pieces, 3*dim*item)
	}
}

func TestScatterErrors(t *testing.T) {
	v := View{Base: make([]byte, 16), Shape: []int{2, 4}, Strides: []int{4, 1}, ItemSize: 2}
	if err := v.ScatterRange(0, 8, make([]byte, 15)); !errors.Is(err, ErrScratch) {
		t.Errorf("short source: %v", err)
	}
	if err := v.ScatterRange(0, 8, make([]byte, 17)); !errors.Is(err, ErrScratch) {
		t.Errorf("long source: %v", err)
	}
	if err := v.ScatterRange(6, 3, make([]byte, 6)); !errors.Is(err, ErrOutOfBounds) {
		t.Errorf("range past the end: %v", err)
	}
	if err := v.ScatterRange(-1, 1, make([]byte, 2)); !errors.Is(err, ErrOutOfBounds) {
		t.Errorf("negative start: %v", err)
	}
	bad := View{Base: make([]byte, 15), Shape: []int{2, 4}, Strides: []int{4, 1}, ItemSize: 2}
	if err := bad.Scatter(make([]byte, 16)); !errors.Is(err, ErrOutOfBounds) {
		t.Errorf("base too short: %v", err)
	}
	bc := View{Base: make([]byte, 8), Shape: []int{2, 4}, Strides: []int{0, 1}, ItemSize: 2}
	if err := bc.Scatter(make([]byte, 16)); !errors.Is(err, ErrOverlap) {
		t.Errorf("broadcast destination: %v", err)
	}
	if err := bc.RunsRange(0, 8, func([]byte) error { return nil }); !errors.Is(err, ErrOverlap) {
		t.Errorf("RunsRange on a broadcast view: %v", err)
	}
	var shp [2]int
	if _, err := v.SliceAxis(2, 0, 1, shp[:]); !errors.Is(err, ErrRank) {
		t.Errorf("SliceAxis axis 2: %v", err)
	}
	if _, err := v.SliceAxis(1, 3, 5, shp[:]); !errors.Is(err, ErrOutOfBounds) {
		t.Errorf("SliceAxis past the end: %v", err)
	}
	stop := errors.New("stop")
	if err := v.RunsRange(0, 8, func([]byte) error { return stop }); err != stop {
		t.Errorf("fn's error: %v", err)
	}
}

func TestScatterZeroAllocs(t *testing.T) {
	base := make([]byte, 2*8*16*4*2)
	v := View{Base: base, Shape: []int{2, 8, 4}, Strides: []int{16 * 4, 4, 1}, ItemSize: 2}
	var shp [3]int
	src := make([]byte, 2*3*4*2)
	fn := func([]byte) error { return nil }
	n := testing.AllocsPerRun(100, func() {
		sub, _ := v.SliceAxis(1, 2, 5, shp[:])
		if err := sub.Scatter(src); err != nil {
			panic(err)
		}
		if err := sub.RunsRange(0, sub.Elements(), fn); err != nil {
			panic(err)
		}
	})
	if n != 0 {
		t.Fatalf("SliceAxis+Scatter+RunsRange allocate %v times", n)
	}
}

// FuzzScatter: any view and range either fails with a documented sentinel
// and writes nothing, or writes exactly what the reference writes.
func FuzzScatter(f *testing.F) {
	f.Add([]byte{4, 1, 2, 5, 4, 64, 32, 8, 2}, 0, uint16(160), uint8(2), uint16(3), uint16(17))
	f.Add([]byte{2, 3, 4, 2, 6}, 0, uint16(48), uint8(3), uint16(0), uint16(12))
	f.Add([]byte{2, 2, 4, 0, 2}, 0, uint16(16), uint8(2), uint16(0), uint16(8))
	f.Fuzz(func(t *testing.T, data []byte, offset int, baseLen uint16, itemSel uint8, start, count uint16) {
		v := decodeView(data, offset, baseLen, itemSel)
		orig := slices.Clone(v.Base)
		verr := v.Validate()
		n := 0
		if verr == nil {
			n = v.Elements()
			if n > 1<<16 {
				return // the reference would be slow
			}
		}
		st, ct := int(start), int(count)
		srcLen := max(0, ct) * max(0, v.ItemSize)
		if srcLen > 1<<20 {
			return
		}
		src := make([]byte, srcLen)
		for i := range src {
			src[i] = byte(i*7 + 1)
		}
		err := v.ScatterRange(st, ct, src)
		if err != nil {
			known := false
			for _, s := range []error{ErrRank, ErrNegativeDim, ErrItemSize, ErrOverflow, ErrOutOfBounds, ErrScratch, ErrOverlap} {
				known = known || errors.Is(err, s)
			}
			if !known {
				t.Fatalf("undocumented error %v", err)
			}
			if !bytes.Equal(v.Base, orig) {
				t.Fatal("a failed scatter wrote to Base")
			}
			if verr == nil && n > 0 && st+ct <= n && !refOverlaps(v) && !errors.Is(err, ErrOverlap) && !errors.Is(err, ErrOutOfBounds) && !errors.Is(err, ErrScratch) {
				t.Fatalf("valid disjoint view refused: %v", err)
			}
			return
		}
		if verr != nil {
			t.Fatalf("invalid view (%v) accepted", verr)
		}
		if n > 0 && refOverlaps(v) {
			t.Fatal("overlapping view accepted")
		}
		want := refScatter(View{Base: orig, Offset: v.Offset, Shape: v.Shape, Strides: v.Strides, ItemSize: v.ItemSize}, st, ct, src)
		if !bytes.Equal(v.Base, want) {
			t.Fatal("scatter differs from the reference")
		}
	})
}
