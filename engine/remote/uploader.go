package remote

import (
	"context"
	"crypto/md5"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"sync"
	"time"
)

// ReadAtCloser is an upload's source, e.g. the local tier's *os.File.
type ReadAtCloser interface {
	io.ReaderAt
	io.Closer
}

// Upload is one object to copy to the store. The queue holds only this
// descriptor, never the bytes: Open is called for every attempt and the
// body is streamed from what it returns, so the local file stays the one
// copy and the uploader's memory does not grow with queued bytes.
type Upload struct {
	Name string                       // object name (Store.PageName, Store.ManifestName)
	Size int64                        // bytes
	Open func() (ReadAtCloser, error) // the source; an error is permanent (the local file is gone)
	// Wait, if set, is called once by the worker before the first attempt,
	// with a context cancelled when Close gives up; an error ends the
	// upload (reported to OnDone; ErrAbandoned when that context ended).
	// A manifest waits here for the pages it names: queue them before it,
	// so that they leave the queue first (FIFO) and Wait never waits for
	// an upload queued behind it.
	Wait func(ctx context.Context) error
	// Verify, if set, checks the source before every PUT (after the
	// StatFirst HEAD found no object), reading it through the very
	// ReadAtCloser the PUT then streams, so the bytes sent are the bytes
	// verified (Open of a local file returns its open descriptor: a file
	// renamed over the path meanwhile is not what is sent). An error ends
	// the upload at once, nothing sent, with an error wrapping
	// ErrSourceCorrupt: a create-only object is never replaced, so a
	// corrupt one would block the right bytes for every machine.
	Verify VerifyFunc
	// Stored, if set (with StatFirst), repairs a corrupt object: when the
	// HEAD finds an object under the name whose ETag is an MD5 (a single
	// PUT's, 32 hex digits) other than the source's, or whose size
	// differs, Stored checks it (Store.CheckStoredPage for a page). nil
	// keeps it: another writer's good bytes (create-only). An error
	// wrapping ErrCorrupt has it replaced by the source, once the source
	// passed Verify, conditional on the object's ETag (Store.Replace;
	// UploadResult.Replaced). Another error fails the attempt (retried).
	// An object whose ETag is not an MD5 (multipart, some server-side
	// encryption) is kept unchecked: finding it corrupt takes a full
	// fetch (kvpersist verify --remote).
	Stored func(ctx context.Context, o Object) error
}

// UploadResult reports one finished (or given up) upload to OnDone.
type UploadResult struct {
	Name     string
	Created  bool  // false with Err nil: the object already existed
	Bytes    int64 // bytes sent by the successful attempt
	Attempts int
	Err      error // nil, ErrAbandoned (Close's context ended), ErrConflict, ErrSourceCorrupt (Verify failed), or the source's error
	// Existing is the object found when Created is false and Err is nil
	// (its ModTime says how close it is to remote GC's grace period).
	Existing Object
	// Replaced: the upload replaced a stored object that did not verify
	// (Upload.Stored); Created is true too.
	Replaced bool
}

// UploaderConfig bounds an Uploader.
type UploaderConfig struct {
	// Workers: uploads in flight at once (goroutines owned by the
	// Uploader). Default 4.
	Workers int
	// QueueLen: uploads waiting; Enqueue beyond it fails with
	// ErrQueueFull instead of blocking. Default 4096.
	QueueLen int
	// BackoffMin, BackoffMax: the wait after a failed attempt starts at
	// BackoffMin and doubles to BackoffMax (full jitter). Defaults 100 ms
	// and 5 s.
	BackoffMin, BackoffMax time.Duration
	// OnDone, if set, is called once per upload that leaves the queue, on
	// the worker's goroutine (keep it short).
	OnDone func(UploadResult)
	// OnRetry, if set, is called after each failed attempt that will be
	// retried (a transient error: the network, a 5xx, or the credentials
	// or bucket refused, which a fix of the store may cure), on the
	// worker's goroutine (keep it short): name, the attempts so far and
	// the attempt's error.
	OnRetry func(name string, attempts int, err error)
	// StatFirst makes every attempt HEAD the object before its PUT: an
	// object already stored with the upload's size is reported existing
	// without sending its bytes (a create-only PUT sends the whole body
	// before the store can answer 412). For uploaders whose objects are
	// often already stored, e.g. pages shared by many machines.
	StatFirst bool
}

// UploaderStats are counters since the Uploader started.
type UploaderStats struct {
	Queued, InFlight                  int // now
	Created, Existed, Failed, Retries int64
	Abandoned                         int64
	BytesUploaded                     int64
}

// Uploader copies objects to the store in the background, create-only,
// with bounded concurrency (Workers) and memory (a queue of descriptors),
// retrying each failed attempt with backoff until it succeeds, fails
// permanently (its source cannot be opened or fails Upload.Verify,
// ErrConflict) or Close's context ends. Enqueue never blocks, and the
// Uploader shares nothing with Fetch or Exists, so uploads never block
// reads. Transient errors (network,
// 5xx, the server down) are retried indefinitely: the local tier still has
// the bytes.
type Uploader struct {
	store *Store
	cfg   UploaderConfig

	ctx    context.Context // cancelled when Close gives up
	cancel context.CancelFunc
	queue  chan Upload
	wg     sync.WaitGroup

	mu      sync.Mutex
	closing bool
	names   map[string]bool // queued or in flight, so a name is uploaded once at a time
	stats   UploaderStats
	lastErr error // the last failed attempt's error, for Close's
}

