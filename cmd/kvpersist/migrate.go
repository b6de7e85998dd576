package main

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"text/tabwriter"

	"github.com/kvpersist/kvpersist/engine"
	"github.com/kvpersist/kvpersist/engine/jobs"
	"github.com/kvpersist/kvpersist/engine/vfs"
	"github.com/spf13/cobra"
)

// migrateCommand migrates every legacy snapshot SRC_ROOT/<ns>/<name> to
// DST_ROOT/<ns>/<name> through an engine on DST_ROOT (a MigrateRequest).
// Exit codes: 0 when every snapshot was migrated or already was, 1 when
// some failed (the others are migrated), 2 for usage errors and errors that
// stopped the whole migration.
func (c *cli) migrateCommand() *cobra.Command {
	cmd := c.command("migrate SRC_ROOT DST_ROOT",
		"rewrite the snapshots of the original Bun worker's store in kvpersist's format (source untouched)", "",
		"kvpersist migrate /var/lib/mlx-kv /var/lib/kvpersist", cobra.ExactArgs(2))
	fs := cmd.Flags()
	nsList := fs.String("ns", "", "comma-separated namespaces to migrate (default: every directory of SRC_ROOT)")
	blockBytes := fs.Int("block-bytes", 0, "0 keeps each manifest's block boundaries (the same blocks as the source); else re-cut manifests at this size (power of two, 4 KiB to 64 MiB)")
	force := fs.Bool("force", false, "re-migrate snapshots already migrated, and overwrite destinations holding something else")
	workers := fs.Int("workers", 0, "pool size (default GOMAXPROCS)")
	noSync := fs.Bool("no-sync", false, "skip fsync (tests and tmpfs only)")
	quiet := fs.Bool("quiet", false, "print only failures and the summary")
	runs(cmd, func(ctx context.Context, args []string) error {
		src, dst := args[0], args[1]
		if err := jobs.CheckMigrateRoots(src, dst); err != nil {
			return fmt.Errorf("migrate: %w", err)
		}
		if st, err := vfs.Default.Lstat(src); err != nil || !st.IsDir() {
			return fmt.Errorf("migrate: source root %s is not a directory", src)
		}
		if *blockBytes != 0 {
			if err := jobs.CheckBlockBytes(*blockBytes); err != nil {
				return fmt.Errorf("--block-bytes: %w", err)
			}
		}
		var namespaces []string
		if *nsList != "" {
			for _, n := range strings.Split(*nsList, ",") {
				namespaces = append(namespaces, strings.TrimSpace(n))
			}
		}
		// Failures are reported below, per snapshot (the engine logs a
		// failed job at debug level only).
		e, err := engine.New(engine.Config{Root: dst, Workers: *workers, NoSync: *noSync, Logger: c.log, FS: c.lockNoticeFS()})
		if err != nil {
			return err
		}
		defer e.Close(context.Background())

		// The callbacks run on the job's goroutine while this one waits in Do.
		bar := &progress{}
		res := e.Do(ctx, &engine.MigrateRequest{
			SrcRoot: src, Namespaces: namespaces, BlockBytes: *blockBytes, Force: *force,
			OnPlan: func(n int, bytes int64) {
				fmt.Fprintf(c.stdout, "migrate %s -> %s: %d legacy snapshot(s), %s of tensors\n", src, dst, n, humanBytes(bytes))
				if bytes > 0 {
					bar = c.progress(bytes, "migrating")
				}
			},
			OnItem: func(it jobs.MigrateItem) { bar.Add(it.LogicalBytes) },
		})
		bar.Done()
		rep := res.Metrics.Migrate
		if rep == nil { // the job did not start
			rep = &jobs.MigrateReport{}
		}
		var merr *jobs.MigrateError
		if res.Err != nil && !errors.As(res.Err, &merr) {
			if len(rep.Items) > 0 {
				printMigrateReport(c, rep, *quiet)
			}
			return fmt.Errorf("migrate: %w", res.Err)
		}
		printMigrateReport(c, rep, *quiet)
		m := res.Metrics
		fmt.Fprintf(c.stdout, "%d snapshot(s): %d migrated, %d skipped, %d failed; %s of tensors migrated, %s written, %s reused (dedup); %d other entries left alone\n",
			len(rep.Items), rep.Migrated, rep.Skipped, rep.Failed,
			humanBytes(m.LogicalBytes), humanBytes(m.WrittenBytes), humanBytes(m.ReusedBytes), len(rep.Ignored))
		if rep.Failed > 0 {
			return problemsError{fmt.Errorf("migrate: %d snapshot(s) failed (listed above); their sources are unchanged", rep.Failed)}
		}
		return nil
	})
	return cmd
}

// printMigrateReport lists every snapshot (failures only when quiet, on
// stderr) and the entries left alone.
func printMigrateReport(c *cli, rep *jobs.MigrateReport, quiet bool) {
	tw := tabwriter.NewWriter(c.stdout, 0, 0, 2, ' ', 0)
	for _, it := range rep.Items {
		switch it.Status {
		case jobs.StatusFailed:
			fmt.Fprintf(c.stderr, "FAILED    %s: %v\n", it.Ref(), it.Err)
		case jobs.StatusSkipped:
			if !quiet {
				fmt.Fprintf(tw, "skipped\t%s\t%s\t%s\talready migrated\n", it.Ref(), it.Layout, humanBytes(it.LogicalBytes))
			}
		default:
			if quiet {
				continue
			}
			note := ""
			if it.Recut {
				note = fmt.Sprintf(", re-cut (source blocks up to %s)", humanBytes(it.SourceBlockBytes))
			}
			fmt.Fprintf(tw, "migrated\t%s\t%s\t%s\t%s written, %s reused%s\n", it.Ref(), it.Layout, humanBytes(it.LogicalBytes),
				humanBytes(it.Metrics.WrittenBytes), humanBytes(it.Metrics.ReusedBytes), note)
		}
	}
	if !quiet {
		for _, ig := range rep.Ignored {
			fmt.Fprintf(tw, "left\t%s\t\t\t%s\n", ig.Path, ig.Why)
		}
	}
	tw.Flush()
}
