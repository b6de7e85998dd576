package bench

import (
	"context"
	"net"
	"path/filepath"
	"sync/atomic"
	"testing"
	"time"

	"github.com/go-zeromq/zmq4"
	"github.com/kvpersist/kvpersist/engine"
	"github.com/kvpersist/kvpersist/engine/events"
	"github.com/kvpersist/kvpersist/engine/layout"
)

// BenchmarkPrefixEvents: BenchmarkPrefix's save-empty row (8,192 tokens,
// 32 new pages) on an engine publishing KV events (Config.Events) to a
// subscriber on loopback that receives them all, beside the same save on
// an engine without events ("off", an extra side of the same iterations)
// and the raw write + fdatasync limit. x-off = the save's time without
// events / with them: what announcing a save's pages costs its ack;
// target >= 0.95.
func BenchmarkPrefixEvents(b *testing.B) {
	w := getWorkload(b, benchModel, prefixTokens)
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		b.Fatal(err)
	}
	endpoint := "tcp://" + l.Addr().String()
	l.Close()
	rootOn, rootOff, lim := mkdir(b, "events-on"), mkdir(b, "events-off"), mkdir(b, "events-limit")
	on, err := engine.New(engine.Config{Root: rootOn, Logger: quietLogger,
		Events: &events.Config{Endpoint: endpoint, Topic: events.Topic("bench", prefixIdentity)}})
	if err != nil {
		b.Fatal(err)
	}
	defer closeEngine(b, on)
	off := newEngine(b, rootOff, false)
	defer closeEngine(b, off)

	// The subscriber: receives and drops every message until the end.
	ctx, cancel := context.WithCancel(context.Background())
	sub := zmq4.NewSub(ctx)
	if err := sub.Dial(endpoint); err != nil {
		b.Fatal(err)
	}
	if err := sub.SetOption(zmq4.OptionSubscribe, ""); err != nil {
		b.Fatal(err)
	}
	var received atomic.Int64 // batches the subscriber got
	done := make(chan struct{})
	go func() {
		defer close(done)
		for {
			if _, err := sub.Recv(); err != nil {
				return
			}
			received.Add(1)
		}
	}()
	defer func() {
		cancel()
		sub.Close()
		<-done
	}()

	req := savePrefixReq(w.cache, tokenIDs(prefixTokens, 1))
	save := func(e *engine.Engine) int64 {
		res := do(b, e, req)
		if res.Prefix.PagesWritten != prefixTokens/layout.DefaultPageTokens || res.Prefix.PagesReused != 0 {
			b.Fatalf("save into an empty store: %+v", res.Prefix)
		}
		return res.Prefix.BytesWritten
	}
	var written int64
	b.ReportAllocs()
	settle(b, rootOn)
	m := alternate(b, steps{
		ours:  func(int) { written = save(on) },
		limit: rawSaveLimit(b, w, lim, &written),
		extra: []side{{name: "off", run: func(int) { save(off) }}},
		cleanup: func(i int) {
			removeAll(b, filepath.Join(rootOff, "ns"))
			cleanSave(b, rootOn, lim)(i)
		},
	})
	b.SetBytes(written)
	m.report(b, written)
	m.reportExtra(b, written)
	// The "on" side counts only if its events reached the subscriber:
	// none dropped, and the batches sent arrive (the first may precede the
	// subscription, as with any ZMQ subscriber that joins late).
	st, _ := on.EventStats()
	if st.Dropped > 0 {
		b.Fatalf("%d events dropped", st.Dropped)
	}
	for deadline := time.Now().Add(10 * time.Second); received.Load() < int64(st.Batches) && time.Now().Before(deadline); {
		time.Sleep(10 * time.Millisecond)
	}
	if received.Load() == 0 || st.Batches == 0 {
		b.Fatalf("the subscriber received %d of %d batches", received.Load(), st.Batches)
	}
	b.ReportMetric(float64(received.Load())/float64(st.Batches), "received/sent")
}
