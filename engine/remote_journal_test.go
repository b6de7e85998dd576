package engine

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/binary"
	"errors"
	"fmt"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/zeebo/xxh3"

	"github.com/kvpersist/kvpersist/engine/layout"
)

func testKeys(n int) []layout.PageKey {
	out := make([]layout.PageKey, n)
	for i := range out {
		out[i] = layout.PageKey(sha256.Sum256([]byte{byte(i), byte(i >> 8)}))
	}
	return out
}

// decodeJournal decodes b as a snapshot alone (the whole file).
func decodeJournal(b []byte) ([]layout.PageKey, []string, error) {
	p, m, end, err := decodeSnapshot(b)
	if err == nil && end != len(b) {
		err = fmt.Errorf("%w: %d bytes after the snapshot", errJournal, len(b)-end)
	}
	return p, m, err
}

// rehash recomputes a journal's trailing hash after a test edited it, so
// that the decoder's later checks are reached.
func rehash(b []byte) []byte {
	body := b[:len(b)-8]
	return binary.LittleEndian.AppendUint64(bytes.Clone(body), xxh3.Hash(body))
}

// TestJournalRoundTrip: a journal decodes to the sorted keys and names it
// was made of, its layout is the documented one (magic, counts, 32-byte
// keys, length-prefixed names, XXH3-64 of the rest), and it is canonical.
func TestJournalRoundTrip(t *testing.T) {
	keys := testKeys(5)
	names := []string{"zeta", "conv-1", "a.b_c"}
	b := encodeJournal(slices.Clone(keys), slices.Clone(names))
	wantLen := 16 + 32*5 + (1 + 4) + (1 + 6) + (1 + 5) + 8
	if len(b) != wantLen || string(b[:8]) != "KVPUPL1\n" || binary.LittleEndian.Uint32(b[8:]) != 5 || binary.LittleEndian.Uint32(b[12:]) != 3 {
		t.Fatalf("journal of %d bytes, head %q; want %d bytes, magic, 5 pages, 3 manifests", len(b), b[:16], wantLen)
	}
	if binary.LittleEndian.Uint64(b[len(b)-8:]) != xxh3.Hash(b[:len(b)-8]) {
		t.Fatal("trailing hash is not XXH3-64 of the bytes before it")
	}
	pages, manifests, err := decodeJournal(b)
	if err != nil {
		t.Fatal(err)
	}
	slices.SortFunc(keys, func(a, b layout.PageKey) int { return bytes.Compare(a[:], b[:]) })
	slices.Sort(names)
	if !slices.Equal(pages, keys) || !slices.Equal(manifests, names) {
		t.Fatalf("decoded %v %v, want %v %v", pages, manifests, keys, names)
	}
	if !bytes.Equal(encodeJournal(pages, manifests), b) {
		t.Fatal("not canonical: re-encoding differs")
	}
	empty := encodeJournal(nil, nil)
	if p, m, err := decodeJournal(empty); err != nil || len(p)+len(m) != 0 || len(empty) != 24 {
		t.Fatalf("empty journal: %d bytes, %v %v %v", len(empty), p, m, err)
	}
}

// TestJournalHostile: every malformed journal is errJournal, never a
// panic or an allocation beyond the file's size.
func TestJournalHostile(t *testing.T) {
	keys := testKeys(3)
	good := encodeJournal(slices.Clone(keys), []string{"a", "b"})
	edit := func(f func(b []byte) []byte) []byte { return f(bytes.Clone(good)) }
	cases := map[string][]byte{
		"empty":      nil,
		"short":      good[:23],
		"magic":      edit(func(b []byte) []byte { b[0] = 'X'; return rehash(b) }),
		"hash":       edit(func(b []byte) []byte { b[20] ^= 1; return b }),
		"truncated":  rehash(good[:len(good)-3]),
		"huge-pages": edit(func(b []byte) []byte { binary.LittleEndian.PutUint32(b[8:], 1<<31); return rehash(b) }),
		"huge-names": edit(func(b []byte) []byte { binary.LittleEndian.PutUint32(b[12:], 1<<20); return rehash(b) }),
		"more-pages": edit(func(b []byte) []byte { binary.LittleEndian.PutUint32(b[8:], 4); return rehash(b) }),
		"fewer-names": edit(func(b []byte) []byte {
			binary.LittleEndian.PutUint32(b[12:], 1)
			return rehash(b)
		}),
		"unsorted-pages": rehash(func() []byte {
			b := bytes.Clone(good)
			var a [32]byte
			copy(a[:], b[16:48])
			copy(b[16:48], b[48:80])
			copy(b[48:80], a[:])
			return b
		}()),
		"duplicate-names": edit(func(b []byte) []byte { b[len(b)-9] = 'a'; return rehash(b) }),
		"bad-name":        edit(func(b []byte) []byte { b[len(b)-9] = '/'; return rehash(b) }),
		"zero-length-name": edit(func(b []byte) []byte {
			b[16+32*3] = 0
			return rehash(b)
		}),
	}
	for name, b := range cases {
		if p, m, err := decodeJournal(b); !errors.Is(err, errJournal) {
			t.Errorf("%s: decoded %d pages %d manifests, err %v; want errJournal", name, len(p), len(m), err)
		}
	}
}

