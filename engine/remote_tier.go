package engine

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"log/slog"
	"path/filepath"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvpersist/kvpersist/engine/evict"
	"github.com/kvpersist/kvpersist/engine/jobs"
	"github.com/kvpersist/kvpersist/engine/layout"
	"github.com/kvpersist/kvpersist/engine/metrics/labels"
	"github.com/kvpersist/kvpersist/engine/remote"
	"github.com/kvpersist/kvpersist/engine/store"
	"github.com/kvpersist/kvpersist/engine/vfs"
)

// The object-store tier behind the local page cache (issue 15), wired into
// the engine: read-through on loads (and LookupRemote), write-behind after
// saves. See ARCHITECTURE.md, "Remote tier (object store)", for the data
// flow and the invariants.

// RemoteConfig says where the object-store tier lives: endpoint (TLS by
// default; plain http only for a loopback host), bucket, prefix,
// credentials (from AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY when
// empty) and the client's bounds. See remote.Config.
type RemoteConfig = remote.Config

// RemoteConfigFromEnv is remote.ConfigFromEnv: endpoint, bucket and prefix
// given, credentials and region from the standard environment variables.
func RemoteConfigFromEnv(endpoint, bucket, prefix string) RemoteConfig {
	return remote.ConfigFromEnv(endpoint, bucket, prefix)
}

// Sentinels of the object-store tier, re-exported for errors.Is.
var (
	// ErrRemoteCorrupt: a fetched object was not the page its name and the
	// prompt's key chain say (short, long, replaced during the fetch, a bad
	// header, key, parent, identity, tokens or tensor hash), or not a valid
	// page manifest. A miss: it is never published locally nor loaded
	// (RemoteReport.Err; a named read fails with it joined to its error).
	ErrRemoteCorrupt = remote.ErrCorrupt
	// ErrUploadsAbandoned: Close's context ended with uploads pending; they
	// were given up (the local pages are intact) and stay listed in their
	// namespace's uploads journal (<root>/<ns>/.uploads), which the next
	// New on the root queues again.
	ErrUploadsAbandoned = remote.ErrAbandoned
)

// RemoteTier configures the object-store tier of an engine (Config.Remote).
// The engine opens the store from Store, owns it and its uploader, and
// closes both in Close; a caller needs nothing but package engine.
type RemoteTier struct {
	// Store: endpoint, bucket, prefix, credentials (RemoteConfig).
	Store RemoteConfig
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

// RemoteReport says what the object-store tier did for one load (Result.
// Remote; nil when the engine has no remote tier).
//
// For a ReadRequest (a named read of a page manifest) the pages asked are
// those the manifest names that the local index lacks; the manifest
// itself, fetched when it was only remote, is not counted.
type RemoteReport struct {
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
	// (errors.Is ErrRemoteCorrupt). The prefix ends before the page it
	// names; the load itself still succeeds with what it found. nil when
	// every page asked for was found or missing cleanly.
	Err error
}

// PrefixHit is LookupRemote's answer, in tokens.
type PrefixHit struct {
	// Local: the longest prefix stored in the local tier (what Lookup
	// returns).
	Local int
	// Total: the longest prefix stored in the local tier and the object
	// store together (>= Local): pages after the local prefix that a load
	// would fetch. Like Local, a multiple of the page size or the prompt's
	// length.
	Total int
}

// tier is the engine's object-store tier.
type tier struct {
	e          *Engine
	st         *remote.Store
	up         *remote.Uploader
	window     int // keys asked per Exists round trip (Store.Concurrency)
	fetchPages int
	refreshAge time.Duration

	backoffMax time.Duration // RemoteTier.UploadBackoffMax: the base of manifestRetryWait

	mu       sync.Mutex
	known    map[string]map[layout.PageKey]time.Time // per namespace: pages known stored remotely -> when learnt
	nknown   int                                     // entries of known, at most knownCap
	knownCap int                                     // RemoteTier.KnownPages
	pending  map[string]*pendingUpload               // object name -> upload queued or in flight
	// j records every upload queued until it is settled, across crashes
	// and restarts (remote_journal.go, remote_journal_file.go).
	j       *journal
	closing bool                      // close began: no manifest is scheduled again
	retries map[string]*manifestRetry // "<ns>/<name>" -> a manifest waiting to be queued again
	retryWG sync.WaitGroup            // their callbacks
	// requeueing: "<ns>/<name>" -> requeueManifest calls running for the
	// manifest (counted by requeueStartLocked, where the caller took it
	// from retries or found it not there).
	requeueing map[string]int

	// Test hooks, nil outside tests: afterUnpend runs in uploaded, and
	// in enqueueFile when the queue refused an upload, once the upload's
	// entry has left pending and t.mu is released;
	// afterGoneLstat runs in enqueueFile after the lstat that found a
	// replayed page's file gone, before its entry is settled;
	// afterManifestRead runs in requeueManifest once it read a page
	// manifest, before queueing it.
	afterUnpend       func()
	afterGoneLstat    func()
	afterManifestRead func()
}

type pendingUpload struct {
	ns       string
	key      layout.PageKey // a page's; zero for a manifest
	manifest bool
	// journaled: the journal lists it already (a retry, a replay): no
	// queued record is appended when it is queued.
	journaled bool
	name      string        // a manifest's snapshot name
	attempt   int           // a manifest's re-queues so far (manifestRetries)
	start     time.Time     // first attempt (zero before it)
	done      chan struct{} // closed when the upload ended; err is then set
	err       error
	// queued: the uploader accepted it (set under tier.mu once Enqueue
	// returned; until then the queue may still refuse it, and a refill
	// reading its entry stops there: requeuePage).
	queued bool
}

// newTier opens the store and starts the uploader (cfg.Remote set).
func newTier(e *Engine, rc *RemoteTier) (*tier, error) {
	sc := rc.Store
	if sc.FetchChunkBytes == 0 {
		sc.FetchChunkBytes = 64 << 20 // a page is one GET up to 64 MiB
	}
	st, err := remote.New(sc)
	if err != nil {
		return nil, fmt.Errorf("%w: Remote: %w", ErrConfig, err)
	}
	if err := e.checkRemote(st); err != nil { // remote_check.go
		st.Close()
		return nil, fmt.Errorf("%w: Remote: %w", ErrConfig, err)
	}
	t := &tier{e: e, st: st, window: rc.Store.Concurrency, fetchPages: rc.FetchPages,
		known: map[string]map[layout.PageKey]time.Time{}, pending: map[string]*pendingUpload{},
		retries: map[string]*manifestRetry{}, requeueing: map[string]int{}, backoffMax: rc.UploadBackoffMax}
	if t.backoffMax == 0 {
		t.backoffMax = 5 * time.Second // remote.UploaderConfig's default
	}
	if t.window == 0 {
		t.window = 16 // remote.Config's default Concurrency
	}
	if t.fetchPages == 0 {
		t.fetchPages = 16
	}
	t.refreshAge = rc.RefreshAge
	t.knownCap = rc.KnownPages
	if t.knownCap == 0 {
		t.knownCap = defaultKnownPages
	}
	if t.refreshAge == 0 {
		t.refreshAge = 30 * time.Minute
	}
	if t.window < 1 || t.fetchPages < 1 || rc.FetchPages > 256 || t.refreshAge < 0 || t.knownCap < 1 {
		st.Close()
		return nil, fmt.Errorf("%w: Remote: FetchPages %d (want 1 to 256), RefreshAge %v (want >= 0), KnownPages %d (want >= 1)", ErrConfig, rc.FetchPages, rc.RefreshAge, rc.KnownPages)
	}
	t.up, err = remote.NewUploader(st, remote.UploaderConfig{
		Workers: rc.UploadWorkers, QueueLen: rc.UploadQueue,
		BackoffMin: rc.UploadBackoffMin, BackoffMax: rc.UploadBackoffMax,
		StatFirst: true, OnDone: t.uploaded, OnRetry: e.uploadRetried(),
	})
	if err != nil {
		st.Close()
		return nil, fmt.Errorf("%w: Remote: %w", ErrConfig, err)
	}
	t.j = startJournal(t)
	t.queueDepth() // the remote metrics are exported from now on
	// The uploads an earlier engine left pending are resumed by New
	// (t.resume) once e.tier is set: one that finds a corrupt page
	// removes it through e, which reads e.tier.
	return t, nil
}

// close finishes or abandons the uploads within ctx, writes the uploads
// journals (closeUploads), then closes the store's idle connections.
// Called by Engine.Close after every job acked, so no save enqueues
// meanwhile.
func (t *tier) close(ctx context.Context) error {
	err := t.closeUploads(ctx)
	t.st.Close()
	t.queueDepth()
	return err
}

func (t *tier) metrics() MetricsSink { return t.e.cfg.Metrics }

func (t *tier) queueDepth() {
	if m := t.metrics(); m != nil {
		s := t.up.Stats()
		m.RemoteQueue(int64(s.Queued + s.InFlight))
	}
}

// isKnown reports whether page k of ns is known stored remotely: learnt
// (uploaded, found by a HEAD or fetched) less than RemoteTier.RefreshAge
// ago. An older entry is dropped and the page is not known: remote GC may
// have deleted it since (an object unreferenced past its grace, which is
// at least twice RefreshAge), so its next save HEADs it again (StatFirst)
// and uploads it if it is gone.
func (t *tier) isKnown(ns string, k layout.PageKey) bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	at, ok := t.known[ns][k]
	if ok && time.Since(at) >= t.refreshAge {
		t.forgetLocked(ns, k)
		return false
	}
	return ok
}

