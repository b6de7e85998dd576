package uploads_test

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/zeebo/xxh3"
	"go.uber.org/goleak"

	"github.com/kvpersist/kvpersist/engine/layout"
	"github.com/kvpersist/kvpersist/engine/remote"
	"github.com/kvpersist/kvpersist/engine/store"
	"github.com/kvpersist/kvpersist/engine/uploads"
	"github.com/kvpersist/kvpersist/engine/vfs"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

var bg = context.Background()

func testKeys(n int) []layout.PageKey {
	out := make([]layout.PageKey, n)
	for i := range out {
		out[i] = layout.PageKey(sha256.Sum256([]byte{byte(i), byte(i >> 8)}))
	}
	return out
}

// decodeJournal decodes b as a snapshot alone (the whole file).
func decodeJournal(b []byte) ([]layout.PageKey, []string, error) {
	p, m, end, err := uploads.DecodeSnapshot(b)
	if err == nil && end != len(b) {
		err = fmt.Errorf("%w: %d bytes after the snapshot", uploads.ErrJournal, len(b)-end)
	}
	return p, m, err
}

// rehash recomputes a journal's trailing hash after a test edited it, so
// that the decoder's later checks are reached.
func rehash(b []byte) []byte {
	body := b[:len(b)-8]
	return binary.LittleEndian.AppendUint64(bytes.Clone(body), xxh3.Hash(body))
}

// record is a journal record encoded from docs/format/uploads-journal.md
// alone: magic "UPR\n", u8 op, u8 L, L bytes, XXH3-64 of the bytes
// before it.
func record(op byte, payload []byte) []byte {
	b := append([]byte("UPR\n"), op, byte(len(payload)))
	b = append(b, payload...)
	return binary.LittleEndian.AppendUint64(b, xxh3.Hash(b))
}

// listOf lists a replayed journal: sorted keys and names.
func listOf(s *uploads.Set) ([]layout.PageKey, []string) {
	return s.SortedPages(), s.SortedManifests()
}

func sortedKeys(keys ...layout.PageKey) []layout.PageKey {
	out := slices.Clone(keys)
	slices.SortFunc(out, func(a, b layout.PageKey) int { return bytes.Compare(a[:], b[:]) })
	return out
}

// pageRecords is the queued records of keys, in order.
func pageRecords(keys ...layout.PageKey) []byte {
	var b []byte
	for _, k := range keys {
		b = append(b, record(uploads.OpPageQueued, k[:])...)
	}
	return b
}

// fakeQueue is an upload queue of capacity uploads that never sends
// anything: the test ends uploads itself (finish, drain). A local page
// manifest is a file starting "pages\n" followed by one hex key a line.
type fakeQueue struct {
	st *store.Store

	mu        sync.Mutex
	capacity  int
	queued    []*uploads.Pending // accepted and not ended, in order
	submitted map[string]int     // object name -> times accepted
	refused   map[string]int     // object name -> times refused
	marks     map[string]bool    // "<ns>/<key>" -> pending mark
	// onSubmit, when set, runs at the start of Submit (without fakeQueue.mu);
	// a non-nil error refuses the upload with it.
	onSubmit func(p *uploads.Pending) error
	// onManifestPages, when set, runs at the start of ManifestPages.
	onManifestPages func(ns, name string)
}

func newFakeQueue(st *store.Store, capacity int) *fakeQueue {
	return &fakeQueue{st: st, capacity: capacity, submitted: map[string]int{}, refused: map[string]int{}, marks: map[string]bool{}}
}

func pageObject(ns string, k layout.PageKey) string { return ns + "/pages/" + k.String() }
func manifestObject(ns, name string) string         { return ns + "/manifests/" + name }

func (q *fakeQueue) Name(u uploads.Upload) (string, error) {
	if u.IsManifest() {
		return manifestObject(u.NS, u.Manifest), nil
	}
	return pageObject(u.NS, u.Key), nil
}

