package engine

import (
	"bytes"
	"context"
	"errors"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/kvpersist/kvpersist/engine/jobs"
	"github.com/kvpersist/kvpersist/engine/layout"
	"github.com/kvpersist/kvpersist/engine/vfs"
	"github.com/kvpersist/kvpersist/internal/kvgen"
	"github.com/kvpersist/kvpersist/internal/testutil"
)

// specialKinds make a FIFO or a symlink (to a regular file outside the
// root) at a path where kvpersist expects a regular file of its own.
var specialKinds = map[string]func(t *testing.T, path string){
	"fifo": func(t *testing.T, path string) {
		if err := syscall.Mkfifo(path, 0o640); err != nil {
			t.Fatalf("mkfifo: %v", err)
		}
	},
	"symlink": func(t *testing.T, path string) {
		target := filepath.Join(t.TempDir(), "target")
		if err := os.WriteFile(target, []byte("not kvpersist's"), 0o640); err != nil {
			t.Fatal(err)
		}
		if err := os.Symlink(target, path); err != nil {
			t.Fatal(err)
		}
	},
}

// specialDeadline bounds each job of TestSpecialFilesNeverBlock: a job
// that honours its context returns by then even if something inside it
// waits; the test's own hang detector (guard) is longer.
const specialDeadline = 10 * time.Second

// doWithin runs req with a ctx of specialDeadline and fails the test if
// Do has not returned within guard (a job that ignores its ctx); a FIFO
// at fifo is then opened for writing to release the open(2) it hangs in.
func doWithin(t *testing.T, e *Engine, fifo string, req Request) Result {
	t.Helper()
	ctx, cancel := context.WithTimeout(bg, specialDeadline)
	defer cancel()
	done := make(chan Result, 1)
	go func() { done <- e.Do(ctx, req) }()
	select {
	case r := <-done:
		return r
	case <-time.After(guard):
		if w, err := os.OpenFile(fifo, os.O_WRONLY|syscall.O_NONBLOCK, 0); err == nil {
			defer w.Close()
		}
		<-done
		t.Fatalf("%T did not return within %v of its ctx's %v deadline", req, guard, specialDeadline)
	}
	panic("unreachable")
}

