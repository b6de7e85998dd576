package engine

import (
	"bytes"
	"cmp"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/zeebo/xxh3"

	"github.com/kvpersist/kvpersist/engine/layout"
	"github.com/kvpersist/kvpersist/engine/store"
	"github.com/kvpersist/kvpersist/engine/vfs"
)

// The uploads journal's file (ARCHITECTURE.md, "The uploads journal"):
// an optional snapshot (the format an engine's Close wrote before
// records existed, and what a compaction writes) followed by records
// appended in batches. All integers little-endian.
//
// Snapshot:
//
//	0            8   magic "KVPUPL1\n"
//	8            4   u32 P, page entries
//	12           4   u32 M, manifest entries
//	16           32·P  page keys, raw, strictly ascending bytewise
//	16+32·P      M × (u8 L, L bytes of name): layout.ValidName names, strictly ascending
//	then         8   u64 XXH3-64 (seed 0) of every snapshot byte before it
//
// Record (14 + L bytes):
//
//	0   4   magic "UPR\n"
//	4   1   u8 op: 1 page queued, 2 page settled, 3 manifest queued, 4 manifest settled
//	5   1   u8 L: 32 for a page op (the key, raw), 1..200 for a manifest op (the name)
//	6   L   payload
//	6+L 8   u64 XXH3-64 (seed 0) of the record's bytes before it
const (
	journalMagic = "KVPUPL1\n"
	recordMagic  = "UPR\n"
	// maxJournalPages and maxJournalManifests bound one snapshot: 64 MiB
	// of page keys and at most 13 MB of names. Entries beyond them are
	// not kept by a compaction (logged): a later save naming them queues
	// them.
	maxJournalPages     = 1 << 21
	maxJournalManifests = 1 << 16
	maxNameBytes        = 200 // layout.ValidName
	// maxJournalBytes: a replay reads at most this much of a journal
	// (the rest is ignored, logged); a compaction reads all of it, in
	// windows of this many bytes. A compaction is
	// attempted once a file is 1 MiB plus twice its size after the last
	// one, so a file reaches it only when no compaction could take the
	// namespace's lock. It exceeds the largest snapshot (80,281,624
	// bytes), so a valid snapshot is always read whole.
	maxJournalBytes = 256 << 20
)

// Record operations.
const (
	opPageQueued      byte = 1
	opPageSettled     byte = 2
	opManifestQueued  byte = 3
	opManifestSettled byte = 4
	recordOverhead         = 4 + 1 + 1 + 8
	// maxRecordBytes: the largest valid record (a manifest op's name).
	maxRecordBytes = recordOverhead + maxNameBytes
)

// errJournal: journal bytes that do not decode (skipped, logged).
var errJournal = errors.New("engine: uploads journal")

// encodeJournal is the snapshot listing pages and manifests (either may
// be empty). It sorts both; the caller keeps each within its maximum.
func encodeJournal(pages []layout.PageKey, manifests []string) []byte {
	slices.SortFunc(pages, func(a, b layout.PageKey) int { return bytes.Compare(a[:], b[:]) })
	slices.Sort(manifests)
	b := make([]byte, 0, 24+32*len(pages)+(1+maxNameBytes)*len(manifests))
	b = append(b, journalMagic...)
	b = binary.LittleEndian.AppendUint32(b, uint32(len(pages)))
	b = binary.LittleEndian.AppendUint32(b, uint32(len(manifests)))
	for _, k := range pages {
		b = append(b, k[:]...)
	}
	for _, m := range manifests {
		b = append(b, byte(len(m)))
		b = append(b, m...)
	}
	return binary.LittleEndian.AppendUint64(b, xxh3.Hash(b))
}

// appendRecord appends the record of op with payload (a page key's 32
// bytes, or a manifest's name) to b.
func appendRecord(b []byte, op byte, payload []byte) []byte {
	start := len(b)
	b = append(b, recordMagic...)
	b = append(b, op, byte(len(payload)))
	b = append(b, payload...)
	return binary.LittleEndian.AppendUint64(b, xxh3.Hash(b[start:]))
}

