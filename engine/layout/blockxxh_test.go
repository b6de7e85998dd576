package layout_test

import (
	"encoding/binary"
	"errors"
	"fmt"
	"strings"
	"testing"

	"github.com/kvpersist/kvpersist/engine/layout"
	"github.com/kvpersist/kvpersist/internal/bunhash"
)

// toBlocksXXH3 turns a baseHeader into a valid formatVersion 8 manifest:
// toBlocks's blocks, each with the xxh3-64 of its bytes (hashOf, computed
// independently of the package).
func toBlocksXXH3(h *layout.Header) {
	toBlocks(h)
	h.FormatVersion = layout.FormatBlocksXXH3
	for i, tn := range h.Slots() {
		data := tensorData(i, int(tn.Bytes))
		for k := range tn.Blocks {
			n := tn.Blocks[k].Bytes
			tn.Blocks[k].XXH3 = hashOf(data[:n])
			data = data[n:]
		}
	}
}

// A formatVersion 8 manifest decodes with every block's xxh3 as written,
// and encodes each block as {"hash", "bytes", "xxh3"} in that order; a
// formatVersion 5 one still decodes, with no xxh3, and encodes without
// the key.
func TestDecodeBlocksXXH3(t *testing.T) {
	if layout.FormatBlocksXXH3 != 8 || layout.FormatBlocks != 5 {
		t.Fatalf("format versions %d and %d, the documented ones are 8 and 5", layout.FormatBlocksXXH3, layout.FormatBlocks)
	}
	h := baseHeader()
	toBlocksXXH3(h)
	file := manifestFile(t, h)
	first := h.Caches[0].Tensors[0].Blocks[0]
	want := fmt.Sprintf(`"blocks":[{"hash":"%s","bytes":64,"xxh3":"%s"},`, first.Hash, hashOf(tensorData(0, 64)))
	if !strings.Contains(string(file), want) {
		t.Fatalf("manifest JSON lacks %s:\n%s", want, file[26:])
	}
	snap, _, err := decodeBytes(t, file)
	if err != nil {
		t.Fatal(err)
	}
	if snap.Layout != layout.Blocks || snap.Header.FormatVersion != 8 {
		t.Fatalf("layout %v, formatVersion %d", snap.Layout, snap.Header.FormatVersion)
	}
	for i, tn := range snap.Header.Slots() {
		data := tensorData(i, int(tn.Bytes))
		for k, r := range tn.Blocks {
			if r.XXH3 != hashOf(data[:r.Bytes]) || r.Hash != sha(data[:r.Bytes]) {
				t.Fatalf("slot %d block %d: %+v", i, k, r)
			}
			data = data[r.Bytes:]
		}
	}

	h = baseHeader()
	toBlocks(h)
	file = manifestFile(t, h)
	if strings.Contains(string(file), "xxh3") {
		t.Fatalf("a formatVersion 5 manifest encodes an xxh3 key:\n%s", file[26:])
	}
	snap, _, err = decodeBytes(t, file)
	if err != nil {
		t.Fatal(err)
	}
	for _, tn := range snap.Header.Slots() {
		for _, r := range tn.Blocks {
			if r.XXH3 != "" {
				t.Fatalf("formatVersion 5 block with xxh3 %q", r.XXH3)
			}
		}
	}
	// SameBlocks compares names and sizes only: a manifest's blocks in
	// either version are the same blocks.
	v8 := baseHeader()
	toBlocksXXH3(v8)
	if !layout.SameBlocks(snap.Header.Slots()[1].Blocks, v8.Slots()[1].Blocks) {
		t.Fatal("SameBlocks: the formatVersion 5 and 8 lists of the same blocks differ")
	}
	if why := layout.DiffHeaders(snap.Header, v8, true); why != "" {
		t.Fatalf("DiffHeaders of the same blocks in formatVersions 5 and 8: %s", why)
	}
	v8.Slots()[1].Blocks[0].Bytes++
	if layout.SameBlocks(snap.Header.Slots()[1].Blocks, v8.Slots()[1].Blocks) {
		t.Fatal("SameBlocks ignores a block's size")
	}
}

