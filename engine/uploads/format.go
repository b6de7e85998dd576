package uploads

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"os"
	"slices"
	"strings"

	"github.com/zeebo/xxh3"

	"github.com/kvpersist/kvpersist/engine/layout"
	"github.com/kvpersist/kvpersist/engine/vfs"
)

// The journal file's format (snapshot, records, framing, torn records,
// compaction) is specified in docs/format/uploads-journal.md.
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

// Record operations (the op byte of a record).
const (
	// OpPageQueued: a page's upload was queued (payload: its 32-byte key).
	OpPageQueued byte = 1
	// OpPageSettled: a page's upload is done or can never be done.
	OpPageSettled byte = 2
	// OpManifestQueued: a page manifest's upload was queued (payload:
	// its name, 1 to 200 bytes, layout.ValidName).
	OpManifestQueued byte = 3
	// OpManifestSettled: a page manifest's upload is done or can never
	// be done.
	OpManifestSettled byte = 4
	// RecordOverhead: a record's bytes besides its payload (magic, op,
	// length, hash).
	RecordOverhead = 4 + 1 + 1 + 8
	// MaxRecordBytes: the largest valid record (a manifest op's name).
	MaxRecordBytes = RecordOverhead + maxNameBytes
)

// ErrJournal: journal bytes that do not decode (skipped, logged), or a
// journal path that is not a regular file.
var ErrJournal = errors.New("uploads: journal")

