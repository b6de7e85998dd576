// Package xxh3s is a streaming XXH3-64 (seed 0) that does not copy what it
// hashes. It drives github.com/zeebo/xxh3's Hasher: the library's Write
// hashes whole 1,024-byte blocks straight from the caller's memory only on
// a hasher's first Write; afterwards it copies every byte through a
// 1,088-byte internal buffer first, which more than halves the hashing
// speed of data hot in cache (BenchmarkDigest). Digest.Write instead brings the
// hasher back to a block boundary with an empty buffer (copying at most
// about 1 KiB per Write) and lets the library's no-copy path hash the rest
// of the chunk in place.
//
// Doing so sets one unexported field of the library's Hasher (the count of
// buffered bytes) through a mirror of its struct (zeebo/xxh3 v1.1.0). The
// package checks at start-up that the mirror has the Hasher's size and that
// the result equals xxh3.Hash over many lengths and chunkings; if either
// check fails (a changed library), Digest falls back to the library's
// copying Write, which is slower but right. ZeroCopy reports which is used.
package xxh3s

import (
	"unsafe"

	"github.com/zeebo/xxh3"
)

// The library's block and stripe sizes in bytes (zeebo/xxh3 consts.go).
const (
	blockBytes  = 1024
	stripeBytes = 64
	bufBytes    = blockBytes + stripeBytes
)

// mirror has the memory layout of xxh3.Hasher in zeebo/xxh3 v1.1.0.
type mirror struct {
	acc  [8]uint64
	blk  uint64
	len  uint64 // bytes buffered in buf, not yet hashed
	key  unsafe.Pointer
	buf  [bufBytes]byte
	seed uint64
}

// zeroCopy is true when the mirror matches the library (checked once).
var zeroCopy = unsafe.Sizeof(xxh3.Hasher{}) == unsafe.Sizeof(mirror{}) && selfTest()

// ZeroCopy reports whether Digest hashes without copying (true unless the
// library's Hasher no longer matches the layout this package knows).
func ZeroCopy() bool { return zeroCopy }

// Digest is a streaming XXH3-64 with seed 0: after any sequence of Writes,
// Sum64 equals xxh3.Hash of their concatenation. The zero value is ready to
// use. It is not safe for concurrent use.
type Digest struct {
	h xxh3.Hasher
}

// Reset makes d hash a new stream.
func (d *Digest) Reset() { d.h = xxh3.Hasher{} }

// Sum64 returns the XXH3-64 of everything written since the last Reset.
func (d *Digest) Sum64() uint64 { return d.h.Sum64() }

// Write adds p to the stream. It never keeps p after it returns.
func (d *Digest) Write(p []byte) {
	if zeroCopy {
		d.write(p)
	} else {
		d.h.Write(p)
	}
}

func (d *Digest) write(p []byte) {
	m := (*mirror)(unsafe.Pointer(&d.h))
	for {
		r := int(m.len)
		if r == 0 || r+len(p) <= bufBytes {
			// Either nothing is buffered, so the library hashes every
			// whole block but the last straight from p and copies at most
			// bufBytes, or p is small enough to copy.
			d.h.Write(p)
			return
		}
		if r > blockBytes {
			// More than a block is buffered: fill the buffer and let a
			// one-byte Write hash its first block; 65 bytes stay buffered.
			fill := bufBytes - r
			d.h.Write(p[:fill+1])
			p = p[fill+1:]
			continue
		}
		// 0 < r <= 1024: complete the buffered block from p, so the stream
		// position is at a block boundary where p begins.
		fill := blockBytes - r
		d.h.Write(p[:fill])
		p = p[fill:]
		// len(p) > 64 here (r+len(p) > bufBytes on entry). The library
		// hashes the buffered block only once bufBytes are buffered and
		// more arrive: buffer p[:65], which hashes the block and leaves
		// p[:65] buffered, then forget the buffered copy (m.len = 0): p is
		// still the next data, and the no-copy path takes it from here.
		d.h.Write(p[:stripeBytes+1])
		m.len = 0
	}
}

// selfTest checks Digest's zero-copy path against xxh3.Hash over lengths
// around block boundaries and chunkings that hit every branch of write.
func selfTest() bool {
	data := make([]byte, 8*bufBytes+123)
	x := uint64(0x9E3779B97F4A7C15)
	for i := range data {
		x ^= x << 13
		x ^= x >> 7
		x ^= x << 17
		data[i] = byte(x)
	}
	for _, n := range []int{0, 1, 64, 65, 240, 241, 1023, 1024, 1025, 1088, 1089, 2048, 2113, 3000, 5000, len(data)} {
		want := xxh3.Hash(data[:n])
		for _, chunk := range []int{1, 63, 64, 65, 1000, 1024, 1087, 1088, 1089, 2000, 4096} {
			var d Digest
			for o := 0; o < n; o += chunk {
				d.write(data[o:min(o+chunk, n)])
			}
			if d.Sum64() != want {
				return false
			}
		}
	}
	return true
}
