package engine

import (
	"bytes"
	"cmp"
	"context"
	"fmt"
	"io/fs"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/kvpersist/kvpersist/engine/layout"
	"github.com/kvpersist/kvpersist/engine/store"
	"github.com/kvpersist/kvpersist/engine/vfs"
)

// journalReadFS counts the bytes read from uploads journals (every
// ReadAt of a file opened at a path named layout.UploadsName), and once
// failPages is set makes every open under pagesDir wait for a token on
// release and then fail: an upload ends at its Open, its entry settled,
// so the test drains the upload queue one upload per token without a
// store answering.
type journalReadFS struct {
	vfs.FS
	pagesDir  string
	read      atomic.Int64
	failPages atomic.Bool
	release   chan struct{}
}

type countingFile struct {
	vfs.File
	n *atomic.Int64
}

func (f countingFile) ReadAt(p []byte, off int64) (int, error) {
	n, err := f.File.ReadAt(p, off)
	f.n.Add(int64(n))
	return n, err
}

func (f *journalReadFS) Open(name string) (vfs.File, error) {
	if f.failPages.Load() && strings.HasPrefix(name, f.pagesDir+string(os.PathSeparator)) {
		<-f.release
		return nil, &fs.PathError{Op: "open", Path: name, Err: syscall.EIO}
	}
	file, err := f.FS.Open(name)
	if err != nil || !strings.HasSuffix(name, string(os.PathSeparator)+layout.UploadsName) {
		return file, err
	}
	return countingFile{File: file, n: &f.read}, nil
}

// journalListing replays the journal of ns as it is on disk.
func journalListing(t *testing.T, e *Engine, ns string) (s *journalSet, size int) {
	t.Helper()
	n, err := e.store.Namespace(ns)
	if err != nil {
		t.Fatal(err)
	}
	b, err := os.ReadFile(n.UploadsPath())
	if err != nil {
		t.Fatal(err)
	}
	s, _, _, _ = decodeJournalFile(b)
	return s, len(b)
}

