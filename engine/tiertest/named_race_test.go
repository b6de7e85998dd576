package tiertest

import (
	"bytes"
	"context"
	"errors"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"

	"github.com/minio/minio-go/v7"

	"github.com/kvpersist/kvpersist/engine"
	"github.com/kvpersist/kvpersist/internal/testutil"
)

// Named reads and manifest uploads racing other writers: a second engine
// on the same root (another process's view of it), a rewrite of a name
// while its upload waits, a read cancelled while it fetches.

// uploadNamed writes tokens' KV as the page manifest name on an engine of
// its own (root rootX, the bucket under prefix) and closes it, its
// uploads done: the name and its pages are then in the bucket.
func uploadNamed(t *testing.T, prefix, rootX, name string, tokens []uint32) {
	t.Helper()
	x := newEngine(t, rootX, prefix, newRecorder(t), nil)
	writePages(t, x, name, tokens)
	closeEngine(t, x)
}

// isPageGet matches the GETs that fetch a page (not a manifest).
func isPageGet(r *http.Request) bool {
	return r.Method == http.MethodGet && strings.Contains(r.URL.Path, "/pages/")
}

// noTier is an engine config change: no remote tier (an engine of another
// process on the same root, or a tool).
func noTier(c *engine.Config) { c.Remote = nil }

// TestNamedReadKeepsANameWrittenMeanwhile: A reads a name that exists only
// remotely (v1, uploaded by X). While A fetches its pages, B, another
// engine on A's root, writes the name locally (v2, other tokens). B's
// write is the newest and must stay: A's read-through must not rename the
// older remote manifest over it. A's read then reads the local name (v2),
// and the local file is still B's.
func TestNamedReadKeepsANameWrittenMeanwhile(t *testing.T) {
	prefix := bucketPrefix(t)
	rootX, root := t.TempDir(), t.TempDir()
	v1, v2 := seq(41000, 3*ptoks), seq(43000, 3*ptoks)
	uploadNamed(t, prefix, rootX, "conv", v1)

	b := newEngineCfg(t, root, prefix, newRecorder(t), nil, noTier)
	var hookErr error
	var written []byte // B's manifest, read right after its write
	hook := &hookRT{next: http.DefaultTransport.(*http.Transport).Clone(), match: isPageGet, hook: func() {
		c := newKV(len(v2))
		c.fill(v2)
		res := b.Do(context.Background(), &engine.WriteRequest{Ref: engine.Ref{Namespace: ns, Name: "conv"}, Layout: engine.Pages,
			Identity: ident, Tokens: v2, PageTokens: ptoks, Caches: []engine.EntrySpec{{Tensors: c.specs(len(v2))}}})
		if hookErr = res.Err; hookErr == nil {
			written, hookErr = os.ReadFile(filepath.Join(root, ns, "conv"))
		}
	}}
	a := newEngine(t, root, prefix, newRecorder(t), func(rt *engine.RemoteTier) { rt.Store.Transport = hook })
	res, dest := readNamed(a, "conv", len(v1))
	if hookErr != nil || hook.seen.Load() == 0 {
		t.Fatalf("B's write during A's fetch: %v (%d page GETs)", hookErr, hook.seen.Load())
	}
	if got := readFile(t, filepath.Join(root, ns, "conv")); !bytes.Equal(got, written) {
		t.Fatal("A's read-through replaced the name B wrote meanwhile with the older remote manifest")
	}
	if res.Err != nil {
		t.Fatalf("A's read: %v (remote %+v)", res.Err, res.Remote)
	}
	checkNamed(t, dest, v2)
	if tmp := testutil.TempFiles(t, root); len(tmp) > 0 {
		t.Fatalf("temp files left: %v", tmp)
	}
}

