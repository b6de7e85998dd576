package engine

import (
	"context"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvpersist/kvpersist/engine/evict"
	"github.com/kvpersist/kvpersist/engine/layout"
	"github.com/kvpersist/kvpersist/engine/metrics/labels"
	"github.com/kvpersist/kvpersist/engine/pageindex"
	"github.com/kvpersist/kvpersist/engine/store"
	"github.com/kvpersist/kvpersist/engine/vfs"
)

// The bounded page cache (issue 13): the engine feeds the eviction policy
// (engine/evict) with the page files it finds at start, writes, loads,
// deletes and evicts, and does the policy's I/O: reservations before a save
// creates a file, unlinks of victims under the namespace's exclusive lock,
// background shrinking, and the recency checkpoints. See ARCHITECTURE.md,
// "Bounded page cache".

// ErrNoSpace: a save to the prefix page cache could not make room within
// Config.CapacityBytes, Config.QuotaBytes or Config.HeadroomBytes (every
// page that could be evicted is pinned, shared by a stored descendant, or
// protected by another namespace's quota). The save wrote nothing and every
// stored page is intact. The error is an *evict.NoSpaceError naming the
// limit ("capacity", "quota" or "headroom"), the namespace and the bytes;
// errors.Is(err, ErrNoSpace) holds. It is evict.ErrNoSpace.
var ErrNoSpace = evict.ErrNoSpace

// Usage is the page cache's accounting at one instant (allocated bytes of
// page files, per namespace): evict.Usage.
type Usage = evict.Usage

// NamespaceUsage is one namespace's part of a Usage.
type NamespaceUsage = evict.NamespaceUsage

// Usage returns the page cache's accounting: capacity, used, reserved and
// evicting bytes (allocated bytes, st_blocks × 512), pages, and the same
// per namespace with its quota. It takes one short lock and does no I/O,
// so it can be read at each scrape: New hands it to a Config.Metrics that
// is a UsageSink (a *metrics.Recorder), so its cache gauges need no
// wiring. A nil *Engine reports a zero Usage (hence the gauges stay 0 if
// eng.Usage is taken before New returned: leave metrics.Options.Usage
// nil).
func (e *Engine) Usage() Usage {
	if e == nil || e.pc == nil {
		return Usage{}
	}
	return e.pc.pol.Usage()
}

// SetQuota changes namespace ns's quota (allocated bytes of its page files;
// 0 removes it). A namespace left above its new quota is shrunk in the
// background. Errors: ErrConfig for an invalid name or a quota outside [0,
// 2^53].
func (e *Engine) SetQuota(ns string, bytes int64) error {
	if err := layout.ValidName("namespace", ns); err != nil {
		return fmt.Errorf("%w: %w", ErrConfig, err)
	}
	if err := e.pc.pol.SetQuota(ns, bytes); err != nil {
		return fmt.Errorf("%w: %w", ErrConfig, err)
	}
	e.pc.mu.Lock()
	e.pc.quotas[ns] = bytes
	e.pc.mu.Unlock()
	e.pc.kickShrink()
	return nil
}

// checkpointEvery is how often the background goroutine writes the
// recency checkpoint of each namespace whose recency changed.
const checkpointEvery = 30 * time.Second

// touchQueue bounds the lookups' touches waiting for the background
// goroutine; beyond it a touch is dropped (recency is advisory).
const touchQueue = 4096

// touch is a lookup's access to the deepest page it found.
type touch struct {
	ns  string
	key evict.Key
	at  int64
}

// pageCache is the engine's part of the bounded page cache: the policy and
// the I/O it asks for. One per engine; its background goroutine (run) is
// started by New and stopped by Close.
type pageCache struct {
	pol      *evict.Cache
	st       *store.Store
	fs       vfs.FS
	index    *pageindex.Index
	log      *slog.Logger
	metrics  MetricsSink
	headroom int64 // Config.HeadroomBytes
	capacity int64 // Config.CapacityBytes
	blkBytes int64 // the file system's block size: page files' lengths are rounded up to it

	touches chan touch
	kick    chan struct{}
	stop    chan struct{}
	done    chan struct{}
	bgCtx   context.Context // cancelled by Close: background unlinks stop waiting for locks
	bgStop  context.CancelFunc

	mu        sync.Mutex
	quotas    map[string]int64
	dirty     map[string]struct{}                 // namespaces whose recency changed since their checkpoint
	manifests map[string]map[string]*manifestPins // ns → page manifest name → its keys and pins
	named     map[string]map[evict.Key]int        // ns → key → manifests naming it
	scanned   map[string]time.Time                // ns → its directory's mtime at the last manifest scan
	scannedAt map[string]time.Time                // ns → when that scan was made
	tooBig    map[string]bool                     // namespaces too large to checkpoint (logged once)

	// onRemoved, when set (the remote tier's forget), is told of every
	// page file the cache removed or found gone (unindex).
	onRemoved atomic.Pointer[func(ns string, k layout.PageKey)]
}

// unindex drops page k of namespace ns, whose file is gone, from the
// index, and tells onRemoved.
func (pc *pageCache) unindex(ns string, k layout.PageKey) {
	pc.index.Remove(ns, k)
	if f := pc.onRemoved.Load(); f != nil {
		(*f)(ns, k)
	}
}

