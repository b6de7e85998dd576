// Package tier is kvpersist's object-store tier behind the local page
// cache: write-behind of saved pages and page manifests through the
// uploads Ledger (engine/uploads) and the background uploader, read-through
// of the pages a prefix load or a named read of a page manifest lacks
// locally (one existence check, one fetcher), and the set of pages known
// stored remotely. See ARCHITECTURE.md, "Remote tier (object store)", for
// the data flow and the invariants.
//
// # API
//
// One Tier per engine: New opens the store, checks it, starts the
// uploader and opens the uploads journals; Resume queues what an earlier
// engine left pending; Close finishes or abandons the uploads. Saves and
// manifest writes report their pages (Saved, ManifestWritten); loads read
// through a LoadSource; named reads through ReadNamed; Forget drops a
// page from the known set. The tier reaches the rest of the engine only
// through Deps: the store, the page index, the page cache, a logger, a
// metrics Sink and the callbacks it names.
package tier

import (
	"context"
	"fmt"
	"log/slog"
	"path/filepath"
	"time"

	"github.com/kvpersist/kvpersist/engine/layout"
	"github.com/kvpersist/kvpersist/engine/metrics/labels"
	"github.com/kvpersist/kvpersist/engine/pagecache"
	"github.com/kvpersist/kvpersist/engine/remote"
	"github.com/kvpersist/kvpersist/engine/store"
	"github.com/kvpersist/kvpersist/engine/uploads"
)

// Config configures the object-store tier (engine.RemoteTier). The tier
// opens the store from Store, owns it and its uploader, and closes both
// in Close.
type Config struct {
	// Store: endpoint, bucket, prefix, credentials.
	Store remote.Config
	// UploadWorkers: uploads in flight at once (goroutines owned by the
	// engine until Close); default 4.
	UploadWorkers int
	// UploadQueue: uploads waiting (descriptors, never bytes: the local
	// page file is re-opened for each attempt); default 4096. A save whose
	// pages find the queue full does not wait: those pages are recorded in
	// the namespace's uploads journal only, and queued from it once the
	// queue has drained to half (a manifest the queue refuses is also
	// queued again on its retry timer).
	UploadQueue int
	// FetchPages: pages of one load whose GETs are in flight at once;
	// default 16. A page gives its turn back once its bytes are in its
	// temp file, and is verified and published while the next pages' GETs
	// run (up to FetchPages pages publishing behind them). Each page
	// is one GET when it fits in Store.FetchChunkBytes, else ranged GETs
	// of that size, up to Store.Concurrency in flight (then it is verified
	// by reading it back: its bytes arrive out of order). Store.FetchChunkBytes
	// left 0 means 64 MiB here (not remote's 8 MiB): on SeaweedFS a 1 GiB
	// prefix of 32 MiB pages loaded at 0.25 GB/s with one GET per page and
	// 16 pages in flight, at 0.11-0.13 GB/s with 8 MiB ranges and 4 or 8
	// pages in flight (BenchmarkRemoteFetch, loaded 2-core machine).
	FetchPages int
	// UploadBackoffMin and UploadBackoffMax bound the wait between the
	// attempts of one upload (full jitter, doubling); defaults 100 ms and
	// 5 s (remote.UploaderConfig).
	UploadBackoffMin, UploadBackoffMax time.Duration
	// KnownPages caps the pages the engine remembers as stored remotely
	// (all namespaces; about 100 bytes each), so that it neither HEADs
	// nor uploads them again. An entry is dropped when its local page is
	// evicted or found gone, when it is RefreshAge old (remote gc may
	// have deleted the page since), and an arbitrary one when the set is
	// full; a dropped entry costs one HEAD when its page is next saved
	// (and an upload when the store lacks it). Default 262,144 (about 26
	// MB); at least 1.
	KnownPages int
	// RefreshAge: before a page manifest is uploaded, every page it names
	// whose mtime (the store's clock) is older than this is refreshed
	// (Store.Refresh), so that remote GC keeps it. It must be at most half
	// the grace period of every remote gc run on the bucket. It is also
	// how long a page stays known stored (KnownPages) after the engine
	// learnt it (local clock). Default 30 minutes (remote GC's default
	// grace is 1 hour).
	RefreshAge time.Duration
}

