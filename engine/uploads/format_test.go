package uploads_test

import (
	"bytes"
	"encoding/binary"
	"errors"
	"maps"
	"slices"
	"testing"

	"github.com/zeebo/xxh3"

	"github.com/kvpersist/kvpersist/engine/layout"
	"github.com/kvpersist/kvpersist/engine/uploads"
)

// The journal's bytes: snapshot and record encoding, decoding of hostile,
// torn and damaged files, and the documented format as an independent
// reader (tableDecode) sees it.

// TestJournalRoundTrip: a journal decodes to the sorted keys and names it
// was made of, its layout is the documented one (magic, counts, 32-byte
// keys, length-prefixed names, XXH3-64 of the rest), and it is canonical.
func TestJournalRoundTrip(t *testing.T) {
	keys := testKeys(5)
	names := []string{"zeta", "conv-1", "a.b_c"}
	b := uploads.EncodeSnapshot(slices.Clone(keys), slices.Clone(names))
	wantLen := 16 + 32*5 + (1 + 4) + (1 + 6) + (1 + 5) + 8
	if len(b) != wantLen || string(b[:8]) != "KVPUPL1\n" || binary.LittleEndian.Uint32(b[8:]) != 5 || binary.LittleEndian.Uint32(b[12:]) != 3 {
		t.Fatalf("journal of %d bytes, head %q; want %d bytes, magic, 5 pages, 3 manifests", len(b), b[:16], wantLen)
	}
	if binary.LittleEndian.Uint64(b[len(b)-8:]) != xxh3.Hash(b[:len(b)-8]) {
		t.Fatal("trailing hash is not XXH3-64 of the bytes before it")
	}
	pages, manifests, err := decodeJournal(b)
	if err != nil {
		t.Fatal(err)
	}
	slices.SortFunc(keys, func(a, b layout.PageKey) int { return bytes.Compare(a[:], b[:]) })
	slices.Sort(names)
	if !slices.Equal(pages, keys) || !slices.Equal(manifests, names) {
		t.Fatalf("decoded %v %v, want %v %v", pages, manifests, keys, names)
	}
	if !bytes.Equal(uploads.EncodeSnapshot(pages, manifests), b) {
		t.Fatal("not canonical: re-encoding differs")
	}
	empty := uploads.EncodeSnapshot(nil, nil)
	if p, m, err := decodeJournal(empty); err != nil || len(p)+len(m) != 0 || len(empty) != 24 {
		t.Fatalf("empty journal: %d bytes, %v %v %v", len(empty), p, m, err)
	}
}

// TestJournalHostile: every malformed journal is uploads.ErrJournal, never a
// panic or an allocation beyond the file's size.
func TestJournalHostile(t *testing.T) {
	keys := testKeys(3)
	good := uploads.EncodeSnapshot(slices.Clone(keys), []string{"a", "b"})
	edit := func(f func(b []byte) []byte) []byte { return f(bytes.Clone(good)) }
	cases := map[string][]byte{
		"empty":      nil,
		"short":      good[:23],
		"magic":      edit(func(b []byte) []byte { b[0] = 'X'; return rehash(b) }),
		"hash":       edit(func(b []byte) []byte { b[20] ^= 1; return b }),
		"truncated":  rehash(good[:len(good)-3]),
		"huge-pages": edit(func(b []byte) []byte { binary.LittleEndian.PutUint32(b[8:], 1<<31); return rehash(b) }),
		"huge-names": edit(func(b []byte) []byte { binary.LittleEndian.PutUint32(b[12:], 1<<20); return rehash(b) }),
		"more-pages": edit(func(b []byte) []byte { binary.LittleEndian.PutUint32(b[8:], 4); return rehash(b) }),
		"fewer-names": edit(func(b []byte) []byte {
			binary.LittleEndian.PutUint32(b[12:], 1)
			return rehash(b)
		}),
		"unsorted-pages": rehash(func() []byte {
			b := bytes.Clone(good)
			var a [32]byte
			copy(a[:], b[16:48])
			copy(b[16:48], b[48:80])
			copy(b[48:80], a[:])
			return b
		}()),
		"duplicate-names": edit(func(b []byte) []byte { b[len(b)-9] = 'a'; return rehash(b) }),
		"bad-name":        edit(func(b []byte) []byte { b[len(b)-9] = '/'; return rehash(b) }),
		"zero-length-name": edit(func(b []byte) []byte {
			b[16+32*3] = 0
			return rehash(b)
		}),
	}
	for name, b := range cases {
		if p, m, err := decodeJournal(b); !errors.Is(err, uploads.ErrJournal) {
			t.Errorf("%s: decoded %d pages %d manifests, err %v; want uploads.ErrJournal", name, len(p), len(m), err)
		}
	}
}

