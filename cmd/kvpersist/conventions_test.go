package main

import (
	"bufio"
	"context"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
)

// A usage error says what is wrong on its first line, then prints the
// command's usage, on stderr, and exits 2; nothing goes to stdout.
func TestUsageErrorFirstLine(t *testing.T) {
	root := t.TempDir()
	for _, tc := range []struct {
		args  []string
		first string
	}{
		{[]string{"synth", "--root", root, "--name", "x", "--tokens", "300x"},
			`kvpersist synth: invalid argument "300x" for "--tokens" flag: strconv.ParseInt: parsing "300x": invalid syntax`},
		{[]string{"synth", "--root", root, "--name", "x", "extra"}, `kvpersist synth: unknown command "extra" for "kvpersist synth"`},
		{[]string{"synth", "--root", root}, `kvpersist synth: required flag(s) "name" not set`},
		{[]string{"ls", root, root}, "kvpersist ls: accepts 1 arg(s), received 2"},
		{[]string{"verify"}, "kvpersist verify: accepts 1 arg(s), received 0"},
		{[]string{"gc", "--block-grace", "-1s", root}, "kvpersist gc: --block-grace must not be negative"},
		{[]string{"gc", "--temp-grace", "-1s", root}, `kvpersist gc: invalid argument "-1s" for "--temp-grace" flag: must not be negative ("none" keeps no temp file back)`},
		{[]string{"verify", "--temp-grace", "0", root}, `kvpersist verify: invalid argument "0" for "--temp-grace" flag: 0 is not a grace: say "none" to keep no temp file back (the default is 10m0s)`},
		{[]string{"demo", "snapshots", "--tokens", "2048,4096x"}, `kvpersist: --tokens: "4096x" is not a positive integer`},
		{[]string{"bogus"}, `kvpersist: unknown command "bogus" for "kvpersist"`},
		{[]string{}, "kvpersist: no command given"},
	} {
		code, out, errs := cliRun(t, tc.args...)
		first, rest, _ := strings.Cut(errs, "\n")
		if code != exitUsage || out != "" || first != tc.first {
			t.Errorf("%q: exit %d, stdout %q, first line of stderr:\n%s\nwant:\n%s", tc.args, code, out, first, tc.first)
		}
		if strings.HasPrefix(tc.first, "kvpersist ") && !strings.HasPrefix(tc.first, "kvpersist: ") && !strings.Contains(rest, "Usage:\n") {
			t.Errorf("%q: no usage after the reason:\n%s", tc.args, errs)
		}
	}
	// Strict parsing wrote nothing.
	if ents, err := os.ReadDir(root); err != nil || len(ents) != 0 {
		t.Errorf("refused commands touched the root: %v %v", ents, err)
	}
}

// Top-level help lists the commands (completion included) on stdout.
func TestHelpOnStdout(t *testing.T) {
	for _, args := range [][]string{{"help"}, {"--help"}} {
		code, out, errs := cliRun(t, args...)
		if code != exitOK || errs != "" {
			t.Fatalf("%q: exit %d, stderr %q", args, code, errs)
		}
		for _, name := range []string{"inspect", "ls", "verify", "gc", "du", "migrate", "synth", "demo", "completion"} {
			if !strings.Contains(out, "\n  "+name+" ") {
				t.Errorf("%q does not list %s:\n%s", args, name, out)
			}
		}
	}
	code, out, errs := cliRun(t, "completion", "bash")
	if code != exitOK || errs != "" || !strings.Contains(out, "__start_kvpersist") {
		t.Errorf("completion bash: exit %d, stderr %q, stdout starts %.200q", code, errs, out)
	}
}

// A failed job is reported once: the command's error line, and the engine
// logs no warning of its own for it (the CLI does not filter its log).
func TestFailedJobReportedOnce(t *testing.T) {
	root := t.TempDir()
	code, out, errs := cliRun(t, "synth", "--root", root, "--name", "x", "--no-sync", "--block-bytes", "1000")
	lines := strings.Split(strings.TrimSuffix(errs, "\n"), "\n")
	if code != exitUsage || out != "" || len(lines) != 1 ||
		!strings.HasPrefix(lines[0], "kvpersist: synth: ") || !strings.Contains(lines[0], "invalid block size: 1000 bytes") {
		t.Fatalf("exit %d, stdout %q, stderr (want one line):\n%s", code, out, errs)
	}
}

