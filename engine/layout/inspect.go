package layout

import (
	"encoding/json"
	"errors"

	"github.com/kvpersist/kvpersist/engine/vfs"
)

// Inspection is what can be read of a file that may fail its checks: the
// full decode when it passes, else as much as can be read without trusting
// it. Sizes are bytes.
type Inspection struct {
	Path string
	Size int64 // file size
	// Magic is Magic, LegacyMagic, or "" when the file starts with neither.
	Magic string
	// Prefix is the parsed prefix; valid when Magic is not "".
	Prefix Prefix
	// JSON is the header as stored, nil when it could not be read (no
	// magic, a header length past the file or MaxHeaderLen).
	JSON []byte
	// ComputedHash is the header hash of JSON under the prefix's rule
	// (Prefix.ComputeHeaderHash); valid when JSON is not nil.
	ComputedHash uint64
	// Snapshot is the full decode (Decode), nil when Err is set.
	Snapshot *Snapshot
	// Err is Decode's error: it wraps one of the decoding sentinels.
	Err error
	// Loose is, when the header failed a check but is JSON of the right
	// shape, a lenient parse of it for display only (UNVERIFIED); its
	// Layout is guessed from formatVersion.
	Loose *Header
	// LooseLayout is Loose's layout (FormatBlocks, FormatBlocksXXH3: Blocks, FormatPages:
	// Pages, else Single).
	LooseLayout Layout
	// LooseVersion is Loose's formatVersion, nil when the key is absent.
	LooseVersion *int
	// Page is the page object of a page file (formatVersion 6): the
	// decoded one (Snapshot.Page) when every check passed, else, when the
	// header is JSON holding a "page" object, a lenient parse of it for
	// display only (UNVERIFIED: a key or parent that is not 64 hex digits
	// is left zero, its text in PageKeyText and PageParentText). nil for
	// other files.
	Page *Page
	// PageKeyText and PageParentText are the page object's key and parent
	// as stored (set with Page).
	PageKeyText, PageParentText string
	// Pages is the page list of a page manifest (formatVersion 7): decoded
	// (Snapshot.Pages) or, as Page, a lenient parse for display (keys that
	// do not parse are left zero). nil for other files.
	Pages *PageList
	// PagesVerified is true when Page or Pages come from the full decode.
	PagesVerified bool
}

// HashOK reports whether the stored header hash equals the computed one.
func (in *Inspection) HashOK() bool { return in.JSON != nil && in.ComputedHash == in.Prefix.HeaderHash }

// IsDecodeError reports whether err is a file's content at fault (one of
// the decoding sentinels) rather than the I/O system.
func IsDecodeError(err error) bool {
	for _, s := range []error{ErrBadMagic, ErrTruncated, ErrHeaderTooLarge, ErrHeaderHash,
		ErrFormatVersion, ErrInvalidHeader, ErrUnknownDType} {
		if errors.Is(err, s) {
			return true
		}
	}
	return false
}

// Inspect decodes an open file as far as it can, for tools that show a
// file whatever its state (kvpersist inspect). It reads the prefix and
// header only, never tensor data, and allocates at most the header length
// (bounded by MaxHeaderLen and the file size). The error is an I/O error
// only; a file that fails a check is an Inspection with Err set.
func Inspect(f vfs.File, path string) (*Inspection, error) {
	st, err := f.Stat()
	if err != nil {
		return nil, err
	}
	in := &Inspection{Path: path, Size: st.Size()}
	in.Snapshot, in.Err = Decode(f, path)
	if in.Err != nil && !IsDecodeError(in.Err) {
		return nil, in.Err
	}
	if snap := in.Snapshot; snap != nil {
		in.Page, in.Pages, in.PagesVerified = snap.Page, snap.Pages, true
		if snap.Page != nil {
			in.PageKeyText, in.PageParentText = snap.Page.Key.String(), snap.Page.Parent.String()
		}
	}
	if in.Size < PrefixLen {
		return in, nil
	}
	var pb [PrefixLen]byte
	if err := ReadFull(f, pb[:], 0); err != nil {
		return nil, err
	}
	p, perr := ParsePrefix(pb[:])
	if errors.Is(perr, ErrBadMagic) {
		return in, nil
	}
	in.Magic, in.Prefix = string(pb[:len(Magic)]), p
	if (perr != nil && !errors.Is(perr, ErrInvalidHeader)) || p.HeaderLen > MaxHeaderLen || int64(PrefixLen)+int64(p.HeaderLen) > in.Size {
		return in, nil
	}
	in.JSON = make([]byte, p.HeaderLen) // bounded by MaxHeaderLen and the file size
	if err := ReadFull(f, in.JSON, PrefixLen); err != nil {
		return nil, err
	}
	in.ComputedHash = p.ComputeHeaderHash(in.JSON)
	if in.Err != nil && json.Valid(in.JSON) {
		in.Loose, in.LooseLayout, in.LooseVersion = parseLoose(in.JSON)
		if in.Loose != nil {
			in.loosePages()
		}
	}
	return in, nil
}

