package remote_test

import (
	"bytes"
	"context"
	"errors"
	"net/http"
	"testing"

	"github.com/kvpersist/kvpersist/engine/remote"
)

// TestFaultEveryRequestKind injects a network error into every kind of
// request the tier sends (PUT, HEAD, GET, LIST, DELETE), before sending
// and, for PUT, after the server stored the object (response lost), and
// cuts GET bodies short. Every failure is an *OpError naming the request
// kind and object and wrapping the injected error; no object is ever
// corrupted or overwritten, and a clean retry succeeds.
func TestFaultEveryRequestKind(t *testing.T) {
	rt := newFaultRT(http.DefaultTransport.(*http.Transport).Clone())
	s := newStore(t, func(c *remote.Config) { c.Transport, c.MaxRetries = rt, 1 })
	ctx := context.Background()
	set := func(m map[string]int, kind string) {
		rt.mu.Lock()
		m[kind] = 1
		rt.mu.Unlock()
	}
	wantOp := func(what string, err error, op, name string) {
		t.Helper()
		var oe *remote.OpError
		if !errors.As(err, &oe) || oe.Op != op || (name != "" && oe.Name != name) {
			t.Fatalf("%s: %v, want an *OpError op %q name %q", what, err, op, name)
		}
		if !errors.Is(err, errInjected) {
			t.Fatalf("%s: %v does not wrap the injected error", what, err)
		}
	}
	objs := map[string][]byte{}
	a := pageName(t, s, "ns", key("fa"))
	objs[a] = randBytes(10, 2<<20+3)

	// PUT refused before sending: nothing stored; a retry creates it.
	set(rt.fail, "put")
	_, err := s.Put(ctx, a, bytes.NewReader(objs[a]), int64(len(objs[a])))
	wantOp("put (fail before send)", err, "put", a)
	if _, err := s.Stat(ctx, a); !errors.Is(err, remote.ErrNotFound) {
		t.Fatalf("after a failed PUT the object exists: %v", err)
	}
	if pr, err := s.Put(ctx, a, bytes.NewReader(objs[a]), int64(len(objs[a]))); err != nil || !pr.Created {
		t.Fatalf("retried Put = %+v, %v", pr, err)
	}

	// PUT stored but its response lost: the retry finds it (create-only).
	b := pageName(t, s, "ns", key("fb"))
	objs[b] = randBytes(11, 1<<20)
	set(rt.lose, "put")
	_, err = s.Put(ctx, b, bytes.NewReader(objs[b]), int64(len(objs[b])))
	wantOp("put (response lost)", err, "put", b)
	if pr, err := s.Put(ctx, b, bytes.NewReader(objs[b]), int64(len(objs[b]))); err != nil || pr.Created {
		t.Fatalf("Put after a lost response = %+v, %v; want found existing", pr, err)
	}

	// HEAD (Stat, Exists, and the first request of Fetch).
	set(rt.fail, "stat")
	_, err = s.Exists(ctx, []string{a, b})
	wantOp("exists", err, "stat", "")
	set(rt.fail, "stat")
	_, err = s.Fetch(ctx, a, &memFile{}, nil)
	wantOp("fetch (stat)", err, "stat", a)

	// GET refused, and GET body cut short: one failure is retried and the
	// fetch is bit-exact; a range failing every attempt fails the fetch.
	for _, m := range []map[string]int{rt.fail, rt.cut} {
		set(m, "get")
		gets := rt.count("get")
		var dst memFile
		if _, err := s.Fetch(ctx, a, &dst, sha256Verify(objs[a])); err != nil || !bytes.Equal(dst.b, objs[a]) {
			t.Fatalf("fetch after one failed range: %v", err)
		}
		if g := rt.count("get") - gets; g != 2 {
			t.Fatalf("fetch after one failed range sent %d GETs, want 2 (one retry)", g)
		}
		rt.mu.Lock()
		m["get"] = remote.RangeAttempts
		rt.mu.Unlock()
		_, err = s.Fetch(ctx, a, &memFile{}, sha256Verify(objs[a]))
		wantOp("fetch (every attempt of a range fails)", err, "get", a)
	}

	// LIST.
	set(rt.fail, "list")
	_, err = s.List(ctx, "ns")
	wantOp("list", err, "list", "")

	// DELETE refused: the object stays.
	c := pageName(t, s, "ns", key("fc"))
	objs[c] = randBytes(12, 1000)
	if _, err := s.Put(ctx, c, bytes.NewReader(objs[c]), int64(len(objs[c]))); err != nil {
		t.Fatal(err)
	}
	set(rt.fail, "delete")
	wantOp("delete", s.Delete(ctx, c), "delete", c)

	// Nothing lost, nothing corrupted.
	l, err := s.List(ctx, "ns")
	if err != nil || len(l) != len(objs) {
		t.Fatalf("List = %d objects, %v; want %d", len(l), err, len(objs))
	}
	for name, want := range objs {
		var dst memFile
		if _, err := s.Fetch(ctx, name, &dst, sha256Verify(want)); err != nil || !bytes.Equal(dst.b, want) {
			t.Fatalf("%s after the faults: %v", name, err)
		}
	}
	if err := s.Delete(ctx, c); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Stat(ctx, c); !errors.Is(err, remote.ErrNotFound) {
		t.Fatalf("after Delete: %v", err)
	}
}
