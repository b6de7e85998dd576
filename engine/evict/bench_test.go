package evict

import (
	"encoding/binary"
	"math/rand/v2"
	"runtime"
	"testing"
)

// benchCache builds a cache of pages in chains of 32 (conversations), in
// 4 namespaces, with random accesses.
// It returns the cache and its Go heap bytes per page.
func benchCache(b *testing.B, pages int) (*Cache, float64) {
	b.Helper()
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	c, _ := New(Config{})
	rng := rand.New(rand.NewPCG(1, 2))
	nss := []string{"ns0", "ns1", "ns2", "ns3"}
	var parent Key
	for i := range pages {
		var k Key
		binary.LittleEndian.PutUint64(k[:], uint64(i))
		k[31] = 0x5a
		p := Page{Namespace: nss[(i/32)%len(nss)], Key: k, Bytes: 8 << 20, Access: rng.Int64N(1 << 40)}
		if i%32 != 0 {
			p.Parent, p.HasParent = parent, true
		}
		if err := c.Add(p); err != nil {
			b.Fatal(err)
		}
		parent = k
	}
	runtime.GC()
	runtime.ReadMemStats(&after)
	return c, float64(after.HeapAlloc-before.HeapAlloc) / float64(pages)
}

// BenchmarkChooseVictims: choose 10,000 victims among 1,000,000 pages
// (Shrink), reported per victim; the victims are returned (Abandon) with
// the timer stopped, so every iteration chooses from the same cache.
func BenchmarkChooseVictims(b *testing.B) {
	const pages, victims = 1_000_000, 10_000
	c, perPage := benchCache(b, pages)
	u := c.Usage()
	dst := make([]Victim, 0, victims)
	runtime.GC() // the build's garbage is not the benchmark's
	b.ReportAllocs()
	b.ResetTimer()
	for range b.N {
		vs, ok := c.Shrink(u.UsedBytes-victims*(8<<20), dst[:0])
		if !ok || len(vs) != victims {
			b.Fatalf("chose %d victims (%v)", len(vs), ok)
		}
		b.StopTimer()
		for i := len(vs) - 1; i >= 0; i-- {
			if err := c.Abandon(vs[i].Namespace, vs[i].Key); err != nil {
				b.Fatal(err)
			}
		}
		b.StartTimer()
	}
	b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N*victims), "ns/victim")
	b.ReportMetric(perPage, "heap-B/page")
}

// BenchmarkReserveAtCapacity: a cache of 1,000,000 pages at capacity; each
// op reserves one page (evicting one victim), removes the victim and
// commits a new page: the steady state of a full cache.
func BenchmarkReserveAtCapacity(b *testing.B) {
	const pages = 1_000_000
	c, _ := benchCache(b, pages)
	if err := c.SetCapacity(c.Usage().UsedBytes); err != nil {
		b.Fatal(err)
	}
	runtime.GC() // the build's garbage is not the benchmark's
	b.ReportAllocs()
	b.ResetTimer()
	for i := range b.N {
		r, err := c.Reserve(Want{Namespace: "ns0", Bytes: 8 << 20, AvailBytes: -1})
		if err != nil {
			b.Fatal(err)
		}
		for _, v := range r.Victims {
			c.Removed(v.Namespace, v.Key)
		}
		var k Key
		binary.LittleEndian.PutUint64(k[:], uint64(pages+i))
		k[31] = 0x5a
		if err := r.Commit(Page{Namespace: "ns0", Key: k, Bytes: 8 << 20, Access: 1<<40 + int64(i)}); err != nil {
			b.Fatal(err)
		}
		r.Release()
	}
}

// BenchmarkCheckpoint: the periodic checkpoint of a namespace of 250,000
// pages (a quarter of the million): Checkpoint (copy and sort the records)
// plus AppendCheckpoint (encode and hash), and DecodeCheckpoint at start.
// Bytes are the checkpoint's.
func BenchmarkCheckpoint(b *testing.B) {
	c, _ := benchCache(b, 1_000_000)
	recs := c.Checkpoint("ns0", nil)
	enc, err := AppendCheckpoint(nil, recs)
	if err != nil {
		b.Fatal(err)
	}
	b.Run("encode", func(b *testing.B) {
		b.SetBytes(int64(len(enc)))
		b.ReportAllocs()
		var rbuf []Record
		var buf []byte
		for range b.N {
			rbuf = c.Checkpoint("ns0", rbuf[:0])
			if buf, err = AppendCheckpoint(buf[:0], rbuf); err != nil || len(buf) != len(enc) {
				b.Fatalf("encoded %d bytes (%v), want %d", len(buf), err, len(enc))
			}
		}
	})
	b.Run("decode", func(b *testing.B) {
		b.SetBytes(int64(len(enc)))
		b.ReportAllocs()
		for range b.N {
			if got, err := DecodeCheckpoint(enc); err != nil || len(got) != len(recs) {
				b.Fatalf("decoded %d records (%v)", len(got), err)
			}
		}
	})
}

// BenchmarkSetPending: mark a page pending and unmark it again (an upload
// queued after a save, then settled) in a cache of 1,000,000 pages (31,250
// evictable leaves in 4 namespaces), reported per call (two per op). Each
// call looks the page up and moves it in its namespace's heap, O(log n).
// hot: the last 64 pages saved, the most recently used (the save path
// marks a page just after committing it, its node and map entry still in
// the CPU's cache); cold: every leaf in turn, of random recency (a settle,
// on an uploader goroutine, long after the save).
func BenchmarkSetPending(b *testing.B) {
	b.Run("hot", func(b *testing.B) { benchSetPending(b, true) })
	b.Run("cold", func(b *testing.B) { benchSetPending(b, false) })
}

func benchSetPending(b *testing.B, hot bool) {
	const pages = 1_000_000
	c, _ := benchCache(b, pages)
	nss := []string{"ns0", "ns1", "ns2", "ns3"}
	type page struct {
		ns  string
		key Key
	}
	var leaves []page
	for i := 31; i < pages; i += 32 { // the chains' leaves: evictable, in the heaps
		var k Key
		binary.LittleEndian.PutUint64(k[:], uint64(i))
		k[31] = 0x5a
		leaves = append(leaves, page{nss[(i/32)%len(nss)], k})
	}
	if hot {
		leaves = leaves[len(leaves)-64:]
		for i, p := range leaves {
			if !c.Touch(p.ns, p.key, 1<<41+int64(i)) {
				b.Fatalf("page %s not tracked", p.key)
			}
		}
	}
	runtime.GC()
	b.ReportAllocs()
	b.ResetTimer()
	for i := range b.N {
		p := leaves[i%len(leaves)]
		if !c.SetPending(p.ns, p.key, true) || !c.SetPending(p.ns, p.key, false) {
			b.Fatalf("page %s of %s not tracked", p.key, p.ns)
		}
	}
	b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(2*b.N), "ns/call")
}
