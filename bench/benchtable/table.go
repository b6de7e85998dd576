// Command benchtable prints one table of every row's x-limit from the
// output of `go test -bench` (a results file of bench/run.sh, or standard
// input): per row, the median, least and greatest x-limit over its runs,
// its target and whether the median meets it, and the medians of its
// other ratios (x-<name>: a further limit's time over the engine's).
//
//	go run ./bench/benchtable bench/results/<file>.txt
package main

import (
	"bufio"
	"fmt"
	"io"
	"math"
	"os"
	"regexp"
	"slices"
	"sort"
	"strconv"
	"strings"
)

// Row is one benchmark row: its name without the -GOMAXPROCS suffix and
// the metrics of each of its runs (unit -> value, e.g. "x-limit", "ns/op").
type Row struct {
	Name string
	Runs []map[string]float64
}

// procSuffix is the -GOMAXPROCS suffix go test adds to a row's name.
var procSuffix = regexp.MustCompile(`-\d+$`)

// Parse reads `go test -bench` output and returns its rows in the order
// they first appear. A result line is the row's name, its iteration
// count, then value-unit pairs; other lines (configuration, logs, PASS,
// a name printed alone before a benchmark's log output) are skipped. A
// result line whose values do not parse is an error naming its line.
func Parse(r io.Reader) ([]Row, error) {
	var rows []Row
	index := map[string]int{}
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for line := 1; sc.Scan(); line++ {
		f := strings.Fields(sc.Text())
		if len(f) < 4 || !strings.HasPrefix(f[0], "Benchmark") {
			continue
		}
		if _, err := strconv.ParseInt(f[1], 10, 64); err != nil {
			continue // not a result line (e.g. "BenchmarkX --- FAIL: ...")
		}
		if len(f)%2 != 0 {
			return nil, fmt.Errorf("line %d: %d fields after the iteration count, want value-unit pairs", line, len(f)-2)
		}
		run := map[string]float64{}
		for i := 2; i < len(f); i += 2 {
			v, err := strconv.ParseFloat(f[i], 64)
			if err != nil {
				return nil, fmt.Errorf("line %d: value %q of %s: %w", line, f[i], f[i+1], err)
			}
			run[f[i+1]] = v
		}
		name := procSuffix.ReplaceAllString(f[0], "")
		k, ok := index[name]
		if !ok {
			k = len(rows)
			index[name] = k
			rows = append(rows, Row{Name: name})
		}
		rows[k].Runs = append(rows[k].Runs, run)
	}
	return rows, sc.Err()
}

// Values are the values of unit over the runs that report it, sorted.
func (r Row) Values(unit string) []float64 {
	var out []float64
	for _, run := range r.Runs {
		if v, ok := run[unit]; ok {
			out = append(out, v)
		}
	}
	slices.Sort(out)
	return out
}

// Median is the median of sorted values (NaN when empty).
func Median(sorted []float64) float64 {
	n := len(sorted)
	if n == 0 {
		return math.NaN()
	}
	if n%2 == 1 {
		return sorted[n/2]
	}
	return (sorted[n/2-1] + sorted[n/2]) / 2
}

// targets are the x-limit targets of the rows, by name prefix: the first
// prefix that matches a row's name gives its target.
var targets = []struct {
	prefix string
	x      float64
}{
	{"BenchmarkSave/single/", 0.9},
	{"BenchmarkSave/blocks-first/", 0.8},
	{"BenchmarkSave/blocks-dedup/", 0.85},
	{"BenchmarkRestore/single/", 0.85},
	{"BenchmarkRestore/blocks/", 0.85},
	{"BenchmarkRestoreCold/single/", 0.8},
	{"BenchmarkRestoreCold/blocks/", 0.7},
	{"BenchmarkRestorePartlyCached/", 0.85},
	{"BenchmarkCollect", 0.5},
	{"BenchmarkEvict", 0.5},
	{"BenchmarkPrefix/save-empty", 0.9},
	{"BenchmarkPrefix/save-grow", 0.8},
	{"BenchmarkPrefix/load-warm-verified", 0.75},
	{"BenchmarkServing/", 0.9},
	{"BenchmarkRemoteUpload/", 0.8},
	{"BenchmarkRemoteFetch", 0.8},
}

// Target is the x-limit target of the row named name, and whether it has
// one.
func Target(name string) (float64, bool) {
	for _, t := range targets {
		if strings.HasPrefix(name, t.prefix) {
			return t.x, true
		}
	}
	return 0, false
}

// Write prints the table of rows to w.
func Write(w io.Writer, rows []Row) error {
	bw := bufio.NewWriter(w)
	width := len("row")
	for _, r := range rows {
		width = max(width, len(r.Name))
	}
	fmt.Fprintf(bw, "%-*s %4s %8s %8s %8s %7s %6s  %s\n", width, "row", "runs", "x-limit", "min", "max", "target", "", "other ratios (median)")
	for _, r := range rows {
		xs := r.Values("x-limit")
		cell := func(v float64) string {
			if math.IsNaN(v) {
				return "-"
			}
			return strconv.FormatFloat(v, 'f', 3, 64)
		}
		med, lo, hi := math.NaN(), math.NaN(), math.NaN()
		if len(xs) > 0 {
			med, lo, hi = Median(xs), xs[0], xs[len(xs)-1]
		}
		tg, verdict := "report", ""
		if t, ok := Target(r.Name); ok {
			tg = ">= " + strconv.FormatFloat(t, 'f', -1, 64)
			switch {
			case math.IsNaN(med):
				verdict = "NONE"
			case med >= t:
				verdict = "ok"
			default:
				verdict = "BELOW"
			}
		}
		var others []string
		for _, u := range r.units() {
			if strings.HasPrefix(u, "x-") && u != "x-limit" {
				others = append(others, fmt.Sprintf("%s %.3f", u, Median(r.Values(u))))
			}
		}
		fmt.Fprintf(bw, "%-*s %4d %8s %8s %8s %7s %6s  %s\n", width, r.Name, len(r.Runs), cell(med), cell(lo), cell(hi), tg, verdict, strings.Join(others, ", "))
	}
	return bw.Flush()
}

// units are the units any run of r reports, sorted.
func (r Row) units() []string {
	set := map[string]bool{}
	for _, run := range r.Runs {
		for u := range run {
			set[u] = true
		}
	}
	out := make([]string, 0, len(set))
	for u := range set {
		out = append(out, u)
	}
	sort.Strings(out)
	return out
}

func main() {
	in := io.Reader(os.Stdin)
	switch len(os.Args) {
	case 1:
	case 2:
		f, err := os.Open(os.Args[1])
		if err != nil {
			fmt.Fprintln(os.Stderr, "benchtable:", err)
			os.Exit(1)
		}
		defer f.Close()
		in = f
	default:
		fmt.Fprintln(os.Stderr, "usage: benchtable [go-test-bench-output-file]")
		os.Exit(2)
	}
	rows, err := Parse(in)
	if err == nil {
		err = Write(os.Stdout, rows)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "benchtable:", err)
		os.Exit(1)
	}
}
