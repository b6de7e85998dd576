package jobs_test

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"github.com/kvpersist/kvpersist/engine/jobs"
	"github.com/kvpersist/kvpersist/engine/layout"
	"github.com/kvpersist/kvpersist/engine/vfs"
	"github.com/kvpersist/kvpersist/internal/bunhash"
	"github.com/kvpersist/kvpersist/internal/kvgen"
	"github.com/kvpersist/kvpersist/internal/testutil"
	"github.com/zeebo/xxh3"
)

// Fuzz input modes (as engine/layout's FuzzDecode): raw file bytes, or a
// header JSON that the harness wraps in a valid prefix, so that mutations
// reach validation and the read instead of failing the header hash.
const (
	fzRaw            = iota // the file is js ‖ tail
	fzSingle                // kvpersist prefix, dataStart = next 16 KiB boundary, tail at dataStart
	fzManifest              // kvpersist prefix, dataStart = 26 + len(js), then tail
	fzLegacyManifest        // Bun worker prefix (Bun.hash of the JSON), as fzManifest
	fzLegacySingle          // Bun worker prefix, as fzSingle
	fzModes
)

// fzFlag bits of FuzzReadHeader's flags argument.
const (
	fzVerify  = 1 << iota // verify (ReadRequest.NoVerify unset)
	fzHelpers             // two helper goroutines
)

func fzBuildFile(mode uint8, js, tail []byte) []byte {
	var out []byte
	switch mode % fzModes {
	case fzRaw:
		return append(append([]byte(nil), js...), tail...)
	case fzSingle, fzLegacySingle:
		out = layout.EncodePrefix(js, uint32(layout.AlignUp(int64(layout.PrefixLen+len(js)), layout.DataAlign)))
	default:
		out = layout.EncodePrefix(js, uint32(layout.PrefixLen+len(js)))
	}
	if m := mode % fzModes; m == fzLegacyManifest || m == fzLegacySingle {
		copy(out, layout.LegacyMagic)
		binary.LittleEndian.PutUint64(out[18:], bunhash.Sum(js))
	}
	return append(out, tail...)
}

func fzSplit(f *testing.F, b []byte) (js, tail []byte) {
	f.Helper()
	p, err := layout.ParsePrefix(b)
	if err != nil {
		f.Fatal(err)
	}
	return b[layout.PrefixLen : layout.PrefixLen+int(p.HeaderLen)], b[p.DataStart:]
}

// bunBlocks writes the block files of the Bun worker's fixture stores
// (testdata/fuzz/FuzzReadHeader holds their manifests) into nsDir/blocks/,
// flat, as the worker did, regenerated from the fixture's documented
// content: K/V [1, 2, T, 8] float16 element v = l*4096 + kv*2048 + h*512 +
// t*8 + d, token ids int32 1000 + 7i; 256-byte blocks cut per row.
func bunBlocks(t testing.TB, nsDir string) {
	t.Helper()
	dir := testutil.BlocksDir(nsDir)
	if err := os.MkdirAll(dir, 0o750); err != nil {
		t.Fatal(err)
	}
	put := func(b []byte) {
		s := sha256.Sum256(b)
		if err := os.WriteFile(filepath.Join(dir, hex.EncodeToString(s[:])), b, 0o640); err != nil {
			t.Fatal(err)
		}
	}
	for _, T := range []int{40, 48} {
		for l := 0; l < 2; l++ {
			for kv := 0; kv < 2; kv++ {
				for h := 0; h < 2; h++ {
					row := make([]byte, 0, T*8*2)
					for tok := 0; tok < T; tok++ {
						for d := 0; d < 8; d++ {
							row = binary.LittleEndian.AppendUint16(row, uint16(l*4096+kv*2048+h*512+tok*8+d))
						}
					}
					for len(row) > 0 {
						n := min(256, len(row))
						put(row[:n])
						row = row[n:]
					}
				}
			}
		}
		ids := make([]byte, 0, 4*T)
		for i := 0; i < T; i++ {
			ids = binary.LittleEndian.AppendUint32(ids, uint32(1000+7*i))
		}
		put(ids)
	}
}

