// Package uploads owns the object-store tier's uploads: which uploads are
// registered (queued, in flight, waiting for a retry), which pages are
// known stored remotely, and the per-namespace journal
// (<root>/<ns>/.uploads) that lists every upload queued until it is
// settled, across crashes and restarts.
//
// A Ledger is one type under one mutex: each method that changes the
// state appends the journal record of that change in the same critical
// section, so the journal's order of records is the order of the state's
// changes (a settled record never follows the queued record of a later
// upload of the same object). A method that queues an upload returns
// once its queued record is durable (written and fdatasync'd under the
// store's sync policy). The Ledger reaches the store only through the
// *store.Store it is given, and the upload queue only through the Queue
// interface.
//
// The journal's bytes are specified in docs/format/uploads-journal.md.
package uploads

import (
	"cmp"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"math/rand/v2"
	"sync/atomic"
	"time"

	"github.com/kvpersist/kvpersist/engine/layout"
	"github.com/kvpersist/kvpersist/engine/remote"
	"github.com/kvpersist/kvpersist/engine/store"
)

// Upload names one upload: page Key of namespace NS, or, when Manifest
// is set, the page manifest of that name.
type Upload struct {
	NS       string
	Key      layout.PageKey // a page's; zero for a manifest
	Manifest string         // a page manifest's snapshot name; "" for a page
}

// IsManifest reports whether u is a page manifest's upload.
func (u Upload) IsManifest() bool { return u.Manifest != "" }

// Queue is what a Ledger needs of the upload queue and of the local
// files; the engine's object-store tier implements it. Its methods are
// called without the Ledger's mutex held, except SetPending.
type Queue interface {
	// Name is u's object name in the store; an error for a name the
	// store refuses (the upload is then skipped).
	Name(u Upload) (string, error)
	// Path is u's local file.
	Path(u Upload) (string, error)
	// Submit hands p to the uploader: nil once accepted (the uploader
	// then reports its end through Ledger.Done), remote.ErrQueueFull when
	// the queue is full (a page is then spilled: listed in the journal
	// only, queued from it when the queue drains), any other error when
	// refused for good (Submit logs and counts it).
	Submit(p *Pending) error
	// ManifestPages returns the page keys, in chain order, that the
	// local page manifest name of ns names now; an error when it is gone
	// or no longer a page manifest.
	ManifestPages(ns, name string) ([]layout.PageKey, error)
	// Room returns how many more uploads the queue takes now, and its
	// capacity.
	Room() (free, capacity int)
	// SetPending marks page k of ns pending in the page cache's eviction
	// policy (or unmarks it). It is called with the Ledger's mutex held,
	// in the critical section that registers or ends the page's upload,
	// so a page's marks are ordered as its uploads are; it must not call
	// the Ledger.
	SetPending(ns string, k layout.PageKey, pending bool)
}

// Config configures a Ledger.
type Config struct {
	// Store is the local store: its namespaces' journals, their locks,
	// its file system (lstat of the local files) and sync policy.
	Store *store.Store
	// Queue is the upload queue the Ledger feeds.
	Queue Queue
	// Log receives the Ledger's Warn and Error lines; nil discards them.
	Log func(level slog.Level, msg string, args ...any)
	// RetryBase is the wait before a failed manifest's first re-queue,
	// doubled per attempt up to 5 minutes (jittered); default 5 s.
	RetryBase time.Duration
	// KnownPages caps the pages remembered as stored remotely; default
	// 262,144. KnownAge: how long an entry stays known; default 30 min.
	KnownPages int
	KnownAge   time.Duration
	// Limits lowered by tests; 0 is the default. ReadLimit: bytes of a
	// journal a replay reads (256 MiB). CompactMin: a journal is
	// compacted once larger than twice its compacted size plus this
	// (1 MiB). OpenMax: journals kept open (64). CursorMax: refill
	// cursors kept (64).
	ReadLimit  int64
	CompactMin int64
	OpenMax    int
	CursorMax  int
}

// manifestRetries is how many times a page manifest whose upload failed
// is queued again, each after retryWait(attempt); then it is given up
// until the engine's next start (it stays listed in the journal).
const manifestRetries = 8

