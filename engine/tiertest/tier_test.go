package tiertest

import (
	"bytes"
	"context"
	"errors"
	"net/http"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/kvpersist/kvpersist/engine"
	"github.com/kvpersist/kvpersist/engine/layout"
	"github.com/kvpersist/kvpersist/internal/testutil"
)

// TestConversationSavedOnAFoundAndLoadedOnB: two engines with separate
// local roots and one bucket. A conversation saved on A (9 full pages and a
// leaf) is uploaded by A's write-behind; B, which has nothing local, finds
// it with LookupRemote, loads it bit-exact (the KV recomputed
// independently), and keeps the fetched pages: they are byte-identical to
// A's files, and a second load is served locally.
func TestConversationSavedOnAFoundAndLoadedOnB(t *testing.T) {
	prefix := bucketPrefix(t)
	rootA, rootB := t.TempDir(), t.TempDir()
	recA, recB := newRecorder(t), newRecorder(t)
	conv := seq(1000, 9*ptoks+24)
	a := newEngine(t, rootA, prefix, recA, nil)
	saveRes := save(t, a, conv)
	closeEngine(t, a) // waits for the uploads
	keys := keysOf(t, conv)
	var pageBytes int64
	for _, k := range keys {
		pageBytes += int64(len(readFile(t, pagePath(rootA, k))))
	}
	if got := recA.Snapshot().Remote.UploadBytes; got != pageBytes || saveRes.Prefix.PagesWritten != len(keys) {
		t.Fatalf("A uploaded %d bytes of %d pages written, want %d bytes of %d pages", got, saveRes.Prefix.PagesWritten, pageBytes, len(keys))
	}

	b := newEngine(t, rootB, prefix, recB, nil)
	ctx := context.Background()
	if n, err := b.Lookup(ns, ident, ptoks, conv); err != nil || n != 0 {
		t.Fatalf("B's local Lookup = %d, %v; want 0 (nothing local)", n, err)
	}
	hit, err := b.LookupRemote(ctx, ns, ident, ptoks, conv)
	if err != nil || hit != (engine.PrefixHit{Local: 0, Total: len(conv)}) {
		t.Fatalf("LookupRemote = %+v, %v; want Local 0, Total %d", hit, err, len(conv))
	}
	// A prompt that continues past a full page of the conversation: the
	// full pages only (the leaf covers other tokens).
	prompt := append(seq(1000, 5*ptoks+3), 7, 7, 7)
	if hit, err := b.LookupRemote(ctx, ns, ident, ptoks, prompt); err != nil || hit.Total != 5*ptoks {
		t.Fatalf("LookupRemote(prompt) = %+v, %v; want Total %d", hit, err, 5*ptoks)
	}

	res, c := load(t, b, conv)
	if res.Prefix.Tokens != len(conv) {
		t.Fatalf("B loaded %d tokens, want %d (remote report %+v)", res.Prefix.Tokens, len(conv), res.Remote)
	}
	c.checkLoaded(t, conv, len(conv))
	if r := res.Remote; r == nil || r.Err != nil || r.PagesFetched != len(keys) || r.BytesFetched != pageBytes {
		t.Fatalf("remote report %+v; want %d pages, %d bytes fetched, no error", r, len(keys), pageBytes)
	}
	for _, k := range keys {
		if !bytes.Equal(readFile(t, pagePath(rootB, k)), readFile(t, pagePath(rootA, k))) {
			t.Fatalf("B's fetched page %s differs from A's file", k)
		}
	}
	if tmp := testutil.TempFiles(t, rootB); len(tmp) > 0 {
		t.Fatalf("temp files left: %v", tmp)
	}
	// Pages asked of the store: 10 (LookupRemote of conv), 5 found and the
	// prompt's leaf not (LookupRemote of prompt), 10 (the load).
	s := recB.Snapshot().Remote
	if s.FetchBytes != pageBytes || s.LookupHitPages != int64(2*len(keys)+5) || s.LookupMissPages != 1 {
		t.Fatalf("B's metrics: fetched %d bytes, lookup %d hits %d misses; want %d, %d, 1", s.FetchBytes, s.LookupHitPages, s.LookupMissPages, pageBytes, 2*len(keys)+5)
	}
	// Now local: Lookup answers from the index, a load fetches nothing.
	if n, err := b.Lookup(ns, ident, ptoks, conv); err != nil || n != len(conv) {
		t.Fatalf("B's Lookup after the fetch = %d, %v; want %d", n, err, len(conv))
	}
	res, c = load(t, b, conv)
	c.checkLoaded(t, conv, len(conv))
	if res.Remote.PagesAsked != 0 || res.Remote.PagesFetched != 0 {
		t.Fatalf("second load asked the store: %+v", res.Remote)
	}
	// B's close uploads nothing: every page is known stored.
	closeEngine(t, b)
	if s := recB.Snapshot().Remote; s.UploadBytes != 0 {
		t.Fatalf("B uploaded %d bytes", s.UploadBytes)
	}
}

