package evict

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"slices"

	"github.com/zeebo/xxh3"
)

// The recency checkpoint: how the policy's recency survives a restart.
//
// The engine writes one checkpoint file per namespace, periodically and on
// Close, with the durable publish of every other file (temp, fdatasync,
// rename, directory fsync); at start it lists the page files (readdir and
// lstat: st_blocks and mtime, no open), takes each page's parent from the
// checkpoint (a page's parent is a function of its key: the chain), reads
// the header only of pages the checkpoint does not name (written since),
// Adds them with Access = the file's mtime (when the page was written), and
// then applies the checkpoint (ApplyCheckpoint: Access = max(mtime,
// min(recorded, now))). A page written after the last checkpoint keeps its mtime,
// which is later than every access the checkpoint recorded; a page the
// checkpoint names that is gone is ignored; a checkpoint that fails to
// decode is ignored as a whole (every header is then read, and the mtimes
// alone order the pages by their writes). So a restart loses at most the
// touches made since the last checkpoint.
//
// Format (all integers little-endian), 24 + 72·N bytes:
//
//	offset      size  field
//	0           8     magic "KVPLRU1\n" (4b 56 50 4c 52 55 31 0a)
//	8           8     u64 N, the number of records
//	16 + 72·i   32    record i: the page key, 32 raw bytes
//	48 + 72·i   32    record i: the parent key, 32 raw bytes; all zero: no parent
//	80 + 72·i   8     record i: i64 last access, unix nanoseconds, ≥ 0
//	16 + 72·N   8     u64 XXH3-64 (seed 0) of bytes [0, 16 + 72·N)
//
// Records are sorted by key, strictly ascending (bytewise): no duplicates.
// No record has a parent equal to its key, and the parent links have no
// cycle: following parents from any record through the records never
// returns to it (a parent not among the records ends the walk). N ≤
// MaxCheckpointRecords. A reader checks, in this order, before allocating:
// the length is at most MaxCheckpointBytes (ReadCheckpoint checks the
// file's size before it reads; CheckCheckpointSize for a reader of its
// own) and at least 24; the magic; N ≤ (length − 24) / 72 and length = 24 +
// 72·N exactly; the hash; then each record (keys ascending, parent ≠ key,
// access ≥ 0); then the cycles.

// CheckpointMagic starts every checkpoint file.
const CheckpointMagic = "KVPLRU1\n"

// Checkpoint layout constants, in bytes.
const (
	checkpointHeaderBytes = 16
	checkpointRecordBytes = 2*KeyBytes + 8
	checkpointTrailBytes  = 8
	// CheckpointMinBytes is the size of an empty checkpoint.
	CheckpointMinBytes = checkpointHeaderBytes + checkpointTrailBytes
)

// MaxCheckpointRecords bounds a checkpoint's records (pages of one
// namespace): 2^23 = 8,388,608, a 604 MB file (MaxCheckpointBytes) and
// about 0.7 GB of decoded records. It bounds what a restart reads into
// memory, whatever the file claims; a namespace with more tracked pages is
// not checkpointed (AppendCheckpoint refuses it), and its restart orders
// the pages by their mtimes alone.
const MaxCheckpointRecords = 1 << 23

// MaxCheckpointBytes is the size of a checkpoint of MaxCheckpointRecords
// records, the largest a reader accepts: 603,979,800 bytes.
const MaxCheckpointBytes = CheckpointMinBytes + MaxCheckpointRecords*checkpointRecordBytes

// ErrCheckpoint: a checkpoint does not decode (wrong magic, length, hash,
// order or value; too large; a parent cycle). The error names what is
// wrong.
var ErrCheckpoint = errors.New("evict: bad recency checkpoint")

// Record is one page's recency (and chain link) in a checkpoint.
type Record struct {
	Key Key
	// Parent is the previous page of the chain when HasParent (encoded as
	// 32 zero bytes when not: no SHA-256 chain key is all zero).
	Parent    Key
	HasParent bool
	Access    int64 // last access, unix nanoseconds, ≥ 0
}

// CheckpointBytes is the encoded size of a checkpoint of n records.
func CheckpointBytes(n int) int64 {
	return CheckpointMinBytes + int64(n)*checkpointRecordBytes
}

// CheckCheckpointSize checks a checkpoint file's size in bytes (from fstat)
// before a reader allocates for it: more than MaxCheckpointBytes, or less
// than CheckpointMinBytes, is ErrCheckpoint.
func CheckCheckpointSize(sizeBytes int64) error {
	if sizeBytes > MaxCheckpointBytes {
		return fmt.Errorf("%w: %d bytes, more than the %d of %d records (MaxCheckpointRecords)", ErrCheckpoint, sizeBytes, int64(MaxCheckpointBytes), MaxCheckpointRecords)
	}
	if sizeBytes < CheckpointMinBytes {
		return fmt.Errorf("%w: %d bytes, shorter than the %d of an empty checkpoint", ErrCheckpoint, sizeBytes, CheckpointMinBytes)
	}
	return nil
}