// newCachePolicy checks the page cache's limits of cfg (ErrConfig) and
// returns an empty policy with them.
func newCachePolicy(cfg Config) (*evict.Cache, error) {
	if cfg.CapacityBytes < 0 || cfg.CapacityBytes > evict.MaxBytes {
		return nil, fmt.Errorf("%w: CapacityBytes %d (want 0, unbounded, to 2^53)", ErrConfig, cfg.CapacityBytes)
	}
	if cfg.HeadroomBytes < 0 || cfg.HeadroomBytes > evict.MaxBytes {
		return nil, fmt.Errorf("%w: HeadroomBytes %d (want 0, none, to 2^53)", ErrConfig, cfg.HeadroomBytes)
	}
	for ns, q := range cfg.QuotaBytes {
		if err := layout.ValidName("namespace", ns); err != nil {
			return nil, fmt.Errorf("%w: QuotaBytes: %w", ErrConfig, err)
		}
		if q < 0 || q > evict.MaxBytes {
			return nil, fmt.Errorf("%w: QuotaBytes of namespace %q is %d (want 0, none, to 2^53)", ErrConfig, ns, q)
		}
	}
	c, err := evict.New(evict.Config{CapacityBytes: cfg.CapacityBytes, Quotas: cfg.QuotaBytes})
	if err != nil {
		return nil, fmt.Errorf("%w: %w", ErrConfig, err)
	}
	return c, nil
}

// openPageCache rebuilds the accounting of every namespace's page files
// from the disk (rebuild) and starts the background goroutine.
func openPageCache(cfg Config, pol *evict.Cache, st *store.Store, index *pageindex.Index) (*pageCache, error) {
	pc := &pageCache{
		pol: pol, st: st, fs: st.FS(), index: index, log: cfg.Logger, metrics: cfg.Metrics,
		headroom: cfg.HeadroomBytes, capacity: cfg.CapacityBytes, blkBytes: 4096,
		touches: make(chan touch, touchQueue), kick: make(chan struct{}, 1),
		stop: make(chan struct{}), done: make(chan struct{}),
		quotas: map[string]int64{}, dirty: map[string]struct{}{},
		manifests: map[string]map[string]*manifestPins{}, named: map[string]map[evict.Key]int{},
		scanned: map[string]time.Time{}, scannedAt: map[string]time.Time{}, tooBig: map[string]bool{},
	}
	for ns, q := range cfg.QuotaBytes {
		pc.quotas[ns] = q
	}
	if fst, err := pc.fs.Statfs(st.Root()); err == nil && fst.BlockBytes > 0 {
		pc.blkBytes = fst.BlockBytes
	}
	if err := pc.rebuild(time.Now()); err != nil {
		return nil, err
	}
	pc.bgCtx, pc.bgStop = context.WithCancel(context.Background())
	go pc.run()
	pc.kickShrink() // the disk may hold more than the limits
	return pc, nil
}

// rebuild adds every page file of every namespace to the policy: its
// allocated bytes and mtime from an lstat, its parent from the namespace's
// recency checkpoint or, for a page the checkpoint does not name, from its
// header; then the checkpoint's recency is applied, and the pages named by
// page manifests are pinned.
func (pc *pageCache) rebuild(now time.Time) error {
	names, _, err := pc.st.Namespaces(false)
	if err != nil {
		if vfs.IsNotExist(err) {
			return nil
		}
		return fmt.Errorf("engine: page cache: %w", err)
	}
	for _, name := range names {
		n, err := pc.st.Namespace(name)
		if err != nil {
			return fmt.Errorf("engine: page cache: %w", err)
		}
		l, err := n.ListPages()
		if err != nil {
			if vfs.IsNotExist(err) {
				continue
			}
			return fmt.Errorf("engine: page cache: %w", err)
		}
		if !l.HasPagesDir {
			continue
		}
		recs := pc.readCheckpoint(n)
		var unreadable, unrecorded int
		for _, pg := range l.Pages {
			var k evict.Key
			_, _ = hex.Decode(k[:], []byte(pg.Key)) // 64 lowercase hex digits: the store checked
			pf, err := n.StatPage(pg.Path)
			if err != nil {
				if !vfs.IsNotExist(err) {
					pc.log.Warn("kvpersist: page cache: page file not accounted", "path", pg.Path, "err", err)
				}
				continue
			}
			p := evict.Page{Namespace: name, Key: k, Bytes: pf.AllocatedBytes, Access: pf.ModTime.UnixNano()}
			r, recorded := findRecord(recs, k)
			switch {
			case recorded:
				p.Parent, p.HasParent = r.Parent, r.HasParent
			default:
				unrecorded++
				if snap, err := n.DecodePage(pg.Path); err == nil && snap.Page != nil {
					p.Parent, p.HasParent = evict.Key(snap.Page.Parent), true
				} else {
					unreadable++ // accounted without a parent; a load finds it out
				}
			}
			if err := pc.pol.Add(p); err != nil {
				pc.log.Warn("kvpersist: page cache: page not accounted", "path", pg.Path, "err", err)
			}
		}
		if unreadable > 0 {
			pc.log.Warn("kvpersist: page cache: page headers that do not decode (accounted, evicted first among equals)", "namespace", name, "count", unreadable)
		}
		if len(recs) > 0 {
			pc.pol.ApplyCheckpoint(name, recs, now.UnixNano())
		}
		if unrecorded > 0 {
			pc.markDirty(name) // checkpointed at Close: the next start reads no header
		}
		pc.mu.Lock()
		pc.scanManifestsLocked(n)
		pc.mu.Unlock()
	}
	return nil
}

// findRecord is the record of key k in recs (sorted by key), by binary
// search.
func findRecord(recs []evict.Record, k evict.Key) (evict.Record, bool) {
	lo, hi := 0, len(recs)
	for lo < hi {
		m := (lo + hi) / 2
		if keyCompare(recs[m].Key, k) < 0 {
			lo = m + 1
		} else {
			hi = m
		}
	}
	if lo < len(recs) && recs[lo].Key == k {
		return recs[lo], true
	}
	return evict.Record{}, false
}

