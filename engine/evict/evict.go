// Package evict is the eviction policy of kvpersist's page cache: a pure,
// in-memory data structure (no file access, no goroutines, no clock) that
// tracks the cache's pages and decides which to evict, so that the cache
// stays within a capacity in bytes, each namespace within its optional
// quota, and the file system above a headroom of free bytes. The page
// cache's I/O (engine/pagecache) drives it; the recency checkpoint's file
// format is engine/recency.
//
// # What it tracks
//
// A page (see ARCHITECTURE.md, "Evict") is identified by
// its namespace and its key (the 32-byte SHA-256 chain key); it has a parent
// key (except the first page of a chain), its allocated bytes on disk
// (st_blocks × 512 of its file, not its length) and its last access (unix
// nanoseconds, from the caller's clock: the package never reads a clock).
//
// # The rules (the order in which pages are evicted)
//
//  1. Never a page with a stored descendant: a page is evictable only when no
//     tracked page of its namespace names it as parent. Leaves go first, so a
//     prefix shared by many chains (a system prompt) outlives their tails.
//  2. Never a pinned page: Pin/Unpin keep a pin count per page, held by every
//     snapshot manifest that names the page and by every in-flight load or
//     save that uses it.
//  3. Never a page already chosen as a victim (it is being unlinked).
//  4. Among the evictable pages of the candidate set, the least recently
//     used first (within each class of rule 6), in the total order
//     (Access, Namespace, Key) ascending.
//  5. Tenants: a save in namespace A may evict pages of A, and pages of any
//     namespace that has no quota or that is above its quota (their bytes
//     beyond a quota are shared); it never evicts pages of a namespace that
//     has a quota and is within it. A's own quota is met from A's pages only.
//  6. Pending pages last: a page marked pending (SetPending; the engine
//     marks a page whose upload to the object store is waiting, so that
//     evicting it would lose the fleet's only copy to come) is evicted
//     only after every evictable page of the candidate set that is not
//     pending. It is a second class of rule 4's order, not a pin: when
//     only pending pages are evictable they are evicted (least recently
//     used first), so a full cache still makes room. Rules 1-3 and 5 hold
//     for both classes alike; a non-pending page whose descendants are
//     pending waits until they are gone (a non-pending parent of a
//     pending leaf becomes evictable, in the first class, once that leaf
//     is gone).
//     So the order is (Pending, Access, Namespace, Key) ascending, and a
//     Victim says whether it was pending.
//
// # Accounting and the bound
//
// Used is the sum of the allocated bytes of tracked pages (victims included
// until Removed) and of the temp files no reservation covers (SetTempBytes), Reserved the sum of the bytes still held by reservations,
// Evicting the bytes of victims chosen but not yet Removed. Reserve succeeds
// only if afterwards
//
//	Used − Evicting + Reserved ≤ Capacity   (and the same per namespace with its quota)
//
// choosing victims to make it so, or fails with ErrNoSpace changing nothing.
// When the engine follows the protocol (reserve before it creates a file,
// write no more than it reserved, call Removed only after the unlink, Release
// only after its temp files are gone), the allocated bytes D of the cache's
// files on disk satisfy at every instant
//
//	D ≤ Capacity + Evicting + Excess
//
// where Excess is the bytes that in-flight saves wrote beyond their
// reservations (zero when a save reserves an upper bound of what it writes).
// So the cache never exceeds its capacity by more than the pages in flight:
// victims not yet unlinked, and the part of in-flight saves their estimate
// missed. Pages added outside a reservation (Add, when the index is rebuilt
// from disk) can leave the cache above capacity; the next Reserve evicts the
// excess first, and Shrink does so in the background.
//
// All methods are safe for concurrent use (one mutex); choosing a victim
// costs O(log n + log m) for n pages and m namespaces.
package evict

import (
	"errors"
	"fmt"
	"sort"
	"sync"
)

// KeyBytes is the length of a page key in bytes (a SHA-256).
const KeyBytes = 32

// Key is a page key: the 32 raw bytes of the page's SHA-256 chain key.
type Key [KeyBytes]byte

// String is the key as 64 lowercase hex digits (the page's file name).
func (k Key) String() string { return fmt.Sprintf("%x", k[:]) }

// Page describes a stored page to the policy.
type Page struct {
	Namespace string
	Key       Key
	// Parent is the previous page of the chain when HasParent; the first
	// page of a chain has none.
	Parent    Key
	HasParent bool
	// Bytes is the page file's allocated size in bytes (st_blocks × 512),
	// ≥ 0.
	Bytes int64
	// Access is the last access, in unix nanoseconds (the caller's clock).
	Access int64
}

// Reason says why a page was chosen as a victim.
type Reason uint8

