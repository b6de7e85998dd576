package uploads

import (
	"cmp"
	"context"
	"encoding/binary"
	"errors"
	"io"
	"log/slog"
	"os"

	"github.com/kvpersist/kvpersist/engine/layout"
	"github.com/kvpersist/kvpersist/engine/store"
	"github.com/kvpersist/kvpersist/engine/vfs"
)

// The refill of a full upload queue from the uploads journal
// (Ledger.refillQueue; ARCHITECTURE.md, "The uploads journal", "Full
// queue"). A refill reads a namespace's journal from where its last
// refill stopped (a cursor: the file, held open, and an offset), in file
// order, and queues what it reads until the queue refuses a page; the
// next refill starts at that page. So a backlog of N spilled uploads
// drained Q at a time costs O(N) bytes read and decoded in all, not the
// O(N²/Q) of replaying the whole journal at each refill. A
// journal replaced by a compaction (of any process) is read from its
// start again, once.

const (
	// refillWindowMaxBytes bounds the bytes a refill reads at once (its
	// memory); the first window of a refill is sized to the queue's room
	// (refillWindowPerUploadBytes bytes per upload it can take), and doubles
	// while a window is read whole without the queue refusing a page.
	refillWindowMaxBytes       = 1 << 20
	refillWindowPerUploadBytes = 2 * (RecordOverhead + 32)
	// maxRefillCursors bounds the cursors kept (one open descriptor
	// each): before another is opened, the one used least recently is
	// closed (its next refill reads its journal from the start).
	maxRefillCursors = maxJournalFiles
)

// refillCursor is where a namespace's refills stopped in its journal:
// every entry before off has been queued (or found queued, known stored,
// or gone) by a refill of this engine, or settled by a record before
// off, or skipped by requeueEntries' two rules: an entry that a later
// entry of the same read settles or queues again (the later one
// decides), and a page queued here when the cursor was opened, by an
// entry before opened, and not any more (its upload ended: settled, its
// settled record possibly beyond off). The file is held open: while it
// is, its inode cannot be reused by a file a compaction renames over the
// path, so os.SameFile of the path's lstat and fi says whether the path
// still names it. So a journal replaced by another process's compaction
// (the old file unlinked) stays open until this namespace's next refill,
// the cursor's eviction or Close: at most maxRefillCursors such files,
// which keep their disk blocks but block nothing (a gc, a namespace's
// removal, a compaction: Linux unlinks and renames over open files).
type refillCursor struct {
	f  vfs.File    // nil: its file was replaced by a compaction of this engine
	fi os.FileInfo // f's Stat at open
	// pagesEnd and snapEnd: the file begins with a valid snapshot whose
	// page entries end at pagesEnd and which ends (its hash included) at
	// snapEnd; both 0 when it does not (its bytes, if any, are skipped by
	// the record scan as a replay skips them).
	pagesEnd, snapEnd int64
	off               int64  // the next entry's offset
	used              uint64 // journal.refills at its last use
	warned            bool   // its undecodable bytes were logged
	// queued: the pages of the namespace queued here when the cursor was
	// opened (at most the queue's capacity and the uploads in flight),
	// and opened, its file's size then. An entry of those pages before
	// opened whose upload has ended since is settled, its settled record
	// beyond the refill's window: it is not queued again. Dropped once
	// the cursor is past opened.
	queued map[layout.PageKey]bool
	opened int64
}

// refillEntry is one entry a refill read: a snapshot entry (a queued
// op) or a record.
type refillEntry struct {
	off  int64 // its offset in the file
	end  int64 // the offset just after it
	op   byte
	key  layout.PageKey // a page op's
	name string         // a manifest op's
}

