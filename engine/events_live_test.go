package engine

import (
	"context"
	"encoding/binary"
	"errors"
	"os"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/go-zeromq/zmq4"
	"github.com/kvpersist/kvpersist/engine/events"
	"github.com/kvpersist/kvpersist/engine/layout"
	"github.com/kvpersist/kvpersist/engine/metrics"
	"github.com/kvpersist/kvpersist/internal/kvgen"
	"github.com/prometheus/client_golang/prometheus"
	promtest "github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/vmihailenco/msgpack/v5"
)

// liveBatch is an EventBatch [ts, events, dp_rank] as the tests decode it
// (own types), its events left raw.
type liveBatch struct {
	_      struct{} `msgpack:",array"`
	TS     float64
	Events []msgpack.RawMessage
	Rank   int
}

// liveStored is a BlockStored as the tests decode it (own types, vLLM's
// positional form).
type liveStored struct {
	_         struct{} `msgpack:",array"`
	Tag       string
	Hashes    []uint64
	Parent    *uint64
	Tokens    []uint32
	BlockSize int
	LoraID    *int
	Medium    *string
	LoraName  *string
}

// liveRemoved is a BlockRemoved.
type liveRemoved struct {
	_      struct{} `msgpack:",array"`
	Tag    string
	Hashes []uint64
	Medium *string
}

// liveBlock is one announced page: its parent's hash (nil: a chain's
// first page), its tokens, and where in the stream it was announced.
type liveBlock struct {
	parent *uint64
	tokens []uint32
	at     int
}

// eventLog is what a subscriber received: the batches' sequence numbers,
// the pages stored (the first announcement of each hash) and the hashes
// removed with the position of each removal.
type eventLog struct {
	seqs    []uint64
	stored  map[uint64]liveBlock
	removed map[uint64][]int
	n       int // events so far
}

// add decodes one message [topic, seq, payload].
func (l *eventLog) add(t *testing.T, m zmq4.Msg) {
	t.Helper()
	if len(m.Frames) != 3 || len(m.Frames[1]) != 8 {
		t.Fatalf("message of %d frames", len(m.Frames))
	}
	l.seqs = append(l.seqs, binary.BigEndian.Uint64(m.Frames[1]))
	var b liveBatch
	if err := msgpack.Unmarshal(m.Frames[2], &b); err != nil {
		t.Fatal(err)
	}
	for _, raw := range b.Events {
		l.n++
		var fields []msgpack.RawMessage
		var tag string
		if err := msgpack.Unmarshal(raw, &fields); err != nil || len(fields) == 0 {
			t.Fatalf("event %x: %v", raw, err)
		}
		if err := msgpack.Unmarshal(fields[0], &tag); err != nil {
			t.Fatal(err)
		}
		switch tag {
		case "BlockStored":
			var ev liveStored
			if err := msgpack.Unmarshal(raw, &ev); err != nil {
				t.Fatal(err)
			}
			parent := ev.Parent
			for i, h := range ev.Hashes {
				if _, ok := l.stored[h]; !ok {
					l.stored[h] = liveBlock{parent: parent, tokens: ev.Tokens[i*ev.BlockSize : (i+1)*ev.BlockSize], at: l.n}
				}
				parent = &ev.Hashes[i]
			}
		case "BlockRemoved":
			var ev liveRemoved
			if err := msgpack.Unmarshal(raw, &ev); err != nil {
				t.Fatal(err)
			}
			for _, h := range ev.Hashes {
				l.removed[h] = append(l.removed[h], l.n)
			}
		default:
			t.Fatalf("event %q", tag)
		}
	}
}

// gapless fails unless the sequence numbers follow each other.
func (l *eventLog) gapless(t *testing.T) {
	t.Helper()
	for i := 1; i < len(l.seqs); i++ {
		if l.seqs[i] != l.seqs[i-1]+1 {
			t.Fatalf("sequence %d after %d", l.seqs[i], l.seqs[i-1])
		}
	}
}

