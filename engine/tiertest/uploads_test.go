package tiertest

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"log/slog"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/zeebo/xxh3"

	"github.com/kvpersist/kvpersist/engine"
	"github.com/kvpersist/kvpersist/engine/layout"
	"github.com/kvpersist/kvpersist/internal/faultproxy"
)

// waitFor polls cond every 10 ms until it holds, failing the test after a
// minute (a bound for a stuck test, not a measured time).
func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(time.Minute)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("still waiting for %s after a minute", what)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// checkObjects fails unless the bucket under st holds exactly the pages
// keys of root and the manifests names of root, each object byte-identical
// to the local file.
func checkObjects(t *testing.T, prefix, root string, keys []layout.PageKey, names ...string) {
	t.Helper()
	st := openStore(t, prefix)
	got := objects(t, st)
	want := map[string][]byte{}
	for _, k := range keys {
		name, _ := st.PageName(ns, k.String())
		want[name] = readFile(t, pagePath(root, k))
	}
	for _, n := range names {
		name, _ := st.ManifestName(ns, n)
		want[name] = readFile(t, filepath.Join(root, ns, n))
	}
	if len(got) != len(want) {
		t.Fatalf("bucket holds %d objects, want %d (%d pages, manifests %v)", len(got), len(want), len(keys), names)
	}
	for name, w := range want {
		if !bytes.Equal(got[name], w) {
			t.Fatalf("object %s: %d bytes, differs from the local file (%d bytes)", name, len(got[name]), len(w))
		}
	}
}

// TestFailedManifestUploadRetried: the pages of a conversation are
// stored; then every HEAD and PUT fails (503) while a page manifest naming
// them is written, so its upload fails (manifestReady's HEADs). Once the
// store answers again, the engine queues the manifest again by itself
// (before: it was never retried), its first PUTs still fail for a while,
// and Close finds it in the bucket, byte-identical to the local file. At
// every PUT of the manifest that reached the store, every page it names
// was already stored.
func TestFailedManifestUploadRetried(t *testing.T) {
	prefix := bucketPrefix(t)
	root := t.TempDir()
	conv := seq(31000, 3*ptoks+5)
	keys := keysOf(t, conv)
	p := faultproxy.Start(t, srv.Endpoint)
	rec := newRecorder(t)
	e := newEngine(t, root, prefix, rec, func(rt *engine.RemoteTier) {
		rt.Store.Endpoint = p.Endpoint
		rt.Store.MaxRetries = 1
	})
	save(t, e, conv)
	waitFor(t, "the pages' uploads", func() bool { return snapshotOps(rec)["upload/ok"] == uint64(len(keys)) })

	p.Set(faultproxy.Rule{Kinds: faultproxy.Head | faultproxy.Put, Fault: faultproxy.Status})
	writePages(t, e, "conv-m", conv)
	waitFor(t, "the manifest's failed upload", func() bool { return snapshotOps(rec)["upload/error"] >= 1 })

	st := openStore(t, prefix) // straight to the server, not through the proxy
	mname, _ := st.ManifestName(ns, "conv-m")
	isManifestPut := func(r *http.Request) bool {
		return r.Method == http.MethodPut && strings.HasSuffix(r.URL.Path, "/"+mname)
	}
	var mu sync.Mutex
	var putsSeen int
	var missing []string // pages absent at a manifest PUT
	p.Set(faultproxy.Rule{Kinds: faultproxy.Put, Fault: faultproxy.Status, Count: 3, Match: func(r *http.Request) bool {
		if !isManifestPut(r) {
			return false
		}
		mu.Lock()
		defer mu.Unlock()
		putsSeen++
		for _, k := range keys {
			name, _ := st.PageName(ns, k.String())
			if _, err := st.Stat(context.Background(), name); err != nil {
				missing = append(missing, name)
			}
		}
		return true
	}})
	closeEngine(t, e)
	checkObjects(t, prefix, root, keys, "conv-m")
	mu.Lock()
	defer mu.Unlock()
	if putsSeen < 4 || p.Injected(faultproxy.Put) < 3 || len(missing) > 0 {
		t.Fatalf("manifest PUTs %d (want >= 4: 3 failed, then created), faults %d, pages absent at a manifest PUT: %v",
			putsSeen, p.Injected(faultproxy.Put), missing)
	}
}

