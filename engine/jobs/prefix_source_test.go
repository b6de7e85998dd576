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
	"time"

	"github.com/kvpersist/kvpersist/engine/jobs"
	"github.com/kvpersist/kvpersist/engine/layout"
	"github.com/kvpersist/kvpersist/engine/store"
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

// openPageFile opens the page file of key in nsDir read-only (the load it
// is handed to closes it).
func openPageFile(t *testing.T, nsDir string, key layout.PageKey) vfs.File {
	t.Helper()
	f, err := vfs.Default.Open(testutil.PagePath(nsDir, key))
	if err != nil {
		t.Fatal(err)
	}
	return f
}

// handSource is a jobs.PageSource that hands over the pages of pages (by
// position; the others are local) and records how it was asked. ready, when
// set, says whether page i is ready to a caller that does not wait.
type handSource struct {
	pages  map[int]jobs.SourcePage
	ready  func(i int) bool
	onWait func(i int) // called when the load waits for page i
	starts int
	ch     *jobs.PageChain
	asked  []int
	waits  []int
}

func (s *handSource) Start(_ context.Context, ch *jobs.PageChain) {
	s.starts++
	s.ch = ch
}

func (s *handSource) Page(_ context.Context, i int, wait bool) (jobs.SourcePage, bool) {
	if !wait && s.ready != nil && !s.ready(i) {
		return jobs.SourcePage{}, false
	}
	if wait {
		s.waits = append(s.waits, i)
		if s.onWait != nil {
			s.onWait(i)
		}
	}
	s.asked = append(s.asked, i)
	pg := s.pages[i]
	delete(s.pages, i)
	return pg, true
}

// closeLeft closes the files a load was never asked for.
func (s *handSource) closeLeft() {
	for _, pg := range s.pages {
		if pg.File != nil {
			pg.File.Close()
		}
	}
}