func (q *fakeQueue) Path(u uploads.Upload) (string, error) {
	n, err := q.st.Namespace(u.NS)
	if err != nil {
		return "", err
	}
	if u.IsManifest() {
		return manifestPath(n, u.Manifest), nil
	}
	return n.PagePath(u.Key), nil
}

func manifestPath(n *store.Namespace, name string) string {
	return filepath.Join(n.Dir(), "manifest-"+name)
}

func (q *fakeQueue) Submit(p *uploads.Pending) error {
	q.mu.Lock()
	hook := q.onSubmit
	q.mu.Unlock()
	if hook != nil {
		if err := hook(p); err != nil {
			q.mu.Lock()
			q.refused[p.Object]++
			q.mu.Unlock()
			return err
		}
	}
	q.mu.Lock()
	defer q.mu.Unlock()
	if len(q.queued) >= q.capacity {
		q.refused[p.Object]++
		return fmt.Errorf("%w: %d uploads waiting", remote.ErrQueueFull, q.capacity)
	}
	q.queued = append(q.queued, p)
	q.submitted[p.Object]++
	return nil
}

func (q *fakeQueue) ManifestPages(ns, name string) ([]layout.PageKey, error) {
	q.mu.Lock()
	hook := q.onManifestPages
	q.mu.Unlock()
	if hook != nil {
		hook(ns, name)
	}
	n, err := q.st.Namespace(ns)
	if err != nil {
		return nil, err
	}
	b, err := os.ReadFile(manifestPath(n, name))
	if err != nil {
		return nil, err
	}
	lines := strings.Split(strings.TrimSpace(string(b)), "\n")
	if lines[0] != "pages" {
		return nil, fmt.Errorf("%s is no longer a page manifest", name)
	}
	var keys []layout.PageKey
	for _, l := range lines[1:] {
		raw, err := hex.DecodeString(l)
		if err != nil || len(raw) != 32 {
			return nil, fmt.Errorf("bad key %q", l)
		}
		keys = append(keys, layout.PageKey(raw))
	}
	return keys, nil
}

func (q *fakeQueue) Room() (free, capacity int) {
	q.mu.Lock()
	defer q.mu.Unlock()
	return q.capacity - len(q.queued), q.capacity
}

func (q *fakeQueue) SetPending(ns string, k layout.PageKey, pending bool) {
	q.mu.Lock() // called under the Ledger's mutex; q.mu is never held calling the Ledger
	defer q.mu.Unlock()
	q.marks[ns+"/"+k.String()] = pending
}

func (q *fakeQueue) marked(ns string, k layout.PageKey) bool {
	q.mu.Lock()
	defer q.mu.Unlock()
	return q.marks[ns+"/"+k.String()]
}

// finish (safe on any goroutine) ends the queued upload of object with err (as the uploader
// reports it: Ledger.Done).
func (q *fakeQueue) finish(t *testing.T, l *uploads.Ledger, object string, err error) {
	t.Helper()
	q.mu.Lock()
	i := slices.IndexFunc(q.queued, func(p *uploads.Pending) bool { return p.Object == object })
	if i < 0 {
		q.mu.Unlock()
		t.Errorf("%s is not queued", object)
		return
	}
	q.queued = slices.Delete(q.queued, i, i+1)
	q.mu.Unlock()
	l.Done(object, err)
}

// drain ends the first n queued uploads with err; it returns how many it
// ended.
func (q *fakeQueue) drain(l *uploads.Ledger, n int, err error) int {
	q.mu.Lock()
	n = min(n, len(q.queued))
	ended := slices.Clone(q.queued[:n])
	q.queued = slices.Delete(q.queued, 0, n)
	q.mu.Unlock()
	for _, p := range ended {
		l.Done(p.Object, err)
	}
	return n
}

func (q *fakeQueue) submits(object string) int {
	q.mu.Lock()
	defer q.mu.Unlock()
	return q.submitted[object]
}

