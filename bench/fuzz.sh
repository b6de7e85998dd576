#!/usr/bin/env bash
# Run every Go fuzz target of the module for a fixed time each (make fuzz):
#
#   bench/fuzz.sh [FUZZTIME]        default 60s; e.g. `make fuzz FUZZTIME=5m`
#
# The targets are found with grep (`func FuzzName(` in *_test.go), so a new
# one is picked up without editing this script. Each runs alone, as
#
#   go test -run '^$' -fuzz '^Name$' -fuzztime FUZZTIME ./pkg
#
# plus -fuzzminimizetime FUZZMINIMIZETIME (default 2s): the minimization of
# every new interesting input otherwise may take up to a minute of the
# budget. One line per target reports the executions; a failing target's
# output is printed in full (the failing input is then in the package's
# testdata/fuzz/Name/: keep it once fixed, it becomes a regression seed).
# The script runs every target and exits non-zero if any failed.
set -euo pipefail
cd "$(dirname "$0")/.."
fuzztime="${1:-60s}"
minimize="${FUZZMINIMIZETIME:-2s}"
go="${GO:-go}"

targets=$(grep -rEo --include='*_test.go' --exclude-dir=testdata --exclude-dir=.git \
	'^func Fuzz[A-Za-z0-9_]+\(' . |
	sed -E 's|^\./||; s|/[^/]*:func (Fuzz[A-Za-z0-9_]+)\($| \1|' | sort -u)
if [ -z "$targets" ]; then
	echo "fuzz.sh: no fuzz targets found" >&2
	exit 1
fi

status=0
log=$(mktemp)
trap 'rm -f "$log"' EXIT
while read -r dir name; do
	if "$go" test -run '^$' -fuzz "^${name}\$" -fuzztime "$fuzztime" -fuzzminimizetime "$minimize" "./$dir" >"$log" 2>&1; then
		result=ok
	else
		result=FAIL
		status=1
	fi
	last=$(grep -E '^fuzz: elapsed: .*execs' "$log" | tail -n 1 || true)
	echo "$result $name ./$dir ${last#fuzz: }"
	if [ "$result" = FAIL ]; then
		cat "$log"
	fi
done <<<"$targets"
exit "$status"
