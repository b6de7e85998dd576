package engine_test

// Concurrency soak: thousands of mixed jobs from several goroutines on a
// two-worker engine, with random cancels, and Close while jobs are still
// queued. Run it under -race (make test does).

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"math/rand/v2"
	"path/filepath"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvpersist/kvpersist/engine"
	"github.com/kvpersist/kvpersist/engine/jobs"
	"github.com/kvpersist/kvpersist/engine/layout"
	"github.com/kvpersist/kvpersist/internal/kvgen"
	"go.uber.org/goleak"
)

// soakTokens are the token counts every write draws from: small (a Tiny
// snapshot is 4 KiB to 66 KiB), some sharing full 128-token blocks, some
// identical across paths and namespaces.
var soakTokens = []int{16, 100, 128, 129, 200, 256}

// soakPaths are the snapshot paths: two namespaces, overlapping names, one
// path per layout and one that switches layout from write to write.
var soakPaths = []struct {
	ref     engine.Ref
	layouts []layout.Layout
}{
	{engine.Ref{Namespace: "a", Name: "p0"}, []layout.Layout{layout.Blocks}},
	{engine.Ref{Namespace: "a", Name: "p1"}, []layout.Layout{layout.Single}},
	{engine.Ref{Namespace: "a", Name: "p2"}, []layout.Layout{layout.Blocks, layout.Single}},
	{engine.Ref{Namespace: "b", Name: "p0"}, []layout.Layout{layout.Blocks}},
	{engine.Ref{Namespace: "b", Name: "p2"}, []layout.Layout{layout.Single, layout.Blocks}},
}

// soakOp is an accepted job awaiting its ack.
type soakOp struct {
	kind     engine.Kind
	path     string
	seq      int64        // write
	tokens   int          // write
	dest     [][]byte     // read
	canceled bool         // its context may have been cancelled
	closing  *atomic.Bool // set when its engine's Close was told to abort
}

// soakWrite is what became of one write.
type soakWrite struct {
	path string
	ok   bool
	recv int64 // position of its ack on the shared channel
}

// soak is the state of a soak run, shared by the submitters and the ack
// collector.
type soak struct {
	t     *testing.T
	root  string
	cache *kvgen.Cache
	seq   atomic.Int64
	// lastTokens holds, per path, the tokens of the last write submitted
	// there: a read that allocates for them usually finds that version.
	lastTokens sync.Map // path -> int

	mu       sync.Mutex
	waiting  map[uint64]*soakOp       // accepted, ack not yet seen
	early    map[uint64]engine.Result // acked before its Submit returned
	ackCount map[uint64]int           // acks seen per job ID, this round (IDs restart per engine)
	recvOf   map[uint64]int64         // write job ID -> position of its ack, this round
	recv     int64                    // acks received on shared channels, all rounds
	writes   map[int64]*soakWrite     // seq -> write
	readSeqs map[int64]string         // seqs returned by successful reads -> path read
	errs     []string

	n struct {
		writesOK, writesCanceled, writesClosed         atomic.Int64
		readsOK, readsRefused, readsCanceled, readsNew atomic.Int64
		collects, collectsCanceled, busy, submitErrs   atomic.Int64
		sharedWrites, blocksDeleted                    atomic.Int64
	}
}

func (s *soak) errorf(format string, a ...any) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if len(s.errs) < 20 {
		s.errs = append(s.errs, fmt.Sprintf(format, a...))
	}
}

// accepted registers an accepted job; an ack that already came is checked now.
func (s *soak) accepted(id uint64, op *soakOp) {
	s.mu.Lock()
	if r, ok := s.early[id]; ok {
		delete(s.early, id)
		s.mu.Unlock()
		s.check(op, r)
		return
	}
	s.waiting[id] = op
	s.mu.Unlock()
}

