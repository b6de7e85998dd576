package jobs_test

import (
	"math/rand/v2"
	"testing"
	"time"

	"github.com/kvpersist/kvpersist/engine/jobs"
	"github.com/minio/sha256-simd"
	"github.com/zeebo/xxh3"
)

// blockSums's two hashes equal SHA-256 and xxh3.Hash of the whole block,
// computed independently, at lengths around its 64 KiB pieces and the
// hashes' own block sizes.
func TestBlockSums(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	data := make([]byte, 3<<20+77)
	for i := range data {
		data[i] = byte(rng.Uint32())
	}
	for _, n := range []int{0, 1, 63, 64, 1023, 1024, 1025, 64<<10 - 1, 64 << 10, 64<<10 + 1, 1 << 20, 1<<20 + 4096, len(data)} {
		sum, xx := jobs.BlockSums(data[:n])
		if sum != sha256.Sum256(data[:n]) || xx != xxh3.Hash(data[:n]) {
			t.Fatalf("%d bytes: blockSums %x %016x, want %x %016x", n, sum, xx, sha256.Sum256(data[:n]), xxh3.Hash(data[:n]))
		}
	}
}

// BenchmarkBlockSums: the hashing of a block save, SHA-256 and xxh3-64 of
// each 1 MiB block of 64 MiB in one pass (blockSums), on one core, against
// SHA-256 alone of the same blocks (sha256.Sum256, timed apart in the same
// iterations, alternating, with the benchmark's timer stopped, so ns/op
// and MB/s are blockSums's): x-limit = SHA-256's time / blockSums's, what
// adding the xxh3 leaves of a save's hashing speed (1 would be free).
func BenchmarkBlockSums(b *testing.B) {
	const blockBytes, total = 1 << 20, 64 << 20
	data := make([]byte, total)
	rng := rand.New(rand.NewPCG(3, 4))
	for i := range data {
		data[i] = byte(rng.Uint32())
	}
	blocks := func(fn func(p []byte)) time.Duration {
		t0 := time.Now()
		for o := 0; o < total; o += blockBytes {
			fn(data[o : o+blockBytes])
		}
		return time.Since(t0)
	}
	ours := func(p []byte) { s, x := jobs.BlockSums(p); blockSumsSink += x + uint64(s[0]) }
	sha := func(p []byte) { s := sha256.Sum256(p); blockSumsSink += uint64(s[0]) }
	shaApart := func() time.Duration {
		b.StopTimer()
		defer b.StartTimer()
		return blocks(sha)
	}
	b.SetBytes(total)
	b.ReportAllocs()
	var tOurs, tSHA time.Duration
	for i := 0; b.Loop(); i++ {
		if i%2 == 0 {
			tOurs += blocks(ours)
			tSHA += shaApart()
		} else {
			tSHA += shaApart()
			tOurs += blocks(ours)
		}
	}
	b.ReportMetric(float64(tSHA)/float64(tOurs), "x-limit")
	b.ReportMetric(float64(total)*float64(b.N)/tSHA.Seconds()/1e9, "sha256-GB/s")
}

// blockSumsSink keeps BenchmarkBlockSums's hashes live.
var blockSumsSink uint64
