package tiertest

import (
	"bytes"
	"errors"
	"math"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvpersist/kvpersist/engine"
	"github.com/kvpersist/kvpersist/engine/layout"
	"github.com/kvpersist/kvpersist/engine/vfs"
	"github.com/kvpersist/kvpersist/internal/testutil"
)

// The read-through's fetch path: GETs overlap the publishes of the pages
// before them, pages are verified from the bytes as they arrive (not read
// back), and a corrupt object among overlapping fetches is still a miss.

// watchFS is the real file system with two watches: it counts the reads
// of a temp file made while it still has its temp name, through a
// descriptor opened on that name (a fetched page read back to be
// verified: before its rename; the load's scatter reads a fetched page's
// descriptor only once the page is published, renamed), and a Rename
// whose target is block waits for unblock (closed) before it runs.
type watchFS struct {
	vfs.FS
	tempReads atomic.Int64
	block     string
	unblock   chan struct{}
}

func (w *watchFS) Open(name string) (vfs.File, error) {
	f, err := w.FS.Open(name)
	if err != nil || !layout.IsTemp(filepath.Base(name)) {
		return f, err
	}
	return &watchFile{File: f, w: w, tmp: name}, nil
}

// watchFile is a descriptor opened on a temp name (watchFS.tempReads).
type watchFile struct {
	vfs.File
	w   *watchFS
	tmp string
}

func (f *watchFile) ReadAt(p []byte, off int64) (int, error) {
	if _, err := f.w.FS.Lstat(f.tmp); err == nil {
		f.w.tempReads.Add(1)
	}
	return f.File.ReadAt(p, off)
}

func (w *watchFS) Rename(oldname, newname string) error {
	if w.block != "" && newname == w.block {
		<-w.unblock
	}
	return w.FS.Rename(oldname, newname)
}

// getOf matches the ranged GETs of page k's object.
func getOf(k layout.PageKey) func(*http.Request) bool {
	return func(r *http.Request) bool { return isRangedGet(r) && strings.HasSuffix(r.URL.Path, "/"+k.String()) }
}

// TestFetchOverlapsPublish: with one GET in flight (FetchPages 1), the GET
// of a prompt's second page is sent while its first page is still being
// published: the publish of page 0 (its rename) is held until page 1's GET
// is seen. Before the GET token was given back at the end of the network
// part, the next GET waited for the whole publish, so page 0's rename
// waited for a GET that never came (the test's 20 s bound). The load then
// gets every page bit-exact.
func TestFetchOverlapsPublish(t *testing.T) {
	prefix, _, conv, keys := uploadedConv(t, 11000, 3*ptoks)
	rootB := t.TempDir()

	fs := &watchFS{FS: vfs.Default, block: pagePath(rootB, keys[0]), unblock: make(chan struct{})}
	var overlapped atomic.Bool
	hook := &hookRT{next: http.DefaultTransport.(*http.Transport).Clone(), match: getOf(keys[1]), hook: func() {
		overlapped.Store(true)
		close(fs.unblock)
	}}
	timer := time.AfterFunc(20*time.Second, func() { hook.once.Do(func() { close(fs.unblock) }) })
	defer timer.Stop()
	b := newEngineCfg(t, rootB, prefix, newRecorder(t), func(rt *engine.RemoteTier) {
		rt.Store.Transport = hook
		rt.FetchPages = 1
	}, func(c *engine.Config) { c.FS = fs })
	res, c := load(t, b, conv)
	if !overlapped.Load() {
		t.Fatal("page 1's GET was not sent while page 0 was publishing: the GETs wait for the publishes")
	}
	if res.Prefix.Tokens != len(conv) || res.Remote.PagesFetched != 3 || res.Remote.Err != nil {
		t.Fatalf("loaded %d tokens, report %+v; want %d tokens, 3 pages fetched", res.Prefix.Tokens, res.Remote, len(conv))
	}
	c.checkLoaded(t, conv, len(conv))
}