// decodeSnapshot decodes the snapshot at the start of b: size, magic,
// counts against the size and the maxima, every record (keys and names
// strictly ascending, names valid), then the hash. end is where it ends
// in b. Every failure wraps errJournal.
func decodeSnapshot(b []byte) (pages []layout.PageKey, manifests []string, end int, err error) {
	bad := func(format string, a ...any) error {
		return fmt.Errorf("%w: snapshot: %s", errJournal, fmt.Sprintf(format, a...))
	}
	if len(b) < 24 {
		return nil, nil, 0, bad("%d bytes (want at least 24)", len(b))
	}
	if string(b[:8]) != journalMagic {
		return nil, nil, 0, bad("bad magic %q", b[:8])
	}
	np, nm := binary.LittleEndian.Uint32(b[8:]), binary.LittleEndian.Uint32(b[12:])
	if np > maxJournalPages || nm > maxJournalManifests || 16+32*int64(np)+2*int64(nm)+8 > int64(len(b)) {
		return nil, nil, 0, bad("%d pages and %d manifests do not fit in %d bytes", np, nm, len(b))
	}
	off := 16
	pages = make([]layout.PageKey, np)
	for i := range pages {
		copy(pages[i][:], b[off:off+32])
		off += 32
		if i > 0 && bytes.Compare(pages[i-1][:], pages[i][:]) >= 0 {
			return nil, nil, 0, bad("page %d is not after page %d", i, i-1)
		}
	}
	manifests = make([]string, 0, nm)
	for i := range int(nm) {
		if off >= len(b)-8 {
			return nil, nil, 0, bad("manifest %d past the end", i)
		}
		l := int(b[off])
		off++
		if l == 0 || off+l > len(b)-8 {
			return nil, nil, 0, bad("manifest %d: length %d", i, l)
		}
		name := string(b[off : off+l])
		off += l
		if err := layout.ValidName("snapshot", name); err != nil {
			return nil, nil, 0, bad("manifest %d: %v", i, err)
		}
		if i > 0 && strings.Compare(manifests[i-1], name) >= 0 {
			return nil, nil, 0, bad("manifest %d is not after manifest %d", i, i-1)
		}
		manifests = append(manifests, name)
	}
	if h := binary.LittleEndian.Uint64(b[off:]); h != xxh3.Hash(b[:off]) {
		return nil, nil, 0, bad("hash %016x, the bytes hash to %016x", h, xxh3.Hash(b[:off]))
	}
	return pages, manifests, off + 8, nil
}

// decodeRecord decodes the record at the start of b: n its length, 0
// when b does not start with a valid record (magic, op, length for the
// op, within b, hash, a valid name for a manifest op).
func decodeRecord(b []byte) (op byte, payload []byte, n int) {
	if len(b) < recordOverhead || string(b[:4]) != recordMagic {
		return 0, nil, 0
	}
	op, l := b[4], int(b[5])
	switch op {
	case opPageQueued, opPageSettled:
		if l != 32 {
			return 0, nil, 0
		}
	case opManifestQueued, opManifestSettled:
		if l == 0 {
			return 0, nil, 0
		}
	default:
		return 0, nil, 0
	}
	n = recordOverhead + l
	if len(b) < n || binary.LittleEndian.Uint64(b[6+l:]) != xxh3.Hash(b[:6+l]) {
		return 0, nil, 0
	}
	payload = b[6 : 6+l]
	if (op == opManifestQueued || op == opManifestSettled) && layout.ValidName("snapshot", string(payload)) != nil {
		return 0, nil, 0
	}
	return op, payload, n
}

// journalSet is what a journal lists: the uploads queued and not
// settled, after replaying its snapshot and records in order.
type journalSet struct {
	pages     map[layout.PageKey]bool
	manifests map[string]bool
}

func (s *journalSet) sortedPages() []layout.PageKey {
	out := make([]layout.PageKey, 0, len(s.pages))
	for k := range s.pages {
		out = append(out, k)
	}
	slices.SortFunc(out, func(a, b layout.PageKey) int { return bytes.Compare(a[:], b[:]) })
	return out
}

func (s *journalSet) sortedManifests() []string {
	out := make([]string, 0, len(s.manifests))
	for m := range s.manifests {
		out = append(out, m)
	}
	slices.Sort(out)
	return out
}

// decodeJournalFile replays a journal's bytes: the snapshot when b
// starts with its magic, then every record in order (queued adds an
// entry, settled removes it). Bytes that do not decode (a torn last
// record, garbage, a snapshot that fails its checks) are skipped up to
// the next record magic; ignored counts them and problem (wrapping
// errJournal) names the first. records reports whether b holds anything
// beyond a valid snapshot (so a compaction would change it).
func decodeJournalFile(b []byte) (s *journalSet, ignored int, problem error, records bool) {
	s, ignored, problem, records, _ = decodeJournalBytes(b, true)
	return s, ignored, problem, records
}

// decodeJournalBytes is decodeJournalFile of b, the first bytes of a
// journal: whole when final, else the file continues after b (see
// decodeRecords; end is where it stopped).
func decodeJournalBytes(b []byte, final bool) (s *journalSet, ignored int, problem error, records bool, end int) {
	s = &journalSet{pages: map[layout.PageKey]bool{}, manifests: map[string]bool{}}
	off := 0
	if len(b) >= 8 && string(b[:8]) == journalMagic {
		pages, manifests, end, err := decodeSnapshot(b)
		if err == nil {
			for _, k := range pages {
				s.pages[k] = true
			}
			for _, m := range manifests {
				s.manifests[m] = true
			}
			off = end
		} else {
			problem = err
		}
	}
	records = off < len(b)
	ignored, perr, n := decodeRecords(s, b[off:], final, int64(off))
	if problem == nil {
		problem = perr
	}
	return s, ignored, problem, records, off + n
}

