package engine

import (
	"bytes"
	"errors"
	"io/fs"
	"os"
	"path/filepath"
	"testing"

	"github.com/kvpersist/kvpersist/engine/gather"
	"github.com/kvpersist/kvpersist/engine/jobs"
	"github.com/kvpersist/kvpersist/engine/layout"
	"github.com/kvpersist/kvpersist/engine/vfs"
	"github.com/kvpersist/kvpersist/internal/testutil"
)

// Stores written by the original Bun worker (testdata/bun-worker, see its
// README.md), read and migrated through the engine.

const bunFixtures = "../testdata/bun-worker"

var (
	bunSingle  = Ref{Namespace: "bun-single", Name: "snapshot.mlxkv"} // T = 40
	bunBlocks  = Ref{Namespace: "bun-blocks", Name: "snapshot.mlxkv"} // T = 40
	bunGrown   = Ref{Namespace: "bun-blocks", Name: "grown.mlxkv"}    // T = 48
	bunLogical = int64(5280 + 5280 + 6336)
)

// bunStore lays the fixtures out under root as a store of the original
// worker: root/bun-single/snapshot.mlxkv, root/bun-blocks/{snapshot.mlxkv,
// grown.mlxkv, blocks/<sha256>} (34 blocks).
func bunStore(t testing.TB, root string) {
	t.Helper()
	testutil.BunStore(t, bunFixtures, root)
}

// bunT40 splits expected.T40.bin (what the original's reader returned) at
// the README's offsets 0, 1280, 2560, 3840, 5120.
func bunT40(t testing.TB) [][]byte {
	t.Helper()
	raw, err := os.ReadFile(filepath.Join(bunFixtures, "expected.T40.bin"))
	if err != nil || len(raw) != 5280 {
		t.Fatalf("expected.T40.bin: %d bytes, %v", len(raw), err)
	}
	return [][]byte{raw[0:1280], raw[1280:2560], raw[2560:3840], raw[3840:5120], raw[5120:]}
}

// bunWant is the content of each fixture snapshot.
func bunWant(t testing.TB, ref Ref) [][]byte {
	if ref == bunGrown {
		return testutil.BunFormula(48)
	}
	return bunT40(t)
}

func bunSameTree(t testing.TB, what string, a, b map[string]string) {
	t.Helper()
	if len(a) != len(b) {
		t.Fatalf("%s: %d entries, then %d", what, len(a), len(b))
	}
	for p, h := range a {
		if b[p] != h {
			t.Fatalf("%s: %s changed", what, p)
		}
	}
}

// bunRead does what a caller does: Stat, allocate, then a verified read
// expecting the header it allocated for.
func bunRead(t testing.TB, e *Engine, ref Ref) ([][]byte, *layout.Snapshot, Result) {
	t.Helper()
	snap, err := e.Stat(ref)
	if err != nil {
		t.Fatalf("Stat %s: %v", ref, err)
	}
	dest := make([][]byte, len(snap.Header.Slots()))
	for i, tn := range snap.Header.Slots() {
		dest[i] = bytes.Repeat([]byte{0x5A}, int(tn.Bytes))
	}
	res := e.Do(bg, &ReadRequest{Ref: ref, Dest: dest, Expect: snap.Header})
	return dest, snap, res
}

func bunFlip(t testing.TB, path string, off int) {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	b[off] ^= 0x01
	if err := os.WriteFile(path, b, 0o644); err != nil {
		t.Fatal(err)
	}
}

