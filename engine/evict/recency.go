package evict

import (
	"bytes"
	"slices"
)

// Record is one page's recency and chain link, as the page cache saves it
// across a restart (engine/recency encodes it in the checkpoint file; the
// policy itself reads and writes no file).
type Record struct {
	Key Key
	// Parent is the previous page of the chain when HasParent.
	Parent    Key
	HasParent bool
	Access    int64 // last access, unix nanoseconds, ≥ 0
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
// Add, which refuses cycles; engine/recency refuses a file with one). It
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