func keyCompare(a, b evict.Key) int {
	for i := range a {
		if a[i] != b[i] {
			if a[i] < b[i] {
				return -1
			}
			return 1
		}
	}
	return 0
}

// readCheckpoint reads namespace n's recency checkpoint; a missing file is
// none, a file that fails validation (evict.ErrCheckpoint) or cannot be
// read is ignored with a log line (the pages then keep their mtimes).
func (pc *pageCache) readCheckpoint(n *store.Namespace) []evict.Record {
	recs, err := n.ReadRecency()
	if err != nil {
		pc.log.Warn("kvpersist: page cache: recency checkpoint ignored; pages ordered by their mtimes", "path", n.RecencyPath(), "err", err)
		return nil
	}
	return recs
}

// writeCheckpoint publishes namespace ns's recency checkpoint (temp file,
// fdatasync, rename, directory fsync, under the store's sync policy). A
// namespace without a directory or without pages is skipped.
func (pc *pageCache) writeCheckpoint(ns string) error {
	recs := pc.pol.Checkpoint(ns, nil)
	if len(recs) == 0 {
		return nil
	}
	b, err := evict.AppendCheckpoint(nil, recs)
	if err != nil {
		pc.mu.Lock()
		first := !pc.tooBig[ns]
		pc.tooBig[ns] = true
		pc.mu.Unlock()
		if first {
			pc.log.Warn("kvpersist: page cache: namespace not checkpointed; its restart orders pages by their mtimes", "namespace", ns, "err", err)
		}
		return nil
	}
	n, err := pc.st.Namespace(ns)
	if err != nil {
		return err
	}
	if fi, err := pc.fs.Lstat(n.Dir()); err != nil || !fi.IsDir() {
		return nil // gone, or not ours to write into
	}
	err = layout.Publish(pc.fs, n.RecencyPath(), pc.st.PublishOptions(true, int64(len(b))), func(f vfs.File) error {
		return layout.WriteFull(f, b, 0)
	})
	if err != nil {
		return fmt.Errorf("engine: page cache: recency checkpoint of %s: %w", ns, err)
	}
	return nil
}

// checkpoint writes the checkpoint of every namespace marked dirty.
func (pc *pageCache) checkpoint() error {
	pc.mu.Lock()
	var names []string
	for ns := range pc.dirty {
		names = append(names, ns)
	}
	clear(pc.dirty)
	pc.mu.Unlock()
	var errs []error
	for _, ns := range names {
		if err := pc.writeCheckpoint(ns); err != nil {
			errs = append(errs, err)
			pc.markDirty(ns) // try again next time
		}
	}
	return errors.Join(errs...)
}

func (pc *pageCache) markDirty(ns string) {
	pc.mu.Lock()
	pc.dirty[ns] = struct{}{}
	pc.mu.Unlock()
}

// run is the background goroutine: it applies the lookups' touches,
// shrinks the cache when kicked (after the rebuild, a quota change, pages
// added outside a reservation), and writes the checkpoints of changed
// namespaces every checkpointEvery. It never takes a lock a load waits on
// for longer than its unlinks.
func (pc *pageCache) run() {
	defer close(pc.done)
	tick := time.NewTicker(checkpointEvery)
	defer tick.Stop()
	for {
		select {
		case <-pc.stop:
			pc.drainTouches()
			return
		case t := <-pc.touches:
			pc.applyTouch(t)
			pc.drainTouches()
		case <-pc.kick:
			pc.shrink()
		case <-tick.C:
			pc.drainTouches()
			if err := pc.checkpoint(); err != nil {
				pc.log.Warn("kvpersist: page cache: checkpoint failed", "err", err)
			}
		}
	}
}

func (pc *pageCache) applyTouch(t touch) {
	if pc.pol.Touch(t.ns, t.key, t.at) {
		pc.markDirty(t.ns)
	}
}

func (pc *pageCache) drainTouches() {
	for {
		select {
		case t := <-pc.touches:
			pc.applyTouch(t)
		default:
			return
		}
	}
}

// touchLookup queues a lookup's access to the deepest page it found (its
// ancestors cannot be evicted before it: leaves go first). It never blocks
// and takes no lock of the policy: the background goroutine applies it.
func (pc *pageCache) touchLookup(ns string, k layout.PageKey) {
	select {
	case pc.touches <- touch{ns: ns, key: evict.Key(k), at: time.Now().UnixNano()}:
	default: // full: dropped (recency is advisory)
	}
}

func (pc *pageCache) kickShrink() {
	select {
	case pc.kick <- struct{}{}:
	default:
	}
}

// shrink evicts down to the capacity and each namespace down to its
// quota (evict.ReasonShrink), in the background.
func (pc *pageCache) shrink() {
	var vs []evict.Victim
	if pc.capacity > 0 {
		vs, _ = pc.pol.Shrink(pc.capacity, vs)
	}
	pc.mu.Lock()
	quotas := make(map[string]int64, len(pc.quotas))
	for ns, q := range pc.quotas {
		quotas[ns] = q
	}
	pc.mu.Unlock()
	for ns, q := range quotas {
		if q > 0 {
			vs, _ = pc.pol.ShrinkNamespace(ns, q, vs)
		}
	}
	if len(vs) == 0 {
		return
	}
	start := time.Now()
	_, err := pc.unlink(pc.bgCtx, vs)
	if err != nil && pc.bgCtx.Err() == nil {
		pc.log.Warn("kvpersist: page cache: background eviction incomplete", "err", err)
	}
	if pc.metrics != nil {
		pc.metrics.Job(labels.KindEvict, labels.OutcomeOf(err), time.Since(start), true)
	}
}