// decodeRecords replays the records of b (at offset at of the file) into
// s, as scanRecords reads them (tail false).
func decodeRecords(s *journalSet, b []byte, final bool, at int64) (ignored int, problem error, end int) {
	return scanRecords(b, final, false, at, func(op byte, payload []byte, _ int) {
		switch op {
		case opPageQueued:
			s.pages[layout.PageKey(payload)] = true
		case opPageSettled:
			delete(s.pages, layout.PageKey(payload))
		case opManifestQueued:
			s.manifests[string(payload)] = true
		case opManifestSettled:
			delete(s.manifests, string(payload))
		}
	})
}

// scanRecords calls fn with each valid record of b (at offset at of the
// file) in order: its op, its payload (aliasing b) and its offset in b.
// It skips what does not decode up to the next record magic (ignored
// counts those bytes, problem names the first). final: b ends where the
// file ends; else it stops before the last maxRecordBytes-1 bytes of b
// unless a record ends beyond them (a record there may continue after
// b), and end is where it stopped (the next window starts there). tail,
// with final: bytes at the end of b that may be the first bytes of a
// record being appended (recordPrefix) stop it there, not skipped (a
// refill reads them again next time).
func scanRecords(b []byte, final, tail bool, at int64, fn func(op byte, payload []byte, off int)) (ignored int, problem error, end int) {
	off := 0
	for off < len(b) {
		if !final && len(b)-off < maxRecordBytes {
			break
		}
		op, payload, n := decodeRecord(b[off:])
		if n == 0 {
			if final && tail && recordPrefix(b[off:]) {
				break
			}
			skip := bytes.Index(b[off+1:], []byte(recordMagic))
			switch {
			case skip < 0 && final:
				skip = len(b) - off - 1
			case skip < 0:
				// A magic may begin in b's last bytes.
				skip = max(0, len(b)-(len(recordMagic)-1)-off-1)
			}
			if problem == nil {
				problem = fmt.Errorf("%w: %d bytes at offset %d are not a record", errJournal, skip+1, at+int64(off))
			}
			ignored += skip + 1
			off += skip + 1
			continue
		}
		fn(op, payload, off)
		off += n
	}
	return ignored, problem, off
}

// recordPrefix reports whether b, the last bytes of a file, may be the
// first bytes of a record whose write(2) is still going on: consistent
// with a record's magic and length so far, shorter than the record they
// announce, and followed by no whole record (wholeRecordAfter). Appends
// to a journal are serialized: within a process by the journal's single
// goroutine; across processes (which hold the namespace's lock shared,
// so it orders nothing among them) by O_APPEND with each batch one
// write(2) on a local file system, which holds the file's inode lock for
// the whole write. So a whole record after them means the write that
// left them has ended: they are a torn record, skipped as a replay skips
// them, never waited for.
func recordPrefix(b []byte) bool {
	if len(b) < len(recordMagic) {
		return string(b) == recordMagic[:len(b)]
	}
	if string(b[:len(recordMagic)]) != recordMagic {
		return false
	}
	if len(b) >= 6 && len(b) >= recordOverhead+int(b[5]) {
		return false
	}
	return !wholeRecordAfter(b)
}

// wholeRecordAfter reports whether a valid record (decodeRecord) begins
// in b after its first byte: where the record scan, resyncing at each
// record magic as a replay does, would read one.
func wholeRecordAfter(b []byte) bool {
	for i := 1; i < len(b); {
		k := bytes.Index(b[i:], []byte(recordMagic))
		if k < 0 {
			return false
		}
		i += k
		if _, _, n := decodeRecord(b[i:]); n > 0 {
			return true
		}
		i++
	}
	return false
}

// replayJournalAt replays the first size bytes of a journal read through
// r, in windows of at most window bytes (its memory): the first holds a
// valid snapshot whole (window exceeds the largest snapshot; tests use
// less), the next start where the last record decoded whole ended.
// err is a read error.
func replayJournalAt(r io.ReaderAt, size int64, window int) (s *journalSet, ignored int, problem error, records bool, err error) {
	window = max(window, 2*maxRecordBytes)
	buf := make([]byte, min(size, int64(window)))
	var pos int64
	for {
		n, rerr := r.ReadAt(buf[:min(int64(len(buf)), size-pos)], pos)
		if rerr != nil && !errors.Is(rerr, io.EOF) {
			return nil, 0, nil, false, rerr
		}
		final := rerr != nil || pos+int64(n) >= size
		var ig, end int
		var pr error
		if s == nil {
			s, ig, pr, records, end = decodeJournalBytes(buf[:n], final)
		} else {
			records = records || n > 0
			ig, pr, end = decodeRecords(s, buf[:n], final, pos)
		}
		ignored += ig
		if problem == nil {
			problem = pr
		}
		if final || end == 0 {
			return s, ignored, problem, records, nil
		}
		pos += int64(end)
	}
}

