// Package events publishes what the prefix cache stores as KV events in
// vLLM's wire format, for the routers of a fleet (llm-d's kv-cache indexer,
// the Gateway API inference extension, Dynamo, AIBrix) to route a request
// to the machine that holds its prefix.
//
// A Publisher owns a ZMQ PUB socket, an optional ROUTER socket that
// replays missed batches, and one goroutine that batches queued events,
// numbers them and sends them. Announcing never blocks the caller: events
// are encoded on the caller's goroutine and offered to a bounded queue;
// when it is full they are dropped, counted (Stats.Dropped) and logged,
// and the next batch's sequence number skips one, so a subscriber sees
// the loss as a gap. The wire format, the 64-bit block hash and the topic
// are documented in docs/format/kv-events.md.
package events

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"sync"
	"sync/atomic"
	"time"

	"github.com/go-zeromq/zmq4"
	"github.com/kvpersist/kvpersist/engine/layout"
)

// Sentinel errors, usable with errors.Is.
var (
	// ErrConfig: a Config field is missing or out of range.
	ErrConfig = errors.New("invalid events config")
	// ErrClosed: the Publisher is closed.
	ErrClosed = errors.New("events publisher closed")
)

// MediumStorage is vLLM's medium for a storage tier, the default Medium.
const MediumStorage = "STORAGE"

// Defaults of Config's zero fields.
const (
	DefaultQueueEvents   = 4096
	DefaultReplayBatches = 10000 // vLLM's buffer_steps
	DefaultReplayBytes   = 64 << 20
	DefaultHWM           = 1000
)

// maxBatchBytes caps a batch's encoded events, in bytes: the batch is
// sent when the next event would pass it (one larger event goes alone).
const maxBatchBytes = 1 << 20

// maxEventBlocks caps the pages of one BlockStored event (a run of a
// chain), and removeChunk the hashes of one BlockRemoved event.
const (
	maxEventBlocks = 64
	removeChunk    = 4096
)

// dropLogEvery is the least time between two warnings about drops.
const dropLogEvery = 10 * time.Second

// Config configures a Publisher. Zero values take the documented defaults.
type Config struct {
	// Endpoint is the PUB socket's ZMQ endpoint, listened on:
	// "tcp://*:5557", "tcp://127.0.0.1:0" (any free port: see Addr),
	// "ipc:///path". Required.
	Endpoint string
	// Connect dials Endpoint instead of listening on it, for a router
	// that binds one SUB socket for its whole fleet. zmq4 dials at New
	// (retrying for about 2.5 s) and does not redial a peer that goes
	// away.
	Connect bool
	// ReplayEndpoint, when set, is listened on by a ROUTER socket that
	// answers a replay request (an 8-byte big-endian start sequence) with
	// the buffered batches from that sequence on, then an end marker.
	ReplayEndpoint string
	// Topic is every message's first frame. llm-d derives the pod and
	// the model from "kv@<pod>@<model>" (see Topic); vLLM's default is "".
	Topic string
	// Namespace, when set, restricts the Sink methods and Snapshot to
	// that namespace's pages (one model per topic); "" announces every
	// namespace's pages under the one Topic.
	Namespace string
	// Medium is every event's medium; default MediumStorage ("STORAGE").
	// Routers also know "SHARED_STORAGE" and "OBJECT_STORE".
	Medium string
	// Locality is "", "LOCAL" or "REMOTE" (relative to the publisher);
	// carried only by FormMap (FormArray has no such field): setting it
	// with FormArray is an error.
	Locality string
	// DPRank is the data-parallel rank carried by every batch, >= 0.
	// Unlike vLLM, which runs one publisher per rank in one process, the
	// endpoints' ports are not offset by it.
	DPRank int
	// Form is how events are encoded; default FormArray.
	Form Form
	// QueueEvents bounds the events waiting to be sent; default
	// DefaultQueueEvents (4096). An event offered to a full queue is
	// dropped.
	QueueEvents int
	// ReplayBatches and ReplayBytes bound the batches kept for replay (the
	// oldest go first): default DefaultReplayBatches (10,000) batches and
	// DefaultReplayBytes (64 MiB) of payload.
	ReplayBatches int
	ReplayBytes   int64
	// HWM bounds the messages zmq4's PUB socket queues for its
	// subscribers; beyond it zmq4 drops them silently (default
	// DefaultHWM, 1000; each message is one batch, at most about 1 MiB).
	HWM int
	// Logger receives drop warnings (at most one per 10 s) and socket
	// errors; nil means slog.Default().
	Logger *slog.Logger
}