// close stops the background goroutine (goroutines it waits for included)
// and writes the checkpoint of every namespace whose recency changed (or
// that had pages its checkpoint did not name at start). Called by
// Engine.Close once no job runs. An engine that changed nothing writes
// nothing.
func (pc *pageCache) close() error {
	pc.bgStop()
	close(pc.stop)
	<-pc.done
	return pc.checkpoint()
}

// unlink removes the victims' page files, namespace by namespace, each
// under its namespace's exclusive lock (as collect deletes: no load or save
// of any process holds the namespace meanwhile), in the victims' order
// (descendants before their ancestors: unlinkGroup). A victim named by a page manifest
// found under the lock (written by another process since the last scan) is
// not removed: it and every later victim of its namespace are abandoned,
// and it is pinned. A removed page leaves the policy (Removed) and the
// index. A failed unlink abandons that victim and every later one of its
// namespace. Evicted pages are reported to Config.Metrics; those whose
// upload to the object store was pending (evict.Victim.Pending: nothing
// else was evictable) are also logged (Warn, one line per namespace) and
// counted (RemoteUploadEvicted). kept is the
// number of victims kept for a page manifest; the error is the first
// failure (the lock's, ctx's or an unlink's).
func (pc *pageCache) unlink(ctx context.Context, vs []evict.Victim) (kept int, err error) {
	var first error
	done := make([]bool, len(vs))
	type tally struct{ pages, bytes int64 }
	var evicted [evict.ReasonShrink + 1]tally
	var pendingEvicted int64 // pages whose upload was pending (evict rule 6)
	for i := range vs {
		if done[i] {
			continue
		}
		ns := vs[i].Namespace
		var group []int
		for j := i; j < len(vs); j++ {
			if !done[j] && vs[j].Namespace == ns {
				group = append(group, j)
				done[j] = true
			}
		}
		abandon := func(from int) {
			for _, j := range group[from:] {
				_ = pc.pol.Abandon(ns, vs[j].Key)
			}
		}
		n, err := pc.st.Namespace(ns)
		var unlock func()
		if err == nil {
			unlock, err = n.Lock(ctx, true)
		}
		if err != nil {
			abandon(0)
			first = cmpOr(first, err)
			continue
		}
		named := pc.rescanManifests(n)
		nsPendingBefore := pendingEvicted
		end := len(group)
		for gi, j := range group {
			if named[vs[j].Key] > 0 {
				// Kept, with every later victim (its ancestors may follow).
				abandon(gi)
				kept += len(group) - gi
				pc.mu.Lock()
				pc.repinLocked(ns)
				pc.mu.Unlock()
				end = gi
				break
			}
		}
		removed, _, uerr := pc.unlinkGroup(n, vs, group[:end])
		if uerr != nil {
			first = cmpOr(first, uerr)
			for _, j := range group[:end] {
				if !removed[j] {
					_ = pc.pol.Abandon(ns, vs[j].Key)
				}
			}
		}
		for _, j := range group[:end] {
			if removed[j] {
				v := vs[j]
				evicted[v.Reason].pages++
				evicted[v.Reason].bytes += v.Bytes
				if v.Pending {
					pendingEvicted++
				}
			}
		}
		if pendingEvicted > nsPendingBefore {
			pc.log.Warn("kvpersist: page cache: evicted pages whose upload to the object store was pending (nothing else was evictable); they reach the store only if a save writes them again",
				"namespace", ns, "pages", pendingEvicted-nsPendingBefore)
		}
		unlock()
		pc.markDirty(ns)
	}
	if pc.metrics != nil {
		for r, t := range evicted {
			if t.pages > 0 {
				pc.metrics.Evicted(evict.Reason(r), t.pages, t.bytes)
			}
		}
		if pendingEvicted > 0 {
			pc.metrics.RemoteUploadEvicted(pendingEvicted)
		}
	}
	return kept, first
}

func cmpOr(a, b error) error {
	if a != nil {
		return a
	}
	return b
}

// manifestPins is what one page manifest holds of the policy: the keys it
// names, and which of them are pinned for it.
type manifestPins struct {
	keys   []evict.Key
	pinned []bool
}

// setManifestLocked records that namespace ns's snapshot name is a page
// manifest naming keys (nil: it is none, or gone), adjusting the pins:
// the old manifest's are dropped, the new one's taken (pages not tracked
// yet are pinned when they are: repinLocked). pc.mu held.
func (pc *pageCache) setManifestLocked(ns, name string, keys []evict.Key) {
	m := pc.manifests[ns]
	if old := m[name]; old != nil {
		for i, k := range old.keys {
			if old.pinned[i] {
				_ = pc.pol.Unpin(ns, k)
			}
			if c := pc.named[ns][k] - 1; c > 0 {
				pc.named[ns][k] = c
			} else {
				delete(pc.named[ns], k)
			}
		}
		delete(m, name)
	}
	if keys == nil {
		return
	}
	if m == nil {
		m = map[string]*manifestPins{}
		pc.manifests[ns] = m
	}
	if pc.named[ns] == nil {
		pc.named[ns] = map[evict.Key]int{}
	}
	mp := &manifestPins{keys: keys, pinned: make([]bool, len(keys))}
	for i, k := range keys {
		pc.named[ns][k]++
		mp.pinned[i] = pc.pol.Pin(ns, k)
	}
	m[name] = mp
}