// fzLegacySingleJSON turns a kvpersist single-file header into the Bun
// worker's: no formatVersion, tensor hashes Bun.hash of the tensor bytes.
func fzLegacySingleJSON(f *testing.F, file []byte) []byte {
	f.Helper()
	p, err := layout.ParsePrefix(file)
	if err != nil {
		f.Fatal(err)
	}
	path := filepath.Join(f.TempDir(), "s")
	if err := os.WriteFile(path, file, 0o640); err != nil {
		f.Fatal(err)
	}
	snap, err := layout.Load(vfs.Default, path)
	if err != nil {
		f.Fatal(err)
	}
	h := snap.Header.Clone()
	h.FormatVersion = 0
	for _, tn := range h.Slots() {
		start := int64(p.DataStart) + tn.Off
		tn.Hash = bunhash.Hex(file[start : start+tn.Bytes])
	}
	js, err := h.Encode()
	if err != nil {
		f.Fatal(err)
	}
	return js
}

// FuzzReadHeader drives jobs.Read with generated and mutated snapshot files
// and manifests, in a store whose blocks exist (written by jobs.Write, and
// the Bun worker's regenerated). Destinations are sized from the decoded
// header (one of them off by the skew argument) and sit inside guard buffers
// filled with a pattern. Whatever the file, Read must not panic (a panic in
// a helper surfaces as ErrPanic), never modify a guard byte, and touch no
// destination when their sizes do not match; when it succeeds, each
// destination holds exactly the tensor's bytes as stored (read back here
// independently), and with verification those bytes match the stored
// hashes.
func FuzzReadHeader(f *testing.F) {
	root := faultRoot(f) // tmpfs when there is one: each input is written to a file
	nsDir := filepath.Join(root, "ns")
	bunBlocks(f, nsDir)
	c := kvgen.NewCache(kvgen.Tiny, 3, true, nil)
	files := map[layout.Layout][]byte{}
	for _, lay := range []layout.Layout{layout.Single, layout.Blocks} {
		p := filepath.Join(nsDir, "seed-"+lay.String())
		if _, _, err := writeAt(context.Background(), &jobs.Config{NoSync: true}, fxSpec(c, p, lay, 4<<10)); err != nil {
			f.Fatal(err)
		}
		b, err := os.ReadFile(p)
		if err != nil {
			f.Fatal(err)
		}
		files[lay] = b
	}
	js, tail := fzSplit(f, files[layout.Single])
	f.Add(uint8(fzSingle), js, tail, int8(0), uint8(fzVerify))
	f.Add(uint8(fzSingle), js, tail, int8(-1), uint8(fzVerify|fzHelpers))
	f.Add(uint8(fzLegacySingle), fzLegacySingleJSON(f, files[layout.Single]), tail, int8(0), uint8(fzVerify))
	js, tail = fzSplit(f, files[layout.Blocks])
	f.Add(uint8(fzManifest), js, tail, int8(0), uint8(fzVerify))
	f.Add(uint8(fzManifest), js, tail, int8(3), uint8(fzHelpers))
	f.Add(uint8(fzRaw), files[layout.Blocks], []byte{}, int8(0), uint8(fzVerify|fzHelpers))
	// One tensor of one 4 KiB block that exists, and a block name that
	// tries to leave the store.
	blk := make([]byte, 4096)
	sum := sha256.Sum256(blk)
	if err := os.MkdirAll(filepath.Dir(testutil.BlockPath(nsDir, hex.EncodeToString(sum[:]))), 0o750); err != nil {
		f.Fatal(err)
	}
	if err := os.WriteFile(testutil.BlockPath(nsDir, hex.EncodeToString(sum[:])), blk, 0o640); err != nil {
		f.Fatal(err)
	}
	one := `{"caches":[{"tensors":[{"off":0,"bytes":4096,"hash":"","dtype":"uint8","shape":[4096],"blocks":[{"hash":"%s","bytes":4096}]}]}],"formatVersion":5}`
	f.Add(uint8(fzManifest), []byte(fmt.Sprintf(one, hex.EncodeToString(sum[:]))), []byte{}, int8(0), uint8(fzVerify))
	f.Add(uint8(fzManifest), []byte(fmt.Sprintf(one, "../../../../../../etc/passwd")), []byte{}, int8(0), uint8(fzVerify))
	// The same block in formatVersion 8: its right xxh3, and a wrong one.
	one8 := `{"caches":[{"tensors":[{"off":0,"bytes":4096,"hash":"","dtype":"uint8","shape":[4096],"blocks":[{"hash":"%s","bytes":4096,"xxh3":"%s"}]}]}],"formatVersion":8}`
	f.Add(uint8(fzManifest), []byte(fmt.Sprintf(one8, hex.EncodeToString(sum[:]), leading16(xxh3.Hash(blk)))), []byte{}, int8(0), uint8(fzVerify))
	f.Add(uint8(fzManifest), []byte(fmt.Sprintf(one8, hex.EncodeToString(sum[:]), leading16(xxh3.Hash(blk)+1))), []byte{}, int8(0), uint8(fzVerify))

	// The seeds that must read back (so the success path is exercised):
	// the files written above and the Bun worker's manifests over the
	// regenerated blocks.
	ctx := context.Background()
	mustRead := [][3][]byte{}
	for _, lay := range []layout.Layout{layout.Single, layout.Blocks} {
		mustRead = append(mustRead, [3][]byte{{fzRaw}, files[lay], nil})
	}
	js, tail = fzSplit(f, files[layout.Single])
	mustRead = append(mustRead, [3][]byte{{fzLegacySingle}, fzLegacySingleJSON(f, files[layout.Single]), tail})
	for _, name := range []string{"bun-blocks-snapshot", "bun-blocks-grown"} {
		mode, js, tail := readCorpusEntry(f, filepath.Join("testdata", "fuzz", "FuzzReadHeader", name))
		mustRead = append(mustRead, [3][]byte{{mode}, js, tail})
	}
	for i, in := range mustRead {
		p := filepath.Join(nsDir, "seed-check")
		if err := os.WriteFile(p, fzBuildFile(in[0][0], in[1], in[2]), 0o640); err != nil {
			f.Fatal(err)
		}
		snap, err := layout.Load(vfs.Default, p)
		if err != nil {
			f.Fatalf("seed %d: %v", i, err)
		}
		var sizes []int
		for _, tn := range snap.Header.Slots() {
			sizes = append(sizes, int(tn.Bytes))
		}
		_, dest := guardedDests(sizes)
		if _, _, err := readAt(ctx, &jobs.Config{NoSync: true}, p, &jobs.ReadRequest{Dest: dest}); err != nil {
			f.Fatalf("seed %d does not read back: %v", i, err)
		}
	}

	path := filepath.Join(nsDir, "fuzz")
	f.Fuzz(func(t *testing.T, mode uint8, js, tail []byte, skew int8, flags uint8) {
		b := fzBuildFile(mode, js, tail)
		if err := os.WriteFile(path, b, 0o640); err != nil {
			t.Fatal(err)
		}
		cfg := &jobs.Config{NoSync: true, NoLock: true}
		if flags&fzHelpers != 0 {
			cfg.Spawn, cfg.Helpers = func(fn func()) bool { go fn(); return true }, 2
		}
		snap, err := layout.Load(vfs.Default, path)
		if err != nil {
			// Read must reject it the same way, touching nothing.
			gs, dest := guardedDests([]int{16, 0})
			if _, _, rerr := readAt(ctx, cfg, path, &jobs.ReadRequest{Dest: dest}); rerr == nil || errors.Is(rerr, jobs.ErrPanic) {
				t.Fatalf("Load failed (%v) but Read returned %v", err, rerr)
			}
			for _, g := range gs {
				if !g.untouched() || g.intact() >= 0 {
					t.Fatal("a rejected read wrote a destination")
				}
			}
			return
		}
		slots := snap.Header.Slots()
		sizes := make([]int, len(slots))
		var total int64
		for i, tn := range slots {
			if tn.Bytes > 8<<20 || len(slots) > 4096 {
				t.Skip("too large to allocate destinations for")
			}
			total += tn.Bytes // no overflow: each term is at most 8 MiB
			if total > 8<<20 {
				t.Skip("too large to allocate destinations for")
			}
			sizes[i] = int(tn.Bytes)
		}
		skewed := false
		if skew != 0 && len(sizes) > 0 {
			i := int(uint8(skew)) % len(sizes)
			if n := sizes[i] + int(skew); n >= 0 {
				sizes[i], skewed = n, true
			}
		}
		gs, dest := guardedDests(sizes)
		_, _, err = readAt(ctx, cfg, path, &jobs.ReadRequest{Dest: dest, NoVerify: flags&fzVerify == 0})
		checkGuards(t, gs)
		if errors.Is(err, jobs.ErrPanic) {
			t.Fatalf("Read panicked: %v", err)
		}
		if skewed {
			if !errors.Is(err, jobs.ErrDestination) {
				t.Fatalf("a destination of the wrong size: %v, want ErrDestination", err)
			}
			for i, g := range gs {
				if !g.untouched() {
					t.Fatalf("destination %d written by a read rejected for its sizes", i)
				}
			}
			return
		}
		if err != nil {
			return
		}
		for i, tn := range slots {
			want := storedBytes(t, snap, b, tn)
			if !bytes.Equal(dest[i], want) {
				t.Fatalf("slot %d: the read's bytes differ from the stored bytes", i)
			}
			if flags&fzVerify != 0 {
				checkStoredHash(t, snap, tn, want)
			}
		}
	})
}

