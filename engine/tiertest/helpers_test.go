package tiertest

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/minio/minio-go/v7"

	"github.com/kvpersist/kvpersist/engine"
	"github.com/kvpersist/kvpersist/engine/layout"
	"github.com/kvpersist/kvpersist/engine/metrics"
	"github.com/kvpersist/kvpersist/engine/remote"
	"github.com/kvpersist/kvpersist/internal/testutil"
)

// Geometry of the test caches: K and V of one layer, each
// [1, heads, capacity, headDim] bf16, capacity-padded as mlx-lm keeps them.
const (
	heads   = 2
	headDim = 64
	item    = 2 // bf16 bytes
	ptoks   = 64
	ns      = "tier"
	ident   = "test-model/bf16/tp0"
)

// tokenBytes is the KV bytes of one token (both tensors, every head).
const tokenBytes = 2 * heads * headDim * item

// kv is a cache with room for capTok tokens.
type kv struct {
	capTok int
	k, v   []byte
}

func newKV(capTok int) *kv {
	n := heads * capTok * headDim * item
	return &kv{capTok: capTok, k: make([]byte, n), v: make([]byte, n)}
}

// value is the byte of KV tensor t (0 K, 1 V), head h, position pos, byte
// b of the row, for a sequence whose token at pos is tok: the KV of a
// token depends on its id and position only, so two conversations that
// share a prefix have the same KV for it (as a real model computes).
func value(t, h, pos, b int, tok uint32) byte {
	x := uint64(tok)*0x9e3779b97f4a7c15 ^ uint64(pos)<<20 ^ uint64(h)<<12 ^ uint64(b)<<2 ^ uint64(t)
	x ^= x >> 31
	x *= 0xbf58476d1ce4e5b9
	x ^= x >> 29
	return byte(x)
}

// fill computes the KV of tokens into c.
func (c *kv) fill(tokens []uint32) {
	row := headDim * item
	for t, buf := range [][]byte{c.k, c.v} {
		for h := range heads {
			for pos, tok := range tokens {
				off := (h*c.capTok + pos) * row
				for b := range row {
					buf[off+b] = value(t, h, pos, b, tok)
				}
			}
		}
	}
}

// specs are c's tensors as views of their first tokens tokens.
func (c *kv) specs(tokens int) []engine.TensorSpec {
	view := func(buf []byte) engine.View {
		return engine.View{Base: buf, Shape: []int{1, heads, tokens, headDim},
			Strides: []int{heads * c.capTok * headDim, c.capTok * headDim, headDim, 1}}
	}
	return []engine.TensorSpec{{DType: "bfloat16", View: view(c.k)}, {DType: "bfloat16", View: view(c.v)}}
}

// checkLoaded fails unless tokens [0, n) of c hold the KV of tokens
// (recomputed, independent of any store) and tokens [n, capTok) are zero.
func (c *kv) checkLoaded(t *testing.T, tokens []uint32, n int) {
	t.Helper()
	want := newKV(c.capTok)
	want.fill(tokens[:n])
	if !bytes.Equal(c.k, want.k) || !bytes.Equal(c.v, want.v) {
		t.Fatalf("loaded KV differs from the KV of the first %d tokens (or a byte past them was written)", n)
	}
}

// seq returns n token ids starting at base.
func seq(base, n int) []uint32 {
	out := make([]uint32, n)
	for i := range out {
		out[i] = uint32(base + i)
	}
	return out
}

var prefixes atomic.Int64

// bucketPrefix is an object-name prefix of the test's own, so tests (and
// -count runs) on the shared server never see each other's objects.
func bucketPrefix(t *testing.T) string {
	return fmt.Sprintf("tier/%s-%d-%d", strings.ReplaceAll(t.Name(), "/", "_"), os.Getpid(), prefixes.Add(1))
}

func storeConfig(prefix string) engine.RemoteConfig {
	return engine.RemoteConfig{Endpoint: srv.Endpoint, Bucket: srv.Bucket, Prefix: prefix,
		AccessKey: srv.AccessKey, SecretKey: srv.SecretKey}
}

// newEngine opens an engine on root with the remote tier under prefix,
// metrics into rec, closed at the test's end. mod may change the tier's
// config.
func newEngine(t *testing.T, root, prefix string, rec *metrics.Recorder, mod func(*engine.RemoteTier)) *engine.Engine {
	t.Helper()
	return newEngineCfg(t, root, prefix, rec, mod, nil)
}

// newEngineCfg is newEngine whose engine config modCfg may change (the
// page cache's limits).
func newEngineCfg(t *testing.T, root, prefix string, rec *metrics.Recorder, mod func(*engine.RemoteTier), modCfg func(*engine.Config)) *engine.Engine {
	t.Helper()
	rt := &engine.RemoteTier{Store: storeConfig(prefix), UploadBackoffMin: 20 * time.Millisecond, UploadBackoffMax: 300 * time.Millisecond}
	if mod != nil {
		mod(rt)
	}
	// The tier's warnings (pages not fetched, uploads failing while the
	// server is down) are what these tests provoke: not logged.
	cfg := engine.Config{Root: root, NoSync: true, Metrics: rec, Remote: rt, Logger: slog.New(slog.DiscardHandler)}
	if modCfg != nil {
		modCfg(&cfg)
	}
	e, err := engine.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		_ = e.Close(ctx)
	})
	return e
}

func newRecorder(t *testing.T) *metrics.Recorder {
	t.Helper()
	r, err := metrics.New(metrics.Options{})
	if err != nil {
		t.Fatal(err)
	}
	return r
}

