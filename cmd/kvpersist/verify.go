package main

import (
	"context"
	"fmt"
	"runtime"

	"github.com/kvpersist/kvpersist/engine/jobs"
	"github.com/spf13/cobra"
)

// verifyReport is what verify --json prints: jobs.VerifyReport with its
// verdict.
type verifyReport struct {
	Target string `json:"target"`
	Clean  bool   `json:"clean"`
	// Problems, by kind (io-error, unreadable, corrupt-tensor,
	// corrupt-block, block-xxh3, corrupt-page, missing-block, missing-page,
	// not-a-directory, block-size, stale-temp, orphan-block), then path.
	Problems []jobs.VerifyProblem `json:"problems"`
	Checked  jobs.VerifyChecked   `json:"checked"`
	// Notes say what was not checked and why (e.g. orphans of a namespace
	// holding an unreadable manifest).
	Notes []string `json:"notes"`
	// Skipped lists entries kvpersist does not recognise (never touched).
	Skipped []string `json:"skipped"`
}

func (c *cli) verifyCommand() *cobra.Command {
	cmd := c.command("verify ROOT|PATH | verify --remote [NAMESPACE...]", "re-read and re-hash a whole store (or one snapshot): headers, tensors, blocks, orphans, stale temp files", `Given a store ROOT (the directory above the namespaces), verify checks every
namespace; given a namespace directory (one holding blocks/, a .lock or a
snapshot file, with or without blocks/), that namespace; given a snapshot
file or manifest PATH, that snapshot only.

  - every header: prefix, header hash, validation (as 'kvpersist inspect');
  - every tensor of a single-file snapshot: re-read and re-hashed (xxh3-64;
    Bun.hash for the Bun worker's files) against its header hash;
  - every block a manifest names: present, of the size the manifest says,
    its SHA-256 equal to its name and, in the same pass, its xxh3-64 equal
    to what every formatVersion 8 manifest naming it records. Each distinct
    block is read once per namespace however many manifests name it; blocks
    of the Bun worker's manifests are looked for in blocks/<sha>
    (kvpersist's in blocks/<2>/<sha>);
  - orphan blocks (ROOT or namespace): block files no manifest names, which 'gc'
    deletes. A namespace holding an unreadable manifest has no orphans:
    the blocks that manifest names cannot be known, so gc does not sweep
    that namespace either; its unnamed blocks are still re-hashed against
    their names, and a note says so;
  - every page file of the prefix page cache (pages/<2>/<key>): its header,
    that its key is the chain step from its parent key over its token ids
    and equals its file name, and every tensor re-hashed (xxh3-64); every
    page a page manifest names: present;
  - stale temp files (ROOT or namespace): leftovers of interrupted writes older than
    --temp-grace (younger ones may belong to a running write).

While it lists a namespace, verify holds the namespace lock exclusively
(as gc does), so a write in progress finishes first and its blocks are not
taken for orphans; it then re-hashes without the lock. Names and paths that
hold non-printable characters are printed quoted. Problems are listed
as KIND PATH DETAIL; kinds: unreadable (a header, or a page's key against
its chain, fails), corrupt-tensor (of a single file or a page),
corrupt-block (its SHA-256 differs from its name: the block is bad),
block-xxh3 (PATH is a manifest recording an xxh3-64 that differs from a
block whose bytes match its name: the manifest is bad, its verified
restore fails; remove or re-save the manifest, never the block),
corrupt-page (a file under pages/ that decodes but is not the page its
name says), missing-block, missing-page (a page a page manifest names is
not stored), not-a-directory (a file or symlink at pages/<xx> or
blocks/<xx>, where a fan-out directory belongs), block-size, orphan-block,
stale-temp, io-error.

With --remote, verify checks the object-store tier instead: it fetches
every object of each namespace (--workers at a time, each through a temp
file) and checks each page as above (header, key against its name and its
chain step, every tensor's xxh3-64) and each manifest (a page manifest
whose header decodes, its attachments re-hashed), then that every page a
manifest names is stored and that its pages form its chain (parent keys,
identity, page size, token count). Problem kinds: corrupt-page,
unreadable (a manifest), missing-page, broken-chain. Objects deleted by a
remote gc while verify runs are listed as vanished, not as problems.
With --repair-from ROOT, each corrupt-page object is then replaced by the
page of the same key in the local store ROOT (a machine that holds it),
if that page verifies and the object still does not; good objects are
never replaced. A save of an engine holding the page repairs it too.

Exit status: 0 when clean, 1 when problems were found, 2 on usage or I/O
errors (io-error problems included; with --remote, a request that fails
after the client's retries).`,
		"kvpersist verify /var/lib/kvcache\nkvpersist verify --json /var/lib/kvcache/conv-42/turn-7\nkvpersist verify --remote --endpoint s3.example.com --bucket kvcache --prefix fleet-a conv-42",
		nil)
	fs := cmd.Flags()
	rf := addRemoteFlags(fs)
	cmd.Args = rf.args(cobra.ExactArgs(1))
	asJSON := fs.Bool("json", false, "print a JSON report: {target, clean, problems: [{kind, path, detail}], checked, notes, skipped}")
	tempGrace := addTempGrace(fs, jobs.DefaultTempGrace, "report temp files older than this as stale")
	noLock := fs.Bool("no-lock", false, "do not wait for the namespace lock (writes in progress may then show as orphan blocks)")
	workers := fs.Int("workers", runtime.GOMAXPROCS(0), "goroutines re-hashing in parallel")
	repairFrom := fs.String("repair-from", "", "with --remote: replace each corrupt page object with the page of the same key under this local store ROOT, when that page verifies")
	runs(cmd, func(ctx context.Context, args []string) error {
		if *workers < 1 {
			return usage(cmd, "--workers must be at least 1")
		}
		if rf.on {
			return c.runRemoteVerify(ctx, cmd, rf, args, *workers, *asJSON, *repairFrom)
		}
		if msg := rf.check(cmd); msg != "" {
			return usage(cmd, "%s", msg)
		}
		if *repairFrom != "" {
			return usage(cmd, "--repair-from needs --remote")
		}
		target := args[0]
		var bar *progress
		defer func() {
			if bar != nil {
				bar.Done()
			}
		}()
		cfg := &jobs.Config{NoLock: *noLock, Helpers: *workers - 1, Spawn: func(fn func()) bool { go fn(); return true }}
		if *workers == 1 {
			cfg.Spawn = nil
		}
		res, err := jobs.VerifyStore(ctx, cfg, &jobs.VerifySpec{Target: target, TempGrace: *tempGrace,
			OnPlan:     func(total int64) { bar = c.progress(total, "verify") },
			OnProgress: func(n int64) { bar.Add(n) },
			OnLockWait: func(nsDir string) {
				c.log.Warn("waiting for the namespace lock (a write or collect is running)", "namespace", nsDir)
			},
		})
		if err != nil {
			return fmt.Errorf("verify: %s", quote(err.Error()))
		}
		r := &verifyReport{Target: target, Problems: res.Problems, Checked: res.Checked, Notes: res.Notes, Skipped: res.Skipped}
		for _, p := range r.Problems {
			if p.Kind == jobs.ProblemIO {
				c.log.Warn("verify: I/O error", "path", p.Path, "err", p.Detail)
			}
		}
		if r.Problems == nil {
			r.Problems = []jobs.VerifyProblem{}
		}
		if r.Notes == nil {
			r.Notes = []string{}
		}
		if r.Skipped == nil {
			r.Skipped = []string{}
		}
		r.Clean = len(r.Problems) == 0
		if *asJSON {
			if err := c.writeJSON(r); err != nil {
				return fmt.Errorf("writing JSON: %w", err)
			}
		} else {
			printVerify(c, r)
		}
		var exit error
		for _, p := range r.Problems {
			if p.Kind == jobs.ProblemIO {
				return errReported
			}
			exit = errProblems
		}
		return exit
	})
	return cmd
}

