package events

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"log/slog"
	"slices"
	"testing"
	"time"

	"github.com/go-zeromq/zmq4"
	"github.com/kvpersist/kvpersist/engine/layout"
	"github.com/vmihailenco/msgpack/v5"
)

// A save's chain is announced as one BlockStored of its full pages: the
// hashes are the keys' last 8 bytes, the first page has no parent, the
// tokens are the pages' tokens, the block size the page size; the leaf is
// not announced; the message is [topic, seq 0, batch] with the DP rank.
func TestStoredChainOnTheWire(t *testing.T) {
	const P = 16
	topic := Topic("pod-a", "llama")
	p := newPub(t, Config{Topic: topic, DPRank: 3})
	s := subscribe(t, p, topic)

	tokens := tokensOf(100000, 3*P+5) // 3 full pages and a leaf
	pages := chain(t, "model@sha:1/bf16", P, tokens)
	p.Stored("ns", pages...)

	m := s.next()
	if m.topic != topic || m.seq != 0 {
		t.Fatalf("message topic %q seq %d, want %q 0", m.topic, m.seq, topic)
	}
	b := decodeBatch(t, m.payload)
	if b.DPRank == nil || *b.DPRank != 3 {
		t.Fatalf("dp rank %v, want 3", b.DPRank)
	}
	if d := time.Since(time.Unix(0, int64(b.TS*1e9))); d < 0 || d > time.Minute {
		t.Fatalf("ts %f is %v from now", b.TS, d)
	}
	if len(b.Events) != 1 {
		t.Fatalf("%d events, want 1", len(b.Events))
	}
	ev := stored(t, b.Events[0])
	if len(ev.BlockHashes) != 3 {
		t.Fatalf("%d block hashes, want 3 (the leaf is not announced)", len(ev.BlockHashes))
	}
	for i := range 3 {
		wantHash(t, "block hash", ev.BlockHashes[i], hash64(pages[i].Key))
	}
	if ev.Parent != nil {
		t.Fatalf("parent %v, want nil for a chain's first page", ev.Parent)
	}
	if !slices.Equal(ev.TokenIDs, tokens[:3*P]) {
		t.Fatalf("token ids differ from the full pages' tokens")
	}
	if ev.BlockSize != P || ev.LoraID != nil || ev.LoraName != nil || str(ev.Medium) != `"STORAGE"` {
		t.Fatalf("block size %d lora_id %v lora_name %s medium %s, want %d nil nil \"STORAGE\"", ev.BlockSize, ev.LoraID, str(ev.LoraName), str(ev.Medium), P)
	}
}

// A run that starts inside a chain names its parent; pages that do not
// follow each other start a new event; page sizes are per event.
func TestStoredRunsAndParents(t *testing.T) {
	const P = 16
	p := newPub(t, Config{Topic: "t", Medium: "SHARED_STORAGE"})
	s := subscribe(t, p, "t")

	a := chain(t, "id-a", P, tokensOf(1, 5*P))
	b := chain(t, "id-b", 2*P, tokensOf(7, 4*P))
	p.Stored("ns", append(slices.Clone(a[2:]), b...)...)

	var evs []wStored
	for len(evs) < 2 {
		for _, raw := range decodeBatch(t, s.next().payload).Events {
			evs = append(evs, stored(t, raw))
		}
	}
	if len(evs) != 2 {
		t.Fatalf("%d events, want 2", len(evs))
	}
	wantHash(t, "parent of a[2:]", evs[0].Parent, hash64(a[1].Key))
	if len(evs[0].BlockHashes) != 3 || evs[0].BlockSize != P {
		t.Fatalf("first event: %d hashes, block size %d; want 3, %d", len(evs[0].BlockHashes), evs[0].BlockSize, P)
	}
	for i, h := range evs[0].BlockHashes {
		wantHash(t, "a's hash", h, hash64(a[2+i].Key))
	}
	if evs[1].Parent != nil || len(evs[1].BlockHashes) != 2 || evs[1].BlockSize != 2*P {
		t.Fatalf("second event: parent %v, %d hashes, block size %d; want nil, 2, %d", evs[1].Parent, len(evs[1].BlockHashes), evs[1].BlockSize, 2*P)
	}
	if !slices.Equal(evs[1].TokenIDs, tokensOf(7, 4*P)) {
		t.Fatal("b's tokens differ")
	}
	if str(evs[0].Medium) != `"SHARED_STORAGE"` {
		t.Fatalf("medium %s", str(evs[0].Medium))
	}
}

