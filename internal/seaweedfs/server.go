package seaweedfs

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/minio/minio-go/v7"
	"github.com/minio/minio-go/v7/pkg/credentials"
)

// StopGrace is how long Stop waits after SIGTERM before SIGKILL (weed mini
// can take far longer than a test should wait to exit after SIGTERM).
const StopGrace = 2 * time.Second

// ReadyTimeout bounds one start: weed mini answers S3 only after its
// master, volume and filer are up, which takes long on a loaded machine.
const ReadyTimeout = 2 * time.Minute

// Server is one running `weed mini`: master, volume, filer and S3 gateway
// in one process, every port bound to 127.0.0.1 only, data in Dir.
type Server struct {
	Bin       string
	Dir       string // data directory (removed by Stop if Start created it)
	Endpoint  string // "http://127.0.0.1:<s3 port>"
	AccessKey string
	SecretKey string
	Bucket    string

	ownDir bool
	ports  map[string]int // flag name -> port

	mu   sync.Mutex
	cmd  *exec.Cmd
	done chan struct{} // closed when cmd has been waited for
	log  *os.File
}

// portFlags are the listening ports of weed mini; each gets an explicit
// free loopback port so that nothing listens on a default port or on
// another interface (and two servers can run side by side).
var portFlags = []string{
	"master.port", "master.port.grpc", "volume.port", "volume.port.grpc",
	"filer.port", "filer.port.grpc", "s3.port", "s3.port.grpc",
	"admin.port", "admin.port.grpc", // the admin server runs even with -admin.ui=false
}

// Start starts weed (bin) on loopback with a fresh data directory under
// os.TempDir (short: the filer and S3 unix sockets live in it), one
// bucket and static credentials, and waits until the bucket answers an
// authenticated request. Stop must be called.
func Start(ctx context.Context, bin string) (*Server, error) {
	dir, err := os.MkdirTemp("", "kvp-weed-")
	if err != nil {
		return nil, err
	}
	s := &Server{Bin: bin, Dir: dir, ownDir: true, AccessKey: "kvpersist-test", SecretKey: fmt.Sprintf("kvpersist-test-secret-%016x", rand.Uint64()), Bucket: "kvpersist-test"}
	var lastErr error
	for attempt := 0; attempt < 3; attempt++ { // a port picked free can be taken before weed binds it
		if err := s.pickPorts(); err != nil {
			os.RemoveAll(dir)
			return nil, err
		}
		if lastErr = s.start(ctx); lastErr == nil {
			return s, nil
		}
		s.kill()
		if ctx.Err() != nil {
			break
		}
	}
	os.RemoveAll(dir)
	return nil, lastErr
}

// pickPorts gives every port flag a loopback port free now, chosen at
// random outside the kernel's ephemeral range
// (/proc/sys/net/ipv4/ip_local_port_range). A port from that range (what
// listening on port 0 returns) can be handed to any outgoing connection
// as its source port once freed, and to another test process's server:
// Restart binds the same ports again after Kill, and a port taken
// meanwhile left a server half up, or a readiness check answered by
// another package's server with the same bucket (seen on a fresh clone:
// connection refused mid-test, PUTs counted by the wrong proxy).
func (s *Server) pickPorts() error {
	s.ports = map[string]int{}
	var ls []net.Listener
	defer func() {
		for _, l := range ls {
			l.Close()
		}
	}()
	lo, hi := portRange()
	for _, f := range portFlags {
		var l net.Listener
		var err error
		for try := 0; try < 200; try++ {
			port := lo + rand.IntN(hi-lo)
			if l, err = net.Listen("tcp", "127.0.0.1:"+strconv.Itoa(port)); err == nil {
				break
			}
		}
		if err != nil {
			return fmt.Errorf("seaweedfs: picking a loopback port in [%d, %d): %w", lo, hi, err)
		}
		ls = append(ls, l)
		s.ports[f] = l.Addr().(*net.TCPAddr).Port
	}
	s.Endpoint = "http://127.0.0.1:" + strconv.Itoa(s.ports["s3.port"])
	return nil
}

