package engine

import (
	"errors"
	"path/filepath"
	"testing"

	"github.com/kvpersist/kvpersist/engine/layout"
	"github.com/kvpersist/kvpersist/internal/kvgen"
	"github.com/kvpersist/kvpersist/internal/testutil"
)

// Reads and prefix loads verify by default: with the zero value of
// ReadRequest and LoadPrefixRequest a flipped data byte in a stored
// snapshot, block or page is ErrCorrupt (a read's error, a load's Stop),
// never loaded as good bytes. NoVerify is the explicit opt-out, and with
// it the flipped byte is what the destination gets.
func TestReadVerifiesByDefault(t *testing.T) {
	m := kvgen.Tiny
	const T = 300
	for _, lay := range []layout.Layout{layout.Single, layout.Blocks} {
		t.Run(lay.String(), func(t *testing.T) {
			e := newEngine(t, Config{Root: t.TempDir(), Workers: 2})
			ref := refOf("v", "snap")
			c, want := cacheOf(m, T, false)
			mustDo(t, e, writeReq(ref, c, lay, 4096))
			snap, err := e.Stat(ref)
			if err != nil {
				t.Fatal(err)
			}
			path, err := e.Path(ref)
			if err != nil {
				t.Fatal(err)
			}
			// Flip a byte in the middle of slot 1 (layer 0's V).
			s1 := snap.Header.Slots()[1]
			at := s1.Bytes / 2
			if lay == layout.Single {
				testutil.FlipByte(t, path, int64(snap.DataStart)+s1.Off+at)
			} else {
				b := s1.Blocks[0]
				for _, r := range s1.Blocks {
					if at < r.Bytes {
						b = r
						break
					}
					at -= r.Bytes
				}
				testutil.FlipByte(t, testutil.BlockPath(filepath.Dir(path), b.Hash), at)
				at = s1.Bytes / 2
			}

			dest := destOf(m, T)
			if r := e.Do(bg, &ReadRequest{Ref: ref, Dest: dest}); !errors.Is(r.Err, ErrCorrupt) {
				t.Fatalf("zero-value read of a flipped byte: err %v, want ErrCorrupt", r.Err)
			}

			dest = destOf(m, T)
			if r := e.Do(bg, &ReadRequest{Ref: ref, Dest: dest, NoVerify: true}); r.Err != nil {
				t.Fatalf("NoVerify read: %v", r.Err)
			}
			if dest[1][at] != want[1][at]^0x10 {
				t.Fatalf("NoVerify read: byte %d of slot 1 is %#x, want the flipped %#x", at, dest[1][at], want[1][at]^0x10)
			}
			dest[1][at] ^= 0x10
			equalSlots(t, "NoVerify read, the flipped byte put back", dest, want)
		})
	}
}

func TestLoadPrefixVerifiesByDefault(t *testing.T) {
	root := t.TempDir()
	e := newEngine(t, Config{Root: root, Workers: 2})
	m := kvgen.Tiny
	const T, P = 300, 64
	c, _ := cacheOf(m, T, true)
	toks := prefixTokens(T, 11)
	mustDo(t, e, &SavePrefixRequest{Namespace: "p", Identity: "tiny", Tokens: toks, Tensors: kvTensors(c), PageTokens: P})
	keys, _, err := layout.PageChain("tiny", P, toks)
	if err != nil {
		t.Fatal(err)
	}
	page := testutil.PagePath(filepath.Join(root, "p"), keys[2])
	// NoVerify first: the corrupt page is still there to be loaded (a
	// verified load removes it).
	flipLastByte(t, page)
	bufs, dest := paddedDest(m, 320, func(n int) []byte { return make([]byte, n) })
	r := mustDo(t, e, &LoadPrefixRequest{Namespace: "p", Identity: "tiny", Tokens: toks, Dest: dest, PageTokens: P, NoVerify: true})
	if r.Prefix.Tokens != T || r.Prefix.Stop != nil {
		t.Fatalf("NoVerify load over a flipped byte: %+v, want all %d tokens", r.Prefix, T)
	}
	if d := loadedDiffs(c, bufs, 320, T); len(d) != 1 || d[0] != len(bufs)-1 {
		t.Fatalf("NoVerify load: tensors differing from the saved KV %v, want the flipped byte in the last tensor only", d)
	}

	bufs, dest = paddedDest(m, 320, func(n int) []byte { return make([]byte, n) })
	r = mustDo(t, e, &LoadPrefixRequest{Namespace: "p", Identity: "tiny", Tokens: toks, Dest: dest, PageTokens: P})
	if r.Prefix.Tokens != 2*P || !errors.Is(r.Prefix.Stop, ErrCorrupt) {
		t.Fatalf("zero-value load over a flipped byte: Tokens %d Stop %v, want %d and ErrCorrupt", r.Prefix.Tokens, r.Prefix.Stop, 2*P)
	}
	// Tokens past the Stop may hold partial data (LoadPrefix): only the
	// loaded ones are compared.
	if d := loadedDiffs(c, bufs, 320, 2*P); len(d) != 0 {
		t.Fatalf("zero-value load: tensors %v differ from the saved KV in the loaded tokens", d)
	}
}

// loadedDiffs lists each destination (capacity capT tokens) whose tokens
// [0, n) differ from c's expected KV, counting one entry per differing byte.
func loadedDiffs(c *kvgen.Cache, bufs [][]byte, capT, n int) []int {
	m := c.Model
	row := m.HeadDim * m.ItemSize
	var out []int
	for i, b := range bufs {
		want := c.Expected(i) // [1, heads, c.Tokens, dim]
		for h := range m.KVHeads {
			for tok := range n {
				got, exp := b[(h*capT+tok)*row:][:row], want[(h*c.Tokens+tok)*row:][:row]
				for k := range row {
					if got[k] != exp[k] {
						out = append(out, i)
					}
				}
			}
		}
	}
	return out
}
