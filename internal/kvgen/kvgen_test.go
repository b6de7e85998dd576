package kvgen

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"slices"
	"strings"
	"testing"

	"github.com/kvpersist/kvpersist/engine/gather"
)

// walk returns the logical bytes of v, visiting elements in row-major order
// and locating each one with plain index arithmetic from Offset, Shape and
// Strides.
func walk(t testing.TB, v gather.View) []byte {
	t.Helper()
	if len(v.Shape) != len(v.Strides) {
		t.Fatalf("shape %v and strides %v differ in rank", v.Shape, v.Strides)
	}
	n := 1
	for _, s := range v.Shape {
		n *= s
	}
	out := make([]byte, 0, n*v.ItemSize)
	if n == 0 {
		return out
	}
	idx := make([]int, len(v.Shape))
	for {
		off := 0
		for i := range idx {
			off += idx[i] * v.Strides[i]
		}
		b := v.Offset + off*v.ItemSize
		if b < 0 || b+v.ItemSize > len(v.Base) {
			t.Fatalf("element %v at byte %d outside base of %d bytes", idx, b, len(v.Base))
		}
		out = append(out, v.Base[b:b+v.ItemSize]...)
		// Increment the multi-index, last axis fastest.
		i := len(idx) - 1
		for ; i >= 0; i-- {
			idx[i]++
			if idx[i] < v.Shape[i] {
				break
			}
			idx[i] = 0
		}
		if i < 0 {
			return out
		}
	}
}

func TestExpectedMatchesViews(t *testing.T) {
	cases := []struct {
		m      Model
		tokens []int
	}{
		{Tiny, []int{0, 1, 3, 40, 255, 256, 257, 300}},
		{Llama31_8B, []int{1, 40}}, // 40 < 256: padded buffers hold 216 padding tokens
		{Qwen25_7B, []int{5}},
		{Gemma2_9B, []int{5}},
	}
	for _, tc := range cases {
		for _, T := range tc.tokens {
			for _, padded := range []bool{false, true} {
				t.Run(fmt.Sprintf("%s/T=%d/padded=%v", tc.m.Name, T, padded), func(t *testing.T) {
					c := NewCache(tc.m, T, padded, nil)
					vs := c.Views()
					if len(vs) != 2*tc.m.Layers+1 || c.Slots() != len(vs) {
						t.Fatalf("got %d views, Slots %d, want %d", len(vs), c.Slots(), 2*tc.m.Layers+1)
					}
					shapes, dtypes := c.Shapes(), c.DTypes()
					for slot, v := range vs {
						if !slices.Equal(v.Shape, shapes[slot]) {
							t.Fatalf("slot %d: view shape %v, Shapes() %v", slot, v.Shape, shapes[slot])
						}
						want := c.Expected(slot)
						got := walk(t, v)
						if !bytes.Equal(got, want) {
							t.Fatalf("slot %d: view content differs from Expected (first diff at byte %d)", slot, firstDiff(got, want))
						}
						wantSize := tc.m.TensorBytes(T)
						wantItem, wantDType := tc.m.ItemSize, tc.m.DType
						if slot == len(vs)-1 {
							wantSize, wantItem, wantDType = 4*T, 4, "int32"
						}
						if len(want) != wantSize || v.ItemSize != wantItem || dtypes[slot] != wantDType {
							t.Fatalf("slot %d: %d bytes, item %d, dtype %s; want %d, %d, %s",
								slot, len(want), v.ItemSize, dtypes[slot], wantSize, wantItem, wantDType)
						}
					}
					// Strides as documented.
					k := vs[0]
					capTok := T
					if padded {
						capTok = Capacity(T)
					}
					m := tc.m
					wantStrides := []int{m.KVHeads * capTok * m.HeadDim, capTok * m.HeadDim, m.HeadDim, 1}
					if !padded {
						wantStrides = gather.RowMajor(k.Shape)
					}
					if !slices.Equal(k.Strides, wantStrides) || k.Offset != 0 {
						t.Fatalf("strides %v offset %d, want %v offset 0", k.Strides, k.Offset, wantStrides)
					}
				})
			}
		}
	}
}

