package gather

import (
	"bytes"
	"errors"
	"math"
	"math/rand/v2"
	"slices"
	"testing"
	"unsafe"
)

// aliases reports whether out starts at base[at].
func aliases(out, base []byte, at int) bool {
	return len(out) > 0 && at < len(base) && unsafe.SliceData(out) == &base[at]
}

// checkRange verifies one GatherRange result against the reference.
func checkRange(t *testing.T, v View, offs []int, ref []byte, run, start, count int, out []byte, copied bool, err error, dst []byte) {
	t.Helper()
	if err != nil {
		t.Fatalf("view %+v range [%d,+%d): %v", v, start, count, err)
	}
	want := ref[start*v.ItemSize : (start+count)*v.ItemSize]
	if !bytes.Equal(out, want) {
		t.Fatalf("view shape %v strides %v off %d item %d range [%d,+%d): got %x want %x", v.Shape, v.Strides, v.Offset, v.ItemSize, start, count, out, want)
	}
	if out == nil {
		t.Fatalf("range [%d,+%d): nil slice", start, count)
	}
	oneRun := count == 0 || start%run+count <= run
	if copied == oneRun {
		t.Fatalf("view shape %v strides %v range [%d,+%d) run %d: copied=%v, want %v", v.Shape, v.Strides, start, count, run, copied, !oneRun)
	}
	if count == 0 {
		return
	}
	if !copied {
		if !aliases(out, v.Base, offs[start]) {
			t.Fatalf("range [%d,+%d): zero-copy result does not start at Base[%d]", start, count, offs[start])
		}
		if cap(out) != len(out) {
			t.Fatalf("range [%d,+%d): zero-copy cap %d != len %d", start, count, cap(out), len(out))
		}
	} else if !aliases(out, dst, 0) {
		t.Fatalf("range [%d,+%d): copied result does not start at dst[0]", start, count)
	}
}

func TestGatherMatchesReference(t *testing.T) {
	defer func(old int) { reorderMinRunBytes = old }(reorderMinRunBytes)
	for _, c := range []struct {
		name    string
		reorder int
		seed    uint64
		iters   int
	}{
		{"default", reorderMinRunBytes, 1, 4000},
		{"always-source-order", 0, 2, 1500},
		{"never-source-order", math.MaxInt, 3, 1500},
	} {
		t.Run(c.name, func(t *testing.T) {
			reorderMinRunBytes = c.reorder
			checkRandomViews(t, c.seed, c.iters)
		})
	}
}

