package recency

import (
	"bytes"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"io"
	"slices"
	"testing"
	"testing/iotest"

	"github.com/kvpersist/kvpersist/engine/layout"
	"github.com/zeebo/xxh3"
)

// key is a distinct page key for index i.
func key(i int) layout.PageKey { return layout.PageKey{byte(i), byte(i >> 8), 0xa5} }

// TestCheckpointBytes pins the format byte by byte against an independent
// construction (the layout in ARCHITECTURE.md).
func TestCheckpointBytes(t *testing.T) {
	recs := []Record{{Key: key(1), Access: 0x0102030405060708}, {Key: key(2), Parent: key(1), HasParent: true, Access: 42}}
	got, err := Append([]byte("prefix"), recs)
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
	if !bytes.Equal(got, want) || int64(len(got)) != Bytes(2) || len(got) != 24+144 {
		t.Fatalf("checkpoint\n got %s\nwant %s", hex.EncodeToString(got), hex.EncodeToString(want))
	}
	dec, err := Decode(got)
	if err != nil || !slices.Equal(dec, recs) {
		t.Fatalf("decode: %v %v", dec, err)
	}
	empty, _ := Append(nil, nil)
	if dec, err := Decode(empty); err != nil || len(dec) != 0 || len(empty) != MinBytes {
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
	good, _ := Append(nil, recs)
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
		if _, err := Decode(b); !errors.Is(err, ErrCheckpoint) {
			t.Errorf("%s: %v, want ErrCheckpoint", name, err)
		}
	}
	if _, err := Append(nil, []Record{{Key: key(2)}, {Key: key(1)}}); !errors.Is(err, ErrInvalid) {
		t.Errorf("encoding unsorted records: %v", err)
	}
	if _, err := Append(nil, []Record{{Key: key(2), Access: -1}}); !errors.Is(err, ErrInvalid) {
		t.Errorf("encoding a negative access: %v", err)
	}
	if _, err := Append(nil, []Record{{Key: key(2), HasParent: true}}); !errors.Is(err, ErrInvalid) {
		t.Errorf("encoding an all-zero parent: %v", err)
	}
}

// FuzzDecode: no input panics; an accepted input re-encodes to
// exactly itself (the format is canonical) and its records are valid.
func FuzzDecode(f *testing.F) {
	for _, n := range []int{0, 1, 3} {
		var recs []Record
		for i := range n {
			recs = append(recs, Record{Key: key(i), Parent: key(i + 7), HasParent: i > 0, Access: int64(i * 1000)})
		}
		b, _ := Append(nil, recs)
		f.Add(b)
	}
	f.Add([]byte("KVPLRU1\n"))
	f.Fuzz(func(t *testing.T, b []byte) {
		recs, err := Decode(b)
		if err != nil {
			if !errors.Is(err, ErrCheckpoint) {
				t.Fatalf("error %v does not wrap ErrCheckpoint", err)
			}
			return
		}
		again, err := Append(nil, recs)
		if err != nil {
			t.Fatalf("decoded records do not encode: %v", err)
		}
		if !bytes.Equal(again, b) {
			t.Fatalf("re-encoding differs from the input")
		}
	})
}

// rawCheckpoint encodes recs byte by byte per the format, without
// Append's checks (so a test can build a file it would refuse).
func rawCheckpoint(recs []Record) []byte {
	b := append([]byte(nil), Magic...)
	b = binary.LittleEndian.AppendUint64(b, uint64(len(recs)))
	for _, r := range recs {
		b = append(b, r.Key[:]...)
		var p layout.PageKey
		if r.HasParent {
			p = r.Parent
		}
		b = append(b, p[:]...)
		b = binary.LittleEndian.AppendUint64(b, uint64(r.Access))
	}
	return binary.LittleEndian.AppendUint64(b, xxh3.Hash(b))
}

