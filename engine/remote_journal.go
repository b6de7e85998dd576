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
	"github.com/kvpersist/kvpersist/engine/store"
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

// manifestDoneLocked is called for every manifest upload that left the
// queue (uploaded) or was refused by it (enqueueFile), t.mu held, in the
// critical section that removed its entry from t.pending: an upload done,
// or failed permanently (manifestSettles), is settled in the journal
// (settleLocked); a failure that is neither an abandon nor permanent is
// registered to be queued again after manifestRetryWait
// (scheduleManifestLocked; bounded by manifestRetries); one abandoned, or
// out of retries (givenUp: the caller logs it after releasing t.mu,
// manifestGivenUp), stays listed there (the next start, or a refill of
// the queue, queues it again). The retry is registered in the same
// critical section so that the name is never in neither t.pending nor
// t.retries while it waits for one: an older retry of the name that
// finds its local file no longer a page manifest (requeueManifest) would
// settle it there, and the journal would list it settled while its retry
// waits (TestManifestNotSettledBeforeItsRetry).
func (t *tier) manifestDoneLocked(p *pendingUpload, err error) (givenUp bool) {
	switch {
	case manifestSettles(err):
		t.settleLocked(p.ns, layout.PageKey{}, p.name)
		return false
	case errors.Is(err, remote.ErrAbandoned):
		return false
	case p.attempt >= manifestRetries:
		return true
	default:
		t.scheduleManifestLocked(p.ns, p.name, p.attempt+1)
		return false
	}
}

// manifestGivenUp logs a manifest upload out of retries
// (manifestDoneLocked), t.mu not held.
func (t *tier) manifestGivenUp(p *pendingUpload, err error) {
	t.e.logSafe(slog.LevelError, "kvpersist: page manifest not uploaded; given up until the next start", "namespace", p.ns, "name", p.name, "attempts", p.attempt+1, "err", err)
}

// manifestSettles reports whether a manifest upload that ended with err
// is settled in the journal: done, or failed permanently (another
// manifest holds the name remotely: ErrConflict, ErrBadName; the local
// manifest is corrupt, logged by uploaded: ErrSourceCorrupt, and a
// write of the name queues its new file).
func manifestSettles(err error) bool {
	return err == nil || errors.Is(err, remote.ErrConflict) || errors.Is(err, remote.ErrBadName) || errors.Is(err, remote.ErrSourceCorrupt)
}

// settleLocked records in the journal that an upload is done or can
// never be done (a page's when manifest is empty). t.mu held, in the
// critical section that removed the upload's entry from t.pending or
// found none: a save of the same object registers its next upload (and
// adds its queued record) only after it, so the journal never reads a
// queued record followed by an older upload's settled record (uploaded).
// Lock order: t.mu, then the journal's mutex (the journal never takes
// t.mu while holding its own).
func (t *tier) settleLocked(ns string, key layout.PageKey, manifest string) {
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

// scheduleManifestLocked registers manifest name of ns to be queued
// again after manifestRetryWait(attempt), on a timer owned by the tier
// (one per manifest name: a name already waiting keeps its timer); t.mu
// held (it only starts a timer). close stops the timers not yet fired
// (queueing their manifests at once) and waits for the callbacks of those
// that fired. The manifest is queued with the keys its local file names
// then (requeueManifest), not those it named when it failed: a name
// rewritten meanwhile is uploaded after its own pages.
func (t *tier) scheduleManifestLocked(ns, name string, attempt int) {
	id := ns + "/" + name
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
			t.requeueStartLocked(id)
		}
		t.mu.Unlock()
		if mine {
			t.requeueManifest(r.ns, r.name, r.attempt, true)
		}
	})
	t.retries[id] = r
}