func checkRandomViews(t *testing.T, seed uint64, iters int) {
	rng := rand.New(rand.NewPCG(seed, 2))
	if testing.Short() {
		iters = min(iters, 500)
	}
	var zeroCopies, copies int
	for it := 0; it < iters; it++ {
		v := randomView(rng)
		if err := v.Validate(); err != nil {
			t.Fatalf("random view %+v invalid: %v", v, err)
		}
		offs := refOffsets(v)
		ref := refBytes(v)
		n := len(offs)
		if v.Elements() != n || v.Bytes() != n*v.ItemSize {
			t.Fatalf("Elements %d Bytes %d, want %d %d", v.Elements(), v.Bytes(), n, n*v.ItemSize)
		}
		run := refRun(v.Shape, v.Strides)
		if got := v.RunElements(); got != run {
			t.Fatalf("shape %v strides %v: RunElements %d want %d", v.Shape, v.Strides, got, run)
		}
		// Sanity of the reference itself: each run is contiguous memory.
		for e := 1; e < n; e++ {
			if e%run != 0 && offs[e] != offs[e-1]+v.ItemSize {
				t.Fatalf("reference run %d not contiguous at %d", run, e)
			}
		}
		if got, want := v.IsContiguous(), refContiguous(v); got != want {
			t.Fatalf("shape %v strides %v: IsContiguous %v want %v", v.Shape, v.Strides, got, want)
		}

		// Whole gather; dst poisoned to catch partial writes.
		dst := bytes.Repeat([]byte{0xA5}, n*v.ItemSize+3)
		out, copied, err := v.Gather(dst)
		checkRange(t, v, offs, ref, run, 0, n, out, copied, err, dst)
		if copied {
			copies++
		} else {
			zeroCopies++
		}

		// Ranges: all of them for small views, a sample otherwise.
		type rg struct{ s, c int }
		var ranges []rg
		if n <= 40 {
			for s := 0; s <= n; s++ {
				for c := 0; c <= n-s; c++ {
					ranges = append(ranges, rg{s, c})
				}
			}
		} else {
			for range 150 {
				s := rng.IntN(n + 1)
				ranges = append(ranges, rg{s, rng.IntN(n - s + 1)})
			}
			for k := 0; k*run < n && k < 20; k++ { // run-aligned edges
				ranges = append(ranges, rg{k * run, min(run, n-k*run)}, rg{k * run, min(run+1, n-k*run)})
			}
		}
		for _, r := range ranges {
			out, copied, err := v.GatherRange(r.s, r.c, dst)
			checkRange(t, v, offs, ref, run, r.s, r.c, out, copied, err, dst)
			if copied && r.c > 0 {
				// One byte less scratch must be refused.
				if _, _, err := v.GatherRange(r.s, r.c, dst[:r.c*v.ItemSize-1]); !errors.Is(err, ErrScratch) {
					t.Fatalf("short scratch: err %v, want ErrScratch", err)
				}
			}
		}

		// Blocks.
		bb := []int{1, 2, 3, 5, 8, 16, 24, 64, 100, 256, 4096}[rng.IntN(11)]
		p, err := NewPlan(v.Shape, v.ItemSize, bb)
		if err != nil {
			t.Fatal(err)
		}
		segs := refSegments(v.Shape, v.ItemSize, bb)
		if p.Len() != len(segs) {
			t.Fatalf("shape %v item %d bb %d: Len %d want %d", v.Shape, v.ItemSize, bb, p.Len(), len(segs))
		}
		maxB := 0
		for _, s := range segs {
			maxB = max(maxB, s[1]*v.ItemSize)
		}
		if p.MaxBlockBytes() != maxB {
			t.Fatalf("MaxBlockBytes %d want %d", p.MaxBlockBytes(), maxB)
		}
		scratch := make([]byte, p.MaxBlockBytes())
		for i, s := range segs {
			start, count := p.Block(i)
			if start != s[0] || count != s[1] {
				t.Fatalf("shape %v bb %d block %d: (%d,%d) want (%d,%d)", v.Shape, bb, i, start, count, s[0], s[1])
			}
			out, copied, err := v.Block(p, i, scratch)
			checkRange(t, v, offs, ref, run, start, count, out, copied, err, scratch)
		}
	}
	t.Logf("%d views: %d whole gathers zero-copy, %d copied", iters, zeroCopies, copies)
	if zeroCopies < iters/10 || copies < iters/10 {
		t.Fatalf("generator imbalance: %d zero-copy, %d copied", zeroCopies, copies)
	}
}

// TestCoalescedOuterAxes pins cases whose outer axes merge (and one whose
// consecutive runs happen to be adjacent in memory but must still be copied,
// because the JS rule only looks at the run suffix).
func TestCoalescedOuterAxes(t *testing.T) {
	base := make([]byte, 4096)
	for i := range base {
		base[i] = byte(i * 7)
	}
	cases := []View{
		{Base: base, Shape: []int{3, 4, 5}, Strides: []int{4 * 9, 9, 1}, ItemSize: 2},               // outer 3x4 merge
		{Base: base, Shape: []int{2, 3, 4, 5}, Strides: []int{3 * 4 * 7, 4 * 7, 7, 1}, ItemSize: 1}, // all outer merge
		{Base: base, Shape: []int{2, 2, 3}, Strides: []int{3, 0, 1}, ItemSize: 4},                   // runs adjacent across carry
		{Base: base, Shape: []int{4, 1, 3, 2}, Strides: []int{0, 999, 0, 1}, ItemSize: 2},           // broadcast merge, size-1 axis
	}
	for _, v := range cases {
		offs, ref, run := refOffsets(v), refBytes(v), refRun(v.Shape, v.Strides)
		dst := make([]byte, len(ref))
		n := len(offs)
		for s := 0; s <= n; s++ {
			for c := 0; c <= n-s; c++ {
				out, copied, err := v.GatherRange(s, c, dst)
				checkRange(t, v, offs, ref, run, s, c, out, copied, err, dst)
			}
		}
	}
	// The adjacent-runs case: elements [3,9) are contiguous in memory yet
	// span two runs of 3, so they are copied, as JS segments would.
	v := cases[2]
	if _, copied, _ := v.GatherRange(3, 6, make([]byte, 24)); !copied {
		t.Fatal("range spanning two runs must be copied")
	}
}

