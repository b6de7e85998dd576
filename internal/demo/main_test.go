package demo

import (
	"testing"

	"go.uber.org/goleak"
)

func TestMain(m *testing.M) {
	// ants starts two goroutines for its default pool at import.
	goleak.VerifyTestMain(m, goleak.IgnoreCurrent())
}
