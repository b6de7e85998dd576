package engine

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"runtime/debug"
	"slices"
	"time"

	"github.com/kvpersist/kvpersist/engine/jobs"
	"github.com/kvpersist/kvpersist/engine/layout"
)

// readBurst is how many reads may be started in a row while an eligible
// write waits, before one write goes first (reads have priority, writes do
// not starve).
const readBurst = 8

// When the pool refuses a job, the dispatcher retries on the next completion
// or helper exit (a kick), and on a timer from retryMin doubling up to
// retryMax: a task signals before its ants worker is back in the pool, so
// the retry right after a completion can still find the pool full, and no
// further event may come (Workers=1: the one worker just finished).
const (
	retryMin = 50 * time.Microsecond
	retryMax = 5 * time.Millisecond
)

// dispatcher owns all ordering state; only its goroutine touches it.
type dispatcher struct {
	e        *Engine
	seq      uint64
	pending  []*job            // accepted, not started, in submission order
	running  int               // started, not completed
	out      []*job            // outstanding (pending or running), submission order
	byPath   map[string][]*job // outstanding jobs per snapshot path
	readRun  int               // reads started in a row while a write waited
	draining bool              // mailbox closed
	aborted  bool              // Close's ctx ended: cancel every job
}

func newDispatcher(e *Engine) *dispatcher {
	return &dispatcher{e: e, byPath: map[string][]*job{}}
}

// run is the dispatcher goroutine. It exits when the mailbox is closed and
// every accepted job has been acked.
func (d *dispatcher) run() {
	e := d.e
	defer close(e.stopped)
	retry := time.NewTimer(retryMax)
	retry.Stop()
	defer retry.Stop()
	backoff := retryMin
	for {
		d.drain()
		if !d.aborted {
			select {
			case <-e.abort:
				d.abortAll()
			default:
			}
		}
		blocked := d.schedule()
		if d.draining && len(d.out) == 0 {
			return
		}
		var mailbox <-chan *job
		if !d.draining {
			mailbox = e.mailbox // Submit's slots bound it
		}
		var abort <-chan struct{}
		if !d.aborted {
			abort = e.abort // once seen, never again: it stays closed
		}
		var retryC <-chan time.Time
		if blocked {
			retry.Reset(backoff)
			retryC = retry.C
		}
		select {
		case j, ok := <-mailbox:
			if !ok {
				d.draining = true
			} else {
				d.accept(j)
			}
			backoff = retryMin
		case j := <-e.done:
			d.complete(j)
			backoff = retryMin
		case <-e.kickCh:
			backoff = retryMin
		case <-abort:
		case <-retryC:
			backoff = min(2*backoff, retryMax)
		}
		retry.Stop() // Go >= 1.23 timers: no stale tick after Stop
	}
}

// drain accepts every job already in the mailbox, so that jobs submitted
// together are ordered and prioritised together.
func (d *dispatcher) drain() {
	for !d.draining {
		select {
		case j, ok := <-d.e.mailbox:
			if !ok {
				d.draining = true
				return
			}
			d.accept(j)
		default:
			return
		}
	}
}

// abortAll cancels every outstanding job (Close's ctx ended).
func (d *dispatcher) abortAll() {
	d.aborted = true
	for _, j := range d.out {
		j.cancel(ErrClosed)
	}
}

func (d *dispatcher) accept(j *job) {
	d.seq++
	j.seq = d.seq
	if d.aborted {
		j.cancel(ErrClosed)
	}
	d.pending = append(d.pending, j)
	d.out = append(d.out, j)
	if j.path != "" {
		d.byPath[j.path] = append(d.byPath[j.path], j)
	}
}

// complete forgets a started job whose ack has been sent.
func (d *dispatcher) complete(j *job) {
	d.running--
	d.forget(j)
}

func (d *dispatcher) forget(j *job) {
	d.out = slices.DeleteFunc(d.out, func(x *job) bool { return x == j })
	if j.path != "" {
		q := slices.DeleteFunc(d.byPath[j.path], func(x *job) bool { return x == j })
		if len(q) == 0 {
			delete(d.byPath, j.path)
		} else {
			d.byPath[j.path] = q
		}
	}
}

// overlaps reports whether two jobs' namespace scopes intersect (nil = all).
func overlaps(a, b *job) bool {
	if a.ns == nil || b.ns == nil {
		return true
	}
	for _, x := range a.ns {
		if slices.Contains(b.ns, x) {
			return true
		}
	}
	return false
}

// nsExclusive reports whether a job kind runs alone in its namespaces.
func nsExclusive(k Kind) bool { return k == KindCollect || k == KindMigrate }

