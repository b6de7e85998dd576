package uploads_test

import (
	"cmp"
	"errors"
	"fmt"
	"os"
	"slices"
	"strings"
	"testing"

	"github.com/kvpersist/kvpersist/engine/layout"
	"github.com/kvpersist/kvpersist/engine/remote"
	"github.com/kvpersist/kvpersist/engine/uploads"
)

// The refill of a full upload queue from the journal: spills, cursors
// (their bound, a replaced file, a record being appended, a torn record),
// and a page being queued by another goroutine.

// errGone ends an upload whose local file changed: settled, not stored.
var errGone = errors.New("the local file changed since it was queued")

// TestSpilledPagesQueuedByRefills: a save of 6 pages into a queue of 1
// queues one and spills five (their queued records in the journal, they
// stay marked pending); as the queue drains, the Ledger refills it from
// the journal by itself until every page was queued exactly once, and the
// journal then lists none.
func TestSpilledPagesQueuedByRefills(t *testing.T) {
	e := newEnv(t, 1, false, uploads.Config{})
	keys := testKeys(6)
	e.writePages(t, "ns", keys...)
	if got := e.l.EnqueuePages("ns", keys); len(got) != 1 {
		t.Fatalf("%d pages queued by a queue of 1", len(got))
	}
	for i, k := range keys {
		if !e.q.marked("ns", k) {
			t.Fatalf("page %d (queued or spilled) is not marked pending", i)
		}
	}
	if s, _ := e.listing(t, "ns"); len(s.Pages) != len(keys) {
		t.Fatalf("the journal lists %d pages, want %d", len(s.Pages), len(keys))
	}
	for ended := 0; ended < len(keys); {
		waitFor(t, "a page queued", func() bool { free, _ := e.q.Room(); return free == 0 })
		ended += e.q.drain(e.l, 1, nil) // uploaded: the Ledger refills
	}
	for i, k := range keys {
		if n := e.q.submits(pageObject("ns", k)); n != 1 || e.q.marked("ns", k) || !e.l.Known("ns", k) {
			t.Errorf("page %d queued %d times (marked %v, known %v); want once, unmarked, known", i, n, e.q.marked("ns", k), e.l.Known("ns", k))
		}
	}
	if s, _ := e.listing(t, "ns"); len(s.Pages) != 0 {
		t.Fatalf("the journal still lists %d pages", len(s.Pages))
	}
}

// TestRefillFindsSpilledRecordsStillInTheBatch: pages spilled while
// their namespace's lock is held elsewhere (their queued records
// deferred: still in the in-memory batch, not in the file a refill
// reads) are not lost by a refill due meanwhile: the refill writes the
// batches first, and a namespace whose batch could not be written stays
// marked and is refilled once it can; every spilled page is queued.
func TestRefillFindsSpilledRecordsStillInTheBatch(t *testing.T) {
	e := newEnv(t, 1, false, uploads.Config{})
	keys := testKeys(6)
	e.writePages(t, "ns", keys...)
	unlock, err := e.ns(t, "ns").Lock(bg, true)
	if err != nil {
		t.Fatal(err)
	}
	e.l.EnqueuePages("ns", keys) // one queued, five spilled, records deferred
	if n, _ := os.ReadFile(e.ns(t, "ns").UploadsPath()); len(n) != 0 {
		t.Fatalf("%d bytes written under another process's exclusive lock", len(n))
	}
	e.q.drain(e.l, 1, nil) // drained: a refill is due, the batch not written
	if again := e.refill(t, "ns"); !again {
		t.Fatal("a refill whose namespace's batch could not be written does not ask for another")
	}
	unlock()
	for ended := 1; ended < len(keys); {
		waitFor(t, "a page queued", func() bool { free, _ := e.q.Room(); return free == 0 })
		ended += e.q.drain(e.l, 1, nil)
	}
	for i, k := range keys {
		if n := e.q.submits(pageObject("ns", k)); n != 1 {
			t.Errorf("page %d queued %d times, want once", i, n)
		}
	}
}

