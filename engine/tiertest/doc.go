// Package tiertest holds the engine's object-store tier tests: two
// engines with separate local roots and one bucket on a real SeaweedFS
// server (internal/seaweedfs), read-through, write-behind, corrupt
// objects and the server killed during fetches and uploads, and the tier
// package (engine/tier) alone, wired by hand as the engine wires it. It has no
// code of its own; its TestMain starts the server (and fails, never
// skips, when it cannot be built or started), apart from package
// engine's tests, which need no server.
package tiertest
