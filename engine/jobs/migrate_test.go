package jobs_test

import (
	"bytes"
	"context"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/kvpersist/kvpersist/engine/gather"
	"github.com/kvpersist/kvpersist/engine/jobs"
	"github.com/kvpersist/kvpersist/engine/layout"
	"github.com/kvpersist/kvpersist/engine/vfs"
	"github.com/kvpersist/kvpersist/internal/bunhash"
	"github.com/kvpersist/kvpersist/internal/testutil"
	"github.com/zeebo/xxh3"
)

// migFixtures holds the files written by the original Bun worker (see its
// README.md).
const migFixtures = testutil.BunFixtures

// migSource lays the fixtures out as a legacy store root:
// root/bun-single/snapshot.mlxkv (T=40) and root/bun-blocks/{snapshot.mlxkv
// (T=40), grown.mlxkv (T=48), blocks/<sha256>}.
func migSource(t testing.TB) string {
	t.Helper()
	return testutil.BunStore(t, migFixtures, filepath.Join(t.TempDir(), "legacy"))
}

// migExpected40 splits expected.T40.bin at the README's offsets
// (0, 1280, 2560, 3840, 5120; 5280 bytes in all).
func migExpected40(t testing.TB) [][]byte {
	t.Helper()
	raw, err := os.ReadFile(filepath.Join(migFixtures, "expected.T40.bin"))
	if err != nil {
		t.Fatal(err)
	}
	if len(raw) != 5280 {
		t.Fatalf("expected.T40.bin has %d bytes, want 5280", len(raw))
	}
	return [][]byte{raw[0:1280], raw[1280:2560], raw[2560:3840], raw[3840:5120], raw[5120:5280]}
}

// migRead restores path into fresh buffers sized from its header.
func migRead(t testing.TB, cfg *jobs.Config, path string) ([][]byte, *layout.Snapshot) {
	t.Helper()
	snap, err := layout.Load(vfs.Default, path)
	if err != nil {
		t.Fatalf("Load %s: %v", path, err)
	}
	dest := make([][]byte, len(snap.Header.Slots()))
	for i, tn := range snap.Header.Slots() {
		dest[i] = bytes.Repeat([]byte{0xA5}, int(tn.Bytes))
	}
	if _, _, err := readAt(context.Background(), cfg, path, &jobs.ReadRequest{Dest: dest, Expect: snap.Header}); err != nil {
		t.Fatalf("Read %s: %v", path, err)
	}
	return dest, snap
}

func migEqual(t testing.TB, what string, got, want [][]byte) {
	t.Helper()
	if len(got) != len(want) {
		t.Fatalf("%s: %d slots, want %d", what, len(got), len(want))
	}
	for i := range want {
		if !bytes.Equal(got[i], want[i]) {
			t.Fatalf("%s: slot %d differs (%d bytes, want %d)", what, i, len(got[i]), len(want[i]))
		}
	}
}

func migSameTree(t testing.TB, what string, before, after map[string]string) {
	t.Helper()
	for p, h := range before {
		if after[p] != h {
			t.Errorf("%s: %s changed or vanished", what, p)
		}
	}
	for p := range after {
		if _, ok := before[p]; !ok {
			t.Errorf("%s: %s appeared", what, p)
		}
	}
}

// migFlip flips one bit of the byte at off (negative: from the end).
func migFlip(t testing.TB, path string, off int) {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	if off < 0 {
		off += len(b)
	}
	b[off] ^= 0x10
	if err := os.WriteFile(path, b, 0o644); err != nil {
		t.Fatal(err)
	}
}