// hash64 is the block hash of a page key as docs/format/kv-events.md
// defines it: the key's last 8 bytes, big-endian.
func hash64(k layout.PageKey) uint64 { return binary.BigEndian.Uint64(k[len(k)-8:]) }

// liveSub subscribes to pub's topics kv@… and returns the messages it
// receives; the subscription has reached the publisher when it returns.
func liveSub(t *testing.T, pub *events.Publisher) <-chan zmq4.Msg {
	t.Helper()
	ctx, cancel := context.WithCancel(bg)
	sub := zmq4.NewSub(ctx)
	if err := sub.Dial("tcp://" + pub.Addr().String()); err != nil {
		t.Fatal(err)
	}
	if err := sub.SetOption(zmq4.OptionSubscribe, "kv@"); err != nil {
		t.Fatal(err)
	}
	eventsWait(t, "the subscription", func() bool { return slices.Contains(pub.Subscriptions(), "kv@") })
	ch := make(chan zmq4.Msg, 1024)
	done := make(chan struct{})
	go func() {
		defer close(done)
		defer close(ch)
		for {
			m, err := sub.Recv()
			if err != nil {
				return
			}
			ch <- m
		}
	}()
	t.Cleanup(func() {
		cancel()
		sub.Close()
		for range ch { // until the receiver stopped
		}
		<-done
	})
	return ch
}

// drain flushes e's publisher and decodes what arrives until nothing more
// does for 300 ms.
func drain(t *testing.T, e *Engine, ch <-chan zmq4.Msg, l *eventLog) {
	t.Helper()
	if err := e.ev.pub.Flush(bg); err != nil {
		t.Fatal(err)
	}
	for {
		select {
		case m, ok := <-ch:
			if !ok {
				t.Fatal("the subscriber stopped")
			}
			l.add(t, m)
		case <-time.After(300 * time.Millisecond):
			return
		}
	}
}

func newEventLog() *eventLog {
	return &eventLog{stored: map[uint64]liveBlock{}, removed: map[uint64][]int{}}
}

