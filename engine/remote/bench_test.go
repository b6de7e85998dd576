package remote_test

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"os"
	"sync"
	"testing"
	"time"

	"github.com/minio/minio-go/v7"
	"golang.org/x/sys/unix"

	"github.com/kvpersist/kvpersist/engine/remote"
)

// Object geometry of the benchmarks: 8 objects of 8 MiB (a Llama-3.1-8B
// page of 64 tokens; 256-token pages are 32 MiB).
const (
	benchObjects     = 8
	benchObjectBytes = 8 << 20
	benchParallel    = 4
)

// sliceFile is a fixed-size fetch destination over a byte slice.
type sliceFile []byte

func (s sliceFile) WriteAt(p []byte, off int64) (int, error) {
	if off+int64(len(p)) > int64(len(s)) {
		return 0, io.ErrShortWrite
	}
	return copy(s[off:], p), nil
}

func (s sliceFile) ReadAt(p []byte, off int64) (int, error) {
	if off >= int64(len(s)) {
		return 0, io.EOF
	}
	n := copy(p, s[off:])
	if n < len(p) {
		return n, io.EOF
	}
	return n, nil
}

// parallel runs fn(i) for i < n on k goroutines and returns the first error.
func parallel(n, k int, fn func(i int) error) error {
	var (
		wg   sync.WaitGroup
		mu   sync.Mutex
		next int
		ferr error
	)
	for range k {
		wg.Go(func() {
			for {
				mu.Lock()
				i := next
				next++
				mu.Unlock()
				if i >= n {
					return
				}
				if err := fn(i); err != nil {
					mu.Lock()
					ferr = err
					mu.Unlock()
					return
				}
			}
		})
	}
	wg.Wait()
	return ferr
}

// versusLimit runs ours and then limit (the same work done the plain way)
// once per benchmark iteration; only ours is timed by the benchmark. It
// reports both rates in GB/s and their ratio (x-limit).
func versusLimit(b *testing.B, total int64, ours, limit func(iter int) error) {
	b.SetBytes(total)
	b.ReportAllocs()
	var tOurs, tLimit time.Duration
	iter := 0
	for b.Loop() {
		iter++
		t0 := time.Now()
		if err := ours(iter); err != nil {
			b.Fatal(err)
		}
		tOurs += time.Since(t0)
		b.StopTimer()
		t0 = time.Now()
		if err := limit(iter); err != nil {
			b.Fatal(err)
		}
		tLimit += time.Since(t0)
		b.StartTimer()
	}
	n := float64(iter) * float64(total)
	b.ReportMetric(n/tOurs.Seconds()/1e9, "GB/s")
	b.ReportMetric(n/tLimit.Seconds()/1e9, "plain-GB/s")
	b.ReportMetric(tLimit.Seconds()/tOurs.Seconds(), "x-limit")
}

// BenchmarkUpload: the Uploader (create-only PUTs, benchParallel workers)
// of benchObjects new objects vs the client's own plain PutObject of the
// same bytes under other names, benchParallel at a time, in the same
// iteration (x-limit = our GB/s / plain GB/s).
func BenchmarkUpload(b *testing.B) {
	s := newStore(b, nil)
	ctx := context.Background()
	data := make([][]byte, benchObjects)
	for i := range data {
		data[i] = randBytes(uint64(1000+i), benchObjectBytes)
	}
	ours := func(iter int) error {
		u, err := remote.NewUploader(s, remote.UploaderConfig{Workers: benchParallel})
		if err != nil {
			return err
		}
		for i := range data {
			name := pageName(b, s, "bench", key(fmt.Sprint("up", iter, i)))
			if err := u.Enqueue(remote.Upload{Name: name, Size: int64(len(data[i])), Open: source(data[i])}); err != nil {
				return err
			}
		}
		if err := u.Close(ctx); err != nil {
			return err
		}
		if st := u.Stats(); st.Created != benchObjects {
			return fmt.Errorf("uploaded %+v", st)
		}
		return nil
	}
	plain := func(iter int) error {
		return parallel(benchObjects, benchParallel, func(i int) error {
			name := pageName(b, s, "bench", key(fmt.Sprint("plain", iter, i)))
			_, err := s.Client().PutObject(ctx, s.Bucket(), name, bytes.NewReader(data[i]), int64(len(data[i])), minio.PutObjectOptions{})
			return err
		})
	}
	versusLimit(b, benchObjects*benchObjectBytes, ours, plain)
}

