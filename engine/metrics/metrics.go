// Package metrics is kvpersist's operational signal: a Recorder that the
// engine feeds as jobs finish (cheap, lock-free atomic counters), exposed
// as a prometheus.Collector that a scheduler registers in its own registry
// (nothing is registered globally), and as a plain Snapshot (JSON) for an
// embedder's status page or logs. (`kvpersist stats --json` runs in its own
// process and measures the disk instead.)
//
// Every method of a nil *Recorder does nothing, so the engine can call it
// unconditionally. The metric names and labels are listed in
// docs/operating.md ("Metrics") and on the Recorder's Describe.
package metrics

import (
	"cmp"
	"errors"
	"fmt"
	"slices"
	"sort"
	"strings"
	"sync/atomic"
	"time"

	"github.com/kvpersist/kvpersist/engine/evict"
	"github.com/kvpersist/kvpersist/engine/metrics/labels"
	"github.com/prometheus/client_golang/prometheus"
)

// Kind is a job's kind, the `kind` label (defined in package labels, which
// does not link prometheus: see engine.MetricsSink).
type Kind = labels.Kind

// Job kinds: the engine's (write, read, collect, delete, migrate) and the
// page cache's (save, load, lookup, evict).
const (
	KindWrite   = labels.KindWrite
	KindRead    = labels.KindRead
	KindCollect = labels.KindCollect
	KindDelete  = labels.KindDelete
	KindMigrate = labels.KindMigrate
	KindSave    = labels.KindSave
	KindLoad    = labels.KindLoad
	KindLookup  = labels.KindLookup
	KindEvict   = labels.KindEvict
	numKinds    = labels.NumKinds
)

// Outcome is how a job ended, the `outcome` label (defined in package
// labels).
type Outcome = labels.Outcome

// Outcomes (see package labels).
const (
	OutcomeOK       = labels.OutcomeOK
	OutcomeError    = labels.OutcomeError
	OutcomeCanceled = labels.OutcomeCanceled
	OutcomeNoSpace  = labels.OutcomeNoSpace
	numOutcomes     = labels.NumOutcomes
)

// OutcomeOf classifies a job's error: nil is OutcomeOK; context.Canceled
// and context.DeadlineExceeded are OutcomeCanceled; evict.ErrNoSpace is
// OutcomeNoSpace; anything else OutcomeError (labels.OutcomeOf).
func OutcomeOf(err error) Outcome { return labels.OutcomeOf(err) }

// Eviction reasons and refusal limits are evict.Reason values; these are
// the ones the metrics label.
var (
	evictReasons  = []evict.Reason{evict.ReasonCapacity, evict.ReasonQuota, evict.ReasonHeadroom, evict.ReasonShrink}
	refusedLimits = []evict.Reason{evict.ReasonCapacity, evict.ReasonQuota, evict.ReasonHeadroom}
)

// DefaultLatencyBuckets are the job latency histogram's upper bounds, in
// seconds: from 100 µs (a lookup) to 60 s (a collect of a large store).
var DefaultLatencyBuckets = []float64{0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
	0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 60}

// Options configures a Recorder.
type Options struct {
	// LatencyBuckets are the histogram's upper bounds in seconds, strictly
	// increasing, finite, > 0; nil means DefaultLatencyBuckets.
	LatencyBuckets []float64
	// Usage, when set, is called at each scrape and snapshot for the page
	// cache's accounting (evict.Cache.Usage, say): the capacity and
	// per-namespace gauges. It must be safe for concurrent use. Leave it
	// nil for an engine's Recorder: engine.New sets it to the engine's
	// own Usage (SetUsage) when given the Recorder as Config.Metrics. A
	// method value such as eng.Usage taken before engine.New returned
	// binds a nil engine, whose Usage is zero.
	Usage func() evict.Usage
	// MaxNamespaces bounds the series of the per-namespace gauges
	// (kvpersist_cache_used_bytes, kvpersist_cache_pages,
	// kvpersist_cache_quota_bytes), whose `namespace` label otherwise
	// takes one value per namespace of the store: the MaxNamespaces
	// namespaces with the most used bytes (ties: by name) get their own
	// series; the others are summed into namespace=".other"
	// (OtherNamespace; no namespace name starts with a dot), which has no
	// quota series. 0 means DefaultMaxNamespaces; < 0 is ErrOptions.
	// Snapshot is not bounded.
	MaxNamespaces int
}

