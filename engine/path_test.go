package engine_test

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/kvpersist/kvpersist/engine"
	"github.com/kvpersist/kvpersist/engine/jobs"
	"github.com/kvpersist/kvpersist/engine/layout"
	"github.com/kvpersist/kvpersist/internal/kvgen"
)

// hostileRefs are names that would leave the store root, or are not one
// plain path element, or could be taken for the engine's own files.
var hostileRefs = []engine.Ref{
	{Namespace: "..", Name: "x"},
	{Namespace: ".", Name: "x"},
	{Namespace: "../ns", Name: "x"},
	{Namespace: "ns/..", Name: "x"},
	{Namespace: "/etc", Name: "passwd"},
	{Namespace: "", Name: "x"},
	{Namespace: "ns", Name: ".."},
	{Namespace: "ns", Name: "."},
	{Namespace: "ns", Name: "../x"},
	{Namespace: "ns", Name: "../../x"},
	{Namespace: "ns", Name: "/etc/passwd"},
	{Namespace: "ns", Name: "a/b"},
	{Namespace: "ns", Name: `a\b`},
	{Namespace: "ns", Name: ""},
	{Namespace: "ns", Name: "blocks"},                  // the namespace's block store
	{Namespace: "ns", Name: ".lock"},                   // the namespace's lock file
	{Namespace: "ns", Name: ".x.tmp-0123456789abcdef"}, // a temp file
	{Namespace: "ns", Name: "-rf"},
	{Namespace: "ns", Name: "x\x00y"},
	{Namespace: "ns", Name: "x\n"},
	{Namespace: "ns", Name: "ü"},
	{Namespace: "ns", Name: strings.Repeat("a", 201)},
	{Namespace: strings.Repeat("n", 201), Name: "x"},
}

func newPathEngine(t *testing.T, root string) *engine.Engine {
	t.Helper()
	e, err := engine.New(engine.Config{Root: root, NoSync: true, Workers: 2, Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := e.Close(context.Background()); err != nil {
			t.Errorf("Close: %v", err)
		}
	})
	return e
}

// TestPathRejectsEscapes: every hostile name is refused by engine.Path
// (ErrPath wrapping layout.ErrBadName), by Stat, and at
// Submit for writes and reads, before anything is created.
func TestPathRejectsEscapes(t *testing.T) {
	root := filepath.Join(t.TempDir(), "store")
	e := newPathEngine(t, root)
	c := kvgen.NewCache(kvgen.Tiny, 8, true, nil)
	views := c.Views()
	for _, ref := range hostileRefs {
		if p, err := e.Path(ref); !errors.Is(err, engine.ErrPath) || !errors.Is(err, layout.ErrBadName) {
			t.Errorf("Path(%q) = %q, %v; want ErrPath wrapping ErrBadName", ref, p, err)
		}
		if _, err := e.Stat(ref); !errors.Is(err, engine.ErrPath) {
			t.Errorf("Stat(%q): %v, want ErrPath", ref, err)
		}
		w := &engine.WriteRequest{Ref: ref, Layout: layout.Blocks,
			Caches: []jobs.EntrySpec{{Tensors: []jobs.TensorSpec{{DType: c.DTypes()[0], View: views[0]}}}}}
		if _, err := e.Submit(context.Background(), w); !errors.Is(err, engine.ErrPath) {
			t.Errorf("Submit write %q: %v, want ErrPath", ref, err)
		}
		r := &engine.ReadRequest{Ref: ref, Dest: [][]byte{make([]byte, 16)}}
		if _, err := e.Submit(context.Background(), r); !errors.Is(err, engine.ErrPath) {
			t.Errorf("Submit read %q: %v, want ErrPath", ref, err)
		}
	}
	// Nothing was created: the root holds nothing, and nothing appeared
	// beside it.
	if ents, err := os.ReadDir(root); err != nil || len(ents) != 0 {
		t.Fatalf("root holds %v (%v) after rejected requests", ents, err)
	}
	if ents, err := os.ReadDir(filepath.Dir(root)); err != nil || len(ents) != 1 {
		t.Fatalf("the root's parent holds %v (%v)", ents, err)
	}
	// A collect of a hostile namespace is refused too.
	for _, ns := range []string{"..", "/etc", "a/b", ""} {
		if _, err := e.Submit(context.Background(), &engine.CollectRequest{Namespaces: []string{ns}}); !errors.Is(err, engine.ErrPath) {
			t.Errorf("collect of namespace %q: %v, want ErrPath", ns, err)
		}
	}
}

// TestPathAcceptsPlainNames: valid names resolve to root/namespace/name,
// inside the root.
func TestPathAcceptsPlainNames(t *testing.T) {
	root := t.TempDir()
	e := newPathEngine(t, root)
	for _, ref := range []engine.Ref{
		{Namespace: "ns", Name: "x"},
		{Namespace: "conv-42", Name: "turn-7.v2"},
		{Namespace: "A_b.c", Name: "_..x"},
		{Namespace: "n", Name: strings.Repeat("a", 200)},
	} {
		p, err := e.Path(ref)
		if err != nil {
			t.Fatalf("Path(%v): %v", ref, err)
		}
		rel, err := filepath.Rel(root, p)
		if err != nil || rel != filepath.Join(ref.Namespace, ref.Name) || strings.HasPrefix(rel, "..") {
			t.Fatalf("Path(%v) = %s (relative %q)", ref, p, rel)
		}
	}
}

