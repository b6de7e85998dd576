package jobs_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"os"
	"path/filepath"
	"slices"
	"testing"

	"github.com/kvpersist/kvpersist/engine/gather"
	"github.com/kvpersist/kvpersist/engine/jobs"
	"github.com/kvpersist/kvpersist/engine/layout"
	"github.com/kvpersist/kvpersist/engine/vfs"
	"github.com/kvpersist/kvpersist/internal/kvgen"
)

// roundTripTokens keeps the big geometries small: T past a Step boundary,
// so padded caches really are padded (capacity 512 or 256), and T*HeadDim*2
// not a multiple of the block size, so every row has a short tail block.
var roundTripTokens = map[string]int{
	kvgen.Llama31_8B.Name: 512, // 64 tensors of 1 MiB (padded capacity 768)
	kvgen.Qwen25_7B.Name:  300,
	kvgen.Gemma2_9B.Name:  150, // 84 tensors of 600 KiB (padded capacity 256)
	kvgen.Tiny.Name:       300,
}

// roundTripBlockBytes: a block file costs a few milliseconds to create and
// remove on the development machine, so the big geometries use the 1 MiB
// default (one block per head row: 512, 224 and 672 files) and Tiny a small
// block size that cuts each row into two full blocks and a tail.
var roundTripBlockBytes = map[string]int{
	kvgen.Llama31_8B.Name: 0,       // row 76800 bytes: one block
	kvgen.Qwen25_7B.Name:  0,       // row 76800 bytes: one block
	kvgen.Gemma2_9B.Name:  0,       // row 76800 bytes: one block
	kvgen.Tiny.Name:       4 << 10, // row 9600 bytes: 4096 + 4096 + 1408
}