// FuzzDecodeJournal: the snapshot decoder never panics, and whatever it
// accepts re-encodes to the same bytes (the format is canonical).
func FuzzDecodeJournal(f *testing.F) {
	f.Add(encodeJournal(testKeys(3), []string{"a", "conv-1"}))
	f.Add(encodeJournal(nil, nil))
	f.Add([]byte("KVPUPL1\n"))
	f.Fuzz(func(t *testing.T, b []byte) {
		p, m, end, err := decodeSnapshot(b)
		if err != nil {
			if !errors.Is(err, errJournal) {
				t.Fatalf("error %v is not errJournal", err)
			}
			return
		}
		if !bytes.Equal(encodeJournal(p, m), b[:end]) {
			t.Fatal("accepted a snapshot that does not re-encode to itself")
		}
	})
}

// record is a journal record encoded from ARCHITECTURE.md's table alone:
// magic "UPR\n", u8 op, u8 L, L bytes, XXH3-64 of the bytes before it.
func record(op byte, payload []byte) []byte {
	b := append([]byte("UPR\n"), op, byte(len(payload)))
	b = append(b, payload...)
	return binary.LittleEndian.AppendUint64(b, xxh3.Hash(b))
}

// setOf lists a replayed journal: sorted keys and names.
func listOf(s *journalSet) ([]layout.PageKey, []string) {
	return s.sortedPages(), s.sortedManifests()
}

func sortedKeys(keys ...layout.PageKey) []layout.PageKey {
	out := slices.Clone(keys)
	slices.SortFunc(out, func(a, b layout.PageKey) int { return bytes.Compare(a[:], b[:]) })
	return out
}

// TestJournalRecordsReplay: a snapshot followed by records replays in
// order (queued adds, settled removes); the encoder's records are the
// documented bytes; a file of records alone (no snapshot) replays too.
func TestJournalRecordsReplay(t *testing.T) {
	k := testKeys(4)
	b := encodeJournal([]layout.PageKey{k[0], k[1]}, []string{"m1"})
	recs := [][]byte{
		record(opPageQueued, k[2][:]), record(opPageSettled, k[0][:]), record(opManifestQueued, []byte("m2")),
		record(opManifestSettled, []byte("m1")), record(opPageQueued, k[3][:]), record(opPageSettled, k[3][:]),
	}
	mine := appendRecord(appendRecord(nil, opPageQueued, k[2][:]), opManifestSettled, []byte("m1"))
	if !bytes.Equal(mine, append(slices.Clone(recs[0]), recs[3]...)) {
		t.Fatalf("appendRecord's bytes differ from the documented record")
	}
	for _, r := range recs {
		b = append(b, r...)
	}
	s, ignored, problem, records := decodeJournalFile(b)
	pages, names := listOf(s)
	if ignored != 0 || problem != nil || !records {
		t.Fatalf("ignored %d bytes (%v), records %v", ignored, problem, records)
	}
	if want := sortedKeys(k[1], k[2]); !slices.Equal(pages, want) || !slices.Equal(names, []string{"m2"}) {
		t.Fatalf("replayed %x %v, want %x [m2]", pages, names, want)
	}
	alone := slices.Concat(recs...)
	s, ignored, _, _ = decodeJournalFile(alone)
	if pages, names := listOf(s); ignored != 0 || !slices.Equal(pages, sortedKeys(k[2])) || !slices.Equal(names, []string{"m2"}) {
		t.Fatalf("records alone: %x %v, %d ignored", pages, names, ignored)
	}
	if _, _, _, records := decodeJournalFile(encodeJournal(slices.Clone(k), nil)); records {
		t.Fatal("a snapshot alone reported records")
	}
}