func TestLegacyReadThroughEngine(t *testing.T) {
	root := t.TempDir()
	bunStore(t, root)
	before := testutil.TreeDigest(t, root)
	e := newEngine(t, Config{Root: root})
	for _, c := range []struct {
		ref Ref
		lay layout.Layout
	}{{bunSingle, layout.Single}, {bunBlocks, layout.Blocks}, {bunGrown, layout.Blocks}} {
		got, snap, res := bunRead(t, e, c.ref)
		if res.Err != nil {
			t.Fatalf("read %s: %v", c.ref, res.Err)
		}
		if !snap.Legacy || snap.Layout != c.lay {
			t.Fatalf("%s: legacy %v, layout %v", c.ref, snap.Legacy, snap.Layout)
		}
		want := bunWant(t, c.ref)
		equalSlots(t, c.ref.String(), got, want)
		var n int64
		for _, w := range want {
			n += int64(len(w))
		}
		if res.Metrics.ReadBytes != n || res.Metrics.LogicalBytes != n {
			t.Fatalf("%s: metrics %+v, want %d bytes", c.ref, res.Metrics, n)
		}
	}
	// Reading takes no lock file and leaves no temp file in a legacy store.
	bunSameTree(t, "legacy store after reads", before, testutil.TreeDigest(t, root))
}

// Legacy files are validated as strictly as kvpersist's own: each
// corruption on its own copy of the store.
func TestLegacyStrictValidation(t *testing.T) {
	for _, c := range []struct {
		name   string
		damage func(t *testing.T, root string)
		bad    []Ref
		slot   int // failing slot of a ReadError; -1 for a decode error
		want   error
	}{
		// The first block of l0K head 0 is shared by both manifests.
		{"shared-block", func(t *testing.T, root string) {
			bunFlip(t, bunBlockPath(t, root, bunBlocks, 0, 0), 100)
		}, []Ref{bunBlocks, bunGrown}, 0, jobs.ErrCorrupt},
		{"tensor", func(t *testing.T, root string) {
			bunFlip(t, filepath.Join(root, "bun-single", "snapshot.mlxkv"), 16384+5120+3) // the tokens
		}, []Ref{bunSingle}, 4, jobs.ErrCorrupt},
		{"header-single", func(t *testing.T, root string) {
			bunFlip(t, filepath.Join(root, "bun-single", "snapshot.mlxkv"), 26+300)
		}, []Ref{bunSingle}, -1, layout.ErrHeaderHash},
		{"header-manifest", func(t *testing.T, root string) {
			bunFlip(t, filepath.Join(root, "bun-blocks", "grown.mlxkv"), 26+1000)
		}, []Ref{bunGrown}, -1, layout.ErrHeaderHash},
		{"truncated-block", func(t *testing.T, root string) {
			if err := os.Truncate(bunBlockPath(t, root, bunGrown, 3, 5), 255); err != nil {
				t.Fatal(err)
			}
		}, []Ref{bunGrown}, 3, jobs.ErrBlockSize},
		{"missing-block", func(t *testing.T, root string) {
			if err := os.Remove(bunBlockPath(t, root, bunBlocks, 4, 0)); err != nil {
				t.Fatal(err)
			}
		}, []Ref{bunBlocks}, 4, jobs.ErrMissingBlock},
	} {
		t.Run(c.name, func(t *testing.T) {
			root := t.TempDir()
			bunStore(t, root)
			c.damage(t, root)
			e := newEngine(t, Config{Root: root})
			for _, ref := range []Ref{bunSingle, bunBlocks, bunGrown} {
				bad := false
				for _, b := range c.bad {
					bad = bad || b == ref
				}
				if !bad {
					got, _, res := bunRead(t, e, ref)
					if res.Err != nil {
						t.Fatalf("undamaged %s: %v", ref, res.Err)
					}
					equalSlots(t, ref.String(), got, bunWant(t, ref))
					continue
				}
				if c.slot < 0 {
					if _, err := e.Stat(ref); !errors.Is(err, c.want) {
						t.Fatalf("Stat %s: %v, want %v", ref, err, c.want)
					}
					// A read decodes too, before touching its buffers.
					dest := make([][]byte, 5)
					for i, w := range bunWant(t, ref) {
						dest[i] = make([]byte, len(w))
					}
					if res := e.Do(bg, &ReadRequest{Ref: ref, Dest: dest}); !errors.Is(res.Err, c.want) {
						t.Fatalf("read %s: %v, want %v", ref, res.Err, c.want)
					}
					continue
				}
				_, _, res := bunRead(t, e, ref)
				var re *jobs.ReadError
				if !errors.Is(res.Err, c.want) || !errors.As(res.Err, &re) || len(re.Slots) != 1 || re.Slots[0].Slot != c.slot {
					t.Fatalf("read %s: %v, want a ReadError of slot %d wrapping %v", ref, res.Err, c.slot, c.want)
				}
			}
		})
	}
}

