package main

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	iofs "io/fs"
	"os"
	"path/filepath"
	"text/tabwriter"
	"time"

	"github.com/kvpersist/kvpersist/engine"
	"github.com/kvpersist/kvpersist/engine/gather"
	"github.com/kvpersist/kvpersist/engine/jobs"
	"github.com/kvpersist/kvpersist/engine/layout"
	"github.com/kvpersist/kvpersist/internal/kvgen"
	"github.com/spf13/cobra"
)

// defaultDemoNamespace is the namespace the demo writes when --ns is not given.
const defaultDemoNamespace = "kvpersist-demo"

// demoSnapshotsCommand is `demo snapshots`: the named-snapshot layouts
// (blocks, then single) of one conversation, turn by turn, and collect.
func (c *cli) demoSnapshotsCommand() *cobra.Command {
	cmd := c.command("snapshots", "simulate a multi-turn conversation saved as named snapshots: save its KV cache each turn (blocks, then single), restore, verify, collect",
		`It builds the conversation's cache in memory (capacity-padded, as mlx-lm
keeps it) and restores each turn into fresh buffers, and refuses, before
allocating, when the two need more memory than the machine has available
(MemAvailable of /proc/meminfo). Exit status: 0 when every restore matched,
1 on a mismatch or a failed save or restore, 2 on usage or I/O errors.`,
		"kvpersist demo snapshots --model llama-3.1-8b --tokens 2048,4096,6144,8192",
		cobra.NoArgs)
	fs := cmd.Flags()
	model := fs.String("model", "llama-3.1-8b", "model geometry: tiny, llama-3.1-8b, qwen2.5-7b, gemma-2-9b")
	tokenList := fs.String("tokens", "2048,4096,6144,8192", "tokens in the cache at each turn, comma-separated, growing")
	blockBytes := fs.Int("block-bytes", jobs.DefaultBlockBytes, "block size in bytes (power of two, 4 KiB to 64 MiB)")
	root := fs.String("root", "", "store root (default: a temporary directory, removed at the end unless --keep)")
	nsName := fs.String("ns", defaultDemoNamespace, "namespace the demo writes, deletes in and collects (nothing else of the store is touched)")
	reuse := fs.Bool("reuse-ns", false, "use --ns even if it exists: its turn-NN and final-single snapshots are overwritten (and older turns deleted unless --keep)")
	keep := fs.Bool("keep", false, "keep the store (and every turn's manifest) at the end")
	workers := fs.Int("workers", 0, "pool size (default GOMAXPROCS)")
	noSync := fs.Bool("no-sync", false, "skip fsync (tmpfs only; numbers then flatter the disk)")
	runs(cmd, func(ctx context.Context, args []string) error {
		m, err := kvgen.ModelByName(*model)
		if err != nil {
			return err
		}
		turns, err := parseInts(*tokenList)
		if err != nil {
			return fmt.Errorf("--tokens: %w", err)
		}
		for i := 1; i < len(turns); i++ {
			if turns[i] < turns[i-1] {
				return fmt.Errorf("--tokens must not shrink: %d after %d", turns[i], turns[i-1])
			}
		}
		if err := jobs.CheckBlockBytes(*blockBytes); err != nil {
			return fmt.Errorf("--block-bytes: %w", err)
		}
		if err := layout.ValidName("namespace", *nsName); err != nil {
			return fmt.Errorf("--ns: %w", err)
		}
		ns := *nsName
		last := turns[len(turns)-1]
		// The cache, and the largest turn's restore buffers.
		if err := c.checkMemory("demo", cacheAllocBytes(m, last)+int64(m.CacheBytes(last))+int64(last*kvgen.IDSize)); err != nil {
			return err
		}
		dir := *root
		if dir != "" && !*reuse {
			// The store may be the operator's: never overwrite or delete
			// snapshots the demo did not write.
			if _, err := os.Lstat(filepath.Join(dir, ns)); err == nil {
				return fmt.Errorf("namespace %s already exists in %s: the demo would overwrite its snapshots; pick another --ns, or pass --reuse-ns", ns, dir)
			} else if !errors.Is(err, iofs.ErrNotExist) {
				return err
			}
		}
		if dir == "" {
			if dir, err = os.MkdirTemp("", "kvpersist-demo-"); err != nil {
				return err
			}
			if !*keep {
				defer os.RemoveAll(dir)
			}
		}
		e, err := engine.New(engine.Config{Root: dir, Workers: *workers, BlockBytes: *blockBytes, NoSync: *noSync, Logger: c.log, FS: c.lockNoticeFS()})
		if err != nil {
			return err
		}
		defer e.Close(context.Background())

		fmt.Fprintf(c.stdout, "kvpersist demo: %s (%d layers, %d KV heads, head_dim %d, %s), turns %v tokens, store %s, namespace %s\n",
			m.Name, m.Layers, m.KVHeads, m.HeadDim, m.DType, turns, dir, ns)
		fmt.Fprintf(c.stdout, "building the conversation's KV cache: %s at %d tokens, capacity-padded as mlx-lm keeps it...\n",
			humanBytes(int64(m.CacheBytes(last))), last)
		cache := kvgen.NewCache(m, last, true, nil)

		tw := tabwriter.NewWriter(c.stdout, 0, 0, 2, ' ', tabwriter.AlignRight)
		fmt.Fprintln(tw, "turn\tlayout\ttokens\tlogical\twritten\treused\tdedup\tsave MB/s\trestore MB/s\t")
		var names []string
		row := func(turn string, l layout.Layout, tokens int, name string) error {
			caches, atts, meta := cacheRequest(cache, tokens)
			ref := engine.Ref{Namespace: ns, Name: name}
			bar := c.progress(int64(m.CacheBytes(tokens)), fmt.Sprintf("turn %s save", turn))
			w := e.Do(ctx, &engine.WriteRequest{Ref: ref, Layout: l, Meta: meta, Caches: caches, Attachments: atts})
			bar.Add(w.Metrics.LogicalBytes)
			bar.Done()
			if w.Err != nil {
				return fmt.Errorf("turn %s: save: %w", turn, w.Err)
			}
			rd, restore, err := restoreAndCompare(ctx, c, e, ref, cache.ViewsAt(tokens))
			if err != nil {
				return fmt.Errorf("turn %s: %w", turn, err)
			}
			lb := float64(w.Metrics.LogicalBytes)
			fmt.Fprintf(tw, "%s\t%s\t%d\t%s\t%s\t%s\t%.0f%%\t%.0f\t%.0f\t\n", turn, l, tokens,
				humanBytes(w.Metrics.LogicalBytes), humanBytes(w.Metrics.WrittenBytes), humanBytes(w.Metrics.ReusedBytes),
				100*float64(w.Metrics.ReusedBytes)/lb, lb/1e6/w.Metrics.Elapsed.Seconds(), float64(rd)/1e6/restore.Seconds())
			return nil
		}
		for i, t := range turns {
			name := fmt.Sprintf("turn-%02d", i+1)
			if err := row(fmt.Sprint(i+1), layout.Blocks, t, name); err != nil {
				return problemsError{fmt.Errorf("demo: %w", err)}
			}
			names = append(names, name)
		}
		if err := row(fmt.Sprint(len(turns)), layout.Single, last, "final-single"); err != nil {
			return problemsError{fmt.Errorf("demo: %w", err)}
		}
		tw.Flush()

		// The scheduler keeps only the newest turn: older manifests go, collect
		// frees the blocks no remaining manifest names.
		if !*keep {
			for _, n := range names[:len(names)-1] {
				if r := e.Do(ctx, &engine.DeleteRequest{Ref: engine.Ref{Namespace: ns, Name: n}}); r.Err != nil {
					return fmt.Errorf("delete %s: %w", n, r.Err)
				}
			}
		}
		col := e.Do(ctx, &engine.CollectRequest{Namespaces: []string{ns}}) // the demo's namespace only
		if col.Err != nil {
			return fmt.Errorf("collect: %w", col.Err)
		}
		cm := col.Metrics.Collect
		fmt.Fprintf(c.stdout, "collect of namespace %s: %d manifests scanned, %d blocks kept, %d deleted, %s freed in %v\n",
			ns, cm.ManifestsScanned, cm.BlocksKept, cm.BlocksDeleted, humanBytes(cm.BytesFreed), col.Metrics.Elapsed.Round(time.Millisecond))
		final := names[len(names)-1]
		if _, _, err := restoreAndCompare(ctx, c, e, engine.Ref{Namespace: ns, Name: final}, cache.ViewsAt(last)); err != nil {
			return problemsError{fmt.Errorf("demo: after collect: %w", err)}
		}
		fmt.Fprintf(c.stdout, "after collect, %s restores bit-exact and verified. Every byte of every restore matched.\n", final)
		if *root != "" || *keep {
			fmt.Fprintf(c.stdout, "the store is kept in %s (kvpersist ls / du / verify %s)\n", dir, dir)
		}
		return nil
	})
	return cmd
}

