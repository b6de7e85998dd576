package layout_test

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"math/big"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/kvpersist/kvpersist/engine/jobs"
	"github.com/kvpersist/kvpersist/engine/layout"
	"github.com/kvpersist/kvpersist/internal/bunhash"
	"github.com/kvpersist/kvpersist/internal/kvgen"
	"github.com/kvpersist/kvpersist/internal/testutil"
)

// memFile is a read-only in-memory vfs.File. It records the largest buffer
// a reader asked it to fill, which bounds what the reader allocated for it.
type memFile struct {
	data    []byte
	maxRead int
}

func (m *memFile) ReadAt(p []byte, off int64) (int, error) {
	m.maxRead = max(m.maxRead, len(p))
	if off < 0 {
		return 0, fmt.Errorf("memFile: negative offset %d", off)
	}
	if off >= int64(len(m.data)) {
		return 0, io.EOF
	}
	n := copy(p, m.data[off:])
	if n < len(p) {
		return n, io.EOF
	}
	return n, nil
}

func (m *memFile) WriteAt([]byte, int64) (int, error) { return 0, errors.New("memFile: read-only") }
func (m *memFile) Sync() error                        { return nil }
func (m *memFile) Allocate(int64) error               { return nil }
func (m *memFile) StartWriteback(off, n int64) error  { return nil }
func (m *memFile) Stat() (os.FileInfo, error)         { return memInfo{int64(len(m.data))}, nil }
func (m *memFile) Name() string                       { return "mem" }
func (m *memFile) Close() error                       { return nil }

// memInfo describes a memFile: a regular file of size bytes.
type memInfo struct{ size int64 }

func (memInfo) Name() string       { return "mem" }
func (i memInfo) Size() int64      { return i.size }
func (memInfo) Mode() fs.FileMode  { return 0o640 }
func (memInfo) ModTime() time.Time { return time.Time{} }
func (memInfo) IsDir() bool        { return false }
func (memInfo) Sys() any           { return nil }

// decodeMem decodes b through a memFile.
func decodeMem(b []byte) (*layout.Snapshot, *memFile, error) {
	f := &memFile{data: b}
	s, err := layout.Decode(f, "fuzz")
	return s, f, err
}

// decodeSentinels are the errors Decode documents; every failure wraps one.
var decodeSentinels = []error{layout.ErrBadMagic, layout.ErrTruncated, layout.ErrHeaderTooLarge,
	layout.ErrHeaderHash, layout.ErrFormatVersion, layout.ErrInvalidHeader}

// fzSeedFiles writes a small cache with jobs.Write as a single file and as
// a block manifest and returns both files' bytes.
func fzSeedFiles(f *testing.F) (single, manifest []byte) {
	f.Helper()
	dir := f.TempDir()
	c := kvgen.NewCache(kvgen.Tiny, 3, true, nil)
	views, dtypes := c.Views(), c.DTypes()
	spec := func(name string, lay layout.Layout) *jobs.WriteRequest {
		s := &jobs.WriteRequest{Ref: jobs.Ref{Namespace: "ns", Name: name}, Layout: lay, BlockBytes: 4 << 10,
			Meta: layout.Meta{"model": []byte(`"tiny"`), "note": []byte(`{"a":[1,2,{"b":null}]}`)}}
		for l := 0; l < c.Model.Layers; l++ {
			s.Caches = append(s.Caches, jobs.EntrySpec{Meta: layout.Meta{"type": []byte(`"KVCache"`), "offset": []byte(`3`)},
				Tensors: []jobs.TensorSpec{{DType: dtypes[2*l], View: views[2*l]}, {DType: dtypes[2*l+1], View: views[2*l+1]}}})
		}
		n := len(views) - 1
		s.Attachments = []jobs.EntrySpec{{Meta: layout.Meta{"name": []byte(`"tokens"`)},
			Tensors: []jobs.TensorSpec{{DType: dtypes[n], View: views[n]}}}}
		return s
	}
	read := func(lay layout.Layout) []byte {
		p := filepath.Join(dir, "ns", "snap-"+lay.String())
		if _, _, err := jobs.Write(context.Background(), &jobs.Config{Root: dir, NoSync: true}, spec(filepath.Base(p), lay)); err != nil {
			f.Fatal(err)
		}
		b, err := os.ReadFile(p)
		if err != nil {
			f.Fatal(err)
		}
		return b
	}
	return read(layout.Single), read(layout.Blocks)
}