// bunBlockPath is the legacy (flat) path of block b of slot s of ref.
func bunBlockPath(t testing.TB, root string, ref Ref, s, b int) string {
	t.Helper()
	snap, err := layout.Load(vfs.Default, filepath.Join(root, ref.Namespace, ref.Name))
	if err != nil {
		t.Fatal(err)
	}
	return testutil.LegacyBlockPath(filepath.Join(root, ref.Namespace), snap.Header.Slots()[s].Blocks[b].Hash)
}

func TestMigrateThroughEngine(t *testing.T) {
	src := filepath.Join(t.TempDir(), "legacy")
	bunStore(t, src)
	before := testutil.TreeDigest(t, src)
	e := newEngine(t, Config{Root: filepath.Join(t.TempDir(), "kv")})
	var items []string
	res := mustDo(t, e, &MigrateRequest{SrcRoot: src,
		OnItem: func(it jobs.MigrateItem) { items = append(items, it.Status.String()+" "+it.Ref()) }})
	if res.Kind != KindMigrate || res.Kind.String() != "migrate" || res.Header != nil {
		t.Fatalf("result %+v", res)
	}
	if m := res.Metrics; m.LogicalBytes != bunLogical || m.ReadBytes != bunLogical || m.ReusedBytes != 4096 || m.BlocksReused != 16 {
		t.Fatalf("metrics %+v", m)
	}
	rep := res.Metrics.Migrate
	if rep.Migrated != 3 || len(items) != 3 || items[0] != "migrated bun-blocks/grown.mlxkv" {
		t.Fatalf("report %+v, items %v", rep, items)
	}
	if s := e.Stats(); s.BytesReused != 4096 || s.BytesRead != bunLogical {
		t.Fatalf("engine stats %+v", s)
	}
	for _, ref := range []Ref{bunSingle, bunBlocks, bunGrown} {
		got, snap, res := bunRead(t, e, ref)
		if res.Err != nil {
			t.Fatalf("read migrated %s: %v", ref, res.Err)
		}
		if snap.Legacy {
			t.Fatalf("%s is still a legacy file", ref)
		}
		equalSlots(t, "migrated "+ref.String(), got, bunWant(t, ref))
	}
	// A re-run skips all three; a collect keeps every block (all named).
	res = mustDo(t, e, &MigrateRequest{SrcRoot: src})
	if rep := res.Metrics.Migrate; rep.Skipped != 3 || res.Metrics.WrittenBytes != 0 {
		t.Fatalf("re-run: %+v, metrics %+v", rep, res.Metrics)
	}
	col := mustDo(t, e, &CollectRequest{})
	if cm := col.Metrics.Collect; cm.BlocksDeleted != 0 || cm.BlocksKept != 34 || len(cm.Unreadable) != 0 {
		t.Fatalf("collect after migrate: %+v", cm)
	}
	bunSameTree(t, "legacy source", before, testutil.TreeDigest(t, src))
}

// A corrupt legacy snapshot fails the job with a *jobs.MigrateError; the
// others are migrated and readable.
func TestMigrateThroughEngineCorrupt(t *testing.T) {
	src := filepath.Join(t.TempDir(), "legacy")
	bunStore(t, src)
	bunFlip(t, filepath.Join(src, "bun-single", "snapshot.mlxkv"), 16384+10)
	e := newEngine(t, Config{Root: filepath.Join(t.TempDir(), "kv")})
	res := e.Do(bg, &MigrateRequest{SrcRoot: src})
	rep := res.Metrics.Migrate
	var merr *jobs.MigrateError
	if !errors.As(res.Err, &merr) || !errors.Is(res.Err, jobs.ErrCorrupt) || len(merr.Failed) != 1 || merr.Failed[0].Ref() != bunSingle.String() {
		t.Fatalf("got %v, want a MigrateError for %s wrapping ErrCorrupt", res.Err, bunSingle)
	}
	if rep.Migrated != 2 || rep.Failed != 1 || e.Stats().Failed != 1 {
		t.Fatalf("report %+v", rep)
	}
	if _, err := e.Stat(bunSingle); !errors.Is(err, fs.ErrNotExist) {
		t.Fatalf("corrupt snapshot was published: %v", err)
	}
	for _, ref := range []Ref{bunBlocks, bunGrown} {
		got, _, res := bunRead(t, e, ref)
		if res.Err != nil {
			t.Fatal(res.Err)
		}
		equalSlots(t, ref.String(), got, bunWant(t, ref))
	}
}