// NewUploader starts cfg.Workers goroutines; Close stops them.
func NewUploader(store *Store, cfg UploaderConfig) (*Uploader, error) {
	if cfg.Workers == 0 {
		cfg.Workers = 4
	}
	if cfg.QueueLen == 0 {
		cfg.QueueLen = 4096
	}
	if cfg.BackoffMin == 0 {
		cfg.BackoffMin = 100 * time.Millisecond
	}
	if cfg.BackoffMax == 0 {
		cfg.BackoffMax = 5 * time.Second
	}
	if cfg.Workers < 1 || cfg.QueueLen < 1 || cfg.BackoffMin <= 0 || cfg.BackoffMax < cfg.BackoffMin {
		return nil, fmt.Errorf("%w: uploader Workers %d, QueueLen %d, backoff %v..%v", ErrConfig, cfg.Workers, cfg.QueueLen, cfg.BackoffMin, cfg.BackoffMax)
	}
	u := &Uploader{store: store, cfg: cfg, queue: make(chan Upload, cfg.QueueLen), names: map[string]bool{}}
	u.ctx, u.cancel = context.WithCancel(context.Background())
	for range cfg.Workers {
		u.wg.Go(u.work)
	}
	return u, nil
}

// Enqueue queues up without blocking. A name already queued or in flight
// is accepted and not queued twice. Errors: ErrQueueFull, ErrClosed,
// ErrConfig (no Open or a negative Size).
func (u *Uploader) Enqueue(up Upload) error {
	if up.Open == nil || up.Size < 0 || up.Name == "" {
		return fmt.Errorf("%w: upload %q needs a Name, Size >= 0 and Open", ErrConfig, up.Name)
	}
	u.mu.Lock()
	defer u.mu.Unlock()
	if u.closing {
		return ErrClosed
	}
	if u.names[up.Name] {
		return nil
	}
	select {
	case u.queue <- up:
		u.names[up.Name] = true
		u.stats.Queued++
		return nil
	default:
		return fmt.Errorf("%w: %d uploads waiting", ErrQueueFull, cap(u.queue))
	}
}

// QueueLen is the queue's capacity (UploaderConfig.QueueLen after its
// default): Enqueue fails with ErrQueueFull when that many uploads wait.
func (u *Uploader) QueueLen() int { return cap(u.queue) }

// Stats returns the counters.
func (u *Uploader) Stats() UploaderStats {
	u.mu.Lock()
	defer u.mu.Unlock()
	return u.stats
}

// Close stops accepting uploads and waits until every queued upload has
// finished. If ctx ends first, uploads in flight are cancelled, the rest
// of the queue is abandoned (each reported to OnDone with ErrAbandoned)
// and Close returns an error wrapping ErrAbandoned, ctx's error and the
// last failed attempt's error (why they had not finished: errors.Is finds
// ErrCredentials, say), after every worker has returned. Nothing local is
// touched either way.
func (u *Uploader) Close(ctx context.Context) error {
	u.mu.Lock()
	if !u.closing {
		u.closing = true
		close(u.queue) // workers drain what is left, then return
	}
	u.mu.Unlock()
	done := make(chan struct{})
	go func() { u.wg.Wait(); close(done) }()
	select {
	case <-done:
		u.cancel()
		return nil
	case <-ctx.Done():
		u.cancel()
		<-done
	}
	if n := u.Stats().Abandoned; n > 0 {
		u.mu.Lock()
		last := u.lastErr
		u.mu.Unlock()
		if last != nil { // why they did not finish: the store's answer
			return fmt.Errorf("%w: %d uploads: %w; the last failed attempt: %w", ErrAbandoned, n, context.Cause(ctx), last)
		}
		return fmt.Errorf("%w: %d uploads: %w", ErrAbandoned, n, context.Cause(ctx))
	}
	return nil
}

func (u *Uploader) work() {
	for up := range u.queue {
		u.mu.Lock()
		u.stats.Queued--
		u.stats.InFlight++
		u.mu.Unlock()
		res := u.upload(up)
		u.mu.Lock()
		u.stats.InFlight--
		delete(u.names, up.Name)
		switch {
		case errors.Is(res.Err, ErrAbandoned):
			u.stats.Abandoned++
		case res.Err != nil:
			u.stats.Failed++
		case res.Created:
			u.stats.Created++
			u.stats.BytesUploaded += res.Bytes
		default:
			u.stats.Existed++
		}
		u.mu.Unlock()
		if u.cfg.OnDone != nil {
			u.cfg.OnDone(res)
		}
	}
}