// defaultKnownPages is RemoteTier.KnownPages's default.
const defaultKnownPages = 1 << 18

// markKnown records page k of ns as stored remotely; when the set holds
// knownCap entries, an arbitrary one is dropped first (it costs a HEAD
// when that page is next saved).
func (t *tier) markKnown(ns string, k layout.PageKey) {
	t.mu.Lock()
	defer t.mu.Unlock()
	m := t.known[ns]
	if m == nil {
		m = map[layout.PageKey]time.Time{}
		t.known[ns] = m
	}
	if _, ok := m[k]; ok {
		m[k] = time.Now() // learnt again: its age restarts
		return
	}
	if t.nknown >= t.knownCap {
		t.dropOneKnownLocked()
	}
	m[k] = time.Now()
	t.nknown++
}

// dropOneKnownLocked drops an arbitrary entry of the known set. t.mu held.
func (t *tier) dropOneKnownLocked() {
	for ns, m := range t.known {
		for k := range m {
			delete(m, k)
			t.nknown--
			if len(m) == 0 {
				delete(t.known, ns)
			}
			return
		}
	}
}

// forget drops page k of ns from the known set: its local file was
// evicted or found gone (pageCache.unindex, forgetIfGone). A later save
// writes the page again and queues it; its upload HEADs the object first
// (StatFirst) and sends nothing when it is stored.
func (t *tier) forget(ns string, k layout.PageKey) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.forgetLocked(ns, k)
}

// forgetLocked is forget with t.mu held.
func (t *tier) forgetLocked(ns string, k layout.PageKey) {
	m := t.known[ns]
	if _, ok := m[k]; !ok {
		return
	}
	delete(m, k)
	t.nknown--
	if len(m) == 0 {
		delete(t.known, ns)
	}
}

// RemoteKnownPages returns how many pages the engine remembers as stored
// in the object store (at most RemoteTier.KnownPages); 0 without a remote
// tier.
func (e *Engine) RemoteKnownPages() int {
	if e.tier == nil {
		return 0
	}
	e.tier.mu.Lock()
	defer e.tier.mu.Unlock()
	return e.tier.nknown
}

// saved enqueues the pages of a durable save (keys, in chain order) for
// upload, except those known stored remotely or already queued. It never
// blocks: it lstats each page file (for its size) and queues a
// descriptor. Pages are enqueued in chain order, so a page is created
// before its descendants unless a retry reorders them (harmless: a lookup
// walks the chain and stops at the first page the store lacks).
func (t *tier) saved(ns string, keys []layout.PageKey) {
	t.enqueuePages(ns, keys)
	t.queueDepth()
}

