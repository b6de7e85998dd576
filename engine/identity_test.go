package engine

import (
	"bytes"
	"errors"
	"testing"

	"github.com/kvpersist/kvpersist/engine/jobs"
	"github.com/kvpersist/kvpersist/engine/layout"
	"github.com/kvpersist/kvpersist/internal/kvgen"
)

// Identity on every layout: a write may carry it; a read naming another
// (or naming one when the snapshot has none) fails with ErrMismatch before
// any destination byte is written.
func TestIdentityOnEveryLayout(t *testing.T) {
	e := newEngine(t, Config{Workers: 2, BlockBytes: 4096})
	m := kvgen.Tiny
	const T = 64
	c, want := cacheOf(m, T, true)
	for _, lay := range []layout.Layout{layout.Single, layout.Blocks} {
		ref := refOf("id", "snap-"+lay.String())
		req := writeReq(ref, c, lay, 0)
		req.Identity = "tiny/bf16/tp0"
		w := mustDo(t, e, req)
		if id, ok := w.Header.Identity(); !ok || id != "tiny/bf16/tp0" {
			t.Fatalf("%s: header identity %q %v", lay, id, ok)
		}
		snap, err := e.Stat(ref)
		if err != nil {
			t.Fatal(err)
		}
		if id, ok := snap.Header.Identity(); !ok || id != "tiny/bf16/tp0" {
			t.Fatalf("%s: stored identity %q %v", lay, id, ok)
		}
		for _, id := range []string{"", "tiny/bf16/tp0"} {
			dest := destOf(m, T)
			r := e.Do(bg, &ReadRequest{Ref: ref, Dest: dest, Identity: id})
			if r.Err != nil {
				t.Fatalf("%s: read naming %q: %v", lay, id, r.Err)
			}
			equalSlots(t, lay.String(), dest, want)
		}
		dest := destOf(m, T)
		for i := range dest {
			for k := range dest[i] {
				dest[i][k] = 0x77
			}
		}
		r := e.Do(bg, &ReadRequest{Ref: ref, Dest: dest, Identity: "tiny/bf16/tp1"})
		if !errors.Is(r.Err, jobs.ErrMismatch) {
			t.Fatalf("%s: read naming another identity: %v", lay, r.Err)
		}
		for i := range dest {
			if !bytes.Equal(dest[i], bytes.Repeat([]byte{0x77}, len(dest[i]))) {
				t.Fatalf("%s: a refused read wrote slot %d", lay, i)
			}
		}
	}
	// A snapshot written without an identity: a read naming one fails.
	mustDo(t, e, writeReq(refOf("id", "none"), c, layout.Single, 0))
	if r := e.Do(bg, &ReadRequest{Ref: refOf("id", "none"), Dest: destOf(m, T), Identity: "x"}); !errors.Is(r.Err, jobs.ErrMismatch) {
		t.Fatalf("read naming an identity of a snapshot without one: %v", r.Err)
	}
	// Metadata that already has the key conflicts with an identity.
	req := writeReq(refOf("id", "conflict"), c, layout.Single, 0)
	req.Meta = layout.Meta{"identity": []byte(`"a"`)}
	req.Identity = "b"
	if r := e.Do(bg, req); !errors.Is(r.Err, jobs.ErrInvalidRequest) {
		t.Fatalf("conflicting identity: %v", r.Err)
	}
}