// eligible applies the ordering rules to a pending job:
//   - per path, in submission order: a write (or delete) waits for every
//     earlier job on its path; a read waits for earlier writes and deletes
//     on its path (reads of one path may run together);
//   - a collect or a migrate (a write to whole namespaces) waits for every
//     earlier job in its namespaces, and every later job in those
//     namespaces waits for it.
func (d *dispatcher) eligible(j *job) bool {
	if j.path != "" {
		for _, x := range d.byPath[j.path] {
			if x == j {
				break
			}
			if j.kind != KindRead || x.kind != KindRead { // a write or a delete
				return false
			}
		}
	}
	for _, x := range d.out {
		if x == j {
			break
		}
		if (nsExclusive(j.kind) || nsExclusive(x.kind)) && overlaps(j, x) {
			return false
		}
	}
	return true
}

// schedule starts every job it can: cancelled pending jobs are acked at
// once; then eligible reads before eligible writes, with readBurst as the
// anti-starvation bound; collects in order with the rest. It reports whether
// a job could not start for want of a free worker.
func (d *dispatcher) schedule() (blocked bool) {
	e := d.e
	for i := 0; i < len(d.pending); {
		if j := d.pending[i]; j.ctx.Err() != nil {
			d.ackCancelled(j) // removes it from pending
			continue
		}
		i++
	}
	e.waiting.Store(false)
	for len(d.pending) > 0 {
		var read, other *job
		for _, j := range d.pending {
			if !d.eligible(j) {
				continue
			}
			if j.kind == KindRead || j.kind == KindLoadPrefix { // restores first
				if read == nil {
					read = j
				}
			} else if other == nil {
				other = j
			}
			if read != nil && other != nil {
				break
			}
		}
		pick := read
		if pick == nil || (other != nil && d.readRun >= readBurst) {
			pick = other
		}
		if pick == nil {
			return false
		}
		if !d.start(pick) {
			e.waiting.Store(true) // helpers yield so this one can start
			return true
		}
		if (pick.kind == KindRead || pick.kind == KindLoadPrefix) && other != nil {
			d.readRun++
		} else {
			d.readRun = 0
		}
	}
	return false
}

// ackCancelled acks a pending job whose context has ended, without a pool
// worker, so the ack is prompt even when every worker is busy. The engine's
// own ack channel takes it at once; a caller's channel may block, so a
// short-lived goroutine sends it and reports completion like a worker (the
// job stays outstanding until then, so later jobs of its path still wait).
func (d *dispatcher) ackCancelled(j *job) {
	e := d.e
	d.pending = slices.DeleteFunc(d.pending, func(x *job) bool { return x == j })
	j.started = true
	<-e.slots
	e.stats.queued.Add(-1)
	res := Result{ID: j.id, Kind: j.kind, Ref: j.ref, Err: ctxError(j.ctx)}
	e.settle(j, &res, false)
	if j.ownAck {
		j.ack <- res // capacity 1, sent once: never blocks
		d.forget(j)
		return
	}
	d.running++
	go func() {
		e.sendAck(j, res)
		e.done <- j
	}()
}

// start hands j to the pool; false when no worker is free.
func (d *dispatcher) start(j *job) bool {
	e := d.e
	if err := e.pool.Submit(func() { e.runJob(j) }); err != nil {
		return false
	}
	j.started = true
	d.running++
	d.pending = slices.DeleteFunc(d.pending, func(x *job) bool { return x == j })
	return true
}

// ctxError is the error of a job whose context has ended: ctx.Err(), also
// wrapping the cancellation cause when there is one (ErrClosed from Close).
func ctxError(ctx context.Context) error {
	err := ctx.Err()
	if cause := context.Cause(ctx); cause != nil && !errors.Is(err, cause) {
		return fmt.Errorf("%w: %w", cause, err)
	}
	return err
}

// runJob runs on a pool worker: the job, then its ack, then the completion
// notice to the dispatcher. It recovers any panic and always acks.
func (e *Engine) runJob(j *job) {
	<-e.slots // the job no longer waits: free its mailbox slot
	e.stats.queued.Add(-1)
	e.stats.running.Add(1)
	j.startedAt = time.Now()
	res := Result{ID: j.id, Kind: j.kind, Ref: j.ref}
	func() {
		defer func() {
			if r := recover(); r != nil {
				res.Header = nil
				res.Err = fmt.Errorf("%w: %s job %d (%s): %v\n%s", jobs.ErrPanic, j.kind, j.id, j.ref, r, debug.Stack())
			}
		}()
		if j.ctx.Err() != nil {
			res.Err = ctxError(j.ctx)
			return
		}
		e.execute(j, &res)
	}()
	e.settle(j, &res, true)
	// The ack: after it the caller owns its buffers again. Every helper task
	// of the job has finished (jobs.parallel waits for them).
	e.sendAck(j, res)
	e.done <- j
}

