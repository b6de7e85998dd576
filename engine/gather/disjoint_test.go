package gather

import (
	"errors"
	"math/rand/v2"
	"slices"
	"testing"
)

// refShared reports whether some byte of memory belongs to an element of
// a and to an element of b, byte by byte (both views over the same Base).
func refShared(a, b View) bool {
	used := map[int]bool{}
	for _, o := range refOffsets(a) {
		for k := range a.ItemSize {
			used[o+k] = true
		}
	}
	for _, o := range refOffsets(b) {
		for k := range b.ItemSize {
			if used[o+k] {
				return true
			}
		}
	}
	return false
}

// smallView is a random valid view of base: rank 1 to 3, dims 1 to 5,
// small strides (negative and zero too), item size 1, 2 or 4.
func smallView(rng *rand.Rand, base []byte) View {
	for {
		rank := 1 + rng.IntN(3)
		v := View{Base: base, Shape: make([]int, rank), Strides: make([]int, rank), ItemSize: []int{1, 2, 4}[rng.IntN(3)], Offset: rng.IntN(len(base))}
		for i := range rank {
			v.Shape[i] = 1 + rng.IntN(5)
			v.Strides[i] = rng.IntN(15) - 4
		}
		if v.Validate() == nil {
			return v
		}
	}
}

// TestCheckDisjointMatchesReference: on random pairs of views of one
// buffer, half of them one view moved by a few bytes (interleaved K and
// V), CheckDisjoint never accepts a pair that shares a byte (by the
// byte-by-byte reference), accepts every pair whose address ranges do not
// meet, and accepts most translated pairs that are in fact disjoint.
func TestCheckDisjointMatchesReference(t *testing.T) {
	rng := rand.New(rand.NewPCG(7, 12))
	base := make([]byte, 256)
	var translated, translatedOK, refused int
	for range 20000 {
		a := smallView(rng, base)
		var b View
		if rng.IntN(2) == 0 {
			b = a
			b.Strides = slices.Clone(a.Strides)
			b.Shape = slices.Clone(a.Shape)
			b.Offset += rng.IntN(33) - 16
			if b.Validate() != nil {
				continue
			}
		} else {
			b = smallView(rng, base)
		}
		i, j, err := CheckDisjoint([]View{a, b})
		shared := refShared(a, b)
		if err == nil && shared {
			t.Fatalf("accepted views sharing a byte: %+v and %+v", a, b)
		}
		if err != nil {
			if !errors.Is(err, ErrOverlap) || i != 0 || j != 1 {
				t.Fatalf("got (%d, %d, %v), want views 0 and 1 and ErrOverlap", i, j, err)
			}
			refused++
		}
		var la, lb layout
		_ = a.compile(&la)
		_ = b.compile(&lb)
		if (la.end <= lb.first || lb.end <= la.first) && err != nil {
			t.Fatalf("refused views whose address ranges do not meet: %+v and %+v: %v", a, b, err)
		}
		if slices.Equal(a.Shape, b.Shape) && slices.Equal(a.Strides, b.Strides) && !shared && a.CheckNoOverlap() == nil {
			translated++
			if err == nil {
				translatedOK++
			}
		}
	}
	if refused == 0 || translated == 0 || translatedOK*2 < translated {
		t.Fatalf("weak sample: %d refused; %d disjoint translated pairs, %d accepted", refused, translated, translatedOK)
	}
}

func TestCheckDisjointCases(t *testing.T) {
	buf := make([]byte, 4096)
	other := make([]byte, 4096)
	row := func(b []byte, off, n int) View {
		return View{Base: b, Offset: off, Shape: []int{n}, Strides: []int{1}, ItemSize: 2}
	}
	// K and V of 8 tokens interleaved per token: [token][K|V][4 elements].
	k := View{Base: buf, Shape: []int{8, 4}, Strides: []int{8, 1}, ItemSize: 2}
	v := k
	v.Offset = 8
	cases := []struct {
		name  string
		views []View
		i, j  int
		want  error
	}{
		{"separate buffers", []View{row(buf, 0, 2048), row(other, 0, 2048)}, 0, 0, nil},
		{"halves of one buffer", []View{row(buf, 2048, 1024), row(buf, 0, 1024)}, 0, 0, nil},
		{"K and V interleaved", []View{k, v}, 0, 0, nil},
		{"the same view twice", []View{row(other, 0, 8), row(buf, 0, 16), row(buf, 0, 16)}, 1, 2, ErrOverlap},
		{"one byte shared", []View{row(buf, 0, 100), row(buf, 199, 10)}, 0, 1, ErrOverlap},
		{"later pair", []View{row(buf, 0, 10), row(other, 0, 10), row(buf, 4000, 10), row(other, 18, 10)}, 1, 3, ErrOverlap},
		{"V moved onto K", []View{k, func() View { w := v; w.Offset = 4; return w }()}, 0, 1, ErrOverlap},
		{"empty views", []View{row(buf, 0, 0), row(buf, 0, 0), row(buf, 0, 4)}, 0, 0, nil},
		{"invalid view", []View{row(buf, 0, 4), row(buf, 4090, 4)}, 1, 1, ErrOutOfBounds},
	}
	for _, tc := range cases {
		i, j, err := CheckDisjoint(tc.views)
		if !errors.Is(err, tc.want) || (tc.want == nil) != (err == nil) {
			t.Fatalf("%s: %v, want %v", tc.name, err, tc.want)
		}
		if err != nil && (i != tc.i || j != tc.j) {
			t.Fatalf("%s: views %d and %d, want %d and %d", tc.name, i, j, tc.i, tc.j)
		}
	}
}
