package remote

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strings"
	"sync"
	"time"

	"github.com/minio/minio-go/v7"
	"github.com/minio/minio-go/v7/pkg/credentials"

	"github.com/kvpersist/kvpersist/engine/layout"
)

// PagesDirName is the element between a namespace and the fan-out
// directories of its pages, locally and remotely.
const PagesDirName = "pages"

// Store is one bucket and prefix of an S3-compatible object store. It is
// safe for concurrent use and starts no goroutine that outlives a call.
type Store struct {
	cfg    Config
	client *minio.Client
	core   minio.Core
	clock  *serverClock
}

// New checks cfg and returns a Store. It sends no request to the store (the
// bucket is first used by the first call). Credentials: cfg's, else the
// environment's (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY,
// AWS_SESSION_TOKEN), else the profile AWS_PROFILE (default "default") of
// the AWS shared files ($AWS_SHARED_CREDENTIALS_FILE or
// ~/.aws/credentials, and $AWS_CONFIG_FILE or ~/.aws/config), read by
// minio-go as the AWS CLI does (static keys, credential_process or SSO).
// Errors wrap ErrConfig.
func New(cfg Config) (*Store, error) {
	c := cfg.withDefaults()
	host, secure, err := c.endpoint()
	if err != nil {
		return nil, err
	}
	if c.Bucket == "" {
		return nil, fmt.Errorf("%w: Bucket is empty", ErrConfig)
	}
	if !validPrefix(c.Prefix) {
		return nil, fmt.Errorf("%w: Prefix %q: want '/'-separated elements of [A-Za-z0-9._-], no empty, '.' or '..' element", ErrConfig, c.Prefix)
	}
	creds := credentials.NewStaticV4(c.AccessKey, c.SecretKey, c.SessionToken)
	if c.AccessKey == "" || c.SecretKey == "" {
		// The AWS shared files, as the AWS CLI reads them.
		creds = credentials.NewFileAWSCredentials("", "")
		if v, err := creds.Get(); err != nil || v.AccessKeyID == "" {
			if err == nil {
				err = errors.New("no access key in the profile")
			}
			return nil, fmt.Errorf("%w: no credentials (set AccessKey and SecretKey, or %s and %s, or a profile in the AWS shared credentials file: %v)", ErrConfig, EnvAccessKey, EnvSecretKey, err)
		}
	}
	if c.Concurrency < 1 || c.FetchChunkBytes < 1 || c.MaxObjectBytes < 1 || c.MaxRetries < 1 {
		return nil, fmt.Errorf("%w: Concurrency, FetchChunkBytes, MaxObjectBytes and MaxRetries must be positive", ErrConfig)
	}
	region := c.Region
	if region == "" {
		region = "us-east-1" // known, so the client never asks for the bucket's location
	}
	next := c.Transport
	if next == nil {
		t, err := minio.DefaultTransport(secure)
		if err != nil {
			return nil, fmt.Errorf("%w: %v", ErrConfig, err)
		}
		t.MaxIdleConnsPerHost = max(c.Concurrency, 16)
		next = t
	}
	if secure {
		next = plainHTTPHint{next: next, endpoint: c.Endpoint, host: host}
	}
	clock := &serverClock{next: next}
	cl, err := minio.New(host, &minio.Options{
		Creds:        creds,
		Secure:       secure,
		Transport:    clock,
		Region:       region,
		BucketLookup: minio.BucketLookupPath,
		MaxRetries:   c.MaxRetries,
	})
	if err != nil {
		return nil, fmt.Errorf("%w: %v", ErrConfig, err)
	}
	return &Store{cfg: c, client: cl, core: minio.Core{Client: cl}, clock: clock}, nil
}

// Close closes the store's idle connections (those of Config.Transport
// too, if it has a CloseIdleConnections method). Calls in flight are not
// affected; the Store stays usable.
func (s *Store) Close() {
	if c, ok := s.clock.next.(interface{ CloseIdleConnections() }); ok {
		c.CloseIdleConnections()
	}
}

// Bucket is the store's bucket.
func (s *Store) Bucket() string { return s.cfg.Bucket }

// Client is the underlying minio client (benchmarks compare against it).
func (s *Store) Client() *minio.Client { return s.client }

func (s *Store) join(rest string) string {
	if s.cfg.Prefix == "" {
		return rest
	}
	return s.cfg.Prefix + "/" + rest
}

