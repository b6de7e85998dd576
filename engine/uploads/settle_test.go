package uploads_test

import (
	"errors"
	"math/rand/v2"
	"os"
	"sync"
	"testing"
	"time"

	"github.com/kvpersist/kvpersist/engine/layout"
	"github.com/kvpersist/kvpersist/engine/uploads"
)

// The order of an upload's settled record and the next queueing of the
// same object, and manifests' retries and re-queues: the journal must
// list every upload registered, spilled or waiting for its retry.

// fillQueue saves pages into ns until the queue of capacity is full.
func fillQueue(t *testing.T, e *env, ns string, capacity int) {
	t.Helper()
	keys := testKeys(1000)[900 : 900+capacity]
	e.writePages(t, ns, keys...)
	e.l.EnqueuePages(ns, keys)
	if free, _ := e.q.Room(); free != 0 {
		t.Fatalf("%d free after %d pages saved", free, capacity)
	}
}

// TestSettledRecordPrecedesTheNextQueueing: an upload of a page ends
// (here: failed, its local file changed, so the page is still not
// stored) and right after it a save of the same page registers a new
// upload, which the full queue refuses: spilled, its queued record the
// only trace of it. The ended upload's settled record must come before
// that queued record in the journal, so the journal (replay and refill
// alike) still lists the page: the settle is appended in the critical
// section that ends the upload.
func TestSettledRecordPrecedesTheNextQueueing(t *testing.T) {
	const capacity = 4
	e := newEnv(t, capacity+1, false, uploads.Config{})
	k := testKeys(1)[0]
	e.writePages(t, "ns", k)
	e.l.EnqueuePages("ns", []layout.PageKey{k}) // queued and in flight
	fillQueue(t, e, "ns", capacity)
	e.q.finish(t, e.l, pageObject("ns", k), errGone)
	x := testKeys(2000)[1999]
	e.writePages(t, "ns", x)
	e.l.EnqueuePages("ns", []layout.PageKey{x}) // the queue full again
	if got := e.l.EnqueuePages("ns", []layout.PageKey{k}); len(got) != 0 || e.l.Pending("ns", k) {
		t.Fatal("the second save's upload was queued: want it spilled")
	}
	if !e.q.marked("ns", k) {
		t.Fatal("the spilled page is not marked pending")
	}
	if s, _ := e.listing(t, "ns"); !s.Pages[k] {
		t.Fatal("the journal does not list the page spilled by the second save: the first upload's settled record came after its queued record")
	}
}

// TestSettledManifestPrecedesTheNextQueueing: as
// TestSettledRecordPrecedesTheNextQueueing for a page manifest: its
// upload is done, and then the manifest is written again and queued; the
// full queue refuses it, so it is scheduled again (and queued by its
// retry); the journal lists it until then.
func TestSettledManifestPrecedesTheNextQueueing(t *testing.T) {
	const capacity = 4
	e := newEnv(t, capacity+1, false, uploads.Config{RetryBase: 20 * time.Millisecond})
	e.writeManifest(t, "ns", "conv-1", true)
	m := manifestObject("ns", "conv-1")
	e.l.EnqueueManifest("ns", "conv-1", nil)
	fillQueue(t, e, "ns", capacity)
	e.q.finish(t, e.l, m, nil) // uploaded: settled
	x := testKeys(2000)[1999]
	e.writePages(t, "ns", x)
	e.l.EnqueuePages("ns", []layout.PageKey{x}) // the queue full again
	e.l.EnqueueManifest("ns", "conv-1", nil)
	if s, _ := e.listing(t, "ns"); !s.Manifests["conv-1"] {
		t.Fatal("the journal does not list the manifest queued again: the first upload's settled record came after its queued record")
	}
	e.q.drain(e.l, 1<<10, nil)
	waitFor(t, "the manifest's retry", func() bool { return e.q.submits(m) == 2 })
}

