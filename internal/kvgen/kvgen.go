// Package kvgen generates synthetic KV caches with the geometries of real
// models (Llama-3.1-8B, Qwen2.5-7B, Gemma-2-9B, and a tiny one), filled with
// deterministic content whose every byte can be recomputed independently
// (Value, TokenID, Cache.Expected). It is product code: the CLI's demo and
// synth commands and the benchmarks use it, as do the tests.
package kvgen

import (
	"encoding/binary"
	"fmt"
	"runtime"
	"strings"
	"sync"

	"github.com/kvpersist/kvpersist/engine/gather"
)

// Model is a transformer's KV geometry.
type Model struct {
	Name     string
	Layers   int
	KVHeads  int
	HeadDim  int
	DType    string
	ItemSize int // bytes per element of DType
}

// Geometries of real models (K and V per layer have shape [1, KVHeads, tokens, HeadDim]).
var (
	Llama31_8B = Model{"llama-3.1-8b", 32, 8, 128, "bfloat16", 2}
	Qwen25_7B  = Model{"qwen2.5-7b", 28, 4, 128, "bfloat16", 2}
	Gemma2_9B  = Model{"gemma-2-9b", 42, 8, 256, "bfloat16", 2}
	Tiny       = Model{"tiny", 2, 2, 16, "bfloat16", 2}
)

// Models returns all known models, Tiny last.
func Models() []Model {
	return []Model{Llama31_8B, Qwen25_7B, Gemma2_9B, Tiny}
}

// ModelByName returns the model with the given name; the error lists the
// valid names.
func ModelByName(name string) (Model, error) {
	ms := Models()
	names := make([]string, len(ms))
	for i, m := range ms {
		if m.Name == name {
			return m, nil
		}
		names[i] = m.Name
	}
	return Model{}, fmt.Errorf("kvgen: unknown model %q (valid: %s)", name, strings.Join(names, ", "))
}

// TensorBytes is the size in bytes of one K (or V) tensor of shape
// [1, KVHeads, tokens, HeadDim].
func (m Model) TensorBytes(tokens int) int {
	return m.KVHeads * tokens * m.HeadDim * m.ItemSize
}

// CacheBytes is the logical size in bytes of a cache of tokens tokens: K and V
// of every layer plus the int32 token ids attachment. Padding is not counted.
func (m Model) CacheBytes(tokens int) int {
	return 2*m.Layers*m.TensorBytes(tokens) + tokens*IDSize
}

// Step is the number of tokens by which mlx-lm grows its KV buffers.
const Step = 256

// IDSize is the size in bytes of one token id (int32).
const IDSize = 4

// Padding is the bf16 bit pattern stored in every element of the padding
// tokens (Tokens..Capacity-1) of a padded cache.
const Padding uint16 = 0xDEAD

// Capacity is the token capacity of a padded buffer holding tokens: the
// next multiple of Step strictly above tokens (mlx-lm grows its buffers in
// steps of 256 tokens; after the next decode step a buffer of exactly
// tokens would have grown, so a live cache almost always has spare room,
// e.g. 8448 at 8192 tokens).
func Capacity(tokens int) int {
	return (tokens/Step + 1) * Step
}

// Cache is a KV cache of one conversation: per layer a K and a V tensor of
// shape [1, KVHeads, Tokens, HeadDim], plus one attachment, the int32 token
// ids of shape [Tokens].
type Cache struct {
	Model  Model
	Tokens int
	// Padded: each tensor is a view of the first Tokens tokens of a buffer of
	// Capacity(Tokens) tokens, strides [KVHeads*cap*HeadDim, cap*HeadDim,
	// HeadDim, 1] as mlx-lm keeps them; the padding tokens hold Padding.
	// Otherwise each tensor is contiguous (row-major).
	Padded bool
	K, V   [][]byte // per layer backing buffers
	IDs    []byte   // int32 LE token ids, contiguous
}

