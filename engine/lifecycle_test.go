package engine

import (
	"context"
	"errors"
	"io/fs"
	"log/slog"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvpersist/kvpersist/engine/gather"
	"github.com/kvpersist/kvpersist/engine/jobs"
	"github.com/kvpersist/kvpersist/engine/layout"
	"github.com/kvpersist/kvpersist/engine/vfs"
	"github.com/kvpersist/kvpersist/internal/kvgen"
	"github.com/kvpersist/kvpersist/internal/testutil"
	"go.uber.org/goleak"
	"golang.org/x/sys/unix"
)

// Backpressure: with Mailbox jobs waiting to start, TrySubmit returns
// ErrBusy and Submit blocks until its ctx ends, returning ctx's error. The
// refused requests' tensors live in PROT_NONE memory: had the engine touched
// them, the test process would have died.
func TestBackpressure(t *testing.T) {
	h := installHook(t)
	arena := newArena(t) // unmapped after the engine's Close
	e := newEngine(t, Config{Workers: 1, Mailbox: 2})
	m := kvgen.Tiny
	c, _ := cacheOf(m, 40, true)
	release := h.hold(t, "write a/h")
	first := mustSubmit(t, e, bg, writeReq(refOf("a", "h"), c, layout.Single, 0))
	h.await(t, "enter write a/h", 1) // started: its mailbox slot is free again
	q1, err := e.TrySubmit(bg, writeReq(refOf("a", "q1"), c, layout.Blocks, 4096))
	if err != nil {
		t.Fatal(err)
	}
	q2 := mustSubmit(t, e, bg, writeReq(refOf("a", "q2"), c, layout.Single, 0))
	if s := e.Stats(); s.Queued != 2 || s.Running != 1 {
		t.Fatalf("Stats with a full mailbox: %+v", s)
	}

	untouchable, _ := arena.cache(m, 40, false)
	arena.protectAll()
	refused := writeReq(refOf("a", "refused"), untouchable, layout.Single, 0)
	for range 3 {
		if _, err := e.TrySubmit(bg, refused); !errors.Is(err, ErrBusy) {
			t.Fatalf("TrySubmit on a full mailbox: %v, want ErrBusy", err)
		}
	}
	ctx, cancel := context.WithCancelCause(bg)
	done := make(chan error, 1)
	go func() {
		_, err := e.Submit(ctx, refused)
		done <- err
	}()
	select {
	case err := <-done:
		t.Fatalf("Submit on a full mailbox returned %v without waiting", err)
	default:
	}
	cause := errors.New("caller gave up")
	cancel(cause)
	if err := recv(t, done); !errors.Is(err, context.Canceled) {
		t.Fatalf("blocked Submit after its ctx ended: %v, want context.Canceled", err)
	}
	if s := e.Stats(); s.Queued != 2 || s.Running != 1 || s.Completed != 0 {
		t.Fatalf("Stats after refusals: %+v", s)
	}
	release()
	for _, j := range []*Job{first, q1, q2} {
		ackOK(t, j)
	}
	if s := e.Stats(); s != (Stats{Completed: 3, BytesWritten: s.BytesWritten}) || s.BytesWritten == 0 {
		t.Fatalf("Stats after the three jobs: %+v", s)
	}
	if _, err := os.Lstat(filepath.Join(e.Root(), "a", "refused")); !errors.Is(err, fs.ErrNotExist) {
		t.Fatalf("a refused write left a file: %v", err)
	}
	// Room again: TrySubmit is accepted.
	ackOK(t, mustSubmit(t, e, bg, writeReq(refOf("a", "later"), c, layout.Single, 0)))
}