// DefaultMaxNamespaces is Options.MaxNamespaces's default.
const DefaultMaxNamespaces = 64

// OtherNamespace is the `namespace` label of the namespaces beyond
// Options.MaxNamespaces, summed.
const OtherNamespace = ".other"

// Recorder counts what the engine does. Create it with New; it is safe for
// concurrent use, and every recording is a few atomic adds (no lock, no
// allocation).
type Recorder struct {
	jobs       [numKinds][numOutcomes]atomic.Uint64
	latency    [numKinds]histogram
	boundsSec  []float64
	boundsNs   []int64
	written    atomic.Int64
	reused     atomic.Int64
	read       atomic.Int64
	readDirect atomic.Int64
	readAsync  atomic.Int64
	hitTokens  atomic.Int64
	missTokens atomic.Int64
	evPages    [evict.ReasonShrink + 1]atomic.Int64
	evBytes    [evict.ReasonShrink + 1]atomic.Int64
	refused    [evict.ReasonShrink + 1]atomic.Uint64
	usage      atomic.Pointer[func() evict.Usage] // nil: no cache gauges
	evDropped  atomic.Pointer[func() uint64]      // nil: no KV events counter
	maxNS      int

	// The object-store tier (see RemoteOp).
	remoteOps     [labels.NumRemoteOps][labels.NumRemoteResults]atomic.Uint64
	remoteLatency [labels.NumRemoteOps]histogram
	remoteBytes   [labels.NumRemoteOps]atomic.Int64
	remoteHit     atomic.Int64 // pages
	remoteMiss    atomic.Int64 // pages
	uploadQueue   atomic.Int64 // uploads waiting or in flight (a gauge)
	uploadEvicted atomic.Int64 // pages evicted with their upload pending
	uploadRetried atomic.Int64 // failed upload attempts, retried
	remoteUsed    atomic.Bool  // a remote method was called: export the remote families
}

// RemoteOp and RemoteResult label the object-store tier's metrics
// (defined in package labels).
type (
	RemoteOp     = labels.RemoteOp
	RemoteResult = labels.RemoteResult
)

// Remote operations and results (see package labels).
const (
	RemoteLookup    = labels.RemoteLookup
	RemoteFetch     = labels.RemoteFetch
	RemoteUpload    = labels.RemoteUpload
	RemoteOK        = labels.RemoteOK
	RemoteExisted   = labels.RemoteExisted
	RemoteCorrupt   = labels.RemoteCorrupt
	RemoteError     = labels.RemoteError
	RemoteAbandoned = labels.RemoteAbandoned
)

// histogram is a lock-free latency histogram: per-bucket counts (not
// cumulative; the last one is +Inf) and the sum in nanoseconds.
type histogram struct {
	counts []atomic.Uint64
	sumNs  atomic.Int64
}

// ErrOptions: Options are invalid.
var ErrOptions = errors.New("metrics: invalid options")

// New returns a Recorder. Error: ErrOptions for bad latency buckets or a
// negative MaxNamespaces.
func New(opts Options) (*Recorder, error) {
	b := opts.LatencyBuckets
	if b == nil {
		b = DefaultLatencyBuckets
	}
	if len(b) == 0 {
		return nil, fmt.Errorf("%w: no latency buckets", ErrOptions)
	}
	if opts.MaxNamespaces < 0 {
		return nil, fmt.Errorf("%w: MaxNamespaces %d (want 0, the default %d, or more)", ErrOptions, opts.MaxNamespaces, DefaultMaxNamespaces)
	}
	r := &Recorder{boundsSec: slices.Clone(b), maxNS: opts.MaxNamespaces}
	r.SetUsage(opts.Usage)
	if r.maxNS == 0 {
		r.maxNS = DefaultMaxNamespaces
	}
	for i, s := range b {
		if !(s > 0) || s > 1e9 || (i > 0 && s <= b[i-1]) {
			return nil, fmt.Errorf("%w: latency bucket %d is %v (want finite, > 0 and increasing)", ErrOptions, i, s)
		}
		r.boundsNs = append(r.boundsNs, int64(s*1e9))
	}
	for k := range r.latency {
		r.latency[k].counts = make([]atomic.Uint64, len(b)+1)
	}
	for k := range r.remoteLatency {
		r.remoteLatency[k].counts = make([]atomic.Uint64, len(b)+1)
	}
	return r, nil
}