// The views are valid for the real gather package, which reproduces Expected.
func TestGatherAgrees(t *testing.T) {
	for _, m := range []Model{Tiny, Qwen25_7B} {
		for _, padded := range []bool{false, true} {
			c := NewCache(m, 45, padded, nil)
			for slot, v := range c.Views() {
				if err := v.Validate(); err != nil {
					t.Fatalf("%s padded=%v slot %d: %v", m.Name, padded, slot, err)
				}
				got, copied, err := v.Gather(make([]byte, v.Bytes()))
				if err != nil {
					t.Fatalf("%s padded=%v slot %d: %v", m.Name, padded, slot, err)
				}
				if !bytes.Equal(got, c.Expected(slot)) {
					t.Fatalf("%s padded=%v slot %d: gather output differs from Expected", m.Name, padded, slot)
				}
				if wantCopy := padded && slot < c.Slots()-1; copied != wantCopy {
					t.Errorf("%s padded=%v slot %d: copied=%v", m.Name, padded, slot, copied)
				}
			}
		}
	}
}

func firstDiff(a, b []byte) int {
	for i := range min(len(a), len(b)) {
		if a[i] != b[i] {
			return i
		}
	}
	return min(len(a), len(b))
}

// prefix returns the first n tokens of a view's logical content, by walking a
// view restricted to n tokens.
func prefix(t *testing.T, v gather.View, n int) []byte {
	t.Helper()
	v.Shape = slices.Clone(v.Shape)
	if len(v.Shape) == 4 {
		v.Shape[2] = n
	} else {
		v.Shape[0] = n
	}
	return walk(t, v)
}

func TestPrefixStable(t *testing.T) {
	for _, m := range []Model{Tiny, Llama31_8B} {
		for _, p := range [][2]bool{{true, true}, {false, false}, {true, false}, {false, true}} {
			t.Run(fmt.Sprintf("%s/padded=%v,%v", m.Name, p[0], p[1]), func(t *testing.T) {
				small := NewCache(m, 40, p[0], nil)
				big := NewCache(m, 300, p[1], nil)
				sv, bv := small.Views(), big.Views()
				for slot := range sv {
					if m.Layers > 2 && slot > 1 && slot < len(sv)-2 {
						continue // first and last layer and the ids are enough for big models
					}
					a := walk(t, sv[slot])
					b := prefix(t, bv[slot], 40)
					if !bytes.Equal(a, b) {
						t.Fatalf("slot %d: first 40 tokens differ between T=40 and T=300", slot)
					}
				}
			})
		}
	}
}

func TestPadding(t *testing.T) {
	for _, m := range []Model{Tiny, Llama31_8B} {
		for _, tc := range []struct{ tokens, capTok int }{{40, 256}, {300, 512}, {256, 512}, {0, 256}} {
			t.Run(fmt.Sprintf("%s/T=%d", m.Name, tc.tokens), func(t *testing.T) {
				if got := Capacity(tc.tokens); got != tc.capTok {
					t.Fatalf("Capacity(%d) = %d, want %d", tc.tokens, got, tc.capTok)
				}
				c := NewCache(m, tc.tokens, true, nil)
				rowBytes := m.HeadDim * m.ItemSize
				padding := bytes.Repeat([]byte{0xAD, 0xDE}, tc.capTok*m.HeadDim)
				for l := range m.Layers {
					for kv, buf := range [][]byte{c.K[l], c.V[l]} {
						if len(buf) != m.TensorBytes(tc.capTok) {
							t.Fatalf("layer %d kv %d: buffer %d bytes, want %d", l, kv, len(buf), m.TensorBytes(tc.capTok))
						}
						for h := range m.KVHeads {
							pad := buf[(h*tc.capTok+tc.tokens)*rowBytes : (h+1)*tc.capTok*rowBytes]
							if !bytes.Equal(pad, padding[:len(pad)]) {
								i := firstDiff(pad, padding) &^ 1
								t.Fatalf("layer %d kv %d head %d: padding element %d = %#x", l, kv, h, i/2, binary.LittleEndian.Uint16(pad[i:]))
							}
							// The rows just before the padding are real data.
							if tc.tokens > 0 && bytes.Equal(buf[(h*tc.capTok+tc.tokens-1)*rowBytes:][:rowBytes], padding[:rowBytes]) {
								t.Fatalf("layer %d kv %d head %d: last real token is padding", l, kv, h)
							}
						}
					}
				}
				if len(c.IDs) != 4*tc.tokens {
					t.Fatalf("ids %d bytes, want %d", len(c.IDs), 4*tc.tokens)
				}
				cc := NewCache(m, tc.tokens, false, nil)
				if len(cc.K[0]) != m.TensorBytes(tc.tokens) || len(cc.V[m.Layers-1]) != m.TensorBytes(tc.tokens) {
					t.Fatalf("contiguous buffer %d bytes, want %d", len(cc.K[0]), m.TensorBytes(tc.tokens))
				}
			})
		}
	}
}