// migRewriteLegacy rewrites a legacy manifest's JSON with edit, keeping
// its format valid: headerLen, dataStart (26 + headerLen for a manifest)
// and the Bun.hash of the new JSON.
func migRewriteLegacy(t testing.TB, path string, edit func(top map[string]any)) {
	t.Helper()
	raw, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	hl := binary.LittleEndian.Uint32(raw[10:])
	var top map[string]any
	if err := json.Unmarshal(raw[26:26+hl], &top); err != nil {
		t.Fatal(err)
	}
	edit(top)
	js, err := json.Marshal(top)
	if err != nil {
		t.Fatal(err)
	}
	out := make([]byte, 26, 26+len(js))
	copy(out, layout.LegacyMagic)
	binary.LittleEndian.PutUint32(out[10:], uint32(len(js)))
	binary.LittleEndian.PutUint32(out[14:], uint32(26+len(js)))
	binary.LittleEndian.PutUint64(out[18:], bunhash.Sum(js))
	out = append(out, js...)
	if err := os.WriteFile(path, out, 0o644); err != nil {
		t.Fatal(err)
	}
}

// migT40TailBlock returns the path of a source block that only
// snapshot.mlxkv names (grown.mlxkv does not): the 128-byte tail of head 0
// of slot 0.
func migT40TailBlock(t testing.TB, src string) string {
	t.Helper()
	snap, err := layout.Load(vfs.Default, filepath.Join(src, "bun-blocks", "snapshot.mlxkv"))
	if err != nil {
		t.Fatal(err)
	}
	ref := snap.Header.Slots()[0].Blocks[2]
	if ref.Bytes != 128 {
		t.Fatalf("slot 0 block 2 has %d bytes, the README says 128", ref.Bytes)
	}
	return filepath.Join(src, "bun-blocks", "blocks", ref.Hash)
}

// migrate migrates into the store at dst and returns the report
// (Metrics.Migrate), the metrics and the error.
func migrate(t testing.TB, cfg *jobs.Config, dst string, req *jobs.MigrateRequest) (*jobs.MigrateReport, jobs.Metrics, error) {
	t.Helper()
	return migrateCtx(context.Background(), cfg, dst, req)
}

func migrateCtx(ctx context.Context, cfg *jobs.Config, dst string, req *jobs.MigrateRequest) (*jobs.MigrateReport, jobs.Metrics, error) {
	c := *cfg
	c.Root = dst
	m, err := jobs.Migrate(ctx, &c, req)
	return m.Migrate, m, err
}

func itemByRef(t testing.TB, rep *jobs.MigrateReport, ref string) jobs.MigrateItem {
	t.Helper()
	for _, it := range rep.Items {
		if it.Ref() == ref {
			return it
		}
	}
	t.Fatalf("no item %s in %+v", ref, rep.Items)
	return jobs.MigrateItem{}
}

// The formula of the README and the original's output agree: the test's
// T=48 expectation is computed the way expected.T40.bin was made.
func TestLegacyFormulaMatchesFixture(t *testing.T) {
	migEqual(t, "formula at T=40 vs expected.T40.bin", testutil.BunFormula(40), migExpected40(t))
}

// The fixtures read back through jobs.Read, verified (Bun.hash per tensor,
// SHA-256 per block).
func TestReadLegacyFixtures(t *testing.T) {
	src := migSource(t)
	before := testutil.TreeDigest(t, src)
	for _, c := range []struct {
		path string
		lay  layout.Layout
		want [][]byte
	}{
		{filepath.Join(src, "bun-single", "snapshot.mlxkv"), layout.Single, migExpected40(t)},
		{filepath.Join(src, "bun-blocks", "snapshot.mlxkv"), layout.Blocks, migExpected40(t)},
		{filepath.Join(src, "bun-blocks", "grown.mlxkv"), layout.Blocks, testutil.BunFormula(48)},
	} {
		got, snap := migRead(t, withHelpers(2), c.path)
		if !snap.Legacy || snap.Layout != c.lay {
			t.Fatalf("%s: legacy %v layout %v", c.path, snap.Legacy, snap.Layout)
		}
		migEqual(t, c.path, got, c.want)
	}
	migSameTree(t, "source after reads", before, testutil.TreeDigest(t, src))
}

