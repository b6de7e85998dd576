package store

import (
	"fmt"
	"path/filepath"
	"time"

	"github.com/kvpersist/kvpersist/engine/layout"
	"github.com/kvpersist/kvpersist/engine/vfs"
)

// DecodePages decodes the header of every page of l (layout.Decode: prefix,
// header hash, validation, and that the page's key is the chain step from
// its parent over its token ids; no tensor data), setting each Page's
// Snap, or Err, and its Size when the listing left it 0 (ListPages). A
// page that vanished since the listing gets an Err wrapping
// fs.ErrNotExist. It takes no lock, like List.
func (l *Listing) DecodePages() {
	fsys := l.Namespace.st.fs
	for i := range l.Pages {
		p := &l.Pages[i]
		p.Snap, p.Err = decodePage(fsys, p.Path)
		if p.Snap != nil {
			p.Size = p.Snap.Size
		}
	}
}

// DecodePage decodes the header of the page file at path (a Page's Path
// from a listing of n), as DecodePages does for one page.
func (n *Namespace) DecodePage(path string) (*layout.Snapshot, error) {
	return decodePage(n.st.fs, path)
}

// PageFile is what the page cache accounts of one page file.
type PageFile struct {
	// AllocatedBytes is the file's st_blocks × 512 (vfs.AllocatedBytes).
	AllocatedBytes int64
	ModTime        time.Time
}

// StatPage lstats the page file at path (a Page's Path, or PagePath):
// a regular file's allocated bytes and mtime. Its fan-out directory must
// be a real directory: through a symlink there the file is not this
// namespace's, and accounting it would make it this namespace's to evict
// (an unlink through the symlink). Errors: fs.ErrNotExist when it is
// gone, ErrNamespace when it or its fan-out directory is not what it
// should be (CheckRealDir), or the lstat's error.
func (n *Namespace) StatPage(path string) (PageFile, error) {
	if err := n.st.CheckRealDir(filepath.Dir(path)); err != nil {
		return PageFile{}, err
	}
	fi, err := n.st.fs.Lstat(path)
	if err != nil {
		return PageFile{}, err
	}
	if !fi.Mode().IsRegular() {
		return PageFile{}, fmt.Errorf("%w: page %s is not a regular file", ErrNamespace, path)
	}
	a, ok := vfs.AllocatedBytes(fi)
	if !ok { // a file system without st_blocks: its length, rounded to 4 KiB
		a = (fi.Size() + 4095) &^ 4095
	}
	return PageFile{AllocatedBytes: a, ModTime: fi.ModTime()}, nil
}

// RemovePage unlinks the page file at path (PagePath). A fan-out
// directory that is a symlink or not a directory holds no page of this
// namespace: nothing is removed (no unlink through the symlink) and the
// error is ErrNamespace. Else the unlink's error (fs.ErrNotExist when the
// file is gone).
func (n *Namespace) RemovePage(path string) error {
	if err := n.st.CheckRealDir(filepath.Dir(path)); err != nil {
		return err
	}
	return n.st.fs.Remove(path)
}

func decodePage(fsys vfs.FS, path string) (*layout.Snapshot, error) {
	f, err := fsys.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	return layout.DecodePage(f, path)
}

// PageUsage is what a namespace's page cache holds (Listing.PageUsage).
// Bytes are file sizes (st_size); tokens are token ids stored.
type PageUsage struct {
	Pages      int   // page files listed
	Unreadable int   // page files whose header did not decode (not in Tokens, LogicalBytes, Shared*)
	Tokens     int64 // sum over readable pages of their token count
	// LogicalBytes: sum over readable pages of their tensor bytes.
	LogicalBytes int64
	FileBytes    int64 // sizes of every page file, readable or not
	// SharedPages / SharedBytes: the readable pages shared between
	// conversations (SharedPage) and the sum of their file sizes.
	SharedPages int
	SharedBytes int64
}

// PageUsage measures l's pages (after DecodePages; pages not decoded
// count as unreadable). A page is shared between conversations when
// stored prefixes continue it in two or more different ways: it is, or is
// an ancestor of, a page with two children whose token ids diverge
// (neither is a prefix of the other). A partial last page that a later
// turn of the same conversation extended (a sibling whose token ids start
// with its own) is not a branch. Equivalently: at least two of the pages
// descending from it (itself included) are ends, an end being a page
// with no stored child and no sibling extending it.
func (l *Listing) PageUsage() PageUsage {
	var u PageUsage
	idx := map[layout.PageKey]int{}
	nodes := make([]pageNode, 0, len(l.Pages))
	for _, p := range l.Pages {
		u.Pages++
		u.FileBytes += p.Size
		if p.Snap == nil || p.Snap.Page == nil {
			u.Unreadable++
			continue
		}
		pg := p.Snap.Page
		u.Tokens += int64(len(pg.Tokens))
		for _, t := range p.Snap.Header.Slots() {
			u.LogicalBytes += t.Bytes
		}
		if _, dup := idx[pg.Key]; dup {
			continue
		}
		idx[pg.Key] = len(nodes)
		nodes = append(nodes, pageNode{size: p.Size, parent: pg.Parent, tokens: pg.Tokens})
	}
	// Pages whose parent is not stored (first pages, whose parent is the
	// chain's root key) are grouped by that parent: siblings too.
	var rootParents []layout.PageKey
	roots := map[layout.PageKey][]int{}
	for i := range nodes {
		if pi, ok := idx[nodes[i].parent]; ok {
			nodes[pi].children = append(nodes[pi].children, i)
			continue
		}
		if roots[nodes[i].parent] == nil {
			rootParents = append(rootParents, nodes[i].parent)
		}
		roots[nodes[i].parent] = append(roots[nodes[i].parent], i)
	}
	for _, rp := range rootParents {
		for _, r := range roots[rp] {
			u.countEnds(nodes, r, roots[rp])
		}
	}
	return u
}

// pageNode is a readable page in PageUsage's tree (children: indices).
type pageNode struct {
	size     int64
	parent   layout.PageKey
	tokens   []uint32
	children []int
	ends     int
}

// extended reports whether a sibling of page i has token ids starting
// with i's own (i is a partial page a later save extended).
func extended(nodes []pageNode, i int, sibs []int) bool {
	for _, j := range sibs {
		if j != i && len(nodes[j].tokens) > len(nodes[i].tokens) && hasPrefix(nodes[j].tokens, nodes[i].tokens) {
			return true
		}
	}
	return false
}

// countEnds sets the ends of r's subtree in post-order, without recursion
// (a chain may be thousands of pages), and adds its shared pages to u.
func (u *PageUsage) countEnds(nodes []pageNode, r int, rootSibs []int) {
	type frame struct {
		i, next int
		sibs    []int
	}
	stack := []frame{{i: r, sibs: rootSibs}}
	for len(stack) > 0 {
		f := &stack[len(stack)-1]
		n := &nodes[f.i]
		if f.next < len(n.children) {
			c := n.children[f.next]
			f.next++
			stack = append(stack, frame{i: c, sibs: n.children})
			continue
		}
		if len(n.children) == 0 && !extended(nodes, f.i, f.sibs) {
			n.ends = 1
		}
		for _, c := range n.children {
			n.ends += nodes[c].ends
		}
		if n.ends >= 2 {
			u.SharedPages++
			u.SharedBytes += n.size
		}
		stack = stack[:len(stack)-1]
	}
}

func hasPrefix(s, prefix []uint32) bool {
	if len(prefix) > len(s) {
		return false
	}
	for i, t := range prefix {
		if s[i] != t {
			return false
		}
	}
	return true
}
