package events

import (
	"context"
	"fmt"
	"runtime"
	"sync"

	"github.com/kvpersist/kvpersist/engine/layout"
	"github.com/kvpersist/kvpersist/engine/store"
	"github.com/kvpersist/kvpersist/engine/vfs"
)

// SnapshotStats reports what a Snapshot announced.
type SnapshotStats struct {
	Pages  int // full pages announced as BlockStored
	Events int // BlockStored events (runs of a chain, at most 64 pages each)
	// Leaves: partial last pages, never announced (routers index full
	// blocks only).
	Leaves int
	// Orphans: full pages not announced because their parent is not
	// among the pages (nor a chain root), or an ancestor's is not: a
	// router places a page through its parent, and would misplace it.
	Orphans int
	// Duplicates: pages given more than once (announced once).
	Duplicates int
}

// Snapshot announces pages of namespace ns (a namespace's stored pages,
// as PagesFromDisk reads them) as BlockStored events in chain order,
// every parent before its children, so that a router that has seen
// nothing of this engine can index them. It waits for room in its own
// queue (the Sink's events keep theirs and go first) and returns once
// every event has been handed to the PUB socket. A namespace that
// Config.Namespace excludes announces nothing. Errors: ctx's, ErrClosed
// (the stats then count what was queued).
func (p *Publisher) Snapshot(ctx context.Context, ns string, pages []layout.Page) (SnapshotStats, error) {
	var st SnapshotStats
	if !p.announces(ns) {
		return st, nil
	}
	order := chainOrder(pages, &st)
	var rc rootCache
	var err error
	p.wire.runs(pages, order, &rc, func(ev []byte) bool {
		if err = p.put(ctx, p.snap, item{ev: ev}); err != nil {
			return false
		}
		st.Events++
		return true
	})
	if err != nil {
		return st, err
	}
	return st, p.waitMark(ctx, p.snap)
}

// chainOrder returns the indices of the full pages of pages reachable
// from a chain root through parents among them, in depth-first pre-order
// (a parent before its children, a chain's pages one after the other),
// and counts leaves, duplicates and orphans in st (st.Pages: the pages
// ordered).
func chainOrder(pages []layout.Page, st *SnapshotStats) []int32 {
	idx := make(map[layout.PageKey]int32, len(pages))
	for i := range pages {
		pg := &pages[i]
		if !full(pg) {
			st.Leaves++
			continue
		}
		if _, dup := idx[pg.Key]; dup {
			st.Duplicates++
			continue
		}
		idx[pg.Key] = int32(i)
	}
	// Children as linked lists: firstChild[i], then nextSibling.
	firstChild := make([]int32, len(pages))
	nextSibling := make([]int32, len(pages))
	for i := range firstChild {
		firstChild[i], nextSibling[i] = -1, -1
	}
	var roots []int32
	var rc rootCache
	for i := len(pages) - 1; i >= 0; i-- { // backwards: lists keep pages' order
		pg := &pages[i]
		if j, ok := idx[pg.Key]; !ok || j != int32(i) {
			continue // a leaf or a duplicate
		}
		if rc.first(pg) {
			roots = append(roots, int32(i))
			continue
		}
		if j, ok := idx[pg.Parent]; ok && j != int32(i) {
			nextSibling[i] = firstChild[j]
			firstChild[j] = int32(i)
		}
	}
	order := make([]int32, 0, len(idx))
	stack := make([]int32, 0, 64)
	for r := len(roots) - 1; r >= 0; r-- { // roots were gathered backwards
		stack = append(stack[:0], roots[r])
		for len(stack) > 0 {
			i := stack[len(stack)-1]
			stack = stack[:len(stack)-1]
			order = append(order, i)
			// Push the children so that the first pops first; with a
			// linked list in order, push them reversed.
			mark := len(stack)
			for c := firstChild[i]; c >= 0; c = nextSibling[c] {
				stack = append(stack, c)
			}
			for a, b := mark, len(stack)-1; a < b; a, b = a+1, b-1 {
				stack[a], stack[b] = stack[b], stack[a]
			}
		}
	}
	st.Pages = len(order)
	st.Orphans = len(idx) - len(order)
	return order
}

