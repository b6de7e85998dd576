package main

import (
	"bytes"
	"math"
	"strings"
	"testing"
)

// sample is go test -bench output as bench/run.sh collects it: a
// configuration header, rows of several runs (one with a log line and its
// name printed alone before its result), a failed row, PASS lines.
const sample = `kvpersist-commit: 05fa70d
goos: linux
kvpersist-bench-dir: /tmp (ext2/3/4)
BenchmarkRestore/single/T=2048-2         	      10	  50000000 ns/op	5368.71 MB/s	 0.9000 x-limit	 3.5 peak-heap-MiB
BenchmarkRestore/single/T=2048-2         	      10	  52000000 ns/op	5161.00 MB/s	 0.8000 x-limit	 3.5 peak-heap-MiB
BenchmarkRestore/single/T=2048-2         	      10	  51000000 ns/op	5263.00 MB/s	 0.8500 x-limit	 3.5 peak-heap-MiB
BenchmarkRemoteFetch-2
    remote_fetch_test.go:90: started SeaweedFS
BenchmarkRemoteFetch-2                   	       1	 900000000 ns/op	 0.6 x-limit	 1.2 x-getwrite	 1.0 x-write
BenchmarkRemoteFetch-2                   	       1	 910000000 ns/op	 0.7 x-limit	 1.1 x-getwrite	 0.9 x-write
BenchmarkHash/sha256-2                   	    1000	   1000000 ns/op	 1.4 GB/s
--- FAIL: BenchmarkSave/blocks-grow/T=2048
BenchmarkSave/blocks-grow/T=2048 --- FAIL: limit ran first
PASS
ok  	github.com/kvpersist/kvpersist/bench	100.0s
`

func TestParse(t *testing.T) {
	rows, err := Parse(strings.NewReader(sample))
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, r := range rows {
		names = append(names, r.Name)
	}
	if got, want := strings.Join(names, ","), "BenchmarkRestore/single/T=2048,BenchmarkRemoteFetch,BenchmarkHash/sha256"; got != want {
		t.Fatalf("rows %s, want %s", got, want)
	}
	r := rows[0]
	if len(r.Runs) != 3 || r.Runs[1]["x-limit"] != 0.8 || r.Runs[1]["ns/op"] != 52000000 || r.Runs[2]["MB/s"] != 5263 {
		t.Fatalf("restore runs %v", r.Runs)
	}
	if xs := r.Values("x-limit"); len(xs) != 3 || xs[0] != 0.8 || xs[2] != 0.9 || Median(xs) != 0.85 {
		t.Fatalf("x-limit values %v, median %v", xs, Median(xs))
	}
	if xs := rows[1].Values("x-getwrite"); Median(xs) != 1.15 {
		t.Fatalf("x-getwrite median of %v is %v, want 1.15", xs, Median(xs))
	}
	if xs := rows[2].Values("x-limit"); len(xs) != 0 || !math.IsNaN(Median(xs)) {
		t.Fatalf("hash row x-limit %v", xs)
	}
}

func TestParseRejectsBadValue(t *testing.T) {
	for _, in := range []string{
		"BenchmarkX-2 1 12 ns/op abc x-limit\n",
		"BenchmarkX-2 1 12 ns/op 0.5\n",
	} {
		if _, err := Parse(strings.NewReader(in)); err == nil || !strings.Contains(err.Error(), "line 1") {
			t.Fatalf("%q: error %v, want one naming line 1", in, err)
		}
	}
}

func TestWrite(t *testing.T) {
	rows, err := Parse(strings.NewReader(sample))
	if err != nil {
		t.Fatal(err)
	}
	var buf bytes.Buffer
	if err := Write(&buf, rows); err != nil {
		t.Fatal(err)
	}
	lines := strings.Split(strings.TrimSpace(buf.String()), "\n")
	if len(lines) != 4 {
		t.Fatalf("%d lines, want a header and 3 rows:\n%s", len(lines), buf.String())
	}
	for i, want := range [][]string{
		{"BenchmarkRestore/single/T=2048", " 3 ", "0.850", "0.800", "0.900", ">= 0.85", "ok"},
		{"BenchmarkRemoteFetch", " 2 ", "0.650", "0.600", "0.700", ">= 0.8", "BELOW", "x-getwrite 1.150, x-write 0.950"},
		{"BenchmarkHash/sha256", " 1 ", "report"},
	} {
		for _, w := range want {
			if !strings.Contains(lines[i+1], w) {
				t.Fatalf("row %d %q lacks %q", i, lines[i+1], w)
			}
		}
	}
	if _, ok := Target("BenchmarkRestorePartlyCached/single/T=8192"); !ok {
		t.Fatal("the partly cached restore row has no target")
	}
}
