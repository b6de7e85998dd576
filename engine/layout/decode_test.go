package layout_test

import (
	"bytes"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"testing"

	"github.com/kvpersist/kvpersist/engine/layout"
	"github.com/kvpersist/kvpersist/engine/vfs"
	"github.com/kvpersist/kvpersist/internal/bunhash"
)

func sha(b []byte) string {
	s := sha256.Sum256(b)
	return hex.EncodeToString(s[:])
}

// toBlocks turns a baseHeader into a valid block manifest: format 5, no
// tensor hashes, Off the running sum of Bytes, each tensor cut into two
// halves named by their SHA-256.
func toBlocks(h *layout.Header) {
	h.FormatVersion = layout.FormatBlocks
	var off int64
	for i, tn := range h.Slots() {
		data := tensorData(i, int(tn.Bytes))
		half := tn.Bytes / 2
		tn.Off, tn.Hash = off, ""
		tn.Blocks = []layout.BlockRef{{Hash: sha(data[:half]), Bytes: half}, {Hash: sha(data[half:]), Bytes: tn.Bytes - half}}
		off += tn.Bytes
	}
}

func TestDecodeValidFiles(t *testing.T) {
	snap, path, err := decodeBytes(t, singleFile(t, baseHeader()))
	if err != nil {
		t.Fatalf("single: %v", err)
	}
	if snap.Layout != layout.Single || snap.DataStart != layout.DataAlign || snap.Path != path || len(snap.Header.Slots()) != 5 {
		t.Fatalf("single: %+v", snap)
	}
	h := baseHeader()
	toBlocks(h)
	snap, _, err = decodeBytes(t, manifestFile(t, h))
	if err != nil {
		t.Fatalf("blocks: %v", err)
	}
	if snap.Layout != layout.Blocks || int(snap.DataStart) != 26+int(snap.HeaderLen) || snap.Size != int64(snap.DataStart) {
		t.Fatalf("blocks: %+v", snap)
	}
}

func TestDecodeLegacyBunFile(t *testing.T) {
	raw, err := os.ReadFile("../../testdata/bun-worker/single/snapshot.mlxkv")
	if err != nil {
		t.Fatal(err)
	}
	snap, err := layout.Load(vfs.Default, "../../testdata/bun-worker/single/snapshot.mlxkv")
	if err != nil {
		t.Fatalf("Load: %v", err)
	}
	if !snap.Legacy || snap.Layout != layout.Single || snap.HeaderLen != 577 || snap.DataStart != 16384 || snap.Size != 21664 {
		t.Fatalf("prefix %+v layout %v size %d", snap.Prefix, snap.Layout, snap.Size)
	}
	if snap.HeaderHash != 0xdfc83af92142dd28 || bunhash.Sum(raw[26:26+577]) != snap.HeaderHash {
		t.Fatalf("header hash %016x", snap.HeaderHash)
	}
	slots := snap.Header.Slots()
	if len(slots) != 5 || snap.Header.FormatVersion != 0 {
		t.Fatalf("%d tensors, formatVersion %d", len(slots), snap.Header.FormatVersion)
	}
	wantOff := []int64{0, 1280, 2560, 3840, 5120}
	for i, tn := range slots {
		wantBytes, wantDT := int64(1280), "float16"
		if i == 4 {
			wantBytes, wantDT = 160, "int32"
		}
		if tn.Off != wantOff[i] || tn.Bytes != wantBytes || tn.DType != wantDT {
			t.Errorf("slot %d: %+v", i, tn)
		}
		// Each hash is Bun.hash of the tensor's bytes in the file.
		data := raw[16384+tn.Off : 16384+tn.Off+tn.Bytes]
		if bunhash.Hex(data) != tn.Hash {
			t.Errorf("slot %d: Bun.hash %s, header %s", i, bunhash.Hex(data), tn.Hash)
		}
	}
	if string(snap.Header.Caches[0].Meta["type"]) != `"KVCache"` || string(snap.Header.Caches[1].Meta["offset"]) != `40` ||
		string(snap.Header.Attachments[0].Meta["name"]) != `"tokens"` {
		t.Fatalf("metadata %v %v", snap.Header.Caches[0].Meta, snap.Header.Attachments[0].Meta)
	}
	// One flipped JSON byte fails the Bun.hash check.
	bad := bytes.Clone(raw)
	bad[26+100] ^= 0x01
	if _, _, err := decodeBytes(t, bad); !errors.Is(err, layout.ErrHeaderHash) {
		t.Fatalf("flipped legacy JSON: %v, want ErrHeaderHash", err)
	}
}

