package engine

import (
	"context"
	"errors"
	"fmt"
	"runtime/debug"
	"slices"

	"github.com/kvpersist/kvpersist/engine/jobs"
	"github.com/kvpersist/kvpersist/engine/layout"
)

// readBurst is how many reads may be started in a row while an eligible
// write waits, before one write goes first (reads have priority, writes do
// not starve).
const readBurst = 8

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
	for {
		if !d.aborted {
			select {
			case <-e.abort:
				d.aborted = true
				for _, j := range d.out {
					j.cancel(ErrClosed)
				}
			default:
			}
		}
		d.schedule()
		if d.draining && len(d.out) == 0 {
			return
		}
		var mailbox <-chan *job
		if !d.draining && len(d.pending) < cap(e.mailbox) {
			mailbox = e.mailbox // bounded: past this, Submit feels backpressure
		}
		select {
		case j, ok := <-mailbox:
			if !ok {
				d.draining = true
				continue
			}
			d.accept(j)
		case j := <-e.done:
			d.complete(j)
		case <-e.kickCh:
		case <-e.abort:
		}
		if d.draining {
			// Accept whatever is still buffered in the closed mailbox.
			for j := range e.mailbox {
				d.accept(j)
			}
		}
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

func (d *dispatcher) complete(j *job) {
	d.running--
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

// eligible applies the ordering rules to a pending job:
//   - per path, in submission order: a write waits for every earlier job
//     on its path; a read waits for earlier writes on its path (reads of
//     one path may run together);
//   - a collect waits for every earlier job in its namespaces, and every
//     later job in those namespaces waits for the collect.
func (d *dispatcher) eligible(j *job) bool {
	if j.path != "" {
		for _, x := range d.byPath[j.path] {
			if x == j {
				break
			}
			if j.kind == KindWrite || x.kind == KindWrite {
				return false
			}
		}
	}
	for _, x := range d.out {
		if x == j {
			break
		}
		if (j.kind == KindCollect || x.kind == KindCollect) && overlaps(j, x) {
			return false
		}
	}
	return true
}

// schedule starts every job it can: cancelled pending jobs are acked at
// once; then eligible reads before eligible writes, with readBurst as the
// anti-starvation bound; collects in order with the rest.
func (d *dispatcher) schedule() {
	e := d.e
	for i := 0; i < len(d.pending); {
		j := d.pending[i]
		if j.ctx.Err() != nil && d.start(j) {
			continue // start removed it from pending
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
			if j.kind == KindRead {
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
			return
		}
		if !d.start(pick) {
			e.waiting.Store(true) // helpers yield so this one can start
			return
		}
		if pick.kind == KindRead && other != nil {
			d.readRun++
		} else {
			d.readRun = 0
		}
	}
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
	e.stats.queued.Add(-1)
	e.stats.running.Add(1)
	return true
}

// runJob runs on a pool worker: the job, then its ack, then the completion
// notice to the dispatcher. It recovers any panic and always acks.
func (e *Engine) runJob(j *job) {
	res := Result{ID: j.id, Kind: j.kind, Ref: j.ref}
	func() {
		defer func() {
			if r := recover(); r != nil {
				res.Header = nil
				res.Err = fmt.Errorf("%w: %s job %d (%s): %v\n%s", jobs.ErrPanic, j.kind, j.id, j.ref, r, debug.Stack())
			}
		}()
		if err := context.Cause(j.ctx); err != nil {
			res.Err = err
			return
		}
		e.execute(j, &res)
	}()
	if cause := context.Cause(j.ctx); res.Err != nil && errors.Is(cause, ErrClosed) && !errors.Is(res.Err, ErrClosed) {
		res.Err = fmt.Errorf("%w: %w", ErrClosed, res.Err)
	}
	j.stopAft()
	j.cancel(nil)
	s := &e.stats
	s.bytesWritten.Add(res.Metrics.WrittenBytes)
	s.bytesReused.Add(res.Metrics.ReusedBytes)
	s.bytesRead.Add(res.Metrics.ReadBytes)
	if res.Err != nil {
		s.failed.Add(1)
		e.log.Warn("kvpersist: job failed", "id", j.id, "kind", j.kind, "ref", j.ref.String(), "err", res.Err)
	} else {
		e.log.Debug("kvpersist: job done", "id", j.id, "kind", j.kind, "ref", j.ref.String(),
			"written", res.Metrics.WrittenBytes, "reused", res.Metrics.ReusedBytes, "read", res.Metrics.ReadBytes,
			"elapsed", res.Metrics.Elapsed)
	}
	s.running.Add(-1)
	s.completed.Add(1)
	// The ack: after it the caller owns its buffers again. Every helper task
	// of the job has finished (jobs.parallel waits for them).
	j.ack <- res
	e.done <- j
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
		bb := r.BlockBytes
		if bb == 0 {
			bb = e.cfg.BlockBytes
		}
		res.Header, res.Metrics, err = jobs.Write(j.ctx, &cfg, &jobs.WriteSpec{
			Path: j.path, Layout: r.Layout, Meta: r.Meta, Caches: r.Caches, Attachments: r.Attachments,
			BlockBytes: bb, Packed: r.Packed,
		})
	case *ReadRequest:
		var snap *layout.Snapshot
		snap, res.Metrics, err = jobs.Read(j.ctx, &cfg, &jobs.ReadSpec{Path: j.path, Dest: r.Dest, Verify: r.Verify, Expect: r.Expect})
		if err == nil {
			res.Header = snap.Header
		}
	case *CollectRequest:
		res.Metrics, err = jobs.Collect(j.ctx, &cfg, &jobs.CollectSpec{
			Root: e.cfg.Root, Namespaces: r.Namespaces, DryRun: r.DryRun,
			TempGrace: e.cfg.TempGrace, BlockGrace: e.cfg.BlockGrace,
		})
	}
	if err != nil {
		res.Header = nil
		res.Err = err
	}
}
