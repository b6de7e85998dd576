package engine

import (
	"fmt"

	"github.com/kvpersist/kvpersist/engine/evict"
	"github.com/kvpersist/kvpersist/engine/layout"
)

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
// so it suits metrics.Options{Usage: eng.Usage}, read at each scrape.
func (e *Engine) Usage() Usage {
	if e.cache == nil {
		return Usage{}
	}
	return e.cache.Usage()
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
