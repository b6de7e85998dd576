package engine

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"time"

	"github.com/kvpersist/kvpersist/engine/jobs"
	"github.com/kvpersist/kvpersist/engine/layout"
	"github.com/kvpersist/kvpersist/engine/metrics/labels"
	"github.com/kvpersist/kvpersist/engine/pagecache"
	"github.com/kvpersist/kvpersist/engine/remote"
	"github.com/kvpersist/kvpersist/engine/store"
	"github.com/kvpersist/kvpersist/engine/vfs"
)

// The object-store tier's one fetcher: the existence check (lookup) and
// the fetch pipeline (fetchRun) serve prefix loads (readThrough, through
// the load's jobs.PageSource: loadSource) and named reads of page
// manifests (fetchNamedPages) alike. See ARCHITECTURE.md, "Read-through".

// lookup is the tier's one existence check: it asks the store about the
// pages keys[ask[0]], keys[ask[1]], ... of namespace ns, in that order,
// Store.Concurrency (t.window) per round trip (one HEAD each, all in
// flight at once), and stops after the first round trip that finds one
// missing: n pages cost at most ceil(n/Concurrency) round trips (a
// 32,768-token prompt at 256 tokens per page: 128 pages, at most 8 round
// trips at the default Concurrency of 16), and one when the first is
// missing. objs[a] is what the store's HEAD said of keys[ask[a]] (size,
// ETag; the zero Object: missing), for the pages asked: fewer than
// len(ask) when it stopped early or failed. Every round trip counts in
// rep.PagesAsked and in the metrics (RemoteLookup latency and outcome,
// pages hit and missed).
func (t *tier) lookup(ctx context.Context, ns string, keys []layout.PageKey, ask []int, rep *RemoteReport) (objs []remote.Object, err error) {
	for w := 0; w < len(ask); w += t.window {
		part := ask[w:min(len(ask), w+t.window)]
		names := make([]string, len(part))
		for a, pos := range part {
			if names[a], err = t.st.PageName(ns, keys[pos].String()); err != nil {
				return objs, err
			}
		}
		began := time.Now()
		got, err := t.st.StatAll(ctx, names)
		m := t.metrics()
		if err != nil {
			if m != nil {
				m.Remote(labels.RemoteLookup, labels.RemoteError, 0, time.Since(began))
			}
			return objs, err
		}
		rep.PagesAsked += len(names)
		hits := 0
		for _, o := range got {
			if o.Name != "" {
				hits++
			}
		}
		if m != nil {
			m.Remote(labels.RemoteLookup, labels.RemoteOK, 0, time.Since(began))
			m.RemoteLookup(int64(hits), int64(len(names)-hits))
		}
		objs = append(objs, got...)
		if hits < len(names) {
			break
		}
	}
	return objs, nil
}

// remoteCandidates returns the keys of a chain (keys, a prompt's) after
// the local prefix (per the index), up to where the store lacks one, and
// which of them are in the local tier already: lookup of the keys the
// index lacks. A leaf (the partial last page) counts only when every full
// page before it is stored, as in Lookup.
//
// start is the position in keys of the first candidate (the first key the
// index lacks); cands are keys[start:start+len(cands)]; objs[c] is what the
// store's HEAD said of cands[c] (size, ETag), the zero Object for a local
// one. The remote candidates are marked known stored. A lookup error is
// rep.Err (the candidates are those before the round trip that failed).
func (t *tier) remoteCandidates(ctx context.Context, ns string, keys []layout.PageKey, rep *RemoteReport) (start int, cands []layout.PageKey, local []bool, objs []remote.Object) {
	for start < len(keys) && t.e.pages.Has(ns, keys[start]) {
		start++
	}
	isLocal := make([]bool, len(keys))
	var ask []int
	for i := start; i < len(keys); i++ {
		if isLocal[i] = t.e.pages.Has(ns, keys[i]); !isLocal[i] {
			ask = append(ask, i)
		}
	}
	got, err := t.lookup(ctx, ns, keys, ask, rep)
	if err != nil {
		rep.Err = err
	}
	found := make(map[int]remote.Object, len(got))
	for a, o := range got {
		if o.Name != "" {
			found[ask[a]] = o
		}
	}
	for i := start; i < len(keys); i++ {
		o, ok := found[i]
		if !isLocal[i] && !ok {
			break
		}
		if !isLocal[i] {
			rep.PagesFound++
			t.markKnown(ns, keys[i])
		}
		cands = append(cands, keys[i])
		local = append(local, isLocal[i])
		objs = append(objs, o)
	}
	return start, cands, local, objs
}

