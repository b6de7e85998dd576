package testutil

import (
	"bytes"
	"context"
	"os"

	"github.com/kvpersist/kvpersist/engine/remote"
	"github.com/kvpersist/kvpersist/engine/store"
)

// UploadNamespace copies namespace ns of the local store at root to s as
// the engine's write-behind lays it out (ARCHITECTURE.md, "Remote tier"):
// every page file (pages first), then every page manifest, each object's
// bytes exactly the local file's, create-only. It returns object name ->
// bytes uploaded. Other snapshot files are not uploaded.
func UploadNamespace(tb TB, s *remote.Store, root, ns string) map[string][]byte {
	tb.Helper()
	st, err := store.Open(root, store.Options{})
	if err != nil {
		tb.Fatal(err)
	}
	n, err := st.Namespace(ns)
	if err != nil {
		tb.Fatal(err)
	}
	l, err := n.List(true)
	if err != nil {
		tb.Fatal(err)
	}
	out := map[string][]byte{}
	put := func(name, path string) {
		b, err := os.ReadFile(path)
		if err != nil {
			tb.Fatal(err)
		}
		if _, err := s.Put(context.Background(), name, bytes.NewReader(b), int64(len(b))); err != nil {
			tb.Fatal(err)
		}
		out[name] = b
	}
	for _, p := range l.Pages {
		name, err := s.PageName(ns, p.Key)
		if err != nil {
			tb.Fatal(err)
		}
		put(name, p.Path)
	}
	for _, sn := range l.Snapshots {
		if sn.Snap == nil || sn.Snap.Pages == nil {
			continue
		}
		name, err := s.ManifestName(ns, sn.Name)
		if err != nil {
			tb.Fatal(err)
		}
		put(name, sn.Path)
	}
	return out
}

// ObjectNames lists the names of the objects of namespace ns of s.
func ObjectNames(tb TB, s *remote.Store, ns string) []string {
	tb.Helper()
	l, err := s.List(context.Background(), ns)
	if err != nil {
		tb.Fatal(err)
	}
	var out []string
	for _, o := range l {
		out = append(out, o.Name)
	}
	return out
}
