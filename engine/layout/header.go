package layout

import (
	"bytes"
	"encoding/json"
	"fmt"
	"slices"
	"sort"
	"strconv"
	"unicode/utf8"
)

// Meta is caller metadata: JSON values by key (model id, token ids, offsets,
// cache type, anything), kept as given except that Encode compacts each
// value (insignificant whitespace removed); a value read back from a file
// is byte-for-byte what the file holds. Keys that kvpersist
// itself owns at that level ("formatVersion", "caches", "attachments",
// "tensors", "off", "bytes", "hash", "dtype", "shape", "blocks") are not
// allowed in Meta.
type Meta map[string]json.RawMessage

// MetaOf marshals each value of m with encoding/json into a Meta.
func MetaOf(m map[string]any) (Meta, error) {
	out := make(Meta, len(m))
	for k, v := range m {
		b, err := json.Marshal(v)
		if err != nil {
			return nil, fmt.Errorf("layout: metadata %q: %w", k, err)
		}
		out[k] = b
	}
	return out, nil
}

// Header is the JSON header of a snapshot file or block manifest. Its tensor
// slots, in file order, are every tensor of Caches (in order), then every
// tensor of Attachments. See docs/format/single-file.md.
type Header struct {
	// FormatVersion is FormatSingle (4), FormatBlocks (5, read only),
	// FormatPage (6), FormatPages (7) or FormatBlocksXXH3 (8, the block
	// manifest kvpersist writes). Files written by the Bun worker carry no
	// version for the single-file layout (read as 0).
	FormatVersion int
	Caches        []Entry
	Attachments   []Entry
	Meta          Meta // caller metadata at the top level
}

// Entry is one cache (a layer's K and V) or one attachment (token ids ...).
type Entry struct {
	Tensors []Tensor
	Meta    Meta // e.g. "type":"KVCache","offset":T or "name":"tokens"
}

// Tensor is one tensor slot.
type Tensor struct {
	// Off is the byte offset of the tensor's bytes from the file's data start
	// (single-file layout; a multiple of TensorAlign in kvpersist's files).
	// In a block manifest it is the running sum of Bytes, informational only.
	Off int64
	// Bytes is the tensor's logical size in bytes: product(Shape) × itemsize.
	Bytes int64
	// Hash is xxh3-64 of the logical bytes as 16 lowercase hex digits of the
	// big-endian u64 (fmt "%016x"), single-file layout only; "" in manifests.
	Hash  string
	DType string
	// Shape is in elements, row-major.
	Shape  []int64
	Blocks []BlockRef // block layout only, in order
	Meta   Meta       // unknown per-tensor keys, preserved
}

// BlockRef names one block of a tensor in a block manifest.
type BlockRef struct {
	Hash  string // SHA-256 of the block's bytes, 64 lowercase hex digits: the block file's name
	Bytes int64  // block length in bytes, > 0
	// XXH3 is XXH3-64 (seed 0) of the block's bytes as 16 lowercase hex
	// digits of the u64, most significant first (fmt "%016x", as
	// Tensor.Hash): what a verified restore checks the bytes against.
	// Required in a FormatBlocksXXH3 manifest, "" (absent) in a
	// FormatBlocks one. In JSON (inspect) it is "XXH3", left out when "".
	XXH3 string `json:"XXH3,omitempty"`
}

// SameBlocks reports whether two block lists name the same blocks (hash
// and size) in the same order; XXH3 is not compared, so a FormatBlocks
// list and the FormatBlocksXXH3 list of the same blocks are the same.
func SameBlocks(a, b []BlockRef) bool {
	return slices.EqualFunc(a, b, func(x, y BlockRef) bool { return x.Hash == y.Hash && x.Bytes == y.Bytes })
}

// Slots returns every tensor slot in file order: caches first, then
// attachments. The returned pointers alias h.
func (h *Header) Slots() []*Tensor {
	var out []*Tensor
	for _, group := range [][]Entry{h.Caches, h.Attachments} {
		for i := range group {
			for j := range group[i].Tensors {
				out = append(out, &group[i].Tensors[j])
			}
		}
	}
	return out
}

