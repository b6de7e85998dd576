package seaweedfs

import (
	"context"
	"fmt"
	"os"
	"testing"

	"go.uber.org/goleak"
)

// RunTests is the TestMain of a package whose tests share one SeaweedFS
// server (one start costs ~15 s): it builds the server if needed, starts
// it, hands it to set, runs the tests, stops the server, then checks that
// no goroutine was left behind (goleak, ignoring those running before the
// call: ants starts a default pool at import). It returns the exit code
// for os.Exit. When the server cannot be built or started the package
// FAILS with a message saying so; it never skips.
func RunTests(m *testing.M, set func(*Server)) int {
	ignore := goleak.IgnoreCurrent()
	s, err := StartForTests(context.Background())
	if err != nil {
		fmt.Fprintln(os.Stderr, "FAIL:", err)
		return 1
	}
	set(s)
	code := m.Run()
	if err := s.Stop(); err != nil {
		fmt.Fprintln(os.Stderr, "stopping SeaweedFS:", err)
		code = 1
	}
	if code == 0 {
		if err := goleak.Find(ignore); err != nil {
			fmt.Fprintln(os.Stderr, "goleak:", err)
			code = 1
		}
	}
	return code
}