// SetUsage sets what the cache gauges read at each scrape and snapshot,
// as Options.Usage (nil: no cache gauges), replacing the earlier one; safe
// while the Recorder is scraped. engine.New calls it with the engine's
// Usage when the Recorder is its Config.Metrics. A nil Recorder ignores it.
func (r *Recorder) SetUsage(usage func() evict.Usage) {
	if r == nil {
		return
	}
	if usage == nil {
		r.usage.Store(nil)
		return
	}
	r.usage.Store(&usage)
}

// SetEventsDropped sets what kvpersist_events_dropped_total reads at each
// scrape: the KV events the publisher dropped, its queue full (nil: no
// such counter). engine.New calls it when the Recorder is its
// Config.Metrics and Config.Events is set. A nil Recorder ignores it.
func (r *Recorder) SetEventsDropped(dropped func() uint64) {
	if r == nil {
		return
	}
	if dropped == nil {
		r.evDropped.Store(nil)
		return
	}
	r.evDropped.Store(&dropped)
}

// observe adds one duration to h (whose buckets are r's).
func (r *Recorder) observe(h *histogram, d time.Duration) {
	ns := max(d.Nanoseconds(), 0)
	i := sort.Search(len(r.boundsNs), func(i int) bool { return ns <= r.boundsNs[i] })
	h.counts[i].Add(1)
	h.sumNs.Add(ns)
}

// Job records a finished job of kind k with outcome o. ran says the job
// ran (took a worker); d, its wall time, goes into the latency histogram
// only then (a job cancelled while it waited has no latency).
func (r *Recorder) Job(k Kind, o Outcome, d time.Duration, ran bool) {
	if r == nil || k >= numKinds || o >= numOutcomes {
		return
	}
	r.jobs[k][o].Add(1)
	if !ran {
		return
	}
	r.observe(&r.latency[k], d)
}

// Remote records one operation of the object-store tier: a lookup batch,
// a page fetch (bytes: the object's bytes fetched, counted only when
// verified and published) or an upload (bytes: the bytes sent by the
// attempt that created the object; 0 when it existed), its result and its
// wall time d (for an upload, from its first attempt to its end, retries
// included).
func (r *Recorder) Remote(op RemoteOp, res RemoteResult, bytes int64, d time.Duration) {
	if r == nil || op >= labels.NumRemoteOps || res >= labels.NumRemoteResults {
		return
	}
	r.remoteUsed.Store(true)
	r.remoteOps[op][res].Add(1)
	r.remoteBytes[op].Add(bytes)
	r.observe(&r.remoteLatency[op], d)
}

// RemoteLookup records the pages a remote lookup asked the store for:
// found (hit) and not found (miss). Pages found in the local tier are not
// counted here (see Lookup).
func (r *Recorder) RemoteLookup(hitPages, missPages int64) {
	if r == nil {
		return
	}
	r.remoteUsed.Store(true)
	r.remoteHit.Add(hitPages)
	r.remoteMiss.Add(missPages)
}

// RemoteQueue sets the upload queue's depth: uploads waiting or in flight.
func (r *Recorder) RemoteQueue(depth int64) {
	if r == nil {
		return
	}
	r.remoteUsed.Store(true)
	r.uploadQueue.Store(depth)
}

// RemoteUploadEvicted adds pages the page cache evicted while their upload
// to the object store was pending (kvpersist_remote_upload_evicted_pages_total):
// the cache had nothing else evictable, and those pages reach the store
// only if a save writes them again. A rate above zero says the cache is
// too small for the time uploads take (or the store is unreachable).
func (r *Recorder) RemoteUploadEvicted(pages int64) {
	if r == nil {
		return
	}
	r.remoteUsed.Store(true)
	r.uploadEvicted.Add(pages)
}

