package engine

import (
	"context"
	"errors"
	"fmt"

	"github.com/kvpersist/kvpersist/engine/layout"
	"github.com/kvpersist/kvpersist/engine/remote"
	"github.com/kvpersist/kvpersist/engine/tier"
)

// The public side of the object-store tier (engine/tier): its config,
// report and sentinels, and the lookup through both tiers. See
// ARCHITECTURE.md, "Remote tier (object store)".

// RemoteConfig says where the object-store tier lives: endpoint (TLS by
// default; plain http only for a loopback host), bucket, prefix,
// credentials (from AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY when
// empty) and the client's bounds. See remote.Config.
type RemoteConfig = remote.Config

// RemoteConfigFromEnv is remote.ConfigFromEnv: endpoint, bucket and prefix
// given, credentials and region from the standard environment variables.
func RemoteConfigFromEnv(endpoint, bucket, prefix string) RemoteConfig {
	return remote.ConfigFromEnv(endpoint, bucket, prefix)
}

// Sentinels of the object-store tier, re-exported for errors.Is.
var (
	// ErrRemoteCorrupt: a fetched object was not the page its name and the
	// prompt's key chain say (short, long, replaced during the fetch, a bad
	// header, key, parent, identity, tokens or tensor hash), or not a valid
	// page manifest. A miss: it is never published locally nor loaded
	// (RemoteReport.Err; a named read fails with it joined to its error).
	ErrRemoteCorrupt = remote.ErrCorrupt
	// ErrUploadsAbandoned: Close's context ended with uploads pending; they
	// were given up (the local pages are intact) and stay listed in their
	// namespace's uploads journal (<root>/<ns>/.uploads), which the next
	// New on the root queues again.
	ErrUploadsAbandoned = remote.ErrAbandoned
)

// RemoteTier configures the object-store tier of an engine (Config.Remote):
// the store (Store: endpoint, bucket, prefix, credentials), the uploads'
// workers, queue and backoff, the pages fetched at once per load, the
// known-stored set's size and the refresh age. The engine opens the store,
// owns it and its uploader, and closes both in Close; a caller needs
// nothing but package engine. See tier.Config for every field.
type RemoteTier = tier.Config

// RemoteReport says what the object-store tier did for one load (Result.
// Remote; nil when the engine has no remote tier): pages asked of the
// store and found, pages and bytes fetched, and the tier's first failure
// (Err; errors.Is ErrRemoteCorrupt for an object that failed
// verification), which never fails a prefix load. See tier.Report.
type RemoteReport = tier.Report

// PrefixHit is LookupRemote's answer, in tokens.
type PrefixHit struct {
	// Local: the longest prefix stored in the local tier (what Lookup
	// returns).
	Local int
	// Total: the longest prefix stored in the local tier and the object
	// store together (>= Local): pages after the local prefix that a load
	// would fetch. Like Local, a multiple of the page size or the prompt's
	// length.
	Total int
}

// Sentinels of the remote tier's check at New (and of failed uploads, in
// Close's error and the log), re-exported for errors.Is.
var (
	// ErrRemoteCredentials: the object store refused the credentials (an
	// unknown access key, a wrong secret key, an expired token).
	ErrRemoteCredentials = remote.ErrCredentials
	// ErrRemoteNoBucket: the bucket does not exist.
	ErrRemoteNoBucket = remote.ErrNoBucket
	// ErrRemoteAccessDenied: the store denied the credentials a request
	// (a missing permission on the bucket).
	ErrRemoteAccessDenied = remote.ErrAccessDenied
)

// openTier opens the object-store tier of cfg.Remote (New, once e.pc and
// e.jcfg are set): the tier gets the store, the index, the page cache, the
// engine's logger and metrics, and the engine's repairs as callbacks.
func (e *Engine) openTier() error {
	t, err := tier.New(*e.cfg.Remote, tier.Deps{Store: e.store, Index: e.pages, Cache: e.pc,
		Log: e.logSafe, Metrics: e.cfg.Metrics, OnFetched: e.pageFetched,
		RemoveCorruptPage: e.removeCorruptPage, ForgetIfGone: e.forgetIfGone})
	if err != nil {
		return fmt.Errorf("%w: Remote: %w", ErrConfig, err)
	}
	e.tier = t
	return nil
}

