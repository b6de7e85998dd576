package remote_test

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvpersist/kvpersist/engine/remote"
)

// runs numbers the stores of this process, so that every store (also
// across -count runs on the same server) has a prefix of its own.
var runs atomic.Int64

// newStore returns a Store on the shared server with a prefix of its own,
// closed at the test's end. mod may change the config (e.g. its
// Transport) before New.
func newStore(t testing.TB, mod func(*remote.Config)) *remote.Store {
	t.Helper()
	cfg := remote.Config{
		Endpoint: srv.Endpoint, Bucket: srv.Bucket, Prefix: fmt.Sprintf("t/%s-%d", strings.ReplaceAll(t.Name(), "/", "_"), runs.Add(1)),
		AccessKey: srv.AccessKey, SecretKey: srv.SecretKey,
	}
	if mod != nil {
		mod(&cfg)
	}
	s, err := remote.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(s.Close)
	return s
}

// key is a page key derived from s (any 64-hex string is a valid key).
func key(s string) string {
	h := sha256.Sum256([]byte(s))
	return hex.EncodeToString(h[:])
}

func pageName(t testing.TB, s *remote.Store, ns, k string) string {
	t.Helper()
	n, err := s.PageName(ns, k)
	if err != nil {
		t.Fatal(err)
	}
	return n
}

// graceKeepingYoung returns a Collect grace under which the page young
// (just put) is still young for a Collect whose listing comes within 2 s
// of now, by the store's clock: the Date of a HEAD of young minus its
// mtime, plus 2 s. Every page whose mtime is at least 3 s older than
// young's is old under it, however long the test ran before. (A fixed
// 2 s grace made young's youth depend on how long the test's earlier
// requests took: a loaded machine could let it age.)
func graceKeepingYoung(t testing.TB, s *remote.Store, young string) time.Duration {
	t.Helper()
	o, err := s.Stat(context.Background(), young)
	if err != nil {
		t.Fatal(err)
	}
	return s.ServerTime().Sub(o.ModTime) + 2*time.Second
}

func randBytes(seed uint64, n int) []byte {
	r := rand.New(rand.NewPCG(seed, seed^0x9e3779b97f4a7c15))
	b := make([]byte, n)
	for i := 0; i+8 <= n; i += 8 {
		v := r.Uint64()
		for j := range 8 {
			b[i+j] = byte(v >> (8 * j))
		}
	}
	for i := n &^ 7; i < n; i++ {
		b[i] = byte(r.Uint32())
	}
	return b
}

// memFile is an in-memory fetch destination that grows on write.
type memFile struct {
	mu sync.Mutex
	b  []byte
}

func (m *memFile) WriteAt(p []byte, off int64) (int, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if end := int(off) + len(p); end > len(m.b) {
		m.b = append(m.b, make([]byte, end-len(m.b))...)
	}
	return copy(m.b[off:], p), nil
}

func (m *memFile) ReadAt(p []byte, off int64) (int, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if off >= int64(len(m.b)) {
		return 0, io.EOF
	}
	n := copy(p, m.b[off:])
	if n < len(p) {
		return n, io.EOF
	}
	return n, nil
}

// bytesSource is an upload source over a byte slice.
type bytesSource struct{ *bytes.Reader }

func (bytesSource) Close() error { return nil }

func source(b []byte) func() (remote.ReadAtCloser, error) {
	return func() (remote.ReadAtCloser, error) { return bytesSource{bytes.NewReader(b)}, nil }
}

// sha256Verify is a VerifyFunc checking the bytes against want's SHA-256,
// computed independently of the fetch.
func sha256Verify(want []byte) remote.VerifyFunc {
	sum := sha256.Sum256(want)
	return func(r io.ReaderAt, size int64) error {
		h := sha256.New()
		if _, err := io.Copy(h, io.NewSectionReader(r, 0, size)); err != nil {
			return err
		}
		if got := h.Sum(nil); string(got) != string(sum[:]) {
			return fmt.Errorf("sha256 %x, want %x", got, sum)
		}
		return nil
	}
}

