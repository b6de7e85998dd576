// Command weed-ensure builds the pinned SeaweedFS server binary if it is not
// cached yet and prints its path. `make test` runs it before `go test`, so the
// first build's minutes are not counted against a test timeout.
package main

import (
	"context"
	"fmt"
	"os"
	"os/signal"
	"syscall"

	"github.com/kvpersist/kvpersist/internal/seaweedfs"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	bin, err := seaweedfs.Ensure(ctx, os.Stderr)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	fmt.Println(bin)
}
