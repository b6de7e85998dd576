package jobs_test

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"os"
	"path/filepath"
	"sync"
	"syscall"
	"testing"

	"github.com/kvpersist/kvpersist/engine/gather"
	"github.com/kvpersist/kvpersist/engine/jobs"
	"github.com/kvpersist/kvpersist/engine/layout"
	"github.com/kvpersist/kvpersist/engine/vfs"
	"github.com/kvpersist/kvpersist/internal/testutil"
	"github.com/zeebo/xxh3"
)

// conv is a conversation's KV cache whose content, like real KV, depends on
// every token up to each position: element (tensor, head, token t, d) is a
// function of a running hash of tokens[0..t]. Buffers are capacity-padded
// [1, heads, capT, dim] bf16, padding filled with 0xee.
type conv struct {
	tokens                  []uint32
	tensors, heads, dim, ct int
	bufs                    [][]byte
	prefix                  []uint64 // running hash per token
}

func mix(x uint64) uint64 {
	x += 0x9e3779b97f4a7c15
	x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9
	x = (x ^ (x >> 27)) * 0x94d049bb133111eb
	return x ^ (x >> 31)
}

func newConv(tokens []uint32, tensors, heads, dim, capT int) *conv {
	c := &conv{tokens: tokens, tensors: tensors, heads: heads, dim: dim, ct: capT}
	c.prefix = make([]uint64, len(tokens))
	var h uint64
	for i, t := range tokens {
		h = mix(h ^ uint64(t))
		c.prefix[i] = h
	}
	for ti := range tensors {
		b := bytes.Repeat([]byte{0xee}, heads*capT*dim*2)
		for hd := range heads {
			for t := range len(tokens) {
				for d := range dim {
					binary.LittleEndian.PutUint16(b[((hd*capT+t)*dim+d)*2:], c.value(ti, hd, t, d))
				}
			}
		}
		c.bufs = append(c.bufs, b)
	}
	return c
}

func (c *conv) value(ti, h, t, d int) uint16 {
	return uint16(mix(c.prefix[t] ^ uint64(ti)<<40 ^ uint64(h)<<20 ^ uint64(d)))
}

// padded returns one view per tensor over bufs of capacity capT tokens,
// viewing n tokens.
func padded(bufs [][]byte, heads, capT, dim, n int) []jobs.TensorSpec {
	out := make([]jobs.TensorSpec, len(bufs))
	for i, b := range bufs {
		out[i] = jobs.TensorSpec{DType: "bfloat16", View: gather.View{
			Base: b, Shape: []int{1, heads, n, dim},
			Strides: []int{heads * capT * dim, capT * dim, dim, 1}, ItemSize: 2,
		}}
	}
	return out
}

func (c *conv) views(n int) []jobs.TensorSpec { return padded(c.bufs, c.heads, c.ct, c.dim, n) }

// dests allocates fresh capacity-padded destinations filled with 0x5a.
func (c *conv) dests(capT int) ([][]byte, []jobs.TensorSpec) {
	bufs := make([][]byte, c.tensors)
	for i := range bufs {
		bufs[i] = bytes.Repeat([]byte{0x5a}, c.heads*capT*c.dim*2)
	}
	return bufs, padded(bufs, c.heads, capT, c.dim, capT)
}

// checkDest asserts that tokens [0, n) of each destination hold c's values
// (computed from the formula) and every other byte still holds 0x5a.
func (c *conv) checkDest(t *testing.T, bufs [][]byte, capT, n int) {
	t.Helper()
	for ti, b := range bufs {
		for h := range c.heads {
			for tok := range capT {
				for d := range c.dim {
					got := binary.LittleEndian.Uint16(b[((h*capT+tok)*c.dim+d)*2:])
					want := uint16(0x5a5a)
					if tok < n {
						want = c.value(ti, h, tok, d)
					}
					if got != want {
						t.Fatalf("tensor %d head %d token %d d %d = %#x, want %#x (loaded %d tokens)", ti, h, tok, d, got, want, n)
					}
				}
			}
		}
	}
}

