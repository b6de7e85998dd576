package recency

import (
	"encoding/binary"
	"testing"

	"github.com/kvpersist/kvpersist/engine/layout"
)

// benchRecords is a namespace's records: n pages in chains of 8.
func benchRecords(n int) []Record {
	recs := make([]Record, n)
	for i := range recs {
		var k layout.PageKey
		binary.BigEndian.PutUint64(k[:], uint64(i)+1)
		recs[i] = Record{Key: k, Access: int64(i)}
		if i%8 != 0 {
			recs[i].Parent, recs[i].HasParent = recs[i-1].Key, true
		}
	}
	return recs
}

// BenchmarkEncode: the checkpoint of a namespace of 250,000 pages, encoded
// (periodically and at Close). Bytes are the checkpoint's.
func BenchmarkEncode(b *testing.B) {
	recs := benchRecords(250_000)
	b.SetBytes(Bytes(len(recs)))
	b.ReportAllocs()
	var buf []byte
	var err error
	for range b.N {
		if buf, err = Append(buf[:0], recs); err != nil || int64(len(buf)) != Bytes(len(recs)) {
			b.Fatalf("encoded %d bytes (%v)", len(buf), err)
		}
	}
}

// BenchmarkDecode: the same checkpoint decoded (at start).
func BenchmarkDecode(b *testing.B) {
	recs := benchRecords(250_000)
	enc, err := Append(nil, recs)
	if err != nil {
		b.Fatal(err)
	}
	b.SetBytes(int64(len(enc)))
	b.ReportAllocs()
	for range b.N {
		if got, err := Decode(enc); err != nil || len(got) != len(recs) {
			b.Fatalf("decoded %d records (%v)", len(got), err)
		}
	}
}