// maxManifestRetryWait caps the wait before a manifest is queued again.
const maxManifestRetryWait = 5 * time.Minute

// defaultKnownPages is Config.KnownPages's default.
const defaultKnownPages = 1 << 18

// Pending is an upload registered with a Ledger: from its queueing until
// the uploader reports its end (Ledger.Done), or the queue refuses it.
type Pending struct {
	Upload
	// Object is its object name, Path its local file, Info Path's lstat
	// when it was registered (a manifest must still be that file when
	// it is sent).
	Object string
	Path   string
	Info   fs.FileInfo
	// Attempt counts a manifest's re-queues after failures.
	Attempt int
	// Keys: the pages a manifest names, in chain order; Pages: the
	// uploads of those it queued or found queued, which it waits for
	// before it is sent (both nil for a page).
	Keys  []layout.PageKey
	Pages []*Pending

	journaled bool // the journal lists it already: no queued record
	// relist: registered by a refill from an entry that a settled record
	// beyond the refill's window may have made stale; spilled, it
	// appends its queued record, so that a spilled page is always listed.
	relist  bool
	queued  bool          // the uploader accepted it (Ledger.mu)
	done    chan struct{} // closed once it ended; err set before
	err     error
	started atomic.Int64 // unix ns of its first attempt (MarkStarted)
}

// Done is closed once the upload ended; Err is then its result.
func (p *Pending) Done() <-chan struct{} { return p.done }

// Err is the upload's result once Done is closed.
func (p *Pending) Err() error { return p.err }

// MarkStarted records the start of the upload's first attempt (later
// calls keep the first).
func (p *Pending) MarkStarted() { p.started.CompareAndSwap(0, time.Now().UnixNano()) }

// Started is the start of its first attempt; zero before it.
func (p *Pending) Started() time.Time {
	if ns := p.started.Load(); ns != 0 {
		return time.Unix(0, ns)
	}
	return time.Time{}
}

func (p *Pending) finish(err error) {
	p.err = err
	close(p.done)
}

// id is a manifest's key in retries and requeueing: "<ns>/<name>".
func manifestID(ns, name string) string { return ns + "/" + name }

// manifestRetry is a manifest waiting to be queued again.
type manifestRetry struct {
	ns, name string
	attempt  int
	tm       *time.Timer
}

// requeueTicket is a manifest's re-queue counted in requeueing: only
// startRequeueLocked makes one, in the critical section that took the
// name from retries or found it not there, and requeueManifest, the only
// taker, ends the count in the critical section that registered the
// upload or settled the name. While it is counted, no other re-queue of
// the name settles it.
type requeueTicket struct {
	ns, name string
	attempt  int
}

// startRequeueLocked counts a re-queue of manifest name of ns. l.mu held.
func (l *Ledger) startRequeueLocked(ns, name string, attempt int) requeueTicket {
	l.requeueing[manifestID(ns, name)]++
	return requeueTicket{ns: ns, name: name, attempt: attempt}
}

// endRequeueLocked ends the count of tk. l.mu held.
func (l *Ledger) endRequeueLocked(tk requeueTicket) {
	id := manifestID(tk.ns, tk.name)
	if l.requeueing[id]--; l.requeueing[id] <= 0 {
		delete(l.requeueing, id)
	}
}

// Open starts a Ledger: its journal goroutine runs until Close. The
// uploads an earlier engine left listed are queued again by Resume.
func Open(cfg Config) (*Ledger, error) {
	if cfg.Store == nil || cfg.Queue == nil {
		return nil, errors.New("uploads: Config.Store and Config.Queue are required")
	}
	if cfg.KnownPages < 0 || cfg.KnownAge < 0 || cfg.RetryBase < 0 {
		return nil, fmt.Errorf("uploads: KnownPages %d, KnownAge %v, RetryBase %v: want none negative", cfg.KnownPages, cfg.KnownAge, cfg.RetryBase)
	}
	if cfg.KnownPages == 0 {
		cfg.KnownPages = defaultKnownPages
	}
	if cfg.KnownAge == 0 {
		cfg.KnownAge = 30 * time.Minute
	}
	if cfg.RetryBase == 0 {
		cfg.RetryBase = 5 * time.Second
	}
	if cfg.Log == nil {
		cfg.Log = func(slog.Level, string, ...any) {}
	}
	l := &Ledger{cfg: cfg, st: cfg.Store, q: cfg.Queue, log: cfg.Log,
		pending: map[string]*Pending{}, retries: map[string]*manifestRetry{}, requeueing: map[string]int{},
		known: map[string]map[layout.PageKey]time.Time{},
		batch: map[string]*batch{}, spilled: map[string]bool{}, touched: map[string]bool{},
		wake: make(chan struct{}, 1), quit: make(chan struct{}), done: make(chan struct{}), calls: make(chan func()),
		files: map[string]*journalFile{}, warned: map[string]time.Time{}, cursors: map[string]*refillCursor{}}
	go l.run()
	return l, nil
}

