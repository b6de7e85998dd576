package tier

import (
	"bytes"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"

	"go.uber.org/goleak"

	"github.com/kvpersist/kvpersist/engine/layout"
	"github.com/kvpersist/kvpersist/engine/vfs"
)

// The tier's pieces that need no object store: the chain check of a
// fetched page and the writeback kicks of its temp file. The tier with a
// store is tested through the engine against SeaweedFS (engine/tiertest).

func TestMain(m *testing.M) { goleak.VerifyTestMain(m, goleak.IgnoreCurrent()) }

// chainPage is page pos of the chain of tokens (identity "m", 16 tokens
// per page), as a load expects it.
func chainPage(t *testing.T, tokens []uint32, pos int) *layout.Page {
	t.Helper()
	const p = 16
	keys, _, err := layout.PageChain("m", p, tokens)
	if err != nil {
		t.Fatal(err)
	}
	parent := layout.PageRoot("m", p)
	if pos > 0 {
		parent = keys[pos-1]
	}
	return &layout.Page{Key: keys[pos], Parent: parent, Identity: "m", PageTokens: p,
		Tokens: tokens[pos*p : min(len(tokens), (pos+1)*p)]}
}

// TestCheckWantNamesWhatDiffers: a verified page that is not the page the
// chain expects at its position fails with an error naming the object and
// what differs (parent, identity or page size, token ids); the same page
// passes, and a named read's want (no token ids) checks the rest only.
func TestCheckWantNamesWhatDiffers(t *testing.T) {
	tokens := make([]uint32, 32)
	for i := range tokens {
		tokens[i] = uint32(i + 1)
	}
	want := chainPage(t, tokens, 1)
	if err := checkWant("obj", want, want); err != nil {
		t.Fatalf("the expected page: %v", err)
	}
	named := *want
	named.Tokens = nil
	if err := checkWant("obj", want, &named); err != nil {
		t.Fatalf("a named read's want: %v", err)
	}
	other := func(mod func(*layout.Page)) *layout.Page {
		pg := *want
		pg.Tokens = slices.Clone(want.Tokens)
		mod(&pg)
		return &pg
	}
	for _, c := range []struct {
		name string
		pg   *layout.Page
		says string
	}{
		{"parent", other(func(pg *layout.Page) { pg.Parent = layout.PageRoot("m", 16) }), "parent"},
		{"identity", other(func(pg *layout.Page) { pg.Identity = "n" }), `identity "n"`},
		{"page size", other(func(pg *layout.Page) { pg.PageTokens = 32 }), "32 tokens per page"},
		{"tokens", other(func(pg *layout.Page) { pg.Tokens[0]++ }), "other token ids"},
	} {
		err := checkWant("obj", c.pg, want)
		if err == nil || !strings.HasPrefix(err.Error(), "obj") || !strings.Contains(err.Error(), c.says) {
			t.Errorf("%s differs: got %v, want an error on obj saying %q", c.name, err, c.says)
		}
	}
}

// kicksFile counts StartWriteback calls on a real file.
type kicksFile struct {
	vfs.File
	mu    sync.Mutex
	kicks int
}

func (f *kicksFile) StartWriteback(off, n int64) error {
	f.mu.Lock()
	f.kicks++
	f.mu.Unlock()
	return f.File.StartWriteback(off, n)
}

// TestKickWriterStartsWritebackPerStep: the writes reach the file
// unchanged; crossing a writebackBytes boundary kicks the writeback (at
// least once, at most once per boundary: kicks coalesce while one is
// pending); writes that cross none kick nothing; stop joins the kicker.
func TestKickWriterStartsWritebackPerStep(t *testing.T) {
	path := filepath.Join(t.TempDir(), "page.tmp")
	raw, err := vfs.Default.Create(path, 0o644)
	if err != nil {
		t.Fatal(err)
	}
	defer raw.Close()
	f := &kicksFile{File: raw}
	w := newKickWriter(f)
	small := bytes.Repeat([]byte{7}, 4096)
	if n, err := w.WriteAt(small, 0); n != len(small) || err != nil {
		t.Fatalf("WriteAt: %d, %v", n, err)
	}
	chunk := bytes.Repeat([]byte{9}, 1<<20)
	const steps = 3
	off := int64(len(small))
	for off < steps*writebackBytes+int64(len(small)) {
		if _, err := w.WriteAt(chunk, off); err != nil {
			t.Fatal(err)
		}
		off += int64(len(chunk))
	}
	w.stop()
	if f.kicks < 1 || f.kicks > steps {
		t.Fatalf("%d writeback kicks for %d boundaries crossed", f.kicks, steps)
	}
	rd, err := vfs.Default.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer rd.Close()
	head := make([]byte, len(small)+1)
	if _, err := rd.ReadAt(head, 0); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(head[:len(small)], small) || head[len(small)] != 9 {
		t.Fatal("the file does not hold the bytes written")
	}
	st, err := rd.Stat()
	if err != nil || st.Size() != off {
		t.Fatalf("file size %v (%v), want %d", st.Size(), err, off)
	}

	// Writes that cross no boundary kick nothing.
	quiet := &kicksFile{File: raw}
	w = newKickWriter(quiet)
	if _, err := w.WriteAt(small, 0); err != nil {
		t.Fatal(err)
	}
	w.stop()
	if quiet.kicks != 0 {
		t.Fatalf("%d kicks for %d bytes", quiet.kicks, len(small))
	}
}
