package evict

import (
	"bytes"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"math/rand/v2"
	"slices"
	"testing"

	"github.com/zeebo/xxh3"
)

// TestCheckpointBytes pins the format byte by byte against an independent
// construction (the layout in ARCHITECTURE.md).
func TestCheckpointBytes(t *testing.T) {
	recs := []Record{{Key: key(1), Access: 0x0102030405060708}, {Key: key(2), Parent: key(1), HasParent: true, Access: 42}}
	got, err := AppendCheckpoint([]byte("prefix"), recs)
	if err != nil {
		t.Fatal(err)
	}
	if string(got[:6]) != "prefix" {
		t.Fatal("dst clobbered")
	}
	got = got[6:]
	var want []byte
	want = append(want, 0x4b, 0x56, 0x50, 0x4c, 0x52, 0x55, 0x31, 0x0a) // "KVPLRU1\n"
	want = append(want, 2, 0, 0, 0, 0, 0, 0, 0)
	want = append(want, recs[0].Key[:]...)
	want = append(want, make([]byte, 32)...) // no parent
	want = append(want, 8, 7, 6, 5, 4, 3, 2, 1)
	want = append(want, recs[1].Key[:]...)
	want = append(want, recs[0].Key[:]...) // its parent
	want = append(want, 42, 0, 0, 0, 0, 0, 0, 0)
	h := xxh3.Hash(want)
	for i := range 8 {
		want = append(want, byte(h>>(8*i)))
	}
	if !bytes.Equal(got, want) || int64(len(got)) != CheckpointBytes(2) || len(got) != 24+144 {
		t.Fatalf("checkpoint\n got %s\nwant %s", hex.EncodeToString(got), hex.EncodeToString(want))
	}
	dec, err := DecodeCheckpoint(got)
	if err != nil || !slices.Equal(dec, recs) {
		t.Fatalf("decode: %v %v", dec, err)
	}
	empty, _ := AppendCheckpoint(nil, nil)
	if dec, err := DecodeCheckpoint(empty); err != nil || len(dec) != 0 || len(empty) != CheckpointMinBytes {
		t.Fatalf("empty checkpoint: %d bytes, %v %v", len(empty), dec, err)
	}
}

// rehash recomputes the trailing hash after a test edits the body.
func rehash(b []byte) []byte {
	body := len(b) - 8
	binary.LittleEndian.PutUint64(b[body:], xxh3.Hash(b[:body]))
	return b
}

func TestCheckpointRejects(t *testing.T) {
	recs := []Record{{Key: key(1), Access: 5}, {Key: key(2), Access: 6}, {Key: key(3), Access: 7}}
	good, _ := AppendCheckpoint(nil, recs)
	edit := func(f func(b []byte) []byte) []byte { return f(slices.Clone(good)) }
	cases := map[string][]byte{
		"empty":           nil,
		"short":           good[:23],
		"magic":           edit(func(b []byte) []byte { b[0] = 'X'; return rehash(b) }),
		"count too big":   edit(func(b []byte) []byte { binary.LittleEndian.PutUint64(b[8:], 1<<62); return b }),
		"count too small": edit(func(b []byte) []byte { binary.LittleEndian.PutUint64(b[8:], 2); return rehash(b) }),
		"truncated":       good[:len(good)-1],
		"trailing byte":   append(slices.Clone(good), 0),
		"hash":            edit(func(b []byte) []byte { b[20] ^= 1; return b }),
		"duplicate key":   edit(func(b []byte) []byte { copy(b[16+72:16+104], b[16:48]); return rehash(b) }),
		"own parent":      edit(func(b []byte) []byte { copy(b[48:80], b[16:48]); return rehash(b) }),
		"descending":      edit(func(b []byte) []byte { b[16] = 9; return rehash(b) }),
		"negative access": edit(func(b []byte) []byte {
			binary.LittleEndian.PutUint64(b[16+64:], 1<<63)
			return rehash(b)
		}),
	}
	for name, b := range cases {
		if _, err := DecodeCheckpoint(b); !errors.Is(err, ErrCheckpoint) {
			t.Errorf("%s: %v, want ErrCheckpoint", name, err)
		}
	}
	if _, err := AppendCheckpoint(nil, []Record{{Key: key(2)}, {Key: key(1)}}); !errors.Is(err, ErrInvalid) {
		t.Errorf("encoding unsorted records: %v", err)
	}
	if _, err := AppendCheckpoint(nil, []Record{{Key: key(2), Access: -1}}); !errors.Is(err, ErrInvalid) {
		t.Errorf("encoding a negative access: %v", err)
	}
	if _, err := AppendCheckpoint(nil, []Record{{Key: key(2), HasParent: true}}); !errors.Is(err, ErrInvalid) {
		t.Errorf("encoding an all-zero parent: %v", err)
	}
}

