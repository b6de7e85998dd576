package layout_test

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"os"
	"path/filepath"
	"reflect"
	"testing"

	"github.com/kvpersist/kvpersist/engine/gather"
	"github.com/kvpersist/kvpersist/engine/jobs"
	"github.com/kvpersist/kvpersist/engine/layout"
	"github.com/kvpersist/kvpersist/engine/vfs"
)

// savePageFiles saves tokens as pages of 16 tokens with identity id under
// a fresh root and returns the page files' paths, in chain order.
func savePageFiles(t *testing.T, id string, tokens []uint32) []string {
	t.Helper()
	root := t.TempDir()
	n := len(tokens)
	buf := make([]byte, 2*n*4)
	for i := range buf {
		buf[i] = byte(i * 5)
	}
	res, _, err := jobs.SavePrefix(context.Background(), &jobs.Config{NoSync: true, Root: root}, &jobs.SavePrefixRequest{
		Namespace: "ns", Identity: id, Tokens: tokens, PageTokens: 16,
		Tensors: []jobs.TensorSpec{{DType: "bfloat16", View: gather.View{Base: buf, Shape: []int{n, 4}, Strides: []int{4, 1}, ItemSize: 2}}},
	})
	if err != nil {
		t.Fatal(err)
	}
	var paths []string
	for _, k := range res.Keys {
		s := k.String()
		paths = append(paths, filepath.Join(root, "ns", "pages", s[:2], s))
	}
	return paths
}

func readPage(t *testing.T, path string) (*layout.Page, error) {
	t.Helper()
	f, err := vfs.Default.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	return layout.ReadPage(f, path)
}

func pageTokenIDs(n int, from uint32) []uint32 {
	ts := make([]uint32, n)
	for i := range ts {
		ts[i] = from + uint32(i)*40503
	}
	return ts
}

// ReadPage gives the page Decode gives, for full pages and a leaf, with a
// plain identity (the fast path) and one JSON escapes (Decode's path).
func TestReadPageEqualsDecode(t *testing.T) {
	for _, id := range []string{"llama@sha:1/bf16", "tiny \"quoted\"\n\u00e9"} {
		for _, path := range savePageFiles(t, id, pageTokenIDs(40, 3)) {
			got, err := readPage(t, path)
			if err != nil {
				t.Fatalf("%q: %v", id, err)
			}
			snap, err := layout.Load(vfs.Default, path)
			if err != nil {
				t.Fatal(err)
			}
			if !reflect.DeepEqual(got, snap.Page) {
				t.Fatalf("%q: ReadPage %+v, Decode %+v", id, got, snap.Page)
			}
		}
	}
}

// rewriteHeader replaces a file's header JSON by edit(JSON), keeping its
// data start and data, with a valid header hash.
func rewriteHeader(t *testing.T, path string, edit func([]byte) []byte) {
	t.Helper()
	raw, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	hl := binary.LittleEndian.Uint32(raw[10:])
	ds := binary.LittleEndian.Uint32(raw[14:])
	js := edit(bytes.Clone(raw[layout.PrefixLen : layout.PrefixLen+int(hl)]))
	out := append(layout.EncodePrefix(js, ds), raw[ds:]...)
	if err := os.WriteFile(path, out, 0o644); err != nil {
		t.Fatal(err)
	}
}

// The fast path reads the page object alone: a page whose tensor entry
// Decode refuses is still read; a page object that does not verify, a
// header hash that does not match or a short file fail with Decode's
// errors.
func TestReadPageChecks(t *testing.T) {
	paths := savePageFiles(t, "id", pageTokenIDs(32, 9))
	want, err := readPage(t, paths[0])
	if err != nil {
		t.Fatal(err)
	}

	rewriteHeader(t, paths[0], func(js []byte) []byte { return bytes.Replace(js, []byte(`"bfloat16"`), []byte(`"float32"`), 1) })
	if _, err := layout.Load(vfs.Default, paths[0]); !errors.Is(err, layout.ErrInvalidHeader) {
		t.Fatalf("Decode of a wrong dtype: %v, want ErrInvalidHeader", err)
	}
	if got, err := readPage(t, paths[0]); err != nil || !reflect.DeepEqual(got, want) {
		t.Fatalf("ReadPage of a page with a wrong dtype: %v (want the page: tensors are not read)", err)
	}

	// A token id changed: the key is no longer the chain step.
	rewriteHeader(t, paths[1], func(js []byte) []byte {
		i := bytes.Index(js, []byte(`"tokens":[`)) + len(`"tokens":[`)
		js[i] = '1' + (js[i]-'0')%8
		return js
	})
	if _, err := readPage(t, paths[1]); !errors.Is(err, layout.ErrInvalidHeader) {
		t.Fatalf("ReadPage of a page whose key does not verify: %v, want ErrInvalidHeader", err)
	}

	raw, _ := os.ReadFile(paths[0])
	raw[layout.PrefixLen+3] ^= 1 // a byte of the header
	if err := os.WriteFile(paths[0], raw, 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := readPage(t, paths[0]); !errors.Is(err, layout.ErrHeaderHash) {
		t.Fatalf("ReadPage with a header hash mismatch: %v, want ErrHeaderHash", err)
	}
	if err := os.WriteFile(paths[0], raw[:20], 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := readPage(t, paths[0]); !errors.Is(err, layout.ErrTruncated) {
		t.Fatalf("ReadPage of a short file: %v, want ErrTruncated", err)
	}
}