// TestAbandonedUploadsResumeAfterRestart: an engine saves a conversation
// and writes a page manifest while the store is unreachable (every request
// refused), then closes with a cancelled context: its uploads are
// abandoned (ErrUploadsAbandoned) and listed in the namespace's uploads
// journal. A new engine on the same root, with the store reachable, queues
// them again in New (no save names them): Close finds every page and the
// manifest in the bucket, byte-identical to the local files.
func TestAbandonedUploadsResumeAfterRestart(t *testing.T) {
	prefix := bucketPrefix(t)
	root := t.TempDir()
	conv := seq(33000, 4*ptoks+3)
	named := seq(35000, 2*ptoks+1)
	keys := append(keysOf(t, conv), keysOf(t, named)...)
	p := faultproxy.Start(t, srv.Endpoint)
	p.Set(faultproxy.Rule{Kinds: faultproxy.Any, Fault: faultproxy.Refuse})
	rec := newRecorder(t)
	e := newEngine(t, root, prefix, rec, func(rt *engine.RemoteTier) {
		rt.Store.Endpoint = p.Endpoint
		rt.Store.MaxRetries = 1
	})
	save(t, e, conv)
	writePages(t, e, "named-1", named)
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if err := e.Close(ctx); !errors.Is(err, engine.ErrUploadsAbandoned) {
		t.Fatalf("Close: %v, want ErrUploadsAbandoned", err)
	}
	if _, err := os.Lstat(filepath.Join(root, ns, layout.UploadsName)); err != nil {
		t.Fatalf("no uploads journal: %v", err)
	}
	if got := objects(t, openStore(t, prefix)); len(got) != 0 {
		t.Fatalf("the unreachable store holds %d objects", len(got))
	}

	e2 := newEngine(t, root, prefix, newRecorder(t), nil)
	closeEngine(t, e2)
	checkObjects(t, prefix, root, keys, "named-1")

	// The journal was rewritten empty: a third engine queues nothing.
	rec3 := newRecorder(t)
	e3 := newEngine(t, root, prefix, rec3, nil)
	closeEngine(t, e3)
	if ops := snapshotOps(rec3); ops["upload/ok"]+ops["upload/existed"] != 0 {
		t.Fatalf("a third engine uploaded again: %v", ops)
	}
}

// TestHostileUploadsJournalIgnored: a journal that does not decode (bytes
// of another file, a flipped byte) does not stop New: it is ignored with a
// log line naming it, nothing is queued from it, and the engine works.
func TestHostileUploadsJournalIgnored(t *testing.T) {
	prefix := bucketPrefix(t)
	root := t.TempDir()
	conv := seq(37000, 2*ptoks)
	e := newEngine(t, root, prefix, newRecorder(t), nil)
	save(t, e, conv)
	closeEngine(t, e)
	path := filepath.Join(root, ns, layout.UploadsName)
	for _, b := range [][]byte{[]byte("KVPUPL1\n\xff\xff\xff\xff\x00\x00\x00\x00garbage!"), readFile(t, pagePath(root, keysOf(t, conv)[0]))} {
		if err := os.WriteFile(path, b, 0o644); err != nil {
			t.Fatal(err)
		}
		var logs bytes.Buffer
		var lmu sync.Mutex
		rec := newRecorder(t)
		e := newEngineCfg(t, root, prefix, rec, nil, func(c *engine.Config) {
			c.Logger = slog.New(slog.NewTextHandler(lockedWriter{&lmu, &logs}, nil))
		})
		res, c := load(t, e, conv)
		if res.Prefix.Tokens != len(conv) {
			t.Fatalf("load after a hostile journal: %d tokens, want %d", res.Prefix.Tokens, len(conv))
		}
		c.checkLoaded(t, conv, len(conv))
		closeEngine(t, e)
		lmu.Lock()
		l := logs.String()
		lmu.Unlock()
		if !strings.Contains(l, "uploads journal ignored") || !strings.Contains(l, path) {
			t.Fatalf("no log line naming the ignored journal: %q", l)
		}
		if ops := snapshotOps(rec); ops["upload/ok"]+ops["upload/existed"] != 0 {
			t.Fatalf("uploads queued from a hostile journal: %v", ops)
		}
	}
}

