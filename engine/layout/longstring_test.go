package layout_test

import (
	"encoding/json"
	"errors"
	"strings"
	"testing"

	"github.com/kvpersist/kvpersist/engine/layout"
)

// A header-controlled string of 4 MiB (a block name, an xxh3, a tensor
// hash, a dtype, a key: headers go up to 64 MiB) is refused with an error
// that quotes only its first bytes and gives its length, and still names
// the slot and block at fault: the error is carried by ls, verify,
// inspect and every log, which must not carry the 4 MiB.
func TestDecodeErrorQuotesLongStringsShort(t *testing.T) {
	const n = 4 << 20
	long := strings.Repeat("a", n-1) + "Z" // 'Z': not hex, past any cut
	quoted := `"` + strings.Repeat("a", 64) + `"... (4194304 bytes)`
	const maxLen = 512 // bytes of the whole error, path included
	check := func(name string, err error, sentinel error, want ...string) {
		t.Helper()
		if !errors.Is(err, sentinel) {
			t.Errorf("%s: got %.200v, want %v", name, err, sentinel)
			return
		}
		e := err.Error()
		if len(e) > maxLen {
			t.Errorf("%s: a %d-byte error (want at most %d): %.200s", name, len(e), maxLen, e)
		}
		for _, w := range want {
			if !strings.Contains(e, w) {
				t.Errorf("%s: error %q lacks %q", name, e, w)
			}
		}
	}

	h := baseHeader()
	toBlocksXXH3(h)
	h.Caches[0].Tensors[1].Blocks[1].XXH3 = long
	_, _, err := decodeBytes(t, manifestFile(t, h))
	check("block xxh3", err, layout.ErrInvalidHeader, "cache 0 tensor 1 (slot 1) block 1 xxh3 "+quoted+" is not 16 lowercase hex digits")

	h = baseHeader()
	toBlocksXXH3(h)
	h.Caches[1].Tensors[0].Blocks[0].Hash = long
	_, _, err = decodeBytes(t, manifestFile(t, h))
	check("block name", err, layout.ErrInvalidHeader, "cache 1 tensor 0 (slot 2) block 0 name "+quoted+" is not 64 lowercase hex digits")

	h = baseHeader()
	toBlocksXXH3(h)
	h.FormatVersion = layout.FormatBlocks
	h.Caches[0].Tensors[0].Blocks[0].XXH3 = long
	_, err = layout.Validate(layout.Prefix{DataStart: 100}, h, 100)
	check("xxh3 in formatVersion 5", err, layout.ErrInvalidHeader, "cache 0 tensor 0 (slot 0) block 0 has an xxh3 ("+quoted+")")

	h = baseHeader()
	h.Attachments[0].Tensors[0].Hash = long
	_, _, err = decodeBytes(t, singleFile(t, h))
	check("tensor hash", err, layout.ErrInvalidHeader, "attachment 0 tensor 0 (slot 4) hash "+quoted+" is not 16 lowercase hex digits")

	h = baseHeader()
	h.Caches[0].Tensors[1].DType = long
	_, _, err = decodeBytes(t, singleFile(t, h))
	check("dtype", err, layout.ErrUnknownDType, "cache 0 tensor 1 (slot 1)", quoted)

	// A key given twice in the header JSON.
	js, err := baseHeader().Encode()
	if err != nil {
		t.Fatal(err)
	}
	dup := `{"` + long + `":1,"` + long + `":2,` + string(js[1:])
	_, _, err = decodeBytes(t, append(prefix([]byte(dup), uint32(layout.AlignUp(int64(26+len(dup)), layout.DataAlign))), dup...))
	check("duplicate header key", err, layout.ErrInvalidHeader, "key "+quoted+" appears twice")

	// Metadata a writer is given: a key not valid UTF-8, a value not JSON.
	h = baseHeader()
	h.Meta[long+"\xff"] = json.RawMessage(`1`)
	_, err = h.Encode()
	check("metadata key not UTF-8", err, layout.ErrInvalidHeader, "header metadata key "+`"`+strings.Repeat("a", 64)+`"... (4194305 bytes)`)

	_, err = layout.ParsePageKey(long)
	check("page key", err, layout.ErrInvalidHeader, "page key "+quoted)
	check("name", layout.ValidName("snapshot", long), layout.ErrBadName, "snapshot "+quoted)

	// A string at the cap is quoted whole, and a cut never splits a UTF-8
	// character: 63 ASCII bytes then 'é' (2 bytes) is cut before the 'é'.
	_, err = layout.ParsePageKey(strings.Repeat("g", 64))
	check("64 bytes", err, layout.ErrInvalidHeader, `page key "`+strings.Repeat("g", 64)+`" is not`)
	_, err = layout.ParsePageKey(strings.Repeat("b", 63) + "é" + long)
	check("utf-8 cut", err, layout.ErrInvalidHeader, `page key "`+strings.Repeat("b", 63)+`"... (`)
}