// setManifest is setManifestLocked taking pc.mu.
func (pc *pageCache) setManifest(ns, name string, keys []evict.Key) {
	pc.mu.Lock()
	defer pc.mu.Unlock()
	pc.setManifestLocked(ns, name, keys)
}

// repinLocked pins the pages of namespace ns's manifests that were not
// tracked (or were victims) when the manifest was recorded. pc.mu held.
func (pc *pageCache) repinLocked(ns string) {
	for _, mp := range pc.manifests[ns] {
		for i, k := range mp.keys {
			if !mp.pinned[i] {
				mp.pinned[i] = pc.pol.Pin(ns, k)
			}
		}
	}
}

// scanManifestsLocked lists namespace n's snapshots (headers decoded) and
// records every page manifest's keys (setManifestLocked), forgetting
// manifests that are gone. pc.mu held.
func (pc *pageCache) scanManifestsLocked(n *store.Namespace) {
	ns := n.Name()
	fi, err := pc.fs.Lstat(n.Dir())
	if err != nil {
		return
	}
	l, err := n.ListSnapshots(true)
	if err != nil {
		pc.log.Warn("kvpersist: page cache: page manifests not scanned", "namespace", ns, "err", err)
		return
	}
	seen := map[string]bool{}
	for _, s := range l.Snapshots {
		if s.Snap == nil || s.Snap.Pages == nil {
			continue
		}
		seen[s.Name] = true
		keys := make([]evict.Key, len(s.Snap.Pages.Keys))
		for i, k := range s.Snap.Pages.Keys {
			keys[i] = evict.Key(k)
		}
		if old := pc.manifests[ns][s.Name]; old != nil && slices.Equal(old.keys, keys) {
			continue
		}
		pc.setManifestLocked(ns, s.Name, keys)
	}
	for name := range pc.manifests[ns] {
		if !seen[name] {
			pc.setManifestLocked(ns, name, nil)
		}
	}
	pc.scanned[ns] = fi.ModTime()
	pc.scannedAt[ns] = time.Now()
}

// rescanManifests, under namespace n's exclusive lock, scans its page
// manifests again when its directory changed since the last scan (a
// manifest written by another process: pins do not cross processes, the
// manifest file is the pin), and returns the keys named by some manifest
// of n. A victim among them must not be unlinked.
func (pc *pageCache) rescanManifests(n *store.Namespace) map[evict.Key]int {
	pc.mu.Lock()
	defer pc.mu.Unlock()
	ns := n.Name()
	if pc.staleLocked(n) {
		pc.scanManifestsLocked(n)
	}
	named := make(map[evict.Key]int, len(pc.named[ns]))
	for k, c := range pc.named[ns] {
		named[k] = c
	}
	return named
}

// staleLocked reports whether namespace n's directory changed since its
// last manifest scan (or was never scanned, or changed within
// manifestMtimeSlack of it). pc.mu held.
func (pc *pageCache) staleLocked(n *store.Namespace) bool {
	fi, err := pc.fs.Lstat(n.Dir())
	if err != nil {
		return false
	}
	last, ok := pc.scanned[n.Name()]
	return !ok || !fi.ModTime().Equal(last) || !fi.ModTime().Before(pc.scannedAt[n.Name()].Add(-manifestMtimeSlack))
}

// rescanStale scans again the page manifests of every namespace that holds
// pins for manifests and whose directory changed since its last scan: a
// manifest another process deleted (or rewrote) no longer pins its pages
// here (pins do not cross processes, and neither do unpins). It takes no
// namespace lock: it only drops the pins of manifests found gone and takes
// those of manifests found new, and unlink checks the manifests again
// under the exclusive lock before it removes a page. It reports whether
// any namespace was scanned again.
func (pc *pageCache) rescanStale() bool {
	pc.mu.Lock()
	defer pc.mu.Unlock()
	var names []string
	for ns, m := range pc.manifests {
		if len(m) > 0 {
			names = append(names, ns)
		}
	}
	rescanned := false
	for _, ns := range names {
		n, err := pc.st.Namespace(ns)
		if err != nil || !pc.staleLocked(n) {
			continue
		}
		pc.scanManifestsLocked(n)
		rescanned = true
	}
	return rescanned
}

// manifestMtimeSlack: a namespace directory whose mtime is within this of
// the last scan is scanned again even when the mtime did not change
// (mtimes are coarse: a manifest renamed in during the tick of the last
// scan leaves the mtime as it was).
const manifestMtimeSlack = 100 * time.Millisecond