// TestJournalTornAndDamagedRecords: a torn last record (any cut), garbage
// between records and records that are well framed but hostile (a bad op,
// a bad length, an invalid name, a wrong hash) are skipped, counted and
// reported as errJournal; every good record before and after them is
// replayed. A snapshot that fails its checks is skipped the same way and
// the records after it are still read.
func TestJournalTornAndDamagedRecords(t *testing.T) {
	k := testKeys(3)
	good := slices.Concat(record(opPageQueued, k[0][:]), record(opManifestQueued, []byte("m")))
	last := record(opPageQueued, k[1][:])
	for cut := 1; cut < len(last); cut++ {
		b := slices.Concat(good, last[:cut])
		s, ignored, problem, _ := decodeJournalFile(b)
		pages, names := listOf(s)
		if ignored != cut || !errors.Is(problem, errJournal) || !slices.Equal(pages, k[:1]) || !slices.Equal(names, []string{"m"}) {
			t.Fatalf("cut at %d: %x %v, %d ignored (%v)", cut, pages, names, ignored, problem)
		}
		// A record appended after the torn one is read (another engine
		// appends to a file whose last record a crash tore).
		s, _, _, _ = decodeJournalFile(slices.Concat(b, last))
		if pages, _ := listOf(s); !slices.Equal(pages, sortedKeys(k[0], k[1])) {
			t.Fatalf("cut at %d, then appended: %x", cut, pages)
		}
	}
	badHash := record(opPageQueued, k[2][:])
	badHash[10] ^= 1
	hostile := [][]byte{
		[]byte("garbage between records"),
		record(9, k[2][:]),                       // no such op
		record(opPageQueued, k[2][:31]),          // a page op of 31 bytes
		record(opManifestQueued, []byte("../x")), // not a valid name
		record(opManifestQueued, nil),            // empty name
		badHash,
	}
	for i, h := range hostile {
		b := slices.Concat(good, h, last)
		s, ignored, problem, _ := decodeJournalFile(b)
		pages, names := listOf(s)
		if ignored != len(h) || !errors.Is(problem, errJournal) || !slices.Equal(pages, sortedKeys(k[0], k[1])) || !slices.Equal(names, []string{"m"}) {
			t.Fatalf("hostile %d: %x %v, %d ignored of %d (%v)", i, pages, names, ignored, len(h), problem)
		}
	}
	snap := encodeJournal([]layout.PageKey{k[2]}, nil)
	snap[20] ^= 1
	s, ignored, problem, _ := decodeJournalFile(slices.Concat(snap, good))
	if pages, _ := listOf(s); ignored != len(snap) || !errors.Is(problem, errJournal) || !slices.Equal(pages, k[:1]) {
		t.Fatalf("bad snapshot: %x, %d ignored (%v)", pages, ignored, problem)
	}
}

// FuzzDecodeJournalFile: the file decoder never panics; it reports a
// problem exactly when it ignored bytes; what it replays, written as a
// snapshot, replays to the same set; and a record appended to any bytes
// (a torn tail, garbage) is read.
func FuzzDecodeJournalFile(f *testing.F) {
	k := testKeys(2)
	f.Add(slices.Concat(encodeJournal(testKeys(3), []string{"a"}), record(opPageSettled, k[0][:]), record(opManifestQueued, []byte("b"))))
	f.Add(record(opPageQueued, k[1][:])[:20])
	f.Add([]byte("UPR\nUPR\n"))
	f.Fuzz(func(t *testing.T, b []byte) {
		s, ignored, problem, _ := decodeJournalFile(b)
		if (ignored > 0) != (problem != nil) || (problem != nil && !errors.Is(problem, errJournal)) {
			t.Fatalf("ignored %d, problem %v", ignored, problem)
		}
		pages, names := listOf(s)
		s2, ignored2, _, records := decodeJournalFile(encodeJournal(slices.Clone(pages), slices.Clone(names)))
		p2, n2 := listOf(s2)
		if ignored2 != 0 || records || !slices.Equal(p2, pages) || !slices.Equal(n2, names) {
			t.Fatal("the replayed set does not survive a compaction")
		}
		s3, _, _, _ := decodeJournalFile(slices.Concat(b, record(opPageQueued, k[1][:]), record(opManifestSettled, []byte("a"))))
		if !s3.pages[k[1]] || s3.manifests["a"] {
			t.Fatal("a record appended after these bytes was not read")
		}
	})
}

// FuzzReplayJournalWindows: a journal replayed in windows of any size
// (each at least twice the largest record, the first holding any valid
// snapshot whole, as a compaction reads a file larger than a replay
// does) replays to what it replays to whole.
func FuzzReplayJournalWindows(f *testing.F) {
	k := testKeys(8)
	var recs []byte
	for i, key := range k {
		recs = append(recs, record(opPageQueued, key[:])...)
		if i%2 == 0 {
			recs = append(recs, record(opPageSettled, k[i/2][:])...)
		}
		recs = append(recs, "garbage UP"...)
	}
	recs = append(recs, record(opManifestQueued, bytes.Repeat([]byte("m"), 200))...)
	f.Add(slices.Concat(encodeJournal(testKeys(3), []string{"a"}), recs), uint16(300))
	f.Add(recs, uint16(250))
	f.Add(recs, uint16(len(recs)-3))
	// Garbage, then a record whose magic a window's end splits.
	f.Add(append(bytes.Repeat([]byte("x"), 2*maxRecordBytes), record(opPageQueued, k[0][:])...), uint16(2*maxRecordBytes+2))
	f.Fuzz(func(t *testing.T, b []byte, w uint16) {
		window := max(int(w), 2*maxRecordBytes)
		if _, _, snapEnd, err := decodeSnapshot(b); err == nil {
			window = max(window, snapEnd)
		}
		whole, ignored, problem, records := decodeJournalFile(b)
		s, ignored2, problem2, records2, err := replayJournalAt(bytes.NewReader(b), int64(len(b)), window)
		if err != nil || !maps.Equal(s.pages, whole.pages) || !maps.Equal(s.manifests, whole.manifests) ||
			ignored2 != ignored || (problem2 == nil) != (problem == nil) || records2 != records {
			t.Fatalf("windows of %d bytes: %d pages %v, %d ignored (%v), records %v; whole: %d pages %v, %d ignored (%v), records %v (%v)",
				window, len(s.pages), s.manifests, ignored2, problem2, records2, len(whole.pages), whole.manifests, ignored, problem, records, err)
		}
	})
}

