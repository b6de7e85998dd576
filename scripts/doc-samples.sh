#!/bin/sh
# Regenerates every checked transcript of the docs (README.md's "Command
# line" section and docs/operating.md): runs their commands in order on a
# fresh temp store with the kvpersist binary built from this tree, and
# writes their outputs into the files (see TestDocSamples in
# cmd/kvpersist/docsamples_test.go, which `make test` and `make docs-check`
# run to check them).
set -eu
cd "$(dirname "$0")/.."
KVPERSIST_UPDATE_DOCS=1 exec ${GO:-go} test -count=1 -run '^TestDocSamples$' ./cmd/kvpersist