// RemoteUploadRetried counts one failed upload attempt that the uploader
// retries (kvpersist_remote_upload_failed_attempts_total): the store
// unreachable, a server error, or the credentials or bucket refused. A
// rate above zero says uploads are not getting through; the engine's log
// says why.
func (r *Recorder) RemoteUploadRetried() {
	if r == nil {
		return
	}
	r.remoteUsed.Store(true)
	r.uploadRetried.Add(1)
}

// Bytes adds bytes written to disk (new data and headers), reused (dedup:
// blocks or pages already stored) and read from disk into destinations.
func (r *Recorder) Bytes(written, reused, read int64) {
	if r == nil {
		return
	}
	r.written.Add(written)
	r.reused.Add(reused)
	r.read.Add(read)
}

// DirectRead adds bytes read with O_DIRECT (past the page cache): a part
// of the bytes read given to Bytes. It stays 0 where the file system has no
// O_DIRECT and reads fell back to buffered I/O, and for warm reads.
func (r *Recorder) DirectRead(n int64) {
	if r == nil {
		return
	}
	r.readDirect.Add(n)
}

// AsyncRead adds bytes read with asynchronous O_DIRECT reads (Linux AIO):
// a part of the bytes given to DirectRead. It stays 0 when the engine's
// AIO setup failed (preads instead) or was turned off.
func (r *Recorder) AsyncRead(n int64) {
	if r == nil {
		return
	}
	r.readAsync.Add(n)
}

// Lookup records one prefix lookup: tokens of the query covered by stored
// pages (hit) and not covered (miss).
func (r *Recorder) Lookup(hitTokens, missTokens int64) {
	if r == nil {
		return
	}
	r.hitTokens.Add(hitTokens)
	r.missTokens.Add(missTokens)
}

// Evicted records pages unlinked by eviction, and their allocated bytes.
func (r *Recorder) Evicted(reason evict.Reason, pages, bytes int64) {
	if r == nil || int(reason) >= len(r.evPages) {
		return
	}
	r.evPages[reason].Add(pages)
	r.evBytes[reason].Add(bytes)
}

// Refused records a save refused for want of space (the NoSpaceError's
// Limit: capacity, quota or headroom).
func (r *Recorder) Refused(limit evict.Reason) {
	if r == nil || int(limit) >= len(r.refused) {
		return
	}
	r.refused[limit].Add(1)
}

