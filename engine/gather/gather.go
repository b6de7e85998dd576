// Package gather turns strided tensor views over caller-owned memory into
// contiguous bytes, either whole (Gather) or as fixed-size blocks (Plan,
// View.Block).
//
// It ports two functions of the JavaScript persistence worker
// (persistence.worker.js): bytesOf, which packs a possibly strided tensor
// (for example the first T tokens of a capacity-padded KV buffer) into one
// byte string, and segments, which cuts the same logical byte string into
// blocks whose boundaries reset at every row (the product of the last two
// dimensions, i.e. one attention head), so that growing the token axis leaves
// earlier full blocks byte-identical.
//
// Units: names ending in Bytes, and the arguments and results documented as
// bytes, count bytes; everything else about positions (start, count, Shape,
// Strides, RunElements, Elements) counts elements of ItemSize bytes. The two
// are never mixed under one name.
//
// Logical order is row-major over Shape: element e has the multi-index whose
// last axis varies fastest. The bytes of element e are the ItemSize bytes at
// Base[Offset+o*ItemSize:], where o = sum(index[i]*Strides[i]).
//
// No View method allocates on success: results are either sub-slices of
// View.Base (zero-copy) or of a caller-supplied scratch slice. Only NewPlan
// and RowMajor allocate (a copy of the shape, the returned strides). View
// methods only read Base, so they may run concurrently on one Base as long
// as each call gets its own scratch.
//
// Copies work per run (the JS `run`: the longest contiguous suffix of axes),
// with one division per call to find the starting multi-index and an
// odometer over the remaining axes afterwards; a whole-view copy with runs of
// at least 64 bytes visits the runs in source-address order instead (same
// bytes, about twice as fast for token-major KV buffers).
package gather

import (
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"math/bits"
)

// Sentinel errors. Every error returned by this package wraps exactly one of
// them as fmt.Errorf("gather: %w: ...") with the offending axis or values, so
// callers test them with errors.Is.
var (
	// ErrRank: len(Shape) != len(Strides), or View.Block got a Plan built
	// for a different shape (rank or dimensions) than the view's.
	ErrRank = errors.New("rank mismatch")
	// ErrNegativeDim: some Shape entry is negative.
	ErrNegativeDim = errors.New("negative dimension")
	// ErrItemSize: ItemSize (bytes per element) is <= 0, or a Plan and a
	// View disagree on it.
	ErrItemSize = errors.New("invalid item size")
	// ErrOverflow: the element count, the byte size, or the addressed
	// extent (in elements or bytes) does not fit in an int.
	ErrOverflow = errors.New("arithmetic overflow")
	// ErrOutOfBounds: an addressed byte lies outside Base (or Offset lies
	// outside [0, len(Base)]), or a requested element range or block index
	// lies outside the view.
	ErrOutOfBounds = errors.New("out of bounds")
	// ErrScratch: a copy is needed and the destination/scratch slice is
	// shorter than the bytes to produce.
	ErrScratch = errors.New("scratch too small")
	// ErrBlockBytes: NewPlan got blockBytes <= 0.
	ErrBlockBytes = errors.New("invalid block bytes")
)

// maxAxes bounds the number of axes that survive compilation (size-1 axes
// dropped). Every surviving axis has size >= 2 and the element count fits in
// an int, so at most bits.UintSize-2 axes can survive: 64 always suffices and
// the odometer state lives in fixed arrays on the stack (no allocation).
const maxAxes = 64

// View is a strided tensor view over caller memory, the Go form of the JS
// worker's tensor descriptor {pointer, shape, strides, itemSize}.
//
// Element zero starts at byte Base[Offset]. Strides count elements, not
// bytes, and may be zero (broadcast) or negative (reversed axes); an element
// with multi-index idx starts at byte Offset + ItemSize*sum(idx[i]*Strides[i]).
// The package never retains Base and writes to it only in Scatter,
// ScatterRange and through the pieces RunsRange hands out (scatter.go).
type View struct {
	Base     []byte // backing memory (caller owned); bytes
	Offset   int    // byte offset of element zero inside Base; bytes
	Shape    []int  // elements per axis; len(Shape) is the rank
	Strides  []int  // elements (not bytes) per step of each axis; zero and negative are legal
	ItemSize int    // bytes per element (2 for bf16)
}

