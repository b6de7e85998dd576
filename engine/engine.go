// Package engine is kvpersist's public API: an Engine saves KV caches to a
// store on local disk and restores them into caller-owned buffers, running
// write, read and collect jobs asynchronously on a bounded pool.
//
// A caller submits a job and receives its ack channel. The engine touches a
// caller's buffers (the views of a write, the destinations of a read) only
// between submission and the ack: once the ack has arrived the buffers are
// the caller's again, whatever happened (success, error, cancellation, a
// recovered panic, Close). See ARCHITECTURE.md for the ordering rules.
//
// The store: <Root>/<namespace>/<name> is a snapshot file (single-file
// layout) or a manifest (block layout) whose blocks live in
// <Root>/<namespace>/blocks/. Namespaces and names are plain file names
// (layout.ValidName).
//
// This package is all an embedder imports: the request, view, header,
// report and error types of the subpackages (jobs, layout, gather) are
// aliased here and their sentinels re-exported (api.go); the subpackages
// stay usable on their own. See Example for a save and a verified restore.
package engine

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"runtime"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvpersist/kvpersist/engine/events"
	"github.com/kvpersist/kvpersist/engine/jobs"
	"github.com/kvpersist/kvpersist/engine/layout"
	"github.com/kvpersist/kvpersist/engine/pagecache"
	"github.com/kvpersist/kvpersist/engine/pageindex"
	"github.com/kvpersist/kvpersist/engine/readio"
	"github.com/kvpersist/kvpersist/engine/store"
	"github.com/kvpersist/kvpersist/engine/tier"
	"github.com/kvpersist/kvpersist/engine/vfs"
	"github.com/panjf2000/ants/v2"
)

// Sentinel errors of the engine, usable with errors.Is.
var (
	// ErrClosed: the engine is closed (or closing) and accepts no jobs; also
	// the cause of jobs cancelled because Close's context ended.
	ErrClosed = errors.New("engine closed")
	// ErrBusy: TrySubmit found the mailbox full.
	ErrBusy = errors.New("engine mailbox full")
	// ErrConfig: a Config field is out of range.
	ErrConfig = errors.New("invalid engine config")
	// ErrPath: a snapshot path would leave the store root (a symlinked
	// namespace directory) or a name is invalid (wraps layout.ErrBadName).
	ErrPath = errors.New("invalid snapshot path")
)

