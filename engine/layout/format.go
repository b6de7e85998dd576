// Package layout owns kvpersist's on-disk formats: the single-file snapshot,
// the block manifest with its content-addressed blocks, the files written by
// the original Bun worker (read only), path rules, and the atomic durable
// publish every writer uses. docs/format/ is the specification; this
// package is its reference implementation.
package layout

import (
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"math"
	"math/bits"
	"regexp"
	"sort"
	"strconv"
	"unicode/utf8"

	"github.com/kvpersist/kvpersist/internal/bunhash"
	"github.com/zeebo/xxh3"
)

// Magic begins every file kvpersist writes (10 bytes).
const Magic = "KVPERSIST\n"

// LegacyMagic begins files written by the original Bun worker.
const LegacyMagic = "MLXBUNKV2\n"

const (
	// PrefixLen is the fixed prefix: magic (10), u32 LE header length,
	// u32 LE data start, u64 LE header hash.
	PrefixLen = 26
	// DataAlign is the alignment of a single-file snapshot's data start,
	// in bytes (16 KiB, as the original).
	DataAlign = 16384
	// TensorAlign is the alignment of each tensor's Off in a single-file
	// snapshot, in bytes: a multiple of every direct-I/O alignment seen on
	// Linux file systems (512 or 4096), so tensors can be written with O_DIRECT.
	TensorAlign = 4096
	// MaxHeaderLen caps the header JSON, in bytes, so that a corrupt length
	// cannot make a reader allocate gigabytes.
	MaxHeaderLen = 64 << 20
	// MaxPageHeaderLen caps a page file's header JSON, in bytes (DecodePage;
	// a save refuses a page whose header would exceed it). A page's header
	// is a few KiB (its token ids, up to MaxPageTokens, and one entry per
	// tensor: about 60 KiB for 4,096 tokens and 256 tensors); 1 MiB leaves
	// room for thousands of tensors while bounding what one page file can
	// make a reader allocate.
	MaxPageHeaderLen = 1 << 20
	// MaxRank caps the number of axes of a tensor.
	MaxRank = 16
	// MaxSnapshotBytes caps a snapshot's total logical bytes (the sum of
	// every tensor slot's Bytes): 1 TiB, far above any KV cache a host
	// holds (Llama-3.1-8B at 128k tokens is 16 GiB) and far below where the
	// sum of int64 byte counts could wrap. A header whose slots sum past it
	// (or whose sum overflows) is refused by Validate, Header.TotalBytes and
	// the writer with ErrSnapshotTooLarge, before anything is allocated for
	// its tensors. A reader that can afford less checks TotalBytes against
	// its own budget before allocating destinations.
	MaxSnapshotBytes int64 = 1 << 40
)

// Format versions carried in the header's "formatVersion".
const (
	FormatSingle = 4 // kvpersist single-file snapshot
	// FormatBlocks is the block manifest of the original worker's number:
	// each block named by its SHA-256 alone. kvpersist reads it (the Bun
	// worker's stores, and kvpersist's own manifests written before
	// FormatBlocksXXH3) and no longer writes it.
	FormatBlocks = 5
	// FormatBlocksXXH3 is the block manifest kvpersist writes: FormatBlocks
	// with each block's XXH3-64 (seed 0) beside its SHA-256 name
	// (BlockRef.XXH3), which a verified restore checks instead of SHA-256
	// (docs/format/block-manifest.md). A new version rather than an
	// optional key: it says every block carries an xxh3, so a block
	// without one is malformed rather than checked by SHA-256 instead.
	// An older build (one reading formatVersion 4 to 7) refuses such a
	// manifest, but not as an unknown version: it parses each block
	// object as exactly {"hash", "bytes"} before it checks
	// formatVersion, so it refuses the manifest with ErrInvalidHeader ("...blocks[0] must be
	// exactly {"hash": string, "bytes": integer}"): its restore of it
	// fails, its verify reports the manifest unreadable (check "header
	// validation"), and its gc leaves that namespace unswept ("it holds
	// an unreadable file"; stale temp files are still removed).
	FormatBlocksXXH3 = 8
)

// Layout says how a snapshot stores its tensor bytes.
type Layout int

