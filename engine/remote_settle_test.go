package engine

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"testing"

	"github.com/kvpersist/kvpersist/engine/layout"
	"github.com/kvpersist/kvpersist/engine/remote"
	"github.com/kvpersist/kvpersist/internal/kvgen"
	"github.com/kvpersist/kvpersist/internal/testutil"
)

// fillUploadQueue saves pages into ns until the unreachable tier's
// queue refuses one (its worker holds one upload and retries it for an
// hour): later uploads spill to the journal.
func fillUploadQueue(t *testing.T, e *Engine, ns string, queueLen int) {
	t.Helper()
	keys := testKeys(1000)[900 : 900+queueLen+2]
	writePageFiles(t, e, ns, keys)
	e.tier.saved(ns, keys)
	e.tier.j.mu.Lock()
	spilled := e.tier.j.spilled[ns]
	e.tier.j.mu.Unlock()
	if !spilled {
		t.Fatalf("%d pages saved, none spilled: the queue of %d is not full", len(keys), queueLen)
	}
}

// registerInFlight registers p as the upload of object name, queued and
// in flight, and adds its queued record to the journal's batch.
func registerInFlight(e *Engine, name string, p *pendingUpload) {
	e.tier.mu.Lock()
	e.tier.pending[name] = p
	e.tier.mu.Unlock()
	e.tier.journalQueued(p)
}

// TestSettledRecordPrecedesTheNextQueueing: an upload of a page ends
// (here: failed, its local file changed: errSourceChanged, so the page
// is still not stored) and, right after its entry left the tier's
// pending set, a save of the same page registers a new upload, which
// the full queue refuses: spilled, its queued record the only trace of
// it. The ended upload's settled record must come before that queued
// record in the journal, so the journal (replay and refill alike) still
// lists the page. Before: uploaded added the settled record after
// releasing the tier's mutex, so the journal read new-queued,
// old-settled, and listed the page as settled: it stayed local, never
// uploaded (until a later save named it).
func TestSettledRecordPrecedesTheNextQueueing(t *testing.T) {
	const queueLen = 4
	e, j := unreachableTierEngine(t, t.TempDir(), queueLen)
	fillUploadQueue(t, e, "ns", queueLen)
	k := testKeys(1)[0]
	writePageFiles(t, e, "ns", []layout.PageKey{k})
	name, err := e.tier.st.PageName("ns", k.String())
	if err != nil {
		t.Fatal(err)
	}
	// The first upload of k, queued and in flight (its queued record in
	// the journal).
	p := &pendingUpload{ns: "ns", key: k, done: make(chan struct{}), queued: true}
	registerInFlight(e, name, p)
	saves := 0
	e.tier.afterUnpend = func() {
		e.tier.afterUnpend = nil
		saves++
		e.tier.saved("ns", []layout.PageKey{k})
	}
	e.tier.uploaded(remote.UploadResult{Name: name, Err: fmt.Errorf("%w: %s", errSourceChanged, name), Attempts: 1})
	select {
	case <-p.done:
	default:
		t.Fatal("the first upload's done is not closed")
	}
	if saves != 1 || pageQueued(t, e, "ns", k) {
		t.Fatalf("%d saves in the gap, page queued %v: want one save, spilled (not queued)", saves, pageQueued(t, e, "ns", k))
	}
	flushJournal(t, j)
	if s, _ := journalListing(t, e, "ns"); !s.pages[k] {
		t.Fatal("the journal does not list the page spilled by the second save: the first upload's settled record came after its queued record")
	}
}

// TestSettledManifestPrecedesTheNextQueueing: as
// TestSettledRecordPrecedesTheNextQueueing for a page manifest: its
// upload is done, and in the gap the manifest is written again and
// queued; the full queue refuses it (scheduled again; the journal lists
// it until then, and at the next start if the engine closes first).
func TestSettledManifestPrecedesTheNextQueueing(t *testing.T) {
	const queueLen = 4
	e, j := unreachableTierEngine(t, t.TempDir(), queueLen)
	fillUploadQueue(t, e, "ns", queueLen)
	ref := Ref{Namespace: "ns", Name: "conv-1"}
	writeNotPageManifest(t, e, "ns", ref.Name)
	name, err := e.tier.st.ManifestName("ns", ref.Name)
	if err != nil {
		t.Fatal(err)
	}
	p := &pendingUpload{ns: "ns", manifest: true, name: ref.Name, done: make(chan struct{}), queued: true}
	registerInFlight(e, name, p)
	e.tier.afterUnpend = func() {
		e.tier.afterUnpend = nil
		e.tier.queueManifest(ref, nil, 0, false)
	}
	e.tier.uploaded(remote.UploadResult{Name: name, Created: true, Attempts: 1})
	e.tier.mu.Lock()
	_, retry := e.tier.retries["ns/"+ref.Name]
	e.tier.mu.Unlock()
	if !retry {
		t.Fatal("the second queueing of the manifest, refused by the full queue, is not scheduled again")
	}
	flushJournal(t, j)
	if s, _ := journalListing(t, e, "ns"); !s.manifests[ref.Name] {
		t.Fatal("the journal does not list the manifest queued again: the first upload's settled record came after its queued record")
	}
}