func TestRoundTripAllGeometries(t *testing.T) {
	for _, m := range kvgen.Models() {
		T := roundTripTokens[m.Name]
		if T == 0 {
			t.Fatalf("no T for model %s", m.Name)
		}
		bb := roundTripBlockBytes[m.Name]
		t.Run(m.Name, func(t *testing.T) {
			t.Parallel()
			var want [][]byte
			// Both block saves share one namespace: the padded view must
			// produce exactly the contiguous view's blocks.
			blocksNS := filepath.Join(t.TempDir(), "ns")
			var firstRefs *layout.Header
			for _, padded := range []bool{false, true} {
				c := kvgen.NewCache(m, T, padded, nil)
				if want == nil {
					want = expectedAll(c)
				}
				if v := c.Views()[0]; v.IsContiguous() == padded {
					t.Fatalf("padded=%v but view contiguous=%v", padded, v.IsContiguous())
				}
				for _, lay := range []layout.Layout{layout.Single, layout.Blocks} {
					kind := map[bool]string{false: "contiguous", true: "padded"}[padded]
					t.Run(lay.String()+"-"+kind, func(t *testing.T) {
						path := filepath.Join(t.TempDir(), "ns", "snap")
						if lay == layout.Blocks {
							path = filepath.Join(blocksNS, kind)
						}
						h, wm := mustWrite(t, withHelpers(1), cacheSpec(t, c, path, lay, bb))
						if wm.LogicalBytes != int64(m.CacheBytes(T)) {
							t.Fatalf("LogicalBytes %d, want %d", wm.LogicalBytes, m.CacheBytes(T))
						}
						// Scratch: at most one chunk (single file) or one
						// block. Contiguous views are never copied; nor are
						// blocks (each lies inside one head row, which is one
						// run of a padded buffer); nor single-file chunks of
						// the Llama rows (512*128*2 = 128 KiB runs).
						limit := int64(jobs.ChunkBytes)
						if lay == layout.Blocks {
							limit = int64(max(bb, jobs.DefaultBlockBytes*boolInt(bb == 0)))
						}
						noCopy := !padded || lay == layout.Blocks || m.Name == kvgen.Llama31_8B.Name
						if wm.ScratchPeak > limit || noCopy && (wm.CopiedBytes != 0 || wm.ScratchPeak != 0) {
							t.Fatalf("ScratchPeak %d (limit %d), CopiedBytes %d", wm.ScratchPeak, limit, wm.CopiedBytes)
						}
						if lay == layout.Single {
							checkSingleHeader(t, h, want)
						} else {
							checkBlockRefs(t, h, want, max(bb, jobs.DefaultBlockBytes*boolInt(bb == 0)))
							st, err := os.Stat(path)
							if err != nil {
								t.Fatal(err)
							}
							nRefs := 0
							for _, tn := range h.Slots() {
								nRefs += len(tn.Blocks)
							}
							if !padded {
								// A first save into an empty namespace writes
								// every (distinct) block and the manifest.
								firstRefs = h
								if wm.BlocksWritten != int64(nRefs) || wm.BlocksReused != 0 || wm.ReusedBytes != 0 ||
									wm.WrittenBytes != wm.LogicalBytes+st.Size() {
									t.Fatalf("metrics %+v for %d refs, manifest %d bytes", wm, nRefs, st.Size())
								}
							} else {
								// The padded save finds every block stored.
								if wm.BlocksWritten != 0 || wm.BlocksReused != int64(nRefs) || wm.ReusedBytes != wm.LogicalBytes ||
									wm.WrittenBytes != st.Size() {
									t.Fatalf("metrics %+v for %d refs, manifest %d bytes", wm, nRefs, st.Size())
								}
								if firstRefs != nil {
									a, b := firstRefs.Slots(), h.Slots()
									for i := range a {
										if !slices.Equal(a[i].Blocks, b[i].Blocks) {
											t.Fatalf("slot %d: padded and contiguous blocks differ", i)
										}
									}
								}
							}
							if files := blockFiles(t, blocksNS); len(files) != nRefs {
								t.Fatalf("%d block files for %d refs", len(files), nRefs)
							}
						}
						// The published header is what a reader decodes.
						snap, err := layout.Load(vfs.Default, path)
						if err != nil {
							t.Fatal(err)
						}
						js, _ := h.Encode()
						if !bytes.Equal(js, snap.JSON) {
							t.Fatal("returned header differs from the published one")
						}
						got, _, rm, err := readBack(t, withHelpers(1), path, true)
						if err != nil {
							t.Fatalf("Read: %v", err)
						}
						mustEqualExpected(t, got, want)
						if rm.ReadBytes != wm.LogicalBytes || rm.LogicalBytes != wm.LogicalBytes {
							t.Fatalf("read metrics %+v, want %d bytes", rm, wm.LogicalBytes)
						}
						if tmp := temps(t, filepath.Dir(path)); len(tmp) != 0 {
							t.Fatalf("temp files left: %v", tmp)
						}
					})
				}
			}
		})
	}
}

func boolInt(b bool) int {
	if b {
		return 1
	}
	return 0
}

// TestRoundTripWithSync keeps every fsync on (file and directory).
func TestRoundTripWithSync(t *testing.T) {
	c := kvgen.NewCache(kvgen.Tiny, 300, true, nil)
	want := expectedAll(c)
	for _, lay := range []layout.Layout{layout.Single, layout.Blocks} {
		cfg := &jobs.Config{Spawn: goSpawn, Helpers: 2}
		path := filepath.Join(t.TempDir(), "ns", "snap")
		h, _ := mustWrite(t, cfg, cacheSpec(t, c, path, lay, 4096))
		if lay == layout.Single {
			checkSingleHeader(t, h, want)
		} else {
			checkBlockRefs(t, h, want, 4096)
		}
		got, _, _, err := readBack(t, cfg, path, true)
		if err != nil {
			t.Fatalf("%v: %v", lay, err)
		}
		mustEqualExpected(t, got, want)
	}
}