func seqTokens(n int, seed uint32) []uint32 {
	out := make([]uint32, n)
	for i := range out {
		out[i] = uint32(mix(uint64(seed)<<32|uint64(i))) % 128256
	}
	return out
}

func pageFiles(t *testing.T, nsDir string) map[string]int64 {
	t.Helper()
	out := map[string]int64{}
	root := testutil.PagesDir(nsDir)
	err := filepath.WalkDir(root, func(p string, d os.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.Type().IsRegular() {
			fi, err := d.Info()
			if err != nil {
				return err
			}
			out[filepath.Base(p)] = fi.Size()
		}
		return nil
	})
	if err != nil && !os.IsNotExist(err) {
		t.Fatal(err)
	}
	return out
}

const (
	pTensors, pHeads, pDim = 4, 2, 64
)

func savePrefix(t *testing.T, cfg *jobs.Config, ns string, c *conv, n, p int) *jobs.PrefixResult {
	t.Helper()
	res, _, err := savePrefixAt(context.Background(), cfg, ns, &jobs.SavePrefixRequest{
		Identity: "tiny/bf16", Tokens: c.tokens[:n], Tensors: c.views(n), PageTokens: p,
	})
	if err != nil {
		t.Fatal(err)
	}
	return res
}

func loadPrefix(t *testing.T, cfg *jobs.Config, ns string, toks []uint32, dest []jobs.TensorSpec, p int, verify bool) *jobs.PrefixResult {
	t.Helper()
	res, _, err := jobs.LoadPrefix(context.Background(), inRoot(cfg, ns), &jobs.LoadPrefixRequest{
		Namespace: filepath.Base(ns), Identity: "tiny/bf16", Tokens: toks, Dest: dest, PageTokens: p, NoVerify: !verify,
	}, nil)
	if err != nil {
		t.Fatal(err)
	}
	return res
}

// inRoot is a copy of cfg whose Root holds the namespace directory nsDir
// (a load names its namespace under Config.Root).
func inRoot(cfg *jobs.Config, nsDir string) *jobs.Config {
	c := *cfg
	c.Root = filepath.Dir(nsDir)
	return &c
}

func TestPrefixRoundTrip(t *testing.T) {
	for _, cfg := range []*jobs.Config{noSync(), withHelpers(2), {}} {
		ns := filepath.Join(t.TempDir(), "ns")
		c := newConv(seqTokens(600, 1), pTensors, pHeads, pDim, 768)
		res := savePrefix(t, cfg, ns, c, 600, 256)
		if res.PagesWritten != 3 || res.PagesReused != 0 || len(res.Keys) != 3 || res.Tokens != 600 {
			t.Fatalf("save: %+v", res)
		}
		files := pageFiles(t, ns)
		var total int64
		for _, k := range res.Keys {
			total += files[k.String()]
		}
		if len(files) != 3 || total != res.BytesWritten {
			t.Fatalf("files %v: %d bytes, result says %d", files, total, res.BytesWritten)
		}
		// Every page file decodes, verifies and carries its chain.
		keys, _, _ := layout.PageChain("tiny/bf16", 256, c.tokens)
		parent := layout.PageRoot("tiny/bf16", 256)
		for i, k := range keys {
			snap, err := layout.Load(vfs.Default, testutil.PagePath(ns, k))
			if err != nil {
				t.Fatal(err)
			}
			pg := snap.Page
			if pg == nil || pg.Key != k || pg.Parent != parent || len(pg.Tokens) != min(256, 600-256*i) || snap.Header.FormatVersion != layout.FormatPage {
				t.Fatalf("page %d: %+v", i, pg)
			}
			parent = k
			// The tensors' hashes are the xxh3 of the page's token range.
			for ti, tt := range snap.Header.Caches[0].Tensors {
				lo, hi := 256*i, min(600, 256*(i+1))
				want := make([]byte, 0, tt.Bytes)
				for h := range pHeads {
					for tok := lo; tok < hi; tok++ {
						for d := range pDim {
							want = binary.LittleEndian.AppendUint16(want, c.value(ti, h, tok, d))
						}
					}
				}
				if tt.Hash != hashHex(want) {
					t.Fatalf("page %d tensor %d hash %s, want %s", i, ti, tt.Hash, hashHex(want))
				}
			}
		}
		bufs, dest := c.dests(1024)
		lr := loadPrefix(t, cfg, ns, c.tokens, dest, 256, true)
		if lr.Tokens != 600 || lr.Stop != nil || len(lr.Keys) != 3 {
			t.Fatalf("load: %+v", lr)
		}
		c.checkDest(t, bufs, 1024, 600)
	}
}