// distinct counts the objects ever accepted.
func (q *fakeQueue) distinct() int {
	q.mu.Lock()
	defer q.mu.Unlock()
	return len(q.submitted)
}

func (q *fakeQueue) setOnSubmit(f func(p *uploads.Pending) error) {
	q.mu.Lock()
	q.onSubmit = f
	q.mu.Unlock()
}

func (q *fakeQueue) setOnManifestPages(f func(ns, name string)) {
	q.mu.Lock()
	q.onManifestPages = f
	q.mu.Unlock()
}

// testFS is the real file system, counting the bytes read from uploads
// journals (ReadAt of a file opened at a path named layout.UploadsName),
// the journal descriptors open for reading, the renames onto a journal
// (compactions), and running onLstat (once set) after each Lstat, before
// it returns.
type testFS struct {
	vfs.FS
	read      atomic.Int64
	openReads atomic.Int64 // journal descriptors open for reading
	renames   atomic.Int64
	appends   atomic.Int64 // journal descriptors open for appending
	onLstat   atomic.Pointer[func(name string)]
}

func isJournal(name string) bool {
	return strings.HasSuffix(name, string(os.PathSeparator)+layout.UploadsName)
}

type countingFile struct {
	vfs.File
	fs     *testFS
	closed atomic.Bool
}

func (f *countingFile) ReadAt(p []byte, off int64) (int, error) {
	n, err := f.File.ReadAt(p, off)
	f.fs.read.Add(int64(n))
	return n, err
}

func (f *countingFile) Close() error {
	if f.closed.CompareAndSwap(false, true) {
		f.fs.openReads.Add(-1)
	}
	return f.File.Close()
}

type countingAppend struct {
	vfs.AppendFile
	fs     *testFS
	closed atomic.Bool
}

func (f *countingAppend) Close() error {
	if f.closed.CompareAndSwap(false, true) {
		f.fs.appends.Add(-1)
	}
	return f.AppendFile.Close()
}

func (f *testFS) Open(name string) (vfs.File, error) {
	file, err := f.FS.Open(name)
	if err != nil || !isJournal(name) {
		return file, err
	}
	f.openReads.Add(1)
	return &countingFile{File: file, fs: f}, nil
}

func (f *testFS) OpenAppend(name string, perm os.FileMode) (vfs.AppendFile, error) {
	file, err := f.FS.OpenAppend(name, perm)
	if err != nil || !isJournal(name) {
		return file, err
	}
	f.appends.Add(1)
	return &countingAppend{AppendFile: file, fs: f}, nil
}

func (f *testFS) Rename(oldname, newname string) error {
	err := f.FS.Rename(oldname, newname)
	if err == nil && isJournal(newname) {
		f.renames.Add(1)
	}
	return err
}

func (f *testFS) Lstat(name string) (os.FileInfo, error) {
	fi, err := f.FS.Lstat(name)
	if hook := f.onLstat.Load(); hook != nil {
		(*hook)(name)
	}
	return fi, err
}

// env is a Ledger on a store root of its own, with its fake queue.
type env struct {
	root string
	fs   *testFS
	st   *store.Store
	q    *fakeQueue
	l    *uploads.Ledger
}

// newEnv opens a Ledger (cfg's Store and Queue set here) on a new root
// (NoSync unless durable) with a fake queue of capacity uploads. Its
// cleanup closes it, abandoning the uploads still queued.
func newEnv(t *testing.T, capacity int, durable bool, cfg uploads.Config) *env {
	t.Helper()
	return newEnvAt(t, t.TempDir(), capacity, durable, cfg)
}

func newEnvAt(t *testing.T, root string, capacity int, durable bool, cfg uploads.Config) *env {
	t.Helper()
	fsys := &testFS{FS: vfs.Default}
	st, err := store.Open(root, store.Options{FS: fsys, NoSync: !durable})
	if err != nil {
		t.Fatal(err)
	}
	q := newFakeQueue(st, capacity)
	cfg.Store, cfg.Queue = st, q
	l, err := uploads.Open(cfg)
	if err != nil {
		t.Fatal(err)
	}
	e := &env{root: root, fs: fsys, st: st, q: q, l: l}
	t.Cleanup(func() { e.close(t) })
	return e
}