// Config configures an Engine. Zero values take the documented defaults.
type Config struct {
	// Root is the store's root directory (created if missing).
	Root string
	// Workers bounds the goroutines that run jobs and their tasks; default
	// runtime.GOMAXPROCS(0).
	Workers int
	// Mailbox is how many accepted jobs may wait to start (Stats.Queued)
	// before Submit blocks (and TrySubmit returns ErrBusy); default 256.
	Mailbox int
	// BlockBytes is the block size of block-layout writes that leave
	// theirs 0, in bytes; default 1 MiB (DefaultBlockBytes): a power of two
	// from 4 KiB to 64 MiB.
	BlockBytes int
	// NoSync turns every fsync off. Only for tests and tmpfs: an engine
	// that syncs does not fdatasync a page it reuses, so a NoSync engine's
	// pages on a shared root stay undurable even after a syncing engine
	// reuses them (ARCHITECTURE.md, "Known-durable pages").
	NoSync bool
	// TempGrace and BlockGrace are collect's grace periods, for collect
	// requests that leave theirs 0 (see CollectRequest); zero TempGrace
	// means jobs.DefaultTempGrace (10 minutes), jobs.NoTempGrace none.
	// The page cache removes temp page files older than TempGrace at New
	// and in the background, and counts the younger ones within the
	// capacity (pagecache.Options).
	TempGrace, BlockGrace time.Duration
	// FS is the file system seam; nil means the real one (vfs.Default).
	FS vfs.FS
	// Logger receives job events at debug level, failed jobs included (a
	// job's error is its Result's, never also a warning), and at warn
	// level only what no ack reports (background eviction, checkpoints,
	// uploads); nil means slog.Default().
	Logger *slog.Logger
	// Metrics, when set, counts every finished job (kind, outcome, latency,
	// bytes): usually a *metrics.Recorder, registered in the scheduler's
	// Prometheus registry, whose cache gauges New points at this engine's
	// Usage (UsageSink). nil: none.
	Metrics MetricsSink
	// ReadDepth is how many read requests one restore keeps in flight;
	// default readio.DefaultReadDepth (see readio.Read). NoDirect turns
	// O_DIRECT reads off (by default they are used where the file system
	// supports them, with a buffered fallback).
	ReadDepth int
	NoDirect  bool
	// NoAsyncReads turns the asynchronous O_DIRECT reads off: the engine
	// then waits for the disk in preads, each holding a Go scheduler P
	// while it blocks (see readio.AsyncReads). By default the first cold
	// read sets up one Linux AIO context, shared by every read until
	// Close; if that fails (no AIO, seccomp, aio-max-nr), preads are used,
	// logged once.
	NoAsyncReads bool
	// Remote, when set, puts an object-store tier (any S3-compatible
	// store) behind the local page cache: loads fetch the pages the store
	// holds past the local prefix (LookupRemote tells how far), saves
	// upload their pages in the background, and Close finishes or abandons
	// the uploads within its context. See RemoteTier and engine/tier.
	Remote *RemoteTier

	// CapacityBytes bounds the prefix page cache: the allocated bytes
	// (st_blocks × 512, vfs.AllocatedBytes) of every page file of every
	// namespace under Root; 0 means unbounded. The accounting is rebuilt
	// from the disk at New and kept exact by the engine's saves, evictions,
	// deletes and collects. The bound: a save reserves an upper bound of
	// its new pages' allocated bytes (each page file's length rounded up to
	// the file system's block size) before it creates any file, and waits
	// until the victims chosen for it are unlinked before it writes, so at
	// every instant the allocated bytes D of the page tree (published and
	// temp page files) satisfy
	//
	//	D ≤ CapacityBytes + S × P + E
	//
	// where S is the number of saves in flight at that instant (a page
	// the remote tier fetches counts as a save of one page: it is
	// reserved the same way) and P the largest page file's allocated
	// bytes (a save's victims may free up to
	// one page more than it needs, and another save may use that room
	// while the victim is still being unlinked), and E the allocated bytes
	// of the background eviction's victims not yet unlinked: 0 except
	// after SetQuota lowers a quota or pages are found beyond the limits;
	// those victims count as freed but wait for their namespace's
	// exclusive lock, which loads of that namespace may keep busy. Pages
	// found on disk beyond the capacity at New (or written by another
	// process) are evicted in the background (ReasonShrink). Temp page
	// files a killed writer left are removed once older than TempGrace and
	// counted in D's accounting until then (Usage().TempBytes). A save that
	// cannot make room (every page that could go is pinned, shared by a
	// stored descendant, or protected by a quota) fails with ErrNoSpace,
	// writes nothing and leaves every stored page intact. Several engines
	// on one root (in one process or several) share one accounting and one
	// recency through the root's page log (engine/pagecache): the bound
	// holds over the root's page files with S counting the saves in flight
	// of every engine and the smallest capacity among them. Pins (of
	// loads, of saves' reused pages, of page manifests) are this engine's;
	// what keeps a load of another process on the same root safe from this
	// engine's evictions is the namespace's shared lock that load holds
	// during its reads (evictions unlink only under the exclusive lock, as
	// collect deletes), and a page manifest written by another process is
	// found, under that lock, before its pages could be unlinked. See
	// ARCHITECTURE.md, "Bounded page cache".
	CapacityBytes int64
	// HeadroomBytes is the minimum of free bytes (statvfs f_bavail ×
	// f_frsize) to keep on the file system holding Root, for the other
	// writers on the disk; 0 means none. Below it a save evicts first,
	// then fails with ErrNoSpace (limit "headroom").
	HeadroomBytes int64
	// QuotaBytes bounds a namespace's page files (allocated bytes), per
	// namespace name; a namespace absent or with 0 has none. A namespace
	// within its quota is never evicted for another namespace's save.
	QuotaBytes map[string]int64

	// Events, when set, publishes the prefix cache's pages as KV events
	// in vLLM's wire format over ZMQ, for the fleet's routers (PUB and
	// replay endpoints, topic, medium, locality, data-parallel rank: see
	// events.Config and docs/format/kv-events.md). New announces the pages
	// on disk in the background once the index is rebuilt; AnnounceSnapshot
	// does it on request. nil: none.
	Events *events.Config
}