// received counts an ack from the shared channel (in channel order) and
// checks it, or parks it until its Submit returns.
func (s *soak) received(r engine.Result) {
	s.mu.Lock()
	s.ackCount[r.ID]++
	s.recv++
	if r.Kind == engine.KindWrite {
		// Writes to one path run one at a time in submission order and each
		// is acked before the next starts: channel order is that order.
		s.recvOf[r.ID] = s.recv
	}
	op, ok := s.waiting[r.ID]
	if !ok {
		s.early[r.ID] = r
		s.mu.Unlock()
		return
	}
	delete(s.waiting, r.ID)
	s.mu.Unlock()
	s.check(op, r)
}

// clearError reports whether err is an error a job may meet in this soak
// without anything being wrong: its context was cancelled, its engine closed
// with an aborted Close, or (reads) the snapshot was never written or is not
// the shape the caller allocated for.
func clearError(op *soakOp, err error) bool {
	switch {
	case op.canceled && errors.Is(err, context.Canceled):
		return true
	case op.closing.Load() && errors.Is(err, engine.ErrClosed):
		return true
	case op.kind == engine.KindRead:
		return errors.Is(err, fs.ErrNotExist) || errors.Is(err, jobs.ErrDestination) || errors.Is(err, jobs.ErrMismatch)
	}
	return false
}

// check checks one job's ack against what was asked.
func (s *soak) check(op *soakOp, r engine.Result) {
	if r.Kind != op.kind {
		s.errorf("job %d: ack of kind %v, submitted %v", r.ID, r.Kind, op.kind)
		return
	}
	if r.Err != nil && !clearError(op, r.Err) {
		s.errorf("%v job %d on %s: unexpected error: %v", op.kind, r.ID, op.path, r.Err)
		return
	}
	switch op.kind {
	case engine.KindWrite:
		s.mu.Lock()
		w := &soakWrite{path: op.path, ok: r.Err == nil, recv: s.recvOf[r.ID]}
		s.writes[op.seq] = w
		s.mu.Unlock()
		switch {
		case r.Err == nil:
			s.n.writesOK.Add(1)
			if v, err := versionOf(r.Header); err != nil || v.Seq != op.seq || v.Tokens != op.tokens {
				s.errorf("write seq %d: ack header holds %+v (%v)", op.seq, v, err)
			}
		case errors.Is(r.Err, engine.ErrClosed):
			s.n.writesClosed.Add(1)
		default:
			s.n.writesCanceled.Add(1)
		}
	case engine.KindRead:
		switch {
		case r.Err == nil:
			v, err := versionOf(r.Header)
			if err == nil {
				err = checkContent(op.dest, v.Tokens)
			}
			if err != nil {
				s.errorf("read of %s returned bytes of no complete version: %v", op.path, err)
				return
			}
			s.mu.Lock()
			s.readSeqs[v.Seq] = op.path
			s.mu.Unlock()
			s.n.readsOK.Add(1)
		case errors.Is(r.Err, fs.ErrNotExist):
			s.n.readsNew.Add(1)
		case errors.Is(r.Err, jobs.ErrDestination) || errors.Is(r.Err, jobs.ErrMismatch):
			s.n.readsRefused.Add(1)
		default:
			s.n.readsCanceled.Add(1)
		}
	case engine.KindCollect:
		if r.Err != nil {
			s.n.collectsCanceled.Add(1)
			return
		}
		cm := r.Metrics.Collect
		if cm == nil || len(cm.Unreadable) > 0 || len(cm.UnsweptNamespaces) > 0 {
			s.errorf("collect job %d: %+v", r.ID, cm)
			return
		}
		for _, sk := range cm.Skipped {
			// A namespace named in the request that no write created yet
			// is skipped; nothing else in this store is unrecognised.
			if sk != filepath.Join(s.root, "a") && sk != filepath.Join(s.root, "b") {
				s.errorf("collect job %d skipped %s", r.ID, sk)
			}
		}
		s.n.collects.Add(1)
		s.n.blocksDeleted.Add(cm.BlocksDeleted)
	}
}

