package engine

import (
	"errors"
	"time"

	"github.com/kvpersist/kvpersist/engine/evict"
	"github.com/kvpersist/kvpersist/engine/metrics/labels"
)

// MetricsSink is what the engine feeds with its operational signal:
// *metrics.Recorder satisfies it (a nil *metrics.Recorder does nothing).
// It is an interface so that importing package engine does not link
// prometheus and protobuf into every embedder: only an embedder that
// creates a metrics.Recorder does (TestEngineLinksNoPrometheus checks it).
// Methods must be safe for concurrent use and cheap: the engine calls them
// from its workers as jobs finish.
type MetricsSink interface {
	// Job records a finished job of kind k with outcome o; d, its wall time
	// from the moment it started on a worker, counts only when ran.
	Job(k labels.Kind, o labels.Outcome, d time.Duration, ran bool)
	// Bytes adds bytes written to disk, reused (dedup) and read from disk.
	Bytes(written, reused, read int64)
	// DirectRead adds bytes read with O_DIRECT (a part of the read bytes).
	DirectRead(n int64)
	// AsyncRead adds bytes read with asynchronous O_DIRECT reads (Linux
	// AIO: a part of the direct bytes).
	AsyncRead(n int64)
	// Lookup records one prefix lookup: tokens hit and missed.
	Lookup(hitTokens, missTokens int64)
	// Evicted records pages unlinked by eviction and their allocated bytes.
	Evicted(reason evict.Reason, pages, bytes int64)
	// Refused records a save refused for want of space, by limit (a page
	// the remote tier could not fetch for want of room counts as one).
	Refused(limit evict.Reason)
	// Remote records one operation of the object-store tier (a lookup
	// batch, a page fetch, an upload): its result, bytes (fetched and
	// verified, or sent) and wall time.
	Remote(op labels.RemoteOp, res labels.RemoteResult, bytes int64, d time.Duration)
	// RemoteLookup records pages asked of the object store: found (hit)
	// and not found (miss).
	RemoteLookup(hitPages, missPages int64)
	// RemoteQueue sets the upload queue's depth (waiting or in flight).
	RemoteQueue(depth int64)
	// RemoteUploadEvicted adds pages that the page cache evicted while
	// their upload to the object store was pending (queued, in flight or
	// spilled to the journal): nothing else evictable was left to make
	// room, and such a page reaches the store only if a save writes it
	// again. Also counted in Evicted.
	RemoteUploadEvicted(pages int64)
	// RemoteUploadRetried counts one failed upload attempt that will be
	// retried (the store unreachable, a server error, the credentials or
	// bucket refused): a rate above zero says uploads are not getting
	// through.
	RemoteUploadRetried()
}

// UsageSink is a MetricsSink that also shows the page cache's accounting
// (*metrics.Recorder's cache gauges): engine.New hands it the engine's
// Usage, so the gauges need no wiring by the embedder.
type UsageSink interface {
	SetUsage(usage func() Usage)
}

// EventsMetricsSink is a MetricsSink that also counts the KV events the
// publisher dropped (*metrics.Recorder's kvpersist_events_dropped_total):
// engine.New hands it the count's reader when Config.Events is set.
type EventsMetricsSink interface {
	SetEventsDropped(dropped func() uint64)
}

// NopMetrics is a MetricsSink that records nothing. Embed it in a sink of
// your own to implement only the methods you need: methods added to
// MetricsSink later then keep your sink compiling.
type NopMetrics struct{}

// Job does nothing.
func (NopMetrics) Job(labels.Kind, labels.Outcome, time.Duration, bool) {}

// Bytes does nothing.
func (NopMetrics) Bytes(written, reused, read int64) {}

// DirectRead does nothing.
func (NopMetrics) DirectRead(n int64) {}

// AsyncRead does nothing.
func (NopMetrics) AsyncRead(n int64) {}

// Lookup does nothing.
func (NopMetrics) Lookup(hitTokens, missTokens int64) {}

// Evicted does nothing.
func (NopMetrics) Evicted(reason evict.Reason, pages, bytes int64) {}

// Refused does nothing.
func (NopMetrics) Refused(limit evict.Reason) {}

// Remote does nothing.
func (NopMetrics) Remote(labels.RemoteOp, labels.RemoteResult, int64, time.Duration) {}

// RemoteLookup does nothing.
func (NopMetrics) RemoteLookup(hitPages, missPages int64) {}

// RemoteQueue does nothing.
func (NopMetrics) RemoteQueue(depth int64) {}

// RemoteUploadEvicted does nothing.
func (NopMetrics) RemoteUploadEvicted(pages int64) {}

// RemoteUploadRetried does nothing.
func (NopMetrics) RemoteUploadRetried() {}

var _ MetricsSink = NopMetrics{}

// metricsKind maps a job kind to its metrics label.
func metricsKind(k Kind) (labels.Kind, bool) {
	switch k {
	case KindWrite:
		return labels.KindWrite, true
	case KindRead:
		return labels.KindRead, true
	case KindCollect:
		return labels.KindCollect, true
	case KindDelete:
		return labels.KindDelete, true
	case KindMigrate:
		return labels.KindMigrate, true
	case KindSavePrefix:
		return labels.KindSave, true
	case KindLoadPrefix:
		return labels.KindLoad, true
	}
	return 0, false
}

// recordJob feeds Config.Metrics (when set) with a finished job: its kind
// and outcome (ErrClosed and context ends are "canceled"), its wall time
// from the moment it started on a worker (only when it ran), and its
// bytes written, reused and read.
func (e *Engine) recordJob(j *job, res *Result, ran bool) {
	m := e.cfg.Metrics
	if m == nil {
		return
	}
	kind, ok := metricsKind(j.kind)
	if !ok {
		return
	}
	outcome := labels.OutcomeOf(res.Err)
	if outcome == labels.OutcomeError && errors.Is(res.Err, ErrClosed) {
		outcome = labels.OutcomeCanceled
	}
	var elapsed time.Duration
	if ran {
		elapsed = time.Since(j.startedAt)
	}
	m.Job(kind, outcome, elapsed, ran)
	m.Bytes(res.Metrics.WrittenBytes, res.Metrics.ReusedBytes, res.Metrics.ReadBytes)
	m.DirectRead(res.Metrics.DirectReadBytes)
	m.AsyncRead(res.Metrics.AsyncReadBytes)
}