// A job cancelled while pending is acked at once with its ctx's error, even
// while the only worker is busy, whether its ack channel is the engine's or
// the caller's; it never runs. The cancellation cause is kept.
func TestCancelPending(t *testing.T) {
	h := installHook(t)
	e := newEngine(t, Config{Workers: 1})
	m := kvgen.Tiny
	c, _ := cacheOf(m, 40, true)
	mustDo(t, e, writeReq(refOf("a", "c"), c, layout.Single, 0))
	release := h.hold(t, "write a/h")
	held := mustSubmit(t, e, bg, writeReq(refOf("a", "h"), c, layout.Single, 0))
	h.await(t, "enter write a/h", 1)

	ctxB, cancelB := context.WithCancel(bg)
	b := mustSubmit(t, e, ctxB, writeReq(refOf("a", "b"), c, layout.Single, 0))
	ctxC, cancelC := context.WithCancelCause(bg)
	cr := mustSubmit(t, e, ctxC, &ReadRequest{Ref: refOf("a", "c"), Dest: destOf(m, 40)})
	mine := make(chan Result, 1)
	ctxD, cancelD := context.WithCancel(bg)
	dreq := writeReq(refOf("a", "d"), c, layout.Blocks, 4096)
	d := mustSubmit(t, e, ctxD, dreq, AckTo(mine))
	survivor := mustSubmit(t, e, bg, &ReadRequest{Ref: refOf("a", "c"), Dest: destOf(m, 40)})

	cancelB()
	if r := ack(t, b); !errors.Is(r.Err, context.Canceled) || r.Kind != KindWrite {
		t.Fatalf("pending write cancelled: %+v", r)
	}
	why := errors.New("conversation closed")
	cancelC(why)
	if r := ack(t, cr); !errors.Is(r.Err, context.Canceled) || !errors.Is(r.Err, why) {
		t.Fatalf("pending read cancelled with a cause: %v", r.Err)
	}
	cancelD()
	select {
	case r := <-mine:
		if r.ID != d.ID || !errors.Is(r.Err, context.Canceled) {
			t.Fatalf("pending write with the caller's channel: %+v", r)
		}
	case <-guardTimer():
		t.Fatal("no ack on the caller's channel")
	}
	if s := e.Stats(); s.Running != 1 || s.Queued != 1 || s.Completed != 4 || s.Failed != 3 {
		t.Fatalf("Stats after three cancels: %+v", s)
	}
	release()
	ackOK(t, held)
	ackOK(t, survivor)
	for _, k := range []string{"write a/b", "read a/c", "write a/d"} {
		if n := h.count("enter " + k); k != "read a/c" && n != 0 || k == "read a/c" && n != 1 {
			t.Fatalf("%q entered %d time(s)", k, n)
		}
	}
	for _, n := range []string{"b", "d"} {
		if _, err := os.Lstat(filepath.Join(e.Root(), "a", n)); !errors.Is(err, fs.ErrNotExist) {
			t.Fatalf("cancelled write a/%s left a file: %v", n, err)
		}
	}
}

// cancelFS cancels a job's context from inside its n-th WriteAt: the job is
// then mid-way through its tensors (single file) or blocks.
type cancelFS struct {
	vfs.FS
	writes atomic.Int64
	at     atomic.Int64 // cancel at this WriteAt; 0 = never
	cancel atomic.Pointer[context.CancelFunc]
}

type cancelFile struct {
	vfs.File
	fs *cancelFS
}

func (f *cancelFS) Create(name string, perm os.FileMode) (vfs.File, error) {
	file, err := f.FS.Create(name, perm)
	if err != nil {
		return nil, err
	}
	return &cancelFile{File: file, fs: f}, nil
}

func (f *cancelFile) WriteAt(p []byte, off int64) (int, error) {
	n, err := f.File.WriteAt(p, off)
	if at := f.fs.at.Load(); at > 0 && f.fs.writes.Add(1) == at {
		(*f.fs.cancel.Load())()
	}
	return n, err
}

