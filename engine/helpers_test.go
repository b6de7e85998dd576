package engine

import (
	"bytes"
	"context"
	"log/slog"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvpersist/kvpersist/engine/jobs"
	"github.com/kvpersist/kvpersist/engine/layout"
	"github.com/kvpersist/kvpersist/internal/kvgen"
)

// TestMain (main_test.go, package engine_test) checks with goleak that no
// goroutine of any engine these tests start is left when they end.

// guard bounds every wait of these tests: it is a deadlock detector, never
// a timing assertion (a correct engine answers in milliseconds). The
// package's -timeout would catch a hang too, but without saying where.
const guard = 60 * time.Second

var bg = context.Background()

// guardTimer fires after guard: a deadlock detector for selects.
func guardTimer() <-chan time.Time { return time.After(guard) }

// recv receives from ch within guard.
func recv[T any](t testing.TB, ch <-chan T) T {
	t.Helper()
	select {
	case v := <-ch:
		return v
	case <-guardTimer():
		t.Fatalf("nothing received within %v", guard)
	}
	panic("unreachable")
}

// newEngineLogger is the tests' logger: silent.
func newEngineLogger() *slog.Logger { return slog.New(slog.DiscardHandler) }

// newEngine opens an engine on a fresh directory (NoSync, a silent logger
// unless given) and closes it when the test ends, checking that Close
// succeeds and releases the pool.
func newEngine(t testing.TB, cfg Config) *Engine {
	t.Helper()
	if cfg.Root == "" {
		cfg.Root = t.TempDir()
	}
	cfg.NoSync = true
	if cfg.Logger == nil {
		cfg.Logger = newEngineLogger()
	}
	e, err := New(cfg)
	if err != nil {
		t.Fatalf("New: %v", err)
	}
	t.Cleanup(func() {
		if err := e.Close(bg); err != nil {
			t.Errorf("Close: %v", err)
		}
		if !e.pool.IsClosed() {
			t.Errorf("pool not released after Close")
		}
	})
	return e
}

// fixtures caches test caches by geometry; they are read only once built.
var fixtures sync.Map // fixtureKey -> *fixture

type fixtureKey struct {
	model  string
	tokens int
	padded bool
}

type fixture struct {
	once     sync.Once
	cache    *kvgen.Cache
	expected [][]byte
}

// cacheOf returns a shared cache of model m with tokens tokens, built with
// ordinary memory, and its expected slot bytes (kvgen.Expected: computed
// element by element, independently of the buffers and strides).
func cacheOf(m kvgen.Model, tokens int, padded bool) (*kvgen.Cache, [][]byte) {
	v, _ := fixtures.LoadOrStore(fixtureKey{m.Name, tokens, padded}, &fixture{})
	f := v.(*fixture)
	f.once.Do(func() {
		f.cache = kvgen.NewCache(m, tokens, padded, nil)
		f.expected = make([][]byte, f.cache.Slots())
		for i := range f.expected {
			f.expected[i] = f.cache.Expected(i)
		}
	})
	return f.cache, f.expected
}

// writeReq builds the write request of cache c the way mlx-lm's caches are
// saved (as cmd/kvpersist's cacheRequest): per layer one entry with K and V,
// one attachment with the int32 token ids.
func writeReq(ref Ref, c *kvgen.Cache, lay layout.Layout, blockBytes int) *WriteRequest {
	views, dtypes := c.Views(), c.DTypes()
	off := layout.Meta{"type": []byte(`"KVCache"`), "offset": []byte(strconv.Itoa(c.Tokens))}
	r := &WriteRequest{Ref: ref, Layout: lay, BlockBytes: blockBytes,
		Meta: layout.Meta{"model": []byte(strconv.Quote(c.Model.Name)), "tokens": []byte(strconv.Itoa(c.Tokens))}}
	for l := 0; l < c.Model.Layers; l++ {
		r.Caches = append(r.Caches, jobs.EntrySpec{Meta: off, Tensors: []jobs.TensorSpec{
			{DType: dtypes[2*l], View: views[2*l]}, {DType: dtypes[2*l+1], View: views[2*l+1]},
		}})
	}
	n := len(views) - 1
	r.Attachments = []jobs.EntrySpec{{Meta: layout.Meta{"name": []byte(`"tokens"`)},
		Tensors: []jobs.TensorSpec{{DType: dtypes[n], View: views[n]}}}}
	return r
}

