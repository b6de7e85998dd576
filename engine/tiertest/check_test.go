package tiertest

import (
	"bytes"
	"context"
	"errors"
	"log/slog"
	"net/http"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvpersist/kvpersist/engine"
	"github.com/kvpersist/kvpersist/engine/remote"
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

// TestCorruptObjectRepairedBySave: A saves a conversation (4 pages, all
// uploaded); page 1's object is then corrupted in the bucket (a flipped
// tensor byte, same size) and page 2's truncated. Verify of the bucket
// reports both. B, holding the same pages locally (saved from the same
// KV), saves the conversation: its uploads find the objects' bytes differ
// from its own, fetch and check them, and replace the two corrupt ones
// with its verified pages, while the good ones are kept untouched
// (create-only: found existing, no bytes sent). The bucket then verifies
// clean and holds B's page bytes.
func TestCorruptObjectRepairedBySave(t *testing.T) {
	prefix := bucketPrefix(t)
	conv := seq(7000, 4*ptoks)
	rootA, rootB := t.TempDir(), t.TempDir()
	a := newEngine(t, rootA, prefix, newRecorder(t), nil)
	save(t, a, conv)
	closeEngine(t, a)
	keys := keysOf(t, conv)
	st := openStore(t, prefix)
	ctx := context.Background()
	names := make([]string, len(keys))
	before := make([]remote.Object, len(keys))
	for i, k := range keys {
		names[i], _ = st.PageName(ns, k.String())
		var err error
		if before[i], err = st.Stat(ctx, names[i]); err != nil {
			t.Fatal(err)
		}
	}
	page1, page2 := readFile(t, pagePath(rootA, keys[1])), readFile(t, pagePath(rootA, keys[2]))
	flipped := bytes.Clone(page1)
	flipped[len(flipped)-100] ^= 0x40
	putObject(t, st, names[1], flipped)
	putObject(t, st, names[2], page2[:len(page2)-4096])
	corrupt := map[int]string{}
	for _, i := range []int{1, 2} {
		o, err := st.Stat(ctx, names[i])
		if err != nil {
			t.Fatal(err)
		}
		corrupt[i] = o.ETag
	}
	rep, err := st.Verify(ctx, ns, remote.VerifyOptions{TempDir: t.TempDir()})
	if err != nil {
		t.Fatal(err)
	}
	var bad []string
	for _, p := range rep.Problems {
		bad = append(bad, p.Name)
	}
	if len(bad) != 2 || !slices.Contains(bad, names[1]) || !slices.Contains(bad, names[2]) {
		t.Fatalf("verify of the bucket: %+v, want pages 1 and 2 reported", rep.Problems)
	}

	rec := newRecorder(t)
	b := newEngine(t, rootB, prefix, rec, nil)
	save(t, b, conv)
	closeEngine(t, b)
	for i, k := range keys {
		o, err := st.Stat(ctx, names[i])
		if err != nil {
			t.Fatal(err)
		}
		got := objects(t, st)[names[i]]
		if want := readFile(t, pagePath(rootB, k)); !bytes.Equal(got, want) {
			t.Fatalf("page %d's object: %d bytes, not B's page (%d bytes)", i, len(got), len(want))
		}
		if bad, ok := corrupt[i]; ok && o.ETag == bad {
			t.Fatalf("page %d's corrupt object (ETag %s) not replaced", i, bad)
		} else if !ok && (o.ETag != before[i].ETag || !o.ModTime.Equal(before[i].ModTime)) {
			t.Fatalf("page %d's good object: ETag %s mtime %v, before %s %v; want it kept", i, o.ETag, o.ModTime, before[i].ETag, before[i].ModTime)
		}
	}
	// The good objects were found stored (no bytes sent), the corrupt
	// ones replaced (created).
	if ops := snapshotOps(rec); ops["upload/existed"] != 2 || ops["upload/ok"] != 2 {
		t.Fatalf("uploads: %v, want 2 existed and 2 ok", ops)
	}
	if rep, err = st.Verify(ctx, ns, remote.VerifyOptions{TempDir: t.TempDir()}); err != nil || len(rep.Problems) != 0 {
		t.Fatalf("verify after B's save: %+v %v", rep, err)
	}
}
