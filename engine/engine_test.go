package engine

import (
	"context"
	"errors"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/kvpersist/kvpersist/engine/jobs"
	"github.com/kvpersist/kvpersist/engine/layout"
	"github.com/kvpersist/kvpersist/engine/readio"
	"github.com/kvpersist/kvpersist/internal/kvgen"
)

// Each kind of job returns its own buffered ack channel carrying exactly one
// Result with the job's ID, kind, ref, header and metrics; what was written
// reads back byte for byte in both layouts, padded or not.
func TestSubmitWriteReadCollect(t *testing.T) {
	e := newEngine(t, Config{Workers: 2, BlockBytes: 4096})
	m := kvgen.Tiny
	const T = 64
	for _, tc := range []struct {
		name   string
		lay    layout.Layout
		padded bool
	}{{"single", layout.Single, true}, {"blk", layout.Blocks, false}} {
		c, want := cacheOf(m, T, tc.padded)
		ref := refOf("conv", tc.name)
		wj := mustSubmit(t, e, bg, writeReq(ref, c, tc.lay, 0))
		if wj.Ack == nil || cap(wj.Ack) != 1 {
			t.Fatalf("write ack channel %v: want the engine's own, capacity 1", wj.Ack)
		}
		w := ackOK(t, wj)
		if w.Kind != KindWrite || w.Ref != ref || w.Header == nil {
			t.Fatalf("write result: kind %v ref %v header %v", w.Kind, w.Ref, w.Header)
		}
		if w.Metrics.LogicalBytes != int64(m.CacheBytes(T)) {
			t.Fatalf("write %s: LogicalBytes %d, want %d", ref, w.Metrics.LogicalBytes, m.CacheBytes(T))
		}
		st, err := os.Stat(filepath.Join(e.Root(), "conv", tc.name))
		if err != nil {
			t.Fatal(err)
		}
		if tc.lay == layout.Single && w.Metrics.WrittenBytes != st.Size() {
			t.Fatalf("single write: WrittenBytes %d, file has %d", w.Metrics.WrittenBytes, st.Size())
		}
		if tc.lay == layout.Blocks && w.Metrics.WrittenBytes != int64(m.CacheBytes(T))+st.Size() {
			t.Fatalf("blocks write: WrittenBytes %d, want blocks %d + manifest %d", w.Metrics.WrittenBytes, m.CacheBytes(T), st.Size())
		}

		dest := destOf(m, T)
		rj := mustSubmit(t, e, bg, &ReadRequest{Ref: ref, Dest: dest, Expect: w.Header})
		r := ackOK(t, rj)
		if r.Kind != KindRead || r.Ref != ref || r.Header == nil || r.ID == wj.ID {
			t.Fatalf("read result: id %d kind %v ref %v header %v", r.ID, r.Kind, r.Ref, r.Header)
		}
		if r.Metrics.ReadBytes != int64(m.CacheBytes(T)) {
			t.Fatalf("read: ReadBytes %d, want %d", r.Metrics.ReadBytes, m.CacheBytes(T))
		}
		equalSlots(t, "read "+tc.name, dest, want)
		if len(rj.Ack) != 0 || len(wj.Ack) != 0 {
			t.Fatalf("a second Result arrived")
		}
	}
	cj := mustSubmit(t, e, bg, &CollectRequest{Namespaces: []string{"conv"}})
	col := ackOK(t, cj)
	cm := col.Metrics.Collect
	if col.Kind != KindCollect || cm == nil {
		t.Fatalf("collect result: kind %v metrics %+v", col.Kind, col.Metrics)
	}
	// Tiny at 64 tokens, 4 KiB blocks: each head's [64, 16] bf16 plane (2 KiB)
	// is one block: 2 layers x K,V x 2 heads + the token ids = 9 blocks.
	if cm.Namespaces != 1 || cm.ManifestsScanned != 2 || cm.BlocksKept != 9 || cm.BlocksDeleted != 0 {
		t.Fatalf("collect: %+v", cm)
	}
}

// Many jobs may share one caller-supplied ack channel; each Result arrives
// exactly once, identified by its ID, and Job.Ack is nil.
func TestAckMultiplex(t *testing.T) {
	e := newEngine(t, Config{Workers: 3})
	m := kvgen.Tiny
	c, want := cacheOf(m, 40, true)
	acks := make(chan Result, 64)
	ids := map[uint64]string{}
	for i := range 12 {
		ref := refOf("mux", "w"+string(rune('a'+i)))
		req := writeReq(ref, c, []layout.Layout{layout.Single, layout.Blocks}[i%2], 0)
		j := mustSubmit(t, e, bg, req, AckTo(acks))
		if j.Ack != nil {
			t.Fatalf("Job.Ack is %v with a caller channel", j.Ack)
		}
		ids[j.ID] = "write " + ref.String()
	}
	for range 12 {
		r := <-acks
		if r.Err != nil {
			t.Fatalf("%s: %v", ids[r.ID], r.Err)
		}
		if _, ok := ids[r.ID]; !ok {
			t.Fatalf("Result for unknown or already acked job %d", r.ID)
		}
		delete(ids, r.ID)
	}
	// Reads of all twelve, on the same channel.
	dests := map[uint64][][]byte{}
	for i := range 12 {
		ref := refOf("mux", "w"+string(rune('a'+i)))
		d := destOf(m, 40)
		j := mustSubmit(t, e, bg, &ReadRequest{Ref: ref, Dest: d}, AckTo(acks))
		ids[j.ID], dests[j.ID] = "read "+ref.String(), d
	}
	for range 12 {
		r := <-acks
		if r.Err != nil {
			t.Fatalf("%s: %v", ids[r.ID], r.Err)
		}
		if _, ok := ids[r.ID]; !ok {
			t.Fatalf("Result for unknown or already acked job %d", r.ID)
		}
		delete(ids, r.ID)
		equalSlots(t, "multiplexed read", dests[r.ID], want)
	}
	if len(acks) != 0 {
		t.Fatalf("%d extra Results", len(acks))
	}
}