// TotalBytes returns the snapshot's logical size in bytes: the sum of every
// slot's Bytes, what a restore fills. It fails with ErrSnapshotTooLarge when
// the sum exceeds MaxSnapshotBytes (1 TiB) or a Bytes is negative, so a
// header that did not come through Validate cannot make a caller allocate
// from a wrapped sum. Headers returned by Decode always succeed.
func (h *Header) TotalBytes() (int64, error) {
	var total int64
	for i, t := range h.Slots() {
		if t.Bytes < 0 {
			return 0, fmt.Errorf("%w: %s has a negative byte count %d", ErrSnapshotTooLarge, h.SlotName(i), t.Bytes)
		}
		if t.Bytes > MaxSnapshotBytes-total {
			return 0, fmt.Errorf("%w: the tensors up to %s sum past %d bytes", ErrSnapshotTooLarge, h.SlotName(i), MaxSnapshotBytes)
		}
		total += t.Bytes
	}
	return total, nil
}

// SlotName describes slot i for error messages: "cache 3 tensor 1 (slot 7)".
// It walks the entries: O(entries) per call. To name many slots (every
// slot of a write, every failed slot of a read), build a SlotIndex once.
func (h *Header) SlotName(i int) string {
	n := i
	for ci, e := range h.Caches {
		if n < len(e.Tensors) {
			return fmt.Sprintf("cache %d tensor %d (slot %d)", ci, n, i)
		}
		n -= len(e.Tensors)
	}
	for ai, e := range h.Attachments {
		if n < len(e.Tensors) {
			return fmt.Sprintf("attachment %d tensor %d (slot %d)", ai, n, i)
		}
		n -= len(e.Tensors)
	}
	return fmt.Sprintf("slot %d", i)
}

// SlotIndex names the slots of one header in O(1) each, as
// Header.SlotName does; building it costs O(slots + entries) time and 8
// bytes per slot plus 8 per entry. It is a snapshot of the header's shape
// when built: it does not follow later changes to the entries.
type SlotIndex struct {
	entry        []int // slot → its entry: Caches first, then Attachments
	first        []int // entry → its first slot
	cacheEntries int   // entries of Caches (the first ones of first)
}

// SlotIndex returns the index of h's slots (see SlotIndex).
func (h *Header) SlotIndex() *SlotIndex {
	x := &SlotIndex{cacheEntries: len(h.Caches), first: make([]int, 0, len(h.Caches)+len(h.Attachments))}
	n := 0
	for _, group := range [][]Entry{h.Caches, h.Attachments} {
		for _, e := range group {
			n += len(e.Tensors)
		}
	}
	x.entry = make([]int, 0, n)
	for _, group := range [][]Entry{h.Caches, h.Attachments} {
		for _, e := range group {
			x.first = append(x.first, len(x.entry))
			for range e.Tensors {
				x.entry = append(x.entry, len(x.first)-1)
			}
		}
	}
	return x
}

// Name is h.SlotName(i) in O(1): "cache 3 tensor 1 (slot 7)", "attachment
// 0 tensor 0 (slot 64)", or "slot i" for an i out of range.
func (x *SlotIndex) Name(i int) string {
	if i < 0 || i >= len(x.entry) {
		return fmt.Sprintf("slot %d", i)
	}
	e := x.entry[i]
	if e < x.cacheEntries {
		return fmt.Sprintf("cache %d tensor %d (slot %d)", e, i-x.first[e], i)
	}
	return fmt.Sprintf("attachment %d tensor %d (slot %d)", e-x.cacheEntries, i-x.first[e], i)
}

// Clone returns a deep copy of h (Meta values are shared: they are immutable).
func (h *Header) Clone() *Header {
	c := *h
	c.Caches = cloneEntries(h.Caches)
	c.Attachments = cloneEntries(h.Attachments)
	return &c
}

func cloneEntries(es []Entry) []Entry {
	if es == nil {
		return nil
	}
	out := make([]Entry, len(es))
	for i, e := range es {
		out[i] = Entry{Meta: e.Meta, Tensors: make([]Tensor, len(e.Tensors))}
		for j, t := range e.Tensors {
			t.Shape = append([]int64(nil), t.Shape...)
			t.Blocks = append([]BlockRef(nil), t.Blocks...)
			out[i].Tensors[j] = t
		}
	}
	return out
}

var reservedTop = []string{"formatVersion", "caches", "attachments"}
var reservedEntry = []string{"tensors"}
var reservedTensor = []string{"off", "bytes", "hash", "dtype", "shape", "blocks"}