// TestNamedReadFetchesAPageEvictedByAnotherEngine: A saves a prefix S (2
// pages); B, another engine on A's root with a cache of 2 pages, saves Y
// and evicts S's pages. X (its own root) writes a page manifest of S and 2
// more pages and uploads it. A's named read of it must fetch S's pages
// too: A's index still lists them, but their files are gone (before: they
// were skipped, the fetched manifest was published naming 2 missing
// pages, and the read failed with ErrMissingPage).
func TestNamedReadFetchesAPageEvictedByAnotherEngine(t *testing.T) {
	prefix := bucketPrefix(t)
	rootX, root := t.TempDir(), t.TempDir()
	s, y := seq(45000, 2*ptoks), seq(47000, 2*ptoks)
	conv := append(append([]uint32{}, s...), seq(49000, 2*ptoks)...)
	ks, kc := keysOf(t, s), keysOf(t, conv)
	a := newEngine(t, root, prefix, newRecorder(t), nil)
	save(t, a, s)
	capacity := 2 * fullPageAlloc(t, root, ks)
	b := newEngineCfg(t, root, prefix, newRecorder(t), nil, func(c *engine.Config) { noTier(c); c.CapacityBytes = capacity })
	save(t, b, y)
	checkStored(t, root, "S", ks, bools(len(ks), func(int) bool { return false }))

	uploadNamed(t, prefix, rootX, "conv", conv)

	res, dest := readNamed(a, "conv", len(conv))
	if res.Err != nil {
		t.Fatalf("A's read: %v (remote %+v)", res.Err, res.Remote)
	}
	checkNamed(t, dest, conv)
	if res.Remote.PagesFetched != len(kc) {
		t.Fatalf("fetched %d pages, want %d (S's evicted pages too)", res.Remote.PagesFetched, len(kc))
	}
	checkStored(t, root, "conv", kc, bools(len(kc), func(int) bool { return true }))
}

// TestRewrittenManifestUploadedAfterAQueuedOne: a page manifest is
// written while the uploads of its pages are held (the first page PUT
// waits), so its own upload is still queued when the name is written
// again with other tokens. The first upload then finds its local file
// changed and is not sent; the second version, which the rewrite could
// not queue (the name was queued already), must still reach the bucket
// while the engine runs (the manifest is queued again): the remote
// manifest equals the local file, and every page of both versions is
// stored.
func TestRewrittenManifestUploadedAfterAQueuedOne(t *testing.T) {
	prefix := bucketPrefix(t)
	root := t.TempDir()
	v1, v2 := seq(51000, 2*ptoks), seq(53000, 2*ptoks)
	release := make(chan struct{})
	var once sync.Once
	hook := &hookRT{next: http.DefaultTransport.(*http.Transport).Clone(),
		match: func(r *http.Request) bool {
			return r.Method == http.MethodPut && strings.Contains(r.URL.Path, "/pages/")
		},
		hook: func() { <-release }}
	defer once.Do(func() { close(release) })
	e := newEngine(t, root, prefix, newRecorder(t), func(rt *engine.RemoteTier) { rt.Store.Transport = hook })
	writePages(t, e, "conv", v1)
	waitFor(t, "the first page PUT", func() bool { return hook.seen.Load() > 0 })
	writePages(t, e, "conv", v2)
	once.Do(func() { close(release) })
	st := openStore(t, prefix)
	mname, _ := st.ManifestName(ns, "conv")
	local := readFile(t, filepath.Join(root, ns, "conv"))
	waitFor(t, "the rewritten manifest in the bucket", func() bool { return bytes.Equal(objects(t, st)[mname], local) })
	closeEngine(t, e)
	checkObjects(t, prefix, root, append(keysOf(t, v1), keysOf(t, v2)...), "conv")
}

