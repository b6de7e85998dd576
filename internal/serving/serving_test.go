package serving

import (
	"bytes"
	"context"
	"errors"
	"io/fs"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"testing"

	"github.com/kvpersist/kvpersist/engine"
	"github.com/kvpersist/kvpersist/engine/layout"
	"github.com/kvpersist/kvpersist/engine/vfs"
	"github.com/kvpersist/kvpersist/internal/kvgen"
	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m, goleak.IgnoreCurrent()) }

// TestPageContentEqualsKvgen: the content PageContent recomputes from a
// run of consecutive ids equals the bytes kvgen's own cache holds at those
// token indices (gathered from its views), for every tensor; and a
// conversation's ids are its system prompt's, then its own consecutive
// ones.
func TestPageContentEqualsKvgen(t *testing.T) {
	m := kvgen.Tiny
	const n = 300
	c := kvgen.NewCache(m, n, true, nil)
	views := c.ViewsAt(n)
	ids := make([]uint32, n-40)
	for i := range ids {
		ids[i] = uint32(40 + i)
	}
	for i := range 2 * m.Layers {
		var shp [4]int
		sub, err := views[i].SliceAxis(2, 40, n, shp[:])
		if err != nil {
			t.Fatal(err)
		}
		want, _, err := sub.Gather(make([]byte, sub.Bytes()))
		if err != nil {
			t.Fatal(err)
		}
		if got := PageContent(m, ids, i); !bytes.Equal(got, want) {
			t.Fatalf("tensor %d: PageContent differs from kvgen's cache", i)
		}
	}
	got := make([]uint32, 7)
	TokenIDs(got, 3, 1, 4)
	want := []uint32{4, 5, 6, 7, 3<<PositionBits | 4, 3<<PositionBits | 5, 3<<PositionBits | 6}
	if !slices.Equal(got, want) {
		t.Fatalf("TokenIDs: %v, want %v", got, want)
	}
}

// TestLoopUnbounded: two loops side by side on one unbounded engine serve
// conversations sharing two system prompts, every loaded byte compared;
// afterwards the page files on disk are exactly what the saves wrote (count
// and bytes), every one holds the content of its token ids, the system
// prompts' pages were reused, and the lookups found tokens.
func TestLoopUnbounded(t *testing.T) {
	root := t.TempDir()
	e, err := engine.New(engine.Config{Root: root, NoSync: true, Workers: 2, Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		t.Fatal(err)
	}
	var loops []*Loop
	for s := range 2 {
		l, err := New(Options{Stream: s, Streams: 2, Seed: 7, Verify: true, Active: 4})
		if err != nil {
			t.Fatal(err)
		}
		loops = append(loops, l)
	}
	st, err := Run(context.Background(), e, loops, 60)
	if cerr := e.Close(context.Background()); cerr != nil {
		t.Fatal(cerr)
	}
	if err != nil {
		t.Fatal(err)
	}
	if st.Turns != 120 || st.Lookups != 120 || st.Saves != 120 || st.SavesRefused != 0 {
		t.Fatalf("stats %+v: want 120 turns, lookups and saves", st)
	}
	if st.HitTokens == 0 || st.Loads == 0 || st.LoadedTokens != st.HitTokens || st.PagesReused == 0 {
		t.Fatalf("stats %+v: want hits, loads of every token found (nothing is evicted) and reused pages", st)
	}
	files, size := 0, int64(0)
	m := kvgen.Tiny
	err = filepath.WalkDir(filepath.Join(root, DefaultNamespace, layout.PagesDirName), func(p string, d fs.DirEntry, err error) error {
		if err != nil || !d.Type().IsRegular() {
			return err
		}
		files++
		fi, err := d.Info()
		if err != nil {
			return err
		}
		size += fi.Size()
		snap, err := layout.Load(vfs.Default, p)
		if err != nil {
			return err
		}
		raw, err := os.ReadFile(p)
		if err != nil {
			return err
		}
		for i, tt := range snap.Header.Slots() {
			got := raw[int64(snap.DataStart)+tt.Off:][:tt.Bytes]
			if !bytes.Equal(got, PageContent(m, snap.Page.Tokens, i)) {
				t.Errorf("%s tensor %d: not the content of its token ids", p, i)
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if int64(files) != st.PagesWritten || size != st.BytesWritten {
		t.Fatalf("%d page files of %d bytes on disk; the saves wrote %d pages, %d bytes", files, size, st.PagesWritten, st.BytesWritten)
	}
}

// TestLoopDetectsMismatch: with Verify, a loaded byte that is not the
// content of its token id is ErrMismatch.
func TestLoopDetectsMismatch(t *testing.T) {
	l, err := New(Options{Verify: true})
	if err != nil {
		t.Fatal(err)
	}
	ids := make([]uint32, 40)
	TokenIDs(ids, 1, 0, l.o.SystemTokens)
	capTok := kvgen.Capacity(len(ids))
	l.compute(ids, capTok, 0)
	if err := l.compare(ids, capTok); err != nil {
		t.Fatalf("computed content: %v", err)
	}
	tb := l.o.Model.TensorBytes(capTok)
	l.arena[3*tb+5] ^= 1 // tensor 3 (layer 1 V), head 0, token 0
	if err := l.compare(ids, capTok); !errors.Is(err, ErrMismatch) {
		t.Fatalf("flipped bit: %v, want ErrMismatch", err)
	}
}

// TestOptionsErrors: out-of-range options are ErrOptions.
func TestOptionsErrors(t *testing.T) {
	for _, o := range []Options{
		{PageTokens: 17},
		{SystemPrompts: 100, SystemTokens: 100},
		{MinTurnTokens: 9, MaxTurnTokens: 8},
		{Stream: 2, Streams: 2},
		{Namespace: ".x"},
		{SystemTokens: 4000, MaxTurnTokens: 200},
	} {
		if _, err := New(o); !errors.Is(err, ErrOptions) {
			t.Errorf("%+v: %v, want ErrOptions", o, err)
		}
	}
}
