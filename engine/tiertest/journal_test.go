package tiertest

import (
	"bufio"
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/zeebo/xxh3"

	"github.com/kvpersist/kvpersist/engine"
	"github.com/kvpersist/kvpersist/engine/layout"
	"github.com/kvpersist/kvpersist/internal/faultproxy"
)

// childEnv, when set, makes the test binary run uploaderChild instead of
// the tests (TestMain): a process that the crash tests SIGKILL.
const childEnv = "KVPERSIST_TIERTEST_CHILD"

// uploaderChild opens an engine on root (args: root, endpoint, bucket,
// prefix, access key, secret key, and optionally the page cache's
// capacity in bytes, the tier's FetchPages and Config.TempGrace) with the
// store's sync on, then runs the commands read from stdin, printing "ok"
// after each:
//
//	save BASE N          saves the N tokens BASE, BASE+1, ... as a prefix
//	write NAME BASE N    writes them as the page manifest NAME
//	load BASE N          loads them (a read-through of what is remote)
//
// It never closes the engine: the test kills it.
func uploaderChild(args []string) int {
	if len(args) != 6 && len(args) != 9 {
		fmt.Fprintln(os.Stderr, "child: want root endpoint bucket prefix access secret [capacity fetchpages tempgrace]")
		return 2
	}
	cfg := engine.Config{Root: args[0], Logger: slog.New(slog.DiscardHandler), Remote: &engine.RemoteTier{
		Store:            engine.RemoteConfig{Endpoint: args[1], Bucket: args[2], Prefix: args[3], AccessKey: args[4], SecretKey: args[5], MaxRetries: 1},
		UploadBackoffMin: 20 * time.Millisecond, UploadBackoffMax: 300 * time.Millisecond,
	}}
	if len(args) == 9 {
		cfg.CapacityBytes, _ = strconv.ParseInt(args[6], 10, 64)
		cfg.Remote.FetchPages, _ = strconv.Atoi(args[7])
		cfg.TempGrace, _ = time.ParseDuration(args[8])
	}
	e, err := engine.New(cfg)
	if err != nil {
		fmt.Fprintln(os.Stderr, "child:", err)
		return 1
	}
	sc := bufio.NewScanner(os.Stdin)
	for sc.Scan() {
		f := strings.Fields(sc.Text())
		var res engine.Result
		switch {
		case len(f) == 3 && f[0] == "save":
			tokens := childTokens(f[1], f[2])
			c := newKV(len(tokens) + 100)
			c.fill(tokens)
			res = e.Do(context.Background(), &engine.SavePrefixRequest{Namespace: ns, Identity: ident, Tokens: tokens, PageTokens: ptoks, Tensors: c.specs(len(tokens))})
		case len(f) == 3 && f[0] == "load":
			tokens := childTokens(f[1], f[2])
			c := newKV(len(tokens) + 100)
			res = e.Do(context.Background(), &engine.LoadPrefixRequest{Namespace: ns, Identity: ident, Tokens: tokens, PageTokens: ptoks, Dest: c.specs(len(tokens))})
		case len(f) == 4 && f[0] == "write":
			tokens := childTokens(f[2], f[3])
			c := newKV(len(tokens))
			c.fill(tokens)
			res = e.Do(context.Background(), &engine.WriteRequest{Ref: engine.Ref{Namespace: ns, Name: f[1]}, Layout: engine.Pages,
				Identity: ident, Tokens: tokens, PageTokens: ptoks, Caches: []engine.EntrySpec{{Tensors: c.specs(len(tokens))}}})
		default:
			res.Err = fmt.Errorf("bad command %q", sc.Text())
		}
		if res.Err != nil {
			fmt.Fprintln(os.Stderr, "child:", res.Err)
			return 1
		}
		fmt.Println("ok")
	}
	return 0
}

func childTokens(base, n string) []uint32 {
	b, _ := strconv.Atoi(base)
	c, _ := strconv.Atoi(n)
	return seq(b, c)
}

// child is a running uploaderChild.
type child struct {
	t     *testing.T
	cmd   *exec.Cmd
	in    *bufio.Writer
	out   *bufio.Scanner
	err   *bytes.Buffer
	mu    sync.Mutex
	dead  bool
	stdin interface{ Close() error }
}

