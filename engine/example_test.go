package engine_test

import (
	"bytes"
	"context"
	"encoding/binary"
	"fmt"
	"log"
	"os"

	"github.com/kvpersist/kvpersist/engine"
)

// Example saves one layer's K and V, kept as mlx-lm keeps them (the first
// 300 tokens of buffers with room for 512), and restores them verified into
// fresh buffers, with the engine package alone. This is the README's
// embedding example.
func Example() {
	ctx := context.Background()
	root, err := os.MkdirTemp("", "kvpersist-example-")
	if err != nil {
		log.Fatal(err)
	}
	defer os.RemoveAll(root)

	// README:begin (README.md, "Embedding", shows the lines up to README:end)
	e, err := engine.New(engine.Config{Root: root}) // Workers, Mailbox, BlockBytes, NoSync, Logger ...
	if err != nil {
		log.Fatal(err)
	}
	defer func() {
		if err := e.Close(ctx); err != nil { // waits for every job's ack
			log.Print(err)
		}
	}()

	// K and V of one layer: [batch 1, kv_heads 2, tokens 300, head_dim 16]
	// bf16 views of buffers with capacity 512 tokens. Shape and strides
	// are in elements; the item size follows from the dtype.
	const heads, capTokens, tokens, headDim = 2, 512, 300, 16
	view := func(buf []byte) engine.View {
		return engine.View{Base: buf, Shape: []int{1, heads, tokens, headDim},
			Strides: []int{heads * capTokens * headDim, capTokens * headDim, headDim, 1}}
	}
	k := make([]byte, heads*capTokens*headDim*2)
	v := make([]byte, len(k))
	for i := 0; i < len(k); i += 2 {
		binary.LittleEndian.PutUint16(k[i:], uint16(i))
		binary.LittleEndian.PutUint16(v[i:], uint16(i+1))
	}

	ref := engine.Ref{Namespace: "conv-42", Name: "turn-7"}
	job, err := e.Submit(ctx, &engine.WriteRequest{
		Ref:    ref,
		Layout: engine.Blocks, // or engine.Single; there is no default
		Meta:   engine.Meta{"model": []byte(`"llama-3.1-8b"`)},
		Caches: []engine.EntrySpec{{
			Meta:    engine.Meta{"type": []byte(`"KVCache"`), "offset": []byte("300")},
			Tensors: []engine.TensorSpec{{DType: "bfloat16", View: view(k)}, {DType: "bfloat16", View: view(v)}},
		}},
	})
	if err != nil {
		log.Fatal(err) // not accepted: no ack will come, the buffers were not touched
	}
	res := <-job.Ack // from here on the engine never touches k or v
	if res.Err != nil {
		log.Fatal(res.Err) // the save failed; the previous snapshot of ref is intact
	}

	// Later: learn the shapes, check the total against what we can afford,
	// allocate one buffer per tensor slot of exactly its bytes, and restore
	// with verification.
	snap, err := e.Stat(ref) // errors.Is(err, engine.ErrNotFound) when there is none
	if err != nil {
		log.Fatal(err)
	}
	const budget = 1 << 30 // bytes this process may allocate for one restore
	total, err := snap.Header.TotalBytes()
	if err != nil || total > budget {
		log.Fatalf("%s: %d bytes (%v): over the %d-byte budget", ref, total, err, budget)
	}
	dest := make([][]byte, len(snap.Header.Slots()))
	for i, t := range snap.Header.Slots() {
		dest[i] = make([]byte, t.Bytes)
	}
	res = e.Do(ctx, &engine.ReadRequest{Ref: ref, Dest: dest, Expect: snap.Header})
	if res.Err != nil {
		log.Fatal(res.Err) // errors.Is(res.Err, engine.ErrCorrupt), engine.ErrMissingBlock, ...
	}
	// README:end

	// K's logical bytes: each head's first 300 tokens, without the padding.
	var want []byte
	for h := 0; h < heads; h++ {
		want = append(want, k[h*capTokens*headDim*2:][:tokens*headDim*2]...)
	}
	fmt.Println(snap.Header.Slots()[0].DType, snap.Header.Slots()[0].Shape, total, "bytes")
	fmt.Println("K restored bit-exact:", bytes.Equal(dest[0], want))
	// Output:
	// bfloat16 [1 2 300 16] 38400 bytes
	// K restored bit-exact: true
}
