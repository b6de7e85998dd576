package demo

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"io/fs"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"github.com/kvpersist/kvpersist/engine"
	"github.com/kvpersist/kvpersist/engine/layout"
	"github.com/kvpersist/kvpersist/internal/kvgen"
	"github.com/kvpersist/kvpersist/internal/testutil"
)

// The small scenario of these tests: tiny model (2 layers, 2 KV heads,
// head_dim 16, bf16: 4 tensors, 64 bytes per token per tensor), 3
// conversations sharing 40 system tokens, 3 turns of 20 tokens, 16 tokens
// per page.
const (
	tConvs, tSystem, tTurns, tTurnTokens, tP = 3, 40, 3, 20, 16
	tIdentity                                = "kvpersist-demo/tiny/bfloat16"
	tTensors, tTensorBytesPerToken           = 4, 2 * 16 * 2
)

func small(root string) Options {
	return Options{
		Root: root, Model: "tiny", Conversations: tConvs, SystemTokens: tSystem, Turns: tTurns,
		MinTurnTokens: tTurnTokens, MaxTurnTokens: tTurnTokens, PageTokens: tP, NoSync: true, ExactBytes: true,
	}
}

// tokenIDs is the scenario's token ids of conversation c, written out
// again from the package doc: position p holds kvgen token index p in the
// system prompt, p + c<<24 after it.
func tokenIDs(c, n int) []uint32 {
	out := make([]uint32, n)
	for p := range out {
		idx := p
		if p >= tSystem {
			idx = p + c<<24
		}
		out[p] = uint32(kvgen.TokenID(idx))
	}
	return out
}

// recorder is the report's writer: it keeps every write and, at each, how
// many page files the namespace held.
type recorder struct {
	t      *testing.T
	nsDir  string
	buf    bytes.Buffer
	writes []write
}

type write struct {
	text  string
	pages int
}

func (r *recorder) Write(p []byte) (int, error) {
	n := 0
	filepath.WalkDir(testutil.PagesDir(r.nsDir), func(_ string, d fs.DirEntry, err error) error {
		if err == nil && d.Type().IsRegular() {
			n++
		}
		return nil
	})
	r.writes = append(r.writes, write{string(p), n})
	return r.buf.Write(p)
}

// pageFileSize is a page file's size in bytes computed from its tokens:
// dataStart (read from the file's prefix, bytes 14..18, a multiple of
// 16,384) then the 4 tensors of n tokens, each starting at a multiple of
// 4,096, the file ending at the last one.
func pageFileSize(t *testing.T, path string, n int) int64 {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	var pre [18]byte
	if _, err := f.ReadAt(pre[:], 0); err != nil {
		t.Fatal(err)
	}
	dataStart := int64(binary.LittleEndian.Uint32(pre[14:18]))
	if dataStart%16384 != 0 || dataStart < 26+int64(binary.LittleEndian.Uint32(pre[10:14])) {
		t.Fatalf("%s: dataStart %d", path, dataStart)
	}
	tb := int64(n * tTensorBytesPerToken)
	aligned := (tb + 4095) / 4096 * 4096
	return dataStart + (tTensors-1)*aligned + tb
}

type row struct{ conv, turn, tokens, newTokens, loaded, written, reused, shared int64 }

func parseRows(t *testing.T, out string) (rows []row, resumes [][3]int64) {
	t.Helper()
	section := 0
	for _, line := range strings.Split(out, "\n") {
		switch {
		case strings.HasPrefix(line, header):
			section = 1
			continue
		case strings.HasPrefix(line, resumeHeader):
			section = 2
			continue
		case strings.HasPrefix(line, "saved:"), strings.HasPrefix(line, "store:"):
			section = 0
		}
		f := strings.Fields(line)
		num := func(i int) int64 {
			v, err := strconv.ParseInt(f[i], 10, 64)
			if err != nil {
				t.Fatalf("row %q field %d: %v", line, i, err)
			}
			return v
		}
		switch {
		case section == 1 && len(f) == 10:
			rows = append(rows, row{num(0), num(1), num(2), num(3), num(4), num(5), num(6), num(7)})
		case section == 2 && len(f) == 4:
			resumes = append(resumes, [3]int64{num(0), num(1), num(2)})
		case section != 0:
			t.Fatalf("unexpected line %q", line)
		}
	}
	return rows, resumes
}

