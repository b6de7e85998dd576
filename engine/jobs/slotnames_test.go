package jobs_test

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"testing"

	"github.com/kvpersist/kvpersist/engine/gather"
	"github.com/kvpersist/kvpersist/engine/jobs"
	"github.com/kvpersist/kvpersist/engine/layout"
	"github.com/kvpersist/kvpersist/internal/testutil"
)

// TestReadNamesEveryFailedSlotOfAHugeManifest: the crafted manifest of the
// review (many one-byte tensors, all deduplicated into one block, that
// block corrupt) fails a verified read with one SlotError per slot, each
// named as its slot is ("cache i tensor 0 (slot i)"). The write names every
// slot and the read every failed slot through one layout.SlotIndex (O(1) a
// name; layout's TestSlotIndexNamesInConstantTime shows it), where
// Header.SlotName per slot was quadratic in the slot count.
func TestReadNamesEveryFailedSlotOfAHugeManifest(t *testing.T) {
	const slots = 4_000
	ns := filepath.Join(t.TempDir(), "ns")
	path := filepath.Join(ns, "huge")
	byteOf := []byte{0x5a}
	req := &jobs.WriteRequest{Layout: layout.Blocks, BlockBytes: 4096}
	for range slots {
		req.Caches = append(req.Caches, jobs.EntrySpec{Tensors: []jobs.TensorSpec{{DType: "uint8",
			View: gather.View{Base: byteOf, Shape: []int{1}, Strides: []int{1}, ItemSize: 1}}}})
	}
	h, _ := mustWrite(t, noSync(), &wreq{path, req})
	blocks := blockSet(h)
	if len(blocks) != 1 {
		t.Fatalf("%d distinct blocks, want 1 (every tensor is the byte 0x5a)", len(blocks))
	}
	for hash := range blocks {
		if err := os.WriteFile(testutil.BlockPath(ns, hash), []byte{0x5b}, 0o640); err != nil {
			t.Fatal(err)
		}
	}
	dest := make([][]byte, slots)
	for i := range dest {
		dest[i] = make([]byte, 1)
	}
	_, _, err := readAt(context.Background(), noSync(), path, &jobs.ReadRequest{Dest: dest})
	var re *jobs.ReadError
	if !errors.Is(err, jobs.ErrCorrupt) || !errors.As(err, &re) || len(re.Slots) != slots {
		t.Fatalf("read: %v, want a ReadError (ErrCorrupt) for all %d slots", err, slots)
	}
	for i, se := range re.Slots {
		if want := fmt.Sprintf("cache %d tensor 0 (slot %d)", i, i); se.Slot != i || se.Name != want {
			t.Fatalf("failure %d: slot %d named %q, want slot %d named %q", i, se.Slot, se.Name, i, want)
		}
	}
}