// retryWait is the wait before re-queue number attempt (1, 2, ...):
// RetryBase doubled per attempt, at most maxManifestRetryWait, with
// jitter (between half and all of it). With the default 5 s: about 5,
// 10, 20, 40, 80, 160, 300, 300 s.
func (l *Ledger) retryWait(attempt int) time.Duration {
	d := l.cfg.RetryBase
	for i := 1; i < attempt && d < maxManifestRetryWait; i++ {
		d *= 2
	}
	d = min(d, maxManifestRetryWait)
	return d/2 + rand.N(d/2+1)
}

// EnqueuePages queues the uploads of pages keys of ns, in that order,
// except those known stored remotely; it returns the uploads of those it
// queued or found queued (a manifest waits for them). It appends the
// queued records of those it registers (and of a page found registered
// from a journal entry) and returns once they are durable, or once they
// cannot be soon: the namespace's lock not granted within journalLockWait
// (written at a later round), or the write failed (logged). It never
// waits for an upload. Local files gone are skipped (logged).
func (l *Ledger) EnqueuePages(ns string, keys []layout.PageKey) []*Pending {
	return l.enqueuePages(ns, keys, true)
}

// EnqueueManifest queues the upload of page manifest name of ns after
// the pages keys it names (EnqueuePages), and returns once its queued
// record is durable, as EnqueuePages does. The manifest's upload waits
// for its pages' (Pending.Pages). A manifest the queue refuses (full) or
// whose upload fails is queued again after a backoff, up to 8 times, with
// the keys its local file names then.
func (l *Ledger) EnqueueManifest(ns, name string, keys []layout.PageKey) {
	l.enqueueManifest(ns, name, keys, 0, false, true)
}

// enqueuePages is EnqueuePages; durable: wait for the records (false on
// the journal's goroutine and on re-queues, whose entries the journal
// lists already).
func (l *Ledger) enqueuePages(ns string, keys []layout.PageKey, durable bool) []*Pending {
	var ps []*Pending
	for _, k := range keys {
		if l.Known(ns, k) {
			continue
		}
		if p := l.newPending(Upload{NS: ns, Key: k}); p != nil {
			ps = append(ps, p)
		}
	}
	return l.enqueue(ps, durable)
}

// enqueueManifest is EnqueueManifest; attempt counts the re-queues after
// failures; journaled: the journal lists it already (a retry, a replay).
func (l *Ledger) enqueueManifest(ns, name string, keys []layout.PageKey, attempt int, journaled, durable bool) {
	pages := l.enqueuePages(ns, keys, durable)
	p := l.newPending(Upload{NS: ns, Manifest: name})
	if p == nil {
		return
	}
	p.Attempt, p.journaled, p.Keys, p.Pages = attempt, journaled, keys, pages
	l.enqueue([]*Pending{p}, durable)
}

// newPending describes u's upload (its object name and local path), or
// nil when the queue names neither.
func (l *Ledger) newPending(u Upload) *Pending {
	name, err := l.q.Name(u)
	if err != nil {
		return nil
	}
	path, err := l.q.Path(u)
	if err != nil {
		return nil
	}
	return &Pending{Upload: u, Object: name, Path: path}
}