func hashHex(b []byte) string { return layout.TensorHash(xxh3.Hash(b)) }

// Saving the same tokens again costs no write; growing by 256 tokens
// writes only the new full page and the new leaf.
func TestPrefixReuseAndGrowth(t *testing.T) {
	ns := filepath.Join(t.TempDir(), "ns")
	c := newConv(seqTokens(856, 2), pTensors, pHeads, pDim, 1024)
	first := savePrefix(t, noSync(), ns, c, 600, 256)
	st0, _ := os.Stat(testutil.PagePath(ns, first.Keys[0]))
	again := savePrefix(t, noSync(), ns, c, 600, 256)
	if again.PagesWritten != 0 || again.BytesWritten != 0 || again.PagesReused != 3 || again.BytesReused != first.BytesWritten {
		t.Fatalf("second save of the same tokens: %+v", again)
	}
	if st1, _ := os.Stat(testutil.PagePath(ns, first.Keys[0])); !os.SameFile(st0, st1) {
		t.Fatal("a reused page was rewritten")
	}
	grown := savePrefix(t, noSync(), ns, c, 856, 256)
	files := pageFiles(t, ns)
	if grown.PagesReused != 2 || grown.PagesWritten != 2 {
		t.Fatalf("grown: %+v", grown)
	}
	if want := files[grown.Keys[2].String()] + files[grown.Keys[3].String()]; grown.BytesWritten != want {
		t.Fatalf("grown wrote %d bytes, the two new pages have %d", grown.BytesWritten, want)
	}
	if len(files) != 5 { // 2 shared full pages, the old leaf, the new full page and leaf
		t.Fatalf("%d page files, want 5", len(files))
	}
	// Loads: exactly the stored tokens (leaf used), a longer prompt (leaf
	// not used: it covers other tokens than the prompt's remainder), a
	// prompt diverging inside page 1.
	for _, tc := range []struct {
		prompt []uint32
		want   int
	}{
		{c.tokens[:600], 600},
		{c.tokens[:856], 856},
		{c.tokens[:700], 512},
		{append(append([]uint32{}, c.tokens[:300]...), 7, 7, 7), 256},
		{c.tokens[:100], 0}, // the 100-token leaf was never stored
	} {
		bufs, dest := c.dests(1024)
		lr := loadPrefix(t, noSync(), ns, tc.prompt, dest, 256, true)
		if lr.Tokens != tc.want || lr.Stop != nil {
			t.Fatalf("prompt of %d tokens: loaded %d (stop %v), want %d", len(tc.prompt), lr.Tokens, lr.Stop, tc.want)
		}
		if tc.want < len(tc.prompt) && lr.Missing == nil {
			t.Fatalf("prompt of %d tokens: no missing key reported", len(tc.prompt))
		}
		c.checkDest(t, bufs, 1024, tc.want)
	}
}

