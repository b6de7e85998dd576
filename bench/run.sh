#!/usr/bin/env bash
# Runs kvpersist's benchmark suite (package ./bench) against the machine's
# limits, writes bench/results/<date>-<hostname>.txt (benchstat input) and
# prints a summary (per row the median throughput, limit and details),
# then ends with one table of every row's x-limit (limit time / engine
# time: median, least, greatest) against its target (bench/benchtable).
#
# Environment:
#   COUNT=6                 runs of every benchmark (6 is enough for benchstat)
#   BIG_BENCHTIME=1x        iterations per run of the 1 GiB saves (T=8192)
#   SMALL_BENCHTIME=1x      iterations per run of the 256 MiB saves, collect
#                           and evict
#   RESTORE_BENCHTIME=10x   iterations per run of the restores (0.1-0.5 s each:
#                           one alone is too short on a noisy machine)
#                           (each benchmark also runs one untimed warm-up
#                           iteration, once per process; Nx with N > 1 adds
#                           the testing package's N=1 probe run)
#   PARTIAL_BENCHTIME=5x    iterations per run of the warm restore of a
#                           partly cached file (each side reads the file
#                           whole and evicts 8% of it first)
#   PREFIX_BENCHTIME=3x     iterations per run of the prefix cache's save
#                           and load rows
#   COLD_BENCHTIME=3x       iterations per run of the cold restores (each
#                           evicts the files, restores, and runs the O_DIRECT
#                           limit at 4 queue depths: about 5 s at 1 GiB)
#   FAST_BENCHTIME=1s       benchtime of dispatch, hashing and the prefix
#                           index's lookups (each builds a 1M-page index)
#   SERVING_BENCHTIME=1x    iterations per run of the serving loop at capacity
#                           (each: 200 turns per loop at the tiny geometry,
#                           50 at Qwen2.5-7B's, bounded and unbounded; about
#                           10 s and 60 s on the project's VM)
#   REMOTE_BENCHTIME=1x     iterations per run of the object-store upload and fetch
#                           (1 GiB of pages to a SeaweedFS the benchmark
#                           starts on loopback, built by `make weed` first)
#   KVPERSIST_BENCH_DIR     directory on the disk to measure (default: the
#                           temp dir unless tmpfs, else bench/); never tmpfs
#   KVPERSIST_BENCH_PREADS=1  the cold restore rows with
#                           engine.Config.NoAsyncReads (O_DIRECT preads
#                           instead of Linux AIO), for a comparison in one
#                           binary
#   KVPERSIST_BENCH_PROFILE_DIR  a directory: each run of a row's engine side
#                           and of its limit is CPU-profiled apart into
#                           <dir>/<row>-<ours|limit>-<i>-<n>.pprof
#                           (`go tool pprof -top BIN DIR/*-ours-*.pprof`)
#   KVPERSIST_BENCH_FETCH_CHUNK_BYTES  BenchmarkRemoteFetch's engine fetches
#                           with this Store.FetchChunkBytes (an experiment;
#                           unset: one GET per page up to 64 MiB)
#   BENCHSTAT=1             also print `benchstat` of the results (fetched with
#                           go run golang.org/x/perf/cmd/benchstat@latest;
#                           skipped if that fails); 0 to skip
# With the defaults the suite takes about 20-30 minutes on the project's
# 2-core machine (a count-1 run about 4-5 minutes; the disk's speed decides).
set -euo pipefail

cd "$(dirname "$0")/.."
COUNT=${COUNT:-6}
BIG_BENCHTIME=${BIG_BENCHTIME:-1x}
SMALL_BENCHTIME=${SMALL_BENCHTIME:-1x}
RESTORE_BENCHTIME=${RESTORE_BENCHTIME:-10x}
COLD_BENCHTIME=${COLD_BENCHTIME:-3x}
PARTIAL_BENCHTIME=${PARTIAL_BENCHTIME:-5x}
PREFIX_BENCHTIME=${PREFIX_BENCHTIME:-3x}
FAST_BENCHTIME=${FAST_BENCHTIME:-1s}
SERVING_BENCHTIME=${SERVING_BENCHTIME:-1x}
REMOTE_BENCHTIME=${REMOTE_BENCHTIME:-1x}
BENCHSTAT=${BENCHSTAT:-1}
GO=${GO:-go}

mkdir -p bench/results
out="bench/results/$(date +%Y-%m-%d-%H%M)-$(hostname -s 2>/dev/null || hostname).txt"
bin=$(mktemp -t kvpersist-bench.XXXXXX)
trap 'rm -f "$bin"' EXIT
"$GO" test -c -o "$bin" ./bench

