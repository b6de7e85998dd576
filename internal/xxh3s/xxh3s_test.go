package xxh3s

import (
	"fmt"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/zeebo/xxh3"
)

// TestZeroCopyActive: with the library version in go.mod the mirror matches,
// so the benchmark below measures the zero-copy path.
func TestZeroCopyActive(t *testing.T) {
	if !ZeroCopy() {
		t.Fatal("xxh3s: the mirror of zeebo/xxh3's Hasher does not match the library; Digest copies")
	}
}

// TestDigestEqualsHash: for random lengths (0 to 3 MiB) and random
// chunkings (chunks of 0 bytes to 300 KiB, including empty writes), Sum64
// equals xxh3.Hash of the whole and the library's own streaming Hasher.
func TestDigestEqualsHash(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	data := make([]byte, 3<<20)
	for i := range data {
		data[i] = byte(rng.Uint32())
	}
	var d Digest
	for iter := 0; iter < 300; iter++ {
		n := rng.IntN(len(data) + 1)
		if iter%3 == 0 {
			n = rng.IntN(5000) // small streams: every branch near the buffer
		}
		maxChunk := 1 + rng.IntN(300<<10)
		if iter%2 == 0 {
			maxChunk = 1 + rng.IntN(3000)
		}
		want := xxh3.Hash(data[:n])
		d.Reset()
		lib := xxh3.New()
		for o := 0; o < n; {
			c := min(rng.IntN(maxChunk+1), n-o)
			d.Write(data[o : o+c])
			lib.Write(data[o : o+c])
			o += c
		}
		if got := d.Sum64(); got != want || lib.Sum64() != want {
			t.Fatalf("iteration %d: %d bytes in chunks of up to %d: Digest %016x, library Hasher %016x, xxh3.Hash %016x", iter, n, maxChunk, got, lib.Sum64(), want)
		}
	}
}

// TestDigestDoesNotKeepInput: changing a chunk after Write (as a caller
// reusing its buffer would) does not change the digest: Digest holds no
// reference to bytes it has not hashed.
func TestDigestDoesNotKeepInput(t *testing.T) {
	rng := rand.New(rand.NewPCG(3, 4))
	data := make([]byte, 10_000)
	for i := range data {
		data[i] = byte(rng.Uint32())
	}
	want := xxh3.Hash(data)
	var d Digest
	buf := make([]byte, 1500)
	for o := 0; o < len(data); o += len(buf) {
		n := copy(buf, data[o:])
		d.Write(buf[:n])
		for i := range buf {
			buf[i] = 0xAA
		}
	}
	if got := d.Sum64(); got != want {
		t.Fatalf("Digest %016x, xxh3.Hash %016x", got, want)
	}
}

var sink uint64

// BenchmarkDigest: streaming a 1 MiB chunk that is hot in cache, as a read
// does right after pread. x-limit is the time of xxh3.Hash of the same bytes
// (measured in the same run) over Digest's time; the library's copying
// Hasher is reported as lib-x-limit.
func BenchmarkDigest(b *testing.B) {
	for _, size := range []int{256 << 10, 1 << 20} {
		b.Run(fmt.Sprintf("%dKiB", size>>10), func(b *testing.B) {
			buf := make([]byte, size)
			for i := range buf {
				buf[i] = byte(i * 7)
			}
			const reps = 64
			timeIt := func(fn func()) float64 {
				best := 0.0
				for range 3 {
					t0 := time.Now()
					for range reps {
						fn()
					}
					if d := float64(time.Since(t0)); best == 0 || d < best {
						best = d
					}
				}
				return best
			}
			var d Digest
			lib := xxh3.New()
			lib.Write(buf) // past the library's first-Write fast path
			b.SetBytes(int64(size))
			b.ReportAllocs()
			b.ResetTimer()
			for b.Loop() {
				d.Write(buf)
			}
			b.StopTimer()
			sink += d.Sum64()
			hash := timeIt(func() { sink += xxh3.Hash(buf) })
			ours := timeIt(func() { d.Write(buf) })
			copying := timeIt(func() { lib.Write(buf) })
			b.ReportMetric(hash/ours, "x-limit")
			b.ReportMetric(hash/copying, "lib-x-limit")
		})
	}
}
