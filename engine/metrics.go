package engine

import (
	"errors"
	"time"

	"github.com/kvpersist/kvpersist/engine/metrics"
)

// metricsKind maps a job kind to its metrics label.
func metricsKind(k Kind) (metrics.Kind, bool) {
	switch k {
	case KindWrite:
		return metrics.KindWrite, true
	case KindRead:
		return metrics.KindRead, true
	case KindCollect:
		return metrics.KindCollect, true
	case KindDelete:
		return metrics.KindDelete, true
	case KindMigrate:
		return metrics.KindMigrate, true
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
	outcome := metrics.OutcomeOf(res.Err)
	if outcome == metrics.OutcomeError && errors.Is(res.Err, ErrClosed) {
		outcome = metrics.OutcomeCanceled
	}
	var elapsed time.Duration
	if ran {
		elapsed = time.Since(j.startedAt)
	}
	m.Job(kind, outcome, elapsed, ran)
	m.Bytes(res.Metrics.WrittenBytes, res.Metrics.ReusedBytes, res.Metrics.ReadBytes)
	m.DirectRead(res.Metrics.DirectReadBytes)
}