// Two conversations sharing a prefix of 512 tokens: the second writes
// exactly its non-shared pages.
func TestPrefixSharedPrefixWritesOnlyNewPages(t *testing.T) {
	ns := filepath.Join(t.TempDir(), "ns")
	shared := seqTokens(512, 3)
	a := newConv(append(append([]uint32{}, shared...), seqTokens(300, 4)...), pTensors, pHeads, pDim, 1024)
	b := newConv(append(append([]uint32{}, shared...), seqTokens(400, 5)...), pTensors, pHeads, pDim, 1024)
	ra := savePrefix(t, noSync(), ns, a, len(a.tokens), 256)
	before := pageFiles(t, ns)
	rb := savePrefix(t, noSync(), ns, b, len(b.tokens), 256)
	after := pageFiles(t, ns)
	var want int64
	for k, sz := range after {
		if _, ok := before[k]; !ok {
			want += sz
		}
	}
	if rb.PagesReused != 2 || rb.PagesWritten != len(rb.Keys)-2 || rb.BytesWritten != want || ra.Keys[1] != rb.Keys[1] || ra.Keys[2] == rb.Keys[2] {
		t.Fatalf("second conversation: %+v; new files hold %d bytes", rb, want)
	}
	bufs, dest := b.dests(1024)
	if lr := loadPrefix(t, noSync(), ns, b.tokens, dest, 256, true); lr.Tokens != len(b.tokens) {
		t.Fatalf("load b: %+v", lr)
	}
	b.checkDest(t, bufs, 1024, len(b.tokens))
}

// A page failing verification ends the prefix there: the pages before it
// are loaded and reported; a missing page is a miss, not an error.
func TestPrefixCorruptAndMissingPages(t *testing.T) {
	ns := filepath.Join(t.TempDir(), "ns")
	c := newConv(seqTokens(800, 6), pTensors, pHeads, pDim, 1024)
	res := savePrefix(t, noSync(), ns, c, 800, 256)
	p1 := testutil.PagePath(ns, res.Keys[1])
	raw := flipLastByte(t, p1)
	bufs, dest := c.dests(1024)
	lr := loadPrefix(t, withHelpers(1), ns, c.tokens, dest, 256, true)
	if lr.Tokens != 256 || !errors.Is(lr.Stop, jobs.ErrCorrupt) || len(lr.Keys) != 1 {
		t.Fatalf("corrupt page 1: %+v", lr)
	}
	// Tokens [0, 256) hold the stored KV; later tokens are documented as
	// possibly overwritten, so only the first page is compared.
	for ti, buf := range bufs {
		for h := range pHeads {
			for tok := range 256 {
				for d := range pDim {
					if got := binary.LittleEndian.Uint16(buf[((h*1024+tok)*pDim+d)*2:]); got != c.value(ti, h, tok, d) {
						t.Fatalf("tensor %d head %d token %d: %#x", ti, h, tok, got)
					}
				}
			}
		}
	}
	// Without verification the corrupt byte is loaded (what Verify is for).
	_, dest = c.dests(1024)
	if lr := loadPrefix(t, noSync(), ns, c.tokens, dest, 256, false); lr.Tokens != 800 {
		t.Fatalf("unverified load: %+v", lr)
	}
	// A torn page (truncated) ends the prefix at decode.
	if err := os.Truncate(p1, int64(len(raw)-10)); err != nil {
		t.Fatal(err)
	}
	bufs, dest = c.dests(1024)
	if lr := loadPrefix(t, noSync(), ns, c.tokens, dest, 256, true); lr.Tokens != 256 || !errors.Is(lr.Stop, layout.ErrTruncated) {
		t.Fatalf("torn page 1: %+v", lr)
	}
	c.checkDest(t, bufs, 1024, 256) // decode failures are found before any write
	// A page removed behind the index's back: a miss.
	if err := os.Remove(testutil.PagePath(ns, res.Keys[0])); err != nil {
		t.Fatal(err)
	}
	bufs, dest = c.dests(1024)
	lr = loadPrefix(t, noSync(), ns, c.tokens, dest, 256, true)
	if lr.Tokens != 0 || lr.Stop != nil || lr.Missing == nil || *lr.Missing != res.Keys[0] {
		t.Fatalf("page 0 removed: %+v", lr)
	}
	c.checkDest(t, bufs, 1024, 0)
	// An empty namespace (no pages/ at all) is a miss too.
	if lr := loadPrefix(t, noSync(), filepath.Join(t.TempDir(), "none"), c.tokens, dest, 256, true); lr.Tokens != 0 {
		t.Fatalf("empty store: %+v", lr)
	}
}