// The metrics' descriptions (names, help, labels).
var (
	descJobs = prometheus.NewDesc("kvpersist_jobs_total",
		"Jobs finished, by kind and outcome.", []string{"kind", "outcome"}, nil)
	descLatency = prometheus.NewDesc("kvpersist_job_duration_seconds",
		"Wall time of the jobs that ran, in seconds, by kind.", []string{"kind"}, nil)
	descWritten = prometheus.NewDesc("kvpersist_written_bytes_total",
		"Bytes written to disk by saves (data and headers).", nil, nil)
	descReused = prometheus.NewDesc("kvpersist_reused_bytes_total",
		"Bytes a save found already stored and did not write (dedup).", nil, nil)
	descRead = prometheus.NewDesc("kvpersist_read_bytes_total",
		"Bytes read from disk into callers' buffers.", nil, nil)
	descReadDirect = prometheus.NewDesc("kvpersist_read_direct_bytes_total",
		"Of kvpersist_read_bytes_total, bytes read with O_DIRECT (0 on a file system without it: buffered fallback).", nil, nil)
	descReadAsync = prometheus.NewDesc("kvpersist_read_async_bytes_total",
		"Of kvpersist_read_direct_bytes_total, bytes read asynchronously (Linux AIO; 0 when its setup failed: preads).", nil, nil)
	descLookup = prometheus.NewDesc("kvpersist_lookup_tokens_total",
		"Tokens of prefix lookups, hit (covered by stored pages) or miss.", []string{"result"}, nil)
	descEvPages = prometheus.NewDesc("kvpersist_evicted_pages_total",
		"Pages evicted, by reason.", []string{"reason"}, nil)
	descEvBytes = prometheus.NewDesc("kvpersist_evicted_bytes_total",
		"Allocated bytes of the pages evicted, by reason.", []string{"reason"}, nil)
	descRefused = prometheus.NewDesc("kvpersist_saves_refused_total",
		"Saves refused for want of space, by the limit that could not be met.", []string{"limit"}, nil)
	descCapacity = prometheus.NewDesc("kvpersist_cache_capacity_bytes",
		"The page cache's capacity in allocated bytes (0: unbounded).", nil, nil)
	descReserved = prometheus.NewDesc("kvpersist_cache_reserved_bytes",
		"Bytes reserved by in-flight saves.", nil, nil)
	descUsed = prometheus.NewDesc("kvpersist_cache_used_bytes",
		"Allocated bytes of the page files of a namespace.", []string{"namespace"}, nil)
	descPages = prometheus.NewDesc("kvpersist_cache_pages",
		"Pages stored in a namespace.", []string{"namespace"}, nil)
	descQuota = prometheus.NewDesc("kvpersist_cache_quota_bytes",
		"A namespace's quota in allocated bytes (namespaces with a quota only).", []string{"namespace"}, nil)
	descRemoteOps = prometheus.NewDesc("kvpersist_remote_ops_total",
		"Object-store tier operations (lookup batches, page fetches, uploads), by op and result.", []string{"op", "result"}, nil)
	descRemoteLatency = prometheus.NewDesc("kvpersist_remote_duration_seconds",
		"Wall time of object-store tier operations, in seconds, by op (an upload's includes its retries).", []string{"op"}, nil)
	descRemoteBytes = prometheus.NewDesc("kvpersist_remote_bytes_total",
		"Bytes fetched from (verified) and uploaded to the object store, by op.", []string{"op"}, nil)
	descRemoteLookup = prometheus.NewDesc("kvpersist_remote_lookup_pages_total",
		"Pages a remote lookup asked the object store for, hit (stored) or miss.", []string{"result"}, nil)
	descUploadQueue = prometheus.NewDesc("kvpersist_remote_upload_queue",
		"Uploads to the object store waiting or in flight.", nil, nil)
	descUploadEvicted = prometheus.NewDesc("kvpersist_remote_upload_evicted_pages_total",
		"Pages the page cache evicted while their upload to the object store was pending (nothing else was evictable).", nil, nil)
	descUploadRetried = prometheus.NewDesc("kvpersist_remote_upload_failed_attempts_total",
		"Upload attempts to the object store that failed and are retried (unreachable, server error, credentials or bucket refused).", nil, nil)
	descEventsDropped = prometheus.NewDesc("kvpersist_events_dropped_total",
		"KV events dropped, the publisher's queue full (a router misses them until a snapshot).", nil, nil)
)

// Describe implements prometheus.Collector.
func (r *Recorder) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{descJobs, descLatency, descWritten, descReused, descRead, descReadDirect, descReadAsync, descLookup,
		descEvPages, descEvBytes, descRefused, descCapacity, descReserved, descUsed, descPages, descQuota,
		descRemoteOps, descRemoteLatency, descRemoteBytes, descRemoteLookup, descUploadQueue, descUploadEvicted, descUploadRetried, descEventsDropped} {
		ch <- d
	}
}

