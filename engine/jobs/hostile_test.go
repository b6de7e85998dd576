package jobs_test

// Hostile and corrupt input: manifests naming blocks by paths, symlinks
// where files belong, restores whose destinations or expectations do not
// match the snapshot, truncated or overlong files and formats from the
// future. Each must fail with its sentinel error before it can read or write
// anything it should not, and never write a destination past its length.

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"github.com/kvpersist/kvpersist/engine/jobs"
	"github.com/kvpersist/kvpersist/engine/layout"
	"github.com/kvpersist/kvpersist/engine/vfs"
	"github.com/kvpersist/kvpersist/internal/bunhash"
	"github.com/kvpersist/kvpersist/internal/kvgen"
	"github.com/kvpersist/kvpersist/internal/testutil"
)

// hsStore is a namespace holding the same Tiny cache as a single file
// ("single") and as a block manifest ("blocks"), 4 KiB blocks.
type hsStore struct {
	root, nsDir string
	single      string
	blocks      string
	want        [][]byte
	header      *layout.Header // of the manifest
}

func newHsStore(t *testing.T) *hsStore {
	t.Helper()
	c := kvgen.NewCache(kvgen.Tiny, 300, true, nil) // rows of 9600 bytes: 3 blocks each
	root := t.TempDir()
	s := &hsStore{root: root, nsDir: filepath.Join(root, "ns"), want: fxExpected(c)}
	s.single = filepath.Join(s.nsDir, "single")
	s.blocks = filepath.Join(s.nsDir, "blocks-snap")
	fxWrite(t, c, s.single, layout.Single)
	s.header = fxWrite(t, c, s.blocks, layout.Blocks)
	return s
}

// rewrite re-encodes the snapshot at src into dst after mutate changed its
// header, with a valid header hash: a manifest keeps dataStart = 26 +
// len(JSON); a single file keeps its dataStart and tensor bytes.
func rewrite(t *testing.T, src, dst string, mutate func(h *layout.Header)) {
	t.Helper()
	snap, err := layout.Load(vfs.Default, src)
	if err != nil {
		t.Fatal(err)
	}
	old, err := os.ReadFile(src)
	if err != nil {
		t.Fatal(err)
	}
	h := snap.Header.Clone()
	mutate(h)
	js, err := h.Encode()
	if err != nil {
		t.Fatal(err)
	}
	var out []byte
	if snap.Layout == layout.Blocks {
		out = layout.EncodePrefix(js, uint32(layout.PrefixLen+len(js)))
	} else {
		if layout.PrefixLen+len(js) > int(snap.DataStart) {
			t.Fatalf("re-encoded header of %d bytes does not fit before dataStart %d", len(js), snap.DataStart)
		}
		out = append(layout.EncodePrefix(js, snap.DataStart), old[snap.DataStart:]...)
	}
	if err := os.WriteFile(dst, out, 0o640); err != nil {
		t.Fatal(err)
	}
}

// legacyManifest encodes h as the Bun worker did: LegacyMagic, dataStart =
// 26 + len(JSON), and the header hash Bun.hash of the JSON alone.
func legacyManifest(t *testing.T, h *layout.Header) []byte {
	t.Helper()
	// The Bun worker wrote formatVersion 5: blocks without xxh3s.
	js, err := testutil.AsFormatBlocks(h).Encode()
	if err != nil {
		t.Fatal(err)
	}
	out := layout.EncodePrefix(js, uint32(layout.PrefixLen+len(js)))
	copy(out, layout.LegacyMagic)
	binary.LittleEndian.PutUint64(out[18:], bunhash.Sum(js))
	return out
}

// readGuarded reads path into guarded buffers of the given sizes.
func readGuarded(cfg *jobs.Config, path string, sizes []int, verify bool, expect *layout.Header) ([]guarded, [][]byte, error) {
	gs, dest := guardedDests(sizes)
	_, _, err := readAt(context.Background(), cfg, path, &jobs.ReadRequest{Dest: dest, NoVerify: !verify, Expect: expect})
	return gs, dest, err
}

