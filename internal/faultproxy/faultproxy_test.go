package faultproxy_test

import (
	"bytes"
	"context"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/kvpersist/kvpersist/internal/faultproxy"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m, goleak.IgnoreCurrent())
}

// origin is a plain HTTP server standing behind the proxy: it stores PUT
// bodies by path, serves them on GET (Range not needed here) and counts
// the requests that reached it.
type origin struct {
	mu      sync.Mutex
	objects map[string][]byte
	reached map[string]int // method -> requests that reached the server
	host    string         // Host header of the latest request
}

func (o *origin) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	o.mu.Lock()
	defer o.mu.Unlock()
	o.reached[r.Method]++
	o.host = r.Host
	switch r.Method {
	case http.MethodPut:
		b, _ := io.ReadAll(r.Body)
		o.objects[r.URL.Path] = b
	case http.MethodGet, http.MethodHead:
		b, ok := o.objects[r.URL.Path]
		if !ok {
			http.NotFound(w, r)
			return
		}
		w.Header().Set("Content-Length", strconv.Itoa(len(b)))
		w.Write(b)
	case http.MethodDelete:
		delete(o.objects, r.URL.Path)
		w.WriteHeader(http.StatusNoContent)
	}
}

func (o *origin) count(method string) int {
	o.mu.Lock()
	defer o.mu.Unlock()
	return o.reached[method]
}

func start(t *testing.T) (*origin, *faultproxy.Proxy, *http.Client) {
	o := &origin{objects: map[string][]byte{}, reached: map[string]int{}}
	srv := httptest.NewServer(o)
	t.Cleanup(srv.Close)
	p := faultproxy.Start(t, srv.URL)
	tr := &http.Transport{}
	t.Cleanup(tr.CloseIdleConnections)
	return o, p, &http.Client{Transport: tr}
}