// TestRefillReadsWhatItQueues: a backlog of 1,000 pages spilled to the
// journal by an upload queue of 8 is drained 4 uploads at a time, each
// time followed by the Ledger's refill of the queue. Every page is queued exactly
// once, and the refills read (bytes, counted through the file-system
// seam) a small multiple of the bytes the journal received: each refill
// reads from where the last one stopped, about what it queues (its first
// compacts the journal, read whole once), not the whole journal (O(N²/Q)
// bytes: 186 times the records here).
func TestRefillReadsWhatItQueues(t *testing.T) {
	const pages, queueLen, drain = 1000, 8, 4
	e := newEnv(t, queueLen, false, uploads.Config{})
	keys := testKeys(pages)
	e.writePages(t, "ns", keys...)
	e.l.EnqueuePages("ns", keys)
	if free, _ := e.q.Room(); free != 0 {
		t.Fatalf("%d free in the queue: want it full and a backlog", free)
	}
	if s, _ := e.listing(t, "ns"); len(s.Pages) != pages {
		t.Fatalf("the journal lists %d pages, want %d", len(s.Pages), pages)
	}
	before := e.fs.read.Load()
	drains := 0
	for e.q.drain(e.l, drain, errGone) > 0 {
		drains++
		// Drained to half: the Ledger refills the queue by itself.
		waitFor(t, "the queue refilled", func() bool {
			free, _ := e.q.Room()
			return free == 0 || e.q.distinct() == pages
		})
	}
	read := e.fs.read.Load() - before
	s, size := e.listing(t, "ns")
	// Every record the journal received: a queued and a settled one per
	// page (a compaction rewrote them as a smaller snapshot meanwhile).
	appended := int64(pages * 2 * (uploads.RecordOverhead + 32))
	t.Logf("%d pages drained through a queue of %d, %d at a time: the refills read %d bytes (%.0f per page), %.1f times the %d bytes of records the journal received (now %d bytes)", pages, queueLen, drain, read, float64(read)/pages, float64(read)/float64(appended), appended, size)
	if len(s.Pages) != 0 {
		t.Errorf("the journal lists %d pages; want none", len(s.Pages))
	}
	for i, k := range keys {
		if n := e.q.submits(pageObject("ns", k)); n != 1 {
			t.Fatalf("page %d queued %d times, want once", i, n)
		}
	}
	// At most 4 times: each refill's stop appends the spilled page's
	// queued record anew (one per refill, a quarter of the pages with a
	// queue of 8), which a later refill reads.
	if read == 0 {
		t.Fatal("the refills read nothing through the FS: the count cannot check them")
	}
	if read > 4*appended {
		t.Errorf("the refills read %d bytes, the journal received %d: want at most 4 times that", read, appended)
	}
}

// TestRefillWaitsForARecordBeingAppended: a refill that finds the
// journal ending in the first bytes of a record (another process's
// write(2) in progress: it holds the namespace's shared lock, so the
// refill's compaction is not granted) stops before them, and the next
// refill reads the record once it is whole. A refill that skipped them
// as undecodable (as a replay of the whole file does) would never read
// that record again: its cursor would be past it.
func TestRefillWaitsForARecordBeingAppended(t *testing.T) {
	e := newEnv(t, 16, false, uploads.Config{})
	keys := testKeys(4)
	e.writePages(t, "ns", keys...)
	b := pageRecords(keys...)
	cut := len(b) - 20 // the last record's first 26 bytes
	unlock, err := e.ns(t, "ns").Lock(bg, false)
	if err != nil {
		t.Fatal(err)
	}
	e.writeJournal(t, "ns", b[:cut])
	e.refill(t, "ns")
	for i, k := range keys {
		if got := e.l.Pending("ns", k); got != (i < 3) {
			t.Fatalf("after the first refill page %d queued %v, want %v", i, got, i < 3)
		}
	}
	e.appendJournal(t, "ns", b[cut:])
	unlock()
	e.refill(t, "ns")
	if !e.l.Pending("ns", keys[3]) {
		t.Fatal("the record completed after the first refill was never queued")
	}
}

