package engine

import (
	"context"
	"errors"
	"fmt"
	"syscall"
	"time"

	"github.com/kvpersist/kvpersist/engine/evict"
	"github.com/kvpersist/kvpersist/engine/jobs"
	"github.com/kvpersist/kvpersist/engine/layout"
	"github.com/kvpersist/kvpersist/engine/metrics/labels"
	"github.com/kvpersist/kvpersist/engine/vfs"
)

// The prefix cache's request types and report, as aliases (see api.go).
type (
	// SavePrefixRequest saves the token pages of a KV cache (see
	// jobs.SavePrefixRequest); its report is Result.Prefix.
	SavePrefixRequest = jobs.SavePrefixRequest
	// LoadPrefixRequest loads the longest stored prefix of a prompt (see
	// jobs.LoadPrefixRequest); its report is Result.Prefix.
	LoadPrefixRequest = jobs.LoadPrefixRequest
	// PrefixResult reports a prefix save or load: pages and bytes written
	// and reused, tokens loaded, why a load stopped.
	PrefixResult = jobs.PrefixResult
)

// Pages is the layout of a named save whose cache is stored as token pages
// shared with the prefix cache (WriteRequest.Identity, Tokens and
// PageTokens).
const Pages = layout.Pages

// Sentinel errors of the prefix cache, re-exported for errors.Is.
var (
	// ErrMissingPage: a page named by a page manifest does not exist.
	ErrMissingPage = jobs.ErrMissingPage
	// ErrIdentity: an identity is empty or longer than 4,096 bytes.
	ErrIdentity = layout.ErrIdentity
	// ErrPageTokens: a page size is not a power of two from 16 to 4,096.
	ErrPageTokens = layout.ErrPageTokens
)

// The prefix cache through the engine: SavePrefixRequest and
// LoadPrefixRequest are jobs like the others (mailbox, dispatcher, pool,
// one ack after the last touch of the caller's views); Lookup answers from
// the engine's in-memory index (pageindex) on the caller's goroutine.
//
// Ordering: a prefix job is scoped to its namespace and has no path. It
// never runs beside a collect or a migrate of its namespace (each waits for
// the other, in submission order); prefix jobs run beside each other and
// beside writes and reads (two saves of one page write the same bytes; the
// later rename wins). A load has a read's priority.

// preparePrefix validates a prefix request's namespace on the submitting
// goroutine and scopes the job to it. ok is false for other requests.
func (e *Engine) preparePrefix(j *job, req Request) (ok bool, err error) {
	var ns string
	switch r := req.(type) {
	case *SavePrefixRequest:
		if r == nil {
			return true, fmt.Errorf("%w: nil *SavePrefixRequest", ErrPath)
		}
		j.kind, ns = KindSavePrefix, r.Namespace
	case *LoadPrefixRequest:
		if r == nil {
			return true, fmt.Errorf("%w: nil *LoadPrefixRequest", ErrPath)
		}
		j.kind, ns = KindLoadPrefix, r.Namespace
	default:
		return false, nil
	}
	if _, err := e.nsDir(ns); err != nil {
		return true, err
	}
	j.ref = Ref{Namespace: ns}
	j.ns = []string{ns}
	return true, nil
}

// nsDir resolves a namespace's directory: ErrPath for an invalid name or a
// namespace directory that is a symlink or not a directory.
func (e *Engine) nsDir(ns string) (string, error) {
	n, err := e.store.Namespace(ns)
	if err != nil {
		return "", fmt.Errorf("%w: %w", ErrPath, err)
	}
	if err := n.Check(); err != nil {
		return "", fmt.Errorf("%w: %w", ErrPath, err)
	}
	return n.Dir(), nil
}

