package jobs_test

import (
	"context"
	"encoding/binary"
	"errors"
	"os"
	"path/filepath"
	"slices"
	"syscall"
	"testing"

	"github.com/kvpersist/kvpersist/engine/jobs"
	"github.com/kvpersist/kvpersist/engine/layout"
	"github.com/kvpersist/kvpersist/engine/vfs"
	"github.com/kvpersist/kvpersist/internal/testutil"
)

// failData is a page file whose reads at or past off fail with EIO (the
// header reads, the tensors' fail).
type failData struct {
	vfs.File
	off int64
}

func (f failData) ReadAt(p []byte, off int64) (int, error) {
	if off+int64(len(p)) > f.off {
		return 0, syscall.EIO
	}
	return f.File.ReadAt(p, off)
}

// failHead is a page file whose reads before dataStart (its prefix and
// header) fail with EIO; its tensors read as they are.
type failHead struct {
	vfs.File
	dataStart int64
}

func (f failHead) ReadAt(p []byte, off int64) (int, error) {
	if off < f.dataStart {
		return 0, syscall.EIO
	}
	return f.File.ReadAt(p, off)
}

// openPageFile opens the page file of key in nsDir read-only, closed at
// the test's end.
func openPageFile(t *testing.T, nsDir string, key layout.PageKey) vfs.File {
	t.Helper()
	f, err := vfs.Default.Open(testutil.PagePath(nsDir, key))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { f.Close() })
	return f
}