// NamespacePrefix is "<prefix>/<ns>/": every object of namespace ns starts
// with it.
func (s *Store) NamespacePrefix(ns string) (string, error) {
	if err := layout.ValidName("namespace", ns); err != nil {
		return "", fmt.Errorf("%w: %v", ErrBadName, err)
	}
	return s.join(ns + "/"), nil
}

// PageName is the object name of page key (64 lowercase hex digits) of
// namespace ns: "<prefix>/<ns>/pages/<key[0:2]>/<key>". Errors wrap
// ErrBadName.
func (s *Store) PageName(ns, key string) (string, error) {
	p, err := s.NamespacePrefix(ns)
	if err != nil {
		return "", err
	}
	if !layout.ValidBlockHash(key) {
		return "", fmt.Errorf("%w: page key %q (want 64 lowercase hex digits)", ErrBadName, key)
	}
	return p + PagesDirName + "/" + key[:2] + "/" + key, nil
}

// ManifestName is the object name of manifest name of namespace ns:
// "<prefix>/<ns>/<name>", name as layout.ValidName accepts and not
// "pages". Errors wrap ErrBadName.
func (s *Store) ManifestName(ns, name string) (string, error) {
	p, err := s.NamespacePrefix(ns)
	if err != nil {
		return "", err
	}
	if err := layout.ValidName("manifest", name); err != nil || name == PagesDirName {
		return "", fmt.Errorf("%w: manifest name %q", ErrBadName, name)
	}
	return p + name, nil
}

// Object describes one stored object.
type Object struct {
	Name    string    // full object name
	Size    int64     // bytes
	ETag    string    // the store's entity tag, quotes removed
	ModTime time.Time // last modification by the store's clock (1 s resolution)
}

func isNotFound(err error) bool {
	r := minio.ToErrorResponse(err)
	return r.StatusCode == http.StatusNotFound || r.Code == "NoSuchKey" || r.Code == "NotFound"
}

func isPrecondition(err error) bool {
	r := minio.ToErrorResponse(err)
	return r.StatusCode == http.StatusPreconditionFailed || r.Code == "PreconditionFailed"
}

func opErr(op, name string, err error) error {
	if err == nil {
		return nil
	}
	if cause := causeOf(err); cause != nil {
		err = fmt.Errorf("%w (%v)", cause, err)
	} else if isNotFound(err) {
		err = fmt.Errorf("%w (%v)", ErrNotFound, err)
	}
	return &OpError{Op: op, Name: name, Err: err}
}

// causeOf is the sentinel of an S3 error response that no retry can fix:
// ErrCredentials, ErrNoBucket or ErrAccessDenied; nil for any other.
func causeOf(err error) error {
	r := minio.ToErrorResponse(err)
	switch r.Code {
	case "InvalidAccessKeyId", "SignatureDoesNotMatch", "InvalidToken", "ExpiredToken", "InvalidSecurity":
		return ErrCredentials
	case "NoSuchBucket":
		return ErrNoBucket
	case "AccessDenied":
		return ErrAccessDenied
	}
	if r.StatusCode == http.StatusForbidden {
		return ErrAccessDenied
	}
	return nil
}

// Check sends one request (a listing of at most one object under the
// store's prefix) to find out, before anything is uploaded, whether the
// store takes the credentials and holds the bucket. Errors: ErrCredentials
// (an unknown access key, a wrong secret key), ErrNoBucket, ErrAccessDenied
// (the credentials may not list the bucket), each naming the bucket and
// endpoint; any other (the store unreachable, a server error) is the
// request's *OpError, which a caller may take as transient.
func (s *Store) Check(ctx context.Context) error {
	var err error
	for info := range s.client.ListObjectsIter(ctx, s.cfg.Bucket, minio.ListObjectsOptions{Prefix: s.join(""), MaxKeys: 1}) {
		err = info.Err
		break // one page of the listing answers the question
	}
	if err == nil {
		return nil
	}
	if cause := causeOf(err); cause != nil {
		return fmt.Errorf("%w: bucket %q at %s: %v", cause, s.cfg.Bucket, s.cfg.Endpoint, err)
	}
	return opErr("list", s.join(""), err)
}

// Stat returns the object's size, ETag and mtime (one HEAD request).
// A missing object is an error wrapping ErrNotFound.
func (s *Store) Stat(ctx context.Context, name string) (Object, error) {
	info, err := s.client.StatObject(ctx, s.cfg.Bucket, name, minio.StatObjectOptions{})
	if err != nil {
		return Object{}, opErr("stat", name, err)
	}
	return Object{Name: name, Size: info.Size, ETag: strings.Trim(info.ETag, `"`), ModTime: info.LastModified}, nil
}

