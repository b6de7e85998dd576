package bench

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"github.com/minio/minio-go/v7"
	"golang.org/x/sys/unix"

	"github.com/kvpersist/kvpersist/engine"
	"github.com/kvpersist/kvpersist/engine/gather"
	"github.com/kvpersist/kvpersist/engine/jobs"
	"github.com/kvpersist/kvpersist/engine/remote"
	"github.com/kvpersist/kvpersist/engine/vfs"
	"github.com/kvpersist/kvpersist/internal/kvgen"
	"github.com/kvpersist/kvpersist/internal/seaweedfs"
)

// remoteFetchInFlight is how many GETs the limit keeps in flight: the
// engine's default read-through keeps FetchPages (16) pages in flight,
// each one GET when it fits in FetchChunkBytes (64 MiB by the engine's
// default; a page here is 32 MiB and 16 KiB), so 16 in all.
const remoteFetchInFlight = 16

// BenchmarkRemoteFetch: the object-store tier's read-through row. A 1 GiB prefix (Llama-3.1-8B geometry, 8,192 tokens, 32 pages of
// 256 tokens) is saved on engine A and uploaded to a real SeaweedFS on
// loopback (untimed). Each iteration, a fresh engine B with an empty local
// root and the tier's defaults loads the prompt: it asks the store which
// pages it holds (HEADs), fetches them (16 pages in flight), verifies each
// against the key chain and its tensor hashes, publishes it durably to
// its local tier (temp, fdatasync, rename) and loads it, verified, into
// capacity-padded destinations. The limit, measured in the same run, is
// the client's own GETs of the same 32 objects into memory with 16 in
// flight. Target x-limit >= 0.8; GB/s reported for both. Two more limits
// run in the same iterations (steps.extra), because the fetch must also
// write every byte durably to the local disk, which the GETs do not, and
// a disk's durable write can be as slow as the GETs:
// "getwrite" is the same GETs, each body copied into its own new file and
// published as the engine publishes a fetched page (fdatasync, rename,
// directory fsync), 16 in flight, nothing verified or scattered: the least
// work a fetch into the local tier can do (getWriteAll); "write" is that
// disk write alone, of the same bytes from memory (writeAll). Each reports
// <name>-GB/s, x-<name> (its time / ours: ours against that limit; x-write
// is ours against the disk alone) and <name>-cpu-s/GiB, and
// getwrite-srv-cpu-s/GiB (write never talks to the server). Every side
// removes its local files right after its run (untimed: steps.afterOurs,
// side.after), and the sides' order rotates from iteration to iteration,
// also across -count runs (alternate), so none runs on a disk another
// side left full. The loaded bytes
// are compared with the cache's at the end. The CPU seconds per GiB
// fetched, of this process and of the server, are reported for both sides
// (measured.reportCPU): on a 2-core machine the two share the cores. The
// requests each side sends are counted per page fetched (heads/page,
// gets/page, ranged/page: GETs with a Range header, ifmatch/page: with
// If-Match, other/page; "limit-" for the limit's), the untimed warm-up
// excluded. With
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
	req := &engine.LoadPrefixRequest{Namespace: "ns", Identity: prefixIdentity, Tokens: toks, Dest: dest}

	var e *engine.Engine
	var root string
	// The local-write limits (getwrite, write): each writes into a fresh
	// directory and removes it after its run (untimed), so the sides after
	// it find the disk and page cache as it found them. What a failed run
	// (b.Fatal) left, engine B and the directories, goes at b's cleanup.
	dirs := map[string]string{}
	b.Cleanup(func() {
		if e != nil {
			closeEngine(b, e)
		}
		if root != "" {
			removeAll(b, root)
		}
		for _, d := range dirs {
			removeAll(b, d)
		}
	})
	getBody := func(i int) (io.ReadCloser, error) {
		// Each GET is bounded to 10 minutes, as getAll's whole run: a
		// stalled server fails the run, never hangs it.
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
		o, err := st.Client().GetObject(ctx, st.Bucket(), names[i], minio.GetObjectOptions{})
		if err != nil {
			cancel()
			return nil, err
		}
		return cancelOnClose{o, cancel}, nil
	}
	intoDir := func(name string, noServer bool, write func(dir string) error) side {
		return side{name: name, noServer: noServer,
			prep: func(i int) { dirs[name] = mkdir(b, fmt.Sprintf("fetch-%s-%d", name, i)) },
			run: func(int) {
				if err := write(dirs[name]); err != nil {
					b.Fatal(err)
				}
			},
			after: func(int) {
				removeAll(b, dirs[name])
				delete(dirs, name)
			}}
	}
	extra := []side{
		intoDir("getwrite", false, func(dir string) error { return getWriteAll(getBody, dir, sizes) }),
		intoDir("write", true, func(dir string) error { return writeAll(dir, limBufs) }),
	}
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
		ours: func(i int) {
			c0 := reqs.counts()
			defer func() { oursReqs = oursReqs.addIf(i >= 0, reqs.counts().sub(c0)) }()
			res := do(b, e, req)
			if res.Prefix.Tokens != prefixTokens || res.Remote == nil || res.Remote.Err != nil || res.Remote.BytesFetched != objBytes {
				b.Fatalf("load: %+v, remote %+v", res.Prefix, res.Remote)
			}
		},
		limit: func(i int) {
			c0 := reqs.counts()
			defer func() { limitReqs = limitReqs.addIf(i >= 0, reqs.counts().sub(c0)) }()
			if err := getAll(st, names, limBufs); err != nil {
				b.Fatal(err)
			}
		},
		// Ours's local tier (1 GiB of page files) goes as soon as ours
		// ran, as the limits' files do after theirs.
		afterOurs: func(int) {
			closeEngine(b, e)
			removeAll(b, root)
			e, root = nil, ""
		},
		extra: extra,
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
	mm.reportExtra(b, objBytes)
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
	return parallelForK(len(names), remoteFetchInFlight, func(i int) error {
		o, err := st.Client().GetObject(ctx, st.Bucket(), names[i], minio.GetObjectOptions{})
		if err != nil {
			return err
		}
		defer o.Close()
		if _, err := io.ReadFull(o, bufs[i]); err != nil {
			return fmt.Errorf("get %s: %w", names[i], err)
		}
		return nil
	})
}