// layout is a validated, compiled view: the JS run suffix collapsed into one
// run of run elements, size-1 outer axes dropped, adjacent outer axes
// coalesced where Strides[i] == Strides[i+1]*Shape[i+1], strides converted
// to bytes.
type layout struct {
	elems  int          // total elements
	item   int          // bytes per element
	run    int          // elements per contiguous run (JS `run`)
	runB   int          // bytes per run
	origin int          // byte offset in Base of element zero
	first  int          // byte offset in Base of the lowest addressed byte
	end    int          // byte offset in Base just past the highest addressed byte
	nax    int          // number of outer (non-run) axes in n/sb
	n      [maxAxes]int // outer axis sizes, outermost first; elements
	sb     [maxAxes]int // outer axis strides; bytes
}

// Validate reports whether v describes only bytes inside v.Base. It returns
// nil, or an error wrapping:
//   - ErrRank if len(Shape) != len(Strides);
//   - ErrNegativeDim if some dimension is negative (naming the axis);
//   - ErrItemSize if ItemSize <= 0;
//   - ErrOverflow if the element count, the byte size, or the extent
//     (the span in elements/bytes between the lowest and highest addressed
//     element, from the per-axis extents (Shape[i]-1)*Strides[i], negative
//     strides included) does not fit in an int;
//   - ErrOutOfBounds if Offset < 0 or Offset > len(Base), or the lowest or
//     highest byte actually addressed lies outside Base.
//
// A view with zero elements (some dimension 0) is valid whatever Base,
// Offset and Strides are, provided rank, dimensions and ItemSize are valid.
// Validate does not allocate unless it fails.
func (v View) Validate() error {
	var l layout
	return v.compile(&l)
}