// Engine runs jobs against one store. It is safe for concurrent use.
type Engine struct {
	cfg     Config
	store   *store.Store
	jcfg    jobs.Config
	log     *slog.Logger
	pool    *ants.Pool
	mailbox chan *job
	slots   chan struct{} // one token per queued job: the mailbox's bound
	done    chan *job     // completions, to the dispatcher
	kickCh  chan struct{} // wake the dispatcher (a cancel, a freed worker)
	closing chan struct{} // closed when Close starts
	stopped chan struct{} // closed when the dispatcher has exited
	abort   chan struct{} // closed when Close's ctx ends: cancel everything

	mu        sync.RWMutex // guards closed against in-flight Submit sends
	closed    bool
	closeOnce sync.Once // closes closing

	waiting atomic.Bool // a job is eligible but no worker is free
	nextID  atomic.Uint64
	stats   stats
	abortMu sync.Once

	helpersStarted atomic.Int64 // helper tasks the pool accepted (tests)

	pages *pageindex.Index // the prefix cache's index (prefix.go)
	tier  *tier.Tier       // the object-store tier; nil without Config.Remote (remote.go)
	// tierOnce closes the tier once (Close may be called concurrently).
	tierOnce sync.Once
	pc       *pagecache.Cache // the bounded page cache: accounting, eviction, checkpoints
	pcOnce   sync.Once
	ev       *engineEvents // the KV events publisher; nil without Config.Events (events.go)
}

type stats struct {
	queued, running, completed, failed   atomic.Int64
	bytesWritten, bytesReused, bytesRead atomic.Int64
	bytesReadDirect, bytesReadAsync      atomic.Int64
}

// Stats is a snapshot of the engine's counters. Bytes are bytes.
type Stats struct {
	Queued       int64 // accepted, not started
	Running      int64
	Completed    int64 // acked, including failures
	Failed       int64 // acked with an error
	BytesWritten int64 // WrittenBytes summed over writes
	BytesReused  int64 // ReusedBytes summed over writes (dedup)
	BytesRead    int64 // ReadBytes summed over reads
	// BytesReadDirect: the part of BytesRead read with O_DIRECT; it stays 0
	// where the file system has no O_DIRECT (the buffered fallback).
	BytesReadDirect int64
	// BytesReadAsync: the part of BytesReadDirect read asynchronously
	// (Linux AIO, see Config.NoAsyncReads); it stays 0 when the AIO setup
	// failed (preads instead: logged once).
	BytesReadAsync int64
}