// TestSoak runs rounds of a soak on one store, each on a new engine with two
// workers: six goroutines submit a mix of writes (both layouts, overlapping
// paths, the same content into both namespaces), reads (allocated from Stat
// with Expect, or for the size of the last write submitted, or a guess) and
// collects (all namespaces, one, dry runs), one in ten by TrySubmit and one
// read or collect in ten through Do; one job in ten is cancelled at a random
// moment within 2 ms, one in ten right after Submit returns; then Close with
// jobs still queued (every other round with an already-ended
// context, which cancels them). It checks that every accepted job is acked
// exactly once (per job ID; Stats agree); that every successful read holds
// exactly the bytes of one complete version, one that a successful write
// produced for that path; that every error is a clear one (cancelled,
// closed, not written yet, replaced by another shape); that each path ends
// holding its last successful write; that every snapshot reads back verified
// before and after a final collect (no referenced block lost); and that no
// goroutine is left.
func TestSoak(t *testing.T) {
	defer goleak.VerifyNone(t, goleak.IgnoreCurrent())
	rounds, ops := 2, 1000
	if soakLong() {
		rounds, ops = 5, 8000
	}
	seed := uint64(time.Now().UnixNano())
	t.Logf("seed %d: %d rounds of %d operations", seed, rounds, ops)
	s := &soak{
		t: t, root: t.TempDir(), cache: kvgen.NewCache(kvgen.Tiny, slices.Max(soakTokens), true, nil),
		writes: map[int64]*soakWrite{}, readSeqs: map[int64]string{},
	}
	start := time.Now()
	for round := 0; round < rounds && !t.Failed(); round++ {
		s.round(round, ops, seed+uint64(round)*1000, round%2 == 1)
	}
	s.finish()
	t.Logf("%d operations in %v: writes %d ok, %d cancelled, %d closed (%d into both namespaces); reads %d exact, %d refused (shape changed), %d before any write, %d cancelled or closed; collects %d (%d blocks deleted), %d cancelled or closed; %d TrySubmit ErrBusy, %d submits refused for a cancelled context",
		rounds*ops, time.Since(start).Round(time.Millisecond),
		s.n.writesOK.Load(), s.n.writesCanceled.Load(), s.n.writesClosed.Load(), s.n.sharedWrites.Load(),
		s.n.readsOK.Load(), s.n.readsRefused.Load(), s.n.readsNew.Load(), s.n.readsCanceled.Load(),
		s.n.collects.Load(), s.n.blocksDeleted.Load(), s.n.collectsCanceled.Load(), s.n.busy.Load(), s.n.submitErrs.Load())
}

// round runs one engine: ops operations from six goroutines, then Close.
func (s *soak) round(round, ops int, seed uint64, abort bool) {
	t := s.t
	e, err := engine.New(engine.Config{Root: s.root, Workers: 2, Mailbox: 32, BlockBytes: tinyBlockBytes, NoSync: true, Logger: discardLogger})
	if err != nil {
		t.Fatal(err)
	}
	s.mu.Lock()
	s.waiting, s.early, s.ackCount, s.recvOf = map[uint64]*soakOp{}, map[uint64]engine.Result{}, map[uint64]int{}, map[uint64]int64{}
	s.mu.Unlock()
	closing := &atomic.Bool{}
	acks := make(chan engine.Result, ops+16) // never full: the engine never waits on it
	collected := make(chan struct{})
	go func() { // owned by round: ends when acks is closed after Close
		defer close(collected)
		for r := range acks {
			s.received(r)
		}
	}()
	var accepted, direct atomic.Int64 // jobs accepted; of them acked through Do
	var cancels []context.CancelFunc
	var cancelsMu sync.Mutex
	var wg sync.WaitGroup
	const submitters = 6
	for g := 0; g < submitters; g++ {
		wg.Go(func() {
			rng := rand.New(rand.NewPCG(seed, uint64(g)))
			for i := g; i < ops; i += submitters {
				s.one(e, rng, closing, acks, &accepted, &direct, func(cancel context.CancelFunc) {
					cancelsMu.Lock()
					cancels = append(cancels, cancel)
					cancelsMu.Unlock()
				})
			}
		})
	}
	wg.Wait()
	// Close with jobs still queued; an aborted Close cancels them.
	ctx := context.Background()
	if abort {
		c, cancel := context.WithCancel(ctx)
		cancel()
		ctx = c
		closing.Store(true)
	}
	if err := e.Close(ctx); err != nil && !(abort && errors.Is(err, context.Canceled)) {
		t.Errorf("round %d: Close: %v", round, err)
	}
	for _, c := range cancels {
		c()
	}
	close(acks) // Close returned: every ack was sent
	<-collected
	if _, err := e.Submit(context.Background(), &engine.CollectRequest{}); !errors.Is(err, engine.ErrClosed) {
		t.Errorf("round %d: Submit after Close: %v, want ErrClosed", round, err)
	}

	s.mu.Lock()
	defer s.mu.Unlock()
	for _, msg := range s.errs {
		t.Error(msg)
	}
	s.errs = nil
	if len(s.waiting) > 0 || len(s.early) > 0 {
		t.Errorf("round %d: %d accepted jobs never acked, %d acks of jobs never accepted", round, len(s.waiting), len(s.early))
	}
	shared := int64(0)
	for id, n := range s.ackCount {
		if n != 1 {
			t.Errorf("round %d: job %d acked %d times", round, id, n)
		}
		shared++
	}
	if shared+direct.Load() != accepted.Load() {
		t.Errorf("round %d: %d acks on the shared channel + %d through Do, %d jobs accepted", round, shared, direct.Load(), accepted.Load())
	}
	st := e.Stats()
	if st.Completed != accepted.Load() || st.Queued != 0 || st.Running != 0 {
		t.Errorf("round %d: stats %+v, %d jobs accepted", round, st, accepted.Load())
	}
}

