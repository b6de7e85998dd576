// Command kvpersist is the operator's tool for a kvpersist store, and the
// home of the demo that shows the engine saving and restoring a realistic KV
// cache. Run "kvpersist help" for the commands.
//
// Exit status, every command: 0 clean; 1 the store has problems (verify
// found damage, ls/inspect met an unreadable file, gc left a namespace
// unswept, the demo found a mismatch); 2 usage or I/O error (and refusals,
// such as synth asking for more memory than the machine has); 130 when
// interrupted (SIGINT or SIGTERM: the command stops at its next
// cancellation point, or is ended windDown after the signal if it has not
// stopped by then; a second signal kills the process at once).
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
	"time"

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
	// stderr; it is also the engine's Logger (which logs a failed job at
	// debug level only: each command reports its failure itself, once).
	log *slog.Logger
	tty bool // stderr is a terminal: show progress bars
}

// Errors a command body returns, and the exit status run maps each to:
//   - nil: 0;
//   - exitStatus: that status, nothing more printed (the command's report
//     said what is wrong): errProblems (1), errReported (2);
//   - problemsError: 1, its message printed after "kvpersist: ";
//   - usageError: 2, its reason then the command's usage printed;
//   - any other error: 2, printed after "kvpersist: ".
//
// Whatever the error, 130 when the command's context ended (an interrupt).

// exitStatus ends a command whose report has already said what is wrong.
type exitStatus int

func (s exitStatus) Error() string { return fmt.Sprintf("exit status %d", int(s)) }

const (
	errProblems = exitStatus(exitProblems) // the store has problems, reported
	errReported = exitStatus(exitUsage)    // an I/O error, reported
)

// problemsError is a problem found (exit 1) that no report printed.
type problemsError struct{ err error }

func (e problemsError) Error() string { return e.err.Error() }
func (e problemsError) Unwrap() error { return e.err }

// usageError is a usage error found by a command body (a flag value out of
// range); run prints its reason, then the command's usage.
type usageError struct {
	cmd *cobra.Command
	msg string
}

func (e usageError) Error() string { return e.msg }

// commandError marks an error returned by a command body (see runs), apart
// from those cobra returns for the flags and arguments it refused.
type commandError struct{ err error }

func (e commandError) Error() string { return e.err.Error() }
func (e commandError) Unwrap() error { return e.err }

// windDown is how long a command may take to stop after SIGINT or SIGTERM
// before the process exits 130 without it: a wait that cannot be cancelled
// (an open(2) of a FIFO where a lock file belongs) must not make the
// signal look ignored. Ending the process there is as safe as a kill,
// which every file kvpersist publishes (by rename) survives.
const windDown = 5 * time.Second

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	// After the first signal, restore the default handling so that a
	// second one kills the process instead of being swallowed while the
	// command winds down, and end the process if the command has not
	// stopped within windDown. The goroutine ends with the process.
	go func() {
		<-ctx.Done()
		stop()
		time.Sleep(windDown)
		fmt.Fprintf(os.Stderr, "kvpersist: interrupted; the command did not stop within %v\n", windDown)
		os.Exit(exitInterrupted)
	}()
	os.Exit(run(ctx, os.Args[1:], os.Stdout, os.Stderr, isTerminal(os.Stderr)))
}

// run runs the command line args and returns the exit status. An ended ctx
// (an interrupt) makes it 130 whatever the command's outcome.
func run(ctx context.Context, args []string, stdout, stderr io.Writer, tty bool) int {
	c := &cli{stdout: stdout, stderr: stderr, tty: tty,
		log: slog.New(slog.NewTextHandler(stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))}
	root := c.rootCommand()
	root.SetArgs(args)
	root.SetOut(stdout)
	root.SetErr(stderr)
	cmd, err := root.ExecuteContextC(ctx)
	if cmd == nil {
		cmd = root
	}
	code := c.exitCode(cmd, err)
	if ctx.Err() != nil {
		return exitInterrupted
	}
	return code
}

// exitCode prints what err says (once) and returns its exit status: the one
// place a command's error becomes one.
func (c *cli) exitCode(cmd *cobra.Command, err error) int {
	var (
		ce commandError
		st exitStatus
		pe problemsError
		ue usageError
	)
	switch {
	case err == nil:
		return exitOK
	case !errors.As(err, &ce): // cobra's: a flag, argument count or command it refused
		c.printUsage(cmd, err.Error())
		return exitUsage
	case errors.As(err, &st):
		return int(st)
	case errors.As(err, &pe):
		fmt.Fprintf(c.stderr, "kvpersist: %v\n", pe.err)
		return exitProblems
	case errors.As(err, &ue):
		c.printUsage(ue.cmd, ue.msg)
		return exitUsage
	default:
		fmt.Fprintf(c.stderr, "kvpersist: %v\n", ce.err)
		return exitUsage
	}
}

// printUsage prints a usage error: its reason first, then cmd's usage.
func (c *cli) printUsage(cmd *cobra.Command, reason string) {
	fmt.Fprintf(c.stderr, "%s: %s\n\n", cmd.CommandPath(), reason)
	fmt.Fprint(c.stderr, cmd.UsageString())
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
// indentation).
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

// runs sets cmd's RunE to body; run maps body's error to the exit status
// (exitCode).
func runs(cmd *cobra.Command, body func(ctx context.Context, args []string) error) {
	cmd.RunE = func(cmd *cobra.Command, args []string) error {
		if err := body(cmd.Context(), args); err != nil {
			return commandError{err}
		}
		return nil
	}
}

// usage is a usage error of cmd found by its body (exit 2).
func usage(cmd *cobra.Command, format string, a ...any) error {
	return usageError{cmd, fmt.Sprintf(format, a...)}
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