// toV5 rewrites a FormatBlocksXXH3 manifest as the FormatBlocks manifest
// of the same blocks (no xxh3s): what kvpersist wrote before, and what the
// Bun worker's manifests hold.
func toV5(tb testing.TB, manifest []byte) []byte {
	tb.Helper()
	snap, _, err := decodeMem(manifest)
	if err != nil || snap.Header.FormatVersion != layout.FormatBlocksXXH3 {
		tb.Fatalf("toV5 of a formatVersion %v manifest: %v", snap.Header.FormatVersion, err)
	}
	js, err := testutil.AsFormatBlocks(snap.Header).Encode()
	if err != nil {
		tb.Fatal(err)
	}
	return layout.EncodePrefix(js, uint32(layout.PrefixLen+len(js)))
}

// toLegacy re-prefixes a kvpersist file the way the Bun worker wrote it:
// LegacyMagic and Bun.hash of the JSON alone (the header itself unchanged).
func toLegacy(b []byte) []byte {
	out := append([]byte(nil), b...)
	copy(out, layout.LegacyMagic)
	n := binary.LittleEndian.Uint32(out[10:])
	binary.LittleEndian.PutUint64(out[18:], bunhash.Sum(out[26:26+n]))
	return out
}

// Fuzz input modes of FuzzDecode and FuzzReadHeader: raw file bytes, or a
// header JSON that the harness wraps in a valid prefix (so that mutations
// reach the header's validation instead of failing the header hash).
const (
	modeRaw            = iota // the file is js ‖ tail
	modeSingle                // kvpersist prefix, dataStart = the next 16 KiB boundary, tail at dataStart
	modeManifest              // kvpersist prefix, dataStart = 26 + len(js), then tail
	modeLegacyManifest        // Bun worker prefix (Bun.hash of the JSON), as modeManifest
	modeLegacySingle          // Bun worker prefix, as modeSingle
	numModes
)

// buildFile makes the file a fuzz input describes (see the modes).
func buildFile(mode uint8, js, tail []byte) []byte {
	var out []byte
	switch mode % numModes {
	case modeRaw:
		return append(append([]byte(nil), js...), tail...)
	case modeSingle, modeLegacySingle:
		ds := layout.AlignUp(int64(layout.PrefixLen+len(js)), layout.DataAlign)
		out = layout.EncodePrefix(js, uint32(ds))
	default:
		out = layout.EncodePrefix(js, uint32(layout.PrefixLen+len(js)))
	}
	if m := mode % numModes; m == modeLegacyManifest || m == modeLegacySingle {
		copy(out, layout.LegacyMagic)
		binary.LittleEndian.PutUint64(out[18:], bunhash.Sum(js))
	}
	return append(out, tail...)
}

// splitFile turns a real file into a fuzz input of the given mode: its
// header JSON and what follows dataStart.
func splitFile(f *testing.F, b []byte) (js, tail []byte) {
	f.Helper()
	p, err := layout.ParsePrefix(b)
	if err != nil {
		f.Fatal(err)
	}
	return b[layout.PrefixLen : layout.PrefixLen+int(p.HeaderLen)], b[p.DataStart:]
}

