package tiertest

import (
	"os"
	"testing"

	"github.com/kvpersist/kvpersist/internal/seaweedfs"
)

// srv is the real SeaweedFS server of this package's tests (one start
// costs ~15 s); each test uses its own bucket prefix, and the tests that
// kill it restart it before they return.
var srv *seaweedfs.Server

// TestMain starts SeaweedFS for the package's tests and checks for leaked
// goroutines after them (seaweedfs.RunTests: it fails, never skips, when
// the server cannot be built or started).
func TestMain(m *testing.M) {
	if os.Getenv(childEnv) != "" { // a crash test's child process
		os.Exit(uploaderChild(os.Args[1:]))
	}
	os.Exit(seaweedfs.RunTests(m, func(s *seaweedfs.Server) { srv = s }))
}