// enqueuePages queues the pages keys of ns not known stored and returns
// the uploads of those it queued or found queued (a manifest waits for
// them).
func (t *tier) enqueuePages(ns string, keys []layout.PageKey) []*pendingUpload {
	n, err := t.e.store.Namespace(ns)
	if err != nil {
		return nil
	}
	var out []*pendingUpload
	for _, k := range keys {
		if t.isKnown(ns, k) {
			continue
		}
		name, err := t.st.PageName(ns, k.String())
		if err != nil {
			continue
		}
		if p := t.enqueueFile(name, n.PagePath(k), &pendingUpload{ns: ns, key: k}, nil); p != nil {
			out = append(out, p)
		}
	}
	return out
}

// enqueueFile queues the upload of the local file path as object name
// (p describes it), unless name is queued already (that upload is
// returned), and appends its queued record to the journal (unless
// p.journaled). It returns nil when nothing is queued: the file is gone
// (a replayed page's entry is then settled), or the queue refused it. A
// page the queue refuses because it is full is spilled: recorded in the
// journal only, and queued from it when the queue drains (journal.spill);
// any other refusal is logged and counted as an upload error. A manifest
// refused is scheduled again as after a failed upload, in the critical
// section that removes its pending entry (manifestDoneLocked). See
// queueUpload for what each attempt checks.
func (t *tier) enqueueFile(name, path string, p *pendingUpload, wait func(context.Context) error) *pendingUpload {
	fi, err := t.e.store.FS().Lstat(path)
	if err != nil || !fi.Mode().IsRegular() {
		if p.journaled && !p.manifest {
			// A replayed page whose file is gone (evicted since) or is
			// not a regular file: it can never be uploaded from here,
			// so its entry is settled, quietly. Under t.mu, after a
			// second lstat: a save that writes the page after that
			// lstat registers its upload (and adds its queued record)
			// after this critical section, so after the settled record;
			// one that wrote it before is seen (its upload registered,
			// or the file back), and the entry is left to it.
			if t.afterGoneLstat != nil {
				t.afterGoneLstat()
			}
			t.mu.Lock()
			if t.pending[name] == nil {
				if fi, err := t.e.store.FS().Lstat(path); err != nil || !fi.Mode().IsRegular() {
					t.settleLocked(p.ns, p.key, "")
				}
			}
			t.mu.Unlock()
			return nil
		}
		t.e.logSafe(slog.LevelWarn, "kvpersist: not uploaded: the local file is gone", "file", path, "err", err)
		return nil
	}
	t.mu.Lock()
	if q := t.pending[name]; q != nil {
		if !p.manifest {
			// Queued already; the page may have been evicted and saved
			// again since, which cleared its mark.
			t.markPendingLocked(p.ns, p.key, true)
		}
		t.mu.Unlock()
		return q
	}
	p.done = make(chan struct{})
	t.pending[name] = p
	if !p.manifest {
		// Before the uploader has it, so that its settle (uploaded)
		// unmarks it after.
		t.markPendingLocked(p.ns, p.key, true)
	}
	t.mu.Unlock()
	if !p.journaled {
		// Before the queue has it: its settled record comes after.
		t.journalQueued(p)
	}
	if err := t.queueUpload(name, path, fi, p, wait); err != nil {
		spilled := !p.manifest && errors.Is(err, remote.ErrQueueFull)
		t.mu.Lock()
		delete(t.pending, name)
		if !p.manifest && !spilled {
			// A spilled page is still pending (listed in the journal,
			// queued from it when the queue drains): it keeps its mark.
			t.markPendingLocked(p.ns, p.key, false)
		}
		// Settled, or its retry registered, in this critical section
		// (see uploaded).
		givenUp := p.manifest && t.manifestDoneLocked(p, err)
		t.mu.Unlock()
		if t.afterUnpend != nil {
			t.afterUnpend()
		}
		if givenUp {
			t.manifestGivenUp(p, err)
		}
		p.err = err
		close(p.done)
		if spilled {
			t.j.spill(p.ns)
			return nil
		}
		if m := t.metrics(); m != nil {
			m.Remote(labels.RemoteUpload, labels.RemoteError, 0, 0)
		}
		t.e.logSafe(slog.LevelWarn, "kvpersist: not queued for upload", "file", path, "err", err)
		return nil
	}
	t.mu.Lock()
	p.queued = true
	t.mu.Unlock()
	return p
}

// queueUpload hands the uploader the upload of path (fi: its lstat) as
// object name for p (registered in t.pending). The source is re-opened
// for each attempt. A manifest's must still be the file lstat'd now (same
// size and mtime; else errSourceChanged, and manifestDoneLocked queues the name
// again: a manifest rewritten under its name is not uploaded with the
// bytes of another version). A page's may be a new file (the page evicted
// and saved again while its upload waited: same key, so the same page)
// of the same size; it is what this attempt sends (a new file of another
// size, or none, is errSourceChanged: the upload ends, and the next save
// naming the page queues it again). Before its PUT the open file is verified
// (remote.Upload.Verify): a page by remote.VerifyPage (header, its key is
// its name's, every tensor's xxh3-64, its length), a manifest by
// remote.VerifyManifest (header, attachments' hashes); the PUT streams
// the same open descriptor, so the bytes sent are the bytes verified
// (page files are never written in place: a save renames a new file
// over the path). A file that fails is not uploaded (remote.ErrSourceCorrupt,
// handled by uploaded).
func (t *tier) queueUpload(name, path string, fi fs.FileInfo, p *pendingUpload, wait func(context.Context) error) error {
	fsys := t.e.store.FS()
	verify := remote.VerifyManifest(nil)
	var stored func(context.Context, remote.Object) error // a corrupt stored page is replaced (remote_check.go)
	if !p.manifest {
		verify, stored = remote.VerifyPage(p.key.String(), nil), t.storedPage(p.key)
	}
	size, mtime := fi.Size(), fi.ModTime()
	return t.up.Enqueue(remote.Upload{Name: name, Size: size, Wait: wait, Verify: verify, Stored: stored, Open: func() (remote.ReadAtCloser, error) {
		t.mu.Lock()
		if p.start.IsZero() {
			p.start = time.Now()
		}
		t.mu.Unlock()
		f, err := fsys.Open(path)
		if err != nil {
			return nil, fmt.Errorf("%w: %s: %w", errSourceChanged, path, err)
		}
		if st, err := f.Stat(); err != nil || !st.Mode().IsRegular() || st.Size() != size || (p.manifest && !st.ModTime().Equal(mtime)) {
			f.Close()
			return nil, fmt.Errorf("%w: %s", errSourceChanged, path)
		}
		return f, nil
	}})
}

