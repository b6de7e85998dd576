package remote_test

import (
	"bytes"
	"context"
	"errors"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"

	"github.com/kvpersist/kvpersist/engine/remote"
)

func TestConfigRules(t *testing.T) {
	base := remote.Config{Bucket: "b", AccessKey: "k", SecretKey: "s"}
	cases := []struct {
		endpoint, prefix string
		ok               bool
	}{
		{"s3.example.com", "", true},                 // TLS by default
		{"https://s3.example.com:9000", "a/b", true}, // explicit TLS
		{"http://127.0.0.1:8333", "", true},          // plain HTTP on loopback
		{"http://[::1]:8333", "", true},              // IPv6 loopback
		{"http://localhost:8333", "x.y-z_1", true},   // named loopback
		{"http://10.0.0.1:8333", "", false},          // plain HTTP off loopback
		{"http://s3.example.com", "", false},         // plain HTTP off loopback
		{"ftp://127.0.0.1", "", false},               // scheme
		{"https://s3.example.com/path", "", false},   // a path
		{"", "", false},                              // empty
		{"s3.example.com", "/lead", false},           // prefix shape
		{"s3.example.com", "a//b", false},            // empty element
		{"s3.example.com", "a/../b", false},          // ..
		{"s3.example.com", "a b", false},             // bad characters
	}
	for _, c := range cases {
		cfg := base
		cfg.Endpoint, cfg.Prefix = c.endpoint, c.prefix
		s, err := remote.New(cfg)
		if c.ok != (err == nil) {
			t.Errorf("New(endpoint %q, prefix %q): err %v, want ok=%v", c.endpoint, c.prefix, err, c.ok)
		}
		if err != nil && !errors.Is(err, remote.ErrConfig) {
			t.Errorf("New(%q): %v does not wrap ErrConfig", c.endpoint, err)
		}
		if s != nil {
			s.Close()
		}
	}
	t.Setenv(remote.EnvAccessKey, "")
	t.Setenv(remote.EnvSecretKey, "")
	noFiles(t)
	if _, err := remote.New(remote.Config{Endpoint: "s3.example.com", Bucket: "b"}); !errors.Is(err, remote.ErrConfig) || !strings.Contains(err.Error(), "credentials") {
		t.Errorf("no credentials: %v", err)
	}
	t.Setenv(remote.EnvAccessKey, "envkey")
	t.Setenv(remote.EnvSecretKey, "envsecret")
	s, err := remote.New(remote.Config{Endpoint: "s3.example.com", Bucket: "b"})
	if err != nil {
		t.Fatalf("credentials from the environment: %v", err)
	}
	s.Close()
}

// TestPlainHTTPServerNeedsHTTPURL: SeaweedFS listens in plain HTTP; given
// as host:port (which means HTTPS) every request fails with ErrConfig
// saying to write http://host:port, not with a TLS record error; given as
// http://host:port it works.
func TestPlainHTTPServerNeedsHTTPURL(t *testing.T) {
	hostport := strings.TrimPrefix(srv.Endpoint, "http://")
	s := newStore(t, func(c *remote.Config) { c.Endpoint = hostport; c.MaxRetries = 1 })
	_, err := s.Stat(context.Background(), "t/none")
	if !errors.Is(err, remote.ErrConfig) || !strings.Contains(err.Error(), "http://"+hostport) {
		t.Fatalf("a plain-HTTP server given as %s: %v, want ErrConfig naming http://%s", hostport, err, hostport)
	}
	s = newStore(t, nil) // srv.Endpoint: the http:// URL
	if _, err := s.Stat(context.Background(), "t/none"); !errors.Is(err, remote.ErrNotFound) {
		t.Fatalf("the same server as %s: %v, want ErrNotFound", srv.Endpoint, err)
	}
}

// noFiles points the AWS shared files at paths that do not exist, so the
// machine's own ~/.aws is never read by a test.
func noFiles(t *testing.T) {
	dir := t.TempDir()
	t.Setenv("AWS_SHARED_CREDENTIALS_FILE", filepath.Join(dir, "credentials"))
	t.Setenv("AWS_CONFIG_FILE", filepath.Join(dir, "config"))
	t.Setenv("AWS_PROFILE", "")
}