// A running write cancelled between tensors (single file) or blocks stops,
// leaves no temp file, is acked with ctx's error, and the previous snapshot
// of its path still reads back and verifies.
func TestCancelRunning(t *testing.T) {
	for _, lay := range []layout.Layout{layout.Single, layout.Blocks} {
		t.Run(lay.String(), func(t *testing.T) {
			cfs := &cancelFS{FS: vfs.Default}
			e := newEngine(t, Config{Workers: 2, FS: cfs, BlockBytes: 4096})
			// Many steps to stop between: 65 tensors, or 41 blocks.
			m, oldT, newT := kvgen.Llama31_8B, 8, 16
			if lay == layout.Blocks {
				m, oldT, newT = kvgen.Tiny, 500, 600
			}
			old, _ := cacheOf(m, oldT, false)
			ref := refOf("conv", "turn")
			mustDo(t, e, writeReq(ref, old, lay, 0))
			next, _ := cacheOf(m, newT, true)
			ctx, cancel := context.WithCancel(bg)
			cfs.cancel.Store(&cancel)
			cfs.at.Store(2)
			r := e.Do(ctx, writeReq(ref, next, lay, 0))
			if !errors.Is(r.Err, context.Canceled) || r.Header != nil {
				t.Fatalf("cancelled write: header %v, err %v", r.Header, r.Err)
			}
			if n := cfs.writes.Load(); n >= 20 {
				t.Fatalf("the cancelled write went on: %d WriteAt calls", n)
			}
			cfs.at.Store(0)
			if tmp := testutil.TempFiles(t, e.Root()); len(tmp) != 0 {
				t.Fatalf("temp files left: %v", tmp)
			}
			readBack(t, e, ref, m, oldT)
		})
	}
}

// A panic inside a job is recovered and acked as an error wrapping
// jobs.ErrPanic that names the job; the engine keeps serving.
func TestPanicRecovered(t *testing.T) {
	h := installHook(t)
	e := newEngine(t, Config{Workers: 2})
	m := kvgen.Tiny
	c, _ := cacheOf(m, 40, true)
	ref := refOf("a", "boom")
	mustDo(t, e, writeReq(ref, c, layout.Single, 0))
	h.panicOnce("write a/boom")
	h.panicOnce("read a/boom")
	h.panicOnce("collect")
	for _, req := range []Request{
		writeReq(ref, c, layout.Blocks, 4096),
		&ReadRequest{Ref: ref, Dest: destOf(m, 40)},
		&CollectRequest{},
	} {
		j := mustSubmit(t, e, bg, req)
		r := ack(t, j)
		if !errors.Is(r.Err, jobs.ErrPanic) || r.Header != nil {
			t.Fatalf("%T: header %v, err %v; want jobs.ErrPanic", req, r.Header, r.Err)
		}
		name := r.Kind.String() + " job " + strconv.FormatUint(j.ID, 10)
		if msg := r.Err.Error(); !strings.Contains(msg, name) || !strings.Contains(msg, "injected panic") {
			t.Fatalf("panic error does not name %q: %.200s", name, msg)
		}
	}
	if s := e.Stats(); s.Failed != 3 || s.Running != 0 {
		t.Fatalf("Stats: %+v", s)
	}
	if tmp := testutil.TempFiles(t, e.Root()); len(tmp) != 0 {
		t.Fatalf("temp files left: %v", tmp)
	}
	readBack(t, e, ref, m, 40)
	mustDo(t, e, writeReq(refOf("a", "after"), c, layout.Blocks, 4096))
	readBack(t, e, refOf("a", "after"), m, 40)
}