// TestRefillReadsWhatItQueues: a backlog of 1,000 pages spilled to the
// journal by an upload queue of 8 is drained 4 uploads at a time, each
// time followed by a refill of the queue (the journal's goroutine is
// stopped; the test runs its refills). Every page is queued exactly
// once, and the refills read (bytes, counted through the file-system
// seam) a small multiple of the bytes the journal received: each refill
// reads from where the last one stopped, about what it queues (its
// first compacts the journal, read whole once). Before: each refill read
// and decoded the whole journal, O(N²/Q) bytes (17 MB here, 186 times
// the 92 KB of records), and tried to queue every page it lists.
func TestRefillReadsWhatItQueues(t *testing.T) {
	const pages, queueLen, drain = 1000, 8, 4
	root := t.TempDir()
	fsys := &journalReadFS{FS: vfs.Default, pagesDir: filepath.Join(root, "ns", layout.PagesDirName), release: make(chan struct{})}
	// A store that refuses every connection, retried every millisecond:
	// the worker holds its first upload, the queue fills, the rest spill.
	e, j := stoppedJournalEngine(t, Config{Root: root, FS: fsys, Remote: &RemoteTier{
		Store:         RemoteConfig{Endpoint: "http://127.0.0.1:1", Bucket: "b", AccessKey: "k", SecretKey: "s", MaxRetries: 1},
		UploadWorkers: 1, UploadQueue: queueLen, UploadBackoffMin: time.Millisecond, UploadBackoffMax: time.Millisecond,
	}})
	keys := testKeys(pages)
	writePageFiles(t, e, "ns", keys)
	e.tier.saved("ns", keys)
	j.mu.Lock()
	spilled := j.spilled["ns"]
	j.mu.Unlock()
	if !spilled || e.tier.up.Stats().Queued != queueLen {
		t.Fatalf("spilled %v, %d queued: want a full queue of %d and a backlog", spilled, e.tier.up.Stats().Queued, queueLen)
	}
	flushJournal(t, j)
	if s, _ := journalListing(t, e, "ns"); len(s.pages) != pages {
		t.Fatalf("the journal lists %d pages, want %d", len(s.pages), pages)
	}

	before := fsys.read.Load()
	fsys.failPages.Store(true)
	guard := time.Now().Add(2 * time.Minute)
	released, refills := 0, 0
	for {
		st := e.tier.up.Stats()
		for range min(drain, st.Queued+st.InFlight) {
			select {
			case fsys.release <- struct{}{}:
				released++
			case <-time.After(time.Until(guard)):
				t.Fatalf("no upload took its token; %d released", released)
			}
		}
		for e.tier.up.Stats().Failed < int64(released) {
			if time.Now().After(guard) {
				t.Fatalf("%d uploads ended, %d released", e.tier.up.Stats().Failed, released)
			}
			time.Sleep(100 * time.Microsecond)
		}
		// The queue has drained to half: a refill is due while uploads
		// are spilled (drained marks it; the test runs it here).
		j.mu.Lock()
		marked := len(j.spilled) > 0
		j.refill = marked
		j.mu.Unlock()
		if !marked {
			break
		}
		j.refillQueue()
		refills++
	}
	// The uploads still queued end; their settled records are written.
	for st := e.tier.up.Stats(); st.Queued+st.InFlight > 0; st = e.tier.up.Stats() {
		if time.Now().After(guard) {
			t.Fatalf("%d queued, %d in flight", st.Queued, st.InFlight)
		}
		select { // the one in flight may have taken the last token already
		case fsys.release <- struct{}{}:
		case <-time.After(time.Millisecond):
		}
	}
	read := fsys.read.Load() - before
	flushJournal(t, j)
	s, size := journalListing(t, e, "ns")
	st := e.tier.up.Stats()
	// Every record the journal received: a queued and a settled one per
	// page (a compaction rewrote them as a smaller snapshot meanwhile).
	appended := int64(pages * 2 * (recordOverhead + 32))
	t.Logf("%d pages drained through a queue of %d in %d refills: they read %d bytes (%.0f per page), %.1f times the %d bytes of records the journal received (now %d bytes); %d uploads ended", pages, queueLen, refills, read, float64(read)/pages, float64(read)/float64(appended), appended, size, st.Failed)
	if len(s.pages) != 0 || st.Failed != pages {
		t.Errorf("the journal lists %d pages and %d uploads ended; want none listed and %d ended (each page queued once)", len(s.pages), st.Failed, pages)
	}
	if read > 3*appended {
		t.Errorf("the refills read %d bytes, the journal received %d: want at most 3 times that", read, appended)
	}
}

// flushJournal writes the journal's batches (its goroutine stopped).
func flushJournal(t *testing.T, j *journal) {
	t.Helper()
	ctx, cancel := context.WithTimeout(bg, 10*time.Second)
	defer cancel()
	if left := j.flush(ctx); len(left) > 0 {
		t.Fatalf("batches of %v not written", left)
	}
}

// pageQueued reports whether page k of ns is queued or in flight here.
func pageQueued(t *testing.T, e *Engine, ns string, k layout.PageKey) bool {
	t.Helper()
	return e.tier.isPending(ns, k)
}

// refillNow marks ns spilled and runs a refill of the queue, as the
// journal's goroutine does once the queue has drained to half.
func refillNow(j *journal, ns string) (again bool) {
	j.mu.Lock()
	j.spilled[ns], j.refill = true, true
	j.mu.Unlock()
	return j.refillQueue()
}

// refillSetup opens an engine whose remote tier cannot drain its queue
// of 16 (unreachableTierEngine), with local files for keys in namespace
// ns and a journal of their queued records, in order.
func refillSetup(t *testing.T, keys []layout.PageKey) (*Engine, *journal, *store.Namespace, []byte) {
	t.Helper()
	e, j := unreachableTierEngine(t, t.TempDir(), 16)
	writePageFiles(t, e, "ns", keys)
	n, err := e.store.Namespace("ns")
	if err != nil {
		t.Fatal(err)
	}
	var b []byte
	for _, k := range keys {
		b = append(b, record(opPageQueued, k[:])...)
	}
	return e, j, n, b
}

