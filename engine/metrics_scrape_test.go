package engine_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"net/http"
	"net/http/httptest"
	"path/filepath"
	"strings"
	"testing"

	"github.com/kvpersist/kvpersist/engine"
	"github.com/kvpersist/kvpersist/engine/evict"
	"github.com/kvpersist/kvpersist/engine/layout"
	"github.com/kvpersist/kvpersist/engine/metrics"
	"github.com/kvpersist/kvpersist/engine/vfs"
	"github.com/kvpersist/kvpersist/internal/kvgen"
	"github.com/kvpersist/kvpersist/internal/serving"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"github.com/prometheus/client_golang/prometheus/testutil"
)

// pageFiles maps every page file under root's namespace ns to its length
// and allocated bytes (st_blocks × 512), read from the disk.
func pageFiles(t *testing.T, root, ns string) map[string][2]int64 {
	t.Helper()
	out := map[string][2]int64{}
	dir := filepath.Join(root, ns, layout.PagesDirName)
	err := filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if errors.Is(err, fs.ErrNotExist) && p == dir {
			return fs.SkipDir
		}
		if err != nil || !d.Type().IsRegular() || layout.IsTemp(d.Name()) {
			return err
		}
		fi, err := d.Info()
		if err != nil {
			return err
		}
		a, _ := vfs.AllocatedBytes(fi)
		out[d.Name()] = [2]int64{fi.Size(), a}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return out
}