// refillNamespace queues the uploads namespace ns's journal lists, read
// from where its last refill stopped (its cursor, or the start of the
// file when the path names another file since), until the queue refuses
// a page (spilled again, which marks the namespace for the next refill)
// or the file ends. again: it stopped at a page another goroutine is
// queueing right now (which may yet spill it): the caller marks the
// namespace for a refill after journalLockWait. A journal that cannot be
// read is ignored (logged), as by a replay.
func (l *Ledger) refillNamespace(ns string) (again bool) {
	n, err := l.st.Namespace(ns)
	if err != nil {
		return false
	}
	c := l.cursor(n)
	if c == nil {
		return false
	}
	st, err := c.f.Stat()
	if err != nil {
		l.refillFailed(n, err)
		return false
	}
	free, _ := l.q.Room()
	room := int64(max(0, free))
	window := min(max(room*refillWindowPerUploadBytes, 2*MaxRecordBytes), refillWindowMaxBytes)
	ignored, problem, err := c.walk(st.Size(), window, func(entries []refillEntry) (int64, bool) {
		stopAt, stopped, b := l.requeueEntries(ns, c, entries)
		again = b
		return stopAt, stopped
	})
	if err != nil {
		l.refillFailed(n, err)
		return false
	}
	if c.off >= c.opened {
		c.queued = nil // read past every entry it speaks for
	}
	if ignored > 0 && !c.warned {
		c.warned = true
		l.log(slog.LevelWarn, "kvpersist: uploads journal ignored in part (bytes that do not decode: a torn last record, or damage)", "path", n.UploadsPath(), "bytes", ignored, "err", problem)
	}
	return again
}

// walk reads c's file from c.off to size in windows (the first of window
// bytes, each next twice the last, at most refillWindowMaxBytes) and hands
// each window's entries (scan) to fn, in file order, until fn stops
// (c.off is then the offset it returned) or the file ends (c.off is its
// end, or the start of a last record that may still be being appended).
// ignored counts the bytes skipped as undecodable, problem names the
// first; err is a read error.
func (c *refillCursor) walk(size, window int64, fn func([]refillEntry) (stopAt int64, stopped bool)) (ignored int, problem error, err error) {
	window = max(window, 2*MaxRecordBytes)
	var buf []byte
	for c.off < size {
		if int64(cap(buf)) < window {
			buf = make([]byte, window)
		}
		b := buf[:min(window, size-c.off)]
		nr, rerr := c.f.ReadAt(b, c.off)
		if rerr != nil && !errors.Is(rerr, io.EOF) {
			return ignored, problem, rerr
		}
		final := rerr != nil || c.off+int64(nr) >= size
		entries, end, ig, pr := c.scan(b[:nr], final)
		ignored += ig
		if problem == nil {
			problem = pr
		}
		if stopAt, stopped := fn(entries); stopped {
			c.off = stopAt
			return ignored, problem, nil
		}
		c.off += int64(end)
		if final || end == 0 {
			break
		}
		window = min(2*window, refillWindowMaxBytes)
	}
	return ignored, problem, nil
}

// refillFailed drops ns's cursor after a failed read (logged): its next
// refill opens the journal again.
func (l *Ledger) refillFailed(n *store.Namespace, err error) {
	l.dropCursor(n.Name())
	l.log(slog.LevelWarn, "kvpersist: uploads journal ignored; its uploads are queued by the next saves that name them", "path", n.UploadsPath(), "err", err)
}

