package metrics

import (
	"encoding/json"
	"fmt"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
)

// remoteFamilies are the object-store tier's metric names.
var remoteFamilies = []string{"kvpersist_remote_ops_total", "kvpersist_remote_duration_seconds",
	"kvpersist_remote_bytes_total", "kvpersist_remote_lookup_pages_total", "kvpersist_remote_upload_queue",
	"kvpersist_remote_upload_evicted_pages_total", "kvpersist_remote_upload_failed_attempts_total"}

// Durations below are binary fractions of a second (whole nanoseconds),
// so sums in float64 are exact in any order.

// remoteHistText renders one op's remote latency histogram from the
// observed seconds.
func remoteHistText(op string, obs ...float64) string {
	return histogramText("kvpersist_remote_duration_seconds", "op", op, obs...)
}

// TestRemoteMetrics: a recorder exports no remote family until the tier
// reports (an engine without a remote tier shows none), then every op ×
// result (zeros included), the latency histograms of the ops that ran,
// the fetch and upload bytes, the lookup pages, the queue depth, the
// pages evicted with their upload pending and the failed upload attempts,
// with
// the values of a known sequence; the snapshot holds the same figures and
// survives a JSON round trip.
func TestRemoteMetrics(t *testing.T) {
	r, err := New(Options{})
	if err != nil {
		t.Fatal(err)
	}
	reg := prometheus.NewPedanticRegistry()
	reg.MustRegister(r)
	if n, err := testutil.GatherAndCount(reg, remoteFamilies...); err != nil || n != 0 {
		t.Fatalf("before any remote report: %d remote series (%v)", n, err)
	}
	if r.Snapshot().Remote != nil {
		t.Fatal("snapshot has remote figures before any remote report")
	}

	r.RemoteQueue(0) // the tier starts
	r.Remote(RemoteLookup, RemoteOK, 0, 250*time.Millisecond)
	r.Remote(RemoteLookup, RemoteError, 0, 2*time.Second)
	r.RemoteLookup(10, 2)
	r.Remote(RemoteFetch, RemoteOK, 1000, 7812500*time.Nanosecond)
	r.Remote(RemoteFetch, RemoteOK, 24, 31250*time.Microsecond)
	r.Remote(RemoteFetch, RemoteCorrupt, 0, 1953125*time.Nanosecond)
	r.Remote(RemoteUpload, RemoteOK, 500, 15625*time.Microsecond)
	r.Remote(RemoteUpload, RemoteExisted, 0, 1953125*time.Nanosecond)
	r.Remote(RemoteUpload, RemoteAbandoned, 0, 0)
	r.RemoteQueue(7)
	r.RemoteUploadEvicted(2)
	r.RemoteUploadEvicted(1)
	r.RemoteUploadRetried()
	r.RemoteUploadRetried()

	want := map[[2]string]int{{"lookup", "ok"}: 1, {"lookup", "error"}: 1, {"fetch", "ok"}: 2, {"fetch", "corrupt"}: 1,
		{"upload", "ok"}: 1, {"upload", "existed"}: 1, {"upload", "abandoned"}: 1}
	var b strings.Builder
	b.WriteString("# HELP kvpersist_remote_ops_total Object-store tier operations (lookup batches, page fetches, uploads), by op and result.\n# TYPE kvpersist_remote_ops_total counter\n")
	for _, op := range []string{"lookup", "fetch", "upload"} {
		for _, res := range []string{"ok", "existed", "corrupt", "error", "abandoned"} {
			fmt.Fprintf(&b, "kvpersist_remote_ops_total{op=%q,result=%q} %d\n", op, res, want[[2]string{op, res}])
		}
	}
	b.WriteString("# HELP kvpersist_remote_duration_seconds Wall time of object-store tier operations, in seconds, by op (an upload's includes its retries).\n# TYPE kvpersist_remote_duration_seconds histogram\n")
	b.WriteString(remoteHistText("lookup", 0.25, 2))
	b.WriteString(remoteHistText("fetch", 0.0078125, 0.03125, 0.001953125))
	b.WriteString(remoteHistText("upload", 0.015625, 0.001953125, 0))
	b.WriteString(`# HELP kvpersist_remote_bytes_total Bytes fetched from (verified) and uploaded to the object store, by op.
# TYPE kvpersist_remote_bytes_total counter
kvpersist_remote_bytes_total{op="fetch"} 1024
kvpersist_remote_bytes_total{op="upload"} 500
# HELP kvpersist_remote_lookup_pages_total Pages a remote lookup asked the object store for, hit (stored) or miss.
# TYPE kvpersist_remote_lookup_pages_total counter
kvpersist_remote_lookup_pages_total{result="hit"} 10
kvpersist_remote_lookup_pages_total{result="miss"} 2
# HELP kvpersist_remote_upload_queue Uploads to the object store waiting or in flight.
# TYPE kvpersist_remote_upload_queue gauge
kvpersist_remote_upload_queue 7
# HELP kvpersist_remote_upload_evicted_pages_total Pages the page cache evicted while their upload to the object store was pending (nothing else was evictable).
# TYPE kvpersist_remote_upload_evicted_pages_total counter
kvpersist_remote_upload_evicted_pages_total 3
# HELP kvpersist_remote_upload_failed_attempts_total Upload attempts to the object store that failed and are retried (unreachable, server error, credentials or bucket refused).
# TYPE kvpersist_remote_upload_failed_attempts_total counter
kvpersist_remote_upload_failed_attempts_total 2
`)
	if err := testutil.GatherAndCompare(reg, strings.NewReader(b.String()), remoteFamilies...); err != nil {
		t.Fatal(err)
	}
	if problems, err := testutil.GatherAndLint(reg); err != nil || len(problems) > 0 {
		t.Fatalf("lint: %v %v", problems, err)
	}

	s := r.Snapshot()
	rs := s.Remote
	if rs == nil || rs.FetchBytes != 1024 || rs.UploadBytes != 500 || rs.LookupHitPages != 10 || rs.LookupMissPages != 2 || rs.UploadQueueDepth != 7 || rs.UploadEvictedPages != 3 || rs.UploadFailedAttempts != 2 {
		t.Fatalf("remote snapshot %+v", rs)
	}
	if len(rs.Ops) != len(want) {
		t.Fatalf("ops %v, want %d non-zero counts", rs.Ops, len(want))
	}
	for _, c := range rs.Ops {
		if want[[2]string{c.Op, c.Result}] != int(c.Count) {
			t.Fatalf("ops %v, want %v", rs.Ops, want)
		}
	}
	if len(rs.Latency) != 3 || rs.Latency[1].Kind != "fetch" || rs.Latency[1].Count != 3 || rs.Latency[1].SumSeconds != 0.041015625 {
		t.Fatalf("latency %+v", rs.Latency)
	}
	js, err := json.Marshal(s)
	if err != nil {
		t.Fatal(err)
	}
	var back Snapshot
	if err := json.Unmarshal(js, &back); err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(back, s) {
		t.Fatalf("JSON round trip:\n%+v\n%+v", back.Remote, s.Remote)
	}
	var nilRec *Recorder
	nilRec.Remote(RemoteFetch, RemoteOK, 1, time.Second) // no panic, no effect
	nilRec.RemoteLookup(1, 1)
	nilRec.RemoteQueue(1)
	nilRec.RemoteUploadRetried()
}