// slotBytes is each slot's size in bytes for model m at tokens tokens.
func slotBytes(m kvgen.Model, tokens int) []int {
	out := make([]int, 2*m.Layers+1)
	for i := range out {
		out[i] = m.TensorBytes(tokens)
	}
	out[len(out)-1] = tokens * kvgen.IDSize
	return out
}

// destOf allocates read destinations for model m at tokens tokens, filled
// with 0xA5 so that a slot left unwritten shows.
func destOf(m kvgen.Model, tokens int) [][]byte {
	sizes := slotBytes(m, tokens)
	out := make([][]byte, len(sizes))
	for i, n := range sizes {
		out[i] = bytes.Repeat([]byte{0xA5}, n)
	}
	return out
}

// equalSlots fails the test unless got equals want slot by slot.
func equalSlots(t testing.TB, what string, got, want [][]byte) {
	t.Helper()
	if len(got) != len(want) {
		t.Fatalf("%s: %d slots, want %d", what, len(got), len(want))
	}
	for i := range want {
		if !bytes.Equal(got[i], want[i]) {
			k := 0
			for k < min(len(got[i]), len(want[i])) && got[i][k] == want[i][k] {
				k++
			}
			t.Fatalf("%s: slot %d: %d bytes, want %d; first difference at byte %d", what, i, len(got[i]), len(want[i]), k)
		}
	}
}

// mustDo runs req to its ack and fails the test on any error.
func mustDo(t testing.TB, e *Engine, req Request) Result {
	t.Helper()
	r := e.Do(bg, req)
	if r.Err != nil {
		t.Fatalf("%T: %v", req, r.Err)
	}
	return r
}

// mustSubmit submits req and fails the test on error.
func mustSubmit(t testing.TB, e *Engine, ctx context.Context, req Request, opts ...SubmitOption) *Job {
	t.Helper()
	j, err := e.Submit(ctx, req, opts...)
	if err != nil {
		t.Fatalf("Submit %T: %v", req, err)
	}
	return j
}

// ack waits (within guard) for a job's Result on its own ack channel.
func ack(t testing.TB, j *Job) Result {
	t.Helper()
	select {
	case r := <-j.Ack:
		if r.ID != j.ID {
			t.Fatalf("ack of job %d carries ID %d", j.ID, r.ID)
		}
		return r
	case <-time.After(guard):
		t.Fatalf("no ack for job %d within %v", j.ID, guard)
	}
	panic("unreachable")
}

// ackOK waits for a job's ack and fails the test if it carries an error.
func ackOK(t testing.TB, j *Job) Result {
	t.Helper()
	r := ack(t, j)
	if r.Err != nil {
		t.Fatalf("job %d (%s %s): %v", j.ID, r.Kind, r.Ref, r.Err)
	}
	return r
}

// readBack restores ref into fresh buffers for model m at tokens tokens and
// compares them with the expected bytes.
func readBack(t testing.TB, e *Engine, ref Ref, m kvgen.Model, tokens int) {
	t.Helper()
	dest := destOf(m, tokens)
	r := mustDo(t, e, &ReadRequest{Ref: ref, Dest: dest})
	_, want := cacheOf(m, tokens, false)
	equalSlots(t, "read back "+ref.String(), dest, want)
	if r.Metrics.ReadBytes != int64(m.CacheBytes(tokens)) {
		t.Fatalf("read %s: ReadBytes %d, want %d", ref, r.Metrics.ReadBytes, m.CacheBytes(tokens))
	}
}

// hookLog is a testHook that records, in order, every job entering and
// leaving it ("enter write ns/name", "exit write ns/name", "enter collect"),
// holds jobs whose key has a hold until it is released, and panics for keys
// given panics. Only the test goroutine calls its wait methods.
type hookLog struct {
	mu      sync.Mutex
	events  []string
	changed chan struct{} // closed and replaced on every event
	holds   map[string]chan struct{}
	panics  map[string]int
}

