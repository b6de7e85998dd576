package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"strconv"
	"strings"

	"github.com/kvpersist/kvpersist/engine/layout"
	"github.com/kvpersist/kvpersist/internal/demo"
	"github.com/spf13/cobra"
)

// demoCommand is `demo`: the serving scenario of internal/demo on the
// prefix cache; `demo snapshots` is the named-snapshot demo.
func (c *cli) demoCommand() *cobra.Command {
	cmd := c.command("demo", "serve conversations that share a system prompt from the prefix cache: look up, load, verify, save each turn",
		`Several conversations share a system prompt and grow over several turns.
Before each turn the conversation is looked up in the prefix cache and its
stored prefix loaded (verified) into a fresh capacity-padded buffer, every
byte compared with what was saved; then its new tokens are computed and it
is saved again: only pages not stored yet are written, so a turn re-writes
its new tokens and its last, partial page, and the system prompt's full
pages are written once for all conversations (the "shared" column). Each
row prints as its turn completes. At the end the engine restarts (its index
rebuilt from the page files) and every conversation is resumed whole.

It refuses, before allocating, a run that needs more memory than the
machine has available (MemAvailable), and a namespace that exists (unless
--reuse-ns). Exit status: 0 when every byte matched, 1 on a mismatch, 2 on
usage or I/O errors and refusals, 130 on interrupt.

"kvpersist demo snapshots" runs the named-snapshot demo (block and
single-file layouts, then collect).`,
		"kvpersist demo\nkvpersist demo --model tiny --conversations 3 --system-tokens 40 --turns 3 --turn-tokens 20,30 --page-tokens 16",
		cobra.NoArgs)
	fs := cmd.Flags()
	model := fs.String("model", demo.DefaultModel, "model geometry: tiny, llama-3.1-8b, qwen2.5-7b, gemma-2-9b")
	convs := fs.Int("conversations", demo.DefaultConversations, "conversations sharing the system prompt")
	system := fs.Int("system-tokens", demo.DefaultSystemTokens, "tokens of the shared system prompt")
	turns := fs.Int("turns", demo.DefaultTurns, "turns per conversation")
	turnTokens := fs.String("turn-tokens", strconv.Itoa(demo.DefaultMinTurnTokens)+","+strconv.Itoa(demo.DefaultMaxTurnTokens), "tokens added per turn: MIN,MAX (or one number)")
	pageTokens := fs.Int("page-tokens", layout.DefaultPageTokens, "tokens per page (a power of two from 16 to 4096)")
	root := fs.String("root", "", "store root (default: a temporary directory, removed at the end unless --keep)")
	nsName := fs.String("ns", demo.DefaultNamespace, "namespace the demo writes (nothing else of the store is touched)")
	reuse := fs.Bool("reuse-ns", false, "use --ns even if it exists (its stored pages then count as reused)")
	keep := fs.Bool("keep", false, "keep the temporary store at the end")
	workers := fs.Int("workers", 0, "pool size (default GOMAXPROCS)")
	noSync := fs.Bool("no-sync", false, "skip fsync (tmpfs only; numbers then flatter the disk)")
	exact := fs.Bool("bytes", false, "print sizes as byte counts")
	runs(cmd, func(ctx context.Context, args []string) error {
		tt, err := parseInts(*turnTokens)
		if err != nil || len(tt) > 2 {
			if err == nil {
				err = errors.New("want MIN,MAX or one number")
			}
			return usage(cmd, "--turn-tokens: %v", err)
		}
		lo, hi := tt[0], tt[len(tt)-1]
		err = demo.Run(ctx, demo.Options{
			Root: *root, Keep: *keep, Namespace: *nsName, ReuseNamespace: *reuse,
			Model: *model, Conversations: *convs, SystemTokens: *system, Turns: *turns,
			MinTurnTokens: lo, MaxTurnTokens: hi, PageTokens: *pageTokens,
			Workers: *workers, NoSync: *noSync, Progress: os.Stderr, ExactBytes: *exact,
			Logger: c.log,
		}, c.stdout)
		switch {
		case err == nil:
			return nil
		case errors.Is(err, demo.ErrInvalidOptions):
			return usage(cmd, "%s", strings.TrimPrefix(err.Error(), "demo: "))
		case errors.Is(err, demo.ErrMismatch):
			return problemsError{fmt.Errorf("demo: %w", err)}
		default:
			return fmt.Errorf("demo: %w", err)
		}
	})
	cmd.AddCommand(c.demoSnapshotsCommand())
	return cmd
}
