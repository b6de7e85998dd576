package uploads

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"sync"
	"time"

	"github.com/kvpersist/kvpersist/engine/layout"
	"github.com/kvpersist/kvpersist/engine/store"
	"github.com/kvpersist/kvpersist/engine/vfs"
)

// Batching of the journal's writes.
const (
	// journalLazySync: files that received settled records only are
	// fdatasync'd at most this often: losing a settled record costs a
	// HEAD at the next start, not an upload, and uploads end far more
	// often than saves, so their fdatasyncs (each a file-system journal
	// commit, which a save's own fsyncs would wait behind) are spared.
	// A file holding a queued record is fdatasync'd at once: its queuer
	// waits for it (EnqueuePages), and the records added meanwhile share
	// the next fdatasync (a group commit).
	journalLazySync = time.Second
	// journalLockWait bounds a wait for a namespace's lock by the
	// journal's goroutine (another process's collect may hold it
	// exclusively for long): the records wait and are tried again after
	// it, and their queuers stop waiting for them.
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

// Ledger is the uploads' state and journal (see the package doc). Its
// journal is written by one goroutine it owns (started by Open, stopped
// by Close): a record is appended to an in-memory batch in the critical
// section of the state change it records, and the goroutine writes each
// namespace's batch in one write(2) under the namespace's shared lock (so
// that a compaction, under the exclusive lock, never misses a record),
// then fdatasyncs the files. It compacts a file grown past
// journalCompactMin + twice its compacted size, and at Close every file
// it appended to. It also refills the upload queue from the journal
// after uploads were spilled.
type Ledger struct {
	cfg Config
	st  *store.Store
	q   Queue
	log func(level slog.Level, msg string, args ...any)

	// mu guards the state and the batches: every change of the one is
	// recorded in the other in the same critical section.
	mu sync.Mutex
	// pending: object name -> upload registered (being handed to the
	// queue, queued or in flight).
	pending map[string]*Pending
	// retries: "<ns>/<name>" -> a manifest waiting to be queued again;
	// requeueing: re-queues of a manifest running (requeueTicket).
	retries    map[string]*manifestRetry
	requeueing map[string]int
	closing    bool // Close began: no manifest is scheduled again
	// known: per namespace, pages known stored remotely -> when learnt;
	// nknown counts them (at most Config.KnownPages).
	known  map[string]map[layout.PageKey]time.Time
	nknown int

	batch   map[string]*batch // namespace -> records not yet written
	nbatch  int               // records in batch
	dropped int               // records dropped since the last log line
	spilled map[string]bool   // namespaces with uploads refused by a full queue
	refill  bool              // the queue drained after a spill: queue them from the journal
	touched map[string]bool   // namespaces to compact at close
	closed  bool

	retryWG sync.WaitGroup // the retry timers' callbacks
	wake    chan struct{}  // cap 1
	quit    chan struct{}
	done    chan struct{}
	calls   chan func() // run on the goroutine (Refill)

	// Owned by the goroutine (then by Close).
	files    map[string]*journalFile
	bases    map[string]journalBase // journals closed to bound files, by namespace
	written  uint64                 // writes so far (journalFile.written)
	lastSync time.Time
	warned   map[string]time.Time // namespace -> last Warn of a failed write
	// cursors: where each namespace's refills stopped in its journal
	// (refill.go), at most Config.CursorMax.
	cursors map[string]*refillCursor
	refills uint64 // refills of a namespace so far (refillCursor.used)
}

// batch is a namespace's records not yet written, and the queuers
// waiting for them to be durable.
type batch struct {
	b       []byte
	waiters []*commit
}

// commit is a queuer's wait for its records: done is closed once they
// are durable (err nil), or once they will not be soon (err: written at a
// later round, or dropped).
type commit struct {
	done chan struct{}
	err  error
}

func (c *commit) release(err error) {
	c.err = err
	close(c.done)
}

// wait blocks until the commit is released.
func (c *commit) wait() error {
	<-c.done
	return c.err
}

// errDeferred: a batch's namespace lock was not granted within
// journalLockWait; its records are written at a later round.
var errDeferred = errors.New("uploads: journal records deferred (the namespace's lock is held)")

func releaseAll(ws []*commit, err error) {
	for _, c := range ws {
		c.release(err)
	}
}

func (l *Ledger) limit() int64 {
	return cmp.Or(l.cfg.ReadLimit, maxJournalBytes)
}

// journalFile is a namespace's journal opened for appending.
type journalFile struct {
	f           vfs.AppendFile
	fi          os.FileInfo // its Stat at open: the path is checked against it
	base        int64       // its size when opened (after a compaction: the snapshot's)
	dirty       bool        // written since its last fdatasync (never with NoSync)
	waiters     []*commit   // queuers waiting for its next fdatasync
	newEntry    bool        // created by this open: the directory is synced after its first fdatasync
	nextCompact time.Time   // no compaction attempt before
	written     uint64      // Ledger.written at its last write (the least recent is closed first)
}

// journalBase is what a journal closed to bound the files open keeps for
// its next open, when the path still names the same file.
type journalBase struct {
	fi   os.FileInfo
	base int64
}

// addLocked appends a record of op for namespace ns to the batch and
// wakes the goroutine; l.mu held. For a queued record it returns the
// commit its queuer may wait for. After Close it does nothing: the queue
// has stopped, so nothing is queued or settled any more.
func (l *Ledger) addLocked(ns string, op byte, payload []byte) *commit {
	if l.closed {
		return nil
	}
	if l.nbatch >= maxJournalBuffered {
		l.dropped++
		return nil
	}
	b := l.batch[ns]
	if b == nil {
		b = &batch{}
		l.batch[ns] = b
	}
	b.b = AppendRecord(b.b, op, payload)
	var c *commit
	if op == OpPageQueued || op == OpManifestQueued {
		// One commit for all the batch's records: they are written and
		// synced together.
		if len(b.waiters) == 0 {
			b.waiters = []*commit{{done: make(chan struct{})}}
		}
		c = b.waiters[0]
	}
	l.nbatch++
	l.touched[ns] = true
	l.poke()
	return c
}

func (l *Ledger) poke() {
	select {
	case l.wake <- struct{}{}:
	default:
	}
}

// drained is called after an upload left the queue (or a spill): once
// the queue holds at most half its capacity, the uploads spilled
// meanwhile are queued from the journal by the goroutine.
func (l *Ledger) drained() {
	l.mu.Lock()
	want := len(l.spilled) > 0 && !l.refill
	l.mu.Unlock()
	if !want {
		return
	}
	if free, capacity := l.q.Room(); capacity-free > capacity/2 {
		return
	}
	l.mu.Lock()
	l.refill = true
	l.mu.Unlock()
	l.poke()
}

func (l *Ledger) run() {
	defer close(l.done)
	timer := time.NewTimer(time.Hour)
	timer.Stop()
	defer timer.Stop()
	for {
		select {
		case <-l.quit:
			return
		case fn := <-l.calls:
			fn()
			continue
		case <-l.wake:
		case <-timer.C:
		}
		left := len(l.flushWithin(journalLockWait)) > 0
		if l.refillQueue() {
			left = true
		}
		l.compactGrown()
		// Again later: records left (a lock not taken), or a sync due.
		var again time.Duration
		if left {
			again = journalLockWait
		}
		if due, ok := l.syncDue(); ok {
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
// theirs: now when one holds a queued record (its queuer waits), else
// journalLazySync after the last sync; ok is false when none was
// written.
func (l *Ledger) syncDue() (due time.Time, ok bool) {
	wait := time.Duration(0)
	for _, f := range l.files {
		switch {
		case len(f.waiters) > 0:
			return time.Now(), true
		case f.dirty:
			wait = journalLazySync
		}
	}
	return l.lastSync.Add(wait), wait > 0
}

// flushWithin is flush with each lock waited for at most wait.
func (l *Ledger) flushWithin(wait time.Duration) (left map[string]bool) {
	ctx, cancel := context.WithTimeout(context.Background(), wait)
	defer cancel()
	return l.flush(ctx)
}

// flush writes every namespace's batch (one write each, under its shared
// lock, taken within ctx), then fdatasyncs the files written when they
// are due (syncDue). A batch whose lock was not granted within ctx waits
// for the next flush: left holds its namespace, and its queuers stop
// waiting (errDeferred). A batch whose lock cannot be taken (the
// namespace's directory gone) or whose write fails is dropped (logged at
// most once a minute per namespace), its queuers released with the error.
func (l *Ledger) flush(ctx context.Context) (left map[string]bool) {
	l.mu.Lock()
	batches := l.batch
	l.batch = map[string]*batch{}
	l.nbatch = 0
	dropped := l.dropped
	l.dropped = 0
	l.mu.Unlock()
	if dropped > 0 {
		l.log(slog.LevelWarn, "kvpersist: uploads journal records dropped (too many waiting); those uploads are queued by the next saves that name them", "records", dropped)
	}
	for ns, b := range batches {
		n, err := l.st.Namespace(ns)
		if err != nil {
			releaseAll(b.waiters, err)
			continue
		}
		unlock, err := n.Lock(ctx, false)
		if err != nil && ctx.Err() != nil && errors.Is(err, context.Cause(ctx)) {
			// Not granted in time: the next round.
			releaseAll(b.waiters, errDeferred)
			l.putBack(ns, b.b)
			if left == nil {
				left = map[string]bool{}
			}
			left[ns] = true
			continue
		}
		if err == nil {
			// Else the lock cannot be taken at all (the namespace's
			// directory gone): dropped as a batch not written.
			err = l.write(n, b)
			unlock()
		}
		if err != nil {
			releaseAll(b.waiters, err)
			if time.Since(l.warned[ns]) >= journalWarnEvery {
				l.warned[ns] = time.Now()
				l.log(slog.LevelWarn, "kvpersist: uploads journal not written; its uploads are queued by the next saves that name them", "path", n.UploadsPath(), "records", countRecords(b.b), "err", err)
			}
		}
	}
	if due, ok := l.syncDue(); ok && !time.Now().Before(due) {
		l.sync()
	}
	return left
}

// putBack returns records not written to the front of ns's batch.
func (l *Ledger) putBack(ns string, b []byte) {
	l.mu.Lock()
	nb := l.batch[ns]
	if nb == nil {
		nb = &batch{}
		l.batch[ns] = nb
	}
	nb.b = append(b, nb.b...)
	l.nbatch += countRecords(b)
	l.mu.Unlock()
}

// countRecords counts the records of a batch (well formed: built by
// AppendRecord).
func countRecords(b []byte) int {
	n := 0
	for len(b) >= RecordOverhead {
		b = b[RecordOverhead+int(b[5]):]
		n++
	}
	return n
}

// write appends b's records to n's journal (the namespace's shared lock
// held): the file is opened, or opened again when the path no longer
// names the file open (a compaction renamed a new one over it). b's
// queuers wait for the file's next fdatasync; with NoSync (nothing is
// ever synced) they are released once written.
func (l *Ledger) write(n *store.Namespace, b *batch) error {
	jf, err := l.file(n)
	if err != nil {
		return err
	}
	l.written++
	jf.written = l.written
	if _, err := jf.f.Write(b.b); err != nil {
		// Part of it may be in the file: a reader skips a torn record.
		l.closeFile(n.Name())
		return err
	}
	if !l.st.Durable() {
		releaseAll(b.waiters, nil)
		return nil
	}
	jf.dirty = true
	jf.waiters = append(jf.waiters, b.waiters...)
	return nil
}

// file returns n's journal open for appending (lock held).
func (l *Ledger) file(n *store.Namespace) (*journalFile, error) {
	fsys := l.st.FS()
	path := n.UploadsPath()
	fi, lerr := fsys.Lstat(path)
	jf := l.files[n.Name()]
	if jf != nil && lerr == nil && os.SameFile(fi, jf.fi) {
		return jf, nil
	}
	if jf != nil {
		l.closeFile(n.Name())
	}
	if lerr != nil && !vfs.IsNotExist(lerr) {
		return nil, lerr
	}
	if len(l.files) >= cmp.Or(l.cfg.OpenMax, maxJournalFiles) {
		l.closeLeastRecent()
	}
	f, err := fsys.OpenAppend(path, layout.FilePerm)
	if err != nil {
		return nil, err
	}
	st, err := f.Stat()
	if err == nil && !st.Mode().IsRegular() {
		err = fmt.Errorf("%w: %s is not a regular file (mode %v)", ErrJournal, path, st.Mode())
	}
	if err != nil {
		f.Close()
		return nil, err
	}
	jf = &journalFile{f: f, fi: st, base: st.Size(), newEntry: lerr != nil}
	if b, ok := l.bases[n.Name()]; ok {
		// Closed to bound the files open: its growth is still measured
		// from its size when first opened (or last compacted).
		if os.SameFile(b.fi, st) {
			jf.base = b.base
		}
		delete(l.bases, n.Name())
	}
	l.files[n.Name()] = jf
	return jf, nil
}

// closeLeastRecent closes the file written least recently, remembering
// its base for its next open.
func (l *Ledger) closeLeastRecent() {
	ns, ok := leastRecent(l.files, func(jf *journalFile) uint64 { return jf.written })
	if !ok {
		return
	}
	old := l.files[ns]
	if l.bases == nil {
		l.bases = map[string]journalBase{}
	}
	l.bases[ns] = journalBase{fi: old.fi, base: old.base}
	l.closeFile(ns)
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
func (l *Ledger) closeFile(ns string) {
	jf := l.files[ns]
	if jf == nil {
		return
	}
	delete(l.files, ns)
	if jf.dirty { // set only under a syncing store
		l.syncFile(ns, jf)
	}
	jf.f.Close()
}

// syncFile fdatasyncs ns's file jf (and the namespace directory when this
// engine created the file and has not synced it yet), and releases the
// queuers waiting for it. A failure is logged: records written since its last sync may be lost at a power
// loss.
func (l *Ledger) syncFile(ns string, jf *journalFile) error {
	err := jf.f.Sync()
	if err == nil && jf.newEntry {
		if n, nerr := l.st.Namespace(ns); nerr == nil {
			err = l.st.SyncDir(n.Dir())
		}
	}
	if err != nil {
		l.log(slog.LevelWarn, "kvpersist: uploads journal not synced; its latest records may be lost at a power loss", "namespace", ns, "err", err)
	}
	releaseAll(jf.waiters, err)
	jf.waiters = nil
	return err
}

// sync fdatasyncs every file written since its last sync (and the
// namespace directory after the first sync of a file this engine
// created). A file whose sync failed is closed (a failed fdatasync is
// never retried on the same file) and logged: records of it written
// since its last sync may be lost at a power loss.
func (l *Ledger) sync() {
	l.lastSync = time.Now()
	for ns, jf := range l.files {
		if !jf.dirty {
			continue
		}
		if l.syncFile(ns, jf) != nil {
			delete(l.files, ns)
			jf.f.Close()
			continue
		}
		jf.dirty, jf.newEntry = false, false
	}
}

// refillQueue queues from the journal the uploads spilled since the last
// refill (the queue has drained to half): each marked namespace's
// journal is read from where its last refill stopped (refillNamespace,
// refill.go), until the queue refuses a page. The batches
// are written first: a spill's queued record may have been added after
// this round's flush, and the refill reads only the file. A namespace
// whose batch could not be written (its lock not taken), or whose refill
// stopped at a page another goroutine is queueing, stays marked, and the
// refill is tried again after journalLockWait (again).
func (l *Ledger) refillQueue() (again bool) {
	l.mu.Lock()
	if !l.refill {
		l.mu.Unlock()
		return false
	}
	l.refill = false
	spilled := l.spilled
	l.spilled = map[string]bool{}
	closing := l.closing
	l.mu.Unlock()
	if closing {
		return false // the next start queues them
	}
	left := l.flushWithin(journalLockWait)
	for ns := range spilled {
		if left[ns] || l.refillNamespace(ns) {
			l.mu.Lock()
			l.spilled[ns], l.refill = true, true
			l.mu.Unlock()
			again = true
		}
	}
	return again
}

// compactGrown compacts each open file grown past its threshold, each
// within journalLockWait (else tried again after journalCompactRetry).
func (l *Ledger) compactGrown() {
	for ns, jf := range l.files {
		if time.Now().Before(jf.nextCompact) {
			continue
		}
		st, err := jf.f.Stat()
		if err != nil || st.Size() <= 2*jf.base+cmp.Or(l.cfg.CompactMin, journalCompactMin) {
			continue
		}
		ctx, cancel := context.WithTimeout(context.Background(), journalLockWait)
		ok := l.compact(ctx, ns)
		cancel()
		if !ok {
			if jf := l.files[ns]; jf != nil {
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
func (l *Ledger) compact(ctx context.Context, ns string) bool {
	st := l.st
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
	set, canonical, ok := l.readWhole(path)
	if !ok || canonical {
		return true
	}
	pl, ml := set.SortedPages(), set.SortedManifests()
	if len(pl) > maxJournalPages || len(ml) > maxJournalManifests {
		l.log(slog.LevelWarn, "kvpersist: uploads journal full; the uploads beyond it are queued by the next saves that name them", "namespace", ns, "pages", len(pl), "manifests", len(ml))
		pl = pl[:min(len(pl), maxJournalPages)]
		ml = ml[:min(len(ml), maxJournalManifests)]
	}
	b := EncodeSnapshot(pl, ml)
	err = layout.Publish(fsys, path, st.PublishOptions(true, int64(len(b))), func(f vfs.File) error {
		return layout.WriteFull(f, b, 0)
	})
	if err != nil {
		l.log(slog.LevelWarn, "kvpersist: uploads journal not compacted", "path", path, "err", err)
		return true
	}
	// The file open is the one renamed over: the next write opens the
	// new, the next refill reads the new from its start.
	l.closeFile(ns)
	l.replacedCursor(ns)
	return true
}

// read reads and replays the journal at path (its first readLimit
// bytes: maxJournalBytes), logging (Warn) what it ignores. ok is false
// when there is no journal or it cannot be read; canonical reports a file
// that is a valid snapshot alone (a compaction would not change it).
func (l *Ledger) read(path string) (set *Set, canonical, ok bool) {
	return l.readJournal(path, false)
}

// readWhole is read of the whole file, in windows of readLimit bytes: a
// compaction's, which must keep everything the file lists.
func (l *Ledger) readWhole(path string) (set *Set, canonical, ok bool) {
	return l.readJournal(path, true)
}

func (l *Ledger) readJournal(path string, whole bool) (set *Set, canonical, ok bool) {
	f, st, exists, err := openJournal(l.st.FS(), path)
	if !exists {
		return nil, false, false
	}
	if err == nil {
		defer f.Close()
		size := st.Size()
		n := size
		if !whole && size > l.limit() {
			n = l.limit()
			l.log(slog.LevelWarn, "kvpersist: uploads journal ignored in part", "path", path,
				"err", fmt.Errorf("%w: %s is %d bytes, only the first %d are read", ErrJournal, path, size, n))
		}
		var ignored int
		var problem error
		set, ignored, problem, canonical, err = replayJournalAt(f, n, int(l.limit()))
		canonical = !canonical && n == size
		if err == nil && ignored > 0 {
			l.log(slog.LevelWarn, "kvpersist: uploads journal ignored in part (bytes that do not decode: a torn last record, or damage)", "path", path, "bytes", ignored, "err", problem)
		}
	}
	if err != nil {
		l.log(slog.LevelWarn, "kvpersist: uploads journal ignored; its uploads are queued by the next saves that name them", "path", path, "err", err)
		return nil, false, false
	}
	return set, canonical, true
}

// Close ends the uploads, in this order: the manifests waiting for a
// retry are queued at once (their timers stopped); closeQueue closes the
// upload queue within ctx (an upload it abandons keeps its queued
// record; Done is called for every upload before it returns); then the
// goroutine stops and the last batches are written (the namespace locks
// taken within ctx, each tried at least once) and fdatasync'd, every
// journal this Ledger appended to or found with records at start is
// compacted (each exclusive lock waited for within ctx and at most
// journalCloseCompactWait in all), and the files are closed. Records
// added after it are dropped. It returns closeQueue's error; ErrClosed
// when called again.
func (l *Ledger) Close(ctx context.Context, closeQueue func(context.Context) error) error {
	l.mu.Lock()
	again := l.closing
	l.mu.Unlock()
	if again {
		return ErrClosed
	}
	l.stopRetries()
	err := closeQueue(ctx)
	close(l.quit)
	<-l.done
	l.flush(ctx)
	l.mu.Lock()
	l.closed = true
	touched, left := l.touched, l.nbatch
	batches := l.batch
	l.batch = nil
	l.mu.Unlock()
	for _, b := range batches {
		releaseAll(b.waiters, errDeferred)
	}
	if left > 0 {
		l.log(slog.LevelWarn, "kvpersist: uploads journal records not written at close (a namespace lock not taken in time); those uploads are queued by the next saves that name them", "records", left)
	}
	if l.st.Durable() {
		l.sync()
	}
	// A compaction is an optimisation: its wait for the exclusive lock
	// (which writers of other processes may keep from it) is bounded.
	cctx, cancel := context.WithTimeout(ctx, journalCloseCompactWait)
	defer cancel()
	for ns := range touched {
		l.compact(cctx, ns)
	}
	for ns := range l.files {
		l.closeFile(ns)
	}
	for ns := range l.cursors {
		l.dropCursor(ns)
	}
	return err
}

// Flush writes the records added so far and fdatasyncs their files
// (under the store's sync policy), on the goroutine, each namespace's
// lock waited for within ctx. It returns the namespaces whose records
// are still waiting (a lock not granted), or ctx's error.
func (l *Ledger) Flush(ctx context.Context) (left []string, err error) {
	err = l.call(ctx, func() {
		for ns := range l.flush(ctx) {
			left = append(left, ns)
		}
		l.sync()
	})
	return left, err
}

// call runs fn on the goroutine and waits for it; ErrClosed after Close.
func (l *Ledger) call(ctx context.Context, fn func()) error {
	done := make(chan struct{})
	select {
	case l.calls <- func() { defer close(done); fn() }:
	case <-l.done:
		return ErrClosed
	case <-ctx.Done():
		return ctx.Err()
	}
	<-done
	return nil
}

// ErrClosed: the Ledger is closed.
var ErrClosed = errors.New("uploads: closed")