func TestMigrateFixtures(t *testing.T) {
	src := migSource(t)
	dst := filepath.Join(t.TempDir(), "kv")
	before := testutil.TreeDigest(t, src)
	var planN int
	var planBytes int64
	var seen []string
	rep, m, err := migrate(t, withHelpers(2), dst, &jobs.MigrateRequest{SrcRoot: src,
		OnPlan: func(n int, b int64) { planN, planBytes = n, b },
		OnItem: func(it jobs.MigrateItem) { seen = append(seen, it.Ref()) }})
	if err != nil {
		t.Fatalf("Migrate: %v", err)
	}
	const logical = 5280 + 5280 + 6336
	if planN != 3 || planBytes != logical {
		t.Fatalf("OnPlan(%d, %d), want (3, %d)", planN, planBytes, logical)
	}
	wantOrder := []string{"bun-blocks/grown.mlxkv", "bun-blocks/snapshot.mlxkv", "bun-single/snapshot.mlxkv"}
	if !slices.Equal(seen, wantOrder) || len(rep.Items) != 3 {
		t.Fatalf("OnItem order %v, want %v", seen, wantOrder)
	}
	if rep.Migrated != 3 || rep.Skipped != 0 || rep.Failed != 0 || len(rep.Ignored) != 0 {
		t.Fatalf("report %+v", rep)
	}
	if m.LogicalBytes != logical || m.ReadBytes != logical {
		t.Fatalf("metrics %+v, want %d logical and read bytes", m, logical)
	}
	// grown.mlxkv comes first (names sorted); snapshot.mlxkv then shares
	// the first two 256-byte blocks of every head: 4 tensors x 2 heads x 2,
	// the original's reusedBytes for the same pair.
	g, s := itemByRef(t, rep, "bun-blocks/grown.mlxkv"), itemByRef(t, rep, "bun-blocks/snapshot.mlxkv")
	if g.Metrics.ReusedBytes != 0 || g.Metrics.BlocksWritten != 25 {
		t.Fatalf("grown: %+v", g.Metrics)
	}
	if s.Metrics.ReusedBytes != 4096 || s.Metrics.BlocksReused != 16 || s.Metrics.BlocksWritten != 9 {
		t.Fatalf("snapshot after grown: %+v", s.Metrics)
	}
	if g.SourceBlockBytes != 256 || g.Recut || s.Recut || g.Layout != layout.Blocks {
		t.Fatalf("grown item %+v", g)
	}
	for _, it := range rep.Items {
		if it.Status != jobs.StatusMigrated || it.Err != nil || it.Metrics.ReadBytes != it.LogicalBytes {
			t.Fatalf("%s: %+v", it.Ref(), it)
		}
	}
	migSameTree(t, "source after migrate", before, testutil.TreeDigest(t, src))

	for _, c := range []struct {
		rel  string
		lay  layout.Layout
		want [][]byte
	}{
		{"bun-single/snapshot.mlxkv", layout.Single, migExpected40(t)},
		{"bun-blocks/snapshot.mlxkv", layout.Blocks, migExpected40(t)},
		{"bun-blocks/grown.mlxkv", layout.Blocks, testutil.BunFormula(48)},
	} {
		got, snap := migRead(t, noSync(), filepath.Join(dst, c.rel))
		if snap.Legacy || snap.Layout != c.lay {
			t.Fatalf("%s: legacy %v layout %v", c.rel, snap.Legacy, snap.Layout)
		}
		migEqual(t, "migrated "+c.rel, got, c.want)
		old, err := layout.Load(vfs.Default, filepath.Join(src, c.rel))
		if err != nil {
			t.Fatal(err)
		}
		// Caller metadata unchanged at every level; a manifest names the
		// very blocks the source named.
		oj, _ := json.Marshal(old.Header.Meta)
		nj, _ := json.Marshal(snap.Header.Meta)
		if !bytes.Equal(oj, nj) {
			t.Fatalf("%s: top-level metadata %s, source %s", c.rel, nj, oj)
		}
		for i, e := range append(slices.Clone(old.Header.Caches), old.Header.Attachments...) {
			ne := append(slices.Clone(snap.Header.Caches), snap.Header.Attachments...)[i]
			oj, _ := json.Marshal(e.Meta)
			nj, _ := json.Marshal(ne.Meta)
			if !bytes.Equal(oj, nj) || len(e.Meta) == 0 {
				t.Fatalf("%s entry %d: metadata %s, source %s", c.rel, i, nj, oj)
			}
		}
		for i, tn := range snap.Header.Slots() {
			ot := old.Header.Slots()[i]
			if tn.DType != ot.DType || !slices.Equal(tn.Shape, ot.Shape) {
				t.Fatalf("%s slot %d: %s%v, source %s%v", c.rel, i, tn.DType, tn.Shape, ot.DType, ot.Shape)
			}
			if c.lay == layout.Blocks && !layout.SameBlocks(tn.Blocks, ot.Blocks) {
				t.Fatalf("%s slot %d: blocks %v, source %v", c.rel, i, tn.Blocks, ot.Blocks)
			}
			// The migrated manifest records each block's xxh3-64, equal to
			// an independent hash of the block file's bytes.
			for k, r := range tn.Blocks {
				if c.lay != layout.Blocks {
					break
				}
				b, err := os.ReadFile(testutil.BlockPath(filepath.Dir(filepath.Join(dst, c.rel)), r.Hash))
				if err != nil {
					t.Fatal(err)
				}
				if want := fmt.Sprintf("%016x", xxh3.Hash(b)); r.XXH3 != want || snap.Header.FormatVersion != layout.FormatBlocksXXH3 {
					t.Fatalf("%s slot %d block %d: xxh3 %q (formatVersion %d), the block's bytes hash to %s", c.rel, i, k, r.XXH3, snap.Header.FormatVersion, want)
				}
			}
		}
	}
	// 34 distinct blocks, as in the source, under kvpersist's fan-out.
	n := 0
	err = filepath.WalkDir(filepath.Join(dst, "bun-blocks", "blocks"), func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.Type().IsRegular() {
			n++
			if filepath.Base(filepath.Dir(p)) != d.Name()[:2] {
				t.Errorf("block %s is not in its fan-out directory", p)
			}
		}
		return nil
	})
	if err != nil || n != 34 {
		t.Fatalf("%d block files (err %v), want 34", n, err)
	}
}