// Removals are BlockRemoved [tag, hashes, medium]; a namespace's clear is
// AllBlocksCleared when the topic is that namespace's, and the removal of
// its keys when the topic covers every namespace.
func TestRemovedAndCleared(t *testing.T) {
	keys := []layout.PageKey{{1, 2, 3}, {31: 0x42}, {24: 0xff, 31: 1}}
	check := func(t *testing.T, ev []byte) {
		if tg, n := tag(t, ev); tg != "BlockRemoved" || n != 3 {
			t.Fatalf("event %s of %d elements, want BlockRemoved of 3", tg, n)
		}
		var r wRemoved
		if err := msgpack.Unmarshal(ev, &r); err != nil {
			t.Fatal(err)
		}
		if len(r.BlockHashes) != len(keys) || str(r.Medium) != `"STORAGE"` {
			t.Fatalf("%d hashes medium %s", len(r.BlockHashes), str(r.Medium))
		}
		for i, h := range r.BlockHashes {
			wantHash(t, "removed hash", h, hash64(keys[i]))
		}
	}
	t.Run("one namespace", func(t *testing.T) {
		p := newPub(t, Config{Topic: "t", Namespace: "ns"})
		s := subscribe(t, p, "t")
		p.Removed("other", keys...) // not this topic's
		p.Removed("ns", keys...)
		p.Cleared("ns", keys...)
		var evs [][]byte
		for len(evs) < 2 {
			for _, raw := range decodeBatch(t, s.next().payload).Events {
				evs = append(evs, raw)
			}
		}
		check(t, evs[0])
		if tg, n := tag(t, evs[1]); tg != "AllBlocksCleared" || n != 1 {
			t.Fatalf("event %s of %d elements, want AllBlocksCleared of 1", tg, n)
		}
		if err := p.Flush(context.Background()); err != nil {
			t.Fatal(err)
		}
		if st := p.Stats(); st.Events != 2 {
			t.Fatalf("%d events sent, want 2 (another namespace's removal is not announced)", st.Events)
		}
	})
	t.Run("every namespace", func(t *testing.T) {
		p := newPub(t, Config{Topic: "t"})
		s := subscribe(t, p, "t")
		p.Cleared("ns", keys...)
		b := decodeBatch(t, s.next().payload)
		if len(b.Events) != 1 {
			t.Fatalf("%d events", len(b.Events))
		}
		check(t, b.Events[0])
	})
}

// FormMap encodes vLLM's tagged maps: "type" first, field names, locality.
func TestMapForm(t *testing.T) {
	const P = 16
	p := newPub(t, Config{Topic: "t", Form: FormMap, Locality: "LOCAL"})
	s := subscribe(t, p, "t")
	pages := chain(t, "id", P, tokensOf(5, 2*P))
	p.Stored("ns", pages...)
	p.Removed("ns", pages[1].Key)
	var evs []msgpack.RawMessage
	for len(evs) < 2 {
		evs = append(evs, decodeBatch(t, s.next().payload).Events...)
	}
	var st map[string]any
	if err := msgpack.Unmarshal(evs[0], &st); err != nil {
		t.Fatal(err)
	}
	if st["type"] != "BlockStored" || st["parent_block_hash"] != nil || st["medium"] != "STORAGE" || st["locality"] != "LOCAL" ||
		st["lora_id"] != nil || st["lora_name"] != nil || len(st) != 9 {
		t.Fatalf("BlockStored map %v", st)
	}
	hs := st["block_hashes"].([]any)
	wantHash(t, "hash 0", hs[0], hash64(pages[0].Key))
	wantHash(t, "hash 1", hs[1], hash64(pages[1].Key))
	if bs, ok := st["block_size"].(int8); !ok || bs != P {
		t.Fatalf("block_size %v (%T)", st["block_size"], st["block_size"])
	}
	if n := len(st["token_ids"].([]any)); n != 2*P {
		t.Fatalf("%d token ids", n)
	}
	// The key order is vLLM's declaration order, "type" first.
	d := msgpack.NewDecoder(bytes.NewReader(evs[0]))
	n, _ := d.DecodeMapLen()
	var order []string
	for range n {
		k, _ := d.DecodeString()
		order = append(order, k)
		_ = d.Skip()
	}
	want := []string{"type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name", "locality"}
	if !slices.Equal(order, want) {
		t.Fatalf("keys %v, want %v", order, want)
	}
	var rm map[string]any
	if err := msgpack.Unmarshal(evs[1], &rm); err != nil {
		t.Fatal(err)
	}
	if rm["type"] != "BlockRemoved" || rm["medium"] != "STORAGE" || rm["locality"] != "LOCAL" || len(rm) != 4 {
		t.Fatalf("BlockRemoved map %v", rm)
	}
	wantHash(t, "removed", rm["block_hashes"].([]any)[0], hash64(pages[1].Key))
}