// TestGoneSettleDoesNotFollowASave: a replay (or a refill) reads the
// entry of a page whose local file is gone (evicted), and would settle
// it; between its lstat and the settle, a save writes the page again and
// queues it, and the full queue refuses it (spilled: its queued record
// the only trace). The settle must not land after that queued record:
// it lstats the file again in its critical section, and finds it.
func TestGoneSettleDoesNotFollowASave(t *testing.T) {
	const capacity = 4
	e := newEnv(t, capacity, false, uploads.Config{})
	fillQueue(t, e, "other", capacity)
	k := testKeys(1)[0]
	path := e.ns(t, "ns").PagePath(k)
	e.writeJournal(t, "ns", pageRecords(k))
	saves := 0
	hook := func(name string) {
		if name != path || saves > 0 {
			return
		}
		saves++
		e.writePages(t, "ns", k)
		e.l.EnqueuePages("ns", []layout.PageKey{k})
	}
	e.fs.onLstat.Store(&hook)
	e.l.Resume()
	e.fs.onLstat.Store(nil)
	if saves != 1 || e.l.Pending("ns", k) {
		t.Fatalf("%d saves in the gap, page queued %v: want one save, spilled", saves, e.l.Pending("ns", k))
	}
	if s, _ := e.listing(t, "ns"); !s.Pages[k] {
		t.Fatal("the journal does not list the page the save spilled: the gone page's settled record came after it")
	}
	// Without a save in the gap, a gone page's entry is still settled.
	k2 := testKeys(2)[1]
	e.writeJournal(t, "ns2", pageRecords(k2))
	e.l.Resume()
	if s, _ := e.listing(t, "ns2"); s.Pages[k2] {
		t.Fatal("the entry of a page whose file is gone is not settled")
	}
}

// TestManifestNotSettledBeforeItsRetry: an upload of manifest M (its
// queued record in the journal) fails transiently while a re-queue of M
// (a refill's) is reading M's local file, which is not a page manifest
// now: the re-queue would settle M unless an upload of M is registered
// or waits for its retry. The failed upload's retry is registered in the
// critical section that ends the upload, so the re-queue sees it and
// leaves M listed; the retry later queues M again.
func TestManifestNotSettledBeforeItsRetry(t *testing.T) {
	e := newEnv(t, 4, false, uploads.Config{RetryBase: 500 * time.Millisecond})
	const name = "conv-1"
	e.writeManifest(t, "ns", name, true)
	m := manifestObject("ns", name)
	e.l.EnqueueManifest("ns", name, nil) // queued, in flight
	e.writeManifest(t, "ns", name, false)
	ended := 0
	e.q.setOnManifestPages(func(string, string) {
		if ended == 0 {
			ended++
			e.q.finish(t, e.l, m, errors.New("503 Slow Down"))
		}
	})
	e.refill(t, "ns") // reads M's queued record: a re-queue of M
	e.q.setOnManifestPages(nil)
	e.writeManifest(t, "ns", name, true) // for the retry
	if ended != 1 {
		t.Fatalf("%d uploads ended during the re-queue, want 1", ended)
	}
	if s, _ := e.listing(t, "ns"); !s.Manifests[name] {
		t.Fatal("the journal does not list M: the re-queue settled it while its retry was due")
	}
	waitFor(t, "the manifest's retry", func() bool { return e.q.submits(m) == 2 })
}

// TestRefusedManifestNotSettledBeforeItsRetry: as
// TestManifestNotSettledBeforeItsRetry when the upload queue refuses the
// manifest (full): its retry is registered in the critical section that
// removes its registration, so a re-queue finding its local file not a
// page manifest leaves it listed.
func TestRefusedManifestNotSettledBeforeItsRetry(t *testing.T) {
	const capacity = 4
	e := newEnv(t, capacity, false, uploads.Config{RetryBase: time.Hour})
	fillQueue(t, e, "other", capacity)
	const name = "conv-1"
	e.writeManifest(t, "ns", name, true)
	e.l.EnqueueManifest("ns", name, nil) // refused: scheduled again
	e.writeManifest(t, "ns", name, false)
	e.refill(t, "ns") // a re-queue: finds the retry waiting
	e.l.Resume()      // a replay's re-queue: the same
	if s, _ := e.listing(t, "ns"); !s.Manifests[name] {
		t.Fatal("the journal does not list the refused manifest whose retry waits")
	}
}