// FuzzDecodeJournal: the snapshot decoder never panics, and whatever it
// accepts re-encodes to the same bytes (the format is canonical).
func FuzzDecodeJournal(f *testing.F) {
	f.Add(uploads.EncodeSnapshot(testKeys(3), []string{"a", "conv-1"}))
	f.Add(uploads.EncodeSnapshot(nil, nil))
	f.Add([]byte("KVPUPL1\n"))
	f.Fuzz(func(t *testing.T, b []byte) {
		p, m, end, err := uploads.DecodeSnapshot(b)
		if err != nil {
			if !errors.Is(err, uploads.ErrJournal) {
				t.Fatalf("error %v is not uploads.ErrJournal", err)
			}
			return
		}
		if !bytes.Equal(uploads.EncodeSnapshot(p, m), b[:end]) {
			t.Fatal("accepted a snapshot that does not re-encode to itself")
		}
	})
}

// TestJournalRecordsReplay: a snapshot followed by records replays in
// order (queued adds, settled removes); the encoder's records are the
// documented bytes; a file of records alone (no snapshot) replays too.
func TestJournalRecordsReplay(t *testing.T) {
	k := testKeys(4)
	b := uploads.EncodeSnapshot([]layout.PageKey{k[0], k[1]}, []string{"m1"})
	recs := [][]byte{
		record(uploads.OpPageQueued, k[2][:]), record(uploads.OpPageSettled, k[0][:]), record(uploads.OpManifestQueued, []byte("m2")),
		record(uploads.OpManifestSettled, []byte("m1")), record(uploads.OpPageQueued, k[3][:]), record(uploads.OpPageSettled, k[3][:]),
	}
	mine := uploads.AppendRecord(uploads.AppendRecord(nil, uploads.OpPageQueued, k[2][:]), uploads.OpManifestSettled, []byte("m1"))
	if !bytes.Equal(mine, append(slices.Clone(recs[0]), recs[3]...)) {
		t.Fatalf("uploads.AppendRecord's bytes differ from the documented record")
	}
	for _, r := range recs {
		b = append(b, r...)
	}
	s, ignored, problem, records := uploads.Decode(b)
	pages, names := listOf(s)
	if ignored != 0 || problem != nil || !records {
		t.Fatalf("ignored %d bytes (%v), records %v", ignored, problem, records)
	}
	if want := sortedKeys(k[1], k[2]); !slices.Equal(pages, want) || !slices.Equal(names, []string{"m2"}) {
		t.Fatalf("replayed %x %v, want %x [m2]", pages, names, want)
	}
	alone := slices.Concat(recs...)
	s, ignored, _, _ = uploads.Decode(alone)
	if pages, names := listOf(s); ignored != 0 || !slices.Equal(pages, sortedKeys(k[2])) || !slices.Equal(names, []string{"m2"}) {
		t.Fatalf("records alone: %x %v, %d ignored", pages, names, ignored)
	}
	if _, _, _, records := uploads.Decode(uploads.EncodeSnapshot(slices.Clone(k), nil)); records {
		t.Fatal("a snapshot alone reported records")
	}
}

