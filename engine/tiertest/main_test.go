package tiertest

import (
	"context"
	"fmt"
	"os"
	"testing"

	"go.uber.org/goleak"

	"github.com/kvpersist/kvpersist/internal/seaweedfs"
)

// srv is the real SeaweedFS server of this package's tests (one start
// costs ~15 s); each test uses its own bucket prefix, and the tests that
// kill it restart it before they return.
var srv *seaweedfs.Server

// TestMain builds (if needed) and starts SeaweedFS, runs the tests, stops
// it, then checks that no goroutine was left behind. When the server
// cannot be built or started the package FAILS, saying so.
func TestMain(m *testing.M) {
	ignore := goleak.IgnoreCurrent() // ants starts a default pool at import
	s, err := seaweedfs.StartForTests(context.Background())
	if err != nil {
		fmt.Fprintln(os.Stderr, "FAIL:", err)
		os.Exit(1)
	}
	srv = s
	code := m.Run()
	if err := srv.Stop(); err != nil {
		fmt.Fprintln(os.Stderr, "stopping SeaweedFS:", err)
		code = 1
	}
	if code == 0 {
		if err := goleak.Find(ignore); err != nil {
			fmt.Fprintln(os.Stderr, "goleak:", err)
			code = 1
		}
	}
	os.Exit(code)
}