// manifestWritten queues the upload of a page manifest (a named snapshot
// in the Pages layout) after the pages it names: the pages are queued
// first, and the manifest's Wait (run by an uploader worker before its
// first attempt) waits for their uploads, then makes sure every page is
// stored and young enough for remote GC (manifestReady). So a listable
// manifest never names a page the store lacks, nor one that a collector
// may delete before the manifest protects it.
func (t *tier) manifestWritten(ref Ref, keys []layout.PageKey) {
	defer t.queueDepth()
	t.queueManifest(ref, keys, 0, false)
}

// queueManifest is manifestWritten's queueing; attempt counts the times
// the manifest was queued again after a failure (manifestDoneLocked);
// journaled: the journal lists it already. A manifest the queue refuses
// (full) is scheduled again as a failure is, by enqueueFile in the
// critical section that removes its pending entry (manifestDoneLocked).
func (t *tier) queueManifest(ref Ref, keys []layout.PageKey, attempt int, journaled bool) {
	pages := t.enqueuePages(ref.Namespace, keys)
	path, err := t.e.Path(ref)
	if err != nil {
		return
	}
	name, err := t.st.ManifestName(ref.Namespace, ref.Name)
	if err != nil {
		return
	}
	p := &pendingUpload{ns: ref.Namespace, manifest: true, name: ref.Name, attempt: attempt, journaled: journaled}
	t.enqueueFile(name, path, p, func(ctx context.Context) error {
		for _, p := range pages {
			select {
			case <-p.done:
				if p.err != nil {
					return fmt.Errorf("engine: a page of manifest %s was not uploaded: %w", name, p.err)
				}
			case <-ctx.Done():
				return ctx.Err()
			}
		}
		return t.manifestReady(ctx, ref.Namespace, keys)
	})
}

// manifestReady checks that every page keys names is stored (one HEAD
// each, Concurrency in flight; a page found missing is dropped from the
// known set, so the manifest's retry uploads it again) and refreshes each whose mtime is older
// than the store's clock minus RemoteTier.RefreshAge (Store.Refresh: a
// server-side copy onto itself, the bytes unchanged), so that remote GC,
// whose grace must be at least twice RefreshAge, keeps it until the
// manifest is listable (ARCHITECTURE.md, "Remote garbage collection and
// its clocks").
func (t *tier) manifestReady(ctx context.Context, ns string, keys []layout.PageKey) error {
	for _, k := range keys {
		name, err := t.st.PageName(ns, k.String())
		if err != nil {
			return err
		}
		o, err := t.st.Stat(ctx, name)
		if errors.Is(err, remote.ErrNotFound) {
			// Known stored, but gone (remote gc deleted it as unreferenced
			// past its grace): forgotten, so that the manifest's retry
			// queues it again instead of skipping it as known.
			t.forget(ns, k)
		}
		if err != nil {
			return err
		}
		if o.ModTime.Before(t.st.ServerTime().Add(-t.refreshAge)) {
			if _, err := t.st.Refresh(ctx, name, o.ETag); err != nil {
				return err
			}
		}
	}
	return nil
}

// markPendingLocked marks page k of ns pending in the page cache's
// eviction policy (evict.Cache.SetPending: evicted only after every
// evictable page that is not), or unmarks it. A page is marked while its
// upload is queued, in flight or spilled to the journal (a full queue),
// from enqueueFile until the upload settles (uploaded, found stored,
// failed for good or abandoned), the queue refuses it for another reason
// than being full, or a replay or refill finds it known stored; so that under pressure the cache evicts the pages the
// object store holds (or need not hold) before the pages it does not
// have yet. A page the policy does not track (written by another process)
// is not marked. t.mu held: a page's marks and unmarks are ordered as its
// entries in t.pending are, so a settle never unmarks a later queueing's
// mark. See ARCHITECTURE.md, "A pending upload is evicted last".
func (t *tier) markPendingLocked(ns string, k layout.PageKey, pending bool) {
	t.e.pc.pol.SetPending(ns, evict.Key(k), pending)
}

// uploaded is the uploader's OnDone: it marks a stored page known and
// feeds the metrics. It runs on an uploader goroutine.
func (t *tier) uploaded(r remote.UploadResult) {
	t.mu.Lock()
	p := t.pending[r.Name]
	delete(t.pending, r.Name)
	if p != nil && !p.manifest {
		// Settled (done, impossible or abandoned): back in the page
		// cache's plain eviction order.
		t.markPendingLocked(p.ns, p.key, false)
	}
	// The settled record is added in the critical section that removed
	// the entry: a save of the same object registers its next upload
	// only after it, so that upload's queued record follows it in the
	// journal. Added later, it could follow the queued record of a save
	// in between (spilled by a full queue, or failed), and the journal
	// would list the page or manifest settled while not uploaded. Done,
	// or never possible (the local file gone or changed: the next save
	// naming the page queues it again; corrupt: removed; a conflict). An
	// abandoned upload stays listed, and so does a manifest scheduled
	// again or out of retries (manifestDoneLocked). A manifest's retry
	// is registered here too, so that the name is always either pending
	// or waiting for its retry: an older retry finding its local file no
	// longer a page manifest settles it only when it is neither
	// (requeueManifest).
	givenUp := false
	switch {
	case p == nil:
	case p.manifest:
		givenUp = t.manifestDoneLocked(p, r.Err)
	case !errors.Is(r.Err, remote.ErrAbandoned):
		t.settleLocked(p.ns, p.key, "")
	}
	t.mu.Unlock()
	if t.afterUnpend != nil {
		t.afterUnpend()
	}
	if p != nil {
		defer func() { p.err = r.Err; close(p.done) }()
	}
	var d time.Duration
	if p != nil && !p.start.IsZero() {
		d = time.Since(p.start)
	}
	res := labels.RemoteOK
	switch {
	case errors.Is(r.Err, remote.ErrAbandoned):
		res = labels.RemoteAbandoned
	case errors.Is(r.Err, remote.ErrSourceCorrupt):
		res = labels.RemoteCorrupt
		t.e.logSafe(slog.LevelError, "kvpersist: local file corrupt: not uploaded", "object", r.Name, "err", r.Err)
		if p != nil && !p.manifest {
			t.e.removeCorruptPage(p.ns, p.key)
		}
	case r.Err != nil:
		res = labels.RemoteError
		t.e.logSafe(slog.LevelWarn, "kvpersist: upload failed", "object", r.Name, "attempts", r.Attempts, "err", r.Err)
	case !r.Created:
		res = labels.RemoteExisted
	case r.Replaced:
		t.e.logSafe(slog.LevelWarn, "kvpersist: replaced a stored page object that did not verify", "object", r.Name)
	}
	if r.Err == nil && p != nil && !p.manifest {
		t.markKnown(p.ns, p.key)
	}
	if givenUp {
		t.manifestGivenUp(p, r.Err)
	}
	t.j.drained()
	if m := t.metrics(); m != nil {
		m.Remote(labels.RemoteUpload, res, r.Bytes, d)
	}
	t.queueDepth()
}