// LookupRemote is Lookup through both tiers: Local is Lookup's answer
// (the engine's index, no I/O), Total the longest prefix stored in the
// local tier and the object store together, which a LoadPrefixRequest
// would load (fetching the remote pages first). It asks the store about
// the pages after the local prefix that the local index lacks, in batches
// of Store.Concurrency HEADs all in flight (one round trip each), and
// stops at the first batch holding a page the store lacks: a prompt of n
// pages past its local prefix costs at most ceil(n/Concurrency) round
// trips (a 32,768-token prompt at 256 tokens per page, nothing local: 128
// HEADs in 8 round trips at the default Concurrency of 16).
//
// Lookup stays local-only on purpose: a scheduler calls it on its hot
// path for every request and needs an answer in microseconds without
// allocation or failure; LookupRemote costs network round trips and can
// fail, so the scheduler calls it when the local answer is short and
// decides whether fetching beats recomputing. Without a remote tier,
// Total equals Local.
//
// Errors: those of Lookup, ctx's, or the store's (a *remote.OpError; Local
// is still set and Total = Local).
func (e *Engine) LookupRemote(ctx context.Context, namespace, identity string, pageTokens int, tokens []uint32) (PrefixHit, error) {
	local, err := e.Lookup(namespace, identity, pageTokens, tokens)
	if err != nil || e.tier == nil || local == len(tokens) {
		return PrefixHit{Local: local, Total: local}, err
	}
	if pageTokens == 0 {
		pageTokens = layout.DefaultPageTokens
	}
	keys, _, err := layout.PageChain(identity, pageTokens, tokens)
	if err != nil {
		return PrefixHit{Local: local, Total: local}, err
	}
	cands, rerr := e.tier.RemotePages(ctx, namespace, keys)
	total := local
	if cands > 0 {
		last := local/pageTokens + cands // pages of the prefix
		full := len(tokens) / pageTokens
		switch {
		case last <= full:
			total = last * pageTokens
		default: // the leaf: the whole prompt
			total = len(tokens)
		}
	}
	return PrefixHit{Local: local, Total: total}, rerr
}

// StatRemote is Stat through both tiers, so a caller on an engine that
// lacks a snapshot the object store holds can still allocate destination
// buffers before reading it: when the name is local it returns Stat's
// answer; when it is missing locally and the engine has a remote tier, it
// fetches the remote manifest (at most remote.MaxManifestBytes, into
// memory), verifies it and returns its header, publishing nothing
// locally. A ReadRequest of ref then reads through: it fetches the pages
// the manifest names and publishes the manifest. Without a remote tier it
// is Stat. It runs on the calling goroutine and costs a HEAD and a GET
// when the name is only remote.
//
// Errors: those of Stat; ErrNotFound when neither tier holds the name;
// otherwise the store's, wrapped (errors.Is ErrRemoteCorrupt for a
// manifest that failed verification, or a *remote.OpError).
func (e *Engine) StatRemote(ctx context.Context, ref Ref) (*Snapshot, error) {
	snap, err := e.Stat(ref)
	if e.tier == nil || !errors.Is(err, ErrNotFound) {
		return snap, err
	}
	rsnap, rerr := e.tier.RemoteManifest(ctx, ref.Namespace, ref.Name)
	if errors.Is(rerr, remote.ErrNotFound) {
		return nil, err
	}
	if rerr != nil {
		return nil, fmt.Errorf("engine: remote manifest of %s: %w", ref, rerr)
	}
	return rsnap, nil
}

// RemoteKnownPages returns how many pages the engine remembers as stored
// in the object store (at most RemoteTier.KnownPages); 0 without a remote
// tier.
func (e *Engine) RemoteKnownPages() int {
	if e.tier == nil {
		return 0
	}
	return e.tier.KnownPages()
}
