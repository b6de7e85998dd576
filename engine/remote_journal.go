package engine

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"slices"
	"strings"
	"time"

	"github.com/zeebo/xxh3"

	"github.com/kvpersist/kvpersist/engine/layout"
	"github.com/kvpersist/kvpersist/engine/remote"
	"github.com/kvpersist/kvpersist/engine/store"
	"github.com/kvpersist/kvpersist/engine/vfs"
)

// Uploads that outlive a failure or a Close (issue 15): a page manifest
// whose upload failed is queued again with backoff (manifestRetries
// times), and the uploads an engine gives up (Close's context ended, or a
// manifest out of retries) are written to a per-namespace journal,
// <root>/<ns>/.uploads, which the next engine on the root reads in New and
// queues again. See ARCHITECTURE.md, "Remote tier", "Uploads across
// failures and restarts" for the format.

// manifestRetries is how many times a page manifest whose upload failed
// (a page it names failed to upload or was not found stored, a HEAD or a
// refresh of manifestReady failed) is queued again, each after a wait of
// manifestRetryWait(attempt); then it is given up until the engine's next
// start (written to the journal at Close).
const manifestRetries = 8

// maxManifestRetryWait caps the wait before a manifest is queued again.
const maxManifestRetryWait = 5 * time.Minute

// manifestRetryWait is the wait before re-queue number attempt (1, 2,
// ...): RemoteTier.UploadBackoffMax doubled per attempt, at most
// maxManifestRetryWait, with jitter (between half and all of it). With the
// default 5 s: about 5, 10, 20, 40, 80, 160, 300, 300 s.
func (t *tier) manifestRetryWait(attempt int) time.Duration {
	d := t.backoffMax
	for i := 1; i < attempt && d < maxManifestRetryWait; i++ {
		d *= 2
	}
	d = min(d, maxManifestRetryWait)
	return d/2 + rand.N(d/2+1)
}

// errSourceChanged: an upload's local file is gone or was rewritten since
// it was queued. A manifest failing so is queued again as after any
// failure: a write of the name while its upload was queued found the name
// queued and did not queue its new file, so the retry (which reads the
// local file again, and drops a name gone or no longer a page manifest)
// is what uploads it.
var errSourceChanged = errors.New("engine: the local file changed since it was queued for upload")

// journalSet is what a journal lists for one namespace.
type journalSet struct {
	pages     map[layout.PageKey]bool
	manifests map[string]bool
}

func newJournalSet() *journalSet {
	return &journalSet{pages: map[layout.PageKey]bool{}, manifests: map[string]bool{}}
}

func setOf(m map[string]*journalSet, ns string) *journalSet {
	s := m[ns]
	if s == nil {
		s = newJournalSet()
		m[ns] = s
	}
	return s
}

// manifestDone is called for every manifest upload that left the queue
// (uploaded) or was refused by it (queueManifest): a failure that is
// neither an abandon nor permanent queues it again after
// manifestRetryWait (bounded by manifestRetries; again reports it); an
// abandon, or a manifest out of retries, is remembered for the journal.
func (t *tier) manifestDone(p *pendingUpload, err error) (again bool) {
	switch {
	case err == nil:
	case errors.Is(err, remote.ErrAbandoned):
		t.remember(p)
	case errors.Is(err, remote.ErrConflict), errors.Is(err, remote.ErrBadName):
		// Permanent: another manifest holds the name remotely.
	case p.attempt >= manifestRetries:
		t.e.logSafe(slog.LevelError, "kvpersist: page manifest not uploaded; given up until the next start", "namespace", p.ns, "name", p.name, "attempts", p.attempt+1, "err", err)
		t.remember(p)
	default:
		t.scheduleManifest(p.ns, p.name, p.attempt+1)
		return true
	}
	return false
}

// remember records an upload given up, for the journal written at close.
func (t *tier) remember(p *pendingUpload) {
	t.mu.Lock()
	defer t.mu.Unlock()
	s := setOf(t.unsent, p.ns)
	if p.manifest {
		s.manifests[p.name] = true
	} else {
		s.pages[p.key] = true
	}
}