func checkMeta(m Meta, reserved []string, where string) error {
	for _, k := range reserved {
		if _, ok := m[k]; ok {
			return fmt.Errorf("%w: %s metadata uses the reserved key %q", ErrInvalidHeader, where, k)
		}
	}
	for k, v := range m {
		if !utf8.ValidString(k) {
			// encoding/json would write U+FFFD for the bad bytes: two such
			// keys could become one key given twice, which readers refuse.
			return fmt.Errorf("%w: %s metadata key %s is not valid UTF-8", ErrInvalidHeader, where, quoteCapped(k))
		}
		if !json.Valid(v) {
			return fmt.Errorf("%w: %s metadata %s is not valid JSON", ErrInvalidHeader, where, quoteCapped(k))
		}
		if dk, _, dup := duplicateKey(v); dup {
			return fmt.Errorf("%w: %s metadata %s has the key %s twice in one object (readers refuse it)", ErrInvalidHeader, where, quoteCapped(k), quoteCapped(dk))
		}
	}
	return nil
}

// jsonWriter builds compact JSON objects with known keys first, then
// metadata keys in sorted order, so that the encoding is deterministic.
type jsonWriter struct{ bytes.Buffer }

func (w *jsonWriter) key(first *bool, k string) {
	if !*first {
		w.WriteByte(',')
	}
	*first = false
	w.str(k)
	w.WriteByte(':')
}

func (w *jsonWriter) meta(first *bool, m Meta) {
	if len(m) == 0 {
		return
	}
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	for _, k := range keys {
		w.key(first, k)
		// Compact so that the bytes are stable; valid JSON was checked.
		var c bytes.Buffer
		if err := json.Compact(&c, m[k]); err != nil {
			w.Write(m[k])
		} else {
			w.Write(c.Bytes())
		}
	}
}

func (w *jsonWriter) int(v int64) {
	var b [20]byte
	w.Write(strconv.AppendInt(b[:0], v, 10))
}

// str writes s as a JSON string, byte for byte as json.Marshal writes it:
// plain printable ASCII (the keys, hex hashes, dtypes and identities a
// header mostly holds) directly, anything else through json.Marshal (which
// escapes control characters, '"', '\\', '<', '>', '&', U+2028, U+2029 and
// replaces invalid UTF-8). Encoding a page header this way is several times
// faster than marshalling every string.
func (w *jsonWriter) str(s string) {
	for i := 0; i < len(s); i++ {
		if c := s[i]; c < 0x20 || c > 0x7e || c == '"' || c == '\\' || c == '<' || c == '>' || c == '&' {
			b, _ := json.Marshal(s)
			w.Write(b)
			return
		}
	}
	w.WriteByte('"')
	w.WriteString(s)
	w.WriteByte('"')
}

// Encode returns the header's compact JSON. Cache entries' metadata comes
// first in each entry object, then "tensors"; tensor keys are written in the
// order off, bytes, hash, dtype, shape, blocks (blocks only when non-nil);
// a block's as hash, bytes, xxh3 (xxh3 only when not "").
// It fails with ErrInvalidHeader when metadata uses a reserved key or is not
// valid JSON.
func (h *Header) Encode() ([]byte, error) {
	if err := checkMeta(h.Meta, reservedTop, "header"); err != nil {
		return nil, err
	}
	var w jsonWriter
	first := true
	w.WriteByte('{')
	w.meta(&first, h.Meta)
	for _, g := range []struct {
		name    string
		entries []Entry
	}{{"caches", h.Caches}, {"attachments", h.Attachments}} {
		if g.name == "attachments" && g.entries == nil {
			continue
		}
		w.key(&first, g.name)
		w.WriteByte('[')
		for i, e := range g.entries {
			if err := checkMeta(e.Meta, reservedEntry, fmt.Sprintf("%s[%d]", g.name, i)); err != nil {
				return nil, err
			}
			if i > 0 {
				w.WriteByte(',')
			}
			ef := true
			w.WriteByte('{')
			w.meta(&ef, e.Meta)
			w.key(&ef, "tensors")
			w.WriteByte('[')
			for j, t := range e.Tensors {
				if err := checkMeta(t.Meta, reservedTensor, fmt.Sprintf("%s[%d].tensors[%d]", g.name, i, j)); err != nil {
					return nil, err
				}
				if j > 0 {
					w.WriteByte(',')
				}
				tf := true
				w.WriteByte('{')
				w.key(&tf, "off")
				w.int(t.Off)
				w.key(&tf, "bytes")
				w.int(t.Bytes)
				w.key(&tf, "hash")
				w.str(t.Hash)
				w.key(&tf, "dtype")
				w.str(t.DType)
				w.key(&tf, "shape")
				w.WriteByte('[')
				for k, d := range t.Shape {
					if k > 0 {
						w.WriteByte(',')
					}
					w.int(d)
				}
				w.WriteByte(']')
				if t.Blocks != nil {
					w.key(&tf, "blocks")
					w.WriteByte('[')
					for k, b := range t.Blocks {
						if k > 0 {
							w.WriteByte(',')
						}
						w.WriteString(`{"hash":`)
						w.str(b.Hash)
						w.WriteString(`,"bytes":`)
						w.int(b.Bytes)
						if b.XXH3 != "" {
							w.WriteString(`,"xxh3":`)
							w.str(b.XXH3)
						}
						w.WriteByte('}')
					}
					w.WriteByte(']')
				}
				w.meta(&tf, t.Meta)
				w.WriteByte('}')
			}
			w.WriteString("]}")
		}
		w.WriteByte(']')
	}
	if h.FormatVersion != 0 {
		w.key(&first, "formatVersion")
		w.int(int64(h.FormatVersion))
	}
	w.WriteByte('}')
	return w.Bytes(), nil
}