func TestGatherExamples(t *testing.T) {
	// [2,3] int16 padded to 4 columns: rows 0..2 and 4..6 of an 8-element buffer.
	base := []byte{0, 1, 2, 3, 4, 5, 99, 99, 6, 7, 8, 9, 10, 11, 99, 99}
	v := View{Base: base, Shape: []int{2, 3}, Strides: []int{4, 1}, ItemSize: 2}
	out, copied, err := v.Gather(make([]byte, 12))
	if err != nil || !copied || !bytes.Equal(out, []byte{0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11}) {
		t.Fatalf("padded gather = %v %v %v", out, copied, err)
	}
	// Elements 1..2 lie in row 0: zero-copy at byte 2.
	out, copied, err = v.GatherRange(1, 2, nil)
	if err != nil || copied || !bytes.Equal(out, []byte{2, 3, 4, 5}) || !aliases(out, base, 2) || cap(out) != 4 {
		t.Fatalf("range = %v %v %v", out, copied, err)
	}
	// Reversed rows (negative stride), element zero at byte 8.
	v = View{Base: base, Offset: 8, Shape: []int{2, 3}, Strides: []int{-4, 1}, ItemSize: 2}
	out, _, err = v.Gather(make([]byte, 12))
	if err != nil || !bytes.Equal(out, []byte{6, 7, 8, 9, 10, 11, 0, 1, 2, 3, 4, 5}) {
		t.Fatalf("reversed gather = %v %v", out, err)
	}
	// Contiguous view with an offset: zero-copy, cap capped.
	v = View{Base: base, Offset: 8, Shape: []int{3}, Strides: []int{1}, ItemSize: 2}
	out, copied, err = v.Gather(nil)
	if err != nil || copied || !aliases(out, base, 8) || len(out) != 6 || cap(out) != 6 {
		t.Fatalf("contiguous gather = %v %v %v", out, copied, err)
	}
	// Rank 0: one element.
	v = View{Base: base, Offset: 3, ItemSize: 2}
	out, copied, err = v.Gather(nil)
	if err != nil || copied || !bytes.Equal(out, []byte{3, 4}) || v.Elements() != 1 || !v.IsContiguous() {
		t.Fatalf("scalar gather = %v %v %v", out, copied, err)
	}
	// Zero elements: valid whatever Base/Offset, empty non-nil result.
	v = View{Base: nil, Offset: 12345, Shape: []int{0, 5}, Strides: []int{999, -7}, ItemSize: 2}
	if err := v.Validate(); err != nil {
		t.Fatal(err)
	}
	out, copied, err = v.Gather(nil)
	if err != nil || copied || out == nil || len(out) != 0 || v.RunElements() != 1 || !v.IsContiguous() {
		t.Fatalf("empty gather = %v %v %v", out, copied, err)
	}
}

func TestRowMajor(t *testing.T) {
	if got := RowMajor([]int{2, 3, 4}); !slices.Equal(got, []int{12, 4, 1}) {
		t.Fatal(got)
	}
	if got := RowMajor(nil); got == nil || len(got) != 0 {
		t.Fatal(got)
	}
	if got := RowMajor([]int{5, 0, 3}); !slices.Equal(got, []int{0, 3, 1}) {
		t.Fatal(got)
	}
}