// TestCredentialsFile: with no keys in the config or the environment, the
// store signs with the profile of the AWS shared credentials file
// (AWS_PROFILE selects it), and the real server accepts the requests.
func TestCredentialsFile(t *testing.T) {
	t.Setenv(remote.EnvAccessKey, "")
	t.Setenv(remote.EnvSecretKey, "")
	noFiles(t)
	file := os.Getenv("AWS_SHARED_CREDENTIALS_FILE")
	ini := "[default]\naws_access_key_id = wrong\naws_secret_access_key = wrong\n\n[kvp]\naws_access_key_id = " + srv.AccessKey + "\naws_secret_access_key = " + srv.SecretKey + "\n"
	if err := os.WriteFile(file, []byte(ini), 0o600); err != nil {
		t.Fatal(err)
	}
	t.Setenv("AWS_PROFILE", "kvp")
	s := newStore(t, func(c *remote.Config) { c.AccessKey, c.SecretKey = "", "" })
	name := pageName(t, s, "ns", key("cred"))
	if _, err := s.Put(context.Background(), name, strings.NewReader("x"), 1); err != nil {
		t.Fatalf("Put signed with the profile's keys: %v", err)
	}
	t.Setenv("AWS_PROFILE", "")
	s = newStore(t, func(c *remote.Config) { c.AccessKey, c.SecretKey = "", "" })
	if _, err := s.Stat(context.Background(), name); err == nil || errors.Is(err, remote.ErrNotFound) {
		t.Fatalf("Stat signed with the default profile's wrong keys: %v, want refused", err)
	}
}

func TestNames(t *testing.T) {
	s, err := remote.New(remote.Config{Endpoint: "s3.example.com", Bucket: "b", Prefix: "fleet/a", AccessKey: "k", SecretKey: "s"})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	k := key("x")
	n, err := s.PageName("conv", k)
	if err != nil || n != "fleet/a/conv/pages/"+k[:2]+"/"+k {
		t.Fatalf("PageName = %q, %v", n, err)
	}
	if m, err := s.ManifestName("conv", "turn-7"); err != nil || m != "fleet/a/conv/turn-7" {
		t.Fatalf("ManifestName = %q, %v", m, err)
	}
	for _, bad := range [][2]string{
		{"conv", strings.ToUpper(k)}, {"conv", k[:63]}, {"conv", k + "0"}, {"../x", k}, {".hidden", k}, {"", k},
	} {
		if _, err := s.PageName(bad[0], bad[1]); !errors.Is(err, remote.ErrBadName) {
			t.Errorf("PageName(%q, %q): %v, want ErrBadName", bad[0], bad[1], err)
		}
	}
	for _, bad := range []string{"pages", "a/b", ".x", ""} {
		if _, err := s.ManifestName("conv", bad); !errors.Is(err, remote.ErrBadName) {
			t.Errorf("ManifestName(%q): %v, want ErrBadName", bad, err)
		}
	}
}