// Every check that can be made before a destination is touched is made
// first: nothing is written on a mismatch.
func TestPrefixLoadChecksFirst(t *testing.T) {
	ns := filepath.Join(t.TempDir(), "ns")
	c := newConv(seqTokens(600, 7), pTensors, pHeads, pDim, 768)
	savePrefix(t, noSync(), ns, c, 600, 256)
	cases := []struct {
		name string
		edit func(d []jobs.TensorSpec) []jobs.TensorSpec
		want error
	}{
		{"too few tokens", func(d []jobs.TensorSpec) []jobs.TensorSpec { d[2].View.Shape[2] = 599; return d }, jobs.ErrDestination},
		{"dtype", func(d []jobs.TensorSpec) []jobs.TensorSpec { d[3].DType = "float16"; return d }, jobs.ErrMismatch},
		{"heads", func(d []jobs.TensorSpec) []jobs.TensorSpec { d[3].View.Shape[1] = 1; return d }, jobs.ErrMismatch},
		{"count", func(d []jobs.TensorSpec) []jobs.TensorSpec { return d[:3] }, jobs.ErrMismatch},
		{"itemsize", func(d []jobs.TensorSpec) []jobs.TensorSpec { d[0].DType = "float32"; return d }, jobs.ErrDestination},
		{"overlap", func(d []jobs.TensorSpec) []jobs.TensorSpec { d[1].View.Strides[1] = 0; return d }, jobs.ErrDestination},
		{"rank", func(d []jobs.TensorSpec) []jobs.TensorSpec {
			d[1].View.Shape, d[1].View.Strides = []int{768}, []int{1}
			return d
		}, jobs.ErrDestination},
	}
	for _, tc := range cases {
		bufs, dest := c.dests(768)
		_, _, err := jobs.LoadPrefix(context.Background(), inRoot(noSync(), ns), &jobs.LoadPrefixRequest{
			Namespace: "ns", Identity: "tiny/bf16", Tokens: c.tokens, Dest: tc.edit(dest), PageTokens: 256,
		}, nil)
		if !errors.Is(err, tc.want) {
			t.Fatalf("%s: got %v, want %v", tc.name, err, tc.want)
		}
		c.checkDest(t, bufs, 768, 0)
	}
	// Another identity or page size is a miss by construction.
	_, dest := c.dests(768)
	for _, sp := range []*jobs.LoadPrefixRequest{
		{Namespace: "ns", Identity: "other", Tokens: c.tokens, Dest: dest, PageTokens: 256},
		{Namespace: "ns", Identity: "tiny/bf16", Tokens: c.tokens, Dest: dest, PageTokens: 128},
	} {
		lr, _, err := jobs.LoadPrefix(context.Background(), inRoot(noSync(), ns), sp, nil)
		if err != nil || lr.Tokens != 0 {
			t.Fatalf("identity %q P %d: %+v %v", sp.Identity, sp.PageTokens, lr, err)
		}
	}
	for _, sp := range []*jobs.LoadPrefixRequest{
		{Namespace: "ns", Identity: "", Tokens: c.tokens, Dest: dest},
		{Namespace: "ns", Identity: "x", Tokens: c.tokens, Dest: dest, PageTokens: 100},
		{Namespace: "ns", Identity: "x", Dest: dest},
	} {
		if _, _, err := jobs.LoadPrefix(context.Background(), inRoot(noSync(), ns), sp, nil); !errors.Is(err, jobs.ErrInvalidRequest) {
			t.Fatalf("%+v: %v", sp, err)
		}
	}
}