// executePrefix runs a prefix job and keeps the index current: a save's
// keys are added once durable; a load adds the pages it found and removes
// the first one it found missing (removed behind the index's back) if it
// is still absent (pageindex.Index.RemoveIfGone).
func (e *Engine) executePrefix(ctx context.Context, cfg *jobs.Config, req Request, res *Result) (ok bool, err error) {
	switch r := req.(type) {
	case *SavePrefixRequest:
		if _, err = e.nsDir(r.Namespace); err != nil {
			return true, err
		}
		// Checked and keyed first, so that the page cache can reserve
		// room for the new pages before any file is created (admit).
		var plan *jobs.PagePlan
		if plan, err = jobs.PlanPrefixSave(r); err != nil {
			return true, err
		}
		err = e.pc.admit(ctx, r.Namespace, plan.Keys, plan.Parents, plan.FileBytes, func() error {
			var serr error
			res.Prefix, res.Metrics, serr = jobs.SavePlannedPrefix(ctx, cfg, plan) // keyed once
			return serr
		})
		if err == nil {
			stored := res.Prefix.Stored() // without the pages that failed
			e.pages.Add(r.Namespace, stored...)
			if e.tier != nil { // write-behind: never blocks (remote_tier.go)
				e.tier.saved(r.Namespace, stored)
			}
		}
	case *LoadPrefixRequest:
		// ErrPath for a namespace that is not a real directory, as for
		// saves (LoadPrefix itself would say ErrInvalidRequest).
		if _, err = e.nsDir(r.Namespace); err != nil {
			return true, err
		}
		// The pages of the prompt that are stored are pinned for the
		// load's duration (a bad request pins nothing: the load reports it).
		// Pages the read-through fetches are pinned at their commit, and
		// the chain's pins are extended over them before the load reads;
		// all are released when the load ends.
		// The prompt's page keys, hashed once for the pins, the
		// read-through and the load (nil for a bad identity or page
		// size: the load reports it).
		keys, _, kerr := layout.PageChain(r.Identity, pageTokensOf(r.PageTokens), r.Tokens)
		var pins *loadPins
		if kerr == nil {
			pins = e.pc.pinChain(r.Namespace, keys)
			defer func() {
				var loaded []layout.PageKey
				if res.Prefix != nil {
					loaded = res.Prefix.Keys
				}
				pins.done(loaded, err == nil)
			}()
		}
		var verified func(layout.PageKey) bool
		var sc *jobs.PrefixScatter
		if e.tier != nil { // read-through: remote pages into the local tier first
			// The fetched pages that begin the chain are scattered into
			// the destinations as they are published (a request that
			// fails the load's checks scatters nothing: the load says why).
			if kerr == nil {
				sc, _ = jobs.NewPrefixScatter(cfg, r, keys)
			}
			var held []evict.Key
			var fetched map[layout.PageKey]bool
			res.Remote, held, fetched = e.tier.readThrough(ctx, r.Namespace, r.Identity, r.PageTokens, r.Tokens, keys, sc)
			if len(fetched) > 0 {
				// Verified by the fetch a moment ago: not hashed again.
				verified = func(k layout.PageKey) bool { return fetched[k] }
			}
			if pins != nil {
				pins.hold(held)
				pins.extend()
			} else {
				_ = e.pc.pol.UnpinAll(r.Namespace, held)
			}
		}
		res.Prefix, res.Metrics, err = jobs.LoadPrefixScattered(ctx, cfg, r, keys, verified, sc)
		if err == nil {
			e.pages.Add(r.Namespace, res.Prefix.Keys...)
			if errors.Is(res.Prefix.Stop, jobs.ErrCorrupt) {
				e.dropCorruptPage(ctx, cfg, r, keys, res.Prefix.Tokens)
			}
			if k := res.Prefix.Missing; k != nil {
				e.forgetIfGone(r.Namespace, *k)
			}
		}
	default:
		return false, nil
	}
	return true, err
}

func pageTokensOf(p int) int {
	if p == 0 {
		return layout.DefaultPageTokens
	}
	return p
}

// corruptPageWait bounds how long a load that found a corrupt page waits
// for its namespace's exclusive lock to remove it (saves and loads of the
// namespace hold it shared).
const corruptPageWait = 2 * time.Second

// dropCorruptPage handles a load whose prefix ended at a corrupt page (the
// page after its loaded tokens; keys are the prompt's page keys): the page is removed from the disk if it
// is still corrupt under the namespace's exclusive lock
// (jobs.RemoveCorruptPage, waiting at most corruptPageWait), so that the
// next save writes it again (a save reuses a page whose header is right
// without reading its data), and dropped from the index, so that Lookup
// stops counting it. When the lock could not be had in time, or the file
// could not be checked, the key is dropped from the index all the same
// (the next load that meets the page tries again); a page found whole
// again (rewritten by a save meanwhile) stays. The load's own result is
// not changed by any of this; failures are logged.
func (e *Engine) dropCorruptPage(ctx context.Context, cfg *jobs.Config, r *LoadPrefixRequest, keys []layout.PageKey, loaded int) {
	p := pageTokensOf(r.PageTokens)
	if loaded%p != 0 || loaded/p >= len(keys) {
		return
	}
	e.dropCorrupt(ctx, cfg, r.Namespace, keys[loaded/p], "kvpersist: a load found a corrupt page")
}

// dropCorrupt is dropCorruptPage's removal of page key of ns (found
// corrupt by a load, or by an upload's verification: removeCorruptPage);
// msg is the warning logged when it fails.
func (e *Engine) dropCorrupt(ctx context.Context, cfg *jobs.Config, ns string, key layout.PageKey, msg string) {
	wctx, cancel := context.WithTimeout(ctx, corruptPageWait)
	defer cancel()
	removed, err := jobs.RemoveCorruptPage(wctx, cfg, ns, key)
	if err != nil {
		e.log.Warn(msg, "namespace", ns, "key", key.String(), "removed", removed, "err", err)
		if !removed {
			e.pages.Remove(ns, key)
			return
		}
	}
	// Removed, gone, or whole again: the index and the accounting follow
	// the disk.
	e.forgetIfGone(ns, key)
}

