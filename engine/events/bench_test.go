package events

import (
	"context"
	"testing"
	"time"

	"github.com/kvpersist/kvpersist/engine/layout"
	"github.com/kvpersist/kvpersist/engine/store"
)

// snapshotPages is the size of BenchmarkSnapshot's namespace: 100,000
// pages of 256 tokens (1,000 conversations of 100 pages sharing nothing).
const (
	snapshotPages  = 100_000
	snapshotChains = 1_000
	benchP         = 256
)

// BenchmarkSnapshot announces 100,000 pages held in memory (ordered into
// chains, encoded, batched and handed to the PUB socket, with one
// subscriber reading them): the part of a snapshot that does not read the
// disk (BenchmarkPagesFromDisk is that part). The target is under 2 s an
// operation.
func BenchmarkSnapshot(b *testing.B) {
	pages := make([]layout.Page, 0, snapshotPages)
	for c := range snapshotChains {
		pages = append(pages, chain(b, "bench-model", benchP, tokensOf(c*31, snapshotPages/snapshotChains*benchP))...)
	}
	p := newPub(b, Config{Topic: "t"})
	s := subscribe(b, p, "t")
	stop := make(chan struct{})
	drained := make(chan struct{})
	go func() { // read as a router would, so that the socket never backs up
		defer close(drained)
		for {
			select {
			case <-s.c:
			case <-stop:
				return
			}
		}
	}()
	defer func() { close(stop); <-drained }()
	b.ResetTimer()
	for b.Loop() {
		st, err := p.Snapshot(context.Background(), "ns", pages)
		if err != nil {
			b.Fatal(err)
		}
		if st.Pages != snapshotPages {
			b.Fatalf("%d pages announced", st.Pages)
		}
	}
	b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N)/snapshotPages, "ns/page")
}

// BenchmarkPagesFromDisk reads the page objects of a namespace of 2,000
// page files of 256 tokens (headers only), the part of a snapshot that
// reads the disk; ns/page times 100,000 is the cost for BenchmarkSnapshot's
// namespace (page cache warm: the files were just written).
func BenchmarkPagesFromDisk(b *testing.B) {
	const files = 2000
	root := b.TempDir()
	for c := range files / 20 {
		savePrefix(b, root, "ns", "bench-model", benchP, tokensOf(c*31, 20*benchP))
	}
	st, err := store.Open(root, store.Options{})
	if err != nil {
		b.Fatal(err)
	}
	n, err := st.Namespace("ns")
	if err != nil {
		b.Fatal(err)
	}
	start := time.Now()
	b.ResetTimer()
	for b.Loop() {
		pages, _, err := PagesFromDisk(n, 0)
		if err != nil || len(pages) != files {
			b.Fatalf("%d pages, %v", len(pages), err)
		}
	}
	b.ReportMetric(float64(time.Since(start).Nanoseconds())/float64(b.N)/files, "ns/page")
}

// BenchmarkStored is what a save of 8,192 tokens (32 pages of 256) pays
// on its own goroutine to announce its chain: grouping, hashing to 64
// bits, encoding and offering (the publisher's goroutine sends it).
func BenchmarkStored(b *testing.B) {
	pages := chain(b, "bench-model", benchP, tokensOf(7, 32*benchP))
	p := newPub(b, Config{Topic: "t"})
	b.ResetTimer()
	for b.Loop() {
		p.Stored("ns", pages...)
	}
	b.StopTimer()
	if err := p.Flush(context.Background()); err != nil {
		b.Fatal(err)
	}
	b.ReportMetric(float64(p.Stats().Dropped), "dropped")
}