// TestConcurrentRequeueDoesNotSettleAQueueing: a re-queue (a replay's,
// a refill's or a retry's) of manifest M from its journal entry reads
// its local file, a page manifest; before it registers M's upload, M is
// deleted and a second re-queue finds it gone, then M is written again.
// The second must not settle M: the first one's upload, which the
// journal lists only by M's earlier queued record, is about to be
// registered; re-queues running are counted, and a name counted is not
// settled.
func TestConcurrentRequeueDoesNotSettleAQueueing(t *testing.T) {
	e := newEnv(t, 4, false, uploads.Config{})
	const name = "turn-1"
	e.writeManifest(t, "ns", name, true)
	e.writeJournal(t, "ns", record(uploads.OpManifestQueued, []byte(name)))
	path := manifestPath(e.ns(t, "ns"), name)
	manifest, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	second := 0
	e.q.setOnManifestPages(func(string, string) {
		if second > 0 {
			return
		}
		second++
		if err := os.Remove(path); err != nil {
			t.Error(err)
		}
		e.l.Resume() // the second re-queue
		if err := os.WriteFile(path, manifest, 0o644); err != nil {
			t.Error(err)
		}
	})
	e.l.Resume()
	if second != 1 {
		t.Fatalf("%d second re-queues ran in the gap, want 1", second)
	}
	if e.q.submits(manifestObject("ns", name)) != 1 {
		t.Fatal("the first re-queue did not queue the manifest")
	}
	if s, _ := e.listing(t, "ns"); !s.Manifests[name] {
		t.Fatal("the journal does not list the manifest whose upload the first re-queue registered: the second settled it")
	}
}

// TestSaveOfAReplayedUploadIsListed: a replay registers page k's upload
// from its journal entry (no record of its own); then another process on
// the root settles k (a settled record after that entry: the journal no
// longer lists k), and a save of k here finds the upload registered. The
// save's queueing appends its own queued record, so the journal lists k
// for as long as that upload runs: a crash then does not lose it.
func TestSaveOfAReplayedUploadIsListed(t *testing.T) {
	e := newEnv(t, 4, false, uploads.Config{})
	k := testKeys(1)[0]
	e.writePages(t, "ns", k)
	e.writeJournal(t, "ns", pageRecords(k))
	e.l.Resume()
	if !e.l.Pending("ns", k) {
		t.Fatal("the replay did not queue the page")
	}
	e.appendJournal(t, "ns", record(uploads.OpPageSettled, k[:])) // another process's
	e.l.EnqueuePages("ns", []layout.PageKey{k})
	if e.q.submits(pageObject("ns", k)) != 1 {
		t.Fatal("the save queued a second upload of a registered page")
	}
	if s, _ := e.listing(t, "ns"); !s.Pages[k] {
		t.Fatal("the journal does not list the page whose upload the save found registered")
	}
}

// TestJournalMatchesStateUnderRaces: goroutines save pages, end their
// uploads (uploaded, or failed with the local file changed) and forget
// known pages at once, through a queue of 2 that spills most saves, while
// the Ledger refills the queue from the journal. Once they stop, every
// page the journal lists is marked pending (registered or spilled); and
// once the queue is drained to the end (its refills included), no page is
// left marked pending and the journal lists none: no spilled page lost its
// queued record to a settle, whatever the interleaving.
func TestJournalMatchesStateUnderRaces(t *testing.T) {
	e := newEnv(t, 2, false, uploads.Config{})
	keys := testKeys(8)
	e.writePages(t, "ns", keys...)
	var wg sync.WaitGroup
	for w := range 4 {
		wg.Go(func() {
			rng := rand.New(rand.NewPCG(uint64(w), 1))
			for range 300 {
				k := keys[rng.IntN(len(keys))]
				switch rng.IntN(4) {
				case 0, 1:
					e.l.EnqueuePages("ns", []layout.PageKey{k})
				case 2:
					e.q.drain(e.l, 1, []error{nil, errGone}[rng.IntN(2)])
				case 3:
					e.l.Forget("ns", k)
				}
			}
		})
	}
	wg.Wait()
	s, _ := e.listing(t, "ns")
	for i, k := range keys {
		if s.Pages[k] && !e.q.marked("ns", k) {
			t.Errorf("page %d: listed, not marked pending", i)
		}
	}
	for idle := 0; idle < 3; { // the Ledger's own refills may still be due
		e.refill(t, "ns")
		if e.q.drain(e.l, 2, errGone) > 0 {
			idle = 0
		} else {
			idle++
		}
	}
	s, _ = e.listing(t, "ns")
	for i, k := range keys {
		if s.Pages[k] || e.q.marked("ns", k) {
			t.Errorf("page %d after the queue drained: listed %v, marked pending %v", i, s.Pages[k], e.q.marked("ns", k))
		}
	}
}
