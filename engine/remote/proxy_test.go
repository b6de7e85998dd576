package remote_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net/http"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/kvpersist/kvpersist/engine/remote"
	"github.com/kvpersist/kvpersist/internal/faultproxy"
	"github.com/kvpersist/kvpersist/internal/testutil"
)

// viaProxy returns two stores on the same prefix: direct talks to the
// server, faulty goes through a fault proxy in front of it (minio-go's own
// retries off, so every injected fault reaches the tier's code).
func viaProxy(t *testing.T, mod func(*remote.Config)) (direct, faulty *remote.Store, p *faultproxy.Proxy) {
	t.Helper()
	p = faultproxy.Start(t, srv.Endpoint)
	var prefix string
	direct = newStore(t, func(c *remote.Config) { prefix = c.Prefix })
	faulty = newStore(t, func(c *remote.Config) {
		c.Prefix, c.Endpoint, c.MaxRetries = prefix, p.Endpoint, 1
		if mod != nil {
			mod(c)
		}
	})
	return direct, faulty, p
}

// forObject matches the requests of one object (its path ends with name).
func forObject(name string) func(*http.Request) bool {
	return func(r *http.Request) bool { return strings.HasSuffix(r.URL.Path, "/"+name) }
}

// TestProxyUploadsLandOnce: uploads through a network that loses PUT
// responses after the server created the object, refuses PUTs, answers
// 503 and delays the rest all land exactly once and bit-exact: the retry
// of a PUT whose response was lost finds the object (create-only, 412) and
// reports it existing instead of writing it again, and every injected
// failure costs exactly one retry.
func TestProxyUploadsLandOnce(t *testing.T) {
	direct, s, p := viaProxy(t, nil)
	objs := map[string][]byte{}
	var names []string
	for i := range 12 {
		name := pageName(t, s, "ns", key(fmt.Sprint("land", i)))
		names = append(names, name)
		objs[name] = randBytes(uint64(300+i), 64<<10*(i+1)+i)
	}
	var rules []faultproxy.Rule
	for _, n := range names[0:3] { // created, response lost
		rules = append(rules, faultproxy.Rule{Kinds: faultproxy.Put, Fault: faultproxy.Reset, Count: 1, Match: forObject(n)})
	}
	for _, n := range names[3:6] { // refused twice
		rules = append(rules, faultproxy.Rule{Kinds: faultproxy.Put, Fault: faultproxy.Refuse, Count: 2, Match: forObject(n)})
	}
	for _, n := range names[6:8] { // 503 once
		rules = append(rules, faultproxy.Rule{Kinds: faultproxy.Put, Fault: faultproxy.Status, Count: 1, Match: forObject(n)})
	}
	rules = append(rules, faultproxy.Rule{Kinds: faultproxy.Put | faultproxy.Head, Fault: faultproxy.Delay, Delay: 5 * time.Millisecond})
	p.Set(rules...)

	var res results
	u, err := remote.NewUploader(s, remote.UploaderConfig{Workers: 3, BackoffMin: 10 * time.Millisecond, BackoffMax: 50 * time.Millisecond, OnDone: res.add})
	if err != nil {
		t.Fatal(err)
	}
	for _, n := range names {
		if err := u.Enqueue(remote.Upload{Name: n, Size: int64(len(objs[n])), Open: source(objs[n])}); err != nil {
			t.Fatal(err)
		}
	}
	if err := u.Close(context.Background()); err != nil {
		t.Fatal(err)
	}
	st := u.Stats()
	if st.Created != 9 || st.Existed != 3 || st.Failed != 0 || st.Retries != 3+6+2 {
		t.Fatalf("stats %+v; want 9 created, 3 found existing (their first PUT's response lost), 11 retries", st)
	}
	r := res.get()
	for i, n := range names {
		want := i >= 3 // the lost-response ones were created by a PUT the uploader never heard back from
		if r[n].Err != nil || r[n].Created != want {
			t.Errorf("%s: %+v, want Created=%v", n, r[n], want)
		}
	}
	if got := p.Seen(faultproxy.Put); got != 12+11 {
		t.Fatalf("%d PUTs reached the proxy, want 23 (12 + one per injected fault)", got)
	}
	got := testutil.ObjectNames(t, direct, "ns")
	slices.Sort(names)
	if !slices.Equal(got, names) {
		t.Fatalf("listed %v, want exactly %v", got, names)
	}
	checkObjects(t, direct, objs)
}