// A legacy (Bun) prefix never carries kvpersist's format 4.
func TestDecodeLegacyMagicWithFormat4(t *testing.T) {
	h := baseHeader()
	js, _ := h.Encode()
	file := singleFile(t, h)
	copy(file, layout.LegacyMagic)
	binary.LittleEndian.PutUint64(file[18:], bunhash.Sum(js))
	_, _, err := decodeBytes(t, file)
	if !errors.Is(err, layout.ErrFormatVersion) || !strings.Contains(err.Error(), "formatVersion 4") {
		t.Fatalf("got %v, want ErrFormatVersion naming formatVersion 4", err)
	}
}

func TestDecodePrefixErrors(t *testing.T) {
	good := singleFile(t, baseHeader())
	hl := binary.LittleEndian.Uint32(good[10:])
	cases := []struct {
		name string
		file func() []byte
		want error
		msg  string
	}{
		{"bad magic", func() []byte { b := bytes.Clone(good); b[8] = 'X'; return b }, layout.ErrBadMagic, "KVPERSISX"},
		{"empty", func() []byte { return nil }, layout.ErrTruncated, "0 bytes"},
		{"short prefix", func() []byte { return good[:25] }, layout.ErrTruncated, "25 bytes"},
		{"header past end", func() []byte { return good[:26+int(hl)-1] }, layout.ErrTruncated, "header of"},
		{"header over cap", func() []byte {
			b := bytes.Clone(good)
			binary.LittleEndian.PutUint32(b[10:], layout.MaxHeaderLen+1)
			return b
		}, layout.ErrHeaderTooLarge, "67108865"},
		{"flipped JSON byte", func() []byte { b := bytes.Clone(good); b[26+5] ^= 0x20; return b }, layout.ErrHeaderHash, "header hash"},
		{"flipped hash", func() []byte { b := bytes.Clone(good); b[20] ^= 0x01; return b }, layout.ErrHeaderHash, "stored"},
		{"dataStart inside header", func() []byte {
			b := bytes.Clone(good)
			copy(b, prefix(b[26:26+hl], 26+hl-1))
			return b
		}, layout.ErrInvalidHeader, "dataStart"},
		{"dataStart not aligned", func() []byte {
			js := good[26 : 26+hl]
			b := append(prefix(js, 26+hl), js...)
			return append(b, make([]byte, 20000)...)
		}, layout.ErrInvalidHeader, "not a multiple of 16384"},
		{"dataStart past end", func() []byte {
			return bytes.Clone(good[:layout.DataAlign-1])
		}, layout.ErrTruncated, "dataStart"},
		{"JSON not an object", func() []byte {
			js := []byte(`[1,2]`)
			return append(prefix(js, 31), js...)
		}, layout.ErrInvalidHeader, "header JSON"},
		{"caches missing", func() []byte {
			js := []byte(`{"formatVersion":5}`)
			return append(prefix(js, uint32(26+len(js))), js...)
		}, layout.ErrInvalidHeader, `"caches" is missing`},
		{"bytes not a number", func() []byte {
			js := []byte(`{"caches":[{"tensors":[{"bytes":"16","dtype":"uint8","shape":[16],"blocks":[]}]}],"formatVersion":5}`)
			return append(prefix(js, uint32(26+len(js))), js...)
		}, layout.ErrInvalidHeader, "caches[0].tensors[0].bytes"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			_, path, err := decodeBytes(t, c.file())
			if !errors.Is(err, c.want) {
				t.Fatalf("got %v, want %v", err, c.want)
			}
			if !strings.Contains(err.Error(), c.msg) || !strings.Contains(err.Error(), path) {
				t.Fatalf("error %q does not name %q and the path", err, c.msg)
			}
		})
	}
}