const (
	// Single is one file holding the header and every tensor's bytes.
	Single Layout = iota + 1
	// Blocks is a manifest naming content-addressed block files.
	Blocks
	// Pages is a page manifest (FormatPages): the cache tensors' bytes are
	// in token pages named by their keys, shared with the prefix cache;
	// attachments are in the manifest's own data region.
	Pages
)

func (l Layout) String() string {
	switch l {
	case Single:
		return "single"
	case Blocks:
		return "blocks"
	case Pages:
		return "pages"
	}
	return fmt.Sprintf("Layout(%d)", int(l))
}

// ParseLayout parses "single" or "blocks".
func ParseLayout(s string) (Layout, error) {
	switch s {
	case "single":
		return Single, nil
	case "blocks":
		return Blocks, nil
	case "pages":
		return Pages, nil
	}
	return 0, fmt.Errorf("layout: unknown layout %q (want single, blocks or pages)", s)
}

// Sentinel errors of decoding, usable with errors.Is. Returned errors wrap
// one of them and name the file and field at fault.
var (
	ErrBadMagic       = errors.New("not a kvpersist file (bad magic)")
	ErrTruncated      = errors.New("file is truncated")
	ErrHeaderTooLarge = errors.New("header length exceeds the limit")
	ErrHeaderHash     = errors.New("header hash mismatch")
	ErrFormatVersion  = errors.New("unsupported format version")
	ErrInvalidHeader  = errors.New("invalid header")
	ErrUnknownDType   = errors.New("unknown dtype")
	// ErrSnapshotTooLarge: the tensors' bytes sum past MaxSnapshotBytes (or
	// past int64). Errors wrapping it also wrap ErrInvalidHeader when they
	// come from decoding a file.
	ErrSnapshotTooLarge = errors.New("snapshot exceeds the size limit")
)

// dtypeSizes maps dtype names (mlx / numpy spellings) to itemsize in bytes.
var dtypeSizes = map[string]int{
	"bool": 1, "int8": 1, "uint8": 1,
	"int16": 2, "uint16": 2, "float16": 2, "bfloat16": 2,
	"int32": 4, "uint32": 4, "float32": 4,
	"int64": 8, "uint64": 8, "float64": 8, "complex64": 8,
}

// ItemSize returns the itemsize in bytes of a known dtype, or ErrUnknownDType.
func ItemSize(dtype string) (int, error) {
	if n, ok := dtypeSizes[dtype]; ok {
		return n, nil
	}
	return 0, fmt.Errorf("%w: %s", ErrUnknownDType, quoteCapped(dtype))
}

// maxQuoted is how many bytes of a string an error quotes (quoteCapped).
const maxQuoted = 64

// quoteCapped quotes s as %q does, but at most its first maxQuoted bytes
// (cut at a UTF-8 character boundary) followed by "... (N bytes)": a
// header-controlled string (a block name, a hash, a dtype, a key) can be
// megabytes long (headers go up to MaxHeaderLen), and an error echoing it
// whole would be carried by ls, verify, inspect and every log.
func quoteCapped(s string) string {
	if len(s) <= maxQuoted {
		return strconv.Quote(s)
	}
	cut := maxQuoted
	for cut > 0 && !utf8.RuneStart(s[cut]) {
		cut--
	}
	return strconv.Quote(s[:cut]) + "... (" + strconv.Itoa(len(s)) + " bytes)"
}

var blockHashRE = regexp.MustCompile(`^[0-9a-f]{64}$`)
var tensorHashRE = regexp.MustCompile(`^[0-9a-f]{16}$`)

// ValidBlockHash reports whether s is exactly 64 lowercase hex digits, the
// only block names kvpersist reads, writes or deletes.
func ValidBlockHash(s string) bool { return blockHashRE.MatchString(s) }

// HeaderHash is the header hash of kvpersist's files: xxh3-64 (seed 0) of
// the 8 bytes u32 LE headerLen ‖ u32 LE dataStart followed by the JSON.
func HeaderHash(headerLen, dataStart uint32, js []byte) uint64 {
	h := xxh3.New()
	var b [8]byte
	binary.LittleEndian.PutUint32(b[0:], headerLen)
	binary.LittleEndian.PutUint32(b[4:], dataStart)
	h.Write(b[:])
	h.Write(js)
	return h.Sum64()
}