// TestNamedReadCancelledMidFetch: a named read whose context ends while
// its pages are fetched fails with the context's error; it leaves no temp
// file, publishes no manifest, and the engine's accounting equals a walk
// of the page tree. Nothing written to the caller's buffers after the ack
// is checked by reading the buffers twice, a while apart: the second read
// of the engine's pages happens after the ack and must not race (-race).
func TestNamedReadCancelledMidFetch(t *testing.T) {
	prefix := bucketPrefix(t)
	rootX, root := t.TempDir(), t.TempDir()
	conv := seq(55000, 6*ptoks)
	uploadNamed(t, prefix, rootX, "conv", conv)

	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	hook := &nthRT{next: http.DefaultTransport.(*http.Transport).Clone(), match: isPageGet, n: 3, hook: cancel}
	a := newEngine(t, root, prefix, newRecorder(t), func(rt *engine.RemoteTier) {
		rt.Store.Transport = hook
		rt.FetchPages = 2
	})
	n := heads * len(conv) * headDim * item
	dest := [][]byte{make([]byte, n), make([]byte, n)}
	res := a.Do(ctx, &engine.ReadRequest{Ref: engine.Ref{Namespace: ns, Name: "conv"}, Dest: dest})
	if !errors.Is(res.Err, context.Canceled) {
		t.Fatalf("cancelled read: %v (remote %+v); want context.Canceled", res.Err, res.Remote)
	}
	// The buffers are the caller's again: writing them must not race with
	// anything the engine still runs.
	for _, d := range dest {
		clear(d)
	}
	if _, err := os.Lstat(filepath.Join(root, ns, "conv")); !os.IsNotExist(err) {
		t.Fatalf("manifest published by a cancelled read (lstat: %v)", err)
	}
	checkUsageIsDisk(t, a, root, 1<<40)
	res, dest = readNamed(a, "conv", len(conv))
	if res.Err != nil {
		t.Fatalf("read after the cancelled one: %v (remote %+v)", res.Err, res.Remote)
	}
	checkNamed(t, dest, conv)
	checkUsageIsDisk(t, a, root, 1<<40)
}

// TestNamedReadKeepsItsLocalPages: A's cache holds 3 pages: a prefix S (2
// pages, saved first, so least recently used) and Z (1 page). A named
// read of a manifest of S and one more page, stored only remotely, must
// make room for that page without evicting S's pages, which the read
// needs: Z's page is evicted, the read gets every byte, and the
// accounting equals the disk (before: S's leaf was evicted for the
// fetched page, the manifest was published naming it, and the read failed
// with ErrMissingPage).
func TestNamedReadKeepsItsLocalPages(t *testing.T) {
	prefix := bucketPrefix(t)
	rootX, root := t.TempDir(), t.TempDir()
	s, z := seq(57000, 2*ptoks), seq(59000, ptoks)
	conv := append(append([]uint32{}, s...), seq(61000, ptoks)...)
	kz, kc := keysOf(t, z), keysOf(t, conv)
	uploadNamed(t, prefix, rootX, "conv", conv)
	capacity := 3 * fullPageAlloc(t, rootX, kc)

	a := newEngineCfg(t, root, prefix, newRecorder(t), nil, func(c *engine.Config) { c.CapacityBytes = capacity })
	save(t, a, s)
	save(t, a, z)
	res, dest := readNamed(a, "conv", len(conv))
	if res.Err != nil {
		t.Fatalf("read: %v (remote %+v)", res.Err, res.Remote)
	}
	checkNamed(t, dest, conv)
	if res.Remote.PagesFetched != 1 {
		t.Fatalf("fetched %d pages, want 1", res.Remote.PagesFetched)
	}
	checkStored(t, root, "conv", kc, bools(len(kc), func(int) bool { return true }))
	checkStored(t, root, "Z", kz, bools(len(kz), func(int) bool { return false }))
	checkUsageIsDisk(t, a, root, capacity)
}

// TestConcurrentNamedReadsOfOneRemoteName: reads of one path run
// together, so several reads of a name stored only remotely fetch its
// pages and publish its manifest at once. Each gets every byte, no temp
// file is left, and every page is accounted once: the accounting equals a
// walk of the page tree.
func TestConcurrentNamedReadsOfOneRemoteName(t *testing.T) {
	prefix := bucketPrefix(t)
	rootX, root := t.TempDir(), t.TempDir()
	conv := seq(63000, 5*ptoks+7)
	uploadNamed(t, prefix, rootX, "conv", conv)

	a := newEngineCfg(t, root, prefix, newRecorder(t), nil, func(c *engine.Config) { c.Workers = 4 })
	const readers = 4
	var wg sync.WaitGroup
	results := make([]engine.Result, readers)
	dests := make([][][]byte, readers)
	for i := range readers {
		wg.Go(func() { results[i], dests[i] = readNamed(a, "conv", len(conv)) })
	}
	wg.Wait()
	for i := range readers {
		if results[i].Err != nil {
			t.Fatalf("reader %d: %v (remote %+v)", i, results[i].Err, results[i].Remote)
		}
		checkNamed(t, dests[i], conv)
	}
	checkUsageIsDisk(t, a, root, 1<<40)
	if tmp := testutil.TempFiles(t, root); len(tmp) > 0 {
		t.Fatalf("temp files left: %v", tmp)
	}
}

