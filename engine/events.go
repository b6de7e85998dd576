package engine

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"

	"github.com/kvpersist/kvpersist/engine/events"
	"github.com/kvpersist/kvpersist/engine/layout"
)

// engineEvents is the KV events publisher of Config.Events and the
// snapshot it announces after the index rebuild at New, which Close
// stops before it closes the publisher.
type engineEvents struct {
	pub    *events.Publisher
	cancel context.CancelFunc // stops the start snapshot
	done   chan struct{}      // closed when the start snapshot has returned
}

// openEvents starts the publisher of cfg.Events; nil without one. A
// Config.Events error wraps ErrConfig.
func openEvents(cfg Config) (*engineEvents, error) {
	if cfg.Events == nil {
		return nil, nil
	}
	ec := *cfg.Events
	if ec.Logger == nil {
		ec.Logger = cfg.Logger
	}
	pub, err := events.New(ec)
	if err != nil {
		if errors.Is(err, events.ErrConfig) {
			return nil, fmt.Errorf("%w: Events: %w", ErrConfig, err)
		}
		return nil, fmt.Errorf("engine: events: %w", err)
	}
	return &engineEvents{pub: pub}, nil
}

// startEventsSnapshot announces the pages on disk in the background, so
// that a router is warm before the first request, and hands the
// publisher's drop count to an EventsMetricsSink.
func (e *Engine) startEventsSnapshot() {
	ev := e.ev
	if ev == nil {
		return
	}
	if s, ok := e.cfg.Metrics.(EventsMetricsSink); ok {
		s.SetEventsDropped(func() uint64 { return ev.pub.Stats().Dropped })
	}
	ctx, cancel := context.WithCancel(context.Background())
	ev.cancel, ev.done = cancel, make(chan struct{})
	go func() {
		defer close(ev.done)
		st, err := ev.pub.SnapshotStore(ctx, e.store, 1)
		if err != nil && ctx.Err() == nil {
			e.logSafe(slog.LevelWarn, "kvpersist: events: start snapshot", "err", err)
			return
		}
		e.logSafe(slog.LevelDebug, "kvpersist: events: start snapshot", "namespaces", st.Namespaces,
			"pages", st.Snapshot.Pages, "unreadable", st.Disk.Unreadable, "orphans", st.Snapshot.Orphans)
	}()
}

// closeEvents stops the start snapshot and closes the publisher; Close
// calls it once no job runs and the page cache is closed, so that every
// removal they made has been offered.
func (e *Engine) closeEvents() {
	ev := e.ev
	if ev == nil {
		return
	}
	if ev.cancel != nil {
		ev.cancel()
		<-ev.done
	}
	if err := ev.pub.Close(); err != nil {
		e.logSafe(slog.LevelWarn, "kvpersist: events: closing the publisher", "err", err)
	}
}

// AnnounceSnapshot announces every page stored now (of Config.Events'
// namespace, or of every namespace) as BlockStored events in chain order,
// read from the page files (events.Publisher.SnapshotStore): for a router
// that restarted, or one that saw a gap in the sequence. It runs on the
// caller's goroutine and returns once the events are handed to the PUB
// socket. Errors: ErrConfig without Config.Events, ctx's,
// events.ErrClosed after Close.
func (e *Engine) AnnounceSnapshot(ctx context.Context) (events.StoreSnapshotStats, error) {
	if e.ev == nil {
		return events.StoreSnapshotStats{}, fmt.Errorf("%w: no Events configured", ErrConfig)
	}
	return e.ev.pub.SnapshotStore(ctx, e.store, 0)
}

// EventStats returns the KV events publisher's counters (Dropped is the
// one to alert on); ok is false without Config.Events.
func (e *Engine) EventStats() (st events.Stats, ok bool) {
	if e.ev == nil {
		return st, false
	}
	return e.ev.pub.Stats(), true
}

// sink is where the engine announces its pages: the publisher, or a nil
// interface without Config.Events.
func (e *Engine) sink() events.Sink {
	if e.ev == nil {
		return nil
	}
	return e.ev.pub
}

// chainStored announces the pages of a chain that a save or a page
// manifest's write made durable: keys are the chain's keys from its first
// page (tokens' pages in order), failed the ones it could not store. The
// chain is announced up to its first failed page (a router drops a page
// whose parent it does not know); leaves are not announced (Sink.Stored).
// Call it before the keys are added to the index and before the save's
// reservation is settled, so that an eviction of a page is announced
// after its BlockStored.
func (e *Engine) chainStored(ns, identity string, pageTokens int, tokens []uint32, keys, failed []layout.PageKey) {
	s := e.sink()
	if s == nil {
		return
	}
	if i := slices.IndexFunc(keys, func(k layout.PageKey) bool { return slices.Contains(failed, k) }); i >= 0 {
		keys = keys[:i]
	}
	pages, err := events.ChainPages(identity, pageTokensOf(pageTokens), tokens, keys)
	if err != nil { // the save checked both: not reached
		e.logSafe(slog.LevelWarn, "kvpersist: events: a saved chain", "namespace", ns, "err", err)
		return
	}
	s.Stored(ns, pages...)
}

// pageFetched announces page pg of namespace ns that the tier fetched
// and published (tier.Deps.OnFetched: before the index has it, and after
// the pages of the same fetch before it, so parents come first).
func (e *Engine) pageFetched(ns string, pg *layout.Page) {
	if s := e.sink(); s != nil {
		s.Stored(ns, *pg)
	}
}

// pageRemoved is the page cache's report of a page file of namespace ns
// that it removed (an eviction) or found gone (a resync after a collect):
// the tier forgets it, and the sink announces it. A page a load or an
// upload found gone is not reported here (forgetIfGone): another process
// removed it and announced it.
func (e *Engine) pageRemoved(ns string, k layout.PageKey) {
	if e.tier != nil {
		e.tier.Forget(ns, k)
	}
	if s := e.sink(); s != nil {
		s.Removed(ns, k)
	}
}

// pageGone is the page cache's report of a page file of namespace ns that
// another engine on the root removed (the root's page log): the tier
// forgets it, and nothing is announced (that engine announced it).
func (e *Engine) pageGone(ns string, k layout.PageKey) {
	if e.tier != nil {
		e.tier.Forget(ns, k)
	}
}