func TestMigrateRerunSkipsAndRepairs(t *testing.T) {
	src := migSource(t)
	dst := filepath.Join(t.TempDir(), "kv")
	if _, _, err := migrate(t, noSync(), dst, &jobs.MigrateRequest{SrcRoot: src}); err != nil {
		t.Fatal(err)
	}
	after1 := testutil.TreeDigest(t, dst)
	rep, m, err := migrate(t, noSync(), dst, &jobs.MigrateRequest{SrcRoot: src})
	if err != nil {
		t.Fatal(err)
	}
	if rep.Skipped != 3 || rep.Migrated != 0 || m.WrittenBytes != 0 || m.ReadBytes != 0 {
		t.Fatalf("re-run: report %+v metrics %+v", rep, m)
	}
	for _, it := range rep.Items {
		if it.Status != jobs.StatusSkipped || it.Status.String() != "skipped" {
			t.Fatalf("%s: %v", it.Ref(), it.Status)
		}
	}
	migSameTree(t, "destination after a re-run", after1, testutil.TreeDigest(t, dst))

	// A block of the destination goes missing: that manifest is migrated
	// again (the block comes back), the others are skipped.
	snap, err := layout.Load(vfs.Default, filepath.Join(dst, "bun-blocks", "grown.mlxkv"))
	if err != nil {
		t.Fatal(err)
	}
	lost := testutil.BlockPath(filepath.Join(dst, "bun-blocks"), snap.Header.Slots()[3].Blocks[5].Hash)
	if err := os.Remove(lost); err != nil {
		t.Fatal(err)
	}
	rep, _, err = migrate(t, noSync(), dst, &jobs.MigrateRequest{SrcRoot: src})
	if err != nil {
		t.Fatal(err)
	}
	if g := itemByRef(t, rep, "bun-blocks/grown.mlxkv"); g.Status != jobs.StatusMigrated || g.Metrics.BlocksWritten != 1 {
		t.Fatalf("grown after losing a block: %+v", g)
	}
	if rep.Skipped != 2 {
		t.Fatalf("report %+v", rep)
	}
	got, _ := migRead(t, noSync(), filepath.Join(dst, "bun-blocks", "grown.mlxkv"))
	migEqual(t, "repaired grown", got, testutil.BunFormula(48))

	// Force re-migrates everything (the same bytes).
	rep, _, err = migrate(t, noSync(), dst, &jobs.MigrateRequest{SrcRoot: src, Force: true})
	if err != nil || rep.Migrated != 3 {
		t.Fatalf("forced: %+v, %v", rep, err)
	}
	migSameTree(t, "destination after a forced run", after1, testutil.TreeDigest(t, dst))
}

