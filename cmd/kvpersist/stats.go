package main

import (
	"context"
	"errors"
	"fmt"
	"math"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/kvpersist/kvpersist/engine/evict"
	"github.com/kvpersist/kvpersist/engine/layout"
	"github.com/kvpersist/kvpersist/engine/recency"
	"github.com/kvpersist/kvpersist/engine/store"
	"github.com/spf13/cobra"
	"github.com/spf13/pflag"
)

// limitFlags are the page cache's limits an operator gives `stats` and
// `du` (the engine's Config.CapacityBytes, QuotaBytes and HeadroomBytes),
// to see the store against them.
type limitFlags struct {
	capacity, headroom string
	quotas             []string
	// parsed
	capacityBytes, headroomBytes int64
	quotaBytes                   map[string]int64
}

func (l *limitFlags) register(fs *pflag.FlagSet) {
	fs.StringVar(&l.capacity, "capacity", "", "the page cache's capacity (engine Config.CapacityBytes), e.g. 64GiB or 1073741824: show usage against it")
	fs.StringArrayVar(&l.quotas, "quota", nil, "a namespace's quota (Config.QuotaBytes) as NAMESPACE=SIZE, e.g. tenant-a=8GiB; repeatable")
	fs.StringVar(&l.headroom, "headroom", "", "the free space to keep on the file system (Config.HeadroomBytes): show the file system's free bytes against it")
}

// parse checks the flags; the error names the flag and the value.
func (l *limitFlags) parse() error {
	var err error
	if l.capacityBytes, err = parseSize("--capacity", l.capacity); err != nil {
		return err
	}
	if l.headroomBytes, err = parseSize("--headroom", l.headroom); err != nil {
		return err
	}
	l.quotaBytes = map[string]int64{}
	for _, q := range l.quotas {
		ns, size, ok := strings.Cut(q, "=")
		if !ok {
			return fmt.Errorf("--quota %q: want NAMESPACE=SIZE", q)
		}
		if err := layout.ValidName("namespace", ns); err != nil {
			return fmt.Errorf("--quota %q: %w", q, err)
		}
		if _, dup := l.quotaBytes[ns]; dup {
			return fmt.Errorf("--quota: namespace %q given twice", ns)
		}
		if l.quotaBytes[ns], err = parseSize("--quota "+ns, size); err != nil {
			return err
		}
	}
	return nil
}

// parseSize parses a size in bytes: an integer, optionally followed by
// B, KiB, MiB, GiB or TiB (K, M, G, T are the same binary units); "" is 0.
// A size must be ≥ 0 and at most 2^53 (evict.MaxBytes).
func parseSize(flag, s string) (int64, error) {
	if s == "" {
		return 0, nil
	}
	num := strings.TrimRight(s, "BKMGTiB")
	unit := s[len(num):]
	shift := map[string]uint{"": 0, "B": 0, "K": 10, "KiB": 10, "M": 20, "MiB": 20, "G": 30, "GiB": 30, "T": 40, "TiB": 40}
	sh, ok := shift[unit]
	v, err := strconv.ParseInt(num, 10, 64)
	if !ok || err != nil || v < 0 || v > evict.MaxBytes>>sh {
		return 0, fmt.Errorf("%s %q: want a size in bytes from 0 to 2^53, an integer with an optional unit B, KiB, MiB, GiB or TiB (e.g. 64GiB)", flag, s)
	}
	return v << sh, nil
}

// statsRow is one namespace's page cache against its quota.
type statsRow struct {
	Namespace string `json:"namespace"`
	store.CacheStats
	// QuotaBytes: --quota for the namespace (0: none); OverQuotaBytes:
	// AllocatedBytes beyond it, what an engine with that quota evicts from
	// the namespace before its next save.
	QuotaBytes     int64 `json:"quotaBytes"`
	OverQuotaBytes int64 `json:"overQuotaBytes"`
	// RecencyError: the namespace's recency checkpoint (.recency) does not
	// decode; it is ignored as the engine ignores it (accesses are then
	// the mtimes) and the command exits 1.
	RecencyError *string `json:"recencyError,omitempty"`
}

// cacheReport is the page cache of a store against the limits given.
// Bytes are allocated bytes (st_blocks × 512) unless named otherwise.
type cacheReport struct {
	// CapacityBytes and HeadroomBytes: as given (0: none).
	CapacityBytes int64 `json:"capacityBytes"`
	HeadroomBytes int64 `json:"headroomBytes"`
	// UsedBytes: the allocated bytes of every page file of every namespace
	// (what the engine accounts against CapacityBytes).
	UsedBytes int64 `json:"usedBytes"`
	// OverCapacityBytes: UsedBytes beyond CapacityBytes (0 when within or
	// unbounded).
	OverCapacityBytes int64 `json:"overCapacityBytes"`
	// FileSystem: statvfs of the root (only with --headroom):
	// AvailBytes = f_bavail × f_frsize; BelowHeadroomBytes: HeadroomBytes
	// beyond AvailBytes, what an engine with that headroom evicts before
	// its next save.
	FileSystem *fsReport `json:"fileSystem,omitempty"`
}