// Topic returns llm-d's topic form "kv@<pod>@<model>".
func Topic(pod, model string) string { return "kv@" + pod + "@" + model }

// Stats are a Publisher's counters since New.
type Stats struct {
	Events  uint64 // events sent
	Batches uint64 // batches sent (one sequence number each)
	// Dropped: events offered to a full queue and dropped (the metric to
	// watch: each drop leaves the routers' view stale until a snapshot).
	Dropped uint64
	// NextSeq is the sequence number of the next batch.
	NextSeq uint64
	// ReplayRequests: replay requests answered.
	ReplayRequests uint64
}

// Publisher publishes KV events over ZMQ. Its methods are safe for
// concurrent use; Close stops it.
type Publisher struct {
	cfg  Config
	wire wire
	log  *slog.Logger

	pub    zmq4.Socket
	router zmq4.Socket // nil without ReplayEndpoint
	cancel context.CancelFunc

	live  chan item // the Sink's events: offered, never waited for
	snap  chan item // Snapshot's events: waited for, sent after live ones
	stop  chan struct{}
	done  chan struct{} // closed when run has returned
	rdone chan struct{} // closed when serveReplay has returned (or never started)

	closeOnce sync.Once
	closeErr  error
	closed    atomic.Bool

	ring ring

	events, batches, dropped, replays, nextSeq atomic.Uint64
	lastDropLogged                             atomic.Uint64 // Dropped at the last warning
	gap                                        atomic.Bool   // events were dropped since the last batch
}

// item is one queued event, or a flush mark (ev nil, mark non-nil: closed
// once every item queued before it on the same queue has been sent).
type item struct {
	ev   []byte
	mark chan struct{}
}

// New checks cfg, opens the sockets and starts the publisher's goroutine
// (and the replay socket's). Errors: ErrConfig naming the field; a
// socket's listen or dial error.
func New(cfg Config) (*Publisher, error) {
	p, err := open(cfg)
	if err != nil {
		return nil, err
	}
	p.start()
	return p, nil
}

