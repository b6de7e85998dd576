package engine

import (
	"errors"
	"fmt"

	"github.com/kvpersist/kvpersist/engine/evict"
	"github.com/kvpersist/kvpersist/engine/pagecache"
)

// The bounded page cache is engine/pagecache (its I/O) driving engine/evict
// (the policy); the engine opens it in New, closes it in Close, and routes
// saves, loads, lookups, deletes and collects through it. See
// ARCHITECTURE.md, "Evict", and README.md, "Bounded cache".

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
	return e.pc.Usage()
}

// SetQuota changes namespace ns's quota (allocated bytes of its page files;
// 0 removes it). A namespace left above its new quota is shrunk in the
// background. Errors: ErrConfig for an invalid name or a quota outside [0,
// 2^53].
func (e *Engine) SetQuota(ns string, bytes int64) error {
	if err := e.pc.SetQuota(ns, bytes); err != nil {
		return configError(err)
	}
	return nil
}

// cacheLimits are cfg's page cache limits.
func cacheLimits(cfg Config) pagecache.Limits {
	return pagecache.Limits{CapacityBytes: cfg.CapacityBytes, HeadroomBytes: cfg.HeadroomBytes, QuotaBytes: cfg.QuotaBytes}
}

// configError makes a pagecache.ErrLimits error an ErrConfig too.
func configError(err error) error {
	if errors.Is(err, pagecache.ErrLimits) {
		return fmt.Errorf("%w: %w", ErrConfig, err)
	}
	return err
}
