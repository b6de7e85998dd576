package metrics

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http/httptest"
	"reflect"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvpersist/kvpersist/engine/evict"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m, goleak.IgnoreCurrent()) }

// histText renders the expected exposition of one kind's latency histogram
// from the observed seconds, counting each bucket by plain comparison.
func histText(kind string, obs ...float64) string {
	return histogramText("kvpersist_job_duration_seconds", "kind", kind, obs...)
}

// histogramText renders the expected exposition of the histogram family
// name for one value of its single label, from the observed seconds.
func histogramText(name, label, value string, obs ...float64) string {
	var b strings.Builder
	var sum float64
	for _, le := range DefaultLatencyBuckets {
		n := 0
		for _, v := range obs {
			if v <= le {
				n++
			}
		}
		fmt.Fprintf(&b, "%s_bucket{%s=%q,le=%q} %d\n", name, label, value, fmt.Sprint(le), n)
	}
	for _, v := range obs {
		sum += v
	}
	fmt.Fprintf(&b, "%s_bucket{%s=%q,le=\"+Inf\"} %d\n", name, label, value, len(obs))
	fmt.Fprintf(&b, "%s_sum{%s=%q} %v\n", name, label, value, sum)
	fmt.Fprintf(&b, "%s_count{%s=%q} %d\n", name, label, value, len(obs))
	return b.String()
}

// record plays a known sequence of events into r; the page cache holds
// pages in namespaces "a" (quota 1 MiB) and "b", and a reservation in b.
func record(t *testing.T) (*Recorder, *evict.Cache) {
	t.Helper()
	cache, err := evict.New(evict.Config{CapacityBytes: 8 << 20, Quotas: map[string]int64{"a": 1 << 20}})
	if err != nil {
		t.Fatal(err)
	}
	for i := range 3 {
		if err := cache.Add(evict.Page{Namespace: "a", Key: evict.Key{byte(i)}, Bytes: 4096}); err != nil {
			t.Fatal(err)
		}
	}
	if err := cache.Add(evict.Page{Namespace: "b", Key: evict.Key{9}, Bytes: 12288}); err != nil {
		t.Fatal(err)
	}
	if _, err := cache.Reserve(evict.Want{Namespace: "b", Bytes: 8192, AvailBytes: -1}); err != nil {
		t.Fatal(err)
	}
	r, err := New(Options{Usage: cache.Usage})
	if err != nil {
		t.Fatal(err)
	}
	r.Job(KindSave, OutcomeOK, 3*time.Millisecond, true)
	r.Job(KindSave, OutcomeNoSpace, 200*time.Microsecond, true)
	r.Job(KindLoad, OutcomeOK, 40*time.Millisecond, true)
	r.Job(KindLookup, OutcomeOK, 50*time.Microsecond, true)
	r.Job(KindLookup, OutcomeOK, 75*time.Microsecond, true)
	r.Job(KindRead, OutcomeCanceled, time.Second, false) // never ran: no latency
	r.Job(KindWrite, OutcomeError, 2*time.Second, true)
	r.Job(KindCollect, OutcomeOK, 90*time.Second, true) // beyond the last bucket
	r.Bytes(1000, 200, 0)
	r.Bytes(0, 0, 5000)
	r.DirectRead(4096)
	r.AsyncRead(2048)
	r.Lookup(256, 768)
	r.Lookup(512, 32)
	r.Evicted(evict.ReasonCapacity, 3, 12288)
	r.Evicted(evict.ReasonQuota, 1, 4096)
	r.Evicted(evict.ReasonShrink, 2, 8192)
	r.Refused(evict.ReasonCapacity)
	r.Refused(evict.ReasonHeadroom)
	r.Refused(evict.ReasonHeadroom)
	return r, cache
}