// Every page a save or a page manifest's write stores is announced as
// BlockStored with its hash, its parent's and its tokens, before any
// removal of it; every page file that eviction (room for later saves,
// and pages a deleted manifest no longer pins), a collect's resync and
// a load that found it corrupt removed is announced once as
// BlockRemoved; the pages left on disk are exactly the ones stored and
// not removed. The sequence numbers have no gap.
func TestEventsLiveSavesAndRemovals(t *testing.T) {
	pb := pageBytes(t)
	root := t.TempDir()
	rec, err := metrics.New(metrics.Options{})
	if err != nil {
		t.Fatal(err)
	}
	e := newEngine(t, Config{Root: root, Workers: 1, CapacityBytes: 6 * pb, Metrics: rec, Events: &events.Config{
		Endpoint: "tcp://127.0.0.1:0", Topic: events.Topic("pod", "tiny"),
	}})
	ch := liveSub(t, e.ev.pub)
	l := newEventLog()

	var chains [][]uint32
	save := func(toks []uint32) {
		mustSavePages(t, e, "p", toks)
		chains = append(chains, toks)
	}
	save(convTokens(0, 4*cP, 1))
	save(convTokens(0, 4*cP+10, 2)) // a leaf too: never announced
	manifest := convTokens(0, 2*cP, 3)
	mustDo(t, e, namedPages("p", "m", manifest))
	chains = append(chains, manifest)
	save(convTokens(0, 3*cP, 4))
	mustDo(t, e, &DeleteRequest{Ref: refOf("p", "m")}) // its pages are evictable now
	save(convTokens(0, 4*cP, 5))
	save(convTokens(0, 4*cP, 6))
	drain(t, e, ch, l)
	if len(l.removed) == 0 {
		t.Fatal("no BlockRemoved: nothing evicted")
	}

	// A page file removed behind the engine's back is announced by the
	// collect that finds it gone.
	last, _, err := layout.PageChain("tiny", cP, chains[len(chains)-1])
	if err != nil {
		t.Fatal(err)
	}
	n, err := e.store.Namespace("p")
	if err != nil {
		t.Fatal(err)
	}
	if err := os.Remove(n.PagePath(last[3])); err != nil {
		t.Fatal(err)
	}
	mustDo(t, e, &CollectRequest{Namespaces: []string{"p"}})
	// A corrupt page a verified load finds is removed and announced.
	if err := os.WriteFile(n.PagePath(last[2]), []byte("not a page"), 0o644); err != nil {
		t.Fatal(err)
	}
	_, dest := paddedDest(kvgen.Tiny, cMax, func(n int) []byte { return make([]byte, n) })
	r := e.Do(bg, &LoadPrefixRequest{Namespace: "p", Identity: "tiny", Tokens: chains[len(chains)-1], Dest: dest, PageTokens: cP})
	if r.Err != nil || r.Prefix.Tokens != 2*cP || !errors.Is(r.Prefix.Stop, ErrCorrupt) {
		t.Fatalf("load over a corrupt page: %v, %d tokens, stop %v", r.Err, r.Prefix.Tokens, r.Prefix.Stop)
	}
	drain(t, e, ch, l)
	l.gapless(t)
	for _, k := range last[2:4] {
		if got := len(l.removed[hash64(k)]); got != 1 {
			t.Fatalf("page %s removed by hand or found corrupt: %d BlockRemoved, want 1", k, got)
		}
	}

	for c, toks := range chains {
		keys, full, err := layout.PageChain("tiny", cP, toks)
		if err != nil {
			t.Fatal(err)
		}
		for i, k := range keys {
			h := hash64(k)
			b, stored := l.stored[h]
			if i >= full {
				if stored {
					t.Fatalf("chain %d: leaf announced", c)
				}
				continue
			}
			if !stored {
				t.Fatalf("chain %d page %d: no BlockStored", c, i)
			}
			if !slices.Equal(b.tokens, toks[i*cP:(i+1)*cP]) {
				t.Fatalf("chain %d page %d: tokens differ", c, i)
			}
			switch {
			case i == 0 && b.parent != nil:
				t.Fatalf("chain %d: first page announced with parent %#x", c, *b.parent)
			case i > 0 && (b.parent == nil || *b.parent != hash64(keys[i-1])):
				t.Fatalf("chain %d page %d: parent %v, want %#x", c, i, b.parent, hash64(keys[i-1]))
			}
			rm := l.removed[h]
			_, statErr := os.Lstat(n.PagePath(k))
			onDisk := statErr == nil
			switch {
			case len(rm) > 1:
				t.Fatalf("chain %d page %d: %d BlockRemoved", c, i, len(rm))
			case onDisk == (len(rm) == 1):
				t.Fatalf("chain %d page %d: on disk %v, BlockRemoved %d times", c, i, onDisk, len(rm))
			case len(rm) == 1 && rm[0] < b.at:
				t.Fatalf("chain %d page %d: removed before it was stored", c, i)
			}
		}
	}
	if st, _ := e.EventStats(); st.Dropped != 0 {
		t.Fatalf("%d events dropped", st.Dropped)
	}
	// The drop count is exported (EventsMetricsSink).
	reg := prometheus.NewRegistry()
	reg.MustRegister(rec)
	if err := promtest.GatherAndCompare(reg, strings.NewReader("# HELP kvpersist_events_dropped_total KV events dropped, the publisher's queue full (a router misses them until a snapshot).\n"+
		"# TYPE kvpersist_events_dropped_total counter\nkvpersist_events_dropped_total 0\n"), "kvpersist_events_dropped_total"); err != nil {
		t.Fatal(err)
	}
}