// startChild starts an uploaderChild on root whose store is endpoint. It
// is killed at the test's end if the test did not kill it.
func startChild(t *testing.T, root, prefix, endpoint string, extra ...string) *child {
	t.Helper()
	cmd := exec.Command(os.Args[0], append([]string{root, endpoint, srv.Bucket, prefix, srv.AccessKey, srv.SecretKey}, extra...)...)
	cmd.Env = append(os.Environ(), childEnv+"=1")
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	c := &child{t: t, cmd: cmd, err: &bytes.Buffer{}}
	cmd.Stderr = c.err
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	in, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	c.stdin, c.in, c.out = in, bufio.NewWriter(in), bufio.NewScanner(out)
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(c.kill)
	return c
}

// do runs one command and waits for its "ok".
func (c *child) do(format string, a ...any) {
	c.t.Helper()
	fmt.Fprintf(c.in, format+"\n", a...)
	if err := c.in.Flush(); err != nil {
		c.t.Fatal(err)
	}
	if !c.out.Scan() || c.out.Text() != "ok" {
		c.kill()
		c.t.Fatalf("child: %q after %q; stderr:\n%s", c.out.Text(), fmt.Sprintf(format, a...), c.err.String())
	}
}

// kill SIGKILLs the child and waits for it.
func (c *child) kill() {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.dead {
		return
	}
	c.dead = true
	_ = c.cmd.Process.Signal(syscall.SIGKILL)
	_ = c.cmd.Wait()
	c.stdin.Close()
	if s := c.err.String(); strings.Contains(s, "DATA RACE") || strings.Contains(s, "panic") {
		c.t.Errorf("child: %s", s)
	}
}

// journalList decodes an uploads journal from ARCHITECTURE.md's table
// alone (an independent reader): an optional snapshot (magic "KVPUPL1\n",
// u32 P, u32 M, P raw keys, M length-prefixed names, XXH3-64), then
// records (magic "UPR\n", u8 op, u8 L, L bytes, XXH3-64), replayed in
// order. It stops at the first record that is incomplete or does not
// check (another process may be appending it). snapshotOnly reports a
// file that is a valid snapshot and nothing else.
func journalList(t *testing.T, path string) (pages map[layout.PageKey]bool, names map[string]bool, snapshotOnly bool) {
	t.Helper()
	pages, names = map[layout.PageKey]bool{}, map[string]bool{}
	b, err := os.ReadFile(path)
	if errors.Is(err, os.ErrNotExist) {
		return pages, names, false
	}
	if err != nil {
		t.Fatal(err)
	}
	off := 0
	if len(b) >= 24 && string(b[:8]) == "KVPUPL1\n" {
		np, nm := int(binary.LittleEndian.Uint32(b[8:])), int(binary.LittleEndian.Uint32(b[12:]))
		off = 16
		for range np {
			pages[layout.PageKey(b[off:off+32])] = true
			off += 32
		}
		for range nm {
			l := int(b[off])
			names[string(b[off+1:off+1+l])] = true
			off += 1 + l
		}
		if binary.LittleEndian.Uint64(b[off:]) != xxh3.Hash(b[:off]) {
			t.Fatalf("%s: the snapshot's hash does not check", path)
		}
		off += 8
		snapshotOnly = off == len(b)
	}
	for off+14 <= len(b) && string(b[off:off+4]) == "UPR\n" {
		op, l := b[off+4], int(b[off+5])
		if off+14+l > len(b) || binary.LittleEndian.Uint64(b[off+6+l:]) != xxh3.Hash(b[off:off+6+l]) {
			break
		}
		p := b[off+6 : off+6+l]
		switch op {
		case 1:
			pages[layout.PageKey(p)] = true
		case 2:
			delete(pages, layout.PageKey(p))
		case 3:
			names[string(p)] = true
		case 4:
			delete(names, string(p))
		}
		off += 14 + l
	}
	return pages, names, snapshotOnly
}

