package testutil

import (
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"

	"github.com/kvpersist/kvpersist/engine/layout"
)

// BunFixtures is the path of the Bun worker's stores (testdata/bun-worker at
// the repository root; see its README) relative to a package directory two
// levels down (engine/jobs, cmd/kvpersist); engine's tests use one level.
const BunFixtures = "../../testdata/bun-worker"

// BunFormula computes, slot by slot, the cache the Bun worker's fixtures
// hold at T tokens (testdata/bun-worker/README.md): 2 layers' K and V of
// shape [1, 2, T, 8] float16, element u16 LE l*4096 + kv*2048 + h*512 +
// t*8 + d, in slot order l0K, l0V, l1K, l1V; then the token ids, int32 LE
// 1000 + 7i.
func BunFormula(T int) [][]byte {
	var out [][]byte
	for l := 0; l < 2; l++ {
		for kv := 0; kv < 2; kv++ {
			b := make([]byte, 0, 2*T*8*2)
			for h := 0; h < 2; h++ {
				for tk := 0; tk < T; tk++ {
					for d := 0; d < 8; d++ {
						b = binary.LittleEndian.AppendUint16(b, uint16(l*4096+kv*2048+h*512+tk*8+d))
					}
				}
			}
			out = append(out, b)
		}
	}
	tok := make([]byte, 0, 4*T)
	for i := 0; i < T; i++ {
		tok = binary.LittleEndian.AppendUint32(tok, uint32(int32(1000+7*i)))
	}
	return append(out, tok)
}

// TreeDigest maps every path under root (relative to it) to the SHA-256 of
// its content as hex, and every directory to "dir": comparing two digests
// shows whether anything under root was created, removed or changed.
func TreeDigest(tb TB, root string) map[string]string {
	tb.Helper()
	out := map[string]string{}
	err := filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(root, p)
		if d.IsDir() {
			out[rel] = "dir"
			return nil
		}
		b, err := os.ReadFile(p)
		if err != nil {
			return err
		}
		s := sha256.Sum256(b)
		out[rel] = hex.EncodeToString(s[:])
		return nil
	})
	if err != nil {
		tb.Fatal(err)
	}
	return out
}

// TB is the part of testing.TB the helpers use (so that the demo binary,
// which imports this package, does not link the testing package).
type TB interface {
	Helper()
	Fatal(args ...any)
}

// BunStore lays the Bun worker's fixtures (found at fixtures: BunFixtures,
// or "../testdata/bun-worker" from a package one level down) out under root
// as a store of the original worker, and returns root:
// root/bun-single/snapshot.mlxkv (T = 40) and root/bun-blocks/{snapshot.mlxkv
// (T = 40), grown.mlxkv (T = 48), blocks/<sha256>} (34 flat blocks).
func BunStore(tb TB, fixtures, root string) string {
	tb.Helper()
	CopyFile(tb, filepath.Join(fixtures, "single", "snapshot.mlxkv"), filepath.Join(root, "bun-single", "snapshot.mlxkv"))
	for _, n := range []string{"snapshot.mlxkv", "grown.mlxkv"} {
		CopyFile(tb, filepath.Join(fixtures, "blocks", n), filepath.Join(root, "bun-blocks", n))
	}
	ents, err := os.ReadDir(filepath.Join(fixtures, "blocks", "blocks"))
	if err != nil || len(ents) != 34 {
		tb.Fatal(fmt.Sprintf("fixture blocks: %d, %v (the README says 34)", len(ents), err))
	}
	for _, e := range ents {
		CopyFile(tb, filepath.Join(fixtures, "blocks", "blocks", e.Name()), filepath.Join(root, "bun-blocks", "blocks", e.Name()))
	}
	return root
}

// AsFormatBlocks returns a copy of h, a block manifest's header, as a
// formatVersion 5 manifest (layout.FormatBlocks) of the same blocks: no
// block carries an xxh3. That is what the Bun worker's manifests hold, and
// kvpersist's own before formatVersion 8.
func AsFormatBlocks(h *layout.Header) *layout.Header {
	c := h.Clone()
	c.FormatVersion = layout.FormatBlocks
	for _, t := range c.Slots() {
		for k := range t.Blocks {
			t.Blocks[k].XXH3 = ""
		}
	}
	return c
}