// settle records that an upload listed by the journal read at start is
// done (or can never be done): the journal written at close drops it.
func (t *tier) settle(ns string, key layout.PageKey, manifest string) {
	t.mu.Lock()
	defer t.mu.Unlock()
	l := t.loaded[ns]
	if l == nil {
		return
	}
	if manifest != "" {
		if l.manifests[manifest] {
			setOf(t.settled, ns).manifests[manifest] = true
		}
	} else if l.pages[key] {
		setOf(t.settled, ns).pages[key] = true
	}
}

// manifestRetry is a manifest waiting to be queued again.
type manifestRetry struct {
	ns, name string
	attempt  int
	tm       *time.Timer
}

// scheduleManifest queues manifest name of ns again after
// manifestRetryWait(attempt), on a timer owned by the tier (one per
// manifest name: a name already waiting keeps its timer): close stops the
// timers not yet fired (queueing their manifests at once) and waits for
// the callbacks of those that fired. The manifest is queued with the keys
// its local file names then (requeueManifest), not those it named when
// it failed: a name rewritten meanwhile is uploaded after its own pages.
func (t *tier) scheduleManifest(ns, name string, attempt int) {
	id := ns + "/" + name
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.closing {
		setOf(t.unsent, ns).manifests[name] = true
		return
	}
	if t.retries[id] != nil {
		return
	}
	r := &manifestRetry{ns: ns, name: name, attempt: attempt}
	t.retryWG.Add(1)
	r.tm = time.AfterFunc(t.manifestRetryWait(attempt), func() {
		defer t.retryWG.Done()
		t.mu.Lock()
		mine := t.retries[id] == r // else close took it (and queued it)
		if mine {
			delete(t.retries, id)
		}
		t.mu.Unlock()
		if mine {
			t.requeueManifest(r.ns, r.name, r.attempt)
		}
	})
	t.retries[id] = r
}

// requeueManifest queues manifest name of ns again (attempt), with the
// keys its local file names now; one that is gone or no longer a page
// manifest is dropped (logged) and settled.
func (t *tier) requeueManifest(ns, name string, attempt int) {
	ref := Ref{Namespace: ns, Name: name}
	keys, err := t.localPageManifest(ref)
	if err != nil {
		t.e.logSafe(slog.LevelWarn, "kvpersist: page manifest not uploaded: its local file changed", "namespace", ns, "name", name, "err", err)
		t.settle(ns, layout.PageKey{}, name)
		return
	}
	t.queueManifest(ref, keys, attempt)
	t.queueDepth()
}

// stopRetries runs at close, before the uploader closes: the manifest
// timers not fired are stopped and their manifests queued at once (the
// uploader's Close then finishes them within its context, or abandons
// them into the journal); the callbacks of those that fired have queued
// theirs when it returns. From now on a failed manifest is not scheduled
// again but remembered for the journal.
func (t *tier) stopRetries() {
	t.mu.Lock()
	t.closing = true
	var now []*manifestRetry
	for _, r := range t.retries {
		if r.tm.Stop() {
			t.retryWG.Done() // its callback never runs
		}
		now = append(now, r)
	}
	clear(t.retries)
	t.mu.Unlock()
	t.retryWG.Wait()
	for _, r := range now {
		t.requeueManifest(r.ns, r.name, r.attempt)
	}
}