func TestPrefixSaveValidation(t *testing.T) {
	ns := filepath.Join(t.TempDir(), "ns")
	c := newConv(seqTokens(300, 8), pTensors, pHeads, pDim, 512)
	for name, sp := range map[string]*jobs.SavePrefixRequest{
		"no tokens":   {Identity: "x", Tensors: c.views(0)},
		"identity":    {Tokens: c.tokens, Tensors: c.views(300)},
		"page size":   {Identity: "x", Tokens: c.tokens, Tensors: c.views(300), PageTokens: 48},
		"few tokens":  {Identity: "x", Tokens: c.tokens, Tensors: c.views(299)},
		"no tensors":  {Identity: "x", Tokens: c.tokens},
		"bad dtype":   {Identity: "x", Tokens: c.tokens, Tensors: []jobs.TensorSpec{{DType: "q4", View: c.views(300)[0].View}}},
		"out of base": {Identity: "x", Tokens: c.tokens, Tensors: padded([][]byte{c.bufs[0][:100]}, pHeads, 512, pDim, 300)},
	} {
		if _, _, err := savePrefixAt(context.Background(), noSync(), ns, sp); !errors.Is(err, jobs.ErrInvalidRequest) {
			t.Fatalf("%s: %v", name, err)
		}
		if _, err := os.Stat(ns); !os.IsNotExist(err) {
			t.Fatalf("%s: the namespace was created by an invalid request", name)
		}
	}
}

// A token-major destination (runs of one head row, 128 bytes) takes the
// scratch-and-scatter path; the bytes are the same.
func TestPrefixLoadTokenMajor(t *testing.T) {
	ns := filepath.Join(t.TempDir(), "ns")
	c := newConv(seqTokens(300, 9), pTensors, pHeads, pDim, 512)
	savePrefix(t, withHelpers(1), ns, c, 300, 64)
	const capT = 320
	dest := make([]jobs.TensorSpec, pTensors)
	bufs := make([][]byte, pTensors)
	for i := range dest {
		bufs[i] = bytes.Repeat([]byte{0x5a}, capT*pHeads*pDim*2)
		dest[i] = jobs.TensorSpec{DType: "bfloat16", View: gather.View{
			Base: bufs[i], Shape: []int{1, pHeads, capT, pDim},
			Strides: []int{capT * pHeads * pDim, pDim, pHeads * pDim, 1}, ItemSize: 2,
		}}
	}
	if lr := loadPrefix(t, withHelpers(1), ns, c.tokens, dest, 64, true); lr.Tokens != 300 {
		t.Fatalf("load: %+v", lr)
	}
	for ti, b := range bufs {
		for tok := range capT {
			for h := range pHeads {
				for d := range pDim {
					got := binary.LittleEndian.Uint16(b[((tok*pHeads+h)*pDim+d)*2:])
					want := uint16(0x5a5a)
					if tok < 300 {
						want = c.value(ti, h, tok, d)
					}
					if got != want {
						t.Fatalf("tensor %d token %d head %d d %d: %#x want %#x", ti, tok, h, d, got, want)
					}
				}
			}
		}
	}
}

