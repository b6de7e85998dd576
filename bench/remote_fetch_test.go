package bench

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"os"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/minio/minio-go/v7"

	"github.com/kvpersist/kvpersist/engine"
	"github.com/kvpersist/kvpersist/engine/gather"
	"github.com/kvpersist/kvpersist/engine/jobs"
	"github.com/kvpersist/kvpersist/engine/remote"
	"github.com/kvpersist/kvpersist/internal/kvgen"
	"github.com/kvpersist/kvpersist/internal/seaweedfs"
)

// remoteFetchInFlight is how many GETs the limit keeps in flight: the
// engine's default read-through keeps FetchPages (16) pages in flight,
// each one GET when it fits in FetchChunkBytes (64 MiB by the engine's
// default; a page here is 32 MiB and 16 KiB), so 16 in all.
const remoteFetchInFlight = 16

// BenchmarkRemoteFetch: the object-store tier's read-through row (issue
// 15). A 1 GiB prefix (Llama-3.1-8B geometry, 8,192 tokens, 32 pages of
// 256 tokens) is saved on engine A and uploaded to a real SeaweedFS on
// loopback (untimed). Each iteration, a fresh engine B with an empty local
// root and the tier's defaults loads the prompt: it asks the store which
// pages it holds (HEADs), fetches them (16 pages in flight), verifies each
// against the key chain and its tensor hashes, publishes it durably to
// its local tier (temp, fdatasync, rename) and loads it, verified, into
// capacity-padded destinations. The limit, measured in the same run, is
// the client's own GETs of the same 32 objects into memory with 16 in
// flight. Target x-limit >= 0.8; GB/s reported for both. The loaded bytes
// are compared with the cache's at the end. The CPU seconds per GiB
// fetched, of this process and of the server, are reported for both sides
// (measured.reportCPU): on a 2-core machine the two share the cores. The
// requests each side sends are counted per page fetched (heads/page,
// gets/page, ranged/page: GETs with a Range header, ifmatch/page: with
// If-Match, other/page; "limit-" for the limit's). With
// KVPERSIST_BENCH_FETCH_CHUNK_BYTES set, engine B's
// Store.FetchChunkBytes is that (an experiment; unset: the engine's
// default, one GET per page up to 64 MiB).
func BenchmarkRemoteFetch(b *testing.B) {
	srv := seaweedfs.StartTB(b) // fails (never skips) when weed cannot be built
	w := getWorkload(b, benchModel, prefixTokens)
	m := w.model
	cfg := engine.RemoteConfig{Endpoint: srv.Endpoint, Bucket: srv.Bucket, Prefix: "bench-fetch",
		AccessKey: srv.AccessKey, SecretKey: srv.SecretKey}
	reqs, err := newCountingRT()
	if err != nil {
		b.Fatal(err)
	}
	toks := tokenIDs(prefixTokens, 15)

	// Engine A saves and uploads (Close waits for the uploads).
	a, err := engine.New(engine.Config{Root: mkdir(b, "remote-a"), Logger: quietLogger, Remote: &engine.RemoteTier{Store: cfg}})
	if err != nil {
		b.Fatal(err)
	}
	saved := do(b, a, savePrefixReq(w.cache, toks))
	if err := a.Close(context.Background()); err != nil {
		b.Fatal(err)
	}

	// Both sides count their requests from here on (one transport).
	cfg.Transport = reqs
	if v := os.Getenv("KVPERSIST_BENCH_FETCH_CHUNK_BYTES"); v != "" {
		n, err := strconv.ParseInt(v, 10, 64)
		if err != nil || n < 1 {
			b.Fatalf("KVPERSIST_BENCH_FETCH_CHUNK_BYTES=%q: want a positive byte count", v)
		}
		cfg.FetchChunkBytes = n // an experiment: the engine's default is one GET per page up to 64 MiB
	}
	// The limit's objects and buffers.
	st, err := remote.New(cfg)
	if err != nil {
		b.Fatal(err)
	}
	defer st.Close()
	names := make([]string, len(saved.Prefix.Keys))
	sizes := make([]int64, len(names))
	var objBytes int64
	for i, k := range saved.Prefix.Keys {
		if names[i], err = st.PageName("ns", k.String()); err != nil {
			b.Fatal(err)
		}
		o, err := st.Stat(context.Background(), names[i])
		if err != nil {
			b.Fatal(err)
		}
		sizes[i] = o.Size
		objBytes += o.Size
	}
	limMem, err := newArena(int(objBytes) + len(names)*pageBytes)
	if err != nil {
		b.Fatal(err)
	}
	defer func() { _ = limMem.free() }()
	limBufs := make([][]byte, len(names))
	for i := range names {
		limBufs[i] = limMem.alloc(int(sizes[i]))
	}

	// Destinations: capacity-padded (8,448 tokens), mmap'd.
	capT := kvgen.Capacity(prefixTokens)
	tb := m.TensorBytes(capT)
	mem, err := newArena(2 * m.Layers * alignPage(tb))
	if err != nil {
		b.Fatal(err)
	}
	defer func() { _ = mem.free() }()
	dest := make([]jobs.TensorSpec, 2*m.Layers)
	for i := range dest {
		dest[i] = jobs.TensorSpec{DType: m.DType, View: gather.View{
			Base: mem.alloc(tb), Shape: []int{1, m.KVHeads, capT, m.HeadDim},
			Strides: []int{m.KVHeads * capT * m.HeadDim, capT * m.HeadDim, m.HeadDim, 1}, ItemSize: m.ItemSize,
		}}
	}
	req := &engine.LoadPrefixRequest{Namespace: "ns", Identity: prefixIdentity, Tokens: toks, Dest: dest, Verify: true}

	var e *engine.Engine
	var root string
	var oursReqs, limitReqs reqCounts
	b.SetBytes(objBytes)
	b.ReportAllocs()
	mm := alternate(b, steps{
		prepOurs: func(i int) {
			root = mkdir(b, fmt.Sprintf("remote-b-%d", i))
			if e, err = engine.New(engine.Config{Root: root, Logger: quietLogger, Remote: &engine.RemoteTier{Store: cfg}}); err != nil {
				b.Fatal(err)
			}
		},
		ours: func(int) {
			c0 := reqs.counts()
			defer func() { oursReqs = oursReqs.add(reqs.counts().sub(c0)) }()
			res := do(b, e, req)
			if res.Prefix.Tokens != prefixTokens || res.Remote == nil || res.Remote.Err != nil || res.Remote.BytesFetched != objBytes {
				b.Fatalf("load: %+v, remote %+v", res.Prefix, res.Remote)
			}
		},
		limit: func(int) {
			c0 := reqs.counts()
			defer func() { limitReqs = limitReqs.add(reqs.counts().sub(c0)) }()
			if err := getAll(st, names, limBufs); err != nil {
				b.Fatal(err)
			}
		},
		cleanup: func(int) {
			closeEngine(b, e)
			removeAll(b, root)
		},
		serverCPU: func() time.Duration {
			d, err := srv.CPUTime()
			if err != nil {
				b.Fatal(err)
			}
			return d
		},
	})
	mm.report(b, objBytes)
	mm.reportCPU(b, objBytes)
	if mm.ours > 0 {
		b.ReportMetric(float64(objBytes)*float64(mm.n)/mm.ours.Seconds()/1e9, "GB/s")
	}
	if mm.limit > 0 {
		b.ReportMetric(float64(objBytes)*float64(mm.n)/mm.limit.Seconds()/1e9, "limit-GB/s")
	}
	pages := float64(len(names) * mm.n)
	oursReqs.report(b, "", pages)
	limitReqs.report(b, "limit-", pages)
	checkLoaded(b, w, dest, capT, prefixTokens)
}