// FuzzDecode feeds arbitrary files to layout.Decode through an in-memory
// file. Decode must never panic; it must never ask for a buffer larger than
// the file (so a header claiming 60 MiB in a 100-byte file allocates no
// 60 MiB); every error wraps a documented sentinel; and what it accepts
// satisfies the format's invariants, checked here independently, and
// re-encodes to a file it accepts again with the same header (a fixed point).
// Seeds: files written by jobs.Write, the Bun worker's manifests
// (testdata/fuzz/FuzzDecode) and hand-made hostile prefixes.
func FuzzDecode(f *testing.F) {
	single, manifest := fzSeedFiles(f)
	v5 := toV5(f, manifest)
	for _, b := range [][]byte{single, manifest, v5, toLegacy(v5)} {
		if _, _, err := decodeMem(b); err != nil {
			f.Fatalf("seed does not decode: %v", err)
		}
	}
	js, tail := splitFile(f, single)
	f.Add(uint8(modeSingle), js, tail)
	f.Add(uint8(modeLegacySingle), js, tail)
	js, tail = splitFile(f, manifest)
	f.Add(uint8(modeManifest), js, tail)
	f.Add(uint8(modeLegacyManifest), js, tail) // refused: the Bun worker wrote no formatVersion 8
	js, tail = splitFile(f, v5)
	f.Add(uint8(modeManifest), js, tail)
	f.Add(uint8(modeLegacyManifest), js, tail)
	f.Add(uint8(modeRaw), manifest, []byte{})
	f.Add(uint8(modeRaw), toLegacy(v5), []byte{})
	f.Add(uint8(modeRaw), manifest[:len(manifest)-1], []byte{})
	// A 100-byte file whose prefix claims a 60 MiB header.
	huge := make([]byte, 100)
	copy(huge, layout.Magic)
	binary.LittleEndian.PutUint32(huge[10:], 60<<20)
	binary.LittleEndian.PutUint32(huge[14:], 60<<20+26)
	f.Add(uint8(modeRaw), huge, []byte{})
	over := append([]byte(nil), huge...)
	binary.LittleEndian.PutUint32(over[10:], layout.MaxHeaderLen+1)
	f.Add(uint8(modeRaw), over, []byte{})
	f.Add(uint8(modeRaw), []byte(layout.Magic), []byte{})
	f.Add(uint8(modeRaw), []byte{}, []byte{})
	f.Add(uint8(modeManifest), []byte(`{"caches":[{"tensors":[{"off":0,"bytes":2,"hash":"","dtype":"int8","shape":[2],"blocks":[{"hash":"`+
		strings.Repeat("0", 64)+`","bytes":2}]}]}],"formatVersion":5}`), []byte{})
	for _, xx := range []string{`"0123456789abcdef"`, `"0123456789ABCDEF"`, `"0123456789abcde"`, `"0123456789abcdefa"`, `"0123456789abcdeg"`, `""`, `null`, `81985529216486895`} {
		f.Add(uint8(modeManifest), []byte(`{"caches":[{"tensors":[{"off":0,"bytes":2,"hash":"","dtype":"int8","shape":[2],"blocks":[{"hash":"`+
			strings.Repeat("0", 64)+`","bytes":2,"xxh3":`+xx+`}]}]}],"formatVersion":8}`), []byte{})
	}
	f.Add(uint8(modeSingle), []byte(`{"caches":[{"tensors":[{"off":0,"bytes":2,"hash":"0123456789abcdef","dtype":"int8","shape":[2]},`+
		`{"off":4096,"bytes":4,"hash":"0123456789abcdef","dtype":"float32","shape":[1]}]}],"formatVersion":4}`), make([]byte, 4100))

	f.Fuzz(func(t *testing.T, mode uint8, js, tail []byte) {
		b := buildFile(mode, js, tail)
		snap, mf, err := decodeMem(b)
		if mf.maxRead > len(b) {
			t.Fatalf("Decode asked for a %d-byte read of a %d-byte file", mf.maxRead, len(b))
		}
		if err != nil {
			for _, s := range decodeSentinels {
				if errors.Is(err, s) {
					return
				}
			}
			t.Fatalf("error wraps no documented sentinel: %v", err)
		}
		checkInvariants(t, snap, int64(len(b)))
		if snap.Legacy {
			return // kvpersist never writes the legacy format
		}
		// Re-encode: the canonical encoding decodes to itself.
		js1, err := snap.Header.Encode()
		if err != nil {
			t.Fatalf("a decoded header does not encode: %v", err)
		}
		again := reencode(t, snap, b, js1)
		snap2, _, err := decodeMem(again)
		if err != nil {
			t.Fatalf("re-encoded file rejected: %v\noriginal JSON %q\nre-encoded %q", err, snap.JSON, js1)
		}
		js2, err := snap2.Header.Encode()
		if err != nil || !bytes.Equal(js1, js2) {
			t.Fatalf("encoding is not a fixed point (%v):\n%q\n%q", err, js1, js2)
		}
	})
}

// reencode builds a file holding js1 in place of snap's header: a manifest
// with dataStart = 26 + len(js1); a single file with its data section moved
// to the next 16 KiB boundary after the new header.
func reencode(t *testing.T, snap *layout.Snapshot, b, js1 []byte) []byte {
	t.Helper()
	if snap.Layout == layout.Blocks {
		return layout.EncodePrefix(js1, uint32(layout.PrefixLen+len(js1)))
	}
	ds := layout.AlignUp(int64(layout.PrefixLen+len(js1)), layout.DataAlign)
	if ds > 1<<31 {
		t.Skip("header too large to re-encode")
	}
	return append(layout.EncodePrefix(js1, uint32(ds)), b[snap.DataStart:]...)
}