func TestHostileBlockNames(t *testing.T) {
	s := newHsStore(t)
	real := s.header.Slots()[0].Blocks[0].Hash
	// A file where "../../x" would lead from the blocks directory, with the
	// right size: it must never be opened.
	size := s.header.Slots()[0].Blocks[0].Bytes
	bait := bytes.Repeat([]byte{0xEE}, int(size))
	for _, p := range []string{filepath.Join(s.nsDir, "x"), filepath.Join(s.root, "x")} {
		if err := os.WriteFile(p, bait, 0o640); err != nil {
			t.Fatal(err)
		}
	}
	names := map[string]string{
		"dotdot":      "../../x",
		"dotdot-64":   "../" + strings.Repeat("a", 61),
		"absolute":    "/etc/passwd",
		"absolute-64": "/" + strings.Repeat("0", 63),
		"uppercase":   strings.ToUpper(real),
		"short":       real[:63],
		"long":        real + "0",
		"slash":       real[:31] + "/" + real[32:],
		"nul":         real[:63] + "\x00",
		"empty":       "",
		"space":       " " + real[1:],
		"newline":     real[:63] + "\n",
	}
	for name, bad := range names {
		t.Run(name, func(t *testing.T) {
			mutate := func(h *layout.Header) { h.Slots()[0].Blocks[0].Hash = bad }
			for _, legacy := range []bool{false, true} {
				path := filepath.Join(s.nsDir, "evil")
				if legacy {
					h := s.header.Clone()
					mutate(h)
					if err := os.WriteFile(path, legacyManifest(t, h), 0o640); err != nil {
						t.Fatal(err)
					}
				} else {
					rewrite(t, s.blocks, path, mutate)
				}
				ffs := testutil.NewFaultFS(nil)
				gs, dest, err := readGuarded(&jobs.Config{FS: ffs, NoLock: true}, path, sizesOf(s.want), false, nil)
				if !errors.Is(err, layout.ErrInvalidHeader) {
					t.Fatalf("legacy=%v: %v, want ErrInvalidHeader", legacy, err)
				}
				// Rejected while decoding: the manifest is the only file
				// opened, and the only stat is of the namespace directory
				// (refused if it were a symlink).
				if n := ffs.Count(testutil.OpOpen); n != 1 || ffs.Count(testutil.OpLstat) != 1 {
					t.Fatalf("legacy=%v: %d opens and %d lstats, want only the manifest's open and the namespace's lstat", legacy, n, ffs.Count(testutil.OpLstat))
				}
				for i, g := range gs {
					if !g.untouched() || g.intact() >= 0 {
						t.Fatalf("destination %d written by a rejected read", i)
					}
				}
				_ = dest
			}
		})
	}
	// Collect treats such a manifest as unreadable: the namespace is not
	// swept, and neither bait file is touched.
	m, err := collectAt(context.Background(), &jobs.Config{NoSync: true}, s.root, &jobs.CollectRequest{})
	if err != nil || len(m.Collect.Unreadable) == 0 || !strings.Contains(strings.Join(m.Collect.Unreadable, "\n"), "evil") || m.Collect.BlocksDeleted != 0 {
		t.Fatalf("collect: %v, unreadable %v, %d blocks deleted", err, m.Collect.Unreadable, m.Collect.BlocksDeleted)
	}
	for _, p := range []string{filepath.Join(s.nsDir, "x"), filepath.Join(s.root, "x")} {
		if b, err := os.ReadFile(p); err != nil || !bytes.Equal(b, bait) {
			t.Fatalf("bait %s changed: %v", p, err)
		}
	}
}