func TestRunElements(t *testing.T) {
	cases := []struct {
		shape, strides []int
		run            int
	}{
		{[]int{1, 8, 8192, 128}, []int{8 * 8448 * 128, 8448 * 128, 128, 1}, 8192 * 128},
		{[]int{1, 8, 8192, 128}, []int{8192 * 8 * 128, 128, 8 * 128, 1}, 128},
		{[]int{2, 3}, []int{3, 1}, 6},
		{[]int{2, 1, 3}, []int{3, 77, 1}, 6}, // size-1 axis ignored whatever its stride
		{[]int{3}, []int{-1}, 1},
		{[]int{3}, []int{0}, 1},
		{[]int{1, 1}, []int{0, 0}, 1},
		{nil, nil, 1},
	}
	for _, c := range cases {
		v := View{Shape: c.shape, Strides: c.strides, ItemSize: 2}
		if got := v.RunElements(); got != c.run {
			t.Errorf("shape %v strides %v: run %d want %d", c.shape, c.strides, got, c.run)
		}
	}
}

func TestValidateErrors(t *testing.T) {
	base := make([]byte, 24)
	cases := []struct {
		name string
		v    View
		want error
	}{
		{"rank", View{Base: base, Shape: []int{2, 3}, Strides: []int{3}, ItemSize: 4}, ErrRank},
		{"negative dim", View{Base: base, Shape: []int{2, -1}, Strides: []int{3, 1}, ItemSize: 4}, ErrNegativeDim},
		{"negative dim beats zero", View{Shape: []int{0, -1}, Strides: []int{3, 1}, ItemSize: 4}, ErrNegativeDim},
		{"item size 0", View{Base: base, Shape: []int{2}, Strides: []int{1}, ItemSize: 0}, ErrItemSize},
		{"item size negative", View{Base: base, Shape: []int{2}, Strides: []int{1}, ItemSize: -2}, ErrItemSize},
		{"element count overflow", View{Base: base, Shape: []int{1 << 40, 1 << 40}, Strides: []int{0, 0}, ItemSize: 1}, ErrOverflow},
		{"byte size overflow", View{Base: base, Shape: []int{1 << 61}, Strides: []int{0}, ItemSize: 8}, ErrOverflow},
		{"axis extent overflow", View{Base: base, Shape: []int{3}, Strides: []int{math.MaxInt/2 + 1}, ItemSize: 1}, ErrOverflow},
		{"extent sum overflow", View{Base: base, Shape: []int{2, 2}, Strides: []int{math.MaxInt, math.MaxInt}, ItemSize: 1}, ErrOverflow},
		{"negative extent overflow", View{Base: base, Shape: []int{2, 2}, Strides: []int{math.MinInt, -1}, ItemSize: 1}, ErrOverflow},
		{"span overflow", View{Base: base, Shape: []int{2, 2}, Strides: []int{math.MaxInt/2 + 1, -(math.MaxInt/2 + 1)}, ItemSize: 1}, ErrOverflow},
		{"lowest extent MinInt", View{Base: base, Shape: []int{2}, Strides: []int{math.MinInt}, ItemSize: 1}, ErrOverflow},
		{"extent bytes overflow", View{Base: base, Shape: []int{2}, Strides: []int{math.MaxInt / 2}, ItemSize: 4}, ErrOverflow},
		{"one byte short", View{Base: base[:23], Shape: []int{2, 3}, Strides: []int{3, 1}, ItemSize: 4}, ErrOutOfBounds},
		{"offset pushes past end", View{Base: base, Offset: 1, Shape: []int{2, 3}, Strides: []int{3, 1}, ItemSize: 4}, ErrOutOfBounds},
		{"offset negative", View{Base: base, Offset: -1, Shape: []int{1}, Strides: []int{1}, ItemSize: 1}, ErrOutOfBounds},
		{"offset past base", View{Base: base, Offset: 25, Shape: nil, Strides: nil, ItemSize: 1}, ErrOutOfBounds},
		{"negative stride below base", View{Base: base, Offset: 1, Shape: []int{3}, Strides: []int{-1}, ItemSize: 1}, ErrOutOfBounds},
		{"padding row past end", View{Base: base, Shape: []int{2, 3}, Strides: []int{10, 1}, ItemSize: 2}, ErrOutOfBounds},
		{"huge stride out of bounds", View{Base: base, Shape: []int{2}, Strides: []int{math.MaxInt / 8}, ItemSize: 2}, ErrOutOfBounds},
	}
	sentinels := []error{ErrRank, ErrNegativeDim, ErrItemSize, ErrOverflow, ErrOutOfBounds, ErrScratch, ErrBlockBytes}
	for _, c := range cases {
		err := c.v.Validate()
		if !errors.Is(err, c.want) {
			t.Errorf("%s: err %v, want %v", c.name, err, c.want)
			continue
		}
		for _, s := range sentinels {
			if s != c.want && errors.Is(err, s) {
				t.Errorf("%s: err %v also matches %v", c.name, err, s)
			}
		}
		if len(err.Error()) < len("gather: ")+len(c.want.Error())+4 || err.Error()[:8] != "gather: " {
			t.Errorf("%s: message %q lacks prefix/details", c.name, err)
		}
		// Every entry point reports the same error, without panicking.
		if _, _, err2 := c.v.Gather(make([]byte, 64)); !errors.Is(err2, c.want) {
			t.Errorf("%s: Gather err %v", c.name, err2)
		}
		if _, _, err2 := c.v.GatherRange(0, 0, nil); !errors.Is(err2, c.want) {
			t.Errorf("%s: GatherRange err %v", c.name, err2)
		}
		var p Plan
		if _, _, err2 := c.v.Block(p, 0, nil); !errors.Is(err2, c.want) {
			t.Errorf("%s: Block err %v", c.name, err2)
		}
	}
	// The boundary cases just inside are valid.
	ok := []View{
		{Base: base, Shape: []int{2, 3}, Strides: []int{3, 1}, ItemSize: 4},
		{Base: base, Offset: 2, Shape: []int{3}, Strides: []int{-1}, ItemSize: 1},
		{Base: base, Offset: 24, Shape: []int{5, 0}, Strides: []int{1, 1}, ItemSize: 1},
		{Base: base, Offset: 23, ItemSize: 1},
		{Base: base, Shape: []int{1 << 62}, Strides: []int{0}, ItemSize: 1}, // broadcast: huge but addresses one byte
	}
	for _, v := range ok {
		if err := v.Validate(); err != nil {
			t.Errorf("%+v: %v", v, err)
		}
	}
}

