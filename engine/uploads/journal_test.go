package uploads_test

import (
	"bytes"
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/kvpersist/kvpersist/engine/layout"
	"github.com/kvpersist/kvpersist/engine/remote"
	"github.com/kvpersist/kvpersist/engine/uploads"
)

// The journal file: writers sharing it, compactions, batches that cannot
// be written, the descriptors it keeps open, paths that are not regular
// files, and replay at start.

// TestEnqueueReturnsOnceDurable: EnqueuePages returns with the queued
// records of the pages it registered in the journal file (written and,
// on a syncing store, fdatasync'd), without a Flush, and before the queue
// has them: a crash after it returns still lists them. A page queued
// already gets no second record.
func TestEnqueueReturnsOnceDurable(t *testing.T) {
	e := newEnv(t, 16, true, uploads.Config{})
	keys := testKeys(3)
	e.writePages(t, "ns", keys...)
	submitted := 0
	e.q.setOnSubmit(func(p *uploads.Pending) error {
		b, err := os.ReadFile(e.ns(t, "ns").UploadsPath())
		if err != nil || !bytes.Contains(b, record(uploads.OpPageQueued, p.Key[:])) {
			t.Errorf("page %s handed to the queue before its queued record is in the journal (%v)", p.Key, err)
		}
		submitted++
		return nil
	})
	got := e.l.EnqueuePages("ns", keys)
	b, err := os.ReadFile(e.ns(t, "ns").UploadsPath())
	if err != nil || !bytes.Equal(b, pageRecords(keys...)) {
		t.Fatalf("journal after EnqueuePages: %x (%v), want the 3 queued records", b, err)
	}
	if len(got) != 3 || submitted != 3 {
		t.Fatalf("%d uploads returned, %d submitted; want 3, 3", len(got), submitted)
	}
	for _, k := range keys {
		if !e.l.Pending("ns", k) || !e.q.marked("ns", k) {
			t.Fatalf("page %s: pending %v, marked %v", k, e.l.Pending("ns", k), e.q.marked("ns", k))
		}
	}
	if again := e.l.EnqueuePages("ns", keys[:1]); len(again) != 1 || again[0] != got[0] {
		t.Fatal("a page queued already was not returned as its registered upload")
	}
	if _, size := e.listing(t, "ns"); size != len(b) {
		t.Fatalf("journal of %d bytes after queueing a queued page again, want %d", size, len(b))
	}
}

// TestJournalWritersAndCompactionsShareAFile: two Ledgers on one root
// (flock locks belong to open file descriptions, so they exclude each
// other as two processes do), one durable and one NoSync, append about 3
// MB of records each to one namespace's journal at once: queued records
// for 20,000 keys of their own and settled records for two thirds of
// them. Their goroutines compact the file as it grows, each under the
// exclusive lock while the other appends. At the end the file lists
// exactly the keys queued and not settled, of both: no record was lost
// to a compaction or landed in a replaced file.
func TestJournalWritersAndCompactionsShareAFile(t *testing.T) {
	root := t.TempDir()
	// Compacted past 64 KiB plus twice the last snapshot, not past 1 MiB
	// (too few compactions to count on).
	cfg := uploads.Config{CompactMin: 64 << 10}
	es := []*env{newEnvAt(t, root, 1<<20, true, cfg), newEnvAt(t, root, 1<<20, false, cfg)}
	const n = 20000
	want := map[layout.PageKey]bool{}
	keys := make([][]layout.PageKey, len(es))
	for w, e := range es {
		keys[w] = make([]layout.PageKey, n)
		for i := range keys[w] {
			keys[w][i] = layout.PageKey(sha256.Sum256(fmt.Appendf(nil, "%d/%d", w, i)))
			if i%3 == 0 {
				want[keys[w][i]] = true
			}
		}
		e.writePages(t, "ns", keys[w]...)
	}
	var wg sync.WaitGroup
	for w, e := range es {
		wg.Go(func() {
			for i := 0; i < n; i += 100 {
				e.l.EnqueuePages("ns", keys[w][i:i+100])
				for j := i; j < i+100; j++ {
					if j%3 != 0 {
						e.q.finish(t, e.l, pageObject("ns", keys[w][j]), errors.New("gone"))
					}
				}
			}
		})
	}
	wg.Wait()
	for _, e := range es {
		e.close(t)
	}
	if c := es[0].fs.renames.Load() + es[1].fs.renames.Load(); c < 4 {
		t.Fatalf("%d compactions, want many while both appended", c)
	}
	b, err := os.ReadFile(filepath.Join(root, "ns", layout.UploadsName))
	if err != nil {
		t.Fatal(err)
	}
	s, ignored, problem, records := uploads.Decode(b)
	if ignored != 0 || problem != nil || records {
		t.Fatalf("journal after close: %d bytes ignored (%v), records after the snapshot %v", ignored, problem, records)
	}
	if len(s.Pages) != len(want) || len(s.Manifests) != 0 {
		t.Fatalf("journal lists %d pages and %d manifests, want %d pages", len(s.Pages), len(s.Manifests), len(want))
	}
	for k := range want {
		if !s.Pages[k] {
			t.Fatalf("page %x queued and never settled is not listed", k)
		}
	}
}