// A malformed xxh3 of a block, or a block object of the wrong keys for
// its manifest's formatVersion, is refused with ErrInvalidHeader naming
// the block; nothing panics.
func TestDecodeBlockXXH3Malformed(t *testing.T) {
	h := baseHeader()
	toBlocksXXH3(h)
	good, err := h.Encode()
	if err != nil {
		t.Fatal(err)
	}
	xx := h.Caches[0].Tensors[1].Blocks[1].XXH3 // slot 1 block 1
	old := fmt.Sprintf(`"xxh3":"%s"`, xx)
	if strings.Count(string(good), old) != 1 {
		t.Fatalf("the xxh3 of slot 1 block 1 is not unique in %s", good)
	}
	exact8 := `must be exactly {"hash": string, "bytes": integer, "xxh3": string} (formatVersion 8)`
	exact5 := `must be exactly {"hash": string, "bytes": integer} (formatVersion 5)`
	for _, c := range []struct {
		name, by string // by replaces slot 1 block 1's "xxh3":"..."
		msg      string
	}{
		{"15 digits", `"xxh3":"` + xx[:15] + `"`, `cache 0 tensor 1 (slot 1) block 1 xxh3 "` + xx[:15] + `" is not 16 lowercase hex digits`},
		{"17 digits", `"xxh3":"` + xx + `0"`, `slot 1) block 1 xxh3`},
		{"upper case", `"xxh3":"` + strings.ToUpper("abcdef0123456789") + `"`, `block 1 xxh3 "ABCDEF0123456789" is not 16 lowercase hex digits`},
		{"not hex", `"xxh3":"0123456789abcdeg"`, `block 1 xxh3 "0123456789abcdeg"`},
		{"empty", `"xxh3":""`, `block 1 xxh3 "" is not 16 lowercase hex digits`},
		{"0x prefix", `"xxh3":"0x23456789abcdef"`, `block 1 xxh3 "0x23456789abcdef"`},
		{"a number", `"xxh3":81985529216486895`, `blocks[1] ` + exact8},
		{"null", `"xxh3":null`, `blocks[1] ` + exact8},
		{"missing", ``, `blocks[1] ` + exact8},
		{"upper-case key", `"XXH3":"` + xx + `"`, `blocks[1] ` + exact8},
		{"an extra key", old + `,"sha":"x"`, `blocks[1] ` + exact8},
	} {
		js := strings.Replace(string(good), old, c.by, 1)
		js = strings.Replace(js, `,}`, `}`, 1) // "missing": the comma before it
		_, _, err := decodeBytes(t, append(prefix([]byte(js), uint32(26+len(js))), js...))
		if !errors.Is(err, layout.ErrInvalidHeader) || !strings.Contains(err.Error(), c.msg) {
			t.Errorf("%s: got %v, want ErrInvalidHeader with %q", c.name, err, c.msg)
		}
	}

	// formatVersion 5 carries no xxh3: a block with one is refused as a
	// block of the wrong keys, as by the readers before formatVersion 8.
	v5 := strings.Replace(string(good), `"formatVersion":8`, `"formatVersion":5`, 1)
	if _, _, err := decodeBytes(t, append(prefix([]byte(v5), uint32(26+len(v5))), v5...)); !errors.Is(err, layout.ErrInvalidHeader) || !strings.Contains(err.Error(), exact5) {
		t.Errorf("formatVersion 5 with xxh3s: got %v, want ErrInvalidHeader with %q", err, exact5)
	}
	// The same refusal by Validate of a header built in memory.
	hv5 := h.Clone()
	hv5.FormatVersion = layout.FormatBlocks
	if _, err := layout.Validate(layout.Prefix{DataStart: 100}, hv5, 100); !errors.Is(err, layout.ErrInvalidHeader) || !strings.Contains(err.Error(), "which a formatVersion 5 manifest does not carry") {
		t.Errorf("Validate of a formatVersion 5 header with xxh3s: %v", err)
	}
	// The Bun worker wrote formatVersion 5 only: its magic with 8 is refused.
	legacy := append(prefix(good, uint32(26+len(good))), good...)
	copy(legacy, layout.LegacyMagic)
	binary.LittleEndian.PutUint64(legacy[18:], bunhash.Sum(good))
	if _, _, err := decodeBytes(t, legacy); !errors.Is(err, layout.ErrFormatVersion) || !strings.Contains(err.Error(), "Bun worker") {
		t.Errorf("a Bun worker file of formatVersion 8: got %v, want ErrFormatVersion", err)
	}
	// And the unchanged file decodes (the cases above changed only it).
	if _, _, err := decodeBytes(t, append(prefix(good, uint32(26+len(good))), good...)); err != nil {
		t.Fatal(err)
	}
}

// A file of the Bun worker's magic whose header says formatVersion 8 is
// refused as a version the Bun worker never wrote (ErrFormatVersion), not
// for its blocks: with the Bun worker's own two-key blocks ({hash, bytes},
// what a Bun manifest with a wrong version would hold) as with three. A
// kvpersist file of an unknown version is refused the same way whatever
// its blocks hold.
func TestDecodeVersionBeforeBlockKeys(t *testing.T) {
	h := baseHeader()
	toBlocks(h) // formatVersion 5: two-key blocks
	v5, err := h.Encode()
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(v5), `"formatVersion":5`) || strings.Contains(string(v5), "xxh3") {
		t.Fatalf("not a formatVersion 5 manifest: %s", v5)
	}
	legacyFile := func(js []byte) []byte {
		b := append(prefix(js, uint32(26+len(js))), js...)
		copy(b, layout.LegacyMagic)
		binary.LittleEndian.PutUint64(b[18:], bunhash.Sum(js))
		return b
	}
	// The unchanged Bun manifest decodes: the cases below change only the
	// version.
	if _, _, err := decodeBytes(t, legacyFile(v5)); err != nil {
		t.Fatal(err)
	}
	for _, v := range []string{"8", "4", "7", "9"} {
		js := []byte(strings.Replace(string(v5), `"formatVersion":5`, `"formatVersion":`+v, 1))
		_, _, err := decodeBytes(t, legacyFile(js))
		if !errors.Is(err, layout.ErrFormatVersion) || !strings.Contains(err.Error(), "formatVersion "+v+" in a file of the Bun worker") {
			t.Errorf("Bun magic, formatVersion %s, two-key blocks: got %v, want ErrFormatVersion naming the Bun worker", v, err)
		}
	}
	for _, v := range []string{"9", "0"} {
		js := []byte(strings.Replace(string(v5), `"formatVersion":5`, `"formatVersion":`+v, 1))
		_, _, err := decodeBytes(t, append(prefix(js, uint32(26+len(js))), js...))
		if !errors.Is(err, layout.ErrFormatVersion) || !strings.Contains(err.Error(), "formatVersion "+v+" (this build reads") {
			t.Errorf("kvpersist magic, formatVersion %s, two-key blocks: got %v, want ErrFormatVersion", v, err)
		}
	}
}