func TestRoundTrip(t *testing.T) {
	s := newStore(t, nil)
	ctx := context.Background()
	data := randBytes(1, 3<<20+5)
	name := pageName(t, s, "ns", key("rt"))
	pr, err := s.Put(ctx, name, bytes.NewReader(data), int64(len(data)))
	if err != nil || !pr.Created || pr.Bytes != int64(len(data)) {
		t.Fatalf("Put = %+v, %v", pr, err)
	}
	var dst memFile
	n, err := s.Fetch(ctx, name, &dst, sha256Verify(data))
	if err != nil || n != int64(len(data)) || !bytes.Equal(dst.b, data) {
		t.Fatalf("Fetch = %d, %v; bytes equal: %v", n, err, bytes.Equal(dst.b, data))
	}
	o, err := s.Stat(ctx, name)
	if err != nil || o.Size != int64(len(data)) || o.ModTime.IsZero() {
		t.Fatalf("Stat = %+v, %v", o, err)
	}
	empty := pageName(t, s, "ns", key("empty"))
	if _, err := s.Put(ctx, empty, bytes.NewReader(nil), 0); err != nil {
		t.Fatal(err)
	}
	var e memFile
	if n, err := s.Fetch(ctx, empty, &e, nil); err != nil || n != 0 {
		t.Fatalf("Fetch(empty) = %d, %v", n, err)
	}
	if _, err := s.Fetch(ctx, pageName(t, s, "ns", key("absent")), &dst, nil); !errors.Is(err, remote.ErrNotFound) {
		t.Fatalf("Fetch(absent): %v, want ErrNotFound", err)
	}
	var oe *remote.OpError
	if _, err := s.Stat(ctx, pageName(t, s, "ns", key("absent"))); !errors.As(err, &oe) || oe.Op != "stat" || !errors.Is(err, remote.ErrNotFound) {
		t.Fatalf("Stat(absent): %v", err)
	}
}

// TestCreateOnly: a second upload under an existing name never overwrites
// it (SeaweedFS honours If-None-Match: * on PUT at the pinned version).
func TestCreateOnly(t *testing.T) {
	s := newStore(t, nil)
	ctx := context.Background()
	a, b := randBytes(2, 1<<20), randBytes(3, 1<<20)
	name := pageName(t, s, "ns", key("co"))
	if pr, err := s.Put(ctx, name, bytes.NewReader(a), int64(len(a))); err != nil || !pr.Created {
		t.Fatalf("first Put = %+v, %v", pr, err)
	}
	pr, err := s.Put(ctx, name, bytes.NewReader(b), int64(len(b)))
	if err != nil || pr.Created || pr.Bytes != 0 {
		t.Fatalf("second Put (same size, other bytes) = %+v, %v; want Created=false", pr, err)
	}
	var dst memFile
	if _, err := s.Fetch(ctx, name, &dst, nil); err != nil || !bytes.Equal(dst.b, a) {
		t.Fatalf("after the second Put the object changed (err %v)", err)
	}
	_, err = s.Put(ctx, name, bytes.NewReader(b[:100]), 100)
	var oe *remote.OpError
	if !errors.Is(err, remote.ErrConflict) || !errors.As(err, &oe) || oe.Op != "put" || oe.Name != name {
		t.Fatalf("Put of another size: %v, want ErrConflict naming put %s", err, name)
	}
	dst = memFile{}
	if _, err := s.Fetch(ctx, name, &dst, nil); err != nil || !bytes.Equal(dst.b, a) {
		t.Fatalf("after the conflicting Put the object changed (err %v)", err)
	}

	// Racing creators: exactly one wins and the object holds its bytes.
	race := pageName(t, s, "ns", key("race"))
	const n = 8
	var (
		wg      sync.WaitGroup
		created [n]bool
		errs    [n]error
	)
	for i := range n {
		wg.Go(func() {
			d := randBytes(uint64(50+i), 256<<10)
			pr, err := s.Put(ctx, race, bytes.NewReader(d), int64(len(d)))
			created[i], errs[i] = pr.Created, err
		})
	}
	wg.Wait()
	winner := -1
	for i := range n {
		if errs[i] != nil {
			t.Fatalf("racing Put %d: %v", i, errs[i])
		}
		if created[i] {
			if winner >= 0 {
				t.Fatalf("racing Puts %d and %d both created the object", winner, i)
			}
			winner = i
		}
	}
	if winner < 0 {
		t.Fatal("no racing Put created the object")
	}
	dst = memFile{}
	if _, err := s.Fetch(ctx, race, &dst, sha256Verify(randBytes(uint64(50+winner), 256<<10))); err != nil {
		t.Fatalf("the raced object is not the winner's bytes: %v", err)
	}
}