// loosePages fills Page or Pages from Loose's "page" or "pages" metadata,
// leniently (display only).
func (in *Inspection) loosePages() {
	if raw, ok := in.Loose.Meta["page"]; ok {
		var w pageJSON
		if json.Unmarshal(raw, &w) == nil {
			p := &Page{Identity: w.Identity, PageTokens: w.PageTokens, Tokens: w.Tokens}
			p.Key, _ = ParsePageKey(w.Key)
			p.Parent, _ = ParsePageKey(w.Parent)
			in.Page, in.PageKeyText, in.PageParentText = p, w.Key, w.Parent
		}
	}
	if raw, ok := in.Loose.Meta["pages"]; ok {
		var w pageListJSON
		if json.Unmarshal(raw, &w) == nil {
			l := &PageList{Identity: w.Identity, PageTokens: w.PageTokens, Tokens: w.Tokens, Keys: make([]PageKey, len(w.Keys))}
			for i, k := range w.Keys {
				l.Keys[i], _ = ParsePageKey(k)
			}
			in.Pages = l
		}
	}
}

// looseTensor is a lenient parse of an unverified tensor, for display only.
type looseTensor struct {
	Off    int64      `json:"off"`
	Bytes  int64      `json:"bytes"`
	Hash   string     `json:"hash"`
	DType  string     `json:"dtype"`
	Shape  []int64    `json:"shape"`
	Blocks []BlockRef `json:"blocks"`
}

// parseLoose turns an unverified header JSON into a Header for display
// (entries' metadata kept, per-tensor unknown keys dropped); nil when it is
// not even that.
func parseLoose(js []byte) (*Header, Layout, *int) {
	var top map[string]json.RawMessage
	if json.Unmarshal(js, &top) != nil {
		return nil, 0, nil
	}
	h := &Header{Meta: Meta{}}
	var version *int
	if v, found := top["formatVersion"]; found {
		if json.Unmarshal(v, &h.FormatVersion) != nil {
			return nil, 0, nil
		}
		version = &h.FormatVersion
	}
	entries := func(raw json.RawMessage) ([]Entry, bool) {
		if raw == nil {
			return nil, true
		}
		var list []map[string]json.RawMessage
		if json.Unmarshal(raw, &list) != nil {
			return nil, false
		}
		out := make([]Entry, len(list))
		for i, obj := range list {
			var ts []looseTensor
			if json.Unmarshal(obj["tensors"], &ts) != nil {
				return nil, false
			}
			out[i].Meta = Meta{}
			for k, v := range obj {
				if k != "tensors" {
					out[i].Meta[k] = v
				}
			}
			for _, t := range ts {
				out[i].Tensors = append(out[i].Tensors, Tensor{Off: t.Off, Bytes: t.Bytes, Hash: t.Hash, DType: t.DType, Shape: t.Shape, Blocks: t.Blocks})
			}
		}
		return out, true
	}
	var ok bool
	if h.Caches, ok = entries(top["caches"]); !ok {
		return nil, 0, nil
	}
	if h.Attachments, ok = entries(top["attachments"]); !ok {
		return nil, 0, nil
	}
	for k, v := range top {
		switch k {
		case "formatVersion", "caches", "attachments":
		default:
			h.Meta[k] = v
		}
	}
	lay := Single
	switch h.FormatVersion {
	case FormatBlocks, FormatBlocksXXH3:
		lay = Blocks
	case FormatPages:
		lay = Pages
	}
	return h, lay, version
}