// hookKey names a job for the hook: "write ns/name", "read ns/name", "collect".
func hookKey(kind Kind, ref Ref) string {
	if kind == KindCollect {
		return "collect"
	}
	return kind.String() + " " + ref.String()
}

// installHook sets testHook for this test (reset when it ends). Call it
// before newEngine: cleanups run last-in first-out, so every engine is
// closed, and no worker reads testHook, before it is reset.
func installHook(t testing.TB) *hookLog {
	h := &hookLog{changed: make(chan struct{}), holds: map[string]chan struct{}{}, panics: map[string]int{}}
	testHook = h.hook
	t.Cleanup(func() { testHook = nil })
	return h
}

func (h *hookLog) add(ev string) {
	h.mu.Lock()
	h.events = append(h.events, ev)
	close(h.changed)
	h.changed = make(chan struct{})
	h.mu.Unlock()
}

func (h *hookLog) hook(kind Kind, ref Ref) {
	k := hookKey(kind, ref)
	h.add("enter " + k)
	h.mu.Lock()
	rel := h.holds[k]
	boom := h.panics[k] > 0
	if boom {
		h.panics[k]--
	}
	h.mu.Unlock()
	if boom {
		h.add("panic " + k)
		panic("injected panic in " + k)
	}
	if rel != nil {
		<-rel
	}
	h.add("exit " + k)
}

// hold makes jobs of key k wait inside the hook until the returned release
// is called (idempotent; also called when the test ends, before the
// engine's Close, so a failing test does not hang).
func (h *hookLog) hold(t testing.TB, k string) (release func()) {
	ch := make(chan struct{})
	h.mu.Lock()
	h.holds[k] = ch
	h.mu.Unlock()
	var once sync.Once
	release = func() { once.Do(func() { close(ch) }) }
	t.Cleanup(release)
	return release
}

// panicOnce makes the next job of key k panic inside the hook.
func (h *hookLog) panicOnce(k string) {
	h.mu.Lock()
	h.panics[k]++
	h.mu.Unlock()
}

// count is how many times ev has been recorded.
func (h *hookLog) count(ev string) int {
	h.mu.Lock()
	defer h.mu.Unlock()
	n := 0
	for _, x := range h.events {
		if x == ev {
			n++
		}
	}
	return n
}

// index is the position of the n-th (1-based) occurrence of ev, -1 if none.
func (h *hookLog) index(ev string, n int) int {
	h.mu.Lock()
	defer h.mu.Unlock()
	for i, x := range h.events {
		if x == ev {
			n--
			if n == 0 {
				return i
			}
		}
	}
	return -1
}

// snapshot returns a copy of the events so far.
func (h *hookLog) snapshot() []string {
	h.mu.Lock()
	defer h.mu.Unlock()
	return slices.Clone(h.events)
}

// await blocks until ev has been recorded at least n times.
func (h *hookLog) await(t testing.TB, ev string, n int) {
	t.Helper()
	deadline := time.After(guard)
	for {
		h.mu.Lock()
		c, ch := 0, h.changed
		for _, x := range h.events {
			if x == ev {
				c++
			}
		}
		h.mu.Unlock()
		if c >= n {
			return
		}
		select {
		case <-ch:
		case <-deadline:
			t.Fatalf("%q not seen %d time(s) within %v; events: %s", ev, n, guard, strings.Join(h.snapshot(), ", "))
		}
	}
}

// before fails the test unless the a-th occurrence of event a precedes the
// b-th occurrence of event b (both recorded).
func (h *hookLog) before(t testing.TB, a string, an int, b string, bn int) {
	t.Helper()
	ia, ib := h.index(a, an), h.index(b, bn)
	if ia < 0 || ib < 0 || ia >= ib {
		t.Fatalf("want %q #%d before %q #%d; events: %s", a, an, b, bn, strings.Join(h.snapshot(), ", "))
	}
}

func refOf(ns, name string) Ref { return Ref{Namespace: ns, Name: name} }