// Collect implements prometheus.Collector: every kind × outcome of
// kvpersist_jobs_total (zeros included), a latency histogram per kind that
// has run, the byte and token counters, every eviction reason and refusal
// limit, and, with a Usage (see Options.Usage), the cache gauges. A nil Recorder
// collects nothing.
func (r *Recorder) Collect(ch chan<- prometheus.Metric) {
	if r == nil {
		return
	}
	emit := func(d *prometheus.Desc, t prometheus.ValueType, v float64, labels ...string) {
		m, err := prometheus.NewConstMetric(d, t, v, labels...)
		if err != nil {
			m = prometheus.NewInvalidMetric(d, err)
		}
		ch <- m
	}
	for k := range numKinds {
		for o := range numOutcomes {
			emit(descJobs, prometheus.CounterValue, float64(r.jobs[k][o].Load()), k.String(), o.String())
		}
	}
	for _, l := range r.latencies() {
		ch <- constHistogram(descLatency, l)
	}
	emit(descWritten, prometheus.CounterValue, float64(r.written.Load()))
	emit(descReused, prometheus.CounterValue, float64(r.reused.Load()))
	emit(descRead, prometheus.CounterValue, float64(r.read.Load()))
	emit(descReadDirect, prometheus.CounterValue, float64(r.readDirect.Load()))
	emit(descReadAsync, prometheus.CounterValue, float64(r.readAsync.Load()))
	emit(descLookup, prometheus.CounterValue, float64(r.hitTokens.Load()), "hit")
	emit(descLookup, prometheus.CounterValue, float64(r.missTokens.Load()), "miss")
	for _, reason := range evictReasons {
		emit(descEvPages, prometheus.CounterValue, float64(r.evPages[reason].Load()), reason.String())
		emit(descEvBytes, prometheus.CounterValue, float64(r.evBytes[reason].Load()), reason.String())
	}
	for _, limit := range refusedLimits {
		emit(descRefused, prometheus.CounterValue, float64(r.refused[limit].Load()), limit.String())
	}
	if r.remoteUsed.Load() {
		r.collectRemote(ch, emit)
	}
	if d := r.evDropped.Load(); d != nil {
		emit(descEventsDropped, prometheus.CounterValue, float64((*d)()))
	}
	usage := r.usage.Load()
	if usage == nil {
		return
	}
	u := (*usage)()
	emit(descCapacity, prometheus.GaugeValue, float64(u.CapacityBytes))
	emit(descReserved, prometheus.GaugeValue, float64(u.ReservedBytes))
	for _, n := range boundNamespaces(u.Namespaces, r.maxNS) {
		emit(descUsed, prometheus.GaugeValue, float64(n.UsedBytes), n.Name)
		emit(descPages, prometheus.GaugeValue, float64(n.Pages), n.Name)
		if n.QuotaBytes > 0 {
			emit(descQuota, prometheus.GaugeValue, float64(n.QuotaBytes), n.Name)
		}
	}
}

// boundNamespaces returns nss (sorted by name) when it has at most max
// namespaces; otherwise the max with the most used bytes (ties: by name),
// sorted by name, then OtherNamespace holding the others' used bytes and
// pages summed (and no quota).
func boundNamespaces(nss []evict.NamespaceUsage, max int) []evict.NamespaceUsage {
	if len(nss) <= max {
		return nss
	}
	s := slices.Clone(nss)
	slices.SortFunc(s, func(a, b evict.NamespaceUsage) int {
		if a.UsedBytes != b.UsedBytes {
			return cmp.Compare(b.UsedBytes, a.UsedBytes)
		}
		return strings.Compare(a.Name, b.Name)
	})
	other := evict.NamespaceUsage{Name: OtherNamespace}
	for _, n := range s[max:] {
		other.UsedBytes += n.UsedBytes
		other.Pages += n.Pages
	}
	s = s[:max]
	slices.SortFunc(s, func(a, b evict.NamespaceUsage) int { return strings.Compare(a.Name, b.Name) })
	return append(s, other)
}

// constHistogram is l as a histogram of d labelled with l.Kind.
func constHistogram(d *prometheus.Desc, l Latency) prometheus.Metric {
	buckets := make(map[float64]uint64, len(l.Buckets))
	for _, b := range l.Buckets {
		buckets[b.LE] = b.Count
	}
	m, err := prometheus.NewConstHistogram(d, l.Count, l.SumSeconds, buckets, l.Kind)
	if err != nil {
		return prometheus.NewInvalidMetric(d, err)
	}
	return m
}

