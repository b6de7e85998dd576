package seaweedfs

import (
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"
)

// TestServerLoopbackOnly starts the real server and checks, from
// /proc/net/tcp{,6}, that every socket it listens on is bound to
// 127.0.0.1, and that Stop removes its data directory.
func TestServerLoopbackOnly(t *testing.T) {
	s := StartTB(t)
	pid := s.cmd.Process.Pid
	inodes := socketInodes(t, pid)
	listening := 0
	for _, f := range []string{"/proc/net/tcp", "/proc/net/tcp6"} {
		b, err := os.ReadFile(f)
		if err != nil {
			continue
		}
		for _, line := range strings.Split(string(b), "\n")[1:] {
			fs := strings.Fields(line)
			if len(fs) < 10 || fs[3] != "0A" || !inodes[fs[9]] { // 0A = LISTEN
				continue
			}
			listening++
			addr := fs[1][:strings.IndexByte(fs[1], ':')]
			if addr != "0100007F" { // 127.0.0.1, little-endian hex
				t.Errorf("weed listens on %s (%s), not 127.0.0.1", fs[1], f)
			}
		}
	}
	if listening < len(portFlags) {
		t.Fatalf("found %d listening sockets of weed, want at least %d", listening, len(portFlags))
	}
	dir := s.Dir
	if err := s.Stop(); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(dir); !os.IsNotExist(err) {
		t.Fatalf("data dir after Stop: %v", err)
	}
}

// socketInodes returns the inodes of the sockets process pid has open.
func socketInodes(t *testing.T, pid int) map[string]bool {
	fds, err := os.ReadDir(filepath.Join("/proc", strconv.Itoa(pid), "fd"))
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]bool{}
	for _, fd := range fds {
		l, err := os.Readlink(filepath.Join("/proc", strconv.Itoa(pid), "fd", fd.Name()))
		if err == nil && strings.HasPrefix(l, "socket:[") {
			out[strings.TrimSuffix(strings.TrimPrefix(l, "socket:["), "]")] = true
		}
	}
	return out
}

// TestParseStatCPU: utime + stime of a /proc/<pid>/stat line, counted
// after the command name even when the name holds spaces and parentheses;
// a short or garbled line is an error.
func TestParseStatCPU(t *testing.T) {
	// Fields 14 and 15 are 250 and 1,234 ticks: 14.84 s.
	line := "4242 (we (ed) x) S 1 4242 4242 0 -1 4194560 100 0 0 0 250 1234 7 9 20 0 12 0 555 1000 200\n"
	got, err := parseStatCPU([]byte(line))
	if want := 14840 * time.Millisecond; err != nil || got != want {
		t.Fatalf("parseStatCPU = %v, %v; want %v", got, err, want)
	}
	for _, bad := range []string{"", "4242 weed S 1", "4242 (weed) S 1 2 3", "4242 (weed) S 1 4242 4242 0 -1 4194560 100 0 0 0 x 1234 7"} {
		if _, err := parseStatCPU([]byte(bad)); err == nil {
			t.Errorf("parseStatCPU(%q) = nil error", bad)
		}
	}
	// The real file of this process parses.
	b, err := os.ReadFile("/proc/self/stat")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := parseStatCPU(b); err != nil {
		t.Fatalf("/proc/self/stat: %v", err)
	}
}
