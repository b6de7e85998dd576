package tier

import (
	"context"
	"errors"
	"fmt"
	"log/slog"

	"github.com/kvpersist/kvpersist/engine/jobs"
	"github.com/kvpersist/kvpersist/engine/layout"
	"github.com/kvpersist/kvpersist/engine/remote"
	"github.com/kvpersist/kvpersist/engine/vfs"
)

// Named reads through the object-store tier: a ReadRequest of a
// page manifest (layout Pages) whose manifest or pages exist only in the
// bucket. See ARCHITECTURE.md, "Remote tier", "Read-through (named read)".

// ReadNamed runs when a ReadRequest of ref on an engine with a remote
// tier failed because the name or a page it names is missing locally
// (engine.ErrNotFound, jobs.ErrMissingPage), on the read's worker; a local
// read that succeeds costs the tier nothing. When the local manifest is missing it fetches
// the remote one (Store.FetchManifest: at most remote.MaxManifestBytes,
// verified by remote.VerifyManifest, into memory); when the manifest
// (local or fetched) is a page manifest, every page it names that the
// local index lacks (or lists though its file is gone) is looked up and,
// when the store holds them all, fetched by the tier's one fetcher, the
// LoadPrefix read-through's (lookup, fetchRun: fetch.go;
// pagecache.Cache.AdmitHeld around fetchPage: room reserved first,
// verified against the manifest's key chain, published atomically, committed
// pinned; the manifest's pages already local are pinned first). Only when
// every page is local is a fetched manifest published (publishManifest:
// the durable publish of a save, under the namespace's exclusive lock,
// and only if the name is still missing locally) and recorded as the page
// cache's manifest (its pages pinned while it exists), so a local
// manifest never names a page this engine failed to fetch. fetched
// reports that a manifest or a page was published, or that the name was
// written locally meanwhile: the caller reads again. held are the pins of
// the manifest's pages (fetched, or local before): the caller releases
// them when that read ends. rep says what the tier did; rep.Err is its first
// failure (errors.Is remote.ErrCorrupt for an object that failed
// verification), and the read then fails as it would locally (the
// manifest not found, or ErrMissingPage) with rep.Err joined to its error.
// A manifest of another layout, or any local decoding error, is left to
// the read.
func (t *Tier) ReadNamed(ctx context.Context, ref jobs.Ref) (rep *Report, held []layout.PageKey, fetched bool) {
	rep = &Report{}
	n, err := t.d.Store.Namespace(ref.Namespace)
	if err != nil {
		return rep, nil, false
	}
	path, err := n.Path(ref.Name)
	if err != nil {
		return rep, nil, false
	}
	fsys := t.d.Store.FS()
	var body []byte // the fetched manifest, published once its pages are local
	var pl *layout.PageList
	if _, lerr := fsys.Lstat(path); lerr == nil {
		f, err := fsys.Open(path)
		if err != nil {
			return rep, nil, false
		}
		snap, err := layout.Decode(f, path)
		f.Close()
		if err != nil || snap.Pages == nil {
			return rep, nil, false // the read reports it, or it needs no page
		}
		pl = snap.Pages
	} else {
		if !vfs.IsNotExist(lerr) {
			return rep, nil, false
		}
		name, err := t.st.ManifestName(ref.Namespace, ref.Name)
		if err != nil {
			return rep, nil, false
		}
		b, snap, err := t.st.FetchManifest(ctx, name)
		if errors.Is(err, remote.ErrNotFound) {
			return rep, nil, false // in neither tier: the read says not found
		}
		if err != nil {
			rep.Err = fmt.Errorf("engine: remote manifest %s: %w", name, err)
			t.d.Log(slog.LevelWarn, "kvpersist: remote manifest not fetched", "object", name, "err", err)
			return rep, nil, false
		}
		body, pl = b, snap.Pages
	}
	held, rep.Err = t.fetchNamedPages(ctx, ref.Namespace, pl, rep)
	if rep.Err != nil || body == nil {
		return rep, held, rep.PagesFetched > 0
	}
	if err := t.publishManifest(ctx, ref, path, body, pl); err != nil {
		rep.Err = fmt.Errorf("engine: publishing the fetched manifest %s: %w", ref, err)
		return rep, held, rep.PagesFetched > 0
	}
	return rep, held, true // published, or the name written meanwhile: read again
}

