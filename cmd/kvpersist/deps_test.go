package main

import (
	"os/exec"
	"slices"
	"strings"
	"testing"
)

// testOnly are the packages the operator binary must not link: test
// helpers (the fault-injecting file system, fixtures) and the standard
// library's test frameworks.
var testOnly = []string{
	"github.com/kvpersist/kvpersist/internal/testutil",
	"github.com/kvpersist/kvpersist/internal/seaweedfs",
	"github.com/kvpersist/kvpersist/internal/faultproxy",
	"testing",
	"testing/fstest",
	"testing/iotest",
	"testing/quick",
	"testing/synctest",
	"go.uber.org/goleak",
}

// The kvpersist binary links product code only: `go list -deps
// ./cmd/kvpersist` (what the build compiles in, tests excluded) names no
// test-only package. The go command is the one of the toolchain running
// the test (go test puts its GOROOT/bin first in the PATH of the tests).
func TestBinaryLinksNoTestOnlyPackage(t *testing.T) {
	out, err := exec.Command("go", "list", "-deps", ".").Output()
	if err != nil {
		t.Fatalf("go list -deps: %v", err)
	}
	deps := strings.Fields(string(out))
	if len(deps) < 10 || !slices.Contains(deps, "github.com/kvpersist/kvpersist/engine") {
		t.Fatalf("go list -deps gave %d packages without the engine: %q", len(deps), out)
	}
	for _, d := range deps {
		if slices.Contains(testOnly, d) {
			t.Errorf("the kvpersist binary links the test-only package %s", d)
		}
	}
}
