package main

import (
	"context"
	"log/slog"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/kvpersist/kvpersist/engine"
)

// statsJSON is the part of `stats --json` the tests read.
type statsJSON struct {
	CapacityBytes     int64 `json:"capacityBytes"`
	HeadroomBytes     int64 `json:"headroomBytes"`
	UsedBytes         int64 `json:"usedBytes"`
	OverCapacityBytes int64 `json:"overCapacityBytes"`
	FileSystem        *struct {
		AvailBytes         int64 `json:"availBytes"`
		BelowHeadroomBytes int64 `json:"belowHeadroomBytes"`
	} `json:"fileSystem"`
	Namespaces []statsJSONRow `json:"namespaces"`
	Total      statsJSONRow   `json:"total"`
}

type statsJSONRow struct {
	Namespace       string     `json:"namespace"`
	Pages           int        `json:"pages"`
	AllocatedBytes  int64      `json:"allocatedBytes"`
	FileBytes       int64      `json:"fileBytes"`
	LogicalBytes    int64      `json:"logicalBytes"`
	Tokens          int64      `json:"tokens"`
	OldestAccess    *time.Time `json:"oldestAccess"`
	NewestAccess    *time.Time `json:"newestAccess"`
	CheckpointPages int        `json:"checkpointPages"`
	QuotaBytes      int64      `json:"quotaBytes"`
	OverQuotaBytes  int64      `json:"overQuotaBytes"`
}

// TestStatsAgainstDisk: `stats --json` on a store the serving demo wrote
// reports what the page files hold, computed independently from the disk:
// their count, allocated bytes (st_blocks × 512 from stat(2)), lengths,
// token ids (from the raw header JSON) and logical bytes (tiny model: 64
// bytes per token in each of its 4 tensors); the oldest and newest access
// are the files' mtimes (no recency checkpoint), which the test sets; the
// bytes over --capacity and --quota are what is beyond them; `du --json`
// gives the same allocated bytes and capacity figures.
func TestStatsAgainstDisk(t *testing.T) {
	root, pages := pageStore(t, 2)
	removeRecency(t, root) // the demo's engine wrote one at Close
	var alloc, size, tokens int64
	base := time.Date(2026, 11, 30, 8, 0, 0, 0, time.UTC)
	i := 0
	for _, p := range pages {
		at := base.Add(time.Duration(i) * time.Minute)
		if err := os.Chtimes(p.path, at, at); err != nil {
			t.Fatal(err)
		}
		i++
		var st syscall.Stat_t
		if err := syscall.Stat(p.path, &st); err != nil {
			t.Fatal(err)
		}
		alloc += st.Blocks * 512
		size += p.size
		tokens += int64(len(p.tokens))
	}
	newest := base.Add(time.Duration(len(pages)-1) * time.Minute)
	capacity, quota := alloc-10000, alloc/2
	var rep statsJSON
	runJSON(t, exitOK, &rep, "stats", "--capacity", strconv.FormatInt(capacity, 10), "--quota", defaultDemoNamespace+"="+strconv.FormatInt(quota, 10), root)
	if len(rep.Namespaces) != 1 {
		t.Fatalf("namespaces %+v", rep.Namespaces)
	}
	r := rep.Namespaces[0]
	if r.Namespace != defaultDemoNamespace || r.Pages != len(pages) || r.AllocatedBytes != alloc || r.FileBytes != size ||
		r.Tokens != tokens || r.LogicalBytes != tokens*4*64 {
		t.Fatalf("row %+v; disk: %d pages, %d allocated, %d bytes, %d tokens", r, len(pages), alloc, size, tokens)
	}
	if r.OldestAccess == nil || !r.OldestAccess.Equal(base) || r.NewestAccess == nil || !r.NewestAccess.Equal(newest) || r.CheckpointPages != 0 {
		t.Fatalf("access %v to %v (%d from a checkpoint); mtimes %v to %v", r.OldestAccess, r.NewestAccess, r.CheckpointPages, base, newest)
	}
	if r.QuotaBytes != quota || r.OverQuotaBytes != alloc-quota {
		t.Fatalf("quota %d, over %d; want %d, %d", r.QuotaBytes, r.OverQuotaBytes, quota, alloc-quota)
	}
	if rep.CapacityBytes != capacity || rep.UsedBytes != alloc || rep.OverCapacityBytes != 10000 || rep.FileSystem != nil {
		t.Fatalf("report %+v; want capacity %d, used %d, 10000 over, no file system without --headroom", rep, capacity, alloc)
	}
	if rep.Total.AllocatedBytes != alloc || rep.Total.Pages != len(pages) {
		t.Fatalf("total %+v", rep.Total)
	}

	var du struct {
		Namespaces []struct {
			PageAllocatedBytes int64 `json:"pageAllocatedBytes"`
			OverQuotaBytes     int64 `json:"overQuotaBytes"`
		} `json:"namespaces"`
		Cache statsJSON `json:"cache"`
	}
	runJSON(t, exitOK, &du, "du", "--capacity", strconv.FormatInt(capacity, 10), "--quota", defaultDemoNamespace+"="+strconv.FormatInt(quota, 10), "--headroom", "1TiB", root)
	if len(du.Namespaces) != 1 || du.Namespaces[0].PageAllocatedBytes != alloc || du.Namespaces[0].OverQuotaBytes != alloc-quota ||
		du.Cache.UsedBytes != alloc || du.Cache.OverCapacityBytes != 10000 || du.Cache.HeadroomBytes != 1<<40 {
		t.Fatalf("du: %+v", du)
	}
	if f := du.Cache.FileSystem; f == nil || f.AvailBytes <= 0 || f.BelowHeadroomBytes != max(0, 1<<40-f.AvailBytes) {
		t.Fatalf("du file system %+v: want available bytes and the headroom's shortfall", f)
	}
}

