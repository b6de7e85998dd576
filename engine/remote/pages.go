package remote

import (
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"strings"
	"sync"
	"time"

	"github.com/minio/minio-go/v7"

	"github.com/kvpersist/kvpersist/engine/layout"
	"github.com/kvpersist/kvpersist/internal/xxh3s"
)

// What the tier knows of kvpersist's files: enough to check a fetched page
// or page manifest (layout's decoding and hashes) and to name the pages a
// manifest holds. Everything else stays opaque.

// objectFile is a fetched object seen as the read-only vfs.File that
// layout.Decode reads: ReadAt and Stat (size) only.
type objectFile struct {
	r    io.ReaderAt
	size int64
	name string
}

func (f objectFile) ReadAt(p []byte, off int64) (int, error) { return f.r.ReadAt(p, off) }
func (f objectFile) Stat() (os.FileInfo, error)              { return objectInfo(f), nil }
func (f objectFile) Name() string                            { return f.name }
func (f objectFile) Close() error                            { return nil }
func (objectFile) WriteAt([]byte, int64) (int, error)        { return 0, errReadOnly }
func (objectFile) Sync() error                               { return errReadOnly }
func (objectFile) Allocate(int64) error                      { return errReadOnly }
func (objectFile) StartWriteback(int64, int64) error         { return errReadOnly }

var errReadOnly = errors.New("remote: a fetched object is read-only")

type objectInfo objectFile

func (i objectInfo) Name() string     { return i.name }
func (i objectInfo) Size() int64      { return i.size }
func (objectInfo) Mode() fs.FileMode  { return 0o444 }
func (objectInfo) ModTime() time.Time { return time.Time{} }
func (objectInfo) IsDir() bool        { return false }
func (objectInfo) Sys() any           { return nil }
func (i objectInfo) String() string   { return i.name }

// Decode decodes and validates the prefix and header of the size bytes of
// an object readable from r (layout.Decode: magic, header hash, format
// version, every extent within size); name is used in errors. Tensor bytes
// are not read.
func Decode(r io.ReaderAt, size int64, name string) (*layout.Snapshot, error) {
	return layout.Decode(objectFile{r: r, size: size, name: name}, name)
}

// hashBufBytes is the chunk in which Verify* re-hash tensor bytes.
const hashBufBytes = 1 << 20

var hashBufs = sync.Pool{New: func() any { b := make([]byte, hashBufBytes); return &b }}

// checkHashes re-hashes (xxh3-64) every tensor slot of snap stored in the
// object itself (a slot with a hash: every tensor of a page, the
// attachments of a page manifest) against its header hash.
func checkHashes(r io.ReaderAt, snap *layout.Snapshot) error {
	bp := hashBufs.Get().(*[]byte)
	defer hashBufs.Put(bp)
	buf := *bp
	names := snap.Header.SlotIndex()
	for i, t := range snap.Header.Slots() {
		if t.Hash == "" {
			continue
		}
		var d xxh3s.Digest
		off := int64(snap.DataStart) + t.Off
		for done := int64(0); done < t.Bytes; {
			n := min(int64(len(buf)), t.Bytes-done)
			if _, err := r.ReadAt(buf[:n], off+done); err != nil && !(errors.Is(err, io.EOF) && n > 0) {
				return fmt.Errorf("%s: reading: %w", names.Name(i), err)
			}
			d.Write(buf[:n])
			done += n
		}
		if got := layout.TensorHash(d.Sum64()); got != t.Hash {
			return fmt.Errorf("%s: xxh3 %s, the header says %s", names.Name(i), got, t.Hash)
		}
	}
	return nil
}

// checkPageSnap is VerifyPage's check of a decoded page's header against
// its name and size: a page (FormatPage) whose key is key, ending exactly
// where its last tensor ends (the single-file rule writers follow: a
// longer object is not the file that was uploaded).
func checkPageSnap(snap *layout.Snapshot, key string, size int64) error {
	if snap.Page == nil {
		return fmt.Errorf("not a page file (formatVersion %d)", snap.Header.FormatVersion)
	}
	if got := snap.Page.Key.String(); got != key {
		return fmt.Errorf("holds the page of key %s, not of its name", got)
	}
	end := int64(snap.DataStart)
	for _, t := range snap.Header.Caches[0].Tensors {
		if t.Bytes > 0 {
			end = max(end, int64(snap.DataStart)+t.Off+t.Bytes)
		}
	}
	if end != size {
		return fmt.Errorf("%d bytes, its last tensor ends at %d", size, end)
	}
	return nil
}

