package readio

// AsyncInFlight is a.InFlight, after making sure a was set up (so that
// 0 means none in flight, not none set up).
func AsyncInFlight(a *AsyncReads) int { return a.reader().InFlight() }