// The journal's format (ARCHITECTURE.md, "The uploads journal"): all
// integers little-endian.
//
//	0            8   magic "KVPUPL1\n"
//	8            4   u32 P, page records
//	12           4   u32 M, manifest records
//	16           32·P  page keys, raw, strictly ascending bytewise
//	16+32·P      M × (u8 L, L bytes of name): layout.ValidName names, strictly ascending
//	end−8        8   u64 XXH3-64 (seed 0) of every byte before it
const (
	journalMagic = "KVPUPL1\n"
	// maxJournalPages and maxJournalManifests bound one journal: 64 MiB
	// of page keys and at most 13 MB of names. Uploads beyond them are
	// not journaled (logged): a later save naming them queues them.
	maxJournalPages     = 1 << 21
	maxJournalManifests = 1 << 16
	maxNameBytes        = 200 // layout.ValidName
	maxJournalBytes     = 16 + 32*maxJournalPages + (1+maxNameBytes)*maxJournalManifests + 8
)

// errJournal: a journal that does not decode (ignored whole, logged).
var errJournal = errors.New("engine: uploads journal")

// encodeJournal is the journal listing pages and manifests (either may be
// empty). It sorts both; the caller keeps each within its maximum.
func encodeJournal(pages []layout.PageKey, manifests []string) []byte {
	slices.SortFunc(pages, func(a, b layout.PageKey) int { return bytes.Compare(a[:], b[:]) })
	slices.Sort(manifests)
	b := make([]byte, 0, 24+32*len(pages)+(1+maxNameBytes)*len(manifests))
	b = append(b, journalMagic...)
	b = binary.LittleEndian.AppendUint32(b, uint32(len(pages)))
	b = binary.LittleEndian.AppendUint32(b, uint32(len(manifests)))
	for _, k := range pages {
		b = append(b, k[:]...)
	}
	for _, m := range manifests {
		b = append(b, byte(len(m)))
		b = append(b, m...)
	}
	return binary.LittleEndian.AppendUint64(b, xxh3.Hash(b))
}

// decodeJournal checks and decodes a journal: size, magic, counts
// against the size and the maxima, the hash, then every record (keys and
// names strictly ascending, names valid). Every failure wraps errJournal.
func decodeJournal(b []byte) (pages []layout.PageKey, manifests []string, err error) {
	bad := func(format string, a ...any) error {
		return fmt.Errorf("%w: %s", errJournal, fmt.Sprintf(format, a...))
	}
	if len(b) < 24 || len(b) > maxJournalBytes {
		return nil, nil, bad("%d bytes (want 24 to %d)", len(b), maxJournalBytes)
	}
	if string(b[:8]) != journalMagic {
		return nil, nil, bad("bad magic %q", b[:8])
	}
	np, nm := binary.LittleEndian.Uint32(b[8:]), binary.LittleEndian.Uint32(b[12:])
	body := b[:len(b)-8]
	if np > maxJournalPages || nm > maxJournalManifests || 16+32*int64(np)+2*int64(nm) > int64(len(body)) {
		return nil, nil, bad("%d pages and %d manifests do not fit in %d bytes", np, nm, len(b))
	}
	if h := binary.LittleEndian.Uint64(b[len(b)-8:]); h != xxh3.Hash(body) {
		return nil, nil, bad("hash %016x, the bytes hash to %016x", h, xxh3.Hash(body))
	}
	off := 16
	pages = make([]layout.PageKey, np)
	for i := range pages {
		copy(pages[i][:], body[off:off+32])
		off += 32
		if i > 0 && bytes.Compare(pages[i-1][:], pages[i][:]) >= 0 {
			return nil, nil, bad("page %d is not after page %d", i, i-1)
		}
	}
	manifests = make([]string, 0, nm)
	for i := range int(nm) {
		if off >= len(body) {
			return nil, nil, bad("manifest %d past the end", i)
		}
		l := int(body[off])
		off++
		if l == 0 || off+l > len(body) {
			return nil, nil, bad("manifest %d: length %d", i, l)
		}
		name := string(body[off : off+l])
		off += l
		if err := layout.ValidName("snapshot", name); err != nil {
			return nil, nil, bad("manifest %d: %v", i, err)
		}
		if i > 0 && strings.Compare(manifests[i-1], name) >= 0 {
			return nil, nil, bad("manifest %d is not after manifest %d", i, i-1)
		}
		manifests = append(manifests, name)
	}
	if off != len(body) {
		return nil, nil, bad("%d bytes after the last record", len(body)-off)
	}
	return pages, manifests, nil
}