// synth refuses, before allocating, a cache larger than the memory
// available, and says how much it needs.
func TestSynthRefusesMoreMemoryThanAvailable(t *testing.T) {
	// tiny: 2 layers x (K, V) x 2 KV heads x head_dim 16 x 2 bytes = 256
	// bytes per token; 99,999,999 tokens pad to a capacity of 100,000,000
	// (a multiple of 256 tokens), plus 4 bytes of token id per token.
	const need = 256*100_000_000 + 4*99_999_999
	avail, err := memAvailable()
	if err != nil {
		t.Skipf("no MemAvailable: %v", err)
	}
	if avail >= need {
		t.Skipf("this machine has %d bytes available, more than the %d the test asks for", avail, need)
	}
	root := t.TempDir()
	code, _, errs := cliRun(t, "synth", "--root", root, "--name", "x", "--tokens", "99999999")
	if code != exitUsage || !strings.Contains(errs, "needs 24.2 GiB (25999999996 bytes) of memory") {
		t.Fatalf("exit %d, stderr:\n%s", code, errs)
	}
	if ents, _ := os.ReadDir(root); len(ents) != 0 {
		t.Errorf("the refused synth wrote %v", ents)
	}
}

func TestMemAvailableIsMeminfo(t *testing.T) {
	b, err := os.ReadFile("/proc/meminfo")
	if err != nil {
		t.Skip(err)
	}
	n, err := memAvailable()
	if err != nil || n <= 0 || n%1024 != 0 || !strings.Contains(string(b), "MemAvailable:") {
		t.Fatalf("memAvailable() = %d, %v", n, err)
	}
}

// buildCLI builds the binary into a temp dir.
func buildCLI(t *testing.T) string {
	t.Helper()
	bin := filepath.Join(t.TempDir(), "kvpersist")
	if out, err := exec.Command("go", "build", "-o", bin, ".").CombinedOutput(); err != nil {
		t.Fatalf("go build: %v\n%s", err, out)
	}
	return bin
}

// The binary's exit statuses: 0 clean, 1 problems, 2 usage, and 130 when
// SIGINT arrives while gc waits (saying so) for a namespace lock another
// process holds.
func TestExitStatusesOfTheBinary(t *testing.T) {
	bin := buildCLI(t)
	root := synthStore(t, testStore[:1])
	status := func(args ...string) int {
		err := exec.Command(bin, args...).Run()
		var ee *exec.ExitError
		if errors.As(err, &ee) {
			return ee.ExitCode()
		}
		if err != nil {
			t.Fatal(err)
		}
		return 0
	}
	if got := status("ls", root); got != exitOK {
		t.Errorf("ls on a clean store: exit %d", got)
	}
	if got := status("ls", root, "extra"); got != exitUsage {
		t.Errorf("ls with two roots: exit %d", got)
	}

	ns := namespaceOf(t, root, "a")
	unlock, err := ns.Lock(context.Background(), false) // shared: gc needs it exclusively
	if err != nil {
		t.Fatal(err)
	}
	defer unlock()
	cmd := exec.Command(bin, "gc", root)
	stderr, err := cmd.StderrPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	sc := bufio.NewScanner(stderr)
	waiting := false
	for sc.Scan() {
		if strings.Contains(sc.Text(), "waiting for the namespace lock") && strings.Contains(sc.Text(), filepath.Join(root, "a")) {
			waiting = true
			break
		}
	}
	if !waiting {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
		t.Fatal("gc did not say it waits for the lock")
	}
	if err := cmd.Process.Signal(syscall.SIGINT); err != nil {
		t.Fatal(err)
	}
	for sc.Scan() { // drain, so Wait does not race the pipe
	}
	err = cmd.Wait()
	var ee *exec.ExitError
	if !errors.As(err, &ee) || ee.ExitCode() != exitInterrupted {
		t.Fatalf("gc interrupted while waiting: %v, want exit %d", err, exitInterrupted)
	}
	unlock()

	// A truncated manifest is unreadable: ls exits 1.
	man := filepath.Join(root, "a", "t1")
	b, err := os.ReadFile(man)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(man, b[:len(b)/2], 0o644); err != nil {
		t.Fatal(err)
	}
	if got := status("ls", root); got != exitProblems {
		t.Errorf("ls with an unreadable manifest: exit %d", got)
	}
}
