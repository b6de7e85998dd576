# kvpersist: every target needs only Go (and the module proxy for the first
# download of dependencies).
GO      ?= go
PKGS    := ./...
# Fuzz time per target for `make fuzz`.
FUZZTIME ?= 60s

.PHONY: test vet weed race demo bench soak fuzz fmt clean docs-check docs-samples readme-check readme-samples

## test: vet, then every test with the race detector (short soak, crash and
## fuzz-seed runs included). CI runs this. The object-store tests need the
## SeaweedFS server: `weed` builds it first (once per machine, several
## minutes) so its build is not counted against the test timeout.
test: vet weed
	$(GO) test -race -timeout 9m -count=1 $(PKGS)

vet:
	@unformatted=$$(gofmt -l $$(git ls-files '*.go' 2>/dev/null || find . -name '*.go')); \
	  if [ -n "$$unformatted" ]; then echo "gofmt needed:"; echo "$$unformatted"; exit 1; fi
	$(GO) vet $(PKGS)

## weed: build the pinned SeaweedFS server for the object-store tests if it
## is not cached yet (${XDG_CACHE_HOME:-$$HOME/.cache}/kvpersist/seaweedfs/).
weed:
	$(GO) run ./internal/seaweedfs/cmd/weed-ensure

## docs-check: the docs' transcripts (README.md's "Command line",
## docs/operating.md) equal what the commands print on a fresh store, the
## README's Go sketches equal the examples, and README.md and
## ARCHITECTURE.md stay within their size budgets, links and set-up
## commands hold (also part of `test`).
docs-check:
	$(GO) test -count=1 -run '^TestDocSamples$$' ./cmd/kvpersist
	$(GO) test -count=1 -run 'README|Example' ./engine
	$(GO) test -count=1 .

## docs-samples: regenerate those transcripts.
docs-samples:
	./scripts/doc-samples.sh

# The former names of docs-check and docs-samples.
readme-check: docs-check
readme-samples: docs-samples

## demo: the main job (the README's first set-up command).
demo:
	$(GO) run ./cmd/kvpersist demo

## bench: the benchmark suite against the machine's limits
## (docs/performance.md).
bench:
	./bench/run.sh

## soak: long concurrency soak and crash (SIGKILL) runs. First the serving
## loop at capacity under random SIGKILLs for SOAK_DURATION (its closing
## line gives the figures: kills, turns, evictions, pages verified), then
## two processes sharing one root's capacity under random SIGKILLs for
## SOAK_DURATION (its closing line: kills, saves, samples, the largest
## on-disk total against the bound), then the other soak, crash and
## two-process tests in their long variants.
SOAK_DURATION ?= 5m
SOAK_TIMED = ^(TestServingSoakSIGKILL|TestTwoProcessCapacitySoakSIGKILL)$$
soak:
	KVPERSIST_SOAK=long KVPERSIST_SOAK_DURATION=$(SOAK_DURATION) $(GO) test -race -timeout 60m -count=1 -v -run '^TestServingSoakSIGKILL$$' ./engine/
	KVPERSIST_SOAK=long KVPERSIST_SOAK_DURATION=$(SOAK_DURATION) $(GO) test -race -timeout 60m -count=1 -v -run '^TestTwoProcessCapacitySoakSIGKILL$$' ./engine/
	KVPERSIST_SOAK=long $(GO) test -race -timeout 60m -count=1 -skip '$(SOAK_TIMED)' -run 'Soak|Crash|TwoProcess' ./...

## fuzz: every fuzz target for FUZZTIME each.
fuzz:
	./bench/fuzz.sh $(FUZZTIME)

fmt:
	gofmt -w $$(git ls-files '*.go')

clean:
	$(GO) clean -testcache
