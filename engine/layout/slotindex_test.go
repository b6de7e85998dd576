package layout_test

import (
	"fmt"
	"testing"
	"time"

	"github.com/kvpersist/kvpersist/engine/layout"
)

// manySlots is a header of 100,000 slots: 60,000 caches of one tensor
// (the crafted shape that made naming quadratic), 10,000 caches of two
// tensors, and 10,000 attachments of two; with the names an independent
// nested walk gives each slot.
func manySlots() (*layout.Header, []string) {
	h := &layout.Header{FormatVersion: layout.FormatBlocks}
	var want []string
	add := func(kind string, group *[]layout.Entry, entries, tensors int) {
		for range entries {
			*group = append(*group, layout.Entry{Tensors: make([]layout.Tensor, tensors)})
			for t := range tensors {
				want = append(want, fmt.Sprintf("%s %d tensor %d (slot %d)", kind, len(*group)-1, t, len(want)))
			}
		}
	}
	add("cache", &h.Caches, 60_000, 1)
	add("cache", &h.Caches, 10_000, 2)
	add("attachment", &h.Attachments, 10_000, 2)
	return h, want
}

// TestSlotIndexNamesInConstantTime: SlotIndex.Name gives every slot of a
// 100,000-slot header the name Header.SlotName gives (spot-checked: SlotName
// over all of them is the quadratic cost this index removes) and an
// independent walk gives. Name costs O(1): after the index is built the
// header's entries are dropped, and every name is still right, so Name
// cannot be walking them.
func TestSlotIndexNamesInConstantTime(t *testing.T) {
	h, want := manySlots()
	if len(want) != 100_000 {
		t.Fatalf("%d slots", len(want))
	}
	x := h.SlotIndex()
	for _, i := range []int{0, 59_999, 60_000, 60_001, 79_999, 80_000, 99_999} {
		if got := h.SlotName(i); got != want[i] {
			t.Fatalf("SlotName(%d) = %q, want %q", i, got, want[i])
		}
	}
	h.Caches, h.Attachments = nil, nil
	for i, w := range want {
		if got := x.Name(i); got != w {
			t.Fatalf("Name(%d) = %q, want %q", i, got, w)
		}
	}
	for _, i := range []int{-1, 100_000} {
		if got := x.Name(i); got != fmt.Sprintf("slot %d", i) {
			t.Fatalf("Name(%d) = %q", i, got)
		}
	}
	if got := (&layout.Header{}).SlotIndex().Name(0); got != "slot 0" {
		t.Fatalf("empty header: %q", got)
	}
}

// BenchmarkSlotNames names every slot of the 100,000-slot header with one
// SlotIndex (what a write and a failed read do): the cost per slot is
// that of formatting one name, whatever the number of entries. x-limit is
// that cost over the floor measured in the same run: formatting the same
// names with fmt.Sprintf from known (entry, tensor) pairs, no lookup.
func BenchmarkSlotNames(b *testing.B) {
	h, want := manySlots()
	b.ReportAllocs()
	for b.Loop() {
		x := h.SlotIndex()
		for i := range want {
			_ = x.Name(i)
		}
	}
	perSlot := float64(b.Elapsed().Nanoseconds()) / float64(b.N*len(want))
	b.ReportMetric(perSlot, "ns/slot")
	start := time.Now()
	for range b.N {
		for i := range want {
			_ = fmt.Sprintf("cache %d tensor %d (slot %d)", i, 0, i)
		}
	}
	floor := float64(time.Since(start).Nanoseconds()) / float64(b.N*len(want))
	b.ReportMetric(perSlot/floor, "x-limit")
}