// cursor returns n's refill cursor on the file its journal's path names
// now: the one kept when the path still names its file, else a new one
// at the start of the file (its snapshot, if it begins with one, checked
// whole once). nil when there is no journal or it cannot be read
// (logged). At the first refill of n (since New, or since its cursor was
// dropped), the journal is first compacted when it holds records (its
// exclusive lock tried for journalLockWait): the refill then reads a
// snapshot of exactly what it lists, rather than records whose settled
// record lies beyond its window (such an entry would be queued again,
// costing an lstat and a HEAD). A file replaced by a compaction since
// the last refill is read from its start without another.
func (l *Ledger) cursor(n *store.Namespace) *refillCursor {
	ns, path, fsys := n.Name(), n.UploadsPath(), l.st.FS()
	l.refills++
	c := l.cursors[ns]
	if c == nil {
		ctx, cancel := context.WithTimeout(context.Background(), journalLockWait)
		l.compact(ctx, ns)
		cancel()
	}
	fi, lerr := fsys.Lstat(path)
	if c != nil && c.f != nil && lerr == nil && os.SameFile(fi, c.fi) {
		c.used = l.refills
		return c
	}
	l.dropCursor(ns)
	if vfs.IsNotExist(lerr) {
		return nil
	}
	f, st, exists, err := openJournal(fsys, path)
	if !exists {
		return nil
	}
	c = &refillCursor{f: f, fi: st, used: l.refills}
	if err == nil {
		c.queued, c.opened = l.queuedPages(ns), st.Size()
		if err = c.readSnapshot(st.Size()); err != nil {
			f.Close()
		}
	}
	if err != nil {
		l.log(slog.LevelWarn, "kvpersist: uploads journal ignored; its uploads are queued by the next saves that name them", "path", path, "err", err)
		return nil
	}
	if len(l.cursors) >= cmp.Or(l.cfg.CursorMax, maxRefillCursors) {
		l.dropLeastRecentCursor()
	}
	if l.cursors == nil {
		l.cursors = map[string]*refillCursor{}
	}
	l.cursors[ns] = c
	return c
}

// replacedCursor closes ns's cursor after a compaction replaced its
// file, keeping its entry (without a file): the next refill reads the new
// file from its start, without compacting it again.
func (l *Ledger) replacedCursor(ns string) {
	if c := l.cursors[ns]; c != nil && c.f != nil {
		c.f.Close()
		l.cursors[ns] = &refillCursor{used: c.used}
	}
}

// dropCursor closes ns's cursor, if any.
func (l *Ledger) dropCursor(ns string) {
	if c := l.cursors[ns]; c != nil {
		if c.f != nil {
			c.f.Close()
		}
		delete(l.cursors, ns)
	}
}

// dropLeastRecentCursor closes the cursor used least recently.
func (l *Ledger) dropLeastRecentCursor() {
	if ns, ok := leastRecent(l.cursors, func(c *refillCursor) uint64 { return c.used }); ok {
		l.dropCursor(ns)
	}
}

// readSnapshot checks the snapshot at the start of c's file (size bytes)
// when the file begins with its magic: a valid one (DecodeSnapshot) is
// then read entry by entry from its first (pagesEnd, snapEnd, off); one that fails its
// checks is left to the record scan, which skips its bytes as a replay
// does. err is a read error.
func (c *refillCursor) readSnapshot(size int64) error {
	if size < 24 {
		return nil
	}
	var hdr [16]byte
	if _, err := c.f.ReadAt(hdr[:], 0); err != nil {
		return err
	}
	if string(hdr[:8]) != journalMagic {
		return nil
	}
	np, nm := int64(binary.LittleEndian.Uint32(hdr[8:])), int64(binary.LittleEndian.Uint32(hdr[12:]))
	if np > maxJournalPages || nm > maxJournalManifests {
		return nil
	}
	b := make([]byte, min(size, 16+32*np+(1+maxNameBytes)*nm+8))
	if _, err := c.f.ReadAt(b, 0); err != nil {
		return err
	}
	if _, _, end, err := DecodeSnapshot(b); err == nil {
		c.pagesEnd, c.snapEnd, c.off = 16+32*np, int64(end), 16
	}
	return nil
}

