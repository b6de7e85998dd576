package pagecache

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"hash/crc32"
	"path/filepath"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvpersist/kvpersist/engine/evict"
	"github.com/kvpersist/kvpersist/engine/layout"
	"github.com/kvpersist/kvpersist/engine/vfs"
)

// The shared page log: how several caches (engines, in one process or
// several) on one root keep one view of the root's page files and their
// recency, so that each one's CapacityBytes, quotas and headroom bound the
// root's page files, not only its own, and one cache's hot pages are not
// another's cold ones.
//
// Every cache appends to <root>/.pagelog (layout.PageLogName) what it does
// to the page tree: the pages it commits (key, parent, allocated bytes,
// access), the pages it unlinks, and the accesses of lookups and loads
// (one record for the deepest page: its ancestors cannot go before it).
// Before each reservation, and every second in the background, each cache
// reads the records appended since its last read and applies those of the
// others to its policy: their pages are tracked (and so counted and
// evictable, least recently used first across every cache), the pages
// they unlinked leave it, their accesses move recency forward. Applying a
// cache's own records changes nothing (Add of a tracked page, Removed of an
// untracked one, an access not newer).
//
// Reservations are shared too: a cache appends the bytes it reserved
// before it creates a file, and their release after it committed the
// pages; the others count them (with the temp page files of dead writers:
// evict.Cache.SetTempBytes) until released, or until the owner's process
// is found gone (a sweep, kill(pid, 0)) and a sweep holding the
// namespace's exclusive lock has counted the temp page files it left and
// added the page files it renamed without a record. So each cache's used bytes are
// the root's page files and the others' writes in flight, and its Reserve
// keeps them with its own reservations within its capacity: the page files
// of the root stay within D ≤ C + S × P + E, S counting the saves in
// flight of every cache on the root, C the smallest capacity among them.
//
// Format: a 16-byte header, magic "KVPGLOG1" and a u64 generation (little
// endian), then records, each u32 body length, the body, u32 CRC-32C of the
// body. Body: u8 op, u8 namespace length, the namespace, the 32-byte key,
// then for an add the 32-byte parent (all zero: none), i64 allocated bytes
// and i64 access (unix nanoseconds); for an access the i64 access; nothing
// for a removal; for a reservation (key all zero) the u64 owner (pid << 32
// | a random number) and the i64 change of its reserved bytes. Appends are one write(2) each, under the log's shared
// flock. A cache that finds the log longer than maxPageLogBytes after its
// append replaces it (under the exclusive flock) by an empty log of the
// next generation; a reader that finds another generation, a log shorter
// than its offset, or a record that does not check, resyncs every
// namespace from the disk (Resync, and the recency checkpoints) and reads
// on from the end.

const (
	pageLogMagic    = "KVPGLOG1"
	pageLogHeader   = 16
	maxPageLogBytes = 64 << 20
	maxLogRecord    = 1 + 1 + 255 + 2*32 + 16

	opAdd      = 1
	opRemove   = 2
	opAccess   = 3
	opReserved = 4
)

// logRecord is one record of the page log.
type logRecord struct {
	op        byte
	ns        string
	key       evict.Key
	parent    evict.Key
	hasParent bool
	bytes     int64 // opAdd: the page's allocated bytes; opReserved: the change of the owner's reserved bytes
	access    int64
	owner     uint64 // opReserved: the cache (pid << 32 | a random number)
}

var castagnoli = crc32.MakeTable(crc32.Castagnoli)

func appendLogRecord(dst []byte, r logRecord) []byte {
	var body [maxLogRecord]byte
	b := append(body[:0], r.op, byte(len(r.ns)))
	b = append(b, r.ns...)
	b = append(b, r.key[:]...)
	switch r.op {
	case opAdd:
		var p evict.Key
		if r.hasParent {
			p = r.parent
		}
		b = append(b, p[:]...)
		b = binary.LittleEndian.AppendUint64(b, uint64(r.bytes))
		b = binary.LittleEndian.AppendUint64(b, uint64(r.access))
	case opAccess:
		b = binary.LittleEndian.AppendUint64(b, uint64(r.access))
	case opReserved:
		b = binary.LittleEndian.AppendUint64(b, r.owner)
		b = binary.LittleEndian.AppendUint64(b, uint64(r.bytes))
	}
	dst = binary.LittleEndian.AppendUint32(dst, uint32(len(b)))
	dst = append(dst, b...)
	return binary.LittleEndian.AppendUint32(dst, crc32.Checksum(b, castagnoli))
}