// PutResult says what a create-only Put did.
type PutResult struct {
	// Created: this call wrote the object. False: an object already
	// existed under the name (and had the same size); nothing was written.
	Created bool
	// Bytes sent in the request body (0 when the object existed).
	Bytes int64
	// Existing is the object found when Created is false (its ModTime
	// tells the caller how close it is to remote GC's grace period).
	Existing Object
	// Replaced: Created by Replace, over an object that did not verify.
	Replaced bool
}

// Put uploads the size bytes of r as object name, create-only: the request
// carries If-None-Match: *, so an existing object is never overwritten
// (the store answers 412 and Put reports Created=false). An existing
// object of another size is ErrConflict: the bytes under one name must
// never differ. The body is streamed from r (section readers, re-read on a
// retry); Put holds no copy of it. One PUT request (no multipart), so
// objects are limited to the store's single-PUT size (5 GiB on AWS).
func (s *Store) Put(ctx context.Context, name string, r io.ReaderAt, size int64) (PutResult, error) {
	if size < 0 {
		return PutResult{}, fmt.Errorf("%w: put %s: negative size %d", ErrConfig, name, size)
	}
	opts := minio.PutObjectOptions{DisableMultipart: true, ContentType: "application/octet-stream"}
	opts.SetMatchETagExcept("*")
	_, err := s.client.PutObject(ctx, s.cfg.Bucket, name, io.NewSectionReader(r, 0, size), size, opts)
	if err == nil {
		return PutResult{Created: true, Bytes: size}, nil
	}
	if !isPrecondition(err) {
		return PutResult{}, opErr("put", name, err)
	}
	o, serr := s.Stat(ctx, name)
	if serr != nil {
		return PutResult{}, serr
	}
	if o.Size != size {
		return PutResult{}, &OpError{Op: "put", Name: name, Err: fmt.Errorf("%w: stored %d bytes, ours %d", ErrConflict, o.Size, size)}
	}
	return PutResult{Existing: o}, nil
}

// Replace uploads the size bytes of r as object name over the object
// stored there, only if that object's ETag is still etag (If-Match): the
// repair of an object found not to verify, which create-only Put never
// replaces. When the object changed since (another writer replaced it, or
// deleted it: a 412 or 404) nothing is written and the object now stored
// is reported as existing (Created false; a deleted one is ErrNotFound).
func (s *Store) Replace(ctx context.Context, name, etag string, r io.ReaderAt, size int64) (PutResult, error) {
	if size < 0 || etag == "" {
		return PutResult{}, fmt.Errorf("%w: replace %s: size %d, ETag %q", ErrConfig, name, size, etag)
	}
	opts := minio.PutObjectOptions{DisableMultipart: true, ContentType: "application/octet-stream"}
	opts.SetMatchETag(etag)
	_, err := s.client.PutObject(ctx, s.cfg.Bucket, name, io.NewSectionReader(r, 0, size), size, opts)
	if err == nil {
		return PutResult{Created: true, Bytes: size, Replaced: true}, nil
	}
	if !isPrecondition(err) && !isNotFound(err) {
		return PutResult{}, opErr("put", name, err)
	}
	o, serr := s.Stat(ctx, name)
	if serr != nil {
		return PutResult{}, serr
	}
	return PutResult{Existing: o}, nil
}

// Refresh renews the mtime of an existing object without changing its
// bytes: a server-side copy onto itself (one request, no data through this
// machine) that replaces its metadata, conditional on its ETag still being
// etag ("" = any). An uploader that found a page present with an mtime
// close to remote GC's grace refreshes it before naming it in a manifest
// (docs/format/bucket-layout.md, "Grace, not locks"). Returns the new
// state; a missing object is ErrNotFound, another ETag is a 412 error.
func (s *Store) Refresh(ctx context.Context, name, etag string) (Object, error) {
	src := minio.CopySrcOptions{Bucket: s.cfg.Bucket, Object: name, MatchETag: etag}
	dst := minio.CopyDestOptions{Bucket: s.cfg.Bucket, Object: name, ReplaceMetadata: true,
		UserMetadata: map[string]string{"Kvpersist-Refreshed": "1"}}
	if _, err := s.client.CopyObject(ctx, dst, src); err != nil {
		return Object{}, opErr("copy", name, err)
	}
	return s.Stat(ctx, name)
}

// Delete removes object name (one DELETE request; a missing object is not
// an error, as S3 defines it). Only Collect and operators call it.
func (s *Store) Delete(ctx context.Context, name string) error {
	return opErr("delete", name, s.client.RemoveObject(ctx, s.cfg.Bucket, name, minio.RemoveObjectOptions{}))
}

