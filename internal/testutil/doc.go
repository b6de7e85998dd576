// Package testutil holds helpers for kvpersist's tests only: the
// fault-injecting file system (FaultFS), the Bun worker's fixtures and the
// formula of their content, and file helpers (copying, listing temp files,
// tree digests). Product code never imports it: the CLI's dependency test
// (cmd/kvpersist) checks that the binary links no test-only package. The
// synthetic KV caches used by the demo, synth and the benchmarks are in
// internal/kvgen.
package testutil
