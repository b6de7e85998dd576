// Command kvpersist is the operator's tool for a kvpersist store, and the
// home of the demo that shows the engine saving and restoring a realistic KV
// cache. Run "kvpersist help" for the commands.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/signal"
	"sort"
	"strings"
	"syscall"
)

// exit codes
const (
	exitOK       = 0
	exitProblems = 1 // verify found problems; demo found a mismatch
	exitUsage    = 2 // usage or I/O error
)

type command struct {
	name, args, summary, example string
	run                          func(ctx context.Context, c *cli, args []string) int
}

var commands = map[string]*command{}

func register(c *command) { commands[c.name] = c }

// cli carries the process's streams so tests can run commands in-process.
type cli struct {
	stdout, stderr io.Writer
	log            *slog.Logger
	tty            bool // stderr is a terminal: show progress bars
}

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	os.Exit(run(ctx, os.Args[1:], os.Stdout, os.Stderr, isTerminal(os.Stderr)))
}

func run(ctx context.Context, args []string, stdout, stderr io.Writer, tty bool) int {
	c := &cli{stdout: stdout, stderr: stderr, tty: tty,
		log: slog.New(slog.NewTextHandler(stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))}
	if len(args) == 0 || args[0] == "help" || args[0] == "-h" || args[0] == "--help" {
		if len(args) > 1 {
			if cmd, ok := commands[args[1]]; ok {
				return cmd.run(ctx, c, []string{"--help"})
			}
		}
		usage(stdout)
		if len(args) == 0 {
			return exitUsage
		}
		return exitOK
	}
	cmd, ok := commands[args[0]]
	if !ok {
		fmt.Fprintf(stderr, "kvpersist: unknown command %q\n\n", args[0])
		usage(stderr)
		return exitUsage
	}
	return cmd.run(ctx, c, args[1:])
}

func usage(w io.Writer) {
	fmt.Fprintln(w, "kvpersist: save and restore LLM KV caches on local disk.\n\nUsage: kvpersist COMMAND [flags] [args]\n\nCommands:")
	names := make([]string, 0, len(commands))
	for n := range commands {
		names = append(names, n)
	}
	sort.Strings(names)
	for _, n := range names {
		fmt.Fprintf(w, "  %-8s %s\n", n, commands[n].summary)
	}
	fmt.Fprintln(w, "\nRun 'kvpersist COMMAND --help' for a command's flags and an example.")
}

// flags makes a FlagSet whose --help prints the command's usage and example.
func (c *cli) flags(cmd *command) *flag.FlagSet {
	fs := flag.NewFlagSet(cmd.name, flag.ContinueOnError)
	fs.SetOutput(c.stderr)
	fs.Usage = func() {
		fmt.Fprintf(c.stderr, "Usage: kvpersist %s [flags] %s\n\n%s\n\nFlags:\n", cmd.name, cmd.args, cmd.summary)
		fs.PrintDefaults()
		fmt.Fprintf(c.stderr, "\nExample:\n  %s\n", cmd.example)
	}
	return fs
}

// parse parses flags, allowing them before and after positional arguments.
// It returns the positional arguments, or a non-negative exit code.
func (c *cli) parse(fs *flag.FlagSet, args []string) ([]string, int) {
	var pos []string
	for {
		if err := fs.Parse(args); err != nil {
			if errors.Is(err, flag.ErrHelp) {
				return nil, exitOK
			}
			return nil, exitUsage
		}
		args = fs.Args()
		if len(args) == 0 {
			return pos, -1
		}
		pos = append(pos, args[0])
		args = args[1:]
	}
}

// parseOne is parse for commands that take exactly one positional argument
// (a path or root): anything else prints the usage and exits 2.
func (c *cli) parseOne(fs *flag.FlagSet, args []string) (string, int) {
	pos, code := c.parse(fs, args)
	if code >= 0 {
		return "", code
	}
	if len(pos) != 1 {
		fs.Usage()
		return "", exitUsage
	}
	return pos[0], -1
}

func (c *cli) fail(format string, a ...any) int {
	fmt.Fprintf(c.stderr, "kvpersist: "+format+"\n", a...)
	return exitUsage
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

func parseInts(s string) ([]int, error) {
	var out []int
	for _, f := range strings.Split(s, ",") {
		var v int
		if _, err := fmt.Sscan(strings.TrimSpace(f), &v); err != nil || v <= 0 {
			return nil, fmt.Errorf("%q is not a positive integer", f)
		}
		out = append(out, v)
	}
	return out, nil
}
