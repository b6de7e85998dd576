// Package remote is kvpersist's object-store tier: pages and page manifests
// stored as immutable objects on any S3-compatible store (AWS S3, SeaweedFS,
// Ceph RGW, ...) through github.com/minio/minio-go/v7.
//
// The package treats object bytes as opaque files: it names them, uploads
// them create-only, looks many of them up at once, fetches them with ranged
// parallel GETs into a caller's file with a caller-supplied verification,
// uploads them in the background (Uploader) and collects unreferenced ones
// (Collect). What a page file holds is the engine's business.
//
// Bucket layout (mirrors the local store, see docs/format/bucket-layout.md):
//
//	<prefix>/<ns>/pages/<k[0:2]>/<k>   a page; k = 64 lowercase hex digits
//	<prefix>/<ns>/<name>               a manifest (a named snapshot)
package remote

import (
	"crypto/tls"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/url"
	"os"
	"strings"
	"sync"
	"time"
)

// Sentinel errors; every error of this package wraps one of them (network
// and server errors wrap the client's error inside an *OpError).
var (
	// ErrConfig: a Config field is invalid (the message names it).
	ErrConfig = errors.New("remote: invalid config")
	// ErrBadName: a namespace, manifest name or page key is not one
	// kvpersist writes (see PageName, ManifestName).
	ErrBadName = errors.New("remote: invalid object name")
	// ErrNotFound: the object does not exist.
	ErrNotFound = errors.New("remote: object not found")
	// ErrCorrupt: a fetched object failed verification or its length
	// differs from what the store announced. It is a miss, never loaded.
	ErrCorrupt = errors.New("remote: corrupt object")
	// ErrSourceCorrupt: an upload's source failed its Upload.Verify (a
	// local page or manifest that rotted on disk): it was not uploaded.
	ErrSourceCorrupt = errors.New("remote: upload source corrupt")
	// ErrTooLarge: an object is larger than Config.MaxObjectBytes.
	ErrTooLarge = errors.New("remote: object too large")
	// ErrConflict: a create-only upload found an object of another size
	// under the same name (the bytes under one name must never differ).
	ErrConflict = errors.New("remote: existing object differs")
	// ErrQueueFull: the uploader's queue is full; the upload was not queued.
	ErrQueueFull = errors.New("remote: upload queue full")
	// ErrClosed: the uploader is closing or closed.
	ErrClosed = errors.New("remote: uploader closed")
	// ErrAbandoned: Close's context ended with uploads not finished.
	ErrAbandoned = errors.New("remote: uploads abandoned")
	// ErrCredentials: the store refused the credentials: an access key
	// it does not know (S3 InvalidAccessKeyId), a signature that does
	// not match (a wrong secret key: SignatureDoesNotMatch), or an
	// invalid or expired session token.
	ErrCredentials = errors.New("remote: credentials refused")
	// ErrNoBucket: the bucket does not exist (S3 NoSuchBucket).
	ErrNoBucket = errors.New("remote: bucket does not exist")
	// ErrAccessDenied: the store denied the request (S3 AccessDenied, or
	// a 403 without a code: HEAD responses carry none): the credentials
	// lack a permission, or (on HEAD) are wrong.
	ErrAccessDenied = errors.New("remote: access denied")
)

// OpError names the request kind and object of a failed request.
type OpError struct {
	Op   string // "put", "stat", "get", "list", "delete", "copy"
	Name string // object name (or listing prefix)
	Err  error
}

func (e *OpError) Error() string { return "remote: " + e.Op + " " + e.Name + ": " + e.Err.Error() }
func (e *OpError) Unwrap() error { return e.Err }

// Environment variables read by ConfigFromEnv and for missing credentials.
const (
	EnvAccessKey = "AWS_ACCESS_KEY_ID"
	EnvSecretKey = "AWS_SECRET_ACCESS_KEY"
	EnvSession   = "AWS_SESSION_TOKEN"
	EnvRegion    = "AWS_REGION"
)