// TestFetchedPagesNotReadBack: pages fetched with one GET each are
// verified from the bytes as they arrived: no temp file is opened to read
// it back (before, each fetched page was read back through its temp file).
// With ranged GETs in flight the bytes arrive out of order and each page
// is read back to be verified instead. Either way the load is bit-exact,
// every page is published and the accounting equals the disk. (Page 0 is
// fetched by a load of its own first, so that the load measured starts
// with a local page and scatters nothing: a scatter reads a fetched page
// through its temp name beside the publish, which the count cannot tell
// from a read-back; it failed a fresh-clone run that way.)
func TestFetchedPagesNotReadBack(t *testing.T) {
	prefix, rootA, conv, keys := uploadedConv(t, 12000, 4*ptoks+10)
	pageBytes := int64(len(readFile(t, pagePath(rootA, keys[0]))))

	for _, tc := range []struct {
		name      string
		chunk     int64
		readBacks func(n int64) bool
	}{
		{"one-get-per-page", 0, func(n int64) bool { return n == 0 }},
		{"ranged-gets", pageBytes / 4, func(n int64) bool { return n >= 1 }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			rootB := t.TempDir()
			fs := &watchFS{FS: vfs.Default}
			b := newEngineCfg(t, rootB, prefix, newRecorder(t), func(rt *engine.RemoteTier) {
				rt.Store.FetchChunkBytes = tc.chunk
				rt.Store.Concurrency = 4
			}, func(c *engine.Config) { c.FS = fs; c.CapacityBytes = math.MaxInt32 })
			// Page 0 first, alone: then the prompt starts with a local
			// page, so nothing is scattered (a scatter reads a fetched
			// page's temp file beside its publish, which would count here).
			if res, _ := load(t, b, conv[:ptoks]); res.Prefix.Tokens != ptoks {
				t.Fatalf("page 0: loaded %d tokens, report %+v", res.Prefix.Tokens, res.Remote)
			}
			fs.tempReads.Store(0)
			res, c := load(t, b, conv)
			if res.Prefix.Tokens != len(conv) || res.Remote.PagesFetched != len(keys)-1 || res.Remote.Err != nil {
				t.Fatalf("loaded %d tokens, report %+v; want %d tokens, %d pages fetched", res.Prefix.Tokens, res.Remote, len(conv), len(keys)-1)
			}
			c.checkLoaded(t, conv, len(conv))
			if n := fs.tempReads.Load(); !tc.readBacks(n) {
				t.Fatalf("%d reads of temp files to verify %d fetched pages", n, len(keys)-1)
			}
			for _, k := range keys {
				if !bytes.Equal(readFile(t, pagePath(rootB, k)), readFile(t, pagePath(rootA, k))) {
					t.Fatalf("page %s differs from A's", k)
				}
			}
			checkUsageIsDisk(t, b, rootB, math.MaxInt32)
		})
	}
}

// TestCorruptPageAmongOverlappingFetches: 8 remote pages, page 3 damaged,
// fetched 2 GETs at a time with publishes overlapping later GETs, one GET
// per page (verified from the stream) and ranged (read back): the load
// gets pages 0-2 bit-exact and nothing past them in its destinations
// (every byte after token 3×64 is as before: zero), reports
// ErrRemoteCorrupt, publishes no file for page 3 and leaves no temp file;
// the valid pages after it are kept, and the accounting equals the disk.
func TestCorruptPageAmongOverlappingFetches(t *testing.T) {
	prefix, rootA, conv, keys := uploadedConv(t, 13000, 8*ptoks)
	st := openStore(t, prefix)
	name, _ := st.PageName(ns, keys[3].String())
	page := readFile(t, pagePath(rootA, keys[3]))
	pageBytes := int64(len(page))
	bad := bytes.Clone(page)
	bad[len(bad)/2] ^= 0x01 // a tensor byte
	putObject(t, st, name, bad)

	for _, chunk := range []int64{0, pageBytes / 3} {
		rootB := t.TempDir()
		rec := newRecorder(t)
		b := newEngineCfg(t, rootB, prefix, rec, func(rt *engine.RemoteTier) {
			rt.FetchPages = 2
			rt.Store.FetchChunkBytes = chunk
		}, func(c *engine.Config) { c.CapacityBytes = math.MaxInt32 })
		res, c := load(t, b, conv)
		if res.Prefix.Tokens != 3*ptoks {
			t.Fatalf("chunk %d: loaded %d tokens, want %d (the pages before the corrupt one)", chunk, res.Prefix.Tokens, 3*ptoks)
		}
		c.checkLoaded(t, conv, 3*ptoks)
		if res.Remote == nil || !errors.Is(res.Remote.Err, engine.ErrRemoteCorrupt) {
			t.Fatalf("chunk %d: remote report %+v: want ErrRemoteCorrupt", chunk, res.Remote)
		}
		if _, err := os.Lstat(pagePath(rootB, keys[3])); !os.IsNotExist(err) {
			t.Fatalf("chunk %d: corrupt page published (lstat: %v)", chunk, err)
		}
		for i, k := range keys {
			if i == 3 {
				continue
			}
			if !bytes.Equal(readFile(t, pagePath(rootB, k)), readFile(t, pagePath(rootA, k))) {
				t.Fatalf("chunk %d: page %d not kept as A's", chunk, i)
			}
		}
		if n := snapshotOps(rec)["fetch/corrupt"]; n != 1 {
			t.Fatalf("chunk %d: fetch/corrupt = %d, want 1", chunk, n)
		}
		if tmp := testutil.TempFiles(t, rootB); len(tmp) > 0 {
			t.Fatalf("chunk %d: temp files left: %v", chunk, tmp)
		}
		checkUsageIsDisk(t, b, rootB, math.MaxInt32)
		closeEngine(t, b)
	}
}