// reserve is the one way pages enter the page cache through this engine:
// a prefix save and the pages of a layout.Pages write (through their
// jobs.Admission, pageAdmission) and pages fetched from the remote tier
// (admitHeld) all go through it, so that every page file created is
// covered by a reservation. keys and parents are the pages of namespace n
// in chain order (parents[i] is page i's parent key); fileBytes(i) is an
// upper bound of page i's file length in bytes. The caller then does the
// I/O that publishes pages of keys (taking the namespace's shared lock
// itself) and settles the admission.
//
// In order: (1) the keys already tracked are pinned (they are reused, cost
// nothing, and cannot be evicted while the write runs); a key that is a
// victim whose unlink is pending is waited for (waitVictim, until ctx ends)
// and then written again, never reused; (2) the allocated bytes
// of the others (each length rounded up to the file system's block size)
// are reserved, after a statvfs of the root when a headroom is set (when
// no room can be made, the page manifests of namespaces whose directory
// changed are listed again, once: rescanStale, and the reservation is
// tried again); when no room can be made the error is an
// *evict.NoSpaceError (ErrNoSpace),
// Config.Metrics.Refused is told, and nothing changes; (3) the
// reservation's victims are unlinked (unlink: under their namespace's
// exclusive lock), and reserve waits for it. Then the caller writes, and
// (4) settle, on every path (error, cancel, panic), commits each page of
// keys that is not tracked and whose file exists with its st_blocks,
// releases the rest of the reservation and drops the pins; on success
// every page of keys is touched. On an error of reserve the admission
// returned holds the pins taken so far: release them (release).
//
// With hold (pages that a load reads next: pages fetched from the remote
// tier) the pins are handed to the caller instead of dropped: every page
// of keys tracked when reserve starts keeps the pin of step (1), and every
// page committed in step (4) is committed pinned
// (evict.Reservation.CommitPinned: no reservation can choose it between
// its commit and its pin), so no page of keys can be evicted between its
// publish and the load's reading it. settle and release return the keys
// pinned for the caller, who unpins them (pc.pol.UnpinAll(ns, held)) when
// the load ends; they are held on every path, error included.
func (pc *pageCache) reserve(ctx context.Context, n *store.Namespace, keys, parents []layout.PageKey, fileBytes func(int) (int64, error), hold bool) (*admission, error) {
	ns := n.Name()
	ek := evictKeys(keys)
	a := &admission{pc: pc, n: n, keys: keys, parents: parents, ek: ek, pinned: make([]bool, len(ek)), hold: hold}
	pinned := a.pinned
	for i := 0; i < len(ek); {
		k := pc.pol.PinPrefix(ns, ek[i:])
		for j := i; j < i+k; j++ {
			pinned[j] = true
		}
		a.pins = append(a.pins, ek[i:i+k]...)
		i += k
		if i == len(ek) {
			break
		}
		// ek[i] is not tracked, or is a victim whose unlink is pending
		// (another save's, or the background shrink's, waiting for the
		// namespace's exclusive lock). A victim must not be reused: its
		// unlink would follow the save and cut the chain after it. Wait
		// for it to be gone (the save writes it again) or abandoned (then
		// pin it).
		if pc.pol.Evicting(ns, ek[i]) {
			if err := pc.waitVictim(ctx, ns, ek[i]); err != nil {
				return a, fmt.Errorf("engine: save to namespace %s waiting for the eviction of page %s: %w", ns, keys[i], err)
			}
			continue
		}
		i++
	}
	var want int64
	for i := range ek {
		if pinned[i] {
			continue
		}
		b, err := fileBytes(i)
		if err != nil {
			return a, err
		}
		want += (b + pc.blkBytes - 1) / pc.blkBytes * pc.blkBytes
	}
	if want == 0 {
		return a, nil
	}
	avail := int64(-1)
	if pc.headroom > 0 {
		if fst, serr := pc.fs.Statfs(pc.st.Root()); serr == nil {
			avail = fst.AvailBytes
		} else {
			pc.log.Warn("kvpersist: page cache: statvfs failed; headroom not checked for this save", "root", pc.st.Root(), "err", serr)
		}
	}
	// A victim that another process's page manifest names is kept
	// (unlink finds the manifest under the lock and pins its pages):
	// then the room was not made, and the reservation is tried again
	// with those pages pinned.
	rescanned := false
	for attempt := 0; ; attempt++ {
		r, err := pc.pol.Reserve(evict.Want{Namespace: ns, Bytes: want, AvailBytes: avail, HeadroomBytes: pc.headroom})
		if err != nil {
			var nse *evict.NoSpaceError
			// Pages pinned for a page manifest another process has
			// deleted since: scan again, once, and retry.
			if errors.As(err, &nse) && !rescanned {
				rescanned = true
				if pc.rescanStale() {
					continue
				}
			}
			if errors.As(err, &nse) && pc.metrics != nil {
				pc.metrics.Refused(nse.Limit)
			}
			return a, fmt.Errorf("engine: page cache of namespace %s: %w", ns, err)
		}
		kept, uerr := pc.unlink(ctx, r.Victims)
		if uerr != nil {
			r.Release()
			return a, fmt.Errorf("engine: making room in the page cache of namespace %s: %w", ns, uerr)
		}
		if kept == 0 {
			a.r = r
			return a, nil
		}
		r.Release()
		if attempt == maxReserveAttempts-1 {
			return a, fmt.Errorf("engine: page cache of namespace %s: %w: %d attempts met pages named by page manifests of another process", ns, ErrNoSpace, maxReserveAttempts)
		}
	}
}

// admission is one reservation of reserve, until its settle.
type admission struct {
	pc            *pageCache
	n             *store.Namespace
	keys, parents []layout.PageKey
	ek            []evict.Key
	pinned        []bool      // ek[i] was tracked and pinned by reserve
	pins          []evict.Key // the pins reserve took
	r             *evict.Reservation
	hold          bool
}

// release drops the pins of an admission whose reserve failed (with
// hold, hands them to the caller: the keys returned).
func (a *admission) release() []evict.Key {
	if a.hold {
		return a.pins
	}
	if err := a.pc.pol.UnpinAll(a.n.Name(), a.pins); err != nil {
		a.pc.log.Warn("kvpersist: page cache: unpin", "err", err)
	}
	return nil
}