// kindOf classifies a request the way OpError.Op names it.
func kindOf(r *http.Request) string {
	switch r.Method {
	case http.MethodPut:
		return "put"
	case http.MethodHead:
		return "stat"
	case http.MethodDelete:
		return "delete"
	case http.MethodGet:
		if r.URL.Query().Has("list-type") || r.URL.Query().Has("prefix") {
			return "list"
		}
		return "get"
	}
	return r.Method
}

var errInjected = errors.New("injected network error")

// faultRT is an http.RoundTripper that injects network errors into
// requests of chosen kinds, and counts requests per kind.
type faultRT struct {
	next http.RoundTripper

	mu     sync.Mutex
	fail   map[string]int    // kind -> requests still to fail before sending
	lose   map[string]int    // kind -> responses to lose after the server handled the request
	cut    map[string]int    // kind -> response bodies to cut short (error mid-body)
	flip   map[string]int    // kind -> response bodies to corrupt (one byte flipped)
	counts map[string]*int64 // kind -> requests seen
}

func newFaultRT(next http.RoundTripper) *faultRT {
	return &faultRT{next: next, fail: map[string]int{}, lose: map[string]int{}, cut: map[string]int{}, flip: map[string]int{}, counts: map[string]*int64{}}
}

func (f *faultRT) take(m map[string]int, kind string) bool {
	f.mu.Lock()
	defer f.mu.Unlock()
	if m[kind] > 0 {
		m[kind]--
		return true
	}
	return false
}

func (f *faultRT) count(kind string) int64 {
	f.mu.Lock()
	defer f.mu.Unlock()
	if c := f.counts[kind]; c != nil {
		return atomic.LoadInt64(c)
	}
	return 0
}

func (f *faultRT) RoundTrip(r *http.Request) (*http.Response, error) {
	kind := kindOf(r)
	f.mu.Lock()
	if f.counts[kind] == nil {
		f.counts[kind] = new(int64)
	}
	atomic.AddInt64(f.counts[kind], 1)
	f.mu.Unlock()
	if f.take(f.fail, kind) {
		if r.Body != nil {
			r.Body.Close()
		}
		return nil, fmt.Errorf("%w (%s before sending)", errInjected, kind)
	}
	resp, err := f.next.RoundTrip(r)
	if err != nil {
		return resp, err
	}
	if f.take(f.lose, kind) {
		io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		return nil, fmt.Errorf("%w (%s response lost)", errInjected, kind)
	}
	if f.take(f.cut, kind) {
		resp.Body = &cutBody{rc: resp.Body, left: 1000}
	}
	if f.take(f.flip, kind) {
		resp.Body = &flipBody{rc: resp.Body, at: 777}
	}
	return resp, nil
}

func (f *faultRT) CloseIdleConnections() {
	if c, ok := f.next.(interface{ CloseIdleConnections() }); ok {
		c.CloseIdleConnections()
	}
}

// cutBody returns left bytes, then an error, as a dropped connection does.
type cutBody struct {
	rc   io.ReadCloser
	left int
}

func (c *cutBody) Read(p []byte) (int, error) {
	if c.left <= 0 {
		return 0, fmt.Errorf("%w (body cut)", errInjected)
	}
	if len(p) > c.left {
		p = p[:c.left]
	}
	n, err := c.rc.Read(p)
	c.left -= n
	return n, err
}

func (c *cutBody) Close() error { return c.rc.Close() }

// flipBody flips the byte at offset at of the body.
type flipBody struct {
	rc  io.ReadCloser
	pos int
	at  int
}

func (f *flipBody) Read(p []byte) (int, error) {
	n, err := f.rc.Read(p)
	if f.at >= f.pos && f.at < f.pos+n {
		p[f.at-f.pos] ^= 0xff
	}
	f.pos += n
	return n, err
}

func (f *flipBody) Close() error { return f.rc.Close() }
