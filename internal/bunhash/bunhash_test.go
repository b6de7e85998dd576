package bunhash

import (
	"encoding/hex"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"testing"
)

type vector struct {
	Name  string `json:"name"`
	Seed  uint64 `json:"seed"`
	Len   int    `json:"len"`
	Input string `json:"input"`
	Hash  string `json:"hash"`
}

func loadVectors(t *testing.T) []vector {
	t.Helper()
	raw, err := os.ReadFile(filepath.Join("testdata", "bunhash_vectors.json"))
	if err != nil {
		t.Fatalf("read vectors: %v", err)
	}
	var f struct {
		Vectors []vector `json:"vectors"`
	}
	if err := json.Unmarshal(raw, &f); err != nil {
		t.Fatalf("parse vectors: %v", err)
	}
	if len(f.Vectors) == 0 {
		t.Fatal("no vectors in testdata/bunhash_vectors.json")
	}
	return f.Vectors
}

func TestVectors(t *testing.T) {
	vs := loadVectors(t)
	seen := make(map[string]bool, len(vs))
	for _, v := range vs {
		if seen[v.Name] {
			t.Fatalf("duplicate vector name %q", v.Name)
		}
		seen[v.Name] = true
		t.Run(v.Name, func(t *testing.T) {
			in, err := hex.DecodeString(v.Input)
			if err != nil {
				t.Fatalf("vector %q: bad input hex: %v", v.Name, err)
			}
			if len(in) != v.Len {
				t.Fatalf("vector %q: input is %d bytes, file says len %d", v.Name, len(in), v.Len)
			}
			got := fmt.Sprintf("%016x", Hash(v.Seed, in))
			if got != v.Hash {
				t.Errorf("vector %q (len %d, seed %d): Hash = %s, want %s", v.Name, v.Len, v.Seed, got, v.Hash)
			}
			if v.Seed == 0 {
				if s := fmt.Sprintf("%016x", Sum(in)); s != v.Hash {
					t.Errorf("vector %q: Sum = %s, want %s", v.Name, s, v.Hash)
				}
				if h := Hex(in); h != v.Hash {
					t.Errorf("vector %q: Hex = %s, want %s", v.Name, h, v.Hash)
				}
			}
		})
	}
	t.Logf("checked %d vectors", len(vs))
}

// The length branches must all be covered by the vectors file.
func TestVectorsCoverBranches(t *testing.T) {
	var zero, tiny, small, medium, large, multiChunk bool
	for _, v := range loadVectors(t) {
		switch n := v.Len; {
		case n == 0:
			zero = true
		case n <= 3:
			tiny = true
		case n <= 16:
			small = true
		case n < 48:
			medium = true
		default:
			large = true
			if n > 96 {
				multiChunk = true
			}
		}
	}
	if !zero || !tiny || !small || !medium || !large || !multiChunk {
		t.Fatalf("vectors miss a length branch: 0:%v 1-3:%v 4-16:%v 17-47:%v >=48:%v >96:%v",
			zero, tiny, small, medium, large, multiChunk)
	}
}

func TestHexPadding(t *testing.T) {
	// Find an input whose hash has a leading zero nibble and check padding.
	buf := make([]byte, 8)
	for i := 0; i < 1<<16; i++ {
		buf[0], buf[1] = byte(i), byte(i>>8)
		if Sum(buf)>>60 == 0 {
			want := fmt.Sprintf("%016x", Sum(buf))
			if got := Hex(buf); got != want || len(got) != 16 {
				t.Fatalf("Hex = %q, want %q", got, want)
			}
			return
		}
	}
	t.Fatal("no hash with leading zero nibble found")
}

func TestHashDoesNotAllocate(t *testing.T) {
	for _, n := range []int{0, 1, 3, 4, 16, 17, 48, 49, 1000, 1 << 20} {
		b := make([]byte, n)
		for i := range b {
			b[i] = byte(i*31 + 7)
		}
		var sink uint64
		allocs := testing.AllocsPerRun(100, func() { sink ^= Hash(uint64(n), b) })
		if allocs != 0 {
			t.Errorf("Hash on %d bytes: %v allocs per run, want 0", n, allocs)
		}
		_ = sink
	}
}

func BenchmarkHash1MiB(b *testing.B) {
	buf := make([]byte, 1<<20)
	for i := range buf {
		buf[i] = byte(i*31 + 7)
	}
	b.SetBytes(int64(len(buf)))
	b.ReportAllocs()
	var sink uint64
	for b.Loop() {
		sink ^= Hash(0, buf)
	}
	_ = sink
}

func FuzzHash(f *testing.F) {
	for _, n := range []int{0, 1, 2, 3, 4, 8, 15, 16, 17, 32, 47, 48, 49, 96, 97, 145} {
		b := make([]byte, n)
		for i := range b {
			b[i] = byte(i*31 + 7)
		}
		f.Add(uint64(n), b)
	}
	f.Fuzz(func(t *testing.T, seed uint64, b []byte) {
		h1 := Hash(seed, b)
		cp := append([]byte(nil), b...)
		if h2 := Hash(seed, cp); h2 != h1 {
			t.Fatalf("Hash not deterministic: %016x vs %016x", h1, h2)
		}
		if string(cp) != string(b) {
			t.Fatal("Hash modified its input")
		}
		if seed == 0 && Sum(b) != h1 {
			t.Fatal("Sum(b) != Hash(0, b)")
		}
		// A sub-slice with spare capacity must hash like an exact-length copy.
		if len(b) > 0 {
			if Hash(seed, b[:len(b)-1]) != Hash(seed, cp[:len(cp)-1:len(cp)-1]) {
				t.Fatal("Hash depends on bytes beyond len")
			}
		}
	})
}
