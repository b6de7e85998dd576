//go:build race

package engine

// raceEnabled: the race detector makes sync.Pool drop items at random, so
// the pooled hashing buffers allocate; allocation tests skip.
const raceEnabled = true