// ReadCheckpoint reads and decodes a whole checkpoint of sizeBytes bytes
// (the file's size from fstat) from r, which the caller opened (the
// package itself opens no file). The size is checked (CheckCheckpointSize)
// before anything is allocated or read; r must then hold exactly sizeBytes
// bytes. Errors: ErrCheckpoint (too large, too short, a size that differs
// from what r holds, or DecodeCheckpoint's), or r's read error.
func ReadCheckpoint(r io.Reader, sizeBytes int64) ([]Record, error) {
	if err := CheckCheckpointSize(sizeBytes); err != nil {
		return nil, err
	}
	b := make([]byte, sizeBytes+1) // one more: a file longer than its size is refused
	n, err := io.ReadFull(r, b)
	switch {
	case err == io.ErrUnexpectedEOF || err == io.EOF:
		if int64(n) != sizeBytes {
			return nil, fmt.Errorf("%w: %d bytes read, the file's size is %d", ErrCheckpoint, n, sizeBytes)
		}
	case err != nil:
		return nil, fmt.Errorf("evict: reading the recency checkpoint: %w", err)
	default:
		return nil, fmt.Errorf("%w: more than the file's size of %d bytes to read", ErrCheckpoint, sizeBytes)
	}
	return DecodeCheckpoint(b[:n])
}

// AppendCheckpoint appends the checkpoint of recs to dst. recs must be
// sorted by key, strictly ascending, with Access ≥ 0, no parent cycle, and
// at most MaxCheckpointRecords of them (Cache.Checkpoint returns them so,
// below that count); otherwise ErrInvalid and dst unchanged.
func AppendCheckpoint(dst []byte, recs []Record) ([]byte, error) {
	if len(recs) > MaxCheckpointRecords {
		return dst, fmt.Errorf("%w: %d checkpoint records, more than MaxCheckpointRecords (%d)", ErrInvalid, len(recs), MaxCheckpointRecords)
	}
	for i, r := range recs {
		if r.Access < 0 {
			return dst, fmt.Errorf("%w: checkpoint record %d (%s) has access %d < 0", ErrInvalid, i, r.Key, r.Access)
		}
		if i > 0 && !keyLess(recs[i-1].Key, r.Key) {
			return dst, fmt.Errorf("%w: checkpoint record %d (%s) is not after record %d (%s)", ErrInvalid, i, r.Key, i-1, recs[i-1].Key)
		}
		if r.HasParent && (r.Parent == r.Key || r.Parent == (Key{})) {
			return dst, fmt.Errorf("%w: checkpoint record %d (%s) has parent %s (its own key, or all zero)", ErrInvalid, i, r.Key, r.Parent)
		}
	}
	if i, ok := parentCycle(recs); ok {
		return dst, fmt.Errorf("%w: checkpoint record %d (%s) is its own ancestor (a parent cycle)", ErrInvalid, i, recs[i].Key)
	}
	start := len(dst)
	dst = slices.Grow(dst, int(CheckpointBytes(len(recs))))
	dst = append(dst, CheckpointMagic...)
	dst = binary.LittleEndian.AppendUint64(dst, uint64(len(recs)))
	for _, r := range recs {
		dst = append(dst, r.Key[:]...)
		var parent Key
		if r.HasParent {
			parent = r.Parent
		}
		dst = append(dst, parent[:]...)
		dst = binary.LittleEndian.AppendUint64(dst, uint64(r.Access))
	}
	return binary.LittleEndian.AppendUint64(dst, xxh3.Hash(dst[start:])), nil
}