func TestGatherRangeErrors(t *testing.T) {
	base := make([]byte, 64)
	v := View{Base: base, Shape: []int{2, 3}, Strides: []int{4, 1}, ItemSize: 2}
	for _, r := range [][2]int{{-1, 1}, {0, -1}, {7, 0}, {6, 1}, {1, 6}, {1, math.MaxInt}, {math.MaxInt, 1}} {
		if _, _, err := v.GatherRange(r[0], r[1], make([]byte, 64)); !errors.Is(err, ErrOutOfBounds) {
			t.Errorf("range %v: err %v", r, err)
		}
	}
	if out, copied, err := v.GatherRange(6, 0, nil); err != nil || copied || out == nil || len(out) != 0 {
		t.Errorf("empty range at end: %v %v %v", out, copied, err)
	}
	if _, _, err := v.Gather(make([]byte, 11)); !errors.Is(err, ErrScratch) {
		t.Errorf("short scratch: %v", err)
	}
	if _, _, err := v.GatherRange(2, 2, make([]byte, 3)); !errors.Is(err, ErrScratch) {
		t.Errorf("short dst across rows: %v", err)
	}
	// Zero-copy ranges need no scratch at all.
	if _, copied, err := v.GatherRange(3, 3, nil); err != nil || copied {
		t.Errorf("zero-copy with nil dst: %v %v", copied, err)
	}
}