func do(t *testing.T, c *http.Client, method, url string, body []byte) (int, []byte, error) {
	t.Helper()
	var rd io.Reader
	if body != nil {
		rd = bytes.NewReader(body)
	}
	req, err := http.NewRequest(method, url, rd)
	if err != nil {
		t.Fatal(err)
	}
	resp, err := c.Do(req)
	if err != nil {
		return 0, nil, err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	return resp.StatusCode, b, err
}

func TestKindOf(t *testing.T) {
	for _, c := range []struct {
		method, url string
		want        faultproxy.Kind
	}{
		{"HEAD", "/b/ns/pages/ab/x", faultproxy.Head},
		{"GET", "/b/ns/pages/ab/x", faultproxy.Get},
		{"GET", "/b/?list-type=2&prefix=ns%2F", faultproxy.List},
		{"GET", "/b/?location=", faultproxy.List},
		{"GET", "/b", faultproxy.List},
		{"PUT", "/b/ns/x", faultproxy.Put},
		{"DELETE", "/b/ns/x", faultproxy.Delete},
		{"POST", "/b/?delete=", faultproxy.Other},
	} {
		r := httptest.NewRequest(c.method, c.url, nil)
		if got := faultproxy.KindOf(r); got != c.want {
			t.Errorf("%s %s: %v, want %v", c.method, c.url, got, c.want)
		}
	}
	if s := (faultproxy.Get | faultproxy.Put).String(); s != "get|put" {
		t.Errorf("String = %q", s)
	}
}

// TestFaults: each fault does what it says, to the requests it names only,
// as many times as Count says, and requests pass untouched otherwise (the
// Host header as the client sent it).
func TestFaults(t *testing.T) {
	o, p, c := start(t)
	data := bytes.Repeat([]byte("0123456789abcdef"), 4096) // 64 KiB
	url := p.Endpoint + "/b/obj"

	// Refuse: the PUT never reaches the server.
	p.Set(faultproxy.Rule{Kinds: faultproxy.Put, Fault: faultproxy.Refuse, Count: 1})
	if _, _, err := do(t, c, "PUT", url, data); err == nil {
		t.Fatal("refused PUT succeeded")
	}
	if o.count("PUT") != 0 {
		t.Fatalf("a refused PUT reached the server %d times", o.count("PUT"))
	}
	// Count 1 is spent: the next PUT passes.
	if code, _, err := do(t, c, "PUT", url, data); err != nil || code != 200 {
		t.Fatalf("PUT after the fault: %d %v", code, err)
	}
	o.mu.Lock()
	host := o.host
	o.mu.Unlock()
	if host != strings.TrimPrefix(p.Endpoint, "http://") {
		t.Fatalf("Host %q reached the server, want the proxy's %q", host, p.Endpoint)
	}

	// Reset: the DELETE reaches the server, its response is lost.
	p.Set(faultproxy.Rule{Kinds: faultproxy.Delete, Fault: faultproxy.Reset, Count: 1})
	if _, _, err := do(t, c, "DELETE", url, nil); err == nil {
		t.Fatal("reset DELETE succeeded")
	}
	o.mu.Lock()
	if o.reached["DELETE"] != 1 || o.objects["/b/obj"] != nil {
		t.Fatalf("reset DELETE: reached %d, object still there: %v", o.reached["DELETE"], o.objects["/b/obj"] != nil)
	}
	o.objects["/b/obj"] = data
	o.mu.Unlock()

	// Truncate: status and length as the server's, body cut at Bytes.
	p.Set(faultproxy.Rule{Kinds: faultproxy.Get, Fault: faultproxy.Truncate, Bytes: 1000, Count: 1})
	code, got, err := do(t, c, "GET", url, nil)
	if code != 200 || !errors.Is(err, io.ErrUnexpectedEOF) || !bytes.Equal(got, data[:1000]) {
		t.Fatalf("truncated GET: %d, %d bytes, %v; want 200, the first 1000 bytes, unexpected EOF", code, len(got), err)
	}

	// Corrupt: one byte inverted, length unchanged; a HEAD is untouched
	// by a GET rule.
	p.Set(faultproxy.Rule{Kinds: faultproxy.Get, Fault: faultproxy.Corrupt, Bytes: 777})
	if code, _, err := do(t, c, "HEAD", url, nil); err != nil || code != 200 {
		t.Fatalf("HEAD under a GET rule: %d %v", code, err)
	}
	for range 2 { // Count 0: every GET
		_, got, err = do(t, c, "GET", url, nil)
		if err != nil || len(got) != len(data) || got[777] != ^data[777] || !bytes.Equal(got[:777], data[:777]) || !bytes.Equal(got[778:], data[778:]) {
			t.Fatalf("corrupted GET: %d bytes, %v", len(got), err)
		}
	}

	// After: the first After matching requests pass.
	p.Set(faultproxy.Rule{Kinds: faultproxy.Head, Fault: faultproxy.Status, After: 1, Count: 1})
	if code, _, _ := do(t, c, "HEAD", url, nil); code != 200 {
		t.Fatalf("first HEAD: %d, want 200 (After 1)", code)
	}
	if code, _, _ := do(t, c, "HEAD", url, nil); code != 503 {
		t.Fatalf("second HEAD: %d, want the injected 503", code)
	}
	if code, _, _ := do(t, c, "HEAD", url, nil); code != 200 {
		t.Fatalf("third HEAD: %d, want 200 (Count 1 spent)", code)
	}

	// Delay: the request waits at the proxy, so a caller giving up
	// 50 ms after the proxy has it (far less than the delay) fails it.
	// The 50 ms start once the proxy counts the request: a deadline set
	// before sending could run out on a stalled machine before the
	// request reached the proxy, which would then neither see nor
	// fault it.
	p.Set(faultproxy.Rule{Kinds: faultproxy.Any, Fault: faultproxy.Delay, Delay: 10 * time.Second})
	seenGets := p.Seen(faultproxy.Get)
	ctx, cancel := context.WithCancel(context.Background())
	gaveUp := make(chan struct{})
	go func() {
		defer close(gaveUp)
		for p.Seen(faultproxy.Get) == seenGets {
			if ctx.Err() != nil {
				return
			}
			time.Sleep(time.Millisecond)
		}
		time.Sleep(50 * time.Millisecond)
		cancel()
	}()
	req, _ := http.NewRequestWithContext(ctx, "GET", url, nil)
	_, err = c.Do(req)
	cancel()
	<-gaveUp
	if !errors.Is(err, context.Canceled) {
		t.Fatalf("delayed GET given up 50 ms after the proxy had it: %v", err)
	}
	// ShiftDate: the Date header moves by Delay.
	p.Set(faultproxy.Rule{Kinds: faultproxy.Head, Fault: faultproxy.ShiftDate, Delay: 2 * time.Hour})
	req, _ = http.NewRequest("HEAD", url, nil)
	resp, err := c.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if d, err := http.ParseTime(resp.Header.Get("Date")); err != nil || d.Sub(time.Now()) < 2*time.Hour-time.Minute || d.Sub(time.Now()) > 2*time.Hour+time.Minute {
		t.Fatalf("shifted Date %q (%v), want about 2 h ahead", resp.Header.Get("Date"), err)
	}
	p.Clear()
	if _, got, err := do(t, c, "GET", url, nil); err != nil || !bytes.Equal(got, data) {
		t.Fatalf("GET after Clear: %d bytes, %v", len(got), err)
	}
	if p.Injected(faultproxy.Any) != 1+1+1+2+1+1+1 {
		t.Fatalf("Injected = %d, want 8", p.Injected(faultproxy.Any))
	}
	if p.Seen(faultproxy.Get) != 5 || p.Seen(faultproxy.Head) != 5 {
		t.Fatalf("Seen get %d head %d, want 5 and 5", p.Seen(faultproxy.Get), p.Seen(faultproxy.Head))
	}
}

// TestCloseWithRequestsInFlight: Close ends delayed requests and open
// connections and returns after every goroutine (goleak checks).
func TestCloseWithRequestsInFlight(t *testing.T) {
	_, p, c := start(t)
	p.Set(faultproxy.Rule{Kinds: faultproxy.Any, Fault: faultproxy.Delay, Delay: time.Hour})
	errs := make(chan error, 3)
	for range 3 {
		go func() { _, _, err := do(t, c, "GET", p.Endpoint+"/b/x", nil); errs <- err }()
	}
	for p.Seen(faultproxy.Get) < 3 {
		time.Sleep(time.Millisecond)
	}
	p.Close()
	for range 3 {
		if err := <-errs; err == nil {
			t.Fatal("a request in flight at Close succeeded")
		}
	}
	p.Close() // twice is fine
}

// TestDelayEndsWhenTheClientGoesAway: a request held by a Delay (an hour
// here) whose client gives up (cancels: its transport closes the
// connection) is dropped by the proxy at once: never forwarded, counted
// by Abandoned, its connection's goroutine returned. A GET (no body) and
// a PUT (its body unread in the socket while the proxy waits) both.
// Before: the proxy waited out the delay, then forwarded the request to
// a server that its client had long stopped waiting for (a PUT then
// created an object after its caller saw it fail).
func TestDelayEndsWhenTheClientGoesAway(t *testing.T) {
	o, p, c := start(t)
	p.Set(faultproxy.Rule{Kinds: faultproxy.Get | faultproxy.Put, Fault: faultproxy.Delay, Delay: time.Hour})
	for i, k := range []faultproxy.Kind{faultproxy.Get, faultproxy.Put} {
		method, body := "GET", io.Reader(nil)
		if k == faultproxy.Put {
			method, body = "PUT", bytes.NewReader(bytes.Repeat([]byte{7}, 64<<10))
		}
		ctx, cancel := context.WithCancel(context.Background())
		req, err := http.NewRequestWithContext(ctx, method, p.Endpoint+"/b/obj", body)
		if err != nil {
			t.Fatal(err)
		}
		errc := make(chan error, 1)
		go func() {
			resp, err := c.Do(req)
			if err == nil {
				resp.Body.Close()
			}
			errc <- err
		}()
		guard := time.Now().Add(30 * time.Second)
		for p.Seen(k) == 0 {
			if time.Now().After(guard) {
				t.Fatalf("%s: the proxy never received the request", method)
			}
			time.Sleep(time.Millisecond)
		}
		cancel()
		if err := <-errc; !errors.Is(err, context.Canceled) {
			t.Fatalf("%s: the cancelled request returned %v", method, err)
		}
		for p.Abandoned(faultproxy.Any) != i+1 {
			if time.Now().After(guard) {
				t.Fatalf("%s: the proxy still holds the request its client gave up (Abandoned %d)", method, p.Abandoned(faultproxy.Any))
			}
			time.Sleep(time.Millisecond)
		}
	}
	p.Close() // joins every connection's goroutine: a forward would have reached the server by now
	if n := o.count("GET") + o.count("PUT"); n != 0 {
		t.Fatalf("%d requests whose clients gave up reached the server", n)
	}
	if p.Abandoned(faultproxy.Get) != 1 || p.Abandoned(faultproxy.Put) != 1 {
		t.Fatalf("Abandoned get %d put %d, want 1 and 1", p.Abandoned(faultproxy.Get), p.Abandoned(faultproxy.Put))
	}
}