// TestMetricsScrapedAfterKnownJobs: a metrics.Recorder registered in a real
// registry and served by promhttp on a loopback port, fed by an engine
// bounded to 8 pages' worth of allocated bytes (namespace "q" with a quota
// smaller than one page) that runs a known sequence: saves (new pages,
// reused pages), lookups that hit and miss, a load, saves that evict, and
// saves refused by the capacity and by the quota. Every metric issue 13
// names is scraped with the value computed independently: job counts by
// kind and outcome, latency histogram counts, bytes written and reused
// (lengths of the page files created and found, read from the disk), bytes
// read (tokens × bytes per token), lookup tokens, pages and allocated bytes
// evicted (files gone from the disk, st_blocks as they were), saves
// refused by limit, and the capacity, used, pages and quota gauges (the
// disk's st_blocks now).
func TestMetricsScrapedAfterKnownJobs(t *testing.T) {
	root := t.TempDir()
	m := kvgen.Tiny
	const (
		p        = 16
		identity = "scrape/tiny/bf16"
		pageMax  = 32 << 10 // a page file of 16 tokens takes 32 KiB (st_blocks) on ext4 and tmpfs
		capacity = 8 * pageMax
		quota    = 16 << 10
	)
	var e *engine.Engine
	rec, err := metrics.New(metrics.Options{Usage: func() evict.Usage { return e.Usage() }})
	if err != nil {
		t.Fatal(err)
	}
	e, err = engine.New(engine.Config{Root: root, NoSync: true, Workers: 2, Logger: discardLogger, Metrics: rec,
		CapacityBytes: capacity, QuotaBytes: map[string]int64{"q": quota}})
	if err != nil {
		t.Fatal(err)
	}
	defer func() {
		if err := e.Close(context.Background()); err != nil {
			t.Fatal(err)
		}
	}()
	reg := prometheus.NewRegistry()
	reg.MustRegister(rec)
	srv := httptest.NewServer(promhttp.HandlerFor(reg, promhttp.HandlerOpts{ErrorHandling: promhttp.PanicOnError}))
	defer srv.Close()

	// Conversation c's first n token ids and KV (serving's content rule).
	arena := kvgen.NewCache(m, 256, true, nil) // capacity-padded buffers of 512 tokens
	tensors := func(ids []uint32) []engine.TensorSpec {
		views := arena.ViewsAt(len(ids))
		out := make([]engine.TensorSpec, 2*m.Layers)
		for i := range out {
			out[i] = engine.TensorSpec{DType: m.DType, View: views[i]}
			// The content of ids, written into the padded buffer.
			rowBytes := m.HeadDim * m.ItemSize
			capTok := views[i].Strides[1] / m.HeadDim
			for h := range m.KVHeads {
				buf := views[i].Base[h*capTok*rowBytes:]
				serving.PageContentHead(m, ids, i, h, buf[:len(ids)*rowBytes])
			}
		}
		return out
	}
	ids := func(c uint32, n int) []uint32 {
		out := make([]uint32, n)
		serving.TokenIDs(out, c, 0, 0)
		return out
	}
	var written, reused int64
	evictedPages, evictedBytes := int64(0), int64(0)
	saves := map[string]int{} // outcome -> count
	save := func(ns string, tok []uint32) engine.Result {
		t.Helper()
		before := pageFiles(t, root, ns)
		res := e.Do(context.Background(), &engine.SavePrefixRequest{Namespace: ns, Identity: identity, Tokens: tok, Tensors: tensors(tok), PageTokens: p})
		after := pageFiles(t, root, ns)
		for name, fa := range after {
			if _, ok := before[name]; !ok {
				written += fa[0]
			}
		}
		for name, fb := range before {
			if _, ok := after[name]; !ok {
				evictedPages++
				evictedBytes += fb[1]
			}
		}
		if res.Err == nil {
			for _, k := range res.Prefix.Keys {
				if fb, ok := before[k.String()]; ok {
					reused += fb[0]
				}
			}
		}
		saves[labelOf(res.Err)]++
		return res
	}

	a := ids(1, 48)
	if r := save("ns", a[:40]); r.Err != nil || r.Prefix.PagesWritten != 3 {
		t.Fatalf("first save: %+v %v", r.Prefix, r.Err)
	}
	if r := save("ns", a); r.Err != nil || r.Prefix.PagesWritten != 1 || r.Prefix.PagesReused != 2 {
		t.Fatalf("grown save: %+v %v", r.Prefix, r.Err)
	}
	var hit, miss int64
	for _, q := range [][]uint32{a, ids(2, 30), a[:40]} {
		n, err := e.Lookup("ns", identity, p, q)
		if err != nil {
			t.Fatal(err)
		}
		hit += int64(n)
		miss += int64(len(q) - n)
	}
	if hit != 48+40 || miss != 30 {
		t.Fatalf("lookups hit %d, missed %d tokens; want 88, 30", hit, miss)
	}
	dest := kvgen.NewCache(m, 48, true, nil).ViewsAt(48)
	ld := make([]engine.TensorSpec, 2*m.Layers) // K and V; not the token ids attachment
	for i := range ld {
		ld[i] = engine.TensorSpec{DType: m.DType, View: dest[i]}
	}
	lr := e.Do(context.Background(), &engine.LoadPrefixRequest{Namespace: "ns", Identity: identity, Tokens: a, Dest: ld, PageTokens: p})
	if lr.Err != nil || lr.Prefix.Tokens != 48 {
		t.Fatalf("load: %+v %v", lr.Prefix, lr.Err)
	}
	readBytes := int64(48 * 2 * m.Layers * m.TensorBytes(1))
	// Four more conversations of 4 full pages each: 20 pages in all, 8 fit.
	for c := uint32(3); c < 7; c++ {
		if r := save("ns", ids(c, 64)); r.Err != nil {
			t.Fatalf("conversation %d: %v", c, r.Err)
		}
	}
	if evictedPages == 0 {
		t.Fatal("nothing was evicted")
	}
	// Refused: 16 pages (more than the capacity) and a page in q (more
	// than its quota); neither changes the disk.
	before := pageFiles(t, root, "ns")
	if r := save("ns", ids(7, 256)); !errors.Is(r.Err, engine.ErrNoSpace) {
		t.Fatalf("a save larger than the capacity: %v", r.Err)
	}
	if r := save("q", ids(8, 16)); !errors.Is(r.Err, engine.ErrNoSpace) {
		t.Fatalf("a save larger than the quota: %v", r.Err)
	}
	if after := pageFiles(t, root, "ns"); fmt.Sprint(after) != fmt.Sprint(before) || len(pageFiles(t, root, "q")) != 0 {
		t.Fatal("a refused save changed the disk")
	}
	var used int64
	now := pageFiles(t, root, "ns")
	for _, f := range now {
		used += f[1]
	}

	// The scrape.
	jobs := map[string]int{"save/ok": saves["ok"], "save/nospace": saves["nospace"], "load/ok": 1, "lookup/ok": 3}
	exp := engine.JobsExposition(jobs, written, reused, readBytes) + fmt.Sprintf(`# HELP kvpersist_lookup_tokens_total Tokens of prefix lookups, hit (covered by stored pages) or miss.
# TYPE kvpersist_lookup_tokens_total counter
kvpersist_lookup_tokens_total{result="hit"} %d
kvpersist_lookup_tokens_total{result="miss"} %d
# HELP kvpersist_evicted_pages_total Pages evicted, by reason.
# TYPE kvpersist_evicted_pages_total counter
kvpersist_evicted_pages_total{reason="capacity"} %d
kvpersist_evicted_pages_total{reason="headroom"} 0
kvpersist_evicted_pages_total{reason="quota"} 0
kvpersist_evicted_pages_total{reason="shrink"} 0
# HELP kvpersist_evicted_bytes_total Allocated bytes of the pages evicted, by reason.
# TYPE kvpersist_evicted_bytes_total counter
kvpersist_evicted_bytes_total{reason="capacity"} %d
kvpersist_evicted_bytes_total{reason="headroom"} 0
kvpersist_evicted_bytes_total{reason="quota"} 0
kvpersist_evicted_bytes_total{reason="shrink"} 0
# HELP kvpersist_saves_refused_total Saves refused for want of space, by the limit that could not be met.
# TYPE kvpersist_saves_refused_total counter
kvpersist_saves_refused_total{limit="capacity"} 1
kvpersist_saves_refused_total{limit="headroom"} 0
kvpersist_saves_refused_total{limit="quota"} 1
# HELP kvpersist_cache_capacity_bytes The page cache's capacity in allocated bytes (0: unbounded).
# TYPE kvpersist_cache_capacity_bytes gauge
kvpersist_cache_capacity_bytes %d
# HELP kvpersist_cache_reserved_bytes Bytes reserved by in-flight saves.
# TYPE kvpersist_cache_reserved_bytes gauge
kvpersist_cache_reserved_bytes 0
# HELP kvpersist_cache_used_bytes Allocated bytes of the page files of a namespace.
# TYPE kvpersist_cache_used_bytes gauge
kvpersist_cache_used_bytes{namespace="ns"} %d
kvpersist_cache_used_bytes{namespace="q"} 0
# HELP kvpersist_cache_pages Pages stored in a namespace.
# TYPE kvpersist_cache_pages gauge
kvpersist_cache_pages{namespace="ns"} %d
kvpersist_cache_pages{namespace="q"} 0
# HELP kvpersist_cache_quota_bytes A namespace's quota in allocated bytes (namespaces with a quota only).
# TYPE kvpersist_cache_quota_bytes gauge
kvpersist_cache_quota_bytes{namespace="q"} %d
`, hit, miss, evictedPages, evictedBytes, capacity, used, len(now), quota)
	names := []string{"kvpersist_jobs_total", "kvpersist_written_bytes_total", "kvpersist_reused_bytes_total",
		"kvpersist_read_bytes_total", "kvpersist_lookup_tokens_total", "kvpersist_evicted_pages_total",
		"kvpersist_evicted_bytes_total", "kvpersist_saves_refused_total", "kvpersist_cache_capacity_bytes",
		"kvpersist_cache_reserved_bytes", "kvpersist_cache_used_bytes", "kvpersist_cache_pages", "kvpersist_cache_quota_bytes"}
	if err := testutil.ScrapeAndCompare(srv.URL, strings.NewReader(exp), names...); err != nil {
		t.Fatal(err)
	}
	// Latency histograms: one observation per job that ran, by kind.
	resp, err := http.Get(srv.URL)
	if err != nil {
		t.Fatal(err)
	}
	body, err := io.ReadAll(resp.Body)
	resp.Body.Close()
	if err != nil {
		t.Fatal(err)
	}
	for kind, n := range map[string]int{"save": saves["ok"] + saves["nospace"], "load": 1, "lookup": 3} {
		line := fmt.Sprintf("kvpersist_job_duration_seconds_count{kind=%q} %d\n", kind, n)
		if !strings.Contains(string(body), line) {
			t.Errorf("scrape lacks %q", line)
		}
	}
	if t.Failed() {
		t.Logf("scrape:\n%s", body)
	}
}

// labelOf is the outcome label of a job's error.
func labelOf(err error) string { return metrics.OutcomeOf(err).String() }