func TestMigrateCorruptSourcesReported(t *testing.T) {
	for _, c := range []struct {
		name    string
		corrupt func(t *testing.T, src string)
		bad     string
		want    error
	}{
		{"block", func(t *testing.T, src string) { migFlip(t, migT40TailBlock(t, src), 7) },
			"bun-blocks/snapshot.mlxkv", jobs.ErrCorrupt},
		{"tensor", func(t *testing.T, src string) {
			migFlip(t, filepath.Join(src, "bun-single", "snapshot.mlxkv"), 16384+2560+100)
		}, "bun-single/snapshot.mlxkv", jobs.ErrCorrupt},
		{"header", func(t *testing.T, src string) { migFlip(t, filepath.Join(src, "bun-blocks", "grown.mlxkv"), 200) },
			"bun-blocks/grown.mlxkv", layout.ErrHeaderHash},
		{"missing-block", func(t *testing.T, src string) {
			if err := os.Remove(migT40TailBlock(t, src)); err != nil {
				t.Fatal(err)
			}
		}, "bun-blocks/snapshot.mlxkv", jobs.ErrMissingBlock},
	} {
		t.Run(c.name, func(t *testing.T) {
			src := migSource(t)
			c.corrupt(t, src)
			before := testutil.TreeDigest(t, src)
			dst := filepath.Join(t.TempDir(), "kv")
			rep, _, err := migrate(t, noSync(), dst, &jobs.MigrateRequest{SrcRoot: src})
			var merr *jobs.MigrateError
			if !errors.As(err, &merr) || !errors.Is(err, c.want) || len(merr.Failed) != 1 || merr.Total != 3 {
				t.Fatalf("got %v, want a MigrateError of 1 of 3 wrapping %v", err, c.want)
			}
			if rep.Failed != 1 || rep.Migrated != 2 {
				t.Fatalf("report %+v", rep)
			}
			it := itemByRef(t, rep, c.bad)
			if it.Status != jobs.StatusFailed || !errors.Is(it.Err, c.want) || !strings.Contains(err.Error(), c.bad) {
				t.Fatalf("%s: %+v (error %v)", c.bad, it, err)
			}
			if _, err := os.Lstat(filepath.Join(dst, c.bad)); !os.IsNotExist(err) {
				t.Fatalf("%s was published: %v", c.bad, err)
			}
			want := map[string][][]byte{
				"bun-single/snapshot.mlxkv": migExpected40(t),
				"bun-blocks/snapshot.mlxkv": migExpected40(t),
				"bun-blocks/grown.mlxkv":    testutil.BunFormula(48),
			}
			for rel, w := range want {
				if rel == c.bad {
					continue
				}
				got, _ := migRead(t, noSync(), filepath.Join(dst, rel))
				migEqual(t, rel, got, w)
			}
			migSameTree(t, "corrupt source after migrate", before, testutil.TreeDigest(t, src))
		})
	}
}