// Reasons (also the Limit of a NoSpaceError).
const (
	// ReasonCapacity: to keep the cache within its capacity.
	ReasonCapacity Reason = iota + 1
	// ReasonQuota: to keep the namespace within its quota.
	ReasonQuota
	// ReasonHeadroom: to keep the file system's free bytes above the
	// headroom.
	ReasonHeadroom
	// ReasonShrink: background eviction down to a target (Shrink).
	ReasonShrink
)

// String is "capacity", "quota", "headroom" or "shrink" (metric labels).
func (r Reason) String() string {
	switch r {
	case ReasonCapacity:
		return "capacity"
	case ReasonQuota:
		return "quota"
	case ReasonHeadroom:
		return "headroom"
	case ReasonShrink:
		return "shrink"
	}
	return fmt.Sprintf("Reason(%d)", int(r))
}

// Victim is a page chosen for eviction. The engine unlinks its file (under
// the namespace's exclusive lock) and then calls Removed; if the unlink
// fails it calls Abandon. Victims come in an order in which each page's
// descendants precede it: unlink them in that order.
type Victim struct {
	Namespace string
	Key       Key
	Bytes     int64 // allocated bytes
	Reason    Reason
	// Pending: the page was marked pending (rule 6) when it was chosen:
	// nothing else evictable was left to make the room.
	Pending bool
}

// Sentinel errors, usable with errors.Is.
var (
	// ErrNoSpace: no room can be made: every page that could be evicted is
	// pinned, has a stored descendant, belongs to a protected tenant, or
	// there are none. A *NoSpaceError says which limit and by how much.
	ErrNoSpace = errors.New("evict: cannot make room")
	// ErrInvalid: a bad argument (negative bytes, a page of another
	// namespace committed to a reservation, a finished reservation).
	ErrInvalid = errors.New("evict: invalid argument")
	// ErrExists: Add of a page that is already tracked.
	ErrExists = errors.New("evict: page already tracked")
	// ErrNotFound: the page is not tracked (or is not pinned, for Unpin; or
	// is not a victim, for Abandon).
	ErrNotFound = errors.New("evict: page not tracked")
)

// NoSpaceError is the error of a Reserve that could not make room. It
// matches ErrNoSpace.
type NoSpaceError struct {
	// Limit is the limit that could not be met: ReasonCapacity,
	// ReasonQuota or ReasonHeadroom.
	Limit     Reason
	Namespace string
	// NeedBytes is how many bytes had to be evicted for the limit;
	// FoundBytes how many evictable bytes there were.
	NeedBytes, FoundBytes int64
	// RequestBytes is the reservation asked for.
	RequestBytes int64
}

func (e *NoSpaceError) Error() string {
	return fmt.Sprintf("evict: cannot make room for %d bytes in namespace %q: %s needs %d bytes evicted, only %d are evictable (the rest is pinned, shared by a stored descendant or protected by a quota)",
		e.RequestBytes, e.Namespace, e.Limit, e.NeedBytes, e.FoundBytes)
}

// Is makes errors.Is(err, ErrNoSpace) true.
func (e *NoSpaceError) Is(target error) bool { return target == ErrNoSpace }

// Config sets the limits. Zero means unbounded.
type Config struct {
	// CapacityBytes bounds the allocated bytes of the whole cache; 0 means
	// no bound.
	CapacityBytes int64
	// Quotas bounds the allocated bytes of a namespace; a namespace not
	// listed (or with 0) has no quota.
	Quotas map[string]int64
}

// Cache is the policy's state. Create it with New.
type Cache struct {
	mu       sync.Mutex
	capacity int64
	nss      map[string]*nsState
	quotas   map[string]int64
	used     int64 // allocated bytes of tracked pages (victims included) and of temp files (SetTempBytes)
	temp     int64 // the part of used that is temp files
	reserved int64
	evicting int64
	pages    int
	shared   nsHeap // namespaces whose pages others may evict, with an evictable page
	nextRes  uint64
}

// nsState is one namespace.
type nsState struct {
	name                     string
	quota                    int64
	used, reserved, evicting int64
	temp                     int64 // the part of used that is temp files (SetTempBytes)
	pages                    int
	reservations             int // not yet released
	nodes                    map[Key]*node
	lru                      pageHeap // evictable pages, least recently used on top
	sharedIdx                int      // index in Cache.shared, -1 when absent
}

// node is a page, or a placeholder for a parent that is not tracked but has
// tracked children (present false), or for a removed page still pinned.
type node struct {
	key       Key
	parent    Key
	hasParent bool
	present   bool
	evicting  bool
	pending   bool // SetPending (rule 6); only a present page is pending
	bytes     int64
	access    int64
	pins      int32
	children  int32 // tracked pages naming this one as parent, victims excluded
	idx       int   // index in nsState.lru, -1 when absent
	up        *node // the parent's node, set when n became a counted child
}

