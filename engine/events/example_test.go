package events_test

import (
	"context"
	"fmt"
	"log"
	"slices"
	"time"

	"github.com/go-zeromq/zmq4"
	"github.com/kvpersist/kvpersist/engine/events"
	"github.com/kvpersist/kvpersist/engine/layout"
	"github.com/vmihailenco/msgpack/v5"
)

// A router subscribes to a publisher's topic and decodes the batches with
// msgpack into its own types (docs/format/kv-events.md, "A subscriber in
// Go").
func Example_subscriber() {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	pub, err := events.New(events.Config{Endpoint: "tcp://127.0.0.1:0", Topic: events.Topic("pod-0", "llama-3.1-8b")})
	if err != nil {
		log.Fatal(err)
	}
	defer pub.Close()

	sub := zmq4.NewSub(ctx)
	defer sub.Close()
	if err := sub.Dial("tcp://" + pub.Addr().String()); err != nil {
		log.Fatal(err)
	}
	if err := sub.SetOption(zmq4.OptionSubscribe, "kv@"); err != nil {
		log.Fatal(err)
	}
	for !slices.Contains(pub.Subscriptions(), "kv@") { // the subscription reaches the publisher
		time.Sleep(time.Millisecond)
	}

	// The engine announces a save's pages: here 2 pages of 16 tokens.
	tokens := make([]uint32, 32)
	for i := range tokens {
		tokens[i] = uint32(1000 + i)
	}
	keys, _, _ := layout.PageChain("llama-3.1-8b@sha256:0c1d/bf16/tp0", 16, tokens)
	pages, _ := events.ChainPages("llama-3.1-8b@sha256:0c1d/bf16/tp0", 16, tokens, keys)
	pub.Stored("llama-3.1-8b", pages...)

	msg, err := sub.Recv() // [topic, seq, payload]
	if err != nil {
		log.Fatal(err)
	}
	var batch struct {
		_      struct{} `msgpack:",array"`
		TS     float64
		Events []msgpack.RawMessage
		Rank   int
	}
	if err := msgpack.Unmarshal(msg.Frames[2], &batch); err != nil {
		log.Fatal(err)
	}
	for _, ev := range batch.Events {
		var stored struct {
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
		if msgpack.Unmarshal(ev, &stored) == nil && stored.Tag == "BlockStored" {
			fmt.Println(string(msg.Frames[0]), stored.Tag, len(stored.Hashes), "blocks of", stored.BlockSize,
				"tokens, parent", stored.Parent, "medium", *stored.Medium,
				"first hash is the key's last 8 bytes:", stored.Hashes[0] == events.Hash64(keys[0]))
		}
	}
	// Output:
	// kv@pod-0@llama-3.1-8b BlockStored 2 blocks of 16 tokens, parent <nil> medium STORAGE first hash is the key's last 8 bytes: true
}
