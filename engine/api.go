package engine

import (
	"io/fs"

	"github.com/kvpersist/kvpersist/engine/gather"
	"github.com/kvpersist/kvpersist/engine/jobs"
	"github.com/kvpersist/kvpersist/engine/layout"
)

// The types an embedder needs, so that saving and restoring takes this one
// import. They are aliases: the same types as in the subpackages (jobs,
// layout, gather), which stay for those who want them.
type (
	// Ref names a snapshot: <Root>/<Namespace>/<Name>.
	Ref = jobs.Ref
	// Request is one of *WriteRequest, *ReadRequest, *CollectRequest,
	// *DeleteRequest and *MigrateRequest.
	Request = jobs.Request
	// WriteRequest saves a KV cache (see jobs.WriteRequest).
	WriteRequest = jobs.WriteRequest
	// ReadRequest restores a snapshot into caller-owned buffers.
	ReadRequest = jobs.ReadRequest
	// CollectRequest garbage-collects unreferenced blocks.
	CollectRequest = jobs.CollectRequest
	// DeleteRequest removes a snapshot file or manifest.
	DeleteRequest = jobs.DeleteRequest
	// MigrateRequest migrates a store of the original Bun worker.
	MigrateRequest = jobs.MigrateRequest
	// EntrySpec is one cache entry (a layer's K and V) or attachment of a
	// WriteRequest.
	EntrySpec = jobs.EntrySpec
	// TensorSpec is one tensor of a WriteRequest: its dtype, given once,
	// and a View of caller memory (View.ItemSize may be left 0).
	TensorSpec = jobs.TensorSpec
	// View is a strided view of caller memory: Shape and Strides in
	// elements, ItemSize in bytes.
	View = gather.View
	// Layout is Single or Blocks.
	Layout = layout.Layout
	// Meta is caller metadata: JSON values by key.
	Meta = layout.Meta
	// Snapshot is a decoded, validated snapshot (what Stat returns).
	Snapshot = layout.Snapshot
	// Header is a snapshot's header: its tensor slots (Slots), their dtypes,
	// shapes and bytes, and caller metadata; TotalBytes sums the slots.
	Header = layout.Header
	// Entry is one cache entry or attachment of a Header.
	Entry = layout.Entry
	// Tensor is one tensor slot of a Header.
	Tensor = layout.Tensor
	// BlockRef names one block of a tensor in a block manifest.
	BlockRef = layout.BlockRef
	// Metrics are a job's counters (Result.Metrics); Collect and Migrate
	// hold the report of those kinds.
	Metrics = jobs.Metrics
	// CollectMetrics is a collect's report (Result.Metrics.Collect).
	CollectMetrics = jobs.CollectMetrics
	// MigrateReport is a migrate's report (Result.Metrics.Migrate).
	MigrateReport = jobs.MigrateReport
	// MigrateItem is one snapshot of a MigrateReport.
	MigrateItem = jobs.MigrateItem
	// MigrateStatus says what a migrate did with one snapshot.
	MigrateStatus = jobs.MigrateStatus
	// ReadError lists every tensor a read could not restore.
	ReadError = jobs.ReadError
	// SlotError is one tensor of a ReadError.
	SlotError = jobs.SlotError
	// MigrateError lists the snapshots a migrate could not migrate.
	MigrateError = jobs.MigrateError
)

// Layouts of a WriteRequest.
const (
	// Single is one file holding the header and every tensor's bytes.
	Single = layout.Single
	// Blocks is a manifest naming content-addressed block files (dedup).
	Blocks = layout.Blocks
)

// Sizes, in bytes.
const (
	// DefaultBlockBytes is the default block size of the block layout (1 MiB).
	DefaultBlockBytes = jobs.DefaultBlockBytes
	// MaxSnapshotBytes caps a snapshot's tensor bytes (1 TiB); see
	// layout.MaxSnapshotBytes.
	MaxSnapshotBytes = layout.MaxSnapshotBytes
)

