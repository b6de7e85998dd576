// Package faultproxy is a loopback HTTP/1.1 proxy that injects network
// faults into chosen kinds of S3 requests, for the object-store tier's
// tests: a request refused before it reaches the server, a connection
// reset after the server acted (the response lost), a response body cut
// short or corrupted, a delay. It forwards everything else unchanged to a
// real server (SeaweedFS in kvpersist's tests), so the client under test
// speaks real S3 through real sockets.
//
// Use:
//
//	p := faultproxy.Start(t, srv.Endpoint) // stopped in t's cleanup
//	cfg.Endpoint = p.Endpoint
//	p.Set(faultproxy.Rule{Kinds: faultproxy.Put, Fault: faultproxy.Reset, Count: 2})
//
// The Host header is forwarded as the client sent it (the proxy's
// address), so AWS Signature V4, which signs it, stays valid.
//
// It is test-only: product code never imports it (cmd/kvpersist's
// dependency test checks the binary does not link it). Every goroutine it
// starts (the accept loop, one per client connection, and one per request
// held by a Delay, watching for its client to go away, joined by that
// connection's goroutine) is owned by the Proxy and joined by Close.
// The watch polls for POLLRDHUP, so a client that only shuts down its
// write side after sending a request (Go's client never does) is taken
// for gone: its delayed request is dropped and counted by Abandoned.
package faultproxy