// TestRunRows: every row's tokens, new tokens, loaded tokens and bytes
// written, reused and shared equal an independent computation from the
// page chains and the page files' sizes (checked against the format);
// the shared system prompt is written once; each row is written when its
// turn completes, before the next turn saves.
func TestRunRows(t *testing.T) {
	root := t.TempDir()
	nsDir := filepath.Join(root, DefaultNamespace)
	rec := &recorder{t: t, nsDir: nsDir}
	if err := Run(context.Background(), small(root), rec); err != nil {
		t.Fatalf("%v\n%s", err, rec.buf.String())
	}
	out := rec.buf.String()
	rows, resumes := parseRows(t, out)
	if len(rows) != tConvs*tTurns || len(resumes) != tConvs {
		t.Fatalf("%d rows, %d resumes:\n%s", len(rows), len(resumes), out)
	}
	size := map[layout.PageKey]int64{}
	first := map[layout.PageKey]int{} // the conversation that first saved the page
	var rowPages []int                // page files stored after each row's turn
	i := 0
	for k := 1; k <= tTurns; k++ {
		for c := 1; c <= tConvs; c++ {
			tokens := tSystem + k*tTurnTokens
			prev := tokens - tTurnTokens
			loaded := prev
			if k == 1 {
				prev, loaded = 0, tSystem/tP*tP
				if c == 1 {
					loaded = 0
				}
			}
			keys, _, err := layout.PageChain(tIdentity, tP, tokenIDs(c, tokens))
			if err != nil {
				t.Fatal(err)
			}
			var written, reused, shared int64
			for j, key := range keys {
				path := testutil.PagePath(nsDir, key)
				fi, err := os.Stat(path)
				if err != nil {
					t.Fatalf("conversation %d turn %d page %d: %v", c, k, j, err)
				}
				if want := pageFileSize(t, path, min(tP, tokens-j*tP)); fi.Size() != want {
					t.Fatalf("%s: %d bytes, the format says %d", path, fi.Size(), want)
				}
				if f, ok := first[key]; ok {
					reused += fi.Size()
					if f != c {
						shared += fi.Size()
					}
					continue
				}
				first[key], size[key] = c, fi.Size()
				written += fi.Size()
			}
			want := row{int64(c), int64(k), int64(tokens), int64(tokens - prev), int64(loaded), written, reused, shared}
			if rows[i] != want {
				t.Errorf("row %d: %+v, want %+v", i, rows[i], want)
			}
			// The system prompt's full pages are stored once, by
			// conversation 1; every later conversation reuses exactly them.
			keys0, _, _ := layout.PageChain(tIdentity, tP, tokenIDs(1, tSystem))
			var sys int64
			for _, key := range keys0[:tSystem/tP] {
				sys += size[key]
			}
			if c > 1 && (shared != sys || sys == 0) || c == 1 && shared != 0 {
				t.Errorf("conversation %d turn %d: shared %d bytes, the system prompt's %d full pages are %d", c, k, shared, tSystem/tP, sys)
			}
			rowPages = append(rowPages, len(first))
			i++
		}
	}
	// Incremental: when row i was written, exactly the pages of the turns
	// up to i were stored.
	i = 0
	for _, w := range rec.writes {
		for _, line := range strings.Split(w.text, "\n") {
			if f := strings.Fields(line); len(f) == 10 && i < len(rows) && f[0] == strconv.FormatInt(rows[i].conv, 10) && f[1] == strconv.FormatInt(rows[i].turn, 10) {
				if w.pages != rowPages[i] {
					t.Errorf("row %d was written with %d page files stored, its turn leaves %d (the next turn's pages were there already?)", i, w.pages, rowPages[i])
				}
				i++
			}
		}
	}
	if i != len(rows) {
		t.Fatalf("found %d of %d rows in the writes", i, len(rows))
	}
	if rowPages[0] == rowPages[len(rowPages)-1] {
		t.Fatal("every turn leaves as many pages as the last: the incremental check cannot fail")
	}
	for c, r := range resumes {
		final := int64(tSystem + tTurns*tTurnTokens)
		if r != [3]int64{int64(c + 1), final, final} {
			t.Errorf("resume %d: %v, want conversation %d with %d tokens loaded", c, r, c+1, final)
		}
	}
	if !strings.Contains(out, "every loaded byte matched") {
		t.Fatalf("no success line:\n%s", out)
	}
}