// NewCache allocates and fills a cache. alloc, when non-nil, provides the
// backing memory (it must return at least n bytes; their content does not
// matter, every byte is written); nil means make([]byte, n).
//
// It panics if tokens < 0 or if the model's ItemSize is not 2.
func NewCache(m Model, tokens int, padded bool, alloc func(n int) []byte) *Cache {
	if tokens < 0 {
		panic(fmt.Sprintf("kvgen: NewCache: negative tokens %d", tokens))
	}
	if m.ItemSize != 2 {
		panic(fmt.Sprintf("kvgen: NewCache: model %s: ItemSize %d, only 2-byte (bf16) elements are supported", m.Name, m.ItemSize))
	}
	if m.Layers <= 0 || m.KVHeads <= 0 || m.HeadDim <= 0 {
		panic(fmt.Sprintf("kvgen: NewCache: invalid model geometry %+v", m))
	}
	if alloc == nil {
		alloc = func(n int) []byte { return make([]byte, n) }
	}
	get := func(n int) []byte {
		b := alloc(n)
		if len(b) < n {
			panic(fmt.Sprintf("kvgen: NewCache: alloc(%d) returned %d bytes", n, len(b)))
		}
		return b[:n:n]
	}
	c := &Cache{
		Model:  m,
		Tokens: tokens,
		Padded: padded,
		K:      make([][]byte, m.Layers),
		V:      make([][]byte, m.Layers),
	}
	capTok := c.capTokens()
	n := m.TensorBytes(capTok)
	for l := 0; l < m.Layers; l++ { // alloc is called from this goroutine only
		c.K[l] = get(n)
		c.V[l] = get(n)
	}
	c.IDs = get(tokens * IDSize)
	fillIDs(c.IDs)
	// Fill the tensors (slot = 2*layer + kv) on up to GOMAXPROCS goroutines.
	slots := 2 * m.Layers
	workers := min(runtime.GOMAXPROCS(0), slots, 1+slots*n/(8<<20)) // one goroutine per 8 MiB at most
	fill := func(w int) {
		for s := w; s < slots; s += workers {
			buf := c.K[s/2]
			if s%2 == 1 {
				buf = c.V[s/2]
			}
			fillTensor(buf, m, s/2, s%2, tokens, capTok)
		}
	}
	var wg sync.WaitGroup
	for w := 1; w < workers; w++ {
		wg.Go(func() { fill(w) })
	}
	fill(0)
	wg.Wait()
	return c
}

// capTokens is the token capacity of the backing buffers.
func (c *Cache) capTokens() int {
	if c.Padded {
		return Capacity(c.Tokens)
	}
	return c.Tokens
}

// Slots is the number of slots: 2*Layers tensors plus the token ids.
func (c *Cache) Slots() int { return 2*c.Model.Layers + 1 }

// Views returns one view per slot, in slot order: layer 0 K, layer 0 V,
// layer 1 K, ..., then the token ids. The returned slices are fresh.
func (c *Cache) Views() []gather.View {
	m := c.Model
	capTok := c.capTokens()
	var strides []int
	if c.Padded {
		strides = []int{m.KVHeads * capTok * m.HeadDim, capTok * m.HeadDim, m.HeadDim, 1}
	} else {
		strides = gather.RowMajor(c.tensorShape())
	}
	vs := make([]gather.View, 0, c.Slots())
	for l := 0; l < m.Layers; l++ {
		for _, b := range [2][]byte{c.K[l], c.V[l]} {
			vs = append(vs, gather.View{
				Base:     b,
				Shape:    c.tensorShape(),
				Strides:  append([]int(nil), strides...),
				ItemSize: m.ItemSize,
			})
		}
	}
	vs = append(vs, gather.View{
		Base:     c.IDs,
		Shape:    []int{c.Tokens},
		Strides:  []int{1},
		ItemSize: IDSize,
	})
	return vs
}

func (c *Cache) tensorShape() []int {
	return []int{1, c.Model.KVHeads, c.Tokens, c.Model.HeadDim}
}