// open checks cfg and opens the sockets; start starts the goroutines.
func open(cfg Config) (*Publisher, error) {
	if cfg.Endpoint == "" {
		return nil, fmt.Errorf("%w: Endpoint is empty", ErrConfig)
	}
	if cfg.Medium == "" {
		cfg.Medium = MediumStorage
	}
	switch cfg.Locality {
	case "", "LOCAL", "REMOTE":
	default:
		return nil, fmt.Errorf("%w: Locality %q (want \"\", \"LOCAL\" or \"REMOTE\")", ErrConfig, cfg.Locality)
	}
	switch cfg.Form {
	case FormArray:
		if cfg.Locality != "" {
			return nil, fmt.Errorf("%w: Locality %q needs Form map (the array form has no locality field)", ErrConfig, cfg.Locality)
		}
	case FormMap:
	default:
		return nil, fmt.Errorf("%w: Form %d (want FormArray or FormMap)", ErrConfig, cfg.Form)
	}
	if cfg.DPRank < 0 {
		return nil, fmt.Errorf("%w: DPRank %d (want >= 0)", ErrConfig, cfg.DPRank)
	}
	var err error
	if cfg.QueueEvents, err = positive("QueueEvents", cfg.QueueEvents, DefaultQueueEvents); err != nil {
		return nil, err
	}
	if cfg.ReplayBatches, err = positive("ReplayBatches", cfg.ReplayBatches, DefaultReplayBatches); err != nil {
		return nil, err
	}
	if cfg.HWM, err = positive("HWM", cfg.HWM, DefaultHWM); err != nil {
		return nil, err
	}
	if cfg.ReplayBytes == 0 {
		cfg.ReplayBytes = DefaultReplayBytes
	}
	if cfg.ReplayBytes < 0 {
		return nil, fmt.Errorf("%w: ReplayBytes %d (want > 0)", ErrConfig, cfg.ReplayBytes)
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	p := &Publisher{
		cfg:   cfg,
		wire:  wire{form: cfg.Form, medium: cfg.Medium, locality: cfg.Locality},
		log:   cfg.Logger,
		live:  make(chan item, cfg.QueueEvents),
		snap:  make(chan item, 4),
		stop:  make(chan struct{}),
		done:  make(chan struct{}),
		rdone: make(chan struct{}),
		ring:  ring{maxN: cfg.ReplayBatches, maxBytes: cfg.ReplayBytes},
	}
	ctx, cancel := context.WithCancel(context.Background())
	p.cancel = cancel
	zlog := slog.NewLogLogger(cfg.Logger.Handler(), slog.LevelWarn)
	p.pub = zmq4.NewPub(ctx, zmq4.WithLogger(zlog))
	// Without a high-water mark zmq4's PUB queue grows without bound
	// behind a stalled subscriber.
	if err := p.pub.SetOption(zmq4.OptionHWM, cfg.HWM); err != nil {
		p.closeSockets()
		return nil, fmt.Errorf("events: PUB high-water mark: %w", err)
	}
	if cfg.Connect {
		err = p.pub.Dial(cfg.Endpoint)
	} else {
		err = p.pub.Listen(cfg.Endpoint)
	}
	if err != nil {
		p.closeSockets()
		return nil, fmt.Errorf("events: PUB %s: %w", cfg.Endpoint, err)
	}
	if cfg.ReplayEndpoint != "" {
		p.router = zmq4.NewRouter(ctx, zmq4.WithLogger(zlog))
		if err := p.router.Listen(cfg.ReplayEndpoint); err != nil {
			p.closeSockets()
			return nil, fmt.Errorf("events: replay ROUTER %s: %w", cfg.ReplayEndpoint, err)
		}
	}
	return p, nil
}

func (p *Publisher) start() {
	if p.router != nil {
		go p.serveReplay()
	} else {
		close(p.rdone)
	}
	go p.run()
}

func positive(name string, v, def int) (int, error) {
	if v == 0 {
		return def, nil
	}
	if v < 0 {
		return 0, fmt.Errorf("%w: %s %d (want > 0)", ErrConfig, name, v)
	}
	return v, nil
}

func (p *Publisher) closeSockets() {
	if p.router != nil {
		_ = p.router.Close()
	}
	_ = p.pub.Close()
	p.cancel()
}

// Addr is the PUB socket's listening address ("127.0.0.1:5557"); nil with
// Connect.
func (p *Publisher) Addr() net.Addr { return p.pub.Addr() }

// ReplayAddr is the ROUTER socket's listening address; nil without
// ReplayEndpoint.
func (p *Publisher) ReplayAddr() net.Addr {
	if p.router == nil {
		return nil
	}
	return p.router.Addr()
}

// Subscriptions returns the topic prefixes the PUB socket's subscribers
// have asked for, sorted: empty when nobody listens (or a dialled peer has
// not subscribed yet).
func (p *Publisher) Subscriptions() []string {
	if t, ok := p.pub.(zmq4.Topics); ok {
		return t.Topics()
	}
	return nil
}

// Stats returns the counters.
func (p *Publisher) Stats() Stats {
	return Stats{
		Events: p.events.Load(), Batches: p.batches.Load(), Dropped: p.dropped.Load(),
		NextSeq: p.nextSeq.Load(), ReplayRequests: p.replays.Load(),
	}
}

// Close stops the goroutine after it has sent what was queued, then
// closes the sockets (messages zmq4 has not yet written are lost, as
// vLLM's publisher closes with linger 0). It is idempotent; afterwards
// events are ignored and Flush and Snapshot return ErrClosed. zmq4
// v0.17.0's PUB socket leaves its writer goroutine parked after Close
// (it holds no socket or file).
func (p *Publisher) Close() error {
	p.closeOnce.Do(func() {
		p.closed.Store(true)
		close(p.stop)
		<-p.done
		if p.router != nil {
			p.closeErr = p.router.Close()
		}
		if err := p.pub.Close(); err != nil && p.closeErr == nil {
			p.closeErr = err
		}
		p.cancel()
		<-p.rdone
		p.logDrops(true)
	})
	return p.closeErr
}

// offer queues ev without waiting: false (and counted) when the queue is
// full.
func (p *Publisher) offer(ev []byte) bool {
	if p.closed.Load() {
		return false
	}
	select {
	case p.live <- item{ev: ev}:
		return true
	default:
		p.dropped.Add(1)
		p.gap.Store(true)
		return false
	}
}

// Flush waits until every event queued before it has been handed to the
// PUB socket. Errors: ctx's, ErrClosed.
func (p *Publisher) Flush(ctx context.Context) error {
	return p.waitMark(ctx, p.live)
}

func (p *Publisher) waitMark(ctx context.Context, q chan item) error {
	mark := make(chan struct{})
	if err := p.put(ctx, q, item{mark: mark}); err != nil {
		return err
	}
	select {
	case <-mark:
		return nil
	case <-p.done:
		select {
		case <-mark: // run drains the queues before it returns
			return nil
		default:
			return ErrClosed
		}
	case <-ctx.Done():
		return ctx.Err()
	}
}

// put queues it on q, waiting for room. Errors: ctx's, ErrClosed.
func (p *Publisher) put(ctx context.Context, q chan item, it item) error {
	if p.closed.Load() {
		return ErrClosed
	}
	select {
	case q <- it:
		return nil
	case <-p.stop:
		return ErrClosed
	case <-ctx.Done():
		return ctx.Err()
	}
}

// run is the publisher's goroutine: it takes queued events (the Sink's
// first, so that a snapshot never holds them up), sends them in batches
// and numbers the batches; on stop it sends what is queued and returns.
func (p *Publisher) run() {
	defer close(p.done)
	var (
		evs     [][]byte
		size    int
		marks   []chan struct{}
		lastLog time.Time
	)
	flush := func() {
		if len(evs) > 0 {
			p.send(evs, size)
			clear(evs)
			evs, size = evs[:0], 0
		}
		for _, m := range marks {
			close(m)
		}
		marks = marks[:0]
		if time.Since(lastLog) >= dropLogEvery && p.logDrops(false) {
			lastLog = time.Now()
		}
	}
	add := func(it item) {
		if it.mark != nil {
			flush()
			marks = append(marks, it.mark)
			flush()
			return
		}
		if len(evs) > 0 && size+len(it.ev) > maxBatchBytes {
			flush()
		}
		evs = append(evs, it.ev)
		size += len(it.ev)
	}
	// next takes a queued item without waiting, the Sink's first.
	next := func() (item, bool) {
		select {
		case it := <-p.live:
			return it, true
		default:
		}
		select {
		case it := <-p.live:
			return it, true
		case it := <-p.snap:
			return it, true
		default:
			return item{}, false
		}
	}
	for {
		var it item
		select {
		case it = <-p.live:
		case it = <-p.snap:
		case <-p.stop:
			for it, ok := next(); ok; it, ok = next() {
				add(it)
			}
			flush()
			return
		}
		add(it)
		for it, ok := next(); ok; it, ok = next() {
			add(it)
		}
		flush()
	}
}

// send publishes one batch [topic, seq, payload] and keeps it for replay.
func (p *Publisher) send(evs [][]byte, size int) {
	seq := p.nextSeq.Load()
	if p.gap.Swap(false) {
		seq++ // events were dropped: subscribers see a gap
	}
	p.nextSeq.Store(seq + 1)
	now := time.Now()
	ts := float64(now.UnixNano()) / 1e9
	payload := appendBatch(make([]byte, 0, size+32), ts, evs, p.cfg.DPRank)
	var seqb [8]byte
	binary.BigEndian.PutUint64(seqb[:], seq)
	if err := p.pub.SendMulti(zmq4.NewMsgFrom([]byte(p.cfg.Topic), seqb[:], payload)); err != nil {
		p.log.Warn("kvpersist: events: PUB send failed", "seq", seq, "err", err)
	}
	p.ring.add(seq, payload)
	p.events.Add(uint64(len(evs)))
	p.batches.Add(1)
}

// logDrops warns of the events dropped since the last warning; it
// reports whether it logged. final: Close's last word.
func (p *Publisher) logDrops(final bool) bool {
	d := p.dropped.Load()
	last := p.lastDropLogged.Swap(d)
	if d == last {
		return false
	}
	p.log.Warn("kvpersist: events: queue full, events dropped (routers' view is stale until a snapshot)",
		"dropped", d-last, "droppedTotal", d, "queueEvents", p.cfg.QueueEvents, "closing", final)
	return true
}

// serveReplay answers replay requests until the ROUTER socket is closed:
// a request [identity, "", start seq as 8 bytes big-endian] gets one
// message [identity, "", seq, payload] per buffered batch with seq >=
// start, then [identity, "", -1 as 8 bytes, ""] (vLLM's end marker).
func (p *Publisher) serveReplay() {
	defer close(p.rdone)
	for {
		msg, err := p.router.Recv()
		if err != nil {
			if !p.closed.Load() {
				p.log.Warn("kvpersist: events: replay socket failed", "err", err)
			}
			return
		}
		f := msg.Frames
		if len(f) == 0 {
			continue
		}
		id := f[0]
		if len(f) == 3 && len(f[1]) == 0 && len(f[2]) == 8 {
			start := binary.BigEndian.Uint64(f[2])
			for _, e := range p.ring.since(start) {
				var seqb [8]byte
				binary.BigEndian.PutUint64(seqb[:], e.seq)
				if err := p.router.SendMulti(zmq4.NewMsgFrom(id, nil, seqb[:], e.payload)); err != nil {
					break
				}
			}
		} else {
			p.log.Debug("kvpersist: events: malformed replay request", "frames", len(f))
		}
		p.replays.Add(1) // before the end marker: a client that has it sees the count
		_ = p.router.SendMulti(zmq4.NewMsgFrom(id, nil, endSeq[:], nil))
	}
}

// endSeq is the replay's end marker: -1 as a signed 8-byte big-endian
// integer.
var endSeq = [8]byte{0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff}

// entry is one sent batch.
type entry struct {
	seq     uint64
	payload []byte
}

// ring keeps the last sent batches, bounded by count and bytes.
type ring struct {
	mu       sync.Mutex
	es       []entry // seq ascending; es[head:] are live
	head     int
	bytes    int64
	maxN     int
	maxBytes int64
}

func (r *ring) add(seq uint64, payload []byte) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.es = append(r.es, entry{seq, payload})
	r.bytes += int64(len(payload))
	for len(r.es)-r.head > r.maxN || (r.bytes > r.maxBytes && len(r.es)-r.head > 1) {
		r.bytes -= int64(len(r.es[r.head].payload))
		r.es[r.head] = entry{}
		r.head++
	}
	if r.head > len(r.es)/2 && r.head > 64 {
		n := copy(r.es, r.es[r.head:])
		clear(r.es[n:])
		r.es, r.head = r.es[:n], 0
	}
}