func TestCapacity(t *testing.T) {
	for _, tc := range [][2]int{{0, 256}, {1, 256}, {255, 256}, {256, 512}, {257, 512}, {512, 768}, {513, 768}, {8192, 8448}} {
		if got := Capacity(tc[0]); got != tc[1] {
			t.Errorf("Capacity(%d) = %d, want %d", tc[0], got, tc[1])
		}
	}
}

func TestSizes(t *testing.T) {
	const mib = 1 << 20
	if 8*8192*128*2 != 16*mib {
		t.Fatal("arithmetic")
	}
	if got := Llama31_8B.TensorBytes(8192); got != 16*mib {
		t.Errorf("Llama TensorBytes(8192) = %d, want %d", got, 16*mib)
	}
	if got, want := Llama31_8B.CacheBytes(8192), 64*16*mib+32768; got != want {
		t.Errorf("Llama CacheBytes(8192) = %d, want %d", got, want)
	}
	if got, want := Tiny.TensorBytes(10), 2*10*16*2; got != want {
		t.Errorf("Tiny TensorBytes(10) = %d, want %d", got, want)
	}
	if got, want := Gemma2_9B.CacheBytes(100), 2*42*8*100*256*2+400; got != want {
		t.Errorf("Gemma CacheBytes(100) = %d, want %d", got, want)
	}
	// CacheBytes is the sum of all Expected slots.
	c := NewCache(Tiny, 77, true, nil)
	total := 0
	for slot := range c.Slots() {
		total += len(c.Expected(slot))
	}
	if total != Tiny.CacheBytes(77) {
		t.Errorf("sum of Expected = %d, CacheBytes = %d", total, Tiny.CacheBytes(77))
	}
}

func TestModelByName(t *testing.T) {
	for _, m := range Models() {
		got, err := ModelByName(m.Name)
		if err != nil || got != m {
			t.Errorf("ModelByName(%q) = %+v, %v", m.Name, got, err)
		}
	}
	if len(Models()) != 4 {
		t.Errorf("Models() has %d models, want 4", len(Models()))
	}
	_, err := ModelByName("gpt-5")
	if err == nil {
		t.Fatal("ModelByName(unknown): no error")
	}
	for _, m := range Models() {
		if !strings.Contains(err.Error(), m.Name) {
			t.Errorf("error %q does not list %q", err, m.Name)
		}
	}
}

// Distinct (layer, kv, head, token) rows never have equal content, and no
// real row looks like a padding row.
func TestDistinctRows(t *testing.T) {
	for _, m := range []Model{Tiny, Llama31_8B} {
		c := NewCache(m, 300, true, nil)
		rowBytes := m.HeadDim * m.ItemSize
		padRow := bytes.Repeat([]byte{0xAD, 0xDE}, m.HeadDim)
		seen := make(map[string]string)
		for slot := range 2 * m.Layers {
			e := c.Expected(slot)
			for r := 0; r < len(e); r += rowBytes {
				row := string(e[r : r+rowBytes])
				name := fmt.Sprintf("slot %d row %d", slot, r/rowBytes)
				if prev, ok := seen[row]; ok {
					t.Fatalf("%s: %s and %s have the same content", m.Name, prev, name)
				}
				if row == string(padRow) {
					t.Fatalf("%s: %s equals a padding row", m.Name, name)
				}
				seen[row] = name
			}
		}
	}
}