// Batches are numbered 0, 1, 2, ... without a gap, and carry every event.
func TestSequencesGapless(t *testing.T) {
	const P, saves = 16, 300
	p := newPub(t, Config{Topic: "t"})
	s := subscribe(t, p, "t")
	for i := range saves {
		p.Stored("ns", chain(t, "id", P, tokensOf(i, P))...)
		if i%50 == 0 {
			if err := p.Flush(context.Background()); err != nil {
				t.Fatal(err)
			}
		}
	}
	if err := p.Flush(context.Background()); err != nil {
		t.Fatal(err)
	}
	st := p.Stats()
	if st.Events != saves || st.Dropped != 0 {
		t.Fatalf("stats %+v, want %d events, none dropped", st, saves)
	}
	events := 0
	for want := uint64(0); want < st.Batches; want++ {
		m := s.next()
		if m.seq != want {
			t.Fatalf("seq %d, want %d", m.seq, want)
		}
		events += len(decodeBatch(t, m.payload).Events)
	}
	if events != saves {
		t.Fatalf("%d events received, want %d", events, saves)
	}
}

// A late subscriber asks the ROUTER endpoint for what it missed: it gets
// each buffered batch [seq, payload] from its start on, then the end
// marker [-1, ""]; the ring keeps only the last ReplayBatches.
func TestReplay(t *testing.T) {
	const P = 16
	p := newPub(t, Config{Topic: "t", ReplayEndpoint: "tcp://127.0.0.1:0", ReplayBatches: 8})
	var sent [][]byte
	for i := range 10 {
		p.Stored("ns", chain(t, "id", P, tokensOf(i, P))...)
		if err := p.Flush(context.Background()); err != nil { // one batch each
			t.Fatal(err)
		}
		sent = append(sent, tokensBytes(tokensOf(i, P)))
	}
	if st := p.Stats(); st.Batches != 10 {
		t.Fatalf("%d batches, want 10", st.Batches)
	}
	ask := func(start uint64) (seqs []uint64, payloads [][]byte) {
		ctx, cancel := context.WithCancel(context.Background())
		defer cancel()
		d := zmq4.NewDealer(ctx)
		defer d.Close()
		if err := d.Dial("tcp://" + p.ReplayAddr().String()); err != nil {
			t.Fatal(err)
		}
		var sb [8]byte
		binary.BigEndian.PutUint64(sb[:], start)
		if err := d.SendMulti(zmq4.NewMsgFrom(nil, sb[:])); err != nil {
			t.Fatal(err)
		}
		for {
			m, err := d.Recv()
			if err != nil {
				t.Fatal(err)
			}
			if len(m.Frames) != 3 || len(m.Frames[0]) != 0 || len(m.Frames[1]) != 8 {
				t.Fatalf("replay message of %d frames", len(m.Frames))
			}
			if int64(binary.BigEndian.Uint64(m.Frames[1])) == -1 {
				if len(m.Frames[2]) != 0 {
					t.Fatal("end marker with a payload")
				}
				return
			}
			seqs = append(seqs, binary.BigEndian.Uint64(m.Frames[1]))
			payloads = append(payloads, m.Frames[2])
		}
	}
	seqs, payloads := ask(5)
	if !slices.Equal(seqs, []uint64{5, 6, 7, 8, 9}) {
		t.Fatalf("replayed %v, want 5..9", seqs)
	}
	for i, pl := range payloads {
		b := decodeBatch(t, pl)
		if got := tokensBytes(stored(t, b.Events[0]).TokenIDs); string(got) != string(sent[5+i]) {
			t.Fatalf("replayed batch %d holds other tokens", 5+i)
		}
	}
	if seqs, _ := ask(0); !slices.Equal(seqs, []uint64{2, 3, 4, 5, 6, 7, 8, 9}) {
		t.Fatalf("replayed %v from 0, want the 8 kept: 2..9", seqs)
	}
	if seqs, _ := ask(10); len(seqs) != 0 {
		t.Fatalf("replayed %v from the next sequence, want nothing", seqs)
	}
	if st := p.Stats(); st.ReplayRequests != 3 {
		t.Fatalf("%d replay requests", st.ReplayRequests)
	}
}