// New returns an empty policy with cfg's limits.
func New(cfg Config) (*Cache, error) {
	if cfg.CapacityBytes < 0 || cfg.CapacityBytes > MaxBytes {
		return nil, fmt.Errorf("%w: CapacityBytes %d (want 0 to 2^53)", ErrInvalid, cfg.CapacityBytes)
	}
	c := &Cache{capacity: cfg.CapacityBytes, nss: map[string]*nsState{}, quotas: map[string]int64{}}
	for ns, q := range cfg.Quotas {
		if q < 0 || q > MaxBytes {
			return nil, fmt.Errorf("%w: quota of namespace %q is %d (want 0 to 2^53)", ErrInvalid, ns, q)
		}
		if q > 0 {
			c.quotas[ns] = q
		}
	}
	return c, nil
}

// ns returns the namespace's state, creating it when create is true.
func (c *Cache) ns(name string, create bool) *nsState {
	s := c.nss[name]
	if s == nil && create {
		s = &nsState{name: name, quota: c.quotas[name], nodes: map[Key]*node{}, sharedIdx: -1}
		c.nss[name] = s
	}
	return s
}

// gc drops an empty namespace's state.
func (c *Cache) gc(s *nsState) {
	if len(s.nodes) == 0 && s.reservations == 0 && s.sharedIdx < 0 && s.temp == 0 {
		delete(c.nss, s.name)
	}
}

func (n *node) eligible() bool {
	return n.present && !n.evicting && n.pins == 0 && n.children == 0
}

// less is the eviction order: pages not pending first (rule 6), then the
// least recently used, then namespace, then key.
func less(a *node, an string, b *node, bn string) bool {
	if a.pending != b.pending {
		return b.pending
	}
	if a.access != b.access {
		return a.access < b.access
	}
	if an != bn {
		return an < bn
	}
	return keyLess(a.key, b.key)
}

func keyLess(a, b Key) bool {
	for i := range a {
		if a[i] != b[i] {
			return a[i] < b[i]
		}
	}
	return false
}

// fix puts n in or out of its namespace's heap after a change of its
// eligibility or access, then fixes the namespace's place among the shared.
func (c *Cache) fix(s *nsState, n *node) {
	switch e := n.eligible(); {
	case e && n.idx < 0:
		s.lru.push(n)
	case !e && n.idx >= 0:
		s.lru.remove(n.idx)
	case e:
		s.lru.fix(n.idx)
	}
	c.fixShared(s)
}

// isShared: other namespaces' saves may evict s's pages.
func (s *nsState) isShared() bool {
	return s.quota == 0 || s.used-s.evicting > s.quota
}

func (c *Cache) fixShared(s *nsState) {
	in := s.isShared() && s.lru.len() > 0
	switch {
	case in && s.sharedIdx < 0:
		c.shared.push(s)
	case !in && s.sharedIdx >= 0:
		c.shared.remove(s.sharedIdx)
	case in:
		c.shared.fix(s.sharedIdx)
	}
}

// drop forgets a node no longer needed.
func (s *nsState) drop(n *node) {
	if !n.present && n.children == 0 && n.pins == 0 {
		delete(s.nodes, n.key)
	}
}

// adjustChildren changes the child count of n's parent by d.
// While n counts as a child (tracked, not a victim) its parent's node stays
// in the map, so n.up is valid for a decrement; an increment looks the
// parent up again (the node may have been dropped meanwhile).
func (c *Cache) adjustChildren(s *nsState, n *node, d int32) {
	if !n.hasParent {
		return
	}
	p := n.up
	if d > 0 {
		p = s.nodes[n.parent]
		if p == nil {
			p = &node{key: n.parent, idx: -1}
			s.nodes[n.parent] = p
		}
		n.up = p
	}
	p.children += d
	c.fix(s, p)
	s.drop(p)
}