func TestPlanArithmetic(t *testing.T) {
	// [1,2,40,8] bf16, 256-byte blocks: limit 128 elements; a head is
	// 40*8 = 320 elements = 640 bytes -> blocks of 128,128,64 elements =
	// 256,256,128 bytes, twice.
	p, err := NewPlan([]int{1, 2, 40, 8}, 2, 256)
	if err != nil {
		t.Fatal(err)
	}
	want := [][2]int{{0, 128}, {128, 128}, {256, 64}, {320, 128}, {448, 128}, {576, 64}}
	if p.Len() != len(want) {
		t.Fatalf("Len %d", p.Len())
	}
	for i, w := range want {
		if s, c := p.Block(i); s != w[0] || c != w[1] {
			t.Errorf("block %d = (%d,%d) want %v", i, s, c, w)
		}
	}
	var sizes []int
	for i := range p.Len() {
		_, c := p.Block(i)
		sizes = append(sizes, c*2)
	}
	if !slices.Equal(sizes, []int{256, 256, 128, 256, 256, 128}) {
		t.Errorf("block bytes %v", sizes)
	}
	if p.MaxBlockBytes() != 256 {
		t.Errorf("MaxBlockBytes %d", p.MaxBlockBytes())
	}

	// [40] int32, 256-byte blocks: limit 64 elements > row of 40 -> one
	// 160-byte block.
	p, err = NewPlan([]int{40}, 4, 256)
	if err != nil {
		t.Fatal(err)
	}
	if s, c := p.Block(0); p.Len() != 1 || s != 0 || c != 40 || p.MaxBlockBytes() != 160 {
		t.Errorf("[40] int32: Len %d block (%d,%d) max %d", p.Len(), s, c, p.MaxBlockBytes())
	}

	// blockBytes smaller than an item: one element per block.
	p, _ = NewPlan([]int{3, 2}, 8, 5)
	if p.Len() != 6 || p.MaxBlockBytes() != 8 {
		t.Errorf("tiny blocks: Len %d max %d", p.Len(), p.MaxBlockBytes())
	}
	// Rank 0: one element, row 1.
	p, _ = NewPlan(nil, 2, 1024)
	if s, c := p.Block(0); p.Len() != 1 || s != 0 || c != 1 || p.MaxBlockBytes() != 2 {
		t.Errorf("rank 0: Len %d (%d,%d)", p.Len(), s, c)
	}
	// Zero elements: no blocks.
	p, _ = NewPlan([]int{4, 0, 8}, 2, 64)
	if p.Len() != 0 || p.MaxBlockBytes() != 0 {
		t.Errorf("empty: Len %d max %d", p.Len(), p.MaxBlockBytes())
	}
	// Large: 1 GiB-scale shape, O(1) block lookup of the very last block.
	p, _ = NewPlan([]int{1, 32, 131072, 128}, 2, 1<<20)
	// row = 131072*128 elements = 32 MiB; 32 blocks per row, 1024 blocks.
	if s, c := p.Block(1023); p.Len() != 1024 || s != 31*131072*128+31*524288 || c != 524288 {
		t.Errorf("large: Len %d last (%d,%d)", p.Len(), s, c)
	}

	// Errors.
	for _, c := range []struct {
		shape    []int
		item, bb int
		want     error
	}{
		{[]int{4}, 2, 0, ErrBlockBytes},
		{[]int{4}, 2, -256, ErrBlockBytes},
		{[]int{4}, 0, 256, ErrItemSize},
		{[]int{4, -1}, 2, 256, ErrNegativeDim},
		{[]int{1 << 40, 1 << 40}, 2, 256, ErrOverflow},
		{[]int{1 << 62}, 4, 256, ErrOverflow},
	} {
		if _, err := NewPlan(c.shape, c.item, c.bb); !errors.Is(err, c.want) {
			t.Errorf("NewPlan(%v,%d,%d): %v want %v", c.shape, c.item, c.bb, err, c.want)
		}
	}
}