// TestRoundTripZeroTokens saves and restores an empty cache (every tensor
// has zero bytes).
// A tensor's dtype is given once: a view whose ItemSize is left 0 takes the
// dtype's itemsize (bfloat16: 2 bytes, int32: 4), saves and restores
// bit-exact, and the caller's request is left as it was (ItemSize still 0).
func TestItemSizeFollowsFromDType(t *testing.T) {
	c := kvgen.NewCache(kvgen.Tiny, 300, true, nil)
	for _, lay := range []layout.Layout{layout.Single, layout.Blocks} {
		path := filepath.Join(t.TempDir(), "ns", "s")
		spec := cacheSpec(t, c, path, lay, 4096)
		for _, g := range [][]jobs.EntrySpec{spec.Caches, spec.Attachments} {
			for i := range g {
				for j := range g[i].Tensors {
					g[i].Tensors[j].View.ItemSize = 0
				}
			}
		}
		h, _ := mustWrite(t, noSync(), spec)
		if ts := h.Slots(); ts[0].Bytes != int64(c.Model.TensorBytes(300)) || ts[len(ts)-1].Bytes != 300*kvgen.IDSize {
			t.Fatalf("%v: slot bytes %d and %d", lay, ts[0].Bytes, ts[len(ts)-1].Bytes)
		}
		if v := spec.Attachments[0].Tensors[0].View; v.ItemSize != 0 {
			t.Fatalf("%v: the request's view was modified (ItemSize %d)", lay, v.ItemSize)
		}
		got, _, _, err := readBack(t, noSync(), path, true)
		if err != nil {
			t.Fatalf("%v: %v", lay, err)
		}
		mustEqualExpected(t, got, expectedAll(c))
	}
}

func TestRoundTripZeroTokens(t *testing.T) {
	c := kvgen.NewCache(kvgen.Tiny, 0, true, nil)
	for _, lay := range []layout.Layout{layout.Single, layout.Blocks} {
		path := filepath.Join(t.TempDir(), "ns", "empty")
		h, m := mustWrite(t, noSync(), cacheSpec(t, c, path, lay, 0))
		if m.LogicalBytes != 0 || len(h.Slots()) != c.Slots() {
			t.Fatalf("%v: metrics %+v, %d slots", lay, m, len(h.Slots()))
		}
		got, _, _, err := readBack(t, noSync(), path, true)
		if err != nil {
			t.Fatalf("%v: %v", lay, err)
		}
		mustEqualExpected(t, got, expectedAll(c))
	}
}

func TestCallerMetadataRoundTrip(t *testing.T) {
	c := kvgen.NewCache(kvgen.Tiny, 40, true, nil)
	top := layout.Meta{
		"model":   json.RawMessage(`"tiny"`),
		"session": json.RawMessage(`{"id":"c0ffee","turns":[{"role":"user","n":12},{"role":"assistant","n":28}],"tags":[]}`),
		"ids":     json.RawMessage(`[128000,9906,11,1917,0]`),
		"score":   json.RawMessage(`-0.25`),
		"none":    json.RawMessage(`null`),
	}
	for _, lay := range []layout.Layout{layout.Single, layout.Blocks} {
		t.Run(lay.String(), func(t *testing.T) {
			path := filepath.Join(t.TempDir(), "ns", "meta")
			spec := cacheSpec(t, c, path, lay, 0)
			spec.Meta = top
			spec.Caches[1].Meta = layout.Meta{"type": json.RawMessage(`"RotatingKVCache"`), "offset": json.RawMessage(`40`),
				"window": json.RawMessage(`{"size":4096,"keep":[0,4]}`)}
			mustWrite(t, noSync(), spec)
			snap, err := layout.Load(vfs.Default, path)
			if err != nil {
				t.Fatal(err)
			}
			h := snap.Header
			if len(h.Meta) != len(top) {
				t.Fatalf("top-level metadata %v", h.Meta)
			}
			for k, v := range top {
				if !bytes.Equal(h.Meta[k], v) {
					t.Errorf("top %q = %s, want %s", k, h.Meta[k], v)
				}
			}
			if string(h.Caches[0].Meta["type"]) != `"KVCache"` || string(h.Caches[0].Meta["offset"]) != `40` || len(h.Caches[0].Meta) != 2 {
				t.Errorf("cache 0 metadata %v", h.Caches[0].Meta)
			}
			if string(h.Caches[1].Meta["window"]) != `{"size":4096,"keep":[0,4]}` || string(h.Caches[1].Meta["type"]) != `"RotatingKVCache"` {
				t.Errorf("cache 1 metadata %v", h.Caches[1].Meta)
			}
			if string(h.Attachments[0].Meta["name"]) != `"tokens"` || len(h.Attachments[0].Meta) != 1 {
				t.Errorf("attachment metadata %v", h.Attachments[0].Meta)
			}
			// Callers cannot set per-tensor metadata: none is stored.
			for i, tn := range h.Slots() {
				if len(tn.Meta) != 0 {
					t.Errorf("slot %d has tensor metadata %v", i, tn.Meta)
				}
			}
		})
	}
}

