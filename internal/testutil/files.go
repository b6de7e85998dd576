package testutil

import (
	"errors"
	"io/fs"
	"os"
	"path/filepath"

	"github.com/kvpersist/kvpersist/engine/layout"
	"github.com/kvpersist/kvpersist/engine/store"
	"golang.org/x/sys/unix"
)

// CopyFile copies src to dst, creating dst's directory.
func CopyFile(tb TB, src, dst string) {
	tb.Helper()
	b, err := os.ReadFile(src)
	if err != nil {
		tb.Fatal(err)
	}
	if err := os.MkdirAll(filepath.Dir(dst), 0o755); err != nil {
		tb.Fatal(err)
	}
	if err := os.WriteFile(dst, b, 0o644); err != nil {
		tb.Fatal(err)
	}
}

// CopyTree copies every file and directory under src to dst.
func CopyTree(tb TB, src, dst string) {
	tb.Helper()
	err := filepath.WalkDir(src, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(src, p)
		if d.IsDir() {
			return os.MkdirAll(filepath.Join(dst, rel), 0o755)
		}
		b, err := os.ReadFile(p)
		if err != nil {
			return err
		}
		return os.WriteFile(filepath.Join(dst, rel), b, 0o644)
	})
	if err != nil {
		tb.Fatal(err)
	}
}

// FilesMatching lists every path under root whose base name satisfies
// match; a missing root lists nothing.
func FilesMatching(tb TB, root string, match func(name string) bool) []string {
	tb.Helper()
	var out []string
	err := filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if match(d.Name()) {
			out = append(out, p)
		}
		return nil
	})
	if err != nil && !errors.Is(err, fs.ErrNotExist) {
		tb.Fatal(err)
	}
	return out
}

// TempFiles lists every kvpersist temp file (layout.IsTemp) under root.
func TempFiles(tb TB, root string) []string {
	tb.Helper()
	return FilesMatching(tb, root, layout.IsTemp)
}

// BlockPath is where the store model puts the block of SHA-256 hash in the
// namespace directory nsDir (kvpersist's fan-out; store.Namespace.BlockPath).
func BlockPath(nsDir, hash string) string {
	return store.NamespaceAt(nsDir, store.Options{}).BlockPath(hash, false)
}

// LegacyBlockPath is where the Bun worker put a block: flat in blocks/.
func LegacyBlockPath(nsDir, hash string) string {
	return store.NamespaceAt(nsDir, store.Options{}).BlockPath(hash, true)
}

// PagePath is where the store model puts the page of key k in the
// namespace directory nsDir (store.Namespace.PagePath).
func PagePath(nsDir string, k layout.PageKey) string {
	return store.NamespaceAt(nsDir, store.Options{}).PagePath(k)
}

// PagesDir is the namespace directory's pages/ (store.Namespace.PagesDir).
func PagesDir(nsDir string) string {
	return store.NamespaceAt(nsDir, store.Options{}).PagesDir()
}

// BlocksDir is the namespace directory's blocks/ (store.Namespace.BlocksDir).
func BlocksDir(nsDir string) string {
	return store.NamespaceAt(nsDir, store.Options{}).BlocksDir()
}

// WriteFile writes data to path (mode 0640), creating its directory.
func WriteFile(tb TB, path, data string) string {
	tb.Helper()
	if err := os.MkdirAll(filepath.Dir(path), 0o750); err != nil {
		tb.Fatal(err)
	}
	if err := os.WriteFile(path, []byte(data), 0o640); err != nil {
		tb.Fatal(err)
	}
	return path
}

// EvictRange drops the pages of [off, off+n) of the file at path from the
// page cache (fdatasync, then posix_fadvise(FADV_DONTNEED) of that range):
// a file partly cached, as memory pressure leaves one.
func EvictRange(tb TB, path string, off, n int64) {
	tb.Helper()
	fd, err := unix.Open(path, unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		tb.Fatal(err)
	}
	defer unix.Close(fd)
	if err := unix.Fdatasync(fd); err != nil {
		tb.Fatal(err)
	}
	if err := unix.Fadvise(fd, off, n, unix.FADV_DONTNEED); err != nil {
		tb.Fatal(err)
	}
}

// EvictTree drops every regular file under root (root itself when it is
// one) from the page cache: fdatasync, then posix_fadvise(FADV_DONTNEED),
// so the next read of them is cold (from the disk).
func EvictTree(tb TB, root string) {
	tb.Helper()
	err := filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
		if err != nil || !d.Type().IsRegular() {
			return err
		}
		fd, err := unix.Open(p, unix.O_RDONLY|unix.O_CLOEXEC, 0)
		if err != nil {
			return err
		}
		defer unix.Close(fd)
		if err := unix.Fdatasync(fd); err != nil {
			return err
		}
		return unix.Fadvise(fd, 0, 0, unix.FADV_DONTNEED)
	})
	if err != nil {
		tb.Fatal(err)
	}
}

// FlipByte flips bit 4 of the byte at offset off of the file at path, in
// place (size and name unchanged): the smallest corruption a verified read
// must catch.
func FlipByte(tb TB, path string, off int64) {
	tb.Helper()
	f, err := os.OpenFile(path, os.O_RDWR, 0)
	if err != nil {
		tb.Fatal(err)
	}
	defer f.Close()
	b := make([]byte, 1)
	if _, err := f.ReadAt(b, off); err != nil {
		tb.Fatal(err)
	}
	b[0] ^= 0x10
	if _, err := f.WriteAt(b, off); err != nil {
		tb.Fatal(err)
	}
}
