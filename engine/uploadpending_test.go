package engine

import (
	"bytes"
	"context"
	"errors"
	"log/slog"
	"os"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvpersist/kvpersist/engine/layout"
)

// A page whose upload is pending is evicted last (ARCHITECTURE.md, "A
// pending upload is evicted last"), tested without a server: the remote
// tier points at a closed port, so every upload stays pending. The
// engine/tiertest package tests the same against a real server, where
// uploads settle.

// uploadSink counts the pages evicted with their upload pending.
type uploadSink struct {
	NopMetrics
	uploadEvicted atomic.Int64
}

func (s *uploadSink) RemoteUploadEvicted(pages int64) { s.uploadEvicted.Add(pages) }

// openStalledTier opens an engine on root whose remote tier points at a
// closed loopback port, with a backoff of an hour: every upload fails its
// first attempt and then waits, pending, until closeStalled abandons it.
// queue: RemoteTier.UploadQueue (0: the default).
func openStalledTier(t *testing.T, root string, capacity int64, m MetricsSink, log *slog.Logger, queue int) *Engine {
	t.Helper()
	if log == nil {
		log = newEngineLogger()
	}
	e, err := New(Config{Root: root, NoSync: true, Workers: 1, Logger: log, Metrics: m, CapacityBytes: capacity, Remote: &RemoteTier{
		Store:            RemoteConfig{Endpoint: "http://127.0.0.1:1", Bucket: "b", AccessKey: "k", SecretKey: "s", MaxRetries: 1},
		UploadBackoffMin: time.Hour, UploadBackoffMax: time.Hour, UploadWorkers: 1, UploadQueue: queue,
	}})
	if err != nil {
		t.Fatal(err)
	}
	return e
}

// closeStalled closes e at once: its pending uploads are abandoned (and
// stay listed in the uploads journal).
func closeStalled(t *testing.T, e *Engine) {
	t.Helper()
	ctx, cancel := context.WithCancel(bg)
	cancel()
	if err := e.Close(ctx); err != nil && !errors.Is(err, ErrUploadsAbandoned) {
		t.Fatalf("Close: %v", err)
	}
}

// saveWithoutTier saves toks in namespace p of root by an engine without
// a remote tier: no upload is queued, so its pages are never pending.
func saveWithoutTier(t *testing.T, root string, toks []uint32) {
	t.Helper()
	e, err := New(Config{Root: root, NoSync: true, Workers: 1, Logger: newEngineLogger()})
	if err != nil {
		t.Fatal(err)
	}
	mustSavePages(t, e, "p", toks)
	if err := e.Close(bg); err != nil {
		t.Fatal(err)
	}
}

// storedPages is how many pages of toks' chain in ns, from its first, are
// stored: tracked by the page cache (whose accounting checkAccounting
// compares with the disk) and their files present. It records no access
// (Engine.Lookup would, changing the order under test).
func storedPages(t *testing.T, e *Engine, ns string, toks []uint32) int {
	t.Helper()
	n, err := e.store.Namespace(ns)
	if err != nil {
		t.Fatal(err)
	}
	for i, k := range chainKeys(t, toks) {
		_, tracked := e.pc.Tracked(ns, k)
		if _, err := os.Lstat(n.PagePath(k)); err != nil || !tracked {
			return i
		}
	}
	return len(toks) / cP
}

func chainKeys(t *testing.T, toks []uint32) []layout.PageKey {
	t.Helper()
	keys, _, err := layout.PageChain("tiny", cP, toks)
	if err != nil {
		t.Fatal(err)
	}
	return keys
}