// CheckStoredPage fetches the stored object o (from Stat, o.Name set), the
// page of key (64 lowercase hex digits), in one GET pinned to o.ETag and
// checks it as VerifyPage would, streamed (PageStream): none of its bytes
// is kept, so it costs one object's transfer and no memory or disk. nil:
// the object is the page. An error wrapping ErrCorrupt: it is not (a
// header, key, tensor hash or length that does not check out). Any other
// error (the request failed, the object changed or went meanwhile) says
// nothing about the object.
func (s *Store) CheckStoredPage(ctx context.Context, o Object, key string) error {
	if o.Size > s.cfg.MaxObjectBytes {
		return &OpError{Op: "get", Name: o.Name, Err: fmt.Errorf("%w: %d bytes > MaxObjectBytes %d", ErrTooLarge, o.Size, s.cfg.MaxObjectBytes)}
	}
	ps := NewPageStream(discardAt{}, key, o.Size)
	// One attempt of one range: a retried range would reach the stream out
	// of order, and a short body is the network's doing, not the object's.
	if err := s.getRangeOnce(ctx, o.Name, o, 0, o.Size, ps); err != nil {
		return &OpError{Op: "get", Name: o.Name, Err: fmt.Errorf("checking the stored page: %v", err)}
	}
	if _, ok := ps.Verified(); !ok {
		return &OpError{Op: "get", Name: o.Name, Err: fmt.Errorf("%w: the stored object is not page %s (its header, key, a tensor hash or its length)", ErrCorrupt, key)}
	}
	return nil
}

// RepairPage replaces the stored object of page key of namespace ns by the
// size bytes of src (a local page file), when the stored object does not
// verify (CheckStoredPage) and src does (VerifyPage): replaced true. A
// stored object that verifies is kept (create-only: replaced false, nil);
// a missing one is uploaded create-only (replaced true). Errors: src not
// the page (ErrSourceCorrupt), or a request's.
func (s *Store) RepairPage(ctx context.Context, ns, key string, src io.ReaderAt, size int64) (replaced bool, err error) {
	name, err := s.PageName(ns, key)
	if err != nil {
		return false, err
	}
	if err := VerifyPage(key, nil)(src, size); err != nil {
		return false, fmt.Errorf("%w: %s: %w", ErrSourceCorrupt, name, err)
	}
	o, err := s.Stat(ctx, name)
	if errors.Is(err, ErrNotFound) {
		pr, err := s.Put(ctx, name, src, size)
		return pr.Created, err
	}
	if err != nil {
		return false, err
	}
	if err := s.CheckStoredPage(ctx, o, key); !errors.Is(err, ErrCorrupt) {
		return false, err // nil: a good object, kept
	}
	pr, err := s.Replace(ctx, name, o.ETag, src, size)
	return pr.Replaced, err
}

// discardAt is a write destination that keeps nothing.
type discardAt struct{}

func (discardAt) WriteAt(p []byte, _ int64) (int, error) { return len(p), nil }

// VerifyPage returns a VerifyFunc accepting only the page file of key (64
// lowercase hex digits): its header decodes (layout.Decode, which also
// checks that the page's key is the chain step from its parent key over
// its token ids), it is a page (FormatPage) whose key is key, and every
// tensor's xxh3-64 equals its header hash, and the object ends exactly
// where its last tensor ends. If out is not nil it receives the decoded
// page. A fetch whose bytes fail it is ErrCorrupt.
func VerifyPage(key string, out **layout.Page) VerifyFunc {
	return func(r io.ReaderAt, size int64) error {
		snap, err := layout.DecodePage(objectFile{r: r, size: size, name: "page " + key}, "page "+key)
		if err != nil {
			return err
		}
		if err := checkPageSnap(snap, key, size); err != nil {
			return err
		}
		if err := checkHashes(r, snap); err != nil {
			return err
		}
		if out != nil {
			*out = snap.Page
		}
		return nil
	}
}

// VerifyManifest returns a VerifyFunc accepting only a page manifest
// (FormatPages): its header decodes and validates (the page list holds
// ceil(tokens/pageTokens) keys) and its attachments' xxh3-64 equal their
// header hashes. If out is not nil it receives the decoded manifest (its
// Pages field is the page list). The pages themselves are not fetched.
func VerifyManifest(out **layout.Snapshot) VerifyFunc {
	return func(r io.ReaderAt, size int64) error {
		snap, err := Decode(r, size, "manifest")
		if err != nil {
			return err
		}
		if snap.Pages == nil {
			return fmt.Errorf("not a page manifest (formatVersion %d, layout %s)", snap.Header.FormatVersion, snap.Layout)
		}
		if err := checkHashes(r, snap); err != nil {
			return err
		}
		if out != nil {
			*out = snap
		}
		return nil
	}
}

