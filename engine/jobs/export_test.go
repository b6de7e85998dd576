package jobs

import (
	"context"
	"log/slog"

	"github.com/kvpersist/kvpersist/engine/vfs"
)

// SetMaxHeldBlocks lowers how many block files a read keeps open (tests of
// the reopen path); it returns a function that restores the old value.
func SetMaxHeldBlocks(n int) (restore func()) {
	old := maxHeldBlocks
	maxHeldBlocks = n
	return func() { maxHeldBlocks = old }
}

// NewAsyncReadsWith is NewAsyncReads with its AIO setup replaced (a setup
// that fails, for the fallback tests).
func NewAsyncReadsWith(logger *slog.Logger, setup func(depth int) (*vfs.AsyncReader, error)) *AsyncReads {
	a := NewAsyncReads(logger)
	a.setup = setup
	return a
}

// AsyncInFlight is a.InFlight, after making sure a was set up (so that
// 0 means none in flight, not none set up).
func AsyncInFlight(a *AsyncReads) int { return a.reader().InFlight() }

// ReadExtentsThen is ReadExtents calling done(i, err) as each extent
// finishes (readExtents' hook).
func ReadExtentsThen(ctx context.Context, cfg *Config, exts []Extent, done func(i int, err error)) ([]error, ExtentStats, error) {
	return readExtents(ctx, cfg, exts, done)
}

// BlockSums is blockSums: a block's SHA-256 and XXH3-64 in one pass.
func BlockSums(data []byte) ([32]byte, uint64) { return blockSums(data) }
