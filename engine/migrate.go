package engine

import (
	"fmt"

	"github.com/kvpersist/kvpersist/engine/jobs"
	"github.com/kvpersist/kvpersist/engine/layout"
)

// A MigrateRequest rewrites the snapshots of a store written by the original
// Bun worker (files beginning with layout.LegacyMagic) into the engine's
// store, in kvpersist's format: SrcRoot/<ns>/<name> becomes
// <Root>/<ns>/<name>, same layout, caller metadata unchanged, every tensor
// verified on the way (see jobs.Migrate). The source is only read.
//
// Ordering: a migrate is a write to every destination namespace it may
// touch (the namespaces named, or every directory of SrcRoot listed at
// submission). Like a collect, it waits for every earlier job in those
// namespaces, and every later job in them waits for it; jobs in other
// namespaces run beside it.
//
// The job's Result has no Header; Metrics.Migrate is the per-snapshot
// report and the other Metrics sum the migrated snapshots' (LogicalBytes,
// ReadBytes, WrittenBytes, ReusedBytes, ...). Its Err is a *MigrateError
// when some snapshots failed (the others were migrated), or the error that
// stopped the migration.

// prepareMigrate validates a migrate request on the submitting goroutine
// and sets j's kind, scope (the valid namespace names: ordering) and request
// (a copy whose Namespaces is the list to scan, fixed at submission).
// Errors wrap ErrPath (roots, namespace names) or jobs.ErrBlockBytes.
func (e *Engine) prepareMigrate(j *job, r *MigrateRequest) error {
	if r == nil {
		return fmt.Errorf("%w: nil *MigrateRequest", ErrPath)
	}
	if err := jobs.CheckMigrateRoots(r.SrcRoot, e.cfg.Root); err != nil {
		return fmt.Errorf("%w: %w", ErrPath, err)
	}
	if r.BlockBytes != 0 {
		if err := jobs.CheckBlockBytes(r.BlockBytes); err != nil {
			return fmt.Errorf("engine: migrate: %w", err)
		}
	}
	c := *r
	if c.Namespaces == nil {
		all, err := jobs.SourceNamespaces(e.cfg.FS, c.SrcRoot)
		if err != nil {
			return fmt.Errorf("%w: %w", ErrPath, err)
		}
		c.Namespaces = all
	} else {
		for _, ns := range c.Namespaces {
			if err := layout.ValidName("namespace", ns); err != nil {
				return fmt.Errorf("%w: %w", ErrPath, err)
			}
		}
		c.Namespaces = append([]string{}, c.Namespaces...)
	}
	// Directories whose names kvpersist refuses are scanned (their legacy
	// snapshots are reported as failed) but never written: not in scope.
	ns := []string{}
	for _, n := range c.Namespaces {
		if layout.ValidName("namespace", n) == nil {
			ns = append(ns, n)
		}
	}
	j.kind, j.ns, j.req = KindMigrate, ns, &c
	return nil
}