// Add tracks a stored page outside any reservation: the index rebuilt from
// disk at start, or a page written by another process. Errors: ErrInvalid
// (negative bytes, a page that is its own parent or its own ancestor: its
// parent chain among the tracked pages leads back to it), ErrExists.
func (c *Cache) Add(p Page) error {
	if err := checkPage(p); err != nil {
		return err
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	s := c.ns(p.Namespace, true)
	if n := s.nodes[p.Key]; n != nil && n.present {
		return fmt.Errorf("%w: %s/%s", ErrExists, p.Namespace, p.Key)
	}
	if err := s.checkAncestry(p); err != nil {
		c.gc(s)
		return err
	}
	c.insert(s, p)
	return nil
}

// checkAncestry refuses (ErrInvalid) a new page p that would be its own
// ancestor: a cycle in the parent links (records A→B and B→A) would make
// every page on it, and every ancestor of those, keep a stored descendant
// forever (rule 1), so never evictable, and every save would end in
// ErrNoSpace. It walks p's tracked ancestors, present pages only (only
// they count as children); the walk is skipped when no node of p's key
// exists and no victim is pending (then no page names p as its parent), so
// adding a chain root first costs O(1) per page.
func (s *nsState) checkAncestry(p Page) error {
	if !p.HasParent || (s.nodes[p.Key] == nil && s.evicting == 0) {
		return nil
	}
	k := p.Parent
	for steps := 0; steps <= s.pages; steps++ {
		if k == p.Key {
			return fmt.Errorf("%w: page %s/%s would be its own ancestor (its parent %s descends from it)", ErrInvalid, p.Namespace, p.Key, p.Parent)
		}
		n := s.nodes[k]
		if n == nil || !n.present || !n.hasParent {
			return nil
		}
		k = n.parent
	}
	return fmt.Errorf("%w: page %s/%s: the chain above its parent %s is longer than the namespace's %d pages (a cycle)", ErrInvalid, p.Namespace, p.Key, p.Parent, s.pages)
}

// MaxBytes bounds every byte count given to the policy (a page, a
// reservation, a limit): 2^53 bytes (8 PiB), so that no sum overflows.
const MaxBytes = 1 << 53

func checkPage(p Page) error {
	if p.Bytes < 0 || p.Bytes > MaxBytes {
		return fmt.Errorf("%w: page %s/%s has %d bytes", ErrInvalid, p.Namespace, p.Key, p.Bytes)
	}
	if p.HasParent && p.Parent == p.Key {
		return fmt.Errorf("%w: page %s/%s is its own parent", ErrInvalid, p.Namespace, p.Key)
	}
	return nil
}

// insert adds p (not present) to s.
func (c *Cache) insert(s *nsState, p Page) {
	n := s.nodes[p.Key]
	if n == nil {
		n = &node{key: p.Key, idx: -1}
		s.nodes[p.Key] = n
	}
	n.present, n.evicting, n.pending = true, false, false
	n.parent, n.hasParent = p.Parent, p.HasParent
	n.bytes, n.access = p.Bytes, p.Access
	s.used += p.Bytes
	c.used += p.Bytes
	s.pages++
	c.pages++
	c.fix(s, n)
	c.adjustChildren(s, n, +1)
}

// Touch records an access to a page at time at (unix nanoseconds); the
// recency only moves forward. A page not tracked is ignored (false).
func (c *Cache) Touch(ns string, key Key, at int64) bool {
	return c.TouchAll(ns, []Key{key}, at) == 1
}

// Pin adds a pin to a tracked page so that it is never evicted until as
// many Unpins. It returns false (pinning nothing) when the page is not
// tracked or is already a victim being unlinked: for a load, a miss.
func (c *Cache) Pin(ns string, key Key) bool {
	return c.PinPrefix(ns, []Key{key}) == 1
}

// PinPrefix pins keys in order (a chain, as a load or a save walks it) and
// stops at the first that Pin refuses (not tracked, or a victim): it
// returns how many it pinned, keys[:n]. One lock for the whole chain.
func (c *Cache) PinPrefix(ns string, keys []Key) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	s := c.ns(ns, false)
	if s == nil {
		return 0
	}
	for i, k := range keys {
		n := s.nodes[k]
		if n == nil || !n.present || n.evicting {
			return i
		}
		n.pins++
		c.fix(s, n)
	}
	return len(keys)
}

// UnpinAll removes one pin from each of keys (as pinned by PinPrefix).
// Keys without a pin are skipped and reported by an ErrNotFound error; the
// others are unpinned.
func (c *Cache) UnpinAll(ns string, keys []Key) error {
	var missing int
	for _, k := range keys {
		if err := c.Unpin(ns, k); err != nil {
			missing++
		}
	}
	if missing > 0 {
		return fmt.Errorf("%w: %d of %d keys of namespace %q had no pin", ErrNotFound, missing, len(keys), ns)
	}
	return nil
}

// TouchAll records an access at time at to each tracked key of keys (a
// loaded or saved chain); it returns how many were tracked.
func (c *Cache) TouchAll(ns string, keys []Key, at int64) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	s := c.ns(ns, false)
	if s == nil {
		return 0
	}
	touched := 0
	for _, k := range keys {
		n := s.nodes[k]
		if n == nil || !n.present {
			continue
		}
		touched++
		if at > n.access {
			n.access = at
			c.fix(s, n)
		}
	}
	return touched
}

