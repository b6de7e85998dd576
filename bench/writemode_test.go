package bench

import (
	"fmt"
	"os"
	"path/filepath"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// BenchmarkWriteModes compares, on the workload's 1 GiB of bytes, the two
// ways a save could write its files, outside the engine and alternating on
// the same disk: buffered writes with early write-back (what the engine
// does: pwrite a chunk, sync_file_range it, fdatasync at the end) against
// O_DIRECT writes (the same pwrites past the page cache, 4 in flight for a
// single file; fdatasync still needed for the file's size and extents):
//   - single: one file, 4 MiB pwrites from the tensors' bytes, on every core;
//   - blocks: 1,024 files of 1 MiB, each created, written, and handed to 32
//     fdatasync waiters (as block saves do), then closed.
//
// It reports buffered-MB/s, direct-MB/s and direct/buffered (time ratio:
// above 1 means O_DIRECT was faster). Not part of make bench: it measures
// a design choice, not kvpersist.
func BenchmarkWriteModes(b *testing.B) {
	w := getWorkload(b, benchModel, benchTokens[len(benchTokens)-1])
	for _, kind := range []string{"single", "blocks"} {
		b.Run(kind, func(b *testing.B) {
			dir := mkdir(b, "writemodes-"+kind)
			defer removeAll(b, dir)
			write := writeSingleFile
			if kind == "blocks" {
				write = writeBlockFiles
			}
			var tb, td time.Duration
			run := func(direct bool, i int) {
				p := filepath.Join(dir, fmt.Sprintf("%v-%d", direct, i))
				settle(b, dir)
				t0 := time.Now()
				if err := write(p, w.contig, direct); err != nil {
					b.Fatal(err)
				}
				d := time.Since(t0)
				if direct {
					td += d
				} else {
					tb += d
				}
				removeAll(b, p)
			}
			b.SetBytes(int64(len(w.contig)))
			for i := 0; i < b.N; i++ {
				run(i%2 == 0, i)
				run(i%2 != 0, i)
			}
			n := float64(len(w.contig)) * float64(b.N)
			b.ReportMetric(n/tb.Seconds()/1e6, "buffered-MB/s")
			b.ReportMetric(n/td.Seconds()/1e6, "direct-MB/s")
			b.ReportMetric(float64(tb)/float64(td), "direct/buffered")
		})
	}
}

const writeChunkBytes = 4 << 20

func openForWrite(path string, direct bool) (int, error) {
	flag := unix.O_CREAT | unix.O_EXCL | unix.O_WRONLY | unix.O_CLOEXEC
	if direct {
		flag |= unix.O_DIRECT
	}
	return unix.Open(path, flag, 0o640)
}

// writeSingleFile writes data to a new file at path in 4 MiB pwrites on
// every core (4 goroutines with O_DIRECT), each followed by sync_file_range
// when buffered; then fdatasync. data is page-aligned (mmap'd) and its
// length a multiple of 4 KiB here, as O_DIRECT needs.
func writeSingleFile(path string, data []byte, direct bool) error {
	if len(data)%pageBytes != 0 {
		return fmt.Errorf("writeSingleFile: %d bytes is not whole pages", len(data))
	}
	fd, err := openForWrite(path, direct)
	if err != nil {
		return err
	}
	defer unix.Close(fd)
	if err := unix.Fallocate(fd, 0, 0, int64(len(data))); err != nil {
		return err
	}
	chunks := (len(data) + writeChunkBytes - 1) / writeChunkBytes
	workers := 4
	if !direct {
		workers = min(workers, 2)
	}
	var next atomic.Int64
	var wg sync.WaitGroup
	var errMu sync.Mutex
	var first error
	for range workers {
		wg.Go(func() {
			for {
				k := int(next.Add(1) - 1)
				if k >= chunks {
					return
				}
				off := k * writeChunkBytes
				c := data[off:min(off+writeChunkBytes, len(data))]
				_, err := unix.Pwrite(fd, c, int64(off))
				if err == nil && !direct {
					err = unix.SyncFileRange(fd, int64(off), int64(len(c)), unix.SYNC_FILE_RANGE_WRITE)
				}
				if err != nil {
					errMu.Lock()
					first = cmpOr(first, err)
					errMu.Unlock()
					return
				}
			}
		})
	}
	wg.Wait()
	if first != nil {
		return first
	}
	return unix.Fdatasync(fd)
}

// writeBlockFiles writes data as 1 MiB files in directory path (made
// here): each created, written (sync_file_range when buffered) and handed
// to one of 32 waiters that fdatasync and close it.
func writeBlockFiles(path string, data []byte, direct bool) error {
	const blockBytes = 1 << 20
	if err := os.Mkdir(path, 0o750); err != nil {
		return err
	}
	fds := make(chan int, 64)
	var wg sync.WaitGroup
	var errMu sync.Mutex
	var first error
	fail := func(err error) {
		errMu.Lock()
		first = cmpOr(first, err)
		errMu.Unlock()
	}
	for range 32 {
		wg.Go(func() {
			for fd := range fds {
				if err := unix.Fdatasync(fd); err != nil {
					fail(err)
				}
				unix.Close(fd)
			}
		})
	}
	// The engine writes blocks from its pool's goroutines: 2 here.
	var next atomic.Int64
	var writers sync.WaitGroup
	n := (len(data) + blockBytes - 1) / blockBytes
	for range 2 {
		writers.Go(func() {
			for {
				k := int(next.Add(1) - 1)
				if k >= n {
					return
				}
				c := data[k*blockBytes : min((k+1)*blockBytes, len(data))]
				fd, err := openForWrite(filepath.Join(path, fmt.Sprintf("%06d", k)), direct)
				if err != nil {
					fail(err)
					return
				}
				if _, err := unix.Pwrite(fd, c, 0); err != nil {
					unix.Close(fd)
					fail(err)
					return
				}
				if !direct {
					_ = unix.SyncFileRange(fd, 0, 0, unix.SYNC_FILE_RANGE_WRITE)
				}
				fds <- fd
			}
		})
	}
	writers.Wait()
	close(fds)
	wg.Wait()
	return first
}