// A nil request and invalid names fail with ErrPath before anything is
// queued: no ID is used, no counter moves, nothing is created on disk.
func TestSubmitInvalid(t *testing.T) {
	e := newEngine(t, Config{Workers: 1})
	c, _ := cacheOf(kvgen.Tiny, 8, false)
	good := writeReq(refOf("ns", "x"), c, layout.Single, 0)
	with := func(ref Ref) *WriteRequest { r := *good; r.Ref = ref; return &r }
	bad := []string{"../x", "blocks", ".hidden", "", "a/b", "-x", strings.Repeat("a", 201)}
	var reqs []Request
	reqs = append(reqs, nil, (*WriteRequest)(nil), (*ReadRequest)(nil), (*CollectRequest)(nil))
	for _, n := range bad {
		reqs = append(reqs,
			with(refOf("ns", n)), with(refOf(n, "x")),
			&ReadRequest{Ref: refOf("ns", n)}, &ReadRequest{Ref: refOf(n, "x")},
			&CollectRequest{Namespaces: []string{"ok", n}})
	}
	for i, req := range reqs {
		for _, try := range []bool{false, true} {
			var err error
			if try {
				_, err = e.TrySubmit(bg, req)
			} else {
				_, err = e.Submit(bg, req)
			}
			if !errors.Is(err, ErrPath) {
				t.Fatalf("request %d (%T): err %v, want ErrPath", i, req, err)
			}
			if i >= 4 && !errors.Is(err, layout.ErrBadName) {
				t.Fatalf("request %d (%T): err %v, want it to wrap layout.ErrBadName", i, req, err)
			}
		}
	}
	// A symlinked namespace directory could lead outside the root.
	if err := os.Symlink(t.TempDir(), filepath.Join(e.Root(), "link")); err != nil {
		t.Fatal(err)
	}
	if _, err := e.Submit(bg, with(refOf("link", "x"))); !errors.Is(err, ErrPath) {
		t.Fatalf("symlinked namespace: err %v, want ErrPath", err)
	}
	if s := e.Stats(); s != (Stats{}) {
		t.Fatalf("Stats after refused submits: %+v", s)
	}
	if n := e.nextID.Load(); n != 0 {
		t.Fatalf("%d IDs used by refused submits", n)
	}
	ents, err := os.ReadDir(e.Root())
	if err != nil {
		t.Fatal(err)
	}
	if len(ents) != 1 || ents[0].Name() != "link" {
		t.Fatalf("root holds %v, want only the test's symlink", ents)
	}
	// The engine still works, and the first accepted job gets ID 1.
	j := mustSubmit(t, e, bg, good)
	if j.ID != 1 {
		t.Fatalf("first accepted job has ID %d", j.ID)
	}
	ackOK(t, j)
}

// Config values out of range are refused with ErrConfig.
func TestNewConfig(t *testing.T) {
	for _, cfg := range []Config{
		{},
		{Root: t.TempDir(), Workers: -1},
		{Root: t.TempDir(), Workers: 5000},
		{Root: t.TempDir(), Mailbox: -1},
		{Root: t.TempDir(), BlockBytes: 1000},
		{Root: t.TempDir(), ReadDepth: -1},
		{Root: t.TempDir(), ReadDepth: readio.MaxReadDepth + 1},
	} {
		if e, err := New(cfg); !errors.Is(err, ErrConfig) {
			if e != nil {
				e.Close(bg)
			}
			t.Fatalf("New(%+v): err %v, want ErrConfig", cfg, err)
		}
	}
}

