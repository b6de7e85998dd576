package evict

import "encoding/binary"

// pageHeap is a 4-ary min-heap of a namespace's evictable pages in the
// eviction order (pending pages last, then Access, then Key: rule 6 and
// rule 4 of the package doc); each node knows its index, so that a
// touched, pinned or chosen page is fixed or removed in O(log n). Entries
// carry the pending mark, the access and the key's first 8 bytes, so that comparisons do not
// chase node pointers, and sifting moves a hole (one node's index written
// per level): a heap of a million pages does not fit in cache, and a
// 4-ary one has half the levels of a binary one.
type pageHeap struct{ a []heapEntry }

type heapEntry struct {
	access  int64
	k0      uint64 // the key's first 8 bytes, big-endian: orders like the bytes
	n       *node
	pending bool // n.pending: after every entry that is not
}

const heapArity = 4

func entryOf(n *node) heapEntry {
	return heapEntry{access: n.access, k0: binary.BigEndian.Uint64(n.key[:8]), n: n, pending: n.pending}
}

func entryLess(a, b *heapEntry) bool {
	if a.pending != b.pending {
		return b.pending
	}
	if a.access != b.access {
		return a.access < b.access
	}
	if a.k0 != b.k0 {
		return a.k0 < b.k0
	}
	return keyLess(a.n.key, b.n.key)
}

func (h *pageHeap) len() int   { return len(h.a) }
func (h *pageHeap) top() *node { return h.a[0].n }

// place puts e at i.
func (h *pageHeap) place(i int, e heapEntry) {
	h.a[i] = e
	e.n.idx = i
}

func (h *pageHeap) push(n *node) {
	h.a = append(h.a, heapEntry{})
	h.up(len(h.a)-1, entryOf(n))
}

func (h *pageHeap) remove(i int) {
	last := len(h.a) - 1
	h.a[i].n.idx = -1
	e := h.a[last]
	h.a[last] = heapEntry{}
	h.a = h.a[:last]
	if i == last {
		return
	}
	h.sift(i, e)
}

// fix restores the order after the node at i changed its access or its
// pending mark.
func (h *pageHeap) fix(i int) {
	e := h.a[i]
	e.access, e.pending = e.n.access, e.n.pending
	h.sift(i, e)
}

// sift places e, which belongs at or near the hole i, up or down.
func (h *pageHeap) sift(i int, e heapEntry) {
	if i > 0 && entryLess(&e, &h.a[(i-1)/heapArity]) {
		h.up(i, e)
	} else {
		h.down(i, e)
	}
}

// up moves the hole i toward the root until e fits, then places e.
func (h *pageHeap) up(i int, e heapEntry) {
	for i > 0 {
		p := (i - 1) / heapArity
		if !entryLess(&e, &h.a[p]) {
			break
		}
		h.place(i, h.a[p])
		i = p
	}
	h.place(i, e)
}

// down moves the hole i toward the leaves until e fits, then places e.
func (h *pageHeap) down(i int, e heapEntry) {
	n := len(h.a)
	for {
		c := heapArity*i + 1
		if c >= n {
			break
		}
		m := c
		for j := c + 1; j < min(c+heapArity, n); j++ {
			if entryLess(&h.a[j], &h.a[m]) {
				m = j
			}
		}
		if !entryLess(&h.a[m], &e) {
			break
		}
		h.place(i, h.a[m])
		i = m
	}
	h.place(i, e)
}

// nsHeap is a binary min-heap of namespaces ordered by their first
// evictable page in the eviction order, (pending, Access, Namespace, Key).
type nsHeap struct{ a []*nsState }

func (h *nsHeap) len() int      { return len(h.a) }
func (h *nsHeap) top() *nsState { return h.a[0] }

func (h *nsHeap) lessAt(i, j int) bool {
	a, b := h.a[i], h.a[j]
	return less(a.lru.top(), a.name, b.lru.top(), b.name)
}

func (h *nsHeap) swap(i, j int) {
	h.a[i], h.a[j] = h.a[j], h.a[i]
	h.a[i].sharedIdx = i
	h.a[j].sharedIdx = j
}

func (h *nsHeap) push(s *nsState) {
	s.sharedIdx = len(h.a)
	h.a = append(h.a, s)
	h.up(s.sharedIdx)
}

func (h *nsHeap) remove(i int) {
	last := len(h.a) - 1
	s := h.a[i]
	if i != last {
		h.swap(i, last)
	}
	h.a[last] = nil
	h.a = h.a[:last]
	s.sharedIdx = -1
	if i != last {
		if !h.down(i) {
			h.up(i)
		}
	}
}

func (h *nsHeap) fix(i int) {
	if !h.down(i) {
		h.up(i)
	}
}

func (h *nsHeap) up(i int) {
	for i > 0 {
		p := (i - 1) / 2
		if !h.lessAt(i, p) {
			return
		}
		h.swap(i, p)
		i = p
	}
}

func (h *nsHeap) down(i0 int) bool {
	i, n := i0, len(h.a)
	for {
		l := 2*i + 1
		if l >= n {
			break
		}
		m := l
		if r := l + 1; r < n && h.lessAt(r, l) {
			m = r
		}
		if !h.lessAt(m, i) {
			break
		}
		h.swap(i, m)
		i = m
	}
	return i > i0
}
