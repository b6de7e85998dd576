package main

import (
	"context"
	"fmt"
	"text/tabwriter"
	"time"

	"github.com/kvpersist/kvpersist/engine/store"
	"github.com/spf13/cobra"
)

// duRow is one namespace's usage. Bytes are bytes.
type duRow struct {
	Namespace  string `json:"namespace"`
	Snapshots  int    `json:"snapshots"`  // readable snapshot files and manifests
	Unreadable int    `json:"unreadable"` // files that did not decode
	// LogicalBytes: the sum over readable snapshots of their tensor bytes
	// (what restoring every snapshot would fill).
	LogicalBytes int64 `json:"logicalBytes"`
	// PhysicalBytes = SnapshotFileBytes + BlockFileBytes + PageFileBytes.
	PhysicalBytes int64 `json:"physicalBytes"`
	// SnapshotFileBytes: sizes of every snapshot file and manifest
	// (readable or not), headers and alignment padding included.
	SnapshotFileBytes int64 `json:"snapshotFileBytes"`
	// BlockFiles / BlockFileBytes: every block file under blocks/, counted
	// once however many manifests name it, referenced or not.
	BlockFiles     int   `json:"blockFiles"`
	BlockFileBytes int64 `json:"blockFileBytes"`
	// Pages / PageFileBytes: every page file of the prefix page cache
	// (pages/), readable or not (unreadable ones also count in
	// Unreadable), and the sum of their sizes.
	Pages         int   `json:"pages"`
	PageFileBytes int64 `json:"pageFileBytes"`
	// SharedPages / SharedPageBytes: the pages shared between
	// conversations (see du --help: a page that stored prefixes continue
	// in two or more different ways) and the sum of their file sizes.
	SharedPages     int   `json:"sharedPages"`
	SharedPageBytes int64 `json:"sharedPageBytes"`
	// PageAllocatedBytes: the page files' allocated bytes (st_blocks ×
	// 512), what the engine accounts against its capacity and quotas;
	// QuotaBytes / OverQuotaBytes: --quota and the allocated bytes
	// beyond it (as `kvpersist stats`).
	PageAllocatedBytes int64 `json:"pageAllocatedBytes"`
	QuotaBytes         int64 `json:"quotaBytes"`
	OverQuotaBytes     int64 `json:"overQuotaBytes"`
	// ReclaimableBytes: block files gc would delete now (no readable
	// manifest names them; 0 when the namespace holds an unreadable file,
	// which gc does not sweep), with --block-grace 0.
	ReclaimableBytes int64 `json:"reclaimableBytes"`
	// TempFiles / TempBytes: temp files of writes in progress or
	// interrupted; not part of PhysicalBytes.
	TempFiles int   `json:"tempFiles"`
	TempBytes int64 `json:"tempBytes"`
	// DedupRatio = LogicalBytes / PhysicalBytes (0 when PhysicalBytes is 0).
	DedupRatio float64 `json:"dedupRatio"`
}

type duReport struct {
	Root       string   `json:"root"`
	Namespaces []duRow  `json:"namespaces"`
	Total      duRow    `json:"total"` // namespace "TOTAL"
	Skipped    []string `json:"skipped"`
	// Cache: the page cache against --capacity and --headroom (as
	// `kvpersist stats`).
	Cache cacheReport `json:"cache"`
}

func (r *duRow) add(o duRow) {
	r.Snapshots += o.Snapshots
	r.Unreadable += o.Unreadable
	r.LogicalBytes += o.LogicalBytes
	r.PhysicalBytes += o.PhysicalBytes
	r.SnapshotFileBytes += o.SnapshotFileBytes
	r.BlockFiles += o.BlockFiles
	r.BlockFileBytes += o.BlockFileBytes
	r.Pages += o.Pages
	r.PageFileBytes += o.PageFileBytes
	r.SharedPages += o.SharedPages
	r.SharedPageBytes += o.SharedPageBytes
	r.PageAllocatedBytes += o.PageAllocatedBytes
	r.QuotaBytes += o.QuotaBytes
	r.OverQuotaBytes += o.OverQuotaBytes
	r.ReclaimableBytes += o.ReclaimableBytes
	r.TempFiles += o.TempFiles
	r.TempBytes += o.TempBytes
}

func (r *duRow) ratio() {
	r.DedupRatio = 0
	if r.PhysicalBytes > 0 {
		r.DedupRatio = float64(r.LogicalBytes) / float64(r.PhysicalBytes)
	}
}

