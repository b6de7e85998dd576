// Package pagecache is the I/O shell of kvpersist's bounded page cache: it
// feeds the eviction policy (engine/evict, pure: no I/O) with the page
// files it finds at start and with every write, load, delete and eviction,
// and does the I/O the policy asks for: reservations before a save creates
// a file, unlinks of victims under the namespace's exclusive lock,
// background shrinking, and the recency checkpoints (engine/recency's
// format). See ARCHITECTURE.md, "Evict".
//
// # API
//
// One Cache per engine: Open rebuilds the accounting from the disk and
// starts the background goroutine; Close stops it and writes the
// checkpoints. Pages enter the cache only through Reserve (a save's
// jobs.Admission, settled once the save returned) or AdmitHeld (pages
// fetched for a load): every page file created is covered by a
// reservation. A load pins its chain with PinChain and releases it
// with LoadPins.Done. Lookups touch (TouchLookup); page manifests pin their
// pages (SetManifest); the remote tier marks pages whose upload is pending
// (SetPending) and is told of every page file removed (SetOnRemoved).
// Metrics go to a Sink. Every method is safe for concurrent use.
//
// # Several engines on one root
//
// Caches on one root (engines in one process or several) share one view
// through the root's page log, <root>/.pagelog (shared.go): each appends
// the pages it commits and unlinks, the accesses of its lookups and loads,
// and the bytes it reserves before a save writes and releases after, and
// reads the others' records before each reservation and every second. So
// each cache counts and may evict every page file of the root, least
// recently used first by the accesses of all, and counts the others'
// writes in flight: CapacityBytes, quotas and headroom bound the root's
// page files, D ≤ C + S × P + E with S the saves in flight of every cache
// and C the smallest capacity. Reservations are decided under the log's
// exclusive flock, so two caches never both take the last room. Pins do
// not cross caches: between Reserve and the save's write another cache
// may evict a page the admission found stored and reserved nothing for.
// So the save, once it holds the namespace's shared lock (kept until its
// write ends; every unlink takes the exclusive one), asks
// Admission.Confirm whether those pages are still there; when one is gone
// it settles the admission (ErrPinLost), unlocks and reserves again, now
// for that page too (jobs.Admission.Confirm; AdmitHeld does the same
// around its write). After a few failed confirmations the save goes on,
// and Settle accounts a lost page it wrote outside the reservation. A
// reservation of a process that died is dropped once its pid is gone and
// a sweep, under the namespace's exclusive lock, has counted the temp
// page files and the unrecorded page files it left. At Open the log gives only the others' reservations; pages come
// from the disk and recency from the checkpoints, which every cache writes
// with the merged recency it holds. A page a process unlinked without its
// record (a kill between the two, a collect) stays counted by the others
// until it is chosen as a victim and found gone: more eviction, never less.
package pagecache

import (
	"context"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"os"
	"slices"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/kvpersist/kvpersist/engine/evict"
	"github.com/kvpersist/kvpersist/engine/layout"
	"github.com/kvpersist/kvpersist/engine/metrics/labels"
	"github.com/kvpersist/kvpersist/engine/recency"
	"github.com/kvpersist/kvpersist/engine/store"
	"github.com/kvpersist/kvpersist/engine/vfs"
)

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

// ErrLimits: a limit of Limits is out of range (a negative or too large
// byte count, an invalid namespace name). The error names the field.
var ErrLimits = errors.New("pagecache: invalid limit")

// Limits are the bounds the cache keeps its page files within, in
// allocated bytes (st_blocks × 512). 0 means none for each.
type Limits struct {
	// CapacityBytes bounds the page files of every namespace together.
	CapacityBytes int64
	// HeadroomBytes is the least free space to keep on the root's file
	// system (statvfs, unprivileged), checked before each reservation.
	HeadroomBytes int64
	// QuotaBytes bounds one namespace's page files (namespace → bytes).
	QuotaBytes map[string]int64
}

// Check reports the first limit out of range: each byte count must be in
// [0, 2^53] (evict.MaxBytes) and each quota's key a valid namespace name.
// Errors wrap ErrLimits.
func (l Limits) Check() error {
	if l.CapacityBytes < 0 || l.CapacityBytes > evict.MaxBytes {
		return fmt.Errorf("%w: CapacityBytes %d (want 0, unbounded, to 2^53)", ErrLimits, l.CapacityBytes)
	}
	if l.HeadroomBytes < 0 || l.HeadroomBytes > evict.MaxBytes {
		return fmt.Errorf("%w: HeadroomBytes %d (want 0, none, to 2^53)", ErrLimits, l.HeadroomBytes)
	}
	for ns, q := range l.QuotaBytes {
		if err := layout.ValidName("namespace", ns); err != nil {
			return fmt.Errorf("%w: QuotaBytes: %w", ErrLimits, err)
		}
		if q < 0 || q > evict.MaxBytes {
			return fmt.Errorf("%w: QuotaBytes of namespace %q is %d (want 0, none, to 2^53)", ErrLimits, ns, q)
		}
	}
	return nil
}

// Sink receives the cache's operational signal; engine.MetricsSink (and so
// *metrics.Recorder) satisfies it. Methods must be safe for concurrent use
// and cheap: the cache calls them from saves, loads and its background
// goroutine.
type Sink interface {
	// Job records a background eviction (labels.KindEvict) and its wall
	// time.
	Job(k labels.Kind, o labels.Outcome, d time.Duration, ran bool)
	// Evicted records pages unlinked by eviction and their allocated bytes.
	Evicted(reason evict.Reason, pages, bytes int64)
	// Refused records a reservation refused for want of space, by limit.
	Refused(limit evict.Reason)
	// RemoteUploadEvicted adds evicted pages whose upload to the object
	// store was pending (also counted in Evicted).
	RemoteUploadEvicted(pages int64)
}

// Index is the prefix cache's index of page files (pageindex.Index
// satisfies it): the cache removes the pages it evicts or finds gone, and
// adds the page files Resync finds.
type Index interface {
	Add(ns string, keys ...layout.PageKey)
	Remove(ns string, keys ...layout.PageKey)
}