type lockedWriter struct {
	mu *sync.Mutex
	w  *bytes.Buffer
}

func (l lockedWriter) Write(b []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.w.Write(b)
}

// TestKnownSetTrimmed: the pages an engine remembers as stored remotely
// shrink when their local files are evicted (a cache of 8 pages: saving Y
// evicts X's 6 pages, and X's entries go with them), and never exceed
// RemoteTier.KnownPages. A trimmed entry costs only a HEAD: a later save
// of a page the set dropped is found stored (upload "existed", no bytes
// sent), and X, evicted locally, still loads bit-exact from the store.
func TestKnownSetTrimmed(t *testing.T) {
	prefix := bucketPrefix(t)
	root, rootP := t.TempDir(), t.TempDir()
	x, y := seq(41000, 6*ptoks), seq(43000, 6*ptoks)
	kx, ky := keysOf(t, x), keysOf(t, y)
	probe := newEngine(t, rootP, bucketPrefix(t), newRecorder(t), nil)
	save(t, probe, x)
	page := fullPageAlloc(t, rootP, kx)
	closeEngine(t, probe)

	rec := newRecorder(t)
	e := newEngineCfg(t, root, prefix, rec, nil, func(c *engine.Config) { c.CapacityBytes = 8 * page })
	save(t, e, x)
	waitFor(t, "X's uploads", func() bool { return snapshotOps(rec)["upload/ok"] == uint64(len(kx)) })
	if n := e.RemoteKnownPages(); n != len(kx) {
		t.Fatalf("%d pages known stored after X's uploads, want %d", n, len(kx))
	}
	save(t, e, y) // 6 more pages in a cache of 8: X's 4 last pages are evicted
	waitFor(t, "Y's uploads", func() bool { return snapshotOps(rec)["upload/ok"] == uint64(len(kx)+len(ky)) })
	stored := 0
	for _, k := range append(append([]layout.PageKey{}, kx...), ky...) {
		if _, err := os.Lstat(pagePath(root, k)); err == nil {
			stored++
		}
	}
	if n := e.RemoteKnownPages(); stored != 8 || n != stored {
		t.Fatalf("%d pages known stored with %d pages local, want 8 and 8 (the evicted pages' entries dropped)", n, stored)
	}
	res, c := load(t, e, x)
	if res.Prefix.Tokens != len(x) || res.Remote.PagesFetched == 0 {
		t.Fatalf("X loaded %d tokens with %d pages fetched, want %d and > 0", res.Prefix.Tokens, res.Remote.PagesFetched, len(x))
	}
	c.checkLoaded(t, x, len(x))
	closeEngine(t, e)

	// The cap: 3 entries at most. Saving Y again (every page local) queues
	// the 3 or more pages the set dropped: each is a HEAD that finds it
	// stored, nothing is sent, and the bucket is unchanged.
	before := objects(t, openStore(t, prefix))
	rec2 := newRecorder(t)
	e2 := newEngine(t, rootP, prefix, rec2, func(rt *engine.RemoteTier) { rt.KnownPages = 3 })
	save(t, e2, y)
	waitFor(t, "Y's uploads on the capped engine", func() bool {
		o := snapshotOps(rec2)
		return o["upload/ok"]+o["upload/existed"] == uint64(len(ky))
	})
	if n := e2.RemoteKnownPages(); n != 3 {
		t.Fatalf("%d pages known stored, want the cap of 3", n)
	}
	save(t, e2, y)
	closeEngine(t, e2)
	ops := snapshotOps(rec2)
	// The second save queues the 3 pages the set lacks, and maybe more: an
	// upload it queued can finish (and, the set full, drop an entry) while
	// it still checks later pages of the chain.
	if ex := ops["upload/existed"]; ops["upload/ok"] != 0 || ex < uint64(2*len(ky)-3) || ex > uint64(2*len(ky)) || rec2.Snapshot().Remote.UploadBytes != 0 {
		t.Fatalf("capped engine's uploads %v, %d bytes; want %d to %d existed (6, then the 3 or more the set dropped), none sent",
			ops, rec2.Snapshot().Remote.UploadBytes, 2*len(ky)-3, 2*len(ky))
	}
	after := objects(t, openStore(t, prefix))
	if len(after) != len(before) {
		t.Fatalf("bucket holds %d objects, had %d", len(after), len(before))
	}
	for name, b := range before {
		if !bytes.Equal(after[name], b) {
			t.Fatalf("object %s changed", name)
		}
	}
}