// requeueStartLocked counts a requeueManifest call for manifest id
// ("<ns>/<name>"), t.mu held, in the critical section where its caller
// took the name from t.retries (a retry's timer, stopRetries) or found it
// not there (requeueListed): from there until the call has registered
// the name's upload (or decided not to), the name is counted here, so
// that no other requeueManifest of it settles it in between (one finding
// the local file gone or no longer a page manifest, while this one read
// it as a page manifest and is about to queue it; the journal would list
// it settled while its upload is registered:
// TestConcurrentRequeueDoesNotSettleAQueueing).
func (t *tier) requeueStartLocked(id string) {
	t.requeueing[id]++
}

// requeueEndLocked ends a call counted by requeueStartLocked; t.mu held.
func (t *tier) requeueEndLocked(id string) {
	if t.requeueing[id]--; t.requeueing[id] <= 0 {
		delete(t.requeueing, id)
	}
}

// requeueManifest queues manifest name of ns again (attempt), with the
// keys its local file names now; the caller counted the call
// (requeueStartLocked), and it ends the count. One that is gone or no
// longer a page manifest is not queued (logged); it is settled only when
// no upload of the name is registered (t.pending), waits for its retry
// (t.retries) or is being queued by another requeueManifest
// (t.requeueing), checked under t.mu: such an upload (a write of the name
// since, a retry) settles it, or keeps it listed. journaled: the journal
// lists it already (a retry, a replay), so no queued record is appended.
func (t *tier) requeueManifest(ns, name string, attempt int, journaled bool) {
	id := ns + "/" + name
	ref := Ref{Namespace: ns, Name: name}
	keys, err := t.localPageManifest(ref)
	if err != nil {
		t.e.logSafe(slog.LevelWarn, "kvpersist: page manifest not uploaded: its local file changed", "namespace", ns, "name", name, "err", err)
		obj, oerr := t.st.ManifestName(ns, name)
		t.mu.Lock()
		t.requeueEndLocked(id)
		if oerr != nil || (t.pending[obj] == nil && t.retries[id] == nil && t.requeueing[id] == 0) {
			t.settleLocked(ns, layout.PageKey{}, name)
		}
		t.mu.Unlock()
		return
	}
	if t.afterManifestRead != nil {
		t.afterManifestRead()
	}
	t.queueManifest(ref, keys, attempt, journaled)
	t.mu.Lock()
	t.requeueEndLocked(id)
	t.mu.Unlock()
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
	for id, r := range t.retries {
		if r.tm.Stop() {
			t.retryWG.Done() // its callback never runs
		}
		t.requeueStartLocked(id)
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
		t.replayJournal(ns)
	}
	t.queueDepth()
}

// replayJournal reads namespace ns's journal at New and queues again
// what it lists (requeuePage, requeueListed): its pages (sorted by key,
// not chain order: harmless, invariant 3), then its manifests. A journal
// holding records or undecodable bytes is marked for compaction at
// close. (A refill of the queue reads the journal from where its last
// refill stopped instead: journal.refillNamespace.)
func (t *tier) replayJournal(ns string) {
	n, err := t.e.store.Namespace(ns)
	if err != nil {
		return
	}
	set, canonical, ok := t.j.read(n.UploadsPath())
	if !ok {
		return
	}
	if !canonical {
		t.j.touch(ns)
	}
	for _, k := range set.sortedPages() {
		t.requeuePage(n, k)
	}
	for _, m := range set.sortedManifests() {
		t.requeueListed(ns, m)
	}
}

// requeueResult is what requeuePage did.
type requeueResult int

const (
	// requeueTaken: queued, queued already, known stored, gone
	// (settled), refused by the queue for another reason than being full
	// (ErrClosed: closing; logged, still listed), or a name PageName
	// rejects (still listed): the refill reads on.
	requeueTaken   requeueResult = iota
	requeueRefused               // the queue is full: spilled again (the namespace marked)
	requeueBusy                  // another goroutine is queueing it (its queueing may yet spill it)
)