// Report says what the tier did for one load (engine.Result.Remote).
//
// For a named read of a page manifest the pages asked are those the
// manifest names that the local index lacks; the manifest itself,
// fetched when it was only remote, is not counted.
type Report struct {
	// PagesAsked: pages after the local prefix whose existence was asked of
	// the store (HEADs); PagesFound: those it holds, in chain order up to
	// the first it does not.
	PagesAsked, PagesFound int
	// PagesFetched, BytesFetched: pages fetched, verified and published to
	// the local tier by this load (object bytes).
	PagesFetched int
	BytesFetched int64
	// Err is the first failure of the tier for this load: a lookup or
	// fetch error (network, server, local I/O), or a corrupt object
	// (errors.Is remote.ErrCorrupt). The prefix ends before the page it
	// names; the load itself still succeeds with what it found. nil when
	// every page asked for was found or missing cleanly.
	Err error
}

// Sink is what the tier feeds with its metrics (engine.MetricsSink
// satisfies it). Methods must be safe for concurrent use.
type Sink interface {
	// Remote records one operation (a lookup batch, a page fetch, an
	// upload): its result, bytes (fetched and verified, or sent) and wall
	// time.
	Remote(op labels.RemoteOp, res labels.RemoteResult, bytes int64, d time.Duration)
	// RemoteLookup records pages asked of the store: found and not found.
	RemoteLookup(hitPages, missPages int64)
	// RemoteQueue sets the upload queue's depth (waiting or in flight).
	RemoteQueue(depth int64)
	// RemoteUploadRetried counts one failed upload attempt to be retried.
	RemoteUploadRetried()
}

// Index is the prefix cache's index of local pages (*pageindex.Index).
type Index interface {
	Has(ns string, key layout.PageKey) bool
	// Present: how many of keys, from the first, are indexed.
	Present(ns string, keys []layout.PageKey) int
	Add(ns string, keys ...layout.PageKey)
}

// Deps is what the tier needs of the engine, given explicitly.
type Deps struct {
	Store *store.Store     // the local root; required
	Index Index            // required
	Cache *pagecache.Cache // the bounded page cache: admissions, pins, pending marks; required
	// Log receives the tier's Warn and Error lines; nil discards them.
	Log func(level slog.Level, msg string, args ...any)
	// Metrics: nil records nothing.
	Metrics Sink
	// RemoveCorruptPage removes local page key of ns found corrupt by its
	// upload's verification (it was not uploaded), as a load finding it
	// would; it runs on an uploader goroutine. Required.
	RemoveCorruptPage func(ns string, key layout.PageKey)
	// ForgetIfGone drops page key of ns from the index and the page
	// cache's accounting when its file is gone (a named read found the
	// index listing a page another engine evicted). Required.
	ForgetIfGone func(ns string, key layout.PageKey)
	// OnFetched, when set, is told of each page the tier fetched,
	// verified and published (pg: the page the chain expects, which it
	// verified to be; a named read's has no token ids: its manifest names
	// keys only), inside the page's admission (its reservation holds) and
	// before it is added to the index. It runs on a fetch worker.
	OnFetched func(ns string, pg *layout.Page)
}

// Tier is the engine's object-store tier. Its methods are safe for
// concurrent use.
type Tier struct {
	d          Deps
	st         *remote.Store
	up         *remote.Uploader
	window     int // keys asked per Exists round trip (Store.Concurrency)
	fetchPages int
	refreshAge time.Duration

	// l: the uploads' state and journal (uploads.go).
	l *uploads.Ledger
}