func expected() string {
	nonzero := map[string]int{"save/ok": 1, "save/nospace": 1, "load/ok": 1, "lookup/ok": 2, "read/canceled": 1,
		"write/error": 1, "collect/ok": 1}
	var b strings.Builder
	b.WriteString("# HELP kvpersist_jobs_total Jobs finished, by kind and outcome.\n# TYPE kvpersist_jobs_total counter\n")
	for _, k := range []string{"write", "read", "collect", "delete", "migrate", "save", "load", "lookup", "evict"} {
		for _, o := range []string{"ok", "error", "canceled", "nospace"} {
			fmt.Fprintf(&b, "kvpersist_jobs_total{kind=%q,outcome=%q} %d\n", k, o, nonzero[k+"/"+o])
		}
	}
	b.WriteString("# HELP kvpersist_job_duration_seconds Wall time of the jobs that ran, in seconds, by kind.\n# TYPE kvpersist_job_duration_seconds histogram\n")
	b.WriteString(histText("write", 2))
	b.WriteString(histText("collect", 90))
	b.WriteString(histText("save", 0.003, 0.0002))
	b.WriteString(histText("load", 0.04))
	b.WriteString(histText("lookup", 0.00005, 0.000075))
	b.WriteString(`# HELP kvpersist_written_bytes_total Bytes written to disk by saves (data and headers).
# TYPE kvpersist_written_bytes_total counter
kvpersist_written_bytes_total 1000
# HELP kvpersist_reused_bytes_total Bytes a save found already stored and did not write (dedup).
# TYPE kvpersist_reused_bytes_total counter
kvpersist_reused_bytes_total 200
# HELP kvpersist_read_bytes_total Bytes read from disk into callers' buffers.
# TYPE kvpersist_read_bytes_total counter
kvpersist_read_bytes_total 5000
# HELP kvpersist_read_direct_bytes_total Of kvpersist_read_bytes_total, bytes read with O_DIRECT (0 on a file system without it: buffered fallback).
# TYPE kvpersist_read_direct_bytes_total counter
kvpersist_read_direct_bytes_total 4096
# HELP kvpersist_read_async_bytes_total Of kvpersist_read_direct_bytes_total, bytes read asynchronously (Linux AIO; 0 when its setup failed: preads).
# TYPE kvpersist_read_async_bytes_total counter
kvpersist_read_async_bytes_total 2048
# HELP kvpersist_lookup_tokens_total Tokens of prefix lookups, hit (covered by stored pages) or miss.
# TYPE kvpersist_lookup_tokens_total counter
kvpersist_lookup_tokens_total{result="hit"} 768
kvpersist_lookup_tokens_total{result="miss"} 800
# HELP kvpersist_evicted_pages_total Pages evicted, by reason.
# TYPE kvpersist_evicted_pages_total counter
kvpersist_evicted_pages_total{reason="capacity"} 3
kvpersist_evicted_pages_total{reason="headroom"} 0
kvpersist_evicted_pages_total{reason="quota"} 1
kvpersist_evicted_pages_total{reason="shrink"} 2
# HELP kvpersist_evicted_bytes_total Allocated bytes of the pages evicted, by reason.
# TYPE kvpersist_evicted_bytes_total counter
kvpersist_evicted_bytes_total{reason="capacity"} 12288
kvpersist_evicted_bytes_total{reason="headroom"} 0
kvpersist_evicted_bytes_total{reason="quota"} 4096
kvpersist_evicted_bytes_total{reason="shrink"} 8192
# HELP kvpersist_saves_refused_total Saves refused for want of space, by the limit that could not be met.
# TYPE kvpersist_saves_refused_total counter
kvpersist_saves_refused_total{limit="capacity"} 1
kvpersist_saves_refused_total{limit="headroom"} 2
kvpersist_saves_refused_total{limit="quota"} 0
# HELP kvpersist_cache_capacity_bytes The page cache's capacity in allocated bytes (0: unbounded).
# TYPE kvpersist_cache_capacity_bytes gauge
kvpersist_cache_capacity_bytes 8.388608e+06
# HELP kvpersist_cache_reserved_bytes Bytes reserved by in-flight saves.
# TYPE kvpersist_cache_reserved_bytes gauge
kvpersist_cache_reserved_bytes 8192
# HELP kvpersist_cache_used_bytes Allocated bytes of the page files of a namespace.
# TYPE kvpersist_cache_used_bytes gauge
kvpersist_cache_used_bytes{namespace="a"} 12288
kvpersist_cache_used_bytes{namespace="b"} 12288
# HELP kvpersist_cache_pages Pages stored in a namespace.
# TYPE kvpersist_cache_pages gauge
kvpersist_cache_pages{namespace="a"} 3
kvpersist_cache_pages{namespace="b"} 1
# HELP kvpersist_cache_quota_bytes A namespace's quota in allocated bytes (namespaces with a quota only).
# TYPE kvpersist_cache_quota_bytes gauge
kvpersist_cache_quota_bytes{namespace="a"} 1.048576e+06
`)
	return b.String()
}