// MaxManifestBytes caps the size of a manifest ReadManifest fetches into
// memory: the header's cap (layout.MaxHeaderLen, 64 MiB) plus as much
// again for attachments.
const MaxManifestBytes = 2 * layout.MaxHeaderLen

// memObject is an in-memory fetch destination of a known size.
type memObject []byte

func (m memObject) WriteAt(p []byte, off int64) (int, error) {
	if off < 0 || off+int64(len(p)) > int64(len(m)) {
		return 0, io.ErrShortWrite
	}
	return copy(m[off:], p), nil
}

func (m memObject) ReadAt(p []byte, off int64) (int, error) {
	if off >= int64(len(m)) {
		return 0, io.EOF
	}
	n := copy(p, m[off:])
	if n < len(p) {
		return n, io.EOF
	}
	return n, nil
}

// ReadManifest fetches and verifies (VerifyManifest) the page manifest
// object name into memory. An object over MaxManifestBytes is ErrTooLarge
// before anything is fetched; one that fails verification is ErrCorrupt;
// a missing one ErrNotFound.
func (s *Store) ReadManifest(ctx context.Context, name string) (*layout.Snapshot, error) {
	_, snap, err := s.FetchManifest(ctx, name)
	return snap, err
}

// FetchManifest is ReadManifest also returning the object's bytes (the
// engine's named read-through publishes them as the local manifest). The
// bytes are returned only when they verified.
func (s *Store) FetchManifest(ctx context.Context, name string) ([]byte, *layout.Snapshot, error) {
	o, err := s.Stat(ctx, name)
	if err != nil {
		return nil, nil, err
	}
	if o.Size > MaxManifestBytes {
		return nil, nil, &OpError{Op: "get", Name: name, Err: fmt.Errorf("%w: a manifest of %d bytes (limit %d)", ErrTooLarge, o.Size, MaxManifestBytes)}
	}
	buf := make(memObject, o.Size)
	var snap *layout.Snapshot
	_, err = s.Fetch(ctx, name, buf, func(r io.ReaderAt, size int64) error {
		if size != int64(len(buf)) {
			return fmt.Errorf("the object changed size from %d to %d bytes", len(buf), size)
		}
		return VerifyManifest(&snap)(r, size)
	})
	if err != nil {
		return nil, nil, err
	}
	return buf, snap, nil
}

// LivePages is the CollectOptions.Live of kvpersist's page manifests: it
// reads every listed manifest (ReadManifest) and returns the keys of every
// page they name. A manifest deleted since the listing is skipped (it
// protects nothing any more); any other failure, a manifest that cannot
// be fetched or is not a valid page manifest, fails it, so that Collect
// deletes nothing: the pages an unreadable manifest names cannot be known.
func (s *Store) LivePages(ctx context.Context, manifests []Listed) (map[string]bool, error) {
	live := map[string]bool{}
	for _, m := range manifests {
		snap, err := s.ReadManifest(ctx, m.Name)
		if errors.Is(err, ErrNotFound) {
			continue
		}
		if err != nil {
			return nil, err
		}
		for _, k := range snap.Pages.Keys {
			live[k.String()] = true
		}
	}
	return live, nil
}

// Namespaces lists the namespaces under the store's prefix: the first
// name elements below it that layout.ValidName accepts, sorted. Objects
// directly under the prefix and elements that are not valid namespace
// names are returned in skipped (full names; never touched). One LIST
// request per 1,000 entries (delimiter '/').
func (s *Store) Namespaces(ctx context.Context) (names, skipped []string, err error) {
	p := s.join("")
	if p != "" && !strings.HasSuffix(p, "/") {
		p += "/"
	}
	for info := range s.client.ListObjectsIter(ctx, s.cfg.Bucket, minio.ListObjectsOptions{Prefix: p}) {
		if info.Err != nil {
			return nil, nil, opErr("list", s.cfg.Bucket+"/"+p, info.Err)
		}
		el, isDir := strings.CutSuffix(strings.TrimPrefix(info.Key, p), "/")
		if isDir && layout.ValidName("namespace", el) == nil {
			names = append(names, el)
		} else {
			skipped = append(skipped, info.Key)
		}
	}
	return names, skipped, nil
}