// upload runs attempts of up until one succeeds, fails permanently, or the
// uploader's context is cancelled.
func (u *Uploader) upload(up Upload) UploadResult {
	res := UploadResult{Name: up.Name}
	if up.Wait != nil {
		if err := up.Wait(u.ctx); err != nil {
			if u.ctx.Err() != nil {
				err = fmt.Errorf("%w: %s before its first attempt: %w", ErrAbandoned, up.Name, err)
			}
			res.Err = err
			return res
		}
	}
	wait := u.cfg.BackoffMin
	for {
		if u.ctx.Err() != nil {
			res.Err = fmt.Errorf("%w: %s after %d attempts", ErrAbandoned, up.Name, res.Attempts)
			return res
		}
		res.Attempts++
		src, err := up.Open()
		if err != nil {
			res.Err = fmt.Errorf("remote: upload %s: opening the source: %w", up.Name, err)
			return res
		}
		var pr PutResult
		if u.cfg.StatFirst {
			var o Object
			if o, err = u.store.Stat(u.ctx, up.Name); err == nil {
				pr, err = u.existing(up, src, o)
			} else if errors.Is(err, ErrNotFound) {
				pr, err = u.put(up, src)
			}
		} else {
			pr, err = u.put(up, src)
		}
		src.Close()
		if err == nil {
			res.Created, res.Bytes, res.Existing, res.Replaced = pr.Created, pr.Bytes, pr.Existing, pr.Replaced
			return res
		}
		if errors.Is(err, ErrConflict) || errors.Is(err, ErrBadName) || errors.Is(err, ErrConfig) || errors.Is(err, ErrSourceCorrupt) {
			res.Err = err
			return res
		}
		if u.ctx.Err() != nil {
			continue // cancelled by Close: abandoned at the loop's top
		}
		u.mu.Lock()
		u.stats.Retries++
		u.lastErr = err
		u.mu.Unlock()
		if u.cfg.OnRetry != nil {
			u.cfg.OnRetry(up.Name, res.Attempts, err)
		}
		t := time.NewTimer(rand.N(wait) + time.Millisecond)
		select {
		case <-t.C:
		case <-u.ctx.Done():
			t.Stop()
		}
		wait = min(2*wait, u.cfg.BackoffMax)
	}
}

// existing decides about the object o that the HEAD found under up's
// name: kept (reported existing) when it holds the source's bytes, as far
// as its ETag can tell, or passes up.Stored; replaced by src (verified
// first) when up.Stored finds it corrupt; ErrConflict when it has another
// size and is not found corrupt.
func (u *Uploader) existing(up Upload, src ReadAtCloser, o Object) (PutResult, error) {
	conflict := func() (PutResult, error) {
		return PutResult{}, &OpError{Op: "put", Name: up.Name, Err: fmt.Errorf("%w: stored %d bytes, ours %d", ErrConflict, o.Size, up.Size)}
	}
	if up.Stored == nil || !isMD5(o.ETag) {
		if o.Size != up.Size {
			return conflict()
		}
		return PutResult{Existing: o}, nil
	}
	if o.Size == up.Size {
		sum, err := md5Of(src, up.Size)
		if err != nil {
			return PutResult{}, fmt.Errorf("remote: upload %s: reading the source: %w", up.Name, err)
		}
		if sum == o.ETag {
			return PutResult{Existing: o}, nil
		}
	}
	err := up.Stored(u.ctx, o)
	switch {
	case err == nil && o.Size != up.Size:
		return conflict()
	case err == nil:
		return PutResult{Existing: o}, nil
	case !errors.Is(err, ErrCorrupt):
		return PutResult{}, err
	}
	if up.Verify != nil {
		if verr := up.Verify(src, up.Size); verr != nil {
			return PutResult{}, fmt.Errorf("%w: %s not uploaded over a corrupt object: %w", ErrSourceCorrupt, up.Name, verr)
		}
	}
	return u.store.Replace(u.ctx, up.Name, o.ETag, src, up.Size)
}

// isMD5 reports whether an ETag is an MD5 in hex (a single PUT's, on S3
// without SSE-KMS and on SeaweedFS), so comparable with the source's.
func isMD5(etag string) bool {
	if len(etag) != 32 {
		return false
	}
	for i := range len(etag) {
		if c := etag[i]; (c < '0' || c > '9') && (c < 'a' || c > 'f') {
			return false
		}
	}
	return true
}

// md5Of is the MD5, in lowercase hex, of the size bytes of r.
func md5Of(r io.ReaderAt, size int64) (string, error) {
	h := md5.New()
	if _, err := io.Copy(h, io.NewSectionReader(r, 0, size)); err != nil {
		return "", err
	}
	return hex.EncodeToString(h.Sum(nil)), nil
}

// put verifies src (up.Verify, when set) and, if it passes, PUTs it
// create-only: the PUT reads the same src the check read.
func (u *Uploader) put(up Upload, src ReadAtCloser) (PutResult, error) {
	if up.Verify != nil {
		if err := up.Verify(src, up.Size); err != nil {
			return PutResult{}, fmt.Errorf("%w: %s not uploaded: %w", ErrSourceCorrupt, up.Name, err)
		}
	}
	return u.store.Put(u.ctx, up.Name, src, up.Size)
}
