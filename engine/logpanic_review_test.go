package engine_test

import (
	"context"
	"log/slog"
	"testing"
	"time"

	"github.com/kvpersist/kvpersist/engine"
	"github.com/kvpersist/kvpersist/engine/layout"
)

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

// runJob recovers panics of the job body only: settle (counters and the
// Config.Logger call) runs outside that recover and before the ack. A
// Logger whose handler panics (a caller-supplied slog.Handler bug) loses the
// job's ack and its completion notice: Do never returns, and Close would
// wait forever for the job.
func TestReviewPanickingLoggerLosesAck(t *testing.T) {
	e, err := engine.New(engine.Config{Root: t.TempDir(), NoSync: true, Logger: slog.New(panicHandler{})})
	if err != nil {
		t.Fatal(err)
	}
	// An invalid write (no tensors): fails fast, logged at warn.
	job, err := e.Submit(context.Background(), &engine.WriteRequest{Ref: engine.Ref{Namespace: "ns", Name: "a"}, Layout: layout.Single})
	if err != nil {
		t.Fatal(err)
	}
	select {
	case res := <-job.Ack:
		t.Logf("acked: %v", res.Err)
		e.Close(context.Background())
	case <-time.After(3 * time.Second):
		t.Fatalf("job never acked after a panic in the logger (engine left running: Close would hang)")
	}
}