// TestPrefixLoadFromSource: a load reads the pages its PageSource hands
// over (files it never opens itself: they are removed from the disk before
// the load, and it still reports every token), asks for the pages in chain
// order after one Start with the checked chain; a handed page whose read
// fails ends the prefix there (Stop wraps the error) and leaves every
// token after it as it was; a first page whose tensors differ from the
// destinations fails the load with ErrMismatch, nothing written; a header
// the source decoded is the one checked (the file's is not read again), and
// a wrong one ends the prefix (ErrCorrupt); a request that fails its checks
// never starts the source.
func TestPrefixLoadFromSource(t *testing.T) {
	ctx := context.Background()
	ns := filepath.Join(t.TempDir(), "ns")
	c := newConv(seqTokens(700, 21), pTensors, pHeads, pDim, 768)
	keys := savePrefix(t, noSync(), ns, c, 700, 256).Keys
	cfg := inRoot(&jobs.Config{NoDirect: true}, ns)
	newReq := func(dest []jobs.TensorSpec) *jobs.LoadPrefixRequest {
		return &jobs.LoadPrefixRequest{Namespace: "ns", Identity: "tiny/bf16", Tokens: c.tokens, Dest: dest, PageTokens: 256}
	}

	t.Run("handed-pages-not-opened", func(t *testing.T) {
		src := &handSource{pages: map[int]jobs.SourcePage{}}
		for i := range 2 {
			src.pages[i] = jobs.SourcePage{File: openPageFile(t, ns, keys[i])}
		}
		// The load must not open them itself: they are gone.
		for _, k := range keys[:2] {
			if err := os.Remove(testutil.PagePath(ns, k)); err != nil {
				t.Fatal(err)
			}
		}
		bufs, dest := c.dests(768)
		lr, m, err := jobs.LoadPrefix(ctx, cfg, newReq(dest), src)
		if err != nil || lr.Tokens != 700 || lr.Stop != nil || lr.Missing != nil || !slices.Equal(lr.Keys, keys) {
			t.Fatalf("load from the source: %+v %v; want 700 tokens, every key", lr, err)
		}
		if src.starts != 1 || src.ch.NS.Name() != "ns" || src.ch.PageTokens != 256 || !slices.Equal(src.ch.Keys, keys) || !slices.Equal(src.asked, []int{0, 1, 2}) {
			t.Fatalf("source: %d starts, chain %+v, asked %v", src.starts, src.ch, src.asked)
		}
		if want := int64(700 * pTensors * pHeads * pDim * 2); m.LogicalBytes != want {
			t.Fatalf("logical bytes %d, want %d", m.LogicalBytes, want)
		}
		c.checkDest(t, bufs, 768, 700)
	})

	// Pages 0 and 1 are gone (above): save them again.
	savePrefix(t, noSync(), ns, c, 700, 256)

	t.Run("read-failure-ends-prefix", func(t *testing.T) {
		f := openPageFile(t, ns, keys[1])
		snap, err := layout.Decode(f, "page 1")
		if err != nil {
			t.Fatal(err)
		}
		src := &handSource{pages: map[int]jobs.SourcePage{1: {File: failData{File: f, off: int64(snap.DataStart)}, Head: snap}}}
		bufs, dest := c.dests(768)
		lr, _, err := jobs.LoadPrefix(ctx, cfg, newReq(dest), src)
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
		src := &handSource{pages: map[int]jobs.SourcePage{0: {File: openPageFile(t, ns, keys[0])}}}
		defer src.closeLeft()
		if _, _, err := jobs.LoadPrefix(ctx, cfg, newReq(dest), src); !errors.Is(err, jobs.ErrMismatch) {
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
		// Page 0's file fails every read before its data, yet it loads
		// from the header the source gives; page 1 given page 2's header
		// is corrupt: the prefix ends before it, nothing of it written.
		heads := make([]*layout.Snapshot, 3)
		for i := range heads {
			f := openPageFile(t, ns, keys[i])
			snap, err := layout.Decode(f, "page")
			f.Close()
			if err != nil {
				t.Fatal(err)
			}
			heads[i] = snap
		}
		src := &handSource{pages: map[int]jobs.SourcePage{
			0: {File: failHead{File: openPageFile(t, ns, keys[0]), dataStart: int64(heads[0].DataStart)}, Head: heads[0]},
			1: {File: openPageFile(t, ns, keys[1]), Head: heads[2]},
		}}
		defer src.closeLeft()
		bufs, dest := c.dests(768)
		lr, _, err := jobs.LoadPrefix(ctx, cfg, newReq(dest), src)
		if err != nil || lr.Tokens != 256 || !errors.Is(lr.Stop, jobs.ErrCorrupt) || !slices.Equal(lr.Keys, keys[:1]) {
			t.Fatalf("load: %+v %v; want 256 tokens, Stop ErrCorrupt", lr, err)
		}
		c.checkDest(t, bufs, 768, 256)
	})

	t.Run("waits-without-the-lock", func(t *testing.T) {
		// Pages 1 and 2 are not ready when page 0 is read: the load reads
		// page 0 alone, then waits for page 1 holding no lock of the
		// namespace (an exclusive lock is granted at once), then reads the
		// rest.
		src := &handSource{pages: map[int]jobs.SourcePage{}, ready: func(i int) bool { return i == 0 }}
		st := store.At(filepath.Dir(ns), store.Options{})
		n, err := st.Namespace("ns")
		if err != nil {
			t.Fatal(err)
		}
		var lockErrs []error
		src.onWait = func(int) {
			wctx, cancel := context.WithTimeout(ctx, 5*time.Second)
			defer cancel()
			unlock, err := n.Lock(wctx, true)
			if err == nil {
				unlock()
			}
			lockErrs = append(lockErrs, err)
		}
		bufs, dest := c.dests(768)
		lr, _, err := jobs.LoadPrefix(ctx, cfg, newReq(dest), src)
		if err != nil || lr.Tokens != 700 {
			t.Fatalf("load: %+v %v", lr, err)
		}
		if !slices.Equal(src.waits, []int{0, 1, 2}) || len(lockErrs) != 3 || errors.Join(lockErrs...) != nil {
			t.Fatalf("waited for pages %v; exclusive lock while waiting: %v", src.waits, lockErrs)
		}
		c.checkDest(t, bufs, 768, 700)
	})

	t.Run("bad-request-no-start", func(t *testing.T) {
		_, dest := c.dests(600) // too few tokens on axis -2
		src := &handSource{}
		if _, _, err := jobs.LoadPrefix(ctx, cfg, newReq(dest), src); !errors.Is(err, jobs.ErrDestination) || src.starts != 0 {
			t.Fatalf("load: %v, %d starts; want ErrDestination, none", err, src.starts)
		}
	})
}

// TestPrefixLoadSkipsHashOfVerifiedPages: a load hashes every page except
// those its source handed over as verified. Pages 1 and 2 of four carry a
// flipped tensor byte: page 1 handed over verified lets the load read
// through it (the flipped byte is loaded: it was not hashed) and stop at
// page 2, which was hashed; handed over unverified, or not handed over,
// page 1 stops the load as a local page would; page 0 handed verified
// changes nothing.
func TestPrefixLoadSkipsHashOfVerifiedPages(t *testing.T) {
	ns := filepath.Join(t.TempDir(), "ns")
	c := newConv(seqTokens(1024, 9), pTensors, pHeads, pDim, 1024)
	res := savePrefix(t, noSync(), ns, c, 1024, 256)
	for _, k := range res.Keys[1:3] {
		flipLastByte(t, testutil.PagePath(ns, k))
	}
	load := func(i int, verified bool) *jobs.PrefixResult {
		t.Helper()
		src := &handSource{pages: map[int]jobs.SourcePage{i: {File: openPageFile(t, ns, res.Keys[i]), Verified: verified}}}
		defer src.closeLeft()
		_, dest := c.dests(1024)
		lr, _, err := jobs.LoadPrefix(context.Background(), inRoot(noSync(), ns), &jobs.LoadPrefixRequest{
			Namespace: "ns", Identity: "tiny/bf16", Tokens: c.tokens, Dest: dest, PageTokens: 256,
		}, src)
		if err != nil {
			t.Fatal(err)
		}
		return lr
	}
	if lr := load(1, true); lr.Tokens != 512 || !errors.Is(lr.Stop, jobs.ErrCorrupt) || len(lr.Keys) != 2 {
		t.Fatalf("page 1 handed verified: loaded %d tokens, stop %v; want 512, ErrCorrupt at page 2", lr.Tokens, lr.Stop)
	}
	if lr := load(1, false); lr.Tokens != 256 || !errors.Is(lr.Stop, jobs.ErrCorrupt) {
		t.Fatalf("page 1 handed unverified: loaded %d tokens, stop %v; want 256, ErrCorrupt at page 1", lr.Tokens, lr.Stop)
	}
	if lr := load(0, true); lr.Tokens != 256 || !errors.Is(lr.Stop, jobs.ErrCorrupt) {
		t.Fatalf("page 0 handed verified: loaded %d tokens, stop %v; want 256", lr.Tokens, lr.Stop)
	}
}
