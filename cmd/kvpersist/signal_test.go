package main

import (
	"bufio"
	"context"
	"errors"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/kvpersist/kvpersist/engine/store"
	"golang.org/x/sys/unix"
)

// namespaceOf opens namespace name of the store at root.
func namespaceOf(t *testing.T, root, name string) *store.Namespace {
	t.Helper()
	st, err := store.Open(root, store.Options{})
	if err != nil {
		t.Fatal(err)
	}
	ns, err := st.Namespace(name)
	if err != nil {
		t.Fatal(err)
	}
	return ns
}

// signalled starts the binary with args, waits until a line of its stderr
// contains waitFor, sends sig and returns its exit status and stderr. The
// child is killed if it has not exited within limit of the signal.
func signalled(t *testing.T, bin string, sig syscall.Signal, limit time.Duration, waitFor string, args ...string) (int, string) {
	t.Helper()
	cmd := exec.Command(bin, args...)
	stderr, err := cmd.StderrPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	var lines []string
	sc := bufio.NewScanner(stderr)
	for !strings.Contains(strings.Join(lines, "\n"), waitFor) && sc.Scan() {
		lines = append(lines, sc.Text())
	}
	if err := cmd.Process.Signal(sig); err != nil {
		t.Fatal(err)
	}
	killer := time.AfterFunc(limit, func() { _ = cmd.Process.Kill() })
	defer killer.Stop()
	for sc.Scan() { // drain, so Wait does not race the pipe
		lines = append(lines, sc.Text())
	}
	err = cmd.Wait()
	var ee *exec.ExitError
	if err != nil && !errors.As(err, &ee) {
		t.Fatal(err)
	}
	return cmd.ProcessState.ExitCode(), strings.Join(lines, "\n")
}

// Every command that waits exits 130 on SIGINT and on SIGTERM: while it
// waits for a namespace lock another process holds (a cancellable wait),
// and while it is stuck where no context reaches (an open(2) of a FIFO
// that stands where the lock file belongs), within windDown.
func TestSignalExits130(t *testing.T) {
	bin := buildCLI(t)
	root := synthStore(t, testStore[:1])
	ns := namespaceOf(t, root, "a")
	unlock, err := ns.Lock(context.Background(), true) // every command waits
	if err != nil {
		t.Fatal(err)
	}
	const waiting = "waiting for the namespace lock"
	for i, args := range [][]string{
		{"verify", root},
		{"gc", root},
		{"synth", "--root", root, "--ns", "a", "--name", "new", "--model", "tiny", "--tokens", "10", "--no-sync"},
		{"demo", "snapshots", "--root", root, "--ns", "a", "--reuse-ns", "--model", "tiny", "--tokens", "300", "--no-sync"},
	} {
		for _, sig := range []syscall.Signal{syscall.SIGTERM, syscall.SIGINT} {
			start := time.Now()
			code, errs := signalled(t, bin, sig, time.Minute, waiting, args...)
			if code != exitInterrupted || !strings.Contains(errs, waiting) {
				t.Errorf("%d %q, %v while waiting for the lock: exit %d, want %d; stderr:\n%s", i, args, sig, code, exitInterrupted, errs)
			}
			if el := time.Since(start); el > windDown {
				t.Errorf("%q, %v: took %v; a cancellable wait should stop well within %v", args, sig, el, windDown)
			}
		}
	}
	unlock()

	// A FIFO at the lock file: the open does not block (it is refused as
	// not a regular file), so verify ends at once with an error naming it
	// instead of waiting for a signal.
	lock := filepath.Join(root, "a", ".lock")
	if err := unix.Unlink(lock); err != nil {
		t.Fatal(err)
	}
	if err := unix.Mkfifo(lock, 0o600); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = unix.Unlink(lock) })
	cmd := exec.Command(bin, "verify", root)
	var errb strings.Builder
	cmd.Stderr = &errb
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	killer := time.AfterFunc(time.Minute, func() { _ = cmd.Process.Kill() })
	_ = cmd.Wait()
	killer.Stop()
	if code := cmd.ProcessState.ExitCode(); code != exitUsage || !strings.Contains(errb.String(), "not a regular file") {
		t.Errorf("verify with a FIFO at the lock: exit %d, want %d naming the FIFO; stderr:\n%s", code, exitUsage, errb.String())
	}
}
