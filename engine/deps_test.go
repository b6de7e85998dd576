package engine

import (
	"os/exec"
	"slices"
	"strings"
	"testing"

	"github.com/kvpersist/kvpersist/engine/metrics"
)

// *metrics.Recorder is a MetricsSink (checked at compile time).
var _ MetricsSink = (*metrics.Recorder)(nil)

// TestEngineLinksNoPrometheus: importing package engine links neither
// prometheus nor protobuf (Config.Metrics is the MetricsSink interface, not
// *metrics.Recorder): `go list -deps .` (what a build of the package
// compiles, tests excluded) names no package of theirs. Only an embedder
// that creates a metrics.Recorder links them.
func TestEngineLinksNoPrometheus(t *testing.T) {
	out, err := exec.Command("go", "list", "-deps", ".").Output()
	if err != nil {
		t.Fatalf("go list -deps: %v", err)
	}
	deps := strings.Fields(string(out))
	if len(deps) < 10 || !slices.Contains(deps, "github.com/kvpersist/kvpersist/engine/jobs") {
		t.Fatalf("go list -deps gave %d packages without engine/jobs: %q", len(deps), out)
	}
	for _, d := range deps {
		for _, banned := range []string{"github.com/prometheus/", "google.golang.org/protobuf/", "github.com/kvpersist/kvpersist/engine/metrics"} {
			if strings.HasPrefix(d, banned) && !strings.HasPrefix(d, "github.com/kvpersist/kvpersist/engine/metrics/labels") {
				t.Errorf("package engine links %s", d)
			}
		}
	}
}

// TestPolicyStaysPure: the eviction policy links no other package of the
// module (it does no I/O: the page cache's shell, engine/pagecache, does
// it), and neither the store nor the checkpoint format links the policy
// (the CLI reads a checkpoint through them).
func TestPolicyStaysPure(t *testing.T) {
	deps := func(pkg string) []string {
		out, err := exec.Command("go", "list", "-deps", pkg).Output()
		if err != nil {
			t.Fatalf("go list -deps %s: %v", pkg, err)
		}
		return strings.Fields(string(out))
	}
	const mod = "github.com/kvpersist/kvpersist/"
	for _, d := range deps("./evict") {
		if strings.HasPrefix(d, mod) && d != mod+"engine/evict" {
			t.Errorf("engine/evict links %s", d)
		}
	}
	for _, pkg := range []string{"./store", "./recency"} {
		if slices.Contains(deps(pkg), mod+"engine/evict") {
			t.Errorf("%s links the policy engine/evict", pkg)
		}
	}
	if !slices.Contains(deps("./pagecache"), mod+"engine/evict") {
		t.Error("engine/pagecache does not link the policy it drives")
	}
}