// Config says where the remote tier lives and how to reach it.
type Config struct {
	// Endpoint is "host[:port]" or "https://host[:port]" for HTTPS, or
	// "http://host:port" for plain HTTP. A bare host:port always means
	// HTTPS: a server that speaks plain HTTP (a local SeaweedFS, MinIO or
	// other test server, which listen without TLS by default) must be
	// given as an http:// URL, e.g. "http://127.0.0.1:8333" (the CLI's
	// --insecure with host:port is the same). Plain HTTP is allowed only
	// when host is a loopback address ("localhost", 127.0.0.0/8, ::1):
	// credentials and pages never cross a network unencrypted. A plain-HTTP
	// server given as host:port fails every request with ErrConfig, whose
	// message says to use http://.
	Endpoint string
	// Bucket must exist; the tier never creates buckets.
	Bucket string
	// Prefix is prepended to every object name: "" or '/'-separated
	// elements of [A-Za-z0-9._-] (not "." or ".."), no leading or trailing '/'.
	Prefix string
	// AccessKey, SecretKey, SessionToken: when AccessKey is empty they are
	// read from AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY and
	// AWS_SESSION_TOKEN, and when those are unset from the AWS shared
	// credentials file (see New).
	AccessKey, SecretKey, SessionToken string
	// Region: "" = AWS_REGION, else the client's default (us-east-1).
	Region string
	// Transport: nil = a default HTTP transport. Tests wrap it to inject
	// faults.
	Transport http.RoundTripper
	// Concurrency bounds the requests in flight for one Exists batch or
	// one Fetch. Default 16.
	Concurrency int
	// FetchChunkBytes is the byte length of one ranged GET. Default 8 MiB
	// here, so that one object fetched alone (kvpersist verify --remote)
	// has several GETs in flight; the engine's read-through, which keeps
	// many pages in flight instead, defaults it to 64 MiB (one GET per
	// page: engine.RemoteTier.FetchPages). Every GET carries a Range
	// header and If-Match, also when one range is the whole object; on
	// SeaweedFS neither costs the server measurably more CPU per byte than
	// a plain GET, nor do 8 MiB ranges. Fetch holds at most Concurrency copy buffers of
	// CopyBufferBytes, whatever this is.
	FetchChunkBytes int64
	// MaxObjectBytes: larger objects are refused by Fetch (ErrTooLarge)
	// before any byte is written. Default 4 GiB.
	MaxObjectBytes int64
	// MaxRetries is the client's retries of one request (network errors,
	// 5xx, throttling) with exponential backoff from 200 ms, capped at
	// 1 s. Default 3; 1 disables retries.
	MaxRetries int
}

// CopyBufferBytes is the size of each Fetch worker's copy buffer.
const CopyBufferBytes = 256 << 10

// ConfigFromEnv returns a Config for endpoint and bucket with credentials
// and region from the standard environment variables.
func ConfigFromEnv(endpoint, bucket, prefix string) Config {
	return Config{
		Endpoint: endpoint, Bucket: bucket, Prefix: prefix,
		AccessKey: os.Getenv(EnvAccessKey), SecretKey: os.Getenv(EnvSecretKey),
		SessionToken: os.Getenv(EnvSession), Region: os.Getenv(EnvRegion),
	}
}

func (c *Config) withDefaults() Config {
	d := *c
	if d.AccessKey == "" {
		d.AccessKey = os.Getenv(EnvAccessKey)
		d.SecretKey = os.Getenv(EnvSecretKey)
		d.SessionToken = os.Getenv(EnvSession)
	}
	if d.Region == "" {
		d.Region = os.Getenv(EnvRegion)
	}
	if d.Concurrency == 0 {
		d.Concurrency = 16
	}
	if d.FetchChunkBytes == 0 {
		d.FetchChunkBytes = 8 << 20
	}
	if d.MaxObjectBytes == 0 {
		d.MaxObjectBytes = 4 << 30
	}
	if d.MaxRetries == 0 {
		d.MaxRetries = 3
	}
	return d
}