// Problem kinds of a remote Verify (the local verify's names where the
// meaning is the same).
const (
	// ProblemCorruptPage: a page object fails VerifyPage (its header, its
	// key against its name or its chain, a tensor hash).
	ProblemCorruptPage = "corrupt-page"
	// ProblemUnreadable: a manifest object fails VerifyManifest.
	ProblemUnreadable = "unreadable"
	// ProblemMissingPage: a manifest names a page that is not stored.
	ProblemMissingPage = "missing-page"
	// ProblemBrokenChain: a manifest's pages, each valid, do not form its
	// chain: a page's parent is not the previous page's key (the chain's
	// root key for the first), its identity or page size differs from the
	// manifest's, a page before the last is partial, or the token counts
	// do not add up to the manifest's.
	ProblemBrokenChain = "broken-chain"
)

// Problem is one thing wrong with an object.
type Problem struct {
	Kind   string `json:"kind"`
	Name   string `json:"name"` // the object's full name
	Detail string `json:"detail"`
}

// VerifyOptions configure Verify.
type VerifyOptions struct {
	// Workers: objects fetched and verified at once (each fetch sends up
	// to Config.Concurrency ranged GETs). Default 4.
	Workers int
	// TempDir holds one temp file per worker, the fetched page being
	// verified ("" = os.TempDir()); removed before Verify returns.
	TempDir string
	// OnObject, if set, is called after each object is checked with its
	// size in bytes (from the worker goroutines, one at a time).
	OnObject func(name string, bytes int64)
}

// VerifyReport is what Verify found in one namespace.
type VerifyReport struct {
	Namespace string    `json:"namespace"`
	Pages     int       `json:"pages"`     // page objects fetched and checked
	Manifests int       `json:"manifests"` // manifest objects fetched and checked
	Bytes     int64     `json:"bytes"`     // bytes fetched
	Problems  []Problem `json:"problems"`
	// Vanished: objects listed but gone when fetched (deleted by a remote
	// collect meanwhile); not problems.
	Vanished []string `json:"vanished"`
	// Unknown: names kvpersist does not write; not fetched.
	Unknown []string `json:"unknown"`
}

// pageInfo is what a verified page tells the chain check.
type pageInfo struct {
	parent     layout.PageKey
	identity   string
	pageTokens int
	tokens     int
}

// Verify fetches and checks every object of namespace ns: each page with
// VerifyPage (header, key against its name and its chain step, every
// tensor hash), each manifest with VerifyManifest; then, per manifest,
// that every page it names is stored and that its pages form its chain
// (ProblemBrokenChain). Damage is reported in the report, not as an
// error; the error is for what stops the check (a request that fails
// after the client's retries, the context, the temp files), with the
// report so far. Nothing is written to the store.
func (s *Store) Verify(ctx context.Context, ns string, o VerifyOptions) (*VerifyReport, error) {
	if o.Workers == 0 {
		o.Workers = 4
	}
	if o.Workers < 1 {
		return nil, fmt.Errorf("%w: Verify Workers %d", ErrConfig, o.Workers)
	}
	rep := &VerifyReport{Namespace: ns}
	objs, err := s.List(ctx, ns)
	if err != nil {
		return rep, err
	}
	var pages, manifests []Listed
	stored := map[string]bool{}
	for _, l := range objs {
		switch l.Kind {
		case Page:
			pages = append(pages, l)
			stored[l.Key] = true
		case Manifest:
			manifests = append(manifests, l)
		default:
			rep.Unknown = append(rep.Unknown, l.Name)
		}
	}
	var (
		mu    sync.Mutex
		infos = map[string]pageInfo{}
		snaps = map[string]*layout.Snapshot{}
	)
	record := func(l Listed, n int64, err error) error {
		mu.Lock()
		defer mu.Unlock()
		switch {
		case errors.Is(err, ErrNotFound):
			rep.Vanished = append(rep.Vanished, l.Name)
			return nil
		case errors.Is(err, ErrCorrupt), errors.Is(err, ErrTooLarge):
			kind := ProblemCorruptPage
			if l.Kind == Manifest {
				kind = ProblemUnreadable
			}
			rep.Problems = append(rep.Problems, Problem{Kind: kind, Name: l.Name, Detail: detail(err, l.Name)})
		case err != nil:
			return err
		}
		if l.Kind == Page {
			rep.Pages++
		} else {
			rep.Manifests++
		}
		rep.Bytes += n
		if o.OnObject != nil {
			o.OnObject(l.Name, l.Size)
		}
		return nil
	}
	// Pages, Workers at a time, each into its worker's temp file.
	files := make(chan *os.File, o.Workers)
	defer func() {
		close(files)
		for f := range files {
			f.Close()
			os.Remove(f.Name())
		}
	}()
	for range o.Workers {
		f, err := os.CreateTemp(o.TempDir, ".kvpersist-remote-verify-*")
		if err != nil {
			return rep, fmt.Errorf("remote: verify: temp file: %w", err)
		}
		files <- f
	}
	vs := *s
	vs.cfg.Concurrency = max(1, s.cfg.Concurrency/o.Workers) // requests in flight stay at about Concurrency
	err = s.eachN(ctx, len(pages), o.Workers, func(ctx context.Context, i int) error {
		l := pages[i]
		f := <-files
		defer func() { files <- f }()
		if err := f.Truncate(0); err != nil {
			return fmt.Errorf("remote: verify: temp file: %w", err)
		}
		var pg *layout.Page
		n, err := vs.Fetch(ctx, l.Name, f, VerifyPage(l.Key, &pg))
		if err == nil {
			mu.Lock()
			infos[l.Key] = pageInfo{parent: pg.Parent, identity: pg.Identity, pageTokens: pg.PageTokens, tokens: len(pg.Tokens)}
			mu.Unlock()
		}
		return record(l, n, err)
	})
	if err != nil {
		return rep, err
	}
	err = s.eachN(ctx, len(manifests), o.Workers, func(ctx context.Context, i int) error {
		l := manifests[i]
		snap, err := s.ReadManifest(ctx, l.Name)
		if err == nil {
			mu.Lock()
			snaps[l.Name] = snap
			mu.Unlock()
		}
		var n int64
		if snap != nil {
			n = snap.Size
		}
		return record(l, n, err)
	})
	if err != nil {
		return rep, err
	}
	for _, l := range manifests {
		if snap := snaps[l.Name]; snap != nil {
			rep.Problems = append(rep.Problems, checkChain(s, ns, l.Name, snap.Pages, stored, infos)...)
		}
	}
	return rep, nil
}