// TestSpecialFilesNeverBlock: a FIFO or a symlink where the namespace's
// lock, its recency checkpoint, a snapshot's manifest or a page file
// belongs never hangs a job nor is followed: a save, load, write and read
// through a namespace whose .lock is one fail at once with an error naming
// the .lock (vfs.ErrNotRegular for the FIFO, ELOOP for the symlink); a
// .recency one does not stop New nor the namespace's saves and loads; a
// manifest one fails its read naming it; a page one ends the load's prefix
// before it.
func TestSpecialFilesNeverBlock(t *testing.T) {
	m := kvgen.Tiny
	c, _ := cacheOf(m, 200, true)
	toks := prefixTokens(200, 7)
	save := func(ns string) *SavePrefixRequest {
		return &SavePrefixRequest{Namespace: ns, Identity: "tiny", Tokens: toks, Tensors: kvTensors(c), PageTokens: 64}
	}
	load := func(ns string) (*LoadPrefixRequest, [][]byte) {
		bufs, dest := paddedDest(m, 256, func(n int) []byte { return make([]byte, n) })
		return &LoadPrefixRequest{Namespace: ns, Identity: "tiny", Tokens: toks, Dest: dest, PageTokens: 64}, bufs
	}
	snap, _ := cacheOf(m, 64, false)
	for kind, mk := range specialKinds {
		t.Run(kind, func(t *testing.T) {
			root := t.TempDir()
			wantErr := error(vfs.ErrNotRegular)
			if kind == "symlink" {
				wantErr = syscall.ELOOP
			}
			for _, ns := range []string{"lock", "recency", "manifest"} {
				if err := os.MkdirAll(filepath.Join(root, ns), 0o750); err != nil {
					t.Fatal(err)
				}
			}
			lockPath := filepath.Join(root, "lock", layout.LockName)
			mk(t, lockPath)
			mk(t, filepath.Join(root, "recency", layout.RecencyName))
			manifest := filepath.Join(root, "manifest", "snap")
			mk(t, manifest)

			e := newEngine(t, Config{Root: root, Workers: 2})
			// The lock: every job of the namespace fails naming it.
			lreq, _ := load("lock")
			for _, req := range []Request{save("lock"), lreq,
				writeReq(refOf("lock", "snap"), snap, layout.Single, 0),
				&ReadRequest{Ref: refOf("lock", "snap"), Dest: destOf(m, 64)}} {
				r := doWithin(t, e, lockPath, req)
				if !errors.Is(r.Err, wantErr) || !strings.Contains(r.Err.Error(), lockPath) {
					t.Errorf("%T in a namespace whose .lock is a %s: %v, want an error wrapping %v naming %s", req, kind, r.Err, wantErr, lockPath)
				}
			}
			// The recency checkpoint: the page cache starts without it.
			if r := doWithin(t, e, "", save("recency")); r.Err != nil || r.Prefix.PagesWritten != 4 {
				t.Fatalf("save beside a %s .recency: %+v %v", kind, r.Prefix, r.Err)
			}
			lr, bufs := load("recency")
			if r := doWithin(t, e, "", lr); r.Err != nil || r.Prefix.Tokens != 200 {
				t.Fatalf("load beside a %s .recency: %+v %v", kind, r.Prefix, r.Err)
			}
			checkLoaded(t, c, bufs, 256, 200)
			// A manifest: its read fails naming it.
			if r := doWithin(t, e, manifest, &ReadRequest{Ref: refOf("manifest", "snap"), Dest: destOf(m, 64)}); r.Err == nil || !strings.Contains(r.Err.Error(), manifest) {
				t.Errorf("read of a %s manifest: %v, want an error naming %s", kind, r.Err, manifest)
			}
			// A page: the load ends its prefix before it.
			keys, _, _ := layout.PageChain("tiny", 64, toks)
			page := testutil.PagePath(filepath.Join(root, "recency"), keys[2])
			if err := os.Remove(page); err != nil {
				t.Fatal(err)
			}
			mk(t, page)
			lr, bufs = load("recency")
			if r := doWithin(t, e, page, lr); r.Err != nil || r.Prefix.Tokens != 128 {
				t.Fatalf("load through a %s page: %+v %v, want the first 128 tokens", kind, r.Prefix, r.Err)
			}
			checkLoaded(t, c, bufs, 256, 128)
		})
	}
}

// strayFanout puts a stray entry of kind ("file" or "symlink", to a
// directory outside the root) at path, a fan-out directory's place.
func strayFanout(t *testing.T, kind, path string) {
	t.Helper()
	var err error
	if kind == "file" {
		err = os.WriteFile(path, []byte("stray"), 0o640)
	} else {
		err = os.Symlink(t.TempDir(), path)
	}
	if err != nil {
		t.Fatal(err)
	}
}

// fanoutAloneChain returns the tokens (320, Tiny's identity "tiny", 64 per
// page) and page keys of a chain whose page i alone starts with its key's
// two hex digits (its fan-out directory holds no other page of the chain).
func fanoutAloneChain(i int) ([]uint32, []layout.PageKey) {
	for seed := uint32(1); ; seed++ {
		toks := prefixTokens(320, seed)
		keys, _, _ := layout.PageChain("tiny", 64, toks)
		alone := true
		for j, k := range keys {
			alone = alone && (j == i || k.String()[:2] != keys[i].String()[:2])
		}
		if alone {
			return toks, keys
		}
	}
}