// TestPendingUploadsEvictedLast: conversation P is saved while the store
// is unreachable (its upload pending when that engine closes: the uploads
// journal lists it), then Q, newer, by an engine without a remote tier
// (no upload, nothing pending). An engine with the unreachable tier and a
// capacity of 5 pages replays the journal at New: P's pages are pending
// again, Q's are not. Saving R (pending) then evicts Q's leaf although P
// is older (plain LRU evicts P's leaf); saving S evicts Q's root, then,
// nothing else evictable, P's leaf, the least recently used pending page
// (no ErrNoSpace), counted and logged; saving T, with only pending pages
// left, evicts P's root and R's leaf. Each eviction keeps leaves first.
func TestPendingUploadsEvictedLast(t *testing.T) {
	pb := pageBytes(t)
	root := t.TempDir()
	P, Q, R, S, T := convTokens(0, 2*cP, 1), convTokens(0, 2*cP, 2), convTokens(0, 2*cP, 3), convTokens(0, 2*cP, 4), convTokens(0, 2*cP, 5)

	e := openStalledTier(t, root, 0, nil, nil, 0)
	mustSavePages(t, e, "p", P)
	closeStalled(t, e)
	saveWithoutTier(t, root, Q)

	m := &uploadSink{}
	var logs bytes.Buffer
	e = openStalledTier(t, root, 5*pb, m, slog.New(slog.NewTextHandler(&syncWriter{w: &logs}, nil)), 0)
	defer closeStalled(t, e)
	for _, k := range chainKeys(t, P) {
		if !e.pc.Pending("p", k) {
			t.Fatalf("page %s of P, replayed from the journal at New, is not pending", k)
		}
	}
	for _, k := range chainKeys(t, Q) {
		if e.pc.Pending("p", k) {
			t.Fatalf("page %s of Q, never queued, is pending", k)
		}
	}
	if a, b := mustAccess(t, e, P[:cP]), mustAccess(t, e, Q[:cP]); a >= b {
		t.Fatalf("P's access %d is not older than Q's %d: the test shows nothing", a, b)
	}

	mustSavePages(t, e, "p", R)
	expectStored(t, e, "after R", stored{"P", P, 2}, stored{"Q", Q, 1}, stored{"R", R, 2})
	if n := m.uploadEvicted.Load(); n != 0 {
		t.Fatalf("after R: %d pages evicted with their upload pending, want 0", n)
	}

	mustSavePages(t, e, "p", S)
	expectStored(t, e, "after S", stored{"P", P, 1}, stored{"Q", Q, 0}, stored{"R", R, 2}, stored{"S", S, 2})
	if n := m.uploadEvicted.Load(); n != 1 {
		t.Fatalf("after S: %d pages evicted with their upload pending, want 1 (P's leaf)", n)
	}
	if !strings.Contains(logs.String(), "upload to the object store was pending") {
		t.Fatalf("no Warn for the page evicted with its upload pending; log:\n%s", logs.String())
	}

	mustSavePages(t, e, "p", T)
	expectStored(t, e, "after T", stored{"P", P, 0}, stored{"R", R, 1}, stored{"S", S, 2}, stored{"T", T, 2})
	if n := m.uploadEvicted.Load(); n != 3 {
		t.Fatalf("after T: %d pages evicted with their upload pending, want 3", n)
	}
	checkAccounting(t, e, root)
}

// stored is how many pages of conversation name (its tokens toks) a test
// expects stored.
type stored struct {
	name string
	toks []uint32
	want int
}

// expectStored fails unless each conversation has its expected pages
// stored (storedPages) at the test's point when.
func expectStored(t *testing.T, e *Engine, when string, cs ...stored) {
	t.Helper()
	for _, c := range cs {
		if got := storedPages(t, e, "p", c.toks); got != c.want {
			t.Fatalf("%s: %s has %d pages stored, want %d", when, c.name, got, c.want)
		}
	}
}

// mustAccess is the policy's last access of the page ending toks' chain.
func mustAccess(t *testing.T, e *Engine, toks []uint32) int64 {
	t.Helper()
	keys := chainKeys(t, toks)
	p, ok := e.pc.Tracked("p", keys[len(keys)-1])
	if !ok {
		t.Fatalf("page %s not tracked", keys[len(keys)-1])
	}
	return p.Access
}

// TestSpilledUploadsStayPending: with an upload queue of one and one
// worker, a save of 4 pages while the store is unreachable has one upload
// in flight, one queued and two spilled to the uploads journal (queued
// from it when the queue drains). All four are pending uploads: the
// spilled ones keep their mark. With a capacity of 5 pages holding P's 4
// and Q's 1 (a newer page saved before the tier existed, so not pending),
// a save of R's page evicts Q, though P's leaf is older; a further save
// then evicts P's leaf, the least recently used pending page, as nothing
// else is left.
func TestSpilledUploadsStayPending(t *testing.T) {
	pb := pageBytes(t)
	root := t.TempDir()
	P, Q, R := convTokens(0, 4*cP, 1), convTokens(0, cP, 2), convTokens(0, cP, 3)
	e := openStalledTier(t, root, 0, nil, nil, 1)
	mustSavePages(t, e, "p", P)
	if st := e.tier.UploaderStats(); st.Queued+st.InFlight >= 4 {
		t.Fatalf("%d uploads queued or in flight: none spilled, the test shows nothing", st.Queued+st.InFlight)
	}
	for i, k := range chainKeys(t, P) {
		if !e.pc.Pending("p", k) {
			t.Fatalf("page %d of P (in flight, queued or spilled) is not pending", i)
		}
	}
	closeStalled(t, e)
	saveWithoutTier(t, root, Q)
	// The queue of one at New: P's pages replayed, most of them spilled
	// again, all pending.
	e = openStalledTier(t, root, 5*pb, nil, nil, 1)
	defer closeStalled(t, e)
	if a, b := mustAccess(t, e, P), mustAccess(t, e, Q); a >= b {
		t.Fatalf("P's leaf's access %d is not older than Q's %d: the test shows nothing", a, b)
	}
	mustSavePages(t, e, "p", R)
	if got := storedPages(t, e, "p", Q); got != 0 {
		t.Fatalf("Q, not pending, has %d pages stored: want it evicted first", got)
	}
	if got := storedPages(t, e, "p", P); got != 4 {
		t.Fatalf("P has %d pages stored, want 4", got)
	}
	mustSavePages(t, e, "p", convTokens(0, cP, 4))
	if got := storedPages(t, e, "p", P); got != 3 {
		t.Fatalf("P has %d pages stored, want 3 (its leaf, the oldest pending page, evicted when nothing else was)", got)
	}
	checkAccounting(t, e, root)
}
