package main

import (
	"context"
	"fmt"
	"time"

	"github.com/kvpersist/kvpersist/engine"
	"github.com/kvpersist/kvpersist/engine/jobs"
	"github.com/kvpersist/kvpersist/engine/store"
	"github.com/spf13/cobra"
)

// gcReport is what gc --json prints. Paths are absolute or relative as ROOT was given.
type gcReport struct {
	Root   string `json:"root"`
	DryRun bool   `json:"dryRun"`
	// Deleted lists every file deleted (with --dry-run: that would be).
	Deleted []string `json:"deleted"`
	// BlocksDeleted and BytesFreed count block files (bytes: their sizes);
	// TempRemoved counts temp files (their bytes are not in BytesFreed).
	BlocksDeleted    int64 `json:"blocksDeleted"`
	BytesFreed       int64 `json:"bytesFreed"`
	TempRemoved      int64 `json:"tempRemoved"`
	BlocksKept       int64 `json:"blocksKept"`
	ManifestsScanned int   `json:"manifestsScanned"`
	Namespaces       int   `json:"namespaces"`
	// Unreadable lists the files that did not decode, with the reason; the
	// namespaces holding them (UnsweptNamespaces) keep all their blocks.
	Unreadable        []string `json:"unreadable"`
	UnsweptNamespaces []string `json:"unsweptNamespaces"`
	// Skipped lists entries kvpersist does not recognise; never deleted.
	Skipped []string `json:"skipped"`
}

func (c *cli) gcCommand() *cobra.Command {
	cmd := c.command("gc ROOT | gc --remote [NAMESPACE...]",
		"delete blocks no manifest names and stale temp files (collect); --dry-run lists them only", `Runs the engine's collect on every namespace of ROOT: it marks every block a
readable manifest names and deletes the block files no manifest names, and
temp files (of interrupted writes) older than --temp-grace. It holds each
namespace's lock exclusively while it works, so writes and reads of this or
another process wait, and a write in progress never loses its blocks.

A namespace holding a file that does not decode (see 'kvpersist verify')
is not swept at all: the blocks that file names cannot be known. Repair or
remove the file, then run gc again. Entries kvpersist does not recognise
are listed as skipped and never deleted. BYTES FREED counts block files;
temp files are listed and counted apart.

With --remote, gc collects the object-store tier instead, and is a DRY RUN
unless --delete is given: the bucket is shared by every machine of the
fleet, no lock excludes their uploads, and a deleted object cannot be
restored, so the default only lists what would go. Per namespace it lists
every object (the listing's Date header gives the store's clock), then
fetches every manifest, then deletes each page that no manifest names and
whose modification time is older than the store's clock minus --grace
(default 1h, minimum 1m). Manifests and objects kvpersist does not write
are never deleted. A namespace holding a manifest that cannot be read is
not collected at all (the pages it names cannot be known). --grace must
exceed the longest time between a machine uploading (or finding) a page
and uploading the manifest that names it, plus the clock skew between the
store's own nodes; the machines' clocks do not matter.

Exit status: 0, 1 when a namespace was not swept because of an unreadable
file (or remote manifest), 2 on usage or I/O errors.`,
		"kvpersist gc --dry-run /var/lib/kvcache\nkvpersist gc --block-grace 1h /var/lib/kvcache\nkvpersist gc --remote --endpoint s3.example.com --bucket kvcache --prefix fleet-a\nkvpersist gc --remote --endpoint s3.example.com --bucket kvcache --prefix fleet-a --grace 2h --delete",
		nil)
	fs := cmd.Flags()
	rf := addRemoteFlags(fs)
	cmd.Args = rf.args(cobra.ExactArgs(1))
	grace := fs.Duration("grace", time.Hour, "with --remote: keep unreferenced pages younger than this, by the store's clock (minimum 1m)")
	del := fs.Bool("delete", false, "with --remote: delete (without it gc --remote is a dry run)")
	dryRun := fs.Bool("dry-run", false, "delete nothing; list what would be deleted")
	asJSON := fs.Bool("json", false, "print a JSON report: {root, dryRun, deleted, blocksDeleted, bytesFreed, tempRemoved, blocksKept, manifestsScanned, namespaces, unreadable, unsweptNamespaces, skipped}")
	tempGrace := addTempGrace(fs, jobs.DefaultTempGrace, "keep temp files younger than this (they may belong to a running write); none removes every temp file")
	blockGrace := fs.Duration("block-grace", 0, "keep unreferenced blocks younger than this (for writers that do not take the namespace lock)")
	runs(cmd, func(ctx context.Context, args []string) error {
		if rf.on {
			return c.runRemoteGC(ctx, cmd, rf, args, *grace, *del, *asJSON)
		}
		if msg := rf.check(cmd); msg != "" {
			return usage(cmd, "%s", msg)
		}
		if fs.Changed("grace") || fs.Changed("delete") {
			return usage(cmd, "--grace and --delete need --remote (a local gc deletes unless --dry-run)")
		}
		return c.runGC(ctx, cmd, args[0], *dryRun, *asJSON, *tempGrace, *blockGrace)
	})
	return cmd
}