// A full queue drops events without blocking the caller, counts them, and
// the next batch skips a sequence number so subscribers see the loss.
func TestDropsCountedAndShownAsGap(t *testing.T) {
	const P = 16
	p, err := open(Config{Endpoint: "tcp://127.0.0.1:0", Topic: "t", QueueEvents: 4, Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	pages := chain(t, "id", P, tokensOf(1, P))
	start := time.Now()
	for range 10 { // the goroutine is not running: 4 fit, 6 are dropped
		p.Stored("ns", pages...)
	}
	if d := time.Since(start); d > 5*time.Second {
		t.Fatalf("offering to a full queue took %v", d)
	}
	if st := p.Stats(); st.Dropped != 6 {
		t.Fatalf("%d dropped, want 6", st.Dropped)
	}
	p.start()
	s := subscribe(t, p, "t")
	if err := p.Flush(context.Background()); err != nil {
		t.Fatal(err)
	}
	p.Stored("ns", pages...)
	if err := p.Flush(context.Background()); err != nil {
		t.Fatal(err)
	}
	st := p.Stats()
	if st.Dropped != 6 || st.Events != 5 || st.Batches != 2 || st.NextSeq != 3 {
		t.Fatalf("stats %+v, want 6 dropped, 5 events in 2 batches, next seq 3 (seq 0 skipped)", st)
	}
	for { // batch 1 may have gone before the subscription
		m := s.next()
		if m.seq == 2 {
			break
		}
		if m.seq != 1 {
			t.Fatalf("seq %d, want 1 or 2", m.seq)
		}
	}
}

// A subscriber that never reads does not slow announcing.
func TestStalledSubscriberDoesNotBlock(t *testing.T) {
	const P = 256
	p := newPub(t, Config{Topic: "t", QueueEvents: 64, HWM: 4})
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	sk := zmq4.NewSub(ctx)
	defer sk.Close()
	if err := sk.Dial("tcp://" + p.Addr().String()); err != nil {
		t.Fatal(err)
	}
	if err := sk.SetOption(zmq4.OptionSubscribe, ""); err != nil {
		t.Fatal(err)
	}
	pages := chain(t, "id", P, tokensOf(1, 16*P))
	start := time.Now()
	for range 1000 { // about 20 MB of events, never read
		p.Stored("ns", pages...)
	}
	if d := time.Since(start); d > 60*time.Second {
		t.Fatalf("announcing behind a stalled subscriber took %v", d)
	}
	// zmq4's SUB reader hands its connection's end to Recv, and waits
	// for it: read up to it, so that it can return.
	if err := p.Close(); err != nil {
		t.Fatal(err)
	}
	for {
		if _, err := sk.Recv(); err != nil {
			break
		}
	}
}

// Close is idempotent; afterwards events are ignored and waits fail with
// ErrClosed.
func TestClose(t *testing.T) {
	p := newPub(t, Config{Topic: "t"})
	if err := p.Close(); err != nil {
		t.Fatal(err)
	}
	if err := p.Close(); err != nil {
		t.Fatal(err)
	}
	p.Stored("ns", chain(t, "id", 16, tokensOf(1, 16))...)
	if err := p.Flush(context.Background()); !errors.Is(err, ErrClosed) {
		t.Fatalf("Flush after Close: %v, want ErrClosed", err)
	}
	if _, err := p.Snapshot(context.Background(), "ns", chain(t, "id", 16, tokensOf(1, 16))); !errors.Is(err, ErrClosed) {
		t.Fatalf("Snapshot after Close: %v, want ErrClosed", err)
	}
	if st := p.Stats(); st.Events != 0 || st.Dropped != 0 {
		t.Fatalf("stats after Close %+v", st)
	}
}

func TestConfigErrors(t *testing.T) {
	for _, c := range []struct {
		name string
		cfg  Config
	}{
		{"no endpoint", Config{}},
		{"locality with array form", Config{Endpoint: "tcp://127.0.0.1:0", Locality: "LOCAL"}},
		{"bad locality", Config{Endpoint: "tcp://127.0.0.1:0", Form: FormMap, Locality: "near"}},
		{"bad form", Config{Endpoint: "tcp://127.0.0.1:0", Form: 7}},
		{"negative rank", Config{Endpoint: "tcp://127.0.0.1:0", DPRank: -1}},
		{"negative queue", Config{Endpoint: "tcp://127.0.0.1:0", QueueEvents: -1}},
		{"negative replay bytes", Config{Endpoint: "tcp://127.0.0.1:0", ReplayBytes: -1}},
	} {
		if _, err := New(c.cfg); !errors.Is(err, ErrConfig) {
			t.Errorf("%s: %v, want ErrConfig", c.name, err)
		}
	}
	if _, err := New(Config{Endpoint: "nope://x"}); err == nil || errors.Is(err, ErrConfig) {
		t.Errorf("bad endpoint: %v, want the socket's error", err)
	}
}

// The 64-bit hash is the key's last 8 bytes, big-endian.
func TestHash64(t *testing.T) {
	k := layout.PageKey{0: 0xaa, 24: 0x01, 25: 0x02, 26: 0x03, 27: 0x04, 28: 0x05, 29: 0x06, 30: 0x07, 31: 0x08}
	if got := Hash64(k); got != 0x0102030405060708 {
		t.Fatalf("Hash64 = %#x", got)
	}
	if Hash64(k) != hash64(k) {
		t.Fatal("differs from the test's reduction")
	}
}

func tokensBytes(ts []uint32) []byte {
	b := make([]byte, 0, 4*len(ts))
	for _, t := range ts {
		b = binary.LittleEndian.AppendUint32(b, t)
	}
	return b
}

// With Connect the publisher dials a subscriber that listens (a router's
// one SUB socket for its whole fleet).
func TestConnectToSubscriber(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	sk := zmq4.NewSub(ctx)
	defer sk.Close()
	if err := sk.Listen("tcp://127.0.0.1:0"); err != nil {
		t.Fatal(err)
	}
	if err := sk.SetOption(zmq4.OptionSubscribe, "kv@"); err != nil {
		t.Fatal(err)
	}
	p := newPub(t, Config{Endpoint: "tcp://" + sk.Addr().String(), Connect: true, Topic: Topic("pod", "m")})
	if p.Addr() != nil {
		t.Fatalf("Addr %v with Connect, want nil", p.Addr())
	}
	for deadline := time.Now().Add(10 * time.Second); !slices.Contains(p.Subscriptions(), "kv@"); time.Sleep(5 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("the subscription never reached the publisher")
		}
	}
	pages := chain(t, "id", 16, tokensOf(4, 16))
	p.Stored("ns", pages...)
	m, err := sk.Recv()
	if err != nil {
		t.Fatal(err)
	}
	if string(m.Frames[0]) != "kv@pod@m" {
		t.Fatalf("topic %q", m.Frames[0])
	}
	b := decodeBatch(t, m.Frames[2])
	wantHash(t, "hash", stored(t, b.Events[0]).BlockHashes[0], hash64(pages[0].Key))
	if err := p.Close(); err != nil {
		t.Fatal(err)
	}
	for { // zmq4's SUB reader hands the connection's end to Recv and waits for it
		if _, err := sk.Recv(); err != nil {
			break
		}
	}
}
