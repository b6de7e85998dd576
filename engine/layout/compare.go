package layout

import (
	"bytes"
	"encoding/json"
	"fmt"
	"slices"
)

// SameBoundaries reports whether two headers cut every tensor into blocks
// of the same sizes.
func SameBoundaries(a, b *Header) bool {
	as, bs := a.Slots(), b.Slots()
	if len(as) != len(bs) {
		return false
	}
	for i := range as {
		if len(as[i].Blocks) != len(bs[i].Blocks) {
			return false
		}
		for k := range as[i].Blocks {
			if as[i].Blocks[k].Bytes != bs[i].Blocks[k].Bytes {
				return false
			}
		}
	}
	return true
}

// DiffHeaders compares header b with header a: metadata at every level
// (MetaEqual), the entries, and each tensor's dtype, shape, bytes and, with
// sameBlocks, block list (SameBlocks: names and sizes). It returns ""
// when they match, else what differs (naming b's value first, a's second).
func DiffHeaders(a, b *Header, sameBlocks bool) string {
	if !MetaEqual(a.Meta, b.Meta) {
		return "top-level metadata differs"
	}
	for _, g := range []struct {
		what string
		a, b []Entry
	}{{"caches", a.Caches, b.Caches}, {"attachments", a.Attachments, b.Attachments}} {
		if len(g.a) != len(g.b) {
			return fmt.Sprintf("%d %s, the other has %d", len(g.b), g.what, len(g.a))
		}
		for i := range g.a {
			ea, eb := g.a[i], g.b[i]
			if !MetaEqual(ea.Meta, eb.Meta) {
				return fmt.Sprintf("%s[%d] metadata differs", g.what, i)
			}
			if len(ea.Tensors) != len(eb.Tensors) {
				return fmt.Sprintf("%s[%d] has %d tensors, the other %d", g.what, i, len(eb.Tensors), len(ea.Tensors))
			}
			for j := range ea.Tensors {
				ta, tb := &ea.Tensors[j], &eb.Tensors[j]
				if ta.DType != tb.DType || ta.Bytes != tb.Bytes || !slices.Equal(ta.Shape, tb.Shape) || !MetaEqual(ta.Meta, tb.Meta) {
					return fmt.Sprintf("%s[%d] tensor %d is %s%v, the other %s%v", g.what, i, j, tb.DType, tb.Shape, ta.DType, ta.Shape)
				}
				if sameBlocks && !SameBlocks(ta.Blocks, tb.Blocks) {
					return fmt.Sprintf("%s[%d] tensor %d names other blocks than the other", g.what, i, j)
				}
			}
		}
	}
	return ""
}

// MetaEqual compares metadata by key and compacted JSON value; nil and
// empty are equal.
func MetaEqual(a, b Meta) bool {
	if len(a) != len(b) {
		return false
	}
	for k, va := range a {
		vb, ok := b[k]
		if !ok {
			return false
		}
		var ca, cb bytes.Buffer
		if json.Compact(&ca, va) != nil || json.Compact(&cb, vb) != nil {
			if !bytes.Equal(va, vb) {
				return false
			}
			continue
		}
		if !bytes.Equal(ca.Bytes(), cb.Bytes()) {
			return false
		}
	}
	return true
}