// TestJournalTornAndDamagedRecords: a torn last record (any cut), garbage
// between records and records that are well framed but hostile (a bad op,
// a bad length, an invalid name, a wrong hash) are skipped, counted and
// reported as uploads.ErrJournal; every good record before and after them is
// replayed. A snapshot that fails its checks is skipped the same way and
// the records after it are still read.
func TestJournalTornAndDamagedRecords(t *testing.T) {
	k := testKeys(3)
	good := slices.Concat(record(uploads.OpPageQueued, k[0][:]), record(uploads.OpManifestQueued, []byte("m")))
	last := record(uploads.OpPageQueued, k[1][:])
	for cut := 1; cut < len(last); cut++ {
		b := slices.Concat(good, last[:cut])
		s, ignored, problem, _ := uploads.Decode(b)
		pages, names := listOf(s)
		if ignored != cut || !errors.Is(problem, uploads.ErrJournal) || !slices.Equal(pages, k[:1]) || !slices.Equal(names, []string{"m"}) {
			t.Fatalf("cut at %d: %x %v, %d ignored (%v)", cut, pages, names, ignored, problem)
		}
		// A record appended after the torn one is read (another engine
		// appends to a file whose last record a crash tore).
		s, _, _, _ = uploads.Decode(slices.Concat(b, last))
		if pages, _ := listOf(s); !slices.Equal(pages, sortedKeys(k[0], k[1])) {
			t.Fatalf("cut at %d, then appended: %x", cut, pages)
		}
	}
	badHash := record(uploads.OpPageQueued, k[2][:])
	badHash[10] ^= 1
	hostile := [][]byte{
		[]byte("garbage between records"),
		record(9, k[2][:]),                               // no such op
		record(uploads.OpPageQueued, k[2][:31]),          // a page op of 31 bytes
		record(uploads.OpManifestQueued, []byte("../x")), // not a valid name
		record(uploads.OpManifestQueued, nil),            // empty name
		badHash,
	}
	for i, h := range hostile {
		b := slices.Concat(good, h, last)
		s, ignored, problem, _ := uploads.Decode(b)
		pages, names := listOf(s)
		if ignored != len(h) || !errors.Is(problem, uploads.ErrJournal) || !slices.Equal(pages, sortedKeys(k[0], k[1])) || !slices.Equal(names, []string{"m"}) {
			t.Fatalf("hostile %d: %x %v, %d ignored of %d (%v)", i, pages, names, ignored, len(h), problem)
		}
	}
	snap := uploads.EncodeSnapshot([]layout.PageKey{k[2]}, nil)
	snap[20] ^= 1
	s, ignored, problem, _ := uploads.Decode(slices.Concat(snap, good))
	if pages, _ := listOf(s); ignored != len(snap) || !errors.Is(problem, uploads.ErrJournal) || !slices.Equal(pages, k[:1]) {
		t.Fatalf("bad snapshot: %x, %d ignored (%v)", pages, ignored, problem)
	}
}

// FuzzDecodeJournalFile: the file decoder never panics; it reports a
// problem exactly when it ignored bytes; what it replays, written as a
// snapshot, replays to the same set; and a record appended to any bytes
// (a torn tail, garbage) is read.
func FuzzDecodeJournalFile(f *testing.F) {
	k := testKeys(2)
	f.Add(slices.Concat(uploads.EncodeSnapshot(testKeys(3), []string{"a"}), record(uploads.OpPageSettled, k[0][:]), record(uploads.OpManifestQueued, []byte("b"))))
	f.Add(record(uploads.OpPageQueued, k[1][:])[:20])
	f.Add([]byte("UPR\nUPR\n"))
	f.Fuzz(func(t *testing.T, b []byte) {
		s, ignored, problem, _ := uploads.Decode(b)
		if (ignored > 0) != (problem != nil) || (problem != nil && !errors.Is(problem, uploads.ErrJournal)) {
			t.Fatalf("ignored %d, problem %v", ignored, problem)
		}
		pages, names := listOf(s)
		s2, ignored2, _, records := uploads.Decode(uploads.EncodeSnapshot(slices.Clone(pages), slices.Clone(names)))
		p2, n2 := listOf(s2)
		if ignored2 != 0 || records || !slices.Equal(p2, pages) || !slices.Equal(n2, names) {
			t.Fatal("the replayed set does not survive a compaction")
		}
		s3, _, _, _ := uploads.Decode(slices.Concat(b, record(uploads.OpPageQueued, k[1][:]), record(uploads.OpManifestSettled, []byte("a"))))
		if !s3.Pages[k[1]] || s3.Manifests["a"] {
			t.Fatal("a record appended after these bytes was not read")
		}
	})
}