// Close lets running and queued jobs finish and be acked, refuses new jobs
// with ErrClosed (also a Submit blocked on a full mailbox), releases the
// pool and leaves no goroutine; a second Close is a no-op.
func TestCloseDrains(t *testing.T) {
	defer goleak.VerifyNone(t, goleak.IgnoreCurrent())
	h := installHook(t)
	m := kvgen.Tiny
	c, _ := cacheOf(m, 40, true)
	e, err := New(Config{Root: t.TempDir(), Workers: 1, Mailbox: 1, NoSync: true, Logger: newEngineLogger()})
	if err != nil {
		t.Fatal(err)
	}
	release := h.hold(t, "write a/h")
	running := mustSubmit(t, e, bg, writeReq(refOf("a", "h"), c, layout.Single, 0))
	h.await(t, "enter write a/h", 1)
	queued := mustSubmit(t, e, bg, writeReq(refOf("a", "q"), c, layout.Blocks, 4096))
	blocked := make(chan error, 1)
	go func() {
		_, err := e.Submit(bg, writeReq(refOf("a", "blocked"), c, layout.Single, 0))
		blocked <- err
	}()
	closed := make(chan error, 1)
	go func() { closed <- e.Close(bg) }()
	recv(t, e.closing)
	if err := recv(t, blocked); !errors.Is(err, ErrClosed) {
		t.Fatalf("Submit blocked on a full mailbox, then Close: %v, want ErrClosed", err)
	}
	for _, try := range []bool{false, true} {
		var err error
		if try {
			_, err = e.TrySubmit(bg, writeReq(refOf("a", "x"), c, layout.Single, 0))
		} else {
			_, err = e.Submit(bg, writeReq(refOf("a", "x"), c, layout.Single, 0))
		}
		if !errors.Is(err, ErrClosed) {
			t.Fatalf("submit during Close: %v, want ErrClosed", err)
		}
	}
	select {
	case err := <-closed:
		t.Fatalf("Close returned (%v) while a job was running", err)
	default:
	}
	release()
	ackOK(t, running)
	ackOK(t, queued)
	if err := recv(t, closed); err != nil {
		t.Fatalf("Close: %v", err)
	}
	if !e.pool.IsClosed() {
		t.Fatal("pool not released")
	}
	if err := e.Close(bg); err != nil {
		t.Fatalf("second Close: %v", err)
	}
	if _, err := e.Submit(bg, writeReq(refOf("a", "x"), c, layout.Single, 0)); !errors.Is(err, ErrClosed) {
		t.Fatalf("Submit after Close: %v", err)
	}
	if s := e.Stats(); s.Completed != 2 || s.Failed != 0 || s.Queued != 0 || s.Running != 0 {
		t.Fatalf("Stats: %+v", s)
	}
	if len(running.Ack)+len(queued.Ack) != 0 {
		t.Fatal("a job was acked twice")
	}
}

// When Close's ctx ends, queued jobs are acked at once and running ones are
// cancelled, all with errors wrapping ErrClosed; Close waits for every ack,
// returns ctx's error, and leaves no goroutine and no temp file.
func TestCloseAbort(t *testing.T) {
	defer goleak.VerifyNone(t, goleak.IgnoreCurrent())
	h := installHook(t)
	m := kvgen.Tiny
	c, _ := cacheOf(m, 40, true)
	root := t.TempDir()
	e, err := New(Config{Root: root, Workers: 1, NoSync: true, Logger: newEngineLogger()})
	if err != nil {
		t.Fatal(err)
	}
	mustDo(t, e, writeReq(refOf("a", "old"), c, layout.Single, 0))
	release := h.hold(t, "write a/old")
	running := mustSubmit(t, e, bg, writeReq(refOf("a", "old"), c, layout.Blocks, 4096))
	h.await(t, "enter write a/old", 2)
	q1 := mustSubmit(t, e, bg, writeReq(refOf("a", "q1"), c, layout.Single, 0))
	q2 := mustSubmit(t, e, bg, &ReadRequest{Ref: refOf("a", "old"), Dest: destOf(m, 40)})
	mine := make(chan Result, 1)
	q3 := mustSubmit(t, e, bg, &CollectRequest{}, AckTo(mine))

	ctx, cancel := context.WithCancel(bg)
	closed := make(chan error, 1)
	go func() { closed <- e.Close(ctx) }()
	recv(t, e.closing)
	cancel()
	// The queued jobs are acked while the running one is still held.
	for _, j := range []*Job{q1, q2} {
		if r := ack(t, j); !errors.Is(r.Err, ErrClosed) || !errors.Is(r.Err, context.Canceled) {
			t.Fatalf("queued %s at Close: %v", r.Kind, r.Err)
		}
	}
	select {
	case r := <-mine:
		if r.ID != q3.ID || !errors.Is(r.Err, ErrClosed) {
			t.Fatalf("queued collect at Close: %+v", r)
		}
	case <-guardTimer():
		t.Fatal("no ack for the queued collect")
	}
	release()
	if r := ack(t, running); !errors.Is(r.Err, ErrClosed) || !errors.Is(r.Err, context.Canceled) {
		t.Fatalf("running write at Close: %v", r.Err)
	}
	if err := recv(t, closed); !errors.Is(err, context.Canceled) {
		t.Fatalf("Close: %v, want context.Canceled", err)
	}
	if !e.pool.IsClosed() {
		t.Fatal("pool not released")
	}
	if s := e.Stats(); s.Completed != 5 || s.Failed != 4 || s.Queued != 0 || s.Running != 0 {
		t.Fatalf("Stats: %+v", s)
	}
	if tmp := testutil.TempFiles(t, root); len(tmp) != 0 {
		t.Fatalf("temp files left: %v", tmp)
	}
	// The previous version is intact.
	e2, err := New(Config{Root: root, Workers: 1, NoSync: true, Logger: newEngineLogger()})
	if err != nil {
		t.Fatal(err)
	}
	readBack(t, e2, refOf("a", "old"), m, 40)
	if err := e2.Close(bg); err != nil {
		t.Fatal(err)
	}
}

