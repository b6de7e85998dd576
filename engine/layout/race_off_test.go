//go:build !race

package layout_test

// raceEnabled: see race_on_test.go.
const raceEnabled = false