// readJournal reads the journal at path: (nil, nil, nil) when there is
// none. A journal that is not a regular file, is larger than
// maxJournalBytes (checked before reading) or does not decode is
// errJournal.
func readJournal(fsys vfs.FS, path string) ([]layout.PageKey, []string, bool, error) {
	fi, err := fsys.Lstat(path)
	if vfs.IsNotExist(err) {
		return nil, nil, false, nil
	}
	if err != nil {
		return nil, nil, true, err
	}
	if !fi.Mode().IsRegular() || fi.Size() > maxJournalBytes {
		return nil, nil, true, fmt.Errorf("%w: %s is not a regular file of at most %d bytes (mode %v, %d bytes)", errJournal, path, maxJournalBytes, fi.Mode(), fi.Size())
	}
	f, err := fsys.Open(path)
	if err != nil {
		return nil, nil, true, err
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return nil, nil, true, err
	}
	if st.Size() != fi.Size() {
		return nil, nil, true, fmt.Errorf("%w: %s changed while opened", errJournal, path)
	}
	b := make([]byte, st.Size())
	if _, err := f.ReadAt(b, 0); err != nil {
		return nil, nil, true, err
	}
	p, m, err := decodeJournal(b)
	if err != nil {
		err = fmt.Errorf("%s: %w", path, err)
	}
	return p, m, true, err
}

// journalOf reads namespace ns's journal (readJournal); n is nil for an
// invalid namespace name.
func (t *tier) journalOf(ns string) (n *store.Namespace, path string, pages []layout.PageKey, manifests []string, exists bool, err error) {
	if n, err = t.e.store.Namespace(ns); err != nil {
		return nil, "", nil, nil, false, err
	}
	path = n.UploadsPath()
	pages, manifests, exists, err = readJournal(t.e.store.FS(), path)
	return n, path, pages, manifests, exists, err
}

// resume reads every namespace's journal (New) and queues what it lists
// again: its pages whose local files exist, then each manifest that is
// still a local page manifest (with its pages, as a write queues it).
// Entries whose local file is gone (or is not a regular file) are
// settled (dropped at close). A journal that cannot be read is ignored
// with a log line (Warn); it stays on disk until close rewrites it.
func (t *tier) resume() {
	names, _, err := t.e.store.Namespaces(false)
	if err != nil {
		return
	}
	fsys := t.e.store.FS()
	for _, ns := range names {
		n, path, pages, manifests, exists, err := t.journalOf(ns)
		if n == nil {
			continue
		}
		if err != nil {
			t.e.logSafe(slog.LevelWarn, "kvpersist: uploads journal ignored; its uploads are queued by the next saves that name them", "path", path, "err", err)
			continue
		}
		if !exists || len(pages)+len(manifests) == 0 {
			continue
		}
		l := newJournalSet()
		for _, k := range pages {
			l.pages[k] = true
		}
		for _, m := range manifests {
			l.manifests[m] = true
		}
		t.mu.Lock()
		t.loaded[ns] = l
		t.mu.Unlock()
		var queue []layout.PageKey
		for _, k := range pages {
			// Only a regular file can be uploaded (enqueueFile): an
			// entry whose path is gone or is anything else is dropped.
			if fi, err := fsys.Lstat(n.PagePath(k)); err != nil || !fi.Mode().IsRegular() {
				t.settle(ns, k, "")
				continue
			}
			queue = append(queue, k)
		}
		t.enqueuePages(ns, queue)
		for _, m := range manifests {
			t.requeueManifest(ns, m, 0)
		}
	}
	t.queueDepth()
}