import (
	"bufio"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"strings"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// Kind is a set of S3 request kinds (a bit mask).
type Kind uint8

// Request kinds, as the proxy classifies them.
const (
	Head   Kind = 1 << iota // HEAD of an object or bucket (Stat, Exists, Fetch's first request)
	Get                     // GET of an object, ranged or whole
	List                    // GET of a bucket: ListObjects (a list-type, prefix or delimiter query, or no object key)
	Put                     // PUT: object uploads, server-side copies (Refresh), bucket creation
	Delete                  // DELETE of an object
	Other                   // anything else (POST multi-delete, OPTIONS, ...)

	Any = Head | Get | List | Put | Delete | Other
)

var kindNames = []string{"head", "get", "list", "put", "delete", "other"}

func (k Kind) String() string {
	var s []string
	for i, n := range kindNames {
		if k&(1<<i) != 0 {
			s = append(s, n)
		}
	}
	if len(s) == 0 {
		return "none"
	}
	return strings.Join(s, "|")
}

// KindOf classifies r. Path-style addressing is assumed (/bucket/key):
// a GET of "/bucket" or "/bucket/" or with a list query is a List.
func KindOf(r *http.Request) Kind {
	switch r.Method {
	case http.MethodHead:
		return Head
	case http.MethodPut:
		return Put
	case http.MethodDelete:
		return Delete
	case http.MethodGet:
		q := r.URL.Query()
		if q.Has("list-type") || q.Has("prefix") || q.Has("delimiter") || q.Has("continuation-token") || q.Has("marker") {
			return List
		}
		if p := strings.Trim(r.URL.Path, "/"); !strings.Contains(p, "/") {
			return List // the bucket itself (ListObjects v1 without a query, or a location query)
		}
		return Get
	}
	return Other
}

// Fault is what the proxy does to a matching request.
type Fault int

const (
	// Refuse closes the client's connection without forwarding the
	// request: the server never sees it (a connection refused or dropped
	// before the request went out).
	Refuse Fault = iota + 1
	// Reset forwards the request, lets the server act on it, then resets
	// the client's connection (TCP RST) instead of answering: the response
	// is lost (a PUT that created its object, a DELETE that deleted).
	Reset
	// Truncate forwards the request and answers with the server's status
	// and headers (Content-Length unchanged) and only the first Rule.Bytes
	// bytes of the body, then closes the connection.
	Truncate
	// Corrupt forwards the request and answers with the body's byte at
	// offset Rule.Bytes inverted (length unchanged; a body shorter than
	// that passes unchanged).
	Corrupt
	// Delay waits Rule.Delay before forwarding the request (then forwards
	// it normally). A client deadline shorter than that fails the request.
	// A client that gives up meanwhile (closes its connection) ends the
	// wait: the request is dropped, never forwarded (counted by
	// Abandoned); so does Close.
	Delay
	// Status answers Rule.Status (default 503) with an S3 XML error body
	// without forwarding the request (a throttling or failing server).
	Status
	// ShiftDate forwards the request and moves the response's Date header
	// by Rule.Delay (a store whose clock is ahead, or behind when
	// negative): what a client that reads the store's clock, such as
	// remote GC, then believes.
	ShiftDate
)

var faultNames = map[Fault]string{Refuse: "refuse", Reset: "reset", Truncate: "truncate", Corrupt: "corrupt", Delay: "delay", Status: "status", ShiftDate: "shift-date"}

func (f Fault) String() string {
	if n, ok := faultNames[f]; ok {
		return n
	}
	return fmt.Sprintf("Fault(%d)", int(f))
}

// Rule injects Fault into requests of Kinds.
type Rule struct {
	Kinds Kind
	Fault Fault
	// After: the first After matching requests pass untouched.
	After int
	// Count: how many matching requests (after the first After) get the
	// fault; 0 means every one until the rules are replaced or cleared.
	Count int
	// Bytes: for Truncate the body bytes passed before the cut; for
	// Corrupt the offset of the inverted byte.
	Bytes int64
	// Delay: for Delay, how long to wait; for ShiftDate, the shift.
	Delay time.Duration
	// Status: for Status, the HTTP status (default 503 Service Unavailable).
	Status int
	// Match, if set, must also accept the request (e.g. one object's path).
	Match func(*http.Request) bool
}

// rule is a Rule with its counters.
type rule struct {
	Rule
	seen, hit int
}

// TB is the part of testing.TB Start needs.
type TB interface {
	Helper()
	Fatalf(format string, args ...any)
	Cleanup(func())
}

// Proxy is one running fault proxy. Its methods are safe for concurrent use.
type Proxy struct {
	// Endpoint is the proxy's URL, "http://127.0.0.1:<port>": give it to
	// the client instead of the server's.
	Endpoint string

	target *url.URL
	ln     net.Listener
	up     *http.Transport
	ctx    context.Context // cancelled by Close: ends delays and upstream requests
	cancel context.CancelFunc
	wg     sync.WaitGroup

	mu        sync.Mutex
	closed    bool
	conns     map[net.Conn]struct{}
	rules     []*rule
	seen      map[Kind]int // requests seen, per kind
	injected  map[Kind]int // faults injected, per kind
	abandoned map[Kind]int // delayed requests dropped: their client went away
}

// Start starts a proxy on a free loopback port forwarding to target
// ("http://host:port" of the real server; loopback only) and registers
// Close with tb.Cleanup. It fails tb if it cannot.
func Start(tb TB, target string) *Proxy {
	tb.Helper()
	p, err := New(target)
	if err != nil {
		tb.Fatalf("faultproxy: %v", err)
	}
	tb.Cleanup(p.Close)
	return p
}

// New is Start without a test: the caller must Close the proxy.
func New(target string) (*Proxy, error) {
	u, err := url.Parse(target)
	if err != nil || u.Scheme != "http" || u.Host == "" {
		return nil, fmt.Errorf("target %q: want http://host:port", target)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	p := &Proxy{
		Endpoint: "http://" + ln.Addr().String(),
		target:   u, ln: ln,
		up:    &http.Transport{Proxy: nil, MaxIdleConnsPerHost: 64, DisableCompression: true},
		conns: map[net.Conn]struct{}{}, seen: map[Kind]int{}, injected: map[Kind]int{}, abandoned: map[Kind]int{},
	}
	p.ctx, p.cancel = context.WithCancel(context.Background())
	p.wg.Go(p.accept)
	return p, nil
}

// Set replaces the rules. A request gets the fault of the first rule that
// matches it and has faults left; a request no rule faults is forwarded.
func (p *Proxy) Set(rules ...Rule) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.rules = p.rules[:0]
	for _, r := range rules {
		if r.Fault == Status && r.Status == 0 {
			r.Status = http.StatusServiceUnavailable
		}
		p.rules = append(p.rules, &rule{Rule: r})
	}
}

// Clear removes every rule: requests pass untouched.
func (p *Proxy) Clear() { p.Set() }

// Seen returns how many requests of the kinds k the proxy has received.
func (p *Proxy) Seen(k Kind) int { return p.count(p.seen, k) }

// Injected returns how many faults the proxy has injected into requests of
// the kinds k.
func (p *Proxy) Injected(k Kind) int { return p.count(p.injected, k) }

// Abandoned returns how many requests of the kinds k the proxy dropped
// while a Delay held them, because their client closed its connection
// (gave up): those were never forwarded.
func (p *Proxy) Abandoned(k Kind) int { return p.count(p.abandoned, k) }

func (p *Proxy) count(m map[Kind]int, k Kind) int {
	p.mu.Lock()
	defer p.mu.Unlock()
	n := 0
	for kind, c := range m {
		if kind&k != 0 {
			n += c
		}
	}
	return n
}

// Close stops accepting, closes every client connection, cancels the
// requests in flight upstream and waits for every goroutine of the proxy
// to return. Safe to call twice.
func (p *Proxy) Close() {
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		return
	}
	p.closed = true
	p.ln.Close()
	for c := range p.conns {
		c.Close()
	}
	p.mu.Unlock()
	p.cancel()
	p.wg.Wait()
	p.up.CloseIdleConnections()
}