// collectRemote emits the object-store tier's families (every op ×
// result, zeros included, once the tier reported anything).
func (r *Recorder) collectRemote(ch chan<- prometheus.Metric, emit func(d *prometheus.Desc, t prometheus.ValueType, v float64, labels ...string)) {
	for op := range labels.NumRemoteOps {
		for res := range labels.NumRemoteResults {
			emit(descRemoteOps, prometheus.CounterValue, float64(r.remoteOps[op][res].Load()), op.String(), res.String())
		}
	}
	for _, l := range r.histograms(r.remoteLatency[:], func(i int) string { return labels.RemoteOp(i).String() }) {
		ch <- constHistogram(descRemoteLatency, l)
	}
	emit(descRemoteBytes, prometheus.CounterValue, float64(r.remoteBytes[RemoteFetch].Load()), RemoteFetch.String())
	emit(descRemoteBytes, prometheus.CounterValue, float64(r.remoteBytes[RemoteUpload].Load()), RemoteUpload.String())
	emit(descRemoteLookup, prometheus.CounterValue, float64(r.remoteHit.Load()), "hit")
	emit(descRemoteLookup, prometheus.CounterValue, float64(r.remoteMiss.Load()), "miss")
	emit(descUploadQueue, prometheus.GaugeValue, float64(r.uploadQueue.Load()))
	emit(descUploadEvicted, prometheus.CounterValue, float64(r.uploadEvicted.Load()))
	emit(descUploadRetried, prometheus.CounterValue, float64(r.uploadRetried.Load()))
}

// Snapshot is the recorder's figures as a plain struct (JSON-ready, field
// names in camelCase). Lists leave out zero counts; Cache is nil without
// a Usage (Options.Usage, SetUsage, or the engine's).
type Snapshot struct {
	Jobs             []JobCount     `json:"jobs"`
	Latency          []Latency      `json:"latency"`
	WrittenBytes     int64          `json:"writtenBytes"`
	ReusedBytes      int64          `json:"reusedBytes"`
	ReadBytes        int64          `json:"readBytes"`
	ReadDirectBytes  int64          `json:"readDirectBytes"`
	ReadAsyncBytes   int64          `json:"readAsyncBytes"`
	LookupHitTokens  int64          `json:"lookupHitTokens"`
	LookupMissTokens int64          `json:"lookupMissTokens"`
	Evicted          []EvictedCount `json:"evicted"`
	Refused          []RefusedCount `json:"refused"`
	Cache            *evict.Usage   `json:"cache,omitempty"`
	// Remote is the object-store tier's figures; nil until the engine's
	// tier reported anything (an engine without Config.Remote never does).
	Remote *RemoteSnapshot `json:"remote,omitempty"`
}

// RemoteSnapshot is the object-store tier's figures (see Recorder.Remote).
type RemoteSnapshot struct {
	Ops []RemoteCount `json:"ops"` // zero counts left out
	// Latency per op that ran; Latency.Kind holds the op.
	Latency          []Latency `json:"latency"`
	FetchBytes       int64     `json:"fetchBytes"`
	UploadBytes      int64     `json:"uploadBytes"`
	LookupHitPages   int64     `json:"lookupHitPages"`
	LookupMissPages  int64     `json:"lookupMissPages"`
	UploadQueueDepth int64     `json:"uploadQueueDepth"`
	// UploadEvictedPages: pages evicted while their upload was pending
	// (kvpersist_remote_upload_evicted_pages_total).
	UploadEvictedPages int64 `json:"uploadEvictedPages"`
	// UploadFailedAttempts: upload attempts that failed and were retried
	// (kvpersist_remote_upload_failed_attempts_total).
	UploadFailedAttempts int64 `json:"uploadFailedAttempts"`
}

// RemoteCount is kvpersist_remote_ops_total for one op and result.
type RemoteCount struct {
	Op     string `json:"op"`
	Result string `json:"result"`
	Count  uint64 `json:"count"`
}

// JobCount is kvpersist_jobs_total for one kind and outcome.
type JobCount struct {
	Kind    string `json:"kind"`
	Outcome string `json:"outcome"`
	Count   uint64 `json:"count"`
}

// Latency is one kind's latency histogram.
type Latency struct {
	Kind       string  `json:"kind"`
	Count      uint64  `json:"count"`
	SumSeconds float64 `json:"sumSeconds"`
	// Buckets are cumulative (jobs that took at most LE seconds), without
	// the +Inf bucket (whose count is Count).
	Buckets []Bucket `json:"buckets"`
}