// decodeLogRecord decodes the record at the start of b: n is its length in
// bytes; n == 0 with ok true means b holds only part of a record (a write
// being appended); ok false means it does not check.
func decodeLogRecord(b []byte) (r logRecord, n int, ok bool) {
	if len(b) < 4 {
		return r, 0, true
	}
	l := int(binary.LittleEndian.Uint32(b))
	if l < 2+32 || l > maxLogRecord {
		return r, 0, false
	}
	if len(b) < 4+l+4 {
		return r, 0, true
	}
	body := b[4 : 4+l]
	if crc32.Checksum(body, castagnoli) != binary.LittleEndian.Uint32(b[4+l:]) {
		return r, 0, false
	}
	r.op = body[0]
	nl := int(body[1])
	rest := body[2:]
	if len(rest) < nl+32 {
		return r, 0, false
	}
	r.ns = string(rest[:nl])
	copy(r.key[:], rest[nl:nl+32])
	rest = rest[nl+32:]
	switch {
	case r.op == opAdd && len(rest) == 48:
		copy(r.parent[:], rest[:32])
		r.hasParent = r.parent != evict.Key{}
		r.bytes = int64(binary.LittleEndian.Uint64(rest[32:]))
		r.access = int64(binary.LittleEndian.Uint64(rest[40:]))
		if r.bytes < 0 || r.bytes > evict.MaxBytes {
			return r, 0, false
		}
	case r.op == opAccess && len(rest) == 8:
		r.access = int64(binary.LittleEndian.Uint64(rest))
	case r.op == opReserved && len(rest) == 16:
		r.owner = binary.LittleEndian.Uint64(rest)
		r.bytes = int64(binary.LittleEndian.Uint64(rest[8:]))
		if r.bytes < -evict.MaxBytes || r.bytes > evict.MaxBytes {
			return r, 0, false
		}
	case r.op == opRemove && len(rest) == 0:
	default:
		return r, 0, false
	}
	return r, 4 + l + 4, true
}

// pageLog is one cache's end of the root's page log.
type pageLog struct {
	fs   vfs.FS
	path string

	mu sync.Mutex // serialises reads (offset, gen) and appends of this cache
	// ready: the log was found with its header. A header, once written,
	// stays (compaction publishes a new log with one), so appends skip
	// ensure's read of it until an append finds none (the log deleted).
	ready  atomic.Bool
	gen    uint64
	offset int64
	buf    []byte
}

func newPageLog(fs vfs.FS, root string) *pageLog {
	return &pageLog{fs: fs, path: filepath.Join(root, layout.PageLogName)}
}

// lockWait bounds how long an append or a compaction waits for the log's
// flock (a compaction holds it for one small write and a rename).
const lockWait = 2 * time.Second

// lock takes the log's flock, shared or exclusive, waiting at most
// lockWait.
func (l *pageLog) lock(exclusive bool) (unlock func() error, err error) {
	ctx, cancel := context.WithTimeout(context.Background(), lockWait)
	defer cancel()
	return l.fs.Lock(ctx, l.path, exclusive, true)
}

// append appends recs in one write under the log's shared flock, creating
// the log when missing; compact reports that the log grew past
// maxPageLogBytes. A failed append is lost to the other caches until their
// next resync; the error says why.
func (l *pageLog) append(recs []logRecord) (compact bool, err error) {
	if len(recs) == 0 {
		return false, nil
	}
	if err := l.ensure(); err != nil {
		return false, err
	}
	unlock, err := l.lock(false)
	if err != nil {
		return false, err
	}
	defer unlock()
	return l.appendHeld(recs)
}

// ensure creates the log when it has no header yet.
func (l *pageLog) ensure() error {
	if l.ready.Load() {
		return nil
	}
	if err := l.create(); err != nil {
		return err
	}
	l.ready.Store(true)
	return nil
}

// exclusive runs fn under the log's exclusive flock and appends the records
// it returns before the flock goes: a reservation is decided on every
// other cache's reservations and commits, and the others see it before
// they decide theirs. When the flock is not granted within lockWait, fn
// runs without it and its records are appended as append does.
func (l *pageLog) exclusive(fn func() []logRecord) error {
	if err := l.ensure(); err != nil {
		_, aerr := l.append(fn())
		return errors.Join(err, aerr)
	}
	unlock, err := l.lock(true)
	if err != nil {
		_, aerr := l.append(fn())
		return errors.Join(err, aerr)
	}
	defer unlock()
	_, err = l.appendHeld(fn())
	return err
}