// BenchmarkJournalAdd: what the uploads journal adds to a save's path per
// page queued: one record appended to the in-memory batch (the write and
// the fdatasync are the journal goroutine's, off the path). The batch is
// emptied every 4,096 records (as the goroutine does), untimed. The
// limit, measured in the same run: one lstat(2) of a file, which the
// path already makes for every page it queues (enqueueFile); x-limit =
// lstat time / add time (above 1: the record costs less than the lstat).
func BenchmarkJournalAdd(b *testing.B) {
	j := &journal{batch: map[string][]byte{}, urgent: map[string]bool{}, spilled: map[string]bool{}, touched: map[string]bool{}, wake: make(chan struct{}, 1)}
	keys := testKeys(4096)
	path := filepath.Join(b.TempDir(), "page")
	if err := os.WriteFile(path, []byte("x"), 0o644); err != nil {
		b.Fatal(err)
	}
	b.ReportAllocs()
	b.SetBytes(recordOverhead + 32)
	var ours, limit time.Duration
	i := 0
	for b.Loop() {
		t0 := time.Now()
		j.add("ns", opPageQueued, keys[i][:])
		ours += time.Since(t0)
		b.StopTimer()
		t0 = time.Now()
		if _, err := os.Lstat(path); err != nil {
			b.Fatal(err)
		}
		limit += time.Since(t0)
		if i++; i == len(keys) {
			i = 0
			j.mu.Lock()
			j.batch["ns"], j.nbatch = j.batch["ns"][:0], 0
			j.mu.Unlock()
			select {
			case <-j.wake:
			default:
			}
		}
		b.StartTimer()
	}
	// ns/op includes the timer's stops and starts around the limit.
	b.ReportMetric(float64(ours.Nanoseconds())/float64(b.N), "add-ns/op")
	b.ReportMetric(float64(limit.Nanoseconds())/float64(b.N), "lstat-ns/op")
	b.ReportMetric(float64(limit)/float64(ours), "x-limit")
}

// TestJournalWritersAndCompactionsShareAFile: two engines on one root
// (flock locks belong to open file descriptions, so they exclude each
// other as two processes do), one durable and one NoSync, append about 3
// MB of records each to one namespace's journal at once: queued records
// for 20,000 keys of their own and settled records for two thirds of
// them. Their goroutines compact the file as it grows, each under the
// exclusive lock while the other appends. At the end the file lists
// exactly the keys queued and not settled, of both engines: no record
// was lost to a compaction or landed in a replaced file.
func TestJournalWritersAndCompactionsShareAFile(t *testing.T) {
	root := t.TempDir()
	if err := os.MkdirAll(filepath.Join(root, "ns"), 0o755); err != nil {
		t.Fatal(err)
	}
	e1, err := New(Config{Root: root, Logger: newEngineLogger()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = e1.Close(bg) })
	e2 := newEngine(t, Config{Root: root})
	js := []*journal{startJournal(&tier{e: e1}), startJournal(&tier{e: e2})}
	for _, j := range js {
		// Compacted past 64 KiB plus twice the last snapshot (7 or 8
		// times in all in runs here), not past 1 MiB (two or three
		// times, one of them at a close: too few to count on).
		j.mu.Lock()
		j.compactMin = 64 << 10
		j.mu.Unlock()
	}
	const n = 20000
	want := map[layout.PageKey]bool{}
	keys := make([][]layout.PageKey, len(js))
	for w := range js {
		keys[w] = make([]layout.PageKey, n)
		for i := range keys[w] {
			keys[w][i] = layout.PageKey(sha256.Sum256(fmt.Appendf(nil, "%d/%d", w, i)))
			if i%3 == 0 {
				want[keys[w][i]] = true
			}
		}
	}
	var wg sync.WaitGroup
	for w, j := range js {
		wg.Go(func() {
			for i, k := range keys[w] {
				j.add("ns", opPageQueued, k[:])
				if i%3 != 0 {
					j.add("ns", opPageSettled, k[:])
				}
				if i%500 == 0 {
					time.Sleep(time.Millisecond) // let the goroutine write and compact
				}
			}
		})
	}
	wg.Wait()
	for _, j := range js {
		j.close(bg)
	}
	if c := js[0].compactions + js[1].compactions; c < 4 {
		t.Fatalf("%d compactions, want many while both appended", c)
	}
	b, err := os.ReadFile(filepath.Join(root, "ns", layout.UploadsName))
	if err != nil {
		t.Fatal(err)
	}
	s, ignored, problem, records := decodeJournalFile(b)
	if ignored != 0 || problem != nil || records {
		t.Fatalf("journal after close: %d bytes ignored (%v), records after the snapshot %v", ignored, problem, records)
	}
	if len(s.pages) != len(want) || len(s.manifests) != 0 {
		t.Fatalf("journal lists %d pages and %d manifests, want %d pages", len(s.pages), len(s.manifests), len(want))
	}
	for k := range want {
		if !s.pages[k] {
			t.Fatalf("page %x queued and never settled is not listed", k)
		}
	}
}

