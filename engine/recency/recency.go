// Package recency is the recency-checkpoint file format: how the page
// cache's eviction order (engine/evict, a pure policy) survives a restart.
// It encodes and decodes bytes and reads from a reader the caller opened;
// it opens no file and knows nothing of the policy, so that the store and
// the CLI read a checkpoint without linking the policy.
//
// The page cache (engine/pagecache) writes one checkpoint file per namespace, periodically and on
// Close, with the durable publish of every other file (temp, fdatasync,
// rename, directory fsync); at start it lists the page files (readdir and
// lstat: st_blocks and mtime, no open), takes each page's parent from the
// checkpoint (a page's parent is a function of its key: the chain), reads
// the header only of pages the checkpoint does not name (written since),
// Adds them with Access = the file's mtime (when the page was written), and
// then applies the checkpoint (evict.Cache.ApplyCheckpoint: Access = max(mtime,
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
// MaxRecords. A reader checks, in this order, before allocating:
// the length is at most MaxBytes (Read checks the
// file's size before it reads; CheckSize for a reader of its
// own) and at least 24; the magic; N ≤ (length − 24) / 72 and length = 24 +
// 72·N exactly; the hash; then each record (keys ascending, parent ≠ key,
// access ≥ 0); then the cycles.
package recency

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"slices"

	"github.com/kvpersist/kvpersist/engine/layout"
	"github.com/zeebo/xxh3"
)

// Magic starts every checkpoint file.
const Magic = "KVPLRU1\n"

// Checkpoint layout constants, in bytes.
const (
	headerBytes = 16
	recordBytes = 2*keyBytes + 8
	trailBytes  = 8
	// MinBytes is the size of an empty checkpoint.
	MinBytes = headerBytes + trailBytes
)

// MaxRecords bounds a checkpoint's records (pages of one
// namespace): 2^23 = 8,388,608, a 604 MB file (MaxBytes) and
// about 0.7 GB of decoded records. It bounds what a restart reads into
// memory, whatever the file claims; a namespace with more tracked pages is
// not checkpointed (Append refuses it), and its restart orders
// the pages by their mtimes alone.
const MaxRecords = 1 << 23

// MaxBytes is the size of a checkpoint of MaxRecords
// records, the largest a reader accepts: 603,979,800 bytes.
const MaxBytes = MinBytes + MaxRecords*recordBytes

// ErrCheckpoint: a checkpoint does not decode (wrong magic, length, hash,
// order or value; too large; a parent cycle). The error names what is
// wrong.
var ErrCheckpoint = errors.New("recency: bad recency checkpoint")

// ErrInvalid: Append was given records that break the format's rules
// (order, access, parent, count). The error names the record.
var ErrInvalid = errors.New("recency: invalid record")

// keyBytes is a page key's length in bytes (layout.PageKey).
const keyBytes = 32

// keyLess reports whether a sorts before b, bytewise.
func keyLess(a, b layout.PageKey) bool { return bytes.Compare(a[:], b[:]) < 0 }

// Record is one page's recency (and chain link) in a checkpoint.
type Record struct {
	Key layout.PageKey
	// Parent is the previous page of the chain when HasParent (encoded as
	// 32 zero bytes when not: no SHA-256 chain key is all zero).
	Parent    layout.PageKey
	HasParent bool
	Access    int64 // last access, unix nanoseconds, ≥ 0
}

// Bytes is the encoded size of a checkpoint of n records.
func Bytes(n int) int64 {
	return MinBytes + int64(n)*recordBytes
}

// CheckSize checks a checkpoint file's size in bytes (from fstat)
// before a reader allocates for it: more than MaxBytes, or less
// than MinBytes, is ErrCheckpoint.
func CheckSize(sizeBytes int64) error {
	if sizeBytes > MaxBytes {
		return fmt.Errorf("%w: %d bytes, more than the %d of %d records (MaxRecords)", ErrCheckpoint, sizeBytes, int64(MaxBytes), MaxRecords)
	}
	if sizeBytes < MinBytes {
		return fmt.Errorf("%w: %d bytes, shorter than the %d of an empty checkpoint", ErrCheckpoint, sizeBytes, MinBytes)
	}
	return nil
}