// Unpin removes one pin. Error: ErrNotFound when the page has no pin.
func (c *Cache) Unpin(ns string, key Key) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	s := c.ns(ns, false)
	var n *node
	if s != nil {
		n = s.nodes[key]
	}
	if n == nil || n.pins == 0 {
		return fmt.Errorf("%w: unpin of %s/%s, which has no pin", ErrNotFound, ns, key)
	}
	n.pins--
	c.fix(s, n)
	s.drop(n)
	c.gc(s)
	return nil
}

// SetPending marks a tracked page pending (pending true) or not (rule 6):
// a pending page is evicted only after every evictable page of the
// candidate set that is not pending. The engine marks a page whose upload
// to the object store is queued and unmarks it when the upload settles
// (uploaded, found stored, or given up). A page not tracked is ignored
// (false): a page added later starts not pending, and Removed clears the
// mark, so a page that leaves the cache and comes back (saved again) is
// marked again by its caller. A victim not yet Removed keeps the mark it
// is given for when it is Abandoned. O(log n) for a namespace of n
// evictable pages.
func (c *Cache) SetPending(ns string, key Key, pending bool) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	n := c.nodeLocked(ns, key)
	if n == nil || !n.present {
		return false
	}
	if n.pending != pending {
		n.pending = pending
		c.fix(c.nss[ns], n)
	}
	return true
}

// Pending reports whether a tracked page is marked pending (SetPending).
func (c *Cache) Pending(ns string, key Key) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	n := c.nodeLocked(ns, key)
	return n != nil && n.present && n.pending
}

// Removed forgets a page whose file is gone: a victim the engine unlinked,
// or a page that a collect, a delete or another process removed. Its bytes
// leave Used (and Evicting, for a victim). It returns false when the page
// was not tracked.
func (c *Cache) Removed(ns string, key Key) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	s := c.ns(ns, false)
	if s == nil {
		return false
	}
	n := s.nodes[key]
	if n == nil || !n.present {
		return false
	}
	if n.evicting {
		s.evicting -= n.bytes
		c.evicting -= n.bytes
	} else {
		c.adjustChildren(s, n, -1)
	}
	s.used -= n.bytes
	c.used -= n.bytes
	s.pages--
	c.pages--
	n.present, n.evicting, n.pending = false, false, false
	c.fix(s, n)
	s.drop(n)
	c.gc(s)
	return true
}

// Abandon returns a victim whose unlink failed to the cache: it is tracked
// and evictable again (its parent is no longer evictable). When a victim's
// unlink fails, abandon it and every later victim of the same list (its
// ancestors may follow it). Error: ErrNotFound when it is not a victim.
func (c *Cache) Abandon(ns string, key Key) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	s := c.ns(ns, false)
	var n *node
	if s != nil {
		n = s.nodes[key]
	}
	if n == nil || !n.present || !n.evicting {
		return fmt.Errorf("%w: abandon of %s/%s, which is not a victim", ErrNotFound, ns, key)
	}
	c.unchoose(s, n)
	return nil
}

// choose makes the evictable page n of s a victim.
func (c *Cache) choose(s *nsState, n *node) {
	n.evicting = true
	s.evicting += n.bytes
	c.evicting += n.bytes
	c.fix(s, n)
	c.adjustChildren(s, n, -1)
}

// victim describes the page n of s chosen for reason.
func victim(s *nsState, n *node, reason Reason) Victim {
	return Victim{Namespace: s.name, Key: n.key, Bytes: n.bytes, Reason: reason, Pending: n.pending}
}

// unchoose undoes choose.
func (c *Cache) unchoose(s *nsState, n *node) {
	n.evicting = false
	s.evicting -= n.bytes
	c.evicting -= n.bytes
	c.adjustChildren(s, n, +1)
	c.fix(s, n)
}

// Want is a reservation request.
type Want struct {
	Namespace string
	// Bytes is the allocated bytes the save will write (an upper bound
	// keeps the cache within its capacity; see the package doc).
	Bytes int64
	// AvailBytes is the file system's free bytes for unprivileged users
	// (vfs.FS.Statfs), measured before the call; < 0 means unknown (no
	// headroom check).
	AvailBytes int64
	// HeadroomBytes is the minimum to keep free on the file system; 0
	// means none.
	HeadroomBytes int64
}

// Reservation holds bytes for a save until it Commits its pages and
// Releases the rest. Victims are the pages chosen to make room, in unlink
// order; the save must not write more than it reserved before they are
// unlinked.
type Reservation struct {
	c       *Cache
	ns      *nsState
	id      uint64
	left    int64
	done    bool
	Victims []Victim
}

