package evict

// pageHeap is a binary min-heap of a namespace's evictable pages in the
// eviction order (Access, then Key); each node knows its index, so that a
// touched, pinned or chosen page is fixed or removed in O(log n).
type pageHeap struct{ a []*node }

func (h *pageHeap) len() int   { return len(h.a) }
func (h *pageHeap) top() *node { return h.a[0] }

func (h *pageHeap) lessAt(i, j int) bool {
	a, b := h.a[i], h.a[j]
	if a.access != b.access {
		return a.access < b.access
	}
	return keyLess(a.key, b.key)
}

func (h *pageHeap) swap(i, j int) {
	h.a[i], h.a[j] = h.a[j], h.a[i]
	h.a[i].idx = i
	h.a[j].idx = j
}

func (h *pageHeap) push(n *node) {
	n.idx = len(h.a)
	h.a = append(h.a, n)
	h.up(n.idx)
}

func (h *pageHeap) remove(i int) {
	last := len(h.a) - 1
	n := h.a[i]
	if i != last {
		h.swap(i, last)
	}
	h.a[last] = nil
	h.a = h.a[:last]
	n.idx = -1
	if i != last {
		if !h.down(i) {
			h.up(i)
		}
	}
}

func (h *pageHeap) fix(i int) {
	if !h.down(i) {
		h.up(i)
	}
}

func (h *pageHeap) up(i int) {
	for i > 0 {
		p := (i - 1) / 2
		if !h.lessAt(i, p) {
			return
		}
		h.swap(i, p)
		i = p
	}
}

// down sifts i down and reports whether it moved.
func (h *pageHeap) down(i0 int) bool {
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

// nsHeap is a binary min-heap of namespaces ordered by their oldest
// evictable page, (Access, Namespace, Key).
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