// compile validates v and fills l. It is the only place that checks
// arithmetic; everything after it works within proven bounds.
func (v View) compile(l *layout) error {
	rank := len(v.Shape)
	if rank != len(v.Strides) {
		return fmt.Errorf("gather: %w: shape has %d axes, strides has %d", ErrRank, rank, len(v.Strides))
	}
	zero := false
	for i, d := range v.Shape {
		if d < 0 {
			return fmt.Errorf("gather: %w: axis %d has dimension %d", ErrNegativeDim, i, d)
		}
		if d == 0 {
			zero = true
		}
	}
	if v.ItemSize <= 0 {
		return fmt.Errorf("gather: %w: item size %d bytes", ErrItemSize, v.ItemSize)
	}
	l.item = v.ItemSize
	if zero {
		l.elems, l.run, l.runB, l.nax, l.origin = 0, 1, v.ItemSize, 0, 0
		return nil
	}
	elems := 1
	for i, d := range v.Shape {
		var ok bool
		if elems, ok = mulInt(elems, d); !ok {
			return fmt.Errorf("gather: %w: element count of shape %v overflows int at axis %d", ErrOverflow, v.Shape, i)
		}
	}
	if _, ok := mulInt(elems, v.ItemSize); !ok {
		return fmt.Errorf("gather: %w: %d elements of %d bytes overflow int", ErrOverflow, elems, v.ItemSize)
	}
	// Extents in elements relative to element zero, as the JS lo/hi loop.
	lo, hi := 0, 0
	for i, d := range v.Shape {
		if d == 1 {
			continue
		}
		e, ok := mulInt(d-1, v.Strides[i])
		if !ok {
			return fmt.Errorf("gather: %w: axis %d extent (%d-1)*%d overflows int", ErrOverflow, i, d, v.Strides[i])
		}
		if e < 0 {
			lo, ok = addInt(lo, e)
		} else {
			hi, ok = addInt(hi, e)
		}
		if !ok {
			return fmt.Errorf("gather: %w: extent overflows int at axis %d (stride %d)", ErrOverflow, i, v.Strides[i])
		}
	}
	// Span hi-lo+1 elements, in bytes; also bounds lo*ItemSize and
	// (hi+1)*ItemSize, which are then overflow free.
	span, ok := 0, lo != math.MinInt
	if ok {
		span, ok = addInt(hi, -lo)
	}
	if ok {
		span, ok = addInt(span, 1)
	}
	if ok {
		_, ok = mulInt(span, v.ItemSize)
	}
	if !ok {
		return fmt.Errorf("gather: %w: extent [%d, %d] elements of %d bytes overflows int", ErrOverflow, lo, hi, v.ItemSize)
	}
	if v.Offset < 0 || v.Offset > len(v.Base) {
		return fmt.Errorf("gather: %w: offset %d outside base of %d bytes", ErrOutOfBounds, v.Offset, len(v.Base))
	}
	first := v.Offset + lo*v.ItemSize // Offset >= 0, lo <= 0: no overflow
	if first < 0 {
		return fmt.Errorf("gather: %w: lowest addressed byte %d (offset %d, %d elements below element zero) is before base", ErrOutOfBounds, first, v.Offset, -lo)
	}
	end, ok := addInt(v.Offset, (hi+1)*v.ItemSize)
	if !ok || end > len(v.Base) {
		return fmt.Errorf("gather: %w: addressed bytes end at offset %d+%d*%d, base has %d bytes", ErrOutOfBounds, v.Offset, hi+1, v.ItemSize, len(v.Base))
	}

	l.elems = elems
	l.origin = v.Offset
	l.first, l.end = first, end
	// The JS `run` loop: coalesce the contiguous suffix.
	run, axis := 1, rank-1
	for axis >= 0 && (v.Shape[axis] == 1 || v.Strides[axis] == run) {
		run *= v.Shape[axis]
		axis--
	}
	l.run, l.runB = run, run*v.ItemSize
	// Outer axes: drop size 1, coalesce where stride[i] == stride[i+1]*shape[i+1].
	// |stride|*(d-1) <= hi-lo and (hi-lo+1)*ItemSize fits, so byte strides fit.
	nax := 0
	prevStride := 0 // element stride of l axis nax-1
	for i := 0; i <= axis; i++ {
		d, s := v.Shape[i], v.Strides[i]
		if d == 1 {
			continue
		}
		if nax > 0 {
			if m, ok := mulInt(s, d); ok && m == prevStride {
				l.n[nax-1] *= d
				l.sb[nax-1] = s * v.ItemSize
				prevStride = s
				continue
			}
		}
		l.n[nax] = d
		l.sb[nax] = s * v.ItemSize
		prevStride = s
		nax++
	}
	l.nax = nax
	return nil
}

// Elements returns the number of elements of v: the product of Shape (1 for
// rank 0, 0 when any dimension is 0). Meaningful for valid views only (see
// Validate); the product wraps silently on overflow.
func (v View) Elements() int {
	n := 1
	for _, d := range v.Shape {
		n *= d
	}
	return n
}

// Bytes returns the packed size of v in bytes: Elements()*ItemSize, the
// length Gather returns (the JS bytesOf result length). Valid views only.
func (v View) Bytes() int {
	return v.Elements() * v.ItemSize
}

// RowMajor returns the contiguous (C order) strides, in elements, for shape:
// strides[len-1] = 1 and strides[i] = strides[i+1]*shape[i+1], exactly as the
// JS worker rebuilds strides for a packed tensor (so axes before a zero
// dimension get stride 0). It returns a new slice of len(shape) (empty, not
// nil, for rank 0). Dimensions must be non-negative and their product must
// fit in an int; otherwise the result wraps.
func RowMajor(shape []int) []int {
	strides := make([]int, len(shape))
	stride := 1
	for i := len(shape) - 1; i >= 0; i-- {
		strides[i] = stride
		stride *= shape[i]
	}
	return strides
}