// TestCompactionKeepsWhatItDidNotRead: a journal larger than what a
// replay reads (256 MiB, lowered here to 1 KiB through Config.ReadLimit;
// a file grows so large when no compaction could take the namespace's
// exclusive lock for long) is compacted (at Close, after the replay at
// start found records in it) into a snapshot of everything it lists, its
// records beyond the limit included: the compaction reads it whole, in
// windows of the limit.
func TestCompactionKeepsWhatItDidNotRead(t *testing.T) {
	const limit = 1 << 10
	e := newEnv(t, 1<<20, false, uploads.Config{ReadLimit: limit})
	keys := testKeys(300)
	b := uploads.EncodeSnapshot(slices.Clone(keys[:10]), []string{"m-0"})
	for i, k := range keys[10:] {
		b = append(b, record(uploads.OpPageQueued, k[:])...)
		if i%3 == 0 {
			b = append(b, record(uploads.OpPageSettled, k[:])...)
		}
	}
	b = append(b, record(uploads.OpManifestQueued, []byte("m-1"))...)
	e.writeJournal(t, "ns", b)
	e.writePages(t, "ns", keys...)
	e.writeManifest(t, "ns", "m-0", true)
	e.writeManifest(t, "ns", "m-1", true)
	want, _, _, _ := uploads.Decode(b)
	if len(b) < 10*limit {
		t.Fatalf("journal of %d bytes, want more than %d", len(b), 10*limit)
	}
	e.l.Resume() // queues what the first KiB lists
	queued := 0
	for k := range want.Pages {
		queued += e.q.submits(pageObject("ns", k))
	}
	if queued == 0 || queued >= len(want.Pages) {
		t.Fatalf("a replay of the first %d bytes queued %d pages, the whole file lists %d: the test needs fewer", limit, queued, len(want.Pages))
	}
	e.close(t) // abandons them (still listed), compacts
	got, err := os.ReadFile(e.ns(t, "ns").UploadsPath())
	if err != nil {
		t.Fatal(err)
	}
	pages, names, err := decodeJournal(got)
	if err != nil || len(pages) != len(want.Pages) || !slices.Equal(names, []string{"m-0", "m-1"}) {
		t.Fatalf("the compacted journal (%d bytes, a snapshot alone: %v) lists %d pages and %v, want %d pages and [m-0 m-1]", len(got), err, len(pages), names, len(want.Pages))
	}
	for _, k := range pages {
		if !want.Pages[k] {
			t.Fatalf("page %x listed, not in the journal", k)
		}
	}
}

// TestJournalBatchOfUnlockableNamespaceDropped: a batch whose namespace
// lock is not granted in time (another process holds it exclusively)
// waits for the next round, and its queuer stops waiting for it; one
// whose lock cannot be taken at all (the namespace's directory is gone:
// an upload settled after the namespace was removed) is dropped, logged,
// as a batch that cannot be written, and the directory is not made
// again.
func TestJournalBatchOfUnlockableNamespaceDropped(t *testing.T) {
	e := newEnv(t, 16, false, uploads.Config{})
	k := testKeys(2)
	e.writePages(t, "gone", k[1])
	e.l.EnqueuePages("gone", k[1:])
	if err := os.RemoveAll(e.ns(t, "gone").Dir()); err != nil {
		t.Fatal(err)
	}
	e.q.finish(t, e.l, pageObject("gone", k[1]), nil) // a settled record for "gone"
	e.writePages(t, "held", k[0])
	unlock, err := e.ns(t, "held").Lock(bg, true)
	if err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	e.l.EnqueuePages("held", k[:1])
	if d := time.Since(start); d > 5*time.Second {
		t.Fatalf("EnqueuePages waited %v for a lock held elsewhere", d)
	}
	ctx, cancel := context.WithTimeout(bg, time.Second)
	left, err := e.l.Flush(ctx)
	cancel()
	if err != nil || !slices.Equal(left, []string{"held"}) {
		t.Fatalf("namespaces left for the next round: %v (%v), want held only", left, err)
	}
	if _, err := os.Stat(filepath.Join(e.root, "gone")); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("the flush made the removed namespace's directory again: %v", err)
	}
	unlock()
	if s, size := e.listing(t, "held"); !s.Pages[k[0]] || size != len(record(uploads.OpPageQueued, k[0][:])) {
		t.Fatalf("held's journal after the lock was released: %d bytes, lists the page %v", size, s.Pages[k[0]])
	}
}