// enqueue registers each upload of ps (unless its object is registered
// already: that upload is returned in its place), appending its queued
// record (unless the journal lists it) in the same critical section,
// then (durable) waits for those records, then hands each to the queue
// in order. It returns the uploads registered or found registered,
// without those the queue refused. An upload whose local file is gone is
// skipped (a replayed page's entry is then settled, settleGone).
func (l *Ledger) enqueue(ps []*Pending, durable bool) []*Pending {
	type step struct {
		p     *Pending
		fresh bool
	}
	steps := make([]step, 0, len(ps))
	for _, p := range ps {
		fi, err := l.st.FS().Lstat(p.Path)
		if err != nil || !fi.Mode().IsRegular() {
			if p.journaled && !p.IsManifest() {
				l.settleGone(p)
			} else {
				l.log(slog.LevelWarn, "kvpersist: not uploaded: the local file is gone", "file", p.Path, "err", err)
			}
			continue
		}
		p.Info = fi
		steps = append(steps, step{p: p})
	}
	var c *commit
	l.mu.Lock()
	for i, s := range steps {
		p := s.p
		if q := l.pending[p.Object]; q != nil {
			if !q.IsManifest() {
				// Queued already; the page may have been evicted and
				// saved again since, which cleared its mark.
				l.q.SetPending(q.NS, q.Key, true)
			}
			if q.journaled && durable {
				// Registered from a journal entry, which a settled
				// record read after it may have made stale: this
				// save's own record lists it from here on.
				q.journaled = false
				c = cmp.Or(l.queuedLocked(q), c)
			}
			steps[i].p = q
			continue
		}
		p.done = make(chan struct{})
		l.pending[p.Object] = p
		steps[i].fresh = true
		if !p.IsManifest() {
			l.q.SetPending(p.NS, p.Key, true)
		}
		if !p.journaled {
			c = cmp.Or(l.queuedLocked(p), c)
		}
	}
	l.mu.Unlock()
	if c != nil && durable {
		c.wait()
	}
	out := make([]*Pending, 0, len(steps))
	for _, s := range steps {
		if !s.fresh {
			out = append(out, s.p)
			continue
		}
		if l.submit(s.p) {
			out = append(out, s.p)
		}
	}
	return out
}

// queuedLocked appends p's queued record and returns the commit its
// queuer may wait for (nil when none: dropped, or closed). l.mu held.
func (l *Ledger) queuedLocked(p *Pending) *commit {
	if p.IsManifest() {
		return l.addLocked(p.NS, OpManifestQueued, []byte(p.Manifest))
	}
	return l.addLocked(p.NS, OpPageQueued, p.Key[:])
}

// submit hands p, registered, to the queue; on a refusal it ends p in
// the critical section that removes its registration: a page refused by
// a full queue is spilled (its queued record stays the journal's), a
// manifest is scheduled again (manifestDoneLocked). It reports whether
// the queue took p.
func (l *Ledger) submit(p *Pending) bool {
	err := l.q.Submit(p)
	l.mu.Lock()
	if err == nil {
		p.queued = true
		l.mu.Unlock()
		return true
	}
	spilled := !p.IsManifest() && errors.Is(err, remote.ErrQueueFull)
	delete(l.pending, p.Object)
	givenUp := false
	switch {
	case spilled:
		// Still pending (listed in the journal, queued from it when the
		// queue drains): it keeps its mark.
		l.spilled[p.NS] = true
		if p.relist {
			l.queuedLocked(p)
		}
	case p.IsManifest():
		givenUp = l.manifestDoneLocked(p, err)
	default:
		l.q.SetPending(p.NS, p.Key, false)
	}
	l.mu.Unlock()
	if givenUp {
		l.manifestGivenUp(p, err)
	}
	p.finish(err)
	if spilled {
		// The queue may have drained since it refused the upload, with
		// no upload left to report it.
		l.drained()
	}
	return false
}

