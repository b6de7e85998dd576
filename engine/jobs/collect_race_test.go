package jobs_test

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvpersist/kvpersist/engine/jobs"
	"github.com/kvpersist/kvpersist/engine/layout"
	"github.com/kvpersist/kvpersist/engine/vfs"
	"github.com/kvpersist/kvpersist/internal/kvgen"
	"github.com/kvpersist/kvpersist/internal/testutil"
)

// TestCollectNeverSweepsAWriteInProgress: a collect that first looks at a
// namespace before a writer has created anything there, then goes on while
// the writer has stored its blocks (or its temp file) but not yet renamed
// its snapshot into place, deletes none of the writer's files, with
// TempGrace < 0 (every temp file stale); the writer publishes and its
// snapshot reads back verified. (The clock is an hour ahead so that even a
// temp file created after the collect started is past any grace.) The schedule is forced, not timed: the
// collect's first Lstat of the namespace's blocks/ waits until the writer
// either stands before its final rename or is blocked on the namespace
// lock; the writer's final rename waits until the collect has returned or
// is itself blocked on the lock. A prefix save is held before its first
// page rename instead (its pages staged as temp files under pages/), and
// must publish every page, which loads back verified.
func TestCollectNeverSweepsAWriteInProgress(t *testing.T) {
	cases := []struct {
		name   string
		lay    layout.Layout
		before bool // the namespace already holds a snapshot (and its .lock)
		prefix bool // a prefix save (jobs.SavePrefix) rather than a write
	}{
		{"blocks-in-a-used-namespace", layout.Blocks, true, false},
		{"blocks-in-a-new-empty-namespace", layout.Blocks, false, false},
		{"single-file-in-a-used-namespace", layout.Single, true, false},
		{"prefix-pages-in-a-new-empty-namespace", 0, false, true},
		{"prefix-pages-in-a-used-namespace", 0, true, true},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			root := t.TempDir()
			ns := filepath.Join(root, "ns")
			if tc.before {
				mustWrite(t, noSync(), cacheSpec(t, kvgen.NewCache(kvgen.Tiny, 10, true, nil), filepath.Join(ns, "single0"), layout.Single, 0))
			} else if err := os.Mkdir(ns, 0o750); err != nil {
				t.Fatal(err)
			}
			target := filepath.Join(ns, "w")
			c := kvgen.NewCache(kvgen.Tiny, 1100, true, nil)
			cv := newConv(seqTokens(300, 8), pTensors, pHeads, pDim, 320)
			pagesDir := testutil.PagesDir(ns)
			held := func(newname string) bool { // the rename the writer is held before
				if tc.prefix {
					return strings.HasPrefix(newname, pagesDir+string(filepath.Separator))
				}
				return newname == target
			}

			var (
				atRename      = make(chan struct{}) // the writer stands before its final rename
				writerBlocked = make(chan struct{}) // the writer waits for the namespace lock
				release       = make(chan struct{}) // the writer may rename
				onceAt        sync.Once
				onceBlocked   sync.Once
				onceRelease   sync.Once
				onceStart     sync.Once
				writeErr      error
				wg            sync.WaitGroup
			)
			let := func() { onceRelease.Do(func() { close(release) }) }
			wfs := &testutil.HookFS{FS: vfs.Default,
				OnLockBlocked: func(string, bool) { onceBlocked.Do(func() { close(writerBlocked) }) },
				BeforeRename: func(_, newname string) {
					if held(newname) {
						onceAt.Do(func() { close(atRename) })
						<-release
					}
				},
			}
			startWriter := func() {
				wg.Add(1)
				go func() {
					defer wg.Done()
					if tc.prefix {
						_, _, writeErr = savePrefixAt(context.Background(), &jobs.Config{FS: wfs, NoSync: true}, ns,
							&jobs.SavePrefixRequest{Identity: "tiny/bf16", Tokens: cv.tokens, Tensors: cv.views(300), PageTokens: 64})
						return
					}
					_, _, writeErr = writeAt(context.Background(), &jobs.Config{FS: wfs, NoSync: true}, cacheSpec(t, c, target, tc.lay, 4096))
				}()
			}
			cfs := &testutil.HookFS{FS: vfs.Default,
				AfterLstat: func(name string, err error) {
					if name == testutil.BlocksDir(ns) && vfs.IsNotExist(err) {
						onceStart.Do(func() {
							startWriter()
							select {
							case <-atRename:
							case <-writerBlocked:
							}
						})
					}
				},
				OnLockBlocked: func(string, bool) { let() }, // the writer holds the lock: let it finish
			}
			m, err := collectAt(context.Background(), &jobs.Config{FS: cfs, NoSync: true}, root,
				&jobs.CollectRequest{TempGrace: -1, Now: time.Now().Add(time.Hour)})
			let()
			wg.Wait()
			if err != nil {
				t.Fatalf("Collect: %v", err)
			}
			for _, p := range m.Collect.Deleted {
				if strings.HasPrefix(p, testutil.BlocksDir(ns)) || strings.HasPrefix(p, pagesDir) || strings.Contains(filepath.Base(p), ".w.tmp-") {
					t.Errorf("collect deleted %s of the write in progress", p)
				}
			}
			if writeErr != nil {
				t.Fatalf("the write collect overlapped failed: %v", writeErr)
			}
			if tc.prefix {
				bufs, dest := cv.dests(320)
				if r := loadPrefix(t, noSync(), ns, cv.tokens, dest, 64, true); r.Tokens != 300 {
					t.Fatalf("the prefix saved beside collect loads %d of 300 tokens", r.Tokens)
				}
				cv.checkDest(t, bufs, 320, 300)
				return
			}
			got, _, _, err := readBack(t, noSync(), target, true)
			if err != nil {
				t.Fatalf("the snapshot written beside collect does not read back: %v", err)
			}
			mustEqualExpected(t, got, expectedAll(c))
		})
	}
}
