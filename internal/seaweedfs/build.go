// Package seaweedfs builds and runs a real SeaweedFS server (weed) for the
// tests of kvpersist's object-store tier. It is test infrastructure: nothing
// in the engine imports it.
//
// The binary is built from the Go module proxy at a pinned version (Version)
// and cached outside any clone, at
// ${XDG_CACHE_HOME:-$HOME/.cache}/kvpersist/seaweedfs/<Version>/weed, so it
// is built once per machine (about 5 minutes of CPU on 2 cores) and reused.
// Only Go is needed: `go install` refuses SeaweedFS (its go.mod has replace
// directives), so the module source is downloaded with `go mod download`
// (outside this module, so the project's go.mod is never touched), copied to
// a writable directory and built there with `go build`.
package seaweedfs

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"time"

	"golang.org/x/sys/unix"
)

// Version is the pinned SeaweedFS module version the tests run against.
const Version = "v0.0.0-20261109003541-7506e5f91cd6"

// Module is SeaweedFS's Go module path.
const Module = "github.com/seaweedfs/seaweedfs"

// ErrBuild wraps every failure to build or find the weed binary, so a test
// can say plainly that the server is unavailable rather than skip.
var ErrBuild = errors.New("seaweedfs: cannot build the weed binary")

// CacheDir is the directory holding the cached binary of Version:
// $KVPERSIST_SEAWEEDFS_CACHE if set, else
// ${XDG_CACHE_HOME:-$HOME/.cache}/kvpersist/seaweedfs/<Version>.
func CacheDir() (string, error) {
	if d := os.Getenv("KVPERSIST_SEAWEEDFS_CACHE"); d != "" {
		return filepath.Join(d, Version), nil
	}
	base, err := os.UserCacheDir()
	if err != nil {
		return "", fmt.Errorf("%w: no cache directory: %v", ErrBuild, err)
	}
	return filepath.Join(base, "kvpersist", "seaweedfs", Version), nil
}

// Ensure returns the path of the weed binary of Version, building it first
// if it is missing. Concurrent callers (several test processes, make and a
// test) serialise on an flock of <CacheDir>/.lock: one builds, the others
// wait and then find the binary. The binary appears atomically (built under
// a temp name, then renamed), so a crashed build leaves no half binary.
// logw receives the build's progress and output (nil: discarded). Errors
// wrap ErrBuild.
func Ensure(ctx context.Context, logw io.Writer) (string, error) {
	if logw == nil {
		logw = io.Discard
	}
	dir, err := CacheDir()
	if err != nil {
		return "", err
	}
	bin := filepath.Join(dir, "weed")
	if isExecutable(bin) {
		return bin, nil
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return "", fmt.Errorf("%w: %v", ErrBuild, err)
	}
	lock, err := os.OpenFile(filepath.Join(dir, ".lock"), os.O_CREATE|os.O_RDWR, 0o644)
	if err != nil {
		return "", fmt.Errorf("%w: %v", ErrBuild, err)
	}
	defer lock.Close()
	if err := flock(ctx, lock, logw); err != nil {
		return "", fmt.Errorf("%w: waiting for another build: %v", ErrBuild, err)
	}
	defer unix.Flock(int(lock.Fd()), unix.LOCK_UN)
	if isExecutable(bin) { // built by whoever held the lock before us
		return bin, nil
	}
	start := time.Now()
	fmt.Fprintf(logw, "seaweedfs: building weed %s into %s (first time only, several minutes)\n", Version, dir)
	if err := build(ctx, dir, bin, logw); err != nil {
		return "", fmt.Errorf("%w: %v", ErrBuild, err)
	}
	fmt.Fprintf(logw, "seaweedfs: built %s in %s\n", bin, time.Since(start).Round(time.Second))
	return bin, nil
}

func isExecutable(p string) bool {
	st, err := os.Stat(p)
	return err == nil && st.Mode().IsRegular() && st.Mode().Perm()&0o111 != 0
}

// flock takes lock exclusively, polling so that ctx can end the wait.
func flock(ctx context.Context, f *os.File, logw io.Writer) error {
	said := false
	for {
		err := unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB)
		if err == nil {
			return nil
		}
		if !errors.Is(err, unix.EWOULDBLOCK) && !errors.Is(err, unix.EINTR) {
			return err
		}
		if !said {
			fmt.Fprintln(logw, "seaweedfs: another process is building weed; waiting")
			said = true
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(500 * time.Millisecond):
		}
	}
}

func build(ctx context.Context, dir, bin string, logw io.Writer) error {
	work, err := os.MkdirTemp(dir, "build-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(work) // the copy under it is writable (os.CopyFS modes)
	// go mod download outside any module: GOFLAGS=-mod=mod so that a
	// -mod=vendor or readonly setting of the caller does not interfere, and
	// a working directory with no go.mod so no project's go.mod is touched.
	env := append(os.Environ(), "GOFLAGS=-mod=mod -buildvcs=false", "GO111MODULE=on", "GOWORK=off")
	var out bytes.Buffer
	cmd := exec.CommandContext(ctx, "go", "mod", "download", "-json", Module+"@"+Version)
	cmd.Dir = work
	cmd.Env = env
	cmd.Stdout = &out
	cmd.Stderr = logw
	if err := cmd.Run(); err != nil {
		return fmt.Errorf("go mod download %s@%s: %v (%s)", Module, Version, err, bytes.TrimSpace(out.Bytes()))
	}
	var info struct{ Dir, Error string }
	if err := json.Unmarshal(out.Bytes(), &info); err != nil {
		return fmt.Errorf("go mod download: decoding its output: %v", err)
	}
	if info.Error != "" || info.Dir == "" {
		return fmt.Errorf("go mod download %s@%s: %s", Module, Version, info.Error)
	}
	src := filepath.Join(work, "src")
	// The module cache is read-only; os.CopyFS makes writable copies (files
	// 0o666, directories 0o777, before umask). A module zip holds no links.
	if err := os.CopyFS(src, os.DirFS(info.Dir)); err != nil {
		return fmt.Errorf("copying the module source: %v", err)
	}
	tmp := bin + ".tmp"
	// -s -w: no symbol tables; the binary is only run, never debugged,
	// and linking the 230 MB binary is a large part of the build.
	cmd = exec.CommandContext(ctx, "go", "build", "-ldflags=-s -w", "-o", tmp, "./weed")
	cmd.Dir = src
	cmd.Env = env
	cmd.Stdout = logw
	cmd.Stderr = logw
	if err := cmd.Run(); err != nil {
		os.Remove(tmp)
		return fmt.Errorf("go build ./weed: %v", err)
	}
	return os.Rename(tmp, bin)
}
