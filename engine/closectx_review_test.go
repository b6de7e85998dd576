package engine_test

import (
	"context"
	"log/slog"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/kvpersist/kvpersist/engine"
	"github.com/kvpersist/kvpersist/engine/gather"
	"github.com/kvpersist/kvpersist/engine/jobs"
	"github.com/kvpersist/kvpersist/engine/layout"
	"golang.org/x/sys/unix"
)

// Close(ctx) is documented to cancel the remaining jobs when ctx ends and
// then return ctx's error once they are acked. A job blocked in flock (a
// `kvpersist gc` of another process holding the namespace's lock, or any
// other holder) cannot see its context: Close then blocks for as long as the
// other process holds the lock, whatever ctx says. The same happens when a
// caller-provided Ack channel is not drained.
func TestReviewCloseCtxIgnoredWhileJobBlockedOnFlock(t *testing.T) {
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

	e, err := engine.New(engine.Config{Root: root, NoSync: true, Workers: 2, Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		t.Fatal(err)
	}
	v := gather.View{Base: make([]byte, 64), Shape: []int{32}, Strides: []int{1}, ItemSize: 2}
	job, err := e.Submit(context.Background(), &engine.WriteRequest{Ref: engine.Ref{Namespace: "ns", Name: "a"}, Layout: layout.Single,
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
	case <-time.After(3 * time.Second):
		release()
		<-closed
		<-job.Ack
		t.Fatalf("Close(ctx with a 200ms deadline) had not returned 3s later: a job blocked in flock ignores cancellation")
	}
}
