// Package bunhash computes Bun.hash as implemented by Bun 1.4.4: Zig's
// standard-library Wyhash (std.hash.Wyhash), the "final4" variant with the
// original wyhash secret constants, in its one-shot form.
//
// The original Bun worker hashed tensors with Bun.hash (seed 0) and stored the
// result as 16 lowercase hex digits. This package reproduces that function
// bit for bit so that stores written by the original worker can be read and
// verified. It is not Go's runtime hash nor any other published wyhash
// variant (final3, v4.2, ...); the output differs from those.
//
// The implementation is pure Go, has no dependencies outside the standard
// library and does not allocate.
package bunhash

import (
	"encoding/binary"
	"math/bits"
)

// The four wyhash secret constants used by Zig's std.hash.Wyhash.
const (
	secret0 uint64 = 0xa0761d6478bd642f
	secret1 uint64 = 0xe7037ed1a0b428db
	secret2 uint64 = 0x8ebc6af09c88c6e3
	secret3 uint64 = 0x589965cc75374cc3
)

// mum returns the low and high halves of the 128-bit product a*b.
func mum(a, b uint64) (lo, hi uint64) {
	hi, lo = bits.Mul64(a, b)
	return lo, hi
}

// mix folds the 128-bit product a*b into 64 bits.
func mix(a, b uint64) uint64 {
	lo, hi := mum(a, b)
	return lo ^ hi
}

func r8(b []byte) uint64 { return binary.LittleEndian.Uint64(b) }
func r4(b []byte) uint64 { return uint64(binary.LittleEndian.Uint32(b)) }

// Hash returns Bun.hash(b, seed), i.e. Zig's std.hash.Wyhash.hash(seed, b).
func Hash(seed uint64, b []byte) uint64 {
	n := len(b)
	s0 := seed ^ mix(seed^secret0, secret1)

	var a, c uint64 // Zig's self.a and self.b
	switch {
	case n == 0:
		// a = c = 0
	case n <= 3:
		a = uint64(b[0])<<16 | uint64(b[n>>1])<<8 | uint64(b[n-1])
	case n <= 16:
		end := n - 4
		quarter := (n >> 3) << 2
		a = r4(b)<<32 | r4(b[quarter:])
		c = r4(b[end:])<<32 | r4(b[end-quarter:])
	default:
		i := 0
		if n >= 48 {
			s1, s2 := s0, s0
			// Every full 48-byte chunk except a final chunk that ends the input.
			for ; i+48 < n; i += 48 {
				p := b[i : i+48 : i+48]
				s0 = mix(r8(p[0:])^secret1, r8(p[8:])^s0)
				s1 = mix(r8(p[16:])^secret2, r8(p[24:])^s1)
				s2 = mix(r8(p[32:])^secret3, r8(p[40:])^s2)
			}
			s0 ^= s1 ^ s2
		}
		// At most 48 bytes remain: consume them 16 at a time, keeping the
		// last (possibly overlapping) 16 bytes for the finish.
		for ; i+16 < n; i += 16 {
			s0 = mix(r8(b[i:])^secret1, r8(b[i+8:])^s0)
		}
		a = r8(b[n-16:])
		c = r8(b[n-8:])
	}

	a ^= secret1
	c ^= s0
	a, c = mum(a, c)
	return mix(a^secret0^uint64(n), c^secret1)
}

// Sum returns Hash(0, b): Bun.hash with its default seed, as used by the
// original worker.
func Sum(b []byte) uint64 { return Hash(0, b) }

// Hex returns Sum(b) formatted as 16 lowercase hex digits (fmt "%016x"),
// the form in which the original worker stored tensor hashes.
func Hex(b []byte) string {
	const digits = "0123456789abcdef"
	h := Sum(b)
	var buf [16]byte
	for i := len(buf) - 1; i >= 0; i-- {
		buf[i] = digits[h&0xf]
		h >>= 4
	}
	return string(buf[:])
}
