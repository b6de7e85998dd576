package jobs

// SetMaxHeldBlocks lowers how many block files a read keeps open (tests of
// the reopen path); it returns a function that restores the old value.
func SetMaxHeldBlocks(n int) (restore func()) {
	old := maxHeldBlocks
	maxHeldBlocks = n
	return func() { maxHeldBlocks = old }
}