// TestStrayFanoutIsAPerPageFailure: a file or a symlink at pages/<xx>,
// where the fan-out directory of page i's key belongs, is a failure of
// that page alone: a save writes every other page (Failed lists page i,
// FailedErr names the path), Lookup reports the prefix before page i, a
// load ends there with a Stop naming the path (not ErrInvalidRequest), and
// verify reports the entry (jobs.ProblemFanout). When the entry replaces
// a fan-out directory of pages already indexed, a load through it ends
// there too and the index forgets the page.
func TestStrayFanoutIsAPerPageFailure(t *testing.T) {
	m := kvgen.Tiny
	c, _ := cacheOf(m, 320, true)
	for _, kind := range []string{"file", "symlink"} {
		t.Run(kind, func(t *testing.T) {
			root := t.TempDir()
			e := newEngine(t, Config{Root: root, Workers: 2})
			const i = 2
			toks, keys := fanoutAloneChain(i)
			save := &SavePrefixRequest{Namespace: "p", Identity: "tiny", Tokens: toks, Tensors: kvTensors(c), PageTokens: 64}
			load := func() (*LoadPrefixRequest, [][]byte) {
				bufs, dest := paddedDest(m, 320, func(n int) []byte { return make([]byte, n) })
				return &LoadPrefixRequest{Namespace: "p", Identity: "tiny", Tokens: toks, Dest: dest, PageTokens: 64}, bufs
			}
			nsDir := filepath.Join(root, "p")
			if err := os.MkdirAll(filepath.Join(nsDir, layout.PagesDirName), 0o750); err != nil {
				t.Fatal(err)
			}
			fan := filepath.Dir(testutil.PagePath(nsDir, keys[i]))
			strayFanout(t, kind, fan)

			r := mustDo(t, e, save)
			if r.Prefix.PagesWritten != len(keys)-1 || len(r.Prefix.Failed) != 1 || r.Prefix.Failed[0] != keys[i] ||
				r.Prefix.FailedErr == nil || !strings.Contains(r.Prefix.FailedErr.Error(), fan) {
				t.Fatalf("save: %d pages written, failed %v (%v); want %d written and page %d failed naming %s",
					r.Prefix.PagesWritten, r.Prefix.Failed, r.Prefix.FailedErr, len(keys)-1, i, fan)
			}
			for j, k := range keys {
				if _, err := os.Lstat(testutil.PagePath(nsDir, k)); (err == nil) != (j != i) {
					t.Fatalf("page %d on disk: %v", j, err)
				}
			}
			if got, err := e.Lookup("p", "tiny", 64, toks); err != nil || got != i*64 {
				t.Fatalf("Lookup: %d %v, want %d", got, err, i*64)
			}
			lr, bufs := load()
			r = e.Do(bg, lr)
			if r.Err != nil || r.Prefix.Tokens != i*64 || r.Prefix.Stop == nil || !strings.Contains(r.Prefix.Stop.Error(), fan) {
				t.Fatalf("load: %+v, err %v; want the first %d tokens and a Stop naming %s", r.Prefix, r.Err, i*64, fan)
			}
			checkLoaded(t, c, bufs, 320, i*64)

			rep, err := jobs.VerifyStore(bg, &jobs.Config{NoSync: true}, &jobs.VerifySpec{Target: root})
			if err != nil {
				t.Fatal(err)
			}
			var found []string
			for _, p := range rep.Problems {
				found = append(found, p.Kind+" "+p.Path)
			}
			if want := []string{jobs.ProblemFanout + " " + fan}; !slices.Equal(found, want) {
				t.Fatalf("verify: %q, want %q", found, want)
			}

			// Indexed pages whose fan-out directory is then replaced.
			if err := os.Remove(fan); err != nil {
				t.Fatal(err)
			}
			mustDo(t, e, save)
			if got, _ := e.Lookup("p", "tiny", 64, toks); got != 320 {
				t.Fatalf("Lookup after the full save: %d", got)
			}
			if err := os.Rename(fan, filepath.Join(t.TempDir(), "moved")); err != nil {
				t.Fatal(err)
			}
			strayFanout(t, kind, fan)
			lr, bufs = load()
			if r := e.Do(bg, lr); r.Err != nil || r.Prefix.Tokens != i*64 || r.Prefix.Stop == nil {
				t.Fatalf("load through a replaced fan-out: %+v, err %v", r.Prefix, r.Err)
			}
			checkLoaded(t, c, bufs, 320, i*64)
			if got, _ := e.Lookup("p", "tiny", 64, toks); got != i*64 {
				t.Fatalf("Lookup after the load: %d, want %d", got, i*64)
			}
		})
	}
}

