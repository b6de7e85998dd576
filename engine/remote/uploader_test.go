package remote_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"maps"
	"net/http"
	"sync"
	"testing"
	"time"

	"github.com/kvpersist/kvpersist/engine/remote"
)

type results struct {
	mu sync.Mutex
	m  map[string]remote.UploadResult
}

func (r *results) add(u remote.UploadResult) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.m == nil {
		r.m = map[string]remote.UploadResult{}
	}
	r.m[u.Name] = u
}

// get returns a copy: workers may still be adding.
func (r *results) get() map[string]remote.UploadResult {
	r.mu.Lock()
	defer r.mu.Unlock()
	return maps.Clone(r.m)
}

func checkObjects(t *testing.T, s *remote.Store, objs map[string][]byte) {
	t.Helper()
	for name, want := range objs {
		var dst memFile
		if _, err := s.Fetch(context.Background(), name, &dst, sha256Verify(want)); err != nil || !bytes.Equal(dst.b, want) {
			t.Fatalf("%s: %v", name, err)
		}
	}
}

func TestUploader(t *testing.T) {
	s := newStore(t, nil)
	var res results
	u, err := remote.NewUploader(s, remote.UploaderConfig{Workers: 3, OnDone: res.add})
	if err != nil {
		t.Fatal(err)
	}
	objs := map[string][]byte{}
	for i := range 20 {
		name := pageName(t, s, "ns", key(fmt.Sprint("up", i)))
		objs[name] = randBytes(uint64(100+i), 1000*i+1)
		if err := u.Enqueue(remote.Upload{Name: name, Size: int64(len(objs[name])), Open: source(objs[name])}); err != nil {
			t.Fatal(err)
		}
	}
	if err := u.Close(context.Background()); err != nil {
		t.Fatal(err)
	}
	if err := u.Enqueue(remote.Upload{Name: "x", Size: 1, Open: source([]byte{1})}); !errors.Is(err, remote.ErrClosed) {
		t.Fatalf("Enqueue after Close: %v, want ErrClosed", err)
	}
	st := u.Stats()
	if st.Created != 20 || st.Failed != 0 || st.Queued != 0 || st.InFlight != 0 {
		t.Fatalf("stats %+v", st)
	}
	var total int64
	for name, r := range res.get() {
		if !r.Created || r.Err != nil || r.Bytes != int64(len(objs[name])) {
			t.Errorf("%s: %+v", name, r)
		}
		total += r.Bytes
	}
	if st.BytesUploaded != total || len(res.get()) != 20 {
		t.Fatalf("BytesUploaded %d, results %d bytes in %d", st.BytesUploaded, total, len(res.get()))
	}
	checkObjects(t, s, objs)
}