type fsReport struct {
	TotalBytes         int64 `json:"totalBytes"`
	AvailBytes         int64 `json:"availBytes"`
	BelowHeadroomBytes int64 `json:"belowHeadroomBytes"`
}

// measureCache measures every namespace's page cache (listings already
// decoded) against the limits: the rows, their total and the report.
func (l *limitFlags) measureCache(st *store.Store, listings []*store.Listing, now time.Time) ([]statsRow, statsRow, cacheReport, error) {
	rep := cacheReport{CapacityBytes: l.capacityBytes, HeadroomBytes: l.headroomBytes}
	rows := []statsRow{}
	total := statsRow{Namespace: "TOTAL"}
	for _, ls := range listings {
		rec, err := ls.Namespace.ReadRecency()
		var bad *string
		if errors.Is(err, recency.ErrCheckpoint) {
			msg := err.Error()
			bad, rec = &msg, nil
		} else if err != nil {
			return nil, total, rep, err
		}
		r := statsRow{Namespace: ls.Namespace.Name(), CacheStats: ls.CacheStats(rec, now), QuotaBytes: l.quotaBytes[ls.Namespace.Name()], RecencyError: bad}
		r.OverQuotaBytes = evict.BytesToEvict(evict.Budget{QuotaBytes: r.QuotaBytes, NamespaceUsedBytes: r.AllocatedBytes}, 0).QuotaBytes
		rows = append(rows, r)
		total.CacheStats.Add(r.CacheStats)
		total.QuotaBytes += r.QuotaBytes
		total.OverQuotaBytes += r.OverQuotaBytes
	}
	rep.UsedBytes = total.AllocatedBytes
	b := evict.Budget{CapacityBytes: l.capacityBytes, UsedBytes: rep.UsedBytes, AvailBytes: -1, HeadroomBytes: l.headroomBytes}
	if l.headroomBytes > 0 {
		fst, err := st.FS().Statfs(st.Root())
		if err != nil {
			return nil, total, rep, err
		}
		rep.FileSystem = &fsReport{TotalBytes: fst.TotalBytes, AvailBytes: fst.AvailBytes}
		b.AvailBytes = fst.AvailBytes
	}
	need := evict.BytesToEvict(b, 0)
	rep.OverCapacityBytes = need.CapacityBytes
	if rep.FileSystem != nil {
		rep.FileSystem.BelowHeadroomBytes = need.HeadroomBytes
	}
	return rows, total, rep, nil
}

// listStore opens the store at root and lists and decodes every namespace
// (listNamespace), checking ctx between namespaces; skipped are the
// entries not recognised (namespaces' and their contents').
func listStore(ctx context.Context, root string) (*store.Store, []*store.Listing, []string, error) {
	st, names, skipped, err := openStore(root)
	if err != nil {
		return nil, nil, nil, err
	}
	var listings []*store.Listing
	for _, n := range names {
		if err := ctx.Err(); err != nil {
			return nil, nil, nil, err
		}
		ns, err := listNamespace(st, n)
		if err != nil {
			return nil, nil, nil, err
		}
		skipped = append(skipped, ns.SkippedPaths()...)
		listings = append(listings, ns)
	}
	return st, listings, skipped, nil
}

type statsReport struct {
	Root string `json:"root"`
	cacheReport
	Namespaces []statsRow `json:"namespaces"`
	Total      statsRow   `json:"total"` // namespace "TOTAL"
	Skipped    []string   `json:"skipped"`
}

// accessTime formats an access time as ls formats mtimes ("-" for none).
func accessTime(t *time.Time) string {
	if t == nil {
		return "-"
	}
	return t.Local().Format("2006-01-02 15:04:05")
}

// percent is used / limit in percent, "-" without a limit.
func percent(used, limit int64) string {
	if limit <= 0 {
		return "-"
	}
	return fmt.Sprintf("%.0f%%", math.Round(100*float64(used)/float64(limit)))
}