// Done ends the upload of object (the uploader's report; err its
// result): in one critical section it removes the registration, unmarks
// a page, settles the upload in the journal when it is done or can never
// be done (a manifest: manifestSettles), or schedules a failed manifest
// again; an abandoned upload (remote.ErrAbandoned) stays listed. A page
// uploaded is known stored from then on; a manifest out of retries is
// logged. It returns the upload (nil when object was not registered),
// whose Done is closed by then.
func (l *Ledger) Done(object string, err error) (p *Pending) {
	l.mu.Lock()
	p = l.pending[object]
	delete(l.pending, object)
	givenUp := false
	switch {
	case p == nil:
	case p.IsManifest():
		givenUp = l.manifestDoneLocked(p, err)
	default:
		l.q.SetPending(p.NS, p.Key, false)
		if !errors.Is(err, remote.ErrAbandoned) {
			l.settleLocked(p.Upload)
		}
		if err == nil {
			l.markKnownLocked(p.NS, p.Key)
		}
	}
	l.mu.Unlock()
	if givenUp {
		l.manifestGivenUp(p, err)
	}
	if p != nil {
		p.finish(err)
	}
	l.drained()
	return p
}

// manifestSettles reports whether a manifest upload that ended with err
// is settled in the journal: done, or failed permanently (another
// manifest holds the name remotely: ErrConflict, ErrBadName; the local
// manifest is corrupt: ErrSourceCorrupt, and a write of the name queues
// its new file).
func manifestSettles(err error) bool {
	return err == nil || errors.Is(err, remote.ErrConflict) || errors.Is(err, remote.ErrBadName) || errors.Is(err, remote.ErrSourceCorrupt)
}

// manifestDoneLocked ends manifest upload p (err), l.mu held, in the
// critical section that removed its registration: settled (done or
// failed for good), left listed (abandoned, or out of retries: givenUp),
// or scheduled again. So the name is never in neither pending nor
// retries while its retry waits, and a re-queue that finds its local
// file no longer a page manifest settles it only when it is in neither
// (requeueManifest).
func (l *Ledger) manifestDoneLocked(p *Pending, err error) (givenUp bool) {
	switch {
	case manifestSettles(err):
		l.settleLocked(p.Upload)
		return false
	case errors.Is(err, remote.ErrAbandoned):
		return false
	case p.Attempt >= manifestRetries:
		return true
	default:
		l.scheduleManifestLocked(p.NS, p.Manifest, p.Attempt+1)
		return false
	}
}

// manifestGivenUp logs a manifest upload out of retries, l.mu not held.
func (l *Ledger) manifestGivenUp(p *Pending, err error) {
	l.log(slog.LevelError, "kvpersist: page manifest not uploaded; given up until the next start", "namespace", p.NS, "name", p.Manifest, "attempts", p.Attempt+1, "err", err)
}

// settleLocked appends u's settled record. l.mu held.
func (l *Ledger) settleLocked(u Upload) {
	if u.IsManifest() {
		l.addLocked(u.NS, OpManifestSettled, []byte(u.Manifest))
	} else {
		l.addLocked(u.NS, OpPageSettled, u.Key[:])
	}
}

// settleGone settles the entry of a replayed page whose local file was
// found gone (evicted since) or not a regular file: it can never be
// uploaded from here. In one critical section it checks that no upload
// of the page is registered and lstats the file again: a save that
// writes the page after that registers its upload (and appends its
// queued record) after this settled record; one that wrote it before is
// seen.
func (l *Ledger) settleGone(p *Pending) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.pending[p.Object] != nil {
		return
	}
	if fi, err := l.st.FS().Lstat(p.Path); err != nil || !fi.Mode().IsRegular() {
		l.settleLocked(p.Upload)
	}
}

// scheduleManifestLocked registers manifest name of ns to be queued
// again after retryWait(attempt), on a timer (one per name: a name
// waiting keeps its timer); l.mu held. Close stops the timers not yet
// fired (queueing their manifests at once) and waits for the callbacks
// of those that fired. The manifest is queued with the keys its local
// file names then: a name rewritten meanwhile is uploaded after its own
// pages.
func (l *Ledger) scheduleManifestLocked(ns, name string, attempt int) {
	id := manifestID(ns, name)
	if l.closing || l.retries[id] != nil {
		return // closing: it stays listed in the journal
	}
	r := &manifestRetry{ns: ns, name: name, attempt: attempt}
	l.retryWG.Add(1)
	r.tm = time.AfterFunc(l.retryWait(attempt), func() {
		defer l.retryWG.Done()
		l.mu.Lock()
		mine := l.retries[id] == r // else Close took it (and queued it)
		var tk requeueTicket
		if mine {
			delete(l.retries, id)
			tk = l.startRequeueLocked(ns, name, attempt)
		}
		l.mu.Unlock()
		if mine {
			l.requeueManifest(tk)
		}
	})
	l.retries[id] = r
}