// Options configure Open.
type Options struct {
	Limits
	Store  *store.Store // the root; required
	Index  Index        // required
	Logger *slog.Logger // nil: slog.Default()
	Sink   Sink         // nil: nothing recorded
	// TempGrace: temp page files (pages/xx/.<key>.tmp-*) older than this
	// are removed by the cache's sweeps, as collect removes them; 0 means
	// store.DefaultTempGrace, a negative value no grace.
	TempGrace time.Duration
}

// Cache is the bounded page cache of one store root: the policy and the
// I/O it asks for. Its background goroutine (run) is started by Open and
// stopped by Close.
type Cache struct {
	pol      *evict.Cache
	st       *store.Store
	fs       vfs.FS
	index    Index
	log      *slog.Logger
	metrics  Sink
	headroom int64         // Limits.HeadroomBytes
	capacity int64         // Limits.CapacityBytes
	blkBytes int64         // the file system's block size: page files' lengths are rounded up to it
	grace    time.Duration // Options.TempGrace as store.Grace reads it

	touches chan touch
	kick    chan struct{}
	sweep   chan struct{} // kicks a sweep of the temp page files (sweepTemps)
	plog    *pageLog      // the root's shared page log (shared.go)
	owner   uint64        // this cache in the page log's reservations
	syncMu  sync.Mutex    // one syncShared at a time: records are applied in order

	extMu    sync.Mutex
	orphans  map[string]int64            // ns → temp page files of dead writers (sweepTemps)
	otherRes map[uint64]map[string]int64 // owner → ns → bytes other caches reserved
	plogErr  sync.Once                   // the first failure to append to it is logged
	stop     chan struct{}
	done     chan struct{}
	bgCtx    context.Context // cancelled by Close: background unlinks stop waiting for locks
	bgStop   context.CancelFunc

	closeOnce sync.Once
	closeErr  error

	mu        sync.Mutex
	quotas    map[string]int64
	dirty     map[string]struct{}                 // namespaces whose recency changed since their checkpoint
	manifests map[string]map[string]*manifestPins // ns → page manifest name → its keys and pins
	named     map[string]map[evict.Key]int        // ns → key → manifests naming it
	scanned   map[string]time.Time                // ns → its directory's mtime at the last manifest scan
	scannedAt map[string]time.Time                // ns → when that scan was made
	tooBig    map[string]bool                     // namespaces too large to checkpoint (logged once)

	// onRemoved, when set (SetOnRemoved), is told of every page file the
	// cache removed or found gone (unindex).
	onRemoved atomic.Pointer[func(ns string, k layout.PageKey)]
	// onGone, when set (SetOnGone), is told of every page file another
	// cache on the root removed (its page log record).
	onGone atomic.Pointer[func(ns string, k layout.PageKey)]
}

// unindex drops page k of namespace ns, whose file is gone, from the
// index, and tells onRemoved.
func (pc *Cache) unindex(ns string, k layout.PageKey) {
	pc.index.Remove(ns, k)
	if f := pc.onRemoved.Load(); f != nil {
		(*f)(ns, k)
	}
}

// Open checks o's limits (ErrLimits), rebuilds the accounting of every
// namespace's page files from the disk (their st_blocks, parents from the
// recency checkpoint or the page headers, pins of the page manifests) and
// starts the background goroutine, which also shrinks the cache at once
// when the disk holds more than the limits. Close it. Errors: ErrLimits,
// or the listing's.
func Open(o Options) (*Cache, error) {
	if o.Store == nil || o.Index == nil {
		return nil, errors.New("pagecache: Options.Store and Options.Index are required")
	}
	if err := o.Limits.Check(); err != nil {
		return nil, err
	}
	pol, err := evict.New(evict.Config{CapacityBytes: o.CapacityBytes, Quotas: o.QuotaBytes})
	if err != nil {
		return nil, fmt.Errorf("%w: %w", ErrLimits, err)
	}
	if o.Logger == nil {
		o.Logger = slog.Default()
	}
	st := o.Store
	pc := &Cache{
		pol: pol, st: st, fs: st.FS(), index: o.Index, log: o.Logger, metrics: o.Sink,
		headroom: o.HeadroomBytes, capacity: o.CapacityBytes, blkBytes: 4096,
		grace:   store.Grace(o.TempGrace),
		touches: make(chan touch, touchQueue), kick: make(chan struct{}, 1), sweep: make(chan struct{}, 1),
		stop: make(chan struct{}), done: make(chan struct{}),
		quotas: map[string]int64{}, dirty: map[string]struct{}{},
		manifests: map[string]map[string]*manifestPins{}, named: map[string]map[evict.Key]int{},
		scanned: map[string]time.Time{}, scannedAt: map[string]time.Time{}, tooBig: map[string]bool{},
	}
	for ns, q := range o.QuotaBytes {
		pc.quotas[ns] = q
	}
	if fst, err := pc.fs.Statfs(st.Root()); err == nil && fst.BlockBytes > 0 {
		pc.blkBytes = fst.BlockBytes
	}
	// The shared page log, created by the first append on the root, is
	// read whole after the rebuild for the reservations of other caches'
	// writes in flight; its pages and accesses are the disk's and the
	// recency checkpoints' (a page a dead process unlinked without its
	// record would come back).
	pc.plog = newPageLog(pc.fs, st.Root())
	pc.owner = uint64(os.Getpid())<<32 | uint64(rand.Uint32())
	liveOwners.Store(pc.owner, true)
	pc.orphans, pc.otherRes = map[string]int64{}, map[uint64]map[string]int64{}
	if err := pc.rebuild(time.Now()); err != nil {
		return nil, err
	}
	pc.syncShared(true)
	pc.bgCtx, pc.bgStop = context.WithCancel(context.Background())
	// Temp page files a crashed process left: removed or counted before
	// the first save reserves.
	pc.sweepTemps(pc.bgCtx, true)
	go pc.run()
	pc.kickShrink() // the disk may hold more than the limits
	return pc, nil
}

// SetOnRemoved sets f (nil: none) to be told of every page file the cache
// removes (evicts) or finds gone (not another cache's, from the page log:
// SetOnGone), after the policy and the index forgot it.
// f runs on the goroutine that removed the page (a save's, a load's or the
// background one), possibly several at once; it must not call back into
// the cache's eviction.
func (pc *Cache) SetOnRemoved(f func(ns string, k layout.PageKey)) {
	if f == nil {
		pc.onRemoved.Store(nil)
		return
	}
	pc.onRemoved.Store(&f)
}