// RemoteManifest fetches and verifies the remote manifest of snapshot
// name in namespace ns (Store.FetchManifest: at most
// remote.MaxManifestBytes, verified by remote.VerifyManifest, into
// memory) and returns it decoded; it publishes and records nothing
// locally (a ReadRequest's read-through does that, ReadNamed). Errors:
// remote.ErrNotFound when the store lacks it, remote.ErrBadName for an
// invalid namespace or name, remote.ErrCorrupt, ErrTooLarge, ctx's or the
// store's.
func (t *Tier) RemoteManifest(ctx context.Context, ns, name string) (*layout.Snapshot, error) {
	obj, err := t.st.ManifestName(ns, name)
	if err != nil {
		return nil, err
	}
	_, snap, err := t.st.FetchManifest(ctx, obj)
	return snap, err
}

// fetchNamedPages fetches the pages of pl that the local index lacks or
// whose file is gone (ReadNamed), through the tier's one fetcher: lookup
// of them all, then a fetchRun that stops at the first failure. Nothing
// is fetched unless the store holds every one of them (a missing page is
// ErrMissingPage, found by the lookup). The pages of pl already local are
// pinned first (held, as a LoadPrefix pins its local prefix), so the room
// made for the fetched pages is never theirs: the read needs them too.
func (t *Tier) fetchNamedPages(ctx context.Context, ns string, pl *layout.PageList, rep *Report) (held []layout.PageKey, err error) {
	n, err := t.d.Store.Namespace(ns)
	if err != nil {
		return nil, err
	}
	var fetch []int // positions in pl.Keys
	for i, k := range pl.Keys {
		if t.d.Index.Has(ns, k) {
			pinned, err := t.d.Cache.PinStored(ctx, ns, k)
			if err != nil {
				return held, err
			}
			if _, err := t.d.Store.FS().Lstat(n.PagePath(k)); err == nil {
				if pinned {
					held = append(held, k)
				}
				continue
			}
			// The index lists a page whose file another engine on the
			// root has evicted since (the read failed on it): it is
			// forgotten and fetched like a page never stored here.
			if pinned {
				t.d.Cache.Unpin(ns, k)
			}
			t.d.ForgetIfGone(ns, k)
		}
		fetch = append(fetch, i)
	}
	if len(fetch) == 0 {
		return held, nil
	}
	objs, err := t.lookup(ctx, ns, pl.Keys, fetch, rep)
	if err != nil {
		return held, err
	}
	for a, pos := range fetch {
		if a >= len(objs) || objs[a].Name == "" {
			name, _ := t.st.PageName(ns, pl.Keys[pos].String())
			return held, fmt.Errorf("%w: page %s is in neither tier", jobs.ErrMissingPage, name)
		}
		rep.PagesFound++
		t.markKnown(ns, pl.Keys[pos])
	}
	if err := t.prepareDirs(ctx, n, pl.Keys, fetch); err != nil {
		return held, err
	}
	// The manifest names keys, not token ids: the chain (key =
	// SHA-256(parent ‖ tokens), parent = the key before) fixes the tokens;
	// verifyPage leaves them unchecked (nil).
	want := func(pos int) *layout.Page {
		parent := layout.PageRoot(pl.Identity, pl.PageTokens)
		if pos > 0 {
			parent = pl.Keys[pos-1]
		}
		return &layout.Page{Key: pl.Keys[pos], Parent: parent, Identity: pl.Identity, PageTokens: pl.PageTokens}
	}
	fr := t.startFetch(ctx, n, want, fetch, objs, false, true)
	fetched, first := fr.wait(rep, pl.Keys)
	return append(held, fetched...), first
}

// publishManifest publishes the verified bytes of a fetched manifest as
// the local file path of ref (temp file, fdatasync, rename, directory
// fsync, as a write publishes it) and records it as the page cache's
// manifest of ref: its pages stay pinned while it exists, as those of a
// manifest written here. It runs under the namespace's exclusive lock and
// publishes only when path is still missing (else it does nothing): a
// write publishes under the shared lock, so a name written meanwhile
// (by another engine on the root; one of this engine waits for the read)
// is newer than the remote manifest and is never replaced by it.
func (t *Tier) publishManifest(ctx context.Context, ref jobs.Ref, path string, body []byte, pl *layout.PageList) error {
	n, err := t.d.Store.Namespace(ref.Namespace)
	if err != nil {
		return err
	}
	if err := n.Create(); err != nil {
		return err
	}
	unlock, err := n.Lock(ctx, true)
	if err != nil {
		return err
	}
	defer unlock()
	fsys := t.d.Store.FS()
	if _, err := fsys.Lstat(path); !vfs.IsNotExist(err) {
		return err // nil: the name exists now, written meanwhile
	}
	err = layout.Publish(fsys, path, t.d.Store.PublishOptions(true, int64(len(body))), func(f vfs.File) error {
		return layout.WriteFull(f, body, 0)
	})
	if err != nil {
		return err
	}
	t.d.Cache.SetManifest(ref.Namespace, ref.Name, pl.Keys)
	return nil
}
