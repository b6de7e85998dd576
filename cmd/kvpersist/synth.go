package main

import (
	"context"
	"fmt"

	"github.com/kvpersist/kvpersist/engine"
	"github.com/kvpersist/kvpersist/engine/jobs"
	"github.com/kvpersist/kvpersist/engine/layout"
	"github.com/kvpersist/kvpersist/internal/kvgen"
	"github.com/spf13/cobra"
)

// cacheRequest is the write request of a conversation's cache as mlx-lm
// saves it (kvgen.CacheRequest).
func cacheRequest(c *kvgen.Cache, tokens int) (caches, attachments []jobs.EntrySpec, meta layout.Meta) {
	return kvgen.CacheRequest(c, tokens)
}

func (c *cli) synthCommand() *cobra.Command {
	cmd := c.command("synth", "write one synthetic KV-cache snapshot (the demo's generator) into a store",
		`It builds the cache in memory first (capacity-padded, as mlx-lm keeps it)
and refuses, before allocating, when that needs more memory than the
machine has available (MemAvailable of /proc/meminfo). It waits for the
namespace's lock if another process holds it exclusively (a collect), and
says so.`,
		"kvpersist synth --root /tmp/kvstore --ns conv --name turn-1 --model tiny --tokens 300 --layout blocks",
		cobra.NoArgs)
	fs := cmd.Flags()
	root := fs.String("root", "", "store root directory (required)")
	ns := fs.String("ns", "default", "namespace")
	name := fs.String("name", "", "snapshot name (required)")
	model := fs.String("model", "tiny", "model geometry: tiny, llama-3.1-8b, qwen2.5-7b, gemma-2-9b")
	tokens := fs.Int("tokens", 256, "tokens in the cache")
	lay := fs.String("layout", "blocks", "layout: blocks or single")
	blockBytes := fs.Int("block-bytes", jobs.DefaultBlockBytes, "block size in bytes (blocks layout)")
	noSync := fs.Bool("no-sync", false, "skip fsync (tests and tmpfs only)")
	_ = cmd.MarkFlagRequired("root")
	_ = cmd.MarkFlagRequired("name")
	runs(cmd, func(ctx context.Context, args []string) error {
		m, err := kvgen.ModelByName(*model)
		if err != nil {
			return err
		}
		l, err := layout.ParseLayout(*lay)
		if err != nil {
			return err
		}
		if *tokens <= 0 {
			return usage(cmd, "--tokens must be positive, not %d", *tokens)
		}
		if err := c.checkMemory("synth", cacheAllocBytes(m, *tokens)); err != nil {
			return err
		}
		e, err := engine.New(engine.Config{Root: *root, NoSync: *noSync, Logger: c.log, FS: c.lockNoticeFS()})
		if err != nil {
			return err
		}
		defer e.Close(context.Background())
		cache := kvgen.NewCache(m, *tokens, true, nil)
		caches, atts, meta := cacheRequest(cache, *tokens)
		res := e.Do(ctx, &engine.WriteRequest{Ref: engine.Ref{Namespace: *ns, Name: *name}, Layout: l,
			Meta: meta, Caches: caches, Attachments: atts, BlockBytes: *blockBytes})
		if res.Err != nil {
			return fmt.Errorf("synth: %w", res.Err)
		}
		fmt.Fprintf(c.stdout, "wrote %s/%s: %s layout, %d tokens, %s logical, %s written, %s reused\n",
			*ns, *name, l, *tokens, humanBytes(res.Metrics.LogicalBytes), humanBytes(res.Metrics.WrittenBytes), humanBytes(res.Metrics.ReusedBytes))
		return nil
	})
	return cmd
}
