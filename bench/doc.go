// Package bench is kvpersist's benchmark suite against the machine's
// limits. It has no API: everything is in its _test.go files.
//
// Every benchmark runs one engine operation on Llama-3.1-8B geometry
// (32 layers, 8 KV heads, head_dim 128, bf16, capacity-padded views as
// mlx-lm keeps them) at 2,048 and 8,192 tokens (about 256 MiB and 1 GiB),
// on a directory of a real disk with fsync on, and measures beside it, in
// the same process and on the same bytes, the limit the operation is held
// to (a raw write + fdatasync, SHA-256 on all cores, pread, readdir +
// unlink, a direct function call). It reports the throughput (MB/s from
// b.SetBytes), the allocations, and x-limit = limit time / engine time
// (engine throughput / limit throughput: 1.0 means the engine runs at the
// limit). Save and restore rows also report peak-heap-MiB, the largest Go
// heap (live and dead objects, runtime/metrics
// "/memory/classes/heap/objects:bytes", sampled every millisecond) seen
// while the engine ran; the KV cache and the restore buffers are mmap'd, so
// they are not Go heap.
//
// The directory: $KVPERSIST_BENCH_DIR when set (it must not be tmpfs), else
// os.TempDir() unless it is tmpfs, else this package's directory. A fresh
// subdirectory is made in it and removed at the end.
//
// BenchmarkRemoteUpload is the exception to the disk rule: it uploads 1 GiB
// of new pages (32 MiB each) through remote.Uploader to a real SeaweedFS it
// starts on loopback, beside the client's own PUTs of the same bytes.
// BenchmarkRemoteFetch fetches a 1 GiB prefix from it into the local tier
// and views, beside three limits in the same iterations: the client's
// GETs into memory (x-limit), the same GETs each written durably to its
// own file (x-getwrite), and that disk write alone (x-write).
// BenchmarkPrefixRemoteSave runs BenchmarkPrefix's save rows on an engine
// whose object-store tier is a SeaweedFS it starts: the cost of
// write-behind (descriptors, uploads-journal records) on a save's ack.
//
// BenchmarkPrefixEvents runs the save-empty row on an engine publishing
// KV events to a subscriber on loopback, beside the same save without
// events in the same iterations (x-off, target >= 0.95).
//
// BenchmarkRestorePartlyCached restores a snapshot whose file is in the
// page cache except one range in twelve, against reads of each 1 MiB range
// the faster way (buffered when cached, else O_DIRECT).
//
// Run it with ./bench/run.sh (make bench), which writes
// bench/results/<date>-<hostname>.txt and ends with the table
// bench/benchtable prints of it: every row's x-limit against its target.
package bench
