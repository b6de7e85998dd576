package jobs_test

import (
	"bytes"
	"encoding/binary"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/kvpersist/kvpersist/engine/gather"
	"github.com/kvpersist/kvpersist/engine/jobs"
	"github.com/kvpersist/kvpersist/engine/layout"
	"github.com/kvpersist/kvpersist/engine/vfs"
	"github.com/kvpersist/kvpersist/internal/kvgen"
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
				Namespace: filepath.Base(ns), Identity: "tiny/bf16", Tokens: c.tokens, Dest: dest, PageTokens: 256,
			}, nil)
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

// Two destinations that share bytes of memory (here tensor 2's view is
// tensor 1's buffer again) are refused before anything is read or
// written: ErrDestination naming both, every buffer untouched. Without the
// check, the two tensors' pages would be read into the same bytes and the
// load would report success with tensor 1 holding tensor 2's KV.
func TestPrefixLoadRefusesSharedDestinations(t *testing.T) {
	ns := filepath.Join(t.TempDir(), "ns")
	c := newConv(seqTokens(600, 13), pTensors, pHeads, pDim, 768)
	savePrefix(t, noSync(), ns, c, 600, 256)
	for _, tc := range []struct {
		name string
		edit func(bufs [][]byte, d []jobs.TensorSpec)
	}{
		{"same buffer", func(bufs [][]byte, d []jobs.TensorSpec) { d[2].View.Base = bufs[1] }},
		{"overlapping halves", func(bufs [][]byte, d []jobs.TensorSpec) {
			// Tensors 1 and 2 in one buffer, 2 starting halfway into 1.
			n := len(bufs[1])
			big := bytes.Repeat([]byte{0x5a}, n+n/2)
			d[1].View.Base, d[2].View.Base = big[:n], big[n/2:]
		}},
	} {
		bufs, dest := c.dests(768)
		tc.edit(bufs, dest)
		_, _, err := jobs.LoadPrefix(t.Context(), inRoot(noSync(), ns), &jobs.LoadPrefixRequest{
			Namespace: "ns", Identity: "tiny/bf16", Tokens: c.tokens[:100], Dest: dest, PageTokens: 256,
		}, nil)
		if !errors.Is(err, jobs.ErrDestination) || !strings.Contains(err.Error(), "destination 1 and destination 2") {
			t.Fatalf("%s: got %v, want ErrDestination naming destinations 1 and 2", tc.name, err)
		}
		c.checkDest(t, bufs, 768, 0)
	}
	// Tensors interleaved in one buffer, [head][token][tensor][dim] (so
	// their address ranges meet but no element is shared), are accepted,
	// and each gets its own KV.
	const capT = 768
	buf := bytes.Repeat([]byte{0x5a}, pHeads*capT*pTensors*pDim*2)
	var dest []jobs.TensorSpec
	for ti := range pTensors {
		dest = append(dest, jobs.TensorSpec{DType: "bfloat16", View: gather.View{
			Base: buf, Offset: ti * pDim * 2, Shape: []int{1, pHeads, capT, pDim},
			Strides: []int{pHeads * capT * pTensors * pDim, capT * pTensors * pDim, pTensors * pDim, 1}, ItemSize: 2}})
	}
	lr := loadPrefix(t, noSync(), ns, c.tokens, dest, 256, true)
	if lr.Tokens != 600 {
		t.Fatalf("interleaved destinations: %+v", lr)
	}
	for h := range pHeads {
		for tok := range capT {
			for ti := range pTensors {
				for d := range pDim {
					got := binary.LittleEndian.Uint16(buf[(((h*capT+tok)*pTensors+ti)*pDim+d)*2:])
					want := uint16(0x5a5a)
					if tok < 600 {
						want = c.value(ti, h, tok, d)
					}
					if got != want {
						t.Fatalf("interleaved: tensor %d head %d token %d d %d = %#x, want %#x", ti, h, tok, d, got, want)
					}
				}
			}
		}
	}
}

// Reading a snapshot into destination buffers that share bytes is refused
// the same way (the same check): ErrDestination naming both slots, nothing
// written.
func TestReadRefusesSharedDestinations(t *testing.T) {
	c := kvgen.NewCache(kvgen.Tiny, 300, true, nil)
	path := filepath.Join(t.TempDir(), "ns", "snap")
	mustWrite(t, noSync(), cacheSpec(t, c, path, layout.Single, 0))
	snap, err := layout.Load(vfs.Default, path)
	if err != nil {
		t.Fatal(err)
	}
	dest := destFor(snap.Header, 0x77)
	dest[3] = dest[0][:len(dest[3])] // slots 0 and 3 have the same size
	_, _, err = readAt(t.Context(), noSync(), path, &jobs.ReadRequest{Dest: dest})
	if !errors.Is(err, jobs.ErrDestination) || !strings.Contains(err.Error(), snap.Header.SlotName(0)) || !strings.Contains(err.Error(), snap.Header.SlotName(3)) {
		t.Fatalf("got %v, want ErrDestination naming slots 0 and 3", err)
	}
	for i, d := range dest {
		if !bytes.Equal(d, bytes.Repeat([]byte{0x77}, len(d))) {
			t.Fatalf("slot %d was written", i)
		}
	}
}

// A hostile or stale first page whose tensors have other shapes than the
// destinations (here one KV head more) fails the load with ErrMismatch
// naming the page, the tensor and the axis that differs with both sizes;
// nothing is written.
func TestPrefixFirstPageOtherShapesNamesTheAxis(t *testing.T) {
	root := t.TempDir()
	ns, other := filepath.Join(root, "ns"), filepath.Join(root, "other")
	c := newConv(seqTokens(600, 14), pTensors, pHeads, pDim, 768)
	res := savePrefix(t, noSync(), ns, c, 600, 256)
	o := newConv(seqTokens(600, 14), pTensors, pHeads+1, pDim, 768)
	ores := savePrefix(t, noSync(), other, o, 600, 256)
	page0 := testutil.PagePath(ns, res.Keys[0])
	raw, err := os.ReadFile(testutil.PagePath(other, ores.Keys[0]))
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(page0, raw, 0o640); err != nil {
		t.Fatal(err)
	}
	bufs, dest := c.dests(768)
	_, _, err = jobs.LoadPrefix(t.Context(), inRoot(noSync(), ns), &jobs.LoadPrefixRequest{
		Namespace: "ns", Identity: "tiny/bf16", Tokens: c.tokens, Dest: dest, PageTokens: 256,
	}, nil)
	if !errors.Is(err, jobs.ErrMismatch) {
		t.Fatalf("got %v, want ErrMismatch", err)
	}
	for _, want := range []string{page0, "tensor 0", "axis 1 (of 4) has 3 elements in the page, 2 in the destination"} {
		if !strings.Contains(err.Error(), want) {
			t.Fatalf("error %q does not say %q", err, want)
		}
	}
	c.checkDest(t, bufs, 768, 0)
}
