package bench

import (
	"context"
	"crypto/rand"
	"crypto/sha256"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/minio/minio-go/v7"

	"github.com/kvpersist/kvpersist/engine/remote"
	"github.com/kvpersist/kvpersist/internal/kvgen"
	"github.com/kvpersist/kvpersist/internal/seaweedfs"
)

// remotePageTokens is the page size of the remote benchmarks: 256 tokens
// of Llama-3.1-8B, 32 MiB per page (32 layers × K and V × 8 KV heads ×
// 128 head_dim × 2 bytes × 256 tokens).
const remotePageTokens = 256

// remoteWorkers is the uploads in flight, ours and the limit's alike.
const remoteWorkers = 4

// BenchmarkRemoteUpload: write-behind of new pages to a real SeaweedFS on
// loopback, started by the benchmark (not counted). Ours: every page
// enqueued on a remote.Uploader (remoteWorkers workers, create-only PUTs
// with If-None-Match: *, each body streamed from its local page file,
// reopened per attempt) and Close waiting for all. The limit, in the same
// iteration on the same files: the client's own PutObject of the same
// bytes under other names, one single-part PUT per page (as ours sends),
// remoteWorkers at a time, without the condition. x-limit = limit time /
// our time (target >= 0.8); GB/s and limit-GB/s are both rates. The
// objects of an iteration are deleted after it (untimed), so every
// iteration uploads new pages. The page files are random bytes on the
// benchmark disk (the tier treats pages as opaque), warm in the page
// cache for both sides. Sub-benchmarks by total size: MiB=1024 is the
// row of `make bench`; MiB=64 checks the benchmark quickly.
func BenchmarkRemoteUpload(b *testing.B) {
	srv := seaweedfs.StartTB(b)
	pageBytes := 2 * kvgen.Llama31_8B.Layers * kvgen.Llama31_8B.TensorBytes(remotePageTokens)
	for _, mib := range []int{64, 1024} {
		b.Run(fmt.Sprintf("MiB=%d", mib), func(b *testing.B) {
			benchRemoteUpload(b, srv, int64(mib)<<20/int64(pageBytes), pageBytes)
		})
	}
}

func benchRemoteUpload(b *testing.B, srv *seaweedfs.Server, pages int64, pageBytes int) {
	if pages < 1 {
		b.Fatalf("fewer than one %d-byte page", pageBytes)
	}
	s, err := remote.New(remote.Config{Endpoint: srv.Endpoint, Bucket: srv.Bucket, Prefix: "bench-upload",
		AccessKey: srv.AccessKey, SecretKey: srv.SecretKey})
	if err != nil {
		b.Fatal(err)
	}
	defer s.Close()
	ctx := context.Background()
	dir, err := os.MkdirTemp(benchRoot, "remote-upload-")
	if err != nil {
		b.Fatal(err)
	}
	defer removeAll(b, dir)
	paths := make([]string, pages)
	for i := range paths {
		paths[i] = filepath.Join(dir, fmt.Sprintf("page-%d", i))
		buf := make([]byte, pageBytes)
		if _, err := rand.Read(buf); err != nil {
			b.Fatal(err)
		}
		if err := os.WriteFile(paths[i], buf, 0o644); err != nil {
			b.Fatal(err)
		}
	}
	total := pages * int64(pageBytes)
	name := func(side string, iter, i int) string {
		h := sha256.Sum256(fmt.Appendf(nil, "%s/%d/%d", side, iter, i))
		n, err := s.PageName("ns", fmt.Sprintf("%x", h))
		if err != nil {
			b.Fatal(err)
		}
		return n
	}
	ours := func(iter int) error {
		u, err := remote.NewUploader(s, remote.UploaderConfig{Workers: remoteWorkers})
		if err != nil {
			return err
		}
		for i, p := range paths {
			up := remote.Upload{Name: name("ours", iter, i), Size: int64(pageBytes),
				Open: func() (remote.ReadAtCloser, error) { return os.Open(p) }}
			if err := u.Enqueue(up); err != nil {
				u.Close(ctx)
				return err
			}
		}
		if err := u.Close(ctx); err != nil {
			return err
		}
		if st := u.Stats(); st.Created != pages || st.BytesUploaded != total {
			return fmt.Errorf("uploader: %+v, want %d pages of %d bytes created", st, pages, total)
		}
		return nil
	}
	limit := func(iter int) error {
		return parallelForK(len(paths), remoteWorkers, func(i int) error {
			f, err := os.Open(paths[i])
			if err != nil {
				return err
			}
			defer f.Close()
			_, err = s.Client().PutObject(ctx, s.Bucket(), name("limit", iter, i), io.NewSectionReader(f, 0, int64(pageBytes)), int64(pageBytes),
				minio.PutObjectOptions{DisableMultipart: true, ContentType: "application/octet-stream"})
			return err
		})
	}
	cleanup := func(iter int) error {
		return parallelForK(len(paths), remoteWorkers, func(i int) error {
			if err := s.Delete(ctx, name("ours", iter, i)); err != nil {
				return err
			}
			return s.Delete(ctx, name("limit", iter, i))
		})
	}
	// One untimed warm-up: connections open, the server's volumes grown.
	for _, step := range []func(int) error{ours, limit, cleanup} {
		if err := step(-1); err != nil {
			b.Fatal(err)
		}
	}
	b.SetBytes(total)
	b.ReportAllocs()
	var tOurs, tLimit time.Duration
	iter := 0
	for b.Loop() {
		run := func(f func(int) error, d *time.Duration) {
			t0 := time.Now()
			if err := f(iter); err != nil {
				b.Fatal(err)
			}
			*d += time.Since(t0)
		}
		if iter%2 == 0 {
			run(ours, &tOurs)
			b.StopTimer()
			run(limit, &tLimit)
		} else {
			b.StopTimer()
			run(limit, &tLimit)
			b.StartTimer()
			run(ours, &tOurs)
			b.StopTimer()
		}
		if err := cleanup(iter); err != nil {
			b.Fatal(err)
		}
		b.StartTimer()
		iter++
	}
	n := float64(iter) * float64(total)
	b.ReportMetric(n/tOurs.Seconds()/1e9, "GB/s")
	b.ReportMetric(n/tLimit.Seconds()/1e9, "limit-GB/s")
	b.ReportMetric(n/tLimit.Seconds()/1e6, "limit-MB/s")
	b.ReportMetric(tLimit.Seconds()/tOurs.Seconds(), "x-limit")
}