// TestRefillWaitsForARecordBeingAppended: a refill that finds the
// journal ending in the first bytes of a record (another process's
// write(2) in progress: it holds the namespace's shared lock, so the
// refill's compaction is not granted) stops before them, and the next
// refill reads the record once it is whole. A refill that skipped them
// as undecodable (as a replay of the whole file does) would never read
// that record again: its cursor would be past it.
func TestRefillWaitsForARecordBeingAppended(t *testing.T) {
	keys := testKeys(4)
	e, j, n, b := refillSetup(t, keys)
	cut := len(b) - 20 // the last record's first 26 bytes
	unlock, err := n.Lock(bg, false)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(n.UploadsPath(), b[:cut], 0o640); err != nil {
		t.Fatal(err)
	}
	refillNow(j, "ns")
	for i, k := range keys {
		if got := pageQueued(t, e, "ns", k); got != (i < 3) {
			t.Fatalf("after the first refill page %d queued %v, want %v", i, got, i < 3)
		}
	}
	f, err := os.OpenFile(n.UploadsPath(), os.O_WRONLY|os.O_APPEND, 0)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := f.Write(b[cut:]); err != nil {
		t.Fatal(err)
	}
	f.Close()
	unlock()
	refillNow(j, "ns")
	if !pageQueued(t, e, "ns", keys[3]) {
		t.Fatal("the record completed after the first refill was never queued")
	}
}

// TestRefillStopsAtAPageBeingQueued: a refill reaching the entry of a
// page that another goroutine has registered but that the uploader has
// not accepted yet (a save's enqueueFile between the two: the full
// queue may yet refuse it, spilling it with its queued record behind
// the refill's cursor) stops there, keeps the namespace marked and asks
// for another refill; that one, once the page is settled either way,
// queues it and what follows it.
func TestRefillStopsAtAPageBeingQueued(t *testing.T) {
	keys := sortedKeys(testKeys(3)...) // the file's order, also once compacted
	e, j, n, b := refillSetup(t, keys)
	if err := os.WriteFile(n.UploadsPath(), b, 0o640); err != nil {
		t.Fatal(err)
	}
	name, err := e.tier.st.PageName("ns", keys[1].String())
	if err != nil {
		t.Fatal(err)
	}
	e.tier.mu.Lock()
	e.tier.pending[name] = &pendingUpload{ns: "ns", key: keys[1], done: make(chan struct{})}
	e.tier.mu.Unlock()
	again := refillNow(j, "ns")
	j.mu.Lock()
	marked := j.spilled["ns"] && j.refill
	j.mu.Unlock()
	if !again || !marked || !pageQueued(t, e, "ns", keys[0]) || pageQueued(t, e, "ns", keys[2]) {
		t.Fatalf("again %v, marked %v, page 0 queued %v, page 2 queued %v: want the refill stopped at page 1, marked for the next", again, marked, pageQueued(t, e, "ns", keys[0]), pageQueued(t, e, "ns", keys[2]))
	}
	// The queue refused it (spilled): it is no longer registered.
	e.tier.mu.Lock()
	delete(e.tier.pending, name)
	e.tier.mu.Unlock()
	refillNow(j, "ns")
	for i, k := range keys {
		if !pageQueued(t, e, "ns", k) {
			t.Errorf("page %d not queued by the next refill", i)
		}
	}
}

