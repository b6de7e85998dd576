package tier

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"path/filepath"
	"slices"
	"sync"
	"sync/atomic"
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
// the load's jobs.PageSource: LoadSource) and named reads of page
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
func (t *Tier) lookup(ctx context.Context, ns string, keys []layout.PageKey, ask []int, rep *Report) (objs []remote.Object, err error) {
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
func (t *Tier) remoteCandidates(ctx context.Context, ns string, keys []layout.PageKey, rep *Report) (start int, cands []layout.PageKey, local []bool, objs []remote.Object) {
	for start < len(keys) && t.d.Index.Has(ns, keys[start]) {
		start++
	}
	isLocal := make([]bool, len(keys))
	var ask []int
	for i := start; i < len(keys); i++ {
		if isLocal[i] = t.d.Index.Has(ns, keys[i]); !isLocal[i] {
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

// RemotePages returns how many pages of the chain keys of namespace ns
// follow its local prefix (per the index) in the local tier and the store
// together, up to the first the store lacks (remoteCandidates; what
// engine.LookupRemote counts). err is the lookup's: the pages counted are
// then those before the round trip that failed.
func (t *Tier) RemotePages(ctx context.Context, ns string, keys []layout.PageKey) (int, error) {
	var rep Report
	_, cands, _, _ := t.remoteCandidates(ctx, ns, keys, &rep)
	return len(cands), rep.Err
}

// readThrough starts the fetch of the pages of a prefix load's chain ch
// (checked and keyed by the load, jobs.LoadPrefix) after the local prefix
// that the store holds: remoteCandidates, then, for those not local, the
// namespace's directories (prepareDirs) and a fetchRun that keeps each
// published page's descriptor for the load (LoadSource hands them over in
// chain order). It returns nil when nothing is to be fetched (every page
// local, none remote, or the lookup or the directories failed: rep.Err).
// Each fetched page is verified against the key chain the prompt implies
// and its tensor hashes, and enters the bounded page cache as a save's
// pages do, pinned for the load (see fetchRun). The prefix the load can
// see ends at the first page that is missing remotely, finds no room,
// fails to fetch or fails verification (reported in the Report,
// never an error of the load).
func (t *Tier) readThrough(ctx context.Context, ch *jobs.PageChain, rep *Report) *fetchRun {
	ns, keys := ch.NS.Name(), ch.Keys
	if t.d.Index.Present(ns, keys) == len(keys) {
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
	// A fan-out path that is no directory (a stray file or symlink) fails
	// its pages alone: the load ends at the first (a Stop naming it), so
	// the pages before it are fetched and the rest are not.
	for f, pos := range fetch {
		if errors.Is(ch.NS.Store().CheckRealDir(filepath.Dir(ch.NS.PagePath(keys[pos]))), store.ErrNamespace) {
			fetch, fobjs = fetch[:f], fobjs[:f]
			break
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
	t           *Tier
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
func (t *Tier) startFetch(ctx context.Context, n *store.Namespace, want func(int) *layout.Page, fetch []int, objs []remote.Object, keep, stopOnError bool) *fetchRun {
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
	h, err := t.d.Cache.AdmitHeld(ctx, fr.n, []layout.PageKey{want.Key}, []layout.PageKey{want.Parent}, fileBytes, func() error {
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
func (fr *fetchRun) wait(rep *Report, keys []layout.PageKey) (held []layout.PageKey, first error) {
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
			t.d.Log(slog.LevelWarn, "kvpersist: remote page not fetched", "namespace", ns, "page", keys[pos].String(), "err", err)
			continue
		}
		if fr.sizes[f] > 0 {
			rep.PagesFetched++ // published even past a failed page: each is valid alone
			rep.BytesFetched += fr.sizes[f]
		}
	}
	if notFetched > 0 {
		t.d.Log(slog.LevelWarn, "kvpersist: remote pages not fetched after a page that failed or found no room", "namespace", ns, "pages", notFetched)
	}
	return fr.held, first
}

// errNotFetched: a page after one whose reservation failed (or, for a
// named read, after one that failed); never sent.
var errNotFetched = errors.New("engine: not fetched: an earlier page of the chain found no room or failed")

// LoadSource is the jobs.PageSource of one prefix load: the local page
// files, and with a remote tier the pages its readThrough fetches, each
// handed over once published (verified: not hashed again), while later
// pages are still being fetched. It holds the load's pins: the stored
// pages of the chain pinned at Start, extended as the load reaches local
// pages past them, and the fetched pages pinned at their commit; finish
// releases them once the load has returned.
type LoadSource struct {
	t    *Tier // nil without a remote tier
	pc   *pagecache.Cache
	ch   *jobs.PageChain
	pins *pagecache.LoadPins
	rep  *Report     // nil without a remote tier
	fr   *fetchRun   // nil when nothing is fetched
	at   map[int]int // position in the chain -> index in fr.fetch
}

// NewLoadSource is the page source of one prefix load on page cache pc,
// reading through t (nil: local pages only).
func NewLoadSource(pc *pagecache.Cache, t *Tier) *LoadSource {
	s := &LoadSource{t: t, pc: pc}
	if t != nil {
		s.rep = &Report{}
	}
	return s
}

// Start pins the stored pages of the chain (a bad request never gets
// here: it pins nothing) and starts the read-through.
func (s *LoadSource) Start(ctx context.Context, ch *jobs.PageChain) {
	s.ch = ch
	s.pins = s.pc.PinChain(ch.NS.Name(), ch.Keys)
	if s.t == nil {
		return
	}
	if s.fr = s.t.readThrough(ctx, ch, s.rep); s.fr != nil {
		s.at = make(map[int]int, len(s.fr.fetch))
		for f, pos := range s.fr.fetch {
			s.at[pos] = f
		}
	}
}

// Page hands over page i: a fetched page once its fetch ended (its
// descriptor when published; why not, when it verified and its publish
// failed; else the local file), a local one at once.
func (s *LoadSource) Page(ctx context.Context, i int, wait bool) (jobs.SourcePage, bool) {
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

// Chain is the chain Start was given (nil before).
func (s *LoadSource) Chain() *jobs.PageChain { return s.ch }

// Finish ends the load's use of the source, once the load returned
// (loaded: the keys it loaded; ok: it succeeded): it joins the fetch
// workers, counts what they did in the report, and releases every pin
// (after a successful load touching the pages loaded). It returns the
// load's Report (nil without a remote tier).
func (s *LoadSource) Finish(loaded []layout.PageKey, ok bool) *Report {
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

// fetchPage is the write of one fetched page's admission (it runs inside
// pagecache.Cache.AdmitHeld, room reserved): under namespace n's shared lock it
// fetches object o, the page want.Key, into a temp file beside its local
// path, verifies it and publishes it (publishFetched); it adds it to the
// index. fetched is called once the object's bytes are all in the temp
// file (the network part is over; the fetchRun's GET token is given back).
// The page is verified from the bytes as they arrive (remote.PageStream:
// header, key, every tensor's xxh3-64, its size) and against the chain
// (checkWant), so it is not read back; when the stream cannot prove it
// (bytes out of order: ranged GETs or a range retried; or a check fails)
// it is verified by reading the temp file back (verifyPage), which names
// what is wrong. The temp file's writeback is started every
// writebackBytes (kickWriter), so the fdatasync of the publish finds
// little left to write. A page that a save published since the lookup is
// not fetched (0 bytes, no error); one published meanwhile by a save is
// simply replaced by the same bytes (same key, same content).
//
// With verified non-nil, once the page's bytes verified and before its
// publish, verified is given a read-only descriptor of its temp file (the
// verification's own when it read the file back; the rename keeps it the
// same file), kept by the fetchRun to hand over to the load once the page
// is published (LoadSource), and the header the stream decoded from the
// bytes it wrote (nil when the page was verified by reading it back), so
// the load does not decode it again; it is not called for a page that did
// not verify (or whose temp file could not be opened again: then the load
// opens the published file).
func (t *Tier) fetchPage(ctx context.Context, n *store.Namespace, want *layout.Page, o remote.Object, fetched func(), verified func(vfs.File, *layout.Snapshot)) (int64, error) {
	if t.d.Index.Has(n.Name(), want.Key) {
		return 0, nil
	}
	unlock, err := n.Lock(ctx, false)
	if err != nil {
		return 0, err
	}
	defer unlock()
	start := time.Now()
	name := o.Name
	path := n.PagePath(want.Key)
	fsys := t.d.Store.FS()
	sf, err := layout.Stage(fsys, path, 0)
	if err != nil {
		return 0, err
	}
	// The writeback kicks only when the publish will fdatasync (the
	// store's sync policy, as a save's StartWriteback).
	var dst io.WriterAt = sf.File
	var kw *kickWriter
	if t.d.Store.Durable() {
		kw = newKickWriter(sf.File)
		dst = kw
	}
	stream := remote.NewPageStream(dst, want.Key.String(), o.Size)
	var rd vfs.File           // read-only, of the temp file: kept for the load
	var head *layout.Snapshot // the stream's decoded header, when it verified the page
	closeRd := func() {
		if rd != nil {
			rd.Close()
			rd = nil
		}
	}
	defer closeRd() // unless handed to verified
	err = t.st.FetchObject(ctx, o, stream, func(_ io.ReaderAt, size int64) error {
		fetched()
		if snap, ok := stream.Verified(); ok {
			head = snap
			return checkWant(name, snap.Page, want)
		}
		// The temp file is open for writing only: verify through a
		// read-only descriptor of it.
		f, err := fsys.Open(sf.Tmp)
		if err != nil {
			return err
		}
		closeRd()
		rd = f
		return verifyPage(f, name, want, size)
	})
	if kw != nil {
		kw.stop() // before the file is closed
	}
	if err == nil && verified != nil {
		if rd == nil {
			if f, oerr := fsys.Open(sf.Tmp); oerr == nil { // else the load opens the published file
				rd = f
			}
		}
		if rd != nil {
			verified(rd, head)
			rd = nil
		}
	}
	if err == nil {
		err = t.publishFetched(sf)
	} else {
		sf.Abort()
	}
	res := labels.RemoteOK
	switch {
	case errors.Is(err, remote.ErrCorrupt):
		res = labels.RemoteCorrupt
	case err != nil:
		res = labels.RemoteError
	}
	if m := t.metrics(); m != nil {
		var b int64
		if err == nil {
			b = o.Size
		}
		m.Remote(labels.RemoteFetch, res, b, time.Since(start))
	}
	if err != nil {
		return 0, err
	}
	if t.d.OnFetched != nil {
		t.d.OnFetched(n.Name(), want)
	}
	t.d.Index.Add(n.Name(), want.Key)
	t.markKnown(n.Name(), want.Key)
	return o.Size, nil
}

// writebackBytes: a fetched page's temp file has its writeback started
// (sync_file_range) each time this many more bytes were written to it.
const writebackBytes = 8 << 20

// kickWriter writes to a fetched page's temp file and has its writeback
// started every writebackBytes (vfs.File.StartWriteback, no durability
// promise: the publish's fdatasync makes it durable), so the disk writes
// while the GET still runs. sync_file_range may block when the disk's
// queue is full, so it runs on the kickWriter's own goroutine (started by
// newKickWriter, ended by stop), never on the GET's: a write only signals
// it. Safe for the concurrent writes of several ranges.
type kickWriter struct {
	f       vfs.File
	written atomic.Int64
	kick    chan struct{}
	done    chan struct{}
}

func newKickWriter(f vfs.File) *kickWriter {
	w := &kickWriter{f: f, kick: make(chan struct{}, 1), done: make(chan struct{})}
	go func() {
		defer close(w.done)
		for range w.kick {
			_ = w.f.StartWriteback(0, 0) // a hint; failures show in the fdatasync
		}
	}()
	return w
}

func (w *kickWriter) WriteAt(p []byte, off int64) (int, error) {
	n, err := w.f.WriteAt(p, off)
	if after := w.written.Add(int64(n)); after/writebackBytes != (after-int64(n))/writebackBytes {
		select {
		case w.kick <- struct{}{}:
		default: // a kick is pending: it covers these bytes too
		}
	}
	return n, err
}

// stop ends the goroutine once its pending kick ran. Called once the
// writes are over (FetchObject returned), before the file is closed.
func (w *kickWriter) stop() {
	close(w.kick)
	<-w.done
}

// publishFetched is the one place a fetched page enters the local tier:
// fdatasync of the verified temp file, rename onto the page's path, fsync
// of its fan-out directory (under the store's sync policy), as a save
// publishes its pages. It runs inside the page's admission
// (pagecache.Cache.AdmitHeld), whose reservation covers the file.
func (t *Tier) publishFetched(sf *layout.Staged) error {
	return sf.Commit(t.d.Store.PublishOptions(true, 0))
}

// verifyPage checks a fetched page file before it may be published:
// remote.VerifyPage (it decodes: every single-file rule, the header hash,
// the page object, whose key must equal SHA-256(parent ‖ tokens); its key
// is the one named; every tensor's xxh3-64 matches; it ends exactly where
// its last tensor ends, so a short or long object fails), and it is
// exactly the page the prompt's chain expects at its position: parent,
// identity, page size and token ids (want.Tokens nil: a named read's page,
// whose manifest names keys only; its key, checked against SHA-256(parent
// ‖ tokens), fixes them).
func verifyPage(f vfs.File, name string, want *layout.Page, size int64) error {
	var pg *layout.Page
	if err := remote.VerifyPage(want.Key.String(), &pg)(f, size); err != nil {
		return fmt.Errorf("%s: %w", name, err)
	}
	return checkWant(name, pg, want)
}

// checkWant: the verified page pg (object name) is exactly the page the
// prompt's chain expects at its position (want): parent, identity, page
// size and token ids.
func checkWant(name string, pg, want *layout.Page) error {
	switch {
	case pg.Parent != want.Parent:
		return fmt.Errorf("%s: parent %s, the chain wants %s", name, pg.Parent, want.Parent)
	case pg.Identity != want.Identity || pg.PageTokens != want.PageTokens:
		return fmt.Errorf("%s has identity %q and %d tokens per page, the load %q and %d", name, pg.Identity, pg.PageTokens, want.Identity, want.PageTokens)
	case want.Tokens != nil && !slices.Equal(pg.Tokens, want.Tokens): // nil: a named read (the key fixes them)
		return fmt.Errorf("%s holds other token ids than the prompt's", name)
	}
	return nil
}
