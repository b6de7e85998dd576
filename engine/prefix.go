package engine

import (
	"context"
	"errors"
	"fmt"
	"path/filepath"
	"syscall"
	"time"

	"github.com/kvpersist/kvpersist/engine/jobs"
	"github.com/kvpersist/kvpersist/engine/layout"
	"github.com/kvpersist/kvpersist/engine/metrics/labels"
	"github.com/kvpersist/kvpersist/engine/pagecache"
	"github.com/kvpersist/kvpersist/engine/store"
	"github.com/kvpersist/kvpersist/engine/tier"
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

// preparePrefix validates a prefix request's namespace name on the
// submitting goroutine (ErrPath) and scopes the job to it. ok is false for
// other requests. The namespace is resolved, once, by the job
// (jobs.SavePrefix, jobs.LoadPrefix).
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
	if err := layout.ValidName("namespace", ns); err != nil {
		return true, fmt.Errorf("%w: %w", ErrPath, err)
	}
	j.ref = Ref{Namespace: ns}
	j.ns = []string{ns}
	return true, nil
}

// executePrefix runs a prefix job, one call into jobs each, and keeps the
// index current: a save's keys are added once durable; a load adds the
// pages it found and removes the first one it found missing (removed
// behind the index's back) if it is still absent
// (pageindex.Index.RemoveIfGone). A namespace directory that is a symlink
// or not a directory is ErrPath, as at Submit for other jobs.
func (e *Engine) executePrefix(ctx context.Context, cfg *jobs.Config, req Request, res *Result) (ok bool, err error) {
	switch r := req.(type) {
	case *SavePrefixRequest:
		// The page cache reserves room for the new pages before the save
		// creates any file (jobs.Admission: the one call back).
		adm := &pageAdmission{pc: e.pc}
		cfg.Admission = adm
		res.Prefix, res.Metrics, err = jobs.SavePrefix(ctx, cfg, r)
		if err == nil { // announced while the reservation holds the pages
			e.chainStored(r.Namespace, r.Identity, r.PageTokens, r.Tokens, res.Prefix.Keys, res.Prefix.Failed)
		}
		adm.settle(err)
		if err == nil {
			stored := res.Prefix.Stored() // without the pages that failed
			e.pages.Add(r.Namespace, stored...)
			if e.tier != nil { // write-behind: never blocks
				e.tier.Saved(r.Namespace, stored)
			}
		}
	case *LoadPrefixRequest:
		// The load's page source pins the prompt's stored pages for the
		// load's duration (a bad request pins nothing: the load reports
		// it) and, with the remote tier, fetches the remote pages after
		// the local prefix, handing each to the load once published
		// (tier.LoadSource); Finish releases the pins and joins the
		// fetch.
		src := tier.NewLoadSource(e.pc, e.tier)
		res.Prefix, res.Metrics, err = jobs.LoadPrefix(ctx, cfg, r, src)
		var loaded []layout.PageKey
		if res.Prefix != nil {
			loaded = res.Prefix.Keys
		}
		res.Remote = src.Finish(loaded, err == nil)
		if err == nil {
			e.pages.Add(r.Namespace, res.Prefix.Keys...)
			if errors.Is(res.Prefix.Stop, jobs.ErrCorrupt) {
				e.dropCorruptPage(ctx, cfg, r, src.Chain().Keys, res.Prefix.Tokens)
			}
			if k := res.Prefix.Missing; k != nil {
				e.forgetIfGone(r.Namespace, *k)
			}
		}
	default:
		return false, nil
	}
	if errors.Is(err, store.ErrNamespace) {
		err = fmt.Errorf("%w: %w", ErrPath, err)
	}
	return true, err
}

// pageAdmission is a page save's jobs.Admission: the page cache's
// reservation for its pages (pagecache.Cache.Reserve), settled by the engine
// once the save returned.
type pageAdmission struct {
	pc   *pagecache.Cache
	a    *pagecache.Admission
	keys []layout.PageKey
}

// Admit reserves room for the save's pages (see pagecache.Cache.Reserve).
// Called again, it replaces an admission whose Confirm failed.
func (pa *pageAdmission) Admit(ctx context.Context, n *store.Namespace, keys, parents []layout.PageKey, fileBytes []int64) error {
	if pa.a != nil {
		pa.a.Settle(pagecache.ErrPinLost)
		pa.a = nil
	}
	a, err := pa.pc.Reserve(ctx, n, keys, parents, func(i int) (int64, error) { return fileBytes[i], nil }, false)
	if err != nil {
		a.Release()
		return err
	}
	pa.a, pa.keys = a, keys
	return nil
}