// TestRefillStopsAtAPageBeingQueued: a refill reaching the entry of a
// page that another goroutine has registered but that the queue has not
// accepted yet (here a replay, whose Submit the test holds: the full
// queue may yet refuse it, spilling it behind the refill's cursor) stops
// there and asks for another refill; that one, once the page is settled
// either way (refused here), queues it and what follows it.
func TestRefillStopsAtAPageBeingQueued(t *testing.T) {
	e := newEnv(t, 16, false, uploads.Config{})
	keys := sortedKeys(testKeys(3)...) // the file's order, also once compacted
	e.writePages(t, "ns", keys...)
	e.writeJournal(t, "ns", pageRecords(keys...))
	entered, release := make(chan struct{}), make(chan struct{})
	held := pageObject("ns", keys[1])
	e.q.setOnSubmit(func(p *uploads.Pending) error {
		if p.Object == held {
			close(entered)
			<-release
			return fmt.Errorf("%w: held by the test", remote.ErrQueueFull)
		}
		return nil
	})
	done := make(chan struct{})
	go func() { defer close(done); e.l.Resume() }()
	<-entered
	again := e.refill(t, "ns")
	if !again || !e.l.Pending("ns", keys[0]) || e.q.submits(pageObject("ns", keys[2])) != 0 {
		t.Fatalf("again %v, page 0 queued %v, page 2 queued %d times: want the refill stopped at page 1, asking for another",
			again, e.l.Pending("ns", keys[0]), e.q.submits(pageObject("ns", keys[2])))
	}
	e.q.setOnSubmit(nil)
	close(release)
	<-done
	e.refill(t, "ns")
	for i, k := range keys {
		if !e.l.Pending("ns", k) {
			t.Errorf("page %d not queued by the next refill", i)
		}
	}
}

// TestRefillReadsAReplacedJournalFromItsStart: after another process's
// compaction renamed a new journal over the path, a refill reads the new
// file from its start (its snapshot), whatever its cursor's offset in
// the old one; the old file's descriptor is closed.
func TestRefillReadsAReplacedJournalFromItsStart(t *testing.T) {
	e := newEnv(t, 16, false, uploads.Config{})
	keys := testKeys(6)
	e.writePages(t, "ns", keys...)
	old := pageRecords(keys[:3]...)
	e.writeJournal(t, "ns", old)
	e.refill(t, "ns") // compacts (a snapshot of 3 keys: 128 bytes), queues them
	if e.fs.openReads.Load() != 1 {
		t.Fatalf("%d journal descriptors open after a refill, want its cursor's", e.fs.openReads.Load())
	}
	// Another process compacts: a snapshot of keys 3..5 (theirs), renamed
	// over the path, no longer than the cursor's offset in the old (its
	// end): read from that offset, it would yield nothing.
	snap := uploads.EncodeSnapshot(slices.Clone(keys[3:]), nil)
	if want := len(uploads.EncodeSnapshot(slices.Clone(keys[:3]), nil)); len(snap) > want {
		t.Fatalf("snapshot of %d bytes, the old file %d: the test wants a new file no longer", len(snap), want)
	}
	n := e.ns(t, "ns")
	tmp := n.UploadsPath() + ".new"
	if err := os.WriteFile(tmp, snap, 0o640); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(tmp, n.UploadsPath()); err != nil {
		t.Fatal(err)
	}
	e.refill(t, "ns")
	for i, k := range keys {
		if !e.l.Pending("ns", k) {
			t.Errorf("page %d not queued", i)
		}
	}
	if open := e.fs.openReads.Load(); open != 1 {
		t.Errorf("%d journal descriptors open: the old journal's was left open", open)
	}
}

