package engine_test

import (
	"bytes"
	"context"
	"fmt"
	"log"
	"os"

	"github.com/kvpersist/kvpersist/engine"
)

// Example_prefixCache saves a conversation's KV cache as token pages,
// then serves a new prompt that starts with the same tokens: Lookup finds
// the longest stored prefix and LoadPrefix loads it into fresh
// capacity-padded buffers, so only the rest of the prompt needs a prefill.
// This is the README's prefix-cache example.
func Example_prefixCache() {
	ctx := context.Background()
	root, err := os.MkdirTemp("", "kvpersist-prefix-")
	if err != nil {
		log.Fatal(err)
	}
	defer os.RemoveAll(root)

	// README:begin (README.md, "Prefix cache", shows the lines up to README:end)
	e, err := engine.New(engine.Config{Root: root}) // the store's directory on the SSD
	if err != nil {
		log.Fatal(err)
	}
	defer func() {
		if err := e.Close(ctx); err != nil {
			log.Print(err)
		}
	}()

	// One layer's K and V, [1, kv_heads 2, tokens, head_dim 16] bf16 views
	// of buffers with room for 1,024 tokens (strides in elements).
	const heads, capTokens, headDim = 2, 1024, 16
	view := func(buf []byte, tokens int) engine.View {
		return engine.View{Base: buf, Shape: []int{1, heads, tokens, headDim},
			Strides: []int{heads * capTokens * headDim, capTokens * headDim, headDim, 1}}
	}
	k, v := make([]byte, heads*capTokens*headDim*2), make([]byte, heads*capTokens*headDim*2)
	for i := range k {
		k[i], v[i] = byte(i), byte(i*7)
	}
	conv := make([]uint32, 600) // the conversation so far: 600 token ids
	for i := range conv {
		conv[i] = uint32(1000 + i)
	}

	// identity names everything that makes KV incompatible: a different
	// identity is a miss by construction.
	const ns, identity = "llama-3.1-8b", "llama-3.1-8b@sha256:0c1d/bf16/tp0"
	res := e.Do(ctx, &engine.SavePrefixRequest{
		Namespace: ns, Identity: identity, Tokens: conv, PageTokens: 256,
		Tensors: []engine.TensorSpec{{DType: "bfloat16", View: view(k, len(conv))},
			{DType: "bfloat16", View: view(v, len(conv))}},
	})
	if res.Err != nil {
		log.Fatal(res.Err)
	}
	fmt.Println("saved pages:", res.Prefix.PagesWritten, "bytes:", res.Prefix.BytesWritten) // file bytes: 2 full pages and a leaf of 88 tokens

	// A new request: the first 520 tokens of the conversation, then new ones.
	prompt := append(append([]uint32{}, conv[:520]...), 7, 8, 9)
	n, err := e.Lookup(ns, identity, 256, prompt) // in memory, no I/O
	if err != nil {
		log.Fatal(err)
	}
	k2, v2 := make([]byte, len(k)), make([]byte, len(v))
	res = e.Do(ctx, &engine.LoadPrefixRequest{
		Namespace: ns, Identity: identity, Tokens: prompt, PageTokens: 256,
		Dest: []engine.TensorSpec{{DType: "bfloat16", View: view(k2, len(prompt))},
			{DType: "bfloat16", View: view(v2, len(prompt))}},
	})
	if res.Err != nil {
		log.Fatal(res.Err)
	}
	// Tokens [0, res.Prefix.Tokens) of k2 and v2 now hold the stored KV,
	// verified against its hashes (NoVerify opts out); the caller
	// prefills the rest of the prompt.
	fmt.Println("lookup:", n, "tokens; loaded:", res.Prefix.Tokens, "tokens")
	// README:end

	same := true
	for h := 0; h < heads; h++ {
		off := h * capTokens * headDim * 2
		n := res.Prefix.Tokens * headDim * 2
		same = same && bytes.Equal(k2[off:off+n], k[off:off+n]) && bytes.Equal(v2[off:off+n], v[off:off+n])
	}
	fmt.Println("loaded tokens equal the saved ones:", same)
	// Output:
	// saved pages: 3 bytes: 128512
	// lookup: 512 tokens; loaded: 512 tokens
	// loaded tokens equal the saved ones: true
}