// remoteCandidates returns the keys of tokens' chain after the local
// prefix (per the index), up to where the store lacks one, and which of
// them are in the local tier already. It asks the store about the keys
// not in the local index, Store.Concurrency keys per round trip (one
// HEAD each, all in flight at once), stopping at the first window holding
// a key the store lacks: a prompt of n pages past its local prefix costs
// at most ceil(n/Concurrency) round trips (a 32,768-token prompt at 256
// tokens per page: 128 pages, at most 8 round trips at the default
// Concurrency of 16), and one when its first remote page is missing.
// A leaf (the partial last page) counts only when every full page before
// it is stored, as in Lookup.
//
// start is the position in keys of the first candidate (the first key the
// index lacks); cands are keys[start:start+len(cands)]; objs[c] is what the
// store's HEAD said of cands[c] (size, ETag), the zero Object for a local
// one.
func (t *tier) remoteCandidates(ctx context.Context, ns string, keys []layout.PageKey, rep *RemoteReport) (start int, cands []layout.PageKey, local []bool, objs []remote.Object) {
	i := 0
	for i < len(keys) && t.e.pages.Has(ns, keys[i]) {
		i++
	}
	start = i
	for i < len(keys) {
		var names []string
		var asked []int // positions in keys of the names
		j := i
		for ; j < len(keys) && len(names) < t.window; j++ {
			if t.e.pages.Has(ns, keys[j]) {
				continue
			}
			name, err := t.st.PageName(ns, keys[j].String())
			if err != nil {
				rep.Err = err
				return start, cands, local, objs
			}
			names = append(names, name)
			asked = append(asked, j)
		}
		present := map[int]remote.Object{}
		if len(names) > 0 {
			began := time.Now()
			ok, err := t.st.StatAll(ctx, names)
			m := t.metrics()
			if err != nil {
				if m != nil {
					m.Remote(labels.RemoteLookup, labels.RemoteError, 0, time.Since(began))
				}
				rep.Err = err
				return start, cands, local, objs
			}
			if m != nil {
				m.Remote(labels.RemoteLookup, labels.RemoteOK, 0, time.Since(began))
			}
			rep.PagesAsked += len(names)
			hits := 0
			for a, pos := range asked {
				if ok[a].Name != "" {
					present[pos] = ok[a]
					hits++
				}
			}
			if m != nil {
				m.RemoteLookup(int64(hits), int64(len(names)-hits))
			}
		}
		for ; i < j; i++ {
			isLocal := t.e.pages.Has(ns, keys[i])
			o, found := present[i]
			if !isLocal && !found {
				return start, cands, local, objs
			}
			if !isLocal {
				rep.PagesFound++
				t.markKnown(ns, keys[i])
			}
			cands = append(cands, keys[i])
			local = append(local, isLocal)
			objs = append(objs, o)
		}
	}
	return start, cands, local, objs
}