// TestRefillPassesATornRecordFollowedByWholeOnes: a journal holding the
// first bytes of a record whose write(2) ended torn (its process killed
// mid-write, or a short write on a full disk), then whole records
// appended after it (appends are serialized: the torn write has ended).
// The refill skips the torn bytes, as a replay does, and queues the
// pages of the records after them; its cursor ends at the file's end (a
// next refill reads nothing). Two tears: a manifest record cut after 10
// bytes (its length byte read), a page record cut after 5 (the next
// record's magic read as its length byte).
func TestRefillPassesATornRecordFollowedByWholeOnes(t *testing.T) {
	for _, tc := range []struct {
		name string
		torn []byte
	}{
		{"manifest record cut after 10 bytes", record(uploads.OpManifestQueued, []byte(strings.Repeat("m", 60)))[:10]},
		{"page record cut after 5 bytes", record(uploads.OpPageQueued, testKeys(3)[2][:])[:5]},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := newEnv(t, 16, false, uploads.Config{})
			keys := testKeys(2)
			e.writePages(t, "ns", keys...)
			e.writeJournal(t, "ns", pageRecords(keys[0]))
			e.refill(t, "ns") // compacts, opens the cursor, queues key 0
			if !e.l.Pending("ns", keys[0]) {
				t.Fatal("key 0 not queued by the first refill")
			}
			e.appendJournal(t, "ns", slices.Concat(tc.torn, record(uploads.OpPageQueued, keys[1][:])))
			all, err := os.ReadFile(e.ns(t, "ns").UploadsPath())
			if err != nil {
				t.Fatal(err)
			}
			if s, _, _, _ := uploads.Decode(all); !s.Pages[keys[1]] {
				t.Fatal("the replay does not list key 1")
			}
			e.refill(t, "ns")
			if !e.l.Pending("ns", keys[1]) {
				t.Fatal("key 1 not queued")
			}
			before := e.fs.read.Load()
			e.refill(t, "ns")
			if read := e.fs.read.Load() - before; read != 0 {
				t.Errorf("a refill after the last read %d bytes: its cursor was not at the file's end", read)
			}
		})
	}
}

// TestRefillCursorsBounded: the refill keeps at most 64 cursors
// (Config.CursorMax in tests), one open descriptor each. The refill of
// one namespace more closes the cursor used least recently (a namespace
// refilled again since is kept), and a later refill of the namespace it
// belonged to opens a new one and queues what its journal lists since.
func TestRefillCursorsBounded(t *testing.T) {
	for _, cmax := range []int{0, 3} {
		t.Run(fmt.Sprintf("CursorMax=%d", cmax), func(t *testing.T) {
			bound := cmp.Or(cmax, 64)
			e := newEnv(t, 4*bound, false, uploads.Config{CursorMax: cmax})
			keys := testKeys(2 * (bound + 1))
			spill := func(i int, k layout.PageKey) {
				t.Helper()
				ns := fmt.Sprintf("ns%d", i)
				e.writePages(t, ns, k)
				e.appendJournal(t, ns, pageRecords(k))
				e.refill(t, ns)
				if !e.l.Pending(ns, k) {
					t.Fatalf("page of %s not queued by its refill", ns)
				}
			}
			for i := range bound {
				spill(i, keys[i])
			}
			if open := e.fs.openReads.Load(); open != int64(bound) {
				t.Fatalf("%d cursors open, want %d", open, bound)
			}
			// ns0 refilled again: ns1 is now the least recently used.
			e.refill(t, "ns0")
			spill(bound, keys[bound])
			if open := e.fs.openReads.Load(); open != int64(bound) {
				t.Fatalf("%d cursors open after one namespace more, want %d", open, bound)
			}
			// ns0's cursor kept: its refill reads nothing (no compaction,
			// which a new cursor's first refill would make).
			before, renames := e.fs.read.Load(), e.fs.renames.Load()
			e.refill(t, "ns0")
			if e.fs.read.Load() != before || e.fs.renames.Load() != renames {
				t.Fatal("ns0's cursor, used more recently than ns1's, was dropped")
			}
			// ns1's dropped: its refill compacts and opens a new one,
			// queueing its new page.
			spill(1, keys[bound+1])
			if e.fs.renames.Load() == renames {
				t.Fatal("ns1's cursor was kept")
			}
			if open := e.fs.openReads.Load(); open != int64(bound) {
				t.Fatalf("%d cursors open, want %d", open, bound)
			}
			if !e.l.Pending("ns1", keys[1]) {
				t.Error("ns1's first page no longer queued")
			}
		})
	}
}