{
	echo "kvpersist-commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)$(git diff --quiet 2>/dev/null || echo -dirty)"
	echo "date: $(date -Iseconds)"
	echo "host: $(hostname)"
	echo "kernel: $(uname -sr)"
	echo "go: $("$GO" env GOVERSION)"
	echo "cores: $(nproc)"
	echo "cpu-model: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ *//')"
	echo "load-start: $(cut -d' ' -f1-3 /proc/loadavg)"
} >"$out"

run() { # pattern benchtime
	local t0=$SECONDS
	echo "== -bench '$1' -benchtime $2 -count $COUNT" >&2
	(cd bench && "$bin" -test.run '^$' -test.bench "$1" -test.benchtime "$2" \
		-test.count "$COUNT" -test.timeout 90m) | tee -a "$out"
	echo "== $((SECONDS - t0)) s" >&2
}

start=$(date +%s)
run '^BenchmarkSave$//^T=8192$' "$BIG_BENCHTIME"
run '^BenchmarkSave$//^T=2048$' "$SMALL_BENCHTIME"
run '^BenchmarkRestore$' "$RESTORE_BENCHTIME"
run '^BenchmarkRestoreCold$' "$COLD_BENCHTIME"
run '^BenchmarkRestorePartlyCached$' "$PARTIAL_BENCHTIME"
run '^BenchmarkPrefix$' "$PREFIX_BENCHTIME"
run '^BenchmarkPrefixLookup(From)?$' "$FAST_BENCHTIME"
run '^BenchmarkCollect$' "$SMALL_BENCHTIME"
run '^BenchmarkEvict$' "$SMALL_BENCHTIME"
run '^Benchmark(Dispatch|Hash)$' "$FAST_BENCHTIME"
run '^BenchmarkServing$' "$SERVING_BENCHTIME"
# The object-store tier (each starts a SeaweedFS on loopback).
"$GO" run ./internal/seaweedfs/cmd/weed-ensure >&2
run '^BenchmarkRemoteUpload$/^MiB=1024$' "$REMOTE_BENCHTIME"
run '^BenchmarkRemoteFetch$' "$REMOTE_BENCHTIME"
echo "load-end: $(cut -d' ' -f1-3 /proc/loadavg)" >>"$out"
echo "elapsed-seconds: $(($(date +%s) - start))" >>"$out"