// Stats counts exactly: after a known sequence every byte counter equals an
// independent computation from the cache geometry and the files' sizes.
func TestStatsExact(t *testing.T) {
	// NoDirect: BytesReadDirect is then exactly 0 (with O_DIRECT it would
	// depend on what the page cache holds: jobs' tests count it).
	e := newEngine(t, Config{Workers: 2, BlockBytes: 4096, NoDirect: true})
	m := kvgen.Tiny
	const T = 40
	logical := int64(m.CacheBytes(T)) // 2 layers x 2 x (2 heads x 40 x 16 x 2 B) + 40 x 4 B
	if logical != 10400 {
		t.Fatalf("Tiny at 40 tokens: %d logical bytes, want 10400", logical)
	}
	c, _ := cacheOf(m, T, true)
	mustDo(t, e, writeReq(refOf("st", "single"), c, layout.Single, 0))
	mustDo(t, e, writeReq(refOf("st", "b1"), c, layout.Blocks, 0))
	mustDo(t, e, writeReq(refOf("st", "b2"), c, layout.Blocks, 0)) // every block reused
	readBack(t, e, refOf("st", "single"), m, T)
	readBack(t, e, refOf("st", "b2"), m, T)
	if r := e.Do(bg, &ReadRequest{Ref: refOf("st", "missing"), Dest: destOf(m, T)}); !errors.Is(r.Err, fs.ErrNotExist) {
		t.Fatalf("read of a missing snapshot: %v, want fs.ErrNotExist", r.Err)
	}
	col := mustDo(t, e, &CollectRequest{})
	if cm := col.Metrics.Collect; cm.BlocksKept != 9 || cm.BlocksDeleted != 0 || cm.ManifestsScanned != 3 {
		t.Fatalf("collect: %+v", cm)
	}
	size := func(name string) int64 {
		st, err := os.Stat(filepath.Join(e.Root(), "st", name))
		if err != nil {
			t.Fatal(err)
		}
		return st.Size()
	}
	want := Stats{
		Completed:    7,
		Failed:       1,
		BytesWritten: size("single") + logical + size("b1") + size("b2"),
		BytesReused:  logical,
		BytesRead:    2 * logical,
	}
	if got := e.Stats(); got != want {
		t.Fatalf("Stats %+v, want %+v", got, want)
	}
	// The blocks on disk: 9 files holding exactly the logical bytes.
	var n, bytes int64
	filepath.WalkDir(filepath.Join(e.Root(), "st", "blocks"), func(p string, d fs.DirEntry, err error) error {
		if err == nil && d.Type().IsRegular() {
			info, _ := d.Info()
			n, bytes = n+1, bytes+info.Size()
		}
		return err
	})
	if n != 9 || bytes != logical {
		t.Fatalf("%d block files of %d bytes, want 9 of %d", n, bytes, logical)
	}
}

// A collect deletes exactly the blocks no manifest names any more.
func TestCollectDeletesUnreferenced(t *testing.T) {
	e := newEngine(t, Config{Workers: 2, BlockBytes: 4096})
	m := kvgen.Tiny
	c64, _ := cacheOf(m, 64, false)
	c40, _ := cacheOf(m, 40, false)
	ref := refOf("gc", "conv")
	mustDo(t, e, writeReq(ref, c64, layout.Blocks, 0))
	mustDo(t, e, writeReq(ref, c40, layout.Blocks, 0)) // every row shorter: no block shared
	dry := mustDo(t, e, &CollectRequest{Namespaces: []string{"gc"}, DryRun: true}).Metrics.Collect
	col := mustDo(t, e, &CollectRequest{Namespaces: []string{"gc"}}).Metrics.Collect
	for _, cm := range []*jobs.CollectMetrics{dry, col} {
		if cm.BlocksDeleted != 9 || cm.BlocksKept != 9 || cm.BytesFreed != int64(m.CacheBytes(64)) {
			t.Fatalf("collect: %+v", cm)
		}
	}
	if !slices.Equal(dry.Deleted, col.Deleted) {
		t.Fatalf("dry run listed %v, collect deleted %v", dry.Deleted, col.Deleted)
	}
	for _, p := range col.Deleted {
		if _, err := os.Lstat(p); !errors.Is(err, fs.ErrNotExist) {
			t.Fatalf("%s still there: %v", p, err)
		}
	}
	readBack(t, e, ref, m, 40)
}

// Do waits for the ack even when its ctx ends first; Submit with a ctx
// already done is refused with ctx's error.
func TestDoAndDoneContext(t *testing.T) {
	e := newEngine(t, Config{Workers: 1})
	c, _ := cacheOf(kvgen.Tiny, 8, false)
	ctx, cancel := context.WithCancel(bg)
	cancel()
	if _, err := e.Submit(ctx, writeReq(refOf("d", "x"), c, layout.Single, 0)); !errors.Is(err, context.Canceled) {
		t.Fatalf("Submit with a done ctx: %v", err)
	}
	if _, err := e.TrySubmit(ctx, writeReq(refOf("d", "x"), c, layout.Single, 0)); !errors.Is(err, context.Canceled) {
		t.Fatalf("TrySubmit with a done ctx: %v", err)
	}
	if r := e.Do(ctx, writeReq(refOf("d", "x"), c, layout.Single, 0)); !errors.Is(r.Err, context.Canceled) {
		t.Fatalf("Do with a done ctx: %v", r.Err)
	}
	if s := e.Stats(); s != (Stats{}) {
		t.Fatalf("Stats: %+v", s)
	}
}