// removeCorruptPage handles a page whose upload found its local file
// corrupt (remote.ErrSourceCorrupt; it was not uploaded) as a load
// finding it would (dropCorruptPage): removed if still corrupt under the
// namespace's exclusive lock (waiting at most corruptPageWait, on the
// uploader's goroutine), so that the next save writes it again and
// uploads it. It runs from the uploader's OnDone, which runs until Close
// has every upload done or abandoned, so the engine's store is open.
func (e *Engine) removeCorruptPage(ns string, key layout.PageKey) {
	cfg := e.jcfg
	cfg.Spawn = nil // the uploader's goroutine does the check alone
	e.dropCorrupt(context.Background(), &cfg, ns, key, "kvpersist: an upload found a corrupt local page")
}

// forgetIfGone drops page key of namespace ns from the index and from the
// page cache's accounting when its file is absent (a save beside this may
// have published it again since a load missed it: then both keep it).
// The two are checked separately: a page can be accounted without being
// indexed (a corrupt page whose removal failed once is dropped from the
// index but stays on disk; the load that later removes it must still take
// it out of the accounting).
func (e *Engine) forgetIfGone(ns string, key layout.PageKey) {
	n, err := e.store.Namespace(ns)
	if err != nil {
		return
	}
	path, fsys := n.PagePath(key), e.store.FS()
	gone := func() bool {
		_, err := fsys.Lstat(path)
		// ENOTDIR: its fan-out directory is not one (a stray file).
		return vfs.IsNotExist(err) || errors.Is(err, syscall.ENOTDIR)
	}
	e.pages.RemoveIfGone(ns, key, gone)
	if gone() {
		e.pc.removedBehind(ns, key)
		if e.tier != nil {
			e.tier.forget(ns, key)
		}
	}
}

// Lookup returns the length, in tokens, of the longest prefix of tokens
// stored in the prefix cache of namespace for identity and pageTokens (0
// means layout.DefaultPageTokens), from the engine's index: a multiple of
// pageTokens, or len(tokens) when the last, partial page was stored with
// exactly the remaining tokens. It runs on the caller's goroutine without
// I/O or allocation, and records an access to the deepest page it found
// for the page cache's eviction order (queued, applied by the engine's
// background goroutine; no lock of the policy is taken here). With
// Config.Metrics it counts a lookup job and its tokens hit and missed. The index reflects this engine's saves and what was
// on disk when it started; a page another process removed since is found
// missing by LoadPrefix (which then loads less, without error).
//
// Errors: ErrPath (invalid namespace), layout.ErrIdentity,
// layout.ErrPageTokens.
func (e *Engine) Lookup(namespace, identity string, pageTokens int, tokens []uint32) (int, error) {
	if err := layout.ValidName("namespace", namespace); err != nil {
		return 0, fmt.Errorf("%w: %w", ErrPath, err)
	}
	if pageTokens == 0 {
		pageTokens = layout.DefaultPageTokens
	}
	m := e.cfg.Metrics
	var start time.Time
	if m != nil {
		start = time.Now()
	}
	n, last, err := e.pages.LookupDeepest(namespace, identity, pageTokens, tokens)
	if n > 0 {
		e.pc.touchLookup(namespace, last)
	}
	if m != nil {
		m.Job(labels.KindLookup, labels.OutcomeOf(err), time.Since(start), true)
		if err == nil {
			m.Lookup(int64(n), int64(len(tokens)-n))
		}
	}
	return n, err
}

// executeWrite runs a write. A layout.Pages write's pages go through the
// page cache's reservation (admit) like a prefix save's, are indexed once
// durable, and stay pinned for as long as the manifest exists; a write of
// another layout over a page manifest drops that manifest's pins.
func (e *Engine) executeWrite(ctx context.Context, cfg *jobs.Config, w *jobs.WriteRequest, res *Result) error {
	write := func() (err error) {
		res.Header, res.Metrics, err = jobs.Write(ctx, cfg, w)
		return err
	}
	if w.Layout != layout.Pages {
		err := write()
		if err == nil {
			e.pc.setManifest(w.Namespace, w.Name, nil)
		}
		return err
	}
	plan, perr := planPagesWrite(w)
	if perr != nil {
		return write() // the write refuses the request, naming the problem
	}
	err := e.pc.admit(ctx, w.Namespace, plan.Keys, plan.Parents, plan.FileBytes, write)
	if err == nil {
		e.pages.Add(w.Namespace, plan.Keys...)
		e.pc.setManifest(w.Namespace, w.Name, evictKeys(plan.Keys))
		if e.tier != nil { // the pages, then the manifest (remote_tier.go)
			e.tier.manifestWritten(w.Ref, plan.Keys)
		}
	}
	return err
}

// resyncAfterCollect resyncs the page cache's accounting of the collected
// namespaces (all of them for nil).
func (e *Engine) resyncAfterCollect(names []string) {
	if names == nil {
		var err error
		if names, _, err = e.store.Namespaces(false); err != nil {
			return
		}
	}
	for _, ns := range names {
		e.pc.resync(ns)
	}
}