// RunElements returns the length, in elements, of the contiguous runs the
// view is made of: the JS `run` loop that walks axes from the last one and
// multiplies them in while Shape[axis] == 1 or Strides[axis] == run. Logical
// elements [k*run, (k+1)*run) are contiguous in Base for every k. The result
// is >= 1; it is 1 for a view with zero elements (the JS returns before
// computing a run). Meaningful for valid views only.
func (v View) RunElements() int {
	for _, d := range v.Shape {
		if d == 0 {
			return 1
		}
	}
	run, axis := 1, len(v.Shape)-1
	for axis >= 0 && axis < len(v.Strides) && (v.Shape[axis] == 1 || v.Strides[axis] == run) {
		run *= v.Shape[axis]
		axis--
	}
	return run
}

// IsContiguous reports whether the whole view, in logical row-major order,
// is one contiguous run of Base (RunElements() == Elements(); size-1 axes are
// ignored whatever their stride, as the JS does). Such views Gather without a
// copy, like the JS bytesOf early return. A view with zero elements is
// contiguous. Meaningful for valid views only.
func (v View) IsContiguous() bool {
	return v.RunElements() >= v.Elements()
}

// GatherRange returns the ItemSize*count bytes of logical (row-major)
// elements [start, start+count) of v.
//
// If the range lies inside one run (start%r + count <= r for
// r = RunElements(), the JS segments test `count <= run - start % run`), out
// is a zero-copy sub-slice of v.Base with its capacity capped to its length
// (appending to it never writes into Base), and copied is false. Otherwise
// the runs are copied into dst[:count*ItemSize] and that slice is returned
// with copied true; the caller owns dst and out aliases it.
// count == 0 yields an empty, non-nil slice and copied false.
//
// Errors (out is nil): any Validate error; ErrOutOfBounds when start < 0,
// count < 0 or start+count > Elements(); ErrScratch when a copy is needed and
// len(dst) < count*ItemSize. dst is not touched when the result is zero-copy.
// GatherRange does not allocate on success.
func (v View) GatherRange(start, count int, dst []byte) (out []byte, copied bool, err error) {
	var l layout
	if err := v.compile(&l); err != nil {
		return nil, false, err
	}
	return l.gather(v.Base, start, count, dst)
}

// Gather returns all bytes of v in logical order: GatherRange(0,
// Elements(), scratch). It is the JS bytesOf: a contiguous view (see
// IsContiguous) comes back zero-copy; anything else is packed into
// scratch[:Bytes()] (ErrScratch if scratch is shorter).
func (v View) Gather(scratch []byte) ([]byte, bool, error) {
	var l layout
	if err := v.compile(&l); err != nil {
		return nil, false, err
	}
	return l.gather(v.Base, 0, l.elems, scratch)
}

func (l *layout) gather(base []byte, start, count int, dst []byte) ([]byte, bool, error) {
	if start < 0 || count < 0 || start > l.elems || count > l.elems-start {
		return nil, false, fmt.Errorf("gather: %w: element range start %d count %d outside %d elements", ErrOutOfBounds, start, count, l.elems)
	}
	if count == 0 {
		return []byte{}, false, nil
	}
	need := count * l.item
	q := start / l.run
	r := start - q*l.run
	if count <= l.run-r {
		off := l.origin + r*l.item
		for k := l.nax - 1; k >= 0; k-- {
			n := l.n[k]
			off += (q % n) * l.sb[k]
			q /= n
		}
		return base[off : off+need : off+need], false, nil
	}
	if len(dst) < need {
		return nil, false, fmt.Errorf("gather: %w: need %d bytes (%d elements of %d bytes), have %d", ErrScratch, need, count, l.item, len(dst))
	}
	l.copyRuns(base, dst[:need], q, r, false)
	return dst[:need], true, nil
}

