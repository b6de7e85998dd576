package store

import (
	"fmt"
	"io"
	"time"

	"github.com/kvpersist/kvpersist/engine/layout"
	"github.com/kvpersist/kvpersist/engine/recency"
	"github.com/kvpersist/kvpersist/engine/vfs"
)

// CacheStats is what a namespace's prefix page cache holds on disk,
// measured as the engine accounts it (Listing.CacheStats; `kvpersist stats`
// and `kvpersist du`). Bytes are bytes, tokens are token ids stored.
type CacheStats struct {
	Pages      int `json:"pages"`      // page files under pages/
	Unreadable int `json:"unreadable"` // page files whose header did not decode (no tokens, logical bytes or access counted)
	// AllocatedBytes: the page files' st_blocks × 512 (vfs.AllocatedBytes),
	// what engine.Config.CapacityBytes and QuotaBytes bound.
	AllocatedBytes int64 `json:"allocatedBytes"`
	FileBytes      int64 `json:"fileBytes"`    // their lengths (st_size)
	LogicalBytes   int64 `json:"logicalBytes"` // their tensors' bytes (readable pages)
	Tokens         int64 `json:"tokens"`       // their token counts (readable pages)
	// TempFiles / TempAllocatedBytes: temp files in pages/ (saves in
	// progress, or left by a crash until collect removes them after its
	// grace period); not accounted by the engine.
	TempFiles          int   `json:"tempFiles"`
	TempAllocatedBytes int64 `json:"tempAllocatedBytes"`
	// OldestAccess and NewestAccess are the least and the most recent last
	// access of the readable pages, as the engine would rebuild it at
	// start: the file's mtime (when it was written), moved forward to the
	// recency checkpoint's record when it names the page (clamped to now:
	// engine/evict's ApplyCheckpoint rule). nil without readable pages.
	OldestAccess *time.Time `json:"oldestAccess,omitempty"`
	NewestAccess *time.Time `json:"newestAccess,omitempty"`
	// CheckpointPages: readable pages the recency checkpoint names (0
	// without one: every access is then the file's mtime).
	CheckpointPages int `json:"checkpointPages"`
}

// Add adds o's counts to s (access times: the oldest and newest of both).
func (s *CacheStats) Add(o CacheStats) {
	s.Pages += o.Pages
	s.Unreadable += o.Unreadable
	s.AllocatedBytes += o.AllocatedBytes
	s.FileBytes += o.FileBytes
	s.LogicalBytes += o.LogicalBytes
	s.Tokens += o.Tokens
	s.TempFiles += o.TempFiles
	s.TempAllocatedBytes += o.TempAllocatedBytes
	s.CheckpointPages += o.CheckpointPages
	if o.OldestAccess != nil && (s.OldestAccess == nil || o.OldestAccess.Before(*s.OldestAccess)) {
		s.OldestAccess = o.OldestAccess
	}
	if o.NewestAccess != nil && (s.NewestAccess == nil || o.NewestAccess.After(*s.NewestAccess)) {
		s.NewestAccess = o.NewestAccess
	}
}

// CacheStats measures l's page cache (after DecodePages: pages not
// decoded count as unreadable; the counts of PageUsage). Each page file and temp file in pages/ is
// lstat'd again for its allocated bytes (a file gone since the listing
// counts 0 bytes). recency is the namespace's recency checkpoint (nil:
// none), now the clock its accesses are clamped to.
func (l *Listing) CacheStats(recs []recency.Record, now time.Time) CacheStats {
	var s CacheStats
	fsys := l.Namespace.st.fs
	alloc := func(path string) int64 {
		fi, err := fsys.Lstat(path)
		if err != nil {
			return 0
		}
		if a, ok := vfs.AllocatedBytes(fi); ok {
			return a
		}
		return (fi.Size() + 4095) &^ 4095 // no st_blocks: the length in 4 KiB blocks
	}
	// The policy's rule for recency across a restart (engine/evict's
	// ApplyCheckpoint): Access = max(mtime, min(recorded, now)).
	recorded := make(map[layout.PageKey]int64, len(recs))
	for _, r := range recs {
		recorded[r.Key] = r.Access
	}
	u := l.PageUsage()
	s.Pages, s.Unreadable, s.FileBytes, s.Tokens, s.LogicalBytes = u.Pages, u.Unreadable, u.FileBytes, u.Tokens, u.LogicalBytes
	seen := make(map[layout.PageKey]bool, len(l.Pages))
	for _, p := range l.Pages {
		s.AllocatedBytes += alloc(p.Path)
		if p.Snap == nil || p.Snap.Page == nil {
			continue
		}
		k := p.Snap.Page.Key
		if seen[k] {
			continue
		}
		seen[k] = true
		access := p.ModTime.UnixNano()
		if r, ok := recorded[k]; ok {
			s.CheckpointPages++
			access = max(access, min(r, now.UnixNano()))
		}
		at := time.Unix(0, access)
		if s.OldestAccess == nil || at.Before(*s.OldestAccess) {
			s.OldestAccess = &at
		}
		if s.NewestAccess == nil || at.After(*s.NewestAccess) {
			s.NewestAccess = &at
		}
	}
	for _, t := range l.Temps {
		if isUnder(t.Path, l.Namespace.PagesDir()) {
			s.TempFiles++
			s.TempAllocatedBytes += alloc(t.Path)
		}
	}
	return s
}

// ReadRecency reads the namespace's recency checkpoint (RecencyPath,
// engine/recency's format, read with recency.Read: its size checked
// before anything is allocated). A missing file is nil, nil. Errors:
// recency.ErrCheckpoint (a file that does not decode, or is not a regular
// file), or the open's or read's error.
func (n *Namespace) ReadRecency() ([]recency.Record, error) {
	path := n.RecencyPath()
	f, err := n.st.fs.Open(path)
	if vfs.IsNotExist(err) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		return nil, err
	}
	if !fi.Mode().IsRegular() {
		return nil, fmt.Errorf("%w: %s is not a regular file", recency.ErrCheckpoint, path)
	}
	recs, err := recency.Read(io.NewSectionReader(f, 0, fi.Size()), fi.Size())
	if err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	return recs, nil
}

// isUnder reports whether path is in dir or below it.
func isUnder(path, dir string) bool {
	return len(path) > len(dir) && path[:len(dir)] == dir && path[len(dir)] == '/'
}