// parseHeader decodes the header JSON of a file of prefix p strictly:
// every known field must have its JSON type; unknown keys become Meta. The
// formatVersion is checked against p's magic first (layoutOf: a version
// this build or the Bun worker never wrote is ErrFormatVersion, whatever
// its tensors hold); the other semantic checks are in Validate.
func parseHeader(js []byte, p Prefix) (*Header, error) {
	var top map[string]json.RawMessage
	if err := json.Unmarshal(js, &top); err != nil {
		return nil, fmt.Errorf("%w: header JSON: %v", ErrInvalidHeader, err)
	}
	// Valid JSON now (Unmarshal checked it): refuse a key given twice in
	// one object, which Unmarshal would have resolved silently (last wins).
	if k, off, dup := duplicateKey(js); dup {
		return nil, fmt.Errorf("%w: header JSON: key %s appears twice in one object (second at byte %d of the JSON)", ErrInvalidHeader, quoteCapped(k), off)
	}
	h := &Header{Meta: Meta{}}
	if v, ok := top["formatVersion"]; ok {
		if err := json.Unmarshal(v, &h.FormatVersion); err != nil {
			return nil, fmt.Errorf("%w: formatVersion: %v", ErrInvalidHeader, err)
		}
	}
	if _, err := layoutOf(p, h.FormatVersion); err != nil {
		return nil, err
	}
	var err error
	if h.Caches, err = parseEntries(top["caches"], "caches", true, h.FormatVersion); err != nil {
		return nil, err
	}
	if v, ok := top["attachments"]; ok {
		if h.Attachments, err = parseEntries(v, "attachments", false, h.FormatVersion); err != nil {
			return nil, err
		}
	}
	for k, v := range top {
		switch k {
		case "formatVersion", "caches", "attachments":
		default:
			h.Meta[k] = v
		}
	}
	return h, nil
}

// parseEntries parses a list of entries of a header of formatVersion
// version (which decides the keys of a block object: parseTensor).
func parseEntries(raw json.RawMessage, name string, required bool, version int) ([]Entry, error) {
	if raw == nil {
		if required {
			return nil, fmt.Errorf("%w: %q is missing", ErrInvalidHeader, name)
		}
		return nil, nil
	}
	if isNull(raw) {
		return nil, fmt.Errorf("%w: %q is null", ErrInvalidHeader, name)
	}
	var list []map[string]json.RawMessage
	if err := json.Unmarshal(raw, &list); err != nil {
		return nil, fmt.Errorf("%w: %s: %v", ErrInvalidHeader, name, err)
	}
	if list == nil {
		list = []map[string]json.RawMessage{}
	}
	out := make([]Entry, len(list))
	for i, obj := range list {
		where := fmt.Sprintf("%s[%d]", name, i)
		if obj == nil {
			return nil, fmt.Errorf("%w: %s is not an object", ErrInvalidHeader, where)
		}
		var ts []map[string]json.RawMessage
		if err := json.Unmarshal(obj["tensors"], &ts); err != nil || obj["tensors"] == nil || isNull(obj["tensors"]) {
			return nil, fmt.Errorf("%w: %s.tensors: missing or not a list", ErrInvalidHeader, where)
		}
		e := Entry{Meta: Meta{}, Tensors: make([]Tensor, len(ts))}
		for k, v := range obj {
			if k != "tensors" {
				e.Meta[k] = v
			}
		}
		for j, t := range ts {
			tw := fmt.Sprintf("%s.tensors[%d]", where, j)
			if t == nil {
				return nil, fmt.Errorf("%w: %s is not an object", ErrInvalidHeader, tw)
			}
			var err error
			if e.Tensors[j], err = parseTensor(t, tw, version); err != nil {
				return nil, err
			}
		}
		out[i] = e
	}
	return out, nil
}

