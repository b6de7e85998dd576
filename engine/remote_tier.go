package engine

import (
	"context"
	"errors"
	"fmt"
	"io"
	"path/filepath"
	"slices"
	"sync/atomic"
	"time"

	"github.com/kvpersist/kvpersist/engine/layout"
	"github.com/kvpersist/kvpersist/engine/metrics/labels"
	"github.com/kvpersist/kvpersist/engine/remote"
	"github.com/kvpersist/kvpersist/engine/store"
	"github.com/kvpersist/kvpersist/engine/uploads"
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

	// l: the uploads' state and journal (remote_uploads.go).
	l *uploads.Ledger
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
	t := &tier{e: e, st: st, window: rc.Store.Concurrency, fetchPages: rc.FetchPages}
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
	if err := t.openUploads(rc); err != nil {
		_ = t.up.Close(context.Background())
		st.Close()
		return nil, fmt.Errorf("%w: Remote: %w", ErrConfig, err)
	}
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
// pagecache.Cache.AdmitHeld, room reserved): under namespace n's shared lock it
// fetches object o, the page want.Key, into a temp file beside its local
// path, verifies it and publishes it (publishFetched); it adds it to the
// index. fetched is called once the object's bytes are all in the temp
// file (the network part is over; the fetchRun's GET token is given back).
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
// same file), kept by the fetchRun to hand over to the load once the page
// is published (loadSource), and the header the stream decoded from the
// bytes it wrote (nil when the page was verified by reading it back), so
// the load does not decode it again; it is not called for a page that did
// not verify (or whose temp file could not be opened again: then the load
// opens the published file).
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
	var rd vfs.File           // read-only, of the temp file: kept for the load
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
			if f, oerr := fsys.Open(sf.Tmp); oerr == nil { // else the load opens the published file
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
	if s := t.e.sink(); s != nil { // before the index: Sink.Stored
		s.Stored(n.Name(), *want)
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
// (pagecache.Cache.AdmitHeld), whose reservation covers the file.
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