// Exists reports for each name whether the object exists. It sends one HEAD
// per name with at most Config.Concurrency in flight, so n names cost n
// requests and about ceil(n/Concurrency) round-trip times: a 32,768-token
// prompt at 256 tokens per page is 128 page keys, 8 round trips at the
// default Concurrency of 16 (S3 has no multi-key HEAD; listing the fan-out
// directories would cost one LIST per distinct k[0:2], about as many
// requests, each returning every page of its directory). The first error
// other than not-found ends the batch and is returned.
func (s *Store) Exists(ctx context.Context, names []string) ([]bool, error) {
	objs, err := s.StatAll(ctx, names)
	out := make([]bool, len(names))
	for i, o := range objs {
		out[i] = o.Name != ""
	}
	return out, err
}

// StatAll is Exists returning what each HEAD said: objs[i] is names[i]'s
// size, ETag and mtime, or the zero Object (Name "") when it does not
// exist. Same requests, bounds and errors as Exists. A caller that fetches
// the objects next passes them to FetchObject (no second HEAD), and knows
// each object's size before it reserves room for it.
func (s *Store) StatAll(ctx context.Context, names []string) ([]Object, error) {
	out := make([]Object, len(names))
	err := s.each(ctx, len(names), func(ctx context.Context, i int) error {
		info, err := s.client.StatObject(ctx, s.cfg.Bucket, names[i], minio.StatObjectOptions{})
		switch {
		case err == nil:
			out[i] = Object{Name: names[i], Size: info.Size, ETag: strings.Trim(info.ETag, `"`), ModTime: info.LastModified}
		case isNotFound(err):
		default:
			return opErr("stat", names[i], err)
		}
		return nil
	})
	return out, err
}

// each runs fn(ctx, i) for i in [0, n) on at most Concurrency goroutines
// it owns and joins; the first error cancels the rest and is returned.
func (s *Store) each(ctx context.Context, n int, fn func(ctx context.Context, i int) error) error {
	ctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	var (
		wg   sync.WaitGroup
		mu   sync.Mutex
		next int
		ferr error
	)
	for range min(n, s.cfg.Concurrency) {
		wg.Go(func() {
			for {
				mu.Lock()
				i := next
				next++
				stop := ferr != nil || i >= n
				mu.Unlock()
				if stop {
					return
				}
				if ctx.Err() != nil {
					s.fail(&mu, &ferr, cancel, context.Cause(ctx))
					return
				}
				if err := fn(ctx, i); err != nil {
					s.fail(&mu, &ferr, cancel, err)
					return
				}
			}
		})
	}
	wg.Wait()
	return ferr
}

func (s *Store) fail(mu *sync.Mutex, ferr *error, cancel context.CancelCauseFunc, err error) {
	mu.Lock()
	if *ferr == nil {
		*ferr = err
	}
	mu.Unlock()
	cancel(err)
}

// WriterReaderAt is a fetch destination: typically a temp file beside the
// local tier's target.
type WriterReaderAt interface {
	io.WriterAt
	io.ReaderAt
}

// VerifyFunc checks a fetched object's size bytes, readable from r. It
// returns nil if the bytes are what the caller expected (e.g. a page whose
// header, hashes and key chain verify). Any error makes Fetch fail with
// ErrCorrupt.
type VerifyFunc func(r io.ReaderAt, size int64) error

// Fetch copies object name into dst[0:size) and verifies it, returning
// size. It stats the object (one HEAD), refuses one larger than
// MaxObjectBytes (ErrTooLarge) before writing anything, then sends ranged
// GETs of FetchChunkBytes, at most Concurrency in flight, each pinned to
// the object's ETag (If-Match), so a replaced object fails rather than
// mixing versions. Memory: Concurrency copy buffers of CopyBufferBytes,
// whatever the object's size. A range whose request or body fails is
// tried again, RangeAttempts times in all; after that its error (an
// *OpError "get") ends the fetch, and a body shorter or longer than its
// range is ErrCorrupt. A failed verify (nil verify: none) is ErrCorrupt.
// After any error dst holds unverified bytes the caller must discard. A
// missing object is ErrNotFound.
func (s *Store) Fetch(ctx context.Context, name string, dst WriterReaderAt, verify VerifyFunc) (int64, error) {
	o, err := s.Stat(ctx, name)
	if err != nil {
		return 0, err
	}
	if err := s.FetchObject(ctx, o, dst, verify); err != nil {
		return 0, err
	}
	return o.Size, nil
}

