package tiertest

import (
	"bytes"
	"context"
	"errors"
	"math"
	"net/http"
	"os"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kvpersist/kvpersist/engine"
	"github.com/kvpersist/kvpersist/engine/vfs"
)

// The read-through's scatter: fetched pages that begin the prompt's chain
// are written into the load's destinations while later pages are still
// being fetched, in chain order, each only once it is verified and
// published; the destinations end as LoadPrefix documents whatever
// happens.

// renameHookFS runs before (once) before the Rename onto target.
type renameHookFS struct {
	vfs.FS
	target string
	before func()
	ran    atomic.Bool
}

func (r *renameHookFS) Rename(oldname, newname string) error {
	if newname == r.target && r.ran.CompareAndSwap(false, true) {
		r.before()
	}
	return r.FS.Rename(oldname, newname)
}

// sentinel is the byte a destination holds before a load: a load that
// writes a token it must not is seen (the KV bytes are pseudo-random).
const sentinel = 0x5a

// fillKV is a cache of capTok tokens holding sentinel everywhere.
func fillKV(capTok int) *kv {
	c := newKV(capTok)
	for _, b := range [][]byte{c.k, c.v} {
		for i := range b {
			b[i] = sentinel
		}
	}
	return c
}

// checkPrefixAndSentinel fails unless tokens [0, n) of c hold the KV of
// tokens and every other byte of c still holds sentinel.
func checkPrefixAndSentinel(t *testing.T, c *kv, tokens []uint32, n int) {
	t.Helper()
	checkPrefixSkipSentinel(t, c, tokens, n, n)
}

// checkPrefixSkipSentinel is checkPrefixAndSentinel with tokens [n, skip)
// left unchecked (a failed page's, which the Stop clause lets hold data).
func checkPrefixSkipSentinel(t *testing.T, c *kv, tokens []uint32, n, skip int) {
	t.Helper()
	want := fillKV(c.capTok)
	row := headDim * item
	for ti, buf := range [][]byte{want.k, want.v} {
		for h := range heads {
			for pos, tok := range tokens[:n] {
				off := (h*c.capTok + pos) * row
				for b := range row {
					buf[off+b] = value(ti, h, pos, b, tok)
				}
			}
		}
	}
	for ti, got := range [][]byte{c.k, c.v} {
		wb := [][]byte{want.k, want.v}[ti]
		for h := range heads {
			for pos := range c.capTok {
				off := (h*c.capTok + pos) * row
				if (pos < n || pos >= skip) && !bytes.Equal(got[off:off+row], wb[off:off+row]) {
					t.Fatalf("tensor %d head %d token %d: not the KV of the first %d tokens followed by what it held before", ti, h, pos, n)
				}
			}
		}
	}
}

// TestFetchedPagesScatteredDuringFetch: a prompt of 5 remote pages, all
// fetched at once; the publish (rename) of the last page is held until the
// load's Progress has reported the first page's bytes in the
// destinations, or 20 s passed. The first page must be in the
// destinations by then (before, the load read every page only once the
// read-through had published the last one, so Progress stayed at 0 and
// the rename waited out the bound). The load then gets every token
// bit-exact, the bytes past them untouched, every page published, the
// accounting equal to the disk.
func TestFetchedPagesScatteredDuringFetch(t *testing.T) {
	prefix, rootA, conv, keys := uploadedConv(t, 71000, 4*ptoks+10)
	rootB := t.TempDir()

	var progress atomic.Int64
	pageTensorBytes := int64(ptoks * tokenBytes)
	reached := make(chan struct{})
	var once atomic.Bool
	scattered := false
	fs := &renameHookFS{FS: vfs.Default, target: pagePath(rootB, keys[len(keys)-1]), before: func() {
		select {
		case <-reached:
			scattered = true
		case <-time.After(20 * time.Second):
		}
	}}
	b := newEngineCfg(t, rootB, prefix, newRecorder(t), nil, func(c *engine.Config) { c.FS = fs; c.CapacityBytes = math.MaxInt32 })
	c := fillKV(len(conv) + 100)
	res := b.Do(context.Background(), &engine.LoadPrefixRequest{Namespace: ns, Identity: ident, Tokens: conv, PageTokens: ptoks,
		Dest: c.specs(len(conv)), Progress: func(n int64) {
			if progress.Add(n) >= pageTensorBytes && once.CompareAndSwap(false, true) {
				close(reached)
			}
		}})
	if res.Err != nil || res.Prefix.Tokens != len(conv) || res.Remote == nil || res.Remote.Err != nil || res.Remote.PagesFetched != len(keys) {
		t.Fatalf("load: %v, %d tokens, remote %+v; want %d tokens, %d pages fetched", res.Err, res.Prefix.Tokens, res.Remote, len(conv), len(keys))
	}
	if !fs.ran.Load() || !scattered {
		t.Fatal("the first page was not in the destinations before the last page was published")
	}
	checkPrefixAndSentinel(t, c, conv, len(conv))
	if got := progress.Load(); got != int64(len(conv)*tokenBytes) {
		t.Fatalf("progress reported %d bytes, want %d", got, len(conv)*tokenBytes)
	}
	if len(res.Prefix.Keys) != len(keys) {
		t.Fatalf("result keys %d, want %d", len(res.Prefix.Keys), len(keys))
	}
	for i, k := range keys {
		if res.Prefix.Keys[i] != k {
			t.Fatalf("result key %d is %s, want %s", i, res.Prefix.Keys[i], k)
		}
		if !bytes.Equal(readFile(t, pagePath(rootB, k)), readFile(t, pagePath(rootA, k))) {
			t.Fatalf("page %d differs from A's", i)
		}
	}
	checkUsageIsDisk(t, b, rootB, math.MaxInt32)
}