// readThrough runs before a prefix load (keys: tokens' page keys,
// layout.PageChain, computed once by the load; nil when they could not
// be): the pages of tokens' chain after
// the local prefix that the store holds are fetched (FetchPages at once,
// each with ranged GETs in flight), verified against the key chain the
// prompt implies and their tensor hashes, and published to the local tier;
// the load then finds them locally. Each fetched page enters the bounded
// page cache as a save's pages do (pageCache.admitHeld): its object's size
// (from the HEAD of remoteCandidates) is reserved against the capacity,
// the quotas and the headroom, victims are evicted first, and the page is
// committed with its st_blocks and pinned. The pages' reservations are
// taken one after another in chain order (a page reserves once the one
// before it has its room), so a fetch that cannot get room stops the
// prefix there: that page and every later one are not fetched (nothing of
// them is written; the error is errors.Is ErrNoSpace). held are the pins
// taken for the load (every page committed, pinned at its commit): the
// caller releases them when the load ends, so no fetched page is evicted
// between its publish and the load's reading it. fetched holds the keys of
// the pages this call published (each verified, every tensor hashed, just
// before its rename): the load need not hash them again
// (jobs.LoadPrefixVerified).
//
// With sc non-nil (jobs.NewPrefixScatter of the load's request), the
// fetched pages that begin the chain (positions 0, 1, ... all fetched by
// this call) are scattered into the load's destinations on the calling
// goroutine, in chain order, each once its bytes verified (beside its
// publish) and the page before it was published and committed, while
// later pages are still being fetched; a page whose publish fails after
// its scatter is retracted (PrefixScatter.Retract); the load then
// opens only the pages after them (jobs.LoadPrefixScattered). Every
// scatter ends before readThrough returns, and readThrough returns only
// once every fetch worker has (also when the scatter panics).
//
// The prefix the load can see ends at the first page that is missing
// remotely, finds no room, fails to fetch or fails verification (reported
// in the RemoteReport, never an error of the load). Nothing local is
// changed except new, verified page files (and the victims evicted for
// them, under the namespace's exclusive lock as any eviction).
func (t *tier) readThrough(ctx context.Context, ns, identity string, p int, tokens []uint32, keys []layout.PageKey, sc *jobs.PrefixScatter) (rep *RemoteReport, held []evict.Key, fetched map[layout.PageKey]bool) {
	rep = &RemoteReport{}
	if p == 0 {
		p = layout.DefaultPageTokens
	}
	if keys == nil || len(tokens) == 0 {
		return rep, nil, nil // the load reports the invalid request
	}
	if t.e.pages.Present(ns, keys) == len(keys) {
		return rep, nil, nil // every page is local
	}
	first, cands, local, objs := t.remoteCandidates(ctx, ns, keys, rep)
	var fetch []int // positions in keys
	var fobjs []remote.Object
	for c := range cands {
		if !local[c] {
			fetch = append(fetch, first+c)
			fobjs = append(fobjs, objs[c])
		}
	}
	if len(fetch) == 0 {
		return rep, nil, nil
	}
	n, err := t.e.store.Namespace(ns)
	if err != nil {
		rep.Err = err
		return rep, nil, nil
	}
	if err := t.prepareDirs(ctx, n, keys, fetch); err != nil {
		rep.Err = err
		return rep, nil, nil
	}
	parents := make([]layout.PageKey, len(keys))
	for i := range keys {
		if i == 0 {
			parents[i] = layout.PageRoot(identity, p)
		} else {
			parents[i] = keys[i-1]
		}
	}
	// Fetch, FetchPages at once; results by position. decided[f] is closed
	// once page f's reservation is decided (its write began, or admit
	// failed before it); page f+1 reserves only after it, and not at all
	// once a reservation found no room (noRoom).
	errs := make([]error, len(fetch))
	sizes := make([]int64, len(fetch))
	decided := make([]chan struct{}, len(fetch))
	for f := range decided {
		decided[f] = make(chan struct{})
	}
	// gets holds a token per page whose GET is in flight: FetchPages at
	// once. A page gives its token back as soon as its bytes are in the
	// temp file, and verifies and publishes (fdatasync, rename, directory
	// fsync) while the next pages' GETs run: up to FetchPages pages are
	// publishing behind FetchPages GETs (2×FetchPages workers).
	gets := make(chan struct{}, t.fetchPages)
	var wg sync.WaitGroup
	var mu sync.Mutex
	next := 0
	noRoom := false
	// The scatter (sc non-nil): the fetched pages that begin the chain
	// (fetch[f] == f) are written into the load's destinations on this
	// goroutine, in chain order, while later pages are still being
	// fetched: page f once its bytes verified (verified[f] closed, rds[f]
	// its read-only descriptor, heads[f] its header as the PageStream
	// decoded it, or nil), beside its publish; the next page only
	// once page f is published and committed (ready[f] closed, errs[f]
	// nil). scatterTo: how many of them may be.
	scatterTo := 0
	if sc != nil {
		for scatterTo < len(fetch) && fetch[scatterTo] == scatterTo {
			scatterTo++
		}
	}
	verified := make([]chan struct{}, scatterTo)
	ready := make([]chan struct{}, scatterTo)
	for f := range ready {
		verified[f] = make(chan struct{})
		ready[f] = make(chan struct{})
	}
	rds := make([]vfs.File, scatterTo)
	// heads[f]: rds[f]'s header as the stream decoded it (nil: not).
	heads := make([]*layout.Snapshot, scatterTo)
	defer func() { // after wg.Wait (deferred below): descriptors not scattered from
		for _, f := range rds {
			if f != nil {
				f.Close()
			}
		}
	}()
	defer wg.Wait() // also when the scatter panics: no worker outlives the load
	for range min(2*t.fetchPages, len(fetch)) {
		wg.Go(func() {
			for {
				mu.Lock()
				f := next
				next++
				mu.Unlock()
				if f >= len(fetch) {
					return
				}
				pos := fetch[f]
				var once sync.Once
				decide := func() { once.Do(func() { close(decided[f]) }) }
				wrote := false
				want := &layout.Page{Key: keys[pos], Parent: parents[pos], Identity: identity, PageTokens: p,
					Tokens: tokens[pos*p : min(len(tokens), (pos+1)*p)]}
				fileBytes := func(int) (int64, error) {
					if f > 0 {
						select {
						case <-decided[f-1]:
						case <-ctx.Done():
							return 0, ctx.Err()
						}
					}
					mu.Lock()
					stop := noRoom
					mu.Unlock()
					if stop {
						return 0, errNotFetched
					}
					return fobjs[f].Size, nil
				}
				var vonce sync.Once
				markVerified := func() { vonce.Do(func() { close(verified[f]) }) }
				var onVerified func(vfs.File, *layout.Snapshot)
				if f < scatterTo {
					onVerified = func(rd vfs.File, head *layout.Snapshot) {
						mu.Lock()
						rds[f], heads[f] = rd, head
						mu.Unlock()
						markVerified()
					}
				}
				h, err := t.e.pc.admitHeld(ctx, ns, keys[pos:pos+1], parents[pos:pos+1], fileBytes, func() error {
					// The GET token is taken before the next page may
					// reserve, so pages take tokens in chain order.
					select {
					case gets <- struct{}{}:
					case <-ctx.Done():
						return ctx.Err()
					}
					var once sync.Once
					release := func() { once.Do(func() { <-gets }) }
					defer release()
					wrote = true
					decide()
					size, err := t.fetchPage(ctx, n, want, fobjs[f], release, onVerified)
					mu.Lock()
					sizes[f] = size
					mu.Unlock()
					return err
				})
				if err != nil && !wrote {
					mu.Lock()
					noRoom = true // no room (or no reservation): later pages are not fetched
					mu.Unlock()
				}
				decide()
				mu.Lock()
				held = append(held, h...)
				errs[f] = err
				mu.Unlock()
				if f < scatterTo {
					markVerified() // when it never verified
					close(ready[f])
				}
			}
		})
	}
	for f := range scatterTo {
		<-verified[f] // every worker closes its page's, whatever happens
		mu.Lock()
		rd, head := rds[f], heads[f]
		rds[f], heads[f] = nil, nil
		mu.Unlock()
		if rd == nil {
			break // not fetched, or failed before its bytes verified
		}
		ok := sc.Page(ctx, f, n.PagePath(keys[f]), rd, head) // beside its publish
		rd.Close()
		<-ready[f]
		mu.Lock()
		err, size := errs[f], sizes[f]
		mu.Unlock()
		if ok && (err != nil || size == 0) {
			// Verified and scattered, but not made local: the prefix
			// ends at it (its tokens hold its verified KV: Stop).
			sc.Retract(f, fmt.Errorf("page %s not published: %w", keys[f], cmp.Or(err, errNotPublished)))
		}
		if !ok || err != nil || size == 0 {
			break
		}
	}
	wg.Wait()
	notFetched := 0
	for f, pos := range fetch {
		if errs[f] != nil {
			if errors.Is(errs[f], errNotFetched) {
				notFetched++
				continue
			}
			if rep.Err == nil {
				rep.Err = fmt.Errorf("engine: remote page %d (%s) of namespace %s: %w", pos, keys[pos], ns, errs[f])
			}
			t.e.logSafe(slog.LevelWarn, "kvpersist: remote page not fetched", "namespace", ns, "page", keys[pos].String(), "err", errs[f])
			continue
		}
		if sizes[f] > 0 {
			rep.PagesFetched++ // published even past a failed page: each is valid alone
			rep.BytesFetched += sizes[f]
			if fetched == nil {
				fetched = map[layout.PageKey]bool{}
			}
			fetched[keys[pos]] = true
		}
	}
	if notFetched > 0 {
		t.e.logSafe(slog.LevelWarn, "kvpersist: remote pages not fetched after a page that found no room", "namespace", ns, "pages", notFetched)
	}
	return rep, held, fetched
}