// detail is err's message without the "remote: get NAME: remote:
// corrupt object: " its OpError puts first (the report names the object
// and the kind already).
func detail(err error, name string) string {
	msg := err.Error()
	if _, rest, ok := strings.Cut(msg, name+": "); ok {
		msg = rest
	}
	for _, sentinel := range []error{ErrCorrupt, ErrTooLarge} {
		msg = strings.TrimPrefix(msg, sentinel.Error()+": ")
	}
	return msg
}

// checkChain checks that the pages a manifest names are stored and form
// its chain.
func checkChain(s *Store, ns, name string, pl *layout.PageList, stored map[string]bool, infos map[string]pageInfo) []Problem {
	var out []Problem
	bad := func(kind, format string, a ...any) {
		out = append(out, Problem{Kind: kind, Name: name, Detail: fmt.Sprintf(format, a...)})
	}
	parent := layout.PageRoot(pl.Identity, pl.PageTokens)
	tokens, known := 0, true
	for i, k := range pl.Keys {
		key := k.String()
		pn, _ := s.PageName(ns, key)
		switch info, ok := infos[key]; {
		case !stored[key]:
			bad(ProblemMissingPage, "page %d (%s) is not stored", i, pn)
			known = false
		case !ok: // stored but corrupt or vanished: reported apart
			known = false
		case info.parent != parent:
			bad(ProblemBrokenChain, "page %d (%s) has parent %s, want %s", i, pn, info.parent, parent)
		case info.identity != pl.Identity || info.pageTokens != pl.PageTokens:
			bad(ProblemBrokenChain, "page %d (%s) has identity %q and page size %d, the manifest %q and %d", i, pn, info.identity, info.pageTokens, pl.Identity, pl.PageTokens)
		case i < len(pl.Keys)-1 && info.tokens != pl.PageTokens:
			bad(ProblemBrokenChain, "page %d (%s) of %d holds %d tokens; only the last may be partial", i, pn, len(pl.Keys), info.tokens)
		default:
			tokens += info.tokens
		}
		parent = k
	}
	if known && len(out) == 0 && tokens != pl.Tokens {
		bad(ProblemBrokenChain, "its pages hold %d tokens, the manifest says %d", tokens, pl.Tokens)
	}
	return out
}

// eachN is each with k workers instead of Config.Concurrency.
func (s *Store) eachN(ctx context.Context, n, k int, fn func(ctx context.Context, i int) error) error {
	t := *s
	t.cfg.Concurrency = k
	return t.each(ctx, n, fn)
}