// TestCheckpointRefusesParentCycles: a checkpoint whose parent links form a
// cycle (A→B and B→A, or through three records) is ErrCheckpoint, and
// Append refuses to write one (ErrInvalid); a chain whose top
// parent is not among the records, and a tree, decode.
func TestCheckpointRefusesParentCycles(t *testing.T) {
	a, b, c, d := key(1), key(2), key(3), key(4)
	rec := func(k, p layout.PageKey) Record { return Record{Key: k, Parent: p, HasParent: true, Access: 7} }
	cycles := map[string][]Record{
		"two":   {rec(a, b), rec(b, a)},
		"three": {rec(a, c), rec(b, a), rec(c, b)},
		"tail":  {{Key: a, Access: 1}, rec(b, c), rec(c, d), rec(d, b)}, // b→c→d→b, a aside
		"below": {rec(a, b), rec(b, c), rec(c, b)},                      // a hangs below the cycle b↔c
	}
	for name, recs := range cycles {
		if _, err := Decode(rawCheckpoint(recs)); !errors.Is(err, ErrCheckpoint) {
			t.Errorf("%s: decode: %v, want ErrCheckpoint", name, err)
		}
		if _, err := Append(nil, recs); !errors.Is(err, ErrInvalid) {
			t.Errorf("%s: encode: %v, want ErrInvalid", name, err)
		}
	}
	fine := []Record{rec(a, key(9)), rec(b, a), rec(c, a), rec(d, c)}
	got, err := Decode(rawCheckpoint(fine))
	if err != nil || !slices.Equal(got, fine) {
		t.Fatalf("a tree under a missing parent: %v %v", got, err)
	}
}

// panicReader fails the test if a read is attempted.
type panicReader struct{ t *testing.T }

func (r panicReader) Read([]byte) (int, error) {
	r.t.Fatal("read of a checkpoint whose size was refused")
	return 0, nil
}

// TestReadCheckpointSizeCap: a file larger than MaxBytes is
// ErrCheckpoint before anything is read or allocated (a 1 TiB size would
// not fit in memory); a reader holding fewer or more bytes than the size
// is ErrCheckpoint; an exact one decodes.
func TestReadCheckpointSizeCap(t *testing.T) {
	if MaxBytes != 24+72*(1<<23) || Bytes(MaxRecords) != MaxBytes {
		t.Fatalf("MaxBytes %d", int64(MaxBytes))
	}
	for _, size := range []int64{MaxBytes + 1, MaxBytes + 72, 1 << 40, 23, -1} {
		if _, err := Read(panicReader{t}, size); !errors.Is(err, ErrCheckpoint) {
			t.Errorf("size %d: %v, want ErrCheckpoint", size, err)
		}
	}
	if err := CheckSize(MaxBytes); err != nil {
		t.Errorf("the largest checkpoint: %v", err)
	}
	recs := []Record{{Key: key(1), Access: 5}, {Key: key(2), Parent: key(1), HasParent: true, Access: 6}}
	file, err := Append(nil, recs)
	if err != nil {
		t.Fatal(err)
	}
	size := int64(len(file))
	got, err := Read(iotest.OneByteReader(bytes.NewReader(file)), size)
	if err != nil || !slices.Equal(got, recs) {
		t.Fatalf("read back: %v %v", got, err)
	}
	if _, err := Read(bytes.NewReader(file[:size-1]), size); !errors.Is(err, ErrCheckpoint) {
		t.Errorf("a reader shorter than the size: %v", err)
	}
	if _, err := Read(bytes.NewReader(append(slices.Clone(file), 0)), size); !errors.Is(err, ErrCheckpoint) {
		t.Errorf("a reader longer than the size: %v", err)
	}
	boom := errors.New("disk gone")
	if _, err := Read(io.MultiReader(bytes.NewReader(file[:10]), iotest.ErrReader(boom)), size); !errors.Is(err, boom) {
		t.Errorf("a read error: %v", err)
	}
	// A header claiming more records than the cap, in a file of that
	// claimed size, is refused on the size alone.
	big := binary.LittleEndian.AppendUint64([]byte(Magic), MaxRecords+1)
	if _, err := Read(bytes.NewReader(big), Bytes(MaxRecords+1)); !errors.Is(err, ErrCheckpoint) {
		t.Errorf("more records than the cap: %v", err)
	}
}