func (c *cli) statsCommand() *cobra.Command {
	cmd := c.command("stats ROOT", "the prefix page cache per namespace: pages, allocated bytes, tokens, last accesses, against a capacity, quotas and headroom",
		`Per namespace of ROOT, what its prefix page cache (pages/) holds, measured as
the engine accounts it:

  PAGES          page files
  ALLOCATED      their allocated bytes (st_blocks x 512, not their lengths):
                 what engine Config.CapacityBytes and QuotaBytes bound
  LOGICAL        their tensors' bytes
  TOKENS         the token ids they hold
  QUOTA          --quota of the namespace ("-": none); OVER QUOTA, the
                 allocated bytes beyond it, which an engine with that quota
                 evicts from the namespace before its next save
  OLDEST/NEWEST  the least and most recent last access of its pages, as an
                 engine rebuilds it at start: the page file's mtime (when it
                 was written), moved forward to the access recorded in the
                 namespace's recency checkpoint (.recency) when it names the
                 page (clamped to now)

Then, for the whole store: the allocated bytes of every page file against
--capacity and the bytes beyond it (what an engine with that capacity
evicts first), and with --headroom the file system's available bytes
(statvfs f_bavail x f_frsize) against it. Without Prometheus, this is the
operator's view of the page cache; a running engine exports the same
figures as metrics (kvpersist_cache_used_bytes, ...; see docs/operating.md).
Temp files under pages/ (saves in progress, or left by a crash until gc
removes them) are counted apart and not in ALLOCATED. A recency checkpoint
that does not decode is ignored, as the engine ignores it, and reported.

Exit status: 0, 1 when some page file or recency checkpoint is unreadable,
2 on usage or I/O errors.`,
		"kvpersist stats --capacity 64GiB --quota tenant-a=8GiB /var/lib/kvcache\nkvpersist stats --json --headroom 20GiB /var/lib/kvcache | jq '.fileSystem'",
		cobra.ExactArgs(1))
	var lim limitFlags
	fs := cmd.Flags()
	asJSON := fs.Bool("json", false, "print a JSON report: {root, capacityBytes, headroomBytes, usedBytes, overCapacityBytes, fileSystem, namespaces: [row], total: row, skipped}, byte counts exact, times RFC 3339")
	exact := fs.Bool("bytes", false, "print exact byte counts instead of KiB/MiB/GiB")
	lim.register(fs)
	runs(cmd, func(ctx context.Context, args []string) error {
		if err := lim.parse(); err != nil {
			return usage(cmd, "%v", err)
		}
		root := args[0]
		st, listings, skipped, err := listStore(ctx, root)
		if err != nil {
			return fmt.Errorf("stats: %s", quote(err.Error()))
		}
		rows, total, cr, err := lim.measureCache(st, listings, time.Now())
		if err != nil {
			return fmt.Errorf("stats: %s", quote(err.Error()))
		}
		rep := statsReport{Root: root, cacheReport: cr, Namespaces: rows, Total: total, Skipped: skipped}
		if rep.Skipped == nil {
			rep.Skipped = []string{}
		}
		if *asJSON {
			if err := c.writeJSON(rep); err != nil {
				return fmt.Errorf("writing JSON: %w", err)
			}
		} else {
			size := sizer(*exact)
			tw := tabwriter.NewWriter(c.stdout, 0, 0, 2, ' ', 0)
			fmt.Fprintln(tw, "NAMESPACE\tPAGES\tALLOCATED\tLOGICAL\tTOKENS\tQUOTA\tOVER QUOTA\tOLDEST ACCESS\tNEWEST ACCESS")
			for _, r := range append(rows, total) {
				quota := "-"
				if r.QuotaBytes > 0 {
					quota = size(r.QuotaBytes)
				}
				fmt.Fprintf(tw, "%s\t%d\t%s\t%s\t%d\t%s\t%s\t%s\t%s\n", r.Namespace, r.Pages, size(r.AllocatedBytes), size(r.LogicalBytes),
					r.Tokens, quota, size(r.OverQuotaBytes), accessTime(r.OldestAccess), accessTime(r.NewestAccess))
			}
			tw.Flush()
			c.printCacheReport(cr, size)
			c.printRecencyErrors(rows)
			if total.TempFiles > 0 {
				fmt.Fprintf(c.stdout, "temp files under pages/: %d, %s allocated (not counted above)\n", total.TempFiles, size(total.TempAllocatedBytes))
			}
			for _, s := range rep.Skipped {
				fmt.Fprintf(c.stdout, "skipped (not a kvpersist file, not counted): %s\n", quote(s))
			}
		}
		if total.Unreadable > 0 || badRecency(rows) {
			return errProblems
		}
		return nil
	})
	return cmd
}

// printRecencyErrors prints a line per namespace whose recency checkpoint
// did not decode.
func (c *cli) printRecencyErrors(rows []statsRow) {
	for _, r := range rows {
		if r.RecencyError != nil {
			fmt.Fprintf(c.stdout, "recency checkpoint of %s ignored (accesses are the mtimes): %s\n", quote(r.Namespace), quote(*r.RecencyError))
		}
	}
}

// badRecency reports whether a namespace's recency checkpoint did not
// decode.
func badRecency(rows []statsRow) bool {
	for _, r := range rows {
		if r.RecencyError != nil {
			return true
		}
	}
	return false
}

// printCacheReport prints the store's page cache against the capacity and
// the headroom (stats and du).
func (c *cli) printCacheReport(cr cacheReport, size func(int64) string) {
	if cr.CapacityBytes > 0 {
		fmt.Fprintf(c.stdout, "page cache: %s allocated of a %s capacity (%s), %s over\n", size(cr.UsedBytes), size(cr.CapacityBytes),
			percent(cr.UsedBytes, cr.CapacityBytes), size(cr.OverCapacityBytes))
	} else {
		fmt.Fprintf(c.stdout, "page cache: %s allocated, no capacity given (--capacity)\n", size(cr.UsedBytes))
	}
	if f := cr.FileSystem; f != nil {
		fmt.Fprintf(c.stdout, "file system: %s available of %s, headroom %s, %s below it\n", size(f.AvailBytes), size(f.TotalBytes),
			size(cr.HeadroomBytes), size(f.BelowHeadroomBytes))
	}
}