// Bytes returns the bytes still reserved.
func (r *Reservation) Bytes() int64 {
	r.c.mu.Lock()
	defer r.c.mu.Unlock()
	return r.left
}

// Reserve reserves w.Bytes for a save in w.Namespace, choosing victims
// first when a limit needs it (see BytesToEvict: the quota from the
// namespace's own pages, then the capacity and the headroom from the
// candidate set of rule 5). All or nothing: when the victims cannot cover
// a limit it returns a *NoSpaceError (errors.Is ErrNoSpace), chooses no
// victim and reserves nothing. Errors: ErrInvalid for negative bytes.
func (c *Cache) Reserve(w Want) (*Reservation, error) {
	if w.Bytes < 0 || w.Bytes > MaxBytes || w.HeadroomBytes < 0 || w.HeadroomBytes > MaxBytes {
		return nil, fmt.Errorf("%w: reservation of %d bytes, headroom %d (each must be in [0, 2^53])", ErrInvalid, w.Bytes, w.HeadroomBytes)
	}
	w.AvailBytes = min(w.AvailBytes, MaxBytes)
	c.mu.Lock()
	defer c.mu.Unlock()
	s := c.ns(w.Namespace, true)
	need := BytesToEvict(c.budget(s, w), w.Bytes)
	// A save larger than a limit can never fit: say so without evicting.
	if s.quota > 0 && w.Bytes > s.quota {
		c.gc(s)
		return nil, &NoSpaceError{Limit: ReasonQuota, Namespace: s.name, NeedBytes: need.QuotaBytes, RequestBytes: w.Bytes}
	}
	if c.capacity > 0 && w.Bytes > c.capacity {
		c.gc(s)
		return nil, &NoSpaceError{Limit: ReasonCapacity, Namespace: s.name, NeedBytes: need.CapacityBytes, RequestBytes: w.Bytes}
	}
	victims, err := c.plan(s, need, w.Bytes, nil)
	if err != nil {
		c.gc(s)
		return nil, err
	}
	c.nextRes++
	r := &Reservation{c: c, ns: s, id: c.nextRes, left: w.Bytes, Victims: victims}
	s.reserved += w.Bytes
	s.reservations++
	c.reserved += w.Bytes
	c.fixShared(s)
	return r, nil
}

func (c *Cache) budget(s *nsState, w Want) Budget {
	return Budget{
		CapacityBytes: c.capacity, UsedBytes: c.used - c.evicting, ReservedBytes: c.reserved,
		QuotaBytes: s.quota, NamespaceUsedBytes: s.used - s.evicting, NamespaceReservedBytes: s.reserved,
		AvailBytes: w.AvailBytes, HeadroomBytes: w.HeadroomBytes, EvictingBytes: c.evicting,
	}
}

// plan chooses victims to meet need, appending to dst; on failure it undoes
// them all.
func (c *Cache) plan(s *nsState, need Need, req int64, dst []Victim) ([]Victim, error) {
	start := len(dst)
	var freed int64
	fail := func(limit Reason, want int64) ([]Victim, error) {
		for i := len(dst) - 1; i >= start; i-- {
			v := dst[i]
			vs := c.nss[v.Namespace]
			c.unchoose(vs, vs.nodes[v.Key])
		}
		return dst[:start], &NoSpaceError{Limit: limit, Namespace: s.name, NeedBytes: want, FoundBytes: freed, RequestBytes: req}
	}
	for freed < need.QuotaBytes {
		if s.lru.len() == 0 {
			return fail(ReasonQuota, need.QuotaBytes)
		}
		n := s.lru.top()
		c.choose(s, n)
		freed += n.bytes
		dst = append(dst, victim(s, n, ReasonQuota))
	}
	for _, lim := range [...]struct {
		want   int64
		reason Reason
	}{{need.CapacityBytes, ReasonCapacity}, {need.HeadroomBytes, ReasonHeadroom}} {
		for freed < lim.want {
			vs, n := c.oldest(s)
			if n == nil {
				return fail(lim.reason, lim.want)
			}
			c.choose(vs, n)
			freed += n.bytes
			dst = append(dst, victim(vs, n, lim.reason))
		}
	}
	return dst, nil
}

// oldest returns the first evictable page in the eviction order (rules 4
// and 6) that a save in s may evict (rule 5): s's own or a shared
// namespace's.
func (c *Cache) oldest(s *nsState) (*nsState, *node) {
	var best *node
	var bs *nsState
	if s.lru.len() > 0 {
		bs, best = s, s.lru.top()
	}
	if c.shared.len() > 0 {
		o := c.shared.top()
		if n := o.lru.top(); best == nil || less(n, o.name, best, bs.name) {
			bs, best = o, n
		}
	}
	return bs, best
}