// openJournal opens the journal at path for reading: exists is false
// when there is none; st is the open file's Stat. A path that is not a
// regular file is an error wrapping errJournal.
func openJournal(fsys vfs.FS, path string) (f vfs.File, st os.FileInfo, exists bool, err error) {
	fi, err := fsys.Lstat(path)
	if vfs.IsNotExist(err) {
		return nil, nil, false, nil
	}
	if err != nil {
		return nil, nil, true, err
	}
	if !fi.Mode().IsRegular() {
		return nil, nil, true, fmt.Errorf("%w: %s is not a regular file (mode %v)", errJournal, path, fi.Mode())
	}
	f, err = fsys.Open(path)
	if err != nil {
		return nil, nil, true, err
	}
	st, err = f.Stat()
	if err == nil && !st.Mode().IsRegular() {
		err = fmt.Errorf("%w: %s is not a regular file (mode %v)", errJournal, path, st.Mode())
	}
	if err != nil {
		f.Close()
		return nil, nil, true, err
	}
	return f, st, true, nil
}

// Batching of the journal's writes.
const (
	// journalCommitEvery: the journal's files are fdatasync'd at most
	// this often once a queued record was written (a group commit of
	// every record written since), under the store's sync policy.
	// Records are written (write(2)) as soon as the goroutine wakes.
	journalCommitEvery = 10 * time.Millisecond
	// journalLazySync: files that received settled records only are
	// fdatasync'd at most this often: losing a settled record costs a
	// HEAD at the next start, not an upload, and uploads end far more
	// often than saves, so their fdatasyncs (each a file-system journal
	// commit, which a save's own fsyncs would wait behind) are spared.
	journalLazySync = time.Second
	// journalLockWait bounds a wait for a namespace's lock by the
	// journal's goroutine (another process's collect may hold it
	// exclusively for long): the records wait and are tried again after
	// it.
	journalLockWait = 200 * time.Millisecond
	// maxJournalBuffered bounds the records waiting to be written (all
	// namespaces); beyond it they are dropped (logged), as when the
	// journal cannot be written: those uploads are queued by the next
	// saves that name them.
	maxJournalBuffered = 1 << 17
	// journalCompactMin: a file is compacted once it is larger than
	// twice its size after the last compaction (or when first opened)
	// plus this.
	journalCompactMin = 1 << 20
	// journalCompactRetry: after a compaction that could not take the
	// namespace's exclusive lock, the next try waits this long.
	journalCompactRetry = 5 * time.Second
	// journalCloseCompactWait bounds Close's wait for the exclusive locks
	// of its compactions: a journal not compacted is still valid.
	journalCloseCompactWait = time.Second
	// maxJournalFiles: journals kept open at once (one per namespace
	// appended to); before another is opened, the one written least
	// recently is closed (fdatasync'd first when written since its last
	// one), so the descriptors do not grow with the namespaces saved into.
	maxJournalFiles = 64
	// journalWarnEvery: a namespace whose journal cannot be written (a
	// full disk, a directory in its place) is logged at most this often.
	journalWarnEvery = time.Minute
)

// journal appends the uploads journal's records, for every namespace, on
// one goroutine the tier owns (started by startJournal, stopped by
// close). add never blocks on I/O: it appends to an in-memory batch and
// wakes the goroutine, which writes each namespace's batch in one
// write(2) under the namespace's shared lock (so that a compaction,
// under the exclusive lock, never misses a record), and fdatasyncs the
// files at most every journalCommitEvery. It compacts a file grown past
// journalCompactMin + twice its compacted size, and at close every file
// it appended to. It also refills the upload queue from the journal
// after uploads were spilled (spill, drained).
type journal struct {
	t *tier

	mu      sync.Mutex
	batch   map[string][]byte // namespace -> records not yet written
	urgent  map[string]bool   // namespace -> its batch holds a queued record
	nbatch  int               // records in batch
	dropped int               // records dropped since the last log line
	spilled map[string]bool   // namespaces with uploads refused by a full queue
	refill  bool              // the queue drained after a spill: queue them from the journal
	touched map[string]bool   // namespaces to compact at close
	closed  bool

	wake chan struct{} // cap 1
	quit chan struct{}
	done chan struct{}

	// Owned by the goroutine (then by close).
	files    map[string]*journalFile
	bases    map[string]journalBase // journals closed to bound files, by namespace
	written  uint64                 // writes so far (journalFile.written)
	lastSync time.Time
	warned   map[string]time.Time // namespace -> last Warn of a failed write
	// compactions published (for tests).
	compactions int
	// readLimit: bytes of a journal a replay reads; 0 is
	// maxJournalBytes (tests lower it).
	readLimit int64
	// compactMin: journalCompactMin, when 0 (tests lower it; set before
	// the first add).
	compactMin int64
	// openMax: maxJournalFiles, when 0 (tests lower it).
	openMax int
	// cursors: where each namespace's refills stopped in its journal
	// (remote_journal_refill.go), at most cursorMax.
	cursors map[string]*refillCursor
	// cursorMax: maxRefillCursors, when 0 (tests lower it).
	cursorMax int
	refills   uint64 // refills of a namespace so far (refillCursor.used)
}