// New opens an engine on cfg.Root and starts its dispatcher. Close it.
func New(cfg Config) (*Engine, error) {
	if cfg.Root == "" {
		return nil, fmt.Errorf("%w: Root is empty", ErrConfig)
	}
	if cfg.Workers == 0 {
		cfg.Workers = runtime.GOMAXPROCS(0)
	}
	if cfg.Workers < 1 || cfg.Workers > 4096 {
		return nil, fmt.Errorf("%w: Workers %d (want 1 to 4096)", ErrConfig, cfg.Workers)
	}
	if cfg.Mailbox == 0 {
		cfg.Mailbox = 256
	}
	if cfg.Mailbox < 1 {
		return nil, fmt.Errorf("%w: Mailbox %d (want >= 1)", ErrConfig, cfg.Mailbox)
	}
	if cfg.BlockBytes == 0 {
		cfg.BlockBytes = jobs.DefaultBlockBytes
	}
	if err := jobs.CheckBlockBytes(cfg.BlockBytes); err != nil {
		return nil, fmt.Errorf("%w: %v", ErrConfig, err)
	}
	if cfg.ReadDepth < 0 || cfg.ReadDepth > readio.MaxReadDepth {
		return nil, fmt.Errorf("%w: ReadDepth %d (want 0 to %d)", ErrConfig, cfg.ReadDepth, readio.MaxReadDepth)
	}
	if err := cacheLimits(cfg).Check(); err != nil {
		return nil, configError(err)
	}
	if cfg.FS == nil {
		cfg.FS = vfs.Default
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	// The root may itself be a symlink, or sit below symlinked directories
	// (the operator's choice); nothing below it is followed. A new root is
	// created with its parents synced.
	st, err := store.Create(cfg.Root, store.Options{FS: cfg.FS, NoSync: cfg.NoSync})
	if err != nil {
		return nil, fmt.Errorf("engine: root %s: %w", cfg.Root, err)
	}
	ev, err := openEvents(cfg)
	if err != nil {
		return nil, err
	}
	started := false
	defer func() {
		if !started && ev != nil {
			_ = ev.pub.Close()
		}
	}()
	// The prefix cache's index, from the page files' names.
	pages, pst, err := pageindex.Build(st)
	if err != nil {
		return nil, fmt.Errorf("engine: page index: %w", err)
	}
	if len(pst.Skipped) > 0 {
		cfg.Logger.Warn("kvpersist: entries under pages/ that are not page files", "count", len(pst.Skipped), "first", pst.Skipped[0])
	}
	e := &Engine{
		ev:      ev,
		pages:   pages,
		cfg:     cfg,
		store:   st,
		log:     cfg.Logger,
		mailbox: make(chan *job, cfg.Mailbox),
		slots:   make(chan struct{}, cfg.Mailbox),
		done:    make(chan *job, cfg.Workers),
		kickCh:  make(chan struct{}, 1),
		closing: make(chan struct{}),
		stopped: make(chan struct{}),
		abort:   make(chan struct{}),
	}
	// The page cache's accounting, from the page files on disk; its
	// background goroutine runs until Close.
	var sink pagecache.Sink
	if cfg.Metrics != nil {
		sink = cfg.Metrics
	}
	if e.pc, err = pagecache.Open(pagecache.Options{Limits: cacheLimits(cfg), Store: st, Index: pages, Logger: cfg.Logger, Sink: sink, TempGrace: cfg.TempGrace}); err != nil {
		return nil, configError(err)
	}
	pool, err := ants.NewPool(cfg.Workers, ants.WithNonblocking(true), ants.WithDisablePurge(true),
		ants.WithPanicHandler(func(r any) { e.logSafe(slog.LevelError, "kvpersist: panic escaped a pool task", "panic", r) }))
	if err != nil {
		_ = e.pc.Close()
		return nil, fmt.Errorf("engine: pool: %w", err)
	}
	e.pool = pool
	e.jcfg = jobs.Config{
		Root:    cfg.Root,
		FS:      cfg.FS,
		NoSync:  cfg.NoSync,
		Helpers: cfg.Workers - 1,
		Logger:  cfg.Logger,
		Spawn: func(fn func()) bool {
			if e.pool.Submit(func() { defer e.kick(); fn() }) != nil {
				return false
			}
			e.helpersStarted.Add(1)
			return true
		},
		Yield:     e.waiting.Load,
		ReadDepth: cfg.ReadDepth,
		NoDirect:  cfg.NoDirect,
		Async:     newAsyncReads(cfg),
		// The index remembers the page files this engine made durable,
		// so that a save reusing one does not fsync its directory again.
		Durable: pages,
	}
	if cfg.Workers == 1 {
		e.jcfg.Spawn = nil // the job's own goroutine is the whole pool
	}
	// The tier last, after e.jcfg: openTier only opens the tier and its
	// journal; the uploads an earlier engine left pending are resumed
	// below, once e.tier and the page cache's onRemoved are set, and
	// start at once (one that finds a corrupt page removes it through
	// e.jcfg and e.tier).
	if cfg.Remote != nil {
		if err := e.openTier(); err != nil { // remote.go
			e.pool.Release()
			_ = e.pc.Close()
			return nil, err
		}
	}
	e.pc.SetOnRemoved(e.pageRemoved) // once e.tier is set: it reads it (events.go)
	e.pc.SetOnGone(e.pageGone)
	if e.tier != nil {
		// Only now, with e.tier and onRemoved set: a resumed upload that
		// finds a corrupt page removes it at once through e
		// (forgetIfGone reads e.tier).
		e.tier.Resume() // the uploads an earlier engine left pending
	}
	if s, ok := cfg.Metrics.(UsageSink); ok {
		s.SetUsage(e.Usage)
	}
	d := newDispatcher(e)
	go d.run()
	started = true
	e.startEventsSnapshot()
	return e, nil
}

// Root returns the store's root directory.
func (e *Engine) Root() string { return e.cfg.Root }

// Stats returns the engine's counters.
func (e *Engine) Stats() Stats {
	s := &e.stats
	return Stats{
		Queued: s.queued.Load(), Running: s.running.Load(),
		Completed: s.completed.Load(), Failed: s.failed.Load(),
		BytesWritten: s.bytesWritten.Load(), BytesReused: s.bytesReused.Load(), BytesRead: s.bytesRead.Load(),
		BytesReadDirect: s.bytesReadDirect.Load(),
		BytesReadAsync:  s.bytesReadAsync.Load(),
	}
}

// Path resolves ref to its file path under the root. It fails with ErrPath
// (wrapping layout.ErrBadName) for invalid names, and when the namespace
// directory is a symlink, which could lead outside the root.
func (e *Engine) Path(ref Ref) (string, error) {
	ns, err := e.store.Namespace(ref.Namespace)
	if err != nil {
		return "", fmt.Errorf("%w: %w", ErrPath, err)
	}
	p, err := ns.Path(ref.Name)
	if err != nil {
		return "", fmt.Errorf("%w: %w", ErrPath, err)
	}
	if err := ns.Check(); err != nil {
		return "", fmt.Errorf("%w: %w", ErrPath, err)
	}
	return p, nil
}

// Stat decodes and validates a snapshot's header (dtypes, shapes, bytes per
// tensor, caller metadata) without reading tensor data, so a caller can
// allocate destination buffers before submitting a read: check
// Header.TotalBytes (at most MaxSnapshotBytes) against what you can afford
// first. It runs on the calling goroutine and sees what is published now: to
// read after a write, wait for the write's ack first. Errors wrap the
// decoding sentinels (ErrHeaderHash, ErrSnapshotTooLarge, ...), ErrNotFound
// or ErrPath.
func (e *Engine) Stat(ref Ref) (*Snapshot, error) {
	p, err := e.Path(ref)
	if err != nil {
		return nil, err
	}
	return layout.Load(e.cfg.FS, p)
}

// Result is a job's ack: sent exactly once, after the engine's last touch of
// the job's buffers. What each kind reports, always through Result:
//
//   - write: Header (as published: offsets, hashes, block lists) and Metrics
//     (LogicalBytes, WrittenBytes, ReusedBytes, ...);
//   - read: Header (as read) and Metrics (ReadBytes, ...);
//   - collect: Metrics.Collect (what was kept, deleted, skipped);
//   - migrate: Metrics.Migrate (one item per legacy snapshot) and the summed
//     Metrics of the migrated snapshots;
//   - delete: Metrics.
//
// On error Header is nil; Metrics.Collect and Metrics.Migrate still hold what
// was done before the error.
type Result struct {
	ID   uint64 // the Job's ID
	Kind Kind
	Ref  Ref // the snapshot (zero for collect and migrate)
	// Header is, for a write, the header as published; for a read, the
	// header that was read. nil for other kinds and on error.
	Header  *Header
	Metrics Metrics
	// Prefix is the report of a SavePrefixRequest or LoadPrefixRequest
	// (also on error, when the job got that far); nil for other kinds.
	Prefix *PrefixResult
	// Remote is what the object-store tier did for a LoadPrefixRequest or
	// a ReadRequest (pages found, fetched, the first failure; for a read,
	// set only when the local read found the name or a page of its page
	// manifest missing: the pages and the manifest itself when it was only
	// remote, a failure also joined to Err); nil for other kinds, for a
	// read served locally, and without Config.Remote.
	Remote *RemoteReport
	Err    error
}

// Kind is a job's kind.
type Kind int

// Job kinds.
const (
	KindWrite Kind = iota + 1
	KindRead
	KindCollect
	KindMigrate
	KindDelete
	KindSavePrefix
	KindLoadPrefix
)

// String is the kind's name: "write", "read", "collect", "migrate" or "delete".
func (k Kind) String() string {
	switch k {
	case KindWrite:
		return "write"
	case KindRead:
		return "read"
	case KindCollect:
		return "collect"
	case KindMigrate:
		return "migrate"
	case KindDelete:
		return "delete"
	case KindSavePrefix:
		return "save-prefix"
	case KindLoadPrefix:
		return "load-prefix"
	}
	return fmt.Sprintf("Kind(%d)", int(k))
}

// Job is an accepted job.
type Job struct {
	ID uint64
	// Ack receives the job's Result exactly once (buffered: it never blocks
	// the engine). nil when Submit was given AckTo.
	Ack <-chan Result
}

// SubmitOption changes how Submit and TrySubmit deliver a job's Result
// (see AckTo).
type SubmitOption struct{ ack chan<- Result }

// AckTo sends the job's Result on ack instead of a channel made by the
// engine (Job.Ack is then nil), to multiplex many jobs on one channel, by
// Result.ID. The engine sends on it from a job goroutine and waits for
// room: give it a buffer, or keep receiving (Close waits for every ack).
func AckTo(ack chan<- Result) SubmitOption { return SubmitOption{ack: ack} }

// job is the engine's record of an accepted request.
type job struct {
	id      uint64
	seq     uint64 // submission order (dispatcher-assigned)
	kind    Kind
	ref     Ref
	path    string   // snapshot path (write, read)
	ns      []string // namespaces touched; nil for a collect of all
	req     Request
	ctx     context.Context
	cancel  context.CancelCauseFunc
	stopAft func() bool
	ack     chan<- Result
	ownAck  bool // ack is the engine's own channel (capacity 1, never blocks)
	started bool
	// startedAt is when the job started on a worker (for Config.Metrics).
	startedAt time.Time
}

// Submit hands a job to the engine. While the mailbox is full (Mailbox jobs
// wait to start) it blocks until ctx is done (returning ctx's error; the
// buffers were never touched). ctx also governs the job: cancelled before it
// starts, the job is acked at once with ctx's error, even when every worker
// is busy; while running, the job stops between tensors and blocks, removes
// its temp files and is acked with ctx's error (the snapshot's previous
// version stays readable). Errors: ErrClosed, ErrPath (a nil request, an
// invalid namespace or name), ctx.Err() (also when ctx is already done), or
// an unknown request type; on error nothing was queued and no ack will come.
func (e *Engine) Submit(ctx context.Context, req Request, opts ...SubmitOption) (*Job, error) {
	return e.submit(ctx, req, true, opts)
}

// TrySubmit is Submit without waiting: a full mailbox returns ErrBusy.
func (e *Engine) TrySubmit(ctx context.Context, req Request, opts ...SubmitOption) (*Job, error) {
	return e.submit(ctx, req, false, opts)
}

func (e *Engine) submit(ctx context.Context, req Request, wait bool, opts []SubmitOption) (*Job, error) {
	if ctx == nil {
		ctx = context.Background()
	}
	j := &job{req: req}
	switch r := req.(type) {
	case nil:
		return nil, fmt.Errorf("%w: nil request", ErrPath)
	case *WriteRequest:
		if r == nil {
			return nil, fmt.Errorf("%w: nil *WriteRequest", ErrPath)
		}
		j.kind, j.ref = KindWrite, r.Ref
	case *ReadRequest:
		if r == nil {
			return nil, fmt.Errorf("%w: nil *ReadRequest", ErrPath)
		}
		j.kind, j.ref = KindRead, r.Ref
	case *CollectRequest:
		if r == nil {
			return nil, fmt.Errorf("%w: nil *CollectRequest", ErrPath)
		}
		j.kind = KindCollect
		for _, ns := range r.Namespaces {
			if err := layout.ValidName("namespace", ns); err != nil {
				return nil, fmt.Errorf("%w: %w", ErrPath, err)
			}
		}
		if r.Namespaces != nil {
			j.ns = append([]string{}, r.Namespaces...) // non-nil even when empty: still ordered
		}
	case *MigrateRequest:
		if err := e.prepareMigrate(j, r); err != nil {
			return nil, err
		}
	case *DeleteRequest:
		if r == nil {
			return nil, fmt.Errorf("%w: nil *DeleteRequest", ErrPath)
		}
		j.kind, j.ref = KindDelete, r.Ref
	default:
		if ok, err := e.preparePrefix(j, req); err != nil {
			return nil, err
		} else if !ok {
			return nil, fmt.Errorf("engine: unknown request type %T", req)
		}
	}
	if j.kind == KindWrite || j.kind == KindRead || j.kind == KindDelete {
		p, err := e.Path(j.ref)
		if err != nil {
			return nil, err
		}
		j.path, j.ns = p, []string{j.ref.Namespace}
	}

	e.mu.RLock()
	defer e.mu.RUnlock()
	if e.closed {
		return nil, ErrClosed
	}
	select {
	case <-e.closing:
		return nil, ErrClosed
	default:
	}
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	// Take a mailbox slot: it bounds the jobs waiting to start, and is given
	// back when the job starts or is acked without starting.
	if wait {
		select {
		case e.slots <- struct{}{}:
		case <-ctx.Done():
			return nil, ctx.Err()
		case <-e.closing: // Close closes it before taking mu
			return nil, ErrClosed
		}
	} else {
		select {
		case e.slots <- struct{}{}:
		default:
			return nil, ErrBusy
		}
	}
	j.id = e.nextID.Add(1)
	out := &Job{ID: j.id}
	for _, o := range opts {
		if o.ack != nil {
			j.ack = o.ack
		}
	}
	if j.ack == nil {
		ch := make(chan Result, 1)
		j.ack, j.ownAck, out.Ack = ch, true, ch
	}
	j.ctx, j.cancel = context.WithCancelCause(ctx)
	// Wake the dispatcher when the job's context ends while it waits. Set
	// before the send: the job may run (and call stopAft) at once.
	j.stopAft = context.AfterFunc(j.ctx, e.kick)
	e.stats.queued.Add(1)
	e.mailbox <- j // never blocks: the mailbox holds at most one job per slot
	return out, nil
}

func (e *Engine) kick() {
	select {
	case e.kickCh <- struct{}{}:
	default:
	}
}

// Close stops accepting jobs (Submit and TrySubmit return ErrClosed, also
// those blocked on a full mailbox), lets every accepted job run and be acked,
// releases the pool and returns when no goroutine of the engine is left. If
// ctx ends first, the remaining jobs are cancelled (acked with an error
// wrapping ErrClosed) and Close still waits for their acks (a cancelled job
// acks promptly), then returns ctx's error without waiting for the pool's
// idle workers to exit (they exit on their own). Every accepted job is
// acked exactly once. Close is idempotent and safe to call concurrently.
func (e *Engine) Close(ctx context.Context) error {
	if ctx == nil {
		ctx = context.Background()
	}
	// Release Submits blocked on a full mailbox first: they hold mu.RLock.
	e.closeOnce.Do(func() { close(e.closing) })
	e.mu.Lock()
	if !e.closed {
		e.closed = true
		close(e.mailbox) // no sender is mid-send: they hold mu.RLock
	}
	e.mu.Unlock()
	var err error
	select {
	case <-e.stopped:
	case <-ctx.Done():
		err = ctx.Err()
		e.abortMu.Do(func() { close(e.abort) })
		e.kick()
		<-e.stopped
	}
	// Every job has been acked: no save enqueues an upload any more. The
	// uploads finish, or are abandoned when ctx ends (the local pages stay).
	if e.tier != nil {
		e.tierOnce.Do(func() {
			if terr := e.tier.Close(ctx); terr != nil {
				err = errors.Join(err, fmt.Errorf("engine: remote tier: %w", terr))
			}
		})
	}
	// No job runs any more: no read is in flight. Stop the reaper of the
	// asynchronous reads and destroy their AIO context.
	if aerr := e.jcfg.Async.Close(); aerr != nil {
		e.logSafe(slog.LevelWarn, "kvpersist: closing the asynchronous reads", "err", aerr)
	}
	// No job runs any more: stop the page cache's background goroutine and
	// write its recency checkpoints.
	e.pcOnce.Do(func() {
		if cerr := e.pc.Close(); cerr != nil {
			e.logSafe(slog.LevelWarn, "kvpersist: page cache checkpoint at close", "err", cerr)
		}
	})
	e.closeEvents() // after the page cache: its last removals are offered
	// The pool's workers exit once released; wait for them only while ctx
	// allows (every job has been acked by now).
	switch perr := e.pool.ReleaseContext(ctx); {
	case perr == nil, errors.Is(perr, ants.ErrPoolClosed): // released, or by an earlier Close
	case ctx.Err() != nil && errors.Is(perr, ctx.Err()):
		if err == nil {
			err = perr
		}
	default:
		err = errors.Join(err, fmt.Errorf("engine: releasing pool: %w", perr))
	}
	return err
}

// Do submits req (waiting while the mailbox is full) and waits for its ack.
// Even when ctx ends first it waits for the ack (the cancelled job acks
// promptly), so the caller's buffers are free when Do returns.
func (e *Engine) Do(ctx context.Context, req Request) Result {
	j, err := e.Submit(ctx, req)
	if err != nil {
		return Result{Err: err}
	}
	return <-j.Ack
}

// newAsyncReads is the engine's asynchronous O_DIRECT reads (nil: preads),
// closed by Close once no job runs.
func newAsyncReads(cfg Config) *readio.AsyncReads {
	if cfg.NoDirect || cfg.NoAsyncReads {
		return nil
	}
	return readio.NewAsyncReads(cfg.Logger)
}