// TestRefillReadsAReplacedJournalFromItsStart: after another process's
// compaction renamed a new journal over the path, a refill reads the new
// file from its start (its snapshot), whatever its cursor's offset in
// the old one; the old file's descriptor is closed.
func TestRefillReadsAReplacedJournalFromItsStart(t *testing.T) {
	keys := testKeys(6)
	e, j, n, b := refillSetup(t, keys)
	b = b[:3*(recordOverhead+32)] // the journal lists keys 0..2
	if err := os.WriteFile(n.UploadsPath(), b, 0o640); err != nil {
		t.Fatal(err)
	}
	refillNow(j, "ns")
	old := j.cursors["ns"]
	if old == nil || old.f == nil {
		t.Fatal("no cursor after a refill")
	}
	// Another process compacts: a snapshot of keys 3..5 (theirs), renamed
	// over the path. It is no longer than the cursor's offset in the old:
	// read from that offset, it would yield nothing.
	snap := encodeJournal(slices.Clone(keys[3:]), nil)
	if int64(len(snap)) > old.off {
		t.Fatalf("snapshot of %d bytes, cursor at %d: the test wants a new file no longer than the offset", len(snap), old.off)
	}
	tmp := n.UploadsPath() + ".new"
	if err := os.WriteFile(tmp, snap, 0o640); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(tmp, n.UploadsPath()); err != nil {
		t.Fatal(err)
	}
	refillNow(j, "ns")
	for i, k := range keys {
		if !pageQueued(t, e, "ns", k) {
			t.Errorf("page %d not queued", i)
		}
	}
	if err := old.f.Close(); err == nil {
		t.Error("the old journal's descriptor was left open")
	}
}

// memFile is a vfs.File reading from memory (ReadAt only).
type memFile struct {
	vfs.File
	r *bytes.Reader
}

func (f memFile) ReadAt(p []byte, off int64) (int, error) { return f.r.ReadAt(p, off) }

// walkAll walks b as a refill's cursor does, in windows of window bytes,
// never stopping; it returns the entries read and where the cursor
// ended.
func walkAll(t *testing.T, b []byte, window int64) ([]refillEntry, int64) {
	t.Helper()
	c := &refillCursor{f: memFile{r: bytes.NewReader(b)}}
	if err := c.readSnapshot(int64(len(b))); err != nil {
		t.Fatal(err)
	}
	var got []refillEntry
	if _, _, err := c.walk(int64(len(b)), window, func(es []refillEntry) (int64, bool) {
		got = append(got, es...)
		return 0, false
	}); err != nil {
		t.Fatal(err)
	}
	return got, c.off
}

