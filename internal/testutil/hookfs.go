package testutil

import (
	"context"
	"os"

	"github.com/kvpersist/kvpersist/engine/vfs"
)

// HookFS wraps a vfs.FS (FS, required: e.g. vfs.Default) with observation points,
// for tests that must force an interleaving of jobs rather than hope for
// it. Every hook is optional and runs on the calling goroutine.
type HookFS struct {
	vfs.FS
	// AfterLstat runs after the real Lstat, before it returns.
	AfterLstat func(name string, err error)
	// BeforeLock runs before the real Lock.
	BeforeLock func(name string, exclusive bool)
	// OnLockBlocked, when set, makes Lock try first without waiting (the OS
	// FS's Lock takes the flock before it looks at ctx, so a done ctx makes
	// it a try-lock) and run the hook when that fails, before it waits.
	OnLockBlocked func(name string, exclusive bool)
	// BeforeRename runs before the real Rename.
	BeforeRename func(oldname, newname string)
}

// Lstat implements vfs.FS.
func (h *HookFS) Lstat(name string) (os.FileInfo, error) {
	fi, err := h.FS.Lstat(name)
	if h.AfterLstat != nil {
		h.AfterLstat(name, err)
	}
	return fi, err
}

// Lock implements vfs.FS.
func (h *HookFS) Lock(ctx context.Context, name string, exclusive, create bool) (func() error, error) {
	if h.BeforeLock != nil {
		h.BeforeLock(name, exclusive)
	}
	if h.OnLockBlocked != nil {
		done, cancel := context.WithCancel(context.Background())
		cancel()
		if u, err := h.FS.Lock(done, name, exclusive, create); err == nil || vfs.IsNotExist(err) {
			return u, err
		}
		h.OnLockBlocked(name, exclusive)
	}
	return h.FS.Lock(ctx, name, exclusive, create)
}

// Rename implements vfs.FS.
func (h *HookFS) Rename(oldname, newname string) error {
	if h.BeforeRename != nil {
		h.BeforeRename(oldname, newname)
	}
	return h.FS.Rename(oldname, newname)
}
