package remote_test

import (
	"os"
	"testing"

	"github.com/kvpersist/kvpersist/internal/seaweedfs"
)

// srv is the real SeaweedFS server every test of this package talks to
// (one start costs ~15 s, so the tests share it; each uses its own
// namespace, and the fault tests that kill it restart it before returning).
var srv *seaweedfs.Server

// TestMain starts SeaweedFS for the package's tests and checks for leaked
// goroutines after them (seaweedfs.RunTests: it fails, never skips, when
// the server cannot be built or started).
func TestMain(m *testing.M) {
	os.Exit(seaweedfs.RunTests(m, func(s *seaweedfs.Server) { srv = s }))
}