// appendHeld is append with the log's flock held by the caller.
func (l *pageLog) appendHeld(recs []logRecord) (compact bool, err error) {
	if len(recs) == 0 {
		return false, nil
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	b := l.buf[:0]
	for _, r := range recs {
		b = appendLogRecord(b, r)
	}
	l.buf = b
	f, err := l.fs.OpenAppend(l.path, 0o640)
	if err != nil {
		return false, err
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		return false, err
	}
	if fi.Size() < pageLogHeader {
		l.ready.Store(false) // the next append creates it again
		return false, errors.New("pagecache: " + l.path + " has no page log header")
	}
	if _, err := f.Write(b); err != nil {
		return false, err
	}
	return fi.Size()+int64(len(b)) > maxPageLogBytes, nil
}

// compact replaces the log by an empty one of the next generation, under
// its exclusive flock (not waited for longer than lockWait).
func (l *pageLog) compact() error {
	unlock, err := l.lock(true)
	if err != nil {
		return err
	}
	defer unlock()
	gen, _, err := l.header()
	if err != nil {
		return err
	}
	var h [pageLogHeader]byte
	copy(h[:], pageLogMagic)
	binary.LittleEndian.PutUint64(h[8:], gen+1)
	return layout.Publish(l.fs, l.path, layout.PublishOptions{Size: pageLogHeader}, func(f vfs.File) error {
		return layout.WriteFull(f, h[:], 0)
	})
}

// header reads the log's generation and size (0, 0 for a log that does not
// exist or has no header yet).
func (l *pageLog) header() (gen uint64, size int64, err error) {
	f, err := l.fs.Open(l.path)
	if vfs.IsNotExist(err) {
		return 0, 0, nil
	}
	if err != nil {
		return 0, 0, err
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		return 0, 0, err
	}
	if !fi.Mode().IsRegular() {
		return 0, 0, errors.New("pagecache: " + l.path + " is not a regular file")
	}
	var h [pageLogHeader]byte
	if fi.Size() < pageLogHeader {
		return 0, fi.Size(), nil
	}
	if _, err := f.ReadAt(h[:], 0); err != nil {
		return 0, 0, err
	}
	if !bytes.Equal(h[:8], []byte(pageLogMagic)) {
		return 0, 0, errors.New("pagecache: " + l.path + " is not a page log")
	}
	return binary.LittleEndian.Uint64(h[8:]), fi.Size(), nil
}

// maxLogRead bounds one read of the log's new records, in bytes.
const maxLogRead = 4 << 20

// read returns the records appended since the last read. resync is true
// when the caller must resync from the disk instead (another generation, a
// log shorter than the offset, a record that does not check); the offset
// is then the log's end.
func (l *pageLog) read() (recs []logRecord, resync bool, err error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	f, err := l.fs.Open(l.path)
	if vfs.IsNotExist(err) {
		return nil, false, nil
	}
	if err != nil {
		return nil, false, err
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		return nil, false, err
	}
	if !fi.Mode().IsRegular() {
		return nil, false, errors.New("pagecache: " + l.path + " is not a regular file")
	}
	size := fi.Size()
	if size < pageLogHeader {
		return nil, false, nil
	}
	var h [pageLogHeader]byte
	if _, err := f.ReadAt(h[:], 0); err != nil {
		return nil, false, err
	}
	gen := binary.LittleEndian.Uint64(h[8:])
	if !bytes.Equal(h[:8], []byte(pageLogMagic)) {
		return nil, false, errors.New("pagecache: " + l.path + " is not a page log")
	}
	if l.offset == 0 {
		l.gen, l.offset = gen, pageLogHeader
	}
	if gen != l.gen || size < l.offset {
		l.gen, l.offset = gen, size
		return nil, true, nil
	}
	for l.offset < size {
		n := min(size-l.offset, maxLogRead)
		b := make([]byte, n)
		k, err := f.ReadAt(b, l.offset)
		if err != nil && int64(k) != n {
			return recs, false, err
		}
		used := 0
		for used < len(b) {
			r, rn, ok := decodeLogRecord(b[used:])
			if !ok {
				l.offset = size
				return recs, true, nil
			}
			if rn == 0 {
				break // a record still being written, or cut by this read
			}
			recs = append(recs, r)
			used += rn
		}
		if used == 0 {
			break
		}
		l.offset += int64(used)
	}
	return recs, false, nil
}

// create makes the log, with its header, when it does not exist (under its
// exclusive flock, which creates the file empty: the header is written when
// the file is still shorter than it).
func (l *pageLog) create() error {
	if _, size, err := l.header(); err != nil || size >= pageLogHeader {
		return err
	}
	unlock, err := l.lock(true)
	if err != nil {
		return err
	}
	defer unlock()
	f, err := l.fs.OpenAppend(l.path, 0o640)
	if err != nil {
		return err
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil || fi.Size() >= pageLogHeader {
		return err
	}
	if fi.Size() != 0 {
		return errors.New("pagecache: " + l.path + " is shorter than a page log's header")
	}
	var h [pageLogHeader]byte
	copy(h[:], pageLogMagic)
	_, err = f.Write(h[:])
	return err
}
