package layout

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"

	"github.com/kvpersist/kvpersist/engine/vfs"
)

// FilePerm is the mode of every file kvpersist creates.
const FilePerm os.FileMode = 0o640

// DirPerm is the mode of every directory kvpersist creates.
const DirPerm os.FileMode = 0o750

// PublishOptions tune Publish.
type PublishOptions struct {
	// Sync fsyncs (fdatasync) the file before the rename and, when SyncDir,
	// the directory after it. Off only for tests or tmpfs.
	Sync bool
	// SyncDir fsyncs the target's directory after the rename. Writers of
	// many blocks turn it off and sync each directory once (SyncDirs).
	SyncDir bool
	// Size, when > 0, preallocates that many bytes (fallocate).
	Size int64
}

// Publish writes a new file at target atomically and, with Sync, durably,
// the one way every kvpersist writer publishes (after prometheus tsdb's
// fileutil): a uniquely named temp file in target's directory (TempPath),
// write, fdatasync, close, rename over target, fsync the directory. On any
// error before the rename the temp file is removed and target is untouched;
// a failed fsync is never retried. An error after the rename (the directory
// sync) is returned: target then holds the new content but may not survive a
// power cut.
func Publish(fsys vfs.FS, target string, opt PublishOptions, write func(f vfs.File) error) (err error) {
	tmp := TempPath(target)
	f, err := fsys.Create(tmp, FilePerm)
	if err != nil {
		return fmt.Errorf("layout: create %s: %w", tmp, err)
	}
	closed := false
	defer func() {
		if err != nil {
			if !closed {
				f.Close()
			}
			if rerr := fsys.Remove(tmp); rerr != nil && !vfs.IsNotExist(rerr) {
				err = errors.Join(err, fmt.Errorf("layout: removing temp file: %w", rerr))
			}
		}
	}()
	if opt.Size > 0 {
		if err = f.Allocate(opt.Size); err != nil {
			return fmt.Errorf("layout: preallocate %s: %w", tmp, err)
		}
	}
	if err = write(f); err != nil {
		return err
	}
	if opt.Sync {
		if err = f.Sync(); err != nil {
			return fmt.Errorf("layout: fsync %s: %w", tmp, err)
		}
	}
	closed = true
	if err = f.Close(); err != nil {
		return fmt.Errorf("layout: close %s: %w", tmp, err)
	}
	if err = fsys.Rename(tmp, target); err != nil {
		return fmt.Errorf("layout: rename %s: %w", target, err)
	}
	if opt.Sync && opt.SyncDir {
		if derr := fsys.SyncDir(filepath.Dir(target)); derr != nil {
			return fmt.Errorf("layout: fsync directory of %s: %w", target, derr)
		}
	}
	return nil
}

// WriteFull writes all of b at off, failing on a short write.
func WriteFull(f vfs.File, b []byte, off int64) error {
	for len(b) > 0 {
		n, err := f.WriteAt(b, off)
		if err != nil {
			return fmt.Errorf("layout: write %s at %d: %w", f.Name(), off, err)
		}
		if n == 0 {
			return fmt.Errorf("layout: write %s at %d: no progress", f.Name(), off)
		}
		b, off = b[n:], off+int64(n)
	}
	return nil
}

// MkdirAllSynced creates dir and any missing parents up to (not including)
// stop, fsyncing each parent whose entries changed, so that a new directory
// survives a power cut. It refuses a path element that is a symlink.
func MkdirAllSynced(fsys vfs.FS, dir, stop string, sync bool) error {
	st, err := fsys.Lstat(dir)
	if err == nil {
		if st.Mode()&os.ModeSymlink != 0 || !st.IsDir() {
			return fmt.Errorf("layout: %s is not a directory (symlinks are refused)", dir)
		}
		return nil
	}
	if !vfs.IsNotExist(err) {
		return err
	}
	parent := filepath.Dir(dir)
	if parent != dir && dir != stop && parent != stop {
		if err := MkdirAllSynced(fsys, parent, stop, sync); err != nil {
			return err
		}
	}
	if err := fsys.MkdirAll(dir, DirPerm); err != nil {
		return err
	}
	if sync {
		if err := fsys.SyncDir(parent); err != nil {
			return fmt.Errorf("layout: fsync directory %s: %w", parent, err)
		}
	}
	return nil
}