// readThrough starts the fetch of the pages of a prefix load's chain ch
// (checked and keyed by the load, jobs.LoadPrefix) after the local prefix
// that the store holds: remoteCandidates, then, for those not local, the
// namespace's directories (prepareDirs) and a fetchRun that keeps each
// published page's descriptor for the load (loadSource hands them over in
// chain order). It returns nil when nothing is to be fetched (every page
// local, none remote, or the lookup or the directories failed: rep.Err).
// Each fetched page is verified against the key chain the prompt implies
// and its tensor hashes, and enters the bounded page cache as a save's
// pages do, pinned for the load (see fetchRun). The prefix the load can
// see ends at the first page that is missing remotely, finds no room,
// fails to fetch or fails verification (reported in the RemoteReport,
// never an error of the load).
func (t *tier) readThrough(ctx context.Context, ch *jobs.PageChain, rep *RemoteReport) *fetchRun {
	ns, keys := ch.NS.Name(), ch.Keys
	if t.e.pages.Present(ns, keys) == len(keys) {
		return nil // every page is local
	}
	first, cands, local, objs := t.remoteCandidates(ctx, ns, keys, rep)
	var fetch []int // positions in keys
	var fobjs []remote.Object
	for c := range cands {
		if !local[c] {
			fetch = append(fetch, first+c)
			fobjs = append(fobjs, objs[c])
		}
	}
	if len(fetch) == 0 {
		return nil
	}
	if err := t.prepareDirs(ctx, ch.NS, keys, fetch); err != nil {
		rep.Err = err
		return nil
	}
	p, tokens := ch.PageTokens, ch.Tokens
	want := func(pos int) *layout.Page {
		return &layout.Page{Key: keys[pos], Parent: ch.Parent(pos), Identity: ch.Identity, PageTokens: p,
			Tokens: tokens[pos*p : min(len(tokens), (pos+1)*p)]}
	}
	return t.startFetch(ctx, ch.NS, want, fetch, fobjs, true, false)
}

// fetchRun is one run of the tier's fetch pipeline: the pages at
// positions fetch of a chain of namespace n, objects objs (from lookup),
// each fetched into a temp file beside its local path, verified against
// want(pos) (the page the chain expects there) and its tensor hashes, and
// published (fetchPage), inside its admission (pagecache.Cache.AdmitHeld: its
// object's size reserved against the capacity, the quotas and the
// headroom, victims evicted first, the page committed with its st_blocks
// and pinned). The reservations are taken one after another in chain order
// (a page reserves once the one before it has its room), so a fetch that
// cannot get room stops the chain there: that page and every later one
// are not fetched (nothing of them is written; its error is errors.Is
// ErrNoSpace, theirs errNotFetched). FetchPages GETs are in flight at
// once: a page gives its GET token back as soon as its bytes are in the
// temp file, and verifies and publishes (fdatasync, rename, directory
// fsync) while the next pages' GETs run (2×FetchPages workers). With
// stopOnError, a page whose fetch failed stops the pages not started yet
// too (a named read needs them all). The run's workers are joined by wait.
type fetchRun struct {
	t           *tier
	n           *store.Namespace
	want        func(pos int) *layout.Page
	fetch       []int
	objs        []remote.Object
	keep        bool // keep each published page's descriptor and header (take)
	stopOnError bool

	// decided[f] is closed once page f's reservation is decided (its write
	// began, or admit failed before it); page f+1 reserves only after it,
	// and not at all once a reservation found no room (noRoom). done[f] is
	// closed once page f is published, or failed.
	decided, done []chan struct{}
	gets          chan struct{} // a token per GET in flight
	wg            sync.WaitGroup

	mu     sync.Mutex
	next   int // the next page a worker takes
	noRoom bool
	failed bool // a page failed (stopOnError)
	errs   []error
	sizes  []int64
	rds    []vfs.File         // keep: page f's read-only descriptor, until taken
	heads  []*layout.Snapshot // keep: page f's header as the stream decoded it, or nil
	lost   []error            // keep: page f verified, then its publish failed with this
	held   []layout.PageKey
}