// TestSharedSystemPromptUploadedOnce: A and B save conversations that
// share a 4-page system prompt. The bucket then holds each page once: the
// union of both engines' pages, each object byte-identical to the local
// files; B sent the bytes of its own pages only and found the shared ones
// stored (a HEAD, no body).
func TestSharedSystemPromptUploadedOnce(t *testing.T) {
	prefix := bucketPrefix(t)
	rootA, rootB := t.TempDir(), t.TempDir()
	recA, recB := newRecorder(t), newRecorder(t)
	system := seq(5000, 4*ptoks)
	convA := append(append([]uint32{}, system...), seq(100000, 2*ptoks+10)...)
	convB := append(append([]uint32{}, system...), seq(200000, 3*ptoks)...)

	a := newEngine(t, rootA, prefix, recA, nil)
	save(t, a, convA)
	closeEngine(t, a)
	b := newEngine(t, rootB, prefix, recB, nil)
	save(t, b, convB)
	closeEngine(t, b)

	keysA, keysB := keysOf(t, convA), keysOf(t, convB)
	for i := range 4 {
		if keysA[i] != keysB[i] {
			t.Fatalf("page %d of the system prompt has two keys", i)
		}
	}
	want := map[string][]byte{} // object name -> the local file's bytes
	st := openStore(t, prefix)
	var bytesB int64 // B's own pages
	for _, k := range keysA {
		name, _ := st.PageName(ns, k.String())
		want[name] = readFile(t, pagePath(rootA, k))
	}
	for i, k := range keysB {
		name, _ := st.PageName(ns, k.String())
		fb := readFile(t, pagePath(rootB, k))
		if i < 4 {
			if !bytes.Equal(fb, want[name]) {
				t.Fatalf("shared page %d differs between A and B", i)
			}
			continue
		}
		want[name] = fb
		bytesB += int64(len(fb))
	}
	got := objects(t, st)
	if len(got) != len(want) {
		t.Fatalf("bucket holds %d objects, want %d (4 shared + %d + %d)", len(got), len(want), len(keysA)-4, len(keysB)-4)
	}
	for name, w := range want {
		if !bytes.Equal(got[name], w) {
			t.Fatalf("object %s: %d bytes, differs from the local file (%d bytes)", name, len(got[name]), len(w))
		}
	}
	ops := snapshotOps(recB)
	if ops["upload/existed"] != 4 || ops["upload/ok"] != uint64(len(keysB)-4) || recB.Snapshot().Remote.UploadBytes != bytesB {
		t.Fatalf("B's uploads %v, %d bytes; want 4 existed, %d created, %d bytes", ops, recB.Snapshot().Remote.UploadBytes, len(keysB)-4, bytesB)
	}
}

