package engine

import (
	"fmt"
	"sync"
	"testing"

	"github.com/kvpersist/kvpersist/engine/layout"
	"github.com/kvpersist/kvpersist/internal/kvgen"
)

// A large job uses the whole pool: with nothing else to run, its goroutine
// is joined by Workers-1 helper tasks (jobs.Config.Spawn), in both layouts
// and for reads. Large: the 65 tensors of Llama-3.1-8B (single file), the 41
// blocks of a 600-token Tiny cache cut at 4 KiB. Each job runs on a fresh
// engine (one store): an ants worker goes back to its pool only after its
// task has returned, so right after an ack some workers of the previous
// job may not be free yet.
func TestLargeJobUsesWholePool(t *testing.T) {
	const workers = 4
	root := t.TempDir()
	llama, tiny := kvgen.Llama31_8B, kvgen.Tiny
	cl, _ := cacheOf(llama, 8, true)
	ct, _ := cacheOf(tiny, 600, true)
	for i, req := range []Request{
		writeReq(refOf("big", "single"), cl, layout.Single, 0),
		writeReq(refOf("big", "blk"), ct, layout.Blocks, 0),
		&ReadRequest{Ref: refOf("big", "single"), Dest: destOf(llama, 8)},
		&ReadRequest{Ref: refOf("big", "blk"), Dest: destOf(tiny, 600)},
	} {
		// A block read asks for helpers twice: to open and size every
		// block, then to read them.
		want := int64(workers - 1)
		if i == 3 {
			want *= 2
		}
		// An ants worker returns to its pool just after its task returns,
		// so a job's second request for helpers can, rarely, find one of
		// the first request's workers not back yet (Spawn says no). A job
		// that really uses fewer helpers does so every time: three tries,
		// each on a fresh engine, must see the whole pool at least once.
		var got int64
		for try := 0; try < 3 && got != want; try++ {
			e, err := New(Config{Root: root, Workers: workers, BlockBytes: 4096, NoSync: true, Logger: newEngineLogger()})
			if err != nil {
				t.Fatal(err)
			}
			r := e.Do(bg, req)
			if err := e.Close(bg); err != nil || r.Err != nil {
				t.Fatalf("job %d (%T): %v; Close: %v", i, req, r.Err, err)
			}
			got = e.helpersStarted.Load()
			if i == 1 && try == 0 && r.Metrics.BlocksWritten != 41 { // later tries reuse them
				t.Fatalf("blocks write: %d blocks, want 41", r.Metrics.BlocksWritten)
			}
		}
		if got != want {
			t.Fatalf("job %d (%T): %d helper tasks, want %d", i, req, got, want)
		}
	}
	e := newEngine(t, Config{Root: root, Workers: workers})
	readBack(t, e, refOf("big", "single"), llama, 8)
	readBack(t, e, refOf("big", "blk"), tiny, 600)
}

// A pool full of parent jobs does not deadlock: helpers are only taken when
// a worker is free, so every parent makes progress on its own goroutine.
// Many large writes and reads submitted at once, on one and two workers,
// with a mailbox smaller than the burst (Submit waits), all complete, and
// every read holds the expected bytes.
func TestPoolFullOfParents(t *testing.T) {
	for _, workers := range []int{1, 2} {
		t.Run(fmt.Sprintf("workers=%d", workers), func(t *testing.T) {
			e := newEngine(t, Config{Workers: workers, Mailbox: 4, BlockBytes: 4096})
			// Large single files (65 tensors) and large block manifests
			// (41 blocks): see TestLargeJobUsesWholePool.
			type big struct {
				m      kvgen.Model
				tokens int
				lay    layout.Layout
			}
			kinds := []big{{kvgen.Llama31_8B, 8, layout.Single}, {kvgen.Tiny, 600, layout.Blocks}}
			const n = 6
			for i := range n {
				k := kinds[i%2]
				c, _ := cacheOf(k.m, k.tokens, true)
				mustDo(t, e, writeReq(refOf("src", fmt.Sprint(i)), c, k.lay, 0))
			}
			var wg sync.WaitGroup
			errs := make(chan error, 4*n)
			for i := range n {
				k := kinds[i%2]
				c, want := cacheOf(k.m, k.tokens, false)
				wg.Go(func() {
					if r := e.Do(bg, writeReq(refOf("dst", fmt.Sprint(i)), c, k.lay, 0)); r.Err != nil {
						errs <- r.Err
					}
				})
				wg.Go(func() {
					dest := destOf(k.m, k.tokens)
					r := e.Do(bg, &ReadRequest{Ref: refOf("src", fmt.Sprint(i)), Dest: dest})
					if r.Err != nil {
						errs <- r.Err
						return
					}
					for s := range dest {
						if string(dest[s]) != string(want[s]) {
							errs <- fmt.Errorf("read src/%d: slot %d differs", i, s)
							return
						}
					}
				})
				wg.Go(func() { // a rewrite of the same content
					if r := e.Do(bg, writeReq(refOf("src", fmt.Sprint(i)), c, k.lay, 0)); r.Err != nil {
						errs <- r.Err
					}
				})
			}
			done := make(chan struct{})
			go func() { wg.Wait(); close(done) }()
			select {
			case <-done:
			case <-guardTimer():
				t.Fatalf("jobs did not all complete within %v: Stats %+v", guard, e.Stats())
			}
			close(errs)
			for err := range errs {
				t.Error(err)
			}
			if s := e.Stats(); s.Completed != 4*n || s.Failed != 0 || s.Queued != 0 || s.Running != 0 {
				t.Fatalf("Stats: %+v", s)
			}
			for i := range n {
				k := kinds[i%2]
				readBack(t, e, refOf("dst", fmt.Sprint(i)), k.m, k.tokens)
				readBack(t, e, refOf("src", fmt.Sprint(i)), k.m, k.tokens)
			}
		})
	}
}