func TestHostileSymlinks(t *testing.T) {
	ctx := context.Background()
	t.Run("snapshot", func(t *testing.T) {
		s := newHsStore(t)
		for _, target := range []string{s.single, s.blocks} {
			link := filepath.Join(s.nsDir, "link")
			os.Remove(link)
			if err := os.Symlink(target, link); err != nil {
				t.Fatal(err)
			}
			gs, _, err := readGuarded(&jobs.Config{}, link, sizesOf(s.want), true, nil)
			if !errors.Is(err, syscall.ELOOP) {
				t.Fatalf("read through a symlink to %s: %v, want ELOOP", target, err)
			}
			for i, g := range gs {
				if !g.untouched() || g.intact() >= 0 {
					t.Fatalf("destination %d written", i)
				}
			}
			if _, err := layout.Load(vfs.Default, link); !errors.Is(err, syscall.ELOOP) {
				t.Fatalf("Load of a symlink: %v, want ELOOP", err)
			}
		}
	})
	t.Run("block", func(t *testing.T) {
		s := newHsStore(t)
		ref := s.header.Slots()[1].Blocks[2]
		p := testutil.BlockPath(s.nsDir, ref.Hash)
		// The block's own bytes, moved outside the store and linked back:
		// even the right content is refused when reached through a link.
		outside := filepath.Join(t.TempDir(), "moved")
		if err := os.Rename(p, outside); err != nil {
			t.Fatal(err)
		}
		if err := os.Symlink(outside, p); err != nil {
			t.Fatal(err)
		}
		for _, verify := range []bool{false, true} {
			gs, dest, err := readGuarded(&jobs.Config{}, s.blocks, sizesOf(s.want), verify, nil)
			var re *jobs.ReadError
			if !errors.Is(err, syscall.ELOOP) || !errors.As(err, &re) || len(re.Slots) != 1 || re.Slots[0].Slot != 1 {
				t.Fatalf("verify=%v: %v, want a ReadError for slot 1 wrapping ELOOP", verify, err)
			}
			checkGuards(t, gs)
			// Found when the blocks are opened, before any data is read:
			// no destination has been touched.
			for i, g := range gs {
				if !g.untouched() {
					t.Fatalf("verify=%v: destination %d written by a read that failed on opening its blocks", verify, i)
				}
			}
			_ = dest
		}
		// Collect neither follows nor deletes the link's target.
		if _, err := collectAt(ctx, &jobs.Config{}, s.root, &jobs.CollectRequest{}); err != nil {
			t.Fatal(err)
		}
		if st, err := os.Stat(outside); err != nil || st.Size() != ref.Bytes {
			t.Fatalf("link target after collect: %v", err)
		}
	})
	t.Run("write-over-link", func(t *testing.T) {
		// A write whose target path is a symlink replaces the link (rename
		// over it); the file it pointed to is not written.
		s := newHsStore(t)
		victim := filepath.Join(t.TempDir(), "victim")
		if err := os.WriteFile(victim, []byte("keep"), 0o640); err != nil {
			t.Fatal(err)
		}
		for _, lay := range []layout.Layout{layout.Single, layout.Blocks} {
			link := filepath.Join(s.nsDir, "link-"+lay.String())
			if err := os.Symlink(victim, link); err != nil {
				t.Fatal(err)
			}
			c := kvgen.NewCache(kvgen.Tiny, 300, true, nil)
			fxWrite(t, c, link, lay)
			if st, err := os.Lstat(link); err != nil || !st.Mode().IsRegular() {
				t.Fatalf("%s after the write: %v %v, want a regular file", link, st, err)
			}
			fxReadVerify(t, link, s.want)
		}
		if b, err := os.ReadFile(victim); err != nil || string(b) != "keep" {
			t.Fatalf("the link's target was written: %q %v", b, err)
		}
	})
	t.Run("symlinked-directories", func(t *testing.T) {
		// A namespace, blocks or fan-out directory that is a symlink is
		// refused by writers: nothing lands in the directory it points to.
		c := kvgen.NewCache(kvgen.Tiny, 40, true, nil)
		for _, which := range []string{"namespace", "blocks", "fanout"} {
			root := t.TempDir()
			elsewhere := t.TempDir()
			nsDir := filepath.Join(root, "ns")
			var link string
			switch which {
			case "namespace":
				link = nsDir
			case "blocks":
				link = testutil.BlocksDir(nsDir)
			case "fanout":
				// The fan-out directory of the first block this cache writes.
				probe := t.TempDir()
				h := fxWrite(t, c, filepath.Join(probe, "ns", "snap"), layout.Blocks)
				link = filepath.Dir(testutil.BlockPath(nsDir, h.Slots()[0].Blocks[0].Hash))
			}
			if err := os.MkdirAll(filepath.Dir(link), 0o750); err != nil {
				t.Fatal(err)
			}
			if err := os.Symlink(elsewhere, link); err != nil {
				t.Fatal(err)
			}
			_, _, err := writeAt(ctx, &jobs.Config{NoSync: true}, fxSpec(c, filepath.Join(nsDir, "snap"), layout.Blocks, 4<<10))
			if err == nil || !strings.Contains(err.Error(), "symlink") {
				t.Fatalf("%s: write through a symlinked directory: %v", which, err)
			}
			if ents, _ := os.ReadDir(elsewhere); len(ents) != 0 {
				t.Fatalf("%s: %d entries written through the link", which, len(ents))
			}
		}
	})
}