echo
echo "results: $out ($(($(date +%s) - start)) s; load average at start $(grep '^load-start' "$out" | cut -d' ' -f2-), at end $(cut -d' ' -f1-3 /proc/loadavg))"
echo
# Summary: medians over the runs of each row.
awk '
function median(key,    n, i, j, t, a) {
	n = cnt[key]
	for (i = 1; i <= n; i++) a[i] = val[key, i]
	for (i = 2; i <= n; i++) { t = a[i]; for (j = i - 1; j >= 1 && a[j] > t; j--) a[j + 1] = a[j]; a[j + 1] = t }
	if (n % 2) return a[(n + 1) / 2]
	return (a[n / 2] + a[n / 2 + 1]) / 2
}
/^Benchmark/ {
	name = $1; sub(/-[0-9]+$/, "", name)
	if (!(name in seen)) { seen[name] = 1; order[++rows] = name }
	for (i = 3; i < NF; i += 2) { k = name SUBSEP $(i + 1); cnt[k]++; val[k, cnt[k]] = $i; has[k] = 1 }
}
END {
	printf "%-40s %4s %10s %10s %8s %9s  %s\n", "row", "runs", "MB/s", "limit-MB/s", "x-limit", "heap-MiB", "other"
	for (r = 1; r <= rows; r++) {
		n = order[r]; x = ""
		if (has[n, "x-limit"]) x = median(n SUBSEP "x-limit")
		other = ""
		if (has[n, "p99-ns"]) other = sprintf("%.0f ns/op, p99 %.0f ns, direct call %.0f ns", median(n SUBSEP "ns/op"), median(n SUBSEP "p99-ns"), median(n SUBSEP "direct-ns"))
		if (has[n, "minio-GB/s"]) other = sprintf("sha256-simd %.2f GB/s, crypto/sha256 %.2f GB/s", median(n SUBSEP "minio-GB/s"), median(n SUBSEP "crypto-GB/s"))
		if (has[n, "GB/s"]) other = sprintf("%.2f GB/s", median(n SUBSEP "GB/s"))
		if (has[n, "limit-GB/s"]) other = other sprintf(", limit %.3f GB/s", median(n SUBSEP "limit-GB/s"))
		if (has[n, "new/logical"]) other = sprintf("new bytes %.0f%% of logical, %d new blocks", 100 * median(n SUBSEP "new/logical"), median(n SUBSEP "new-blocks"))
		if (has[n, "unlinks/s"]) other = sprintf("%.0f unlinks/s", median(n SUBSEP "unlinks/s"))
		if (has[n, "pages/s"]) other = sprintf("%.0f pages evicted/s", median(n SUBSEP "pages/s"))
		if (has[n, "direct/read"]) other = sprintf("O_DIRECT %.0f%% of bytes", 100 * median(n SUBSEP "direct/read"))
		if (has[n, "qd1-MB/s"]) other = other sprintf("; limit by depth 1/4/16/32: %.0f/%.0f/%.0f/%.0f MB/s", median(n SUBSEP "qd1-MB/s"), median(n SUBSEP "qd4-MB/s"), median(n SUBSEP "qd16-MB/s"), median(n SUBSEP "qd32-MB/s"))
		if (has[n, "missing/file"]) other = other sprintf(" (%.1f%% of the file missing from the page cache; the limit %.0f%% O_DIRECT; all O_DIRECT: %.2f GB/s)", 100 * median(n SUBSEP "missing/file"), 100 * median(n SUBSEP "limit-direct/read"), median(n SUBSEP "alldirect-GB/s"))
		if (has[n, "x-cpu-bound"]) other = other sprintf("; sha256 %.0f MB/s, CPU bound %.0f MB/s, x-bound %.3f, x-cpu-bound %.3f, %.0f CPU-ms/op (bound %.0f)", median(n SUBSEP "sha256-MB/s"), median(n SUBSEP "cpu-bound-MB/s"), median(n SUBSEP "x-bound"), median(n SUBSEP "x-cpu-bound"), median(n SUBSEP "cpu-ms/op"), median(n SUBSEP "bound-cpu-ms/op"))
		if (has[n, "x-cpu-bound-xxh3"]) other = other sprintf("; xxh3 %.0f MB/s, CPU bound %.0f MB/s, x-bound-xxh3 %.3f, x-cpu-bound-xxh3 %.3f (CPU bound %.0f ms/op)", median(n SUBSEP "xxh3-MB/s"), median(n SUBSEP "cpu-bound-xxh3-MB/s"), median(n SUBSEP "x-bound-xxh3"), median(n SUBSEP "x-cpu-bound-xxh3"), median(n SUBSEP "bound-xxh3-cpu-ms/op"))
		if (has[n, "x-pread-xxh3"]) other = other sprintf("pread+xxh3 %.0f MB/s, x-pread-xxh3 %.3f; ", median(n SUBSEP "pread-xxh3-MB/s"), median(n SUBSEP "x-pread-xxh3"))
		if (has[n, "x-sha256-xxh3"]) other = other sprintf("x-sha256-xxh3 %.3f; ", median(n SUBSEP "x-sha256-xxh3"))
		if (has[n, "hit-rate"]) other = sprintf("%.0f saves/s (unbounded %.0f), hit rate %.3f (unbounded %.3f), %.1f pages evicted/turn", median(n SUBSEP "saves/s"), median(n SUBSEP "unbounded-saves/s"), median(n SUBSEP "hit-rate"), median(n SUBSEP "unbounded-hit-rate"), median(n SUBSEP "evicted/turn"))
		if (n ~ /^BenchmarkPrefixLookup(From)?$/) other = sprintf("%.1f us/op (goal < %d us), %.0f allocs/op", median(n SUBSEP "ns/op") / 1000, n ~ /From$/ ? 10 : 100, median(n SUBSEP "allocs/op"))
		if (has[n, "allocs/block"]) other = other sprintf("%.1f allocs/block", median(n SUBSEP "allocs/block"))
		printf "%-40s %4d %10s %10s %8s %9s  %s\n", n, cnt[n SUBSEP "ns/op"],
			has[n, "MB/s"] ? sprintf("%.0f", median(n SUBSEP "MB/s")) : "-",
			has[n, "limit-MB/s"] ? sprintf("%.0f", median(n SUBSEP "limit-MB/s")) : "-",
			x != "" ? sprintf("%.3f", x) : "-",
			has[n, "peak-heap-MiB"] ? sprintf("%.1f", median(n SUBSEP "peak-heap-MiB")) : "-", other
	}
}' "$out"

if [ "$BENCHSTAT" != 0 ]; then
	echo
	"$GO" run golang.org/x/perf/cmd/benchstat@latest "$out" 2>/dev/null ||
		echo "(benchstat unavailable: skipped)"
fi

# Last: every row's x-limit against its target, in one table.
echo
"$GO" run ./bench/benchtable "$out"