// TestScrapeThroughRegistry: the recorder, registered in a pedantic
// registry of its own, exposes every metric with the right name, labels and
// value after a known sequence of events (the comparison covers every
// family the registry gathers).
func TestScrapeThroughRegistry(t *testing.T) {
	r, _ := record(t)
	reg := prometheus.NewPedanticRegistry()
	if err := reg.Register(r); err != nil {
		t.Fatal(err)
	}
	if err := testutil.GatherAndCompare(reg, strings.NewReader(expected())); err != nil {
		t.Fatal(err)
	}
	if n, err := testutil.GatherAndCount(reg); err != nil || n != 36+5+3+2+8+3+2+2+2+1+1+1 {
		t.Fatalf("gathered %d series (%v)", n, err)
	}
	if problems, err := testutil.GatherAndLint(reg); err != nil || len(problems) > 0 {
		t.Fatalf("lint: %v %v", problems, err)
	}
}

// TestScrapeOverHTTP: the same figures scraped from a promhttp handler on a
// loopback port.
func TestScrapeOverHTTP(t *testing.T) {
	r, _ := record(t)
	reg := prometheus.NewRegistry()
	reg.MustRegister(r)
	srv := httptest.NewServer(promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
	defer srv.Close()
	if !strings.HasPrefix(srv.URL, "http://127.0.0.1:") {
		t.Fatalf("server not on loopback: %s", srv.URL)
	}
	if err := testutil.ScrapeAndCompare(srv.URL, strings.NewReader(expected()),
		"kvpersist_jobs_total", "kvpersist_job_duration_seconds", "kvpersist_written_bytes_total",
		"kvpersist_reused_bytes_total", "kvpersist_read_bytes_total", "kvpersist_read_direct_bytes_total", "kvpersist_read_async_bytes_total", "kvpersist_lookup_tokens_total",
		"kvpersist_evicted_pages_total", "kvpersist_evicted_bytes_total", "kvpersist_saves_refused_total",
		"kvpersist_cache_capacity_bytes", "kvpersist_cache_reserved_bytes", "kvpersist_cache_used_bytes",
		"kvpersist_cache_pages", "kvpersist_cache_quota_bytes"); err != nil {
		t.Fatal(err)
	}
}

// TestSnapshotJSON: the snapshot holds the same figures (zeros left out)
// and survives a JSON round trip.
func TestSnapshotJSON(t *testing.T) {
	r, _ := record(t)
	s := r.Snapshot()
	b, err := json.Marshal(s)
	if err != nil {
		t.Fatal(err)
	}
	var back Snapshot
	if err := json.Unmarshal(b, &back); err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(back, s) {
		t.Fatalf("JSON round trip:\n%v\n%v", back, s)
	}
	wantJobs := []JobCount{{"write", "error", 1}, {"read", "canceled", 1}, {"collect", "ok", 1}, {"save", "ok", 1},
		{"save", "nospace", 1}, {"load", "ok", 1}, {"lookup", "ok", 2}}
	if fmt.Sprint(s.Jobs) != fmt.Sprint(wantJobs) {
		t.Fatalf("jobs %v, want %v", s.Jobs, wantJobs)
	}
	if s.WrittenBytes != 1000 || s.ReusedBytes != 200 || s.ReadBytes != 5000 || s.ReadDirectBytes != 4096 || s.ReadAsyncBytes != 2048 || s.LookupHitTokens != 768 || s.LookupMissTokens != 800 {
		t.Fatalf("counters %+v", s)
	}
	if fmt.Sprint(s.Evicted) != "[{capacity 3 12288} {quota 1 4096} {shrink 2 8192}]" ||
		fmt.Sprint(s.Refused) != "[{capacity 1} {headroom 2}]" {
		t.Fatalf("evicted %v refused %v", s.Evicted, s.Refused)
	}
	if len(s.Latency) != 5 || s.Latency[0].Kind != "write" || s.Latency[0].Count != 1 || s.Latency[0].SumSeconds != 2 {
		t.Fatalf("latency %+v", s.Latency)
	}
	if s.Cache == nil || s.Cache.UsedBytes != 24576 || s.Cache.ReservedBytes != 8192 || len(s.Cache.Namespaces) != 2 {
		t.Fatalf("cache %+v", s.Cache)
	}
}

// TestConcurrentRecording: counts are exact under concurrent recording
// (run with -race).
func TestConcurrentRecording(t *testing.T) {
	r, err := New(Options{})
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	for g := range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range 1000 {
				r.Job(KindLoad, OutcomeOK, time.Duration(g*1000+i)*time.Microsecond, true)
				r.Bytes(1, 2, 3)
				r.Evicted(evict.ReasonQuota, 1, 4096)
			}
		}()
	}
	wg.Wait()
	s := r.Snapshot()
	if len(s.Jobs) != 1 || s.Jobs[0].Count != 4000 || s.Latency[0].Count != 4000 || s.WrittenBytes != 4000 ||
		s.ReadBytes != 12000 || s.Evicted[0].Pages != 4000 || s.Evicted[0].Bytes != 4000*4096 {
		t.Fatalf("after 4 x 1000 recordings: %+v", s)
	}
	// Sum of g*1000+i µs over g in 0..3, i in 0..999.
	if want := float64(4*999*1000/2+1000*1000*(0+1+2+3)) / 1e6; s.Latency[0].SumSeconds != want {
		t.Fatalf("latency sum %v s, want %v", s.Latency[0].SumSeconds, want)
	}
	if s.Cache != nil {
		t.Fatal("cache figures without a Usage source")
	}
}