func (c *cli) runGC(ctx context.Context, cmd *cobra.Command, root string, dryRun, asJSON bool, tempGrace, blockGrace time.Duration) error {
	if blockGrace < 0 {
		return usage(cmd, "--block-grace must not be negative")
	}
	// engine.New creates a missing root: check first that it is one.
	if _, err := store.Open(root, store.Options{}); err != nil {
		return fmt.Errorf("gc: %s", quote(err.Error()))
	}
	e, err := engine.New(engine.Config{Root: root, TempGrace: tempGrace, BlockGrace: blockGrace, Logger: c.log, FS: c.lockNoticeFS()})
	if err != nil {
		return fmt.Errorf("gc: %w", err)
	}
	res := e.Do(ctx, &engine.CollectRequest{DryRun: dryRun})
	if err := e.Close(context.Background()); err != nil {
		c.log.Warn("closing the engine", "err", err)
	}
	if res.Err != nil {
		return fmt.Errorf("gc %s: %w", root, res.Err)
	}
	cm := res.Metrics.Collect
	rep := gcReport{Root: root, DryRun: dryRun, Deleted: gcList(cm.Deleted),
		BlocksDeleted: cm.BlocksDeleted, BytesFreed: cm.BytesFreed, TempRemoved: cm.TempRemoved,
		BlocksKept: cm.BlocksKept, ManifestsScanned: cm.ManifestsScanned, Namespaces: cm.Namespaces,
		Unreadable: gcList(cm.Unreadable), UnsweptNamespaces: gcList(cm.UnsweptNamespaces), Skipped: gcList(cm.Skipped)}
	if asJSON {
		if err := c.writeJSON(rep); err != nil {
			return fmt.Errorf("writing JSON: %w", err)
		}
	} else {
		w := c.stdout
		verb, freed := "deleted", "freed"
		if dryRun {
			verb, freed = "would delete", "would free"
		}
		for _, p := range rep.Deleted {
			fmt.Fprintf(w, "%s %s\n", verb, quote(p))
		}
		fmt.Fprintf(w, "gc %s: %d namespaces, %d manifests scanned, %d blocks kept; %s %d blocks and %d temp files, %s %s (%d bytes) in %v\n",
			root, rep.Namespaces, rep.ManifestsScanned, rep.BlocksKept, verb, rep.BlocksDeleted, rep.TempRemoved,
			freed, humanBytes(rep.BytesFreed), rep.BytesFreed, res.Metrics.Elapsed.Round(time.Millisecond))
		if dryRun {
			fmt.Fprintln(w, "dry run: nothing was deleted")
		}
		for _, u := range rep.Unreadable {
			fmt.Fprintf(w, "unreadable: %s\n", quote(u))
		}
		for _, ns := range rep.UnsweptNamespaces {
			fmt.Fprintf(w, "not swept (it holds an unreadable file; repair or remove it): %s\n", quote(ns))
		}
		for _, s := range rep.Skipped {
			fmt.Fprintf(w, "skipped (not a kvpersist file, never deleted): %s\n", quote(s))
		}
	}
	if len(rep.UnsweptNamespaces) > 0 || len(rep.Unreadable) > 0 {
		return errProblems
	}
	return nil
}

func gcList(s []string) []string {
	if s == nil {
		return []string{}
	}
	return s
}