// Read reads and decodes a whole checkpoint of sizeBytes bytes
// (the file's size from fstat) from r, which the caller opened (the
// package itself opens no file). The size is checked (CheckSize)
// before anything is allocated or read; r must then hold exactly sizeBytes
// bytes. Errors: ErrCheckpoint (too large, too short, a size that differs
// from what r holds, or Decode's), or r's read error.
func Read(r io.Reader, sizeBytes int64) ([]Record, error) {
	if err := CheckSize(sizeBytes); err != nil {
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
		return nil, fmt.Errorf("recency: reading the checkpoint: %w", err)
	default:
		return nil, fmt.Errorf("%w: more than the file's size of %d bytes to read", ErrCheckpoint, sizeBytes)
	}
	return Decode(b[:n])
}

// Append appends the checkpoint of recs to dst. recs must be
// sorted by key, strictly ascending, with Access ≥ 0, no parent cycle, and
// at most MaxRecords of them (Cache.Checkpoint returns them so,
// below that count); otherwise ErrInvalid and dst unchanged.
func Append(dst []byte, recs []Record) ([]byte, error) {
	if len(recs) > MaxRecords {
		return dst, fmt.Errorf("%w: %d checkpoint records, more than MaxRecords (%d)", ErrInvalid, len(recs), MaxRecords)
	}
	for i, r := range recs {
		if r.Access < 0 {
			return dst, fmt.Errorf("%w: checkpoint record %d (%s) has access %d < 0", ErrInvalid, i, r.Key, r.Access)
		}
		if i > 0 && !keyLess(recs[i-1].Key, r.Key) {
			return dst, fmt.Errorf("%w: checkpoint record %d (%s) is not after record %d (%s)", ErrInvalid, i, r.Key, i-1, recs[i-1].Key)
		}
		if r.HasParent && (r.Parent == r.Key || r.Parent == (layout.PageKey{})) {
			return dst, fmt.Errorf("%w: checkpoint record %d (%s) has parent %s (its own key, or all zero)", ErrInvalid, i, r.Key, r.Parent)
		}
	}
	if i, ok := parentCycle(recs); ok {
		return dst, fmt.Errorf("%w: checkpoint record %d (%s) is its own ancestor (a parent cycle)", ErrInvalid, i, recs[i].Key)
	}
	start := len(dst)
	dst = slices.Grow(dst, int(Bytes(len(recs))))
	dst = append(dst, Magic...)
	dst = binary.LittleEndian.AppendUint64(dst, uint64(len(recs)))
	for _, r := range recs {
		dst = append(dst, r.Key[:]...)
		var parent layout.PageKey
		if r.HasParent {
			parent = r.Parent
		}
		dst = append(dst, parent[:]...)
		dst = binary.LittleEndian.AppendUint64(dst, uint64(r.Access))
	}
	return binary.LittleEndian.AppendUint64(dst, xxh3.Hash(dst[start:])), nil
}

// Decode decodes and validates a whole checkpoint file (see the
// format above). Errors wrap ErrCheckpoint and name the first problem.
func Decode(b []byte) ([]Record, error) {
	if err := CheckSize(int64(len(b))); err != nil {
		return nil, err
	}
	if !bytes.Equal(b[:8], []byte(Magic)) {
		return nil, fmt.Errorf("%w: magic %q, want %q", ErrCheckpoint, b[:8], Magic)
	}
	n := binary.LittleEndian.Uint64(b[8:16])
	if limit := uint64(len(b)-MinBytes) / recordBytes; n > limit {
		return nil, fmt.Errorf("%w: %d records do not fit in %d bytes", ErrCheckpoint, n, len(b))
	}
	if want := Bytes(int(n)); int64(len(b)) != want {
		return nil, fmt.Errorf("%w: %d bytes for %d records, want exactly %d", ErrCheckpoint, len(b), n, want)
	}
	body := len(b) - trailBytes
	if got, want := xxh3.Hash(b[:body]), binary.LittleEndian.Uint64(b[body:]); got != want {
		return nil, fmt.Errorf("%w: hash %016x, stored %016x", ErrCheckpoint, got, want)
	}
	recs := make([]Record, n)
	for i := range recs {
		off := headerBytes + i*recordBytes
		r := &recs[i]
		copy(r.Key[:], b[off:off+keyBytes])
		copy(r.Parent[:], b[off+keyBytes:off+2*keyBytes])
		r.HasParent = r.Parent != layout.PageKey{}
		r.Access = int64(binary.LittleEndian.Uint64(b[off+2*keyBytes:]))
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
	find := func(k *layout.PageKey) int {
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
