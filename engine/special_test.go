package engine

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

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
			t.Skipf("mkfifo: %v", err)
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
		return &LoadPrefixRequest{Namespace: ns, Identity: "tiny", Tokens: toks, Dest: dest, PageTokens: 64, Verify: true}, bufs
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