// A caller that closes its own ack channel before the ack loses that Result
// (a send on a closed channel would panic the worker): the engine recovers,
// still completes the job, keeps serving and closes cleanly.
func TestClosedAckChannel(t *testing.T) {
	h := installHook(t)
	e := newEngine(t, Config{Workers: 1})
	m := kvgen.Tiny
	c, _ := cacheOf(m, 40, true)
	release := h.hold(t, "write a/x")
	mine := make(chan Result)
	req := writeReq(refOf("a", "x"), c, layout.Single, 0)
	mustSubmit(t, e, bg, req, AckTo(mine))
	h.await(t, "enter write a/x", 1)
	close(mine)
	release()
	readBack(t, e, refOf("a", "x"), m, 40) // waits for the write (same path)
	if s := e.Stats(); s.Completed != 2 || s.Failed != 0 {
		t.Fatalf("Stats: %+v", s)
	}
}

// TestCloseCtxEndsAJobWaitingForAnotherProcessesLock: Close(ctx) cancels
// the remaining jobs when ctx ends and returns once they are acked, also
// for a job waiting for the namespace's flock (another process's gc
// holding it): the wait polls and sees its context.
func TestCloseCtxEndsAJobWaitingForAnotherProcessesLock(t *testing.T) {
	root := t.TempDir()
	ns := filepath.Join(root, "ns")
	if err := os.MkdirAll(ns, 0o750); err != nil {
		t.Fatal(err)
	}
	lf, err := os.OpenFile(filepath.Join(ns, layout.LockName), os.O_CREATE|os.O_RDONLY, 0o640)
	if err != nil {
		t.Fatal(err)
	}
	defer lf.Close()
	if err := unix.Flock(int(lf.Fd()), unix.LOCK_EX); err != nil { // "another process's gc"
		t.Fatal(err)
	}
	released := false
	release := func() {
		if !released {
			released = true
			unix.Flock(int(lf.Fd()), unix.LOCK_UN)
		}
	}
	defer release()

	e, err := New(Config{Root: root, NoSync: true, Workers: 2, Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		t.Fatal(err)
	}
	v := gather.View{Base: make([]byte, 64), Shape: []int{32}, Strides: []int{1}, ItemSize: 2}
	job, err := e.Submit(context.Background(), &WriteRequest{Ref: Ref{Namespace: "ns", Name: "a"}, Layout: layout.Single,
		Caches: []jobs.EntrySpec{{Tensors: []jobs.TensorSpec{{DType: "bfloat16", View: v}}}}})
	if err != nil {
		t.Fatal(err)
	}
	for deadline := time.Now().Add(5 * time.Second); e.Stats().Running == 0 && time.Now().Before(deadline); {
		time.Sleep(time.Millisecond)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
	defer cancel()
	closed := make(chan error, 1)
	go func() { closed <- e.Close(ctx) }()
	select {
	case err := <-closed:
		t.Logf("Close returned %v", err)
	case <-guardTimer(): // a hang detector: a correct Close returns about 200 ms after it is called
		release()
		<-closed
		<-job.Ack
		t.Fatalf("Close(ctx with a 200ms deadline) had not returned %v later: the job waiting for the flock did not see its context", guard)
	}
}