// TestUploaderBounds: Enqueue never blocks: beyond QueueLen it fails with
// ErrQueueFull; a name already queued is not queued twice; a source that
// cannot be opened fails that upload only.
func TestUploaderBounds(t *testing.T) {
	s := newStore(t, nil)
	var res results
	u, err := remote.NewUploader(s, remote.UploaderConfig{Workers: 1, QueueLen: 1, OnDone: res.add})
	if err != nil {
		t.Fatal(err)
	}
	opened, release := make(chan struct{}), make(chan struct{})
	first := pageName(t, s, "ns", key("first"))
	data := randBytes(7, 5000)
	blocking := func() (remote.ReadAtCloser, error) {
		close(opened)
		<-release
		return source(data)()
	}
	if err := u.Enqueue(remote.Upload{Name: first, Size: int64(len(data)), Open: blocking}); err != nil {
		t.Fatal(err)
	}
	<-opened // the only worker is busy with the first upload
	second := pageName(t, s, "ns", key("second"))
	gone := errors.New("local file removed")
	if err := u.Enqueue(remote.Upload{Name: second, Size: 1, Open: func() (remote.ReadAtCloser, error) { return nil, gone }}); err != nil {
		t.Fatal(err)
	}
	if err := u.Enqueue(remote.Upload{Name: second, Size: 1, Open: source([]byte{1})}); err != nil {
		t.Fatalf("a name already queued: %v, want accepted (not queued twice)", err)
	}
	third := pageName(t, s, "ns", key("third"))
	if err := u.Enqueue(remote.Upload{Name: third, Size: 1, Open: source([]byte{1})}); !errors.Is(err, remote.ErrQueueFull) {
		t.Fatalf("Enqueue beyond QueueLen: %v, want ErrQueueFull", err)
	}
	if err := u.Enqueue(remote.Upload{Name: third, Size: -1, Open: source(nil)}); !errors.Is(err, remote.ErrConfig) {
		t.Fatalf("negative size: %v", err)
	}
	// Reads go on while every upload worker is stuck.
	if ex, err := s.Exists(context.Background(), []string{first, third}); err != nil || ex[0] || ex[1] {
		t.Fatalf("Exists while the uploader is busy = %v, %v", ex, err)
	}
	close(release)
	if err := u.Close(context.Background()); err != nil {
		t.Fatal(err)
	}
	r := res.get()
	if !r[first].Created || !errors.Is(r[second].Err, gone) || len(r) != 2 {
		t.Fatalf("results %+v", r)
	}
	if st := u.Stats(); st.Created != 1 || st.Failed != 1 {
		t.Fatalf("stats %+v", st)
	}
	if _, err := s.Stat(context.Background(), third); !errors.Is(err, remote.ErrNotFound) {
		t.Fatalf("the refused upload exists: %v", err)
	}
	checkObjects(t, s, map[string][]byte{first: data})
}

// TestUploaderServerKilled kills the real server while uploads run: they
// retry with backoff and all finish after the restart (bit-exact, none
// failed); an uploader closed while the server is down abandons its
// uploads within Close's context and says so; a fetch while it is down
// fails with a named error.
func TestUploaderServerKilled(t *testing.T) {
	s := newStore(t, func(c *remote.Config) { c.MaxRetries = 1 })
	var res results
	done := make(chan struct{}, 100)
	u, err := remote.NewUploader(s, remote.UploaderConfig{Workers: 2, BackoffMin: 50 * time.Millisecond, BackoffMax: time.Second,
		OnDone: func(r remote.UploadResult) { res.add(r); done <- struct{}{} }})
	if err != nil {
		t.Fatal(err)
	}
	defer u.Close(context.Background())
	objs := map[string][]byte{}
	for i := range 24 {
		name := pageName(t, s, "ns", key(fmt.Sprint("kill", i)))
		objs[name] = randBytes(uint64(200+i), 512<<10+i)
		if err := u.Enqueue(remote.Upload{Name: name, Size: int64(len(objs[name])), Open: source(objs[name])}); err != nil {
			t.Fatal(err)
		}
	}
	for range 4 {
		<-done
	}
	var fetched string // an object uploaded before the kill
	for name, r := range res.get() {
		if r.Err == nil {
			fetched = name
		}
	}
	srv.Kill()
	restarted := false
	defer func() {
		if !restarted { // leave a server for the other tests
			if err := srv.Restart(context.Background()); err != nil {
				t.Error(err)
			}
		}
	}()

	// While the server is down: an uploader closed with a short context
	// abandons its uploads, reports each, and stops its goroutines.
	var res2 results
	u2, err := remote.NewUploader(s, remote.UploaderConfig{Workers: 2, OnDone: res2.add})
	if err != nil {
		t.Fatal(err)
	}
	for i := range 3 {
		name := pageName(t, s, "ns", key(fmt.Sprint("abandon", i)))
		if err := u2.Enqueue(remote.Upload{Name: name, Size: 10, Open: source(make([]byte, 10))}); err != nil {
			t.Fatal(err)
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), 500*time.Millisecond)
	err = u2.Close(ctx)
	cancel()
	if !errors.Is(err, remote.ErrAbandoned) || !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Close with the server down: %v, want ErrAbandoned and the deadline", err)
	}
	if st := u2.Stats(); st.Abandoned != 3 || st.Created != 0 {
		t.Fatalf("abandoning uploader stats %+v", st)
	}
	for name, r := range res2.get() {
		if !errors.Is(r.Err, remote.ErrAbandoned) {
			t.Fatalf("%s: %+v", name, r)
		}
	}

	// A fetch while the server is down fails, naming the request; it
	// never returns bytes as if they were the object's.
	var oe *remote.OpError
	if n, err := s.Fetch(context.Background(), fetched, &memFile{}, sha256Verify(objs[fetched])); !errors.As(err, &oe) || oe.Name != fetched || n != 0 {
		t.Fatalf("Fetch with the server down = %d, %v; want an *OpError naming %s", n, err, fetched)
	}

	if err := srv.Restart(context.Background()); err != nil {
		t.Fatal(err)
	}
	restarted = true
	if err := u.Close(context.Background()); err != nil {
		t.Fatal(err)
	}
	st := u.Stats()
	if st.Created+st.Existed != 24 || st.Failed != 0 || st.Retries == 0 {
		t.Fatalf("after the restart: stats %+v (want 24 done, 0 failed, some retries)", st)
	}
	for name, r := range res.get() {
		if r.Err != nil {
			t.Errorf("%s: %v", name, r.Err)
		}
	}
	checkObjects(t, s, objs)
}

