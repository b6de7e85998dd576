package engine

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"os"
	"sort"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/kvpersist/kvpersist/engine/jobs"
	"github.com/kvpersist/kvpersist/engine/layout"
	"github.com/kvpersist/kvpersist/internal/kvgen"
	"github.com/kvpersist/kvpersist/internal/testutil"
	"golang.org/x/sys/unix"
)

// arena hands out memory outside the Go heap: one anonymous mmap per buffer
// (page aligned), so that a job's memory can be made PROT_NONE on its own.
// A touch of PROT_NONE memory is a SIGSEGV, which the Go runtime turns into
// a fatal "unexpected fault address": the test process dies. Every mapping
// is unmapped when the test ends (after the engines it lent memory to are
// closed: create the arena before them).
type arena struct {
	t    testing.TB
	mu   sync.Mutex
	maps [][]byte
}

// region is the memory of one job: every mapping behind its buffers.
type region struct{ maps [][]byte }

func newArena(t testing.TB) *arena {
	a := &arena{t: t}
	t.Cleanup(a.free)
	return a
}

// alloc maps n bytes (at least one page) read-write and records it in r.
func (a *arena) alloc(r *region, n int) []byte {
	page := os.Getpagesize()
	size := max(page, (n+page-1)/page*page)
	b, err := unix.Mmap(-1, 0, size, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_ANON|unix.MAP_PRIVATE)
	if err != nil {
		panic(fmt.Sprintf("mmap %d bytes: %v", size, err)) // on the test goroutine or a submitter
	}
	a.mu.Lock()
	a.maps = append(a.maps, b)
	a.mu.Unlock()
	r.maps = append(r.maps, b)
	return b[:n:n]
}

// cache builds a kvgen cache whose every buffer is its own mapping.
func (a *arena) cache(m kvgen.Model, tokens int, padded bool) (*kvgen.Cache, *region) {
	r := &region{}
	c := kvgen.NewCache(m, tokens, padded, func(n int) []byte { return a.alloc(r, n) })
	return c, r
}

// dest maps one read destination per slot of model m at tokens tokens.
func (a *arena) dest(m kvgen.Model, tokens int) ([][]byte, *region) {
	r := &region{}
	sizes := slotBytes(m, tokens)
	out := make([][]byte, len(sizes))
	for i, n := range sizes {
		out[i] = a.alloc(r, n)
	}
	return out, r
}

// protect sets the protection of every mapping of the region.
func (r *region) protect(prot int) error {
	for _, b := range r.maps {
		if err := unix.Mprotect(b, prot); err != nil {
			return fmt.Errorf("mprotect: %w", err)
		}
	}
	return nil
}

// protectAll makes every mapping so far PROT_NONE.
func (a *arena) protectAll() {
	a.mu.Lock()
	defer a.mu.Unlock()
	for _, b := range a.maps {
		if err := unix.Mprotect(b, unix.PROT_NONE); err != nil {
			a.t.Fatalf("mprotect: %v", err)
		}
	}
}

func (a *arena) free() {
	a.mu.Lock()
	defer a.mu.Unlock()
	for _, b := range a.maps {
		if err := unix.Munmap(b); err != nil {
			a.t.Errorf("munmap: %v", err)
		}
	}
	a.maps = nil
}

// invPath is a snapshot path of the invariant test: its geometry never
// changes, so whichever write of it last succeeded, it reads back as the
// expected bytes of (model, tokens).
type invPath struct {
	ref    Ref
	model  kvgen.Model
	tokens int
}

// invJob is one submitted request and what became of it.
type invJob struct {
	id     uint64
	kind   Kind
	path   *invPath
	mem    *region
	dest   [][]byte
	own    *Job // nil when acked on the shared channel
	res    Result
	acks   atomic.Int32
	subErr error
}

