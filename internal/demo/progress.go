package demo

import (
	"io"
	"os"
	"sync"
	"time"

	"github.com/schollz/progressbar/v3"
	"golang.org/x/term"
)

// bar is the progress bar of one save or load, driven by the job's own
// progress (SavePrefixRequest.Progress, LoadPrefixRequest.Progress: bytes
// done). It draws nothing unless its writer is a terminal, and appears only
// once the job has run ProgressDelay, so short jobs leave no trace. add may
// be called from several of the job's goroutines at once; done is called
// after the job's ack (no add follows it). It starts no goroutine.
type bar struct {
	out   io.Writer // nil: draw nothing
	total int64
	what  string
	start time.Time

	pb *progressbar.ProgressBar // nil unless out is a terminal

	mu    sync.Mutex
	sum   int64
	shown bool // drawn (the job has run ProgressDelay)
	dead  bool // done was called
}

// newBar returns a bar of total bytes described by what, drawn on out when
// out is a terminal.
func newBar(out io.Writer, total int64, what string) *bar {
	b := &bar{total: total, what: what, start: time.Now()}
	if isTerminal(out) {
		b.out = out
		// Created now, drawn later: its clock (and so its rate) starts
		// with the job.
		b.pb = progressbar.NewOptions64(total,
			progressbar.OptionSetWriter(out),
			progressbar.OptionSetDescription(what),
			progressbar.OptionShowBytes(true),
			progressbar.OptionThrottle(100*time.Millisecond),
			progressbar.OptionClearOnFinish(),
			progressbar.OptionSetWidth(30),
		)
		b.pb.StartWithoutRender()
	}
	return b
}

// isTerminal reports whether w is an *os.File on a terminal.
func isTerminal(w io.Writer) bool {
	f, ok := w.(*os.File)
	return ok && f != nil && term.IsTerminal(int(f.Fd()))
}

func (b *bar) add(n int64) {
	if b.out == nil {
		return
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	b.sum += n
	switch {
	case b.dead:
	case b.shown:
		_ = b.pb.Add64(n)
	case time.Since(b.start) >= ProgressDelay:
		b.shown = true
		_ = b.pb.Set64(b.sum)
	}
}

func (b *bar) done() {
	if b.out == nil {
		return
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	b.dead = true
	if b.shown {
		_ = b.pb.Finish()
		_ = b.pb.Clear()
	}
}