// settle finishes a job's bookkeeping before its ack: the ErrClosed cause,
// the job's context, the counters and the log.
func (e *Engine) settle(j *job, res *Result, ran bool) {
	if cause := context.Cause(j.ctx); res.Err != nil && errors.Is(cause, ErrClosed) && !errors.Is(res.Err, ErrClosed) {
		res.Err = fmt.Errorf("%w: %w", ErrClosed, res.Err)
	}
	j.stopAft()
	j.cancel(nil)
	s := &e.stats
	s.bytesWritten.Add(res.Metrics.WrittenBytes)
	s.bytesReused.Add(res.Metrics.ReusedBytes)
	s.bytesRead.Add(res.Metrics.ReadBytes)
	s.bytesReadDirect.Add(res.Metrics.DirectReadBytes)
	s.bytesReadAsync.Add(res.Metrics.AsyncReadBytes)
	if res.Err != nil {
		s.failed.Add(1)
		// Debug, not Warn: the error is the ack's, and the caller decides
		// whether it is worth a warning (a miss is often not).
		e.logSafe(slog.LevelDebug, "kvpersist: job failed", "id", j.id, "kind", j.kind, "ref", j.ref.String(), "err", res.Err)
	} else {
		e.logSafe(slog.LevelDebug, "kvpersist: job done", "id", j.id, "kind", j.kind, "ref", j.ref.String(),
			"written", res.Metrics.WrittenBytes, "reused", res.Metrics.ReusedBytes, "read", res.Metrics.ReadBytes,
			"elapsed", res.Metrics.Elapsed)
	}
	e.recordJob(j, res, ran)
	if ran {
		s.running.Add(-1)
	}
	s.completed.Add(1)
}

// sendAck sends a job's one Result. A caller's ack channel that its owner
// closed would panic the sender: that is logged and the Result dropped, so
// the engine still completes the job (and Close does not hang).
func (e *Engine) sendAck(j *job, res Result) {
	defer func() {
		if r := recover(); r != nil {
			e.logSafe(slog.LevelError, "kvpersist: ack channel closed by its owner; result dropped", "id", j.id, "kind", j.kind, "ref", j.ref.String(), "panic", r)
		}
	}()
	j.ack <- res
}

// logSafe logs through the caller's Logger, recovering a panic in its
// handler: the ack and the dispatcher's bookkeeping must not depend on the
// logger behaving.
func (e *Engine) logSafe(level slog.Level, msg string, args ...any) {
	defer func() { _ = recover() }()
	e.log.Log(context.Background(), level, msg, args...)
}

// testHook, when set by a test, runs at the start of every job (to inject
// panics or delays).
var testHook func(kind Kind, ref Ref)

func (e *Engine) execute(j *job, res *Result) {
	if testHook != nil {
		testHook(j.kind, j.ref)
	}
	cfg := e.jcfg
	var err error
	switch r := j.req.(type) {
	case *WriteRequest:
		w := *r // a shallow copy: the caller's request is not modified
		if w.BlockBytes == 0 {
			w.BlockBytes = e.cfg.BlockBytes
		}
		err = e.executeWrite(j.ctx, &cfg, &w, res)
	case *ReadRequest:
		var snap *layout.Snapshot
		snap, res.Metrics, err = jobs.Read(j.ctx, &cfg, r)
		if err != nil && e.tier != nil && (errors.Is(err, ErrNotFound) || errors.Is(err, ErrMissingPage)) {
			// Read-through of a page manifest (tier.ReadNamed): only
			// when the local tier lacks the name or a page it names.
			var held []layout.PageKey
			var fetched bool
			res.Remote, held, fetched = e.tier.ReadNamed(j.ctx, r.Ref)
			if fetched && res.Remote.Err == nil {
				snap, res.Metrics, err = jobs.Read(j.ctx, &cfg, r)
			}
			if len(held) > 0 {
				e.pc.Unpin(r.Namespace, held...)
			}
			if err != nil && res.Remote.Err != nil {
				err = errors.Join(err, fmt.Errorf("engine: remote tier: %w", res.Remote.Err))
			}
		}
		if err == nil {
			res.Header = snap.Header
		}
	case *DeleteRequest:
		res.Metrics, err = jobs.Delete(j.ctx, &cfg, r)
		if err == nil {
			e.pc.SetManifest(r.Namespace, r.Name, nil) // its pages' pins go with it
		}
	case *CollectRequest:
		c := *r
		if c.TempGrace == 0 {
			c.TempGrace = e.cfg.TempGrace
		}
		if c.BlockGrace == 0 {
			c.BlockGrace = e.cfg.BlockGrace
		}
		res.Metrics, err = jobs.Collect(j.ctx, &cfg, &c)
		// Still alone in its namespaces: the page cache's accounting is
		// made equal to their page files (pages of other processes).
		e.resyncAfterCollect(c.Namespaces)
	case *MigrateRequest:
		res.Metrics, err = jobs.Migrate(j.ctx, &cfg, r)
	default:
		_, err = e.executePrefix(j.ctx, &cfg, r, res)
	}
	if err != nil {
		res.Header = nil
		res.Err = err
	}
}
