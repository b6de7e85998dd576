package gather

import (
	"cmp"
	"errors"
	"fmt"
	"slices"
	"unsafe"
)

// Scatter is the inverse of gather: it writes logical (row-major) bytes
// into the elements of a strided view, e.g. the token range of a page into
// a capacity-padded KV buffer. It is the only part of this package that
// writes to View.Base.

// ErrOverlap: a view to be written (Scatter, ScatterRange, RunsRange) may
// address one byte through two elements, so what it would hold is
// ambiguous. The check is conservative (see CheckNoOverlap).
var ErrOverlap = errors.New("overlapping elements")

// CheckNoOverlap validates v (see Validate) and proves that no two of its
// elements share a byte: with the contiguous run and the outer axes sorted
// by the absolute value of their byte stride, each stride must be at least
// the extent, in bytes, that the run and every smaller-strided axis cover.
// Views that fail this test but whose elements are in fact disjoint (exotic
// interleavings such as shape [2, 3] with strides [5, 3]) are refused too:
// ErrOverlap. Broadcast (stride 0) axes of size > 1 always fail it. A view
// with zero elements passes. It does not allocate unless it fails.
func (v View) CheckNoOverlap() error {
	var l layout
	if err := v.compile(&l); err != nil {
		return err
	}
	return l.checkNoOverlap()
}

func (l *layout) checkNoOverlap() error {
	if l.elems == 0 {
		return nil
	}
	var abs [maxAxes]int
	var n [maxAxes]int
	for k := range l.nax {
		abs[k], n[k] = l.sb[k], l.n[k]
		if abs[k] < 0 {
			abs[k] = -abs[k]
		}
	}
	// Insertion sort by absolute stride (at most maxAxes entries).
	for i := 1; i < l.nax; i++ {
		for j := i; j > 0 && abs[j-1] > abs[j]; j-- {
			abs[j-1], abs[j] = abs[j], abs[j-1]
			n[j-1], n[j] = n[j], n[j-1]
		}
	}
	extent := l.runB
	for k := range l.nax {
		if abs[k] < extent {
			return fmt.Errorf("gather: %w: an axis of %d elements steps %d bytes, inside the %d bytes the smaller axes cover", ErrOverlap, n[k], abs[k], extent)
		}
		extent += (n[k] - 1) * abs[k] // <= the validated span: no overflow
	}
	return nil
}

// ScatterRange writes src, the ItemSize*count bytes of logical elements
// [start, start+count), into v.Base at those elements' places: afterwards
// GatherRange(start, count, ...) returns src's bytes. Bytes of Base that
// belong to no element of the range are not written.
//
// Errors (nothing is written): any Validate error; ErrOverlap (see
// CheckNoOverlap); ErrOutOfBounds when start < 0, count < 0 or start+count >
// Elements(); ErrScratch when len(src) != count*ItemSize. ScatterRange does
// not allocate on success.
func (v View) ScatterRange(start, count int, src []byte) error {
	var l layout
	if err := v.compile(&l); err != nil {
		return err
	}
	if err := l.checkNoOverlap(); err != nil {
		return err
	}
	if start < 0 || count < 0 || start > l.elems || count > l.elems-start {
		return fmt.Errorf("gather: %w: element range start %d count %d outside %d elements", ErrOutOfBounds, start, count, l.elems)
	}
	need := count * l.item
	if len(src) != need {
		return fmt.Errorf("gather: %w: source has %d bytes, %d elements of %d bytes need %d", ErrScratch, len(src), count, l.item, need)
	}
	if count == 0 {
		return nil
	}
	q := start / l.run
	r := start - q*l.run
	if count <= l.run-r {
		off := l.runOffset(q) + r*l.item
		copy(v.Base[off:off+need], src)
		return nil
	}
	l.copyRuns(v.Base, src, q, r, true)
	return nil
}

// Scatter writes src, all Bytes() bytes of v in logical order, into v:
// ScatterRange(0, Elements(), src).
func (v View) Scatter(src []byte) error {
	var l layout
	if err := v.compile(&l); err != nil {
		return err
	}
	return v.ScatterRange(0, l.elems, src)
}

// RunsRange calls fn, in logical order, with each contiguous piece of
// v.Base that holds logical elements [start, start+count): a sub-slice of
// Base with its capacity capped to its length, at most one run
// (RunElements()) long. The pieces' lengths sum to count*ItemSize. It is
// how a reader fills a strided destination without a copy: pread straight
// into each piece. fn's error stops the walk and is returned as is.
//
// Errors before fn is first called: any Validate error; ErrOverlap;
// ErrOutOfBounds for a range outside the view. RunsRange itself does not
// allocate.
func (v View) RunsRange(start, count int, fn func(piece []byte) error) error {
	var l layout
	if err := v.compile(&l); err != nil {
		return err
	}
	if err := l.checkNoOverlap(); err != nil {
		return err
	}
	if start < 0 || count < 0 || start > l.elems || count > l.elems-start {
		return fmt.Errorf("gather: %w: element range start %d count %d outside %d elements", ErrOutOfBounds, start, count, l.elems)
	}
	for e, end := start, start+count; e < end; {
		q := e / l.run
		r := e - q*l.run
		n := min(l.run-r, end-e)
		off := l.runOffset(q) + r*l.item
		b := n * l.item
		if err := fn(v.Base[off : off+b : off+b]); err != nil {
			return err
		}
		e += n
	}
	return nil
}