// startFetch starts a fetchRun (see fetchRun; want, fetch, objs, keep,
// stopOnError as there).
func (t *tier) startFetch(ctx context.Context, n *store.Namespace, want func(int) *layout.Page, fetch []int, objs []remote.Object, keep, stopOnError bool) *fetchRun {
	k := len(fetch)
	fr := &fetchRun{t: t, n: n, want: want, fetch: fetch, objs: objs, keep: keep, stopOnError: stopOnError,
		decided: make([]chan struct{}, k), done: make([]chan struct{}, k), gets: make(chan struct{}, t.fetchPages),
		errs: make([]error, k), sizes: make([]int64, k), rds: make([]vfs.File, k), heads: make([]*layout.Snapshot, k),
		lost: make([]error, k)}
	for f := range k {
		fr.decided[f] = make(chan struct{})
		fr.done[f] = make(chan struct{})
	}
	for range min(2*t.fetchPages, k) {
		fr.wg.Go(func() {
			for {
				fr.mu.Lock()
				f := fr.next
				fr.next++
				fr.mu.Unlock()
				if f >= k {
					return
				}
				fr.page(ctx, f)
			}
		})
	}
	return fr
}

// page fetches page f of the run (a worker's).
func (fr *fetchRun) page(ctx context.Context, f int) {
	t, pos := fr.t, fr.fetch[f]
	want := fr.want(pos)
	var once sync.Once
	decide := func() { once.Do(func() { close(fr.decided[f]) }) }
	defer close(fr.done[f])
	fr.mu.Lock()
	skip := fr.stopOnError && fr.failed
	fr.mu.Unlock()
	if skip {
		decide()
		fr.mu.Lock()
		fr.errs[f] = errNotFetched
		fr.mu.Unlock()
		return
	}
	wrote := false
	fileBytes := func(int) (int64, error) {
		if f > 0 {
			select {
			case <-fr.decided[f-1]:
			case <-ctx.Done():
				return 0, ctx.Err()
			}
		}
		fr.mu.Lock()
		stop := fr.noRoom
		fr.mu.Unlock()
		if stop {
			return 0, errNotFetched
		}
		return fr.objs[f].Size, nil
	}
	var verified func(vfs.File, *layout.Snapshot)
	if fr.keep {
		verified = func(rd vfs.File, head *layout.Snapshot) {
			fr.mu.Lock()
			fr.rds[f], fr.heads[f] = rd, head
			fr.mu.Unlock()
		}
	}
	var size int64
	h, err := t.e.pc.AdmitHeld(ctx, fr.n, []layout.PageKey{want.Key}, []layout.PageKey{want.Parent}, fileBytes, func() error {
		// The GET token is taken before the next page may reserve, so
		// pages take tokens in chain order.
		select {
		case fr.gets <- struct{}{}:
		case <-ctx.Done():
			return ctx.Err()
		}
		var once sync.Once
		release := func() { once.Do(func() { <-fr.gets }) }
		defer release()
		wrote = true
		decide()
		var err error
		size, err = t.fetchPage(ctx, fr.n, want, fr.objs[f], release, verified)
		return err
	})
	decide()
	fr.mu.Lock()
	defer fr.mu.Unlock()
	if err != nil && !wrote {
		fr.noRoom = true // no room (or no reservation): later pages are not fetched
	}
	if err != nil {
		fr.failed = true
	}
	fr.held = append(fr.held, h...)
	fr.errs[f], fr.sizes[f] = err, size
	if (err != nil || size == 0) && fr.rds[f] != nil {
		// Verified but not published: the load's prefix ends before it.
		fr.lost[f] = cmp.Or(err, errNotPublished)
		fr.rds[f].Close()
		fr.rds[f], fr.heads[f] = nil, nil
	}
}

// take hands over page f's descriptor and header (keep), once done[f] is
// closed: nil when the page was not published by this run, and then lost
// is why when it verified but its publish failed.
func (fr *fetchRun) take(f int) (rd vfs.File, head *layout.Snapshot, lost error) {
	fr.mu.Lock()
	defer fr.mu.Unlock()
	rd, head, lost = fr.rds[f], fr.heads[f], fr.lost[f]
	fr.rds[f], fr.heads[f] = nil, nil
	return rd, head, lost
}

// errNotPublished: a fetched page that verified was not published.
var errNotPublished = errors.New("engine: fetched page not published")