// TestUploaderStatFirstAndWait: with StatFirst an object already stored
// is reported existing (its Existing filled in) and no body is sent (no
// PUT request at all); an upload whose Wait fails ends with that error and
// creates nothing; one whose Wait blocks is abandoned when Close's context
// ends (ErrAbandoned), its object never created.
func TestUploaderStatFirstAndWait(t *testing.T) {
	frt := newFaultRT(http.DefaultTransport.(*http.Transport).Clone())
	s := newStore(t, func(c *remote.Config) { c.Transport = frt })
	var res results
	u, err := remote.NewUploader(s, remote.UploaderConfig{Workers: 2, StatFirst: true, OnDone: res.add})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	present := pageName(t, s, "ns", key("present"))
	body := randBytes(7, 5000)
	if _, err := s.Put(ctx, present, bytes.NewReader(body), int64(len(body))); err != nil {
		t.Fatal(err)
	}
	puts := frt.count("put")
	failing := pageName(t, s, "ns", key("wait-fails"))
	blocked := pageName(t, s, "ns", key("wait-blocks"))
	errWait := errors.New("a page of the manifest failed")
	release := make(chan struct{})
	for _, up := range []remote.Upload{
		{Name: present, Size: int64(len(body)), Open: source(body)},
		{Name: failing, Size: 10, Open: source(make([]byte, 10)), Wait: func(context.Context) error { return errWait }},
		{Name: blocked, Size: 10, Open: source(make([]byte, 10)), Wait: func(ctx context.Context) error {
			close(release)
			<-ctx.Done()
			return ctx.Err()
		}},
	} {
		if err := u.Enqueue(up); err != nil {
			t.Fatal(err)
		}
	}
	<-release // the blocked upload is waiting
	// Close can finish nothing more: its context ends the wait.
	cctx, cancel := context.WithTimeout(ctx, 200*time.Millisecond)
	defer cancel()
	if err := u.Close(cctx); !errors.Is(err, remote.ErrAbandoned) {
		t.Fatalf("Close: %v, want ErrAbandoned", err)
	}
	got := res.get()
	if r := got[present]; r.Err != nil || r.Created || r.Bytes != 0 || r.Existing.Size != int64(len(body)) {
		t.Fatalf("present: %+v, want existing, nothing sent", r)
	}
	if frt.count("put") != puts {
		t.Fatalf("%d PUTs sent for an object already stored", frt.count("put")-puts)
	}
	if r := got[failing]; !errors.Is(r.Err, errWait) || r.Attempts != 0 {
		t.Fatalf("failing Wait: %+v", r)
	}
	if r := got[blocked]; !errors.Is(r.Err, remote.ErrAbandoned) {
		t.Fatalf("blocked Wait: %+v, want ErrAbandoned", r)
	}
	if ok, err := s.Exists(ctx, []string{failing, blocked}); err != nil || ok[0] || ok[1] {
		t.Fatalf("objects of uploads that never attempted exist: %v %v", ok, err)
	}
}