// TestRunStoreHoldsEveryByte: after a run, each conversation loads from
// the kept store (through a fresh engine, into contiguous buffers) with
// content equal, element by element, to kvgen.Value at the scenario's
// content indices.
func TestRunStoreHoldsEveryByte(t *testing.T) {
	root := t.TempDir()
	if err := Run(context.Background(), small(root), &bytes.Buffer{}); err != nil {
		t.Fatal(err)
	}
	e, err := engine.New(engine.Config{Root: root, NoSync: true})
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close(context.Background())
	m := kvgen.Tiny
	n := tSystem + tTurns*tTurnTokens
	for c := 1; c <= tConvs; c++ {
		ids := tokenIDs(c, n)
		if got, err := e.Lookup(DefaultNamespace, tIdentity, tP, ids); err != nil || got != n {
			t.Fatalf("conversation %d: lookup %d, %v; want %d", c, got, err, n)
		}
		shape := []int{1, m.KVHeads, n, m.HeadDim}
		bufs := make([][]byte, tTensors)
		dest := make([]engine.TensorSpec, tTensors)
		for i := range bufs {
			bufs[i] = make([]byte, m.TensorBytes(n))
			dest[i] = engine.TensorSpec{DType: "bfloat16", View: engine.View{Base: bufs[i], Shape: shape, Strides: engine.RowMajor(shape), ItemSize: 2}}
		}
		res := e.Do(context.Background(), &engine.LoadPrefixRequest{Namespace: DefaultNamespace, Identity: tIdentity, Tokens: ids, Dest: dest, PageTokens: tP})
		if res.Err != nil || res.Prefix.Tokens != n {
			t.Fatalf("conversation %d: load %+v, %v", c, res.Prefix, res.Err)
		}
		for i, b := range bufs {
			for h := range m.KVHeads {
				for p := range n {
					idx := p
					if p >= tSystem {
						idx = p + c<<24
					}
					for d := range m.HeadDim {
						off := ((h*n+p)*m.HeadDim + d) * 2
						if got, want := binary.LittleEndian.Uint16(b[off:]), kvgen.Value(i/2, i%2, h, idx, d); got != want {
							t.Fatalf("conversation %d tensor %d head %d token %d d %d: %#x, want %#x", c, i, h, p, d, got, want)
						}
					}
				}
			}
		}
	}
}

// TestRunDetectsMismatch: the demo's own comparison fails the run when a
// loaded byte differs, and when a byte past the loaded tokens was written.
func TestRunDetectsMismatch(t *testing.T) {
	m := kvgen.Tiny
	for name, flip := range map[string]func(arena []byte, loads int){
		"loaded token": func(arena []byte, loads int) {
			if loads == tConvs+1 { // conversation 1, turn 2: 60 tokens loaded
				arena[5*m.HeadDim*2+3] ^= 1 // tensor 0, head 0, token 5
			}
		},
		"padding": func(arena []byte, loads int) {
			if loads == tConvs+1 {
				capTok := kvgen.Capacity(tSystem + 2*tTurnTokens)
				arena[(capTok+70)*m.HeadDim*2] ^= 1 // tensor 0, head 1, token 70 (60 loaded)
			}
		},
	} {
		t.Run(name, func(t *testing.T) {
			loads := 0
			testHookAfterLoad = func(arena []byte) { loads++; flip(arena, loads) }
			defer func() { testHookAfterLoad = nil }()
			var out bytes.Buffer
			err := Run(context.Background(), small(t.TempDir()), &out)
			if !errors.Is(err, ErrMismatch) || !strings.Contains(err.Error(), "conversation 1") {
				t.Fatalf("err %v, want ErrMismatch naming conversation 1\n%s", err, out.String())
			}
			if strings.Contains(out.String(), "every loaded byte matched") {
				t.Fatal("success reported")
			}
		})
	}
}

// TestRunRefusesExistingNamespace: a namespace that exists in the given
// root is refused before anything is written, unless ReuseNamespace; a
// reused one then counts its stored pages as reused.
func TestRunRefusesExistingNamespace(t *testing.T) {
	root := t.TempDir()
	ns := filepath.Join(root, "mine")
	if err := os.Mkdir(ns, 0o755); err != nil {
		t.Fatal(err)
	}
	o := small(root)
	o.Namespace = "mine"
	var out bytes.Buffer
	err := Run(context.Background(), o, &out)
	if !errors.Is(err, ErrNamespaceExists) || !strings.Contains(err.Error(), "mine") {
		t.Fatalf("err %v, want ErrNamespaceExists naming the namespace", err)
	}
	if ents, _ := os.ReadDir(ns); len(ents) != 0 || out.Len() != 0 {
		t.Fatalf("refused run wrote %d entries and %q", len(ents), out.String())
	}
	o.ReuseNamespace = true
	if err := Run(context.Background(), o, &out); err != nil {
		t.Fatal(err)
	}
	out.Reset()
	if err := Run(context.Background(), o, &out); err != nil { // every page stored already
		t.Fatal(err)
	}
	rows, _ := parseRows(t, out.String())
	for _, r := range rows {
		if r.written != 0 || r.reused == 0 {
			t.Fatalf("second run over the same namespace: %+v, want nothing written", r)
		}
	}
}