// Commit records a page the reservation's save published: its bytes move
// from the reservation to Used (bytes beyond what is left are the Excess of
// the package doc). A page already tracked (written by a concurrent save)
// takes the new allocated bytes and the later access. Errors: ErrInvalid for
// a page of another namespace, a finished reservation, a bad page, or a page
// that is a victim not yet Removed (the save must not rewrite it: Pin
// refuses victims, so the save knows it is going), or a new page that
// would be its own ancestor (see Add).
func (r *Reservation) Commit(p Page) error { return r.commit(p, false) }

// CommitPinned is Commit that also pins the page (one pin, as Pin), in the
// same critical section: no Reserve can choose it as a victim between its
// commit and the pin. A page fetched for a load is committed so, and
// unpinned when the load ends. On error nothing is pinned.
func (r *Reservation) CommitPinned(p Page) error { return r.commit(p, true) }

func (r *Reservation) commit(p Page, pin bool) error {
	if err := checkPage(p); err != nil {
		return err
	}
	c := r.c
	c.mu.Lock()
	defer c.mu.Unlock()
	if r.done {
		return fmt.Errorf("%w: commit to a released reservation", ErrInvalid)
	}
	s := r.ns
	if p.Namespace != s.name {
		return fmt.Errorf("%w: page of namespace %q committed to a reservation of %q", ErrInvalid, p.Namespace, s.name)
	}
	n := s.nodes[p.Key]
	if n != nil && n.evicting {
		return fmt.Errorf("%w: page %s/%s is a victim being unlinked: wait for Removed before writing it again", ErrInvalid, p.Namespace, p.Key)
	}
	if n == nil || !n.present {
		if err := s.checkAncestry(p); err != nil {
			return err
		}
	}
	take := min(p.Bytes, r.left)
	r.left -= take
	s.reserved -= take
	c.reserved -= take
	if n != nil && n.present {
		d := p.Bytes - n.bytes
		n.bytes = p.Bytes
		s.used += d
		c.used += d
		n.access = max(n.access, p.Access)
		if pin {
			n.pins++
		}
		c.fix(s, n)
		return nil
	}
	c.insert(s, p)
	if pin {
		n = s.nodes[p.Key]
		n.pins++
		c.fix(s, n)
	}
	return nil
}

// Release gives back what is left of the reservation (the save finished or
// failed; its temp files must be gone). Idempotent.
func (r *Reservation) Release() {
	c := r.c
	c.mu.Lock()
	defer c.mu.Unlock()
	if r.done {
		return
	}
	r.done = true
	r.ns.reserved -= r.left
	r.ns.reservations--
	c.reserved -= r.left
	r.left = 0
	c.fixShared(r.ns)
	c.gc(r.ns)
}

// Shrink chooses victims among the shared namespaces (rule 5: no quota, or
// above it), least recently used first, until Used − Evicting ≤
// targetBytes or nothing is evictable, and appends them to dst
// (ReasonShrink). Background eviction calls it to keep a low watermark
// below the capacity, so that saves rarely wait for evictions. It returns
// whether the target was reached.
func (c *Cache) Shrink(targetBytes int64, dst []Victim) ([]Victim, bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	for c.used-c.evicting > targetBytes {
		if c.shared.len() == 0 {
			return dst, false
		}
		s := c.shared.top()
		n := s.lru.top()
		c.choose(s, n)
		dst = append(dst, victim(s, n, ReasonShrink))
	}
	return dst, true
}

// ShrinkNamespace is Shrink within one namespace (whatever its quota),
// down to targetBytes of that namespace.
func (c *Cache) ShrinkNamespace(ns string, targetBytes int64, dst []Victim) ([]Victim, bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	s := c.ns(ns, false)
	if s == nil {
		return dst, targetBytes >= 0
	}
	for s.used-s.evicting > targetBytes {
		if s.lru.len() == 0 {
			return dst, false
		}
		n := s.lru.top()
		c.choose(s, n)
		dst = append(dst, victim(s, n, ReasonShrink))
	}
	return dst, true
}