// TestCorruptRemoteObjectIsAMiss: a remote page that is not what the
// chain expects (a flipped tensor byte, a truncated object, another page's
// bytes under its name, a long object, an empty one, one of the 26-byte
// prefix alone) is a miss: the load loads the pages
// before it, reports ErrRemoteCorrupt, publishes no file for it, leaves no
// temp file, and counts it.
func TestCorruptRemoteObjectIsAMiss(t *testing.T) {
	cases := []struct {
		name string
		bad  func(page, other []byte) []byte
	}{
		{"flipped-tensor-byte", func(p, _ []byte) []byte {
			q := bytes.Clone(p)
			q[len(q)-100] ^= 0x40
			return q
		}},
		{"truncated", func(p, _ []byte) []byte { return bytes.Clone(p[:len(p)-4096]) }},
		{"other-page", func(_, o []byte) []byte { return bytes.Clone(o) }},
		{"long", func(p, _ []byte) []byte { return append(bytes.Clone(p), 0) }},
		{"empty", func(_, _ []byte) []byte { return []byte{} }},
		{"prefix-only", func(p, _ []byte) []byte { return bytes.Clone(p[:layout.PrefixLen]) }},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			prefix := bucketPrefix(t)
			rootA, rootB := t.TempDir(), t.TempDir()
			conv := seq(3000, 4*ptoks)
			a := newEngine(t, rootA, prefix, newRecorder(t), nil)
			save(t, a, conv)
			closeEngine(t, a)
			keys := keysOf(t, conv)
			st := openStore(t, prefix)
			name, _ := st.PageName(ns, keys[1].String())
			putObject(t, st, name, tc.bad(readFile(t, pagePath(rootA, keys[1])), readFile(t, pagePath(rootA, keys[2]))))

			rec := newRecorder(t)
			b := newEngine(t, rootB, prefix, rec, nil)
			res, c := load(t, b, conv)
			if res.Prefix.Tokens != ptoks {
				t.Fatalf("loaded %d tokens, want %d (the page before the corrupt one)", res.Prefix.Tokens, ptoks)
			}
			c.checkLoaded(t, conv, ptoks)
			if res.Remote == nil || !errors.Is(res.Remote.Err, engine.ErrRemoteCorrupt) {
				t.Fatalf("remote report %+v: want ErrRemoteCorrupt", res.Remote)
			}
			if _, err := os.Lstat(pagePath(rootB, keys[1])); !os.IsNotExist(err) {
				t.Fatalf("corrupt page published locally (lstat: %v)", err)
			}
			if tmp := testutil.TempFiles(t, rootB); len(tmp) > 0 {
				t.Fatalf("temp files left: %v", tmp)
			}
			if n := snapshotOps(rec)["fetch/corrupt"]; n != 1 {
				t.Fatalf("fetch/corrupt = %d, want 1 (%v)", n, snapshotOps(rec))
			}
			// The pages after it were valid: fetched and kept (each stands
			// alone), but not loaded past the hole.
			for _, k := range keys[2:] {
				if _, err := os.Lstat(pagePath(rootB, k)); err != nil {
					t.Fatalf("valid page %s after the corrupt one not kept: %v", k, err)
				}
			}
		})
	}
}

// TestServerKilledDuringFetch: B holds the first 2 pages locally; the
// server is killed as B's load sends its first ranged GET. The load
// succeeds with the local pages (128 tokens, bit-exact), reports the
// remote error, leaves no temp file, and B's local pages are intact.
func TestServerKilledDuringFetch(t *testing.T) {
	prefix := bucketPrefix(t)
	rootA, rootB := t.TempDir(), t.TempDir()
	conv := seq(7000, 8*ptoks)
	a := newEngine(t, rootA, prefix, newRecorder(t), nil)
	save(t, a, conv)
	closeEngine(t, a)

	rec := newRecorder(t)
	hook := &hookRT{next: http.DefaultTransport.(*http.Transport).Clone(), match: isRangedGet, hook: srv.Kill}
	t.Cleanup(func() { // the package's other tests need the server
		if hook.seen.Load() == 0 {
			return // never killed
		}
		ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
		defer cancel()
		if err := srv.Restart(ctx); err != nil {
			t.Errorf("restarting SeaweedFS: %v", err)
		}
	})
	b := newEngine(t, rootB, prefix, rec, func(rt *engine.RemoteTier) {
		rt.Store.Transport = hook
		rt.Store.MaxRetries = 1
	})
	save(t, b, conv[:2*ptoks])
	keys := keysOf(t, conv)
	before := map[string][]byte{}
	for _, k := range keys[:2] {
		before[k.String()] = readFile(t, pagePath(rootB, k))
	}
	res, c := load(t, b, conv)
	if hook.seen.Load() == 0 {
		t.Fatal("no ranged GET was sent: the kill did not happen during a fetch")
	}
	if res.Prefix.Tokens != 2*ptoks {
		t.Fatalf("loaded %d tokens, want %d (the local pages)", res.Prefix.Tokens, 2*ptoks)
	}
	c.checkLoaded(t, conv, 2*ptoks)
	if res.Remote == nil || res.Remote.Err == nil || res.Remote.PagesFetched != 0 {
		t.Fatalf("remote report %+v: want an error and nothing fetched", res.Remote)
	}
	if n := snapshotOps(rec)["fetch/error"]; n == 0 {
		t.Fatalf("no fetch error counted: %v", snapshotOps(rec))
	}
	if tmp := testutil.TempFiles(t, rootB); len(tmp) > 0 {
		t.Fatalf("temp files left: %v", tmp)
	}
	for _, k := range keys[:2] {
		if !bytes.Equal(readFile(t, pagePath(rootB, k)), before[k.String()]) {
			t.Fatalf("local page %s changed", k)
		}
	}
	for _, k := range keys[2:] {
		if _, err := os.Lstat(pagePath(rootB, k)); !os.IsNotExist(err) {
			t.Fatalf("page %s published though its fetch failed (lstat: %v)", k, err)
		}
	}
	// The engine closes promptly even though B's own saved pages could not
	// be uploaded: Close's context abandons them, nothing local is lost.
	ctx, cancel := context.WithTimeout(context.Background(), 500*time.Millisecond)
	defer cancel()
	if err := b.Close(ctx); err != nil && !errors.Is(err, engine.ErrUploadsAbandoned) {
		t.Fatalf("Close: %v (want nil or ErrUploadsAbandoned)", err)
	}
	for _, k := range keys[:2] {
		if !bytes.Equal(readFile(t, pagePath(rootB, k)), before[k.String()]) {
			t.Fatalf("local page %s changed by Close", k)
		}
	}
}