func TestValueDeterministic(t *testing.T) {
	// Pinned values: content must not change between versions, or stored
	// files and cross-run comparisons would break. Row (0,0,0,0) hashes key 0,
	// and splitmix64's first output from seed 0 is 0xe220a8397b1dcdaf.
	for _, tc := range []struct {
		l, kv, h, tok, d int
		want             uint16
	}{
		{0, 0, 0, 0, 0, 0xcdaf}, {0, 0, 0, 0, 1, 0x7b1d}, {0, 0, 0, 0, 2, 0xa839}, {0, 0, 0, 0, 3, 0xe220},
		{3, 1, 2, 1000, 77, 0x38a4}, {31, 0, 7, 8191, 127, 0x11bc},
	} {
		if got := Value(tc.l, tc.kv, tc.h, tc.tok, tc.d); got != tc.want {
			t.Errorf("Value(%d,%d,%d,%d,%d) = %#04x, want %#04x", tc.l, tc.kv, tc.h, tc.tok, tc.d, got, tc.want)
		}
	}
	if TokenID(0) != 57211 || TokenID(12345) != 2429 {
		t.Errorf("TokenID(0), TokenID(12345) = %d, %d; want 57211, 2429", TokenID(0), TokenID(12345))
	}
	if Value(0, 0, 0, 0, 0) == Value(0, 1, 0, 0, 0) {
		t.Error("K and V rows start with the same element")
	}
	if TokenID(5) != TokenID(5) || TokenID(5) < 0 || TokenID(5) >= 128256 {
		t.Error("TokenID out of range or not deterministic")
	}
	distinct := map[int32]bool{}
	for i := range 1000 {
		distinct[TokenID(i)] = true
	}
	if len(distinct) < 990 {
		t.Errorf("TokenID(0..999) has only %d distinct values", len(distinct))
	}
}

func TestAlloc(t *testing.T) {
	var got [][]byte
	var asked []int
	alloc := func(n int) []byte {
		asked = append(asked, n)
		b := bytes.Repeat([]byte{0xFF}, n+13) // dirty and oversized
		got = append(got, b)
		return b
	}
	for _, padded := range []bool{false, true} {
		got, asked = nil, nil
		c := NewCache(Tiny, 40, padded, alloc)
		if len(got) != 2*Tiny.Layers+1 {
			t.Fatalf("alloc called %d times, want %d", len(got), 2*Tiny.Layers+1)
		}
		bufs := append(slices.Clone(c.K), c.V...)
		bufs = append(bufs, c.IDs)
		for _, b := range bufs {
			if !slices.ContainsFunc(got, func(g []byte) bool { return &g[0] == &b[0] }) {
				t.Fatal("cache buffer not from alloc")
			}
		}
		for i, n := range asked {
			if len(got[i][:n]) != n {
				t.Fatal("bad alloc size")
			}
		}
		vs := c.Views()
		for slot, v := range vs {
			if len(v.Base) != cap(v.Base) {
				t.Errorf("slot %d: base not trimmed to its size", slot)
			}
			if !bytes.Equal(walk(t, v), c.Expected(slot)) {
				t.Fatalf("padded=%v slot %d: content wrong with dirty alloc", padded, slot)
			}
		}
	}
}

func TestAllocTooSmallPanics(t *testing.T) {
	defer func() {
		if recover() == nil {
			t.Fatal("no panic")
		}
	}()
	NewCache(Tiny, 10, false, func(n int) []byte { return make([]byte, n-1) })
}

func TestViewsFresh(t *testing.T) {
	c := NewCache(Tiny, 10, true, nil)
	v := c.Views()
	v[0].Shape[2] = 99
	v[0].Strides[0] = 99
	v[1].Strides[1] = 99
	c.Shapes()[0][2] = 99
	for slot, w := range c.Views() {
		if !bytes.Equal(walk(t, w), c.Expected(slot)) {
			t.Fatalf("slot %d changed after mutating returned slices", slot)
		}
	}
}