// errNotPublished: a fetched page that verified was not published (a save
// had published it first: fetchPage returned 0 bytes); only its scatter
// sees it.
var errNotPublished = errors.New("engine: fetched page not published")

// errNotFetched: a page after one whose reservation failed; never sent.
var errNotFetched = errors.New("engine: not fetched: an earlier page of the chain found no room")

// prepareDirs makes, as a save does, the namespace durably, pages/ and the
// fan-out directories of the pages at positions fetch of keys, under the
// namespace's shared lock (no collect of another process sweeps
// meanwhile), and syncs pages/ and the namespace directory under the
// store's sync policy.
func (t *tier) prepareDirs(ctx context.Context, n *store.Namespace, keys []layout.PageKey, fetch []int) error {
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
	if !t.e.store.Durable() {
		return nil
	}
	// The fan-out directories' entries in pages/, and pages/'s in the
	// namespace directory (CreatePagesDir syncs it only when it made
	// pages/: another process may have made it and died before its fsync).
	if err := t.e.store.SyncDir(n.PagesDir()); err != nil {
		return err
	}
	return t.e.store.SyncDir(n.Dir())
}

// fetchPage is the write of one fetched page's admission (it runs inside
// pageCache.admitHeld, room reserved): under namespace n's shared lock it
// fetches object o, the page want.Key, into a temp file beside its local
// path, verifies it and publishes it (publishFetched); it adds it to the
// index. fetched is called once the object's bytes are all in the temp
// file (the network part is over; readThrough's GET token is given back).
// The page is verified from the bytes as they arrive (remote.PageStream:
// header, key, every tensor's xxh3-64, its size) and against the chain
// (checkWant), so it is not read back; when the stream cannot prove it
// (bytes out of order: ranged GETs or a range retried; or a check fails)
// it is verified by reading the temp file back (verifyPage), which names
// what is wrong. The temp file's writeback is started every
// writebackBytes (kickWriter), so the fdatasync of the publish finds
// little left to write. A page that a save published since the lookup is
// not fetched (0 bytes, no error); one published meanwhile by a save is
// simply replaced by the same bytes (same key, same content).
//
// With verified non-nil, once the page's bytes verified and before its
// publish, verified is given a read-only descriptor of its temp file (the
// verification's own when it read the file back; the rename keeps it the
// same file), for the load's scatter (readThrough), which closes it, and
// the header the stream decoded from the bytes it wrote (nil when the page
// was verified by reading it back), so the scatter does not decode it
// again; it is not called for a page that did not verify (or whose temp
// file could not be opened again: then it is simply not scattered).
func (t *tier) fetchPage(ctx context.Context, n *store.Namespace, want *layout.Page, o remote.Object, fetched func(), verified func(vfs.File, *layout.Snapshot)) (int64, error) {
	if t.e.pages.Has(n.Name(), want.Key) {
		return 0, nil
	}
	unlock, err := n.Lock(ctx, false)
	if err != nil {
		return 0, err
	}
	defer unlock()
	start := time.Now()
	name := o.Name
	path := n.PagePath(want.Key)
	fsys := t.e.store.FS()
	sf, err := layout.Stage(fsys, path, 0)
	if err != nil {
		return 0, err
	}
	// The writeback kicks only when the publish will fdatasync (the
	// store's sync policy, as a save's StartWriteback).
	var dst io.WriterAt = sf.File
	var kw *kickWriter
	if t.e.store.Durable() {
		kw = newKickWriter(sf.File)
		dst = kw
	}
	stream := remote.NewPageStream(dst, want.Key.String(), o.Size)
	var rd vfs.File           // read-only, of the temp file: kept for the scatter
	var head *layout.Snapshot // the stream's decoded header, when it verified the page
	closeRd := func() {
		if rd != nil {
			rd.Close()
			rd = nil
		}
	}
	defer closeRd() // unless handed to verified
	err = t.st.FetchObject(ctx, o, stream, func(_ io.ReaderAt, size int64) error {
		fetched()
		if snap, ok := stream.Verified(); ok {
			head = snap
			return checkWant(name, snap.Page, want)
		}
		// The temp file is open for writing only: verify through a
		// read-only descriptor of it.
		f, err := fsys.Open(sf.Tmp)
		if err != nil {
			return err
		}
		closeRd()
		rd = f
		return verifyPage(f, name, want, size)
	})
	if kw != nil {
		kw.stop() // before the file is closed
	}
	if err == nil && verified != nil {
		if rd == nil {
			if f, oerr := fsys.Open(sf.Tmp); oerr == nil { // else the page is simply not scattered
				rd = f
			}
		}
		if rd != nil {
			verified(rd, head)
			rd = nil
		}
	}
	if err == nil {
		err = t.publishFetched(sf)
	} else {
		sf.Abort()
	}
	res := labels.RemoteOK
	switch {
	case errors.Is(err, remote.ErrCorrupt):
		res = labels.RemoteCorrupt
	case err != nil:
		res = labels.RemoteError
	}
	if m := t.metrics(); m != nil {
		var b int64
		if err == nil {
			b = o.Size
		}
		m.Remote(labels.RemoteFetch, res, b, time.Since(start))
	}
	if err != nil {
		return 0, err
	}
	t.e.pages.Add(n.Name(), want.Key)
	t.markKnown(n.Name(), want.Key)
	return o.Size, nil
}

