// Package labels holds the label values of kvpersist's metrics (a job's
// kind and outcome) apart from the Prometheus collector in package
// metrics, so that package engine can name them in its metrics interface
// (engine.MetricsSink) without linking prometheus or protobuf into every
// embedder. It imports only the standard library and evict.
package labels

import (
	"context"
	"errors"
	"fmt"

	"github.com/kvpersist/kvpersist/engine/evict"
)

// Kind is a job's kind, the `kind` label.
type Kind uint8

// Job kinds: the engine's (write, read, collect, delete, migrate) and the
// page cache's (save, load, lookup, evict).
const (
	KindWrite Kind = iota
	KindRead
	KindCollect
	KindDelete
	KindMigrate
	KindSave
	KindLoad
	KindLookup
	KindEvict
	// NumKinds is the number of kinds: every Kind below it is valid.
	NumKinds
)

var kindNames = [NumKinds]string{"write", "read", "collect", "delete", "migrate", "save", "load", "lookup", "evict"}

// String is the label value: "write", "read", ..., "evict".
func (k Kind) String() string {
	if k < NumKinds {
		return kindNames[k]
	}
	return fmt.Sprintf("Kind(%d)", int(k))
}

// Outcome is how a job ended, the `outcome` label.
type Outcome uint8

// Outcomes.
const (
	// OutcomeOK: no error.
	OutcomeOK Outcome = iota
	// OutcomeError: any other error.
	OutcomeError
	// OutcomeCanceled: the job's context ended or the engine closed.
	OutcomeCanceled
	// OutcomeNoSpace: a save refused for want of space (evict.ErrNoSpace).
	OutcomeNoSpace
	// NumOutcomes is the number of outcomes: every Outcome below it is
	// valid.
	NumOutcomes
)

var outcomeNames = [NumOutcomes]string{"ok", "error", "canceled", "nospace"}

// String is the label value: "ok", "error", "canceled" or "nospace".
func (o Outcome) String() string {
	if o < NumOutcomes {
		return outcomeNames[o]
	}
	return fmt.Sprintf("Outcome(%d)", int(o))
}

// OutcomeOf classifies a job's error: nil is OutcomeOK; context.Canceled
// and context.DeadlineExceeded are OutcomeCanceled; evict.ErrNoSpace is
// OutcomeNoSpace; anything else OutcomeError. (The engine also counts its
// own ErrClosed as canceled.)
func OutcomeOf(err error) Outcome {
	switch {
	case err == nil:
		return OutcomeOK
	case errors.Is(err, evict.ErrNoSpace):
		return OutcomeNoSpace
	case errors.Is(err, context.Canceled), errors.Is(err, context.DeadlineExceeded):
		return OutcomeCanceled
	}
	return OutcomeError
}

// RemoteOp is a request kind of the object-store tier, the `op` label of
// the remote metrics.
type RemoteOp uint8

// Remote operations.
const (
	// RemoteLookup: a batch of existence checks (HEADs) of page keys.
	RemoteLookup RemoteOp = iota
	// RemoteFetch: one page fetched (ranged GETs), verified and published
	// to the local tier.
	RemoteFetch
	// RemoteUpload: one page or manifest uploaded (write-behind).
	RemoteUpload
	// NumRemoteOps is the number of operations.
	NumRemoteOps
)

var remoteOpNames = [NumRemoteOps]string{"lookup", "fetch", "upload"}

// String is the label value: "lookup", "fetch" or "upload".
func (o RemoteOp) String() string {
	if o < NumRemoteOps {
		return remoteOpNames[o]
	}
	return fmt.Sprintf("RemoteOp(%d)", int(o))
}

// RemoteResult is how one remote operation ended, the `result` label.
type RemoteResult uint8

// Remote results.
const (
	// RemoteOK: done (a lookup batch answered, a page fetched and
	// verified, an object created).
	RemoteOK RemoteResult = iota
	// RemoteExisted: an upload found the object already stored and sent
	// no bytes.
	RemoteExisted
	// RemoteCorrupt: a fetched object failed verification (short, long,
	// replaced, a bad header, key chain or tensor hash): a miss, never
	// loaded.
	RemoteCorrupt
	// RemoteError: a network or server error (after the retries), or a
	// local error publishing a fetched page.
	RemoteError
	// RemoteAbandoned: an upload given up when the engine closed.
	RemoteAbandoned
	// NumRemoteResults is the number of results.
	NumRemoteResults
)

var remoteResultNames = [NumRemoteResults]string{"ok", "existed", "corrupt", "error", "abandoned"}

// String is the label value: "ok", "existed", "corrupt", "error" or
// "abandoned".
func (r RemoteResult) String() string {
	if r < NumRemoteResults {
		return remoteResultNames[r]
	}
	return fmt.Sprintf("RemoteResult(%d)", int(r))
}