// SetCapacity changes the capacity (0: unbounded). A cache above the new
// capacity stays there until a Reserve or Shrink evicts.
func (c *Cache) SetCapacity(bytes int64) error {
	if bytes < 0 || bytes > MaxBytes {
		return fmt.Errorf("%w: capacity %d (want 0 to 2^53)", ErrInvalid, bytes)
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	c.capacity = bytes
	return nil
}

// SetQuota changes a namespace's quota (0: none).
func (c *Cache) SetQuota(ns string, bytes int64) error {
	if bytes < 0 || bytes > MaxBytes {
		return fmt.Errorf("%w: quota of namespace %q is %d (want 0 to 2^53)", ErrInvalid, ns, bytes)
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if bytes == 0 {
		delete(c.quotas, ns)
	} else {
		c.quotas[ns] = bytes
	}
	if s := c.ns(ns, false); s != nil {
		s.quota = bytes
		c.fixShared(s)
	}
	return nil
}

// SetTempBytes sets the allocated bytes of namespace ns's temp files that
// no reservation covers (left by a process that died mid-write, until the
// engine removes them). They count in Used, the namespace's and the
// cache's, like pages, so Reserve and Shrink evict pages to make room for
// them and the bound of the package doc holds over page and temp files;
// they are never victims. bytes replaces the previous value; 0 clears it.
// Errors: ErrInvalid for bytes outside [0, 2^53].
func (c *Cache) SetTempBytes(ns string, bytes int64) error {
	if bytes < 0 || bytes > MaxBytes {
		return fmt.Errorf("%w: temp bytes of namespace %q are %d (want 0 to 2^53)", ErrInvalid, ns, bytes)
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	s := c.ns(ns, bytes > 0)
	if s == nil {
		return nil
	}
	d := bytes - s.temp
	s.temp, s.used = bytes, s.used+d
	c.temp, c.used = c.temp+d, c.used+d
	c.fixShared(s)
	c.gc(s)
	return nil
}

// Usage is the accounting at one instant. Bytes are allocated bytes.
type Usage struct {
	CapacityBytes int64 `json:"capacityBytes"` // 0: unbounded
	// UsedBytes: tracked pages, victims included, and the temp files of
	// SetTempBytes (TempBytes).
	UsedBytes     int64 `json:"usedBytes"`
	TempBytes     int64 `json:"tempBytes"`     // the part of UsedBytes that is temp files
	ReservedBytes int64 `json:"reservedBytes"` // held by in-flight saves
	EvictingBytes int64 `json:"evictingBytes"` // victims not yet Removed
	Pages         int   `json:"pages"`
	// Namespaces, sorted by name: every namespace with a page, a
	// reservation or a quota.
	Namespaces []NamespaceUsage `json:"namespaces"`
}

// NamespaceUsage is one namespace's accounting.
type NamespaceUsage struct {
	Name          string `json:"name"`
	QuotaBytes    int64  `json:"quotaBytes"` // 0: none
	UsedBytes     int64  `json:"usedBytes"`  // pages and temp files
	TempBytes     int64  `json:"tempBytes"`  // the part of UsedBytes that is temp files
	ReservedBytes int64  `json:"reservedBytes"`
	EvictingBytes int64  `json:"evictingBytes"`
	Pages         int    `json:"pages"`
}

// Usage returns the accounting.
func (c *Cache) Usage() Usage {
	c.mu.Lock()
	defer c.mu.Unlock()
	u := Usage{CapacityBytes: c.capacity, UsedBytes: c.used, TempBytes: c.temp, ReservedBytes: c.reserved, EvictingBytes: c.evicting, Pages: c.pages}
	seen := map[string]bool{}
	for name, s := range c.nss {
		seen[name] = true
		u.Namespaces = append(u.Namespaces, NamespaceUsage{Name: name, QuotaBytes: s.quota, UsedBytes: s.used, TempBytes: s.temp,
			ReservedBytes: s.reserved, EvictingBytes: s.evicting, Pages: s.pages})
	}
	for name, q := range c.quotas {
		if !seen[name] {
			u.Namespaces = append(u.Namespaces, NamespaceUsage{Name: name, QuotaBytes: q})
		}
	}
	sort.Slice(u.Namespaces, func(i, j int) bool { return u.Namespaces[i].Name < u.Namespaces[j].Name })
	return u
}

// Evicting reports whether a tracked page is a victim chosen but not yet
// Removed or Abandoned (its unlink is pending). A save must not reuse such
// a page (Pin refuses it): its unlink would leave the save's later pages
// without their parent. The engine waits for it to be gone, then writes it
// again.
func (c *Cache) Evicting(ns string, key Key) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	n := c.nodeLocked(ns, key)
	return n != nil && n.present && n.evicting
}

// nodeLocked is the node of key in namespace ns, or nil. c.mu held.
func (c *Cache) nodeLocked(ns string, key Key) *node {
	if s := c.ns(ns, false); s != nil {
		return s.nodes[key]
	}
	return nil
}

// Lookup returns a tracked page's record (Bytes and Access current) and
// whether it is tracked.
func (c *Cache) Lookup(ns string, key Key) (Page, bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	n := c.nodeLocked(ns, key)
	if n == nil || !n.present {
		return Page{}, false
	}
	return Page{Namespace: ns, Key: key, Parent: n.parent, HasParent: n.hasParent, Bytes: n.bytes, Access: n.access}, true
}
