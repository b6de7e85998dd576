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