// endpoint parses c.Endpoint into host:port and whether TLS is used.
func (c *Config) endpoint() (host string, secure bool, err error) {
	e := c.Endpoint
	if e == "" {
		return "", false, fmt.Errorf("%w: Endpoint is empty", ErrConfig)
	}
	secure = true
	if strings.Contains(e, "://") {
		u, err := url.Parse(e)
		if err != nil {
			return "", false, fmt.Errorf("%w: Endpoint %q: %v", ErrConfig, e, err)
		}
		switch u.Scheme {
		case "https":
		case "http":
			secure = false
		default:
			return "", false, fmt.Errorf("%w: Endpoint %q: scheme must be https or http", ErrConfig, e)
		}
		if (u.Path != "" && u.Path != "/") || u.RawQuery != "" || u.User != nil {
			return "", false, fmt.Errorf("%w: Endpoint %q: want scheme://host[:port] only", ErrConfig, e)
		}
		e = u.Host
	}
	if e == "" || strings.ContainsAny(e, "/?#@ ") {
		return "", false, fmt.Errorf("%w: Endpoint %q: want host[:port]", ErrConfig, c.Endpoint)
	}
	if !secure && !isLoopback(e) {
		return "", false, fmt.Errorf("%w: Endpoint %q: plain http is allowed only for a loopback host", ErrConfig, c.Endpoint)
	}
	return e, secure, nil
}

func isLoopback(hostport string) bool {
	h := hostport
	if host, _, err := net.SplitHostPort(hostport); err == nil {
		h = host
	}
	if h == "localhost" {
		return true
	}
	ip := net.ParseIP(strings.Trim(h, "[]"))
	return ip != nil && ip.IsLoopback()
}

func validPrefix(p string) bool {
	if p == "" {
		return true
	}
	for _, el := range strings.Split(p, "/") {
		if el == "" || el == "." || el == ".." || !isNameChars(el) {
			return false
		}
	}
	return true
}

func isNameChars(s string) bool {
	for i := 0; i < len(s); i++ {
		c := s[i]
		if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '.' || c == '_' || c == '-') {
			return false
		}
	}
	return true
}

// plainHTTPHint turns the TLS error of an HTTPS request answered in plain
// HTTP (an http:// server given as host:port) into ErrConfig naming the
// fix, instead of a TLS record error every request would repeat (and
// uploads retry).
type plainHTTPHint struct {
	next     http.RoundTripper
	endpoint string // Config.Endpoint as given
	host     string // its host:port
}

func (p plainHTTPHint) RoundTrip(r *http.Request) (*http.Response, error) {
	resp, err := p.next.RoundTrip(r)
	var re tls.RecordHeaderError
	if err != nil && errors.As(err, &re) && string(re.RecordHeader[:]) == "HTTP/" {
		return nil, fmt.Errorf("%w: Endpoint %q: the server answered HTTPS in plain HTTP; give a plain-HTTP server as http://%s (loopback hosts only)",
			ErrConfig, p.endpoint, p.host)
	}
	return resp, err
}

// CloseIdleConnections closes next's idle connections (Store.Close).
func (p plainHTTPHint) CloseIdleConnections() {
	if c, ok := p.next.(interface{ CloseIdleConnections() }); ok {
		c.CloseIdleConnections()
	}
}

// serverClock remembers the Date header of the store's latest response, so
// that remote GC compares object mtimes (the store's clock) with the
// store's own clock, not this machine's.
type serverClock struct {
	next http.RoundTripper
	mu   sync.Mutex
	last time.Time // latest Date seen; zero before the first response
}

func (s *serverClock) RoundTrip(r *http.Request) (*http.Response, error) {
	resp, err := s.next.RoundTrip(r)
	if err == nil {
		if t, perr := http.ParseTime(resp.Header.Get("Date")); perr == nil {
			s.mu.Lock()
			if t.After(s.last) {
				s.last = t
			}
			s.mu.Unlock()
		}
	}
	return resp, err
}

func (s *serverClock) now() time.Time {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.last
}