// SetOnGone sets f (nil: none) to be told of every page file another
// cache on the root removed, once the page log tells it and the policy
// and the index forgot it: unlike SetOnRemoved's, not this cache's
// removal (the other cache reported it). f runs on the goroutine that
// read the page log; it must not call back into the cache's eviction.
func (pc *Cache) SetOnGone(f func(ns string, k layout.PageKey)) {
	if f == nil {
		pc.onGone.Store(nil)
		return
	}
	pc.onGone.Store(&f)
}

// Usage returns the accounting (allocated bytes of page files: capacity,
// used, reserved, evicting, pages, and the same per namespace with its
// quota). One short lock, no I/O.
func (pc *Cache) Usage() evict.Usage { return pc.pol.Usage() }

// SetQuota changes namespace ns's quota in allocated bytes (0 removes it).
// A namespace left above its new quota is shrunk in the background.
// Errors wrap ErrLimits: an invalid name, a quota outside [0, 2^53].
func (pc *Cache) SetQuota(ns string, bytes int64) error {
	if err := (Limits{QuotaBytes: map[string]int64{ns: bytes}}).Check(); err != nil {
		return err
	}
	if err := pc.pol.SetQuota(ns, bytes); err != nil {
		return fmt.Errorf("%w: %w", ErrLimits, err)
	}
	pc.mu.Lock()
	pc.quotas[ns] = bytes
	pc.mu.Unlock()
	pc.kickShrink()
	return nil
}