func TestNilRecorderAndOptions(t *testing.T) {
	var r *Recorder
	r.Job(KindSave, OutcomeOK, time.Second, true)
	r.Bytes(1, 1, 1)
	r.Lookup(1, 1)
	r.Evicted(evict.ReasonCapacity, 1, 1)
	r.Refused(evict.ReasonQuota)
	if s := r.Snapshot(); s.Jobs != nil || s.WrittenBytes != 0 {
		t.Fatalf("nil recorder snapshot %+v", s)
	}
	// Registered, a nil recorder is scraped as no metric (not a panic).
	reg := prometheus.NewPedanticRegistry()
	if err := reg.Register(r); err != nil {
		t.Fatalf("register a nil recorder: %v", err)
	}
	if mfs, err := reg.Gather(); err != nil || len(mfs) != 0 {
		t.Fatalf("nil recorder scraped: %v, %d families", err, len(mfs))
	}
	for _, b := range [][]float64{{}, {0.1, 0.1}, {-1}, {0.5, 0.1}} {
		if _, err := New(Options{LatencyBuckets: b}); !errors.Is(err, ErrOptions) {
			t.Errorf("buckets %v: %v", b, err)
		}
	}
	cases := map[error]Outcome{
		nil: OutcomeOK, errors.New("x"): OutcomeError, context.Canceled: OutcomeCanceled,
		fmt.Errorf("job: %w", context.DeadlineExceeded): OutcomeCanceled,
		&evict.NoSpaceError{Limit: evict.ReasonQuota}:   OutcomeNoSpace,
	}
	for err, want := range cases {
		if got := OutcomeOf(err); got != want {
			t.Errorf("OutcomeOf(%v) = %s, want %s", err, got, want)
		}
	}
}

