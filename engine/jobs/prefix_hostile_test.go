package jobs_test

import (
	"errors"
	"os"
	"path/filepath"
	"testing"

	"github.com/kvpersist/kvpersist/engine/jobs"
	"github.com/kvpersist/kvpersist/internal/testutil"
)

// A hostile or misplaced file where page 1 of a prompt should be ends the
// prefix there: the load does not fail, page 0 is loaded and reported, and
// since every such page is found before any destination is written, every
// other byte of the destinations is untouched.
func TestPrefixHostilePageEndsPrefix(t *testing.T) {
	root := t.TempDir()
	copyOver := func(t *testing.T, page1, other string) {
		raw, err := os.ReadFile(other)
		if err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(page1, raw, 0o640); err != nil {
			t.Fatal(err)
		}
	}
	cases := []struct {
		name      string
		sameToken bool // other is page 1 of the same tokens saved with 1 more KV head
		plant     func(t *testing.T, page1, other string)
	}{
		// A valid page of another conversation, copied under page 1's key:
		// its header claims another key, parent and token ids.
		{"other page's file", false, copyOver},
		// Page 1 of the same tokens and identity with other shapes: its key
		// is right, its tensors disagree with page 0's.
		{"other shapes", true, copyOver},
		{"symlink", false, func(t *testing.T, page1, other string) {
			if err := os.Symlink(other, page1); err != nil {
				t.Fatal(err)
			}
		}},
		{"directory", false, func(t *testing.T, page1, other string) {
			if err := os.Mkdir(page1, 0o750); err != nil {
				t.Fatal(err)
			}
		}},
	}
	for i, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			ns := filepath.Join(root, "ns"+string(rune('a'+i)))
			c := newConv(seqTokens(800, 11), pTensors, pHeads, pDim, 1024)
			res := savePrefix(t, noSync(), ns, c, 800, 256)
			o, ons := newConv(seqTokens(800, 12), pTensors, pHeads, pDim, 1024), ns
			if tc.sameToken {
				o, ons = newConv(seqTokens(800, 11), pTensors, pHeads+1, pDim, 1024), ns+"-other"
			}
			ores := savePrefix(t, noSync(), ons, o, 800, 256)
			page1 := testutil.PagePath(ns, res.Keys[1])
			if err := os.Remove(page1); err != nil {
				t.Fatal(err)
			}
			tc.plant(t, page1, testutil.PagePath(ons, ores.Keys[1]))
			bufs, dest := c.dests(1024)
			lr, _, err := jobs.LoadPrefix(t.Context(), inRoot(withHelpers(2), ns), &jobs.LoadPrefixRequest{
				Namespace: filepath.Base(ns), Identity: "tiny/bf16", Tokens: c.tokens, Dest: dest, PageTokens: 256, Verify: true,
			})
			if err != nil {
				t.Fatalf("load failed for a bad page (it should end the prefix): %v", err)
			}
			if lr.Tokens != 256 || len(lr.Keys) != 1 || lr.Keys[0] != res.Keys[0] || lr.Stop == nil || lr.Missing != nil {
				t.Fatalf("got %+v, want page 0 loaded and Stop set", lr)
			}
			if (tc.name == "other page's file" || tc.sameToken) && !errors.Is(lr.Stop, jobs.ErrCorrupt) {
				t.Fatalf("Stop %v, want ErrCorrupt", lr.Stop)
			}
			c.checkDest(t, bufs, 1024, 256)
		})
	}
}