// localPageManifest decodes the local page manifest of ref and returns
// the keys it names.
func (t *tier) localPageManifest(ref Ref) ([]layout.PageKey, error) {
	path, err := t.e.Path(ref)
	if err != nil {
		return nil, err
	}
	f, err := t.e.store.FS().Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	snap, err := layout.Decode(f, path)
	if err != nil {
		return nil, err
	}
	if snap.Pages == nil {
		return nil, fmt.Errorf("%s is no longer a page manifest", path)
	}
	return snap.Pages.Keys, nil
}

// writeJournals runs at close, after the uploader has stopped: for every
// namespace with uploads given up or a journal read at start, the journal
// becomes (the journal on disk now − what this engine settled) ∪ what it
// gave up, published durably (temp file, fdatasync, rename, directory
// fsync, under the store's sync policy). An empty result is written as an
// empty journal when a file exists (nothing is deleted), and not at all
// otherwise. A journal on disk that does not decode is replaced (logged).
// Two engines on one root closing at the same moment may each write its
// own union; the entries of the one renamed first are then lost (they are
// queued by the next save that names them, as without a journal).
func (t *tier) writeJournals() error {
	t.mu.Lock()
	todo := map[string]bool{}
	for ns := range t.unsent {
		todo[ns] = true
	}
	for ns := range t.loaded {
		todo[ns] = true
	}
	t.mu.Unlock()
	fsys := t.e.store.FS()
	var first error
	for ns := range todo {
		n, path, cur, curM, exists, err := t.journalOf(ns)
		if n == nil {
			continue
		}
		if err != nil {
			t.e.logSafe(slog.LevelWarn, "kvpersist: uploads journal replaced", "path", path, "err", err)
		}
		t.mu.Lock()
		settled, unsent := t.settled[ns], t.unsent[ns]
		pages := map[layout.PageKey]bool{}
		manifests := map[string]bool{}
		for _, k := range cur {
			if settled == nil || !settled.pages[k] {
				pages[k] = true
			}
		}
		for _, m := range curM {
			if settled == nil || !settled.manifests[m] {
				manifests[m] = true
			}
		}
		if unsent != nil {
			for k := range unsent.pages {
				pages[k] = true
			}
			for m := range unsent.manifests {
				manifests[m] = true
			}
		}
		t.mu.Unlock()
		if !exists && len(pages)+len(manifests) == 0 {
			continue
		}
		pl := make([]layout.PageKey, 0, len(pages))
		for k := range pages {
			pl = append(pl, k)
		}
		ml := make([]string, 0, len(manifests))
		for m := range manifests {
			ml = append(ml, m)
		}
		if len(pl) > maxJournalPages || len(ml) > maxJournalManifests {
			t.e.logSafe(slog.LevelWarn, "kvpersist: uploads journal full; the uploads beyond it are queued by the next saves that name them", "namespace", ns, "pages", len(pl), "manifests", len(ml))
			slices.SortFunc(pl, func(a, b layout.PageKey) int { return bytes.Compare(a[:], b[:]) })
			pl = pl[:min(len(pl), maxJournalPages)]
			ml = ml[:min(len(ml), maxJournalManifests)]
		}
		if fi, err := fsys.Lstat(n.Dir()); err != nil || !fi.IsDir() {
			continue // gone, or not ours to write into
		}
		b := encodeJournal(pl, ml)
		err = layout.Publish(fsys, path, t.e.store.PublishOptions(true, int64(len(b))), func(f vfs.File) error {
			return layout.WriteFull(f, b, 0)
		})
		if err != nil && first == nil {
			first = fmt.Errorf("engine: uploads journal of %s: %w", ns, err)
		}
	}
	return first
}

// closeUploads is the tier's part of Close: the manifest timers stopped,
// the uploader closed within ctx (its OnDone records every abandon), the
// journals written.
func (t *tier) closeUploads(ctx context.Context) error {
	t.stopRetries()
	err := t.up.Close(ctx)
	if jerr := t.writeJournals(); jerr != nil {
		t.e.logSafe(slog.LevelWarn, "kvpersist: uploads journal not written; its uploads are queued by the next saves that name them", "err", jerr)
	}
	return err
}