// settle is step (4) of reserve, once the write returned with err: what
// is on disk now is accounted (a failed save leaves the pages it
// renamed), the rest of the reservation released, the pins dropped (with
// hold, returned with the commits' pins).
func (a *admission) settle(err error) (held []evict.Key) {
	pc, n, ns := a.pc, a.n, a.n.Name()
	r, hold := a.r, a.hold
	now := time.Now().UnixNano()
	for i, k := range a.ek {
		if a.pinned[i] {
			continue
		}
		if _, ok := pc.pol.Lookup(ns, k); ok {
			// Committed by a save beside this one.
			if hold && pc.pol.Pin(ns, k) {
				held = append(held, k)
			}
			continue
		}
		pf, serr := n.StatPage(n.PagePath(a.keys[i]))
		if serr != nil {
			continue
		}
		p := evict.Page{Namespace: ns, Key: k, Parent: evict.Key(a.parents[i]), HasParent: true, Bytes: pf.AllocatedBytes, Access: now}
		switch {
		case r != nil && hold:
			if serr = r.CommitPinned(p); serr == nil {
				held = append(held, k)
			}
		case r != nil:
			serr = r.Commit(p)
		default:
			if serr = pc.pol.Add(p); serr == nil && hold && pc.pol.Pin(ns, k) {
				held = append(held, k)
			}
		}
		if serr != nil && !errors.Is(serr, evict.ErrExists) {
			pc.log.Debug("kvpersist: page cache: page not accounted", "namespace", ns, "key", a.keys[i].String(), "err", serr)
		}
	}
	if err == nil {
		pc.pol.TouchAll(ns, a.ek, now)
	}
	pc.markDirty(ns)
	pc.kickShrink() // a page longer than estimated, or one added outside a reservation
	if r != nil {
		r.Release()
	}
	return append(held, a.release()...)
}

// admitHeld reserves (with hold) room for pages that a load reads next,
// runs write, which publishes them, and settles: held are the keys
// pinned for the caller (see reserve).
func (pc *pageCache) admitHeld(ctx context.Context, n *store.Namespace, keys, parents []layout.PageKey, fileBytes func(int) (int64, error), write func() error) (held []evict.Key, err error) {
	a, err := pc.reserve(ctx, n, keys, parents, fileBytes, true)
	if err != nil {
		return a.release(), err
	}
	defer func() { held = a.settle(err) }()
	return nil, write()
}

// waitVictim waits until page k of namespace ns is no longer a victim
// whose unlink is pending (Removed or Abandoned), or ctx ends (its error).
// The unlink it waits for needs the namespace's exclusive lock; the caller
// holds no lock of the namespace.
func (pc *pageCache) waitVictim(ctx context.Context, ns string, k evict.Key) error {
	d := time.Millisecond
	for pc.pol.Evicting(ns, k) {
		t := time.NewTimer(d)
		select {
		case <-ctx.Done():
			t.Stop()
			return ctx.Err()
		case <-t.C:
		}
		d = min(2*d, 20*time.Millisecond)
	}
	return nil
}

// unlinkWorkers bounds the unlinks in flight in one namespace: they only
// wait on the file system's metadata (I/O waiting, like a save's fsync
// waiters), and a journal takes several at once.
const unlinkWorkers = 8

// unlinkGroup unlinks the victims vs[group...] of namespace n (its
// exclusive lock held), descendants before ancestors: in waves, each the
// victims whose descendants among the group are all gone, unlinked by up
// to unlinkWorkers goroutines started and joined here. Each removed page
// leaves the policy and the index. After a failed unlink no later wave
// starts; removed says which victims are gone (by index in vs), and the
// caller abandons the rest.
func (pc *pageCache) unlinkGroup(n *store.Namespace, vs []evict.Victim, group []int) (removed map[int]bool, waves int, err error) {
	ns := n.Name()
	removed = make(map[int]bool, len(group))
	at := make(map[evict.Key]int, len(group)) // key -> index in vs
	for _, j := range group {
		at[vs[j].Key] = j
	}
	parent := make(map[int]int, len(group))  // victim -> its parent victim
	waiting := make(map[int]int, len(group)) // victim -> its child victims not yet removed
	for _, j := range group {
		if p, ok := pc.pol.Lookup(ns, vs[j].Key); ok && p.HasParent {
			if pj, ok := at[p.Parent]; ok {
				parent[j] = pj
				waiting[pj]++
			}
		}
	}
	var wave []int
	for _, j := range group {
		if waiting[j] == 0 {
			wave = append(wave, j)
		}
	}
	var mu sync.Mutex
	for len(wave) > 0 && err == nil {
		waves++
		var next []int
		var wg sync.WaitGroup
		work := make(chan int)
		for range min(unlinkWorkers, len(wave)) {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for j := range work {
					path := n.PagePath(layout.PageKey(vs[j].Key))
					// A fan-out that is no directory holds no page of n.
					if rerr := n.RemovePage(path); rerr != nil && !vfs.IsNotExist(rerr) && !errors.Is(rerr, store.ErrNamespace) {
						mu.Lock()
						err = cmpOr(err, fmt.Errorf("engine: evict page %s: %w", path, rerr))
						mu.Unlock()
						continue
					}
					pc.pol.Removed(ns, vs[j].Key)
					pc.unindex(ns, layout.PageKey(vs[j].Key))
					mu.Lock()
					removed[j] = true
					if pj, ok := parent[j]; ok {
						if waiting[pj]--; waiting[pj] == 0 {
							next = append(next, pj)
						}
					}
					mu.Unlock()
				}
			}()
		}
		for _, j := range wave {
			work <- j
		}
		close(work)
		wg.Wait()
		wave = next
	}
	return removed, waves, err
}

// maxReserveAttempts bounds how often a save reserves again after victims
// were kept for page manifests it did not know of.
const maxReserveAttempts = 4

func evictKeys(keys []layout.PageKey) []evict.Key {
	out := make([]evict.Key, len(keys))
	for i, k := range keys {
		out[i] = evict.Key(k)
	}
	return out
}