func (j *journal) limit() int64 {
	if j.readLimit > 0 {
		return j.readLimit
	}
	return maxJournalBytes
}

// journalFile is a namespace's journal opened for appending.
type journalFile struct {
	f           vfs.AppendFile
	fi          os.FileInfo // its Stat at open: the path is checked against it
	base        int64       // its size when opened (after a compaction: the snapshot's)
	dirty       bool        // written since its last fdatasync (never with NoSync)
	urgent      bool        // and one of those writes held a queued record
	newEntry    bool        // created by this open: the directory is synced after its first fdatasync
	nextCompact time.Time   // no compaction attempt before
	written     uint64      // journal.written at its last write (the least recent is closed first)
}

// journalBase is what a journal closed to bound the files open keeps for
// its next open, when the path still names the same file.
type journalBase struct {
	fi   os.FileInfo
	base int64
}

func startJournal(t *tier) *journal {
	j := &journal{t: t, batch: map[string][]byte{}, urgent: map[string]bool{}, spilled: map[string]bool{}, touched: map[string]bool{},
		wake: make(chan struct{}, 1), quit: make(chan struct{}), done: make(chan struct{}), files: map[string]*journalFile{}, warned: map[string]time.Time{}, cursors: map[string]*refillCursor{}}
	go j.run()
	return j
}

// add appends a record of op for namespace ns to the batch and wakes the
// goroutine. After close it does nothing: the uploader has stopped, so
// nothing is queued or settled any more.
func (j *journal) add(ns string, op byte, payload []byte) {
	j.mu.Lock()
	if j.closed {
		j.mu.Unlock()
		return
	}
	if j.nbatch >= maxJournalBuffered {
		j.dropped++
		j.mu.Unlock()
		return
	}
	j.batch[ns] = appendRecord(j.batch[ns], op, payload)
	if op == opPageQueued || op == opManifestQueued {
		j.urgent[ns] = true
	}
	j.nbatch++
	j.touched[ns] = true
	j.mu.Unlock()
	j.poke()
}

func (j *journal) poke() {
	select {
	case j.wake <- struct{}{}:
	default:
	}
}

// touch marks namespace ns's journal for compaction at close (New found
// records or undecodable bytes in it).
func (j *journal) touch(ns string) {
	j.mu.Lock()
	j.touched[ns] = true
	j.mu.Unlock()
}

// journalQueued appends p's queued record.
func (t *tier) journalQueued(p *pendingUpload) {
	if p.manifest {
		t.j.add(p.ns, opManifestQueued, []byte(p.name))
	} else {
		t.j.add(p.ns, opPageQueued, p.key[:])
	}
}

// spill records that namespace ns has an upload the full queue refused
// (its queued record is in the journal).
func (j *journal) spill(ns string) {
	j.mu.Lock()
	j.spilled[ns] = true
	j.mu.Unlock()
	// The queue may have drained since it refused the upload, with no
	// upload left to report it.
	j.drained()
}

// drained is called after every upload left the queue: once the queue
// holds at most half its capacity, the uploads spilled meanwhile are
// queued from the journal by the goroutine.
func (j *journal) drained() {
	j.mu.Lock()
	want := len(j.spilled) > 0 && !j.refill
	j.mu.Unlock()
	if !want || j.t.up.Stats().Queued > j.t.up.QueueLen()/2 {
		return
	}
	j.mu.Lock()
	j.refill = true
	j.mu.Unlock()
	j.poke()
}

func (j *journal) run() {
	defer close(j.done)
	timer := time.NewTimer(time.Hour)
	timer.Stop()
	defer timer.Stop()
	for {
		select {
		case <-j.quit:
			return
		case <-j.wake:
		case <-timer.C:
		}
		left := len(j.flushWithin(journalLockWait)) > 0
		if j.refillQueue() {
			left = true
		}
		j.compactGrown()
		// Again later: records left (a lock not taken), or a sync due.
		var again time.Duration
		if left {
			again = journalLockWait
		}
		if due, ok := j.syncDue(); ok {
			d := max(time.Millisecond, time.Until(due))
			if again == 0 || d < again {
				again = d
			}
		}
		if again > 0 {
			timer.Reset(again)
		}
	}
}

// syncDue is when the files written since the last sync are due for
// theirs: journalCommitEvery after it when one holds a queued record,
// else journalLazySync after it; ok is false when none was written.
func (j *journal) syncDue() (due time.Time, ok bool) {
	wait := time.Duration(0)
	for _, f := range j.files {
		switch {
		case f.urgent:
			return j.lastSync.Add(journalCommitEvery), true
		case f.dirty:
			wait = journalLazySync
		}
	}
	return j.lastSync.Add(wait), wait > 0
}

// flushWithin is flush with each lock waited for at most wait.
func (j *journal) flushWithin(wait time.Duration) (left map[string]bool) {
	ctx, cancel := context.WithTimeout(context.Background(), wait)
	defer cancel()
	return j.flush(ctx)
}