// requeuePage queues page k of n again from its journal entry (a replay
// at New, a refill), unless it is queued here already: a page known
// stored gets a settled record (and loses its pending mark when it was
// spilled: stored since); one whose local file is gone or is not a
// regular file is settled by enqueueFile's lstat. Nothing queued from
// here gets a queued record (the journal lists it). An entry another
// process on the root has queued and not yet settled is queued here too:
// a duplicate costs one HEAD (StatFirst).
func (t *tier) requeuePage(n *store.Namespace, k layout.PageKey) requeueResult {
	ns := n.Name()
	name, err := t.st.PageName(ns, k.String())
	if err != nil {
		return requeueTaken
	}
	if t.isKnown(ns, k) {
		t.mu.Lock()
		if t.pending[name] == nil {
			// Spilled earlier (marked pending), and stored since.
			t.markPendingLocked(ns, k, false)
		}
		t.settleLocked(ns, k, "")
		t.mu.Unlock()
		return requeueTaken
	}
	t.mu.Lock()
	q := t.pending[name]
	busy := q != nil && !q.queued
	t.mu.Unlock()
	switch {
	case busy:
		return requeueBusy
	case q != nil:
		return requeueTaken
	}
	p := &pendingUpload{ns: ns, key: k, journaled: true}
	if t.enqueueFile(name, n.PagePath(k), p, nil) == nil && errors.Is(p.err, remote.ErrQueueFull) {
		return requeueRefused
	}
	return requeueTaken
}

// queuedPages returns the pages of ns whose uploads are queued or in
// flight here (accepted by the uploader).
func (t *tier) queuedPages(ns string) map[layout.PageKey]bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	out := map[layout.PageKey]bool{}
	for _, p := range t.pending {
		if p.ns == ns && !p.manifest && p.queued {
			out[p.key] = true
		}
	}
	return out
}

// isPending reports whether page k of ns is queued or in flight here.
func (t *tier) isPending(ns string, k layout.PageKey) bool {
	name, err := t.st.PageName(ns, k.String())
	if err != nil {
		return false
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.pending[name] != nil
}

// requeueListed queues manifest name of ns again from its journal entry
// (requeueManifest, counted by requeueStartLocked in the critical section
// that found it not waiting), unless it is waiting for a retry.
func (t *tier) requeueListed(ns, name string) {
	id := ns + "/" + name
	t.mu.Lock()
	_, waiting := t.retries[id]
	if !waiting {
		t.requeueStartLocked(id)
	}
	t.mu.Unlock()
	if !waiting {
		t.requeueManifest(ns, name, 0, true)
	}
}

// requeueEntries queues again the entries a refill read from n's
// journal through c, in file order: each queued page (requeuePage) and
// manifest (requeueListed), except an entry that a later entry of the
// same read settles or queues again (the later one decides), and a page
// that was queued here when c was opened, by an entry from before then,
// and is not any more (its upload ended: settled). It stops at the first
// page the queue refuses, or that another goroutine is queueing (busy):
// stopAt is its offset, where the next refill starts.
func (t *tier) requeueEntries(n *store.Namespace, c *refillCursor, entries []refillEntry) (stopAt int64, stopped, busy bool) {
	lastPage, lastName := map[layout.PageKey]int{}, map[string]int{}
	for i, e := range entries {
		if e.op == opPageQueued || e.op == opPageSettled {
			lastPage[e.key] = i
		} else {
			lastName[e.name] = i
		}
	}
	for i, e := range entries {
		switch {
		case e.op == opPageQueued && lastPage[e.key] == i:
			if e.off < c.opened && c.queued[e.key] && !t.isPending(n.Name(), e.key) {
				// Queued when the cursor was opened, and settled since.
				continue
			}
			switch t.requeuePage(n, e.key) {
			case requeueRefused:
				return e.off, true, false
			case requeueBusy:
				return e.off, true, true
			}
		case e.op == opManifestQueued && lastName[e.name] == i:
			t.requeueListed(n.Name(), e.name)
		}
	}
	return 0, false, false
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