// TestServerKilledAndRestartedDuringUploads: the server is killed as A's
// uploader sends its first request; the uploads fail and are retried with
// backoff while the server is down; it is restarted, and Close (which
// waits for the uploads) returns with every page in the bucket, byte-
// identical to A's files. Then an engine closed with the server down
// abandons its uploads within Close's context, losing nothing local, and
// a later engine on the same root uploads them when a save names them.
func TestServerKilledAndRestartedDuringUploads(t *testing.T) {
	prefix := bucketPrefix(t)
	root := t.TempDir()
	conv := seq(9000, 6*ptoks+5)
	keys := keysOf(t, conv)
	restarted := make(chan error, 1)
	hook := &hookRT{next: http.DefaultTransport.(*http.Transport).Clone(),
		match: func(r *http.Request) bool { return r.Method == http.MethodHead || r.Method == http.MethodPut },
		hook: func() {
			srv.Kill()
			go func() { // restart while the uploader retries
				ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
				defer cancel()
				restarted <- srv.Restart(ctx)
			}()
		}}
	rec := newRecorder(t)
	a := newEngine(t, root, prefix, rec, func(rt *engine.RemoteTier) {
		rt.Store.Transport = hook
		rt.Store.MaxRetries = 1
	})
	save(t, a, conv)
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	if err := a.Close(ctx); err != nil {
		t.Fatalf("Close: %v", err)
	}
	if err := <-restarted; err != nil {
		t.Fatalf("restart: %v", err)
	}
	st := openStore(t, prefix)
	got := objects(t, st)
	if len(got) != len(keys) {
		t.Fatalf("bucket holds %d objects, want %d", len(got), len(keys))
	}
	for _, k := range keys {
		name, _ := st.PageName(ns, k.String())
		if !bytes.Equal(got[name], readFile(t, pagePath(root, k))) {
			t.Fatalf("object of page %s differs from the local file", k)
		}
	}
	if ops := snapshotOps(rec); ops["upload/ok"] != uint64(len(keys)) {
		t.Fatalf("uploads %v, want %d created", ops, len(keys))
	}

	// Abandon: the server down for the whole life of an engine.
	prefix2 := bucketPrefix(t)
	root2 := t.TempDir()
	srv.Kill()
	down := true
	t.Cleanup(func() {
		if !down {
			return
		}
		ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
		defer cancel()
		if err := srv.Restart(ctx); err != nil {
			t.Errorf("restarting SeaweedFS: %v", err)
		}
	})
	rec2 := newRecorder(t)
	e2 := newEngine(t, root2, prefix2, rec2, func(rt *engine.RemoteTier) { rt.Store.MaxRetries = 1 })
	save(t, e2, conv)
	before := testutil.TreeDigest(t, filepath.Join(root2, ns, "pages"))
	cctx, ccancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
	defer ccancel()
	if err := e2.Close(cctx); !errors.Is(err, engine.ErrUploadsAbandoned) {
		t.Fatalf("Close with the server down: %v, want ErrUploadsAbandoned", err)
	}
	if ops := snapshotOps(rec2); ops["upload/abandoned"] != uint64(len(keys)) {
		t.Fatalf("uploads %v, want %d abandoned", ops, len(keys))
	}
	if after := testutil.TreeDigest(t, filepath.Join(root2, ns, "pages")); !equalDigests(before, after) {
		t.Fatalf("local pages changed by the abandoned uploads: %d entries before, %d after", len(before), len(after))
	}
	for _, k := range keys {
		if _, err := os.Lstat(pagePath(root2, k)); err != nil {
			t.Fatalf("page %s: %v", k, err)
		}
	}
	ctx3, cancel3 := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel3()
	if err := srv.Restart(ctx3); err != nil {
		t.Fatal(err)
	}
	down = false
	e3 := newEngine(t, root2, prefix2, newRecorder(t), nil)
	save(t, e3, conv) // every page reused locally, every page enqueued
	closeEngine(t, e3)
	if got := objects(t, openStore(t, prefix2)); len(got) != len(keys) {
		t.Fatalf("after the restart the bucket holds %d objects, want %d", len(got), len(keys))
	}
}

