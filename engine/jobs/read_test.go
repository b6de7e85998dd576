package jobs_test

import (
	"bytes"
	"context"
	"errors"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/kvpersist/kvpersist/engine/jobs"
	"github.com/kvpersist/kvpersist/engine/layout"
	"github.com/kvpersist/kvpersist/engine/vfs"
	"github.com/kvpersist/kvpersist/internal/kvgen"
	"github.com/kvpersist/kvpersist/internal/testutil"
)

func allFilled(bufs [][]byte, fill byte) bool {
	for _, b := range bufs {
		for _, x := range b {
			if x != fill {
				return false
			}
		}
	}
	return true
}

// Reads check every destination before touching any: a wrong length or
// count is ErrDestination and a changed shape ErrMismatch, with every buffer
// (all filled with a sentinel) left as it was.
func TestReadNeverWritesPastDestination(t *testing.T) {
	const fill = 0xA5
	for _, lay := range []layout.Layout{layout.Single, layout.Blocks} {
		t.Run(lay.String(), func(t *testing.T) {
			ns := filepath.Join(t.TempDir(), "ns")
			c40 := kvgen.NewCache(kvgen.Tiny, 40, true, nil)
			c48 := kvgen.NewCache(kvgen.Tiny, 48, true, nil)
			h40, _ := mustWrite(t, noSync(), cacheSpec(t, c40, filepath.Join(ns, "t40"), lay, 0))
			h48, _ := mustWrite(t, noSync(), cacheSpec(t, c48, filepath.Join(ns, "t48"), lay, 0))
			path := filepath.Join(ns, "t40")
			read := func(dest [][]byte, expect *layout.Header) error {
				_, _, err := readAt(context.Background(), noSync(), path, &jobs.ReadRequest{Dest: dest, Expect: expect})
				return err
			}
			for _, c := range []struct {
				name   string
				dest   func() [][]byte
				expect *layout.Header
				want   error
				msg    string
			}{
				{"one buffer a byte short", func() [][]byte {
					d := destFor(h40, fill)
					d[2] = d[2][:len(d[2])-1]
					return d
				}, nil, jobs.ErrDestination, "cache 1 tensor 0 (slot 2) has 2560 bytes, its destination 2559"},
				{"one buffer a byte long", func() [][]byte {
					d := destFor(h40, fill)
					d[4] = append(d[4], fill)
					return d
				}, nil, jobs.ErrDestination, "slot 4"},
				{"buffers of the grown cache", func() [][]byte { return destFor(h48, fill) }, nil, jobs.ErrDestination, "slot 0"},
				{"one buffer missing", func() [][]byte { return destFor(h40, fill)[:4] }, nil, jobs.ErrDestination, "has 5 tensors, got 4"},
				{"one buffer too many", func() [][]byte { return append(destFor(h40, fill), []byte{fill}) }, nil, jobs.ErrDestination, "got 6"},
				{"expect a different shape", func() [][]byte { return destFor(h40, fill) }, h48, jobs.ErrMismatch, "[1 2 48 16]"},
				{"expect a different dtype", func() [][]byte { return destFor(h40, fill) }, func() *layout.Header {
					h := h40.Clone()
					h.Caches[0].Tensors[1].DType = "float16"
					return h
				}(), jobs.ErrMismatch, "cache 0 tensor 1 (slot 1) is bfloat16"},
			} {
				dest := c.dest()
				err := read(dest, c.expect)
				if !errors.Is(err, c.want) || !strings.Contains(err.Error(), c.msg) {
					t.Fatalf("%s: got %v, want %v naming %q", c.name, err, c.want, c.msg)
				}
				if !allFilled(dest, fill) {
					t.Fatalf("%s: a destination was written", c.name)
				}
			}
			// The matching expectation reads.
			dest := destFor(h40, fill)
			if err := read(dest, h40.Clone()); err != nil {
				t.Fatal(err)
			}
			mustEqualExpected(t, dest, expectedAll(c40))
		})
	}
}

// TestReadBunWorkerStores reads the files the original worker wrote (single
// file and flat block store), verified with Bun.hash and SHA-256.
func TestReadBunWorkerStores(t *testing.T) {
	root := t.TempDir()
	testutil.CopyTree(t, testutil.BunFixtures, root)
	golden, err := os.ReadFile(filepath.Join(root, "expected.T40.bin"))
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(slices.Concat(testutil.BunFormula(40)...), golden) {
		t.Fatal("the fixture's documented formula disagrees with expected.T40.bin")
	}
	// The fixture's folders become namespaces ("blocks" is not a valid
	// namespace name: it is the blocks directory of a namespace).
	for _, d := range []string{"single", "blocks"} {
		if err := os.Rename(filepath.Join(root, d), filepath.Join(root, "bun-"+d)); err != nil {
			t.Fatal(err)
		}
	}
	for _, c := range []struct {
		path string
		T    int
		lay  layout.Layout
	}{{"bun-single/snapshot.mlxkv", 40, layout.Single}, {"bun-blocks/snapshot.mlxkv", 40, layout.Blocks}, {"bun-blocks/grown.mlxkv", 48, layout.Blocks}} {
		got, snap, m, err := readBack(t, noSync(), filepath.Join(root, c.path), true)
		if err != nil {
			t.Fatalf("%s: %v", c.path, err)
		}
		if !snap.Legacy || snap.Layout != c.lay || m.ReadBytes != int64(len(slices.Concat(testutil.BunFormula(c.T)...))) {
			t.Fatalf("%s: legacy %v layout %v metrics %+v", c.path, snap.Legacy, snap.Layout, m)
		}
		mustEqualExpected(t, got, testutil.BunFormula(c.T))
	}
	// A flipped byte in a Bun single file fails Bun.hash verification.
	snap, err := layout.Load(vfs.Default, filepath.Join(root, "bun-single/snapshot.mlxkv"))
	if err != nil {
		t.Fatal(err)
	}
	flipByte(t, filepath.Join(root, "bun-single/snapshot.mlxkv"), int64(snap.DataStart)+snap.Header.Slots()[1].Off+7)
	if _, _, _, err := readBack(t, noSync(), filepath.Join(root, "bun-single/snapshot.mlxkv"), true); !errors.Is(err, jobs.ErrCorrupt) ||
		!strings.Contains(err.Error(), "slot 1") {
		t.Fatalf("flipped legacy byte: %v", err)
	}
}