func (p *Proxy) accept() {
	for {
		c, err := p.ln.Accept()
		if err != nil {
			return // closed
		}
		p.mu.Lock()
		if p.closed {
			p.mu.Unlock()
			c.Close()
			return
		}
		p.conns[c] = struct{}{}
		p.mu.Unlock()
		p.wg.Go(func() {
			p.serve(c)
			p.mu.Lock()
			delete(p.conns, c)
			p.mu.Unlock()
			c.Close()
		})
	}
}

// pick counts r and returns the rule faulting it, if any.
func (p *Proxy) pick(r *http.Request, k Kind) *rule {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.seen[k]++
	for _, ru := range p.rules {
		if ru.Kinds&k == 0 || (ru.Match != nil && !ru.Match(r)) {
			continue
		}
		if ru.Count > 0 && ru.hit >= ru.Count {
			continue
		}
		ru.seen++
		if ru.seen <= ru.After {
			continue
		}
		ru.hit++
		p.injected[k]++
		return ru
	}
	return nil
}

// serve handles the requests of one client connection until it closes or
// a fault ends it.
func (p *Proxy) serve(c net.Conn) {
	br := bufio.NewReader(c)
	bw := bufio.NewWriter(c)
	for {
		req, err := http.ReadRequest(br)
		if err != nil {
			return
		}
		if !p.handle(c, bw, req) {
			return
		}
		if req.Close {
			return
		}
	}
}