// TestPathRefusesSymlinkedNamespace: a namespace directory that is a
// symlink (which could point anywhere) or not a directory is refused at
// Path, Stat and Submit; nothing is written through the link, and the file
// it leads to is not read.
func TestPathRefusesSymlinkedNamespace(t *testing.T) {
	root := t.TempDir()
	e := newPathEngine(t, root)
	c := kvgen.NewCache(kvgen.Tiny, 8, true, nil)
	views, dtypes := c.Views(), c.DTypes()
	// A real snapshot outside the store, reachable through the link.
	outside := t.TempDir()
	h, _, err := jobs.Write(context.Background(), &jobs.Config{Root: filepath.Dir(outside), NoSync: true}, &jobs.WriteRequest{
		Ref: jobs.Ref{Namespace: filepath.Base(outside), Name: "x"}, Layout: layout.Single,
		Caches: []jobs.EntrySpec{{Tensors: []jobs.TensorSpec{{DType: dtypes[0], View: views[0]}}}},
	})
	if err != nil {
		t.Fatal(err)
	}
	before := listTree(t, outside)
	if err := os.Symlink(outside, filepath.Join(root, "evil")); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(root, "file"), []byte("not a directory"), 0o640); err != nil {
		t.Fatal(err)
	}
	for _, ns := range []string{"evil", "file"} {
		ref := engine.Ref{Namespace: ns, Name: "x"}
		if _, err := e.Path(ref); !errors.Is(err, engine.ErrPath) {
			t.Fatalf("Path(%v): %v, want ErrPath", ref, err)
		}
		if _, err := e.Stat(ref); !errors.Is(err, engine.ErrPath) {
			t.Fatalf("Stat(%v): %v, want ErrPath", ref, err)
		}
		for _, lay := range []layout.Layout{layout.Single, layout.Blocks} {
			w := &engine.WriteRequest{Ref: ref, Layout: lay,
				Caches: []jobs.EntrySpec{{Tensors: []jobs.TensorSpec{{DType: dtypes[0], View: views[0]}}}}}
			if res := e.Do(context.Background(), w); !errors.Is(res.Err, engine.ErrPath) {
				t.Fatalf("write %v: %v, want ErrPath", ref, res.Err)
			}
		}
		dest := make([]byte, h.Slots()[0].Bytes)
		if res := e.Do(context.Background(), &engine.ReadRequest{Ref: ref, Dest: [][]byte{dest}}); !errors.Is(res.Err, engine.ErrPath) {
			t.Fatalf("read %v: %v, want ErrPath", ref, res.Err)
		}
		for _, b := range dest {
			if b != 0 {
				t.Fatal("the read through the link filled the destination")
			}
		}
	}
	if after := listTree(t, outside); strings.Join(after, "\n") != strings.Join(before, "\n") {
		t.Fatalf("the link's target changed:\nbefore %v\nafter  %v", before, after)
	}
}

// listTree lists every path under dir with its mode, size and mtime.
func listTree(t *testing.T, dir string) []string {
	t.Helper()
	var out []string
	err := filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		info, err := d.Info()
		if err != nil {
			return err
		}
		out = append(out, fmt.Sprintf("%s %v %d %d", p, info.Mode(), info.Size(), info.ModTime().UnixNano()))
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return out
}

// TestStatOfAFIFONamedLikeASnapshotReturns: a FIFO under a snapshot's name
// is opened without blocking (O_NONBLOCK) and refused as not a regular
// file; Stat (and a read, which would hold the namespace's shared lock)
// cannot hang in open(2) waiting for a writer.
func TestStatOfAFIFONamedLikeASnapshotReturns(t *testing.T) {
	root := t.TempDir()
	if err := os.MkdirAll(filepath.Join(root, "ns"), 0o750); err != nil {
		t.Fatal(err)
	}
	fifo := filepath.Join(root, "ns", "snap")
	if err := syscall.Mkfifo(fifo, 0o640); err != nil {
		t.Skip(err)
	}
	e, err := engine.New(engine.Config{Root: root, NoSync: true, Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close(context.Background())
	done := make(chan error, 1)
	go func() { _, err := e.Stat(engine.Ref{Namespace: "ns", Name: "snap"}); done <- err }()
	select {
	case err := <-done:
		t.Logf("Stat: %v", err)
	case <-time.After(time.Minute): // a hang detector: a correct Stat returns in microseconds
		w, _ := os.OpenFile(fifo, os.O_WRONLY, 0) // unblock it
		<-done
		w.Close()
		t.Fatalf("Stat of a FIFO named like a snapshot blocked in open(2) for a minute")
	}
}