// TestProxyFetchFaults: a fetch whose GET bodies are cut short, corrupted
// or refused on every attempt fails with an error naming the object and
// returns 0 bytes, never accepting the bytes; one such fault is retried
// and the fetch is bit-exact; delays on every request kind change nothing.
func TestProxyFetchFaults(t *testing.T) {
	direct, s, p := viaProxy(t, func(c *remote.Config) { c.FetchChunkBytes = 1 << 20; c.Concurrency = 2 })
	ctx := context.Background()
	name := pageName(t, direct, "ns", key("fetch"))
	data := randBytes(400, 3<<20+5) // 4 ranges
	if _, err := direct.Put(ctx, name, bytes.NewReader(data), int64(len(data))); err != nil {
		t.Fatal(err)
	}
	fetch := func() (int64, []byte, error) {
		var dst memFile
		n, err := s.Fetch(ctx, name, &dst, sha256Verify(data))
		return n, dst.b, err
	}
	wantMiss := func(what string, wantCorrupt bool) {
		t.Helper()
		n, _, err := fetch()
		var oe *remote.OpError
		if n != 0 || !errors.As(err, &oe) || oe.Name != name {
			t.Fatalf("%s: Fetch = %d, %v; want 0 and an *OpError naming %s", what, n, err, name)
		}
		if wantCorrupt && !errors.Is(err, remote.ErrCorrupt) {
			t.Fatalf("%s: %v, want ErrCorrupt", what, err)
		}
	}
	wantExact := func(what string, extraGets int) {
		t.Helper()
		before := p.Seen(faultproxy.Get)
		n, got, err := fetch()
		if err != nil || n != int64(len(data)) || !bytes.Equal(got, data) {
			t.Fatalf("%s: Fetch = %d, %v (bytes equal: %v)", what, n, err, bytes.Equal(got, data))
		}
		if g := p.Seen(faultproxy.Get) - before; g != 4+extraGets {
			t.Fatalf("%s: %d GETs, want %d", what, g, 4+extraGets)
		}
	}

	for _, f := range []faultproxy.Fault{faultproxy.Truncate, faultproxy.Reset, faultproxy.Refuse, faultproxy.Status} {
		p.Set(faultproxy.Rule{Kinds: faultproxy.Get, Fault: f, Bytes: 1000, Count: 1})
		wantExact(f.String()+" once", 1)
		p.Set(faultproxy.Rule{Kinds: faultproxy.Get, Fault: f, Bytes: 1000})
		wantMiss(f.String()+" every GET", false)
	}
	// A corrupted body has the right length: only verification catches it.
	p.Set(faultproxy.Rule{Kinds: faultproxy.Get, Fault: faultproxy.Corrupt, Bytes: 4321})
	wantMiss("corrupt every GET", true)
	p.Set(faultproxy.Rule{Kinds: faultproxy.Head, Fault: faultproxy.Refuse})
	wantMiss("refused HEAD", false)
	p.Set(faultproxy.Rule{Kinds: faultproxy.Any, Fault: faultproxy.Delay, Delay: 20 * time.Millisecond})
	wantExact("delay on every request", 0)
	if ex, err := s.Exists(ctx, []string{name, pageName(t, s, "ns", key("absent"))}); err != nil || !ex[0] || ex[1] {
		t.Fatalf("Exists with delays = %v, %v", ex, err)
	}
	if got := testutil.ObjectNames(t, s, "ns"); len(got) != 1 || got[0] != name {
		t.Fatalf("List with delays = %v", got)
	}
	// A deadline shorter than the delay fails the request, naming it.
	p.Set(faultproxy.Rule{Kinds: faultproxy.Head, Fault: faultproxy.Delay, Delay: time.Second})
	dctx, cancel := context.WithTimeout(ctx, 100*time.Millisecond)
	_, err := s.Exists(dctx, []string{name})
	cancel()
	var oe *remote.OpError
	if !errors.As(err, &oe) || oe.Op != "stat" || !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Exists past its deadline: %v", err)
	}
	p.Clear()
	wantExact("after the faults", 0)
}

