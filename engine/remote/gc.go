package remote

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/minio/minio-go/v7"

	"github.com/kvpersist/kvpersist/engine/layout"
)

// Kind classifies an object found under a namespace's prefix.
type Kind int

const (
	// Unknown: a name kvpersist does not write; never deleted.
	Unknown Kind = iota
	// Page: <ns>/pages/<k[0:2]>/<k>, k 64 lowercase hex digits.
	Page
	// Manifest: <ns>/<name>, a valid manifest name.
	Manifest
)

func (k Kind) String() string {
	switch k {
	case Page:
		return "page"
	case Manifest:
		return "manifest"
	}
	return "unknown"
}

// Listed is one object of a namespace listing.
type Listed struct {
	Object
	Kind Kind
	Key  string // a page's key (64 hex); a manifest's name; "" if Unknown
}

// List returns every object under "<prefix>/<ns>/" (pages, manifests and
// unknown names), classified, in the store's (lexical) order. It costs one
// LIST request per 1,000 objects.
func (s *Store) List(ctx context.Context, ns string) ([]Listed, error) {
	p, err := s.NamespacePrefix(ns)
	if err != nil {
		return nil, err
	}
	var out []Listed
	for info := range s.client.ListObjectsIter(ctx, s.cfg.Bucket, minio.ListObjectsOptions{Prefix: p, Recursive: true}) {
		if info.Err != nil {
			return nil, opErr("list", p, info.Err)
		}
		l := Listed{Object: Object{Name: info.Key, Size: info.Size, ETag: strings.Trim(info.ETag, `"`), ModTime: info.LastModified}}
		rest := strings.TrimPrefix(info.Key, p)
		if k, ok := strings.CutPrefix(rest, PagesDirName+"/"); ok {
			if len(k) == 67 && k[2] == '/' && layout.ValidBlockHash(k[3:]) && k[:2] == k[3:5] {
				l.Kind, l.Key = Page, k[3:]
			}
		} else if layout.ValidName("manifest", rest) == nil {
			l.Kind, l.Key = Manifest, rest
		}
		out = append(out, l)
	}
	return out, nil
}

// minGrace is the smallest Grace Collect accepts (lowered only by tests).
var minGrace = time.Minute

// CollectOptions configure one remote garbage collection of a namespace.
type CollectOptions struct {
	// Namespace to collect.
	Namespace string
	// Grace: a page is deleted only if its mtime is older than the store's
	// clock at the listing minus Grace. It must exceed the longest time
	// between an uploader deciding a page is present (or uploading it) and
	// the manifest naming it becoming listable, plus the clock skew between
	// the store's nodes. Minimum 1 minute; default 1 hour.
	Grace time.Duration
	// Live is called after the pages have been listed and returns the set
	// of live page keys: every key named by a manifest listable now (the
	// caller fetches and decodes manifests; the page format is not this
	// package's). Reading the manifests after listing the pages is what
	// makes a manifest published before Live runs protect its pages.
	Live func(ctx context.Context, manifests []Listed) (map[string]bool, error)
	// DryRun: report what would be deleted, delete nothing.
	DryRun bool
}

// CollectReport says what a Collect did. Byte counts are object sizes.
type CollectReport struct {
	Pages, Manifests         int
	PageBytes, ManifestBytes int64
	Live, Young              int // pages kept: named by a manifest; unreferenced but within Grace
	LiveBytes, YoungBytes    int64
	Deleted                  int
	DeletedBytes             int64
	DeletedNames             []string // the pages deleted (DryRun: that would be), in listing order
	Refreshed                int      // unreferenced pages old in the listing but found younger than Grace just before their delete (kept)
	Unknown                  []string // names not recognised: skipped, never deleted
	ServerNow, Threshold     time.Time
}

// Collect deletes the pages of a namespace that no manifest names and
// whose mtime is older than the store's clock at the listing minus Grace.
// Order: list the namespace (which also reads the store's clock from the
// listing's Date header), then call Live, then, per page to delete, read
// its mtime again (one HEAD: a page refreshed since the listing is kept,
// counted in Refreshed) and delete it. Manifests and unrecognised names
// are never deleted. If Live fails nothing is deleted. A dry run sends no
// HEAD: it reports what the listing says. The clock rule is in
// docs/format/bucket-layout.md ("Grace, not locks").
func (s *Store) Collect(ctx context.Context, o CollectOptions) (CollectReport, error) {
	var rep CollectReport
	if o.Grace == 0 {
		o.Grace = time.Hour
	}
	if o.Grace < minGrace {
		return rep, fmt.Errorf("%w: Grace %v is under the %v minimum", ErrConfig, o.Grace, minGrace)
	}
	if o.Live == nil {
		return rep, fmt.Errorf("%w: Live is nil", ErrConfig)
	}
	objs, err := s.List(ctx, o.Namespace)
	if err != nil {
		return rep, err
	}
	rep.ServerNow = s.ServerTime()
	if rep.ServerNow.IsZero() {
		return rep, &OpError{Op: "list", Name: o.Namespace, Err: fmt.Errorf("%w: the store sent no Date header; cannot judge ages", ErrConfig)}
	}
	rep.Threshold = rep.ServerNow.Add(-o.Grace)
	var manifests []Listed
	for _, l := range objs {
		switch l.Kind {
		case Manifest:
			rep.Manifests++
			rep.ManifestBytes += l.Size
			manifests = append(manifests, l)
		case Page:
			rep.Pages++
			rep.PageBytes += l.Size
		default:
			rep.Unknown = append(rep.Unknown, l.Name)
		}
	}
	live, err := o.Live(ctx, manifests)
	if err != nil {
		return rep, fmt.Errorf("remote: collect %s: reading live pages: %w", o.Namespace, err)
	}
	for _, l := range objs {
		if l.Kind != Page {
			continue
		}
		switch {
		case live[l.Key]:
			rep.Live++
			rep.LiveBytes += l.Size
		case !l.ModTime.Before(rep.Threshold):
			rep.Young++
			rep.YoungBytes += l.Size
		default:
			if !o.DryRun {
				// The listing's mtime may be stale: an uploader may have
				// refreshed the page since (Store.Refresh), to name it in
				// a manifest this collect has not read. Re-read it.
				cur, err := s.Stat(ctx, l.Name)
				if errors.Is(err, ErrNotFound) {
					continue // deleted meanwhile (another collector)
				}
				if err != nil {
					return rep, err
				}
				if !cur.ModTime.Before(rep.Threshold) {
					rep.Refreshed++
					continue
				}
				if err := s.Delete(ctx, l.Name); err != nil {
					return rep, err
				}
			}
			rep.Deleted++
			rep.DeletedBytes += l.Size
			rep.DeletedNames = append(rep.DeletedNames, l.Name)
		}
	}
	return rep, nil
}