// handle forwards one request (with its fault) and reports whether the
// connection can carry another.
func (p *Proxy) handle(c net.Conn, bw *bufio.Writer, req *http.Request) bool {
	k := KindOf(req)
	ru := p.pick(req, k)
	var f Fault
	if ru != nil {
		f = ru.Fault
	}
	switch f {
	case Refuse:
		return false
	case Delay:
		gone, stop := clientGone(c)
		t := time.NewTimer(ru.Delay)
		select {
		case <-t.C:
			stop()
		case <-gone:
			t.Stop()
			stop()
			p.mu.Lock()
			p.abandoned[k]++
			p.mu.Unlock()
			return false
		case <-p.ctx.Done():
			t.Stop()
			stop()
			return false
		}
	case Status:
		io.Copy(io.Discard, req.Body)
		body := fmt.Sprintf(`<?xml version="1.0" encoding="UTF-8"?><Error><Code>ServiceUnavailable</Code><Message>injected by faultproxy</Message><Resource>%s</Resource></Error>`, req.URL.Path)
		fmt.Fprintf(bw, "HTTP/1.1 %d %s\r\nContent-Type: application/xml\r\nContent-Length: %d\r\n\r\n", ru.Status, http.StatusText(ru.Status), len(body))
		if req.Method != http.MethodHead {
			bw.WriteString(body)
		}
		return bw.Flush() == nil
	}
	out := req.Clone(p.ctx)
	out.RequestURI = ""
	out.URL.Scheme, out.URL.Host = p.target.Scheme, p.target.Host
	out.Host = req.Host // signed by the client
	if req.ContentLength == 0 {
		out.Body = nil
	}
	resp, err := p.up.RoundTrip(out)
	if err != nil {
		return false // the server is down: the client sees its connection closed
	}
	defer resp.Body.Close()
	switch f {
	case Reset:
		if tc, ok := c.(*net.TCPConn); ok {
			tc.SetLinger(0) // Close sends RST
		}
		return false
	case Truncate:
		resp.Body = struct {
			io.Reader
			io.Closer
		}{io.MultiReader(io.LimitReader(resp.Body, ru.Bytes), errReader{}), resp.Body}
		resp.Write(bw) // fails at the cut, with the bytes before it buffered
		bw.Flush()
		return false
	case ShiftDate:
		if t, err := http.ParseTime(resp.Header.Get("Date")); err == nil {
			resp.Header.Set("Date", t.Add(ru.Delay).UTC().Format(http.TimeFormat))
		}
	case Corrupt:
		resp.Body = struct {
			io.Reader
			io.Closer
		}{&flipper{r: resp.Body, at: ru.Bytes}, resp.Body}
	}
	if err := resp.Write(bw); err != nil {
		return false
	}
	return bw.Flush() == nil && !resp.Close
}

// clientGone watches c for its client closing the connection (a FIN or
// an RST: POLLRDHUP, POLLHUP or POLLERR on a duplicate of its
// descriptor) without reading from it, so a request's body still in the
// socket stays there for the forward. gone is closed when the client
// has gone; stop ends the watch and returns once its goroutine has (the
// caller owns it and calls stop exactly once). A connection whose
// descriptor cannot be watched (not a socket, or out of descriptors)
// gets a gone that is never closed: its Delay is waited out as before.
func clientGone(c net.Conn) (gone <-chan struct{}, stop func()) {
	ch := make(chan struct{})
	none := func() {}
	sc, ok := c.(syscall.Conn)
	if !ok {
		return ch, none
	}
	rc, err := sc.SyscallConn()
	if err != nil {
		return ch, none
	}
	fd, derr := -1, error(nil)
	if err := rc.Control(func(s uintptr) { fd, derr = unix.FcntlInt(s, unix.F_DUPFD_CLOEXEC, 0) }); err != nil || derr != nil {
		return ch, none
	}
	// The duplicate keeps the socket open while it is polled (Close of
	// the connection, by the proxy's Close, does not wait for the poll).
	efd, err := unix.Eventfd(0, unix.EFD_CLOEXEC)
	if err != nil {
		unix.Close(fd)
		return ch, none
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		defer unix.Close(fd)
		fds := []unix.PollFd{{Fd: int32(fd), Events: unix.POLLRDHUP}, {Fd: int32(efd), Events: unix.POLLIN}}
		for {
			_, err := unix.Poll(fds, -1)
			if err == unix.EINTR {
				continue
			}
			if err != nil || fds[1].Revents != 0 {
				return // stopped (or poll failed: the delay is waited out)
			}
			if fds[0].Revents != 0 {
				close(ch)
				return
			}
		}
	}()
	return ch, func() {
		var one [8]byte
		binary.NativeEndian.PutUint64(one[:], 1)
		unix.Write(efd, one[:])
		<-done
		unix.Close(efd) // after the goroutine: its number is never reused under the poll
	}
}

var errCut = errors.New("faultproxy: body cut")

type errReader struct{}

func (errReader) Read([]byte) (int, error) { return 0, errCut }

// flipper inverts the byte at offset at of what it reads.
type flipper struct {
	r       io.Reader
	pos, at int64
}

func (f *flipper) Read(b []byte) (int, error) {
	n, err := f.r.Read(b)
	if f.at >= f.pos && f.at < f.pos+int64(n) {
		b[f.at-f.pos] ^= 0xff
	}
	f.pos += int64(n)
	return n, err
}
