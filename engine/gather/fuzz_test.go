package gather

import (
	"bytes"
	"encoding/binary"
	"errors"
	"testing"
)

// decodeView turns fuzz input into a view: data[0]%7 is the rank (6 gives a
// rank mismatch: one stride fewer), then one signed byte per dimension, then
// one signed varint per stride (so huge and negative strides occur). Base
// holds baseLen bytes of a position-dependent pattern.
func decodeView(data []byte, offset int, baseLen uint16, itemSel uint8) View {
	v := View{Offset: offset}
	switch itemSel % 8 {
	case 0:
		v.ItemSize = 0
	case 7:
		v.ItemSize = -int(itemSel)
	default:
		v.ItemSize = []int{1, 2, 4, 8, 3, 16}[itemSel%8-1]
	}
	v.Base = make([]byte, baseLen)
	for i := range v.Base {
		v.Base[i] = byte(i*131 + i>>8)
	}
	if len(data) == 0 {
		return v
	}
	rank := int(data[0] % 7)
	data = data[1:]
	nStrides := rank
	if rank == 6 {
		rank, nStrides = 3, 2
	}
	v.Shape = make([]int, rank)
	for i := range v.Shape {
		if len(data) > 0 {
			v.Shape[i] = int(int8(data[0]))
			data = data[1:]
		}
	}
	v.Strides = make([]int, nStrides)
	for i := range v.Strides {
		s, n := binary.Varint(data)
		if n <= 0 {
			break
		}
		v.Strides[i] = int(s)
		data = data[n:]
	}
	return v
}

func FuzzGather(f *testing.F) {
	varints := func(xs ...int64) []byte {
		var out []byte
		for _, x := range xs {
			out = binary.AppendVarint(out, x)
		}
		return out
	}
	seed := func(rank byte, dims []byte, strides []int64, offset int, baseLen uint16, item uint8, bb uint16, start, count uint16) {
		data := append([]byte{rank}, dims...)
		f.Add(append(data, varints(strides...)...), offset, baseLen, item, bb, start, count)
	}
	seed(4, []byte{1, 2, 5, 4}, []int64{2 * 8 * 4, 8 * 4, 4, 1}, 0, 2*8*4*2, 2, 16, 3, 17) // padded heads, bf16
	seed(4, []byte{1, 2, 5, 4}, []int64{8 * 2 * 4, 4, 2 * 4, 1}, 0, 8*2*4*2, 2, 8, 1, 30)  // token-major
	seed(2, []byte{3, 4}, []int64{1, 3}, 0, 12*4, 3, 8, 0, 12)                             // transposed int32
	seed(2, []byte{3, 4}, []int64{-4, 1}, 8*4, 12*4, 3, 7, 2, 5)                           // reversed rows
	seed(3, []byte{2, 0, 5}, []int64{99, -3, 7}, -5, 0, 2, 64, 0, 0)                       // zero elements
	seed(2, []byte{2, 2}, []int64{1 << 62, 1 << 62}, 0, 16, 1, 4, 0, 1)                    // overflow
	seed(6, []byte{2, 2, 2}, []int64{4, 2}, 0, 16, 1, 4, 0, 1)                             // rank mismatch
	seed(1, []byte{0xff}, []int64{1}, 0, 16, 1, 4, 0, 1)                                   // negative dim
	seed(0, nil, nil, 3, 16, 4, 4, 0, 1)                                                   // scalar
	seed(3, []byte{4, 3, 2}, []int64{0, 2, 1}, 0, 16, 4, 5, 1, 20)                         // broadcast

	f.Fuzz(func(t *testing.T, data []byte, offset int, baseLen uint16, itemSel uint8, blockBytes uint16, start, count uint16) {
		v := decodeView(data, offset, baseLen, itemSel)
		// These must never panic, valid or not.
		_, _, _ = v.Elements(), v.RunElements(), v.IsContiguous()
		if err := v.Validate(); err != nil {
			// Every entry point reports the same failure.
			var p Plan
			for _, err2 := range []error{
				func() error { _, _, e := v.Gather(nil); return e }(),
				func() error { _, _, e := v.GatherRange(0, 0, nil); return e }(),
				func() error { _, _, e := v.Block(p, 0, nil); return e }(),
			} {
				if err2 == nil || err2.Error() != err.Error() {
					t.Fatalf("Validate %v but entry point %v", err, err2)
				}
			}
			return
		}
		n := v.Elements()
		if n > 1<<14 {
			t.Skip("too many elements for the reference")
		}
		offs := refOffsets(v)
		ref := refBytes(v)
		run := refRun(v.Shape, v.Strides)
		if v.RunElements() != run {
			t.Fatalf("RunElements %d want %d", v.RunElements(), run)
		}
		dst := make([]byte, len(ref))
		out, copied, err := v.Gather(dst)
		checkRange(t, v, offs, ref, run, 0, n, out, copied, err, dst)

		s := int(start) % (n + 1)
		c := int(count) % (n - s + 1)
		out, copied, err = v.GatherRange(s, c, dst)
		checkRange(t, v, offs, ref, run, s, c, out, copied, err, dst)
		if _, _, err := v.GatherRange(s, n-s+1, dst); !errors.Is(err, ErrOutOfBounds) {
			t.Fatalf("range past end: %v", err)
		}

		p, err := NewPlan(v.Shape, v.ItemSize, int(blockBytes))
		if blockBytes == 0 {
			if !errors.Is(err, ErrBlockBytes) {
				t.Fatalf("blockBytes 0: %v", err)
			}
			return
		}
		if err != nil {
			t.Fatal(err)
		}
		segs := refSegments(v.Shape, v.ItemSize, int(blockBytes))
		if p.Len() != len(segs) {
			t.Fatalf("Len %d want %d", p.Len(), len(segs))
		}
		scratch := make([]byte, p.MaxBlockBytes())
		var joined []byte
		for i, sg := range segs {
			st, ct := p.Block(i)
			if st != sg[0] || ct != sg[1] {
				t.Fatalf("block %d (%d,%d) want %v", i, st, ct, sg)
			}
			out, copied, err := v.Block(p, i, scratch)
			checkRange(t, v, offs, ref, run, st, ct, out, copied, err, scratch)
			joined = append(joined, out...)
		}
		if !bytes.Equal(joined, ref) {
			t.Fatal("blocks do not concatenate to Gather")
		}
	})
}