// Faults at every point of a save: the error is returned, no temp file is
// left, every page that was published decodes and verifies, and progress
// counted exactly the pages that were published (never one whose fsync or
// rename then failed).
func TestPrefixSaveFaults(t *testing.T) {
	perToken := int64(pTensors * pHeads * pDim * 2) // bytes of one token in every tensor
	firedTotal := 0
	for _, op := range []testutil.Op{testutil.OpCreate, testutil.OpWriteAt, testutil.OpSync, testutil.OpRename, testutil.OpSyncDir, testutil.OpMkdirAll} {
		for nth := 1; nth <= 3; nth++ {
			root := t.TempDir()
			ns := filepath.Join(root, "ns")
			ffs := testutil.NewFaultFS(nil)
			ffs.Inject(testutil.Fault{Op: op, Nth: nth, Err: syscall.EIO})
			c := newConv(seqTokens(600, 10), pTensors, pHeads, pDim, 768)
			var told int64
			_, _, err := savePrefixAt(context.Background(), &jobs.Config{FS: ffs}, ns, &jobs.SavePrefixRequest{
				Identity: "tiny/bf16", Tokens: c.tokens, Tensors: c.views(600), PageTokens: 256,
				Progress: func(n int64) { told += n },
			})
			keys, _, kerr := layout.PageChain("tiny/bf16", 256, c.tokens)
			if kerr != nil {
				t.Fatal(kerr)
			}
			var published int64
			for i, k := range keys {
				if _, serr := os.Stat(testutil.PagePath(ns, k)); serr == nil {
					published += int64(min(256, 600-i*256)) * perToken
				}
			}
			if told != published {
				t.Fatalf("%s #%d: progress told %d bytes, the published pages hold %d", op, nth, told, published)
			}
			fired := len(ffs.Injected()) > 0
			if fired {
				firedTotal++
			}
			if fired != (err != nil) {
				t.Fatalf("%s #%d: fault fired %v, error %v", op, nth, fired, err)
			}
			if fired && !errors.Is(err, syscall.EIO) {
				t.Fatalf("%s #%d: %v does not wrap EIO", op, nth, err)
			}
			if tmp := testutil.TempFiles(t, root); len(tmp) > 0 {
				t.Fatalf("%s #%d: temp files left: %v", op, nth, tmp)
			}
			// Whatever was published loads, verified, as a prefix.
			bufs, dest := c.dests(768)
			lr := loadPrefix(t, noSync(), ns, c.tokens, dest, 256, true)
			if lr.Stop != nil {
				t.Fatalf("%s #%d: a published page fails: %v", op, nth, lr.Stop)
			}
			c.checkDest(t, bufs, 768, lr.Tokens)
			if !fired && lr.Tokens != 600 {
				t.Fatalf("%s #%d: no fault, loaded %d", op, nth, lr.Tokens)
			}
		}
	}
	if firedTotal < 12 {
		t.Fatalf("only %d of the injected faults fired", firedTotal)
	}
}

// Faults at every point of a load: never a failed load; the prefix ends at
// the first page that could not be opened or read (Stop wraps the errno),
// and the tokens reported as loaded hold the stored KV.
func TestPrefixLoadFaults(t *testing.T) {
	ns := filepath.Join(t.TempDir(), "ns")
	c := newConv(seqTokens(600, 11), pTensors, pHeads, pDim, 768)
	savePrefix(t, noSync(), ns, c, 600, 256)
	fired := 0
	for _, op := range []testutil.Op{testutil.OpOpen, testutil.OpReadAt, testutil.OpLstat, testutil.OpLock} {
		for nth := 1; nth <= 12; nth++ {
			ffs := testutil.NewFaultFS(nil)
			ffs.Inject(testutil.Fault{Op: op, Nth: nth, Err: syscall.EIO})
			bufs, dest := c.dests(768)
			res, _, err := jobs.LoadPrefix(context.Background(), inRoot(&jobs.Config{FS: ffs}, ns), &jobs.LoadPrefixRequest{
				Namespace: "ns", Identity: "tiny/bf16", Tokens: c.tokens, Dest: dest, PageTokens: 256,
			}, nil)
			hit := len(ffs.Injected()) > 0
			if !hit {
				if err != nil || res.Tokens != 600 {
					t.Fatalf("%s #%d: no fault fired: %+v %v", op, nth, res, err)
				}
				continue
			}
			fired++
			if err != nil {
				// Only the checks before any page is opened may fail the load.
				if !errors.Is(err, syscall.EIO) || res != nil {
					t.Fatalf("%s #%d: %v", op, nth, err)
				}
				c.checkDest(t, bufs, 768, 0)
				continue
			}
			if res.Tokens == 600 || res.Tokens%256 != 0 || !errors.Is(res.Stop, syscall.EIO) {
				t.Fatalf("%s #%d: %+v", op, nth, res)
			}
			for ti, b := range bufs { // the loaded tokens are the stored KV
				for h := range pHeads {
					for tok := range res.Tokens {
						if got := binary.LittleEndian.Uint16(b[((h*768+tok)*pDim)*2:]); got != c.value(ti, h, tok, 0) {
							t.Fatalf("%s #%d: tensor %d token %d differs", op, nth, ti, tok)
						}
					}
				}
			}
		}
	}
	if fired < 10 {
		t.Fatalf("only %d faults fired", fired)
	}
}