// TestScatterStopsAtFailedPage: 6 remote pages, page 2 damaged, fetched 2
// at a time so that pages after it are fetched while pages 0-1 are
// scattered. The load gets tokens [0, 2×64) and every other byte of the
// destinations holds what it held before (pages 3-5 verified and were
// kept locally, but are past the hole: not scattered, not loaded).
func TestScatterStopsAtFailedPage(t *testing.T) {
	prefix, rootA, conv, keys := uploadedConv(t, 73000, 6*ptoks)
	rootB := t.TempDir()
	st := openStore(t, prefix)
	name, _ := st.PageName(ns, keys[2].String())
	bad := bytes.Clone(readFile(t, pagePath(rootA, keys[2])))
	bad[len(bad)-3] ^= 0x10 // a tensor byte
	putObject(t, st, name, bad)

	b := newEngineCfg(t, rootB, prefix, newRecorder(t), func(rt *engine.RemoteTier) { rt.FetchPages = 2 },
		func(c *engine.Config) { c.CapacityBytes = math.MaxInt32 })
	c := fillKV(len(conv) + 100)
	res := b.Do(context.Background(), &engine.LoadPrefixRequest{Namespace: ns, Identity: ident, Tokens: conv, PageTokens: ptoks, Dest: c.specs(len(conv))})
	if res.Err != nil || res.Prefix.Tokens != 2*ptoks || res.Remote == nil || !errors.Is(res.Remote.Err, engine.ErrRemoteCorrupt) {
		t.Fatalf("load: %v, %d tokens, remote %+v; want %d tokens and ErrRemoteCorrupt", res.Err, res.Prefix.Tokens, res.Remote, 2*ptoks)
	}
	checkPrefixAndSentinel(t, c, conv, 2*ptoks)
	for i := 3; i < len(keys); i++ {
		if !bytes.Equal(readFile(t, pagePath(rootB, keys[i])), readFile(t, pagePath(rootA, keys[i]))) {
			t.Fatalf("page %d not kept as A's", i)
		}
	}
	checkUsageIsDisk(t, b, rootB, math.MaxInt32)
}

// TestScatterMismatchWritesNothing: destinations whose head_dim is not
// the stored pages' (32 elements, the pages 64): the load fails with
// ErrMismatch and no byte of the destinations is written, although every
// page was fetched and published (the first page is checked against the
// destinations before anything is scattered).
func TestScatterMismatchWritesNothing(t *testing.T) {
	prefix, _, conv, keys := uploadedConv(t, 75000, 3*ptoks)
	rootB := t.TempDir()

	b := newEngine(t, rootB, prefix, newRecorder(t), nil)
	capTok := len(conv)
	n := heads * capTok * (headDim / 2) * item
	k, v := bytes.Repeat([]byte{sentinel}, n), bytes.Repeat([]byte{sentinel}, n)
	view := func(buf []byte) engine.View {
		return engine.View{Base: buf, Shape: []int{1, heads, capTok, headDim / 2},
			Strides: []int{heads * capTok * headDim / 2, capTok * headDim / 2, headDim / 2, 1}}
	}
	res := b.Do(context.Background(), &engine.LoadPrefixRequest{Namespace: ns, Identity: ident, Tokens: conv, PageTokens: ptoks,
		Dest: []engine.TensorSpec{{DType: "bfloat16", View: view(k)}, {DType: "bfloat16", View: view(v)}}})
	if !errors.Is(res.Err, engine.ErrMismatch) {
		t.Fatalf("load: %v; want ErrMismatch", res.Err)
	}
	if res.Remote == nil || res.Remote.PagesFetched != len(keys) {
		t.Fatalf("remote report %+v: want %d pages fetched", res.Remote, len(keys))
	}
	for _, buf := range [][]byte{k, v} {
		if !bytes.Equal(buf, bytes.Repeat([]byte{sentinel}, n)) {
			t.Fatal("a destination was written by a load that failed with ErrMismatch")
		}
	}
}

