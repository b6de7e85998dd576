package uploads_test

import (
	"bytes"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/kvpersist/kvpersist/engine/layout"
	"github.com/kvpersist/kvpersist/engine/uploads"
)

// Reading a journal in windows: a replay's (a compaction reads files
// larger than its window) and a refill's cursor's.

// FuzzReplayJournalWindows: a journal replayed in windows of any size
// (each at least twice the largest record, the first holding any valid
// snapshot whole, as a compaction reads a file larger than a replay
// does) replays to what it replays to whole.
func FuzzReplayJournalWindows(f *testing.F) {
	k := testKeys(8)
	var recs []byte
	for i, key := range k {
		recs = append(recs, record(uploads.OpPageQueued, key[:])...)
		if i%2 == 0 {
			recs = append(recs, record(uploads.OpPageSettled, k[i/2][:])...)
		}
		recs = append(recs, "garbage UP"...)
	}
	recs = append(recs, record(uploads.OpManifestQueued, bytes.Repeat([]byte("m"), 200))...)
	f.Add(slices.Concat(uploads.EncodeSnapshot(testKeys(3), []string{"a"}), recs), uint16(300))
	f.Add(recs, uint16(250))
	f.Add(recs, uint16(len(recs)-3))
	// Garbage, then a record whose magic a window's end splits.
	f.Add(append(bytes.Repeat([]byte("x"), 2*uploads.MaxRecordBytes), record(uploads.OpPageQueued, k[0][:])...), uint16(2*uploads.MaxRecordBytes+2))
	f.Fuzz(func(t *testing.T, b []byte, w uint16) {
		window := max(int(w), 2*uploads.MaxRecordBytes)
		if _, _, snapEnd, err := uploads.DecodeSnapshot(b); err == nil {
			window = max(window, snapEnd)
		}
		whole, ignored, problem, records := uploads.Decode(b)
		s, ignored2, problem2, records2, err := uploads.ReplayJournalAt(bytes.NewReader(b), int64(len(b)), window)
		if err != nil || !maps.Equal(s.Pages, whole.Pages) || !maps.Equal(s.Manifests, whole.Manifests) ||
			ignored2 != ignored || (problem2 == nil) != (problem == nil) || records2 != records {
			t.Fatalf("windows of %d bytes: %d pages %v, %d ignored (%v), records %v; whole: %d pages %v, %d ignored (%v), records %v (%v)",
				window, len(s.Pages), s.Manifests, ignored2, problem2, records2, len(whole.Pages), whole.Manifests, ignored, problem, records, err)
		}
	})
}

// BenchmarkJournalAdd: what the uploads journal adds to a queueing's
// critical section per page queued: one record appended to the in-memory
// batch (the write and the fdatasync are the journal goroutine's; the
// queuer waits for them once per call, not per record). The batch is
// emptied every 4,096 records (as the goroutine does), untimed. The
// limit, measured in the same run: one lstat(2) of a file, which the
// queueing already makes for every page it queues; x-limit = lstat time
// / add time (above 1: the record costs less than the lstat).
func BenchmarkJournalAdd(b *testing.B) {
	l := uploads.NewIdle()
	keys := testKeys(4096)
	path := filepath.Join(b.TempDir(), "page")
	if err := os.WriteFile(path, []byte("x"), 0o644); err != nil {
		b.Fatal(err)
	}
	b.ReportAllocs()
	b.SetBytes(uploads.RecordOverhead + 32)
	var ours, limit time.Duration
	i := 0
	for b.Loop() {
		t0 := time.Now()
		l.AddQueued("ns", keys[i])
		ours += time.Since(t0)
		b.StopTimer()
		t0 = time.Now()
		if _, err := os.Lstat(path); err != nil {
			b.Fatal(err)
		}
		limit += time.Since(t0)
		if i++; i == len(keys) {
			i = 0
			l.DropBatch()
		}
		b.StartTimer()
	}
	// ns/op includes the timer's stops and starts around the limit.
	b.ReportMetric(float64(ours.Nanoseconds())/float64(b.N), "add-ns/op")
	b.ReportMetric(float64(limit.Nanoseconds())/float64(b.N), "lstat-ns/op")
	b.ReportMetric(float64(limit)/float64(ours), "x-limit")
}