// Bucket is one cumulative histogram bucket.
type Bucket struct {
	LE    float64 `json:"le"` // upper bound, seconds
	Count uint64  `json:"count"`
}

// EvictedCount is pages and bytes evicted for one reason.
type EvictedCount struct {
	Reason string `json:"reason"`
	Pages  int64  `json:"pages"`
	Bytes  int64  `json:"bytes"`
}

// RefusedCount is saves refused for one limit.
type RefusedCount struct {
	Limit string `json:"limit"`
	Count uint64 `json:"count"`
}

// latencies reads every kind's histogram that has observations. Count is
// the sum of the bucket counts read, so a histogram is self-consistent
// even while jobs finish (the sum may lag by the observations in flight).
func (r *Recorder) latencies() []Latency {
	return r.histograms(r.latency[:], func(i int) string { return Kind(i).String() })
}

// histograms reads each histogram of hs that has observations, labelled
// by name(index).
func (r *Recorder) histograms(hs []histogram, name func(int) string) []Latency {
	var out []Latency
	for k := range hs {
		h := &hs[k]
		l := Latency{Kind: name(k), Buckets: make([]Bucket, len(r.boundsSec))}
		var cum uint64
		for i := range h.counts {
			cum += h.counts[i].Load()
			if i < len(r.boundsSec) {
				l.Buckets[i] = Bucket{LE: r.boundsSec[i], Count: cum}
			}
		}
		if cum == 0 {
			continue
		}
		l.Count = cum
		l.SumSeconds = float64(h.sumNs.Load()) / 1e9
		out = append(out, l)
	}
	return out
}

// Snapshot returns the figures now. A nil Recorder returns the zero
// Snapshot.
func (r *Recorder) Snapshot() Snapshot {
	var s Snapshot
	if r == nil {
		return s
	}
	for k := range numKinds {
		for o := range numOutcomes {
			if n := r.jobs[k][o].Load(); n > 0 {
				s.Jobs = append(s.Jobs, JobCount{Kind: k.String(), Outcome: o.String(), Count: n})
			}
		}
	}
	s.Latency = r.latencies()
	s.WrittenBytes, s.ReusedBytes, s.ReadBytes = r.written.Load(), r.reused.Load(), r.read.Load()
	s.ReadDirectBytes, s.ReadAsyncBytes = r.readDirect.Load(), r.readAsync.Load()
	s.LookupHitTokens, s.LookupMissTokens = r.hitTokens.Load(), r.missTokens.Load()
	for _, reason := range evictReasons {
		if p, b := r.evPages[reason].Load(), r.evBytes[reason].Load(); p != 0 || b != 0 {
			s.Evicted = append(s.Evicted, EvictedCount{Reason: reason.String(), Pages: p, Bytes: b})
		}
	}
	for _, limit := range refusedLimits {
		if n := r.refused[limit].Load(); n > 0 {
			s.Refused = append(s.Refused, RefusedCount{Limit: limit.String(), Count: n})
		}
	}
	if usage := r.usage.Load(); usage != nil {
		u := (*usage)()
		s.Cache = &u
	}
	if !r.remoteUsed.Load() {
		return s
	}
	s.Remote = &RemoteSnapshot{}
	for op := range labels.NumRemoteOps {
		for res := range labels.NumRemoteResults {
			if n := r.remoteOps[op][res].Load(); n > 0 {
				s.Remote.Ops = append(s.Remote.Ops, RemoteCount{Op: op.String(), Result: res.String(), Count: n})
			}
		}
	}
	s.Remote.Latency = r.histograms(r.remoteLatency[:], func(i int) string { return labels.RemoteOp(i).String() })
	s.Remote.FetchBytes, s.Remote.UploadBytes = r.remoteBytes[RemoteFetch].Load(), r.remoteBytes[RemoteUpload].Load()
	s.Remote.LookupHitPages, s.Remote.LookupMissPages = r.remoteHit.Load(), r.remoteMiss.Load()
	s.Remote.UploadQueueDepth = r.uploadQueue.Load()
	s.Remote.UploadEvictedPages = r.uploadEvicted.Load()
	s.Remote.UploadFailedAttempts = r.uploadRetried.Load()
	return s
}