// What a migrate did with one snapshot (MigrateItem.Status).
const (
	StatusMigrated = jobs.StatusMigrated
	StatusSkipped  = jobs.StatusSkipped
	StatusFailed   = jobs.StatusFailed
)

// Sentinel errors of the jobs and of decoding, re-exported so that
// errors.Is works with this import alone. Each is the subpackage's own
// value (errors.Is(err, engine.ErrCorrupt) == errors.Is(err, jobs.ErrCorrupt)).
var (
	// ErrNotFound: the snapshot does not exist (Stat, a read, a delete);
	// it is fs.ErrNotExist.
	ErrNotFound = fs.ErrNotExist
	// ErrInvalidRequest: a request is malformed (no tensors, a bad view, a
	// dtype whose itemsize disagrees with the view's, tensors past
	// MaxSnapshotBytes, ...).
	ErrInvalidRequest = jobs.ErrInvalidRequest
	// ErrBlockBytes: a block size is not a power of two from 4 KiB to 64 MiB.
	ErrBlockBytes = jobs.ErrBlockBytes
	// ErrDestination: a read's destinations do not match the snapshot.
	ErrDestination = jobs.ErrDestination
	// ErrMismatch: the snapshot's dtypes or shapes differ from
	// ReadRequest.Expect (it was replaced since Stat).
	ErrMismatch = jobs.ErrMismatch
	// ErrCorrupt: a tensor or block failed verification.
	ErrCorrupt = jobs.ErrCorrupt
	// ErrMissingBlock: a block named by a manifest does not exist.
	ErrMissingBlock = jobs.ErrMissingBlock
	// ErrBlockSize: a block file's size differs from its manifest entry.
	ErrBlockSize = jobs.ErrBlockSize
	// ErrPanic: a job panicked; the panic was recovered and the job acked.
	ErrPanic = jobs.ErrPanic
	// ErrDestinationExists: a migrate's destination holds another file.
	ErrDestinationExists = jobs.ErrDestinationExists
	// ErrUnsupported: a legacy snapshot cannot be migrated unchanged.
	ErrUnsupported = jobs.ErrUnsupported
	// ErrBadName: a namespace or snapshot name is not one valid path
	// element (errors from Submit wrap ErrPath too).
	ErrBadName = layout.ErrBadName
	// ErrBadMagic, ErrTruncated, ErrHeaderTooLarge, ErrHeaderHash,
	// ErrFormatVersion, ErrInvalidHeader, ErrUnknownDType and
	// ErrSnapshotTooLarge: a file failed decoding (see ARCHITECTURE.md,
	// "Validation"). A WriteRequest's unknown dtype, or tensors past
	// MaxSnapshotBytes, wrap ErrUnknownDType or ErrSnapshotTooLarge as well
	// as ErrInvalidRequest.
	ErrBadMagic         = layout.ErrBadMagic
	ErrTruncated        = layout.ErrTruncated
	ErrHeaderTooLarge   = layout.ErrHeaderTooLarge
	ErrHeaderHash       = layout.ErrHeaderHash
	ErrFormatVersion    = layout.ErrFormatVersion
	ErrInvalidHeader    = layout.ErrInvalidHeader
	ErrUnknownDType     = layout.ErrUnknownDType
	ErrSnapshotTooLarge = layout.ErrSnapshotTooLarge
)

// MetaOf marshals each value of m with encoding/json into a Meta.
func MetaOf(m map[string]any) (Meta, error) { return layout.MetaOf(m) }

// RowMajor returns the strides, in elements, of a contiguous row-major
// tensor of the given shape: the View of an unpadded buffer.
func RowMajor(shape []int) []int { return gather.RowMajor(shape) }

// ItemSize returns the itemsize in bytes of a dtype ("bfloat16": 2), or an
// error wrapping ErrUnknownDType.
func ItemSize(dtype string) (int, error) { return layout.ItemSize(dtype) }