// copyRuns fills dst (len = count*item, count > run-r) with the elements
// starting at element r of run q; with toBase it copies the other way, dst's
// bytes into those elements of base (scatter). The starting multi-index is
// computed once with divisions; after that an odometer walks the outer axes,
// copying one line (all runs along the innermost outer axis) at a time.
func (l *layout) copyRuns(base, dst []byte, q, r int, toBase bool) {
	if !toBase && q == 0 && r == 0 && len(dst) == l.elems*l.item && l.nax >= 2 && l.runB >= reorderMinRunBytes {
		l.copyAll(base, dst)
		return
	}
	var idx [maxAxes]int
	off := l.origin
	for k := l.nax - 1; k >= 0; k-- {
		n := l.n[k]
		i := q % n
		q /= n
		idx[k] = i
		off += i * l.sb[k]
	}
	// l.nax >= 1 here: with no outer axis the view is one run and every
	// range fits in it.
	last := l.nax - 1
	nL, sL := l.n[last], l.sb[last]
	iL := idx[last]
	runB := l.runB
	need := len(dst)
	w := 0
	if r > 0 {
		skip := r * l.item
		if toBase {
			w = copy(base[off+skip:off+runB], dst)
		} else {
			w = copy(dst, base[off+skip:off+runB])
		}
		off += sL
		if iL++; iL == nL {
			iL = 0
			off = l.carry(&idx, last, off-nL*sL)
		}
	}
	full := (need - w) / runB
	for full > 0 {
		m := min(nL-iL, full)
		full -= m
		iL += m
		if toBase {
			copyLine(base, off, sL, dst, w, runB, m, runB)
		} else {
			copyLine(dst, w, runB, base, off, sL, m, runB)
		}
		w += m * runB
		off += m * sL
		if iL == nL {
			iL = 0
			off = l.carry(&idx, last, off-nL*sL)
		}
	}
	if w < need {
		if toBase {
			copy(base[off:off+need-w], dst[w:])
		} else {
			copy(dst[w:], base[off:off+need-w])
		}
	}
}

// reorderMinRunBytes is the run size from which a whole-view copy walks the
// source in address order rather than the destination (see copyAll). A
// variable so tests can force either path.
var reorderMinRunBytes = 64

// copyAll copies every run of the view into dst (len = elems*item), walking
// the outer axes in order of decreasing source stride (negative strides
// walked backwards), so the source is read in ascending address order and
// each run still lands at its logical place in dst. The bytes produced are
// those of the logical-order walk; only the order of the copies differs.
// Reading a transposed (token-major) source sequentially and writing a few
// sequential destination streams is about twice as fast as the converse.
func (l *layout) copyAll(base, dst []byte) {
	var n, sb, db, idx [maxAxes]int
	k := l.nax
	src, d := l.origin, 0
	step := l.runB
	for a := k - 1; a >= 0; a-- {
		n[a], sb[a], db[a] = l.n[a], l.sb[a], step
		step *= l.n[a]
		if sb[a] < 0 {
			src += (n[a] - 1) * sb[a]
			d += (n[a] - 1) * db[a]
			sb[a], db[a] = -sb[a], -db[a]
		}
	}
	for i := 1; i < k; i++ { // stable insertion sort, source stride descending
		for j := i; j > 0 && sb[j-1] < sb[j]; j-- {
			n[j-1], n[j] = n[j], n[j-1]
			sb[j-1], sb[j] = sb[j], sb[j-1]
			db[j-1], db[j] = db[j], db[j-1]
		}
	}
	last := k - 1
	nL, sL, dL := n[last], sb[last], db[last]
	for {
		copyLine(dst, d, dL, base, src, sL, nL, l.runB)
		a := last - 1
		for ; a >= 0; a-- {
			idx[a]++
			src += sb[a]
			d += db[a]
			if idx[a] < n[a] {
				break
			}
			idx[a] = 0
			src -= n[a] * sb[a]
			d -= n[a] * db[a]
		}
		if a < 0 {
			return
		}
	}
}