// New opens the store, checks it (Check), starts the uploader and opens
// the uploads journals. Its errors are configuration errors: the store's
// config, a refusal of the credentials or the bucket (remote.ErrCredentials,
// ErrNoBucket, ErrAccessDenied), a bound out of range, the journals. Call
// Resume once the engine can take the tier's callbacks.
func New(rc Config, d Deps) (*Tier, error) {
	if d.Log == nil {
		d.Log = func(slog.Level, string, ...any) {}
	}
	sc := rc.Store
	if sc.FetchChunkBytes == 0 {
		sc.FetchChunkBytes = 64 << 20 // a page is one GET up to 64 MiB
	}
	st, err := remote.New(sc)
	if err != nil {
		return nil, err
	}
	t := &Tier{d: d, st: st, window: rc.Store.Concurrency, fetchPages: rc.FetchPages}
	if err := t.checkRemote(); err != nil { // check.go
		st.Close()
		return nil, err
	}
	if t.window == 0 {
		t.window = 16 // remote.Config's default Concurrency
	}
	if t.fetchPages == 0 {
		t.fetchPages = 16
	}
	t.refreshAge = rc.RefreshAge
	if t.refreshAge == 0 {
		t.refreshAge = 30 * time.Minute
	}
	if t.window < 1 || t.fetchPages < 1 || rc.FetchPages > 256 || t.refreshAge < 0 || rc.KnownPages < 0 {
		st.Close()
		return nil, fmt.Errorf("FetchPages %d (want 1 to 256), RefreshAge %v (want >= 0), KnownPages %d (want >= 1)", rc.FetchPages, rc.RefreshAge, rc.KnownPages)
	}
	t.up, err = remote.NewUploader(st, remote.UploaderConfig{
		Workers: rc.UploadWorkers, QueueLen: rc.UploadQueue,
		BackoffMin: rc.UploadBackoffMin, BackoffMax: rc.UploadBackoffMax,
		StatFirst: true, OnDone: t.uploaded, OnRetry: t.uploadRetried(),
	})
	if err != nil {
		st.Close()
		return nil, err
	}
	if err := t.openUploads(&rc); err != nil {
		_ = t.up.Close(context.Background())
		st.Close()
		return nil, err
	}
	t.queueDepth() // the remote metrics are exported from now on
	return t, nil
}

// Close finishes or abandons the uploads within ctx, writes the uploads
// journals (closeUploads), then closes the store's idle connections.
// Call it once, after every job acked, so no save enqueues meanwhile.
// Errors: ctx's with remote.ErrAbandoned when uploads were given up, the
// journals'.
func (t *Tier) Close(ctx context.Context) error {
	err := t.closeUploads(ctx)
	t.st.Close()
	t.queueDepth()
	return err
}

func (t *Tier) metrics() Sink { return t.d.Metrics }

func (t *Tier) queueDepth() {
	if m := t.metrics(); m != nil {
		s := t.up.Stats()
		m.RemoteQueue(int64(s.Queued + s.InFlight))
	}
}

// UploaderStats is the uploader's queue: uploads waiting and in flight.
func (t *Tier) UploaderStats() remote.UploaderStats { return t.up.Stats() }

// prepareDirs makes, as a save does, the namespace durably, pages/ and the
// fan-out directories of the pages at positions fetch of keys, under the
// namespace's shared lock (no collect of another process sweeps
// meanwhile), and syncs pages/ and the namespace directory under the
// store's sync policy.
func (t *Tier) prepareDirs(ctx context.Context, n *store.Namespace, keys []layout.PageKey, fetch []int) error {
	unlock, err := createLocked(ctx, n)
	if err != nil {
		return err
	}
	defer unlock()
	if err := n.CreatePagesDir(); err != nil {
		return err
	}
	dirs := map[string]bool{}
	for _, pos := range fetch {
		d := filepath.Dir(n.PagePath(keys[pos]))
		if !dirs[d] {
			if err := n.CreateFanout(d); err != nil {
				return err
			}
			dirs[d] = true
		}
	}
	if !t.d.Store.Durable() {
		return nil
	}
	// The fan-out directories' entries in pages/, and pages/'s in the
	// namespace directory (CreatePagesDir syncs it only when it made
	// pages/: another process may have made it and died before its fsync).
	if err := t.d.Store.SyncDir(n.PagesDir()); err != nil {
		return err
	}
	return t.d.Store.SyncDir(n.Dir())
}

// createLocked makes namespace n durably, as a save does, and takes its
// lock shared (no collect of another process sweeps meanwhile).
func createLocked(ctx context.Context, n *store.Namespace) (unlock func(), err error) {
	if err := n.Create(); err != nil {
		return nil, err
	}
	return n.Lock(ctx, false)
}

// manifestPath resolves the local path of manifest name in namespace ns
// (as engine.Engine.Path: no symlinked namespace directory).
func (t *Tier) manifestPath(ns, name string) (string, error) {
	n, err := t.d.Store.Namespace(ns)
	if err != nil {
		return "", err
	}
	p, err := n.Path(name)
	if err != nil {
		return "", err
	}
	if err := n.Check(); err != nil {
		return "", err
	}
	return p, nil
}