// TestHeaderHashCoversDataStart changes dataStart in the prefix only, to a
// value under which the file would otherwise be perfectly valid (the data
// moved along with it): the hash, which covers dataStart, must reject it.
func TestHeaderHashCoversDataStart(t *testing.T) {
	good := singleFile(t, baseHeader())
	if _, _, err := decodeBytes(t, good); err != nil {
		t.Fatal(err)
	}
	moved := make([]byte, len(good)+layout.DataAlign)
	copy(moved, good[:layout.DataAlign])
	copy(moved[2*layout.DataAlign:], good[layout.DataAlign:])
	binary.LittleEndian.PutUint32(moved[14:], 2*layout.DataAlign)
	_, _, err := decodeBytes(t, moved)
	if !errors.Is(err, layout.ErrHeaderHash) {
		t.Fatalf("dataStart changed in the prefix only: %v, want ErrHeaderHash", err)
	}
	// With the hash recomputed for the new dataStart the same file decodes:
	// the failure above was the hash's doing.
	hl := binary.LittleEndian.Uint32(good[10:])
	copy(moved, prefix(good[26:26+hl], 2*layout.DataAlign))
	if snap, _, err := decodeBytes(t, moved); err != nil || snap.DataStart != 2*layout.DataAlign {
		t.Fatalf("re-hashed: %v", err)
	}
}

func TestDecodeHugeHeaderClaimAllocatesLittle(t *testing.T) {
	// A 100-byte file claiming a 60 MiB header (dataStart consistent with it).
	const claim = 60 << 20
	b := make([]byte, 100)
	copy(b, layout.Magic)
	binary.LittleEndian.PutUint32(b[10:], claim)
	binary.LittleEndian.PutUint32(b[14:], uint32(layout.AlignUp(26+claim, layout.DataAlign)))
	path := filepath.Join(t.TempDir(), "huge")
	if err := os.WriteFile(path, b, 0o600); err != nil {
		t.Fatal(err)
	}
	f, err := vfs.Default.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if _, err := layout.Decode(f, path); !errors.Is(err, layout.ErrTruncated) {
		t.Fatalf("got %v, want ErrTruncated", err)
	}
	var before, after runtime.MemStats
	runtime.ReadMemStats(&before)
	for range 10 {
		if _, err := layout.Decode(f, path); !errors.Is(err, layout.ErrTruncated) {
			t.Fatalf("got %v, want ErrTruncated", err)
		}
	}
	runtime.ReadMemStats(&after)
	if d := after.TotalAlloc - before.TotalAlloc; d > 64<<10 {
		t.Fatalf("10 decodes allocated %d bytes (the claimed header is %d)", d, claim)
	}
	allocs := testing.AllocsPerRun(10, func() { _, _ = layout.Decode(f, path) })
	if allocs > 20 {
		t.Fatalf("%v allocations per decode", allocs)
	}

	// Over the cap: ErrHeaderTooLarge straight from the prefix.
	binary.LittleEndian.PutUint32(b[10:], layout.MaxHeaderLen+1)
	binary.LittleEndian.PutUint32(b[14:], 0xffffffff)
	if _, err := layout.ParsePrefix(b); !errors.Is(err, layout.ErrHeaderTooLarge) {
		t.Fatalf("ParsePrefix: %v, want ErrHeaderTooLarge", err)
	}
	if _, _, err := decodeBytes(t, b); !errors.Is(err, layout.ErrHeaderTooLarge) {
		t.Fatalf("Decode: %v, want ErrHeaderTooLarge", err)
	}
}

