package engine

import (
	"context"
	"errors"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/kvpersist/kvpersist/engine/layout"
	"github.com/kvpersist/kvpersist/engine/vfs"
	"github.com/kvpersist/kvpersist/internal/kvgen"
	"github.com/kvpersist/kvpersist/internal/testutil"
)

// TestColdReadsAsync: cold restores through the engine read with O_DIRECT
// and, by default, asynchronously (Stats.BytesReadAsync); with
// NoAsyncReads, with O_DIRECT preads (BytesReadAsync 0). Restores
// cancelled at random moments while their reads are in flight are acked
// only once none of their asynchronous reads is left with the kernel (so
// none can land in the buffers after the ack), and the restores that
// complete hold exactly the saved bytes. Close stops the reaper goroutine
// (goleak in TestMain).
func TestColdReadsAsync(t *testing.T) {
	probeAIO, err := vfs.NewAsyncReader(1)
	if err != nil {
		t.Skipf("no Linux AIO here: %v", err)
	}
	probeAIO.Close()
	root := t.TempDir()
	skipWithoutDirect(t, root)
	m, tokens := kvgen.Llama31_8B, 32
	c, _ := cacheOf(m, tokens, false)
	for _, noAsync := range []bool{false, true} {
		e := newEngine(t, Config{Root: t.TempDir(), Workers: 2, BlockBytes: 256 << 10, NoAsyncReads: noAsync})
		refs := []Ref{refOf("cold", "single"), refOf("cold", "manifest")}
		mustDo(t, e, writeReq(refs[0], c, layout.Single, 0))
		mustDo(t, e, writeReq(refs[1], c, layout.Blocks, 0))
		rng := rand.New(rand.NewPCG(7, uint64(len(refs))))
		cancelled := 0
		for round := range 6 {
			for _, ref := range refs {
				testutil.EvictTree(t, e.Root())
				if round%2 == 0 {
					readBack(t, e, ref, m, tokens)
					continue
				}
				ctx, cancel := context.WithCancel(bg)
				timer := time.AfterFunc(time.Duration(rng.IntN(30000))*time.Microsecond, cancel)
				r := e.Do(ctx, &ReadRequest{Ref: ref, Dest: destOf(m, tokens)})
				timer.Stop()
				cancel()
				if n := e.jcfg.Async.InFlight(); n != 0 {
					t.Fatalf("NoAsyncReads=%v, %s: %d asynchronous reads in flight at the ack", noAsync, ref, n)
				}
				if r.Err != nil {
					if !errors.Is(r.Err, context.Canceled) {
						t.Fatalf("%s: %v", ref, r.Err)
					}
					cancelled++
				}
			}
		}
		st := e.Stats()
		if st.BytesReadDirect == 0 || (st.BytesReadAsync == 0) != noAsync || st.BytesReadAsync > st.BytesReadDirect {
			t.Fatalf("NoAsyncReads=%v: %d bytes read, %d direct, %d async", noAsync, st.BytesRead, st.BytesReadDirect, st.BytesReadAsync)
		}
		t.Logf("NoAsyncReads=%v: %d of 6 restores cancelled", noAsync, cancelled)
	}
}
