// Package pageindex is the prefix cache's in-memory index: per namespace,
// the set of page keys stored on disk. It answers "how many tokens of this
// prompt are stored?" without touching the disk: the keys of the prompt's
// pages are derived from its token ids (layout.PageChain) and looked up in
// chain order until one is absent.
//
// The index is a cache of the disk, not its authority: it is built from
// the disk when the engine starts (Build) and kept current by the engine's
// own saves (Add) and removals (Remove). A page removed behind its back (by
// another process) is found missing when it is loaded; a load is never
// failed by it (jobs.LoadPrefix reports a miss, and the engine then removes
// the key).
package pageindex

import (
	"encoding/hex"
	"fmt"
	"path/filepath"
	"sync"

	"github.com/kvpersist/kvpersist/engine/layout"
	"github.com/kvpersist/kvpersist/engine/vfs"
)

// Index holds the stored page keys of each namespace. It is safe for
// concurrent use; lookups share a read lock.
type Index struct {
	mu sync.RWMutex
	ns map[string]map[layout.PageKey]struct{}
}

// New returns an empty index.
func New() *Index { return &Index{ns: map[string]map[layout.PageKey]struct{}{}} }

// Add records keys as stored in namespace ns.
func (x *Index) Add(ns string, keys ...layout.PageKey) {
	if len(keys) == 0 {
		return
	}
	x.mu.Lock()
	defer x.mu.Unlock()
	set := x.ns[ns]
	if set == nil {
		set = make(map[layout.PageKey]struct{}, len(keys))
		x.ns[ns] = set
	}
	for _, k := range keys {
		set[k] = struct{}{}
	}
}

// Remove forgets keys of namespace ns (absent keys are ignored).
func (x *Index) Remove(ns string, keys ...layout.PageKey) {
	x.mu.Lock()
	defer x.mu.Unlock()
	set := x.ns[ns]
	for _, k := range keys {
		delete(set, k)
	}
	if set != nil && len(set) == 0 {
		delete(x.ns, ns)
	}
}

// Has reports whether key is recorded in namespace ns.
func (x *Index) Has(ns string, key layout.PageKey) bool {
	x.mu.RLock()
	defer x.mu.RUnlock()
	_, ok := x.ns[ns][key]
	return ok
}

// Len returns the number of keys recorded in namespace ns.
func (x *Index) Len(ns string) int {
	x.mu.RLock()
	defer x.mu.RUnlock()
	return len(x.ns[ns])
}

// Lookup returns the length, in tokens, of the longest prefix of tokens
// whose pages are recorded in namespace ns for identity and pageTokens (P):
// the full pages in chain order up to the first absent one, then, when
// every full page is present and len(tokens) is not a multiple of P, the
// leaf over the remaining tokens if it is recorded (a leaf is used only
// when it covers exactly the prompt's remaining tokens). So the result is
// a multiple of P, or len(tokens).
//
// Errors: layout.ErrIdentity, layout.ErrPageTokens. Lookup does not
// allocate; it hashes 32+4P bytes per page it examines (SHA-256).
func (x *Index) Lookup(ns, identity string, pageTokens int, tokens []uint32) (int, error) {
	if err := layout.CheckIdentity(identity); err != nil {
		return 0, err
	}
	if err := layout.CheckPageTokens(pageTokens); err != nil {
		return 0, err
	}
	x.mu.RLock()
	defer x.mu.RUnlock()
	set := x.ns[ns]
	if len(set) == 0 {
		return 0, nil
	}
	k := layout.PageRoot(identity, pageTokens)
	full := len(tokens) / pageTokens
	for i := range full {
		k = layout.PageNext(k, tokens[i*pageTokens:(i+1)*pageTokens])
		if _, ok := set[k]; !ok {
			return i * pageTokens, nil
		}
	}
	if rest := tokens[full*pageTokens:]; len(rest) > 0 {
		if _, ok := set[layout.PageNext(k, rest)]; ok {
			return len(tokens), nil
		}
	}
	return full * pageTokens, nil
}

// BuildStats reports what Build found.
type BuildStats struct {
	Namespaces int // namespaces with a pages/ directory
	Pages      int // page files recorded
	// Skipped lists entries under pages/ that are not page files by name
	// (temp files excepted): never recorded.
	Skipped []string
}

// Build scans every namespace under root (directories with a valid name,
// not symlinks) and records each page file it finds, by name:
// <ns>/pages/<2 hex>/<64 hex> whose first two digits are its directory's.
// It reads directory entries only (no file is opened): a torn or corrupt
// page is recorded and found out when loaded. Temp files are ignored.
func Build(fsys vfs.FS, root string) (*Index, BuildStats, error) {
	x := New()
	var st BuildStats
	ents, err := fsys.ReadDir(root)
	if err != nil {
		if vfs.IsNotExist(err) {
			return x, st, nil
		}
		return nil, st, fmt.Errorf("pageindex: %w", err)
	}
	for _, e := range ents {
		if !e.IsDir() || layout.ValidName("namespace", e.Name()) != nil {
			continue
		}
		n, err := x.scanNamespace(fsys, filepath.Join(root, e.Name()), e.Name(), &st)
		if err != nil {
			return nil, st, err
		}
		if n >= 0 {
			st.Namespaces++
			st.Pages += n
		}
	}
	return x, st, nil
}

// scanNamespace records the pages of one namespace; -1 when it has no
// pages/ directory.
func (x *Index) scanNamespace(fsys vfs.FS, nsDir, ns string, st *BuildStats) (int, error) {
	pagesDir := layout.PagesDir(nsDir)
	fi, err := fsys.Lstat(pagesDir)
	if err != nil {
		if vfs.IsNotExist(err) {
			return -1, nil
		}
		return 0, fmt.Errorf("pageindex: %w", err)
	}
	if !fi.IsDir() {
		st.Skipped = append(st.Skipped, pagesDir)
		return -1, nil
	}
	fans, err := fsys.ReadDir(pagesDir)
	if err != nil {
		return 0, fmt.Errorf("pageindex: %w", err)
	}
	var keys []layout.PageKey
	for _, fan := range fans {
		name := fan.Name()
		dir := filepath.Join(pagesDir, name)
		if !fan.IsDir() || len(name) != 2 || !isHex(name) {
			if !layout.IsTemp(name) {
				st.Skipped = append(st.Skipped, dir)
			}
			continue
		}
		ents, err := fsys.ReadDir(dir)
		if err != nil {
			if vfs.IsNotExist(err) {
				continue
			}
			return 0, fmt.Errorf("pageindex: %w", err)
		}
		for _, e := range ents {
			pn := e.Name()
			if layout.IsTemp(pn) {
				continue
			}
			if !e.Type().IsRegular() || !layout.ValidBlockHash(pn) || pn[:2] != name {
				st.Skipped = append(st.Skipped, filepath.Join(dir, pn))
				continue
			}
			var k layout.PageKey
			_, _ = hex.Decode(k[:], []byte(pn))
			keys = append(keys, k)
		}
	}
	x.Add(ns, keys...)
	return len(keys), nil
}

func isHex(s string) bool {
	for i := 0; i < len(s); i++ {
		c := s[i]
		if (c < '0' || c > '9') && (c < 'a' || c > 'f') {
			return false
		}
	}
	return true
}