// pinLoad pins the stored pages of a load's chain (keys, in order, up to
// the first that is not tracked or is a victim) for the load's duration;
// done(loaded, parents) unpins them, and after a successful load touches
// the pages loaded and accounts those this engine did not track (written
// by another process).
func (pc *pageCache) pinLoad(ns string, keys []layout.PageKey) (done func(loaded []layout.PageKey, ok bool)) {
	return pc.pinChain(ns, keys).done
}

// loadPins are the pins of one load: the prefix of its chain pinned so far
// (ek[:k]) and pins taken for it elsewhere (held: pages the remote tier
// fetched, pinned at their commit by admitHeld).
type loadPins struct {
	pc   *pageCache
	ns   string
	ek   []evict.Key
	k    int
	held []evict.Key
}

// pinChain is pinLoad returning the load's pins, so that the load can
// take more before it reads (extend, hold).
func (pc *pageCache) pinChain(ns string, keys []layout.PageKey) *loadPins {
	ek := evictKeys(keys)
	return &loadPins{pc: pc, ns: ns, ek: ek, k: pc.pol.PinPrefix(ns, ek)}
}

// hold adds pins taken for the load elsewhere; done releases them.
func (lp *loadPins) hold(keys []evict.Key) { lp.held = append(lp.held, keys...) }

// extend pins the chain further, from the first page the first pin did
// not reach (a page the read-through has committed since, and the stored
// pages after it), up to the first that is still not tracked.
func (lp *loadPins) extend() {
	lp.k += lp.pc.pol.PinPrefix(lp.ns, lp.ek[lp.k:])
}

// done unpins every pin of the load; after a successful load it touches
// the pages loaded and accounts those this engine did not track (written
// by another process).
func (lp *loadPins) done(loaded []layout.PageKey, ok bool) {
	pc, ns := lp.pc, lp.ns
	if err := pc.pol.UnpinAll(ns, lp.ek[:lp.k]); err != nil {
		pc.log.Warn("kvpersist: page cache: unpin", "err", err)
	}
	if err := pc.pol.UnpinAll(ns, lp.held); err != nil {
		pc.log.Warn("kvpersist: page cache: unpin", "err", err)
	}
	if !ok || len(loaded) == 0 {
		return
	}
	now := time.Now().UnixNano()
	lk := evictKeys(loaded)
	if pc.pol.TouchAll(ns, lk, now) < len(lk) {
		pc.addUntracked(ns, loaded, now)
	}
	pc.markDirty(ns)
}

// addUntracked accounts the pages of chain (from its first page, in order)
// that the policy does not track but whose files exist: pages another
// process wrote. Each is added outside a reservation (the background
// shrink evicts any excess).
func (pc *pageCache) addUntracked(ns string, chain []layout.PageKey, now int64) {
	n, err := pc.st.Namespace(ns)
	if err != nil {
		return
	}
	added := false
	for i, k := range chain {
		if _, ok := pc.pol.Lookup(ns, evict.Key(k)); ok {
			continue
		}
		pf, err := n.StatPage(n.PagePath(k))
		if err != nil {
			continue
		}
		p := evict.Page{Namespace: ns, Key: evict.Key(k), Bytes: pf.AllocatedBytes, Access: now}
		if i > 0 {
			p.Parent, p.HasParent = evict.Key(chain[i-1]), true
		} else if snap, err := n.DecodePage(n.PagePath(k)); err == nil && snap.Page != nil {
			p.Parent, p.HasParent = evict.Key(snap.Page.Parent), true
		}
		if pc.pol.Add(p) == nil {
			added = true
		}
	}
	if added {
		pc.kickShrink()
	}
}

// removedBehind forgets a page a load found missing (removed by another
// process); called only once its file is known to be absent.
func (pc *pageCache) removedBehind(ns string, k layout.PageKey) {
	if pc.pol.Removed(ns, evict.Key(k)) {
		pc.markDirty(ns)
	}
}

// resync makes namespace ns's accounting equal to its page files on disk:
// pages tracked whose files are gone are Removed, page files not tracked
// are added (lstat, and the header for the parent). The engine calls it
// after a collect of ns, which ran alone in the namespace (in this
// process, and under the exclusive lock against others).
func (pc *pageCache) resync(ns string) {
	n, err := pc.st.Namespace(ns)
	if err != nil {
		return
	}
	l, err := n.ListPages()
	if err != nil {
		return
	}
	onDisk := make(map[evict.Key]string, len(l.Pages))
	for _, pg := range l.Pages {
		var k evict.Key
		_, _ = hex.Decode(k[:], []byte(pg.Key))
		onDisk[k] = pg.Path
	}
	changed := false
	for _, r := range pc.pol.Checkpoint(ns, nil) {
		if _, ok := onDisk[r.Key]; ok {
			delete(onDisk, r.Key)
			continue
		}
		if _, err := pc.fs.Lstat(n.PagePath(layout.PageKey(r.Key))); vfs.IsNotExist(err) {
			pc.pol.Removed(ns, r.Key)
			pc.unindex(ns, layout.PageKey(r.Key))
			changed = true
		}
	}
	for k, path := range onDisk {
		pf, err := n.StatPage(path)
		if err != nil {
			continue
		}
		p := evict.Page{Namespace: ns, Key: k, Bytes: pf.AllocatedBytes, Access: pf.ModTime.UnixNano()}
		if snap, err := n.DecodePage(path); err == nil && snap.Page != nil {
			p.Parent, p.HasParent = evict.Key(snap.Page.Parent), true
		}
		if pc.pol.Add(p) == nil {
			pc.index.Add(ns, layout.PageKey(k))
			changed = true
		}
	}
	if changed {
		pc.markDirty(ns)
		pc.kickShrink()
	}
}
