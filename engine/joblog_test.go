package engine

import (
	"bytes"
	"errors"
	"io/fs"
	"log/slog"
	"strings"
	"testing"

	"github.com/kvpersist/kvpersist/internal/kvgen"
)

// A failed job's error is its ack's only: the engine logs it at debug
// level, never as a warning the caller would see twice (a CLI that
// reports the error itself then had to filter the engine's log by its
// message text).
func TestFailedJobNotLoggedAsWarning(t *testing.T) {
	for _, level := range []slog.Level{slog.LevelWarn, slog.LevelDebug} {
		var logs bytes.Buffer
		lg := slog.New(slog.NewTextHandler(&syncWriter{w: &logs}, &slog.HandlerOptions{Level: level}))
		e := newEngine(t, Config{Root: t.TempDir(), Workers: 1, Logger: lg})
		r := e.Do(bg, &ReadRequest{Ref: refOf("ns", "missing"), Dest: destOf(kvgen.Tiny, 8)})
		if !errors.Is(r.Err, fs.ErrNotExist) {
			t.Fatalf("read of a missing snapshot: %v, want fs.ErrNotExist", r.Err)
		}
		got := logs.String() // settle logs before the ack: Do has returned

		failed := strings.Contains(got, "job failed") && strings.Contains(got, "level=DEBUG")
		if level == slog.LevelWarn && got != "" {
			t.Errorf("at warn level the failed job was logged:\n%s", got)
		}
		if level == slog.LevelDebug && !failed {
			t.Errorf("at debug level, want the failed job's record:\n%s", got)
		}
	}
}