// one submits one random operation. One in ten is cancelled at a random
// moment up to 2 ms later, one in ten right after Submit returns; keep
// receives what to call at the end of the round (every cancel and timer stop).
func (s *soak) one(e *engine.Engine, rng *rand.Rand, closing *atomic.Bool,
	acks chan engine.Result, accepted, direct *atomic.Int64, keep func(context.CancelFunc)) {
	ctx, canceled := context.Background(), false
	var cancelNow context.CancelFunc
	switch rng.IntN(10) {
	case 0:
		c, cancel := context.WithCancel(ctx)
		tm := time.AfterFunc(time.Duration(rng.IntN(2000))*time.Microsecond, cancel)
		keep(cancel)
		keep(func() { tm.Stop() })
		ctx, canceled = c, true
	case 1:
		c, cancel := context.WithCancel(ctx)
		keep(cancel)
		ctx, canceled, cancelNow = c, true, cancel
	}
	submit := e.Submit
	if rng.IntN(10) == 0 {
		submit = e.TrySubmit
	}
	// viaDo runs req through Do (its own ack channel) instead.
	viaDo := rng.IntN(10) == 0
	run := func(op *soakOp, req engine.Request) {
		if viaDo {
			r := e.Do(ctx, req)
			if r.ID == 0 { // not accepted
				s.submitErr(op, r.Err)
				return
			}
			accepted.Add(1)
			direct.Add(1)
			s.check(op, r)
			return
		}
		j, err := submit(ctx, req, engine.AckTo(acks))
		if cancelNow != nil {
			cancelNow()
		}
		if err != nil {
			s.submitErr(op, err)
			return
		}
		accepted.Add(1)
		s.accepted(j.ID, op)
	}
	p := soakPaths[rng.IntN(len(soakPaths))]
	path := filepath.Join(s.root, p.ref.Namespace, p.ref.Name)
	switch k := rng.IntN(100); {
	case k < 50: // write; one in four into both namespaces (same name, tokens, layout)
		viaDo = false // writes' acks are ordered on the shared channel
		tokens := soakTokens[rng.IntN(len(soakTokens))]
		lay := p.layouts[rng.IntN(len(p.layouts))]
		refs := []engine.Ref{p.ref}
		if rng.IntN(4) == 0 && p.ref.Name != "p1" {
			refs = []engine.Ref{{Namespace: "a", Name: p.ref.Name}, {Namespace: "b", Name: p.ref.Name}}
			lay = layout.Blocks
			s.n.sharedWrites.Add(1)
		}
		packed := rng.IntN(4) == 0
		for _, ref := range refs {
			v := version{Writer: "soak", Seq: s.seq.Add(1), Tokens: tokens}
			caches, atts := cacheEntries(s.cache, tokens)
			s.lastTokens.Store(filepath.Join(s.root, ref.Namespace, ref.Name), tokens)
			op := &soakOp{kind: engine.KindWrite, path: filepath.Join(s.root, ref.Namespace, ref.Name), seq: v.Seq, tokens: tokens, canceled: canceled, closing: closing}
			run(op, &engine.WriteRequest{Ref: ref, Layout: lay, Meta: v.meta(), Caches: caches, Attachments: atts, Packed: packed})
		}
	case k < 96: // read
		op := &soakOp{kind: engine.KindRead, path: path, canceled: canceled, closing: closing}
		req := &engine.ReadRequest{Ref: p.ref, NoVerify: rng.IntN(4) == 0}
		tokens := soakTokens[rng.IntN(len(soakTokens))] // a guess
		if v, ok := s.lastTokens.Load(path); ok && rng.IntN(3) > 0 {
			tokens = v.(int) // the version the read will likely meet
		}
		if snap, err := e.Stat(p.ref); err == nil && rng.IntN(2) == 0 {
			req.Expect = snap.Header // the version published now
			dest, err := destFor(snap.Header)
			if err != nil {
				s.errorf("Stat %s: %v", p.ref, err)
				return
			}
			op.dest = dest
		} else {
			for _, b := range expectedSlots(tokens) {
				op.dest = append(op.dest, make([]byte, len(b)))
			}
		}
		req.Dest = op.dest
		run(op, req)
	default: // collect
		op := &soakOp{kind: engine.KindCollect, canceled: canceled, closing: closing}
		req := &engine.CollectRequest{DryRun: rng.IntN(5) == 0}
		switch rng.IntN(4) {
		case 1:
			req.Namespaces = []string{"a"}
		case 2:
			req.Namespaces = []string{"b"}
		case 3:
			req.Namespaces = []string{"a", "b"}
		}
		run(op, req)
	}
}