// headerBomb rewrites the page file at path as a valid page whose header
// JSON is padded to at least n bytes by whitespace inside its token ids:
// the same key, tokens and tensors, its data moved to the new data start,
// the header hash recomputed.
func headerBomb(t *testing.T, path string, n int) {
	t.Helper()
	snap, err := layout.Load(vfs.Default, path)
	if err != nil {
		t.Fatal(err)
	}
	old, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	at := bytes.Index(snap.JSON, []byte(`"tokens":[`)) + len(`"tokens":[`)
	js := make([]byte, 0, n+len(snap.JSON))
	js = append(js, snap.JSON[:at]...)
	for len(js) < n {
		js = append(js, " \n"...)
	}
	js = append(js, snap.JSON[at:]...)
	ds := layout.AlignUp(int64(layout.PrefixLen+len(js)), layout.DataAlign)
	b := make([]byte, ds, ds+int64(len(old))-int64(snap.DataStart))
	copy(b, layout.EncodePrefix(js, uint32(ds)))
	copy(b[layout.PrefixLen:], js)
	b = append(b, old[snap.DataStart:]...)
	if err := os.WriteFile(path, b, 0o640); err != nil {
		t.Fatal(err)
	}
}

// allocated is the bytes the Go heap allocated while f ran
// (runtime.MemStats.TotalAlloc), this test's goroutines and the engine's
// included.
func allocated(f func()) uint64 {
	var a, b runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&a)
	f()
	runtime.ReadMemStats(&b)
	return b.TotalAlloc - a.TotalAlloc
}

// TestPageHeaderBombBounded: a valid page file (its header hash, key and
// tensors check out) whose header JSON is 24 MiB, far past
// layout.MaxPageHeaderLen, is refused from its prefix (ErrHeaderTooLarge
// naming the file) by the page decoder, so New and verify allocate less
// than 2 MiB more for it than for the same store without it (before the
// cap, each read and parsed the whole header: gigabytes for 58 MB).
func TestPageHeaderBombBounded(t *testing.T) {
	const bomb, bound = 24 << 20, 2 << 20
	root := t.TempDir()
	c, _ := cacheOf(kvgen.Tiny, 128, true)
	toks := prefixTokens(128, 5)
	func() {
		e := newEngine(t, Config{Root: root})
		mustDo(t, e, &SavePrefixRequest{Namespace: "p", Identity: "tiny", Tokens: toks, Tensors: kvTensors(c), PageTokens: 64})
		if err := e.Close(bg); err != nil {
			t.Fatal(err)
		}
	}()
	cfg := Config{Root: root, NoSync: true, Logger: newEngineLogger(), CapacityBytes: 1 << 30}
	open := func() {
		// Without a recency checkpoint the page cache decodes every
		// page's header at start, to learn its parent.
		if err := os.Remove(filepath.Join(root, "p", layout.RecencyName)); err != nil && !os.IsNotExist(err) {
			t.Fatal(err)
		}
		e, err := New(cfg)
		if err != nil {
			t.Fatalf("New: %v", err)
		}
		if err := e.Close(bg); err != nil {
			t.Fatalf("Close: %v", err)
		}
	}
	verify := func() (rep *jobs.VerifyReport) {
		var err error
		if rep, err = jobs.VerifyStore(bg, &jobs.Config{NoSync: true}, &jobs.VerifySpec{Target: root}); err != nil {
			t.Fatal(err)
		}
		return rep
	}
	open() // warm: lazily built package state is not counted below
	cleanNew, cleanVerify := allocated(open), allocated(func() { verify() })

	keys, _, _ := layout.PageChain("tiny", 64, toks)
	path := testutil.PagePath(filepath.Join(root, "p"), keys[1])
	headerBomb(t, path, bomb)
	if snap, err := layout.Load(vfs.Default, path); err != nil || snap.Page == nil || snap.Page.Key != keys[1] || len(snap.JSON) < bomb {
		t.Fatalf("the bomb is not a valid page of %d header bytes: %v", bomb, err)
	}
	f, err := vfs.Default.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	_, err = layout.DecodePage(f, path)
	f.Close()
	if !errors.Is(err, layout.ErrHeaderTooLarge) || !strings.Contains(err.Error(), path) {
		t.Errorf("DecodePage of the bomb: %v, want ErrHeaderTooLarge naming %s", err, path)
	}
	if got := allocated(open); got > cleanNew+bound {
		t.Errorf("New and Close with the bomb allocated %d bytes, without it %d: more than %d apart", got, cleanNew, bound)
	}
	var rep *jobs.VerifyReport
	if got := allocated(func() { rep = verify() }); got > cleanVerify+bound {
		t.Errorf("verify with the bomb allocated %d bytes, without it %d: more than %d apart", got, cleanVerify, bound)
	}
	if len(rep.Problems) != 1 || rep.Problems[0].Kind != jobs.ProblemUnreadable || rep.Problems[0].Path != path {
		t.Fatalf("verify: %+v, want the bomb unreadable", rep.Problems)
	}
}