// ViewsAt returns the views of the first tokens tokens (0 <= tokens <=
// c.Tokens): the cache as it was earlier in the conversation. The content of
// those tokens is the same as a cache built with that many tokens.
func (c *Cache) ViewsAt(tokens int) []gather.View {
	if tokens < 0 || tokens > c.Tokens {
		panic(fmt.Sprintf("kvgen: ViewsAt(%d) outside [0, %d]", tokens, c.Tokens))
	}
	vs := c.Views()
	for i := range vs {
		vs[i].Shape[len(vs[i].Shape)-2+boolInt(i == len(vs)-1)] = tokens
	}
	vs[len(vs)-1].Base = c.IDs[: tokens*IDSize : tokens*IDSize]
	return vs
}

func boolInt(b bool) int {
	if b {
		return 1
	}
	return 0
}

// DTypes returns the dtype of each slot: the model's dtype for every tensor,
// then "int32" for the token ids.
func (c *Cache) DTypes() []string {
	ds := make([]string, c.Slots())
	for i := range ds {
		ds[i] = c.Model.DType
	}
	ds[len(ds)-1] = "int32"
	return ds
}

// Shapes returns the logical shape of each slot.
func (c *Cache) Shapes() [][]int {
	ss := make([][]int, c.Slots())
	for i := range ss[:len(ss)-1] {
		ss[i] = c.tensorShape()
	}
	ss[len(ss)-1] = []int{c.Tokens}
	return ss
}

// Expected returns the slot's logical bytes (row-major, little endian),
// computed element by element from Value and TokenID, independently of the
// backing buffers and of the views' strides. It panics if slot is out of
// range.
func (c *Cache) Expected(slot int) []byte {
	m := c.Model
	if slot < 0 || slot >= c.Slots() {
		panic(fmt.Sprintf("kvgen: Expected: slot %d out of range [0, %d)", slot, c.Slots()))
	}
	if slot == 2*m.Layers {
		out := make([]byte, 0, c.Tokens*IDSize)
		for i := 0; i < c.Tokens; i++ {
			out = binary.LittleEndian.AppendUint32(out, uint32(TokenID(i)))
		}
		return out // small: no need to bypass the race detector
	}
	out := make([]byte, m.TensorBytes(c.Tokens))
	layer, kv := slot/2, slot%2
	headBytes := c.Tokens * m.HeadDim * 2
	if len(out) < 1<<20 || runtime.GOMAXPROCS(0) == 1 {
		for h := 0; h < m.KVHeads; h++ {
			expectedHead(out[h*headBytes:(h+1)*headBytes], layer, kv, h, m.HeadDim)
		}
		return out
	}
	var wg sync.WaitGroup // heads in parallel: a 1 GiB cache is checked slot by slot
	for h := 0; h < m.KVHeads; h++ {
		wg.Go(func() { expectedHead(out[h*headBytes:(h+1)*headBytes], layer, kv, h, m.HeadDim) })
	}
	wg.Wait()
	return out
}

// expectedHead writes the row-major [tokens, headDim] content of one head,
// one Value call per element; len(out) is tokens*headDim*2.
//
// The race detector is off here and in the fill functions below: they only
// write memory that no other goroutine can reach yet (Expected and NewCache
// publish it when they return), and instrumenting every 2- or 8-byte store
// makes building or checking a 1 GiB cache under -race take tens of seconds
// instead of about one.
//
//go:norace
func expectedHead(out []byte, layer, kv, head, headDim int) {
	i := 0
	for t := 0; i < len(out); t++ {
		for d := 0; d < headDim; d++ {
			binary.LittleEndian.PutUint16(out[i:i+2], Value(layer, kv, head, t, d))
			i += 2
		}
	}
}

// Content.
//
// Every (layer, kv, head, token) row has a 64-bit hash r = splitmix64(key),
// where key packs token (bits 0-31), head (32-46), kv (47) and layer (48-63).
// Element d of the row is 16-bit lane d%4 of r ^ (d/4)*golden. Because the
// key packing is injective (for layer < 1<<16, head < 1<<15,
// 0 <= token < 1<<32) and splitmix64 is a bijection, and elements 0-3 of a
// row are r itself, rows with distinct (layer, kv, head, token) always have
// distinct content (for HeadDim >= 4). Value does not depend on the number
// of tokens or the capacity, so the first T tokens never change when T grows.

const golden = 0x9E3779B97F4A7C15

