package engine_test

import (
	"context"
	"log/slog"
	"os"
	"path/filepath"
	"syscall"
	"testing"
	"time"

	"github.com/kvpersist/kvpersist/engine"
)

// vfs.Open (O_RDONLY|O_NOFOLLOW, no O_NONBLOCK) blocks in open(2) on a FIFO
// until a writer appears; Decode's "not a regular file" check comes after.
// A FIFO under a snapshot name hangs Stat on the caller's goroutine, and a
// ReadRequest on a pool worker while it holds the namespace's shared flock
// (so a collect of any process then hangs too); ctx cannot interrupt it.
func TestReviewStatHangsOnFIFO(t *testing.T) {
	root := t.TempDir()
	if err := os.MkdirAll(filepath.Join(root, "ns"), 0o750); err != nil {
		t.Fatal(err)
	}
	fifo := filepath.Join(root, "ns", "snap")
	if err := syscall.Mkfifo(fifo, 0o640); err != nil {
		t.Skip(err)
	}
	e, err := engine.New(engine.Config{Root: root, NoSync: true, Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close(context.Background())
	done := make(chan error, 1)
	go func() { _, err := e.Stat(engine.Ref{Namespace: "ns", Name: "snap"}); done <- err }()
	select {
	case err := <-done:
		t.Logf("Stat: %v", err)
	case <-time.After(2 * time.Second):
		w, _ := os.OpenFile(fifo, os.O_WRONLY, 0) // unblock it
		<-done
		w.Close()
		t.Fatalf("Stat of a FIFO named like a snapshot blocked in open(2)")
	}
}