// rebuild adds every page file of every namespace to the policy: its
// allocated bytes and mtime from an lstat, its parent from the namespace's
// recency checkpoint or, for a page the checkpoint does not name, from its
// header; then the checkpoint's recency is applied, and the pages named by
// page manifests are pinned.
func (pc *Cache) rebuild(now time.Time) error {
	names, _, err := pc.st.Namespaces(false)
	if err != nil {
		if vfs.IsNotExist(err) {
			return nil
		}
		return fmt.Errorf("pagecache: page cache: %w", err)
	}
	for _, name := range names {
		n, err := pc.st.Namespace(name)
		if err != nil {
			return fmt.Errorf("pagecache: page cache: %w", err)
		}
		l, err := n.ListPages()
		if err != nil {
			if vfs.IsNotExist(err) {
				continue
			}
			return fmt.Errorf("pagecache: page cache: %w", err)
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
// none, a file that fails validation (recency.ErrCheckpoint) or cannot be
// read is ignored with a log line (the pages then keep their mtimes).
func (pc *Cache) readCheckpoint(n *store.Namespace) []evict.Record {
	recs, err := n.ReadRecency()
	if err != nil {
		pc.log.Warn("kvpersist: page cache: recency checkpoint ignored; pages ordered by their mtimes", "path", n.RecencyPath(), "err", err)
		return nil
	}
	return fromRecency(recs)
}

// fromRecency converts a checkpoint file's records to the policy's.
func fromRecency(recs []recency.Record) []evict.Record {
	out := make([]evict.Record, len(recs))
	for i, r := range recs {
		out[i] = evict.Record{Key: evict.Key(r.Key), Parent: evict.Key(r.Parent), HasParent: r.HasParent, Access: r.Access}
	}
	return out
}

// toRecency converts the policy's records to a checkpoint file's.
func toRecency(recs []evict.Record) []recency.Record {
	out := make([]recency.Record, len(recs))
	for i, r := range recs {
		out[i] = recency.Record{Key: layout.PageKey(r.Key), Parent: layout.PageKey(r.Parent), HasParent: r.HasParent, Access: r.Access}
	}
	return out
}

// writeCheckpoint publishes namespace ns's recency checkpoint (temp file,
// fdatasync, rename, directory fsync, under the store's sync policy). A
// namespace without a directory or without pages is skipped.
func (pc *Cache) writeCheckpoint(ns string) error {
	recs := pc.pol.Checkpoint(ns, nil)
	if len(recs) == 0 {
		return nil
	}
	b, err := recency.Append(nil, toRecency(recs))
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
		return fmt.Errorf("pagecache: page cache: recency checkpoint of %s: %w", ns, err)
	}
	return nil
}

// checkpoint writes the checkpoint of every namespace marked dirty.
func (pc *Cache) checkpoint() error {
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

func (pc *Cache) markDirty(ns string) {
	pc.mu.Lock()
	pc.dirty[ns] = struct{}{}
	pc.mu.Unlock()
}

// run is the background goroutine: it applies the lookups' touches,
// shrinks the cache when kicked (after the rebuild, a quota change, pages
// added outside a reservation), writes the checkpoints of changed
// namespaces every checkpointEvery, and sweeps the temp page files
// (sweepTemps) every sweepEvery and after a Resync. It never takes a lock a load waits on
// for longer than its unlinks.
func (pc *Cache) run() {
	defer close(pc.done)
	tick := time.NewTicker(checkpointEvery)
	defer tick.Stop()
	sweepTick := time.NewTicker(sweepEvery(pc.grace))
	defer sweepTick.Stop()
	sharedTick := time.NewTicker(sharedEvery)
	defer sharedTick.Stop()
	for {
		select {
		case <-sharedTick.C:
			pc.syncShared(false)
		case <-sweepTick.C:
			pc.sweepTemps(pc.bgCtx, false)
		case <-pc.sweep:
			pc.sweepTemps(pc.bgCtx, false)
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

func (pc *Cache) applyTouch(t touch) {
	if pc.pol.Touch(t.ns, t.key, t.at) {
		pc.markDirty(t.ns)
		pc.appendShared([]logRecord{{op: opAccess, ns: t.ns, key: t.key, access: t.at}})
	}
}

// drainTouches applies the queued touches, and appends them to the page
// log in one write.
func (pc *Cache) drainTouches() {
	var recs []logRecord
	defer func() { pc.appendShared(recs) }()
	for {
		select {
		case t := <-pc.touches:
			if pc.pol.Touch(t.ns, t.key, t.at) {
				pc.markDirty(t.ns)
				recs = append(recs, logRecord{op: opAccess, ns: t.ns, key: t.key, access: t.at})
			}
		default:
			return
		}
	}
}

// TouchLookup queues a lookup's access to the deepest page it found (its
// ancestors cannot be evicted before it: leaves go first). It never blocks
// and takes no lock of the policy: the background goroutine applies it.
func (pc *Cache) TouchLookup(ns string, k layout.PageKey) {
	select {
	case pc.touches <- touch{ns: ns, key: evict.Key(k), at: time.Now().UnixNano()}:
	default: // full: dropped (recency is advisory)
	}
}

func (pc *Cache) kickShrink() {
	select {
	case pc.kick <- struct{}{}:
	default:
	}
}

// shrink evicts down to the capacity and each namespace down to its
// quota (evict.ReasonShrink), in the background.
func (pc *Cache) shrink() {
	pc.syncShared(false)
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

// Close stops the background goroutine (goroutines it waits for included)
// and writes the checkpoint of every namespace whose recency changed (or
// that had pages its checkpoint did not name at start). Call it once, when
// no save or load uses the cache any more. A cache that changed nothing
// writes nothing. The error is a checkpoint's (the pages are intact; the
// next start orders them by their mtimes). Later calls return the first
// call's error.
func (pc *Cache) Close() error {
	pc.closeOnce.Do(func() {
		defer liveOwners.Delete(pc.owner)
		pc.bgStop()
		close(pc.stop)
		<-pc.done
		pc.closeErr = pc.checkpoint()
	})
	return pc.closeErr
}

// unlink removes the victims' page files, namespace by namespace, each
// under its namespace's exclusive lock (as collect deletes: no load or save
// of any process holds the namespace meanwhile), in the victims' order
// (descendants before their ancestors: unlinkGroup). A victim named by a page manifest
// found under the lock (written by another process since the last scan) is
// not removed: it and every later victim of its namespace are abandoned,
// and it is pinned. A removed page leaves the policy (Removed) and the
// index. A failed unlink abandons that victim and every later one of its
// namespace. Evicted pages are reported to the Sink; those whose
// upload to the object store was pending (evict.Victim.Pending: nothing
// else was evictable) are also logged (Warn, one line per namespace) and
// counted (RemoteUploadEvicted). kept is the
// number of victims kept for a page manifest; the error is the first
// failure (the lock's, ctx's or an unlink's).
func (pc *Cache) unlink(ctx context.Context, vs []evict.Victim) (kept int, err error) {
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
		// Told to the other caches on the root before the lock goes: no
		// save can write these pages again before the records are in.
		var recs []logRecord
		for _, j := range group[:end] {
			if removed[j] {
				recs = append(recs, logRecord{op: opRemove, ns: ns, key: vs[j].Key})
			}
		}
		pc.appendShared(recs)
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
func (pc *Cache) setManifestLocked(ns, name string, keys []evict.Key) {
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

// SetManifest records that snapshot name of namespace ns is a page
// manifest naming keys (nil: it is none any more, or is gone): the pages
// it names are pinned for as long as it exists (pages not tracked yet are
// pinned when they are), and the pins of what the name held before are
// dropped.
func (pc *Cache) SetManifest(ns, name string, keys []layout.PageKey) {
	var ek []evict.Key
	if keys != nil {
		ek = evictKeys(keys)
	}
	pc.mu.Lock()
	defer pc.mu.Unlock()
	pc.setManifestLocked(ns, name, ek)
}

// Unpin drops one pin of each page of keys in namespace ns (pins that
// AdmitHeld handed over, or that PinStored took). A key not pinned is
// logged and skipped.
func (pc *Cache) Unpin(ns string, keys ...layout.PageKey) {
	if err := pc.pol.UnpinAll(ns, evictKeys(keys)); err != nil {
		pc.log.Warn("kvpersist: page cache: unpin", "err", err)
	}
}

// PinStored pins page k of namespace ns, a stored page about to be read: a
// page being evicted is waited for (then it is gone, or kept and pinned).
// pinned is false when the cache does not track the page (written by
// another process: never this cache's victim) or it is gone. Errors: ctx's.
func (pc *Cache) PinStored(ctx context.Context, ns string, k layout.PageKey) (pinned bool, err error) {
	ek := evict.Key(k)
	for {
		if pc.pol.Pin(ns, ek) {
			return true, nil
		}
		if !pc.pol.Evicting(ns, ek) {
			return false, nil
		}
		if err := pc.waitVictim(ctx, ns, ek); err != nil {
			return false, err
		}
	}
}

// SetPending marks page k of namespace ns pending (its upload to the
// object store is waiting: evicted only after every evictable page that is
// not, evict rule 6), or unmarks it. A page not tracked is not marked.
func (pc *Cache) SetPending(ns string, k layout.PageKey, pending bool) {
	pc.pol.SetPending(ns, evict.Key(k), pending)
}

// Tracked returns the policy's view of page k of namespace ns (allocated
// bytes, parent, last access) and whether the cache tracks it. For tests
// and diagnostics.
func (pc *Cache) Tracked(ns string, k layout.PageKey) (evict.Page, bool) {
	return pc.pol.Lookup(ns, evict.Key(k))
}

// Evicting reports whether page k of namespace ns is a victim whose unlink
// is pending.
func (pc *Cache) Evicting(ns string, k layout.PageKey) bool {
	return pc.pol.Evicting(ns, evict.Key(k))
}

// Pending reports whether page k of namespace ns is marked pending
// (SetPending).
func (pc *Cache) Pending(ns string, k layout.PageKey) bool {
	return pc.pol.Pending(ns, evict.Key(k))
}

// repinLocked pins the pages of namespace ns's manifests that were not
// tracked (or were victims) when the manifest was recorded. pc.mu held.
func (pc *Cache) repinLocked(ns string) {
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
func (pc *Cache) scanManifestsLocked(n *store.Namespace) {
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
func (pc *Cache) rescanManifests(n *store.Namespace) map[evict.Key]int {
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
func (pc *Cache) staleLocked(n *store.Namespace) bool {
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
func (pc *Cache) rescanStale() bool {
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

// Reserve is the one way pages enter the page cache: a prefix save and
// the pages of a layout.Pages write (through their jobs.Admission) and
// pages fetched from the remote tier (AdmitHeld) all go through it, so
// that every page file created is covered by a reservation. keys and
// parents are the pages of namespace n in chain order (parents[i] is page
// i's parent key); fileBytes(i) is an upper bound of page i's file length
// in bytes. The caller then takes the namespace's shared lock, confirms
// the admission under it (Admission.Confirm: the pinned pages are still
// there), does the I/O that publishes pages of keys and settles the
// admission (Admission.Settle).
//
// In order: (1) the keys already tracked are pinned (they are reused, cost
// nothing, and cannot be evicted by this cache while the write runs;
// another cache on the root may evict them: Confirm); a key that is a
// victim whose unlink is pending is waited for (waitVictim, until ctx
// ends) and then written again, never reused; (2) the allocated bytes
// of the others (each length rounded up to the file system's block size)
// are reserved, after a statvfs of the root when a headroom is set, on
// the others' records read from the page log and with the reservation
// appended to it under its exclusive flock (when
// no room can be made, the page manifests of namespaces whose directory
// changed are listed again, once: rescanStale, and the reservation is
// tried again); when no room can be made the error is an
// *evict.NoSpaceError (evict.ErrNoSpace), Sink.Refused is told, and
// nothing changes; (3) the reservation's victims are unlinked (unlink:
// under their namespace's exclusive lock), and Reserve waits for it. Then
// the caller writes, and (4) Settle, on every path (error, cancel, panic),
// commits each page of keys that is not tracked and whose file exists
// with its st_blocks, releases the rest of the reservation (in the page
// log too, with the commits) and drops the pins; on success every page of keys is touched. On an error of Reserve
// the Admission returned (never nil) holds the pins taken so far: release
// them (Admission.Release). Other errors: fileBytes's, ctx's (waiting for
// a victim or a lock), an unlink's.
//
// With hold (pages that a load reads next: pages fetched from the remote
// tier) the pins are handed to the caller instead of dropped: every page
// of keys tracked when Reserve starts keeps the pin of step (1), and every
// page committed in step (4) is committed pinned
// (evict.Reservation.CommitPinned: no reservation can choose it between
// its commit and its pin), so no page of keys can be evicted between its
// publish and the load's reading it. Settle and Release return the keys
// pinned for the caller, who releases them (Unpin, or LoadPins.Hold) when
// the load ends; they are held on every path, error included.
func (pc *Cache) Reserve(ctx context.Context, n *store.Namespace, keys, parents []layout.PageKey, fileBytes func(int) (int64, error), hold bool) (*Admission, error) {
	ns := n.Name()
	// The other caches' unlinks are applied before the pins are taken: a
	// page another cache evicted is not pinned, but reserved for (a save
	// admitted again after Confirm failed needs this).
	pc.syncShared(false)
	ek := evictKeys(keys)
	a := &Admission{pc: pc, n: n, keys: keys, parents: parents, ek: ek, pinned: make([]bool, len(ek)), hold: hold}
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
				return a, fmt.Errorf("pagecache: save to namespace %s waiting for the eviction of page %s: %w", ns, keys[i], err)
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
	// release releases a reservation that is not kept, here and in the
	// page log.
	release := func(r *evict.Reservation) {
		r.Release()
		pc.appendShared([]logRecord{{op: opReserved, ns: ns, owner: pc.owner, bytes: -want}})
	}
	rescanned := false
	for attempt := 0; ; attempt++ {
		// Decided on the other caches' pages, accesses and reservations,
		// and told to them, under the page log's exclusive flock.
		var r *evict.Reservation
		var err error
		lerr := pc.plog.exclusive(func() []logRecord {
			pc.syncShared(false)
			r, err = pc.pol.Reserve(evict.Want{Namespace: ns, Bytes: want, AvailBytes: avail, HeadroomBytes: pc.headroom})
			if err != nil {
				return nil
			}
			return []logRecord{{op: opReserved, ns: ns, owner: pc.owner, bytes: want}}
		})
		if lerr != nil {
			pc.plogErr.Do(func() {
				pc.log.Warn("kvpersist: page cache: page log not appended; other engines on the root see this one's pages late", "path", pc.plog.path, "err", lerr)
			})
		}
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
			return a, fmt.Errorf("pagecache: page cache of namespace %s: %w", ns, err)
		}
		kept, uerr := pc.unlink(ctx, r.Victims)
		if uerr != nil {
			release(r)
			return a, fmt.Errorf("pagecache: making room in the page cache of namespace %s: %w", ns, uerr)
		}
		if kept == 0 {
			// Released in the page log in the same write as the commits
			// (Settle): no other cache counts the pages twice meanwhile.
			a.r, a.want = r, want
			return a, nil
		}
		release(r)
		if attempt == maxReserveAttempts-1 {
			return a, fmt.Errorf("pagecache: page cache of namespace %s: %w: %d attempts met pages named by page manifests of another process", ns, evict.ErrNoSpace, maxReserveAttempts)
		}
	}
}

// Admission is one reservation of Reserve, until its Settle (or, when
// Reserve failed, its Release). One goroutine uses it.
type Admission struct {
	pc            *Cache
	n             *store.Namespace
	keys, parents []layout.PageKey
	ek            []evict.Key
	pinned        []bool      // ek[i] was tracked and pinned by Reserve
	pins          []evict.Key // the pins Reserve took
	r             *evict.Reservation
	want          int64 // r's bytes, released in the page log by Settle
	hold          bool
}

// Release drops the pins of an admission whose Reserve failed; with hold
// it hands them to the caller instead: the keys returned (nil without
// hold).
func (a *Admission) Release() []layout.PageKey {
	return pageKeys(a.release())
}

func (a *Admission) release() []evict.Key {
	if a.hold {
		return a.pins
	}
	if err := a.pc.pol.UnpinAll(a.n.Name(), a.pins); err != nil {
		a.pc.log.Warn("kvpersist: page cache: unpin", "err", err)
	}
	return nil
}

// Settle is step (4) of Reserve, once the write returned with err: what
// is on disk now is accounted (a failed save leaves the pages it
// renamed), the rest of the reservation released, the pins dropped (with
// hold, returned with the commits' pins: the keys held for the caller).
func (a *Admission) Settle(err error) (held []layout.PageKey) {
	return pageKeys(a.settle(err))
}

func (a *Admission) settle(err error) (held []evict.Key) {
	pc, n, ns := a.pc, a.n, a.n.Name()
	r, hold := a.r, a.hold
	now := time.Now().UnixNano()
	// The page log's records of this settle, appended in one write with
	// the reservation's release.
	var recs []logRecord
	for i, k := range a.ek {
		_, tracked := pc.pol.Lookup(ns, k)
		if tracked && a.pinned[i] {
			continue
		}
		// A page pinned by Reserve that is not tracked any more was
		// unlinked by another cache on the root (pins do not cross
		// caches) and written again by this save after Confirm gave up:
		// accounted again below, outside the reservation.
		if tracked {
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
		case a.pinned[i]: // its pin is still held (a.pins)
			serr = pc.pol.Add(p)
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
		if serr == nil {
			recs = append(recs, logRecord{op: opAdd, ns: ns, key: k, parent: p.Parent, hasParent: p.HasParent, bytes: p.Bytes, access: now})
		}
	}
	if err == nil {
		pc.pol.TouchAll(ns, a.ek, now)
		if len(a.ek) > 0 {
			recs = append(recs, logRecord{op: opAccess, ns: ns, key: a.ek[len(a.ek)-1], access: now})
		}
	}
	pc.markDirty(ns)
	pc.kickShrink() // a page longer than estimated, or one added outside a reservation
	if r != nil {
		r.Release()
		recs = append(recs, logRecord{op: opReserved, ns: ns, owner: pc.owner, bytes: -a.want})
	}
	pc.appendShared(recs)
	return append(held, a.release()...)
}

// ErrPinLost settles an admission whose Confirm failed: a page it reused
// was unlinked by another engine on the root; the caller admits again.
var ErrPinLost = errors.New("pagecache: a reused page was evicted by another engine on the root")

// Confirm reports whether every page Reserve found stored (pinned, and
// reserved no room for) still exists. Pins do not cross caches: another
// cache on the root may have unlinked one since, and a save that writes it
// again would write outside its reservation. The caller holds namespace
// n's shared lock, and keeps it until its write ends: no cache unlinks a
// page of n meanwhile, so a true answer stays true. On false the caller
// settles the admission (Settle(ErrPinLost)), releases the lock and
// reserves again.
func (a *Admission) Confirm() bool {
	for i, k := range a.keys {
		if !a.pinned[i] {
			continue
		}
		if _, err := a.pc.fs.Lstat(a.n.PagePath(k)); vfs.IsNotExist(err) {
			return false
		}
	}
	return true
}

// maxPinLost bounds the reservations AdmitHeld makes when Confirm fails;
// after the last, the fetch goes on unconfirmed (it then
// writes the lost pages outside its reservation, accounted by Settle and
// trimmed by the next shrink).
const maxPinLost = 4

// AdmitHeld reserves (with hold) room for pages of namespace n that a
// load reads next, runs write, which publishes them, and settles (see
// Reserve): held are the keys pinned for the caller, on every path, error
// included. When Reserve found pages of keys stored, write runs under n's
// shared lock, taken after the reservation and confirmed (Confirm): write
// may take the shared lock itself, never the exclusive one. Errors:
// Reserve's, write's, ctx's (waiting for the lock).
func (pc *Cache) AdmitHeld(ctx context.Context, n *store.Namespace, keys, parents []layout.PageKey, fileBytes func(int) (int64, error), write func() error) (held []layout.PageKey, err error) {
	for attempt := 1; ; attempt++ {
		var a *Admission
		if a, err = pc.Reserve(ctx, n, keys, parents, fileBytes, true); err != nil {
			return a.Release(), err
		}
		if len(a.pins) > 0 {
			unlock, lerr := n.Lock(ctx, false)
			if lerr != nil {
				return a.Settle(lerr), lerr
			}
			if attempt < maxPinLost && !a.Confirm() {
				lost := a.Settle(ErrPinLost)
				unlock()
				if uerr := pc.pol.UnpinAll(n.Name(), evictKeys(lost)); uerr != nil {
					pc.log.Warn("kvpersist: page cache: unpin", "err", uerr)
				}
				continue
			}
			defer unlock() // after the settle below
		}
		defer func() { held = a.Settle(err) }()
		return nil, write()
	}
}

// waitVictim waits until page k of namespace ns is no longer a victim
// whose unlink is pending (Removed or Abandoned), or ctx ends (its error).
// The unlink it waits for needs the namespace's exclusive lock; the caller
// holds no lock of the namespace.
func (pc *Cache) waitVictim(ctx context.Context, ns string, k evict.Key) error {
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
func (pc *Cache) unlinkGroup(n *store.Namespace, vs []evict.Victim, group []int) (removed map[int]bool, waves int, err error) {
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
						err = cmpOr(err, fmt.Errorf("pagecache: evict page %s: %w", path, rerr))
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

func pageKeys(keys []evict.Key) []layout.PageKey {
	if keys == nil {
		return nil
	}
	out := make([]layout.PageKey, len(keys))
	for i, k := range keys {
		out[i] = layout.PageKey(k)
	}
	return out
}

// LoadPins are the pins of one load: the prefix of its chain pinned so far
// (ek[:k]) and pins taken for it elsewhere (held: pages the remote tier
// fetched, pinned at their commit by AdmitHeld).
type LoadPins struct {
	pc   *Cache
	ns   string
	ek   []evict.Key
	k    int
	held []evict.Key
}

// PinChain pins the stored pages of a load's chain (keys, in chain order,
// up to the first that is not tracked or is a victim) for the load's
// duration and returns the load's pins, so that the load can take more
// before it reads (Extend, Hold). The caller calls Done exactly once.
func (pc *Cache) PinChain(ns string, keys []layout.PageKey) *LoadPins {
	ek := evictKeys(keys)
	return &LoadPins{pc: pc, ns: ns, ek: ek, k: pc.pol.PinPrefix(ns, ek)}
}

// Pinned is how many pages of the chain, from its first, the load has
// pinned so far (PinChain, Extend).
func (lp *LoadPins) Pinned() int { return lp.k }

// Hold adds pins taken for the load elsewhere (AdmitHeld's held); Done
// releases them.
func (lp *LoadPins) Hold(keys []layout.PageKey) { lp.held = append(lp.held, evictKeys(keys)...) }

// Extend pins the chain further, from the first page the first pin did
// not reach (a page the read-through has committed since, and the stored
// pages after it), up to the first that is still not tracked.
func (lp *LoadPins) Extend() {
	lp.k += lp.pc.pol.PinPrefix(lp.ns, lp.ek[lp.k:])
}

// Done unpins every pin of the load; when ok (the load succeeded) it
// touches the pages loaded (loaded, in chain order from the first page)
// and accounts those the cache did not track (written by another process).
func (lp *LoadPins) Done(loaded []layout.PageKey, ok bool) {
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
	pc.appendShared([]logRecord{{op: opAccess, ns: ns, key: lk[len(lk)-1], access: now}})
}

// addUntracked accounts the pages of chain (from its first page, in order)
// that the policy does not track but whose files exist: pages another
// process wrote. Each is added outside a reservation (the background
// shrink evicts any excess).
func (pc *Cache) addUntracked(ns string, chain []layout.PageKey, now int64) {
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

// RemovedBehind forgets a page a load found missing (removed by another
// process); called only once its file is known to be absent.
func (pc *Cache) RemovedBehind(ns string, k layout.PageKey) {
	if pc.pol.Removed(ns, evict.Key(k)) {
		pc.markDirty(ns)
	}
}

// Resync makes namespace ns's accounting equal to its page files on disk:
// pages tracked whose files are gone are Removed, page files not tracked
// are added (lstat, and the header for the parent). The engine calls it
// after a collect of ns, which ran alone in the namespace (in this
// process, and under the exclusive lock against others).
func (pc *Cache) Resync(ns string) {
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
	select { // a collect removed temp files: count them again
	case pc.sweep <- struct{}{}:
	default:
	}
}

// sweepEvery is how often the background goroutine sweeps the temp page
// files: half the grace, so an orphan goes within 1.5 graces of its last
// write, between a second (a readdir of every fan-out directory costs
// 2 µs an entry) and a minute.
func sweepEvery(grace time.Duration) time.Duration {
	return min(max(grace/2, time.Second), time.Minute)
}

// sweepLockWait bounds how long a sweep waits for a namespace's exclusive
// lock (held by collect, or waited for behind loads and saves): the
// background goroutine also applies touches and evicts.
const sweepLockWait = 200 * time.Millisecond

// sweepTemps removes and counts the temp page files of every namespace
// (sweepNamespaceTemps). atOpen: no save of this cache is in flight yet.
func (pc *Cache) sweepTemps(ctx context.Context, atOpen bool) {
	dead := pc.deadOwners()
	names, _, err := pc.st.Namespaces(false)
	if err != nil {
		return
	}
	for _, ns := range names {
		if ctx.Err() != nil {
			return
		}
		pc.sweepNamespaceTemps(ctx, ns, atOpen, dead[ns])
		delete(dead, ns)
	}
	for ns, owners := range dead {
		pc.dropOwners(ns, owners) // the namespace is gone, and its files
	}
}

// sweepNamespaceTemps deals with the temp page files of namespace ns
// (pages/xx/.<key>.tmp-*: a save or a read-through that died before its
// rename). Every writer of a temp page file holds the namespace's shared
// lock from before it creates the file until it is renamed or removed, so
// under the exclusive lock every temp file found has no writer left: one
// older than the grace is removed (as collect removes it), the others are
// counted in the policy's Used (evict.Cache.SetTempBytes) until a later
// sweep removes them, so that the capacity bounds page and temp files
// together. When the lock is not granted within sweepLockWait: at Open
// every temp file is counted (some may be another process's writes in
// flight, counted twice until the next sweep: more eviction, never less);
// later, the count is left as it was until the next sweep (the cache's own
// writes in flight are covered by their reservations).
//
// dead are the owners of reservations in ns whose process is gone
// (deadOwners). Their reservations stay counted until a sweep holds the
// exclusive lock: then their temp page files are counted here and the
// page files they renamed into place without a page log record (killed
// between the two) are added by Resync, and only then are the
// reservations dropped, so that no moment counts neither.
func (pc *Cache) sweepNamespaceTemps(ctx context.Context, ns string, atOpen bool, dead []uint64) {
	n, err := pc.st.Namespace(ns)
	if err != nil {
		return
	}
	l, err := n.ListPages()
	if err != nil || (len(l.Temps) == 0 && len(dead) == 0) {
		if err == nil {
			pc.setTempBytes(ns, 0)
		}
		return
	}
	lctx, cancel := context.WithTimeout(ctx, sweepLockWait)
	unlock, err := n.Lock(lctx, true)
	cancel()
	if err != nil {
		if atOpen {
			var all int64
			for _, t := range l.Temps {
				if fi, err := pc.fs.Lstat(t.Path); err == nil {
					all += allocated(fi)
				}
			}
			pc.setTempBytes(ns, all)
		}
		return
	}
	defer unlock()
	now := time.Now()
	var left int64
	removed := 0
	for _, t := range l.Temps {
		fi, err := pc.fs.Lstat(t.Path)
		if err != nil || !fi.Mode().IsRegular() {
			continue // renamed into place or removed since the listing
		}
		if now.Sub(fi.ModTime()) >= pc.grace {
			rerr := pc.fs.Remove(t.Path)
			if rerr == nil || vfs.IsNotExist(rerr) {
				removed++
				continue
			}
			pc.log.Warn("kvpersist: page cache: temp page file not removed", "path", t.Path, "err", rerr)
		}
		left += allocated(fi)
	}
	pc.setTempBytes(ns, left)
	if len(dead) > 0 {
		pc.Resync(ns)
		pc.dropOwners(ns, dead)
	}
	if removed > 0 {
		pc.log.Info("kvpersist: page cache: removed temp page files left by a write that did not finish", "namespace", ns, "files", removed)
	}
}

// setTempBytes sets the bytes of namespace ns's temp page files whose
// writers are dead, and accounts them (extBytes).
func (pc *Cache) setTempBytes(ns string, bytes int64) {
	pc.extMu.Lock()
	if bytes > 0 {
		pc.orphans[ns] = bytes
	} else {
		delete(pc.orphans, ns)
	}
	pc.extMu.Unlock()
	pc.extBytes(ns)
}

// otherReserved adds delta to the bytes cache owner (another one on the
// root) holds reserved in namespace ns, and accounts them (extBytes).
func (pc *Cache) otherReserved(owner uint64, ns string, delta int64) {
	pc.extMu.Lock()
	m := pc.otherRes[owner]
	if m == nil {
		m = map[string]int64{}
		pc.otherRes[owner] = m
	}
	if m[ns] += delta; m[ns] <= 0 {
		delete(m, ns)
		if len(m) == 0 {
			delete(pc.otherRes, owner)
		}
	}
	pc.extMu.Unlock()
	pc.extBytes(ns)
}

// liveOwners are the page log owners of the caches open in this process
// (a record of this process's pid from another owner is a dead process's
// whose pid was reused, or a closed cache's).
var liveOwners sync.Map

// deadOwners are, per namespace, the other caches holding reservations
// counted here whose process is gone (they will never release them).
func (pc *Cache) deadOwners() map[string][]uint64 {
	pc.extMu.Lock()
	defer pc.extMu.Unlock()
	dead := map[string][]uint64{}
	for owner, m := range pc.otherRes {
		if pid := int(owner >> 32); pid == os.Getpid() {
			if _, live := liveOwners.Load(owner); live {
				continue
			}
		} else if syscall.Kill(pid, 0) != syscall.ESRCH {
			continue
		}
		for ns := range m {
			dead[ns] = append(dead[ns], owner)
		}
	}
	return dead
}

// dropOwners forgets the reservations of owners in namespace ns.
func (pc *Cache) dropOwners(ns string, owners []uint64) {
	pc.extMu.Lock()
	for _, owner := range owners {
		if m := pc.otherRes[owner]; m != nil {
			if delete(m, ns); len(m) == 0 {
				delete(pc.otherRes, owner)
			}
		}
	}
	pc.extMu.Unlock()
	pc.extBytes(ns)
}

// extBytes gives the policy namespace ns's bytes that are not its pages
// nor its reservations: temp page files of dead writers and the other
// caches' reservations (evict.Cache.SetTempBytes), and shrinks the cache
// when they grew.
func (pc *Cache) extBytes(ns string) {
	pc.extMu.Lock()
	defer pc.extMu.Unlock()
	bytes := pc.orphans[ns]
	for _, m := range pc.otherRes {
		bytes += m[ns]
	}
	before := pc.pol.Usage().TempBytes
	if err := pc.pol.SetTempBytes(ns, min(bytes, evict.MaxBytes)); err != nil {
		pc.log.Warn("kvpersist: page cache: temp bytes not accounted", "namespace", ns, "err", err)
		return
	}
	if pc.pol.Usage().TempBytes > before {
		pc.kickShrink()
	}
}

// allocated is a file's allocated bytes (st_blocks × 512), or its length
// rounded up to 4 KiB where the file system reports no blocks.
func allocated(fi os.FileInfo) int64 {
	if a, ok := vfs.AllocatedBytes(fi); ok {
		return a
	}
	return (fi.Size() + 4095) &^ 4095
}

// sharedEvery is how often the background goroutine reads the page log
// (besides before each reservation and each shrink).
const sharedEvery = time.Second

// appendShared appends recs to the root's page log (replacing the log when
// it grew too long). A failure is logged once: the other caches then miss
// these records until their next resync.
func (pc *Cache) appendShared(recs []logRecord) {
	compact, err := pc.plog.append(recs)
	if err == nil && compact {
		err = pc.plog.compact()
	}
	if err != nil {
		pc.plogErr.Do(func() {
			pc.log.Warn("kvpersist: page cache: page log not appended; other engines on the root see this one's pages late", "path", pc.plog.path, "err", err)
		})
	}
}

// syncShared applies the page log's records appended since the last read
// (atOpen: only the reservations, see Open):
// the pages other caches committed are tracked (counted, and evictable
// here), those they unlinked are forgotten, their accesses move recency
// forward. When the log was replaced or does not check, every namespace is
// resynced from the disk and its recency checkpoint applied.
func (pc *Cache) syncShared(atOpen bool) {
	pc.syncMu.Lock()
	defer pc.syncMu.Unlock()
	recs, resync, err := pc.plog.read()
	if err != nil {
		pc.plogErr.Do(func() {
			pc.log.Warn("kvpersist: page cache: page log not read; other engines on the root are seen late", "path", pc.plog.path, "err", err)
		})
		return
	}
	added := false
	for _, r := range recs {
		if atOpen && r.op != opReserved {
			continue
		}
		switch r.op {
		case opAdd:
			if _, ok := pc.pol.Lookup(r.ns, r.key); ok {
				pc.pol.Touch(r.ns, r.key, r.access)
				continue
			}
			p := evict.Page{Namespace: r.ns, Key: r.key, Parent: r.parent, HasParent: r.hasParent, Bytes: r.bytes, Access: r.access}
			if pc.pol.Add(p) == nil {
				added = true
				pc.markDirty(r.ns)
			}
		case opRemove:
			// The other cache removed it and told its onRemoved: here
			// it is only forgotten (onGone).
			if pc.pol.Removed(r.ns, r.key) {
				pc.index.Remove(r.ns, layout.PageKey(r.key))
				if f := pc.onGone.Load(); f != nil {
					(*f)(r.ns, layout.PageKey(r.key))
				}
				pc.markDirty(r.ns)
			}
		case opAccess:
			if pc.pol.Touch(r.ns, r.key, r.access) {
				pc.markDirty(r.ns)
			}
		case opReserved:
			if r.owner != pc.owner {
				pc.otherReserved(r.owner, r.ns, r.bytes)
			}
		}
	}
	if resync {
		names, _, err := pc.st.Namespaces(false)
		if err == nil {
			for _, ns := range names {
				pc.Resync(ns)
				if n, err := pc.st.Namespace(ns); err == nil {
					if recs := pc.readCheckpoint(n); len(recs) > 0 {
						pc.pol.ApplyCheckpoint(ns, recs, time.Now().UnixNano())
					}
				}
			}
		}
		added = true
	}
	if added {
		pc.kickShrink()
	}
}