// FuzzRefillWalk: a refill's reading of a journal (a snapshot's entries,
// then records, in windows; a tail that may be a record being appended
// left for later) reads the same entries whatever its windows, and
// replaying them (queued adds, settled removes) lists exactly what a
// replay of the whole file up to where the cursor stopped lists
// (decodeJournalFile, the replay New runs).
func FuzzRefillWalk(f *testing.F) {
	keys := testKeys(4)
	snap := encodeJournal(slices.Clone(keys[:2]), []string{"m-a", "m-b"})
	recs := slices.Concat(record(opPageQueued, keys[2][:]), record(opPageSettled, keys[0][:]), record(opManifestQueued, []byte("m-c")), record(opManifestSettled, []byte("m-a")))
	f.Add(slices.Concat(snap, recs), uint16(0))
	f.Add(slices.Concat(snap, recs, []byte("junk"), record(opPageQueued, keys[3][:])), uint16(1))
	f.Add(slices.Concat(snap, recs, record(opPageQueued, keys[3][:])[:20]), uint16(500))
	f.Add(slices.Concat(recs, snap, recs), uint16(3))
	f.Add(slices.Concat(snap[:len(snap)-1], []byte{0}, recs), uint16(7))
	// Torn records followed by whole ones (a write(2) that ended short).
	f.Add(slices.Concat(snap, record(opManifestQueued, []byte(strings.Repeat("m", 60)))[:10], record(opPageQueued, keys[3][:])), uint16(0))
	f.Add(slices.Concat(recs, record(opPageQueued, keys[3][:])[:5], record(opPageQueued, keys[1][:])), uint16(2))
	f.Fuzz(func(t *testing.T, b []byte, w uint16) {
		got, end := walkAll(t, b, int64(w))
		whole, wholeEnd := walkAll(t, b, int64(len(b))+refillWindowMaxBytes)
		if len(b) <= refillWindowMaxBytes && (end != wholeEnd || !slices.Equal(got, whole)) {
			t.Fatalf("windows of %d: %d entries, ended at %d; one window: %d entries, ended at %d", w, len(got), end, len(whole), wholeEnd)
		}
		s := &journalSet{pages: map[layout.PageKey]bool{}, manifests: map[string]bool{}}
		for _, e := range got {
			switch e.op {
			case opPageQueued:
				s.pages[e.key] = true
			case opPageSettled:
				delete(s.pages, e.key)
			case opManifestQueued:
				s.manifests[e.name] = true
			case opManifestSettled:
				delete(s.manifests, e.name)
			}
		}
		want, _, _, _ := decodeJournalFile(b[:end])
		if !maps.Equal(s.pages, want.pages) || !maps.Equal(s.manifests, want.manifests) {
			t.Fatalf("the walk lists %d pages and %v, the replay of its %d bytes %d pages and %v", len(s.pages), s.manifests, end, len(want.pages), want.manifests)
		}
		if end == int64(len(b)) {
			return
		}
		// Stopped before a tail it takes for a record being appended:
		// bytes that may begin one, after which no whole record begins
		// (appends are serialized: one would mean that write ended), so
		// the replay of the whole file lists what the walk lists.
		if !recordPrefix(b[end:]) {
			t.Fatalf("the walk stopped at %d of %d bytes, before bytes that cannot begin a record", end, len(b))
		}
		for i := end; i < int64(len(b)); i++ {
			if _, _, n := decodeRecord(b[i:]); n > 0 {
				t.Fatalf("the walk stopped at %d of %d bytes, before a whole record at %d", end, len(b), i)
			}
		}
		if full, _, _, _ := decodeJournalFile(b); !maps.Equal(full.pages, want.pages) || !maps.Equal(full.manifests, want.manifests) {
			t.Fatalf("the walk stopped at %d of %d bytes; the replay of the whole file lists %d pages and %v, of those bytes %d pages and %v", end, len(b), len(full.pages), full.manifests, len(want.pages), want.manifests)
		}
	})
}

// TestRefillPassesATornRecordFollowedByWholeOnes: a journal holding the
// first bytes of a record whose write(2) ended torn (its process killed
// mid-write, or a short write on a full disk), then whole records
// appended after it (appends are serialized: the torn write has ended).
// The refill skips the torn bytes, as a replay does, and queues the
// pages of the records after them. Before: it took the torn bytes for a
// record still being appended (their magic and length byte announce a
// record longer than the bytes left) and stopped in front of them at
// every refill; the pages after were never queued (cursor at 56 of 112
// bytes). Two tears: a manifest record cut after 10 bytes (its length
// byte read), a page record cut after 5 (the next record's magic read as
// its length byte).
func TestRefillPassesATornRecordFollowedByWholeOnes(t *testing.T) {
	for _, tc := range []struct {
		name string
		torn []byte
	}{
		{"manifest record cut after 10 bytes", record(opManifestQueued, []byte(strings.Repeat("m", 60)))[:10]},
		{"page record cut after 5 bytes", record(opPageQueued, testKeys(3)[2][:])[:5]},
	} {
		t.Run(tc.name, func(t *testing.T) {
			keys := testKeys(2)
			e, j, n, b := refillSetup(t, keys)
			if err := os.WriteFile(n.UploadsPath(), b[:recordOverhead+32], 0o640); err != nil {
				t.Fatal(err)
			}
			refillNow(j, "ns") // compacts, opens the cursor, queues key 0
			if !pageQueued(t, e, "ns", keys[0]) {
				t.Fatal("key 0 not queued by the first refill")
			}
			f, err := os.OpenFile(n.UploadsPath(), os.O_WRONLY|os.O_APPEND, 0)
			if err != nil {
				t.Fatal(err)
			}
			if _, err := f.Write(slices.Concat(tc.torn, record(opPageQueued, keys[1][:]))); err != nil {
				t.Fatal(err)
			}
			f.Close()
			all, err := os.ReadFile(n.UploadsPath())
			if err != nil {
				t.Fatal(err)
			}
			if s, _, _, _ := decodeJournalFile(all); !s.pages[keys[1]] {
				t.Fatal("the replay does not list key 1")
			}
			refillNow(j, "ns")
			if !pageQueued(t, e, "ns", keys[1]) {
				t.Fatalf("key 1 not queued; cursor at %d of %d bytes", j.cursors["ns"].off, len(all))
			}
			if c := j.cursors["ns"]; c.off != int64(len(all)) {
				t.Errorf("cursor at %d, want the file's end %d", c.off, len(all))
			}
		})
	}
}

