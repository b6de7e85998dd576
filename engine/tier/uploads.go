package tier

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/kvpersist/kvpersist/engine/jobs"
	"github.com/kvpersist/kvpersist/engine/layout"
	"github.com/kvpersist/kvpersist/engine/metrics/labels"
	"github.com/kvpersist/kvpersist/engine/remote"
	"github.com/kvpersist/kvpersist/engine/uploads"
)

// The tier's side of the uploads (write-behind after saves): package
// uploads owns their state (registered, waiting for a retry, known
// stored) and the per-namespace journal (<root>/<ns>/.uploads) that
// lists every upload queued until it is settled, so that uploads outlive
// a failure, a full queue, a Close or a crash; the tier feeds it the
// uploader through uploadQueue and reports each upload's end (uploaded).
// See ARCHITECTURE.md, "Remote tier", "The uploads journal".

// errSourceChanged: an upload's local file is gone or was rewritten since
// it was queued. A manifest failing so is queued again as after any
// failure: a write of the name while its upload was queued found the name
// queued and did not queue its new file, so the retry (which reads the
// local file again, and drops a name gone or no longer a page manifest)
// is what uploads it.
var errSourceChanged = errors.New("engine: the local file changed since it was queued for upload")

// openUploads opens the tier's uploads.Ledger (newTier, once t.up is set).
func (t *Tier) openUploads(rc *Config) error {
	l, err := uploads.Open(uploads.Config{
		Store: t.d.Store, Queue: uploadQueue{t}, Log: t.d.Log,
		RetryBase: rc.UploadBackoffMax, KnownPages: rc.KnownPages, KnownAge: t.refreshAge,
	})
	t.l = l
	return err
}

// uploadQueue is the tier as the uploads.Ledger's Queue: object names,
// local paths, the uploader, local page manifests and the page cache's
// pending marks.
type uploadQueue struct{ t *Tier }

func (q uploadQueue) Name(u uploads.Upload) (string, error) {
	if u.IsManifest() {
		return q.t.st.ManifestName(u.NS, u.Manifest)
	}
	return q.t.st.PageName(u.NS, u.Key.String())
}

func (q uploadQueue) Path(u uploads.Upload) (string, error) {
	if u.IsManifest() {
		return q.t.manifestPath(u.NS, u.Manifest)
	}
	n, err := q.t.d.Store.Namespace(u.NS)
	if err != nil {
		return "", err
	}
	return n.PagePath(u.Key), nil
}

// Submit hands p to the uploader (queueUpload). A refusal other than a
// full queue for a page (which spills it) is logged and counted as an
// upload error.
func (q uploadQueue) Submit(p *uploads.Pending) error {
	t := q.t
	err := t.queueUpload(p)
	if err != nil && (p.IsManifest() || !errors.Is(err, remote.ErrQueueFull)) {
		if m := t.metrics(); m != nil {
			m.Remote(labels.RemoteUpload, labels.RemoteError, 0, 0)
		}
		t.d.Log(slog.LevelWarn, "kvpersist: not queued for upload", "file", p.Path, "err", err)
	}
	t.queueDepth()
	return err
}

func (q uploadQueue) ManifestPages(ns, name string) ([]layout.PageKey, error) {
	return q.t.localPageManifest(ns, name)
}

func (q uploadQueue) Room() (free, capacity int) {
	capacity = q.t.up.QueueLen()
	return capacity - q.t.up.Stats().Queued, capacity
}

// SetPending marks page k of ns pending in the page cache's eviction
// policy (pagecache.Cache.SetPending: evicted only after every evictable page
// that is not), or unmarks it: a page is marked while its upload is
// queued, in flight or spilled to the journal, so that under pressure the
// cache evicts the pages the object store holds (or need not hold)
// before the pages it does not have yet. A page the policy does not track
// (written by another process) is not marked. See ARCHITECTURE.md, "A
// pending upload is evicted last".
func (q uploadQueue) SetPending(ns string, k layout.PageKey, pending bool) {
	q.t.d.Cache.SetPending(ns, k, pending)
}

