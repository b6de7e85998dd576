package testutil

import (
	"errors"
	"io/fs"
	"os"
	"path/filepath"
	"syscall"

	"github.com/kvpersist/kvpersist/engine/layout"
)

// PageTree measures the page cache on disk independently of the engine:
// a walk of <root>/<ns>/pages for each of namespaces (every directory
// under root when none are given): the allocated bytes (st_blocks × 512,
// from lstat) of page files and of temp files, and how many of each.
// Files and directories that vanish during the walk (unlinked by an
// eviction beside it) are skipped, so it can run beside an engine.
func PageTree(tb TB, root string, namespaces ...string) (pageBytes, tempBytes int64, pages, temps int) {
	tb.Helper()
	if len(namespaces) == 0 {
		ents, err := os.ReadDir(root)
		if err != nil {
			tb.Fatal(err)
		}
		for _, e := range ents {
			if e.IsDir() {
				namespaces = append(namespaces, e.Name())
			}
		}
	}
	for _, ns := range namespaces {
		err := filepath.WalkDir(filepath.Join(root, ns, layout.PagesDirName), func(path string, d fs.DirEntry, err error) error {
			if err != nil {
				if errors.Is(err, fs.ErrNotExist) {
					return nil
				}
				return err
			}
			if d.IsDir() {
				return nil
			}
			var st syscall.Stat_t
			if err := syscall.Lstat(path, &st); err != nil {
				if errors.Is(err, syscall.ENOENT) {
					return nil
				}
				return err
			}
			if layout.IsTemp(d.Name()) {
				tempBytes += st.Blocks * 512
				temps++
			} else {
				pageBytes += st.Blocks * 512
				pages++
			}
			return nil
		})
		if err != nil {
			tb.Fatal(err)
		}
	}
	return pageBytes, tempBytes, pages, temps
}