// since returns the kept batches with seq >= start, in order.
func (r *ring) since(start uint64) []entry {
	r.mu.Lock()
	defer r.mu.Unlock()
	live := r.es[r.head:]
	lo, hi := 0, len(live)
	for lo < hi {
		m := (lo + hi) / 2
		if live[m].seq < start {
			lo = m + 1
		} else {
			hi = m
		}
	}
	return append([]entry(nil), live[lo:]...)
}

// Sink is what the page cache tells of its page files. Every method
// returns at once (events are encoded on the caller's goroutine and
// offered to a bounded queue) and keeps no reference to its arguments.
// *Publisher implements it.
type Sink interface {
	// Stored: pages of namespace ns are durable, in chain order (a page
	// after its parent). A save passes its whole chain from the first
	// page (ChainPages), pages found stored included, so that its
	// announcement does not depend on any earlier one; a page fetched
	// from the object store passes that page. Call it before the pages
	// are added to the page index: a save that finds them there may
	// announce a child, which must come after them.
	Stored(ns string, pages ...layout.Page)
	// Removed: the page files of keys of namespace ns are gone
	// (evicted, collected, deleted, found corrupt and removed).
	Removed(ns string, keys ...layout.PageKey)
	// Cleared: every page of namespace ns is gone; keys are the ones it
	// held (announced as BlockRemoved when the topic covers other
	// namespaces too, since AllBlocksCleared would clear them all).
	Cleared(ns string, keys ...layout.PageKey)
}