// DecodeCheckpoint decodes and validates a whole checkpoint file (see the
// format above). Errors wrap ErrCheckpoint and name the first problem.
func DecodeCheckpoint(b []byte) ([]Record, error) {
	if err := CheckCheckpointSize(int64(len(b))); err != nil {
		return nil, err
	}
	if !bytes.Equal(b[:8], []byte(CheckpointMagic)) {
		return nil, fmt.Errorf("%w: magic %q, want %q", ErrCheckpoint, b[:8], CheckpointMagic)
	}
	n := binary.LittleEndian.Uint64(b[8:16])
	if limit := uint64(len(b)-CheckpointMinBytes) / checkpointRecordBytes; n > limit {
		return nil, fmt.Errorf("%w: %d records do not fit in %d bytes", ErrCheckpoint, n, len(b))
	}
	if want := CheckpointBytes(int(n)); int64(len(b)) != want {
		return nil, fmt.Errorf("%w: %d bytes for %d records, want exactly %d", ErrCheckpoint, len(b), n, want)
	}
	body := len(b) - checkpointTrailBytes
	if got, want := xxh3.Hash(b[:body]), binary.LittleEndian.Uint64(b[body:]); got != want {
		return nil, fmt.Errorf("%w: hash %016x, stored %016x", ErrCheckpoint, got, want)
	}
	recs := make([]Record, n)
	for i := range recs {
		off := checkpointHeaderBytes + i*checkpointRecordBytes
		r := &recs[i]
		copy(r.Key[:], b[off:off+KeyBytes])
		copy(r.Parent[:], b[off+KeyBytes:off+2*KeyBytes])
		r.HasParent = r.Parent != Key{}
		r.Access = int64(binary.LittleEndian.Uint64(b[off+2*KeyBytes:]))
		if r.Access < 0 {
			return nil, fmt.Errorf("%w: record %d (%s) has access %d < 0", ErrCheckpoint, i, r.Key, r.Access)
		}
		if i > 0 && !keyLess(recs[i-1].Key, r.Key) {
			return nil, fmt.Errorf("%w: record %d (%s) is not after record %d: keys must be strictly ascending", ErrCheckpoint, i, r.Key, i-1)
		}
		if r.Parent == r.Key {
			return nil, fmt.Errorf("%w: record %d (%s) is its own parent", ErrCheckpoint, i, r.Key)
		}
	}
	if i, ok := parentCycle(recs); ok {
		return nil, fmt.Errorf("%w: record %d (%s) is its own ancestor (a parent cycle): its pages could never be evicted", ErrCheckpoint, i, recs[i].Key)
	}
	return recs, nil
}

// parentCycle reports a record on a cycle of parent links among recs
// (sorted by key, strictly ascending). Parents are found by binary search
// over the keys' first 8 bytes (a dense array, 8·N bytes, that stays in
// cache where the 80-byte records would not), then the full key: O(N log N)
// time, 9·N bytes of state, no map.
func parentCycle(recs []Record) (int, bool) {
	const (
		unseen = iota
		onPath
		done
	)
	prefix := make([]uint64, len(recs))
	for i := range recs {
		prefix[i] = binary.BigEndian.Uint64(recs[i].Key[:8])
	}
	find := func(k *Key) int {
		p := binary.BigEndian.Uint64(k[:8])
		i, _ := slices.BinarySearch(prefix, p)
		for ; i < len(recs) && prefix[i] == p; i++ {
			if recs[i].Key == *k {
				return i
			}
		}
		return -1
	}
	state := make([]uint8, len(recs))
	var path []int
	for i := range recs {
		path = path[:0]
		for j := i; state[j] == unseen; {
			state[j] = onPath
			path = append(path, j)
			if !recs[j].HasParent {
				break
			}
			p := find(&recs[j].Parent)
			if p < 0 {
				break
			}
			if state[p] == onPath {
				return p, true
			}
			j = p
		}
		for _, j := range path {
			state[j] = done
		}
	}
	return 0, false
}

// Checkpoint appends the recency and parent of every tracked page of
// namespace ns to dst, sorted by key (victims included: their unlink may
// still fail). A negative access (a caller's clock before 1970) is recorded
// as 0. A page whose parent is all zero bytes (impossible for a SHA-256
// chain) would be recorded without one.
func (c *Cache) Checkpoint(ns string, dst []Record) []Record {
	c.mu.Lock()
	start := len(dst)
	if s := c.ns(ns, false); s != nil {
		dst = slices.Grow(dst, s.pages)
		for _, n := range s.nodes {
			if n.present {
				dst = append(dst, Record{Key: n.key, Parent: n.parent, HasParent: n.hasParent && n.parent != Key{}, Access: max(n.access, 0)})
			}
		}
	}
	c.mu.Unlock()
	slices.SortFunc(dst[start:], func(a, b Record) int { return bytes.Compare(a.Key[:], b.Key[:]) })
	return dst
}

// ApplyCheckpoint moves the recency of namespace ns's tracked pages forward
// to the checkpoint's, clamped to nowNanos, the caller's clock at the
// restart (unix nanoseconds): Access = max(current, min(recorded,
// nowNanos)). The clamp is for a checkpoint written while the clock ran
// ahead: its accesses, in the future of the restarted process, would
// otherwise keep their pages newer than every later touch for as long as
// the clock takes to catch up; clamped, they count as touched at the
// restart and later touches pass them. Records of pages not tracked are
// ignored; the records' parents are not used (a page's parent is set by
// Add, which refuses cycles; DecodeCheckpoint refuses a file with one). It
// returns how many pages it matched.
func (c *Cache) ApplyCheckpoint(ns string, recs []Record, nowNanos int64) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	s := c.ns(ns, false)
	if s == nil {
		return 0
	}
	matched := 0
	for _, r := range recs {
		n := s.nodes[r.Key]
		if n == nil || !n.present {
			continue
		}
		matched++
		if at := min(r.Access, nowNanos); at > n.access {
			n.access = at
			c.fix(s, n)
		}
	}
	return matched
}