func printVerify(c *cli, r *verifyReport) {
	w := c.stdout
	hashed := nounCount(r.Checked.Tensors, "tensor") + " and " + nounCount(r.Checked.Blocks, "block")
	if r.Checked.Pages > 0 {
		hashed = nounCount(r.Checked.Tensors, "tensor") + ", " + nounCount(r.Checked.Blocks, "block") + " and " + nounCount(r.Checked.Pages, "page")
	}
	fmt.Fprintf(w, "verify %s: %s, %s; %s re-hashed (%s)\n", quote(r.Target),
		nounCount(r.Checked.Namespaces, "namespace"), nounCount(r.Checked.Snapshots, "snapshot"), hashed, humanBytes(r.Checked.Bytes))
	for _, n := range r.Notes {
		fmt.Fprintf(w, "note: %s\n", quote(n))
	}
	for _, s := range r.Skipped {
		fmt.Fprintf(w, "skipped (not a kvpersist file, not checked): %s\n", quote(s))
	}
	if r.Clean {
		fmt.Fprintln(w, "clean: no problems found")
		return
	}
	fmt.Fprintf(w, "%s:\n", nounCount(len(r.Problems), "problem"))
	for _, p := range r.Problems {
		fmt.Fprintf(w, "  %-14s %s\n      %s\n", p.Kind, quote(p.Path), quote(p.Detail))
	}
}