// requeueManifest queues manifest tk.name again (journaled: the journal
// lists it), with the keys its local file names now, and ends tk's
// count. One that is gone or no longer a page manifest is not queued
// (logged); it is settled only when no upload of it is registered,
// waits for its retry or is being queued by another re-queue (such an
// upload settles it, or keeps it listed).
func (l *Ledger) requeueManifest(tk requeueTicket) {
	keys, err := l.q.ManifestPages(tk.ns, tk.name)
	if err != nil {
		l.log(slog.LevelWarn, "kvpersist: page manifest not uploaded: its local file changed", "namespace", tk.ns, "name", tk.name, "err", err)
		u := Upload{NS: tk.ns, Manifest: tk.name}
		obj, oerr := l.q.Name(u)
		id := manifestID(tk.ns, tk.name)
		l.mu.Lock()
		l.endRequeueLocked(tk)
		if oerr != nil || (l.pending[obj] == nil && l.retries[id] == nil && l.requeueing[id] == 0) {
			l.settleLocked(u)
		}
		l.mu.Unlock()
		return
	}
	l.enqueueManifest(tk.ns, tk.name, keys, tk.attempt, true, false)
	l.mu.Lock()
	l.endRequeueLocked(tk)
	l.mu.Unlock()
}

// requeueListed queues manifest name of ns again from its journal entry,
// unless it waits for a retry.
func (l *Ledger) requeueListed(ns, name string) {
	l.mu.Lock()
	_, waiting := l.retries[manifestID(ns, name)]
	var tk requeueTicket
	if !waiting {
		tk = l.startRequeueLocked(ns, name, 0)
	}
	l.mu.Unlock()
	if !waiting {
		l.requeueManifest(tk)
	}
}

// requeueResult is what requeuePage did.
type requeueResult int

const (
	// requeueTaken: queued, queued already, known stored, gone
	// (settled), refused by the queue for another reason than being full
	// (logged, still listed), or a name the queue rejects (still
	// listed): the refill reads on.
	requeueTaken   requeueResult = iota
	requeueRefused               // the queue is full: spilled again (the namespace marked)
	requeueBusy                  // another goroutine is queueing it (its queueing may yet spill it)
)

// requeuePage queues page k of ns again from its journal entry (a
// replay, or a refill: refill), unless it is registered here already: a page known
// stored is settled (and unmarked when it was spilled: stored since), in
// the critical section that found it known and not registered; one whose
// local file is gone is settled (settleGone). Nothing queued from here
// gets a queued record (the journal lists it). An entry another process
// on the root has queued and not yet settled is queued here too: a
// duplicate costs one HEAD.
func (l *Ledger) requeuePage(ns string, k layout.PageKey, refill bool) requeueResult {
	p := l.newPending(Upload{NS: ns, Key: k})
	if p == nil {
		return requeueTaken
	}
	p.journaled, p.relist = true, refill
	l.mu.Lock()
	q := l.pending[p.Object]
	if q == nil && l.knownLocked(ns, k) {
		// Spilled earlier (marked pending), and stored since.
		l.q.SetPending(ns, k, false)
		l.settleLocked(p.Upload)
		l.mu.Unlock()
		return requeueTaken
	}
	busy := q != nil && !q.queued
	l.mu.Unlock()
	switch {
	case busy:
		return requeueBusy
	case q != nil:
		return requeueTaken
	}
	if len(l.enqueue([]*Pending{p}, false)) == 0 && errors.Is(p.err, remote.ErrQueueFull) {
		return requeueRefused
	}
	return requeueTaken
}

// Pending reports whether the upload of page k of ns is registered here
// (being queued, queued or in flight).
func (l *Ledger) Pending(ns string, k layout.PageKey) bool {
	name, err := l.q.Name(Upload{NS: ns, Key: k})
	if err != nil {
		return false
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.pending[name] != nil
}

// queuedPages returns the pages of ns whose uploads the queue accepted
// and that have not ended.
func (l *Ledger) queuedPages(ns string) map[layout.PageKey]bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	out := map[layout.PageKey]bool{}
	for _, p := range l.pending {
		if p.NS == ns && !p.IsManifest() && p.queued {
			out[p.Key] = true
		}
	}
	return out
}