// unreachableTierEngine opens an engine on root whose remote tier points
// at a closed loopback port, with an upload queue of queueLen, one
// worker, and a backoff of an hour (an upload taken by the worker fails
// its first attempt and then waits): its queue never drains. Its
// journal's goroutine is stopped, so the test runs the goroutine's steps
// itself; the goroutine is started again before Close, which abandons
// the uploads.
func unreachableTierEngine(t *testing.T, root string, queueLen int) (*Engine, *journal) {
	t.Helper()
	return stoppedJournalEngine(t, Config{Root: root, Remote: &RemoteTier{
		Store:         RemoteConfig{Endpoint: "http://127.0.0.1:1", Bucket: "b", AccessKey: "k", SecretKey: "s", MaxRetries: 1},
		UploadWorkers: 1, UploadQueue: queueLen, UploadBackoffMin: time.Hour, UploadBackoffMax: time.Hour,
	}})
}

// stoppedJournalEngine opens an engine of cfg (NoSync, a silent logger)
// with a remote tier whose journal's goroutine is stopped, as
// unreachableTierEngine's.
func stoppedJournalEngine(t *testing.T, cfg Config) (*Engine, *journal) {
	t.Helper()
	cfg.NoSync, cfg.Logger = true, newEngineLogger()
	e, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	j := e.tier.j
	close(j.quit)
	<-j.done
	t.Cleanup(func() {
		j.quit, j.done = make(chan struct{}), make(chan struct{})
		go j.run()
		ctx, cancel := context.WithCancel(bg)
		cancel()
		// Close's wait for the jobs may report ctx's error (nothing was
		// abandoned then).
		if err := e.Close(ctx); err != nil && !errors.Is(err, ErrUploadsAbandoned) && !errors.Is(err, context.Canceled) {
			t.Errorf("Close: %v", err)
		}
	})
	return e, j
}

