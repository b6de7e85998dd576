package gather

import (
	"math/rand/v2"
	"slices"
)

// This file holds the naive reference the fast path is checked against. It
// shares no code with gather.go: every element's address comes from its own
// multi-index, computed by division from the logical element number.

// refOffsets returns, for every logical (row-major) element, the byte offset
// in v.Base of its first byte.
func refOffsets(v View) []int {
	n := 1
	for _, d := range v.Shape {
		n *= d
	}
	offs := make([]int, n)
	for e := range n {
		rem, o := e, 0
		for i := len(v.Shape) - 1; i >= 0; i-- {
			o += (rem % v.Shape[i]) * v.Strides[i]
			rem /= v.Shape[i]
		}
		offs[e] = v.Offset + o*v.ItemSize
	}
	return offs
}

// refBytes packs v element by element.
func refBytes(v View) []byte {
	offs := refOffsets(v)
	out := make([]byte, 0, len(offs)*v.ItemSize)
	for _, o := range offs {
		out = append(out, v.Base[o:o+v.ItemSize]...)
	}
	return out
}

// refRun is the JS `run` loop of bytesOf/segments, transcribed literally
// (JS returns before computing it for zero elements; the Go API says 1).
func refRun(shape, strides []int) int {
	size := 1
	for _, d := range shape {
		size *= d
	}
	if size == 0 {
		return 1
	}
	run, axis := 1, len(shape)-1
	for axis >= 0 && (shape[axis] == 1 || strides[axis] == run) {
		run *= shape[axis]
		axis--
	}
	return run
}

// refContiguous: every logical element directly follows the previous one in
// memory. Independent of the run loop.
func refContiguous(v View) bool {
	offs := refOffsets(v)
	for e := 1; e < len(offs); e++ {
		if offs[e] != offs[e-1]+v.ItemSize {
			return false
		}
	}
	return true
}

// refSegments is the JS segments loop over element ranges, transcribed
// literally (including the modulo arithmetic the Plan avoids).
func refSegments(shape []int, itemSize, blockBytes int) [][2]int {
	size := 1
	for _, d := range shape {
		size *= d
	}
	rowSize := 1
	for _, d := range shape[max(0, len(shape)-2):] {
		rowSize *= d
	}
	if size == 0 {
		return nil
	}
	limit := max(1, blockBytes/itemSize)
	var out [][2]int
	for start := 0; start < size; {
		count := min(limit, rowSize-start%rowSize, size-start)
		out = append(out, [2]int{start, count})
		start += count
	}
	return out
}

// randomView builds a valid view: rank 0..5, dims 0..7, strides that are
// row-major, padded, transposed, random, with zero (broadcast) and negative
// axes mixed in; item sizes 1, 2, 4, 8; random offset and slack in Base.
func randomView(rng *rand.Rand) View {
	rank := rng.IntN(6)
	shape := make([]int, rank)
	for i := range shape {
		if rng.IntN(12) == 0 {
			shape[i] = 0
		} else {
			shape[i] = 1 + rng.IntN(7)
		}
	}
	item := []int{1, 2, 4, 8}[rng.IntN(4)]
	var strides []int
	mode := rng.IntN(6)
	switch mode {
	case 0: // packed
		strides = RowMajor(shape)
	case 1, 2: // capacity-padded physical buffer, optionally transposed
		capShape := make([]int, rank)
		for i, d := range shape {
			capShape[i] = d + rng.IntN(3)*rng.IntN(2)
		}
		perm := make([]int, rank)
		for i := range perm {
			perm[i] = i
		}
		if mode == 2 {
			rng.Shuffle(rank, func(i, j int) { perm[i], perm[j] = perm[j], perm[i] })
		}
		phys := make([]int, rank)
		for j, ax := range perm {
			phys[j] = capShape[ax]
		}
		ps := RowMajor(phys)
		strides = make([]int, rank)
		for j, ax := range perm {
			strides[ax] = ps[j]
		}
	case 3: // arbitrary small strides
		strides = make([]int, rank)
		for i := range strides {
			strides[i] = rng.IntN(19) - 9
		}
	default: // packed or padded, then broadcast/negated axes
		strides = RowMajor(shape)
		if rng.IntN(2) == 0 && rank > 0 {
			capShape := slices.Clone(shape)
			capShape[rng.IntN(rank)] += 1 + rng.IntN(3)
			strides = RowMajor(capShape)
		}
	}
	if mode != 0 {
		for i := range strides {
			switch rng.IntN(10) {
			case 0:
				strides[i] = 0
			case 1:
				strides[i] = -strides[i]
			}
		}
	}
	v := View{Shape: shape, Strides: strides, ItemSize: item}
	lo, hi, empty := 0, 0, false
	for i, d := range shape {
		if d == 0 {
			empty = true
			continue
		}
		e := (d - 1) * strides[i]
		lo += min(0, e)
		hi += max(0, e)
	}
	if empty {
		v.Base = make([]byte, rng.IntN(4))
		v.Offset = rng.IntN(3) - 1 // may even be "invalid": zero elements are valid anyway
		return v
	}
	v.Offset = -lo*item + rng.IntN(5)
	v.Base = make([]byte, v.Offset+(hi+1)*item+rng.IntN(5))
	for i := range v.Base {
		v.Base[i] = byte(rng.Uint32())
	}
	return v
}