// duNamespace measures one scanned namespace.
func duNamespace(ns *store.Listing) duRow {
	r := duRow{Namespace: ns.Namespace.Name()}
	live := map[string]bool{}
	for _, s := range ns.Snapshots {
		r.SnapshotFileBytes += s.Size
		if s.Err != nil {
			r.Unreadable++
			continue
		}
		r.Snapshots++
		r.LogicalBytes += logicalBytes(s.Snap.Header)
		for _, t := range s.Snap.Header.Slots() {
			for _, b := range t.Blocks {
				live[b.Hash] = true
			}
		}
	}
	for _, b := range ns.Blocks {
		r.BlockFiles++
		r.BlockFileBytes += b.Size
		if !live[b.Hash] && r.Unreadable == 0 {
			r.ReclaimableBytes += b.Size
		}
	}
	for _, t := range ns.Temps {
		r.TempFiles++
		r.TempBytes += t.Size
	}
	u := ns.PageUsage()
	r.Pages, r.PageFileBytes = u.Pages, u.FileBytes
	r.SharedPages, r.SharedPageBytes = u.SharedPages, u.SharedBytes
	r.Unreadable += u.Unreadable
	r.PhysicalBytes = r.SnapshotFileBytes + r.BlockFileBytes + r.PageFileBytes
	r.ratio()
	return r
}