// writebackBytes: a fetched page's temp file has its writeback started
// (sync_file_range) each time this many more bytes were written to it.
const writebackBytes = 8 << 20

// kickWriter writes to a fetched page's temp file and has its writeback
// started every writebackBytes (vfs.File.StartWriteback, no durability
// promise: the publish's fdatasync makes it durable), so the disk writes
// while the GET still runs. sync_file_range may block when the disk's
// queue is full, so it runs on the kickWriter's own goroutine (started by
// newKickWriter, ended by stop), never on the GET's: a write only signals
// it. Safe for the concurrent writes of several ranges.
type kickWriter struct {
	f       vfs.File
	written atomic.Int64
	kick    chan struct{}
	done    chan struct{}
}

func newKickWriter(f vfs.File) *kickWriter {
	w := &kickWriter{f: f, kick: make(chan struct{}, 1), done: make(chan struct{})}
	go func() {
		defer close(w.done)
		for range w.kick {
			_ = w.f.StartWriteback(0, 0) // a hint; failures show in the fdatasync
		}
	}()
	return w
}

func (w *kickWriter) WriteAt(p []byte, off int64) (int, error) {
	n, err := w.f.WriteAt(p, off)
	if after := w.written.Add(int64(n)); after/writebackBytes != (after-int64(n))/writebackBytes {
		select {
		case w.kick <- struct{}{}:
		default: // a kick is pending: it covers these bytes too
		}
	}
	return n, err
}

// stop ends the goroutine once its pending kick ran. Called once the
// writes are over (FetchObject returned), before the file is closed.
func (w *kickWriter) stop() {
	close(w.kick)
	<-w.done
}

// publishFetched is the one place a fetched page enters the local tier:
// fdatasync of the verified temp file, rename onto the page's path, fsync
// of its fan-out directory (under the store's sync policy), as a save
// publishes its pages. It runs inside the page's admission
// (pageCache.admitHeld), whose reservation covers the file.
func (t *tier) publishFetched(sf *layout.Staged) error {
	return sf.Commit(t.e.store.PublishOptions(true, 0))
}

// verifyPage checks a fetched page file before it may be published:
// remote.VerifyPage (it decodes: every single-file rule, the header hash,
// the page object, whose key must equal SHA-256(parent ‖ tokens); its key
// is the one named; every tensor's xxh3-64 matches; it ends exactly where
// its last tensor ends, so a short or long object fails), and it is
// exactly the page the prompt's chain expects at its position: parent,
// identity, page size and token ids (want.Tokens nil: a named read's page,
// whose manifest names keys only; its key, checked against SHA-256(parent
// ‖ tokens), fixes them).
func verifyPage(f vfs.File, name string, want *layout.Page, size int64) error {
	var pg *layout.Page
	if err := remote.VerifyPage(want.Key.String(), &pg)(f, size); err != nil {
		return fmt.Errorf("%s: %w", name, err)
	}
	return checkWant(name, pg, want)
}

// checkWant: the verified page pg (object name) is exactly the page the
// prompt's chain expects at its position (want): parent, identity, page
// size and token ids.
func checkWant(name string, pg, want *layout.Page) error {
	switch {
	case pg.Parent != want.Parent:
		return fmt.Errorf("%s: parent %s, the chain wants %s", name, pg.Parent, want.Parent)
	case pg.Identity != want.Identity || pg.PageTokens != want.PageTokens:
		return fmt.Errorf("%s has identity %q and %d tokens per page, the load %q and %d", name, pg.Identity, pg.PageTokens, want.Identity, want.PageTokens)
	case want.Tokens != nil && !slices.Equal(pg.Tokens, want.Tokens): // nil: a named read (the key fixes them)
		return fmt.Errorf("%s holds other token ids than the prompt's", name)
	}
	return nil
}

// LookupRemote is Lookup through both tiers: Local is Lookup's answer
// (the engine's index, no I/O), Total the longest prefix stored in the
// local tier and the object store together, which a LoadPrefixRequest
// would load (fetching the remote pages first). It asks the store about
// the pages after the local prefix that the local index lacks, in batches
// of Store.Concurrency HEADs all in flight (one round trip each), and
// stops at the first batch holding a page the store lacks: a prompt of n
// pages past its local prefix costs at most ceil(n/Concurrency) round
// trips (a 32,768-token prompt at 256 tokens per page, nothing local: 128
// HEADs in 8 round trips at the default Concurrency of 16).
//
// Lookup stays local-only on purpose: a scheduler calls it on its hot
// path for every request and needs an answer in microseconds without
// allocation or failure; LookupRemote costs network round trips and can
// fail, so the scheduler calls it when the local answer is short and
// decides whether fetching beats recomputing. Without a remote tier,
// Total equals Local.
//
// Errors: those of Lookup, ctx's, or the store's (a *remote.OpError; Local
// is still set and Total = Local).
func (e *Engine) LookupRemote(ctx context.Context, namespace, identity string, pageTokens int, tokens []uint32) (PrefixHit, error) {
	local, err := e.Lookup(namespace, identity, pageTokens, tokens)
	if err != nil || e.tier == nil || local == len(tokens) {
		return PrefixHit{Local: local, Total: local}, err
	}
	if pageTokens == 0 {
		pageTokens = layout.DefaultPageTokens
	}
	keys, _, err := layout.PageChain(identity, pageTokens, tokens)
	if err != nil {
		return PrefixHit{Local: local, Total: local}, err
	}
	var rep RemoteReport
	_, cands, _, _ := e.tier.remoteCandidates(ctx, namespace, keys, &rep)
	total := local
	if len(cands) > 0 {
		last := local/pageTokens + len(cands) // pages of the prefix
		full := len(tokens) / pageTokens
		switch {
		case last <= full:
			total = last * pageTokens
		default: // the leaf: the whole prompt
			total = len(tokens)
		}
	}
	return PrefixHit{Local: local, Total: total}, rep.Err
}