// EncodeSnapshot is the snapshot listing pages and manifests (either may
// be empty). It sorts both; the caller keeps each within its maximum.
func EncodeSnapshot(pages []layout.PageKey, manifests []string) []byte {
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

// AppendRecord appends the record of op with payload (a page key's 32
// bytes, or a manifest's name) to b.
func AppendRecord(b []byte, op byte, payload []byte) []byte {
	start := len(b)
	b = append(b, recordMagic...)
	b = append(b, op, byte(len(payload)))
	b = append(b, payload...)
	return binary.LittleEndian.AppendUint64(b, xxh3.Hash(b[start:]))
}

// DecodeSnapshot decodes the snapshot at the start of b: size, magic,
// counts against the size and the maxima, every record (keys and names
// strictly ascending, names valid), then the hash. end is where it ends
// in b. Every failure wraps ErrJournal.
func DecodeSnapshot(b []byte) (pages []layout.PageKey, manifests []string, end int, err error) {
	bad := func(format string, a ...any) error {
		return fmt.Errorf("%w: snapshot: %s", ErrJournal, fmt.Sprintf(format, a...))
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
	if len(b) < RecordOverhead || string(b[:4]) != recordMagic {
		return 0, nil, 0
	}
	op, l := b[4], int(b[5])
	switch op {
	case OpPageQueued, OpPageSettled:
		if l != 32 {
			return 0, nil, 0
		}
	case OpManifestQueued, OpManifestSettled:
		if l == 0 {
			return 0, nil, 0
		}
	default:
		return 0, nil, 0
	}
	n = RecordOverhead + l
	if len(b) < n || binary.LittleEndian.Uint64(b[6+l:]) != xxh3.Hash(b[:6+l]) {
		return 0, nil, 0
	}
	payload = b[6 : 6+l]
	if (op == OpManifestQueued || op == OpManifestSettled) && layout.ValidName("snapshot", string(payload)) != nil {
		return 0, nil, 0
	}
	return op, payload, n
}

// Set is what a journal lists: the uploads queued and not
// settled, after replaying its snapshot and records in order.
type Set struct {
	Pages     map[layout.PageKey]bool
	Manifests map[string]bool
}

func (s *Set) SortedPages() []layout.PageKey {
	out := make([]layout.PageKey, 0, len(s.Pages))
	for k := range s.Pages {
		out = append(out, k)
	}
	slices.SortFunc(out, func(a, b layout.PageKey) int { return bytes.Compare(a[:], b[:]) })
	return out
}

func (s *Set) SortedManifests() []string {
	out := make([]string, 0, len(s.Manifests))
	for m := range s.Manifests {
		out = append(out, m)
	}
	slices.Sort(out)
	return out
}

// Decode replays a journal's bytes: the snapshot when b
// starts with its magic, then every record in order (queued adds an
// entry, settled removes it). Bytes that do not decode (a torn last
// record, garbage, a snapshot that fails its checks) are skipped up to
// the next record magic; ignored counts them and problem (wrapping
// ErrJournal) names the first. records reports whether b holds anything
// beyond a valid snapshot (so a compaction would change it).
func Decode(b []byte) (s *Set, ignored int, problem error, records bool) {
	s, ignored, problem, records, _ = decodeJournalBytes(b, true)
	return s, ignored, problem, records
}

// decodeJournalBytes is Decode of b, the first bytes of a
// journal: whole when final, else the file continues after b (see
// decodeRecords; end is where it stopped).
func decodeJournalBytes(b []byte, final bool) (s *Set, ignored int, problem error, records bool, end int) {
	s = &Set{Pages: map[layout.PageKey]bool{}, Manifests: map[string]bool{}}
	off := 0
	if len(b) >= 8 && string(b[:8]) == journalMagic {
		pages, manifests, end, err := DecodeSnapshot(b)
		if err == nil {
			for _, k := range pages {
				s.Pages[k] = true
			}
			for _, m := range manifests {
				s.Manifests[m] = true
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
func decodeRecords(s *Set, b []byte, final bool, at int64) (ignored int, problem error, end int) {
	return scanRecords(b, final, false, at, func(op byte, payload []byte, _ int) {
		switch op {
		case OpPageQueued:
			s.Pages[layout.PageKey(payload)] = true
		case OpPageSettled:
			delete(s.Pages, layout.PageKey(payload))
		case OpManifestQueued:
			s.Manifests[string(payload)] = true
		case OpManifestSettled:
			delete(s.Manifests, string(payload))
		}
	})
}

// scanRecords calls fn with each valid record of b (at offset at of the
// file) in order: its op, its payload (aliasing b) and its offset in b.
// It skips what does not decode up to the next record magic (ignored
// counts those bytes, problem names the first). final: b ends where the
// file ends; else it stops before the last MaxRecordBytes-1 bytes of b
// unless a record ends beyond them (a record there may continue after
// b), and end is where it stopped (the next window starts there). tail,
// with final: bytes at the end of b that may be the first bytes of a
// record being appended (recordPrefix) stop it there, not skipped (a
// refill reads them again next time).
func scanRecords(b []byte, final, tail bool, at int64, fn func(op byte, payload []byte, off int)) (ignored int, problem error, end int) {
	off := 0
	for off < len(b) {
		if !final && len(b)-off < MaxRecordBytes {
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
				problem = fmt.Errorf("%w: %d bytes at offset %d are not a record", ErrJournal, skip+1, at+int64(off))
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
	if len(b) >= 6 && len(b) >= RecordOverhead+int(b[5]) {
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
func replayJournalAt(r io.ReaderAt, size int64, window int) (s *Set, ignored int, problem error, records bool, err error) {
	window = max(window, 2*MaxRecordBytes)
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
// regular file is an error wrapping ErrJournal.
func openJournal(fsys vfs.FS, path string) (f vfs.File, st os.FileInfo, exists bool, err error) {
	fi, err := fsys.Lstat(path)
	if vfs.IsNotExist(err) {
		return nil, nil, false, nil
	}
	if err != nil {
		return nil, nil, true, err
	}
	if !fi.Mode().IsRegular() {
		return nil, nil, true, fmt.Errorf("%w: %s is not a regular file (mode %v)", ErrJournal, path, fi.Mode())
	}
	f, err = fsys.Open(path)
	if err != nil {
		return nil, nil, true, err
	}
	st, err = f.Stat()
	if err == nil && !st.Mode().IsRegular() {
		err = fmt.Errorf("%w: %s is not a regular file (mode %v)", ErrJournal, path, st.Mode())
	}
	if err != nil {
		f.Close()
		return nil, nil, true, err
	}
	return f, st, true, nil
}