// TensorHash formats a tensor hash: xxh3-64 (seed 0) of the logical bytes
// as 16 lowercase hex digits of the u64 (most significant digit first).
func TensorHash(sum uint64) string {
	var b [8]byte // the big-endian bytes' hex is "%016x", one allocation fewer
	binary.BigEndian.PutUint64(b[:], sum)
	return hex.EncodeToString(b[:])
}

// HashValue is TensorHash's inverse: the u64 of a hash of 16 lowercase
// hex digits (a tensor's hash, a formatVersion 8 block's xxh3), which the
// caller took from a header Decode validated; any other string gives 0.
func HashValue(s string) uint64 {
	v, _ := strconv.ParseUint(s, 16, 64)
	return v
}

// EncodePrefix builds the 26-byte prefix plus JSON for kvpersist's format,
// returning a buffer of at least PrefixLen+len(js) bytes (padded with zeros
// up to dataStart when dataStart is larger).
func EncodePrefix(js []byte, dataStart uint32) []byte {
	n := max(int(dataStart), PrefixLen+len(js))
	buf := make([]byte, n)
	copy(buf, Magic)
	binary.LittleEndian.PutUint32(buf[10:], uint32(len(js)))
	binary.LittleEndian.PutUint32(buf[14:], dataStart)
	binary.LittleEndian.PutUint64(buf[18:], HeaderHash(uint32(len(js)), dataStart, js))
	copy(buf[PrefixLen:], js)
	return buf
}

// AlignUp rounds n up to a multiple of a (a power of two).
func AlignUp(n, a int64) int64 { return (n + a - 1) &^ (a - 1) }

// Prefix is a decoded file prefix.
type Prefix struct {
	Legacy     bool // written by the Bun worker (LegacyMagic, Bun.hash)
	HeaderLen  uint32
	DataStart  uint32
	HeaderHash uint64 // as stored
}

// ParsePrefix decodes the first PrefixLen bytes of a file.
func ParsePrefix(b []byte) (Prefix, error) {
	if len(b) < PrefixLen {
		return Prefix{}, fmt.Errorf("%w: %d bytes, the prefix needs %d", ErrTruncated, len(b), PrefixLen)
	}
	var p Prefix
	switch string(b[:10]) {
	case Magic:
	case LegacyMagic:
		p.Legacy = true
	default:
		return p, fmt.Errorf("%w: starts with %q", ErrBadMagic, b[:10])
	}
	p.HeaderLen = binary.LittleEndian.Uint32(b[10:])
	p.DataStart = binary.LittleEndian.Uint32(b[14:])
	p.HeaderHash = binary.LittleEndian.Uint64(b[18:])
	if p.HeaderLen > MaxHeaderLen {
		return p, fmt.Errorf("%w: %d bytes (limit %d)", ErrHeaderTooLarge, p.HeaderLen, MaxHeaderLen)
	}
	if uint64(p.DataStart) < uint64(PrefixLen)+uint64(p.HeaderLen) {
		return p, fmt.Errorf("%w: dataStart %d is inside the header (prefix %d + header %d)", ErrInvalidHeader, p.DataStart, PrefixLen, p.HeaderLen)
	}
	return p, nil
}

// CheckHeaderHash verifies the stored header hash against the JSON: the
// kvpersist rule (covers headerLen and dataStart) or, for legacy files, the
// Bun worker's (Bun.hash of the JSON alone).
func (p Prefix) CheckHeaderHash(js []byte) error {
	if got := p.ComputeHeaderHash(js); got != p.HeaderHash {
		return fmt.Errorf("%w: stored %016x, computed %016x", ErrHeaderHash, p.HeaderHash, got)
	}
	return nil
}

// ComputeHeaderHash is the header hash of js under p's rule: HeaderHash
// (xxh3-64 over headerLen, dataStart and the JSON) for kvpersist's files,
// Bun.hash of the JSON alone for the Bun worker's.
func (p Prefix) ComputeHeaderHash(js []byte) uint64 {
	if p.Legacy {
		return bunhash.Sum(js)
	}
	return HeaderHash(p.HeaderLen, p.DataStart, js)
}