// TestHostileFileModes: every file kvpersist creates (snapshots, manifests,
// blocks, the lock file) has no group-write and no world bits, and every
// directory no group-write and no world bits, whatever the umask: the test
// clears the umask, so a mode requested too wide would show.
func TestHostileFileModes(t *testing.T) {
	old := syscall.Umask(0)
	defer syscall.Umask(old)
	c := kvgen.NewCache(kvgen.Tiny, 40, true, nil)
	root := t.TempDir()
	for _, lay := range []layout.Layout{layout.Single, layout.Blocks} {
		p := filepath.Join(root, "ns", "snap-"+lay.String())
		if _, _, err := writeAt(context.Background(), &jobs.Config{}, fxSpec(c, p, lay, 4<<10)); err != nil {
			t.Fatal(err)
		}
	}
	files, dirs := 0, 0
	err := filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
		if err != nil || p == root {
			return err
		}
		info, err := d.Info()
		if err != nil {
			return err
		}
		mode := info.Mode()
		switch {
		case mode.IsRegular():
			files++
			if mode.Perm()&0o037 != 0 {
				t.Errorf("file %s has mode %v (want 0640 or tighter)", p, mode.Perm())
			}
		case mode.IsDir():
			dirs++
			if mode.Perm()&0o027 != 0 {
				t.Errorf("directory %s has mode %v (want 0750 or tighter)", p, mode.Perm())
			}
		default:
			t.Errorf("unexpected %v at %s", mode.Type(), p)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if files < 4 || dirs < 3 {
		t.Fatalf("walked %d files and %d directories: the writes made too few", files, dirs)
	}
}

// TestHostileMismatchedRestores: every restore that cannot succeed fails
// with its sentinel; those detectable before any byte is read leave the
// destinations untouched; none writes past a destination's length.
func TestHostileMismatchedRestores(t *testing.T) {
	s := newHsStore(t)
	sizes := sizesOf(s.want)
	resize := func(slot, delta int) []int {
		out := append([]int(nil), sizes...)
		out[slot] += delta
		return out
	}
	otherDType := s.header.Clone()
	otherDType.Slots()[0].DType = "float16"
	otherShape := s.header.Clone()
	otherShape.Slots()[2].Shape = []int64{1, 2, 299, 16}
	fewerSlots := s.header.Clone()
	fewerSlots.Attachments = nil

	type tc struct {
		name      string
		prepare   func(t *testing.T, path string) // damage a copy of the store
		sizes     []int
		expect    *layout.Header
		want      error
		untouched bool // the failure is found before any byte is read
	}
	cases := []tc{
		{name: "dest-shorter", sizes: resize(2, -1), want: jobs.ErrDestination, untouched: true},
		{name: "dest-longer", sizes: resize(2, 1), want: jobs.ErrDestination, untouched: true},
		{name: "dest-last-longer", sizes: resize(len(sizes)-1, 4), want: jobs.ErrDestination, untouched: true},
		{name: "dest-fewer", sizes: sizes[:len(sizes)-1], want: jobs.ErrDestination, untouched: true},
		{name: "dest-more", sizes: append(append([]int(nil), sizes...), 8), want: jobs.ErrDestination, untouched: true},
		{name: "expect-dtype", sizes: sizes, expect: otherDType, want: jobs.ErrMismatch, untouched: true},
		{name: "expect-shape", sizes: sizes, expect: otherShape, want: jobs.ErrMismatch, untouched: true},
		{name: "expect-slots", sizes: sizes, expect: fewerSlots, want: jobs.ErrMismatch, untouched: true},
		{name: "future-format", sizes: sizes, want: layout.ErrFormatVersion, untouched: true,
			prepare: func(t *testing.T, path string) {
				rewrite(t, path, path, func(h *layout.Header) { h.FormatVersion = 99 })
			}},
	}
	for _, lay := range []layout.Layout{layout.Single, layout.Blocks} {
		for _, c := range cases {
			t.Run(lay.String()+"/"+c.name, func(t *testing.T) {
				path := s.single
				if lay == layout.Blocks {
					path = s.blocks
				}
				if c.prepare != nil {
					dup := filepath.Join(s.nsDir, "dup")
					b, err := os.ReadFile(path)
					if err != nil {
						t.Fatal(err)
					}
					if err := os.WriteFile(dup, b, 0o640); err != nil {
						t.Fatal(err)
					}
					path = dup
					c.prepare(t, path)
				}
				gs, _, err := readGuarded(&jobs.Config{}, path, c.sizes, true, c.expect)
				if !errors.Is(err, c.want) {
					t.Fatalf("%v, want %v", err, c.want)
				}
				checkGuards(t, gs)
				for i, g := range gs {
					if c.untouched && !g.untouched() {
						t.Fatalf("destination %d written by a read rejected before reading", i)
					}
				}
			})
		}
	}

	// Damaged block files: each on a fresh store (a block is shared by
	// nothing else, so exactly one slot fails).
	blockCases := []struct {
		name   string
		damage func(b []byte) []byte
		want   error
		// beforeData: found when every block is opened and sized, before
		// the first byte of any destination is written: every destination
		// is untouched. Otherwise (found while reading) every other slot
		// is restored.
		beforeData bool
	}{
		{"truncated", func(b []byte) []byte { return b[:len(b)-1] }, jobs.ErrBlockSize, true},
		{"empty", func(b []byte) []byte { return nil }, jobs.ErrBlockSize, true},
		{"longer", func(b []byte) []byte { return append(b, 0) }, jobs.ErrBlockSize, true},
		{"much-longer", func(b []byte) []byte { return append(b, make([]byte, 1<<16)...) }, jobs.ErrBlockSize, true},
		{"flipped", func(b []byte) []byte { b[len(b)/2] ^= 1; return b }, jobs.ErrCorrupt, false},
		{"missing", nil, jobs.ErrMissingBlock, true},
	}
	for _, bc := range blockCases {
		t.Run("block-"+bc.name, func(t *testing.T) {
			s := newHsStore(t)
			ref := s.header.Slots()[3].Blocks[4]
			p := testutil.BlockPath(s.nsDir, ref.Hash)
			b, err := os.ReadFile(p)
			if err != nil {
				t.Fatal(err)
			}
			if bc.damage == nil {
				err = os.Remove(p)
			} else {
				err = os.WriteFile(p, bc.damage(b), 0o640)
			}
			if err != nil {
				t.Fatal(err)
			}
			gs, dest, err := readGuarded(&jobs.Config{}, s.blocks, sizesOf(s.want), true, nil)
			var re *jobs.ReadError
			if !errors.Is(err, bc.want) || !errors.As(err, &re) || len(re.Slots) != 1 || re.Slots[0].Slot != 3 ||
				!strings.Contains(err.Error(), ref.Hash) {
				t.Fatalf("%v, want a ReadError for slot 3 naming block %s and wrapping %v", err, ref.Hash, bc.want)
			}
			checkGuards(t, gs)
			for i, g := range gs {
				if bc.beforeData && !g.untouched() {
					t.Fatalf("destination %d written by a read that failed on opening its blocks", i)
				}
				if !bc.beforeData && i != 3 && !bytes.Equal(dest[i], s.want[i]) {
					t.Fatalf("slot %d not restored beside the damaged one", i)
				}
			}
		})
	}

	// A damaged single file: truncated (found while decoding) or with a
	// flipped tensor byte (found by verification).
	t.Run("single-truncated", func(t *testing.T) {
		snap, err := layout.Load(vfs.Default, s.single)
		if err != nil {
			t.Fatal(err)
		}
		b, err := os.ReadFile(s.single)
		if err != nil {
			t.Fatal(err)
		}
		// Cut the last tensor's last byte (the file ends with alignment
		// padding after it).
		last := snap.Header.Slots()[len(sizes)-1]
		p := filepath.Join(s.nsDir, "cut")
		if err := os.WriteFile(p, b[:int64(snap.DataStart)+last.Off+last.Bytes-1], 0o640); err != nil {
			t.Fatal(err)
		}
		gs, _, err := readGuarded(&jobs.Config{}, p, sizes, true, nil)
		if !errors.Is(err, layout.ErrTruncated) {
			t.Fatalf("%v, want ErrTruncated", err)
		}
		for i, g := range gs {
			if !g.untouched() || g.intact() >= 0 {
				t.Fatalf("destination %d written", i)
			}
		}
	})
	t.Run("single-flipped", func(t *testing.T) {
		snap, err := layout.Load(vfs.Default, s.single)
		if err != nil {
			t.Fatal(err)
		}
		b, err := os.ReadFile(s.single)
		if err != nil {
			t.Fatal(err)
		}
		tn := snap.Header.Slots()[4]
		b[int64(snap.DataStart)+tn.Off+tn.Bytes-1] ^= 0x80
		p := filepath.Join(s.nsDir, "flipped")
		if err := os.WriteFile(p, b, 0o640); err != nil {
			t.Fatal(err)
		}
		gs, _, err := readGuarded(&jobs.Config{}, p, sizes, true, nil)
		var re *jobs.ReadError
		if !errors.Is(err, jobs.ErrCorrupt) || !errors.As(err, &re) || len(re.Slots) != 1 || re.Slots[0].Slot != 4 {
			t.Fatalf("%v, want ErrCorrupt for slot 4", err)
		}
		checkGuards(t, gs)
	})
}
