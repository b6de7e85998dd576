package jobs_test

import (
	"context"
	"os"
	"path/filepath"
	"testing"

	"github.com/kvpersist/kvpersist/engine/jobs"
	"github.com/kvpersist/kvpersist/engine/layout"
	"github.com/kvpersist/kvpersist/engine/vfs"
	"github.com/kvpersist/kvpersist/internal/testutil"
)

// The Bun worker accepted any file name (its own collect marks every
// "*.mlxkv"). Collect only decodes files whose names pass layout.ValidName;
// a legacy manifest named e.g. "turn 1.mlxkv" (a space) or "-x.mlxkv" is
// put in Skipped, its blocks are not marked, and they are deleted: a valid,
// published manifest loses its blocks.
func TestReviewCollectDeletesBlocksOfLegacyManifestWithUnusualName(t *testing.T) {
	root := t.TempDir()
	ns := filepath.Join(root, "bun")
	testutil.CopyTree(t, filepath.Join(testutil.BunFixtures, "blocks"), ns)
	if err := os.Rename(filepath.Join(ns, "grown.mlxkv"), filepath.Join(ns, "turn 2.mlxkv")); err != nil {
		t.Fatal(err)
	}
	if err := os.Remove(filepath.Join(ns, "snapshot.mlxkv")); err != nil {
		t.Fatal(err)
	}
	snap, err := layout.Load(vfs.Default, filepath.Join(ns, "turn 2.mlxkv"))
	if err != nil {
		t.Fatal(err)
	}
	m, err := jobs.Collect(context.Background(), noSync(), &jobs.CollectSpec{Root: root})
	if err != nil {
		t.Fatal(err)
	}
	missing := 0
	for _, tn := range snap.Header.Slots() {
		for _, b := range tn.Blocks {
			if _, err := os.Lstat(testutil.LegacyBlockPath(ns, b.Hash)); err != nil {
				missing++
			}
		}
	}
	if missing > 0 {
		t.Fatalf("collect deleted %d blocks named by the published manifest %q (skipped: %v)", missing, "turn 2.mlxkv", m.Collect.Skipped)
	}
}