// TestRunRefusesMemory: with less MemAvailable than NeedBytes the run is
// refused, naming both figures, before a temporary root is made.
func TestRunRefusesMemory(t *testing.T) {
	tmp := t.TempDir()
	t.Setenv("TMPDIR", tmp)
	o := small("")
	need, err := NeedBytes(o)
	if err != nil {
		t.Fatal(err)
	}
	if want := int64(kvgen.Capacity(tSystem+tTurns*tTurnTokens) * tTensors * tTensorBytesPerToken); need < want {
		t.Fatalf("NeedBytes %d, less than the buffer's %d", need, want)
	}
	old := memAvailable
	defer func() { memAvailable = old }()
	memAvailable = func() (int64, bool) { return need - 1, true }
	err = Run(context.Background(), o, &bytes.Buffer{})
	if !errors.Is(err, ErrMemory) || !strings.Contains(err.Error(), strconv.FormatInt(need, 10)+" bytes") {
		t.Fatalf("err %v, want ErrMemory naming %d bytes", err, need)
	}
	if ents, _ := os.ReadDir(tmp); len(ents) != 0 {
		t.Fatalf("refused run left %d entries in TMPDIR", len(ents))
	}
	memAvailable = func() (int64, bool) { return need, true }
	if err := Run(context.Background(), o, &bytes.Buffer{}); err != nil {
		t.Fatal(err)
	}
}

// TestRunTempRoot: without Root the run uses a temporary root and removes
// it at the end (kept with Keep); progress on a writer that is not a
// terminal draws nothing.
func TestRunTempRoot(t *testing.T) {
	tmp := t.TempDir()
	t.Setenv("TMPDIR", tmp)
	o := small("")
	var progress bytes.Buffer
	o.Progress = &progress
	f, err := os.Create(filepath.Join(t.TempDir(), "progress"))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	for _, keep := range []bool{false, true} {
		o.Keep = keep
		var out bytes.Buffer
		if err := Run(context.Background(), o, &out); err != nil {
			t.Fatal(err)
		}
		ents, _ := os.ReadDir(tmp)
		if keep != (len(ents) == 1) || !keep && len(ents) != 0 {
			t.Fatalf("keep %v: %d entries left in TMPDIR", keep, len(ents))
		}
		if strings.Contains(out.String(), "is kept in") != keep {
			t.Fatalf("keep %v: output says otherwise:\n%s", keep, out.String())
		}
		o.Progress = f // a regular file: not a terminal
	}
	if st, _ := f.Stat(); progress.Len() != 0 || st.Size() != 0 {
		t.Fatalf("progress drawn on a non-terminal: %q, %d bytes", progress.String(), st.Size())
	}
}

// TestOptionsErrors: out-of-range options are refused with
// ErrInvalidOptions naming the field.
func TestOptionsErrors(t *testing.T) {
	for _, tc := range []struct {
		mod  func(*Options)
		want string
	}{
		{func(o *Options) { o.Conversations = MaxConversations + 1 }, "conversations"},
		{func(o *Options) { o.Turns = -1 }, "turns"},
		{func(o *Options) { o.MinTurnTokens, o.MaxTurnTokens = 10, 5 }, "turn tokens"},
		{func(o *Options) { o.PageTokens = 17 }, "page tokens"},
		{func(o *Options) { o.Model = "gpt-9" }, "gpt-9"},
		{func(o *Options) { o.Namespace = "../x" }, "namespace"},
		{func(o *Options) { o.SystemTokens = -1 }, "system tokens"},
		{func(o *Options) { o.MaxTurnTokens = MaxConversationTokens }, "reaches"},
	} {
		o := small(t.TempDir())
		tc.mod(&o)
		err := Run(context.Background(), o, &bytes.Buffer{})
		if !errors.Is(err, ErrInvalidOptions) || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%+v: %v, want ErrInvalidOptions naming %q", o, err, tc.want)
		}
	}
}

// TestRunCancel: a run whose context ends returns ctx's error, reports no
// success and removes its temporary root.
func TestRunCancel(t *testing.T) {
	tmp := t.TempDir()
	t.Setenv("TMPDIR", tmp)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	loads := 0
	testHookAfterLoad = func([]byte) {
		if loads++; loads == 2 {
			cancel()
		}
	}
	defer func() { testHookAfterLoad = nil }()
	var out bytes.Buffer
	err := Run(ctx, small(""), &out)
	if !errors.Is(err, context.Canceled) || strings.Contains(out.String(), "every loaded byte matched") {
		t.Fatalf("err %v, want context.Canceled\n%s", err, out.String())
	}
	if ents, _ := os.ReadDir(tmp); len(ents) != 0 {
		t.Fatalf("cancelled run left %d entries in TMPDIR", len(ents))
	}
}
