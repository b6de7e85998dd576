package jobs_test

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strings"
	"testing"

	"github.com/kvpersist/kvpersist/engine/jobs"
	"github.com/kvpersist/kvpersist/engine/layout"
	"github.com/kvpersist/kvpersist/engine/vfs"
	"github.com/kvpersist/kvpersist/internal/kvgen"
	"github.com/kvpersist/kvpersist/internal/testutil"
	"github.com/zeebo/xxh3"
)

// noSync is the configuration of most tests: no fsync, one goroutine.
// wreq is a write request with the path it is written at: the tests
// address snapshots by path (<root>/<namespace>/<name>), under many
// temporary roots.
type wreq struct {
	path string
	*jobs.WriteRequest
}

// at returns a copy of cfg whose Root is the store root holding path
// (<root>/<namespace>/<name>), and path's Ref.
func at(cfg *jobs.Config, path string) (*jobs.Config, jobs.Ref) {
	c := *cfg
	ns := filepath.Dir(path)
	c.Root = filepath.Dir(ns)
	return &c, jobs.Ref{Namespace: filepath.Base(ns), Name: filepath.Base(path)}
}

// writeAt is jobs.Write of w at w.path.
func writeAt(ctx context.Context, cfg *jobs.Config, w *wreq) (*layout.Header, jobs.Metrics, error) {
	c, ref := at(cfg, w.path)
	r := *w.WriteRequest
	r.Ref = ref
	return jobs.Write(ctx, c, &r)
}

// readAt is jobs.Read of the snapshot at path.
func readAt(ctx context.Context, cfg *jobs.Config, path string, req *jobs.ReadRequest) (*layout.Snapshot, jobs.Metrics, error) {
	c, ref := at(cfg, path)
	r := *req
	r.Ref = ref
	return jobs.Read(ctx, c, &r)
}

// collectAt is jobs.Collect of the store at root.
func collectAt(ctx context.Context, cfg *jobs.Config, root string, req *jobs.CollectRequest) (jobs.Metrics, error) {
	c := *cfg
	c.Root = root
	return jobs.Collect(ctx, &c, req)
}

func noSync() *jobs.Config { return &jobs.Config{NoSync: true} }

// goSpawn lends a real goroutine every time (tests only: unbounded).
func goSpawn(fn func()) bool { go fn(); return true }

// withHelpers is noSync with n helper goroutines.
func withHelpers(n int) *jobs.Config {
	return &jobs.Config{NoSync: true, Spawn: goSpawn, Helpers: n}
}