// journalHolds reports whether the journal at path lists every key and
// name.
func journalHolds(t *testing.T, path string, keys []layout.PageKey, names ...string) bool {
	p, n, _ := journalList(t, path)
	for _, k := range keys {
		if !p[k] {
			return false
		}
	}
	for _, m := range names {
		if !n[m] {
			return false
		}
	}
	return true
}

// TestUploadsSurviveSIGKILL: a process saves a conversation and writes a
// page manifest while the store is unreachable, so every upload is
// pending; its journal lists them within a group commit of the saves'
// acks (before: nothing was written before Close), and it is SIGKILLed.
// A new engine on the same root with the store reachable uploads them
// all (no save names them): the bucket holds every page and the
// manifest, byte-identical to the local files.
func TestUploadsSurviveSIGKILL(t *testing.T) {
	prefix := bucketPrefix(t)
	root := t.TempDir()
	conv, named := seq(51000, 4*ptoks+3), seq(53000, 2*ptoks+1)
	keys := append(keysOf(t, conv), keysOf(t, named)...)
	p := faultproxy.Start(t, srv.Endpoint)
	p.Set(faultproxy.Rule{Kinds: faultproxy.Any, Fault: faultproxy.Refuse})
	c := startChild(t, root, prefix, p.Endpoint)
	c.do("save 51000 %d", len(conv))
	c.do("write named-1 53000 %d", len(named))
	path := filepath.Join(root, ns, layout.UploadsName)
	waitFor(t, "the journal to list the pending uploads", func() bool { return journalHolds(t, path, keys, "named-1") })
	c.kill()
	if got := objects(t, openStore(t, prefix)); len(got) != 0 {
		t.Fatalf("the unreachable store holds %d objects", len(got))
	}

	rec := newRecorder(t)
	e := newEngine(t, root, prefix, rec, nil)
	closeEngine(t, e)
	checkObjects(t, prefix, root, keys, "named-1")
	// Close compacted the journal: a snapshot listing nothing.
	if pages, names, only := journalList(t, path); len(pages)+len(names) != 0 || !only {
		t.Fatalf("journal after Close lists %d pages, %v (a snapshot alone: %v)", len(pages), names, only)
	}
}

// TestJournalCompactedWhileAnotherProcessAppends: two processes share a
// root, their uploads pending (the store unreachable). Process B (a
// child) saves Y; engine A (this process) saves X and closes, abandoning
// its uploads and compacting the journal (a snapshot of X and Y) under
// the namespace's exclusive lock while B runs. B then saves Z: its
// records go to the new file (it opens it again), not to the one A's
// rename replaced. B is SIGKILLed; a new engine uploads X, Y and Z.
func TestJournalCompactedWhileAnotherProcessAppends(t *testing.T) {
	prefix := bucketPrefix(t)
	root := t.TempDir()
	x, y, z := seq(55000, 2*ptoks+1), seq(57000, 3*ptoks), seq(59000, 2*ptoks+7)
	kx, ky, kz := keysOf(t, x), keysOf(t, y), keysOf(t, z)
	p := faultproxy.Start(t, srv.Endpoint)
	p.Set(faultproxy.Rule{Kinds: faultproxy.Any, Fault: faultproxy.Refuse})
	path := filepath.Join(root, ns, layout.UploadsName)

	b := startChild(t, root, prefix, p.Endpoint)
	b.do("save 57000 %d", len(y))
	waitFor(t, "B's records", func() bool { return journalHolds(t, path, ky) })

	a := newEngine(t, root, prefix, newRecorder(t), func(rt *engine.RemoteTier) {
		rt.Store.Endpoint = p.Endpoint
		rt.Store.MaxRetries = 1
	})
	save(t, a, x)
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if err := a.Close(ctx); !errors.Is(err, engine.ErrUploadsAbandoned) {
		t.Fatalf("A's Close: %v, want ErrUploadsAbandoned", err)
	}
	if _, _, only := journalList(t, path); !only || !journalHolds(t, path, append(slices.Clone(kx), ky...)) {
		t.Fatal("A's Close did not compact the journal into a snapshot listing X and Y")
	}

	b.do("save 59000 %d", len(z))
	waitFor(t, "B's records after the compaction", func() bool { return journalHolds(t, path, kz) })
	b.kill()

	e := newEngine(t, root, prefix, newRecorder(t), nil)
	closeEngine(t, e)
	checkObjects(t, prefix, root, slices.Concat(kx, ky, kz))
}

