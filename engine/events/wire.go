package events

import (
	"encoding/binary"
	"math"

	"github.com/kvpersist/kvpersist/engine/layout"
)

// Form is how each event of a batch is encoded; the batch itself is always
// the positional array [ts, [events], dp_rank] (docs/format/kv-events.md).
type Form int

const (
	// FormArray encodes an event as a tagged positional array, the tag
	// first: BlockStored ["BlockStored", block_hashes, parent_block_hash,
	// token_ids, block_size, lora_id, medium, lora_name] (8 elements),
	// BlockRemoved ["BlockRemoved", block_hashes, medium] (3),
	// AllBlocksCleared ["AllBlocksCleared"] (1). These lengths are exact:
	// llm-d's Go decoders map the array onto a struct of exactly that many
	// fields and refuse any other length, so the form has no locality.
	FormArray Form = iota
	// FormMap encodes an event as a msgpack map whose first key "type" is
	// the tag, the other keys vLLM's field names (vLLM's encoding since its
	// events stopped being array_like); locality is carried when set.
	FormMap
)

// String is the form's name as Config documents it.
func (f Form) String() string {
	switch f {
	case FormArray:
		return "array"
	case FormMap:
		return "map"
	}
	return "invalid"
}

// Event tags: the first array element (FormArray) or the "type" value
// (FormMap) of each event.
const (
	TagBlockStored      = "BlockStored"
	TagBlockRemoved     = "BlockRemoved"
	TagAllBlocksCleared = "AllBlocksCleared"
)

// Hash64 is the 64-bit block hash announced for a page: the last 8 bytes
// of its key (layout.PageKey, a SHA-256) read as a big-endian unsigned
// integer. It is the reduction vLLM applies to its own 32-byte block
// hashes and llm-d applies to a byte-string hash, so a router that is
// given the full key reduces it to the same value.
func Hash64(k layout.PageKey) uint64 {
	return binary.BigEndian.Uint64(k[len(k)-8:])
}

// msgpack codes used by the encoder (msgpack spec).
const (
	mpNil      = 0xc0
	mpFloat64  = 0xcb
	mpUint8    = 0xcc
	mpUint16   = 0xcd
	mpUint32   = 0xce
	mpUint64   = 0xcf
	mpStr8     = 0xd9
	mpStr16    = 0xda
	mpStr32    = 0xdb
	mpArray16  = 0xdc
	mpArray32  = 0xdd
	mpMap16    = 0xde
	mpFixArray = 0x90
	mpFixMap   = 0x80
	mpFixStr   = 0xa0
)

// appendUint appends n in the shortest msgpack unsigned form, as msgspec
// encodes Python ints (token ids, block size, dp rank).
func appendUint(b []byte, n uint64) []byte {
	switch {
	case n <= 0x7f:
		return append(b, byte(n))
	case n <= math.MaxUint8:
		return append(b, mpUint8, byte(n))
	case n <= math.MaxUint16:
		return binary.BigEndian.AppendUint16(append(b, mpUint16), uint16(n))
	case n <= math.MaxUint32:
		return binary.BigEndian.AppendUint32(append(b, mpUint32), uint32(n))
	}
	return binary.BigEndian.AppendUint64(append(b, mpUint64), n)
}

// appendHash appends a block hash always as msgpack uint64 (0xcf and 8
// bytes): decoded into an interface, it is a uint64 whatever its value
// (llm-d accepts only uint64, int64 or bytes there, never the narrower
// integer types a compact encoding would give).
func appendHash(b []byte, h uint64) []byte {
	return binary.BigEndian.AppendUint64(append(b, mpUint64), h)
}

func appendStr(b []byte, s string) []byte {
	switch n := len(s); {
	case n <= 31:
		b = append(b, mpFixStr|byte(n))
	case n <= math.MaxUint8:
		b = append(b, mpStr8, byte(n))
	case n <= math.MaxUint16:
		b = binary.BigEndian.AppendUint16(append(b, mpStr16), uint16(n))
	default:
		b = binary.BigEndian.AppendUint32(append(b, mpStr32), uint32(n))
	}
	return append(b, s...)
}

// appendOptStr appends s, or nil when s is empty (Python None).
func appendOptStr(b []byte, s string) []byte {
	if s == "" {
		return append(b, mpNil)
	}
	return appendStr(b, s)
}