// DiskStats reports what PagesFromDisk found.
type DiskStats struct {
	Files int // page files listed
	// Unreadable: page files whose header did not decode, or whose page
	// key is not their name (not returned).
	Unreadable int
	Vanished   int // removed since the listing
}

// PagesFromDisk reads the page object (key, parent, identity, page size,
// token ids) of every page file of namespace ns, for Snapshot: it lists
// pages/ (store.Namespace.ListPages) and reads each file's page object
// (layout.ReadPage: header hash and key chain verified, tensors not read)
// on up to workers goroutines (0: GOMAXPROCS), all joined before it
// returns. The pages come in the
// listing's order; files that do not decode, or whose key is not their
// name, are skipped and counted. Errors: the listing's.
func PagesFromDisk(ns *store.Namespace, workers int) ([]layout.Page, DiskStats, error) {
	var ds DiskStats
	l, err := ns.ListPages()
	if err != nil {
		return nil, ds, fmt.Errorf("events: list pages: %w", err)
	}
	ds.Files = len(l.Pages)
	if workers <= 0 {
		workers = runtime.GOMAXPROCS(0)
	}
	workers = min(workers, max(1, len(l.Pages)))
	fsys := ns.Store().FS()
	got := make([]*layout.Page, len(l.Pages))
	errs := make([]error, len(l.Pages))
	var wg sync.WaitGroup
	for w := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := w; i < len(l.Pages); i += workers {
				pg, err := readPage(fsys, l.Pages[i].Path)
				switch {
				case err != nil:
					errs[i] = err
				case pg.Key.String() != l.Pages[i].Key:
					errs[i] = fmt.Errorf("page file %s holds page %s", l.Pages[i].Path, pg.Key)
				default:
					got[i] = pg
				}
			}
		}()
	}
	wg.Wait()
	pages := make([]layout.Page, 0, len(got))
	for i, pg := range got {
		switch {
		case pg != nil:
			pages = append(pages, *pg)
		case vfs.IsNotExist(errs[i]):
			ds.Vanished++
		default:
			ds.Unreadable++
		}
	}
	return pages, ds, nil
}

// StoreSnapshotStats reports what SnapshotStore did.
type StoreSnapshotStats struct {
	Namespaces int // namespaces announced
	Snapshot   SnapshotStats
	Disk       DiskStats
}

// SnapshotStore announces the stored pages of every namespace of st (or
// of Config.Namespace alone) as Snapshot does, reading each namespace's
// page files with PagesFromDisk (workers goroutines, 0: GOMAXPROCS): what
// an engine runs after its index rebuild at start, so that a router is
// warm before the first request, and on request. A namespace removed
// while it runs is skipped; a missing root announces nothing. Errors:
// ctx's, ErrClosed, a listing's (the stats count what was announced).
func (p *Publisher) SnapshotStore(ctx context.Context, st *store.Store, workers int) (StoreSnapshotStats, error) {
	var ss StoreSnapshotStats
	names, _, err := st.Namespaces(false)
	if err != nil {
		if vfs.IsNotExist(err) {
			return ss, nil
		}
		return ss, fmt.Errorf("events: %w", err)
	}
	for _, name := range names {
		if !p.announces(name) {
			continue
		}
		if err := ctx.Err(); err != nil {
			return ss, err
		}
		ns, err := st.Namespace(name)
		if err != nil {
			return ss, fmt.Errorf("events: %w", err)
		}
		pages, ds, err := PagesFromDisk(ns, workers)
		if err != nil {
			if vfs.IsNotExist(err) { // removed since the root was listed
				continue
			}
			return ss, err
		}
		ss.Disk.Files += ds.Files
		ss.Disk.Unreadable += ds.Unreadable
		ss.Disk.Vanished += ds.Vanished
		s, err := p.Snapshot(ctx, name, pages)
		ss.Snapshot.Pages += s.Pages
		ss.Snapshot.Events += s.Events
		ss.Snapshot.Leaves += s.Leaves
		ss.Snapshot.Orphans += s.Orphans
		ss.Snapshot.Duplicates += s.Duplicates
		if err != nil {
			return ss, err
		}
		ss.Namespaces++
	}
	return ss, nil
}

func readPage(fsys vfs.FS, path string) (*layout.Page, error) {
	f, err := fsys.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	return layout.ReadPage(f, path)
}