// restoreAndCompare reads ref back through the engine with verification into
// fresh buffers and compares every byte with the source views.
func restoreAndCompare(ctx context.Context, c *cli, e *engine.Engine, ref engine.Ref, views []gather.View) (int64, time.Duration, error) {
	snap, err := e.Stat(ref)
	if err != nil {
		return 0, 0, fmt.Errorf("stat: %w", err)
	}
	slots := snap.Header.Slots()
	dest := make([][]byte, len(slots))
	for i, t := range slots {
		dest[i] = make([]byte, t.Bytes)
	}
	start := time.Now()
	r := e.Do(ctx, &engine.ReadRequest{Ref: ref, Dest: dest, Expect: snap.Header})
	elapsed := time.Since(start)
	if r.Err != nil {
		return 0, 0, fmt.Errorf("restore: %w", r.Err)
	}
	scratch := make([]byte, jobs.ChunkBytes)
	for i, v := range views {
		if len(dest[i]) != v.Bytes() {
			return 0, 0, fmt.Errorf("%s: restored %d bytes, saved %d", snap.Header.SlotName(i), len(dest[i]), v.Bytes())
		}
		chunk := len(scratch) / v.ItemSize
		for e := 0; e < v.Elements(); e += chunk {
			n := min(chunk, v.Elements()-e)
			want, _, err := v.GatherRange(e, n, scratch)
			if err != nil {
				return 0, 0, err
			}
			got := dest[i][e*v.ItemSize : (e+n)*v.ItemSize]
			if !bytes.Equal(got, want) {
				k := 0
				for k < len(got) && got[k] == want[k] {
					k++
				}
				return 0, 0, fmt.Errorf("%s of %s: byte %d differs: restored %#02x, saved %#02x", snap.Header.SlotName(i), ref, e*v.ItemSize+k, got[k], want[k])
			}
		}
	}
	return r.Metrics.ReadBytes, elapsed, nil
}