// FuzzDecodeCheckpoint: no input panics; an accepted input re-encodes to
// exactly itself (the format is canonical) and its records are valid.
func FuzzDecodeCheckpoint(f *testing.F) {
	for _, n := range []int{0, 1, 3} {
		var recs []Record
		for i := range n {
			recs = append(recs, Record{Key: key(i), Parent: key(i + 7), HasParent: i > 0, Access: int64(i * 1000)})
		}
		b, _ := AppendCheckpoint(nil, recs)
		f.Add(b)
	}
	f.Add([]byte("KVPLRU1\n"))
	f.Fuzz(func(t *testing.T, b []byte) {
		recs, err := DecodeCheckpoint(b)
		if err != nil {
			if !errors.Is(err, ErrCheckpoint) {
				t.Fatalf("error %v does not wrap ErrCheckpoint", err)
			}
			return
		}
		again, err := AppendCheckpoint(nil, recs)
		if err != nil {
			t.Fatalf("decoded records do not encode: %v", err)
		}
		if !bytes.Equal(again, b) {
			t.Fatalf("re-encoding differs from the input")
		}
	})
}

// drain returns the order in which the cache evicts every evictable page
// (Shrink to 0, each victim removed as it goes).
func drain(c *Cache) []Victim {
	vs, _ := c.Shrink(0, nil)
	for _, v := range vs {
		c.Removed(v.Namespace, v.Key)
	}
	return vs
}

// TestRestartPreservesEvictionOrder: an engine's cache sees writes and then
// touches in random order; a restart rebuilds the pages from the "disk"
// (Access = mtime, the write time) and applies the checkpoint written at
// Close. The rebuilt cache evicts in exactly the order the original would
// have; without the checkpoint (mtimes only) the order differs.
func TestRestartPreservesEvictionOrder(t *testing.T) {
	rng := rand.New(rand.NewPCG(3, 4))
	orig, _ := New(Config{})
	type onDisk struct {
		p     Page
		mtime int64
	}
	var disk []onDisk
	now := int64(1_700_000_000_000_000_000)
	nss := []string{"a", "b"}
	for conv := range 40 {
		ns := nss[conv%2]
		var parent Key
		for i := range 1 + rng.IntN(5) {
			now += 1000
			k := Key{byte(conv), byte(i), 0x42}
			p := Page{Namespace: ns, Key: k, Bytes: 4096, Access: now}
			if i > 0 {
				p.Parent, p.HasParent = parent, true
			}
			if err := orig.Add(p); err != nil {
				t.Fatal(err)
			}
			disk = append(disk, onDisk{p, now})
			parent = k
		}
	}
	for range 300 { // loads touch random pages later
		now += 1000
		d := disk[rng.IntN(len(disk))]
		orig.Touch(d.p.Namespace, d.p.Key, now)
	}
	// Close: one checkpoint per namespace, encoded and decoded.
	files := map[string][]byte{}
	for _, ns := range nss {
		b, err := AppendCheckpoint(nil, orig.Checkpoint(ns, nil))
		if err != nil {
			t.Fatal(err)
		}
		files[ns] = b
	}
	// A restart lists the files (key, bytes, mtime: no open); with a
	// checkpoint each page's parent comes from it, without one from the
	// page's header.
	rebuild := func(withCheckpoint bool) *Cache {
		c, _ := New(Config{})
		recs := map[string][]Record{}
		parents := map[Key]Record{}
		if withCheckpoint {
			for _, ns := range nss {
				r, err := DecodeCheckpoint(files[ns])
				if err != nil {
					t.Fatal(err)
				}
				recs[ns] = r
				for _, rec := range r {
					parents[rec.Key] = rec
				}
			}
		}
		for _, i := range rng.Perm(len(disk)) { // readdir order is arbitrary
			d := disk[i]
			p := Page{Namespace: d.p.Namespace, Key: d.p.Key, Bytes: d.p.Bytes, Access: d.mtime}
			if rec, ok := parents[p.Key]; ok {
				p.Parent, p.HasParent = rec.Parent, rec.HasParent
			} else {
				if withCheckpoint {
					t.Fatalf("page %s not in the checkpoint", p.Key)
				}
				p.Parent, p.HasParent = d.p.Parent, d.p.HasParent // read from the header
			}
			if err := c.Add(p); err != nil {
				t.Fatal(err)
			}
		}
		for ns, r := range recs {
			if n := c.ApplyCheckpoint(ns, r, now); n != len(r) {
				t.Fatalf("applied %d of %d records", n, len(r))
			}
		}
		return c
	}
	restarted, mtimesOnly := rebuild(true), rebuild(false)
	want := drain(orig)
	if len(want) != len(disk) {
		t.Fatalf("drained %d of %d pages", len(want), len(disk))
	}
	if got := drain(restarted); !slices.Equal(got, want) {
		t.Fatalf("eviction order after a restart with the checkpoint differs:\n got %v\nwant %v", victimKeys(got), victimKeys(want))
	}
	if got := drain(mtimesOnly); slices.Equal(got, want) {
		t.Fatal("mtimes alone gave the same order: the test does not show the checkpoint's effect")
	}
}