// wait joins the run's workers and closes the descriptors not taken. It
// counts what was fetched in rep, logs each page not fetched, and returns
// the pins taken for the caller (every page committed; the caller releases
// them when its read ends) and the first failure, naming the page (nil when
// every page was fetched, or found local meanwhile).
func (fr *fetchRun) wait(rep *RemoteReport, keys []layout.PageKey) (held []layout.PageKey, first error) {
	fr.wg.Wait()
	t, ns := fr.t, fr.n.Name()
	notFetched := 0
	for f, pos := range fr.fetch {
		if fr.rds[f] != nil {
			fr.rds[f].Close()
			fr.rds[f] = nil
		}
		if err := fr.errs[f]; err != nil {
			if errors.Is(err, errNotFetched) {
				notFetched++
				continue
			}
			if first == nil {
				first = fmt.Errorf("engine: remote page %d (%s) of namespace %s: %w", pos, keys[pos], ns, err)
			}
			t.e.logSafe(slog.LevelWarn, "kvpersist: remote page not fetched", "namespace", ns, "page", keys[pos].String(), "err", err)
			continue
		}
		if fr.sizes[f] > 0 {
			rep.PagesFetched++ // published even past a failed page: each is valid alone
			rep.BytesFetched += fr.sizes[f]
		}
	}
	if notFetched > 0 {
		t.e.logSafe(slog.LevelWarn, "kvpersist: remote pages not fetched after a page that failed or found no room", "namespace", ns, "pages", notFetched)
	}
	return fr.held, first
}

// errNotFetched: a page after one whose reservation failed (or, for a
// named read, after one that failed); never sent.
var errNotFetched = errors.New("engine: not fetched: an earlier page of the chain found no room or failed")

// loadSource is the jobs.PageSource of one prefix load: the local page
// files, and with a remote tier the pages its readThrough fetches, each
// handed over once published (verified: not hashed again), while later
// pages are still being fetched. It holds the load's pins: the stored
// pages of the chain pinned at Start, extended as the load reaches local
// pages past them, and the fetched pages pinned at their commit; finish
// releases them once the load has returned.
type loadSource struct {
	e    *Engine
	ch   *jobs.PageChain
	pins *pagecache.LoadPins
	rep  *RemoteReport // nil without a remote tier
	fr   *fetchRun     // nil when nothing is fetched
	at   map[int]int   // position in the chain -> index in fr.fetch
}

func (e *Engine) newLoadSource() *loadSource {
	s := &loadSource{e: e}
	if e.tier != nil {
		s.rep = &RemoteReport{}
	}
	return s
}

// Start pins the stored pages of the chain (a bad request never gets
// here: it pins nothing) and starts the read-through.
func (s *loadSource) Start(ctx context.Context, ch *jobs.PageChain) {
	s.ch = ch
	s.pins = s.e.pc.PinChain(ch.NS.Name(), ch.Keys)
	if s.e.tier == nil {
		return
	}
	if s.fr = s.e.tier.readThrough(ctx, ch, s.rep); s.fr != nil {
		s.at = make(map[int]int, len(s.fr.fetch))
		for f, pos := range s.fr.fetch {
			s.at[pos] = f
		}
	}
}

// Page hands over page i: a fetched page once its fetch ended (its
// descriptor when published; why not, when it verified and its publish
// failed; else the local file), a local one at once.
func (s *loadSource) Page(ctx context.Context, i int, wait bool) (jobs.SourcePage, bool) {
	f, fetched := s.at[i]
	if !fetched {
		if i >= s.pins.Pinned() {
			s.pins.Extend() // pages the read-through committed, and stored ones after them
		}
		return jobs.SourcePage{}, true
	}
	select {
	case <-s.fr.done[f]:
	default:
		if !wait {
			return jobs.SourcePage{}, false
		}
		select {
		case <-s.fr.done[f]:
		case <-ctx.Done():
			return jobs.SourcePage{}, true
		}
	}
	rd, head, lost := s.fr.take(f)
	if lost != nil {
		return jobs.SourcePage{Err: fmt.Errorf("not published: %w", lost)}, true
	}
	if rd == nil {
		return jobs.SourcePage{}, true
	}
	return jobs.SourcePage{File: rd, Head: head, Verified: true}, true
}

// finish ends the load's use of the source, once the load returned
// (loaded: the keys it loaded; ok: it succeeded): it joins the fetch
// workers, counts what they did in the report, and releases every pin
// (after a successful load touching the pages loaded). It returns the
// load's RemoteReport (nil without a remote tier).
func (s *loadSource) finish(loaded []layout.PageKey, ok bool) *RemoteReport {
	if s.fr != nil {
		held, err := s.fr.wait(s.rep, s.ch.Keys)
		if s.rep.Err == nil {
			s.rep.Err = err
		}
		s.pins.Hold(held)
	}
	if s.pins != nil {
		s.pins.Done(loaded, ok)
	}
	return s.rep
}