// TestCollectBunWorkerStore sweeps the flat legacy block store: with the
// T=40 manifest removed, exactly its unshared blocks go.
func TestCollectBunWorkerStore(t *testing.T) {
	root := t.TempDir()
	ns := filepath.Join(root, "bun")
	testutil.CopyTree(t, testutil.BunFixtures+"/blocks", ns)
	old, err := layout.Load(vfs.Default, filepath.Join(ns, "snapshot.mlxkv"))
	if err != nil {
		t.Fatal(err)
	}
	grown, err := layout.Load(vfs.Default, filepath.Join(ns, "grown.mlxkv"))
	if err != nil {
		t.Fatal(err)
	}
	if n := len(blockFiles(t, ns)); n != 34 {
		t.Fatalf("%d legacy block files, want 34", n)
	}
	if err := os.Remove(filepath.Join(ns, "snapshot.mlxkv")); err != nil {
		t.Fatal(err)
	}
	m, err := collectAt(context.Background(), noSync(), root, &jobs.CollectRequest{})
	if err != nil {
		t.Fatal(err)
	}
	keep := blockSet(grown.Header)
	var want []string
	for h := range blockSet(old.Header) {
		if _, ok := keep[h]; !ok {
			want = append(want, testutil.LegacyBlockPath(ns, h))
		}
	}
	slices.Sort(want)
	// 4 K/V tensors x 2 heads lose their 128-byte tail, plus the token ids.
	if len(want) != 9 || !slices.Equal(m.Collect.Deleted, want) {
		t.Fatalf("deleted %v, want %v", m.Collect.Deleted, want)
	}
	if files := blockFiles(t, ns); !slices.Equal(sortedKeys(files), sortedKeys(keep)) {
		t.Fatalf("left %d blocks, want the %d of grown", len(files), len(keep))
	}
	got, _, _, err := readBack(t, noSync(), filepath.Join(ns, "grown.mlxkv"), true)
	if err != nil {
		t.Fatal(err)
	}
	mustEqualExpected(t, got, testutil.BunFormula(48))
}

// TestReadRefusesSymlinkedDirectories: a read does not follow a symlinked
// fan-out directory, blocks/ directory or namespace, even when the link's
// target holds the right bytes (a hostile store cannot steer a read outside
// the namespace).
func TestReadRefusesSymlinkedDirectories(t *testing.T) {
	root := t.TempDir()
	c := kvgen.NewCache(kvgen.Tiny, 40, true, nil)
	path := filepath.Join(root, "ns", "snap")
	h, _ := mustWrite(t, noSync(), cacheSpec(t, c, path, layout.Blocks, 4096))
	nsDir := filepath.Dir(path)
	fan := filepath.Join(testutil.BlocksDir(nsDir), h.Slots()[0].Blocks[0].Hash[:2])
	moved := filepath.Join(root, "elsewhere")
	if err := os.Rename(fan, moved); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(moved, fan); err != nil {
		t.Fatal(err)
	}
	if _, _, _, err := readBack(t, noSync(), path, true); !errors.Is(err, jobs.ErrInvalidRequest) || !strings.Contains(err.Error(), fan) {
		t.Fatalf("read through a symlinked fan-out directory: got %v, want ErrInvalidRequest naming %s", err, fan)
	}
	// Put it back: the read works again, so the refusal was the symlink's.
	if err := os.Remove(fan); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(moved, fan); err != nil {
		t.Fatal(err)
	}
	got, _, _, err := readBack(t, noSync(), path, true)
	if err != nil {
		t.Fatal(err)
	}
	mustEqualExpected(t, got, expectedAll(c))
	// A symlinked namespace directory is refused as well.
	link := filepath.Join(root, "linked")
	if err := os.Symlink(nsDir, link); err != nil {
		t.Fatal(err)
	}
	if _, _, _, err := readBack(t, noSync(), filepath.Join(link, "snap"), true); !errors.Is(err, jobs.ErrInvalidRequest) {
		t.Fatalf("read through a symlinked namespace: got %v, want ErrInvalidRequest", err)
	}
}