func rawJSON(t testing.TB, v any) json.RawMessage {
	t.Helper()
	b, err := json.Marshal(v)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// cacheSpec describes c the way mlx-lm's caches are saved: one entry per
// layer {"type":"KVCache","offset":T} with K and V, then one attachment
// {"name":"tokens"} holding the int32 token ids.
func cacheSpec(t testing.TB, c *kvgen.Cache, path string, lay layout.Layout, blockBytes int) *wreq {
	t.Helper()
	caches, atts, meta := kvgen.CacheRequest(c, c.Tokens)
	return &wreq{path, &jobs.WriteRequest{Layout: lay, BlockBytes: blockBytes, Meta: meta, Caches: caches, Attachments: atts}}
}

func expectedAll(c *kvgen.Cache) [][]byte {
	out := make([][]byte, c.Slots())
	for i := range out {
		out[i] = c.Expected(i)
	}
	return out
}

// destFor allocates one buffer per slot of h, filled with a sentinel.
func destFor(h *layout.Header, fill byte) [][]byte {
	slots := h.Slots()
	out := make([][]byte, len(slots))
	for i, tn := range slots {
		out[i] = bytes.Repeat([]byte{fill}, int(tn.Bytes))
	}
	return out
}

// readBack reads path into fresh buffers sized from its header.
func readBack(t testing.TB, cfg *jobs.Config, path string, verify bool) ([][]byte, *layout.Snapshot, jobs.Metrics, error) {
	t.Helper()
	snap, err := layout.Load(vfs.Default, path)
	if err != nil {
		t.Fatalf("Load %s: %v", path, err)
	}
	dest := make([][]byte, len(snap.Header.Slots()))
	for i, tn := range snap.Header.Slots() {
		dest[i] = make([]byte, tn.Bytes)
	}
	s, m, err := readAt(context.Background(), cfg, path, &jobs.ReadRequest{Dest: dest, NoVerify: !verify})
	return dest, s, m, err
}

// mustEqualExpected compares every destination with the cache's Expected.
func mustEqualExpected(t testing.TB, got, want [][]byte) {
	t.Helper()
	if len(got) != len(want) {
		t.Fatalf("%d slots read, want %d", len(got), len(want))
	}
	for i := range want {
		if !bytes.Equal(got[i], want[i]) {
			k := 0
			for k < min(len(got[i]), len(want[i])) && got[i][k] == want[i][k] {
				k++
			}
			t.Fatalf("slot %d: %d bytes read, want %d; first difference at byte %d", i, len(got[i]), len(want[i]), k)
		}
	}
}

func shaHex(b []byte) string {
	s := sha256.Sum256(b)
	return hex.EncodeToString(s[:])
}

func xxhHex(b []byte) string { return fmt.Sprintf("%016x", xxh3.Hash(b)) }

// planSizes re-derives the block sizes of the documented cut: limit =
// blockBytes/itemsize elements; a row is the product of the last two dims;
// each row cut into limit-element blocks from its own start.
func planSizes(shape []int64, itemSize, blockBytes int) []int64 {
	elems := int64(1)
	for _, d := range shape {
		elems *= d
	}
	if elems == 0 {
		return nil
	}
	row := int64(1)
	for _, d := range shape[max(0, len(shape)-2):] {
		row *= d
	}
	limit := int64(max(1, blockBytes/itemSize))
	var out []int64
	for r := int64(0); r < elems/row; r++ {
		for s := int64(0); s < row; s += limit {
			out = append(out, min(limit, row-s)*int64(itemSize))
		}
	}
	return out
}

// checkBlockRefs checks that the refs of every slot name the SHA-256 of the
// corresponding byte ranges of want, with the planned sizes, and record
// their xxh3-64 (a formatVersion 8 manifest).
func checkBlockRefs(t testing.TB, h *layout.Header, want [][]byte, blockBytes int) {
	t.Helper()
	for i, tn := range h.Slots() {
		item, _ := layout.ItemSize(tn.DType)
		sizes := planSizes(tn.Shape, item, blockBytes)
		if len(tn.Blocks) != len(sizes) {
			t.Fatalf("slot %d: %d blocks, plan has %d", i, len(tn.Blocks), len(sizes))
		}
		var off int64
		for b, ref := range tn.Blocks {
			if ref.Bytes != sizes[b] {
				t.Fatalf("slot %d block %d: %d bytes, plan says %d", i, b, ref.Bytes, sizes[b])
			}
			if got := shaHex(want[i][off : off+ref.Bytes]); ref.Hash != got {
				t.Fatalf("slot %d block %d: hash %s, SHA-256 of its bytes is %s", i, b, ref.Hash, got)
			}
			if got := xxhHex(want[i][off : off+ref.Bytes]); ref.XXH3 != got || h.FormatVersion != layout.FormatBlocksXXH3 {
				t.Fatalf("slot %d block %d: xxh3 %q (formatVersion %d), xxh3-64 of its bytes is %s", i, b, ref.XXH3, h.FormatVersion, got)
			}
			off += ref.Bytes
		}
		if off != int64(len(want[i])) || tn.Bytes != off || tn.Hash != "" {
			t.Fatalf("slot %d: blocks cover %d of %d bytes (header %d), hash %q", i, off, len(want[i]), tn.Bytes, tn.Hash)
		}
	}
}

// checkSingleHeader checks offsets (aligned, in order, non-overlapping) and
// every tensor hash against xxh3 of the expected bytes.
func checkSingleHeader(t testing.TB, h *layout.Header, want [][]byte) {
	t.Helper()
	var end int64
	for i, tn := range h.Slots() {
		if tn.Off%layout.TensorAlign != 0 || tn.Off < end {
			t.Fatalf("slot %d: off %d (previous tensor ends at %d)", i, tn.Off, end)
		}
		end = tn.Off + tn.Bytes
		if tn.Bytes != int64(len(want[i])) || tn.Blocks != nil {
			t.Fatalf("slot %d: %d bytes, want %d; blocks %v", i, tn.Bytes, len(want[i]), tn.Blocks)
		}
		if got := xxhHex(want[i]); tn.Hash != got {
			t.Fatalf("slot %d: hash %s, xxh3 of the expected bytes is %s", i, tn.Hash, got)
		}
	}
}

// blockSet lists the distinct block hashes a header names.
func blockSet(h *layout.Header) map[string]int64 {
	out := map[string]int64{}
	for _, tn := range h.Slots() {
		for _, r := range tn.Blocks {
			out[r.Hash] = r.Bytes
		}
	}
	return out
}

// blockFiles lists the block files under nsDir/blocks (by hash).
func blockFiles(t testing.TB, nsDir string) map[string]int64 {
	t.Helper()
	out := map[string]int64{}
	root := testutil.BlocksDir(nsDir)
	err := filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			if os.IsNotExist(err) && p == root {
				return filepath.SkipDir
			}
			return err
		}
		if d.Type().IsRegular() && layout.ValidBlockHash(d.Name()) {
			info, err := d.Info()
			if err != nil {
				return err
			}
			out[d.Name()] = info.Size()
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return out
}

// temps lists every temp file (by IsTemp) under root.
func temps(t testing.TB, root string) []string {
	t.Helper()
	return testutil.FilesMatching(t, root, func(name string) bool {
		return layout.IsTemp(name) || strings.Contains(name, ".tmp")
	})
}

func sortedKeys[V any](m map[string]V) []string {
	out := make([]string, 0, len(m))
	for k := range m {
		out = append(out, k)
	}
	sort.Strings(out)
	return out
}

func mustWrite(t testing.TB, cfg *jobs.Config, spec *wreq) (*layout.Header, jobs.Metrics) {
	t.Helper()
	h, m, err := writeAt(context.Background(), cfg, spec)
	if err != nil {
		t.Fatalf("Write %s: %v", spec.path, err)
	}
	return h, m
}

// blockPaths maps hashes to their block paths in nsDir.
func blockPaths(nsDir string, hashes []string) []string {
	out := make([]string, len(hashes))
	for i, h := range hashes {
		out[i] = testutil.BlockPath(nsDir, h)
	}
	slices.Sort(out)
	return out
}

// savePrefixAt is jobs.SavePrefix of req in the namespace directory nsDir:
// cfg's root is nsDir's parent (cfg itself is not modified) and
// req.Namespace its base name.
func savePrefixAt(ctx context.Context, cfg *jobs.Config, nsDir string, req *jobs.SavePrefixRequest) (*jobs.PrefixResult, jobs.Metrics, error) {
	c := *cfg
	c.Root = filepath.Dir(nsDir)
	r := *req
	r.Namespace = filepath.Base(nsDir)
	return jobs.SavePrefix(ctx, &c, &r)
}