// portRange is where pickPorts draws ports: [lo, hi), below the kernel's
// ephemeral range when there is room (10000 up to it), else above it.
func portRange() (lo, hi int) {
	eLo, eHi := 32768, 60999 // Linux's default
	if b, err := os.ReadFile("/proc/sys/net/ipv4/ip_local_port_range"); err == nil {
		if f := strings.Fields(string(b)); len(f) == 2 {
			if a, err1 := strconv.Atoi(f[0]); err1 == nil {
				if z, err2 := strconv.Atoi(f[1]); err2 == nil {
					eLo, eHi = a, z
				}
			}
		}
	}
	if eLo-10000 >= 2000 {
		return 10000, eLo
	}
	if 65535-eHi >= 2000 {
		return eHi + 1, 65536
	}
	return 1024, 65536 // no room outside it: anywhere unprivileged
}

// start launches the process and waits for readiness.
func (s *Server) start(ctx context.Context) error {
	args := []string{"mini",
		"-dir=" + s.Dir, "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
		"-master.telemetry=false", "-webdav=false", "-admin.ui=false",
		"-admin.port.legacy=0", "-s3.port.iceberg=0", "-s3.port.lance=0",
		"-s3.port.https=0", "-s3.iam=false",
		"-filer.localSocket=" + filepath.Join(s.Dir, "filer.sock"),
		"-s3.localSocket=" + filepath.Join(s.Dir, "s3.sock"),
		"-bucket=" + s.Bucket,
	}
	for _, f := range portFlags {
		args = append(args, fmt.Sprintf("-%s=%d", f, s.ports[f]))
	}
	log, err := os.OpenFile(filepath.Join(s.Dir, "weed.log"), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return err
	}
	cmd := exec.Command(s.Bin, args...)
	cmd.Dir = s.Dir
	cmd.Env = append(os.Environ(),
		"AWS_ACCESS_KEY_ID="+s.AccessKey, "AWS_SECRET_ACCESS_KEY="+s.SecretKey, "S3_BUCKET="+s.Bucket)
	cmd.Stdout, cmd.Stderr = log, log
	// Own process group, and SIGKILL if the test process dies first, so a
	// crashed test leaves no server behind.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		log.Close()
		return fmt.Errorf("seaweedfs: starting %s: %w", s.Bin, err)
	}
	done := make(chan struct{})
	s.mu.Lock()
	s.cmd, s.done, s.log = cmd, done, log
	s.mu.Unlock()
	go func() { cmd.Wait(); close(done) }() // owned by s; joined by kill
	if err := s.waitReady(ctx, done); err != nil {
		return fmt.Errorf("%w\n--- weed.log (tail) ---\n%s", err, s.LogTail(4096))
	}
	return nil
}

// waitReady polls until the bucket exists for our credentials: first the
// S3 port must accept connections, then BucketExists must say true.
func (s *Server) waitReady(ctx context.Context, exited <-chan struct{}) error {
	ctx, cancel := context.WithTimeout(ctx, ReadyTimeout)
	defer cancel()
	tr := &http.Transport{DisableKeepAlives: true}
	defer tr.CloseIdleConnections()
	cl, err := minio.New(s.Endpoint[len("http://"):], &minio.Options{
		Creds: credentials.NewStaticV4(s.AccessKey, s.SecretKey, ""), Secure: false,
		Transport: tr, Region: "us-east-1", BucketLookup: minio.BucketLookupPath, MaxRetries: 1,
	})
	if err != nil {
		return err
	}
	var last error
	for {
		rctx, rcancel := context.WithTimeout(ctx, 5*time.Second)
		ok, err := cl.BucketExists(rctx, s.Bucket)
		rcancel()
		if err == nil && ok {
			return nil
		}
		last = err
		select {
		case <-exited:
			return fmt.Errorf("seaweedfs: weed exited before it was ready (last probe: %v)", last)
		case <-ctx.Done():
			return fmt.Errorf("seaweedfs: not ready within %v (last probe: %v, bucket exists: %v)", ReadyTimeout, last, ok)
		case <-time.After(200 * time.Millisecond):
		}
	}
}

// LogTail returns up to n bytes of the end of the server's log.
func (s *Server) LogTail(n int) string {
	b, _ := os.ReadFile(filepath.Join(s.Dir, "weed.log"))
	if len(b) > n {
		b = b[len(b)-n:]
	}
	return string(bytes.TrimSpace(b))
}

// CPUTime returns the CPU time (user + system) the running weed process
// has used since it started, from /proc/<pid>/stat (Linux; fields utime
// and stime in USER_HZ ticks of 10 ms). Benchmarks read it before and
// after a step to see what the server spent on it. Errors: the server is
// not running, or /proc cannot be read or parsed.
func (s *Server) CPUTime() (time.Duration, error) {
	s.mu.Lock()
	cmd := s.cmd
	s.mu.Unlock()
	if cmd == nil || cmd.Process == nil {
		return 0, errors.New("seaweedfs: server not running")
	}
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", cmd.Process.Pid))
	if err != nil {
		return 0, err
	}
	return parseStatCPU(b)
}