// checkInvariants re-derives, independently of Validate, what a decoded
// snapshot promises its readers.
func checkInvariants(t *testing.T, s *layout.Snapshot, size int64) {
	t.Helper()
	if s.Size != size || int64(s.DataStart) > size || int64(layout.PrefixLen)+int64(s.HeaderLen) > int64(s.DataStart) || int(s.HeaderLen) != len(s.JSON) {
		t.Fatalf("prefix %+v inconsistent with a %d-byte file", s.Prefix, size)
	}
	itemSize := map[string]int64{"bool": 1, "int8": 1, "uint8": 1, "int16": 2, "uint16": 2, "float16": 2, "bfloat16": 2,
		"int32": 4, "uint32": 4, "float32": 4, "int64": 8, "uint64": 8, "float64": 8, "complex64": 8}
	type span struct{ lo, hi int64 }
	var spans []span
	for i, tn := range s.Header.Slots() {
		if len(tn.Shape) > layout.MaxRank || tn.Bytes < 0 {
			t.Fatalf("slot %d: rank %d, bytes %d", i, len(tn.Shape), tn.Bytes)
		}
		prod := big.NewInt(1)
		for _, d := range tn.Shape {
			if d < 0 {
				t.Fatalf("slot %d: negative dimension in %v", i, tn.Shape)
			}
			prod.Mul(prod, big.NewInt(d))
		}
		if n, ok := itemSize[tn.DType]; ok {
			if prod.Mul(prod, big.NewInt(n)); !prod.IsInt64() || prod.Int64() != tn.Bytes {
				t.Fatalf("slot %d: %d bytes for %s%v", i, tn.Bytes, tn.DType, tn.Shape)
			}
		} else if !s.Legacy || tn.DType == "" {
			t.Fatalf("slot %d: dtype %q accepted", i, tn.DType)
		}
		switch s.Layout {
		case layout.Single:
			end := new(big.Int).Add(big.NewInt(int64(s.DataStart)), big.NewInt(tn.Off))
			end.Add(end, big.NewInt(tn.Bytes))
			if tn.Off < 0 || end.Cmp(big.NewInt(size)) > 0 {
				t.Fatalf("slot %d: [%d, +%d) past the file's %d bytes (dataStart %d)", i, tn.Off, tn.Bytes, size, s.DataStart)
			}
			if len(tn.Hash) != 16 || !isLowerHex(tn.Hash) || tn.Blocks != nil {
				t.Fatalf("slot %d: hash %q, blocks %v in a single file", i, tn.Hash, tn.Blocks)
			}
			if tn.Bytes > 0 {
				spans = append(spans, span{tn.Off, tn.Off + tn.Bytes})
			}
		case layout.Blocks:
			var sum int64
			v := s.Header.FormatVersion
			if v != 5 && (v != 8 || s.Legacy) {
				t.Fatalf("a block manifest of formatVersion %d (legacy %v)", v, s.Legacy)
			}
			for k, r := range tn.Blocks {
				if len(r.Hash) != 64 || !isLowerHex(r.Hash) || r.Bytes <= 0 {
					t.Fatalf("slot %d block %d: %q, %d bytes", i, k, r.Hash, r.Bytes)
				}
				// formatVersion 8 records every block's xxh3 as 16
				// lowercase hex digits; 5 records none.
				if (v == 8) != (len(r.XXH3) == 16 && isLowerHex(r.XXH3)) || (v == 5 && r.XXH3 != "") {
					t.Fatalf("slot %d block %d: xxh3 %q in a formatVersion %d manifest", i, k, r.XXH3, v)
				}
				if r.Bytes > tn.Bytes-sum { // 0 <= sum <= tn.Bytes: no overflow
					t.Fatalf("slot %d: blocks sum past its %d bytes", i, tn.Bytes)
				}
				sum += r.Bytes
			}
			if sum != tn.Bytes {
				t.Fatalf("slot %d: blocks sum to %d of %d bytes", i, sum, tn.Bytes)
			}
		default:
			t.Fatalf("layout %v", s.Layout)
		}
	}
	sort.Slice(spans, func(i, j int) bool { return spans[i].lo < spans[j].lo })
	for i := 1; i < len(spans); i++ {
		if spans[i].lo < spans[i-1].hi {
			t.Fatalf("tensors overlap: %v and %v", spans[i-1], spans[i])
		}
	}
}

func isLowerHex(s string) bool {
	for i := 0; i < len(s); i++ {
		if c := s[i]; (c < '0' || c > '9') && (c < 'a' || c > 'f') {
			return false
		}
	}
	return true
}

// BenchmarkDecodeManyTensors decodes a manifest of n one-tensor entries
// (empty tensors, so the manifest is all header): the cost of decoding must
// grow linearly with the header, as a hostile manifest can be 64 MiB.
func BenchmarkDecodeManyTensors(b *testing.B) {
	for _, n := range []int{1000, 10000, 100000} {
		b.Run(fmt.Sprint(n), func(b *testing.B) {
			h := &layout.Header{FormatVersion: layout.FormatBlocks}
			for i := 0; i < n; i++ {
				h.Caches = append(h.Caches, layout.Entry{Tensors: []layout.Tensor{{DType: "int8", Shape: []int64{0}, Blocks: []layout.BlockRef{}}}})
			}
			js, err := h.Encode()
			if err != nil {
				b.Fatal(err)
			}
			file := layout.EncodePrefix(js, uint32(layout.PrefixLen+len(js)))
			b.SetBytes(int64(len(file)))
			b.ReportAllocs()
			for b.Loop() {
				if _, _, err := decodeMem(file); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}