// A migrate is a write to its destination namespaces: a job submitted
// after it in one of them waits for it; jobs in other namespaces do not.
func TestOrderMigrate(t *testing.T) {
	h := installHook(t)
	src := filepath.Join(t.TempDir(), "legacy")
	bunStore(t, src)
	e := newEngine(t, Config{Root: filepath.Join(t.TempDir(), "kv"), Workers: 4})
	release := h.hold(t, "migrate /")
	mig := mustSubmit(t, e, bg, &MigrateRequest{SrcRoot: src})
	h.await(t, "enter migrate /", 1)
	// A read of a snapshot the migrate is about to publish: it must wait,
	// or it would find nothing. Sized from the legacy header.
	want := bunWant(t, bunSingle)
	dest := make([][]byte, len(want))
	for i, w := range want {
		dest[i] = make([]byte, len(w))
	}
	rd := mustSubmit(t, e, bg, &ReadRequest{Ref: bunSingle, Dest: dest})
	// Another namespace is not in the migrate's scope.
	data := []byte("0123456789abcdef")
	other := &WriteRequest{Ref: Ref{Namespace: "other", Name: "x"}, Layout: layout.Single, Caches: []jobs.EntrySpec{{Tensors: []jobs.TensorSpec{{
		DType: "uint8", View: gather.View{Base: data, Shape: []int{len(data)}, Strides: []int{1}, ItemSize: 1}}}}}}
	ackOK(t, mustSubmit(t, e, bg, other))
	if h.count("enter read "+bunSingle.String()) != 0 {
		t.Fatalf("a read in the migrate's namespace started beside it; events: %v", h.snapshot())
	}
	release()
	ackOK(t, mig)
	ackOK(t, rd)
	h.before(t, "exit migrate /", 1, "enter read "+bunSingle.String(), 1)
	equalSlots(t, "read after migrate", dest, want)
}

func TestMigrateSubmitErrors(t *testing.T) {
	root := filepath.Join(t.TempDir(), "kv")
	e := newEngine(t, Config{Root: root})
	src := filepath.Join(t.TempDir(), "legacy")
	bunStore(t, src)
	for _, c := range []struct {
		name string
		req  Request
		want error
	}{
		{"nil", (*MigrateRequest)(nil), ErrPath},
		{"same-root", &MigrateRequest{SrcRoot: root}, jobs.ErrInvalidRequest},
		{"source-in-root", &MigrateRequest{SrcRoot: filepath.Join(root, "old")}, ErrPath},
		{"root-in-source", &MigrateRequest{SrcRoot: filepath.Dir(root)}, ErrPath},
		{"missing-source", &MigrateRequest{SrcRoot: filepath.Join(t.TempDir(), "none")}, fs.ErrNotExist},
		{"namespace", &MigrateRequest{SrcRoot: src, Namespaces: []string{"../x"}}, layout.ErrBadName},
		{"block-bytes", &MigrateRequest{SrcRoot: src, BlockBytes: 256}, jobs.ErrBlockBytes},
	} {
		if _, err := e.Submit(bg, c.req); !errors.Is(err, c.want) {
			t.Errorf("%s: %v, want %v", c.name, err, c.want)
		}
	}
	if s := e.Stats(); s.Queued != 0 || s.Completed != 0 {
		t.Fatalf("rejected requests were queued: %+v", s)
	}
}
