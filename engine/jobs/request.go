package jobs

import (
	"fmt"
	"time"

	"github.com/kvpersist/kvpersist/engine/gather"
	"github.com/kvpersist/kvpersist/engine/layout"
	"github.com/kvpersist/kvpersist/engine/store"
)

// Ref names a snapshot of a store: the file <root>/<Namespace>/<Name>,
// where root is Config.Root (for the engine, engine.Config.Root). Both names
// are single path elements (layout.ValidName: 1-200 of [A-Za-z0-9._-], not
// starting with '.' or '-', not "blocks" or "pages").
type Ref struct {
	Namespace string
	Name      string
}

// String is "namespace/name".
func (r Ref) String() string { return r.Namespace + "/" + r.Name }

// Request is one of *WriteRequest, *ReadRequest, *CollectRequest,
// *DeleteRequest, *MigrateRequest, *SavePrefixRequest and
// *LoadPrefixRequest (prefix_request.go): the one request type of each job
// kind, taken by the engine's Submit and by this package's functions alike.
type Request interface{ request() }

func (*WriteRequest) request()   {}
func (*ReadRequest) request()    {}
func (*CollectRequest) request() {}
func (*DeleteRequest) request()  {}
func (*MigrateRequest) request() {}

// TensorSpec is one tensor to save: its dtype and a strided view of caller
// memory. The dtype says the element type once: View.ItemSize may be left
// 0 and is then the dtype's itemsize in bytes (layout.ItemSize); when set it
// must equal it (else ErrInvalidRequest).
type TensorSpec struct {
	DType string // "bfloat16", "float16", "float32", "int32", ... (layout.ItemSize)
	View  gather.View
	// Meta is the tensor's caller metadata (keys other than the format's,
	// see layout.Tensor.Meta); nil for none. It round-trips unchanged.
	Meta layout.Meta
	// Plan, for the block layout only, is the tensor's precomputed block
	// plan (for View's shape and the dtype's itemsize, else
	// ErrInvalidRequest): the blocks are cut where it says instead of at
	// WriteRequest.BlockBytes. Migrate uses it to keep a source's block
	// boundaries. nil: cut at BlockBytes.
	Plan *gather.Plan
}

// EntrySpec is one cache entry (e.g. a layer's K and V) or attachment.
type EntrySpec struct {
	Meta    layout.Meta // caller metadata, round-trips unchanged
	Tensors []TensorSpec
}

// WriteRequest saves a KV cache as the snapshot Ref. The views' memory, and
// the request itself (its Meta maps included), must stay valid and
// unchanged until the write returns (for the engine: until the ack). The
// header returned shares the request's Meta values (immutable JSON).
type WriteRequest struct {
	Ref
	// Layout is layout.Single, layout.Blocks or layout.Pages; there is no
	// default.
	Layout layout.Layout
	// Meta is top-level caller metadata (model id, token count, ...).
	Meta layout.Meta
	// Caches and Attachments are the tensor slots, in this order; together
	// at most layout.MaxSnapshotBytes (1 TiB) of tensor bytes.
	Caches      []EntrySpec
	Attachments []EntrySpec
	// BlockBytes is the block size in bytes of the block layout: a power of
	// two from 4 KiB to 64 MiB (CheckBlockBytes); 0 means the engine's
	// Config.BlockBytes (for a direct Write, DefaultBlockBytes).
	BlockBytes int
	// Packed gathers each whole tensor into scratch before cutting blocks
	// (the original's segmented:false); the blocks are identical, only the
	// copying differs. Default is segmented: blocks straight from the view.
	Packed bool
	// Identity, when not empty, is written as the header's top-level
	// "identity" (layout.IdentityKey; Meta must not have that key): a read
	// naming another identity fails with ErrMismatch. Required by the
	// Pages layout (it roots the page keys).
	Identity string
	// Tokens and PageTokens, for the Pages layout only: the token ids whose
	// KV the cache tensors hold (each cache tensor's axis -2 has exactly
	// len(Tokens) tokens) and tokens per page (0 means
	// layout.DefaultPageTokens). The cache is stored as token pages shared
	// with the prefix cache; the manifest lists their keys (writePages).
	Tokens     []uint32
	PageTokens int
}

// ReadRequest restores the snapshot Ref into Dest. Dest must stay valid
// until the read returns (for the engine: until the ack).
type ReadRequest struct {
	Ref
	// Dest holds one buffer per tensor slot in file order (caches, then
	// attachments); len(Dest[i]) must equal slot i's bytes exactly (from
	// the header of Stat: check Header.TotalBytes against what you can
	// allocate first).
	Dest [][]byte
	// NoVerify skips re-hashing what was read. The zero value verifies:
	// xxh3-64 per tensor (single file, page manifest), per block against
	// the xxh3-64 the manifest records (block layout, formatVersion 8),
	// SHA-256 per block against its name (formatVersion 5 manifests: the
	// Bun worker's, kvpersist's older ones); a tensor whose bytes do not
	// match fails with ErrCorrupt (in a *ReadError). Set NoVerify only
	// where a wrong byte cannot reach a model (benchmarks of the raw read
	// path): the headers' shapes and dtypes are still checked, the tensor
	// bytes are not.
	NoVerify bool
	// Expect, when non-nil, is the header the caller allocated for (from an
	// earlier Stat): every slot's dtype and shape must still match, else
	// ErrMismatch (the snapshot was replaced in between).
	Expect *layout.Header
	// Identity, when not empty, must equal the identity the snapshot was
	// written with (layout.Header.Identity), else ErrMismatch before any
	// destination is touched (also when it was written without one).
	Identity string
}