func TestDecodeValidatesTensors(t *testing.T) {
	type tcase struct {
		name   string
		blocks bool // start from the block manifest
		mut    func(h *layout.Header)
		want   error
		msg    []string
	}
	cases := []tcase{
		{"future formatVersion", false, func(h *layout.Header) { h.FormatVersion = 6 }, layout.ErrFormatVersion, []string{"formatVersion 6"}},
		{"formatVersion 0 without legacy magic", false, func(h *layout.Header) { h.FormatVersion = 0 }, layout.ErrFormatVersion, []string{"formatVersion 0"}},
		{"tensor beyond file size", false, func(h *layout.Header) { h.Attachments[0].Tensors[0].Off = 8 * layout.TensorAlign }, layout.ErrTruncated,
			[]string{"attachment 0 tensor 0 (slot 4)"}},
		{"tensor off overflows", false, func(h *layout.Header) { h.Attachments[0].Tensors[0].Off = 1<<63 - layout.TensorAlign }, layout.ErrTruncated,
			[]string{"slot 4"}},
		{"tensors overlap (same start)", false, func(h *layout.Header) { h.Caches[0].Tensors[1].Off = 0 }, layout.ErrInvalidHeader,
			[]string{"cache 0 tensor 0 (slot 0)", "cache 0 tensor 1 (slot 1)", "overlap"}},
		{"tensors overlap (partly)", false, func(h *layout.Header) {
			tn := &h.Caches[1].Tensors[0] // slot 2 at 8192 grows to 8192 bytes: into slot 3 at 12288
			tn.Shape, tn.Bytes = []int64{1, 2, 256, 8}, 8192
		}, layout.ErrInvalidHeader, []string{"cache 1 tensor 0 (slot 2)", "cache 1 tensor 1 (slot 3)", "overlap"}},
		{"bytes != product(shape)*itemsize", false, func(h *layout.Header) { h.Caches[1].Tensors[0].Bytes = 127 }, layout.ErrInvalidHeader,
			[]string{"cache 1 tensor 0 (slot 2)", "bytes 127"}},
		{"bytes for the wrong itemsize", false, func(h *layout.Header) { h.Caches[0].Tensors[0].DType = "float32" }, layout.ErrInvalidHeader,
			[]string{"slot 0", "float32"}},
		{"negative dim", false, func(h *layout.Header) { h.Caches[0].Tensors[1].Shape = []int64{1, -2, 4, 8} }, layout.ErrInvalidHeader,
			[]string{"cache 0 tensor 1 (slot 1)", "shape[1] = -2"}},
		{"shape product overflows", false, func(h *layout.Header) { h.Caches[1].Tensors[1].Shape = []int64{1 << 32, 1 << 32, 2} }, layout.ErrInvalidHeader,
			[]string{"cache 1 tensor 1 (slot 3)", "overflows"}},
		{"shape bytes overflow", false, func(h *layout.Header) { h.Caches[1].Tensors[1].Shape = []int64{1 << 62} }, layout.ErrInvalidHeader,
			[]string{"slot 3"}},
		{"too many axes", false, func(h *layout.Header) { h.Caches[0].Tensors[0].Shape = make([]int64, 17) }, layout.ErrInvalidHeader,
			[]string{"slot 0", "17 axes"}},
		{"negative bytes", false, func(h *layout.Header) { h.Caches[0].Tensors[0].Bytes = -128 }, layout.ErrInvalidHeader,
			[]string{"slot 0", "bytes -128"}},
		{"negative off", false, func(h *layout.Header) { h.Caches[0].Tensors[1].Off = -4096 }, layout.ErrInvalidHeader,
			[]string{"slot 1", "off -4096"}},
		{"off not aligned", false, func(h *layout.Header) { h.Caches[0].Tensors[1].Off = 4000 }, layout.ErrInvalidHeader,
			[]string{"slot 1", "off 4000"}},
		{"unknown dtype", false, func(h *layout.Header) { h.Caches[1].Tensors[1].DType = "bfloat17" }, layout.ErrInvalidHeader,
			[]string{"cache 1 tensor 1 (slot 3)", "bfloat17"}},
		{"tensor hash upper case", false, func(h *layout.Header) { h.Caches[0].Tensors[0].Hash = strings.ToUpper(h.Caches[0].Tensors[0].Hash) }, layout.ErrInvalidHeader,
			[]string{"slot 0", "hash"}},
		{"blocks in a single file", false, func(h *layout.Header) {
			h.Caches[0].Tensors[0].Blocks = []layout.BlockRef{{Hash: sha(nil), Bytes: 128}}
		}, layout.ErrInvalidHeader, []string{"slot 0", "blocks"}},
		{"block hash upper case", true, func(h *layout.Header) {
			r := &h.Caches[0].Tensors[1].Blocks[1]
			r.Hash = strings.ToUpper(r.Hash)
		}, layout.ErrInvalidHeader, []string{"cache 0 tensor 1 (slot 1) block 1"}},
		{"block hash path traversal", true, func(h *layout.Header) { h.Caches[1].Tensors[0].Blocks[0].Hash = "../../x" }, layout.ErrInvalidHeader,
			[]string{"cache 1 tensor 0 (slot 2) block 0", `"../../x"`}},
		{"block hash short", true, func(h *layout.Header) { h.Attachments[0].Tensors[0].Blocks[0].Hash = "abc123" }, layout.ErrInvalidHeader,
			[]string{"attachment 0 tensor 0 (slot 4) block 0", `"abc123"`}},
		{"block bytes zero", true, func(h *layout.Header) { h.Caches[0].Tensors[0].Blocks[1].Bytes = 0 }, layout.ErrInvalidHeader,
			[]string{"cache 0 tensor 0 (slot 0) block 1", "0 bytes"}},
		{"block bytes negative", true, func(h *layout.Header) {
			b := h.Caches[0].Tensors[0].Blocks
			b[0].Bytes, b[1].Bytes = -64, 192 // sums to 128
		}, layout.ErrInvalidHeader, []string{"(slot 0) block 0", "-64 bytes"}},
		{"blocks sum short", true, func(h *layout.Header) { h.Caches[1].Tensors[1].Blocks[1].Bytes = 32 }, layout.ErrInvalidHeader,
			[]string{"cache 1 tensor 1 (slot 3)", "sum to 96"}},
		{"blocks sum past", true, func(h *layout.Header) { h.Caches[1].Tensors[1].Blocks[1].Bytes = 65 }, layout.ErrInvalidHeader,
			[]string{"cache 1 tensor 1 (slot 3)", "sum past"}},
		{"blocks missing", true, func(h *layout.Header) { h.Caches[0].Tensors[0].Blocks = nil }, layout.ErrInvalidHeader,
			[]string{"slot 0", "sum to 0"}},
		{"manifest unknown dtype", true, func(h *layout.Header) { h.Attachments[0].Tensors[0].DType = "int33" }, layout.ErrInvalidHeader,
			[]string{"slot 4", "int33"}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			h := baseHeader()
			var file []byte
			if c.blocks {
				toBlocks(h)
				c.mut(h)
				file = manifestFile(t, h)
			} else {
				c.mut(h)
				file = singleFile(t, h)
			}
			_, path, err := decodeBytes(t, file)
			if !errors.Is(err, c.want) {
				t.Fatalf("got %v, want %v", err, c.want)
			}
			for _, m := range append(c.msg, path) {
				if !strings.Contains(err.Error(), m) {
					t.Errorf("error %q does not name %q", err, m)
				}
			}
		})
	}
}

