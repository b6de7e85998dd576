// Command kvpersist is the operator's tool for a kvpersist store, and the
// home of the demo that shows the engine saving and restoring a realistic KV
// cache. Run "kvpersist help" for the commands.
//
// Exit status, every command: 0 clean; 1 the store has problems (verify
// found damage, ls/inspect met an unreadable file, gc left a namespace
// unswept, the demo found a mismatch); 2 usage or I/O error (and refusals,
// such as synth asking for more memory than the machine has); 130 when
// interrupted (SIGINT or SIGTERM: the command stops at its next
// cancellation point; a second signal kills the process at once).
package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/signal"
	"strconv"
	"strings"
	"syscall"

	"github.com/spf13/cobra"
)

// exit codes
const (
	exitOK          = 0
	exitProblems    = 1   // the store has problems; demo found a mismatch
	exitUsage       = 2   // usage or I/O error
	exitInterrupted = 130 // 128 + SIGINT, as shells report it
)

// cli carries the process's streams so tests can run commands in-process.
type cli struct {
	stdout, stderr io.Writer
	// log prints warnings (a lock wait, an I/O error met by verify) on
	// stderr; it is also the engine's Logger, minus job failures, which
	// each command reports itself (once).
	log *slog.Logger
	tty bool // stderr is a terminal: show progress bars
}

// exitError ends a command with an exit status; whatever explains it has
// already been printed.
type exitError struct{ code int }

func (e exitError) Error() string { return fmt.Sprintf("exit status %d", e.code) }

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	// After the first signal, restore the default handling so that a
	// second one kills the process instead of being swallowed while the
	// command winds down. The goroutine ends with the first signal or with
	// the process.
	go func() {
		<-ctx.Done()
		stop()
	}()
	os.Exit(run(ctx, os.Args[1:], os.Stdout, os.Stderr, isTerminal(os.Stderr)))
}

// run runs the command line args and returns the exit status. An ended ctx
// (an interrupt) turns a failed command's status into 130.
func run(ctx context.Context, args []string, stdout, stderr io.Writer, tty bool) int {
	c := &cli{stdout: stdout, stderr: stderr, tty: tty,
		log: slog.New(dropJobFailures{slog.NewTextHandler(stderr, &slog.HandlerOptions{Level: slog.LevelWarn})})}
	root := c.rootCommand()
	root.SetArgs(args)
	root.SetOut(stdout)
	root.SetErr(stderr)
	cmd, err := root.ExecuteContextC(ctx)
	code := exitOK
	var ee exitError
	switch {
	case err == nil:
	case errors.As(err, &ee):
		code = ee.code
	default: // cobra's: a flag, argument count or command it refused
		if cmd == nil {
			cmd = root
		}
		fmt.Fprintf(stderr, "%s: %v\n\n", cmd.CommandPath(), err)
		fmt.Fprint(stderr, cmd.UsageString())
		code = exitUsage
	}
	if code != exitOK && ctx.Err() != nil {
		return exitInterrupted
	}
	return code
}

// rootCommand builds the command tree.
func (c *cli) rootCommand() *cobra.Command {
	root := &cobra.Command{
		Use:   "kvpersist",
		Short: "save and restore LLM KV caches on local disk",
		Long: `kvpersist: save and restore LLM KV caches on local disk.

Exit status, every command: 0 clean, 1 the store has problems, 2 usage or
I/O error, 130 interrupted (a second interrupt kills at once).`,
		Args:          cobra.NoArgs,
		SilenceErrors: true, // run prints a usage error once, with its reason first
		SilenceUsage:  true,
		RunE: func(cmd *cobra.Command, args []string) error {
			return errors.New("no command given")
		},
	}
	root.SetFlagErrorFunc(func(cmd *cobra.Command, err error) error { return err })
	for _, sub := range []*cobra.Command{
		c.inspectCommand(), c.lsCommand(), c.verifyCommand(), c.gcCommand(), c.duCommand(), c.statsCommand(),
		c.migrateCommand(), c.synthCommand(), c.demoCommand(),
	} {
		root.AddCommand(sub)
	}
	return root
}

// command is the shape every subcommand is built from: use is "NAME ARGS",
// doc the long help (may be empty), example one or more lines (without
// indentation), body the command, returning its exit status.
func (c *cli) command(use, short, doc, example string, args cobra.PositionalArgs) *cobra.Command {
	long := short
	if doc != "" {
		long = short + "\n\n" + doc
	}
	return &cobra.Command{
		Use: use, Short: short, Long: long, Args: args,
		Example: "  " + strings.ReplaceAll(strings.TrimSpace(example), "\n", "\n  "),
	}
}

// runs sets cmd's RunE to body, whose exit status becomes an exitError.
func runs(cmd *cobra.Command, body func(ctx context.Context, args []string) int) {
	cmd.RunE = func(cmd *cobra.Command, args []string) error {
		if code := body(cmd.Context(), args); code != exitOK {
			return exitError{code}
		}
		return nil
	}
}

// usageError is a usage error found by a command body (a flag value out of
// range): it prints the reason and the command's usage, and returns 2.
func (c *cli) usageError(cmd *cobra.Command, format string, a ...any) int {
	fmt.Fprintf(c.stderr, "%s: %s\n\n", cmd.CommandPath(), fmt.Sprintf(format, a...))
	fmt.Fprint(c.stderr, cmd.UsageString())
	return exitUsage
}

func (c *cli) fail(format string, a ...any) int {
	fmt.Fprintf(c.stderr, "kvpersist: "+format+"\n", a...)
	return exitUsage
}

// dropJobFailures is the CLI's log handler: it passes every record but the
// engine's "job failed" warning, since each command reports its failed job
// itself, once.
type dropJobFailures struct{ slog.Handler }

// engineJobFailed is the message engine logs a failed job with (dispatch.go).
const engineJobFailed = "kvpersist: job failed"

func (h dropJobFailures) Handle(ctx context.Context, r slog.Record) error {
	if r.Message == engineJobFailed {
		return nil
	}
	return h.Handler.Handle(ctx, r)
}

func (h dropJobFailures) WithAttrs(as []slog.Attr) slog.Handler {
	return dropJobFailures{h.Handler.WithAttrs(as)}
}

func (h dropJobFailures) WithGroup(name string) slog.Handler {
	return dropJobFailures{h.Handler.WithGroup(name)}
}

func humanBytes(n int64) string {
	const unit = 1024
	if n < unit && n > -unit {
		return fmt.Sprintf("%d B", n)
	}
	f, i := float64(n), 0
	for ; (f >= unit || f <= -unit) && i < 5; i++ {
		f /= unit
	}
	return fmt.Sprintf("%.1f %ciB", f, "KMGTP"[i-1])
}

// sizer is how du and stats print a byte count: humanBytes, or the exact
// count with --bytes.
func sizer(exact bool) func(int64) string {
	if exact {
		return func(n int64) string { return strconv.FormatInt(n, 10) }
	}
	return humanBytes
}

// parseInts parses a comma-separated list of positive integers, strictly
// (strconv.Atoi: "300x" is an error).
func parseInts(s string) ([]int, error) {
	var out []int
	for _, f := range strings.Split(s, ",") {
		v, err := strconv.Atoi(strings.TrimSpace(f))
		if err != nil || v <= 0 {
			return nil, fmt.Errorf("%q is not a positive integer", f)
		}
		out = append(out, v)
	}
	return out, nil
}
