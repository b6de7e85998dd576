package testutil

import (
	"bytes"
	"context"
	"io"
	"os"

	"github.com/minio/minio-go/v7"

	"github.com/kvpersist/kvpersist/engine/jobs"
	"github.com/kvpersist/kvpersist/engine/layout"
	"github.com/kvpersist/kvpersist/engine/remote"
	"github.com/kvpersist/kvpersist/engine/store"
	"github.com/kvpersist/kvpersist/internal/kvgen"
)

// PageManifests writes into the store at root namespace ns holding two
// page manifests of the tiny model at 64 tokens per page: "turn-1" (300
// tokens: 4 full pages and a leaf of 44) and "turn-2" (200 tokens of the
// same ids: its 3 full pages are turn-1's, then its own leaf of 8), so
// 6 distinct page files. It returns each manifest's page keys computed
// with layout.PageChain from the token ids (independently of the write).
func PageManifests(tb TB, root, ns string) map[string][]string {
	tb.Helper()
	const identity, pageTokens = "tiny", 64
	toks := make([]uint32, 300)
	for i := range toks {
		toks[i] = uint32(1000 + 7*i)
	}
	keys := map[string][]string{}
	for _, m := range []struct {
		name   string
		tokens int
	}{{"turn-1", 300}, {"turn-2", 200}} {
		c := kvgen.NewCache(kvgen.Tiny, m.tokens, true, nil)
		caches, atts, meta := kvgen.CacheRequest(c, m.tokens)
		req := &jobs.WriteRequest{Ref: jobs.Ref{Namespace: ns, Name: m.name}, Layout: layout.Pages, Meta: meta,
			Caches: caches, Attachments: atts, Identity: identity, Tokens: toks[:m.tokens], PageTokens: pageTokens}
		if _, _, err := jobs.Write(context.Background(), &jobs.Config{Root: root, NoSync: true}, req); err != nil {
			tb.Fatal(err)
		}
		ks, _, err := layout.PageChain(identity, pageTokens, toks[:m.tokens])
		if err != nil {
			tb.Fatal(err)
		}
		for _, k := range ks {
			keys[m.name] = append(keys[m.name], k.String())
		}
	}
	return keys
}

// UploadNamespace copies namespace ns of the local store at root to s as
// the engine's write-behind lays it out (docs/format/bucket-layout.md):
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

// ObjectBytes reads object name of s whole, with a plain GET of the
// client (no verification).
func ObjectBytes(tb TB, s *remote.Store, name string) []byte {
	tb.Helper()
	o, err := s.Client().GetObject(context.Background(), s.Bucket(), name, minio.GetObjectOptions{})
	if err != nil {
		tb.Fatal(err)
	}
	defer o.Close()
	b, err := io.ReadAll(o)
	if err != nil {
		tb.Fatal(err)
	}
	return b
}