// TestNamespaceSeriesBound: with more namespaces than MaxNamespaces, the
// per-namespace gauges have a series for the MaxNamespaces namespaces with
// the most used bytes (a tie broken by name) and one for ".other" holding
// the rest summed, without a quota series; a negative bound is
// ErrOptions.
func TestNamespaceSeriesBound(t *testing.T) {
	cache, err := evict.New(evict.Config{Quotas: map[string]int64{"d": 1 << 20, "e": 1 << 20}})
	if err != nil {
		t.Fatal(err)
	}
	used := map[string]int{"a": 1, "b": 3, "c": 3, "d": 2, "e": 5} // pages of 4 KiB
	for ns, n := range used {
		for i := range n {
			if err := cache.Add(evict.Page{Namespace: ns, Key: evict.Key{byte(i)}, Bytes: 4096}); err != nil {
				t.Fatal(err)
			}
		}
	}
	r, err := New(Options{Usage: cache.Usage, MaxNamespaces: 2})
	if err != nil {
		t.Fatal(err)
	}
	reg := prometheus.NewPedanticRegistry()
	reg.MustRegister(r)
	// e (5 pages) and b (3, before c by name); .other: a, c, d = 6 pages.
	want := `# HELP kvpersist_cache_pages Pages stored in a namespace.
# TYPE kvpersist_cache_pages gauge
kvpersist_cache_pages{namespace=".other"} 6
kvpersist_cache_pages{namespace="b"} 3
kvpersist_cache_pages{namespace="e"} 5
# HELP kvpersist_cache_used_bytes Allocated bytes of the page files of a namespace.
# TYPE kvpersist_cache_used_bytes gauge
kvpersist_cache_used_bytes{namespace=".other"} 24576
kvpersist_cache_used_bytes{namespace="b"} 12288
kvpersist_cache_used_bytes{namespace="e"} 20480
# HELP kvpersist_cache_quota_bytes A namespace's quota in allocated bytes (namespaces with a quota only).
# TYPE kvpersist_cache_quota_bytes gauge
kvpersist_cache_quota_bytes{namespace="e"} 1.048576e+06
`
	if err := testutil.GatherAndCompare(reg, strings.NewReader(want), "kvpersist_cache_pages", "kvpersist_cache_used_bytes", "kvpersist_cache_quota_bytes"); err != nil {
		t.Fatal(err)
	}
	if s := r.Snapshot(); s.Cache == nil || len(s.Cache.Namespaces) != 5 {
		t.Fatalf("Snapshot is not bounded: %+v", s.Cache)
	}
	if _, err := New(Options{MaxNamespaces: -1}); !errors.Is(err, ErrOptions) {
		t.Fatalf("MaxNamespaces -1: %v", err)
	}
}

// TestEventsDropped: kvpersist_events_dropped_total reads the publisher's
// drop count at each scrape once it is set, and is absent without it.
func TestEventsDropped(t *testing.T) {
	r, err := New(Options{})
	if err != nil {
		t.Fatal(err)
	}
	reg := prometheus.NewRegistry()
	reg.MustRegister(r)
	if n, err := testutil.GatherAndCount(reg, "kvpersist_events_dropped_total"); err != nil || n != 0 {
		t.Fatalf("without events: %d series, %v", n, err)
	}
	var dropped uint64 = 7
	r.SetEventsDropped(func() uint64 { return dropped })
	want := `# HELP kvpersist_events_dropped_total KV events dropped, the publisher's queue full (a router misses them until a snapshot).
# TYPE kvpersist_events_dropped_total counter
kvpersist_events_dropped_total 7
`
	if err := testutil.GatherAndCompare(reg, strings.NewReader(want), "kvpersist_events_dropped_total"); err != nil {
		t.Fatal(err)
	}
	dropped = 9
	if err := testutil.GatherAndCompare(reg, strings.NewReader(strings.Replace(want, " 7\n", " 9\n", 1)), "kvpersist_events_dropped_total"); err != nil {
		t.Fatal(err)
	}
	var nilRec *Recorder
	nilRec.SetEventsDropped(func() uint64 { return 1 }) // ignored, no panic
}