// Re-cut at a kvpersist block size: same bytes, blocks of at most that
// size, boundaries reported as changed. The fixture's rows (640 and 768
// bytes) fit one 4 KiB block each, so T=40 and T=48 share none.
func TestMigrateRecut(t *testing.T) {
	src := migSource(t)
	dst := filepath.Join(t.TempDir(), "kv")
	rep, m, err := migrate(t, noSync(), dst, &jobs.MigrateRequest{SrcRoot: src, Namespaces: []string{"bun-blocks"}, BlockBytes: 4096})
	if err != nil {
		t.Fatal(err)
	}
	if len(rep.Items) != 2 || rep.Migrated != 2 || m.ReusedBytes != 0 {
		t.Fatalf("report %+v metrics %+v", rep, m)
	}
	for _, it := range rep.Items {
		if !it.Recut || it.SourceBlockBytes != 256 {
			t.Fatalf("%s: %+v", it.Ref(), it)
		}
	}
	got, snap := migRead(t, noSync(), filepath.Join(dst, "bun-blocks", "grown.mlxkv"))
	migEqual(t, "re-cut grown", got, testutil.BunFormula(48))
	for i, tn := range snap.Header.Slots() {
		wantBlocks := 2 // two heads, one 768-byte row each
		if i == 4 {
			wantBlocks = 1
		}
		if len(tn.Blocks) != wantBlocks {
			t.Fatalf("slot %d: %d blocks, want %d", i, len(tn.Blocks), wantBlocks)
		}
	}
	// A re-run with the same block size skips them.
	rep, _, err = migrate(t, noSync(), dst, &jobs.MigrateRequest{SrcRoot: src, Namespaces: []string{"bun-blocks"}, BlockBytes: 4096})
	if err != nil || rep.Skipped != 2 {
		t.Fatalf("re-run: %+v, %v", rep, err)
	}
	if _, _, err := migrate(t, noSync(), dst, &jobs.MigrateRequest{SrcRoot: src, BlockBytes: 256}); !errors.Is(err, jobs.ErrBlockBytes) {
		t.Fatalf("BlockBytes 256: %v, want ErrBlockBytes", err)
	}
}

// Metadata the original's callers could add, at the top level, per entry
// and per tensor, survives a kept-boundaries migration byte for byte.
func TestMigrateKeepsMetadata(t *testing.T) {
	src := migSource(t)
	path := filepath.Join(src, "bun-blocks", "grown.mlxkv")
	migRewriteLegacy(t, path, func(top map[string]any) {
		top["model"] = "tiny-test"
		top["turn"] = 7
		c0 := top["caches"].([]any)[0].(map[string]any)
		c0["layer"] = map[string]any{"index": 0, "sliding": false}
		c0["tensors"].([]any)[1].(map[string]any)["role"] = "V"
	})
	dst := filepath.Join(t.TempDir(), "kv")
	if _, _, err := migrate(t, noSync(), dst, &jobs.MigrateRequest{SrcRoot: src}); err != nil {
		t.Fatal(err)
	}
	got, snap := migRead(t, noSync(), filepath.Join(dst, "bun-blocks", "grown.mlxkv"))
	migEqual(t, "grown with metadata", got, testutil.BunFormula(48))
	h := snap.Header
	if string(h.Meta["model"]) != `"tiny-test"` || string(h.Meta["turn"]) != `7` || len(h.Meta) != 2 {
		t.Fatalf("top-level metadata %v", h.Meta)
	}
	if string(h.Caches[0].Meta["layer"]) != `{"index":0,"sliding":false}` || string(h.Caches[0].Meta["type"]) != `"KVCache"` ||
		string(h.Caches[0].Meta["offset"]) != `48` || string(h.Attachments[0].Meta["name"]) != `"tokens"` {
		t.Fatalf("entry metadata %v / %v", h.Caches[0].Meta, h.Attachments[0].Meta)
	}
	if string(h.Caches[0].Tensors[1].Meta["role"]) != `"V"` {
		t.Fatalf("tensor metadata %v", h.Caches[0].Tensors[1].Meta)
	}
	// Re-cut goes through Write, which has no per-tensor metadata: refused
	// rather than dropped.
	dst2 := filepath.Join(t.TempDir(), "kv2")
	rep, _, err := migrate(t, noSync(), dst2, &jobs.MigrateRequest{SrcRoot: src, BlockBytes: 4096})
	if !errors.Is(err, jobs.ErrUnsupported) || itemByRef(t, rep, "bun-blocks/grown.mlxkv").Status != jobs.StatusFailed || rep.Migrated != 2 {
		t.Fatalf("re-cut with tensor metadata: %v, report %+v", err, rep)
	}
}