// HeaderHashRule describes p's header-hash rule, for people.
func (p Prefix) HeaderHashRule() string {
	if p.Legacy {
		return "Bun.hash (wyhash) of the JSON"
	}
	return "xxh3-64 of u32 headerLen, u32 dataStart and the JSON"
}

// slotName formats as h.SlotName(i) when printed.
type slotName struct {
	h *Header
	i int
}

func (n slotName) String() string { return n.h.SlotName(n.i) }

// layoutOf is the layout of formatVersion version in a file of prefix p
// (kvpersist's magic or the Bun worker's), or ErrFormatVersion. Decode
// checks it as soon as the header's formatVersion is read, before the
// tensors (whose block keys depend on the version), so a file of a
// version it does not read is refused as such, not for its blocks.
func layoutOf(p Prefix, version int) (Layout, error) {
	switch {
	case version == FormatBlocks, version == FormatBlocksXXH3 && !p.Legacy:
		return Blocks, nil
	case (version == FormatSingle || version == FormatPage) && !p.Legacy:
		return Single, nil // a page file is a single file with a "page" object
	case version == FormatPages && !p.Legacy:
		return Pages, nil
	case version == 0 && p.Legacy:
		return Single, nil
	case p.Legacy:
		return 0, fmt.Errorf("%w: formatVersion %d in a file of the Bun worker (it wrote none, or %d)", ErrFormatVersion, version, FormatBlocks)
	default:
		return 0, fmt.Errorf("%w: formatVersion %d (this build reads %d to %d)", ErrFormatVersion, version, FormatSingle, FormatBlocksXXH3)
	}
}

