package engine_test

import (
	"os"
	"testing"

	"go.uber.org/goleak"
)

// helperEnv, when set, makes the test binary run as a helper process instead
// of running tests: the crash and two-process tests re-execute os.Args[0]
// with helperEnv=<mode> and the helper's own flags (see runHelper).
const helperEnv = "KVPERSIST_TEST_HELPER"

func TestMain(m *testing.M) {
	if mode := os.Getenv(helperEnv); mode != "" {
		os.Exit(runHelper(mode, os.Args[1:]))
	}
	// ants starts two goroutines for its default pool at import; zmq4's
	// PUB socket (Config.Events) never stops its writer goroutine.
	goleak.VerifyTestMain(m, goleak.IgnoreCurrent(),
		goleak.IgnoreAnyFunction("github.com/go-zeromq/zmq4.(*pubMWriter).run"))
}
