package engine_test

import (
	"bytes"
	"context"
	"encoding/binary"
	"fmt"
	"log"
	"os"

	"github.com/kvpersist/kvpersist/engine"
	"github.com/kvpersist/kvpersist/engine/gather"
	"github.com/kvpersist/kvpersist/engine/jobs"
	"github.com/kvpersist/kvpersist/engine/layout"
)

// Example saves one layer's K and V, kept as mlx-lm keeps them (the first
// 300 tokens of buffers with room for 512), and restores them verified into
// fresh buffers. This is the README's embedding example.
func Example() {
	ctx := context.Background()
	root, err := os.MkdirTemp("", "kvpersist-example-")
	if err != nil {
		log.Fatal(err)
	}
	defer os.RemoveAll(root)

	e, err := engine.New(engine.Config{Root: root})
	if err != nil {
		log.Fatal(err)
	}
	defer e.Close(ctx)

	// K and V of one layer: [batch 1, kv_heads 2, tokens 300, head_dim 16]
	// bf16 views of buffers with capacity 512 tokens. Strides are in
	// elements; ItemSize is in bytes.
	const heads, capTokens, tokens, headDim = 2, 512, 300, 16
	view := func(buf []byte) gather.View {
		return gather.View{Base: buf, Shape: []int{1, heads, tokens, headDim},
			Strides: []int{heads * capTokens * headDim, capTokens * headDim, headDim, 1}, ItemSize: 2}
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
		Layout: layout.Blocks, // or layout.Single
		Meta:   layout.Meta{"model": []byte(`"llama-3.1-8b"`)},
		Caches: []jobs.EntrySpec{{
			Meta:    layout.Meta{"type": []byte(`"KVCache"`), "offset": []byte("300")},
			Tensors: []jobs.TensorSpec{{DType: "bfloat16", View: view(k)}, {DType: "bfloat16", View: view(v)}},
		}},
	})
	if err != nil {
		log.Fatal(err) // not accepted: no ack will come, the buffers were not touched
	}
	res := <-job.Ack // from here on the engine never touches k or v
	if res.Err != nil {
		log.Fatal(res.Err)
	}

	// Later: learn the shapes, allocate one buffer per tensor slot of exactly
	// its bytes, and restore with verification.
	snap, err := e.Stat(ref)
	if err != nil {
		log.Fatal(err)
	}
	dest := make([][]byte, len(snap.Header.Slots()))
	for i, t := range snap.Header.Slots() {
		dest[i] = make([]byte, t.Bytes)
	}
	res = e.Do(ctx, &engine.ReadRequest{Ref: ref, Dest: dest, Verify: true, Expect: snap.Header})
	if res.Err != nil {
		log.Fatal(res.Err)
	}

	want, _, _ := view(k).Gather(make([]byte, view(k).Bytes()))
	fmt.Println(snap.Header.Slots()[0].DType, snap.Header.Slots()[0].Shape, len(dest[0]), "bytes")
	fmt.Println("K restored bit-exact:", bytes.Equal(dest[0], want))
	// Output:
	// bfloat16 [1 2 300 16] 19200 bytes
	// K restored bit-exact: true
}