// An unknown dtype is reported with its own sentinel as well.
func TestDecodeUnknownDTypeSentinel(t *testing.T) {
	h := baseHeader()
	h.Caches[1].Tensors[1].DType = "bfloat17"
	_, _, err := decodeBytes(t, singleFile(t, h))
	if !errors.Is(err, layout.ErrUnknownDType) || !errors.Is(err, layout.ErrInvalidHeader) {
		t.Fatalf("got %v, want ErrUnknownDType and ErrInvalidHeader", err)
	}
}

func TestValidateZeroByteTensors(t *testing.T) {
	h := baseHeader()
	// Zero-size tensors may share an offset with anything: no data, no overlap.
	tn := &h.Caches[0].Tensors[1]
	tn.Shape, tn.Bytes, tn.Hash = []int64{1, 2, 0, 8}, 0, hashOf(nil)
	tn.Off = 0
	if _, _, err := decodeBytes(t, singleFile(t, h)); err != nil {
		t.Fatalf("zero-byte tensor: %v", err)
	}
}

// manifestOfSizes is a block manifest whose slots are uint8 tensors of the
// given byte counts, each one block (block sizes are not checked against
// any file, so a manifest can claim any size).
func manifestOfSizes(t *testing.T, sizes ...int64) []byte {
	t.Helper()
	var ts []layout.Tensor
	for i, n := range sizes {
		ts = append(ts, layout.Tensor{Bytes: n, DType: "uint8", Shape: []int64{n},
			Blocks: []layout.BlockRef{{Hash: sha([]byte{byte(i)}), Bytes: n}}})
	}
	return manifestFile(t, &layout.Header{FormatVersion: layout.FormatBlocks, Caches: []layout.Entry{{Tensors: ts}}})
}

