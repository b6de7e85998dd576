package main

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/kvpersist/kvpersist/engine/vfs"
	"github.com/kvpersist/kvpersist/internal/kvgen"
)

// lockNoticeAfter is how long a lock wait lasts before the CLI says what it
// is waiting for.
const lockNoticeAfter = 50 * time.Millisecond

// lockNoticeFS is the real file system whose Lock warns (once per wait) on
// the CLI's log when a namespace lock is not granted within
// lockNoticeAfter: another process's write, read or collect holds it.
type lockNoticeFS struct {
	vfs.FS
	c *cli
}

func (c *cli) lockNoticeFS() vfs.FS { return lockNoticeFS{vfs.Default, c} }

func (f lockNoticeFS) Lock(ctx context.Context, name string, exclusive, create bool) (func() error, error) {
	wctx, cancel := context.WithTimeout(ctx, lockNoticeAfter)
	unlock, err := f.FS.Lock(wctx, name, exclusive, create)
	cancel()
	if err == nil || ctx.Err() != nil || !errors.Is(err, context.DeadlineExceeded) {
		return unlock, err
	}
	how := "shared"
	if exclusive {
		how = "exclusive"
	}
	f.c.log.Warn("waiting for the namespace lock (another process's write, read or collect holds it)",
		"namespace", filepath.Dir(name), "mode", how)
	return f.FS.Lock(ctx, name, exclusive, create)
}

// cacheAllocBytes is what kvgen.NewCache(m, tokens, true, nil) allocates,
// in bytes: a K and a V buffer per layer of kvgen.Capacity(tokens) tokens,
// and the token ids.
func cacheAllocBytes(m kvgen.Model, tokens int) int64 {
	return 2*int64(m.Layers)*int64(m.TensorBytes(kvgen.Capacity(tokens))) + int64(tokens)*kvgen.IDSize
}

// memAvailable returns MemAvailable of /proc/meminfo, in bytes (the
// kernel's estimate of memory available for new allocations without
// swapping).
func memAvailable() (int64, error) {
	f, err := os.Open("/proc/meminfo")
	if err != nil {
		return 0, err
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		rest, ok := strings.CutPrefix(sc.Text(), "MemAvailable:")
		if !ok {
			continue
		}
		kb, ok := strings.CutSuffix(strings.TrimSpace(rest), " kB")
		if !ok {
			return 0, fmt.Errorf("/proc/meminfo: MemAvailable %q is not in kB", rest)
		}
		n, err := strconv.ParseInt(kb, 10, 64)
		if err != nil {
			return 0, fmt.Errorf("/proc/meminfo: MemAvailable: %w", err)
		}
		return n << 10, nil
	}
	if err := sc.Err(); err != nil {
		return 0, err
	}
	return 0, errors.New("/proc/meminfo has no MemAvailable line")
}

// checkMemory refuses (exit 2) when need bytes exceed the memory available;
// when that cannot be read (not Linux) it does not refuse.
func (c *cli) checkMemory(what string, need int64) error {
	avail, err := memAvailable()
	if err != nil {
		c.log.Debug("memory available unknown; not checked", "err", err)
		return nil
	}
	if need > avail {
		return fmt.Errorf("%s: needs %s (%d bytes) of memory for the cache it builds, the machine has %s available (MemAvailable); use fewer --tokens or a smaller --model",
			what, humanBytes(need), need, humanBytes(avail))
	}
	return nil
}