// TestPrefixScatterThenLoad: pages scattered ahead of a load
// (PrefixScatter.Page, in chain order) are in the destinations, counted as
// loaded and never opened again by LoadPrefixScattered (their files are
// removed before it runs, and it still reports every token); a page given
// out of order is refused without a write; a scatter whose read of page 1
// fails ends the load's prefix at page 1 (Stop wraps the error) and leaves
// every token from page 2 on as it was; a first page whose tensors differ
// from the destinations is not written, and the load fails with
// ErrMismatch, nothing written.
func TestPrefixScatterThenLoad(t *testing.T) {
	ctx := context.Background()
	ns := filepath.Join(t.TempDir(), "ns")
	c := newConv(seqTokens(700, 21), pTensors, pHeads, pDim, 768)
	res := savePrefix(t, noSync(), ns, c, 700, 256)
	keys := res.Keys
	cfg := inRoot(&jobs.Config{NoDirect: true}, ns)
	newReq := func(dest []jobs.TensorSpec) *jobs.LoadPrefixRequest {
		return &jobs.LoadPrefixRequest{Namespace: "ns", Identity: "tiny/bf16", Tokens: c.tokens, Dest: dest, PageTokens: 256}
	}

	t.Run("scattered-pages-not-opened", func(t *testing.T) {
		bufs, dest := c.dests(768)
		req := newReq(dest)
		sc, err := jobs.NewPrefixScatter(cfg, req, keys)
		if err != nil {
			t.Fatal(err)
		}
		if sc.Page(ctx, 1, "page 1", openPageFile(t, ns, keys[1]), nil) {
			t.Fatal("page 1 scattered before page 0")
		}
		c.checkDest(t, bufs, 768, 0)
		for i := range 2 {
			if !sc.Page(ctx, i, "page", openPageFile(t, ns, keys[i]), nil) {
				t.Fatalf("page %d not scattered", i)
			}
		}
		if sc.Pages() != 2 {
			t.Fatalf("Pages() = %d, want 2", sc.Pages())
		}
		c.checkDest(t, bufs, 768, 512)
		// The load must not open them again: they are gone.
		for _, k := range keys[:2] {
			if err := os.Remove(testutil.PagePath(ns, k)); err != nil {
				t.Fatal(err)
			}
		}
		lr, m, err := jobs.LoadPrefixScattered(ctx, cfg, req, keys, nil, sc)
		if err != nil || lr.Tokens != 700 || lr.Stop != nil || lr.Missing != nil || !slices.Equal(lr.Keys, keys) {
			t.Fatalf("load after the scatter: %+v %v; want 700 tokens, every key", lr, err)
		}
		if want := int64(700 * pTensors * pHeads * pDim * 2); m.LogicalBytes != want {
			t.Fatalf("logical bytes %d, want %d", m.LogicalBytes, want)
		}
		c.checkDest(t, bufs, 768, 700)
	})

	// Pages 0 and 1 are gone (above): save them again.
	savePrefix(t, noSync(), ns, c, 700, 256)

	t.Run("read-failure-ends-prefix", func(t *testing.T) {
		bufs, dest := c.dests(768)
		req := newReq(dest)
		sc, err := jobs.NewPrefixScatter(cfg, req, keys)
		if err != nil {
			t.Fatal(err)
		}
		if !sc.Page(ctx, 0, "page 0", openPageFile(t, ns, keys[0]), nil) {
			t.Fatal("page 0 not scattered")
		}
		f := openPageFile(t, ns, keys[1])
		snap, err := layout.Decode(f, "page 1")
		if err != nil {
			t.Fatal(err)
		}
		if sc.Page(ctx, 1, "page 1", failData{File: f, off: int64(snap.DataStart)}, nil) {
			t.Fatal("page 1 scattered although its reads fail")
		}
		if sc.Page(ctx, 2, "page 2", openPageFile(t, ns, keys[2]), nil) {
			t.Fatal("page 2 scattered after a failed page")
		}
		lr, _, err := jobs.LoadPrefixScattered(ctx, cfg, req, keys, nil, sc)
		if err != nil || lr.Tokens != 256 || !errors.Is(lr.Stop, syscall.EIO) || !slices.Equal(lr.Keys, keys[:1]) {
			t.Fatalf("load: %+v %v; want 256 tokens, Stop EIO", lr, err)
		}
		// Tokens of page 1 may be partly written (Stop); from page 2 on
		// every byte is as before.
		for ti, b := range bufs {
			for h := range pHeads {
				for tok := range 768 {
					got := binary.LittleEndian.Uint16(b[((h*768+tok)*pDim)*2:])
					switch {
					case tok < 256 && got != c.value(ti, h, tok, 0):
						t.Fatalf("tensor %d token %d: not the stored KV", ti, tok)
					case tok >= 512 && got != 0x5a5a:
						t.Fatalf("tensor %d head %d token %d written past the failed page", ti, h, tok)
					}
				}
			}
		}
	})

	t.Run("mismatch-writes-nothing", func(t *testing.T) {
		bufs := make([][]byte, pTensors)
		dest := make([]jobs.TensorSpec, pTensors)
		half := pDim / 2
		for i := range bufs {
			bufs[i] = make([]byte, pHeads*768*half*2)
			for j := range bufs[i] {
				bufs[i][j] = 0x5a
			}
			dest[i] = padded(bufs[i:i+1], pHeads, 768, half, 768)[0]
		}
		req := newReq(dest)
		sc, err := jobs.NewPrefixScatter(cfg, req, keys)
		if err != nil {
			t.Fatal(err)
		}
		if sc.Page(ctx, 0, "page 0", openPageFile(t, ns, keys[0]), nil) {
			t.Fatal("a page unlike the destinations was scattered")
		}
		if _, _, err := jobs.LoadPrefixScattered(ctx, cfg, req, keys, nil, sc); !errors.Is(err, jobs.ErrMismatch) {
			t.Fatalf("load: %v; want ErrMismatch", err)
		}
		for _, b := range bufs {
			for _, x := range b {
				if x != 0x5a {
					t.Fatal("a destination was written")
				}
			}
		}
	})

	t.Run("given-header", func(t *testing.T) {
		// A header given to Page is the one checked, and f's header is not
		// read again: page 0's file fails every read before its data, yet
		// it scatters from its decoded header; page 1 given page 2's
		// header is refused, nothing of it written.
		heads := make([]*layout.Snapshot, 3)
		for i := range heads {
			snap, err := layout.Decode(openPageFile(t, ns, keys[i]), "page")
			if err != nil {
				t.Fatal(err)
			}
			heads[i] = snap
		}
		bufs, dest := c.dests(768)
		req := newReq(dest)
		sc, err := jobs.NewPrefixScatter(cfg, req, keys)
		if err != nil {
			t.Fatal(err)
		}
		f0 := failHead{File: openPageFile(t, ns, keys[0]), dataStart: int64(heads[0].DataStart)}
		if !sc.Page(ctx, 0, "page 0", f0, heads[0]) {
			t.Fatal("page 0 not scattered from its given header")
		}
		if sc.Page(ctx, 1, "page 1", openPageFile(t, ns, keys[1]), heads[2]) {
			t.Fatal("page 1 scattered with page 2's header")
		}
		c.checkDest(t, bufs, 768, 256)
		lr, _, err := jobs.LoadPrefixScattered(ctx, cfg, req, keys, nil, sc)
		if err != nil || lr.Tokens != 700 || lr.Stop != nil || !slices.Equal(lr.Keys, keys) {
			t.Fatalf("load after the scatter: %+v %v; want 700 tokens, every key", lr, err)
		}
		c.checkDest(t, bufs, 768, 700)
	})

	t.Run("bad-request-no-scatter", func(t *testing.T) {
		_, dest := c.dests(600) // too few tokens on axis -2
		if _, err := jobs.NewPrefixScatter(cfg, newReq(dest), keys); !errors.Is(err, jobs.ErrDestination) {
			t.Fatalf("NewPrefixScatter: %v; want ErrDestination", err)
		}
		_, dest = c.dests(768)
		sc, err := jobs.NewPrefixScatter(cfg, newReq(dest), keys)
		if err != nil {
			t.Fatal(err)
		}
		if _, _, err := jobs.LoadPrefixScattered(ctx, cfg, newReq(dest), keys, nil, sc); !errors.Is(err, jobs.ErrInvalidRequest) {
			t.Fatalf("a scatter of another request: %v; want ErrInvalidRequest", err)
		}
	})
}
