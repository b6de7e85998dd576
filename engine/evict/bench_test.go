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
// pages (a quarter of the million): Checkpoint copies and sorts the
// records (engine/recency's BenchmarkEncode encodes them).
func BenchmarkCheckpoint(b *testing.B) {
	c, _ := benchCache(b, 1_000_000)
	want := len(c.Checkpoint("ns0", nil))
	b.ReportAllocs()
	var rbuf []Record
	for range b.N {
		if rbuf = c.Checkpoint("ns0", rbuf[:0]); len(rbuf) != want {
			b.Fatalf("%d records, want %d", len(rbuf), want)
		}
	}
}