var _ Sink = (*Publisher)(nil)

// announces reports whether namespace ns is published.
func (p *Publisher) announces(ns string) bool {
	return p.cfg.Namespace == "" || p.cfg.Namespace == ns
}

// Stored implements Sink: one BlockStored event per run of pages that
// follow each other in the chain (at most 64 pages an event). Leaves
// (partial last pages) are not announced: a router indexes full blocks
// of Medium's block size only.
func (p *Publisher) Stored(ns string, pages ...layout.Page) {
	if !p.announces(ns) || p.closed.Load() {
		return
	}
	var rc rootCache
	p.wire.runs(pages, nil, &rc, func(ev []byte) bool {
		p.offer(ev)
		return true
	})
}

// Removed implements Sink: BlockRemoved events of the keys' 64-bit
// hashes.
func (p *Publisher) Removed(ns string, keys ...layout.PageKey) {
	if !p.announces(ns) || p.closed.Load() || len(keys) == 0 {
		return
	}
	hs := make([]uint64, 0, min(len(keys), removeChunk))
	for len(keys) > 0 {
		n := min(len(keys), removeChunk)
		hs = hs[:0]
		for _, k := range keys[:n] {
			hs = append(hs, Hash64(k))
		}
		p.offer(p.wire.appendRemoved(make([]byte, 0, 32+9*n), hs))
		keys = keys[n:]
	}
}