// Metadata using a key the format owns is an invalid request, found before
// any data is written (no block, no temp file, nothing published).
func TestReservedMetadataRejectedBeforeData(t *testing.T) {
	c := kvgen.NewCache(kvgen.Tiny, 40, true, nil)
	for _, lay := range []layout.Layout{layout.Single, layout.Blocks} {
		for _, mut := range []func(s *wreq){
			func(s *wreq) { s.Meta["caches"] = json.RawMessage(`[]`) },
			func(s *wreq) { s.Caches[1].Meta["tensors"] = json.RawMessage(`1`) },
			func(s *wreq) { s.Attachments[0].Meta["bad"] = json.RawMessage(`{`) },
		} {
			root := t.TempDir()
			path := filepath.Join(root, "ns", "meta")
			spec := cacheSpec(t, c, path, lay, 0)
			mut(spec)
			_, _, err := writeAt(context.Background(), noSync(), spec)
			if !errors.Is(err, jobs.ErrInvalidRequest) || !errors.Is(err, layout.ErrInvalidHeader) {
				t.Fatalf("%v: got %v, want ErrInvalidRequest and layout.ErrInvalidHeader", lay, err)
			}
			if _, err := os.Lstat(path); !os.IsNotExist(err) {
				t.Fatalf("%v: snapshot published: %v", lay, err)
			}
			if files := blockFiles(t, filepath.Join(root, "ns")); len(files) != 0 {
				t.Fatalf("%v: %d blocks written before the request was rejected", lay, len(files))
			}
			if tmp := temps(t, root); len(tmp) != 0 {
				t.Fatalf("%v: temp files %v", lay, tmp)
			}
		}
	}
}

// noAllocFS is the real file system on one without fallocate: vfs.File.Allocate
// documents that "a file system without fallocate is not an error (it is a
// hint)", and osFile.Allocate returns nil on EOPNOTSUPP (e.g. some FUSE, NFSv3,
// older ZFS).
type noAllocFS struct{ vfs.FS }
type noAllocFile struct{ vfs.File }

func (f noAllocFile) Allocate(int64) error { return nil }
func (n noAllocFS) Create(name string, perm os.FileMode) (vfs.File, error) {
	f, err := n.FS.Create(name, perm)
	if err != nil {
		return nil, err
	}
	return noAllocFile{f}, nil
}

// TestSingleFileEndsAtItsLastTensorWithoutFallocate: a single-file
// snapshot whose last slot has zero bytes (an empty token attachment, an
// unfilled cache) loads on a file system without fallocate: an empty
// tensor has off 0 and the file ends at the last non-empty tensor, so the
// file's size does not depend on fallocate having extended it.
func TestSingleFileEndsAtItsLastTensorWithoutFallocate(t *testing.T) {
	root := t.TempDir()
	path := filepath.Join(root, "ns", "snap")
	k := gather.View{Base: make([]byte, 100), Shape: []int{50}, Strides: []int{1}, ItemSize: 2}
	empty := gather.View{Base: nil, Shape: []int{0}, Strides: []int{1}, ItemSize: 4}
	spec := &wreq{path, &jobs.WriteRequest{Layout: layout.Single,
		Caches:      []jobs.EntrySpec{{Tensors: []jobs.TensorSpec{{DType: "bfloat16", View: k}}}},
		Attachments: []jobs.EntrySpec{{Tensors: []jobs.TensorSpec{{DType: "int32", View: empty}}}}}}
	cfg := &jobs.Config{NoSync: true, FS: noAllocFS{vfs.Default}}
	if _, _, err := writeAt(context.Background(), cfg, spec); err != nil {
		t.Fatalf("Write: %v", err)
	}
	if _, err := layout.Load(vfs.Default, path); err != nil {
		t.Fatalf("Write acked, but the snapshot it published does not load: %v", err)
	}
}
