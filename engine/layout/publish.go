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
// power cut. Publish is Stage, write, Commit.
func Publish(fsys vfs.FS, target string, opt PublishOptions, write func(f vfs.File) error) error {
	st, err := Stage(fsys, target, opt.Size)
	if err != nil {
		return err
	}
	if err := write(st.File); err != nil {
		st.Abort()
		return err
	}
	return st.Commit(opt)
}

// Staged is a temp file being written, not yet published. Exactly one of
// Commit or Abort must be called.
type Staged struct {
	File   vfs.File
	Tmp    string // the temp file's path (TempPath(Target))
	Target string
	fsys   vfs.FS
}

// Stage creates the temp file for target (exclusively, mode FilePerm, not
// following symlinks) and preallocates size bytes when size > 0.
func Stage(fsys vfs.FS, target string, size int64) (*Staged, error) {
	tmp := TempPath(target)
	f, err := fsys.Create(tmp, FilePerm)
	if err != nil {
		return nil, fmt.Errorf("layout: create %s: %w", tmp, err)
	}
	st := &Staged{File: f, Tmp: tmp, Target: target, fsys: fsys}
	if size > 0 {
		if err := f.Allocate(size); err != nil {
			st.Abort()
			return nil, fmt.Errorf("layout: preallocate %s: %w", tmp, err)
		}
	}
	return st, nil
}

// Abort closes and removes the temp file, returning the removal's error.
func (s *Staged) Abort() error {
	s.File.Close()
	if err := s.fsys.Remove(s.Tmp); err != nil && !vfs.IsNotExist(err) {
		return fmt.Errorf("layout: removing temp file: %w", err)
	}
	return nil
}

// Commit makes the temp file durable (opt.Sync: fdatasync), closes it and
// renames it over Target, then (opt.Sync && opt.SyncDir) fsyncs Target's
// directory. A failure before the rename aborts: the temp file is removed
// and Target is untouched. A failed fsync is not retried.
func (s *Staged) Commit(opt PublishOptions) (err error) {
	if opt.Sync {
		if err = s.File.Sync(); err != nil {
			return errors.Join(fmt.Errorf("layout: fsync %s: %w", s.Tmp, err), s.Abort())
		}
	}
	if err = s.File.Close(); err != nil {
		_ = s.fsys.Remove(s.Tmp)
		return fmt.Errorf("layout: close %s: %w", s.Tmp, err)
	}
	if err = s.fsys.Rename(s.Tmp, s.Target); err != nil {
		if rerr := s.fsys.Remove(s.Tmp); rerr != nil && !vfs.IsNotExist(rerr) {
			err = errors.Join(err, rerr)
		}
		return fmt.Errorf("layout: rename %s: %w", s.Target, err)
	}
	if opt.Sync && opt.SyncDir {
		if derr := s.fsys.SyncDir(filepath.Dir(s.Target)); derr != nil {
			return fmt.Errorf("layout: fsync directory of %s: %w", s.Target, derr)
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