// TestExistsBatch looks up the 128 page keys of a 32,768-token prompt
// (256 tokens per page) with one HEAD each and no other request.
func TestExistsBatch(t *testing.T) {
	rt := newFaultRT(http.DefaultTransport.(*http.Transport).Clone())
	s := newStore(t, func(c *remote.Config) { c.Transport = rt })
	ctx := context.Background()
	names := make([]string, 128)
	want := make([]bool, 128)
	for i := range names {
		names[i] = pageName(t, s, "ns", key(string(rune('a'+i%26))+strings.Repeat("x", i)))
		if i%3 == 0 || i < 10 {
			want[i] = true
			if _, err := s.Put(ctx, names[i], bytes.NewReader([]byte{byte(i)}), 1); err != nil {
				t.Fatal(err)
			}
		}
	}
	heads := rt.count("stat")
	got, err := s.Exists(ctx, names)
	if err != nil {
		t.Fatal(err)
	}
	for i := range got {
		if got[i] != want[i] {
			t.Errorf("Exists[%d] = %v, want %v", i, got[i], want[i])
		}
	}
	if n := rt.count("stat") - heads; n != 128 {
		t.Errorf("Exists sent %d HEAD requests for 128 keys, want 128", n)
	}
	if rt.count("list") != 0 || rt.count("get") != 0 {
		t.Errorf("Exists sent lists or gets")
	}
}

// TestFetchLargeRanged fetches an object of 13 MiB + 17 bytes in ranges
// of 1 MiB, 4 in flight: bit-exact, and one GET per range.
func TestFetchLargeRanged(t *testing.T) {
	rt := newFaultRT(http.DefaultTransport.(*http.Transport).Clone())
	s := newStore(t, func(c *remote.Config) {
		c.Transport, c.FetchChunkBytes, c.Concurrency = rt, 1<<20, 4
	})
	ctx := context.Background()
	data := randBytes(4, 13<<20+17)
	name := pageName(t, s, "ns", key("large"))
	if _, err := s.Put(ctx, name, bytes.NewReader(data), int64(len(data))); err != nil {
		t.Fatal(err)
	}
	gets := rt.count("get")
	var dst memFile
	n, err := s.Fetch(ctx, name, &dst, sha256Verify(data))
	if err != nil || n != int64(len(data)) || !bytes.Equal(dst.b, data) {
		t.Fatalf("Fetch = %d, %v, equal %v", n, err, bytes.Equal(dst.b, data))
	}
	if g := rt.count("get") - gets; g != 14 {
		t.Errorf("Fetch sent %d GETs, want 14 ranges", g)
	}
	var tooBig memFile
	small := newStore(t, func(c *remote.Config) { c.MaxObjectBytes = 1 << 20 })
	if _, err := small.Fetch(ctx, name, &tooBig, nil); !errors.Is(err, remote.ErrTooLarge) || len(tooBig.b) != 0 {
		t.Fatalf("Fetch over MaxObjectBytes: %v (wrote %d bytes), want ErrTooLarge and nothing written", err, len(tooBig.b))
	}
}

// TestFetchCorrupt: a body corrupted in flight fails verification and a
// failing verify is ErrCorrupt; the object itself stays intact.
func TestFetchCorrupt(t *testing.T) {
	rt := newFaultRT(http.DefaultTransport.(*http.Transport).Clone())
	s := newStore(t, func(c *remote.Config) { c.Transport, c.MaxRetries = rt, 1 })
	ctx := context.Background()
	data := randBytes(5, 100_000)
	name := pageName(t, s, "ns", key("corrupt"))
	if _, err := s.Put(ctx, name, bytes.NewReader(data), int64(len(data))); err != nil {
		t.Fatal(err)
	}
	rt.mu.Lock()
	rt.flip["get"] = 1
	rt.mu.Unlock()
	var dst memFile
	if _, err := s.Fetch(ctx, name, &dst, sha256Verify(data)); !errors.Is(err, remote.ErrCorrupt) {
		t.Fatalf("Fetch of a flipped body: %v, want ErrCorrupt", err)
	}
	dst = memFile{}
	if _, err := s.Fetch(ctx, name, &dst, sha256Verify(data)); err != nil || !bytes.Equal(dst.b, data) {
		t.Fatalf("clean Fetch after: %v", err)
	}
}