// journalBytes encodes an uploads journal from ARCHITECTURE.md's table
// alone (an independent encoder: magic, u32 P, u32 M, the sorted keys,
// the sorted length-prefixed names, XXH3-64 of every byte before it).
func journalBytes(keys []layout.PageKey, names []string) []byte {
	slices.SortFunc(keys, func(a, b layout.PageKey) int { return bytes.Compare(a[:], b[:]) })
	slices.Sort(names)
	b := []byte("KVPUPL1\n")
	b = binary.LittleEndian.AppendUint32(b, uint32(len(keys)))
	b = binary.LittleEndian.AppendUint32(b, uint32(len(names)))
	for _, k := range keys {
		b = append(b, k[:]...)
	}
	for _, n := range names {
		b = append(b, byte(len(n)))
		b = append(b, n...)
	}
	return binary.LittleEndian.AppendUint64(b, xxh3.Hash(b))
}

// TestJournalOfImpossibleUploadsEmptied: a valid journal (encoded from the
// documented format) lists a page whose path is a directory, a page that
// does not exist, a snapshot that is not a page manifest and one that does
// not exist. None can ever be uploaded: New queues nothing from it, and
// Close rewrites it empty (before: the page whose path is a directory
// stayed listed at every restart).
func TestJournalOfImpossibleUploadsEmptied(t *testing.T) {
	prefix := bucketPrefix(t)
	root := t.TempDir()
	dirKey, goneKey := keysOf(t, seq(71000, ptoks))[0], keysOf(t, seq(73000, ptoks))[0]
	e := newEngineCfg(t, root, prefix, newRecorder(t), nil, func(c *engine.Config) { c.Remote = nil })
	c := newKV(ptoks)
	c.fill(seq(75000, ptoks))
	if r := e.Do(context.Background(), &engine.WriteRequest{Ref: engine.Ref{Namespace: ns, Name: "single"}, Layout: engine.Single,
		Caches: []engine.EntrySpec{{Tensors: c.specs(ptoks)}}}); r.Err != nil {
		t.Fatal(r.Err)
	}
	closeEngine(t, e)
	if err := os.MkdirAll(pagePath(root, dirKey), 0o755); err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(root, ns, layout.UploadsName)
	if err := os.WriteFile(path, journalBytes([]layout.PageKey{dirKey, goneKey}, []string{"single", "absent"}), 0o644); err != nil {
		t.Fatal(err)
	}
	var logs bytes.Buffer
	var lmu sync.Mutex
	rec := newRecorder(t)
	e = newEngineCfg(t, root, prefix, rec, nil, func(c *engine.Config) {
		c.Logger = slog.New(slog.NewTextHandler(lockedWriter{&lmu, &logs}, nil))
	})
	closeEngine(t, e)
	lmu.Lock()
	l := logs.String()
	lmu.Unlock()
	if strings.Contains(l, "uploads journal ignored") {
		t.Fatalf("the journal encoded from the documented format was not accepted: %s", l)
	}
	if ops := snapshotOps(rec); ops["upload/ok"]+ops["upload/existed"] != 0 {
		t.Fatalf("uploads from impossible entries: %v", ops)
	}
	if got, want := readFile(t, path), journalBytes(nil, nil); !bytes.Equal(got, want) {
		t.Fatalf("journal after Close: %d bytes %x, want the empty journal", len(got), got)
	}
	if got := objects(t, openStore(t, prefix)); len(got) != 0 {
		t.Fatalf("%d objects in the bucket", len(got))
	}
}