// readCorpusEntry parses a FuzzReadHeader corpus file ("go test fuzz v1"
// then one Go literal per argument) and returns its mode, js and tail.
func readCorpusEntry(f *testing.F, path string) (mode byte, js, tail []byte) {
	f.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		f.Fatal(err)
	}
	lines := strings.Split(string(b), "\n")
	if len(lines) < 4 || lines[0] != "go test fuzz v1" {
		f.Fatalf("%s: not a corpus file", path)
	}
	lit := func(line, prefix string) string {
		if !strings.HasPrefix(line, prefix) || !strings.HasSuffix(line, ")") {
			f.Fatalf("%s: %.40q is not %s...)", path, line, prefix)
		}
		return line[len(prefix) : len(line)-1]
	}
	r, _, _, err := strconv.UnquoteChar(strings.Trim(lit(lines[1], "byte("), "'"), '\'')
	if err != nil {
		f.Fatal(err)
	}
	js1, err := strconv.Unquote(lit(lines[2], "[]byte("))
	if err != nil {
		f.Fatal(err)
	}
	tail1, err := strconv.Unquote(lit(lines[3], "[]byte("))
	if err != nil {
		f.Fatal(err)
	}
	return byte(r), []byte(js1), []byte(tail1)
}

// storedBytes reads a tensor's bytes as stored, without jobs.Read: from the
// file at dataStart+off, or by concatenating its block files.
func storedBytes(t *testing.T, snap *layout.Snapshot, file []byte, tn *layout.Tensor) []byte {
	t.Helper()
	if snap.Layout == layout.Single {
		start := int64(snap.DataStart) + tn.Off
		return file[start : start+tn.Bytes]
	}
	nsDir := filepath.Dir(snap.Path)
	var out []byte
	for _, r := range tn.Blocks {
		p := testutil.BlockPath(nsDir, r.Hash)
		if snap.Legacy {
			p = testutil.LegacyBlockPath(nsDir, r.Hash)
		}
		b, err := os.ReadFile(p)
		if err != nil {
			t.Fatalf("a read succeeded without block %s: %v", p, err)
		}
		out = append(out, b...)
	}
	return out
}

