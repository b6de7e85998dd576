// Package scratch hands out reusable byte buffers by power-of-two size
// class, so that scratch memory is bounded by (goroutines using it × class
// size) and reused across jobs instead of growing to the largest tensor
// ever seen. Package jobs (gathers, block writes) and package readio
// (O_DIRECT staging) share it.
package scratch

import "sync"

var pools [40]sync.Pool

// Get returns a buffer of at least n bytes (its length is n rounded up to
// a power of two); give it back with Put.
func Get(n int) *[]byte {
	class := 0
	for 1<<class < n {
		class++
	}
	if b, ok := pools[class].Get().(*[]byte); ok {
		return b
	}
	b := make([]byte, 1<<class)
	return &b
}

// Put gives back a buffer from Get; the caller must not use it after.
func Put(b *[]byte) {
	class := 0
	for 1<<class < len(*b) {
		class++
	}
	pools[class].Put(b)
}
