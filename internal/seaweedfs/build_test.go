package seaweedfs

import (
	"bytes"
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// TestEnsureUsesCacheAndWaitsForBuilder: a cached binary is returned
// without building; while another process holds the build lock, Ensure
// waits, then finds the binary that process built instead of building a
// second one.
func TestEnsureUsesCacheAndWaitsForBuilder(t *testing.T) {
	root := t.TempDir()
	t.Setenv("KVPERSIST_SEAWEEDFS_CACHE", root)
	dir, err := CacheDir()
	if err != nil || dir != filepath.Join(root, Version) {
		t.Fatalf("CacheDir = %q, %v", dir, err)
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	lock, err := os.OpenFile(filepath.Join(dir, ".lock"), os.O_CREATE|os.O_RDWR, 0o644)
	if err != nil {
		t.Fatal(err)
	}
	defer lock.Close()
	// Another open file description of the lock file: flock conflicts with
	// Ensure's own open, as another process's would.
	if err := unix.Flock(int(lock.Fd()), unix.LOCK_EX); err != nil {
		t.Fatal(err)
	}
	var log bytes.Buffer
	type result struct {
		bin string
		err error
	}
	done := make(chan result, 1)
	go func() {
		bin, err := Ensure(context.Background(), &syncWriter{w: &log})
		done <- result{bin, err}
	}()
	// Let Ensure reach the lock, then "finish the other build".
	deadline := time.Now().Add(30 * time.Second)
	for !strings.Contains(syncRead(&log), "another process is building") {
		if time.Now().After(deadline) {
			t.Fatalf("Ensure did not wait for the lock; log: %s", syncRead(&log))
		}
		time.Sleep(10 * time.Millisecond)
	}
	bin := filepath.Join(dir, "weed")
	if err := os.WriteFile(bin, []byte("#!/bin/sh\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	unix.Flock(int(lock.Fd()), unix.LOCK_UN)
	r := <-done
	if r.err != nil || r.bin != bin {
		t.Fatalf("Ensure = %q, %v; want %q", r.bin, r.err, bin)
	}
	if strings.Contains(syncRead(&log), "seaweedfs: building weed") {
		t.Fatalf("Ensure built although the binary appeared: %s", syncRead(&log))
	}
	// Cached: returned at once, lock not even taken.
	unix.Flock(int(lock.Fd()), unix.LOCK_EX)
	if got, err := Ensure(context.Background(), nil); err != nil || got != bin {
		t.Fatalf("cached Ensure = %q, %v", got, err)
	}
}

// TestEnsureCancelledWhileWaiting: a context that ends during the wait for
// the lock ends Ensure with an error wrapping ErrBuild.
func TestEnsureCancelledWhileWaiting(t *testing.T) {
	t.Setenv("KVPERSIST_SEAWEEDFS_CACHE", t.TempDir())
	dir, _ := CacheDir()
	os.MkdirAll(dir, 0o755)
	lock, err := os.OpenFile(filepath.Join(dir, ".lock"), os.O_CREATE|os.O_RDWR, 0o644)
	if err != nil {
		t.Fatal(err)
	}
	defer lock.Close()
	unix.Flock(int(lock.Fd()), unix.LOCK_EX)
	ctx, cancel := context.WithTimeout(context.Background(), 700*time.Millisecond)
	defer cancel()
	if _, err := Ensure(ctx, nil); err == nil || !strings.Contains(err.Error(), "waiting") {
		t.Fatalf("Ensure under a held lock with a short context: %v", err)
	} else if !errors.Is(err, ErrBuild) {
		t.Fatalf("%v does not wrap ErrBuild", err)
	}
}
