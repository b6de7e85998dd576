package tiertest

import (
	"bytes"
	"errors"
	"math"
	"os"
	"testing"

	"github.com/kvpersist/kvpersist/engine"
	"github.com/kvpersist/kvpersist/engine/vfs"
	"github.com/kvpersist/kvpersist/internal/faultproxy"
	"github.com/kvpersist/kvpersist/internal/testutil"
)

// TestFetchRetriedGetNotTrustedFromStream: a page's one GET is cut after
// part of its body (the bytes before the cut passed in order through the
// stream's hashes) and retried from its start. The stream must not prove
// the page from what it saw: the retry's bytes are verified by reading the
// temp file back. A retry that brings the whole page publishes it
// byte-identical to A's; a retry whose body has a flipped byte (same
// length) is ErrRemoteCorrupt, publishes nothing and leaves no temp file.
// Either way the accounting equals the disk.
func TestFetchRetriedGetNotTrustedFromStream(t *testing.T) {
	prefix, rootA, conv, keys := uploadedConv(t, 14000, 3*ptoks)
	page := readFile(t, pagePath(rootA, keys[1]))
	pageBytes := int64(len(page))

	for _, tc := range []struct {
		name    string
		cutAt   int64 // body bytes passed before the cut
		corrupt bool  // the retry's body has a flipped tensor byte
	}{
		{"cut-in-header", 100, false},
		{"cut-in-tensors", pageBytes * 2 / 3, false},
		{"cut-then-corrupt-retry", pageBytes / 2, true},
		{"cut-then-corrupt-retry-past-cut", pageBytes / 4, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := faultproxy.Start(t, srv.Endpoint)
			rules := []faultproxy.Rule{{Kinds: faultproxy.Get, Fault: faultproxy.Truncate, Bytes: tc.cutAt, Count: 1, Match: getOf(keys[1])}}
			if tc.corrupt {
				// The flipped byte lies after the cut: the bytes the
				// stream hashed before the cut were all good.
				rules = append(rules, faultproxy.Rule{Kinds: faultproxy.Get, Fault: faultproxy.Corrupt, Bytes: pageBytes - 10, Count: 1, Match: getOf(keys[1])})
			}
			p.Set(rules...)
			rootB := t.TempDir()
			fs := &watchFS{FS: vfs.Default}
			b := newEngineCfg(t, rootB, prefix, newRecorder(t), func(rt *engine.RemoteTier) {
				rt.Store.Endpoint = p.Endpoint
				rt.FetchPages = 1
			}, func(c *engine.Config) { c.FS = fs; c.CapacityBytes = math.MaxInt32 })
			res, c := load(t, b, conv)
			if got := p.Injected(faultproxy.Get); got != len(rules) {
				t.Fatalf("faults injected into GETs: %d, want %d", got, len(rules))
			}
			if fs.tempReads.Load() < 1 {
				t.Fatal("the retried page was proved by the stream: its temp file was never read back")
			}
			if tc.corrupt {
				if res.Prefix.Tokens != ptoks || res.Remote == nil || !errors.Is(res.Remote.Err, engine.ErrRemoteCorrupt) {
					t.Fatalf("loaded %d tokens, report %+v; want %d tokens and ErrRemoteCorrupt", res.Prefix.Tokens, res.Remote, ptoks)
				}
				c.checkLoaded(t, conv, ptoks)
				if _, err := os.Lstat(pagePath(rootB, keys[1])); !os.IsNotExist(err) {
					t.Fatalf("the corrupt page was published (lstat: %v)", err)
				}
			} else {
				if res.Prefix.Tokens != len(conv) || res.Remote.Err != nil {
					t.Fatalf("loaded %d tokens, report %+v; want %d", res.Prefix.Tokens, res.Remote, len(conv))
				}
				c.checkLoaded(t, conv, len(conv))
				if !bytes.Equal(readFile(t, pagePath(rootB, keys[1])), page) {
					t.Fatal("the retried page differs from A's")
				}
			}
			if tmp := testutil.TempFiles(t, rootB); len(tmp) > 0 {
				t.Fatalf("temp files left: %v", tmp)
			}
			checkUsageIsDisk(t, b, rootB, math.MaxInt32)
		})
	}
}
