package engine_test

import (
	"context"
	"fmt"
	"log"
	"net"
	"os"
	"time"

	"github.com/kvpersist/kvpersist/engine"
	"github.com/kvpersist/kvpersist/engine/events"

	"github.com/go-zeromq/zmq4"
	"github.com/vmihailenco/msgpack/v5"
)

// Example_kvEvents: an engine with Config.Events announces the pages it
// saves; a router subscribes with zmq4 and decodes the batches with
// msgpack into its own types (docs/format/kv-events.md). This is the
// README's KV events example.
func Example_kvEvents() {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	root, err := os.MkdirTemp("", "kvpersist-events-")
	if err != nil {
		log.Fatal(err)
	}
	defer os.RemoveAll(root)
	l, err := net.Listen("tcp", "127.0.0.1:0") // a free loopback port
	if err != nil {
		log.Fatal(err)
	}
	endpoint := "tcp://" + l.Addr().String()
	l.Close()
	e, err := engine.New(engine.Config{Root: root, Events: &events.Config{
		Endpoint: endpoint, Topic: events.Topic("pod-0", "llama-3.1-8b")}})
	if err != nil {
		log.Fatal(err)
	}
	defer e.Close(context.Background())

	// A save of 2 pages of 16 tokens, again every 50 ms until a message
	// arrives: a subscription takes a moment to reach the publisher, and
	// each save announces its whole chain.
	buf := make([]byte, 2*32*8*2)
	kv := engine.TensorSpec{DType: "bfloat16", View: engine.View{Base: buf, Shape: []int{1, 2, 32, 8}, Strides: []int{512, 256, 8, 1}}}
	tokens := make([]uint32, 32)
	saving := make(chan struct{})
	go func() {
		defer close(saving)
		for ; ctx.Err() == nil; time.Sleep(50 * time.Millisecond) {
			e.Do(ctx, &engine.SavePrefixRequest{Namespace: "llama-3.1-8b", Identity: "llama-3.1-8b/bf16",
				Tokens: tokens, PageTokens: 16, Tensors: []engine.TensorSpec{kv, kv}})
		}
	}()

	// README:begin (README.md, "KV events", shows the lines up to README:end)
	sub := zmq4.NewSub(ctx)
	if err := sub.Dial(endpoint); err != nil { // Config.Events.Endpoint
		log.Fatal(err)
	}
	_ = sub.SetOption(zmq4.OptionSubscribe, "kv@")
	msg, err := sub.Recv() // in a loop: [topic, 8-byte sequence, batch]
	if err != nil {
		log.Fatal(err)
	}
	var batch struct { // [ts, [events], dp_rank]; an event is [tag, hashes, ...]
		_      struct{} `msgpack:",array"`
		TS     float64
		Events [][]msgpack.RawMessage
		Rank   int
	}
	var tag string
	if msgpack.Unmarshal(msg.Frames[2], &batch) == nil {
		_ = msgpack.Unmarshal(batch.Events[0][0], &tag)
	}
	fmt.Println(string(msg.Frames[0]), tag, len(batch.Events[0]), "fields")
	// README:end
	sub.Close()
	cancel()
	<-saving
	// Output:
	// kv@pod-0@llama-3.1-8b BlockStored 8 fields
}