// queueUpload hands the uploader the upload p (registered with the
// Ledger; p.Info is its file's lstat). The source is re-opened for each
// attempt. A manifest's must still be the file lstat'd then (same size
// and mtime; else errSourceChanged, and the Ledger queues the name
// again: a manifest rewritten under its name is not uploaded with the
// bytes of another version). A page's may be a new file (the page evicted
// and saved again while its upload waited: same key, so the same page)
// of the same size; it is what this attempt sends (a new file of another
// size, or none, is errSourceChanged: the upload ends, and the next save
// naming the page queues it again). Before its PUT the open file is
// verified (remote.Upload.Verify): a page by remote.VerifyPage (header,
// its key is its name's, every tensor's xxh3-64, its length), a manifest
// by remote.VerifyManifest (header, attachments' hashes); the PUT streams
// the same open descriptor, so the bytes sent are the bytes verified
// (page files are never written in place: a save renames a new file over
// the path). A file that fails is not uploaded (remote.ErrSourceCorrupt,
// handled by uploaded). A manifest's upload first waits for its pages'
// uploads, then makes sure every page is stored and young enough for
// remote GC (manifestReady): a listable manifest never names a page the
// store lacks, nor one a collector may delete before the manifest
// protects it.
func (t *Tier) queueUpload(p *uploads.Pending) error {
	fsys := t.d.Store.FS()
	verify := remote.VerifyManifest(nil)
	var wait func(context.Context) error
	var stored func(context.Context, remote.Object) error
	if p.IsManifest() {
		wait = func(ctx context.Context) error {
			for _, pg := range p.Pages {
				select {
				case <-pg.Done():
					if pg.Err() != nil {
						return fmt.Errorf("engine: a page of manifest %s was not uploaded: %w", p.Object, pg.Err())
					}
				case <-ctx.Done():
					return ctx.Err()
				}
			}
			return t.manifestReady(ctx, p.NS, p.Keys)
		}
	} else {
		// a corrupt stored page is replaced (check.go)
		verify, stored = remote.VerifyPage(p.Key.String(), nil), t.storedPage(p.Key)
	}
	path, size, mtime := p.Path, p.Info.Size(), p.Info.ModTime()
	return t.up.Enqueue(remote.Upload{Name: p.Object, Size: size, Wait: wait, Verify: verify, Stored: stored, Open: func() (remote.ReadAtCloser, error) {
		p.MarkStarted()
		f, err := fsys.Open(path)
		if err != nil {
			return nil, fmt.Errorf("%w: %s: %w", errSourceChanged, path, err)
		}
		if st, err := f.Stat(); err != nil || !st.Mode().IsRegular() || st.Size() != size || (p.IsManifest() && !st.ModTime().Equal(mtime)) {
			f.Close()
			return nil, fmt.Errorf("%w: %s", errSourceChanged, path)
		}
		return f, nil
	}})
}

