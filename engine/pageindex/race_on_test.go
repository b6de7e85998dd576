//go:build race

package pageindex_test

// raceEnabled: the race detector makes sync.Pool drop items at random, so
// the pooled hashing buffers allocate; allocation tests skip.
const raceEnabled = true