// parseTensor parses one tensor object. Its blocks, if any, are exactly
// {"hash": string, "bytes": integer}, plus "xxh3": string when version is
// FormatBlocksXXH3 (either for versions without blocks); the xxh3's form
// is Validate's to check.
func parseTensor(t map[string]json.RawMessage, where string, version int) (Tensor, error) {
	var x Tensor
	field := func(k string, dst any, required bool) error {
		v, ok := t[k]
		if !ok {
			if required {
				return fmt.Errorf("%w: %s.%s is missing", ErrInvalidHeader, where, k)
			}
			return nil
		}
		if isNull(v) {
			return fmt.Errorf("%w: %s.%s is null", ErrInvalidHeader, where, k)
		}
		if err := json.Unmarshal(v, dst); err != nil {
			return fmt.Errorf("%w: %s.%s: %v", ErrInvalidHeader, where, k, err)
		}
		return nil
	}
	var blocks []map[string]json.RawMessage
	for _, f := range []struct {
		k        string
		dst      any
		required bool
	}{
		{"off", &x.Off, false}, {"bytes", &x.Bytes, true}, {"hash", &x.Hash, false},
		{"dtype", &x.DType, true}, {"shape", &x.Shape, true}, {"blocks", &blocks, false},
	} {
		if err := field(f.k, f.dst, f.required); err != nil {
			return x, err
		}
	}
	if _, ok := t["blocks"]; ok {
		x.Blocks = make([]BlockRef, len(blocks))
		// FormatBlocks: exactly {hash, bytes}; FormatBlocksXXH3: exactly
		// {hash, bytes, xxh3}; any other version either (an unknown one
		// was refused with ErrFormatVersion before, by parseHeader; a
		// known one without blocks is refused for having them by
		// Validate, the error that matters).
		keys, want := 0, `{"hash": string, "bytes": integer} or {"hash": string, "bytes": integer, "xxh3": string}`
		switch version {
		case FormatBlocks:
			keys, want = 2, `{"hash": string, "bytes": integer}`
		case FormatBlocksXXH3:
			keys, want = 3, `{"hash": string, "bytes": integer, "xxh3": string}`
		}
		for i, b := range blocks {
			// Exactly these keys, matched exactly (encoding/json's struct
			// matching ignores case).
			hv, bv, xv := b["hash"], b["bytes"], b["xxh3"]
			n := 2
			if xv != nil {
				n = 3
			}
			if len(b) != n || (keys != 0 && n != keys) || hv == nil || bv == nil ||
				json.Unmarshal(hv, &x.Blocks[i].Hash) != nil || isNull(hv) ||
				json.Unmarshal(bv, &x.Blocks[i].Bytes) != nil || isNull(bv) ||
				(xv != nil && (json.Unmarshal(xv, &x.Blocks[i].XXH3) != nil || isNull(xv))) {
				return x, fmt.Errorf("%w: %s.blocks[%d] must be exactly %s (formatVersion %d)", ErrInvalidHeader, where, i, want, version)
			}
		}
	}
	x.Meta = Meta{}
	for k, v := range t {
		switch k {
		case "off", "bytes", "hash", "dtype", "shape", "blocks":
		default:
			x.Meta[k] = v
		}
	}
	return x, nil
}

// isNull reports whether a JSON value is the literal null.
func isNull(v json.RawMessage) bool { return string(bytes.TrimSpace(v)) == "null" }
