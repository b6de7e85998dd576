package layout

import (
	"bytes"
	"encoding/hex"
	"fmt"
	"unicode/utf8"

	"github.com/kvpersist/kvpersist/engine/vfs"
)

// pageReadMaxHeader bounds the header ReadPage reads on its fast path, in
// bytes; a longer one (a page holds at most MaxPageTokens token ids, about
// 45 KiB of JSON, plus its tensors' entries) goes to Decode, which checks
// the length against the file's size before it allocates.
const pageReadMaxHeader = 1 << 20

// ReadPage returns the page object of a page file (FormatPage): its key,
// parent, identity, page size and token ids, without decoding the rest of
// the header. It reads the prefix and the header, verifies the header
// hash, takes the "page" object that the writer puts first, and checks it
// as Page.Check does (the key is the chain step of its parent over its
// token ids). Tensors are not validated: it serves callers that need a
// page's place in its chain (the KV events' snapshot), not its data, at a
// fraction of Decode's cost. A header in any other form than the writer's
// (another key order, escapes in the identity, a legacy prefix) is decoded
// in full by Decode, as is a file that fails any of these checks, so that
// errors are Decode's: they wrap ErrTruncated, ErrHeaderHash,
// ErrInvalidHeader, ... and name the path.
func ReadPage(f vfs.File, path string) (*Page, error) {
	if p, ok := readPageFast(f); ok {
		return p, nil
	}
	snap, err := Decode(f, path)
	if err != nil {
		return nil, err
	}
	if snap.Page == nil {
		return nil, fmt.Errorf("layout: %s: %w: not a page file (formatVersion %d)", path, ErrInvalidHeader, snap.Header.FormatVersion)
	}
	return snap.Page, nil
}

// readPageFast is ReadPage's fast path; ok false sends the file to Decode.
func readPageFast(f vfs.File) (*Page, bool) {
	var pb [PrefixLen]byte
	if readFull(f, pb[:], 0) != nil {
		return nil, false
	}
	p, err := ParsePrefix(pb[:])
	if err != nil || p.Legacy || p.HeaderLen > pageReadMaxHeader {
		return nil, false
	}
	js := make([]byte, p.HeaderLen)
	if readFull(f, js, PrefixLen) != nil || p.CheckHeaderHash(js) != nil {
		return nil, false
	}
	pg, ok := scanPageObject(js)
	if !ok || pg.Check() != nil {
		return nil, false
	}
	return pg, true
}

// scanPageObject parses the header of a page file in the writer's form:
// {"page":{"key":"<64 hex>","parent":"<64 hex>","identity":"<string>",
// "pageTokens":N,"tokenCount":N,"tokens":[N,...]},...,"formatVersion":F}
// (F: FormatPage)
// with no escape in the identity and every number plain decimal digits
// (the form MetaJSON and the header encoder write). ok is false for
// anything else.
func scanPageObject(js []byte) (*Page, bool) {
	s := scanner{b: js}
	var pg Page
	if !s.lit(`{"page":{"key":"`) || !s.key(&pg.Key) || !s.lit(`","parent":"`) || !s.key(&pg.Parent) ||
		!s.lit(`","identity":"`) {
		return nil, false
	}
	id, ok := s.plainString()
	if !ok {
		return nil, false
	}
	pg.Identity = id
	var count uint64
	var pt uint64
	if !s.lit(`,"pageTokens":`) || !s.uint(&pt, MaxPageTokens) || !s.lit(`,"tokenCount":`) ||
		!s.uint(&count, MaxPageTokens) || !s.lit(`,"tokens":[`) {
		return nil, false
	}
	pg.PageTokens = int(pt)
	pg.Tokens = make([]uint32, 0, count)
	for i := uint64(0); i < count; i++ {
		if i > 0 && !s.lit(",") {
			return nil, false
		}
		var t uint64
		if !s.uint(&t, 1<<32-1) {
			return nil, false
		}
		pg.Tokens = append(pg.Tokens, uint32(t))
	}
	if !s.lit("]},") || !bytes.HasSuffix(js, pageHeaderEnd) {
		return nil, false
	}
	return &pg, true
}

// pageHeaderEnd ends a page file's header in the writer's form.
var pageHeaderEnd = fmt.Appendf(nil, `,"formatVersion":%d}`, FormatPage)

// scanner walks a JSON header in an expected form.
type scanner struct {
	b []byte
	i int
}

// lit consumes lit exactly.
func (s *scanner) lit(lit string) bool {
	if !bytes.HasPrefix(s.b[s.i:], []byte(lit)) {
		return false
	}
	s.i += len(lit)
	return true
}

// key consumes 64 lowercase hex digits into k.
func (s *scanner) key(k *PageKey) bool {
	if len(s.b)-s.i < 64 {
		return false
	}
	h := s.b[s.i : s.i+64]
	for _, c := range h {
		if (c < '0' || c > '9') && (c < 'a' || c > 'f') {
			return false
		}
	}
	_, _ = hex.Decode(k[:], h)
	s.i += 64
	return true
}

// plainString consumes a string's characters and its closing quote: valid
// UTF-8 without a backslash or a control character (which JSON would
// escape or refuse).
func (s *scanner) plainString() (string, bool) {
	j := bytes.IndexByte(s.b[s.i:], '"')
	if j < 0 {
		return "", false
	}
	raw := s.b[s.i : s.i+j]
	for _, c := range raw {
		if c == '\\' || c < 0x20 {
			return "", false
		}
	}
	if !utf8.Valid(raw) {
		return "", false
	}
	s.i += j + 1
	return string(raw), true
}

// uint consumes a decimal number without sign, exponent or leading zero,
// at most maxV.
func (s *scanner) uint(v *uint64, maxV uint64) bool {
	start := s.i
	var n uint64
	for s.i < len(s.b) && s.b[s.i] >= '0' && s.b[s.i] <= '9' {
		n = n*10 + uint64(s.b[s.i]-'0')
		s.i++
		if n > maxV || s.i-start > 10 {
			return false
		}
	}
	if s.i == start || (s.b[start] == '0' && s.i-start > 1) {
		return false
	}
	*v = n
	return true
}
