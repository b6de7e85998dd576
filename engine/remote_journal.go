package engine

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"time"

	"github.com/kvpersist/kvpersist/engine/layout"
	"github.com/kvpersist/kvpersist/engine/remote"
)

// Uploads that outlive a failure, a full queue, a Close or a crash
// (issue 15): a page manifest whose upload failed is queued again with
// backoff (manifestRetries times), and every upload queued (or refused by
// a full queue) is recorded in a per-namespace journal,
// <root>/<ns>/.uploads, until it is done: a record appended when it is
// queued, another when it is settled (remote_journal_file.go writes them
// in batches, from a goroutine the tier owns). New replays the journals
// and queues again what they list; a full queue is refilled from them
// when it drains. See ARCHITECTURE.md, "Remote tier", "The uploads
// journal".

// manifestRetries is how many times a page manifest whose upload failed
// (a page it names failed to upload or was not found stored, a HEAD or a
// refresh of manifestReady failed) is queued again, each after a wait of
// manifestRetryWait(attempt); then it is given up until the engine's next
// start (it stays listed in the journal).
const manifestRetries = 8

// maxManifestRetryWait caps the wait before a manifest is queued again.
const maxManifestRetryWait = 5 * time.Minute

// manifestRetryWait is the wait before re-queue number attempt (1, 2,
// ...): RemoteTier.UploadBackoffMax doubled per attempt, at most
// maxManifestRetryWait, with jitter (between half and all of it). With the
// default 5 s: about 5, 10, 20, 40, 80, 160, 300, 300 s.
func (t *tier) manifestRetryWait(attempt int) time.Duration {
	d := t.backoffMax
	for i := 1; i < attempt && d < maxManifestRetryWait; i++ {
		d *= 2
	}
	d = min(d, maxManifestRetryWait)
	return d/2 + rand.N(d/2+1)
}

// errSourceChanged: an upload's local file is gone or was rewritten since
// it was queued. A manifest failing so is queued again as after any
// failure: a write of the name while its upload was queued found the name
// queued and did not queue its new file, so the retry (which reads the
// local file again, and drops a name gone or no longer a page manifest)
// is what uploads it.
var errSourceChanged = errors.New("engine: the local file changed since it was queued for upload")

// manifestDone is called for every manifest upload that left the queue
// (uploaded) or was refused by it (queueManifest): a failure that is
// neither an abandon nor permanent queues it again after
// manifestRetryWait (bounded by manifestRetries; again reports it). An
// upload done, or failed permanently, is settled in the journal; one
// abandoned, or out of retries, stays listed there (the next start, or a
// refill of the queue, queues it again).
func (t *tier) manifestDone(p *pendingUpload, err error) (again bool) {
	switch {
	case err == nil:
	case errors.Is(err, remote.ErrAbandoned):
		return false
	case errors.Is(err, remote.ErrConflict), errors.Is(err, remote.ErrBadName):
		// Permanent: another manifest holds the name remotely.
	case errors.Is(err, remote.ErrSourceCorrupt):
		// Permanent: the local manifest is corrupt (logged by uploaded);
		// a write of the name queues its new file.
	case p.attempt >= manifestRetries:
		t.e.logSafe(slog.LevelError, "kvpersist: page manifest not uploaded; given up until the next start", "namespace", p.ns, "name", p.name, "attempts", p.attempt+1, "err", err)
		return false
	default:
		t.scheduleManifest(p.ns, p.name, p.attempt+1)
		return true
	}
	t.settle(p.ns, layout.PageKey{}, p.name)
	return false
}

// settle records in the journal that an upload is done or can never be
// done (a page's when manifest is empty).
func (t *tier) settle(ns string, key layout.PageKey, manifest string) {
	if manifest != "" {
		t.j.add(ns, opManifestSettled, []byte(manifest))
	} else {
		t.j.add(ns, opPageSettled, key[:])
	}
}

// manifestRetry is a manifest waiting to be queued again.
type manifestRetry struct {
	ns, name string
	attempt  int
	tm       *time.Timer
}

// scheduleManifest queues manifest name of ns again after
// manifestRetryWait(attempt), on a timer owned by the tier (one per
// manifest name: a name already waiting keeps its timer): close stops the
// timers not yet fired (queueing their manifests at once) and waits for
// the callbacks of those that fired. The manifest is queued with the keys
// its local file names then (requeueManifest), not those it named when
// it failed: a name rewritten meanwhile is uploaded after its own pages.
func (t *tier) scheduleManifest(ns, name string, attempt int) {
	id := ns + "/" + name
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.closing {
		return // it stays listed in the journal
	}
	if t.retries[id] != nil {
		return
	}
	r := &manifestRetry{ns: ns, name: name, attempt: attempt}
	t.retryWG.Add(1)
	r.tm = time.AfterFunc(t.manifestRetryWait(attempt), func() {
		defer t.retryWG.Done()
		t.mu.Lock()
		mine := t.retries[id] == r // else close took it (and queued it)
		if mine {
			delete(t.retries, id)
		}
		t.mu.Unlock()
		if mine {
			t.requeueManifest(r.ns, r.name, r.attempt, true)
		}
	})
	t.retries[id] = r
}

