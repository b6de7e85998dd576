package bench

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/kvpersist/kvpersist/engine"
	"github.com/kvpersist/kvpersist/engine/jobs"
	"github.com/kvpersist/kvpersist/engine/layout"
)

// The page cache's eviction: 10,000 page files evicted by the
// engine against readdir + unlink of the same files.

const (
	evictChains     = 100 // conversations
	evictChainPages = 100 // pages per conversation: 10,000 pages
	evictPageTokens = 16  // the smallest page: small files, the cost is the metadata
)

// evictTemplate is a namespace of evictChains × evictChainPages page files
// written by the engine (every page's parent stored: leaves first makes
// the order), kept in mmap'd memory.
type evictTemplate struct {
	files []storeFile
	pages int
	names map[string]bool // the page files' names
	alloc int64           // their allocated bytes (st_blocks × 512) as laid down
	mem   *arena
}

var evictTpl template[*evictTemplate]

func getEvictTemplate(b *testing.B) *evictTemplate {
	b.Helper()
	return evictTpl.get(b, func() (*evictTemplate, error) {
		return buildEvictTemplate(filepath.Join(benchRoot, "evict-template"))
	})
}

// buildEvictTemplate saves the conversations (NoSync: set-up; one bf16
// tensor [1, 1, tokens, 8]) and reads the namespace's pages/ into memory.
func buildEvictTemplate(root string) (*evictTemplate, error) {
	defer os.RemoveAll(root)
	e, err := engine.New(engine.Config{Root: root, NoSync: true, Logger: quietLogger})
	if err != nil {
		return nil, err
	}
	defer e.Close(context.Background())
	n := evictChainPages * evictPageTokens
	buf := make([]byte, n*8*2)
	v := viewOf(buf, []int{1, 1, n, 8}, 2)
	toks := make([]uint32, n)
	for c := range evictChains {
		for i := range toks {
			toks[i] = uint32(c*n + i)
		}
		r := e.Do(context.Background(), &engine.SavePrefixRequest{Namespace: "ns", Identity: "bench", Tokens: toks,
			Tensors: []jobs.TensorSpec{{DType: "bfloat16", View: v}}, PageTokens: evictPageTokens})
		if r.Err != nil {
			return nil, r.Err
		}
	}
	t := &evictTemplate{names: map[string]bool{}}
	if t.files, t.mem, err = readTemplate(filepath.Join(root, "ns")); err != nil {
		return nil, err
	}
	for _, f := range t.files {
		if strings.HasPrefix(f.rel, layout.PagesDirName+string(filepath.Separator)) {
			t.names[filepath.Base(f.rel)] = true
		}
	}
	if t.pages = len(t.names); t.pages != evictChains*evictChainPages {
		return nil, fmt.Errorf("evict template: %d pages, want %d", t.pages, evictChains*evictChainPages)
	}
	return t, nil
}

// BenchmarkEvict: the engine evicts 10,000 page files of a namespace (its
// quota set to 1 byte: the background goroutine unlinks every page under
// the namespace's exclusive lock, leaves first, and keeps the accounting
// and the index), timed from SetQuota until Usage shows none left; against
// readdir of the same fan-out directories + unlink (on every core) of the
// same files. Target x-limit ≥ 0.5. SetBytes counts the allocated bytes
// freed; pages/s is the engine's eviction rate.
func BenchmarkEvict(b *testing.B) {
	tpl := getEvictTemplate(b)
	root, lim := mkdir(b, "evict"), mkdir(b, "evict-limit")
	dir := func(base string, i int) string { return filepath.Join(base, fmt.Sprint(i)) }
	var e *engine.Engine
	var freed int64
	b.ReportAllocs()
	m := alternate(b, steps{
		prepOurs: func(i int) {
			materialize(b, tpl.files, filepath.Join(dir(root, i), "ns"))
			settle(b, root)
			var err error
			if e, err = engine.New(engine.Config{Root: dir(root, i), Logger: quietLogger}); err != nil {
				b.Fatal(err)
			}
			if u := e.Usage(); u.Pages != tpl.pages {
				b.Fatalf("the engine found %d pages, want %d", u.Pages, tpl.pages)
			}
			freed = e.Usage().UsedBytes
		},
		ours: func(i int) {
			if err := e.SetQuota("ns", 1); err != nil {
				b.Fatal(err)
			}
			for {
				if u := e.Usage(); u.Pages == 0 && u.EvictingBytes == 0 {
					break
				}
				time.Sleep(50 * time.Microsecond)
			}
		},
		prepLimit: func(i int) {
			materialize(b, tpl.files, filepath.Join(dir(lim, i), "ns"))
			settle(b, lim)
		},
		limit: func(i int) {
			n, err := unlinkLimit(filepath.Join(dir(lim, i), "ns", layout.PagesDirName), tpl.names)
			if err != nil || n != tpl.pages {
				b.Fatalf("unlink limit removed %d files (want %d): %v", n, tpl.pages, err)
			}
		},
		cleanup: func(i int) {
			closeEngine(b, e)
			left, err := filepath.Glob(filepath.Join(dir(root, i), "ns", layout.PagesDirName, "*", "*"))
			if err != nil || len(left) != 0 {
				b.Fatalf("%d page files left after the eviction: %v", len(left), err)
			}
			removeAll(b, dir(root, i))
			removeAll(b, dir(lim, i))
			settle(b, root)
		},
	})
	b.SetBytes(freed)
	m.report(b, freed)
	if m.ours > 0 {
		b.ReportMetric(float64(tpl.pages)*float64(m.n)/m.ours.Seconds(), "pages/s")
	}
}

// BenchmarkEvictRebuild: engine start (New) on a namespace of 10,000 page
// files, whose page cache accounting is rebuilt from the disk: with the
// recency checkpoint (an lstat per page; parents from the checkpoint) and
// without it (each page's header read for its parent). Reports ns/page
// of each; the index's own rebuild is BenchmarkPrefixIndexBuild.
func BenchmarkEvictRebuild(b *testing.B) {
	tpl := getEvictTemplate(b)
	for _, ckpt := range []bool{true, false} {
		name := "no-checkpoint"
		if ckpt {
			name = "checkpoint"
		}
		b.Run(name, func(b *testing.B) {
			root := mkdir(b, "evict-rebuild")
			materialize(b, tpl.files, filepath.Join(root, "ns"))
			e, err := engine.New(engine.Config{Root: root, Logger: quietLogger})
			if err != nil {
				b.Fatal(err)
			}
			closeEngine(b, e) // writes the checkpoint
			recency := filepath.Join(root, "ns", layout.RecencyName)
			if !ckpt {
				removeAll(b, recency)
			}
			settle(b, root)
			b.ReportAllocs()
			var took time.Duration
			for b.Loop() {
				t0 := time.Now()
				e, err := engine.New(engine.Config{Root: root, Logger: quietLogger})
				if err != nil {
					b.Fatal(err)
				}
				took += time.Since(t0)
				if u := e.Usage(); u.Pages != tpl.pages {
					b.Fatalf("%d pages accounted, want %d", u.Pages, tpl.pages)
				}
				b.StopTimer()
				closeEngine(b, e)
				if !ckpt {
					removeAll(b, recency)
				}
				b.StartTimer()
			}
			b.ReportMetric(float64(took.Nanoseconds())/float64(b.N)/float64(tpl.pages), "ns/page")
			removeAll(b, root)
		})
	}
}