// Confirm checks, under n's shared lock, that the pages the admission
// found stored are still there (pagecache.Admission.Confirm).
func (pa *pageAdmission) Confirm(n *store.Namespace) bool {
	return pa.a == nil || pa.a.Confirm()
}

// settle ends the reservation once the save returned with err (nothing
// when the save was refused before it was admitted).
func (pa *pageAdmission) settle(err error) {
	if pa.a != nil {
		pa.a.Settle(err)
	}
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
	if removed {
		if s := e.sink(); s != nil {
			s.Removed(ns, key)
		}
	}
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
		// A fan-out that is a symlink or no directory holds no page of
		// ns, whatever a path through it finds.
		if errors.Is(n.Store().CheckRealDir(filepath.Dir(path)), store.ErrNamespace) {
			return true
		}
		_, err := fsys.Lstat(path)
		// ENOTDIR: its fan-out directory is not one (a stray file).
		return vfs.IsNotExist(err) || errors.Is(err, syscall.ENOTDIR)
	}
	e.pages.RemoveIfGone(ns, key, gone)
	if gone() {
		e.pc.RemovedBehind(ns, key)
		if e.tier != nil {
			e.tier.Forget(ns, key)
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
	pageTokens, start, err := e.lookupStart(namespace, pageTokens)
	if err != nil {
		return 0, err
	}
	n, last, err := e.pages.LookupDeepest(namespace, identity, pageTokens, tokens)
	e.lookupDone(namespace, start, n, last, len(tokens), err)
	return n, err
}

// lookupStart checks a lookup's namespace and returns its page size (0:
// layout.DefaultPageTokens) and its start time (zero without
// Config.Metrics).
func (e *Engine) lookupStart(namespace string, pageTokens int) (int, time.Time, error) {
	if err := layout.ValidName("namespace", namespace); err != nil {
		return 0, time.Time{}, fmt.Errorf("%w: %w", ErrPath, err)
	}
	if pageTokens == 0 {
		pageTokens = layout.DefaultPageTokens
	}
	var start time.Time
	if e.cfg.Metrics != nil {
		start = time.Now()
	}
	return pageTokens, start, nil
}

// lookupDone records a lookup that found n of total tokens, last its
// deepest page: the access to last, and with Config.Metrics the job and
// its tokens hit and missed.
func (e *Engine) lookupDone(namespace string, start time.Time, n int, last layout.PageKey, total int, err error) {
	if n > 0 {
		e.pc.TouchLookup(namespace, last)
	}
	if m := e.cfg.Metrics; m != nil {
		m.Job(labels.KindLookup, labels.OutcomeOf(err), time.Since(start), true)
		if err == nil {
			m.Lookup(int64(n), int64(total-n))
		}
	}
}

// executeWrite runs a write. A layout.Pages write's pages go through the
// page cache's reservation (its jobs.Admission) like a prefix save's, are
// indexed once durable, and stay pinned for as long as the manifest
// exists; a write of another layout over a page manifest drops that
// manifest's pins.
func (e *Engine) executeWrite(ctx context.Context, cfg *jobs.Config, w *jobs.WriteRequest, res *Result) error {
	adm := &pageAdmission{pc: e.pc}
	if w.Layout == layout.Pages {
		cfg.Admission = adm
	}
	var err error
	res.Header, res.Metrics, err = jobs.Write(ctx, cfg, w)
	if err == nil && w.Layout == layout.Pages {
		e.chainStored(w.Namespace, w.Identity, w.PageTokens, w.Tokens, adm.keys, nil)
	}
	adm.settle(err)
	if err != nil {
		return err
	}
	if w.Layout != layout.Pages {
		e.pc.SetManifest(w.Namespace, w.Name, nil)
		return nil
	}
	e.pages.Add(w.Namespace, adm.keys...)
	e.pc.SetManifest(w.Namespace, w.Name, adm.keys)
	if e.tier != nil { // the pages, then the manifest
		e.tier.ManifestWritten(w.Ref, adm.keys)
	}
	return nil
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
		e.pc.Resync(ns)
	}
}