// copyLine copies m runs of runB bytes, run j from base[s+j*ss:] to
// dst[d+j*ds:]. Runs of 1, 2, 4, 8 and 16 bytes move through registers
// instead of a memmove call each.
func copyLine(dst []byte, d, ds int, base []byte, s, ss, m, runB int) {
	switch runB {
	case 1:
		for ; m > 0; m-- {
			dst[d] = base[s]
			d += ds
			s += ss
		}
	case 2:
		for ; m > 0; m-- {
			binary.LittleEndian.PutUint16(dst[d:], binary.LittleEndian.Uint16(base[s:]))
			d += ds
			s += ss
		}
	case 4:
		for ; m > 0; m-- {
			binary.LittleEndian.PutUint32(dst[d:], binary.LittleEndian.Uint32(base[s:]))
			d += ds
			s += ss
		}
	case 8:
		for ; m > 0; m-- {
			binary.LittleEndian.PutUint64(dst[d:], binary.LittleEndian.Uint64(base[s:]))
			d += ds
			s += ss
		}
	case 16:
		for ; m > 0; m-- {
			src, out := base[s:s+16], dst[d:d+16]
			binary.LittleEndian.PutUint64(out, binary.LittleEndian.Uint64(src))
			binary.LittleEndian.PutUint64(out[8:], binary.LittleEndian.Uint64(src[8:]))
			d += ds
			s += ss
		}
	default:
		for ; m > 0; m-- {
			copy(dst[d:d+runB], base[s:s+runB])
			d += ds
			s += ss
		}
	}
}

// carry propagates an odometer wrap of axis k into the axes outside it and
// returns the adjusted byte offset. Past the last element it wraps to zero;
// the offset is then unused.
func (l *layout) carry(idx *[maxAxes]int, k, off int) int {
	for k--; k >= 0; k-- {
		idx[k]++
		off += l.sb[k]
		if idx[k] < l.n[k] {
			return off
		}
		idx[k] = 0
		off -= l.n[k] * l.sb[k]
	}
	return off
}

// Plan cuts a tensor of a given shape into blocks exactly as the JS worker's
// segments generator does, independent of strides (so a padded view and its
// packed copy give the same blocks):
//
//   - limit = max(1, blockBytes/itemSize) elements per block (integer
//     division; a block is never larger than blockBytes unless itemSize >
//     blockBytes, in which case it holds one element);
//   - a row is the product of the last two dimensions (the last one for
//     rank 1, 1 for rank 0): one attention head of [.., heads, tokens, dim];
//   - each row is cut into limit-element blocks from its own start, the last
//     block of a row shorter; a block never spans two rows, so growing the
//     token axis leaves the earlier full blocks of every row byte-identical.
//
// The zero Plan has no blocks. Plans are immutable and safe for concurrent
// use.
type Plan struct {
	shape    []int // private copy, compared by View.Block
	itemSize int   // bytes per element
	limit    int   // elements per full block
	rowSize  int   // elements per row
	perRow   int   // blocks per row
	n        int   // blocks in total
}

// NewPlan returns the block plan for a tensor of shape (elements per axis)
// and itemSize bytes per element, cut at blockBytes bytes (see Plan).
// Errors: ErrItemSize if itemSize <= 0, ErrBlockBytes if blockBytes <= 0,
// ErrNegativeDim for a negative dimension, ErrOverflow if the element count
// or byte size overflows int. Power-of-two or range policies for blockBytes
// are the engine's business, not checked here.
func NewPlan(shape []int, itemSize, blockBytes int) (Plan, error) {
	if itemSize <= 0 {
		return Plan{}, fmt.Errorf("gather: %w: item size %d bytes", ErrItemSize, itemSize)
	}
	if blockBytes <= 0 {
		return Plan{}, fmt.Errorf("gather: %w: block size %d bytes", ErrBlockBytes, blockBytes)
	}
	zero := false
	for i, d := range shape {
		if d < 0 {
			return Plan{}, fmt.Errorf("gather: %w: axis %d has dimension %d", ErrNegativeDim, i, d)
		}
		zero = zero || d == 0
	}
	p := Plan{shape: append([]int{}, shape...), itemSize: itemSize}
	if zero {
		return p, nil
	}
	elems := 1
	for i, d := range shape {
		var ok bool
		if elems, ok = mulInt(elems, d); !ok {
			return Plan{}, fmt.Errorf("gather: %w: element count of shape %v overflows int at axis %d", ErrOverflow, shape, i)
		}
	}
	if _, ok := mulInt(elems, itemSize); !ok {
		return Plan{}, fmt.Errorf("gather: %w: %d elements of %d bytes overflow int", ErrOverflow, elems, itemSize)
	}
	row := 1
	for _, d := range shape[max(0, len(shape)-2):] {
		row *= d
	}
	p.limit = max(1, blockBytes/itemSize)
	p.rowSize = row
	p.perRow = (row-1)/p.limit + 1
	p.n = elems / row * p.perRow
	return p, nil
}