// BenchmarkFetch: Fetch (HEAD, then ranged GETs of 2 MiB, 4 in flight,
// and a SHA-256-free copy into the destination) of benchObjects objects,
// benchParallel at a time, vs the client's own whole-object GETs of the
// same objects read into buffers, in the same iteration.
func BenchmarkFetch(b *testing.B) {
	s := newStore(b, func(c *remote.Config) { c.FetchChunkBytes = 2 << 20; c.Concurrency = 4 })
	ctx := context.Background()
	names := make([]string, benchObjects)
	bufs := make([][]byte, benchObjects)
	for i := range names {
		names[i] = pageName(b, s, "bench", key(fmt.Sprint("fetch", i)))
		d := randBytes(uint64(2000+i), benchObjectBytes)
		if _, err := s.Put(ctx, names[i], bytes.NewReader(d), int64(len(d))); err != nil {
			b.Fatal(err)
		}
		bufs[i] = make([]byte, benchObjectBytes)
	}
	ours := func(int) error {
		return parallel(benchObjects, benchParallel, func(i int) error {
			_, err := s.Fetch(ctx, names[i], sliceFile(bufs[i]), nil)
			return err
		})
	}
	plain := func(int) error {
		return parallel(benchObjects, benchParallel, func(i int) error {
			o, err := s.Client().GetObject(ctx, s.Bucket(), names[i], minio.GetObjectOptions{})
			if err != nil {
				return err
			}
			defer o.Close()
			_, err = io.ReadFull(o, bufs[i])
			return err
		})
	}
	versusLimit(b, benchObjects*benchObjectBytes, ours, plain)
}

// BenchmarkFetchCPU: what writing fetched bytes to a local file costs in
// CPU on top of the GET itself. 16 objects of 32 MiB + 16 KiB each (a
// Llama-3.1-8B page of 256 tokens), 16 in flight, each fetched by
// FetchObject (one GET, no verify) either into memory (into=memory: the
// same work as the plain GETs of the engine's BenchmarkRemoteFetch limit)
// or into a new file on disk, fdatasync'd and removed (into=file: the
// fetch's durable write without the rename). Reported per GiB fetched:
// this process's CPU seconds ("cpu-s/GiB", getrusage) and the server's
// ("srv-cpu-s/GiB", /proc), beside the MB/s b.SetBytes gives. On a 2-core machine that runs
// the server too, the sum of the two bounds the rate: the difference
// between the rows is the CPU a fetch that publishes locally spends that
// the limit does not.
func BenchmarkFetchCPU(b *testing.B) {
	const n, size = 16, 32<<20 + 16<<10
	s := newStore(b, func(c *remote.Config) { c.FetchChunkBytes = 64 << 20 })
	ctx := context.Background()
	objs := make([]remote.Object, n)
	bufs := make([][]byte, n)
	for i := range objs {
		name := pageName(b, s, "bench", key(fmt.Sprint("fetchcpu", i)))
		if _, err := s.Put(ctx, name, bytes.NewReader(randBytes(uint64(3000+i), size)), size); err != nil {
			b.Fatal(err)
		}
		o, err := s.Stat(ctx, name)
		if err != nil {
			b.Fatal(err)
		}
		objs[i] = o
		bufs[i] = bytes.Repeat([]byte{1}, size) // touched: no first-touch faults in the loop
	}
	dir := b.TempDir()
	for _, into := range []string{"memory", "file"} {
		b.Run("into="+into, func(b *testing.B) {
			fetch := func(i int) error {
				if into == "memory" {
					return s.FetchObject(ctx, objs[i], sliceFile(bufs[i]), nil)
				}
				f, err := os.CreateTemp(dir, "page")
				if err != nil {
					return err
				}
				defer os.Remove(f.Name())
				defer f.Close()
				if err := s.FetchObject(ctx, objs[i], f, nil); err != nil {
					return err
				}
				return unix.Fdatasync(int(f.Fd()))
			}
			b.SetBytes(n * size)
			b.ReportAllocs()
			var cpu, srvCPU time.Duration
			iters := 0
			for b.Loop() {
				c0, s0 := processCPU(), serverCPU(b)
				if err := parallel(n, n, fetch); err != nil {
					b.Fatal(err)
				}
				cpu += processCPU() - c0
				srvCPU += serverCPU(b) - s0
				iters++
			}
			gib := float64(iters) * n * size / (1 << 30)
			b.ReportMetric(cpu.Seconds()/gib, "cpu-s/GiB")
			b.ReportMetric(srvCPU.Seconds()/gib, "srv-cpu-s/GiB")
		})
	}
}

// processCPU is this process's CPU time so far (user + system).
func processCPU() time.Duration {
	var ru unix.Rusage
	if err := unix.Getrusage(unix.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// serverCPU is the shared server's CPU time so far.
func serverCPU(b *testing.B) time.Duration {
	d, err := srv.CPUTime()
	if err != nil {
		b.Fatal(err)
	}
	return d
}
