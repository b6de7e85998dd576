package engine

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"math/rand/v2"
	"strings"
	"testing"

	"github.com/kvpersist/kvpersist/engine/gather"
	"github.com/kvpersist/kvpersist/engine/jobs"
	"github.com/kvpersist/kvpersist/engine/layout"
	"github.com/kvpersist/kvpersist/engine/metrics"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
)

// blockWrite saves buf as one bfloat16 tensor in 4 KiB blocks.
func blockWrite(ref Ref, buf []byte) *WriteRequest {
	return &WriteRequest{Ref: ref, Layout: layout.Blocks, BlockBytes: 4096,
		Caches: []jobs.EntrySpec{{Tensors: []jobs.TensorSpec{{DType: "bfloat16",
			View: gather.View{Base: buf, Shape: []int{len(buf) / 2}, Strides: []int{1}, ItemSize: 2}}}}}}
}

// TestMetricsCountJobs: with Config.Metrics, every finished job is counted
// by kind and outcome (a job cancelled while it waited for a worker as
// "canceled", without latency), the latency histogram counts the jobs that
// ran, and the byte counters equal the sums of the Results' metrics; the
// figures are scraped through a real registry.
func TestMetricsCountJobs(t *testing.T) {
	rec, err := metrics.New(metrics.Options{})
	if err != nil {
		t.Fatal(err)
	}
	h := installHook(t)
	e := newEngine(t, Config{Workers: 1, Metrics: rec})
	buf := make([]byte, 3*4096) // three distinct blocks: no dedup within the write
	rng := rand.New(rand.NewPCG(1, 2))
	for i := range buf {
		buf[i] = byte(rng.Uint32())
	}
	a, b := refOf("ns", "a"), refOf("ns", "b")
	var written, reused, read int64
	add := func(r Result) Result {
		written += r.Metrics.WrittenBytes
		reused += r.Metrics.ReusedBytes
		read += r.Metrics.ReadBytes
		return r
	}

	release := h.hold(t, hookKey(KindWrite, a))
	j1 := mustSubmit(t, e, bg, blockWrite(a, buf))
	h.await(t, "enter "+hookKey(KindWrite, a), 1) // the only worker is busy
	ctx, cancel := context.WithCancel(bg)
	j2 := mustSubmit(t, e, ctx, blockWrite(b, buf))
	cancel()
	if r := add(ack(t, j2)); !errors.Is(r.Err, context.Canceled) {
		t.Fatalf("cancelled pending write: %v", r.Err)
	}
	release()
	add(ackOK(t, j1))
	if r := add(mustDo(t, e, blockWrite(a, buf))); r.Metrics.ReusedBytes != int64(len(buf)) {
		t.Fatalf("second write reused %d bytes, want %d", r.Metrics.ReusedBytes, len(buf))
	}
	dest := [][]byte{make([]byte, len(buf))}
	if r := add(mustDo(t, e, &ReadRequest{Ref: a, Dest: dest})); r.Metrics.ReadBytes != int64(len(buf)) || string(dest[0]) != string(buf) {
		t.Fatalf("read: %d bytes, equal %v", r.Metrics.ReadBytes, string(dest[0]) == string(buf))
	}
	if r := add(e.Do(bg, &ReadRequest{Ref: refOf("ns", "missing"), Dest: dest})); !errors.Is(r.Err, fs.ErrNotExist) {
		t.Fatalf("read of a missing snapshot: %v", r.Err)
	}
	add(mustDo(t, e, &DeleteRequest{Ref: a}))
	add(mustDo(t, e, &CollectRequest{}))

	if written <= int64(len(buf)) || reused != int64(len(buf)) || read != int64(len(buf)) {
		t.Fatalf("results: written %d, reused %d, read %d", written, reused, read)
	}
	reg := prometheus.NewPedanticRegistry()
	reg.MustRegister(rec)
	want := map[string]int{"write/ok": 2, "write/canceled": 1, "read/ok": 1, "read/error": 1, "delete/ok": 1, "collect/ok": 1}
	exp := JobsExposition(want, written, reused, read)
	if err := testutil.GatherAndCompare(reg, strings.NewReader(exp), "kvpersist_jobs_total",
		"kvpersist_written_bytes_total", "kvpersist_reused_bytes_total", "kvpersist_read_bytes_total"); err != nil {
		t.Fatal(err)
	}
	counts := map[string]uint64{}
	for _, l := range rec.Snapshot().Latency {
		counts[l.Kind] = l.Count
	}
	if fmt.Sprint(counts) != fmt.Sprint(map[string]uint64{"write": 2, "read": 2, "delete": 1, "collect": 1}) {
		t.Fatalf("latency observations per kind %v: want only the jobs that ran", counts)
	}
}

// JobsExposition is the expected Prometheus text exposition of
// kvpersist_jobs_total (every kind × outcome; counts["kind/outcome"], 0
// when absent) and of the written, reused and read byte counters. It is
// exported for the external tests (metrics_scrape_test.go).
func JobsExposition(counts map[string]int, written, reused, read int64) string {
	var exp strings.Builder
	exp.WriteString("# HELP kvpersist_jobs_total Jobs finished, by kind and outcome.\n# TYPE kvpersist_jobs_total counter\n")
	for _, k := range []string{"write", "read", "collect", "delete", "migrate", "save", "load", "lookup", "evict"} {
		for _, o := range []string{"ok", "error", "canceled", "nospace"} {
			fmt.Fprintf(&exp, "kvpersist_jobs_total{kind=%q,outcome=%q} %d\n", k, o, counts[k+"/"+o])
		}
	}
	fmt.Fprintf(&exp, `# HELP kvpersist_written_bytes_total Bytes written to disk by saves (data and headers).
# TYPE kvpersist_written_bytes_total counter
kvpersist_written_bytes_total %d
# HELP kvpersist_reused_bytes_total Bytes a save found already stored and did not write (dedup).
# TYPE kvpersist_reused_bytes_total counter
kvpersist_reused_bytes_total %d
# HELP kvpersist_read_bytes_total Bytes read from disk into callers' buffers.
# TYPE kvpersist_read_bytes_total counter
kvpersist_read_bytes_total %d
`, written, reused, read)
	return exp.String()
}