// writePageFiles creates a file at the page path of every key of ns (the
// queue takes any regular file; nothing here is uploaded).
func writePageFiles(t *testing.T, e *Engine, ns string, keys []layout.PageKey) {
	t.Helper()
	n, err := e.store.Namespace(ns)
	if err != nil {
		t.Fatal(err)
	}
	for _, k := range keys {
		if err := os.MkdirAll(filepath.Dir(n.PagePath(k)), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(n.PagePath(k), k[:], 0o644); err != nil {
			t.Fatal(err)
		}
	}
}

// TestRefillFindsSpilledRecordsStillInTheBatch: a save spills pages (the
// queue full) after the journal's goroutine wrote its batch and before
// it refills the queue (a refill was due: the queue had drained to half
// meanwhile). The spilled pages' queued records are still in the
// in-memory batch, not in the file the refill reads. Every spilled page
// must still be queued, or its namespace stay marked for the next
// refill with the journal listing it. Before: the refill read the file
// without them and cleared the mark, so they were uploaded by nobody
// until another spill in the namespace or the next start.
func TestRefillFindsSpilledRecordsStillInTheBatch(t *testing.T) {
	root := t.TempDir()
	e, j := unreachableTierEngine(t, root, 1)
	keys := testKeys(6)
	writePageFiles(t, e, "ns", keys)
	e.tier.saved("ns", keys) // the worker takes at most one, the queue one: the rest spill
	j.mu.Lock()
	spilled, batched := j.spilled["ns"], len(j.batch["ns"])
	j.refill = true // the queue drained to half (drained), before the goroutine's refill
	j.mu.Unlock()
	if !spilled || batched != len(keys)*(recordOverhead+32) {
		t.Fatalf("spilled %v, %d bytes batched; want a spill and %d queued records", spilled, batched, len(keys))
	}
	j.refillQueue()
	// The goroutine's next round.
	ctx, cancel := context.WithTimeout(bg, time.Second)
	j.flush(ctx)
	cancel()
	j.refillQueue()

	n, _ := e.store.Namespace("ns")
	b, err := os.ReadFile(n.UploadsPath())
	if err != nil {
		t.Fatal(err)
	}
	s, _, _, _ := decodeJournalFile(b)
	j.mu.Lock()
	marked := j.spilled["ns"]
	j.mu.Unlock()
	for i, k := range keys {
		name, err := e.tier.st.PageName("ns", k.String())
		if err != nil {
			t.Fatal(err)
		}
		e.tier.mu.Lock()
		queued := e.tier.pending[name] != nil
		e.tier.mu.Unlock()
		if !queued && !(marked && s.pages[k]) {
			t.Errorf("page %d: not queued, and not left for the next refill (namespace marked %v, journal lists it %v)", i, marked, s.pages[k])
		}
	}
}

// TestCompactionKeepsWhatItDidNotRead: a journal larger than what a
// replay reads (maxJournalBytes, lowered here to 1 KiB through the
// journal's readLimit; a file grows so large when no compaction could
// take the namespace's exclusive lock for long) is compacted into a
// snapshot of everything it lists, its records beyond the limit
// included: the compaction reads it whole, in windows of the limit.
// Before: it published the snapshot of the first 1 KiB (256 MiB) alone,
// and the uploads queued in the rest were forgotten.
func TestCompactionKeepsWhatItDidNotRead(t *testing.T) {
	root := t.TempDir()
	if err := os.MkdirAll(filepath.Join(root, "ns"), 0o755); err != nil {
		t.Fatal(err)
	}
	e := newEngine(t, Config{Root: root})
	keys := testKeys(300)
	b := encodeJournal(slices.Clone(keys[:10]), []string{"m-0"})
	for i, k := range keys[10:] {
		b = append(b, record(opPageQueued, k[:])...)
		if i%3 == 0 {
			b = append(b, record(opPageSettled, k[:])...)
		}
	}
	b = append(b, record(opManifestQueued, []byte("m-1"))...)
	path := filepath.Join(root, "ns", layout.UploadsName)
	if err := os.WriteFile(path, b, 0o640); err != nil {
		t.Fatal(err)
	}
	want, _, _, _ := decodeJournalFile(b)
	const limit = 1 << 10
	if len(b) < 10*limit {
		t.Fatalf("journal of %d bytes, want more than %d", len(b), 10*limit)
	}
	j := &journal{t: &tier{e: e}, files: map[string]*journalFile{}, readLimit: limit}
	if s, _, _ := j.read(path); len(s.pages) >= len(want.pages) {
		t.Fatalf("a replay of the first %d bytes lists %d pages, the whole file %d: the test needs fewer", limit, len(s.pages), len(want.pages))
	}
	if !j.compact(bg, "ns") || j.compactions != 1 {
		t.Fatalf("%d compactions", j.compactions)
	}
	got, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	pages, names, err := decodeJournal(got)
	if err != nil || len(pages) != len(want.pages) || !maps.Equal(want.manifests, map[string]bool{"m-0": true, "m-1": true}) || !slices.Equal(names, []string{"m-0", "m-1"}) {
		t.Fatalf("the compacted journal (%d bytes, a snapshot alone: %v) lists %d pages and %v, want %d pages and %v", len(got), err, len(pages), names, len(want.pages), want.manifests)
	}
	for _, k := range pages {
		if !want.pages[k] {
			t.Fatalf("page %x listed, not in the journal", k)
		}
	}
}

// TestJournalBatchOfUnlockableNamespaceDropped: a batch whose namespace
// lock is not granted in time (another process holds it exclusively)
// waits for the next round; one whose lock cannot be taken at all (the
// namespace's directory is gone: an upload settled after the namespace
// was removed) is dropped, logged, as a batch that cannot be written.
// Before: it was put back and tried again every 200 ms for the life of
// the engine, its records held in memory.
func TestJournalBatchOfUnlockableNamespaceDropped(t *testing.T) {
	root := t.TempDir()
	if err := os.MkdirAll(filepath.Join(root, "held"), 0o755); err != nil {
		t.Fatal(err)
	}
	e := newEngine(t, Config{Root: root})
	held, err := e.store.Namespace("held")
	if err != nil {
		t.Fatal(err)
	}
	unlock, err := held.Lock(bg, true)
	if err != nil {
		t.Fatal(err)
	}
	defer unlock()
	j := &journal{t: &tier{e: e}, batch: map[string][]byte{}, urgent: map[string]bool{}, touched: map[string]bool{},
		wake: make(chan struct{}, 1), files: map[string]*journalFile{}, warned: map[string]time.Time{}}
	k := testKeys(2)
	j.add("held", opPageQueued, k[0][:])
	j.add("gone", opPageSettled, k[1][:])
	ctx, cancel := context.WithTimeout(bg, 50*time.Millisecond)
	left := j.flush(ctx)
	cancel()
	if !left["held"] || left["gone"] || len(left) != 1 {
		t.Fatalf("namespaces left for the next round: %v, want held only", left)
	}
	if want := record(opPageQueued, k[0][:]); j.nbatch != 1 || !bytes.Equal(j.batch["held"], want) || j.batch["gone"] != nil {
		t.Fatalf("%d records waiting: %x; want held's queued record alone", j.nbatch, j.batch)
	}
	if _, err := os.Stat(filepath.Join(root, "gone")); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("the flush created the removed namespace's directory: %v", err)
	}
}