// getWriteAll is the fetch-into-the-local-tier limit: the least work a
// fetch into the local tier can do. open(i) (in the benchmark a plain GET
// of object i, as getAll's) is copied into file i of dir (fetchFileName),
// published durably as the engine publishes a fetched page
// (publishFile), remoteFetchInFlight at a time; no verification, no
// scatter. A body of another size than sizes[i] bytes is an error (its
// temp file is removed).
//
// The body is io.Copy'd into the file (32 KiB reads and writes): 256 KiB
// pieces written as they arrive were no faster, and reading the whole
// body into memory first was slower, so the simplest way is kept. Each
// side removes its files right after its run (steps' side.after): files
// left by one side slowed the sides that wrote after it.
func getWriteAll(open func(i int) (io.ReadCloser, error), dir string, sizes []int64) error {
	return parallelForK(len(sizes), remoteFetchInFlight, func(i int) error {
		body, err := open(i)
		if err != nil {
			return err
		}
		defer body.Close()
		return publishFile(dir, fetchFileName(i), func(f *os.File) error {
			n, err := io.Copy(f, body)
			if err == nil && n != sizes[i] {
				err = fmt.Errorf("object %d: %d bytes, want %d", i, n, sizes[i])
			}
			return err
		})
	})
}

// writePieceBytes is the size of the local-write limits' write(2) calls:
// on ext4, 16 writers of 32 MiB files wrote several times faster in
// 256 KiB or 1 MiB writes than in 4 MiB writes or one write per file (an
// experiment not in the suite), so the limit writes as fast as the disk
// allows.
const writePieceBytes = 256 << 10

// writePieces writes b to f in writePieceBytes writes.
func writePieces(f *os.File, b []byte) error {
	for len(b) > 0 {
		n := min(len(b), writePieceBytes)
		if _, err := f.Write(b[:n]); err != nil {
			return err
		}
		b = b[n:]
	}
	return nil
}

// writeAll is the disk's share of getWriteAll alone: bufs[i] (the objects'
// bytes, already in memory) written to file i of dir in writePieceBytes
// writes, published as getWriteAll publishes it, remoteFetchInFlight at a
// time.
func writeAll(dir string, bufs [][]byte) error {
	return parallelForK(len(bufs), remoteFetchInFlight, func(i int) error {
		return publishFile(dir, fetchFileName(i), func(f *os.File) error {
			return writePieces(f, bufs[i])
		})
	})
}

// fetchFileName is the name of object i's file in getWriteAll's and
// writeAll's directory.
func fetchFileName(i int) string { return fmt.Sprintf("page-%04d", i) }

// publishFile creates dir/name durably the way the engine publishes a
// fetched page (layout.Stage, then Staged.Commit with the store's
// PublishOptions(true, 0), engine/tier publishFetched): a new
// temp file beside it, fill, fdatasync, close, rename onto name, fsync of
// dir (the engine syncs each page's fan-out directory after its rename).
// On an error before the rename the temp file is removed.
func publishFile(dir, name string, fill func(f *os.File) error) error {
	tmp := filepath.Join(dir, name+".tmp")
	f, err := os.OpenFile(tmp, os.O_CREATE|os.O_EXCL|os.O_WRONLY|unix.O_CLOEXEC, 0o640)
	if err != nil {
		return err
	}
	err = fill(f)
	if err == nil {
		err = fdatasync(f)
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = os.Rename(tmp, filepath.Join(dir, name))
	}
	if err != nil {
		if rerr := os.Remove(tmp); rerr != nil && !vfs.IsNotExist(rerr) {
			err = errors.Join(err, rerr)
		}
		return fmt.Errorf("publish %s: %w", name, err)
	}
	if err := vfs.Default.SyncDir(dir); err != nil {
		return fmt.Errorf("publish %s: fsync %s: %w", name, dir, err)
	}
	return nil
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

// addIf is a + b when ok (a timed iteration's counts; the warm-up's,
// index -1, are not reported), else a.
func (a reqCounts) addIf(ok bool, b reqCounts) reqCounts {
	if !ok {
		return a
	}
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

// cancelOnClose is a GET's body whose Close also cancels its context.
type cancelOnClose struct {
	io.ReadCloser
	cancel context.CancelFunc
}

func (c cancelOnClose) Close() error {
	err := c.ReadCloser.Close()
	c.cancel()
	return err
}
