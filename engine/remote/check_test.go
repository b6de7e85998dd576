package remote_test

import (
	"bytes"
	"context"
	"errors"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvpersist/kvpersist/engine/layout"
	"github.com/kvpersist/kvpersist/engine/remote"
	"github.com/kvpersist/kvpersist/internal/testutil"
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

// TestUploaderRepairsOnlyCorruptObjects: an upload with Stored
// (CheckStoredPage) over a stored object: the same bytes are kept
// (existing, nothing sent), and so are other bytes of the same page (a
// header spaced otherwise: another writer's encoding, which verifies),
// after a check; a flipped byte, another page's bytes under the
// name and a truncated object do not verify as the page, so each is
// replaced (Replaced, the object then holds the page). RepairPage refuses
// a local page that does not verify (ErrSourceCorrupt), replaces a
// corrupt object and keeps a good one.
func TestUploaderRepairsOnlyCorruptObjects(t *testing.T) {
	ctx := context.Background()
	key, page, other := storedPages(t)
	flipped := bytes.Clone(page)
	flipped[len(flipped)-10] ^= 1
	for _, tc := range []struct {
		name     string
		stored   []byte
		replaced bool
	}{{"same", page, false}, {"other-writer", respaced(t, page), false}, {"flipped", flipped, true},
		{"other-page", other, true}, {"truncated", page[:len(page)-100], true}} {
		s := newStore(t, nil)
		name := pageName(t, s, "ns", key)
		if _, err := s.Put(ctx, name, bytes.NewReader(tc.stored), int64(len(tc.stored))); err != nil {
			t.Fatal(err)
		}
		done := make(chan remote.UploadResult, 1)
		u, err := remote.NewUploader(s, remote.UploaderConfig{Workers: 1, StatFirst: true, OnDone: func(r remote.UploadResult) { done <- r }})
		if err != nil {
			t.Fatal(err)
		}
		err = u.Enqueue(remote.Upload{Name: name, Size: int64(len(page)), Open: source(page), Verify: remote.VerifyPage(key, nil),
			Stored: func(ctx context.Context, o remote.Object) error { return s.CheckStoredPage(ctx, o, key) }})
		if err != nil {
			t.Fatal(err)
		}
		r := <-done
		if err := u.Close(ctx); err != nil {
			t.Fatal(err)
		}
		if r.Err != nil || r.Replaced != tc.replaced || r.Created != tc.replaced {
			t.Errorf("%s: %+v, want replaced %v", tc.name, r, tc.replaced)
		}
		want := page
		if !tc.replaced {
			want = tc.stored // a good object is kept as it is
		}
		if got := testutil.ObjectBytes(t, s, name); !bytes.Equal(got, want) {
			t.Errorf("%s: the object holds %d bytes, want %d", tc.name, len(got), len(want))
		}
	}

	s := newStore(t, nil)
	name := pageName(t, s, "ns", key)
	if _, err := s.Put(ctx, name, bytes.NewReader(flipped), int64(len(flipped))); err != nil {
		t.Fatal(err)
	}
	if _, err := s.RepairPage(ctx, "ns", key, bytes.NewReader(flipped), int64(len(flipped))); !errors.Is(err, remote.ErrSourceCorrupt) {
		t.Fatalf("RepairPage from a corrupt local page: %v, want ErrSourceCorrupt", err)
	}
	if ok, err := s.RepairPage(ctx, "ns", key, bytes.NewReader(page), int64(len(page))); err != nil || !ok {
		t.Fatalf("RepairPage of a corrupt object: %v %v", ok, err)
	}
	if ok, err := s.RepairPage(ctx, "ns", key, bytes.NewReader(page), int64(len(page))); err != nil || ok {
		t.Fatalf("RepairPage of a good object: %v %v, want it kept", ok, err)
	}
	if got := testutil.ObjectBytes(t, s, name); !bytes.Equal(got, page) {
		t.Fatalf("after RepairPage the object holds %d bytes, not the page", len(got))
	}
}

// respaced is page with one more space in its header JSON (the same page,
// encoded otherwise: its header hash recomputed, its data start kept).
func respaced(t *testing.T, page []byte) []byte {
	t.Helper()
	p, err := layout.ParsePrefix(page[:layout.PrefixLen])
	if err != nil {
		t.Fatal(err)
	}
	js := page[layout.PrefixLen : layout.PrefixLen+int(p.HeaderLen)]
	at := bytes.Index(js, []byte(`"tokens":[`)) + len(`"tokens":[`)
	js2 := append(append(append([]byte{}, js[:at]...), ' '), js[at:]...)
	if layout.PrefixLen+len(js2) > int(p.DataStart) {
		t.Fatal("no room for one more header byte before the data")
	}
	out := bytes.Clone(page)
	copy(out, layout.EncodePrefix(js2, p.DataStart))
	copy(out[layout.PrefixLen:], js2)
	if _, err := remote.Decode(bytes.NewReader(out), int64(len(out)), "respaced"); err != nil || bytes.Equal(out, page) {
		t.Fatalf("respaced page: %v", err)
	}
	return out
}
