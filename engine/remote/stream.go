package remote

import (
	"bytes"
	"cmp"
	"io"
	"slices"
	"sync"

	"github.com/kvpersist/kvpersist/engine/layout"
	"github.com/kvpersist/kvpersist/internal/xxh3s"
)

// MaxStreamHeaderBytes caps the prefix and header a PageStream keeps in
// memory (a page's header is a few KiB); a larger one is verified by
// reading it back instead.
const MaxStreamHeaderBytes = layout.PrefixLen + layout.MaxPageHeaderLen

// PageStream is a fetch destination for one page object that verifies the
// page from the bytes in hand, so that it need not be read back: every
// write goes through to dst unchanged, and as long as the bytes arrive in
// order from offset 0 (one GET per page, no range tried twice) it keeps the
// object's prefix and header (at most MaxStreamHeaderBytes) and hashes each
// tensor's bytes (xxh3-64) as they pass. Verified then says whether the
// stream proved the page exactly as VerifyPage would from a read-back; when
// it cannot (bytes out of order, a header too large, or any check failing)
// the caller verifies by reading back (VerifyPage), which also gives the
// precise error. A PageStream is safe for the concurrent WriteAt calls of
// several ranges (any out-of-order write just ends the streaming check).
type PageStream struct {
	dst  io.WriterAt
	key  string
	size int64

	mu     sync.Mutex
	pos    int64 // bytes [0, pos) seen, in order
	broken bool  // out of order, or the header cannot be streamed
	head   []byte
	snap   *layout.Snapshot
	slots  []streamSlot // tensor extents with a hash, by offset
	first  int          // slots before it are complete
}

type streamSlot struct {
	start, end int64 // object offsets
	want       string
	d          xxh3s.Digest
}

// NewPageStream returns a PageStream writing the size-byte object of page
// key (64 lowercase hex digits) to dst.
func NewPageStream(dst io.WriterAt, key string, size int64) *PageStream {
	return &PageStream{dst: dst, key: key, size: size}
}

// WriteAt writes p to dst at off, then follows it.
func (s *PageStream) WriteAt(p []byte, off int64) (int, error) {
	n, err := s.dst.WriteAt(p, off)
	s.mu.Lock()
	defer s.mu.Unlock()
	if err != nil || s.broken || off != s.pos {
		s.broken = true
		return n, err
	}
	s.follow(p[:n])
	return n, err
}

// ReadAt fails: a PageStream is a write destination (its caller reads the
// file back itself when Verified says no).
func (s *PageStream) ReadAt([]byte, int64) (int, error) { return 0, errReadOnly }

// follow takes the next bytes of the object (at s.pos), s.mu held.
func (s *PageStream) follow(p []byte) {
	start := s.pos
	s.pos += int64(len(p))
	if s.pos > s.size {
		s.broken = true
		return
	}
	if s.snap == nil {
		s.head = append(s.head, p...)
		s.decodeHead() // once decoded, it follows the bytes after the header itself
		return
	}
	end := start + int64(len(p))
	for i := s.first; i < len(s.slots) && s.slots[i].start < end; i++ {
		t := &s.slots[i]
		lo, hi := max(start, t.start), min(end, t.end)
		if lo < hi {
			t.d.Write(p[lo-start : hi-start])
		}
		if t.end <= end && i == s.first {
			s.first++
		}
	}
}

// decodeHead decodes the header once the bytes in s.head hold it; then
// s.head is released, the slots are set and the bytes after the header
// that came with it are followed.
func (s *PageStream) decodeHead() {
	if len(s.head) < layout.PrefixLen {
		return
	}
	p, err := layout.ParsePrefix(s.head)
	need := int64(layout.PrefixLen) + int64(p.HeaderLen)
	if err != nil || need > MaxStreamHeaderBytes || need > s.size {
		s.broken = true
		return
	}
	if int64(len(s.head)) < need {
		return
	}
	snap, err := Decode(bytes.NewReader(s.head[:need]), s.size, "page "+s.key)
	if err != nil {
		s.broken = true
		return
	}
	s.snap = snap
	for _, t := range snap.Header.Slots() {
		if t.Hash != "" {
			st := int64(snap.DataStart) + t.Off
			s.slots = append(s.slots, streamSlot{start: st, end: st + t.Bytes, want: t.Hash})
		}
	}
	slices.SortFunc(s.slots, func(a, b streamSlot) int { return cmp.Compare(a.start, b.start) })
	// The bytes after the header that came with it.
	rest := s.head[need:]
	s.head = nil
	s.pos = need
	s.follow(rest)
}

// Verified reports whether the stream proved the page: every byte of the
// object written once, in order, its header decoding (layout.Decode) as
// the page of s's key ending exactly at the object's size, and every
// tensor's xxh3-64 equal to its header hash; snap is then the decoded
// header (snap.Page the page), decoded from the very bytes written to dst,
// which a caller may use instead of decoding dst's header again (the
// engine: its prefix load, jobs.SourcePage.Head). false means nothing: the
// caller verifies by reading the object back (VerifyPage).
func (s *PageStream) Verified() (snap *layout.Snapshot, ok bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.broken || s.snap == nil || s.pos != s.size || checkPageSnap(s.snap, s.key, s.size) != nil {
		return nil, false
	}
	for i := range s.slots {
		if layout.TensorHash(s.slots[i].d.Sum64()) != s.slots[i].want {
			return nil, false
		}
	}
	return s.snap, true
}
