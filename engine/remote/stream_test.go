package remote_test

import (
	"bytes"
	"errors"
	"os"
	"path/filepath"
	"testing"

	"github.com/kvpersist/kvpersist/engine/remote"
	"github.com/kvpersist/kvpersist/internal/testutil"
)

// wbuf is an in-memory write destination of a fixed size.
type wbuf []byte

func (w wbuf) WriteAt(p []byte, off int64) (int, error) { return copy(w[off:], p), nil }

// storedPages returns the key and bytes of a page file of PageManifests,
// and the bytes of another page.
func storedPages(t *testing.T) (key string, page, other []byte) {
	t.Helper()
	root := t.TempDir()
	keys := testutil.PageManifests(t, root, "ns")["turn-1"]
	read := func(k string) []byte {
		b, err := os.ReadFile(filepath.Join(root, "ns", "pages", k[:2], k))
		if err != nil {
			t.Fatal(err)
		}
		return b
	}
	return keys[1], read(keys[1]), read(keys[2])
}

// stream writes obj through a PageStream for key in chunks of the given
// sizes (cycled), in order, and returns it with the destination.
func stream(key string, obj []byte, size int64, chunks ...int) (*remote.PageStream, wbuf) {
	dst := make(wbuf, max(size, int64(len(obj))))
	s := remote.NewPageStream(dst, key, size)
	for off, i := 0, 0; off < len(obj); i++ {
		n := min(chunks[i%len(chunks)], len(obj)-off)
		if _, err := s.WriteAt(obj[off:off+n], int64(off)); err != nil {
			panic(err)
		}
		off += n
	}
	return s, dst
}

// TestPageStreamVerifiesInOrderBytes: a page whose bytes pass in order,
// in chunks of any size (1 byte, splits inside the prefix, the header and
// at tensor boundaries, one write of the whole object), is proved by the
// stream alone, exactly when VerifyPage accepts it from a read-back; the
// destination receives every byte unchanged.
func TestPageStreamVerifiesInOrderBytes(t *testing.T) {
	key, page, _ := storedPages(t)
	if err := remote.VerifyPage(key, nil)(bytes.NewReader(page), int64(len(page))); err != nil {
		t.Fatalf("the stored page does not verify by read-back: %v", err)
	}
	for _, chunks := range [][]int{{1}, {7, 4093}, {len(page)}, {25, 1 << 10, 3}, {256 << 10}} {
		s, dst := stream(key, page, int64(len(page)), chunks...)
		snap, ok := s.Verified()
		if !ok || snap == nil || snap.Page == nil || snap.Page.Key.String() != key {
			t.Fatalf("chunks %v: Verified = %v, %v; want the page of key %s", chunks, snap, ok, key)
		}
		if !bytes.Equal(dst, page) {
			t.Fatalf("chunks %v: the destination differs from the object", chunks)
		}
	}
}

// TestPageStreamRefusesWhatReadBackRefuses: every damage VerifyPage finds
// from a read-back leaves the stream unproved (Verified false, so the
// caller verifies by reading back and reports ErrCorrupt): a flipped
// tensor byte, a flipped header byte, a truncated or a long object,
// another page's bytes under the key; and so do bytes that did not pass
// in order (two ranges written concurrently, a range written again) even
// when the page is whole, since the stream did not see them once in order.
func TestPageStreamRefusesWhatReadBackRefuses(t *testing.T) {
	key, page, other := storedPages(t)
	flip := func(at int) []byte { q := bytes.Clone(page); q[at] ^= 0x10; return q }
	for _, tc := range []struct {
		name string
		obj  []byte
	}{
		{"flipped-tensor-byte", flip(len(page) - 100)},
		{"flipped-header-byte", flip(40)},
		{"truncated", page[:len(page)-4096]},
		{"long", append(bytes.Clone(page), 0)},
		{"other-page", other},
	} {
		if err := remote.VerifyPage(key, nil)(bytes.NewReader(tc.obj), int64(len(tc.obj))); err == nil {
			t.Fatalf("%s: VerifyPage accepts it", tc.name)
		}
		for _, chunks := range [][]int{{1 << 10}, {len(tc.obj)}} {
			if s, _ := stream(key, tc.obj, int64(len(tc.obj)), chunks...); func() bool { _, ok := s.Verified(); return ok }() {
				t.Fatalf("%s, chunks %v: the stream proves a damaged page", tc.name, chunks)
			}
		}
	}
	// The object is shorter than the size its HEAD said (a body cut
	// short): not proved.
	if s, _ := stream(key, page[:len(page)-1], int64(len(page)), 4096); func() bool { _, ok := s.Verified(); return ok }() {
		t.Fatal("a short stream is proved")
	}

	// Out of order: the second half first, then the first.
	half := len(page) / 2
	dst := make(wbuf, len(page))
	s := remote.NewPageStream(dst, key, int64(len(page)))
	s.WriteAt(page[half:], int64(half))
	s.WriteAt(page[:half], 0)
	if _, ok := s.Verified(); ok || !bytes.Equal(dst, page) {
		t.Fatalf("out-of-order writes: proved %v, destination equal %v; want not proved, equal", ok, bytes.Equal(dst, page))
	}
	// A range retried from its start after part of its body.
	dst = make(wbuf, len(page))
	s = remote.NewPageStream(dst, key, int64(len(page)))
	s.WriteAt(page[:1000], 0)
	s.WriteAt(page, 0)
	if _, ok := s.Verified(); ok {
		t.Fatal("a range written twice is proved by the stream")
	}
}

// failWriter fails every write.
type failWriter struct{}

var errDisk = errors.New("disk full")

func (failWriter) WriteAt([]byte, int64) (int, error) { return 0, errDisk }

// TestPageStreamWriteErrorIsReturned: a destination's write error is
// returned as is and the stream proves nothing.
func TestPageStreamWriteErrorIsReturned(t *testing.T) {
	key, page, _ := storedPages(t)
	s := remote.NewPageStream(failWriter{}, key, int64(len(page)))
	if _, err := s.WriteAt(page, 0); !errors.Is(err, errDisk) {
		t.Fatalf("WriteAt: %v, want the destination's error", err)
	}
	if _, ok := s.Verified(); ok {
		t.Fatal("proved a page whose write failed")
	}
}