// TestUploaderVerify: Upload.Verify runs on the very source the PUT then
// streams (the ReaderAt it is given is the one Open returned for that
// attempt). A source that passes is stored byte-identical; one that fails
// is never sent: the upload ends after one attempt with ErrSourceCorrupt
// (no retry) and the store has no object under its name.
func TestUploaderVerify(t *testing.T) {
	for _, statFirst := range []bool{false, true} {
		t.Run(fmt.Sprint("StatFirst_", statFirst), func(t *testing.T) {
			s := newStore(t, nil)
			var res results
			u, err := remote.NewUploader(s, remote.UploaderConfig{Workers: 2, StatFirst: statFirst, OnDone: res.add})
			if err != nil {
				t.Fatal(err)
			}
			good, bad := randBytes(7, 5000), randBytes(8, 5000)
			goodName := pageName(t, s, "ns", key(fmt.Sprint("verify-good-", statFirst)))
			badName := pageName(t, s, "ns", key(fmt.Sprint("verify-bad-", statFirst)))
			var mu sync.Mutex
			opened := map[string]remote.ReadAtCloser{}
			sameSource := map[string]bool{}
			open := func(name string, b []byte) func() (remote.ReadAtCloser, error) {
				return func() (remote.ReadAtCloser, error) {
					src := &bytesSource{bytes.NewReader(b)}
					mu.Lock()
					opened[name] = src
					mu.Unlock()
					return src, nil
				}
			}
			verify := func(name string, want []byte) remote.VerifyFunc {
				check := sha256Verify(want)
				return func(r io.ReaderAt, size int64) error {
					mu.Lock()
					sameSource[name] = r == io.ReaderAt(opened[name])
					mu.Unlock()
					return check(r, size)
				}
			}
			// The bad source holds other bytes than its check expects (a
			// file that rotted after its hashes were written).
			for _, up := range []remote.Upload{
				{Name: goodName, Size: int64(len(good)), Open: open(goodName, good), Verify: verify(goodName, good)},
				{Name: badName, Size: int64(len(bad)), Open: open(badName, bad), Verify: verify(badName, good)},
			} {
				if err := u.Enqueue(up); err != nil {
					t.Fatal(err)
				}
			}
			if err := u.Close(context.Background()); err != nil {
				t.Fatal(err)
			}
			r := res.get()
			if g := r[goodName]; !g.Created || g.Err != nil || g.Bytes != int64(len(good)) {
				t.Fatalf("good source: %+v", g)
			}
			if b := r[badName]; !errors.Is(b.Err, remote.ErrSourceCorrupt) || b.Attempts != 1 || b.Created {
				t.Fatalf("corrupt source: %+v, want ErrSourceCorrupt after 1 attempt", b)
			}
			if !sameSource[goodName] || !sameSource[badName] {
				t.Fatalf("Verify was not given the source Open returned: %v", sameSource)
			}
			checkObjects(t, s, map[string][]byte{goodName: good})
			if _, err := s.Stat(context.Background(), badName); !errors.Is(err, remote.ErrNotFound) {
				t.Fatalf("stat of the corrupt source's object: %v, want ErrNotFound", err)
			}
			if st := u.Stats(); st.Created != 1 || st.Failed != 1 || st.Retries != 0 {
				t.Fatalf("stats %+v", st)
			}
		})
	}
}