func (c *cli) duCommand() *cobra.Command {
	cmd := c.command("du ROOT | du --remote [NAMESPACE...]", "disk usage per namespace: snapshots, logical and physical bytes, dedup ratio, what gc would free", `Per namespace of ROOT (sizes are file sizes, st_size, as 'du -b' counts them,
not allocated disk blocks):

  SNAPSHOTS    readable snapshot files and manifests (unreadable ones are
               counted apart and add no logical bytes)
  LOGICAL      sum over readable snapshots of their tensors' bytes: what
               restoring every snapshot would fill (a page manifest's
               included; pages alone are not: 'kvpersist ls' shows their
               tensor bytes)
  PHYSICAL     the bytes the namespace's data takes on disk: the sizes of
               every snapshot file and manifest (headers and alignment
               padding included) plus every block file under blocks/,
               each counted once however many manifests name it, named or
               not, plus every page file under pages/. The .lock file,
               temp files (listed apart) and unrecognised entries are not
               counted.
  DEDUP        LOGICAL / PHYSICAL (above 1 when manifests share blocks)
  BLOCK FILES  block files under blocks/
  RECLAIMABLE  block bytes 'gc' would free now: blocks no readable manifest
               names (0 when the namespace holds an unreadable file: gc does
               not sweep it)
  TEMP         bytes of temp files (writes in progress or interrupted)
  UNREADABLE   snapshot files, manifests and page files that did not decode

When some namespace holds a prefix page cache (pages/), four columns follow
(and a line for the whole cache against --capacity and --headroom, the
figures of 'kvpersist stats'):

  PAGES        page files under pages/
  PAGE BYTES   their file sizes (part of PHYSICAL)
  PAGE ALLOC   their allocated bytes (st_blocks x 512): what the engine
               accounts against its capacity and quotas
  SHARED       file sizes of the pages shared between conversations. A page
               is shared when stored prefixes continue it in two or more
               different ways: it is, or is an ancestor of (by the parent
               keys in the page headers), a stored page with two children
               whose token ids diverge (neither is a prefix of the other).
               A partial last page that a later turn extended (a sibling
               whose token ids start with its own) is not a branch, so a
               single growing conversation shares nothing. Equivalently:
               two or more of the pages descending from it, itself
               included, are ends (no stored child, no sibling extending
               it). The system prompt's pages of conversations that share
               it are shared; each conversation's own pages are not.

With --remote, du measures the object-store tier instead (sizes are object
sizes): per namespace its manifests and pages, the bytes of pages a
manifest names (LIVE), of unreferenced pages younger than --grace (YOUNG:
machines may be uploading them for a manifest to come), and of the pages
'gc --remote --grace' would delete (RECLAIMABLE). It lists the namespace
and fetches every manifest (a dry run of gc --remote); a namespace holding
an unreadable manifest is reported and counts no reclaimable bytes.

Exit status: 0, 1 when some file (or remote manifest) is unreadable, 2 on
usage or I/O errors.`,
		"kvpersist du /var/lib/kvcache\nkvpersist du --json /var/lib/kvcache | jq '.namespaces[] | {namespace, dedupRatio}'\nkvpersist du --remote --endpoint s3.example.com --bucket kvcache --prefix fleet-a",
		nil)
	fs := cmd.Flags()
	rf := addRemoteFlags(fs)
	cmd.Args = rf.args(cobra.ExactArgs(1))
	grace := fs.Duration("grace", time.Hour, "with --remote: unreferenced pages younger than this (by the store's clock) are not reclaimable")
	asJSON := fs.Bool("json", false, "print a JSON report: {root, namespaces: [row], total: row, skipped}, byte counts exact")
	exact := fs.Bool("bytes", false, "print exact byte counts instead of KiB/MiB/GiB")
	var lim limitFlags
	lim.register(fs)
	runs(cmd, func(ctx context.Context, args []string) error {
		if rf.on {
			if lim.capacity != "" || lim.headroom != "" || len(lim.quotas) > 0 {
				return usage(cmd, "--capacity, --quota and --headroom are for a local store, not --remote")
			}
			return c.runRemoteDu(ctx, cmd, rf, args, *grace, *asJSON, *exact)
		}
		if msg := rf.check(cmd); msg != "" {
			return usage(cmd, "%s", msg)
		}
		if fs.Changed("grace") {
			return usage(cmd, "--grace needs --remote")
		}
		if err := lim.parse(); err != nil {
			return usage(cmd, "%v", err)
		}
		root := args[0]
		st, listings, skipped, err := listStore(ctx, root)
		if err != nil {
			return fmt.Errorf("du: %s", quote(err.Error()))
		}
		hasPages := false
		for _, ns := range listings {
			hasPages = hasPages || ns.HasPagesDir
		}
		rep := duReport{Root: root, Namespaces: []duRow{}, Total: duRow{Namespace: "TOTAL"}, Skipped: skipped}
		cache, _, cr, err := lim.measureCache(st, listings, time.Now())
		if err != nil {
			return fmt.Errorf("du: %s", quote(err.Error()))
		}
		rep.Cache = cr
		for i, ns := range listings {
			row := duNamespace(ns)
			row.PageAllocatedBytes, row.QuotaBytes, row.OverQuotaBytes = cache[i].AllocatedBytes, cache[i].QuotaBytes, cache[i].OverQuotaBytes
			rep.Namespaces = append(rep.Namespaces, row)
			rep.Total.add(row)
		}
		rep.Total.ratio()
		if rep.Skipped == nil {
			rep.Skipped = []string{}
		}
		if *asJSON {
			if err := c.writeJSON(rep); err != nil {
				return fmt.Errorf("writing JSON: %w", err)
			}
		} else {
			size := sizer(*exact)
			tw := tabwriter.NewWriter(c.stdout, 0, 0, 2, ' ', tabwriter.AlignRight)
			pages := ""
			if hasPages {
				pages = "PAGES\tPAGE BYTES\tPAGE ALLOC\tSHARED\t"
			}
			fmt.Fprintln(tw, "NAMESPACE\tSNAPSHOTS\tLOGICAL\tPHYSICAL\tDEDUP\tBLOCK FILES\tRECLAIMABLE\tTEMP\tUNREADABLE\t"+pages)
			for _, r := range append(rep.Namespaces, rep.Total) {
				fmt.Fprintf(tw, "%s\t%d\t%s\t%s\t%.2fx\t%d\t%s\t%s\t%d\t", r.Namespace, r.Snapshots, size(r.LogicalBytes),
					size(r.PhysicalBytes), r.DedupRatio, r.BlockFiles, size(r.ReclaimableBytes), size(r.TempBytes), r.Unreadable)
				if hasPages {
					fmt.Fprintf(tw, "%d\t%s\t%s\t%s\t", r.Pages, size(r.PageFileBytes), size(r.PageAllocatedBytes), size(r.SharedPageBytes))
				}
				fmt.Fprintln(tw)
			}
			tw.Flush()
			if hasPages || lim.capacityBytes > 0 || lim.headroomBytes > 0 {
				c.printCacheReport(cr, size)
			}
			c.printRecencyErrors(cache)
			for _, s := range rep.Skipped {
				fmt.Fprintf(c.stdout, "skipped (not a kvpersist file, not counted): %s\n", quote(s))
			}
		}
		if rep.Total.Unreadable > 0 || badRecency(cache) {
			return errProblems
		}
		return nil
	})
	return cmd
}