func appendArrayLen(b []byte, n int) []byte {
	switch {
	case n <= 15:
		return append(b, mpFixArray|byte(n))
	case n <= math.MaxUint16:
		return binary.BigEndian.AppendUint16(append(b, mpArray16), uint16(n))
	}
	return binary.BigEndian.AppendUint32(append(b, mpArray32), uint32(n))
}

func appendMapLen(b []byte, n int) []byte {
	if n <= 15 {
		return append(b, mpFixMap|byte(n))
	}
	return binary.BigEndian.AppendUint16(append(b, mpMap16), uint16(n))
}

func appendFloat64(b []byte, f float64) []byte {
	return binary.BigEndian.AppendUint64(append(b, mpFloat64), math.Float64bits(f))
}

// wire is the per-publisher part of every event: its form and the
// strings that do not change.
type wire struct {
	form     Form
	medium   string // "" encodes None
	locality string // FormMap only; "" omits the field
}

// head appends an event's start: for FormArray an array of n elements
// and the tag; for FormMap a map of n entries (one more with a locality)
// and "type": tag.
func (w *wire) head(b []byte, tag string, n int) []byte {
	if w.form == FormMap {
		if w.locality != "" {
			n++
		}
		b = appendMapLen(b, n)
		b = appendStr(b, "type")
	} else {
		b = appendArrayLen(b, n)
	}
	return appendStr(b, tag)
}

// key appends a field's name (FormMap only: FormArray is positional).
func (w *wire) key(b []byte, name string) []byte {
	if w.form == FormMap {
		return appendStr(b, name)
	}
	return b
}

// tail appends the fields FormMap carries after vLLM's positional ones.
func (w *wire) tail(b []byte) []byte {
	if w.form == FormMap && w.locality != "" {
		b = appendStr(b, "locality")
		b = appendStr(b, w.locality)
	}
	return b
}

func appendHashes(b []byte, hashes []uint64) []byte {
	b = appendArrayLen(b, len(hashes))
	for _, h := range hashes {
		b = appendHash(b, h)
	}
	return b
}

// appendStored appends one BlockStored event: hashes of the pages, the
// parent's hash (hasParent false: None, a chain's first page), the token
// ids of all the pages concatenated, and the block size in tokens.
// lora_id and lora_name are None: a page key's identity already separates
// adapters (the caller puts the adapter into it).
func (w *wire) appendStored(b []byte, hashes []uint64, parent uint64, hasParent bool, tokens []uint32, blockSize int) []byte {
	b = w.head(b, TagBlockStored, 8)
	b = appendHashes(w.key(b, "block_hashes"), hashes)
	b = w.key(b, "parent_block_hash")
	if hasParent {
		b = appendHash(b, parent)
	} else {
		b = append(b, mpNil)
	}
	b = appendArrayLen(w.key(b, "token_ids"), len(tokens))
	for _, t := range tokens {
		b = appendUint(b, uint64(t))
	}
	b = appendUint(w.key(b, "block_size"), uint64(blockSize))
	b = append(w.key(b, "lora_id"), mpNil)
	b = appendOptStr(w.key(b, "medium"), w.medium)
	b = append(w.key(b, "lora_name"), mpNil)
	return w.tail(b)
}

// appendRemoved appends one BlockRemoved event.
func (w *wire) appendRemoved(b []byte, hashes []uint64) []byte {
	b = w.head(b, TagBlockRemoved, 3)
	b = appendHashes(w.key(b, "block_hashes"), hashes)
	b = appendOptStr(w.key(b, "medium"), w.medium)
	return w.tail(b)
}

// appendCleared appends one AllBlocksCleared event (no locality: vLLM's
// AllBlocksCleared has no field).
func (w *wire) appendCleared(b []byte) []byte {
	if w.form == FormMap {
		b = appendMapLen(b, 1)
		b = appendStr(b, "type")
	} else {
		b = appendArrayLen(b, 1)
	}
	return appendStr(b, TagAllBlocksCleared)
}

// appendBatch appends an EventBatch [ts, [events...], dp_rank] holding the
// already encoded events evs; ts is seconds since the Unix epoch.
func appendBatch(b []byte, ts float64, evs [][]byte, dpRank int) []byte {
	b = appendArrayLen(b, 3)
	b = appendFloat64(b, ts)
	b = appendArrayLen(b, len(evs))
	for _, e := range evs {
		b = append(b, e...)
	}
	return appendUint(b, uint64(dpRank))
}