// flush writes every namespace's batch (one write each, under its shared
// lock, taken within ctx), then fdatasyncs the files written when they
// are due (syncDue). A batch whose lock was not granted within ctx waits
// for the next flush: left holds its namespace. A batch whose lock
// cannot be taken (the namespace's directory gone) or whose write fails
// is dropped (logged at most once a minute per namespace).
func (j *journal) flush(ctx context.Context) (left map[string]bool) {
	j.mu.Lock()
	batch, urgent := j.batch, j.urgent
	j.batch, j.urgent = map[string][]byte{}, map[string]bool{}
	j.nbatch = 0
	dropped := j.dropped
	j.dropped = 0
	j.mu.Unlock()
	if dropped > 0 {
		j.t.e.logSafe(slog.LevelWarn, "kvpersist: uploads journal records dropped (too many waiting); those uploads are queued by the next saves that name them", "records", dropped)
	}
	st := j.t.e.store
	for ns, b := range batch {
		n, err := st.Namespace(ns)
		if err != nil {
			continue
		}
		unlock, err := n.Lock(ctx, false)
		if err != nil && ctx.Err() != nil && errors.Is(err, context.Cause(ctx)) {
			// Not granted in time: the next round.
			j.putBack(ns, b, urgent[ns])
			if left == nil {
				left = map[string]bool{}
			}
			left[ns] = true
			continue
		}
		if err == nil {
			// Else the lock cannot be taken at all (the namespace's
			// directory gone): dropped as a batch not written.
			err = j.write(n, b, urgent[ns])
			unlock()
		}
		if err != nil && time.Since(j.warned[ns]) >= journalWarnEvery {
			j.warned[ns] = time.Now()
			j.t.e.logSafe(slog.LevelWarn, "kvpersist: uploads journal not written; its uploads are queued by the next saves that name them", "path", n.UploadsPath(), "records", countRecords(b), "err", err)
		}
	}
	if due, ok := j.syncDue(); ok && !time.Now().Before(due) {
		j.sync()
	}
	return left
}

// putBack returns a batch not written to the front of ns's batch.
func (j *journal) putBack(ns string, b []byte, urgent bool) {
	j.mu.Lock()
	j.batch[ns] = append(b, j.batch[ns]...)
	j.urgent[ns] = j.urgent[ns] || urgent
	j.nbatch += countRecords(b)
	j.mu.Unlock()
}

// countRecords counts the records of a batch (well formed: built by
// appendRecord).
func countRecords(b []byte) int {
	n := 0
	for len(b) >= recordOverhead {
		b = b[recordOverhead+int(b[5]):]
		n++
	}
	return n
}

// write appends b (urgent: it holds a queued record) to n's journal (the namespace's shared lock held): the
// file is opened, or opened again when the path no longer names the file
// open (a compaction renamed a new one over it).
func (j *journal) write(n *store.Namespace, b []byte, urgent bool) error {
	jf, err := j.file(n)
	if err != nil {
		return err
	}
	j.written++
	jf.written = j.written
	if _, err := jf.f.Write(b); err != nil {
		// Part of it may be in the file: a reader skips a torn record.
		j.closeFile(n.Name())
		return err
	}
	if j.t.e.store.Durable() { // with NoSync, nothing is ever synced
		jf.dirty = true
		jf.urgent = jf.urgent || urgent
	}
	return nil
}

// file returns n's journal open for appending (lock held).
func (j *journal) file(n *store.Namespace) (*journalFile, error) {
	fsys := j.t.e.store.FS()
	path := n.UploadsPath()
	fi, lerr := fsys.Lstat(path)
	jf := j.files[n.Name()]
	if jf != nil && lerr == nil && os.SameFile(fi, jf.fi) {
		return jf, nil
	}
	if jf != nil {
		j.closeFile(n.Name())
	}
	if lerr != nil && !vfs.IsNotExist(lerr) {
		return nil, lerr
	}
	if len(j.files) >= cmp.Or(j.openMax, maxJournalFiles) {
		j.closeLeastRecent()
	}
	f, err := fsys.OpenAppend(path, layout.FilePerm)
	if err != nil {
		return nil, err
	}
	st, err := f.Stat()
	if err == nil && !st.Mode().IsRegular() {
		err = fmt.Errorf("%w: %s is not a regular file (mode %v)", errJournal, path, st.Mode())
	}
	if err != nil {
		f.Close()
		return nil, err
	}
	jf = &journalFile{f: f, fi: st, base: st.Size(), newEntry: lerr != nil}
	if b, ok := j.bases[n.Name()]; ok {
		// Closed to bound the files open: its growth is still measured
		// from its size when first opened (or last compacted).
		if os.SameFile(b.fi, st) {
			jf.base = b.base
		}
		delete(j.bases, n.Name())
	}
	j.files[n.Name()] = jf
	return jf, nil
}

