package jobs

// SetMaxHeldBlocks lowers how many block files a read keeps open (tests of
// the reopen path); it returns a function that restores the old value.
func SetMaxHeldBlocks(n int) (restore func()) {
	old := maxHeldBlocks
	maxHeldBlocks = n
	return func() { maxHeldBlocks = old }
}

// BlockSums is blockSums: a block's SHA-256 and XXH3-64 in one pass.
func BlockSums(data []byte) ([32]byte, uint64) { return blockSums(data) }
