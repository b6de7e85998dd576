package remote_test

import (
	"context"
	"errors"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvpersist/kvpersist/engine/remote"
)

// TestCheckNamesTheCause: Check passes with the server's credentials and
// bucket, and fails with a distinct sentinel naming the bucket for a
// wrong secret key or an unknown access key (ErrCredentials) and for a
// bucket that does not exist (ErrNoBucket).
func TestCheckNamesTheCause(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if err := newStore(t, nil).Check(ctx); err != nil {
		t.Fatalf("Check with the server's credentials: %v", err)
	}
	for _, tc := range []struct {
		name   string
		mod    func(*remote.Config)
		want   error
		bucket string
	}{
		{"wrong secret", func(c *remote.Config) { c.SecretKey += "x" }, remote.ErrCredentials, srv.Bucket},
		{"unknown access key", func(c *remote.Config) { c.AccessKey = "nobody" }, remote.ErrCredentials, srv.Bucket},
		{"missing bucket", func(c *remote.Config) { c.Bucket = "no-such-bucket" }, remote.ErrNoBucket, "no-such-bucket"},
	} {
		err := newStore(t, tc.mod).Check(ctx)
		if !errors.Is(err, tc.want) || !strings.Contains(err.Error(), tc.bucket) {
			t.Errorf("%s: %v, want an error wrapping %v naming bucket %s", tc.name, err, tc.want, tc.bucket)
		}
	}
}

// TestUploaderReportsFailedAttemptsAndCloseNamesTheCause: with a wrong
// secret key every attempt of an upload fails; each is reported to
// OnRetry with an error wrapping ErrCredentials, and Close, whose context
// ends with the upload pending, returns an error wrapping ErrAbandoned,
// the context's error and ErrCredentials.
func TestUploaderReportsFailedAttemptsAndCloseNamesTheCause(t *testing.T) {
	s := newStore(t, func(c *remote.Config) { c.SecretKey += "x" })
	var mu sync.Mutex
	var errs []error
	enough := make(chan struct{})
	u, err := remote.NewUploader(s, remote.UploaderConfig{Workers: 1, BackoffMin: time.Millisecond, BackoffMax: 5 * time.Millisecond,
		OnRetry: func(name string, attempts int, err error) {
			mu.Lock()
			defer mu.Unlock()
			errs = append(errs, err)
			if len(errs) == 3 {
				close(enough)
			}
		}})
	if err != nil {
		t.Fatal(err)
	}
	b := randBytes(1, 4096)
	if err := u.Enqueue(remote.Upload{Name: pageName(t, s, "ns", key("a")), Size: int64(len(b)), Open: source(b)}); err != nil {
		t.Fatal(err)
	}
	select {
	case <-enough:
	case <-time.After(time.Minute):
		t.Fatal("fewer than 3 failed attempts reported within a minute")
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	err = u.Close(ctx)
	if !errors.Is(err, remote.ErrAbandoned) || !errors.Is(err, context.Canceled) || !errors.Is(err, remote.ErrCredentials) {
		t.Fatalf("Close: %v, want ErrAbandoned, the context's error and ErrCredentials", err)
	}
	mu.Lock()
	defer mu.Unlock()
	for i, e := range errs {
		if !errors.Is(e, remote.ErrCredentials) {
			t.Fatalf("attempt %d: %v, want ErrCredentials", i+1, e)
		}
	}
}