// submitErr accounts for a job that was not accepted: TrySubmit's ErrBusy,
// or its context already cancelled. Anything else is an error.
func (s *soak) submitErr(op *soakOp, err error) {
	switch {
	case errors.Is(err, engine.ErrBusy):
		s.n.busy.Add(1)
	case op.canceled && errors.Is(err, context.Canceled):
		s.n.submitErrs.Add(1)
	default:
		s.errorf("Submit of a %v job: %v", op.kind, err)
	}
	if op.kind == engine.KindWrite {
		s.mu.Lock()
		s.writes[op.seq] = &soakWrite{path: op.path}
		s.mu.Unlock()
	}
}

// finish checks the store after the last round: each path holds its last
// successful write, every read returned a version a successful write made
// for that path, every snapshot verifies before and after a collect.
func (s *soak) finish() {
	t := s.t
	scan := scanStore(t, s.root)
	// The last successful write per path: the latest ack on the shared
	// channel (recv grows across rounds; one path's writes ack in order).
	last := map[string]*soakWrite{}
	lastSeq := map[string]int64{}
	for seq, w := range s.writes {
		if w.ok && (last[w.path] == nil || w.recv > last[w.path].recv) {
			last[w.path], lastSeq[w.path] = w, seq
		}
	}
	for _, p := range soakPaths {
		path := filepath.Join(s.root, p.ref.Namespace, p.ref.Name)
		got, ok := scan.snaps[path]
		switch want, wrote := lastSeq[path]; {
		case !wrote && ok:
			t.Errorf("%s holds %+v; no write to it succeeded", path, got.v)
		case wrote && (!ok || got.v.Seq != want):
			t.Errorf("%s holds %+v (present %v); its last successful write is seq %d", path, got.v, ok, want)
		}
	}
	for seq, path := range s.readSeqs {
		if w := s.writes[seq]; w == nil || !w.ok || w.path != path {
			t.Errorf("a read of %s returned seq %d, which is no successful write of that path (%+v)", path, seq, w)
		}
	}
	finalCollect(t, s.root, scan)
}
