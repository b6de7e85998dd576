package pagecache

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/kvpersist/kvpersist/engine/evict"
	"github.com/kvpersist/kvpersist/engine/vfs"
)

// TestPageLogRecords: records appended by one end are read back equal by
// another, each once; a record cut short (an append in progress) waits;
// a record that does not check, a replaced log (another generation) and a
// log shorter than the offset ask for a resync from the disk.
func TestPageLogRecords(t *testing.T) {
	root := t.TempDir()
	w, r := newPageLog(vfs.Default, root), newPageLog(vfs.Default, root)
	if recs, resync, err := r.read(); err != nil || resync || len(recs) != 0 {
		t.Fatalf("no log yet: %v %v %v", recs, resync, err)
	}
	k, p := evict.Key{1, 2, 3}, evict.Key{9}
	want := []logRecord{
		{op: opAdd, ns: "ns-a", key: k, parent: p, hasParent: true, bytes: 4096, access: 17},
		{op: opAdd, ns: "b", key: p, bytes: 8192, access: 18},
		{op: opAccess, ns: "ns-a", key: k, access: 99},
		{op: opReserved, ns: "b", owner: 7<<32 | 5, bytes: -12288},
		{op: opRemove, ns: "ns-a", key: k},
	}
	if _, err := w.append(want[:2]); err != nil {
		t.Fatal(err)
	}
	if _, err := w.append(want[2:]); err != nil {
		t.Fatal(err)
	}
	got, resync, err := r.read()
	if err != nil || resync || len(got) != len(want) {
		t.Fatalf("read %d records (resync %v, %v), want %d", len(got), resync, err, len(want))
	}
	for i := range want {
		if got[i] != want[i] {
			t.Fatalf("record %d: %+v, want %+v", i, got[i], want[i])
		}
	}
	if again, _, _ := r.read(); len(again) != 0 {
		t.Fatalf("read again: %d records, want none", len(again))
	}
	path := filepath.Join(root, ".pagelog")
	// Half a record at the end: nothing yet.
	half := appendLogRecord(nil, want[0])
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_APPEND, 0)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := f.Write(half[:10]); err != nil {
		t.Fatal(err)
	}
	if recs, resync, err := r.read(); err != nil || resync || len(recs) != 0 {
		t.Fatalf("half a record: %v %v %v", recs, resync, err)
	}
	// Its rest, with a flipped byte: resync.
	rest := append([]byte(nil), half[10:]...)
	rest[5] ^= 1
	if _, err := f.Write(rest); err != nil {
		t.Fatal(err)
	}
	f.Close()
	if _, resync, _ := r.read(); !resync {
		t.Fatal("a record that does not check: no resync")
	}
	// Replaced by compaction: another generation, resync, then new records.
	if err := w.compact(); err != nil {
		t.Fatal(err)
	}
	if _, resync, _ := r.read(); !resync {
		t.Fatal("a replaced log: no resync")
	}
	if _, err := w.append(want[4:]); err != nil {
		t.Fatal(err)
	}
	if got, resync, err := r.read(); err != nil || resync || len(got) != 1 || got[0] != want[4] {
		t.Fatalf("after the replacement: %v %v %v", got, resync, err)
	}
}