// Len returns the number of blocks (0 for a tensor with zero elements).
func (p Plan) Len() int { return p.n }

// Block returns the element range [start, start+count) of block i, in
// logical row-major elements, in O(1). Blocks are in order, contiguous and
// cover every element once. It panics if i is not in [0, Len()), like an
// out-of-range slice index.
func (p Plan) Block(i int) (start, count int) {
	if uint(i) >= uint(p.n) {
		panic(fmt.Sprintf("gather: Plan.Block index %d out of range [0, %d)", i, p.n))
	}
	row := i / p.perRow
	j := i - row*p.perRow
	start = row*p.rowSize + j*p.limit
	count = min(p.limit, p.rowSize-j*p.limit)
	return start, count
}

// MaxBlockBytes returns the size in bytes of the largest block,
// min(limit, row)*itemSize: the scratch length View.Block needs for any
// block that must be packed. 0 when Len() == 0.
func (p Plan) MaxBlockBytes() int {
	if p.n == 0 {
		return 0
	}
	return min(p.limit, p.rowSize) * p.itemSize
}

// Fits checks that p was built for shape and itemSize (bytes): ErrItemSize
// or ErrRank otherwise.
func (p Plan) Fits(shape []int, itemSize int) error {
	if p.itemSize != itemSize {
		return fmt.Errorf("gather: %w: plan item size %d bytes, view item size %d bytes", ErrItemSize, p.itemSize, itemSize)
	}
	same := len(p.shape) == len(shape)
	for k := 0; same && k < len(p.shape); k++ {
		same = p.shape[k] == shape[k]
	}
	if !same {
		return fmt.Errorf("gather: %w: plan shape %v, view shape %v", ErrRank, p.shape, shape)
	}
	return nil
}

// Block returns the bytes of block i of plan p for view v: zero-copy (a
// capacity-capped sub-slice of v.Base, copied false) when the block lies
// inside one run of v, else packed into scratch (copied true). See
// GatherRange; a scratch of MaxBlockBytes() bytes is always enough.
//
// Errors: any Validate error; ErrRank if p was built for another shape,
// ErrItemSize if for another item size; ErrOutOfBounds if i is not in
// [0, p.Len()); ErrScratch if scratch is too short for a block that must be
// copied. Block does not allocate on success.
func (v View) Block(p Plan, i int, scratch []byte) (out []byte, copied bool, err error) {
	var l layout
	if err := v.compile(&l); err != nil {
		return nil, false, err
	}
	if err := p.Fits(v.Shape, v.ItemSize); err != nil {
		return nil, false, err
	}
	if uint(i) >= uint(p.n) {
		return nil, false, fmt.Errorf("gather: %w: block %d outside [0, %d)", ErrOutOfBounds, i, p.n)
	}
	start, count := p.Block(i)
	return l.gather(v.Base, start, count, scratch)
}

// mulInt returns a*b and whether it fits in an int.
func mulInt(a, b int) (int, bool) {
	if a == 0 || b == 0 {
		return 0, true
	}
	neg := (a < 0) != (b < 0)
	hi, lo := bits.Mul(absU(a), absU(b))
	if hi != 0 {
		return 0, false
	}
	if neg {
		if lo > uint(math.MaxInt)+1 {
			return 0, false
		}
		return -int(lo), true // lo == MaxInt+1 wraps to MinInt, as wanted
	}
	if lo > uint(math.MaxInt) {
		return 0, false
	}
	return int(lo), true
}

// addInt returns a+b and whether it fits in an int.
func addInt(a, b int) (int, bool) {
	s := a + b
	if (a > 0 && b > 0 && s < 0) || (a < 0 && b < 0 && s >= 0) {
		return 0, false
	}
	return s, true
}

func absU(a int) uint {
	if a < 0 {
		return uint(-a) // MinInt: -a == MinInt, uint(MinInt) == 1<<(UintSize-1)
	}
	return uint(a)
}