// A snapshot's tensors may sum to at most layout.MaxSnapshotBytes (1 TiB):
// a sum past it, or one that wraps int64 (four tensors of 2^62 bytes sum to
// 0 in int64), is refused at decode with ErrSnapshotTooLarge, so no caller
// allocates from it; exactly the bound is accepted and TotalBytes gives it.
func TestDecodeCapsSnapshotBytes(t *testing.T) {
	if layout.MaxSnapshotBytes != 1<<40 {
		t.Fatalf("MaxSnapshotBytes = %d, the documented bound is 1 TiB", layout.MaxSnapshotBytes)
	}
	const q = 1 << 62
	for name, sizes := range map[string][]int64{
		"four tensors of 2^62 bytes (int64 sum wraps to 0)":   {q, q, q, q},
		"two tensors of 2^62 bytes (sum 2^63 wraps negative)": {q, q},
		"one byte past the bound":                             {1 << 38, 1 << 38, 1 << 38, 1 << 38, 1},
		"one tensor past the bound":                           {1<<40 + 1},
	} {
		_, _, err := decodeBytes(t, manifestOfSizes(t, sizes...))
		if !errors.Is(err, layout.ErrSnapshotTooLarge) || !errors.Is(err, layout.ErrInvalidHeader) {
			t.Errorf("%s: got %v, want ErrSnapshotTooLarge (and ErrInvalidHeader)", name, err)
		}
	}
	snap, _, err := decodeBytes(t, manifestOfSizes(t, 1<<38, 1<<38, 1<<38, 1<<38))
	if err != nil {
		t.Fatalf("exactly 1 TiB: %v", err)
	}
	if n, err := snap.Header.TotalBytes(); err != nil || n != 1<<40 {
		t.Fatalf("TotalBytes = %d, %v; want %d", n, err, int64(1<<40))
	}
}

// TotalBytes refuses, on its own, headers that never went through Validate.
func TestHeaderTotalBytes(t *testing.T) {
	h := baseHeader()
	if n, err := h.TotalBytes(); err != nil || n != 4*128+16 {
		t.Fatalf("TotalBytes = %d, %v; want %d", n, err, 4*128+16)
	}
	for _, b := range []int64{1 << 62, -1} {
		h.Caches[1].Tensors[0].Bytes = b
		h.Caches[1].Tensors[1].Bytes = 1 << 62
		if _, err := h.TotalBytes(); !errors.Is(err, layout.ErrSnapshotTooLarge) || !strings.Contains(err.Error(), "cache 1 tensor 0 (slot 2)") {
			t.Errorf("Bytes %d: got %v, want ErrSnapshotTooLarge naming slot 2", b, err)
		}
	}
}