// A destination holding something else is not overwritten (unless Force).
func TestMigrateDestinationConflict(t *testing.T) {
	src := migSource(t)
	dst := filepath.Join(t.TempDir(), "kv")
	other := filepath.Join(dst, "bun-single", "snapshot.mlxkv")
	data := []byte("0123456789abcdef")
	if _, _, err := writeAt(context.Background(), noSync(), &wreq{other, &jobs.WriteRequest{Layout: layout.Single,
		Caches: []jobs.EntrySpec{{Tensors: []jobs.TensorSpec{{DType: "uint8", View: gather.View{Base: data, Shape: []int{16}, Strides: []int{1}}}}}}}}); err != nil {
		t.Fatal(err)
	}
	before := testutil.TreeDigest(t, filepath.Join(dst, "bun-single"))
	rep, _, err := migrate(t, noSync(), dst, &jobs.MigrateRequest{SrcRoot: src})
	if !errors.Is(err, jobs.ErrDestinationExists) || rep.Failed != 1 || rep.Migrated != 2 {
		t.Fatalf("got %v, report %+v; want ErrDestinationExists for 1", err, rep)
	}
	migSameTree(t, "conflicting destination", before, testutil.TreeDigest(t, filepath.Join(dst, "bun-single")))
	rep, _, err = migrate(t, noSync(), dst, &jobs.MigrateRequest{SrcRoot: src, Force: true})
	if err != nil || rep.Migrated != 3 {
		t.Fatalf("forced: %v, %+v", err, rep)
	}
	got, _ := migRead(t, noSync(), other)
	migEqual(t, "forced over a conflict", got, migExpected40(t))
}

