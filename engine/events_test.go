package engine

import (
	"context"
	"encoding/binary"
	"errors"
	"net"
	"slices"
	"testing"
	"time"

	"github.com/go-zeromq/zmq4"
	"github.com/kvpersist/kvpersist/engine/events"
	"github.com/kvpersist/kvpersist/engine/layout"
	"github.com/kvpersist/kvpersist/internal/kvgen"
	"github.com/vmihailenco/msgpack/v5"
)

// freeAddr returns a loopback TCP address no one listens on now.
func freeAddr(t *testing.T) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().String()
}

// storedHashes decodes the BlockStored events of a batch payload (own
// types, vLLM's positional form) into hash → tokens.
func storedHashes(t *testing.T, payload []byte, into map[uint64][]uint32) {
	t.Helper()
	var b liveBatch
	if err := msgpack.Unmarshal(payload, &b); err != nil {
		t.Fatal(err)
	}
	for _, raw := range b.Events {
		var ev liveStored
		if err := msgpack.Unmarshal(raw, &ev); err != nil || ev.Tag != "BlockStored" {
			t.Fatalf("event %q: %v", ev.Tag, err)
		}
		for i, h := range ev.Hashes {
			into[h] = ev.Tokens[i*ev.BlockSize : (i+1)*ev.BlockSize]
		}
	}
}

// An engine with Config.Events announces the pages on disk after its
// index rebuild: a subscriber that comes late gets them by replay. On
// request (AnnounceSnapshot) a live subscriber gets them again.
func TestEventsStartSnapshotAndOnRequest(t *testing.T) {
	root := t.TempDir()
	c, _ := cacheOf(kvgen.Tiny, 300, true)
	toks := prefixTokens(300, 11)
	func() { // an earlier process saves 4 full pages and a leaf
		e := newEngine(t, Config{Root: root})
		mustDo(t, e, &SavePrefixRequest{Namespace: "p", Identity: "tiny", Tokens: toks, Tensors: kvTensors(c), PageTokens: 64})
		if err := e.Close(bg); err != nil {
			t.Fatal(err)
		}
	}()
	keys, full, err := layout.PageChain("tiny", 64, toks)
	if err != nil || full != 4 {
		t.Fatal(full, err)
	}
	want := map[uint64][]uint32{}
	for i := range full {
		want[events.Hash64(keys[i])] = toks[i*64 : (i+1)*64]
	}

	replay := freeAddr(t)
	e := newEngine(t, Config{Root: root, Events: &events.Config{
		Endpoint: "tcp://127.0.0.1:0", ReplayEndpoint: "tcp://" + replay, Topic: events.Topic("pod", "tiny"),
	}})
	eventsWait(t, "the start snapshot", func() bool { st, _ := e.EventStats(); return st.Batches > 0 })

	ctx, cancel := context.WithCancel(bg)
	defer cancel()
	d := zmq4.NewDealer(ctx)
	defer d.Close()
	if err := d.Dial("tcp://" + replay); err != nil {
		t.Fatal(err)
	}
	if err := d.SendMulti(zmq4.NewMsgFrom(nil, make([]byte, 8))); err != nil { // from seq 0
		t.Fatal(err)
	}
	got := map[uint64][]uint32{}
	for {
		m, err := d.Recv()
		if err != nil {
			t.Fatal(err)
		}
		if int64(binary.BigEndian.Uint64(m.Frames[1])) == -1 {
			break
		}
		storedHashes(t, m.Frames[2], got)
	}
	checkAnnounced(t, got, want)

	// On request, to a live subscriber.
	sub := zmq4.NewSub(ctx)
	defer sub.Close()
	if err := sub.Dial("tcp://" + e.ev.pub.Addr().String()); err != nil {
		t.Fatal(err)
	}
	if err := sub.SetOption(zmq4.OptionSubscribe, "kv@pod@"); err != nil {
		t.Fatal(err)
	}
	eventsWait(t, "the subscription", func() bool { return slices.Contains(e.ev.pub.Subscriptions(), "kv@pod@") })
	st, err := e.AnnounceSnapshot(bg)
	if err != nil || st.Snapshot.Pages != full || st.Snapshot.Leaves != 1 || st.Namespaces != 1 {
		t.Fatalf("AnnounceSnapshot: %+v, %v", st, err)
	}
	got = map[uint64][]uint32{}
	for len(got) < full {
		m, err := sub.Recv()
		if err != nil {
			t.Fatal(err)
		}
		storedHashes(t, m.Frames[2], got)
	}
	checkAnnounced(t, got, want)
	if st, ok := e.EventStats(); !ok || st.Dropped != 0 {
		t.Fatalf("event stats %+v %v", st, ok)
	}
}

// eventsWait polls cond for up to 10 s.
func eventsWait(t *testing.T, what string, cond func() bool) {
	t.Helper()
	for deadline := time.Now().Add(10 * time.Second); !cond(); time.Sleep(5 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("waited 10 s for %s", what)
		}
	}
}

func checkAnnounced(t *testing.T, got, want map[uint64][]uint32) {
	t.Helper()
	if len(got) != len(want) {
		t.Fatalf("%d pages announced, want %d", len(got), len(want))
	}
	for h, w := range want {
		if !slices.Equal(got[h], w) {
			t.Fatalf("page %#x announced with other tokens (or not at all)", h)
		}
	}
}

// A bad Config.Events is an ErrConfig; AnnounceSnapshot without events
// too.
func TestEventsConfig(t *testing.T) {
	_, err := New(Config{Root: t.TempDir(), Logger: newEngineLogger(), Events: &events.Config{}})
	if !errors.Is(err, ErrConfig) || !errors.Is(err, events.ErrConfig) {
		t.Fatalf("New with an empty Events: %v, want ErrConfig", err)
	}
	e := newEngine(t, Config{})
	if _, err := e.AnnounceSnapshot(bg); !errors.Is(err, ErrConfig) {
		t.Fatalf("AnnounceSnapshot without Events: %v", err)
	}
	if _, ok := e.EventStats(); ok {
		t.Fatal("EventStats without Events")
	}
}