// manifestReady checks that every page keys names is stored (one HEAD
// each, Concurrency in flight; a page found missing is dropped from the
// known set, so the manifest's retry uploads it again) and refreshes each whose mtime is older
// than the store's clock minus Config.RefreshAge (Store.Refresh: a
// server-side copy onto itself, the bytes unchanged), so that remote GC,
// whose grace must be at least twice RefreshAge, keeps it until the
// manifest is listable (ARCHITECTURE.md, "Remote garbage collection and
// its clocks").
func (t *Tier) manifestReady(ctx context.Context, ns string, keys []layout.PageKey) error {
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
			t.Forget(ns, k)
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

// localPageManifest decodes the local page manifest of ref and returns
// the keys it names.
func (t *Tier) localPageManifest(ns, name string) ([]layout.PageKey, error) {
	path, err := t.manifestPath(ns, name)
	if err != nil {
		return nil, err
	}
	f, err := t.d.Store.FS().Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	snap, err := layout.Decode(f, path)
	if err != nil {
		return nil, err
	}
	if snap.Pages == nil {
		return nil, fmt.Errorf("%s is no longer a page manifest", path)
	}
	return snap.Pages.Keys, nil
}

// uploaded is the uploader's OnDone: the Ledger ends the upload (settled,
// scheduled again or left listed; a page uploaded is known stored), then
// the metrics are fed and a corrupt local page is removed. It runs on an
// uploader goroutine.
func (t *Tier) uploaded(r remote.UploadResult) {
	p := t.l.Done(r.Name, r.Err)
	var d time.Duration
	if p != nil && !p.Started().IsZero() {
		d = time.Since(p.Started())
	}
	res := labels.RemoteOK
	switch {
	case errors.Is(r.Err, remote.ErrAbandoned):
		res = labels.RemoteAbandoned
	case errors.Is(r.Err, remote.ErrSourceCorrupt):
		res = labels.RemoteCorrupt
		t.d.Log(slog.LevelError, "kvpersist: local file corrupt: not uploaded", "object", r.Name, "err", r.Err)
		if p != nil && !p.IsManifest() {
			t.d.RemoveCorruptPage(p.NS, p.Key)
		}
	case r.Err != nil:
		res = labels.RemoteError
		t.d.Log(slog.LevelWarn, "kvpersist: upload failed", "object", r.Name, "attempts", r.Attempts, "err", r.Err)
	case !r.Created:
		res = labels.RemoteExisted
	case r.Replaced:
		t.d.Log(slog.LevelWarn, "kvpersist: replaced a stored page object that did not verify", "object", r.Name)
	}
	if m := t.metrics(); m != nil {
		m.Remote(labels.RemoteUpload, res, r.Bytes, d)
	}
	t.queueDepth()
}

// Saved queues the uploads of the pages of a durable save (keys, in
// chain order), except those known stored remotely or already queued,
// and returns once their queued records are durable (uploads.Ledger.
// EnqueuePages); it never waits for an upload. Pages are queued in chain
// order, so a page is created before its descendants unless a retry
// reorders them (harmless: a lookup walks the chain and stops at the
// first page the store lacks).
func (t *Tier) Saved(ns string, keys []layout.PageKey) {
	t.l.EnqueuePages(ns, keys)
	t.queueDepth()
}

// ManifestWritten queues the upload of a page manifest (a named snapshot
// in the Pages layout) after the pages it names (uploads.Ledger.
// EnqueueManifest; queueUpload says what its upload waits for).
func (t *Tier) ManifestWritten(ref jobs.Ref, keys []layout.PageKey) {
	t.l.EnqueueManifest(ref.Namespace, ref.Name, keys)
	t.queueDepth()
}

// Resume queues again the uploads the journals list, once the engine can
// take the tier's callbacks (one that finds a corrupt page removes it
// through Deps.RemoveCorruptPage, which may call Forget).
func (t *Tier) Resume() {
	t.l.Resume()
	t.queueDepth()
}

// closeUploads is the tier's part of Close (uploads.Ledger.Close): the
// manifest retries queued at once, the uploader closed within ctx (an
// abandoned upload keeps its queued record), then the journals written,
// synced and compacted.
func (t *Tier) closeUploads(ctx context.Context) error {
	return t.l.Close(ctx, t.up.Close)
}

// markKnown records page k of ns as stored remotely (at most
// Config.KnownPages entries).
func (t *Tier) markKnown(ns string, k layout.PageKey) { t.l.MarkKnown(ns, k) }

// Forget drops page k of ns from the known set: its local file was
// evicted or found gone (the page cache's onRemoved, the engine's
// forgetIfGone), or the store lacks it. A later save writes the page
// again and queues it; its upload HEADs the object first (StatFirst) and
// sends nothing when it is stored.
func (t *Tier) Forget(ns string, k layout.PageKey) { t.l.Forget(ns, k) }

// KnownPages returns how many pages the tier remembers as stored in the
// object store (at most Config.KnownPages).
func (t *Tier) KnownPages() int { return t.l.KnownPages() }
