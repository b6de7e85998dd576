package remote_test

import (
	"context"
	"fmt"
	"os"
	"testing"

	"go.uber.org/goleak"

	"github.com/kvpersist/kvpersist/internal/seaweedfs"
)

// srv is the real SeaweedFS server every test of this package talks to
// (one start costs ~15 s, so the tests share it; each uses its own
// namespace, and the fault tests that kill it restart it before returning).
var srv *seaweedfs.Server

// TestMain builds (if needed) and starts SeaweedFS, runs the tests, stops
// the server and then checks that no goroutine was left behind. If the
// server cannot be built or started the package FAILS with a message
// saying so; it never skips.
func TestMain(m *testing.M) {
	ignore := goleak.IgnoreCurrent()
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