// TestJournalFilesOpenBounded: a Ledger appending to the journals of more
// namespaces than it keeps open (64, lowered here to 3) closes the one
// written least recently before it opens another, so its descriptors do
// not grow with the namespaces it ever saved into; every record is in its
// journal, and a journal opened again keeps the size its growth is
// measured from (so that it is still compacted).
func TestJournalFilesOpenBounded(t *testing.T) {
	e := newEnv(t, 1<<10, false, uploads.Config{OpenMax: 3})
	const namespaces = 10
	keys := testKeys(2 * namespaces)
	for round := range 2 {
		for i := range namespaces {
			ns := fmt.Sprintf("ns%d", i)
			k := keys[round*namespaces+i]
			e.writePages(t, ns, k)
			e.l.EnqueuePages(ns, []layout.PageKey{k})
			if open := e.fs.appends.Load(); open > 3 {
				t.Fatalf("round %d, namespace %d: %d journals open, want at most 3", round, i, open)
			}
		}
	}
	if base, open, err := uploads.JournalBase(e.l, "ns9"); err != nil || !open || base != 0 {
		t.Fatalf("ns9's journal, created here and opened again: open %v, base %d (%v); want open with base 0", open, base, err)
	}
	e.close(t)
	if open := e.fs.appends.Load(); open != 0 {
		t.Fatalf("%d journals open after Close", open)
	}
	for i := range namespaces {
		b, err := os.ReadFile(filepath.Join(e.root, fmt.Sprintf("ns%d", i), layout.UploadsName))
		if err != nil {
			t.Fatal(err)
		}
		// Compacted at Close: the snapshot of its two pages.
		if want := uploads.EncodeSnapshot([]layout.PageKey{keys[i], keys[namespaces+i]}, nil); !bytes.Equal(b, want) {
			t.Fatalf("ns%d's journal: %x, want the snapshot of its two pages", i, b)
		}
	}
}

// TestJournalNotARegularFile: a namespace's .uploads that is a symlink
// (to a file outside the namespace), a FIFO (with and without a reader)
// or a directory is never written through, followed, blocked on or
// replaced: a batch for it is dropped (logged), a replay and a
// compaction leave it, and the symlink's target keeps its bytes.
func TestJournalNotARegularFile(t *testing.T) {
	e := newEnv(t, 16, false, uploads.Config{})
	victim := filepath.Join(t.TempDir(), "victim")
	if err := os.WriteFile(victim, []byte("not a journal"), 0o644); err != nil {
		t.Fatal(err)
	}
	kinds := map[string]func(path string) error{
		"symlink":   func(p string) error { return os.Symlink(victim, p) },
		"fifo":      func(p string) error { return syscall.Mkfifo(p, 0o644) },
		"fifo-read": func(p string) error { return syscall.Mkfifo(p, 0o644) },
		"directory": func(p string) error { return os.Mkdir(p, 0o755) },
	}
	k := testKeys(1)[0]
	before := map[string]os.FileInfo{}
	for kind, mk := range kinds {
		path := e.ns(t, kind).UploadsPath()
		if err := mk(path); err != nil {
			t.Fatal(err)
		}
		if kind == "fifo-read" {
			r, err := os.OpenFile(path, os.O_RDONLY|syscall.O_NONBLOCK, 0)
			if err != nil {
				t.Fatal(err)
			}
			defer r.Close()
		}
		fi, err := os.Lstat(path)
		if err != nil {
			t.Fatal(err)
		}
		before[kind] = fi
		e.writePages(t, kind, k)
		e.l.EnqueuePages(kind, []layout.PageKey{k})
	}
	e.flush(t) // the batches are dropped, nothing left
	e.l.Resume()
	if open := e.fs.appends.Load() + e.fs.openReads.Load(); open != 0 {
		t.Fatalf("%d journal descriptors open", open)
	}
	e.close(t) // compacts the journals it appended to
	for kind, fi := range before {
		after, err := os.Lstat(e.ns(t, kind).UploadsPath())
		if err != nil || after.Mode() != fi.Mode() || !os.SameFile(fi, after) {
			t.Fatalf("%s: the path is now %v (%v), was %v", kind, after.Mode(), err, fi.Mode())
		}
	}
	if b, err := os.ReadFile(victim); err != nil || string(b) != "not a journal" {
		t.Fatalf("the symlink's target: %q, %v", b, err)
	}
}