// TestStrayFanoutSymlinkNeverAccounted: a symlink at pages/<xx> of
// namespace p that leads to the same fan-out directory of namespace q,
// which holds page i of the same chain, fails page i of p's save; the page
// cache must not account q's page as p's (it would be p's to evict, and
// its unlink, through the symlink, would remove q's page). p then shrunk
// to nothing leaves q's page on disk.
func TestStrayFanoutSymlinkNeverAccounted(t *testing.T) {
	m := kvgen.Tiny
	c, _ := cacheOf(m, 320, true)
	root := t.TempDir()
	e := newEngine(t, Config{Root: root, Workers: 2, CapacityBytes: 1 << 30})
	const i = 2
	toks, keys := fanoutAloneChain(i)
	save := func(ns string) Result {
		return mustDo(t, e, &SavePrefixRequest{Namespace: ns, Identity: "tiny", Tokens: toks, Tensors: kvTensors(c), PageTokens: 64})
	}
	save("q")
	qPage := testutil.PagePath(filepath.Join(root, "q"), keys[i])
	pDir := filepath.Join(root, "p")
	if err := os.MkdirAll(filepath.Join(pDir, layout.PagesDirName), 0o750); err != nil {
		t.Fatal(err)
	}
	fan := filepath.Dir(testutil.PagePath(pDir, keys[i]))
	if err := os.Symlink(filepath.Dir(qPage), fan); err != nil {
		t.Fatal(err)
	}
	if r := save("p"); len(r.Prefix.Failed) != 1 || r.Prefix.Failed[0] != keys[i] {
		t.Fatalf("save to p: failed %v (%v), want page %d", r.Prefix.Failed, r.Prefix.FailedErr, i)
	}
	nsPages := func(ns string) int {
		for _, u := range e.Usage().Namespaces {
			if u.Name == ns {
				return u.Pages
			}
		}
		return 0
	}
	// shrinkAway sets p's quota to 1 byte and waits until p accounts no page.
	shrinkAway := func() {
		t.Helper()
		if err := e.SetQuota("p", 1); err != nil {
			t.Fatal(err)
		}
		for deadline := time.Now().Add(20 * time.Second); nsPages("p") > 0; {
			if time.Now().After(deadline) {
				t.Fatalf("p still accounts %d pages", nsPages("p"))
			}
			time.Sleep(10 * time.Millisecond)
		}
	}
	if got := nsPages("p"); got != len(keys)-1 {
		t.Errorf("p accounts %d pages, want the %d it stored", got, len(keys)-1)
	}
	shrinkAway()
	if _, err := os.Lstat(qPage); err != nil {
		t.Fatalf("q's page %d after p was shrunk: %v", i, err)
	}
	if got := nsPages("q"); got != len(keys) {
		t.Fatalf("q accounts %d pages, want %d", got, len(keys))
	}

	// p's pages stored and indexed, then its fan-out directory replaced
	// by the symlink: a load ends at page i, Lookup forgets it, and a
	// shrink of p leaves q's page.
	if err := e.SetQuota("p", 0); err != nil {
		t.Fatal(err)
	}
	if err := os.Remove(fan); err != nil {
		t.Fatal(err)
	}
	save("p")
	if got, _ := e.Lookup("p", "tiny", 64, toks); got != 320 {
		t.Fatalf("Lookup after p's full save: %d", got)
	}
	if err := os.RemoveAll(fan); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(filepath.Dir(qPage), fan); err != nil {
		t.Fatal(err)
	}
	bufs, dest := paddedDest(m, 320, func(n int) []byte { return make([]byte, n) })
	r := e.Do(bg, &LoadPrefixRequest{Namespace: "p", Identity: "tiny", Tokens: toks, Dest: dest, PageTokens: 64})
	if r.Err != nil || r.Prefix.Tokens != i*64 || r.Prefix.Stop == nil {
		t.Fatalf("load through the symlink: %+v, err %v", r.Prefix, r.Err)
	}
	checkLoaded(t, c, bufs, 320, i*64)
	if got, _ := e.Lookup("p", "tiny", 64, toks); got != i*64 {
		t.Errorf("Lookup after the load: %d, want %d", got, i*64)
	}
	shrinkAway()
	if _, err := os.Lstat(qPage); err != nil {
		t.Fatalf("q's page %d after p was shrunk again: %v", i, err)
	}
}

