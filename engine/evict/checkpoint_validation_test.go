package evict

import (
	"bytes"
	"encoding/binary"
	"errors"
	"io"
	"slices"
	"testing"
	"testing/iotest"

	"github.com/zeebo/xxh3"
)

// rawCheckpoint encodes recs byte by byte per the format, without
// AppendCheckpoint's checks (so a test can build a file it would refuse).
func rawCheckpoint(recs []Record) []byte {
	b := append([]byte(nil), CheckpointMagic...)
	b = binary.LittleEndian.AppendUint64(b, uint64(len(recs)))
	for _, r := range recs {
		b = append(b, r.Key[:]...)
		var p Key
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
// AppendCheckpoint refuses to write one (ErrInvalid); a chain whose top
// parent is not among the records, and a tree, decode.
func TestCheckpointRefusesParentCycles(t *testing.T) {
	a, b, c, d := key(1), key(2), key(3), key(4)
	rec := func(k, p Key) Record { return Record{Key: k, Parent: p, HasParent: true, Access: 7} }
	cycles := map[string][]Record{
		"two":   {rec(a, b), rec(b, a)},
		"three": {rec(a, c), rec(b, a), rec(c, b)},
		"tail":  {{Key: a, Access: 1}, rec(b, c), rec(c, d), rec(d, b)}, // b→c→d→b, a aside
		"below": {rec(a, b), rec(b, c), rec(c, b)},                      // a hangs below the cycle b↔c
	}
	for name, recs := range cycles {
		if _, err := DecodeCheckpoint(rawCheckpoint(recs)); !errors.Is(err, ErrCheckpoint) {
			t.Errorf("%s: decode: %v, want ErrCheckpoint", name, err)
		}
		if _, err := AppendCheckpoint(nil, recs); !errors.Is(err, ErrInvalid) {
			t.Errorf("%s: encode: %v, want ErrInvalid", name, err)
		}
	}
	fine := []Record{rec(a, key(9)), rec(b, a), rec(c, a), rec(d, c)}
	got, err := DecodeCheckpoint(rawCheckpoint(fine))
	if err != nil || !slices.Equal(got, fine) {
		t.Fatalf("a tree under a missing parent: %v %v", got, err)
	}
}

// TestAddRefusesOwnAncestor: pages whose parents (taken from a checkpoint
// at a restart) would form a cycle are refused (ErrInvalid) instead of
// becoming unevictable: with B→A refused after A→B, A is a leaf and a
// Reserve can evict it. Commit refuses the same.
func TestAddRefusesOwnAncestor(t *testing.T) {
	c, _ := New(Config{CapacityBytes: 100})
	a, b, r := key(1), key(2), key(3)
	for _, p := range []Page{
		{Namespace: "n", Key: r, Bytes: 10, Access: 9},
		{Namespace: "n", Key: a, Parent: b, HasParent: true, Bytes: 40, Access: 2},
	} {
		if err := c.Add(p); err != nil {
			t.Fatal(err)
		}
	}
	if err := c.Add(Page{Namespace: "n", Key: b, Parent: a, HasParent: true, Bytes: 40, Access: 3}); !errors.Is(err, ErrInvalid) {
		t.Fatalf("Add of B under A, with A under B: %v, want ErrInvalid", err)
	}
	if _, ok := c.Lookup("n", b); ok {
		t.Fatal("the refused page is tracked")
	}
	res, err := c.Reserve(Want{Namespace: "n", Bytes: 80})
	if err != nil {
		t.Fatalf("Reserve with A a leaf: %v", err)
	}
	if len(res.Victims) != 1 || res.Victims[0].Key != a {
		t.Fatalf("victims %v, want A (its parent B is not tracked)", res.Victims)
	}
	c.Removed("n", a)
	// A save's Commit: X under Y, then Y under X.
	x, y := key(5), key(6)
	if err := res.Commit(Page{Namespace: "n", Key: x, Parent: y, HasParent: true, Bytes: 10, Access: 4}); err != nil {
		t.Fatal(err)
	}
	if err := res.Commit(Page{Namespace: "n", Key: y, Parent: x, HasParent: true, Bytes: 10, Access: 5}); !errors.Is(err, ErrInvalid) {
		t.Fatalf("Commit of Y under X, with X under Y: %v, want ErrInvalid", err)
	}
	res.Release()
	if u := c.Usage(); u.Pages != 2 || u.UsedBytes != 20 {
		t.Fatalf("usage %+v, want R and X: 2 pages, 20 bytes", u)
	}
}

// TestApplyCheckpointClampsFutureAccess: a checkpoint written while the
// clock ran ahead records accesses after the restart's now; they count as
// now, so a page touched after the restart is newer and outlives it.
func TestApplyCheckpointClampsFutureAccess(t *testing.T) {
	const now = int64(1_000_000)
	c, _ := New(Config{})
	x, y := key(1), key(2)
	for _, p := range []Page{{Namespace: "n", Key: x, Bytes: 1, Access: 100}, {Namespace: "n", Key: y, Bytes: 1, Access: 200}} {
		if err := c.Add(p); err != nil {
			t.Fatal(err)
		}
	}
	recs := []Record{{Key: x, Access: now + 3_600_000_000_000}, {Key: y, Access: 150}} // x: an hour ahead
	if n := c.ApplyCheckpoint("n", recs, now); n != 2 {
		t.Fatalf("matched %d records, want 2", n)
	}
	if p, _ := c.Lookup("n", x); p.Access != now {
		t.Fatalf("x's access %d, want it clamped to now %d", p.Access, now)
	}
	if p, _ := c.Lookup("n", y); p.Access != 200 {
		t.Fatalf("y's access %d, want its mtime 200 (the record is older)", p.Access)
	}
	c.Touch("n", y, now+1)
	if got := drain(c); len(got) != 2 || got[0].Key != x || got[1].Key != y {
		t.Fatalf("eviction order %v, want x (clamped to now) before y (touched after now)", victimKeys(got))
	}
}

// panicReader fails the test if a read is attempted.
type panicReader struct{ t *testing.T }

func (r panicReader) Read([]byte) (int, error) {
	r.t.Fatal("read of a checkpoint whose size was refused")
	return 0, nil
}

// TestReadCheckpointSizeCap: a file larger than MaxCheckpointBytes is
// ErrCheckpoint before anything is read or allocated (a 1 TiB size would
// not fit in memory); a reader holding fewer or more bytes than the size
// is ErrCheckpoint; an exact one decodes.
func TestReadCheckpointSizeCap(t *testing.T) {
	if MaxCheckpointBytes != 24+72*(1<<23) || CheckpointBytes(MaxCheckpointRecords) != MaxCheckpointBytes {
		t.Fatalf("MaxCheckpointBytes %d", int64(MaxCheckpointBytes))
	}
	for _, size := range []int64{MaxCheckpointBytes + 1, MaxCheckpointBytes + 72, 1 << 40, 23, -1} {
		if _, err := ReadCheckpoint(panicReader{t}, size); !errors.Is(err, ErrCheckpoint) {
			t.Errorf("size %d: %v, want ErrCheckpoint", size, err)
		}
	}
	if err := CheckCheckpointSize(MaxCheckpointBytes); err != nil {
		t.Errorf("the largest checkpoint: %v", err)
	}
	recs := []Record{{Key: key(1), Access: 5}, {Key: key(2), Parent: key(1), HasParent: true, Access: 6}}
	file, err := AppendCheckpoint(nil, recs)
	if err != nil {
		t.Fatal(err)
	}
	size := int64(len(file))
	got, err := ReadCheckpoint(iotest.OneByteReader(bytes.NewReader(file)), size)
	if err != nil || !slices.Equal(got, recs) {
		t.Fatalf("read back: %v %v", got, err)
	}
	if _, err := ReadCheckpoint(bytes.NewReader(file[:size-1]), size); !errors.Is(err, ErrCheckpoint) {
		t.Errorf("a reader shorter than the size: %v", err)
	}
	if _, err := ReadCheckpoint(bytes.NewReader(append(slices.Clone(file), 0)), size); !errors.Is(err, ErrCheckpoint) {
		t.Errorf("a reader longer than the size: %v", err)
	}
	boom := errors.New("disk gone")
	if _, err := ReadCheckpoint(io.MultiReader(bytes.NewReader(file[:10]), iotest.ErrReader(boom)), size); !errors.Is(err, boom) {
		t.Errorf("a read error: %v", err)
	}
	// A header claiming more records than the cap, in a file of that
	// claimed size, is refused on the size alone.
	big := binary.LittleEndian.AppendUint64([]byte(CheckpointMagic), MaxCheckpointRecords+1)
	if _, err := ReadCheckpoint(bytes.NewReader(big), CheckpointBytes(MaxCheckpointRecords+1)); !errors.Is(err, ErrCheckpoint) {
		t.Errorf("more records than the cap: %v", err)
	}
}
