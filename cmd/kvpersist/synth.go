package main

import (
	"context"
	"fmt"

	"github.com/kvpersist/kvpersist/engine"
	"github.com/kvpersist/kvpersist/engine/jobs"
	"github.com/kvpersist/kvpersist/engine/layout"
	"github.com/kvpersist/kvpersist/internal/kvgen"
)

func init() {
	register(&command{
		name: "synth", args: "",
		summary: "write one synthetic KV-cache snapshot (the demo's generator) into a store",
		example: "kvpersist synth --root /tmp/kvstore --ns conv --name turn-1 --model tiny --tokens 300 --layout blocks",
		run:     runSynth,
	})
}

// cacheRequest is the write request of a conversation's cache as mlx-lm
// saves it (kvgen.CacheRequest).
func cacheRequest(c *kvgen.Cache, tokens int) (caches, attachments []jobs.EntrySpec, meta layout.Meta) {
	return kvgen.CacheRequest(c, tokens)
}

func runSynth(ctx context.Context, c *cli, args []string) int {
	cmd := commands["synth"]
	fs := c.flags(cmd)
	root := fs.String("root", "", "store root directory (required)")
	ns := fs.String("ns", "default", "namespace")
	name := fs.String("name", "", "snapshot name (required)")
	model := fs.String("model", "tiny", "model geometry: tiny, llama-3.1-8b, qwen2.5-7b, gemma-2-9b")
	tokens := fs.Int("tokens", 256, "tokens in the cache")
	lay := fs.String("layout", "blocks", "layout: blocks or single")
	blockBytes := fs.Int("block-bytes", jobs.DefaultBlockBytes, "block size in bytes (blocks layout)")
	noSync := fs.Bool("no-sync", false, "skip fsync (tests and tmpfs only)")
	if _, code := c.parse(fs, args); code >= 0 {
		return code
	}
	if *root == "" || *name == "" {
		fs.Usage()
		return exitUsage
	}
	m, err := kvgen.ModelByName(*model)
	if err != nil {
		return c.fail("%v", err)
	}
	l, err := layout.ParseLayout(*lay)
	if err != nil {
		return c.fail("%v", err)
	}
	if *tokens <= 0 {
		return c.fail("--tokens must be positive")
	}
	e, err := engine.New(engine.Config{Root: *root, NoSync: *noSync, Logger: c.log})
	if err != nil {
		return c.fail("%v", err)
	}
	defer e.Close(context.Background())
	cache := kvgen.NewCache(m, *tokens, true, nil)
	caches, atts, meta := cacheRequest(cache, *tokens)
	res := e.Do(ctx, &engine.WriteRequest{Ref: engine.Ref{Namespace: *ns, Name: *name}, Layout: l,
		Meta: meta, Caches: caches, Attachments: atts, BlockBytes: *blockBytes})
	if res.Err != nil {
		return c.fail("synth: %v", res.Err)
	}
	fmt.Fprintf(c.stdout, "wrote %s/%s: %s layout, %d tokens, %s logical, %s written, %s reused\n",
		*ns, *name, l, *tokens, humanBytes(res.Metrics.LogicalBytes), humanBytes(res.Metrics.WrittenBytes), humanBytes(res.Metrics.ReusedBytes))
	return exitOK
}