// TestJournalFilesOpenBounded: an engine appending to the journals of
// more namespaces than it keeps open (maxJournalFiles, lowered here to
// 3) closes the one written least recently before it opens another, so
// its descriptors do not grow with the namespaces it ever saved into;
// every record is in its journal, and a journal opened again keeps the
// size its growth is measured from (so that it is still compacted).
// Before: one descriptor per namespace, open until Close.
func TestJournalFilesOpenBounded(t *testing.T) {
	root := t.TempDir()
	const namespaces = 10
	for i := range namespaces {
		if err := os.MkdirAll(filepath.Join(root, fmt.Sprintf("ns%d", i)), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	e := newEngine(t, Config{Root: root})
	j := &journal{t: &tier{e: e}, batch: map[string][]byte{}, urgent: map[string]bool{}, touched: map[string]bool{},
		wake: make(chan struct{}, 1), files: map[string]*journalFile{}, warned: map[string]time.Time{}, openMax: 3}
	keys := testKeys(2 * namespaces)
	for round := range 2 {
		for i := range namespaces {
			j.add(fmt.Sprintf("ns%d", i), opPageQueued, keys[round*namespaces+i][:])
			if left := j.flush(bg); len(left) != 0 {
				t.Fatalf("left %v", left)
			}
			if len(j.files) > 3 {
				t.Fatalf("round %d, namespace %d: %d journals open, want at most 3", round, i, len(j.files))
			}
		}
	}
	if jf := j.files["ns9"]; jf == nil || jf.base != 0 {
		t.Fatalf("ns9's journal, created by this engine and opened again: %+v, want open with base 0", jf)
	}
	for _, ns := range slices.Collect(maps.Keys(j.files)) {
		j.closeFile(ns)
	}
	for i := range namespaces {
		b, err := os.ReadFile(filepath.Join(root, fmt.Sprintf("ns%d", i), layout.UploadsName))
		if err != nil {
			t.Fatal(err)
		}
		if want := slices.Concat(record(opPageQueued, keys[i][:]), record(opPageQueued, keys[namespaces+i][:])); !bytes.Equal(b, want) {
			t.Fatalf("ns%d's journal: %x, want its two queued records %x", i, b, want)
		}
	}
}

// TestJournalNotARegularFile: a namespace's .uploads that is a symlink
// (to a file outside the namespace), a FIFO (with and without a reader)
// or a directory is never written through, followed, blocked on or
// replaced: a batch for it is dropped (logged), a compaction and a
// replay leave it, and the symlink's target keeps its bytes.
func TestJournalNotARegularFile(t *testing.T) {
	root := t.TempDir()
	e := newEngine(t, Config{Root: root})
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
	for kind, mk := range kinds {
		if err := os.MkdirAll(filepath.Join(root, kind), 0o755); err != nil {
			t.Fatal(err)
		}
		path := filepath.Join(root, kind, layout.UploadsName)
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
		before, err := os.Lstat(path)
		if err != nil {
			t.Fatal(err)
		}
		j := &journal{t: &tier{e: e}, batch: map[string][]byte{}, urgent: map[string]bool{}, touched: map[string]bool{},
			wake: make(chan struct{}, 1), files: map[string]*journalFile{}, warned: map[string]time.Time{}}
		j.add(kind, opPageQueued, k[:])
		if left := j.flush(bg); len(left) != 0 || j.nbatch != 0 || len(j.files) != 0 {
			t.Fatalf("%s: left %v, %d records waiting, %d files open; want the batch dropped", kind, left, j.nbatch, len(j.files))
		}
		if !j.compact(bg, kind) || j.compactions != 0 {
			t.Fatalf("%s: %d compactions", kind, j.compactions)
		}
		if _, _, ok := j.read(path); ok {
			t.Fatalf("%s: read as a journal", kind)
		}
		after, err := os.Lstat(path)
		if err != nil || after.Mode() != before.Mode() || !os.SameFile(before, after) {
			t.Fatalf("%s: the path is now %v (%v), was %v", kind, after.Mode(), err, before.Mode())
		}
	}
	if b, err := os.ReadFile(victim); err != nil || string(b) != "not a journal" {
		t.Fatalf("the symlink's target: %q, %v", b, err)
	}
}

// tableDecode replays a journal from ARCHITECTURE.md's tables and rules
// alone ("The uploads journal", Format), written without decodeJournalFile:
// the snapshot when the file begins with its magic and passes the checks
// listed there, else none; then, from the snapshot's end (or offset 0),
// every valid record in order, and at an invalid one a skip to the next
// occurrence of the record magic after its first byte.
func tableDecode(b []byte) (pages map[layout.PageKey]bool, names map[string]bool) {
	pages, names = map[layout.PageKey]bool{}, map[string]bool{}
	le := binary.LittleEndian
	off := 0
	if len(b) >= 24 && string(b[:8]) == "KVPUPL1\n" {
		p, m := int64(le.Uint32(b[8:])), int64(le.Uint32(b[12:]))
		ok := p <= 1<<21 && m <= 1<<16 && 16+32*p+2*m+8 <= int64(len(b))
		var ks []layout.PageKey
		var ns []string
		o := 16
		for i := 0; ok && i < int(p); i++ {
			k := layout.PageKey(b[o : o+32])
			ok = i == 0 || bytes.Compare(ks[i-1][:], k[:]) < 0
			ks = append(ks, k)
			o += 32
		}
		for i := 0; ok && i < int(m); i++ {
			if o >= len(b)-8 {
				ok = false
				break
			}
			l := int(b[o])
			if l < 1 || l > 200 || o+1+l > len(b)-8 {
				ok = false
				break
			}
			n := string(b[o+1 : o+1+l])
			ok = layout.ValidName("snapshot", n) == nil && (i == 0 || ns[i-1] < n)
			ns = append(ns, n)
			o += 1 + l
		}
		if ok && le.Uint64(b[o:]) == xxh3.Hash(b[:o]) {
			for _, k := range ks {
				pages[k] = true
			}
			for _, n := range ns {
				names[n] = true
			}
			off = o + 8
		}
	}
	for off < len(b) {
		r := b[off:]
		valid := len(r) >= 14 && string(r[:4]) == "UPR\n" && r[4] >= 1 && r[4] <= 4
		var l int
		if valid {
			l = int(r[5])
			page := r[4] == 1 || r[4] == 2
			valid = (page && l == 32 || !page && l >= 1 && l <= 200) && 14+l <= len(r) &&
				le.Uint64(r[6+l:]) == xxh3.Hash(r[:6+l]) && (page || layout.ValidName("snapshot", string(r[6:6+l])) == nil)
		}
		if !valid {
			next := bytes.Index(r[1:], []byte("UPR\n"))
			if next < 0 {
				break
			}
			off += 1 + next
			continue
		}
		// Ops 1 and 3 queue (add), 2 and 4 settle (remove).
		if queued, p := r[4]%2 == 1, r[6:6+l]; r[4] <= 2 && queued {
			pages[layout.PageKey(p)] = true
		} else if r[4] <= 2 {
			delete(pages, layout.PageKey(p))
		} else if queued {
			names[string(p)] = true
		} else {
			delete(names, string(p))
		}
		off += 14 + l
	}
	return pages, names
}

// FuzzJournalTable: the decoder replays every input as the documented
// format says (tableDecode), so the tables are precise enough for an
// independent reader.
func FuzzJournalTable(f *testing.F) {
	k := testKeys(4)
	snap := encodeJournal(testKeys(3), []string{"a", "b-1"})
	f.Add(slices.Concat(snap, record(opPageSettled, k[0][:]), record(opManifestQueued, []byte("c")), []byte("UPR\n\x01"), record(opPageQueued, k[3][:])))
	f.Add(slices.Concat(snap[:len(snap)-1], record(opPageQueued, k[1][:])))
	f.Add(slices.Concat(record(opManifestQueued, []byte(".x")), record(opManifestSettled, []byte("a")), record(opPageQueued, k[2][:])[:30]))
	f.Add([]byte("KVPUPL1\n\x00\x00\x00\x00\x01\x00\x00\x00\x00UPR\n"))
	// A magic right after an invalid record's first bytes.
	f.Add(slices.Concat([]byte("UPR\n"), record(opPageQueued, k[1][:]), []byte("U"), record(opManifestQueued, []byte("d"))))
	f.Fuzz(func(t *testing.T, b []byte) {
		s, _, _, _ := decodeJournalFile(b)
		pages, names := tableDecode(b)
		if !maps.Equal(s.pages, pages) || !maps.Equal(s.manifests, names) {
			t.Fatalf("decoder: %d pages %v; the table: %d pages %v", len(s.pages), s.manifests, len(pages), names)
		}
	})
}
