package evict

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
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
// recorded)). A page written after the last checkpoint keeps its mtime,
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
// No record has a parent equal to its key. A reader checks, in this order,
// before allocating: the length is at least 24; the magic; N ≤ (length −
// 24) / 72 and length = 24 + 72·N exactly; the hash; then each record (keys
// ascending, parent ≠ key, access ≥ 0).

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

// ErrCheckpoint: a checkpoint does not decode (wrong magic, length, hash,
// order or value). The error names what is wrong.
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

// AppendCheckpoint appends the checkpoint of recs to dst. recs must be
// sorted by key, strictly ascending, with Access ≥ 0 (Cache.Checkpoint
// returns them so); otherwise ErrInvalid and dst unchanged.
func AppendCheckpoint(dst []byte, recs []Record) ([]byte, error) {
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
	if len(b) < CheckpointMinBytes {
		return nil, fmt.Errorf("%w: %d bytes, shorter than the %d of an empty checkpoint", ErrCheckpoint, len(b), CheckpointMinBytes)
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
	return recs, nil
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
// to the checkpoint's (Access = max(current, recorded)); records of pages
// not tracked are ignored. It returns how many pages it matched.
func (c *Cache) ApplyCheckpoint(ns string, recs []Record) int {
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
		if r.Access > n.access {
			n.access = r.Access
			c.fix(s, n)
		}
	}
	return matched
}