// requeueManifest queues manifest name of ns again (attempt), with the
// keys its local file names now; one that is gone or no longer a page
// manifest is dropped (logged) and settled. journaled: the journal lists
// it already (a retry, a replay), so no queued record is appended.
func (t *tier) requeueManifest(ns, name string, attempt int, journaled bool) {
	ref := Ref{Namespace: ns, Name: name}
	keys, err := t.localPageManifest(ref)
	if err != nil {
		t.e.logSafe(slog.LevelWarn, "kvpersist: page manifest not uploaded: its local file changed", "namespace", ns, "name", name, "err", err)
		t.settle(ns, layout.PageKey{}, name)
		return
	}
	t.queueManifest(ref, keys, attempt, journaled)
	t.queueDepth()
}

// stopRetries runs at close, before the uploader closes: the manifest
// timers not fired are stopped and their manifests queued at once (the
// uploader's Close then finishes them within its context, or abandons
// them: they stay listed in the journal); the callbacks of those that
// fired have queued theirs when it returns. From now on a failed manifest
// is not scheduled again (it stays listed in the journal).
func (t *tier) stopRetries() {
	t.mu.Lock()
	t.closing = true
	var now []*manifestRetry
	for _, r := range t.retries {
		if r.tm.Stop() {
			t.retryWG.Done() // its callback never runs
		}
		now = append(now, r)
	}
	clear(t.retries)
	t.mu.Unlock()
	t.retryWG.Wait()
	for _, r := range now {
		t.requeueManifest(r.ns, r.name, r.attempt, true)
	}
}

// resume replays every namespace's journal (New) and queues again what
// it lists (replay). A journal that cannot be read is ignored with a
// Warn; bytes of it that do not decode are skipped with a Warn
// (readJournalFile).
func (t *tier) resume() {
	names, _, err := t.e.store.Namespaces(false)
	if err != nil {
		return
	}
	for _, ns := range names {
		t.replayJournal(ns, true)
	}
	t.queueDepth()
}

// replayJournal reads namespace ns's journal and queues again what it
// lists that is neither queued here already nor known stored: its pages
// whose local files exist as regular files (sorted by key, not chain
// order: harmless, invariant 3), then each manifest that is still a
// local page manifest and is not waiting for a retry, with its pages, as
// a write queues it. An entry that can never be uploaded (its local file
// gone or not a regular file, or not a page manifest) or is known stored
// gets a settled record. Nothing queued from it gets a queued record (it
// is in the journal already). atStart: New's replay, which marks a
// journal holding records or undecodable bytes for compaction at close.
func (t *tier) replayJournal(ns string, atStart bool) {
	n, err := t.e.store.Namespace(ns)
	if err != nil {
		return
	}
	set, canonical, ok := t.j.read(n.UploadsPath())
	if !ok {
		return
	}
	if atStart && !canonical {
		t.j.touch(ns)
	}
	var queue []layout.PageKey
	for _, k := range set.sortedPages() {
		// A page known stored is settled here; one whose path is gone or
		// is not a regular file is settled by enqueueFile's lstat.
		if t.isKnown(ns, k) {
			t.mu.Lock()
			if name, err := t.st.PageName(ns, k.String()); err == nil && t.pending[name] == nil {
				// Spilled earlier (marked pending), and stored since.
				t.markPendingLocked(ns, k, false)
			}
			t.mu.Unlock()
			t.settle(ns, k, "")
			continue
		}
		queue = append(queue, k)
	}
	t.enqueuePages(ns, queue, true)
	for _, m := range set.sortedManifests() {
		t.mu.Lock()
		_, waiting := t.retries[ns+"/"+m]
		t.mu.Unlock()
		if !waiting {
			t.requeueManifest(ns, m, 0, true)
		}
	}
}

// localPageManifest decodes the local page manifest of ref and returns
// the keys it names.
func (t *tier) localPageManifest(ref Ref) ([]layout.PageKey, error) {
	path, err := t.e.Path(ref)
	if err != nil {
		return nil, err
	}
	f, err := t.e.store.FS().Open(path)
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

// closeUploads is the tier's part of Close: the manifest timers stopped,
// the uploader closed within ctx (an abandoned upload keeps its queued
// record), then the journal's last records written and synced and the
// journals this engine appended to (or found with records at start)
// compacted (journal.close).
func (t *tier) closeUploads(ctx context.Context) error {
	t.stopRetries()
	err := t.up.Close(ctx)
	t.j.close(ctx)
	return err
}