// close closes the Ledger (once), abandoning the uploads still queued.
func (e *env) close(t *testing.T) {
	t.Helper()
	err := e.l.Close(bg, func(context.Context) error {
		e.q.setOnSubmit(nil)
		e.q.drain(e.l, 1<<30, remote.ErrAbandoned)
		return nil
	})
	if err != nil && !errors.Is(err, uploads.ErrClosed) {
		t.Errorf("Close: %v", err)
	}
}

// ns returns namespace name, its directory made.
func (e *env) ns(t *testing.T, name string) *store.Namespace {
	t.Helper()
	n, err := e.st.Namespace(name)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.MkdirAll(n.Dir(), 0o755); err != nil {
		t.Fatal(err)
	}
	return n
}

// writePages creates a file at the page path of every key of ns.
func (e *env) writePages(t *testing.T, ns string, keys ...layout.PageKey) {
	t.Helper()
	n := e.ns(t, ns)
	for _, k := range keys {
		if err := os.MkdirAll(filepath.Dir(n.PagePath(k)), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(n.PagePath(k), k[:], 0o644); err != nil {
			t.Fatal(err)
		}
	}
}

// writeManifest writes manifest name of ns: a page manifest naming keys
// when pageManifest, else a file that is not one.
func (e *env) writeManifest(t *testing.T, ns, name string, pageManifest bool, keys ...layout.PageKey) {
	t.Helper()
	n := e.ns(t, ns)
	b := "not a page manifest\n"
	if pageManifest {
		b = "pages\n"
		for _, k := range keys {
			b += k.String() + "\n"
		}
	}
	if err := os.WriteFile(manifestPath(n, name), []byte(b), 0o644); err != nil {
		t.Fatal(err)
	}
}

// writeJournal writes ns's journal file.
func (e *env) writeJournal(t *testing.T, ns string, b []byte) {
	t.Helper()
	if err := os.WriteFile(e.ns(t, ns).UploadsPath(), b, 0o640); err != nil {
		t.Fatal(err)
	}
}

// appendJournal appends b to ns's journal file.
func (e *env) appendJournal(t *testing.T, ns string, b []byte) {
	t.Helper()
	f, err := os.OpenFile(e.ns(t, ns).UploadsPath(), os.O_WRONLY|os.O_APPEND|os.O_CREATE, 0o640)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if _, err := f.Write(b); err != nil {
		t.Fatal(err)
	}
}

// flush writes every record added so far.
func (e *env) flush(t *testing.T) {
	t.Helper()
	ctx, cancel := context.WithTimeout(bg, 10*time.Second)
	defer cancel()
	if left, err := e.l.Flush(ctx); err != nil || len(left) > 0 {
		t.Fatalf("Flush: %v left, %v", left, err)
	}
}

// listing replays ns's journal as it is on disk (records flushed first).
func (e *env) listing(t *testing.T, ns string) (s *uploads.Set, size int) {
	t.Helper()
	e.flush(t)
	b, err := os.ReadFile(e.ns(t, ns).UploadsPath())
	if err != nil {
		t.Fatal(err)
	}
	s, _, _, _ = uploads.Decode(b)
	return s, len(b)
}

// refill runs a refill of ns now.
func (e *env) refill(t *testing.T, ns string) (again bool) {
	t.Helper()
	again, err := e.l.Refill(bg, ns)
	if err != nil {
		t.Fatal(err)
	}
	return again
}

// waitFor polls cond for up to 10 s.
func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	for end := time.Now().Add(10 * time.Second); !cond(); {
		if time.Now().After(end) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(time.Millisecond)
	}
}
