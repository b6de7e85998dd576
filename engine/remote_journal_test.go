package engine

import (
	"bytes"
	"crypto/sha256"
	"encoding/binary"
	"errors"
	"slices"
	"testing"

	"github.com/zeebo/xxh3"

	"github.com/kvpersist/kvpersist/engine/layout"
)

func testKeys(n int) []layout.PageKey {
	out := make([]layout.PageKey, n)
	for i := range out {
		out[i] = layout.PageKey(sha256.Sum256([]byte{byte(i), byte(i >> 8)}))
	}
	return out
}

// rehash recomputes a journal's trailing hash after a test edited it, so
// that the decoder's later checks are reached.
func rehash(b []byte) []byte {
	body := b[:len(b)-8]
	return binary.LittleEndian.AppendUint64(bytes.Clone(body), xxh3.Hash(body))
}

// TestJournalRoundTrip: a journal decodes to the sorted keys and names it
// was made of, its layout is the documented one (magic, counts, 32-byte
// keys, length-prefixed names, XXH3-64 of the rest), and it is canonical.
func TestJournalRoundTrip(t *testing.T) {
	keys := testKeys(5)
	names := []string{"zeta", "conv-1", "a.b_c"}
	b := encodeJournal(slices.Clone(keys), slices.Clone(names))
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
	if !bytes.Equal(encodeJournal(pages, manifests), b) {
		t.Fatal("not canonical: re-encoding differs")
	}
	empty := encodeJournal(nil, nil)
	if p, m, err := decodeJournal(empty); err != nil || len(p)+len(m) != 0 || len(empty) != 24 {
		t.Fatalf("empty journal: %d bytes, %v %v %v", len(empty), p, m, err)
	}
}

// TestJournalHostile: every malformed journal is errJournal, never a
// panic or an allocation beyond the file's size.
func TestJournalHostile(t *testing.T) {
	keys := testKeys(3)
	good := encodeJournal(slices.Clone(keys), []string{"a", "b"})
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
		if p, m, err := decodeJournal(b); !errors.Is(err, errJournal) {
			t.Errorf("%s: decoded %d pages %d manifests, err %v; want errJournal", name, len(p), len(m), err)
		}
	}
}

// FuzzDecodeJournal: the decoder never panics, and whatever it accepts
// re-encodes to the same bytes (the format is canonical).
func FuzzDecodeJournal(f *testing.F) {
	f.Add(encodeJournal(testKeys(3), []string{"a", "conv-1"}))
	f.Add(encodeJournal(nil, nil))
	f.Add([]byte("KVPUPL1\n"))
	f.Fuzz(func(t *testing.T, b []byte) {
		p, m, err := decodeJournal(b)
		if err != nil {
			if !errors.Is(err, errJournal) {
				t.Fatalf("error %v is not errJournal", err)
			}
			return
		}
		if !bytes.Equal(encodeJournal(p, m), b) {
			t.Fatal("accepted a journal that does not re-encode to itself")
		}
	})
}