// DeleteRequest removes the snapshot file or manifest Ref (see Delete). Its
// blocks stay until a collect.
type DeleteRequest struct {
	Ref
}

// CollectRequest garbage-collects the store's unreferenced blocks and stale
// temp files (see Collect). Its report is Metrics.Collect.
type CollectRequest struct {
	// Namespaces to collect. nil means every namespace of the root; an
	// empty non-nil list (a filter that matched nothing) collects nothing:
	// no namespace is locked, scanned or swept, and Collect reports 0
	// namespaces. Beware that appending matches to a nil slice yields nil
	// when nothing matched: start a filter from []string{} to keep it
	// non-nil.
	Namespaces []string
	// DryRun deletes nothing; CollectMetrics.Deleted then lists what would
	// be deleted.
	DryRun bool
	// TempGrace: temp files younger than this are kept. 0 means the
	// engine's Config.TempGrace, else DefaultTempGrace; NoTempGrace (any
	// negative value) removes every temp file (only when no writer can be
	// running).
	TempGrace time.Duration
	// BlockGrace: unreferenced blocks whose file was written less than this
	// long ago (by mtime) are kept: a second line of defence for writers that
	// do not take the namespace lock, covering blocks they just wrote. It does
	// not cover an old block such a writer decides to reuse (its mtime is
	// not refreshed); only the lock protects reuse. 0 means the engine's
	// Config.BlockGrace, else none are kept back.
	BlockGrace time.Duration
	// Now is the clock for the grace periods; zero means time.Now().
	Now time.Time
}

// MigrateRequest migrates the stores written by the original Bun worker
// (files beginning with layout.LegacyMagic) into kvpersist's format, into
// the store at Config.Root (see Migrate). Its report is Metrics.Migrate.
//
// Every legacy snapshot SrcRoot/<ns>/<name> is restored with verification
// (Bun.hash per tensor, SHA-256 per block) and rewritten, in the same layout,
// at <root>/<ns>/<name>. The source is only read: no file, lock or temp file
// is created under SrcRoot.
type MigrateRequest struct {
	// SrcRoot is the root of the legacy store: each directory directly under
	// it is a namespace holding snapshot files, manifests and (block layout)
	// a flat blocks/ directory. It must differ from the destination root
	// and neither may contain the other (CheckMigrateRoots).
	SrcRoot string
	// Namespaces lists the namespace directories of SrcRoot to migrate, as
	// plain directory names; nil means every directory under SrcRoot. A name
	// kvpersist does not accept (layout.ValidName) is still scanned, and each
	// legacy snapshot in it is reported as failed (wrapping layout.ErrBadName).
	Namespaces []string
	// BlockBytes, for block manifests: 0 (the default) keeps the source's
	// block boundaries exactly, so the migrated manifest names the very same
	// blocks (same sizes, same SHA-256 names) and dedup between snapshots is
	// preserved as the original had it, whatever its block size was. A
	// non-zero value re-cuts every tensor at that size through Write
	// (CheckBlockBytes applies), so that later kvpersist writes at the same
	// size share blocks with the migrated snapshots. The engine's
	// Config.BlockBytes is not used here.
	BlockBytes int
	// Force migrates even when the destination already holds the snapshot
	// (re-migrates) or holds another file (overwrites it atomically).
	// Without it a destination is taken as migrated from its header alone
	// (see StatusSkipped): a single-file snapshot's data is not compared,
	// since the two formats hash tensors differently. Sources are expected
	// not to change once the original worker is retired; if one did (same
	// shapes, new data), Force migrates it again.
	Force bool
	// OnPlan, when non-nil, is called once after the scan with the number
	// of legacy snapshots found and the sum of their tensor bytes (snapshots
	// whose header does not decode count 0 bytes).
	OnPlan func(snapshots int, logicalBytes int64)
	// OnItem, when non-nil, is called after each snapshot, in the order of
	// MigrateReport.Items. Both callbacks run on Migrate's own goroutine,
	// one at a time, and never after Migrate returns (for the engine:
	// before the ack).
	OnItem func(MigrateItem)
}

// snapshotPath resolves ref under cfg.Root. Errors wrap layout.ErrBadName
// (a name that is not one valid path element) or ErrInvalidRequest (no
// root).
func (c *Config) snapshotPath(ref Ref) (string, error) {
	ns, err := c.namespace(ref.Namespace)
	if err != nil {
		return "", err
	}
	return ns.Path(ref.Name)
}

// namespace resolves the namespace name under cfg.Root (no disk access).
// Errors wrap layout.ErrBadName (not one valid path element) or
// ErrInvalidRequest (no root).
func (c *Config) namespace(name string) (*store.Namespace, error) {
	if c.Root == "" {
		return nil, fmt.Errorf("%w: Config.Root is empty", ErrInvalidRequest)
	}
	return store.At(c.Root, c.storeOptions()).Namespace(name)
}