// TestGoneSettleDoesNotFollowASave: a refill (or a replay) reads the
// entry of a page whose local file is gone (evicted), and would settle
// it; between its lstat and the settle, a save writes the page again and
// queues it, and the full queue refuses it (spilled: its queued record
// the only trace). The settle must not land after that queued record.
// Before: it did, and the journal listed the page settled.
func TestGoneSettleDoesNotFollowASave(t *testing.T) {
	const queueLen = 4
	e, j := unreachableTierEngine(t, t.TempDir(), queueLen)
	fillUploadQueue(t, e, "ns", queueLen)
	k := testKeys(1)[0]
	n, err := e.store.Namespace("ns")
	if err != nil {
		t.Fatal(err)
	}
	saves := 0
	e.tier.afterGoneLstat = func() {
		e.tier.afterGoneLstat = nil
		saves++
		writePageFiles(t, e, "ns", []layout.PageKey{k})
		e.tier.saved("ns", []layout.PageKey{k})
	}
	if got := e.tier.requeuePage(n, k); got != requeueTaken {
		t.Fatalf("requeuePage = %d, want requeueTaken", got)
	}
	if saves != 1 || pageQueued(t, e, "ns", k) {
		t.Fatalf("%d saves in the gap, page queued %v: want one save, spilled", saves, pageQueued(t, e, "ns", k))
	}
	flushJournal(t, j)
	if s, _ := journalListing(t, e, "ns"); !s.pages[k] {
		t.Fatal("the journal does not list the page the save spilled: the gone page's settled record came after it")
	}
	// Without a save in the gap, a gone page's entry is still settled.
	k2 := testKeys(2)[1]
	j.add("ns", opPageQueued, k2[:])
	e.tier.requeuePage(n, k2)
	flushJournal(t, j)
	if s, _ := journalListing(t, e, "ns"); s.pages[k2] {
		t.Fatal("the entry of a page whose file is gone is not settled")
	}
}