// Cleared implements Sink: AllBlocksCleared when Config.Namespace is ns
// (the topic is that namespace's), else BlockRemoved of keys.
func (p *Publisher) Cleared(ns string, keys ...layout.PageKey) {
	if !p.announces(ns) || p.closed.Load() {
		return
	}
	if p.cfg.Namespace == "" {
		p.Removed(ns, keys...)
		return
	}
	p.offer(p.wire.appendCleared(nil))
}

// ChainPages returns the pages of a chain from its first page: page i
// holds tokens[i*pageTokens:] up to pageTokens of them (the last one may
// be a leaf), has key keys[i] and parent keys[i-1] (PageRoot(identity,
// pageTokens) for i = 0). keys may cover fewer pages than tokens does (a
// load's prefix). The pages share tokens' memory; keys are not checked
// against the tokens. Errors: ErrConfig when keys cover more pages than
// tokens has, or pageTokens is invalid.
func ChainPages(identity string, pageTokens int, tokens []uint32, keys []layout.PageKey) ([]layout.Page, error) {
	if err := layout.CheckPageTokens(pageTokens); err != nil {
		return nil, fmt.Errorf("%w: %w", ErrConfig, err)
	}
	if n := (len(tokens) + pageTokens - 1) / pageTokens; len(keys) > n {
		return nil, fmt.Errorf("%w: %d keys for %d tokens of %d per page (at most %d)", ErrConfig, len(keys), len(tokens), pageTokens, n)
	}
	pages := make([]layout.Page, len(keys))
	parent := layout.PageRoot(identity, pageTokens)
	for i, k := range keys {
		pages[i] = layout.Page{
			Key: k, Parent: parent, Identity: identity, PageTokens: pageTokens,
			Tokens: tokens[i*pageTokens : min(len(tokens), (i+1)*pageTokens)],
		}
		parent = k
	}
	return pages, nil
}

// rootCache remembers the last chain root computed, since the pages of
// one call almost always share their identity and page size.
type rootCache struct {
	identity string
	p        int
	root     layout.PageKey
	ok       bool
}

// first reports whether pg is its chain's first page.
func (c *rootCache) first(pg *layout.Page) bool {
	if !c.ok || c.identity != pg.Identity || c.p != pg.PageTokens {
		c.identity, c.p, c.ok = pg.Identity, pg.PageTokens, true
		c.root = layout.PageRoot(pg.Identity, pg.PageTokens)
	}
	return pg.Parent == c.root
}

// full reports whether pg is a whole page (announced), not a leaf.
func full(pg *layout.Page) bool {
	return pg.PageTokens > 0 && len(pg.Tokens) == pg.PageTokens
}

// runs encodes pages as BlockStored events, in the order given by order
// (indices into pages; nil: pages' own order), one event per run of
// consecutive full pages each the parent of the next (same page size, at
// most maxEventBlocks), and hands each to emit; it stops when emit returns
// false. Leaves and pages of an invalid size are skipped.
func (w *wire) runs(pages []layout.Page, order []int32, rc *rootCache, emit func([]byte) bool) {
	n := len(pages)
	if order != nil {
		n = len(order)
	}
	at := func(i int) *layout.Page {
		if order != nil {
			return &pages[order[i]]
		}
		return &pages[i]
	}
	var (
		run    []*layout.Page
		hashes []uint64
		tokens []uint32
	)
	flush := func() bool {
		if len(run) == 0 {
			return true
		}
		first := run[0]
		hashes, tokens = hashes[:0], tokens[:0]
		for _, pg := range run {
			hashes = append(hashes, Hash64(pg.Key))
			tokens = append(tokens, pg.Tokens...)
		}
		hasParent := !rc.first(first)
		ev := w.appendStored(make([]byte, 0, 64+9*len(hashes)+5*len(tokens)), hashes, Hash64(first.Parent), hasParent, tokens, first.PageTokens)
		run = run[:0]
		return emit(ev)
	}
	for i := range n {
		pg := at(i)
		if !full(pg) {
			continue
		}
		if len(run) > 0 {
			last := run[len(run)-1]
			if pg.Parent != last.Key || pg.PageTokens != last.PageTokens || len(run) == maxEventBlocks {
				if !flush() {
					return
				}
			}
		}
		run = append(run, pg)
	}
	flush()
}