// closeLeastRecent closes the file written least recently, remembering
// its base for its next open.
func (j *journal) closeLeastRecent() {
	ns, ok := leastRecent(j.files, func(jf *journalFile) uint64 { return jf.written })
	if !ok {
		return
	}
	old := j.files[ns]
	if j.bases == nil {
		j.bases = map[string]journalBase{}
	}
	j.bases[ns] = journalBase{fi: old.fi, base: old.base}
	j.closeFile(ns)
}

// leastRecent returns the key of m whose value has the smallest stamp
// (ok false when m is empty).
func leastRecent[V any](m map[string]V, stamp func(V) uint64) (key string, ok bool) {
	var least uint64
	for k, v := range m {
		if s := stamp(v); !ok || s < least {
			key, least, ok = k, s, true
		}
	}
	return key, ok
}

// closeFile closes ns's file, after a last fdatasync (and the directory's,
// when this engine created the file and has not synced it yet) when it
// was written since its last one (its records may be what a compaction
// read).
func (j *journal) closeFile(ns string) {
	jf := j.files[ns]
	if jf == nil {
		return
	}
	delete(j.files, ns)
	if jf.dirty { // set only under a syncing store
		j.syncFile(ns, jf)
	}
	jf.f.Close()
}

// syncFile fdatasyncs ns's file jf (and the namespace directory when this
// engine created the file and has not synced it yet). A failure is
// logged: records written since its last sync may be lost at a power
// loss.
func (j *journal) syncFile(ns string, jf *journalFile) error {
	err := jf.f.Sync()
	if err == nil && jf.newEntry {
		if n, nerr := j.t.e.store.Namespace(ns); nerr == nil {
			err = j.t.e.store.SyncDir(n.Dir())
		}
	}
	if err != nil {
		j.t.e.logSafe(slog.LevelWarn, "kvpersist: uploads journal not synced; its latest records may be lost at a power loss", "namespace", ns, "err", err)
	}
	return err
}

// sync fdatasyncs every file written since its last sync (and the
// namespace directory after the first sync of a file this engine
// created). A file whose sync failed is closed (a failed fdatasync is
// never retried on the same file) and logged: records of it written
// since its last sync may be lost at a power loss.
func (j *journal) sync() {
	j.lastSync = time.Now()
	for ns, jf := range j.files {
		if !jf.dirty {
			continue
		}
		if j.syncFile(ns, jf) != nil {
			delete(j.files, ns)
			jf.f.Close()
			continue
		}
		jf.dirty, jf.urgent, jf.newEntry = false, false, false
	}
}

// refillQueue queues from the journal the uploads spilled since the last
// refill (the queue has drained to half): each marked namespace's
// journal is read from where its last refill stopped (refillNamespace,
// remote_journal_refill.go), until the queue refuses a page. The batches
// are written first: a spill's queued record may have been added after
// this round's flush, and the refill reads only the file. A namespace
// whose batch could not be written (its lock not taken), or whose refill
// stopped at a page another goroutine is queueing, stays marked, and the
// refill is tried again after journalLockWait (again).
func (j *journal) refillQueue() (again bool) {
	j.mu.Lock()
	if !j.refill {
		j.mu.Unlock()
		return false
	}
	j.refill = false
	spilled := j.spilled
	j.spilled = map[string]bool{}
	j.mu.Unlock()
	j.t.mu.Lock()
	closing := j.t.closing
	j.t.mu.Unlock()
	if closing {
		return false // the next start queues them
	}
	left := j.flushWithin(journalLockWait)
	for ns := range spilled {
		if left[ns] || j.refillNamespace(ns) {
			j.mu.Lock()
			j.spilled[ns], j.refill = true, true
			j.mu.Unlock()
			again = true
		}
	}
	j.t.queueDepth()
	return again
}

// compactGrown compacts each open file grown past its threshold, each
// within journalLockWait (else tried again after journalCompactRetry).
func (j *journal) compactGrown() {
	for ns, jf := range j.files {
		if time.Now().Before(jf.nextCompact) {
			continue
		}
		st, err := jf.f.Stat()
		if err != nil || st.Size() <= 2*jf.base+cmp.Or(j.compactMin, journalCompactMin) {
			continue
		}
		ctx, cancel := context.WithTimeout(context.Background(), journalLockWait)
		ok := j.compact(ctx, ns)
		cancel()
		if !ok {
			if jf := j.files[ns]; jf != nil {
				jf.nextCompact = time.Now().Add(journalCompactRetry)
			}
		}
	}
}