func TestPlanBlockPanicsOutOfRange(t *testing.T) {
	p, _ := NewPlan([]int{4}, 1, 2)
	for _, i := range []int{-1, 2, math.MaxInt} {
		func() {
			defer func() {
				if recover() == nil {
					t.Errorf("Block(%d) did not panic", i)
				}
			}()
			p.Block(i)
		}()
	}
}

func TestViewBlockErrors(t *testing.T) {
	base := make([]byte, 64)
	v := View{Base: base, Shape: []int{2, 4}, Strides: []int{8, 1}, ItemSize: 2}
	p, _ := NewPlan([]int{2, 4}, 2, 4)
	if _, _, err := v.Block(p, p.Len(), nil); !errors.Is(err, ErrOutOfBounds) {
		t.Errorf("index past end: %v", err)
	}
	if _, _, err := v.Block(p, -1, nil); !errors.Is(err, ErrOutOfBounds) {
		t.Errorf("negative index: %v", err)
	}
	q, _ := NewPlan([]int{4, 2}, 2, 4)
	if _, _, err := v.Block(q, 0, nil); !errors.Is(err, ErrRank) {
		t.Errorf("other shape: %v", err)
	}
	q, _ = NewPlan([]int{2, 4, 1}, 2, 4)
	if _, _, err := v.Block(q, 0, nil); !errors.Is(err, ErrRank) {
		t.Errorf("other rank: %v", err)
	}
	q, _ = NewPlan([]int{2, 4}, 4, 8)
	if _, _, err := v.Block(q, 0, nil); !errors.Is(err, ErrItemSize) {
		t.Errorf("other item size: %v", err)
	}
	// Transposed view: blocks need copies; scratch one byte short fails.
	v = View{Base: base, Shape: []int{2, 4}, Strides: []int{1, 2}, ItemSize: 2}
	if _, _, err := v.Block(p, 0, make([]byte, p.MaxBlockBytes()-1)); !errors.Is(err, ErrScratch) {
		t.Errorf("short scratch: %v", err)
	}
}

// TestGrowthKeepsFullBlocks: a capacity-padded cache grown from T=40 to
// T=48 tokens yields byte-identical earlier full blocks per head (content,
// not just ranges), for a head-major and a token-major physical layout.
func TestGrowthKeepsFullBlocks(t *testing.T) {
	const heads, capT, dim, item, bb = 2, 64, 8, 2, 256
	rng := rand.New(rand.NewPCG(7, 8))
	buf := make([]byte, heads*capT*dim*item)
	for i := range buf {
		buf[i] = byte(rng.Uint32())
	}
	headMajor := func(T int) View { // buffer [1, heads, capT, dim]
		return View{Base: buf, Shape: []int{1, heads, T, dim}, Strides: RowMajor([]int{1, heads, capT, dim}), ItemSize: item}
	}
	tokenMajor := func(T int) View { // buffer [1, capT, heads, dim]
		return View{Base: buf, Shape: []int{1, heads, T, dim}, Strides: []int{capT * heads * dim, dim, heads * dim, 1}, ItemSize: item}
	}
	for name, mk := range map[string]func(int) View{"head-major": headMajor, "token-major": tokenMajor} {
		blocks := func(T int) (out [][]byte, sizes []int) {
			v := mk(T)
			p, err := NewPlan(v.Shape, item, bb)
			if err != nil {
				t.Fatal(err)
			}
			scratch := make([]byte, p.MaxBlockBytes())
			for i := range p.Len() {
				b, _, err := v.Block(p, i, scratch)
				if err != nil {
					t.Fatal(err)
				}
				out = append(out, slices.Clone(b))
				sizes = append(sizes, len(b))
			}
			return
		}
		b40, s40 := blocks(40)
		b48, s48 := blocks(48)
		if !slices.Equal(s40, []int{256, 256, 128, 256, 256, 128}) || !slices.Equal(s48, []int{256, 256, 256, 256, 256, 256}) {
			t.Fatalf("%s: sizes %v / %v", name, s40, s48)
		}
		for _, i := range []int{0, 1, 3, 4} { // the full blocks of each head
			if !bytes.Equal(b40[i], b48[i]) {
				t.Errorf("%s: full block %d changed when growing 40 -> 48 tokens", name, i)
			}
		}
		if bytes.Equal(b40[2], b48[2][:128]) != true {
			t.Errorf("%s: partial block is not a prefix of the grown block", name)
		}
		// And the blocks concatenate to the packed tensor.
		want := refBytes(mk(48))
		if got := bytes.Join(b48, nil); !bytes.Equal(got, want) {
			t.Errorf("%s: blocks do not concatenate to the packed tensor", name)
		}
	}
}

