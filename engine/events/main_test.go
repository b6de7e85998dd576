package events

import (
	"context"
	"encoding/binary"
	"fmt"
	"log/slog"
	"slices"
	"testing"
	"time"

	"github.com/go-zeromq/zmq4"
	"github.com/kvpersist/kvpersist/engine/layout"
	"github.com/vmihailenco/msgpack/v5"
	"go.uber.org/goleak"
)

// zmq4 v0.17.0's PUB socket never stops its writer goroutine (Close does
// not close the writer): the one goroutine tolerated.
var zmqPubWriter = goleak.IgnoreAnyFunction("github.com/go-zeromq/zmq4.(*pubMWriter).run")

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m, zmqPubWriter)
}

// The test's own wire types, written from vLLM's definitions (not the
// publisher's encoder): a batch [ts, events, dp_rank]; tagged arrays.

type wBatch struct {
	_      struct{} `msgpack:",array"`
	TS     float64
	Events []msgpack.RawMessage
	DPRank *int
}

type wStored struct {
	_           struct{} `msgpack:",array"`
	Tag         string
	BlockHashes []any
	Parent      any
	TokenIDs    []uint32
	BlockSize   int
	LoraID      *int
	Medium      *string
	LoraName    *string
}

type wRemoved struct {
	_           struct{} `msgpack:",array"`
	Tag         string
	BlockHashes []any
	Medium      *string
}

// msg is one received message.
type msg struct {
	topic   string
	seq     uint64
	payload []byte
}

// subscriber is a SUB socket on p's PUB endpoint and the goroutine that
// reads it; stopped by the test's cleanup.
type subscriber struct {
	t  testing.TB
	c  chan msg
	sk zmq4.Socket
}

// subscribe connects a SUB socket filtering on topic to p and waits until
// p has its subscription.
func subscribe(t testing.TB, p *Publisher, topic string) *subscriber {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	sk := zmq4.NewSub(ctx)
	if err := sk.Dial("tcp://" + p.Addr().String()); err != nil {
		cancel()
		t.Fatal(err)
	}
	if err := sk.SetOption(zmq4.OptionSubscribe, topic); err != nil {
		cancel()
		t.Fatal(err)
	}
	s := &subscriber{t: t, c: make(chan msg, 1<<16), sk: sk}
	done := make(chan struct{})
	go func() {
		defer close(done)
		for {
			m, err := sk.Recv()
			if err != nil {
				return
			}
			if len(m.Frames) != 3 || len(m.Frames[1]) != 8 {
				t.Errorf("message of %d frames, sequence frame %d bytes (want 3 frames, 8 bytes)", len(m.Frames), len(m.Frames[1]))
				continue
			}
			s.c <- msg{string(m.Frames[0]), binary.BigEndian.Uint64(m.Frames[1]), m.Frames[2]}
		}
	}()
	t.Cleanup(func() {
		_ = sk.Close()
		cancel()
		<-done
	})
	deadline := time.Now().Add(10 * time.Second)
	for !slices.Contains(p.Subscriptions(), topic) {
		if time.Now().After(deadline) {
			t.Fatalf("the publisher never saw the subscription to %q", topic)
		}
		time.Sleep(5 * time.Millisecond)
	}
	return s
}

// next returns the next message, failing the test after 10 s.
func (s *subscriber) next() msg {
	s.t.Helper()
	select {
	case m := <-s.c:
		return m
	case <-time.After(10 * time.Second):
		s.t.Fatal("no message within 10 s")
		return msg{}
	}
}

// decodeBatch decodes a payload as vLLM's EventBatch, checking its shape.
func decodeBatch(t *testing.T, payload []byte) wBatch {
	t.Helper()
	var raw []any
	if err := msgpack.Unmarshal(payload, &raw); err != nil || len(raw) != 3 {
		t.Fatalf("batch is not a 3-element array: %d elements, %v", len(raw), err)
	}
	var b wBatch
	if err := msgpack.Unmarshal(payload, &b); err != nil {
		t.Fatalf("decoding the batch: %v", err)
	}
	return b
}

// tag returns an array-form event's tag and element count.
func tag(t *testing.T, ev []byte) (string, int) {
	t.Helper()
	var raw []any
	if err := msgpack.Unmarshal(ev, &raw); err != nil || len(raw) == 0 {
		t.Fatalf("event is not a tagged array: %v", err)
	}
	s, ok := raw[0].(string)
	if !ok {
		t.Fatalf("event tag is %T, want a string", raw[0])
	}
	return s, len(raw)
}

// hash64 is the test's own reduction of a page key: its last 8 bytes,
// big-endian.
func hash64(k layout.PageKey) uint64 {
	var h uint64
	for _, b := range k[24:] {
		h = h<<8 | uint64(b)
	}
	return h
}

// wantHash checks that v decoded as a uint64 (as llm-d requires) equal to
// want.
func wantHash(t *testing.T, what string, v any, want uint64) {
	t.Helper()
	got, ok := v.(uint64)
	if !ok {
		t.Fatalf("%s decoded as %T (want uint64)", what, v)
	}
	if got != want {
		t.Fatalf("%s = %#x, want %#x", what, got, want)
	}
}

// stored decodes a BlockStored event (8 elements exactly).
func stored(t *testing.T, ev []byte) wStored {
	t.Helper()
	if tg, n := tag(t, ev); tg != "BlockStored" || n != 8 {
		t.Fatalf("event %s of %d elements, want BlockStored of 8", tg, n)
	}
	var s wStored
	if err := msgpack.Unmarshal(ev, &s); err != nil {
		t.Fatalf("decoding BlockStored: %v", err)
	}
	return s
}

// tokensOf returns n token ids starting at from.
func tokensOf(from, n int) []uint32 {
	ts := make([]uint32, n)
	for i := range ts {
		ts[i] = uint32(from + i*7919%200000)
	}
	return ts
}

// chain returns the pages of tokens (identity id, P tokens a page).
func chain(t testing.TB, id string, p int, tokens []uint32) []layout.Page {
	t.Helper()
	keys, _, err := layout.PageChain(id, p, tokens)
	if err != nil {
		t.Fatal(err)
	}
	pages, err := ChainPages(id, p, tokens, keys)
	if err != nil {
		t.Fatal(err)
	}
	return pages
}

// newPub starts a publisher on a free loopback port, closed at cleanup.
func newPub(t testing.TB, cfg Config) *Publisher {
	t.Helper()
	if cfg.Endpoint == "" {
		cfg.Endpoint = "tcp://127.0.0.1:0"
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	p, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = p.Close() })
	return p
}

func str(p *string) string {
	if p == nil {
		return "<nil>"
	}
	return fmt.Sprintf("%q", *p)
}