// runOffset is the byte offset in Base of the first element of run q.
func (l *layout) runOffset(q int) int {
	off := l.origin
	for k := l.nax - 1; k >= 0; k-- {
		n := l.n[k]
		off += (q % n) * l.sb[k]
		q /= n
	}
	return off
}

// SliceAxis returns the view of elements [lo, hi) along axis ax of v (the
// other axes whole): same strides, Shape[ax] = hi-lo, Offset moved to the
// element with index lo on that axis. The result shares v's Shape only by
// copy into dst (len(dst) >= len(v.Shape), so that no allocation is
// needed); it is not validated (see Validate). Errors: ErrRank for an axis
// outside the view or a dst too short, ErrOutOfBounds unless 0 <= lo <= hi
// <= Shape[ax], ErrOverflow if the offset overflows.
func (v View) SliceAxis(ax, lo, hi int, dst []int) (View, error) {
	if ax < 0 || ax >= len(v.Shape) || len(v.Strides) != len(v.Shape) || len(dst) < len(v.Shape) {
		return View{}, fmt.Errorf("gather: %w: axis %d of a %d-axis view (shape buffer %d)", ErrRank, ax, len(v.Shape), len(dst))
	}
	if lo < 0 || hi < lo || hi > v.Shape[ax] {
		return View{}, fmt.Errorf("gather: %w: range [%d, %d) of axis %d with %d elements", ErrOutOfBounds, lo, hi, ax, v.Shape[ax])
	}
	shift, ok := mulInt(lo, v.Strides[ax])
	if ok {
		shift, ok = mulInt(shift, v.ItemSize)
	}
	var off int
	if ok {
		off, ok = addInt(v.Offset, shift)
	}
	if !ok {
		return View{}, fmt.Errorf("gather: %w: offset of index %d on axis %d", ErrOverflow, lo, ax)
	}
	shape := dst[:len(v.Shape)]
	copy(shape, v.Shape)
	shape[ax] = hi - lo
	return View{Base: v.Base, Offset: off, Shape: shape, Strides: v.Strides, ItemSize: v.ItemSize}, nil
}

// CheckDisjoint proves that no byte of memory is addressed by elements of
// two different views of views (the destinations of one read: each must be
// valid, see Validate). Two views whose address ranges (from the lowest to
// the highest byte they address, compared as memory addresses, so views of
// different Bases are compared too) do not meet are disjoint. Two whose
// ranges meet are accepted only when one is the other moved by d bytes
// (same shape, strides and itemsize, e.g. K and V interleaved in one
// buffer) and the pair, seen as one view with an extra axis of 2 elements
// and a stride of d bytes, passes CheckNoOverlap's test; anything else
// that meets is refused (conservatively, as CheckNoOverlap). Views with no
// elements never overlap.
//
// It returns the indices i < j of the first overlapping pair found and an
// error wrapping ErrOverlap, or, for an invalid view k, i = j = k and its
// Validate error. It allocates one small record per view.
func CheckDisjoint(views []View) (i, j int, err error) {
	type span struct {
		lo, hi uintptr // addresses: [lo, hi)
		k      int
	}
	spans := make([]span, 0, len(views))
	for k, v := range views {
		var l layout
		if err := v.compile(&l); err != nil {
			return k, k, err
		}
		if l.elems == 0 {
			continue
		}
		base := uintptr(unsafe.Pointer(unsafe.SliceData(v.Base)))
		spans = append(spans, span{base + uintptr(l.first), base + uintptr(l.end), k})
	}
	slices.SortFunc(spans, func(a, b span) int { return cmp.Compare(a.lo, b.lo) })
	for a := range spans {
		for b := a + 1; b < len(spans) && spans[b].lo < spans[a].hi; b++ {
			x, y := spans[a].k, spans[b].k
			if !translatedApart(views[x], views[y]) {
				x, y = min(x, y), max(x, y)
				return x, y, fmt.Errorf("gather: %w: views %d and %d address the same bytes of memory", ErrOverlap, x, y)
			}
		}
	}
	return 0, 0, nil
}

// translatedApart reports whether a and b, valid views whose address
// ranges meet, are one layout moved by some bytes d whose elements provably
// never meet: a's layout with an extra axis of 2 elements and stride d
// passes checkNoOverlap.
func translatedApart(a, b View) bool {
	if a.ItemSize != b.ItemSize || !slices.Equal(a.Shape, b.Shape) || !slices.Equal(a.Strides, b.Strides) {
		return false
	}
	var l layout
	if a.compile(&l) != nil || l.checkNoOverlap() != nil || l.nax == maxAxes {
		return false
	}
	za := uintptr(unsafe.Pointer(unsafe.SliceData(a.Base))) + uintptr(a.Offset)
	zb := uintptr(unsafe.Pointer(unsafe.SliceData(b.Base))) + uintptr(b.Offset)
	d := int(zb - za) // element zero of b minus that of a, in bytes
	l.n[l.nax], l.sb[l.nax] = 2, d
	l.nax++
	return l.checkNoOverlap() == nil
}