// getAll is the remote fetch limit: a plain GET of every object through
// the same minio client, remoteFetchInFlight at a time, each body read
// whole into its buffer.
func getAll(st *remote.Store, names []string, bufs [][]byte) error {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	var (
		wg    sync.WaitGroup
		mu    sync.Mutex
		next  int
		first error
	)
	for range min(remoteFetchInFlight, len(names)) {
		wg.Go(func() {
			for {
				mu.Lock()
				i := next
				next++
				stop := i >= len(names) || first != nil
				mu.Unlock()
				if stop {
					return
				}
				err := func() error {
					o, err := st.Client().GetObject(ctx, st.Bucket(), names[i], minio.GetObjectOptions{})
					if err != nil {
						return err
					}
					defer o.Close()
					if _, err := io.ReadFull(o, bufs[i]); err != nil {
						return fmt.Errorf("get %s: %w", names[i], err)
					}
					return nil
				}()
				if err != nil {
					mu.Lock()
					if first == nil {
						first = err
					}
					mu.Unlock()
					return
				}
			}
		})
	}
	wg.Wait()
	return first
}

// countingRT is an http.RoundTripper (the default minio transport, as
// remote.New builds it) counting the requests sent through it by kind.
type countingRT struct {
	next                              http.RoundTripper
	head, get, ranged, ifMatch, other atomic.Int64
}

func newCountingRT() (*countingRT, error) {
	t, err := minio.DefaultTransport(false)
	if err != nil {
		return nil, err
	}
	t.MaxIdleConnsPerHost = 16 // as remote.New sets it at the default Concurrency
	return &countingRT{next: t}, nil
}

func (c *countingRT) RoundTrip(r *http.Request) (*http.Response, error) {
	switch r.Method {
	case http.MethodHead:
		c.head.Add(1)
	case http.MethodGet:
		c.get.Add(1)
		if r.Header.Get("Range") != "" {
			c.ranged.Add(1)
		}
		if r.Header.Get("If-Match") != "" {
			c.ifMatch.Add(1)
		}
	default:
		c.other.Add(1)
	}
	return c.next.RoundTrip(r)
}

// reqCounts: requests by kind (a GET may be ranged and conditional both).
type reqCounts struct{ head, get, ranged, ifMatch, other int64 }

func (c *countingRT) counts() reqCounts {
	return reqCounts{c.head.Load(), c.get.Load(), c.ranged.Load(), c.ifMatch.Load(), c.other.Load()}
}

func (a reqCounts) sub(b reqCounts) reqCounts {
	return reqCounts{a.head - b.head, a.get - b.get, a.ranged - b.ranged, a.ifMatch - b.ifMatch, a.other - b.other}
}

func (a reqCounts) add(b reqCounts) reqCounts {
	return reqCounts{a.head + b.head, a.get + b.get, a.ranged + b.ranged, a.ifMatch + b.ifMatch, a.other + b.other}
}

// report reports the requests per page fetched, each kind under prefix.
func (a reqCounts) report(b *testing.B, prefix string, pages float64) {
	if pages == 0 {
		return
	}
	b.ReportMetric(float64(a.head)/pages, prefix+"heads/page")
	b.ReportMetric(float64(a.get)/pages, prefix+"gets/page")
	b.ReportMetric(float64(a.ranged)/pages, prefix+"ranged/page")
	b.ReportMetric(float64(a.ifMatch)/pages, prefix+"ifmatch/page")
	b.ReportMetric(float64(a.other)/pages, prefix+"other/page")
}
