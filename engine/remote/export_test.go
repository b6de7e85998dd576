package remote

import "time"

// SetMinGrace lowers Collect's minimum grace so a test can age objects in
// seconds; it returns a function restoring the old value.
func SetMinGrace(d time.Duration) func() {
	old := minGrace
	minGrace = d
	return func() { minGrace = old }
}