// writeNotPageManifest writes, at the local path of manifest name of ns,
// a file that is not a page manifest (localPageManifest rejects it).
func writeNotPageManifest(t *testing.T, e *Engine, ns, name string) {
	t.Helper()
	path, err := e.Path(Ref{Namespace: ns, Name: name})
	if err != nil {
		t.Fatal(err)
	}
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(path, []byte("not a page manifest"), 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := e.tier.localPageManifest(Ref{Namespace: ns, Name: name}); err == nil {
		t.Fatal("the local file is a page manifest")
	}
}

// olderRetry runs a retry of manifest name of ns whose timer fired:
// taken from the tier's retries (as the timer's callback does), then
// queued again with the keys its local file names (requeueManifest).
func olderRetry(e *Engine, ns, name string) {
	e.tier.mu.Lock()
	e.tier.requeueStartLocked(ns + "/" + name)
	e.tier.mu.Unlock()
	e.tier.requeueManifest(ns, name, 1, true)
}

// manifestRetryAndListing reports whether manifest name of ns waits for
// its retry, and whether the journal (flushed) lists it.
func manifestRetryAndListing(t *testing.T, e *Engine, j *journal, ns, name string) (retry, listed bool) {
	t.Helper()
	e.tier.mu.Lock()
	retry = e.tier.retries[ns+"/"+name] != nil
	e.tier.mu.Unlock()
	flushJournal(t, j)
	s, _ := journalListing(t, e, ns)
	return retry, s.manifests[name]
}

// TestManifestNotSettledBeforeItsRetry: an upload of manifest M (its
// queued record in the journal) fails transiently and leaves the tier's
// pending set; right then an older retry of M reads M's local file while
// it is not a page manifest, and would settle M unless an upload of M is
// registered or waits for its retry. The failed upload's retry must be
// registered in the critical section that removed its pending entry, so
// the older retry sees it and leaves M listed. Before: uploaded removed
// the entry, and manifestDone registered the retry later, after the
// older retry had settled M: the journal read queued, settled, and after
// a crash (or an abandoning Close) the next start did not upload M.
func TestManifestNotSettledBeforeItsRetry(t *testing.T) {
	e, j := unreachableTierEngine(t, t.TempDir(), 4)
	const m = "conv-1"
	writeNotPageManifest(t, e, "ns", m)
	name, err := e.tier.st.ManifestName("ns", m)
	if err != nil {
		t.Fatal(err)
	}
	p := &pendingUpload{ns: "ns", manifest: true, name: m, done: make(chan struct{}), queued: true}
	registerInFlight(e, name, p)
	retries := 0
	e.tier.afterUnpend = func() {
		e.tier.afterUnpend = nil
		retries++
		olderRetry(e, "ns", m)
	}
	e.tier.uploaded(remote.UploadResult{Name: name, Err: errors.New("503 Slow Down"), Attempts: 3})
	if retries != 1 {
		t.Fatalf("%d older retries ran in the gap, want 1", retries)
	}
	if retry, listed := manifestRetryAndListing(t, e, j, "ns", m); !retry || !listed {
		t.Fatalf("retry scheduled %v, journal lists manifest %v: want both", retry, listed)
	}
}

// TestRefusedManifestNotSettledBeforeItsRetry: as
// TestManifestNotSettledBeforeItsRetry when the upload queue refuses the
// manifest (full): enqueueFile removes its pending entry, and its retry
// must be registered in that critical section.
func TestRefusedManifestNotSettledBeforeItsRetry(t *testing.T) {
	const queueLen = 4
	e, j := unreachableTierEngine(t, t.TempDir(), queueLen)
	fillUploadQueue(t, e, "ns", queueLen)
	const m = "conv-1"
	writeNotPageManifest(t, e, "ns", m)
	retries := 0
	e.tier.afterUnpend = func() {
		e.tier.afterUnpend = nil
		retries++
		olderRetry(e, "ns", m)
	}
	e.tier.queueManifest(Ref{Namespace: "ns", Name: m}, nil, 0, false)
	if retries != 1 {
		t.Fatalf("%d older retries ran in the gap, want 1", retries)
	}
	if retry, listed := manifestRetryAndListing(t, e, j, "ns", m); !retry || !listed {
		t.Fatalf("retry scheduled %v, journal lists manifest %v: want both", retry, listed)
	}
}

// TestConcurrentRequeueDoesNotSettleAQueueing: a refill (or a retry)
// queues manifest M again from its journal entry and reads its local
// file, a page manifest; before it registers M's upload, M is deleted
// and a second refill finds it gone, then M is written again (as a save
// would, whose own queueing then finds M's upload registered and adds
// no queued record). The second refill must not settle M: the first
// one's upload, which the journal lists only by M's earlier queued
// record, is about to be registered. Before: nothing was registered
// for M in between (neither pending nor waiting for its retry), so the
// journal read queued, settled while M's upload was registered, and a
// crash (or an abandoning Close) lost it.
func TestConcurrentRequeueDoesNotSettleAQueueing(t *testing.T) {
	const m = "turn-1"
	// A page manifest, written by an engine without a remote tier.
	src := newEngine(t, Config{Root: t.TempDir(), Workers: 1})
	c, _ := cacheOf(kvgen.Tiny, 300, true)
	req := writeReq(refOf("ns", m), c, layout.Pages, 0)
	req.Identity, req.Tokens, req.PageTokens = "tiny", prefixTokens(300, 9), 64
	mustDo(t, src, req)
	srcPath, err := src.Path(refOf("ns", m))
	if err != nil {
		t.Fatal(err)
	}
	manifest, err := os.ReadFile(srcPath)
	if err != nil {
		t.Fatal(err)
	}
	e, j := unreachableTierEngine(t, t.TempDir(), 4)
	path, err := e.Path(refOf("ns", m))
	if err != nil {
		t.Fatal(err)
	}
	testutil.CopyFile(t, srcPath, path)
	name, err := e.tier.st.ManifestName("ns", m)
	if err != nil {
		t.Fatal(err)
	}
	j.add("ns", opManifestQueued, []byte(m))
	second := 0
	e.tier.afterManifestRead = func() {
		e.tier.afterManifestRead = nil
		second++
		if err := os.Remove(path); err != nil {
			t.Fatal(err)
		}
		e.tier.requeueListed("ns", m)
		if err := os.WriteFile(path, manifest, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	e.tier.requeueListed("ns", m)
	if second != 1 {
		t.Fatalf("%d second refills ran in the gap, want 1", second)
	}
	e.tier.mu.Lock()
	registered := e.tier.pending[name] != nil || e.tier.retries["ns/"+m] != nil
	counted := len(e.tier.requeueing)
	e.tier.mu.Unlock()
	if !registered || counted != 0 {
		t.Fatalf("upload registered %v, requeueManifest calls still counted %d: want true, 0", registered, counted)
	}
	flushJournal(t, j)
	if s, _ := journalListing(t, e, "ns"); !s.manifests[m] {
		t.Fatal("the journal does not list the manifest whose upload the first refill registered: the second refill settled it")
	}
}