// TestStatsUsageErrors: a bad size or quota is a usage error (exit 2)
// whose first line names the flag and the value.
func TestStatsUsageErrors(t *testing.T) {
	root := t.TempDir()
	for _, c := range []struct{ args, want []string }{
		{[]string{"stats", "--capacity", "12X", root}, []string{`--capacity "12X"`}},
		{[]string{"stats", "--capacity", "-5", root}, []string{`--capacity "-5"`}},
		{[]string{"stats", "--headroom", "9999999TiB", root}, []string{`--headroom "9999999TiB"`}},
		{[]string{"stats", "--quota", "ns", root}, []string{`--quota "ns": want NAMESPACE=SIZE`}},
		{[]string{"stats", "--quota", ".x=1", root}, []string{`--quota ".x=1"`}},
		{[]string{"stats", "--quota", "a=1", "--quota", "a=2", root}, []string{`namespace "a" given twice`}},
		{[]string{"du", "--capacity", "1PB", root}, []string{`--capacity "1PB"`}},
		{[]string{"du", "--remote", "--endpoint", "127.0.0.1:1", "--bucket", "b", "--capacity", "1GiB"}, []string{"are for a local store, not --remote"}},
	} {
		out, errs := mustRunErr(t, c.args...)
		first, _, _ := strings.Cut(errs, "\n")
		for _, w := range c.want {
			if !strings.Contains(first, w) {
				t.Errorf("%v: stderr's first line %q lacks %q (stdout %q)", c.args, first, w, out)
			}
		}
		if code, _, _ := cliRun(t, c.args...); code != exitUsage {
			t.Errorf("%v: exit %d, want %d", c.args, code, exitUsage)
		}
	}
}

// TestStatsRecencyCheckpoint: after an engine looked a conversation up
// (touching its pages) and closed (writing the namespace's recency
// checkpoint), `stats` takes those pages' last access from the checkpoint:
// later than every mtime, which the test set in the past. A checkpoint
// that does not decode is ignored (accesses are the mtimes again),
// reported, and the exit status is 1.
func TestStatsRecencyCheckpoint(t *testing.T) {
	root, pages := pageStore(t, 2)
	removeRecency(t, root) // the demo's: its accesses would be the oldest
	past := time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)
	for _, p := range pages {
		if err := os.Chtimes(p.path, past, past); err != nil {
			t.Fatal(err)
		}
	}
	// The first page of the store (no parent among the pages): look its
	// tokens up, as a new request starting with the system prompt would.
	var first diskPage
	for _, p := range pages {
		if _, ok := pages[p.parent]; !ok {
			first = p
		}
	}
	e, err := engine.New(engine.Config{Root: root, NoSync: true, Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		t.Fatal(err)
	}
	before := time.Now()
	n, err := e.Lookup(defaultDemoNamespace, "kvpersist-demo/tiny/bfloat16", 16, first.tokens)
	if cerr := e.Close(context.Background()); cerr != nil {
		t.Fatal(cerr)
	}
	if err != nil || n != len(first.tokens) {
		t.Fatalf("lookup of the first page's %d tokens: %d, %v", len(first.tokens), n, err)
	}
	var rep statsJSON
	runJSON(t, exitOK, &rep, "stats", root)
	r := rep.Namespaces[0]
	if r.CheckpointPages != len(pages) || !r.OldestAccess.Equal(past) || r.NewestAccess.Before(before) {
		t.Fatalf("%d pages from the checkpoint, access %v to %v; want %d, the mtime %v to the lookup's time (after %v)",
			r.CheckpointPages, r.OldestAccess, r.NewestAccess, len(pages), past, before)
	}

	if err := os.WriteFile(filepath.Join(root, defaultDemoNamespace, ".recency"), []byte("not a checkpoint"), 0o640); err != nil {
		t.Fatal(err)
	}
	var bad struct {
		Namespaces []struct {
			statsJSONRow
			RecencyError *string `json:"recencyError"`
		} `json:"namespaces"`
	}
	runJSON(t, exitProblems, &bad, "stats", root)
	b := bad.Namespaces[0]
	if b.RecencyError == nil || !strings.Contains(*b.RecencyError, "bad recency checkpoint") || b.CheckpointPages != 0 ||
		!b.OldestAccess.Equal(past) || !b.NewestAccess.Equal(past) {
		t.Fatalf("bad checkpoint: %+v (error %v)", b.statsJSONRow, b.RecencyError)
	}
	if out := mustRun(t, exitProblems, "stats", root); !strings.Contains(out, "recency checkpoint of kvpersist-demo ignored") {
		t.Fatalf("stats does not report the bad checkpoint:\n%s", out)
	}
}

// removeRecency removes the recency checkpoint of root's demo namespace.
func removeRecency(t *testing.T, root string) {
	t.Helper()
	if err := os.Remove(filepath.Join(root, defaultDemoNamespace, ".recency")); err != nil {
		t.Fatal(err)
	}
}