func equalDigests(a, b map[string]string) bool {
	if len(a) != len(b) {
		return false
	}
	for k, v := range a {
		if b[k] != v {
			return false
		}
	}
	return true
}

// TestPageManifestUploadedAfterItsPages: a named snapshot in the Pages
// layout is uploaded after its pages: the bucket then holds the manifest,
// byte-identical to the local file, and every page it names. An engine
// that writes a second manifest over the same pages later, when they are
// older than its RefreshAge, refreshes them (their mtimes move, their
// bytes stay) before uploading the manifest.
func TestPageManifestUploadedAfterItsPages(t *testing.T) {
	prefix := bucketPrefix(t)
	rootA, rootB := t.TempDir(), t.TempDir()
	conv := seq(11000, 3*ptoks+7)
	keys := keysOf(t, conv)
	write := func(e *engine.Engine, name string) { writePages(t, e, name, conv) }
	recA := newRecorder(t)
	a := newEngine(t, rootA, prefix, recA, nil)
	write(a, "conv-1")
	closeEngine(t, a)
	st := openStore(t, prefix)
	got := objects(t, st)
	mname, _ := st.ManifestName(ns, "conv-1")
	if !bytes.Equal(got[mname], readFile(t, filepath.Join(rootA, ns, "conv-1"))) {
		t.Fatalf("manifest object (%d bytes) differs from the local manifest", len(got[mname]))
	}
	if len(got) != len(keys)+1 {
		t.Fatalf("bucket holds %d objects, want %d pages and the manifest", len(got), len(keys))
	}
	for _, k := range keys {
		name, _ := st.PageName(ns, k.String())
		if !bytes.Equal(got[name], readFile(t, pagePath(rootA, k))) {
			t.Fatalf("page %s: object differs from the local file", k)
		}
	}
	if ops := snapshotOps(recA); ops["upload/ok"] != uint64(len(keys)+1) {
		t.Fatalf("A's uploads %v, want %d created", ops, len(keys)+1)
	}

	ctx := context.Background()
	before := map[string]time.Time{}
	for _, k := range keys {
		name, _ := st.PageName(ns, k.String())
		o, err := st.Stat(ctx, name)
		if err != nil {
			t.Fatal(err)
		}
		before[name] = o.ModTime
	}
	time.Sleep(2100 * time.Millisecond) // mtimes have 1 s resolution
	b := newEngine(t, rootB, prefix, newRecorder(t), func(rt *engine.RemoteTier) { rt.RefreshAge = time.Second })
	write(b, "conv-2")
	closeEngine(t, b)
	got2 := objects(t, st)
	m2, _ := st.ManifestName(ns, "conv-2")
	if !bytes.Equal(got2[m2], readFile(t, filepath.Join(rootB, ns, "conv-2"))) {
		t.Fatal("second manifest not uploaded as written")
	}
	for name, mt := range before {
		o, err := st.Stat(ctx, name)
		if err != nil {
			t.Fatal(err)
		}
		if !o.ModTime.After(mt) || !bytes.Equal(got2[name], got[name]) {
			t.Fatalf("page %s: mtime %v -> %v (want later), bytes same: %v", name, mt, o.ModTime, bytes.Equal(got2[name], got[name]))
		}
	}
}