// The fixture folder itself as a source root: "single" is a namespace; a
// namespace named "blocks" is not one kvpersist accepts, so its snapshots
// fail (ErrBadName) and the rest migrates. Files that are not legacy
// snapshots are left alone and listed.
func TestMigrateScan(t *testing.T) {
	src := filepath.Join(t.TempDir(), "fixtures")
	err := filepath.WalkDir(migFixtures, func(p string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() {
			return err
		}
		rel, _ := filepath.Rel(migFixtures, p)
		testutil.CopyFile(t, p, filepath.Join(src, rel))
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	ns := filepath.Join(src, "single")
	testutil.CopyFile(t, filepath.Join(ns, "snapshot.mlxkv"), filepath.Join(ns, "snapshot.mlxkv.tmp")) // the original's temp name
	if err := os.WriteFile(filepath.Join(ns, "notes.txt"), []byte("hello"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Mkdir(filepath.Join(ns, "sub"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink("snapshot.mlxkv", filepath.Join(ns, "link.mlxkv")); err != nil {
		t.Fatal(err)
	}
	kv := filepath.Join(t.TempDir(), "kv")
	if _, _, err := migrate(t, noSync(), kv, &jobs.MigrateRequest{SrcRoot: migSource(t), Namespaces: []string{"bun-single"}}); err != nil {
		t.Fatal(err)
	}
	testutil.CopyFile(t, filepath.Join(kv, "bun-single", "snapshot.mlxkv"), filepath.Join(ns, "already.kv"))
	before := testutil.TreeDigest(t, src)

	dst := filepath.Join(t.TempDir(), "kv")
	rep, _, err := migrate(t, noSync(), dst, &jobs.MigrateRequest{SrcRoot: src})
	if !errors.Is(err, layout.ErrBadName) {
		t.Fatalf("got %v, want ErrBadName for the namespace \"blocks\"", err)
	}
	if rep.Migrated != 1 || rep.Failed != 2 || itemByRef(t, rep, "single/snapshot.mlxkv").Status != jobs.StatusMigrated {
		t.Fatalf("report %+v", rep)
	}
	why := map[string]string{}
	for _, ig := range rep.Ignored {
		rel, _ := filepath.Rel(src, ig.Path)
		why[rel] = ig.Why
	}
	for rel, want := range map[string]string{
		"README.md": "not a namespace directory", "expected.T40.bin": "not a namespace directory",
		"single/snapshot.mlxkv.tmp": "temp file", "single/notes.txt": "not a snapshot of the original worker",
		"single/sub": "directory", "single/link.mlxkv": "not a regular file", "single/already.kv": "already in kvpersist's format",
	} {
		if !strings.Contains(why[rel], want) {
			t.Errorf("%s: ignored as %q, want %q", rel, why[rel], want)
		}
	}
	if len(why) != 11 { // 6 files at the root; the temp file, notes, sub, link and already.kv
		t.Errorf("%d ignored entries: %v", len(why), why)
	}
	got, _ := migRead(t, noSync(), filepath.Join(dst, "single", "snapshot.mlxkv"))
	migEqual(t, "single", got, migExpected40(t))
	migSameTree(t, "fixture source", before, testutil.TreeDigest(t, src))
	if ents, _ := os.ReadDir(dst); len(ents) != 1 {
		t.Fatalf("destination has %d namespaces, want 1 (single)", len(ents))
	}
}

func TestMigrateRoots(t *testing.T) {
	dir := t.TempDir()
	for _, c := range [][2]string{{dir, dir}, {dir, filepath.Join(dir, "kv")}, {filepath.Join(dir, "old"), dir}, {"", dir}, {dir, ""}} {
		if _, _, err := migrate(t, noSync(), c[1], &jobs.MigrateRequest{SrcRoot: c[0]}); !errors.Is(err, jobs.ErrInvalidRequest) {
			t.Errorf("roots %q -> %q: %v, want ErrInvalidRequest", c[0], c[1], err)
		}
	}
	// A symlink to the source is the source.
	src := migSource(t)
	link := filepath.Join(dir, "link")
	if err := os.Symlink(src, link); err != nil {
		t.Fatal(err)
	}
	if err := jobs.CheckMigrateRoots(src, filepath.Join(link, "kv")); !errors.Is(err, jobs.ErrInvalidRequest) {
		t.Errorf("destination inside the source through a symlink: %v", err)
	}
	if _, _, err := migrate(t, noSync(), filepath.Join(dir, "kv"), &jobs.MigrateRequest{SrcRoot: src, Namespaces: []string{"../x"}}); !errors.Is(err, jobs.ErrInvalidRequest) {
		t.Errorf("namespace ../x: %v", err)
	}
	// An empty source migrates nothing and creates nothing.
	empty := filepath.Join(dir, "empty")
	if err := os.Mkdir(empty, 0o755); err != nil {
		t.Fatal(err)
	}
	rep, _, err := migrate(t, noSync(), filepath.Join(dir, "kv-empty"), &jobs.MigrateRequest{SrcRoot: empty})
	if err != nil || len(rep.Items) != 0 {
		t.Fatalf("empty source: %+v, %v", rep, err)
	}
	if _, err := os.Lstat(filepath.Join(dir, "kv-empty")); !os.IsNotExist(err) {
		t.Fatalf("destination created for an empty source: %v", err)
	}
}

func TestMigrateCancelled(t *testing.T) {
	src := migSource(t)
	ctx, cancel := context.WithCancel(context.Background())
	dst := filepath.Join(t.TempDir(), "kv")
	n := 0
	rep, _, err := migrateCtx(ctx, noSync(), dst, &jobs.MigrateRequest{SrcRoot: src,
		OnItem: func(jobs.MigrateItem) {
			if n++; n == 1 {
				cancel()
			}
		}})
	if !errors.Is(err, context.Canceled) || len(rep.Items) != 1 || rep.Migrated != 1 {
		t.Fatalf("got %v, report %+v; want context.Canceled after the first snapshot", err, rep)
	}
	if _, err := os.Lstat(filepath.Join(dst, "bun-blocks", "snapshot.mlxkv")); !os.IsNotExist(err) {
		t.Fatalf("second snapshot migrated after cancel: %v", err)
	}
}