// TestFullUploadQueueLosesNothing: with a queue of one upload and one
// worker, a save of 8 pages and a page manifest find the queue full
// while the store is unreachable: the pages it refuses are spilled to
// the journal (before: dropped, left local-only until a later save named
// them). Once the store answers, the queue drains and is refilled from
// the journal until every page and the manifest are in the bucket,
// byte-identical to the local files, without any further save.
func TestFullUploadQueueLosesNothing(t *testing.T) {
	prefix := bucketPrefix(t)
	root := t.TempDir()
	conv, named := seq(61000, 8*ptoks), seq(63000, 3*ptoks)
	keys := append(keysOf(t, conv), keysOf(t, named)...)
	p := faultproxy.Start(t, srv.Endpoint)
	p.Set(faultproxy.Rule{Kinds: faultproxy.Any, Fault: faultproxy.Refuse})
	e := newEngine(t, root, prefix, newRecorder(t), func(rt *engine.RemoteTier) {
		rt.Store.Endpoint = p.Endpoint
		rt.Store.MaxRetries = 1
		rt.UploadQueue, rt.UploadWorkers = 1, 1
	})
	save(t, e, conv)
	writePages(t, e, "named-q", named)
	p.Clear()
	st := openStore(t, prefix)
	waitFor(t, "every page and the manifest in the bucket", func() bool { return len(objects(t, st)) == len(keys)+1 })
	closeEngine(t, e)
	checkObjects(t, prefix, root, keys, "named-q")
}

// journalRecord is one record of the uploads journal as ARCHITECTURE.md's
// table gives it: "UPR\n", op, payload length, payload, xxh3-64 of all
// that (little-endian).
func journalRecord(op byte, payload []byte) []byte {
	b := append([]byte("UPR\n"), op, byte(len(payload)))
	b = append(b, payload...)
	return binary.LittleEndian.AppendUint64(b, xxh3.Hash(b))
}

// TestTornJournalTailReplaysGoodRecords: a journal of records alone
// (encoded from ARCHITECTURE.md's table) whose last record is torn, as a
// crash in the middle of an append leaves it: New replays the good
// records (their pages are uploaded) and skips the torn one with a Warn;
// Close compacts the journal into an empty snapshot.
func TestTornJournalTailReplaysGoodRecords(t *testing.T) {
	prefix := bucketPrefix(t)
	root := t.TempDir()
	conv := seq(65000, 3*ptoks)
	keys := keysOf(t, conv)
	local := newEngineCfg(t, root, prefix, newRecorder(t), nil, noTier)
	save(t, local, conv)
	closeEngine(t, local)
	rec := journalRecord
	torn := rec(1, keys[2][:])
	j := slices.Concat(rec(1, keys[0][:]), rec(1, keys[1][:]), torn[:len(torn)-5])
	path := filepath.Join(root, ns, layout.UploadsName)
	if err := os.WriteFile(path, j, 0o640); err != nil {
		t.Fatal(err)
	}
	var logs bytes.Buffer
	var lmu sync.Mutex
	e := newEngineCfg(t, root, prefix, newRecorder(t), nil, func(c *engine.Config) {
		c.Logger = slog.New(slog.NewTextHandler(lockedWriter{&lmu, &logs}, nil))
	})
	closeEngine(t, e)
	checkObjects(t, prefix, root, keys[:2])
	lmu.Lock()
	l := logs.String()
	lmu.Unlock()
	if !strings.Contains(l, "uploads journal ignored in part") || !strings.Contains(l, "bytes="+strconv.Itoa(len(torn)-5)) {
		t.Fatalf("no Warn naming the torn record's %d bytes: %q", len(torn)-5, l)
	}
	if pages, names, only := journalList(t, path); len(pages)+len(names) != 0 || !only {
		t.Fatalf("journal after Close lists %d pages, %v (a snapshot alone: %v)", len(pages), names, only)
	}
}
