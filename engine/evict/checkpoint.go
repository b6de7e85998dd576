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
// rename, directory fsync); at start it rebuilds the pages from the disk
// (Add, with Access = the file's mtime: when the page was written) and then
// applies the checkpoint (ApplyCheckpoint: Access = max(mtime, recorded)).
// A page written after the last checkpoint keeps its mtime, which is later
// than every access the checkpoint recorded; a page the checkpoint names
// that is gone is ignored; a checkpoint that fails to decode is ignored as a
// whole (the mtimes alone still order the pages by their writes). So a
// restart loses at most the touches made since the last checkpoint.
//
// Format (all integers little-endian), 24 + 40·N bytes:
//
//	offset      size  field
//	0           8     magic "KVPLRU1\n" (4b 56 50 4c 52 55 31 0a)
//	8           8     u64 N, the number of records
//	16 + 40·i   32    record i: the page key, 32 raw bytes
//	48 + 40·i   8     record i: i64 last access, unix nanoseconds, ≥ 0
//	16 + 40·N   8     u64 XXH3-64 (seed 0) of bytes [0, 16 + 40·N)
//
// Records are sorted by key, strictly ascending (bytewise): no duplicates.
// A reader checks, in this order, before allocating: the length is at least
// 24; the magic; N ≤ (length − 24) / 40 and length = 24 + 40·N exactly; the
// hash; then each record (keys ascending, access ≥ 0).

// CheckpointMagic starts every checkpoint file.
const CheckpointMagic = "KVPLRU1\n"

// Checkpoint layout constants, in bytes.
const (
	checkpointHeaderBytes = 16
	checkpointRecordBytes = KeyBytes + 8
	checkpointTrailBytes  = 8
	// CheckpointMinBytes is the size of an empty checkpoint.
	CheckpointMinBytes = checkpointHeaderBytes + checkpointTrailBytes
)

// ErrCheckpoint: a checkpoint does not decode (wrong magic, length, hash,
// order or value). The error names what is wrong.
var ErrCheckpoint = errors.New("evict: bad recency checkpoint")

// Record is one page's recency in a checkpoint.
type Record struct {
	Key    Key
	Access int64 // last access, unix nanoseconds, ≥ 0
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
	}
	start := len(dst)
	dst = slices.Grow(dst, int(CheckpointBytes(len(recs))))
	dst = append(dst, CheckpointMagic...)
	dst = binary.LittleEndian.AppendUint64(dst, uint64(len(recs)))
	for _, r := range recs {
		dst = append(dst, r.Key[:]...)
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
		r.Access = int64(binary.LittleEndian.Uint64(b[off+KeyBytes:]))
		if r.Access < 0 {
			return nil, fmt.Errorf("%w: record %d (%s) has access %d < 0", ErrCheckpoint, i, r.Key, r.Access)
		}
		if i > 0 && !keyLess(recs[i-1].Key, r.Key) {
			return nil, fmt.Errorf("%w: record %d (%s) is not after record %d: keys must be strictly ascending", ErrCheckpoint, i, r.Key, i-1)
		}
	}
	return recs, nil
}

// Checkpoint appends the recency of every tracked page of namespace ns to
// dst, sorted by key (victims included: their unlink may still fail). A
// negative access (a caller's clock before 1970) is recorded as 0.
func (c *Cache) Checkpoint(ns string, dst []Record) []Record {
	c.mu.Lock()
	start := len(dst)
	if s := c.ns(ns, false); s != nil {
		dst = slices.Grow(dst, s.pages)
		for _, n := range s.nodes {
			if n.present {
				dst = append(dst, Record{Key: n.key, Access: max(n.access, 0)})
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
