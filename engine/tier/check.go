package tier

import (
	"context"
	"errors"
	"log/slog"
	"sync"
	"time"

	"github.com/kvpersist/kvpersist/engine/layout"
	"github.com/kvpersist/kvpersist/engine/remote"
)

// remoteCheckBudget bounds the remote tier's check at New: a store that
// does not answer within it (down, unreachable) is logged, not fatal.
const remoteCheckBudget = 5 * time.Second

// checkRemote asks the store, once at New, whether it takes the
// credentials and holds the bucket: a refusal (remote.ErrCredentials,
// ErrNoBucket, ErrAccessDenied) fails New, since no upload or fetch could
// ever succeed; a store that does not answer is logged and the tier
// starts (its uploads retry, its fetches miss).
func (t *Tier) checkRemote() error {
	st := t.st
	ctx, cancel := context.WithTimeout(context.Background(), remoteCheckBudget)
	defer cancel()
	err := st.Check(ctx)
	if err == nil || errors.Is(err, remote.ErrCredentials) || errors.Is(err, remote.ErrNoBucket) || errors.Is(err, remote.ErrAccessDenied) {
		return err
	}
	t.d.Log(slog.LevelWarn, "kvpersist: remote tier: the object store did not answer its check at start; uploads retry until it does", "bucket", st.Bucket(), "err", err)
	return nil
}

// retryLogEvery is the shortest time between two log lines about failed
// upload attempts (each attempt is counted in the metrics).
const retryLogEvery = time.Minute

// uploadRetried returns the uploader's OnRetry: each failed attempt
// counts in RemoteUploadRetried, and one line per retryLogEvery at most
// says which upload failed and why, with how many were not logged since.
func (t *Tier) uploadRetried() func(name string, attempts int, err error) {
	var mu sync.Mutex
	var last time.Time
	var quiet int
	return func(name string, attempts int, err error) {
		if m := t.metrics(); m != nil {
			m.RemoteUploadRetried()
		}
		mu.Lock()
		now := time.Now()
		if !last.IsZero() && now.Sub(last) < retryLogEvery {
			quiet++
			mu.Unlock()
			return
		}
		n := quiet
		last, quiet = now, 0
		mu.Unlock()
		t.d.Log(slog.LevelWarn, "kvpersist: upload to the object store failed; retrying", "object", name, "attempts", attempts, "err", err, "failedAttemptsNotLogged", n)
	}
}

// storedPage is the Upload.Stored of page k: a page object found stored
// under its name with bytes other than the local page's is fetched once
// and checked (remote.Store.CheckStoredPage); one that does not verify is
// replaced by the local page (which the upload verifies first), a good
// one (another writer's bytes of the same page) is kept. A page the tier
// knows stored is not uploaded again until Config.RefreshAge has
// passed, so that is when a save of it repairs its object at the latest.
func (t *Tier) storedPage(k layout.PageKey) func(context.Context, remote.Object) error {
	key := k.String()
	return func(ctx context.Context, o remote.Object) error { return t.st.CheckStoredPage(ctx, o, key) }
}