// compact rewrites namespace ns's journal as the snapshot of what it
// lists, under the namespace's exclusive lock (taken within ctx): so no
// process appends meanwhile, and each finds the new file at its next
// append. The file is read (all processes' records), replayed, and
// published with the durable publish (temp file, fdatasync, rename,
// directory fsync, under the store's sync policy); a file that is a
// snapshot alone already is left. The whole file is replayed, also
// beyond what a replay reads (maxJournalBytes), in windows of that many
// bytes. Entries beyond a snapshot's maxima are dropped (logged). It
// reports whether the lock was taken.
func (j *journal) compact(ctx context.Context, ns string) bool {
	st := j.t.e.store
	n, err := st.Namespace(ns)
	if err != nil {
		return true
	}
	unlock, err := n.Lock(ctx, true)
	if err != nil {
		return false
	}
	defer unlock()
	fsys := st.FS()
	path := n.UploadsPath()
	if fi, err := fsys.Lstat(n.Dir()); err != nil || !fi.IsDir() {
		return true // gone, or not ours to write into
	}
	set, canonical, ok := j.readWhole(path)
	if !ok || canonical {
		return true
	}
	pl, ml := set.sortedPages(), set.sortedManifests()
	if len(pl) > maxJournalPages || len(ml) > maxJournalManifests {
		j.t.e.logSafe(slog.LevelWarn, "kvpersist: uploads journal full; the uploads beyond it are queued by the next saves that name them", "namespace", ns, "pages", len(pl), "manifests", len(ml))
		pl = pl[:min(len(pl), maxJournalPages)]
		ml = ml[:min(len(ml), maxJournalManifests)]
	}
	b := encodeJournal(pl, ml)
	err = layout.Publish(fsys, path, st.PublishOptions(true, int64(len(b))), func(f vfs.File) error {
		return layout.WriteFull(f, b, 0)
	})
	if err != nil {
		j.t.e.logSafe(slog.LevelWarn, "kvpersist: uploads journal not compacted", "path", path, "err", err)
		return true
	}
	// The file open is the one renamed over: the next write opens the
	// new, the next refill reads the new from its start.
	j.closeFile(ns)
	j.replacedCursor(ns)
	j.compactions++
	return true
}

// read reads and replays the journal at path (its first readLimit
// bytes: maxJournalBytes), logging (Warn) what it ignores. ok is false
// when there is no journal or it cannot be read; canonical reports a file
// that is a valid snapshot alone (a compaction would not change it).
func (j *journal) read(path string) (set *journalSet, canonical, ok bool) {
	return j.readJournal(path, false)
}

// readWhole is read of the whole file, in windows of readLimit bytes: a
// compaction's, which must keep everything the file lists.
func (j *journal) readWhole(path string) (set *journalSet, canonical, ok bool) {
	return j.readJournal(path, true)
}

func (j *journal) readJournal(path string, whole bool) (set *journalSet, canonical, ok bool) {
	f, st, exists, err := openJournal(j.t.e.store.FS(), path)
	if !exists {
		return nil, false, false
	}
	if err == nil {
		defer f.Close()
		size := st.Size()
		n := size
		if !whole && size > j.limit() {
			n = j.limit()
			j.t.e.logSafe(slog.LevelWarn, "kvpersist: uploads journal ignored in part", "path", path,
				"err", fmt.Errorf("%w: %s is %d bytes, only the first %d are read", errJournal, path, size, n))
		}
		var ignored int
		var problem error
		set, ignored, problem, canonical, err = replayJournalAt(f, n, int(j.limit()))
		canonical = !canonical && n == size
		if err == nil && ignored > 0 {
			j.t.e.logSafe(slog.LevelWarn, "kvpersist: uploads journal ignored in part (bytes that do not decode: a torn last record, or damage)", "path", path, "bytes", ignored, "err", problem)
		}
	}
	if err != nil {
		j.t.e.logSafe(slog.LevelWarn, "kvpersist: uploads journal ignored; its uploads are queued by the next saves that name them", "path", path, "err", err)
		return nil, false, false
	}
	return set, canonical, true
}

// close stops the goroutine, then (on the caller's goroutine) writes the
// last batches (the namespace locks taken within ctx, each tried at
// least once), fdatasyncs them, compacts every journal this engine
// appended to or found with records at start (each exclusive lock waited
// for within ctx and at most journalCloseCompactWait in all), and closes
// the files. Records added after it are dropped: the uploader has
// stopped before it.
func (j *journal) close(ctx context.Context) {
	close(j.quit)
	<-j.done
	j.flush(ctx)
	j.mu.Lock()
	j.closed = true
	touched, left := j.touched, j.nbatch
	j.batch = nil
	j.mu.Unlock()
	if left > 0 {
		j.t.e.logSafe(slog.LevelWarn, "kvpersist: uploads journal records not written at close (a namespace lock not taken in time); those uploads are queued by the next saves that name them", "records", left)
	}
	if j.t.e.store.Durable() {
		j.sync()
	}
	// A compaction is an optimisation: its wait for the exclusive lock
	// (which writers of other processes may keep from it) is bounded.
	cctx, cancel := context.WithTimeout(ctx, journalCloseCompactWait)
	defer cancel()
	for ns := range touched {
		j.compact(cctx, ns)
	}
	for ns := range j.files {
		j.closeFile(ns)
	}
	for ns := range j.cursors {
		j.dropCursor(ns)
	}
}
