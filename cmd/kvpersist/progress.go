package main

import (
	"io"
	"os"

	"github.com/schollz/progressbar/v3"
	"golang.org/x/term"
)

func isTerminal(f *os.File) bool { return term.IsTerminal(int(f.Fd())) }

// progress is a byte-count progress bar on a terminal, and nothing
// otherwise (output piped to a file or a test stays clean).
type progress struct{ bar *progressbar.ProgressBar }

func (c *cli) progress(total int64, what string) *progress {
	if !c.tty {
		return &progress{}
	}
	return &progress{bar: progressbar.NewOptions64(total,
		progressbar.OptionSetWriter(c.stderr),
		progressbar.OptionSetDescription(what),
		progressbar.OptionShowBytes(true),
		progressbar.OptionThrottle(100_000_000),
		progressbar.OptionClearOnFinish(),
		progressbar.OptionSetWidth(30),
	)}
}

func (p *progress) Add(n int64) {
	if p.bar != nil {
		_ = p.bar.Add64(n)
	}
}

func (p *progress) Done() {
	if p.bar != nil {
		_ = p.bar.Finish()
		_ = p.bar.Clear()
	}
}

var _ io.Writer = (*progressbar.ProgressBar)(nil)