// TestScatterCancelledMidFetch: the load's context ends at the third page
// GET of 8 (2 in flight), while earlier pages are being scattered. The
// load fails with the context's error; its destinations are mmap'd memory
// made PROT_NONE as soon as Do returns, until the engine is closed (every
// goroutine of it ended): any write of the engine to them after the ack
// kills the test process. Then the bytes past the pages of the prompt are
// untouched, and the accounting equals the disk.
func TestScatterCancelledMidFetch(t *testing.T) {
	prefix, _, conv, _ := uploadedConv(t, 77000, 8*ptoks)
	rootB := t.TempDir()

	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	hook := &nthRT{next: http.DefaultTransport.(*http.Transport).Clone(), match: isPageGet, n: 3, hook: cancel}
	b := newEngineCfg(t, rootB, prefix, newRecorder(t), func(rt *engine.RemoteTier) {
		rt.Store.Transport = hook
		rt.FetchPages = 2
	}, func(c *engine.Config) { c.CapacityBytes = math.MaxInt32 })
	capTok := len(conv) + 100
	size := heads * capTok * headDim * item
	mem := make([][]byte, 2)
	for i := range mem {
		m, err := unix.Mmap(-1, 0, size, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_ANON|unix.MAP_PRIVATE)
		if err != nil {
			t.Fatal(err)
		}
		defer func() { _ = unix.Munmap(m) }()
		for j := range m {
			m[j] = sentinel
		}
		mem[i] = m
	}
	c := &kv{capTok: capTok, k: mem[0], v: mem[1]}
	res := b.Do(ctx, &engine.LoadPrefixRequest{Namespace: ns, Identity: ident, Tokens: conv, PageTokens: ptoks, Dest: c.specs(len(conv))})
	for _, m := range mem {
		if err := unix.Mprotect(m, unix.PROT_NONE); err != nil {
			t.Fatal(err)
		}
	}
	if !errors.Is(res.Err, context.Canceled) {
		t.Errorf("cancelled load: %v (remote %+v); want context.Canceled", res.Err, res.Remote)
	}
	checkUsageIsDisk(t, b, rootB, math.MaxInt32)
	closeEngine(t, b) // every goroutine of the engine ends here
	for _, m := range mem {
		if err := unix.Mprotect(m, unix.PROT_READ|unix.PROT_WRITE); err != nil {
			t.Fatal(err)
		}
	}
	// Bytes past the prompt's tokens: never a destination's.
	row := headDim * item
	for _, m := range mem {
		for h := range heads {
			for pos := len(conv); pos < capTok; pos++ {
				off := (h*capTok + pos) * row
				for _, x := range m[off : off+row] {
					if x != sentinel {
						t.Fatalf("head %d token %d (past the prompt) was written", h, pos)
					}
				}
			}
		}
	}
}

// failRenameFS fails the Rename onto target with EIO.
type failRenameFS struct {
	vfs.FS
	target string
}

func (r *failRenameFS) Rename(oldname, newname string) error {
	if newname == r.target {
		return syscall.EIO
	}
	return r.FS.Rename(oldname, newname)
}

// TestScatterPublishFailureEndsPrefix: 5 remote pages; the publish
// (rename) of page 2 fails after its bytes verified, so it may already
// be scattered (a page is scattered beside its publish). The load's
// prefix ends before it (2×64 tokens, Stop set, Remote.Err the rename's
// EIO), tokens from page 3 on hold what they held before, page 2 has no
// file and leaves no temp file, and the accounting equals the disk.
func TestScatterPublishFailureEndsPrefix(t *testing.T) {
	prefix, _, conv, keys := uploadedConv(t, 79000, 5*ptoks)
	rootB := t.TempDir()

	fs := &failRenameFS{FS: vfs.Default, target: pagePath(rootB, keys[2])}
	b := newEngineCfg(t, rootB, prefix, newRecorder(t), func(rt *engine.RemoteTier) { rt.FetchPages = 1 },
		func(c *engine.Config) { c.FS = fs; c.CapacityBytes = math.MaxInt32 })
	c := fillKV(len(conv) + 100)
	res := b.Do(context.Background(), &engine.LoadPrefixRequest{Namespace: ns, Identity: ident, Tokens: conv, PageTokens: ptoks, Dest: c.specs(len(conv))})
	if res.Err != nil || res.Prefix.Tokens != 2*ptoks || res.Remote == nil || !errors.Is(res.Remote.Err, syscall.EIO) {
		t.Fatalf("load: %v, %d tokens, remote %+v; want %d tokens and the rename's EIO", res.Err, res.Prefix.Tokens, res.Remote, 2*ptoks)
	}
	if !errors.Is(res.Prefix.Stop, syscall.EIO) {
		t.Fatalf("Stop = %v; want the rename's EIO", res.Prefix.Stop)
	}
	// Tokens of page 2 may hold its verified KV (Stop); check the rest.
	checkPrefixSkipSentinel(t, c, conv, 2*ptoks, 3*ptoks)
	if _, err := os.Lstat(pagePath(rootB, keys[2])); !os.IsNotExist(err) {
		t.Fatalf("page 2 has a file (lstat: %v)", err)
	}
	checkUsageIsDisk(t, b, rootB, math.MaxInt32)
}
