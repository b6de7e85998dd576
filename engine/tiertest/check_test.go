package tiertest

import (
	"bytes"
	"context"
	"errors"
	"log/slog"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvpersist/kvpersist/engine"
)

// TestNewRefusesBadCredentialsAndBucket: New asks the store at once: a
// wrong secret key or an unknown access key fails it with
// ErrRemoteCredentials, a bucket that does not exist with
// ErrRemoteNoBucket (both also ErrConfig), each naming the bucket, instead
// of an engine whose uploads retry forever.
func TestNewRefusesBadCredentialsAndBucket(t *testing.T) {
	for _, tc := range []struct {
		name   string
		mod    func(*engine.RemoteConfig)
		want   error
		bucket string
	}{
		{"wrong secret", func(c *engine.RemoteConfig) { c.SecretKey += "x" }, engine.ErrRemoteCredentials, srv.Bucket},
		{"unknown access key", func(c *engine.RemoteConfig) { c.AccessKey = "nobody" }, engine.ErrRemoteCredentials, srv.Bucket},
		{"missing bucket", func(c *engine.RemoteConfig) { c.Bucket = "no-such-bucket" }, engine.ErrRemoteNoBucket, "no-such-bucket"},
	} {
		sc := storeConfig(bucketPrefix(t))
		tc.mod(&sc)
		e, err := engine.New(engine.Config{Root: t.TempDir(), NoSync: true, Logger: slog.New(slog.DiscardHandler), Remote: &engine.RemoteTier{Store: sc}})
		if err == nil {
			e.Close(context.Background())
		}
		if !errors.Is(err, tc.want) || !errors.Is(err, engine.ErrConfig) || !strings.Contains(err.Error(), tc.bucket) {
			t.Errorf("%s: New: %v, want an error wrapping %v and ErrConfig naming bucket %s", tc.name, err, tc.want, tc.bucket)
		}
	}
}

// failPuts fails every PUT (an upload) with err before it reaches the
// server; other requests pass.
type failPuts struct {
	next http.RoundTripper
	err  error
}

func (f *failPuts) RoundTrip(r *http.Request) (*http.Response, error) {
	if r.Method == http.MethodPut {
		if r.Body != nil {
			r.Body.Close()
		}
		return nil, f.err
	}
	return f.next.RoundTrip(r)
}

// syncBuffer is a bytes.Buffer safe for the engine's logging goroutines.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// TestFailingUploadsLoggedCountedAndNamedByClose: when every upload
// attempt fails (here every PUT, with an injected error), each failed
// attempt counts in kvpersist_remote_upload_failed_attempts_total, the
// log says which upload failed and why, once per minute at most, and
// Close, whose context ends with the uploads pending, returns an error
// naming that cause besides ErrUploadsAbandoned.
func TestFailingUploadsLoggedCountedAndNamedByClose(t *testing.T) {
	cause := errors.New("injected: the store resets every upload")
	rec := newRecorder(t)
	var logs syncBuffer
	sc := storeConfig(bucketPrefix(t))
	sc.Transport = &failPuts{next: http.DefaultTransport, err: cause}
	sc.MaxRetries = 1
	e, err := engine.New(engine.Config{Root: t.TempDir(), NoSync: true, Metrics: rec,
		Logger: slog.New(slog.NewTextHandler(&logs, &slog.HandlerOptions{Level: slog.LevelWarn})),
		Remote: &engine.RemoteTier{Store: sc, UploadBackoffMin: time.Millisecond, UploadBackoffMax: 5 * time.Millisecond}})
	if err != nil {
		t.Fatal(err)
	}
	save(t, e, seq(1, 3*ptoks))
	deadline := time.Now().Add(time.Minute)
	for rec.Snapshot().Remote.UploadFailedAttempts < 10 {
		if time.Now().After(deadline) {
			t.Fatalf("failed attempts counted: %d, want at least 10", rec.Snapshot().Remote.UploadFailedAttempts)
		}
		time.Sleep(5 * time.Millisecond)
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	err = e.Close(ctx)
	if !errors.Is(err, engine.ErrUploadsAbandoned) || !errors.Is(err, cause) {
		t.Fatalf("Close: %v, want ErrUploadsAbandoned and the injected cause", err)
	}
	if n := strings.Count(logs.String(), "upload to the object store failed; retrying"); n != 1 || !strings.Contains(logs.String(), cause.Error()) {
		t.Fatalf("log: %d lines about failed attempts (want 1, naming the cause):\n%s", n, logs.String())
	}
}
