package seaweedfs

import (
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
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