// TestPrefixProgress: the progress calls of a save add up to the saved
// tokens' bytes of every tensor (pages written and pages reused alike), and
// those of a load to the loaded tokens' bytes; every call is positive.
func TestPrefixProgress(t *testing.T) {
	for _, cfg := range []*jobs.Config{noSync(), withHelpers(2)} {
		ns := filepath.Join(t.TempDir(), "ns")
		c := newConv(seqTokens(600, 3), pTensors, pHeads, pDim, 768)
		perToken := int64(pTensors * pHeads * pDim * 2) // bytes of one token in every tensor
		var mu sync.Mutex
		var sum int64
		calls := 0
		progress := func(n int64) {
			mu.Lock()
			defer mu.Unlock()
			if n <= 0 {
				t.Errorf("progress(%d)", n)
			}
			sum += n
			calls++
		}
		for _, n := range []int{300, 600} { // the second save reuses the first page
			sum, calls = 0, 0
			res, _, err := savePrefixAt(context.Background(), cfg, ns, &jobs.SavePrefixRequest{
				Identity: "tiny/bf16", Tokens: c.tokens[:n], Tensors: c.views(n), PageTokens: 256, Progress: progress,
			})
			if err != nil {
				t.Fatal(err)
			}
			// Published pages are told in batches (as their commits
			// end), reused ones one by one: at most one call per page.
			if want := int64(n) * perToken; sum != want || calls < 1 || calls > len(res.Keys) {
				t.Fatalf("save of %d tokens: progress %d bytes in %d calls, want %d in 1 to %d", n, sum, calls, want, len(res.Keys))
			}
		}
		sum, calls = 0, 0
		bufs, dest := c.dests(768)
		res, _, err := jobs.LoadPrefix(context.Background(), inRoot(cfg, ns), &jobs.LoadPrefixRequest{
			Namespace: "ns", Identity: "tiny/bf16", Tokens: c.tokens[:600], Dest: dest, PageTokens: 256, Progress: progress,
		}, nil)
		if err != nil {
			t.Fatal(err)
		}
		c.checkDest(t, bufs, 768, res.Tokens)
		if want := int64(600) * perToken; res.Tokens != 600 || sum != want || calls != 3*pTensors {
			t.Fatalf("load: %d tokens, progress %d bytes in %d calls, want %d in %d", res.Tokens, sum, calls, want, 3*pTensors)
		}
	}
}

// flipLastByte inverts the last byte of the page file path (the last
// tensor's data) and returns the file's new bytes.
func flipLastByte(t *testing.T, path string) []byte {
	t.Helper()
	raw, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	raw[len(raw)-1] ^= 0xff
	if err := os.WriteFile(path, raw, 0o640); err != nil {
		t.Fatal(err)
	}
	return raw
}