// TestProxyCollectFaults: remote GC through a network that fails, cuts or
// 503s its LIST, corrupts the manifests Live reads, or loses and refuses
// its DELETEs never deletes a live page, a young page or a manifest; a
// failed step deletes nothing after it; a clean run afterwards deletes
// exactly the old unreferenced pages.
func TestProxyCollectFaults(t *testing.T) {
	defer remote.SetMinGrace(time.Second)()
	direct, s, p := viaProxy(t, nil)
	ctx := context.Background()
	put := func(name string, b []byte) {
		t.Helper()
		if _, err := direct.Put(ctx, name, bytes.NewReader(b), int64(len(b))); err != nil {
			t.Fatal(err)
		}
	}
	live := []string{key("l1"), key("l2")}
	var old []string
	for i := range 4 {
		old = append(old, pageName(t, direct, "ns", key(fmt.Sprint("old", i))))
	}
	man, err := direct.ManifestName("ns", "conv")
	if err != nil {
		t.Fatal(err)
	}
	manBytes := []byte(strings.Join(live, "\n"))
	put(man, manBytes)
	for _, k := range live {
		put(pageName(t, direct, "ns", k), []byte("live "+k))
	}
	for _, n := range old {
		put(n, []byte("old "+n))
	}
	time.Sleep(3500 * time.Millisecond) // 3 s older than young at 1 s mtime resolution
	young := pageName(t, direct, "ns", key("young"))
	put(young, []byte("young"))
	all := testutil.ObjectNames(t, direct, "ns")

	opts := remote.CollectOptions{Namespace: "ns",
		Live: func(ctx context.Context, ms []remote.Listed) (map[string]bool, error) {
			set := map[string]bool{}
			for _, m := range ms {
				var dst memFile
				if _, err := s.Fetch(ctx, m.Name, &dst, sha256Verify(manBytes)); err != nil {
					return nil, err
				}
				for _, k := range strings.Split(string(dst.b), "\n") {
					set[k] = true
				}
			}
			return set, nil
		}}
	for _, c := range []struct {
		what string
		rule faultproxy.Rule
	}{
		{"LIST refused", faultproxy.Rule{Kinds: faultproxy.List, Fault: faultproxy.Refuse}},
		{"LIST cut short", faultproxy.Rule{Kinds: faultproxy.List, Fault: faultproxy.Truncate, Bytes: 300}},
		{"LIST answered 503", faultproxy.Rule{Kinds: faultproxy.List, Fault: faultproxy.Status}},
		{"manifest GET corrupted", faultproxy.Rule{Kinds: faultproxy.Get, Fault: faultproxy.Corrupt, Bytes: 10}},
		{"manifest HEAD refused", faultproxy.Rule{Kinds: faultproxy.Head, Fault: faultproxy.Refuse}},
	} {
		p.Set(c.rule)
		opts.Grace = graceKeepingYoung(t, direct, young)
		rep, err := s.Collect(ctx, opts)
		if err == nil || rep.Deleted != 0 {
			t.Fatalf("%s: Collect = %+v, %v; want an error and nothing deleted", c.what, rep, err)
		}
		if got := testutil.ObjectNames(t, direct, "ns"); !slices.Equal(got, all) {
			t.Fatalf("%s: objects now %v, want all of %v", c.what, got, all)
		}
	}
	// The first DELETE deletes but its response is lost, the next is
	// refused: Collect stops at the first error.
	p.Set(faultproxy.Rule{Kinds: faultproxy.Delete, Fault: faultproxy.Reset, Count: 1},
		faultproxy.Rule{Kinds: faultproxy.Delete, Fault: faultproxy.Refuse, Count: 1})
	opts.Grace = graceKeepingYoung(t, direct, young)
	if _, err := s.Collect(ctx, opts); err == nil {
		t.Fatal("Collect with a lost DELETE response succeeded")
	}
	opts.Grace = graceKeepingYoung(t, direct, young)
	if _, err := s.Collect(ctx, opts); err == nil {
		t.Fatal("Collect with a refused DELETE succeeded")
	}
	if got := len(testutil.ObjectNames(t, direct, "ns")); got != len(all)-1 {
		t.Fatalf("%d objects after a lost and a refused DELETE, want %d (one deleted)", got, len(all)-1)
	}
	p.Clear()
	opts.Grace = graceKeepingYoung(t, direct, young)
	rep, err := s.Collect(ctx, opts)
	if err != nil || rep.Deleted != len(old)-1 || rep.Live != 2 || rep.Young != 1 || rep.Manifests != 1 {
		t.Fatalf("clean Collect = %+v, %v; want the 3 remaining old pages deleted", rep, err)
	}
	want := []string{man, young}
	for _, k := range live {
		want = append(want, pageName(t, direct, "ns", k))
	}
	slices.Sort(want)
	if got := testutil.ObjectNames(t, direct, "ns"); !slices.Equal(got, want) {
		t.Fatalf("objects after GC %v, want exactly %v", got, want)
	}
}