// TestResumeQueuesWhatTheJournalLists: a replay at start queues every
// page and manifest the journal lists (a snapshot, then records: queued
// adds, settled removes) whose local file exists, without queued records
// of its own (the journal lists them); a page whose file is gone is
// settled; a page known stored is settled without being queued; and a
// journal holding records is compacted at Close.
func TestResumeQueuesWhatTheJournalLists(t *testing.T) {
	e := newEnv(t, 16, false, uploads.Config{})
	k := testKeys(5)
	e.writePages(t, "ns", k[0], k[1], k[3])
	e.writeManifest(t, "ns", "m", true, k[0])
	b := slices.Concat(uploads.EncodeSnapshot([]layout.PageKey{k[0], k[1]}, nil),
		record(uploads.OpPageQueued, k[2][:]), // no local file: settled
		record(uploads.OpPageQueued, k[3][:]), record(uploads.OpPageSettled, k[3][:]),
		record(uploads.OpPageQueued, k[4][:]), // known stored: settled
		record(uploads.OpManifestQueued, []byte("m")))
	e.writePages(t, "ns", k[4])
	e.writeJournal(t, "ns", b)
	e.l.MarkKnown("ns", k[4])
	e.l.Resume()
	for i, want := range []bool{true, true, false, false, false} {
		if got := e.q.submits(pageObject("ns", k[i])); got != map[bool]int{true: 1}[want] {
			t.Errorf("page %d queued %d times, want queued %v", i, got, want)
		}
	}
	if e.q.submits(manifestObject("ns", "m")) != 1 {
		t.Error("the manifest listed was not queued")
	}
	s, size := e.listing(t, "ns")
	if pages, names := listOf(s); !slices.Equal(pages, sortedKeys(k[0], k[1])) || !slices.Equal(names, []string{"m"}) {
		t.Fatalf("journal lists %x %v after the replay, want pages 0, 1 and m", pages, names)
	}
	if size != len(b)+2*len(record(uploads.OpPageSettled, k[0][:])) {
		t.Fatalf("journal of %d bytes: want the two settled records appended and nothing else", size)
	}
	e.close(t)
	got, err := os.ReadFile(e.ns(t, "ns").UploadsPath())
	if err != nil {
		t.Fatal(err)
	}
	if want := uploads.EncodeSnapshot([]layout.PageKey{k[0], k[1]}, []string{"m"}); !bytes.Equal(got, want) {
		t.Fatalf("the journal after Close is not the snapshot of what it lists (abandoned uploads stay listed)")
	}
}

// TestAbandonedStaysListedDoneSettles: an upload the queue abandons at
// Close (remote.ErrAbandoned) keeps its queued record, one that is done
// is settled, and a manifest that failed for good (remote.ErrConflict) is
// settled.
func TestAbandonedStaysListedDoneSettles(t *testing.T) {
	e := newEnv(t, 16, false, uploads.Config{})
	k := testKeys(2)
	e.writePages(t, "ns", k...)
	e.writeManifest(t, "ns", "m", true)
	e.l.EnqueuePages("ns", k)
	e.l.EnqueueManifest("ns", "m", nil)
	e.q.finish(t, e.l, pageObject("ns", k[0]), nil)
	e.q.finish(t, e.l, manifestObject("ns", "m"), fmt.Errorf("%w: held by another manifest", remote.ErrConflict))
	if !e.l.Known("ns", k[0]) || e.l.Known("ns", k[1]) {
		t.Fatal("the page uploaded is not known stored, or the other is")
	}
	e.close(t) // abandons k[1]
	b, err := os.ReadFile(e.ns(t, "ns").UploadsPath())
	if err != nil {
		t.Fatal(err)
	}
	if pages, names, err := decodeJournal(b); err != nil || !slices.Equal(pages, k[1:]) || len(names) != 0 {
		t.Fatalf("journal after Close: %x %v (%v); want the abandoned page alone", pages, names, err)
	}
}