func TestZeroAllocs(t *testing.T) {
	const T, capT = 64, 80
	buf := make([]byte, 8*capT*128*2)
	padded := View{Base: buf, Shape: []int{1, 8, T, 128}, Strides: []int{8 * capT * 128, capT * 128, 128, 1}, ItemSize: 2}
	tokenMajor := View{Base: buf, Shape: []int{1, 8, T, 128}, Strides: []int{capT * 8 * 128, 128, 8 * 128, 1}, ItemSize: 2}
	scratch := make([]byte, padded.Bytes())
	p, _ := NewPlan(padded.Shape, 2, 4096)
	var sink int
	cases := map[string]func(){
		"Validate":             func() { _ = padded.Validate() },
		"GatherRange zerocopy": func() { o, _, _ := padded.GatherRange(5, 100, scratch); sink += len(o) },
		"GatherRange copy":     func() { o, _, _ := padded.GatherRange(5, T*128, scratch); sink += len(o) },
		"Gather copy":          func() { o, _, _ := tokenMajor.Gather(scratch); sink += len(o) },
		"Block zerocopy":       func() { o, _, _ := padded.Block(p, 3, scratch); sink += len(o) },
		"Block copy":           func() { o, _, _ := tokenMajor.Block(p, 3, scratch); sink += len(o) },
		"empty range":          func() { o, _, _ := padded.GatherRange(7, 0, scratch); sink += len(o) },
	}
	for name, f := range cases {
		if a := testing.AllocsPerRun(100, f); a != 0 {
			t.Errorf("%s: %v allocs per call", name, a)
		}
	}
	_ = sink
}

// TestManyAxes: the largest possible number of surviving axes (every one of
// size 2, none coalescable) still works without allocation.
func TestManyAxes(t *testing.T) {
	const rank = 20 // 2^20 elements of 1 byte
	shape := make([]int, rank)
	strides := make([]int, rank)
	for i := range shape {
		shape[i] = 2
	}
	// Strides: powers of two but in reverse order (fully transposed).
	for i := range strides {
		strides[i] = 1 << i
	}
	buf := make([]byte, 1<<rank)
	for i := range buf {
		buf[i] = byte(i ^ i>>8 ^ i>>16)
	}
	v := View{Base: buf, Shape: shape, Strides: strides, ItemSize: 1}
	dst := make([]byte, len(buf))
	out, copied, err := v.Gather(dst)
	if err != nil || !copied {
		t.Fatal(err, copied)
	}
	if !bytes.Equal(out, refBytes(v)) {
		t.Fatal("mismatch")
	}
	// 62 axes of size 2 (2^62 elements) validate: broadcast (stride 0).
	big := View{Base: buf, Shape: make([]int, 62), Strides: make([]int, 62), ItemSize: 1}
	for i := range big.Shape {
		big.Shape[i] = 2
	}
	if err := big.Validate(); err != nil {
		t.Fatal(err)
	}
	// A range near the end: the odometer starts at a deep multi-index.
	o, copied, err := big.GatherRange(1<<62-5, 5, dst)
	if err != nil || !bytes.Equal(o, bytes.Repeat(buf[:1], 5)) || !copied {
		t.Fatal(err, o, copied)
	}
}