// scan reads the entries of b, the bytes of c's file from c.off on
// (final: to its end as this refill stat'd it), in file order: a valid
// snapshot's entries (as queued ops; its hash skipped), then the records
// as scanRecords reads them (tail: a record that may still be being
// appended stops the scan, to be read again next time). end is where
// the scan stopped in b: the next window starts there.
func (c *refillCursor) scan(b []byte, final bool) (entries []refillEntry, end, ignored int, problem error) {
	pos := 0
	for pos < len(b) {
		at := c.off + int64(pos)
		switch {
		case at < c.pagesEnd:
			if len(b)-pos < 32 {
				return entries, pos, ignored, problem
			}
			entries = append(entries, refillEntry{off: at, end: at + 32, op: OpPageQueued, key: layout.PageKey(b[pos : pos+32])})
			pos += 32
		case at < c.snapEnd-8:
			l := int(b[pos])
			if len(b)-pos < 1+l {
				return entries, pos, ignored, problem
			}
			entries = append(entries, refillEntry{off: at, end: at + 1 + int64(l), op: OpManifestQueued, name: string(b[pos+1 : pos+1+l])})
			pos += 1 + l
		case at < c.snapEnd:
			if int64(len(b)-pos) < c.snapEnd-at {
				return entries, pos, ignored, problem
			}
			pos += int(c.snapEnd - at)
		default:
			ignored, problem, end = scanRecords(b[pos:], final, true, at, func(op byte, payload []byte, off int) {
				e := refillEntry{off: at + int64(off), end: at + int64(off+RecordOverhead+len(payload)), op: op}
				if op == OpPageQueued || op == OpPageSettled {
					e.key = layout.PageKey(payload)
				} else {
					e.name = string(payload)
				}
				entries = append(entries, e)
			})
			return entries, pos + end, ignored, problem
		}
	}
	return entries, pos, ignored, problem
}

// requeueEntries queues again the entries a refill read from ns's
// journal through c, in file order: each queued page (requeuePage) and
// manifest (requeueListed), except an entry that a later entry of the
// same read settles or queues again (the later one decides), and a page
// that was queued here when c was opened, by an entry from before then,
// and is not any more (its upload ended: settled). It stops at the first
// page the queue refuses (stopAt just after its entry: the spill appended
// its queued record anew), or that another goroutine is queueing (busy:
// stopAt its entry's offset); the next refill starts at stopAt.
func (l *Ledger) requeueEntries(ns string, c *refillCursor, entries []refillEntry) (stopAt int64, stopped, busy bool) {
	lastPage, lastName := map[layout.PageKey]int{}, map[string]int{}
	for i, e := range entries {
		if e.op == OpPageQueued || e.op == OpPageSettled {
			lastPage[e.key] = i
		} else {
			lastName[e.name] = i
		}
	}
	for i, e := range entries {
		switch {
		case e.op == OpPageQueued && lastPage[e.key] == i:
			if e.off < c.opened && c.queued[e.key] && !l.Pending(ns, e.key) {
				// Queued when the cursor was opened, and settled since.
				continue
			}
			switch l.requeuePage(ns, e.key, true) {
			case requeueRefused:
				// Spilled again, its queued record appended anew (the
				// entry may be stale: a settled record beyond this
				// window): the next refill reads that record, not this
				// entry again.
				return e.end, true, false
			case requeueBusy:
				return e.off, true, true
			}
		case e.op == OpManifestQueued && lastName[e.name] == i:
			l.requeueListed(ns, e.name)
		}
	}
	return 0, false, false
}

// Refill queues now, on the journal's goroutine, the uploads namespace
// ns's journal lists from where its last refill stopped, as the
// goroutine does by itself once the queue has drained to half after a
// spill; it stops at the first page the queue refuses. The records added
// before it are written first. again: it stopped at a page another
// goroutine is queueing (the namespace stays marked for a refill after
// journalLockWait). ErrClosed after Close.
func (l *Ledger) Refill(ctx context.Context, ns string) (again bool, err error) {
	err = l.call(ctx, func() {
		l.mu.Lock()
		l.spilled[ns], l.refill = true, true
		l.mu.Unlock()
		again = l.refillQueue()
	})
	return again, err
}