// TestDirectoryAtPagePathIsAPerPageFailure: a directory where page i's
// file belongs (pages/<xx>/<key>) fails page i alone, as a stray fan-out
// does: a save writes every other page (Failed lists page i, FailedErr
// names the path) instead of failing whole, and a load ends at page i.
func TestDirectoryAtPagePathIsAPerPageFailure(t *testing.T) {
	m := kvgen.Tiny
	c, _ := cacheOf(m, 320, true)
	root := t.TempDir()
	e := newEngine(t, Config{Root: root, Workers: 2})
	const i = 2
	toks, keys := fanoutAloneChain(i)
	path := testutil.PagePath(filepath.Join(root, "p"), keys[i])
	if err := os.MkdirAll(path, 0o750); err != nil {
		t.Fatal(err)
	}
	inside := filepath.Join(path, "not-kvpersists")
	if err := os.WriteFile(inside, []byte("kept"), 0o640); err != nil {
		t.Fatal(err)
	}
	r := e.Do(bg, &SavePrefixRequest{Namespace: "p", Identity: "tiny", Tokens: toks, Tensors: kvTensors(c), PageTokens: 64})
	if r.Err != nil || r.Prefix.PagesWritten != len(keys)-1 || len(r.Prefix.Failed) != 1 || r.Prefix.Failed[0] != keys[i] ||
		r.Prefix.FailedErr == nil || !strings.Contains(r.Prefix.FailedErr.Error(), path) {
		t.Fatalf("save: %+v, err %v; want %d pages written and page %d failed naming %s", r.Prefix, r.Err, len(keys)-1, i, path)
	}
	if got, err := e.Lookup("p", "tiny", 64, toks); err != nil || got != i*64 {
		t.Fatalf("Lookup: %d %v, want %d", got, err, i*64)
	}
	bufs, dest := paddedDest(m, 320, func(n int) []byte { return make([]byte, n) })
	r = e.Do(bg, &LoadPrefixRequest{Namespace: "p", Identity: "tiny", Tokens: toks, Dest: dest, PageTokens: 64})
	if r.Err != nil || r.Prefix.Tokens != i*64 || r.Prefix.Stop == nil {
		t.Fatalf("load: %+v, err %v; want the first %d tokens and a Stop", r.Prefix, r.Err, i*64)
	}
	checkLoaded(t, c, bufs, 320, i*64)
	if b, err := os.ReadFile(inside); err != nil || string(b) != "kept" {
		t.Fatalf("the file in the directory at %s: %q %v", path, b, err)
	}
}