// closeEngine closes e, waiting for its uploads (up to a minute).
func closeEngine(t *testing.T, e *engine.Engine) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if err := e.Close(ctx); err != nil {
		t.Fatalf("Close: %v", err)
	}
}

// save saves tokens' KV (computed by fill) as pages of ptoks tokens.
func save(t *testing.T, e *engine.Engine, tokens []uint32) engine.Result {
	t.Helper()
	c := newKV(len(tokens) + 100)
	c.fill(tokens)
	res := e.Do(context.Background(), &engine.SavePrefixRequest{Namespace: ns, Identity: ident, Tokens: tokens, PageTokens: ptoks, Tensors: c.specs(len(tokens))})
	if res.Err != nil {
		t.Fatalf("save: %v", res.Err)
	}
	return res
}

// load loads the longest stored prefix of tokens into a fresh cache.
func load(t *testing.T, e *engine.Engine, tokens []uint32) (engine.Result, *kv) {
	t.Helper()
	c := newKV(len(tokens) + 100)
	res := e.Do(context.Background(), &engine.LoadPrefixRequest{Namespace: ns, Identity: ident, Tokens: tokens, PageTokens: ptoks, Dest: c.specs(len(tokens))})
	if res.Err != nil {
		t.Fatalf("load: %v", res.Err)
	}
	return res, c
}

// writePages writes tokens' KV as the named snapshot name in the Pages
// layout: a page manifest, which pins its pages in the engine's cache.
func writePages(t *testing.T, e *engine.Engine, name string, tokens []uint32) {
	t.Helper()
	c := newKV(len(tokens))
	c.fill(tokens)
	res := e.Do(context.Background(), &engine.WriteRequest{Ref: engine.Ref{Namespace: ns, Name: name}, Layout: engine.Pages,
		Identity: ident, Tokens: tokens, PageTokens: ptoks, Caches: []engine.EntrySpec{{Tensors: c.specs(len(tokens))}}})
	if res.Err != nil {
		t.Fatalf("write %s: %v", name, res.Err)
	}
}

func keysOf(t *testing.T, tokens []uint32) []layout.PageKey {
	t.Helper()
	keys, _, err := layout.PageChain(ident, ptoks, tokens)
	if err != nil {
		t.Fatal(err)
	}
	return keys
}

func pagePath(root string, k layout.PageKey) string {
	return testutil.PagePath(filepath.Join(root, ns), k)
}

func readFile(t *testing.T, path string) []byte {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// openStore opens the bucket under prefix for the test's own checks.
func openStore(t *testing.T, prefix string) *remote.Store {
	t.Helper()
	s, err := remote.New(storeConfig(prefix))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(s.Close)
	return s
}

// objects returns every object of the namespace in the bucket: name ->
// bytes (read with plain GETs of the client).
func objects(t *testing.T, s *remote.Store) map[string][]byte {
	t.Helper()
	ctx := context.Background()
	ls, err := s.List(ctx, ns)
	if err != nil {
		t.Fatal(err)
	}
	out := map[string][]byte{}
	for _, l := range ls {
		o, err := s.Client().GetObject(ctx, s.Bucket(), l.Name, minio.GetObjectOptions{})
		if err != nil {
			t.Fatal(err)
		}
		b, err := io.ReadAll(o)
		o.Close()
		if err != nil {
			t.Fatal(err)
		}
		out[l.Name] = b
	}
	return out
}

// putObject replaces object name with b (a plain PUT: tests corrupt the
// bucket with it, which kvpersist itself never does).
func putObject(t *testing.T, s *remote.Store, name string, b []byte) {
	t.Helper()
	_, err := s.Client().PutObject(context.Background(), s.Bucket(), name, bytes.NewReader(b), int64(len(b)), minio.PutObjectOptions{DisableMultipart: true})
	if err != nil {
		t.Fatal(err)
	}
}

// hookRT calls hook (once) before the first request matching match is
// sent, then forwards every request.
type hookRT struct {
	next  http.RoundTripper
	match func(*http.Request) bool
	once  sync.Once
	hook  func()
	seen  atomic.Int64 // matching requests
}

func (h *hookRT) RoundTrip(r *http.Request) (*http.Response, error) {
	if h.match(r) {
		h.seen.Add(1)
		h.once.Do(h.hook)
	}
	return h.next.RoundTrip(r)
}

func (h *hookRT) CloseIdleConnections() {
	if c, ok := h.next.(interface{ CloseIdleConnections() }); ok {
		c.CloseIdleConnections()
	}
}

// isRangedGet matches the GETs of a fetch (they carry a Range).
func isRangedGet(r *http.Request) bool {
	return r.Method == http.MethodGet && r.Header.Get("Range") != ""
}

func snapshotOps(rec *metrics.Recorder) map[string]uint64 {
	out := map[string]uint64{}
	for _, c := range rec.Snapshot().Remote.Ops {
		out[c.Op+"/"+c.Result] = c.Count
	}
	return out
}

// uploadedConv saves n tokens from base on an engine of its own root
// (rootA) and closes it, so every page is uploaded under a bucket prefix
// of the test's own.
func uploadedConv(t *testing.T, base, n int) (prefix, rootA string, conv []uint32, keys []layout.PageKey) {
	t.Helper()
	prefix, rootA = bucketPrefix(t), t.TempDir()
	conv = seq(base, n)
	keys = keysOf(t, conv)
	a := newEngine(t, rootA, prefix, newRecorder(t), nil)
	save(t, a, conv)
	closeEngine(t, a)
	return prefix, rootA, conv, keys
}
