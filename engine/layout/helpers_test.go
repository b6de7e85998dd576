package layout_test

import (
	"encoding/binary"
	"encoding/json"
	"os"
	"path/filepath"
	"testing"

	"github.com/kvpersist/kvpersist/engine/layout"
	"github.com/kvpersist/kvpersist/engine/vfs"
	"github.com/zeebo/xxh3"
)

// tensorData returns n deterministic bytes for slot i.
func tensorData(slot, n int) []byte {
	b := make([]byte, n)
	for k := range b {
		b[k] = byte(slot*37 + k*11 + 5)
	}
	return b
}

// baseHeader is a valid single-file header: two caches (K and V of shape
// [1, 2, 4, 8] bfloat16, 128 bytes each) and one attachment (int32 [4], 16
// bytes), tensors at offsets 0, 4096, 8192, 12288, 16384, each hash the
// xxh3-64 of tensorData(slot, bytes). Every level carries caller metadata.
func baseHeader() *layout.Header {
	kv := func(slot int) layout.Tensor {
		return layout.Tensor{
			Off: int64(slot) * layout.TensorAlign, Bytes: 128, DType: "bfloat16",
			Shape: []int64{1, 2, 4, 8},
			Hash:  hashOf(tensorData(slot, 128)),
			Meta:  layout.Meta{},
		}
	}
	return &layout.Header{
		FormatVersion: layout.FormatSingle,
		Meta:          layout.Meta{"model": json.RawMessage(`"tiny"`)},
		Caches: []layout.Entry{
			{Meta: layout.Meta{"type": json.RawMessage(`"KVCache"`), "offset": json.RawMessage(`4`)}, Tensors: []layout.Tensor{kv(0), kv(1)}},
			{Meta: layout.Meta{"type": json.RawMessage(`"KVCache"`), "offset": json.RawMessage(`4`)}, Tensors: []layout.Tensor{kv(2), kv(3)}},
		},
		Attachments: []layout.Entry{
			{Meta: layout.Meta{"name": json.RawMessage(`"tokens"`)}, Tensors: []layout.Tensor{{
				Off: 4 * layout.TensorAlign, Bytes: 16, DType: "int32", Shape: []int64{4},
				Hash: hashOf(tensorData(4, 16)), Meta: layout.Meta{},
			}}},
		},
	}
}

// hashOf is the documented tensor hash, derived independently of
// layout.TensorHash: xxh3-64 (seed 0) printed as 16 lowercase hex digits.
func hashOf(b []byte) string {
	const hexd = "0123456789abcdef"
	v := xxh3.Hash(b)
	out := make([]byte, 16)
	for i := 15; i >= 0; i-- {
		out[i] = hexd[v&15]
		v >>= 4
	}
	return string(out)
}

// prefix builds the 26-byte prefix by hand from the documented format:
// magic, u32 LE headerLen, u32 LE dataStart, u64 LE xxh3-64 of
// (u32 LE headerLen ‖ u32 LE dataStart ‖ JSON).
func prefix(js []byte, dataStart uint32) []byte {
	b := make([]byte, 26)
	copy(b, layout.Magic)
	binary.LittleEndian.PutUint32(b[10:], uint32(len(js)))
	binary.LittleEndian.PutUint32(b[14:], dataStart)
	msg := make([]byte, 8, 8+len(js))
	copy(msg, b[10:18])
	msg = append(msg, js...)
	binary.LittleEndian.PutUint64(b[18:], xxh3.Hash(msg))
	return b
}

// singleFile encodes h as a single-file snapshot: prefix, JSON, zeros up to
// a 16 KiB aligned dataStart, then every tensor's data at dataStart+Off. The
// file is sized for the unmodified baseHeader's tensors (dataStart + 16400).
func singleFile(t *testing.T, h *layout.Header) []byte {
	t.Helper()
	js, err := h.Encode()
	if err != nil {
		t.Fatalf("Encode: %v", err)
	}
	ds := int(layout.AlignUp(int64(26+len(js)), layout.DataAlign))
	buf := make([]byte, ds+4*layout.TensorAlign+16)
	copy(buf, prefix(js, uint32(ds)))
	copy(buf[26:], js)
	for i, tn := range h.Slots() {
		if tn.Off >= 0 && tn.Bytes > 0 && tn.Off <= int64(len(buf)) && tn.Bytes <= int64(len(buf)) && int(tn.Off)+int(tn.Bytes)+ds <= len(buf) {
			copy(buf[ds+int(tn.Off):], tensorData(i, int(tn.Bytes)))
		}
	}
	return buf
}

// manifestFile encodes h as a block manifest: prefix and JSON, dataStart =
// 26 + len(JSON), nothing after.
func manifestFile(t *testing.T, h *layout.Header) []byte {
	t.Helper()
	js, err := h.Encode()
	if err != nil {
		t.Fatalf("Encode: %v", err)
	}
	return append(prefix(js, uint32(26+len(js))), js...)
}

// decodeBytes writes b to a fresh file and decodes it with layout.Load.
func decodeBytes(t *testing.T, b []byte) (*layout.Snapshot, string, error) {
	t.Helper()
	path := filepath.Join(t.TempDir(), "snap")
	if err := os.WriteFile(path, b, 0o600); err != nil {
		t.Fatal(err)
	}
	s, err := layout.Load(vfs.Default, path)
	return s, path, err
}