// userHZ is the unit of /proc/<pid>/stat's times: 100 ticks per second on
// every Linux architecture (USER_HZ, fixed by the kernel's ABI).
const userHZ = 100

// parseStatCPU returns utime + stime (fields 14 and 15) of a
// /proc/<pid>/stat line. The command name (field 2) is in parentheses and
// may hold spaces, so fields are counted after its last ')'.
func parseStatCPU(b []byte) (time.Duration, error) {
	i := bytes.LastIndexByte(b, ')')
	if i < 0 {
		return 0, fmt.Errorf("seaweedfs: /proc stat without a command name: %q", b)
	}
	f := strings.Fields(string(b[i+1:])) // f[0] is field 3 (state)
	if len(f) < 13 {
		return 0, fmt.Errorf("seaweedfs: /proc stat has %d fields after the name, want at least 13", len(f))
	}
	var ticks int64
	for _, v := range f[11:13] { // fields 14 (utime) and 15 (stime)
		n, err := strconv.ParseInt(v, 10, 64)
		if err != nil || n < 0 {
			return 0, fmt.Errorf("seaweedfs: /proc stat time %q: not a tick count", v)
		}
		ticks += n
	}
	return time.Duration(ticks) * time.Second / userHZ, nil
}

// Port is the port given to weed for flag (e.g. "s3.port").
func (s *Server) Port(flag string) int { return s.ports[flag] }

// Kill stops the server at once (SIGKILL to its process group) and waits
// for it to exit; the data directory is kept, so Restart can resume.
func (s *Server) Kill() { s.kill() }

func (s *Server) kill() { s.signalAndWait(syscall.SIGKILL, 0) }

// signalAndWait sends sig to the process group and waits grace for the
// exit, then SIGKILLs it and waits for the exit.
func (s *Server) signalAndWait(sig syscall.Signal, grace time.Duration) {
	s.mu.Lock()
	cmd, done, log := s.cmd, s.done, s.log
	s.cmd, s.done, s.log = nil, nil, nil
	s.mu.Unlock()
	if cmd == nil {
		return
	}
	syscall.Kill(-cmd.Process.Pid, sig)
	if grace > 0 {
		select {
		case <-done:
		case <-time.After(grace):
			syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL)
			<-done
		}
	} else {
		<-done
	}
	log.Close()
}

// Restart starts the server again on the same ports and data directory
// (after Kill) and waits until it is ready.
func (s *Server) Restart(ctx context.Context) error {
	s.kill()
	return s.start(ctx)
}

// Stop sends SIGTERM, SIGKILL after StopGrace, waits for the exit and
// removes the data directory Start created. Safe to call twice.
func (s *Server) Stop() error {
	s.signalAndWait(syscall.SIGTERM, StopGrace)
	if s.ownDir {
		s.ownDir = false
		return os.RemoveAll(s.Dir)
	}
	return nil
}

// TB is the part of testing.TB the helpers need.
type TB interface {
	Helper()
	Fatalf(format string, args ...any)
	Logf(format string, args ...any)
	Cleanup(func())
}

// StartTB builds weed if needed and starts a server for a test, stopped in
// the test's cleanup whether it passed or not. When weed cannot be built
// or started the test fails with a message saying so: the object-store
// tests never skip silently.
func StartTB(tb TB) *Server {
	tb.Helper()
	s, err := StartForTests(context.Background())
	if err != nil {
		tb.Fatalf("%v", err)
	}
	tb.Cleanup(func() { s.Stop() })
	return s
}

// StartForTests is Ensure then Start, with errors that say what to do.
// Used by TestMain functions that share one server between tests.
func StartForTests(ctx context.Context) (*Server, error) {
	bin, err := Ensure(ctx, os.Stderr)
	if err != nil {
		return nil, fmt.Errorf("the object-store tests need a real SeaweedFS server and it could not be built (run `make weed` to see why): %w", err)
	}
	s, err := Start(ctx, bin)
	if err != nil {
		return nil, fmt.Errorf("the object-store tests need a real SeaweedFS server and it did not start: %w", err)
	}
	return s, nil
}