// TestRefillCursorsBounded: the refill keeps at most maxRefillCursors
// cursors (64; cursorMax in tests), one open descriptor each. The
// refill of one namespace more closes the cursor used least recently
// (its descriptor closed; a namespace refilled again since is kept),
// and a later refill of the namespace it belonged to opens a new one
// and queues what its journal lists since.
func TestRefillCursorsBounded(t *testing.T) {
	for _, cmax := range []int{0, 3} {
		t.Run(fmt.Sprintf("cursorMax=%d", cmax), func(t *testing.T) {
			bound := cmp.Or(cmax, maxRefillCursors)
			e, j := unreachableTierEngine(t, t.TempDir(), 4*bound)
			j.cursorMax = cmax
			keys := testKeys(2 * (bound + 1))
			spill := func(i int, k layout.PageKey) {
				t.Helper()
				ns := fmt.Sprintf("ns%d", i)
				writePageFiles(t, e, ns, []layout.PageKey{k})
				n, err := e.store.Namespace(ns)
				if err != nil {
					t.Fatal(err)
				}
				f, err := os.OpenFile(n.UploadsPath(), os.O_WRONLY|os.O_APPEND|os.O_CREATE, 0o640)
				if err != nil {
					t.Fatal(err)
				}
				if _, err := f.Write(record(opPageQueued, k[:])); err != nil {
					t.Fatal(err)
				}
				f.Close()
				refillNow(j, ns)
				if !pageQueued(t, e, ns, k) {
					t.Fatalf("page of %s not queued by its refill", ns)
				}
			}
			for i := range bound {
				spill(i, keys[i])
			}
			if len(j.cursors) != bound {
				t.Fatalf("%d cursors, want %d", len(j.cursors), bound)
			}
			// ns0 refilled again: ns1 is now the least recently used.
			refillNow(j, "ns0")
			first, second := j.cursors["ns0"], j.cursors["ns1"]
			spill(bound, keys[bound])
			if len(j.cursors) != bound || j.cursors["ns1"] != nil || j.cursors["ns0"] != first {
				t.Fatalf("%d cursors, ns0's kept %v, ns1's dropped %v: want %d, ns1's (least recently used) dropped", len(j.cursors), j.cursors["ns0"] == first, j.cursors["ns1"] == nil, bound)
			}
			if err := second.f.Close(); err == nil {
				t.Error("the dropped cursor's descriptor was left open")
			}
			// ns1 refills again: a new cursor, the new page queued.
			spill(1, keys[bound+1])
			if c := j.cursors["ns1"]; c == nil || c == second || len(j.cursors) != bound {
				t.Fatalf("ns1's cursor %v (the old one: %v), %d cursors: want a new one, %d cursors", c != nil, c == second, len(j.cursors), bound)
			}
			if !pageQueued(t, e, "ns1", keys[1]) {
				t.Error("ns1's first page no longer queued")
			}
		})
	}
}