// tableDecode replays a journal from docs/format/uploads-journal.md
// alone, written without uploads.Decode:
// the snapshot when the file begins with its magic and passes the checks
// listed there, else none; then, from the snapshot's end (or offset 0),
// every valid record in order, and at an invalid one a skip to the next
// occurrence of the record magic after its first byte.
func tableDecode(b []byte) (pages map[layout.PageKey]bool, names map[string]bool) {
	pages, names = map[layout.PageKey]bool{}, map[string]bool{}
	le := binary.LittleEndian
	off := 0
	if len(b) >= 24 && string(b[:8]) == "KVPUPL1\n" {
		p, m := int64(le.Uint32(b[8:])), int64(le.Uint32(b[12:]))
		ok := p <= 1<<21 && m <= 1<<16 && 16+32*p+2*m+8 <= int64(len(b))
		var ks []layout.PageKey
		var ns []string
		o := 16
		for i := 0; ok && i < int(p); i++ {
			k := layout.PageKey(b[o : o+32])
			ok = i == 0 || bytes.Compare(ks[i-1][:], k[:]) < 0
			ks = append(ks, k)
			o += 32
		}
		for i := 0; ok && i < int(m); i++ {
			if o >= len(b)-8 {
				ok = false
				break
			}
			l := int(b[o])
			if l < 1 || l > 200 || o+1+l > len(b)-8 {
				ok = false
				break
			}
			n := string(b[o+1 : o+1+l])
			ok = layout.ValidName("snapshot", n) == nil && (i == 0 || ns[i-1] < n)
			ns = append(ns, n)
			o += 1 + l
		}
		if ok && le.Uint64(b[o:]) == xxh3.Hash(b[:o]) {
			for _, k := range ks {
				pages[k] = true
			}
			for _, n := range ns {
				names[n] = true
			}
			off = o + 8
		}
	}
	for off < len(b) {
		r := b[off:]
		valid := len(r) >= 14 && string(r[:4]) == "UPR\n" && r[4] >= 1 && r[4] <= 4
		var l int
		if valid {
			l = int(r[5])
			page := r[4] == 1 || r[4] == 2
			valid = (page && l == 32 || !page && l >= 1 && l <= 200) && 14+l <= len(r) &&
				le.Uint64(r[6+l:]) == xxh3.Hash(r[:6+l]) && (page || layout.ValidName("snapshot", string(r[6:6+l])) == nil)
		}
		if !valid {
			next := bytes.Index(r[1:], []byte("UPR\n"))
			if next < 0 {
				break
			}
			off += 1 + next
			continue
		}
		// Ops 1 and 3 queue (add), 2 and 4 settle (remove).
		if queued, p := r[4]%2 == 1, r[6:6+l]; r[4] <= 2 && queued {
			pages[layout.PageKey(p)] = true
		} else if r[4] <= 2 {
			delete(pages, layout.PageKey(p))
		} else if queued {
			names[string(p)] = true
		} else {
			delete(names, string(p))
		}
		off += 14 + l
	}
	return pages, names
}

// FuzzJournalTable: the decoder replays every input as the documented
// format says (tableDecode), so the tables are precise enough for an
// independent reader.
func FuzzJournalTable(f *testing.F) {
	k := testKeys(4)
	snap := uploads.EncodeSnapshot(testKeys(3), []string{"a", "b-1"})
	f.Add(slices.Concat(snap, record(uploads.OpPageSettled, k[0][:]), record(uploads.OpManifestQueued, []byte("c")), []byte("UPR\n\x01"), record(uploads.OpPageQueued, k[3][:])))
	f.Add(slices.Concat(snap[:len(snap)-1], record(uploads.OpPageQueued, k[1][:])))
	f.Add(slices.Concat(record(uploads.OpManifestQueued, []byte(".x")), record(uploads.OpManifestSettled, []byte("a")), record(uploads.OpPageQueued, k[2][:])[:30]))
	f.Add([]byte("KVPUPL1\n\x00\x00\x00\x00\x01\x00\x00\x00\x00UPR\n"))
	// A magic right after an invalid record's first bytes.
	f.Add(slices.Concat([]byte("UPR\n"), record(uploads.OpPageQueued, k[1][:]), []byte("U"), record(uploads.OpManifestQueued, []byte("d"))))
	f.Fuzz(func(t *testing.T, b []byte) {
		s, _, _, _ := uploads.Decode(b)
		pages, names := tableDecode(b)
		if !maps.Equal(s.Pages, pages) || !maps.Equal(s.Manifests, names) {
			t.Fatalf("decoder: %d pages %v; the table: %d pages %v", len(s.Pages), s.Manifests, len(pages), names)
		}
	})
}
