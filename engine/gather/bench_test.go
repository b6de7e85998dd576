package gather

import (
	"testing"
	"time"
)

// benchGather runs op (which must produce v.Bytes() bytes) b.N times and, in
// the same iterations with the timer stopped, a plain copy of the same number
// of bytes between two other buffers of that size: the memcpy limit. It
// reports x-limit = gather time / memcpy time (1.0 = memcpy speed).
func benchGather(b *testing.B, v View, op func(dst []byte) int) {
	n := v.Bytes()
	dst := make([]byte, n)
	src := make([]byte, n)
	limDst := make([]byte, n)
	for i := range src {
		src[i] = byte(i)
	}
	if got := op(dst); got != n { // warm up and check
		b.Fatalf("produced %d bytes, want %d", got, n)
	}
	copy(limDst, src)
	b.SetBytes(int64(n))
	b.ReportAllocs()
	var gatherDur, limitDur time.Duration
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		t0 := time.Now()
		op(dst)
		gatherDur += time.Since(t0)
		b.StopTimer()
		t1 := time.Now()
		copy(limDst, src)
		limitDur += time.Since(t1)
		b.StartTimer()
	}
	b.ReportMetric(float64(gatherDur)/float64(limitDur), "x-limit")
}

func gatherOp(b *testing.B, v View) func([]byte) int {
	return func(dst []byte) int {
		out, _, err := v.Gather(dst)
		if err != nil {
			b.Fatal(err)
		}
		return len(out)
	}
}

func blocksOp(b *testing.B, v View, blockBytes int) func([]byte) int {
	p, err := NewPlan(v.Shape, v.ItemSize, blockBytes)
	if err != nil {
		b.Fatal(err)
	}
	return func(dst []byte) int {
		total := 0
		for i := range p.Len() {
			// Pack each block at its final place so the limit comparison
			// moves the same bytes; scratch here is dst's tail.
			s, c := p.Block(i)
			out, _, err := v.Block(p, i, dst[s*v.ItemSize:(s+c)*v.ItemSize])
			if err != nil {
				b.Fatal(err)
			}
			total += len(out)
		}
		return total
	}
}

const (
	benchHeads = 8
	benchT     = 8192
	benchCap   = 8448
	benchDim   = 128
)

func filled(n int) []byte {
	buf := make([]byte, n)
	for i := range buf {
		buf[i] = byte(i * 31)
	}
	return buf
}

// headMajorPadded: [8, 8448, 128] bf16 buffer viewed as its first 8192
// tokens, shape [1,8,8192,128]: one 2 MiB run per head.
func headMajorPadded() View {
	return View{
		Base:     filled(benchHeads * benchCap * benchDim * 2),
		Shape:    []int{1, benchHeads, benchT, benchDim},
		Strides:  []int{benchHeads * benchCap * benchDim, benchCap * benchDim, benchDim, 1},
		ItemSize: 2,
	}
}

// tokenMajor: [1, T(cap), 8, 128] bf16 buffer viewed head-major as
// [1,8,T,128]: 256-byte runs (one head_dim row), 65536 of them.
func tokenMajor(capT int) View {
	return View{
		Base:     filled(capT * benchHeads * benchDim * 2),
		Shape:    []int{1, benchHeads, benchT, benchDim},
		Strides:  []int{capT * benchHeads * benchDim, benchDim, benchHeads * benchDim, 1},
		ItemSize: 2,
	}
}

func BenchmarkGatherHeadMajorPadded(b *testing.B) {
	v := headMajorPadded()
	benchGather(b, v, gatherOp(b, v))
}

func BenchmarkGatherTokenMajor256B(b *testing.B) {
	v := tokenMajor(benchT)
	benchGather(b, v, gatherOp(b, v))
}

func BenchmarkGatherTokenMajorPadded256B(b *testing.B) {
	v := tokenMajor(benchCap)
	benchGather(b, v, gatherOp(b, v))
}

func BenchmarkGatherBlocks1MiBTokenMajor(b *testing.B) {
	v := tokenMajor(benchCap)
	benchGather(b, v, blocksOp(b, v, 1<<20))
}

// Blocks packed into one reused scratch of MaxBlockBytes, as a writer that
// hashes and writes each block before the next would do.
func BenchmarkGatherBlocks1MiBReusedScratch(b *testing.B) {
	v := tokenMajor(benchCap)
	p, err := NewPlan(v.Shape, v.ItemSize, 1<<20)
	if err != nil {
		b.Fatal(err)
	}
	scratch := make([]byte, p.MaxBlockBytes())
	benchGather(b, v, func([]byte) int {
		total := 0
		for i := range p.Len() {
			out, _, err := v.Block(p, i, scratch)
			if err != nil {
				b.Fatal(err)
			}
			total += len(out)
		}
		return total
	})
}

// Cache-resident (512 KiB) token-major gather: loop overhead rather than
// DRAM bandwidth.
func BenchmarkGatherTokenMajorInCache(b *testing.B) {
	v := tokenMajor(256)
	v.Shape = []int{1, benchHeads, 256, benchDim}
	benchGather(b, v, gatherOp(b, v))
}

func BenchmarkGatherBlocks64KiBTokenMajor(b *testing.B) {
	v := tokenMajor(benchCap)
	benchGather(b, v, blocksOp(b, v, 64<<10))
}

// Worst case: a transposed [128, 8192] bf16 matrix, runs of one element.
func BenchmarkGatherTransposed2B(b *testing.B) {
	v := View{Base: filled(8192 * 128 * 2), Shape: []int{128, 8192}, Strides: []int{1, 128}, ItemSize: 2}
	benchGather(b, v, gatherOp(b, v))
}

// Contiguous view: zero-copy, so the "gather" is nearly free.
func BenchmarkGatherContiguous(b *testing.B) {
	v := View{Base: filled(benchHeads * benchT * benchDim * 2), Shape: []int{1, benchHeads, benchT, benchDim},
		Strides: RowMajor([]int{1, benchHeads, benchT, benchDim}), ItemSize: 2}
	benchGather(b, v, func(dst []byte) int {
		out, _, err := v.Gather(dst)
		if err != nil {
			b.Fatal(err)
		}
		return len(out)
	})
}
