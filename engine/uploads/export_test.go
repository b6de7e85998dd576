package uploads

import (
	"bytes"
	"context"
	"io"

	"github.com/kvpersist/kvpersist/engine/layout"
	"github.com/kvpersist/kvpersist/engine/vfs"
)

// Internals exported to the package's black-box tests.

// RefillWindowMaxBytes is refillWindowMaxBytes.
const RefillWindowMaxBytes = refillWindowMaxBytes

// ReplayJournalAt is replayJournalAt.
func ReplayJournalAt(r io.ReaderAt, size int64, window int) (s *Set, ignored int, problem error, records bool, err error) {
	return replayJournalAt(r, size, window)
}

// RecordPrefix is recordPrefix; DecodeRecordLen is decodeRecord's length.
func RecordPrefix(b []byte) bool { return recordPrefix(b) }

func DecodeRecordLen(b []byte) int {
	_, _, n := decodeRecord(b)
	return n
}

// WalkEntry is a refillEntry.
type WalkEntry struct {
	Off  int64
	Op   byte
	Key  layout.PageKey
	Name string
}

// memFile is a vfs.File reading from memory (ReadAt only).
type memFile struct {
	vfs.File
	r *bytes.Reader
}

func (f memFile) ReadAt(p []byte, off int64) (int, error) { return f.r.ReadAt(p, off) }

// WalkAll walks b as a refill's cursor does, in windows of window bytes,
// never stopping; it returns the entries read and where the cursor ended.
func WalkAll(b []byte, window int64) ([]WalkEntry, int64, error) {
	c := &refillCursor{f: memFile{r: bytes.NewReader(b)}}
	if err := c.readSnapshot(int64(len(b))); err != nil {
		return nil, 0, err
	}
	var got []WalkEntry
	_, _, err := c.walk(int64(len(b)), window, func(es []refillEntry) (int64, bool) {
		for _, e := range es {
			got = append(got, WalkEntry{Off: e.off, Op: e.op, Key: e.key, Name: e.name})
		}
		return 0, false
	})
	return got, c.off, err
}

// JournalBase returns the size ns's open journal's growth is measured
// from, and whether it is open (read on the goroutine).
func JournalBase(l *Ledger, ns string) (base int64, open bool, err error) {
	err = l.call(context.Background(), func() {
		if jf := l.files[ns]; jf != nil {
			base, open = jf.base, true
		}
	})
	return base, open, err
}

// NewIdle is a Ledger whose goroutine is not started: AddQueued and
// DropBatch only (BenchmarkJournalAdd).
func NewIdle() *Ledger {
	return &Ledger{batch: map[string]*batch{}, spilled: map[string]bool{}, touched: map[string]bool{}, wake: make(chan struct{}, 1)}
}

// AddQueued appends a queued record of page k to ns's batch, as a
// queueing does in its critical section.
func (l *Ledger) AddQueued(ns string, k layout.PageKey) {
	l.mu.Lock()
	l.addLocked(ns, OpPageQueued, k[:])
	l.mu.Unlock()
}

// DropBatch empties the batches, as the goroutine's write does.
func (l *Ledger) DropBatch() {
	l.mu.Lock()
	clear(l.batch)
	l.nbatch = 0
	l.mu.Unlock()
	select {
	case <-l.wake:
	default:
	}
}