// TestManifestUploadedAfterRemoteGCDeletedItsPages: an engine saves a
// prefix (its pages uploaded, so known stored); remote gc then deletes
// them (prefix pages no manifest names are garbage once past the grace;
// here deleted with plain DELETEs of the client). A page manifest of the
// same tokens written later must still reach the bucket with its pages
// while the engine runs: the manifest's HEADs find the pages missing, and
// the retry must upload them again rather than trust the known set
// (before: every retry skipped them as known, and the manifest was given
// up until the next start).
func TestManifestUploadedAfterRemoteGCDeletedItsPages(t *testing.T) {
	prefix := bucketPrefix(t)
	root := t.TempDir()
	conv := seq(65000, 3*ptoks)
	keys := keysOf(t, conv)
	rec := newRecorder(t)
	e := newEngine(t, root, prefix, rec, nil)
	save(t, e, conv)
	waitFor(t, "the pages' uploads", func() bool { return snapshotOps(rec)["upload/ok"] == uint64(len(keys)) })
	st := openStore(t, prefix)
	for _, k := range keys {
		name, _ := st.PageName(ns, k.String())
		if err := st.Client().RemoveObject(context.Background(), st.Bucket(), name, minio.RemoveObjectOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	if got := objects(t, st); len(got) != 0 {
		t.Fatalf("%d objects left after the deletes", len(got))
	}
	writePages(t, e, "conv", conv)
	mname, _ := st.ManifestName(ns, "conv")
	local := readFile(t, filepath.Join(root, ns, "conv"))
	waitFor(t, "the manifest in the bucket", func() bool { return bytes.Equal(objects(t, st)[mname], local) })
	checkObjects(t, prefix, root, keys, "conv")
}

// TestNamedReadWithRoomForPartOfIt: A's cache holds 4 pages, 3 of them
// pinned by a page manifest of its own. A named read of a 2-page snapshot
// stored only remotely has room for one page: the read fails with
// ErrNoSpace, the manifest is not published, at most one page is fetched,
// A's page manifest keeps every page, and the accounting equals the disk
// within the capacity. Once the manifest that pinned the cache is deleted,
// the same read succeeds.
func TestNamedReadWithRoomForPartOfIt(t *testing.T) {
	prefix := bucketPrefix(t)
	rootX, root := t.TempDir(), t.TempDir()
	conv, y := seq(67000, 2*ptoks), seq(69000, 3*ptoks)
	kc, ky := keysOf(t, conv), keysOf(t, y)
	uploadNamed(t, prefix, rootX, "conv", conv)
	capacity := 4 * fullPageAlloc(t, rootX, kc)

	a := newEngineCfg(t, root, prefix, newRecorder(t), nil, func(c *engine.Config) { c.CapacityBytes = capacity })
	writePages(t, a, "keep", y)
	res, _ := readNamed(a, "conv", len(conv))
	if !errors.Is(res.Err, engine.ErrNoSpace) || res.Remote.PagesFetched > 1 {
		t.Fatalf("read: %v (remote %+v); want ErrNoSpace, at most 1 page fetched", res.Err, res.Remote)
	}
	if _, err := os.Lstat(filepath.Join(root, ns, "conv")); !os.IsNotExist(err) {
		t.Fatalf("manifest published without its pages (lstat: %v)", err)
	}
	checkStored(t, root, "keep", ky, bools(len(ky), func(int) bool { return true }))
	checkUsageIsDisk(t, a, root, capacity)

	if r := a.Do(context.Background(), &engine.DeleteRequest{Ref: engine.Ref{Namespace: ns, Name: "keep"}}); r.Err != nil {
		t.Fatalf("delete keep: %v", r.Err)
	}
	res, dest := readNamed(a, "conv", len(conv))
	if res.Err != nil {
		t.Fatalf("read after the delete: %v (remote %+v)", res.Err, res.Remote)
	}
	checkNamed(t, dest, conv)
	checkUsageIsDisk(t, a, root, capacity)
}
