//go:build !race

package pageindex_test

// raceEnabled: see race_on_test.go.
const raceEnabled = false
