package readio

import (
	"errors"
	"log/slog"

	"github.com/kvpersist/kvpersist/engine/vfs"
)

// Config is what a read needs from its caller (package jobs builds it from
// its own Config).
type Config struct {
	// FS is the file system; nil means vfs.Default.
	FS vfs.FS
	// ReadDepth is how many read requests one Read keeps in flight; 0
	// means DefaultReadDepth, at most MaxReadDepth.
	ReadDepth int
	// NoDirect turns O_DIRECT reads off (buffered reads only).
	NoDirect bool
	// Async, when non-nil, issues the O_DIRECT reads asynchronously (see
	// AsyncReads); nil: preads.
	Async *AsyncReads
	// Spawn runs fn on a goroutine of the caller's bounded pool if one is
	// free now and reports whether it did; it must never block. Read and
	// InFlight take up to Helpers of them before starting goroutines of
	// their own. nil: none.
	Spawn func(fn func()) bool
	// Helpers caps how many goroutines one Read asks Spawn for; 0 means 1.
	Helpers int
	// Logger receives the O_DIRECT and AIO decisions (once per file
	// system); nil means slog.Default().
	Logger *slog.Logger
}

func (c *Config) fs() vfs.FS {
	if c.FS == nil {
		return vfs.Default
	}
	return c.FS
}

func (c *Config) helpers() int {
	if c.Helpers <= 0 {
		return 1
	}
	return c.Helpers
}

// Sentinel errors of a read, usable with errors.Is (package jobs exports
// them under its own names).
var (
	// ErrCorrupt: an extent failed verification.
	ErrCorrupt = errors.New("data failed verification")
	// ErrShort: a file ended before an extent did.
	ErrShort = errors.New("file size mismatch")
	// ErrPanic: a read goroutine panicked; the panic was recovered.
	ErrPanic = errors.New("job panicked")
	// ErrNotRegular: a Source was asked of a file that is not a regular
	// file.
	ErrNotRegular = errors.New("not a regular file")
)
