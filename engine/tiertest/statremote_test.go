package tiertest

import (
	"bytes"
	"context"
	"errors"
	"os"
	"path/filepath"
	"reflect"
	"testing"

	"github.com/kvpersist/kvpersist/engine"
)

// TestStatRemoteThenRead: A writes a named snapshot in the Pages layout
// and uploads it. B, with an empty root and the same bucket, cannot Stat
// it (ErrNotFound) but StatRemote returns A's header without publishing
// anything; B allocates destinations from that header's tensor sizes and
// reads the name through the tier: the bytes equal the KV written. A
// name in neither tier is ErrNotFound, and a remote manifest that fails
// verification is ErrRemoteCorrupt.
func TestStatRemoteThenRead(t *testing.T) {
	ctx := context.Background()
	prefix := bucketPrefix(t)
	rootA, rootB := t.TempDir(), t.TempDir()
	conv := seq(25000, 3*ptoks+5)
	ref := engine.Ref{Namespace: ns, Name: "conv-stat"}
	a := newEngine(t, rootA, prefix, newRecorder(t), nil)
	writePages(t, a, ref.Name, conv)
	want, err := a.Stat(ref)
	if err != nil {
		t.Fatalf("Stat on A: %v", err)
	}
	if got, err := a.StatRemote(ctx, ref); err != nil || !reflect.DeepEqual(got.Header, want.Header) {
		t.Fatalf("StatRemote on A (local name): %v; want Stat's header", err)
	}
	closeEngine(t, a) // the uploads finish

	b := newEngine(t, rootB, prefix, newRecorder(t), nil)
	if _, err := b.Stat(ref); !errors.Is(err, engine.ErrNotFound) {
		t.Fatalf("Stat on B: %v; want ErrNotFound", err)
	}
	snap, err := b.StatRemote(ctx, ref)
	if err != nil {
		t.Fatalf("StatRemote on B: %v", err)
	}
	if !reflect.DeepEqual(snap.Header, want.Header) || !bytes.Equal(snap.JSON, want.JSON) || !reflect.DeepEqual(snap.Pages, want.Pages) {
		t.Fatalf("StatRemote header %+v; want A's %+v", snap.Header, want.Header)
	}
	if _, err := os.Lstat(filepath.Join(rootB, ns, ref.Name)); !os.IsNotExist(err) {
		t.Fatalf("StatRemote published the manifest (lstat: %v)", err)
	}
	var dest [][]byte
	for _, s := range snap.Header.Slots() {
		dest = append(dest, make([]byte, s.Bytes))
	}
	res := b.Do(ctx, &engine.ReadRequest{Ref: ref, Dest: dest})
	if res.Err != nil {
		t.Fatalf("read on B: %v (remote %+v)", res.Err, res.Remote)
	}
	checkNamed(t, dest, conv)
	if got, err := b.Stat(ref); err != nil || !reflect.DeepEqual(got.Header, want.Header) {
		t.Fatalf("Stat on B after the read: %v; want A's header, published", err)
	}

	if _, err := b.StatRemote(ctx, engine.Ref{Namespace: ns, Name: "conv-none"}); !errors.Is(err, engine.ErrNotFound) {
		t.Fatalf("StatRemote of a name in neither tier: %v; want ErrNotFound", err)
	}

	st := openStore(t, prefix)
	name, _ := st.ManifestName(ns, "conv-bad")
	bad := bytes.Clone(readFile(t, filepath.Join(rootA, ns, ref.Name)))
	bad[40] ^= 0x40 // in the header JSON
	putObject(t, st, name, bad)
	if _, err := b.StatRemote(ctx, engine.Ref{Namespace: ns, Name: "conv-bad"}); !errors.Is(err, engine.ErrRemoteCorrupt) || errors.Is(err, engine.ErrNotFound) {
		t.Fatalf("StatRemote of a corrupt remote manifest: %v; want ErrRemoteCorrupt", err)
	}

	plain, err := engine.New(engine.Config{Root: rootA, NoSync: true})
	if err != nil {
		t.Fatal(err)
	}
	defer plain.Close(ctx)
	if got, err := plain.StatRemote(ctx, ref); err != nil || !reflect.DeepEqual(got.Header, want.Header) {
		t.Fatalf("StatRemote without a tier: %v; want Stat's header", err)
	}
	if _, err := plain.StatRemote(ctx, engine.Ref{Namespace: ns, Name: "conv-none"}); !errors.Is(err, engine.ErrNotFound) {
		t.Fatalf("StatRemote without a tier, missing name: %v; want ErrNotFound", err)
	}
}