func splitmix64(x uint64) uint64 {
	x += golden
	x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9
	x = (x ^ (x >> 27)) * 0x94D049BB133111EB
	return x ^ (x >> 31)
}

func rowHash(layer, kv, head, token int) uint64 {
	key := uint64(token) | uint64(head)<<32 | uint64(kv)<<47 | uint64(layer)<<48
	return splitmix64(key)
}

// Value is the content of element d of the row (layer, kv, head, token): a
// bf16 bit pattern (any 16-bit pattern, NaNs included). kv is 0 for K and 1
// for V. It depends only on its arguments; rows are guaranteed distinct for
// 0 <= layer < 1<<16, 0 <= head < 1<<15, 0 <= token < 1<<32.
func Value(layer, kv, head, token, d int) uint16 {
	r := rowHash(layer, kv, head, token) ^ uint64(uint(d)>>2)*golden
	return uint16(r >> (uint(d) & 3 << 4))
}

// TokenID is the id of the i-th token, in [0, 128256) (Llama 3's vocabulary).
func TokenID(i int) int32 {
	return int32(splitmix64(uint64(i)^0x5EED_70C3_1D5E_ED00) % 128256)
}

// fillTensor writes a [1, KVHeads, capTok, HeadDim] buffer: tokens
// 0..tokens-1 of each head get Value content (Rows), tokens..capTok-1 get
// Padding.
func fillTensor(buf []byte, m Model, layer, kv, tokens, capTok int) {
	rowBytes := m.HeadDim * m.ItemSize
	for h := 0; h < m.KVHeads; h++ {
		base := h * capTok * rowBytes
		m.Rows(buf[base:base+tokens*rowBytes], layer, kv, h, 0)
		fillPadding(buf[base+tokens*rowBytes : base+capTok*rowBytes])
	}
}

//go:norace
func fillPadding(b []byte) {
	const word = uint64(Padding) * 0x0001_0001_0001_0001
	i := 0
	for ; i+8 <= len(b); i += 8 {
		binary.LittleEndian.PutUint64(b[i:i+8], word)
	}
	for ; i+2 <= len(b); i += 2 {
		binary.LittleEndian.PutUint16(b[i:], Padding)
	}
}

//go:norace
func fillIDs(b []byte) {
	for i := 0; i+IDSize <= len(b); i += IDSize {
		binary.LittleEndian.PutUint32(b[i:i+IDSize], uint32(TokenID(i/IDSize)))
	}
}

// Rows writes into out the content of n consecutive rows of one head,
// (layer, kv, head, token) for token = first, first+1, ..., first+n-1,
// row-major [n, HeadDim] bf16 little endian, where n = len(out) /
// (HeadDim*ItemSize): the same bytes as Value, computed a 64-bit word at a
// time. A conversation whose token position p should hold the content of
// another token index (a scenario mapping positions to distinct content)
// passes that index as first. It panics if len(out) is not a whole number
// of rows, if first < 0, or if the model's ItemSize is not 2.
//
//go:norace
func (m Model) Rows(out []byte, layer, kv, head, first int) {
	rowBytes := m.HeadDim * m.ItemSize
	if m.ItemSize != 2 || len(out)%rowBytes != 0 || first < 0 {
		panic(fmt.Sprintf("kvgen: Rows: %d bytes, first token %d, model %s (rows of %d bytes, 2-byte elements)", len(out), first, m.Name, rowBytes))
	}
	full := m.HeadDim / 4
	for t := 0; t*rowBytes < len(out); t++ {
		row := out[t*rowBytes : (t+1)*rowBytes]
		r := rowHash(layer, kv, head, first+t)
		for w := 0; w < full; w++ {
			binary.LittleEndian.PutUint64(row[w*8:w*8+8], r^uint64(w)*golden)
		}
		for d := full * 4; d < m.HeadDim; d++ {
			x := r ^ uint64(d/4)*golden
			binary.LittleEndian.PutUint16(row[d*2:], uint16(x>>(16*uint(d%4))))
		}
	}
}

// FillPadding fills b with the Padding bit pattern (every whole 2-byte
// element; an odd last byte is left as is).
func FillPadding(b []byte) { fillPadding(b) }