// FuzzRefillWalk: a refill's reading of a journal (a snapshot's entries,
// then records, in windows; a tail that may be a record being appended
// left for later) reads the same entries whatever its windows, and
// replaying them (queued adds, settled removes) lists exactly what a
// replay of the whole file up to where the cursor stopped lists
// (uploads.Decode, the replay New runs).
func FuzzRefillWalk(f *testing.F) {
	keys := testKeys(4)
	snap := uploads.EncodeSnapshot(slices.Clone(keys[:2]), []string{"m-a", "m-b"})
	recs := slices.Concat(record(uploads.OpPageQueued, keys[2][:]), record(uploads.OpPageSettled, keys[0][:]), record(uploads.OpManifestQueued, []byte("m-c")), record(uploads.OpManifestSettled, []byte("m-a")))
	f.Add(slices.Concat(snap, recs), uint16(0))
	f.Add(slices.Concat(snap, recs, []byte("junk"), record(uploads.OpPageQueued, keys[3][:])), uint16(1))
	f.Add(slices.Concat(snap, recs, record(uploads.OpPageQueued, keys[3][:])[:20]), uint16(500))
	f.Add(slices.Concat(recs, snap, recs), uint16(3))
	f.Add(slices.Concat(snap[:len(snap)-1], []byte{0}, recs), uint16(7))
	// Torn records followed by whole ones (a write(2) that ended short).
	f.Add(slices.Concat(snap, record(uploads.OpManifestQueued, []byte(strings.Repeat("m", 60)))[:10], record(uploads.OpPageQueued, keys[3][:])), uint16(0))
	f.Add(slices.Concat(recs, record(uploads.OpPageQueued, keys[3][:])[:5], record(uploads.OpPageQueued, keys[1][:])), uint16(2))
	f.Fuzz(func(t *testing.T, b []byte, w uint16) {
		got, end := walkAll(t, b, int64(w))
		whole, wholeEnd := walkAll(t, b, int64(len(b))+uploads.RefillWindowMaxBytes)
		if len(b) <= uploads.RefillWindowMaxBytes && (end != wholeEnd || !slices.Equal(got, whole)) {
			t.Fatalf("windows of %d: %d entries, ended at %d; one window: %d entries, ended at %d", w, len(got), end, len(whole), wholeEnd)
		}
		s := &uploads.Set{Pages: map[layout.PageKey]bool{}, Manifests: map[string]bool{}}
		for _, e := range got {
			switch e.Op {
			case uploads.OpPageQueued:
				s.Pages[e.Key] = true
			case uploads.OpPageSettled:
				delete(s.Pages, e.Key)
			case uploads.OpManifestQueued:
				s.Manifests[e.Name] = true
			case uploads.OpManifestSettled:
				delete(s.Manifests, e.Name)
			}
		}
		want, _, _, _ := uploads.Decode(b[:end])
		if !maps.Equal(s.Pages, want.Pages) || !maps.Equal(s.Manifests, want.Manifests) {
			t.Fatalf("the walk lists %d pages and %v, the replay of its %d bytes %d pages and %v", len(s.Pages), s.Manifests, end, len(want.Pages), want.Manifests)
		}
		if end == int64(len(b)) {
			return
		}
		// Stopped before a tail it takes for a record being appended:
		// bytes that may begin one, after which no whole record begins
		// (appends are serialized: one would mean that write ended), so
		// the replay of the whole file lists what the walk lists.
		if !uploads.RecordPrefix(b[end:]) {
			t.Fatalf("the walk stopped at %d of %d bytes, before bytes that cannot begin a record", end, len(b))
		}
		for i := end; i < int64(len(b)); i++ {
			if uploads.DecodeRecordLen(b[i:]) > 0 {
				t.Fatalf("the walk stopped at %d of %d bytes, before a whole record at %d", end, len(b), i)
			}
		}
		if full, _, _, _ := uploads.Decode(b); !maps.Equal(full.Pages, want.Pages) || !maps.Equal(full.Manifests, want.Manifests) {
			t.Fatalf("the walk stopped at %d of %d bytes; the replay of the whole file lists %d pages and %v, of those bytes %d pages and %v", end, len(b), len(full.Pages), full.Manifests, len(want.Pages), want.Manifests)
		}
	})
}

// walkAll walks b as a refill's cursor does, in windows of window bytes,
// never stopping; it returns the entries read and where the cursor
// ended.
func walkAll(t *testing.T, b []byte, window int64) ([]uploads.WalkEntry, int64) {
	t.Helper()
	got, end, err := uploads.WalkAll(b, window)
	if err != nil {
		t.Fatal(err)
	}
	return got, end
}