// FetchObject is Fetch of an object already statted (o from Stat or
// StatAll, o.Name set): no HEAD; the ranged GETs are pinned to o.ETag, so
// exactly o.Size bytes are written to dst or the fetch fails (an object
// replaced since the HEAD is ErrCorrupt, a deleted one ErrNotFound).
// Errors as Fetch's.
func (s *Store) FetchObject(ctx context.Context, o Object, dst WriterReaderAt, verify VerifyFunc) error {
	name := o.Name
	if o.Size > s.cfg.MaxObjectBytes {
		return &OpError{Op: "get", Name: name, Err: fmt.Errorf("%w: %d bytes > MaxObjectBytes %d", ErrTooLarge, o.Size, s.cfg.MaxObjectBytes)}
	}
	chunk := s.cfg.FetchChunkBytes
	n := int((o.Size + chunk - 1) / chunk)
	err := s.each(ctx, n, func(ctx context.Context, i int) error {
		off := int64(i) * chunk
		return s.getRange(ctx, name, o, off, min(chunk, o.Size-off), dst)
	})
	if err != nil {
		return err
	}
	if verify != nil {
		if err := verify(dst, o.Size); err != nil {
			return &OpError{Op: "get", Name: name, Err: fmt.Errorf("%w: %v", ErrCorrupt, err)}
		}
	}
	return nil
}

var copyBufs = sync.Pool{New: func() any { b := make([]byte, CopyBufferBytes); return &b }}

// RangeAttempts is how many times Fetch tries one range before failing:
// a body cut short by the network is retried after 100 ms, then 200 ms
// (minio-go retries only errors before a response arrives).
const RangeAttempts = 3

// getRange GETs bytes [off, off+n) of o into dst at off, retrying a range
// whose request or body failed; not-found, a replaced object (412) and the
// context ending are not retried.
func (s *Store) getRange(ctx context.Context, name string, o Object, off, n int64, dst io.WriterAt) error {
	wait := 100 * time.Millisecond
	for attempt := 1; ; attempt++ {
		err := s.getRangeOnce(ctx, name, o, off, n, dst)
		if err == nil || attempt == RangeAttempts || ctx.Err() != nil ||
			errors.Is(err, ErrNotFound) || errors.Is(err, errReplaced) {
			return err
		}
		t := time.NewTimer(wait)
		select {
		case <-t.C:
		case <-ctx.Done():
			t.Stop()
			return err
		}
		wait *= 2
	}
}

// errReplaced marks a range GET refused because the object's ETag changed.
var errReplaced = errors.New("object replaced during fetch")

func (s *Store) getRangeOnce(ctx context.Context, name string, o Object, off, n int64, dst io.WriterAt) error {
	var opts minio.GetObjectOptions
	if o.ETag != "" {
		if err := opts.SetMatchETag(o.ETag); err != nil {
			return &OpError{Op: "get", Name: name, Err: err}
		}
	}
	if n == 0 {
		return nil
	}
	if err := opts.SetRange(off, off+n-1); err != nil {
		return &OpError{Op: "get", Name: name, Err: err}
	}
	body, _, _, err := s.core.GetObject(ctx, s.cfg.Bucket, name, opts)
	if err != nil {
		if isPrecondition(err) {
			err = fmt.Errorf("%w: %w: %v", ErrCorrupt, errReplaced, err)
		}
		return opErr("get", name, err)
	}
	defer body.Close()
	bp := copyBufs.Get().(*[]byte)
	defer copyBufs.Put(bp)
	got, err := io.CopyBuffer(io.NewOffsetWriter(dst, off), io.LimitReader(body, n), *bp)
	if err != nil {
		return &OpError{Op: "get", Name: name, Err: err}
	}
	if got != n {
		return &OpError{Op: "get", Name: name, Err: fmt.Errorf("%w: range at %d: got %d of %d bytes", ErrCorrupt, off, got, n)}
	}
	// A body longer than its range is as wrong as a short one.
	var one [1]byte
	if k, _ := body.Read(one[:]); k != 0 {
		return &OpError{Op: "get", Name: name, Err: fmt.Errorf("%w: range at %d: more than %d bytes", ErrCorrupt, off, n)}
	}
	return nil
}

// ServerTime is the Date of the store's latest response (zero before the
// first response). Remote GC compares it, not this machine's clock, with
// object mtimes.
func (s *Store) ServerTime() time.Time { return s.clock.now() }
