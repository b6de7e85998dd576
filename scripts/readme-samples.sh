#!/bin/sh
# Regenerates every transcript of README.md's "Operating a store" section:
# runs its commands in order on a fresh temp store with the kvpersist binary
# built from this tree, and writes their outputs into README.md (see
# TestREADMESamples in cmd/kvpersist/readme_test.go, which `make test` and
# `make readme-check` run to check them).
set -eu
cd "$(dirname "$0")/.."
KVPERSIST_UPDATE_README=1 exec ${GO:-go} test -count=1 -run '^TestREADMESamples$' ./cmd/kvpersist