// checkStoredHash checks a verified read's bytes against the header's
// hashes, computed here independently.
func checkStoredHash(t *testing.T, snap *layout.Snapshot, tn *layout.Tensor, b []byte) {
	t.Helper()
	if snap.Layout == layout.Single {
		got := bunhash.Hex(b)
		if !snap.Legacy {
			got = leading16(xxh3.Hash(b))
		}
		if got != tn.Hash {
			t.Fatalf("verified read of bytes hashing to %s, header says %s", got, tn.Hash)
		}
		return
	}
	for _, r := range tn.Blocks {
		s := sha256.Sum256(b[:r.Bytes])
		if hex.EncodeToString(s[:]) != r.Hash {
			t.Fatalf("verified read of a block hashing to %x, manifest says %s", s, r.Hash)
		}
		// A formatVersion 8 manifest's restore checks the xxh3 it records.
		if x := leading16(xxh3.Hash(b[:r.Bytes])); r.XXH3 != "" && x != r.XXH3 {
			t.Fatalf("verified read of a block of xxh3 %s, manifest says %s", x, r.XXH3)
		}
		if (r.XXH3 != "") != (snap.Header.FormatVersion == layout.FormatBlocksXXH3) {
			t.Fatalf("block xxh3 %q in a formatVersion %d manifest", r.XXH3, snap.Header.FormatVersion)
		}
		b = b[r.Bytes:]
	}
}

// leading16 formats v as 16 lowercase hex digits, most significant first.
func leading16(v uint64) string {
	var b [8]byte
	binary.BigEndian.PutUint64(b[:], v)
	return hex.EncodeToString(b[:])
}