// The decoder is strict: a key given twice in one object, at any level and
// however it is escaped, is refused (encoding/json alone keeps the last, so
// two readers could see two different snapshots in one file).
func TestDecodeRefusesDuplicateKeys(t *testing.T) {
	blk := sha(nil)
	tensor := `{"bytes":1,"dtype":"uint8","shape":[1],"blocks":[{"hash":"` + blk + `","bytes":1}]}`
	cases := map[string]struct{ js, key string }{
		"top level":                  {`{"caches":[{"tensors":[` + tensor + `]}],"caches":[],"formatVersion":5}`, "caches"},
		"top level via an escape":    {`{"caches":[{"tensors":[` + tensor + `]}],"\u0063aches":[],"formatVersion":5}`, "caches"},
		"formatVersion":              {`{"formatVersion":4,"caches":[{"tensors":[` + tensor + `]}],"formatVersion":5}`, "formatVersion"},
		"top-level metadata":         {`{"model":"a","caches":[{"tensors":[` + tensor + `]}],"model":"b","formatVersion":5}`, "model"},
		"entry":                      {`{"caches":[{"tensors":[],"tensors":[` + tensor + `]}],"formatVersion":5}`, "tensors"},
		"tensor":                     {`{"caches":[{"tensors":[{"bytes":1,"dtype":"uint8","shape":[1],"shape":[1],"blocks":[{"hash":"` + blk + `","bytes":1}]}]}],"formatVersion":5}`, "shape"},
		"block object":               {`{"caches":[{"tensors":[{"bytes":1,"dtype":"uint8","shape":[1],"blocks":[{"hash":"` + blk + `","bytes":1,"bytes":1}]}]}],"formatVersion":5}`, "bytes"},
		"block object via an escape": {`{"caches":[{"tensors":[{"bytes":1,"dtype":"uint8","shape":[1],"blocks":[{"hash":"` + blk + `","\u0062ytes":1,"bytes":1}]}]}],"formatVersion":5}`, "bytes"},
		"inside a metadata value":    {`{"cfg":{"a":{"x":1,"x":2}},"caches":[{"tensors":[` + tensor + `]}],"formatVersion":5}`, "x"},
		"after many distinct keys":   {`{"k0":0,"k1":1,"k2":2,"k3":3,"k4":4,"k5":5,"k6":6,"k7":7,"k8":8,"k9":9,"k10":10,"k11":11,"k12":12,"k13":13,"k14":14,"k15":15,"k16":16,"k17":17,"caches":[{"tensors":[` + tensor + `]}],"k3":0,"formatVersion":5}`, "k3"},
		"escaped quote in a dup key": {`{"a\"b":1,"caches":[{"tensors":[` + tensor + `]}],"a\u0022b":2,"formatVersion":5}`, `a"b`},
		// encoding/json reads each invalid UTF-8 byte of a key as U+FFFD, so
		// two keys that differ only in such bytes are one key to it.
		"invalid UTF-8 in raw keys":    {"{\"m\xff\":1,\"caches\":[{\"tensors\":[" + tensor + "]}],\"m\xfe\":2,\"formatVersion\":5}", "m\ufffd"},
		"invalid UTF-8 against escape": {"{\"m\\ufffd\":1,\"caches\":[{\"tensors\":[" + tensor + "]}],\"m\xc0\":2,\"formatVersion\":5}", "m\ufffd"},
		"invalid UTF-8 in nested keys": {"{\"cfg\":{\"\xff\":1,\"\xfe\":2},\"caches\":[{\"tensors\":[" + tensor + "]}],\"formatVersion\":5}", "\ufffd"},
	}
	for name, c := range cases {
		b := append(prefix([]byte(c.js), uint32(26+len(c.js))), c.js...)
		_, _, err := decodeBytes(t, b)
		if !errors.Is(err, layout.ErrInvalidHeader) || !strings.Contains(err.Error(), fmt.Sprintf("key %q appears twice", c.key)) {
			t.Errorf("%s: got %v, want ErrInvalidHeader naming the key %q", name, err, c.key)
		}
	}
	// Equal keys in different objects, and a value equal to a key, are fine.
	ok := `{"model":"caches","caches":[{"tensors":[` + tensor + `,` + tensor + `],"x":{"bytes":1}}],"formatVersion":5}`
	if _, _, err := decodeBytes(t, append(prefix([]byte(ok), uint32(26+len(ok))), ok...)); err != nil {
		t.Fatalf("keys repeated across objects: %v", err)
	}
}