// Known reports whether page k of ns is known stored remotely: learnt
// (uploaded, found by a HEAD or fetched) less than Config.KnownAge ago.
// An older entry is dropped: remote gc may have deleted the page since.
func (l *Ledger) Known(ns string, k layout.PageKey) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.knownLocked(ns, k)
}

func (l *Ledger) knownLocked(ns string, k layout.PageKey) bool {
	at, ok := l.known[ns][k]
	if ok && time.Since(at) >= l.cfg.KnownAge {
		l.forgetLocked(ns, k)
		return false
	}
	return ok
}

// MarkKnown records page k of ns as stored remotely; when the set holds
// Config.KnownPages entries, an arbitrary one is dropped first (it costs
// a HEAD when that page is next saved).
func (l *Ledger) MarkKnown(ns string, k layout.PageKey) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.markKnownLocked(ns, k)
}

func (l *Ledger) markKnownLocked(ns string, k layout.PageKey) {
	m := l.known[ns]
	if m == nil {
		m = map[layout.PageKey]time.Time{}
		l.known[ns] = m
	}
	if _, ok := m[k]; ok {
		m[k] = time.Now() // learnt again: its age restarts
		return
	}
	if l.nknown >= l.cfg.KnownPages {
		l.dropOneKnownLocked()
	}
	m[k] = time.Now()
	l.nknown++
}

func (l *Ledger) dropOneKnownLocked() {
	for ns, m := range l.known {
		for k := range m {
			delete(m, k)
			l.nknown--
			if len(m) == 0 {
				delete(l.known, ns)
			}
			return
		}
	}
}

// Forget drops page k of ns from the known set (its local file was
// evicted or found gone, or the store lacks it).
func (l *Ledger) Forget(ns string, k layout.PageKey) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.forgetLocked(ns, k)
}

func (l *Ledger) forgetLocked(ns string, k layout.PageKey) {
	m := l.known[ns]
	if _, ok := m[k]; !ok {
		return
	}
	delete(m, k)
	l.nknown--
	if len(m) == 0 {
		delete(l.known, ns)
	}
}

// KnownPages returns how many pages are known stored remotely.
func (l *Ledger) KnownPages() int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.nknown
}

// Resume replays every namespace's journal and queues again what it
// lists (pages sorted by key, then manifests), as an engine does at
// start. A journal that cannot be read is ignored (logged); bytes of it
// that do not decode are skipped (logged). A journal holding records or
// undecodable bytes is compacted at Close.
func (l *Ledger) Resume() {
	names, _, err := l.st.Namespaces(false)
	if err != nil {
		return
	}
	for _, ns := range names {
		l.replay(ns)
	}
}

// replay is Resume of namespace ns.
func (l *Ledger) replay(ns string) {
	n, err := l.st.Namespace(ns)
	if err != nil {
		return
	}
	set, canonical, ok := l.read(n.UploadsPath())
	if !ok {
		return
	}
	if !canonical {
		l.mu.Lock()
		l.touched[ns] = true
		l.mu.Unlock()
	}
	for _, k := range set.SortedPages() {
		l.requeuePage(ns, k, false)
	}
	for _, m := range set.SortedManifests() {
		l.requeueListed(ns, m)
	}
}

// stopRetries runs at Close, before the queue closes: the manifest
// timers not fired are stopped and their manifests queued at once; the
// callbacks of those that fired have queued theirs when it returns. From
// now on a failed manifest is not scheduled again (it stays listed).
func (l *Ledger) stopRetries() {
	l.mu.Lock()
	l.closing = true
	var now []requeueTicket
	for _, r := range l.retries {
		if r.tm.Stop() {
			l.retryWG.Done() // its callback never runs
		}
		now = append(now, l.startRequeueLocked(r.ns, r.name, r.attempt))
	}
	clear(l.retries)
	l.mu.Unlock()
	l.retryWG.Wait()
	for _, tk := range now {
		l.requeueManifest(tk)
	}
}