// Content depends on the filling loop and Value agreeing for a head_dim that
// is not a multiple of 4 as well.
func TestOddHeadDim(t *testing.T) {
	m := Model{"odd", 1, 3, 7, "bfloat16", 2}
	for _, padded := range []bool{false, true} {
		c := NewCache(m, 21, padded, nil)
		for slot, v := range c.Views() {
			if !bytes.Equal(walk(t, v), c.Expected(slot)) {
				t.Fatalf("padded=%v slot %d: content differs", padded, slot)
			}
		}
	}
}

func benchNewCache(b *testing.B, m Model, tokens int, padded bool, reuse bool) {
	var pool [][]byte
	i := 0
	alloc := func(n int) []byte {
		if i < len(pool) {
			i++
			return pool[i-1][:n]
		}
		buf := make([]byte, n)
		pool = append(pool, buf)
		i++
		return buf
	}
	if !reuse {
		alloc = nil
	} else {
		NewCache(m, tokens, padded, alloc) // warm the pool
	}
	b.SetBytes(int64(m.CacheBytes(tokens)))
	b.ReportAllocs()
	b.ResetTimer()
	for b.Loop() {
		i = 0
		c := NewCache(m, tokens, padded, alloc)
		_ = c
	}
}

// BenchmarkNewCache measures allocation (fresh make, page faults included)
// plus filling.
func BenchmarkNewCache(b *testing.B) {
	for _, tc := range []struct {
		m      Model
		tokens int
		padded bool
	}{
		{Llama31_8B, 8192, false},
		{Llama31_8B, 8000, true},
		{Gemma2_9B, 2048, false},
	} {
		b.Run(fmt.Sprintf("%s/T=%d/padded=%v", tc.m.Name, tc.tokens, tc.padded), func(b *testing.B) {
			benchNewCache(b, tc.m, tc.tokens, tc.padded, false)
		})
	}
}

// BenchmarkFill measures filling alone, into reused buffers.
func BenchmarkFill(b *testing.B) {
	b.Run("llama-3.1-8b/T=8192", func(b *testing.B) { benchNewCache(b, Llama31_8B, 8192, false, true) })
	b.Run("tiny/T=300/padded", func(b *testing.B) { benchNewCache(b, Tiny, 300, true, true) })
}

// BenchmarkExpected measures the reference (element-by-element) path.
func BenchmarkExpected(b *testing.B) {
	c := NewCache(Llama31_8B, 1024, false, nil)
	b.SetBytes(int64(Llama31_8B.TensorBytes(1024)))
	b.ReportAllocs()
	for b.Loop() {
		_ = c.Expected(5)
	}
}

func TestViewsAt(t *testing.T) {
	big := NewCache(Tiny, 300, true, nil)
	small := NewCache(Tiny, 40, false, nil)
	for slot, v := range big.ViewsAt(40) {
		got, _, err := v.Gather(make([]byte, v.Bytes()))
		if err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(got, small.Expected(slot)) {
			t.Fatalf("slot %d: ViewsAt(40) of a T=300 cache differs from a T=40 cache", slot)
		}
	}
}

// TestRowsMatchesValue: Rows writes exactly Value's elements, for a head
// dim that is a multiple of 4 and one that is not, at any first token.
func TestRowsMatchesValue(t *testing.T) {
	for _, m := range []Model{Tiny, {Name: "odd", Layers: 2, KVHeads: 2, HeadDim: 6, DType: "bfloat16", ItemSize: 2}} {
		for _, first := range []int{0, 7, 1 << 20} {
			out := make([]byte, 5*m.HeadDim*2)
			m.Rows(out, 1, 1, 1, first)
			for tok := range 5 {
				for d := range m.HeadDim {
					if got, want := binary.LittleEndian.Uint16(out[(tok*m.HeadDim+d)*2:]), Value(1, 1, 1, first+tok, d); got != want {
						t.Fatalf("%s first %d token %d d %d: %#x, want %#x", m.Name, first, tok, d, got, want)
					}
				}
			}
		}
	}
}