// Validate checks a parsed header against the prefix and the file size
// (bytes), before any tensor data is touched. It returns the layout.
func Validate(p Prefix, h *Header, fileSize int64) (Layout, error) {
	lay, err := layoutOf(p, h.FormatVersion)
	if err != nil {
		return 0, err
	}
	if lay != Blocks && !p.Legacy && p.DataStart%DataAlign != 0 {
		return 0, fmt.Errorf("%w: dataStart %d is not a multiple of %d", ErrInvalidHeader, p.DataStart, DataAlign)
	}
	if int64(p.DataStart) > fileSize {
		return 0, fmt.Errorf("%w: dataStart %d beyond the file's %d bytes", ErrTruncated, p.DataStart, fileSize)
	}
	type span struct {
		lo, hi int64
		slot   int
	}
	var spans []span
	paged := 0 // slots whose bytes are in pages: every cache tensor of a page manifest
	if lay == Pages {
		for _, e := range h.Caches {
			paged += len(e.Tensors)
		}
	}
	var total int64 // logical bytes of the slots so far, <= MaxSnapshotBytes
	for i, t := range h.Slots() {
		name := slotName{h, i} // formatted only on error: SlotName is O(entries)
		if len(t.Shape) > MaxRank {
			return 0, fmt.Errorf("%w: %s has %d axes (limit %d)", ErrInvalidHeader, name, len(t.Shape), MaxRank)
		}
		elems := int64(1)
		for ax, d := range t.Shape {
			if d < 0 {
				return 0, fmt.Errorf("%w: %s shape[%d] = %d is negative", ErrInvalidHeader, name, ax, d)
			}
			hi, lo := bits.Mul64(uint64(elems), uint64(d))
			if hi != 0 || lo > math.MaxInt64 {
				return 0, fmt.Errorf("%w: %s shape %v overflows", ErrInvalidHeader, name, t.Shape)
			}
			elems = int64(lo)
		}
		if t.Bytes < 0 {
			return 0, fmt.Errorf("%w: %s bytes %d is negative", ErrInvalidHeader, name, t.Bytes)
		}
		// Before anything else trusts Bytes: a sum that stays under the cap
		// cannot overflow (both terms are at most MaxSnapshotBytes here).
		if t.Bytes > MaxSnapshotBytes-total {
			return 0, fmt.Errorf("%w: %w: the tensors up to %s sum past %d bytes", ErrInvalidHeader, ErrSnapshotTooLarge, name, MaxSnapshotBytes)
		}
		total += t.Bytes
		if size, err := ItemSize(t.DType); err == nil {
			hi, lo := bits.Mul64(uint64(elems), uint64(size))
			if hi != 0 || lo != uint64(t.Bytes) {
				return 0, fmt.Errorf("%w: %s bytes %d != product(shape %v) × itemsize %d of %s", ErrInvalidHeader, name, t.Bytes, t.Shape, size, t.DType)
			}
		} else if !p.Legacy || t.DType == "" {
			return 0, fmt.Errorf("%w: %s: %w", ErrInvalidHeader, name, err)
		}
		kind := lay
		if lay == Pages {
			kind = Single // an attachment of a page manifest
			if i < paged {
				if t.Off != 0 || t.Hash != "" || t.Blocks != nil || len(t.Shape) < 2 {
					return 0, fmt.Errorf("%w: %s of a page manifest must have off 0, hash \"\", no blocks and at least 2 axes", ErrInvalidHeader, name)
				}
				continue
			}
		}
		switch kind {
		case Single:
			if t.Off < 0 {
				return 0, fmt.Errorf("%w: %s off %d is negative", ErrInvalidHeader, name, t.Off)
			}
			if !p.Legacy && t.Off%TensorAlign != 0 {
				return 0, fmt.Errorf("%w: %s off %d is not a multiple of %d", ErrInvalidHeader, name, t.Off, TensorAlign)
			}
			end, carry := bits.Add64(uint64(p.DataStart)+uint64(t.Off), uint64(t.Bytes), 0)
			if carry != 0 || end > uint64(fileSize) {
				return 0, fmt.Errorf("%w: %s spans bytes up to %d of a %d-byte file", ErrTruncated, name, end, fileSize)
			}
			if !tensorHashRE.MatchString(t.Hash) {
				return 0, fmt.Errorf("%w: %s hash %s is not 16 lowercase hex digits", ErrInvalidHeader, name, quoteCapped(t.Hash))
			}
			if t.Blocks != nil {
				return 0, fmt.Errorf("%w: %s has blocks in a single-file snapshot", ErrInvalidHeader, name)
			}
			if t.Bytes > 0 {
				spans = append(spans, span{t.Off, t.Off + t.Bytes, i})
			}
		case Blocks:
			var sum int64
			for b, ref := range t.Blocks {
				if !ValidBlockHash(ref.Hash) {
					return 0, fmt.Errorf("%w: %s block %d name %s is not 64 lowercase hex digits", ErrInvalidHeader, name, b, quoteCapped(ref.Hash))
				}
				if h.FormatVersion == FormatBlocksXXH3 {
					if !tensorHashRE.MatchString(ref.XXH3) {
						return 0, fmt.Errorf("%w: %s block %d xxh3 %s is not 16 lowercase hex digits", ErrInvalidHeader, name, b, quoteCapped(ref.XXH3))
					}
				} else if ref.XXH3 != "" {
					return 0, fmt.Errorf("%w: %s block %d has an xxh3 (%s), which a formatVersion %d manifest does not carry", ErrInvalidHeader, name, b, quoteCapped(ref.XXH3), FormatBlocks)
				}
				if ref.Bytes <= 0 {
					return 0, fmt.Errorf("%w: %s block %d has %d bytes", ErrInvalidHeader, name, b, ref.Bytes)
				}
				var carry uint64
				var s uint64
				s, carry = bits.Add64(uint64(sum), uint64(ref.Bytes), 0)
				if carry != 0 || s > uint64(t.Bytes) {
					return 0, fmt.Errorf("%w: %s blocks sum past its %d bytes", ErrInvalidHeader, name, t.Bytes)
				}
				sum = int64(s)
			}
			if sum != t.Bytes {
				return 0, fmt.Errorf("%w: %s blocks sum to %d bytes, the tensor has %d", ErrInvalidHeader, name, sum, t.Bytes)
			}
		}
	}
	// No two tensors of a single file may overlap: sorted by start, each
	// must end before the next begins.
	sort.Slice(spans, func(i, j int) bool { return spans[i].lo < spans[j].lo })
	for i := 1; i < len(spans); i++ {
		a, b := spans[i-1], spans[i]
		if b.lo < a.hi {
			return 0, fmt.Errorf("%w: %s and %s overlap", ErrInvalidHeader, h.SlotName(a.slot), h.SlotName(b.slot))
		}
	}
	return lay, nil
}