// THE ACK INVARIANT: the engine never touches a job's buffers after its ack.
// Every tensor of every write and every destination of every read is its
// own mmap; the moment a job's ack arrives, its memory becomes PROT_NONE, so
// any later touch kills the test process. Concurrent writes (both layouts,
// padded and not, segmented and packed, Tiny and small Llama-3.1-8B) and
// reads run on a small pool with a small mailbox, some submitted with
// TrySubmit, some acked on one shared caller channel; some are cancelled
// right after Submit or from inside the pool, some panic inside the pool,
// collects run beside them, and Close (whose ctx is then cancelled) comes in
// the middle while submitters keep going. A refused submit makes its memory
// PROT_NONE at once (the engine never had it). At the end: every accepted
// job was acked exactly once with nil or an expected error, every read that
// succeeded holds exactly the expected bytes, and every path still reads
// back and verifies.
func TestAckInvariant(t *testing.T) {
	h := installHook(t)
	// Injected trouble, consumed by the hook in order per job key.
	var (
		actMu     sync.Mutex
		actions   = map[string][]func(){}
		panics    atomic.Int64
		closing   atomic.Bool
		closeOnce sync.Once
	)
	closeCtx, cancelClose := context.WithCancel(bg)
	defer cancelClose()
	testHook = func(kind Kind, ref Ref) {
		if closing.Load() {
			closeOnce.Do(cancelClose) // Close's ctx ends while jobs run
		}
		k := hookKey(kind, ref)
		actMu.Lock()
		var act func()
		if q := actions[k]; len(q) > 0 {
			act, actions[k] = q[0], q[1:]
		}
		actMu.Unlock()
		if act != nil {
			act()
		}
		h.hook(kind, ref)
	}
	addAction := func(k string, f func()) {
		actMu.Lock()
		actions[k] = append(actions[k], f)
		actMu.Unlock()
	}

	a := newArena(t)
	root := t.TempDir()
	e, err := New(Config{Root: root, Workers: 3, Mailbox: 6, BlockBytes: 16 << 10, NoSync: true, Logger: newEngineLogger()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { e.Close(bg) }) // before the arena unmaps (LIFO)

	var paths []*invPath
	for ns := range 3 {
		for p := range 4 {
			ip := &invPath{ref: refOf(fmt.Sprintf("inv%d", ns), fmt.Sprintf("p%d", p)), model: kvgen.Tiny, tokens: []int{40, 64, 100}[(ns+p)%3]}
			if ns == 0 && p == 3 { // 65 tensors, 513 blocks: one such path
				ip.model, ip.tokens = kvgen.Llama31_8B, 8
			}
			paths = append(paths, ip)
			c, _ := cacheOf(ip.model, ip.tokens, false)
			mustDo(t, e, writeReq(ip.ref, c, layout.Layout(1+(ns+p)%2), 0))
		}
	}

	var (
		mu       sync.Mutex
		all      []*invJob
		byID     = map[uint64]*invJob{}
		acked    int
		ackedCh  = make(chan struct{}, 1024)
		waiters  sync.WaitGroup
		sharedMu sync.Mutex // held across Submit of shared-channel jobs: their ID is known before their ack is looked up
	)
	shared := make(chan Result, 1024)
	onAck := func(j *invJob, r Result) {
		// First thing: the job's memory becomes untouchable.
		if err := j.mem.protect(unix.PROT_NONE); err != nil {
			panic(err)
		}
		j.res = r
		j.acks.Add(1)
		mu.Lock()
		acked++
		mu.Unlock()
		ackedCh <- struct{}{}
	}
	collector := make(chan struct{})
	go func() {
		defer close(collector)
		for r := range shared {
			mu.Lock()
			j := byID[r.ID]
			mu.Unlock()
			if j == nil { // acked before its submitter registered it
				sharedMu.Lock()
				mu.Lock()
				j = byID[r.ID]
				mu.Unlock()
				sharedMu.Unlock()
			}
			if j == nil {
				panic(fmt.Sprintf("Result for unknown job %d", r.ID))
			}
			onAck(j, r)
		}
	}()

	const submitters, perSubmitter = 4, 36
	var wg sync.WaitGroup
	for s := range submitters {
		wg.Go(func() {
			rng := rand.New(rand.NewPCG(uint64(s), 42))
			var cancels []context.CancelFunc
			defer func() {
				for _, c := range cancels {
					c()
				}
			}()
			for range perSubmitter {
				p := paths[rng.IntN(len(paths))]
				j := &invJob{path: p}
				var req Request
				switch x := rng.IntN(10); {
				case x < 5:
					c, mem := a.cache(p.model, p.tokens, rng.IntN(2) == 0)
					w := writeReq(p.ref, c, layout.Layout(1+rng.IntN(2)), []int{0, 4096}[rng.IntN(2)])
					w.Packed = rng.IntN(3) == 0
					req, j.kind, j.mem = w, KindWrite, mem
				case x < 9:
					dest, mem := a.dest(p.model, p.tokens)
					r := &ReadRequest{Ref: p.ref, Dest: dest, NoVerify: rng.IntN(2) != 0}
					req, j.kind, j.mem, j.dest = r, KindRead, mem, dest
				default:
					c := &CollectRequest{}
					if rng.IntN(2) == 0 {
						c.Namespaces = []string{p.ref.Namespace}
					}
					req, j.kind, j.mem, j.path = c, KindCollect, &region{}, nil
				}
				ctx, cancel := context.WithCancel(bg)
				cancels = append(cancels, cancel)
				key := hookKey(j.kind, p.ref)
				switch x := rng.IntN(100); {
				case x < 6:
					addAction(key, func() { panics.Add(1); panic("injected panic") })
				case x < 14:
					addAction(key, cancel)
				}
				useShared := rng.IntN(10) < 3
				try := rng.IntN(5) == 0
				submit := e.Submit
				if try {
					submit = e.TrySubmit
				}
				var job *Job
				var err error
				if useShared {
					sharedMu.Lock()
					job, err = submit(ctx, req, AckTo(shared))
					if err == nil {
						j.id = job.ID
						mu.Lock()
						byID[j.id] = j
						mu.Unlock()
					}
					sharedMu.Unlock()
				} else {
					job, err = submit(ctx, req)
				}
				if err != nil {
					// Refused: the engine never had this memory.
					if perr := j.mem.protect(unix.PROT_NONE); perr != nil {
						panic(perr)
					}
					j.subErr = err
				} else if !useShared {
					j.id, j.own = job.ID, job
					mu.Lock()
					byID[j.id] = j
					mu.Unlock()
					waiters.Go(func() { onAck(j, <-job.Ack) })
				}
				if rng.IntN(10) == 0 {
					cancel() // right after Submit: pending, running or done
				}
				mu.Lock()
				all = append(all, j)
				mu.Unlock()
			}
		})
	}

	// Close in the middle: once a good part of the jobs have been acked
	// (or, should too many have been refused, once every submit is done).
	submittersDone := make(chan struct{})
	go func() { wg.Wait(); close(submittersDone) }()
wait:
	for n := 0; n < submitters*perSubmitter/2; n++ {
		select {
		case <-ackedCh:
		case <-submittersDone:
			break wait
		case <-guardTimer():
			t.Fatalf("only %d acks within %v", n, guard)
		}
	}
	closing.Store(true)
	closeErr := e.Close(closeCtx)
	if closeErr != nil && !errors.Is(closeErr, context.Canceled) {
		t.Fatalf("Close: %v", closeErr)
	}
	<-submittersDone
	waiters.Wait()
	close(shared) // Close has returned: the engine sends nothing more
	<-collector

	counts := map[string]int{}
	var nPanic int64
	for _, j := range all {
		if j.subErr != nil {
			if !errors.Is(j.subErr, ErrBusy) && !errors.Is(j.subErr, ErrClosed) && !errors.Is(j.subErr, context.Canceled) {
				t.Errorf("submit %s: unexpected error %v", j.kind, j.subErr)
			}
			counts["refused "+errName(j.subErr)]++
			continue
		}
		if n := j.acks.Load(); n != 1 {
			t.Errorf("job %d (%s) acked %d times", j.id, j.kind, n)
			continue
		}
		if j.own != nil && len(j.own.Ack) != 0 {
			t.Errorf("job %d (%s): a second Result on its channel", j.id, j.kind)
		}
		r := j.res
		if r.ID != j.id || r.Kind != j.kind {
			t.Errorf("job %d (%s): Result for job %d (%s)", j.id, j.kind, r.ID, r.Kind)
		}
		switch {
		case r.Err == nil:
		case errors.Is(r.Err, jobs.ErrPanic):
			nPanic++
		case errors.Is(r.Err, context.Canceled), errors.Is(r.Err, ErrClosed):
		default:
			t.Errorf("job %d (%s %v): unexpected error %v", j.id, j.kind, r.Ref, r.Err)
		}
		counts[j.kind.String()+" "+errName(r.Err)]++
		if j.kind == KindRead && r.Err == nil {
			if err := j.mem.protect(unix.PROT_READ); err != nil {
				t.Fatal(err)
			}
			_, want := cacheOf(j.path.model, j.path.tokens, false)
			equalSlots(t, fmt.Sprintf("read %d of %s", j.id, j.path.ref), j.dest, want)
			if err := j.mem.protect(unix.PROT_NONE); err != nil {
				t.Fatal(err)
			}
		}
	}
	if nPanic != panics.Load() {
		t.Errorf("%d panics injected, %d acked as jobs.ErrPanic", panics.Load(), nPanic)
	}
	keys := make([]string, 0, len(counts))
	for k := range counts {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	for _, k := range keys {
		t.Logf("%-24s %d", k, counts[k])
	}
	t.Logf("Close: %v; Stats: %+v", closeErr, e.Stats())
	if counts["write ok"] == 0 || counts["read ok"] == 0 {
		t.Errorf("no write or no read succeeded: %v", counts)
	}
	if s := e.Stats(); s.Queued != 0 || s.Running != 0 || s.Completed != int64(acked)+int64(len(paths)) {
		t.Errorf("Stats %+v after %d acks (+%d setup writes)", s, acked, len(paths))
	}
	if tmp := testutil.TempFiles(t, root); len(tmp) != 0 {
		t.Errorf("temp files left: %v", tmp)
	}
	// Every path still reads back and verifies (its last successful write,
	// or the setup one).
	for _, p := range paths {
		dest := destOf(p.model, p.tokens)
		cfg := &jobs.Config{Root: root, NoSync: true}
		if _, _, err := jobs.Read(bg, cfg, &jobs.ReadRequest{Ref: p.ref, Dest: dest}); err != nil {
			t.Fatalf("final read of %s: %v", p.ref, err)
		}
		_, want := cacheOf(p.model, p.tokens, false)
		equalSlots(t, "final "+p.ref.String(), dest, want)
	}
}

func errName(err error) string {
	switch {
	case err == nil:
		return "ok"
	case errors.Is(err, ErrBusy):
		return "busy"
	case errors.Is(err, ErrClosed):
		return "closed"
	case errors.Is(err, jobs.ErrPanic):
		return "panic"
	case errors.Is(err, context.Canceled):
		return "canceled"
	}
	return "other"
}

// panicHandler is a slog.Handler that panics on every warning.
type panicHandler struct{}

func (panicHandler) Enabled(context.Context, slog.Level) bool { return true }
func (panicHandler) Handle(_ context.Context, r slog.Record) error {
	if r.Level == slog.LevelWarn {
		panic("handler bug") // only on warn: the pool's panic handler logs at error
	}
	return nil
}
func (h panicHandler) WithAttrs([]slog.Attr) slog.Handler { return h }
func (h panicHandler) WithGroup(string) slog.Handler      { return h }

// TestEveryJobIsAckedWhenTheLoggerPanics: a caller's slog.Handler that
// panics (a bug of theirs) when the engine logs a failed job costs neither
// the job's ack nor its completion: Do returns and Close does not hang.
func TestEveryJobIsAckedWhenTheLoggerPanics(t *testing.T) {
	e, err := New(Config{Root: t.TempDir(), NoSync: true, Logger: slog.New(panicHandler{})})
	if err != nil {
		t.Fatal(err)
	}
	// An invalid write (no tensors): fails fast, logged at warn.
	job, err := e.Submit(context.Background(), &WriteRequest{Ref: Ref{Namespace: "ns", Name: "a"}, Layout: layout.Single})
	if err != nil {
		t.Fatal(err)
	}
	select {
	case res := <-job.Ack:
		t.Logf("acked: %v", res.Err)
		e.Close(context.Background())
	case <-guardTimer():
		t.Fatalf("job not acked within %v after a panic in the logger (engine left running: Close would hang)", guard)
	}
}
