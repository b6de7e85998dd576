package engine_test

// Crash consistency with real SIGKILLs: a helper process (this test binary
// re-executed, see TestMain) saves and collects through the engine with fsync
// on; the test kills it at random moments and checks the store it leaves.
//
// This file also holds what the crash, soak and two-process tests share:
// the Tiny cache requests, the version metadata that lets a reader tell which
// write produced a snapshot, the store scan that reads every snapshot back
// verified, and the helper-process plumbing.

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
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

	"github.com/kvpersist/kvpersist/engine"
	"github.com/kvpersist/kvpersist/engine/jobs"
	"github.com/kvpersist/kvpersist/engine/layout"
	"github.com/kvpersist/kvpersist/engine/vfs"
	"github.com/kvpersist/kvpersist/internal/kvgen"
	"github.com/kvpersist/kvpersist/internal/testutil"
)

// runHelper runs the helper process selected by mode (see TestMain) and
// returns its exit code.
func runHelper(mode string, args []string) int {
	switch mode {
	case "crash-writer":
		return crashWriterMain(args)
	case "writer":
		return writerMain(args)
	case "collector":
		return collectorMain(args)
	case "crash-prefix":
		return crashPrefixMain(args)
	case "prefix-writer":
		return prefixWriterMain(args)
	case "serving-soak":
		return servingSoakMain(args)
	case "events-evictor":
		return eventsEvictorMain(args)
	}
	fmt.Fprintf(os.Stderr, "unknown helper mode %q\n", mode)
	return 2
}

// soakLong reports whether the long variants run (make soak).
func soakLong() bool { return os.Getenv("KVPERSIST_SOAK") == "long" }

var discardLogger = slog.New(slog.DiscardHandler)

// tinyBlockBytes is the block size of every block-layout write here: the
// smallest allowed, so a Tiny snapshot has many blocks (128 tokens of one
// head per block) and a conversation that grows keeps its earlier full blocks.
const tinyBlockBytes = jobs.MinBlockBytes

// cacheEntries describes the first tokens tokens of c as mlx-lm's caches are
// saved: per layer {"type":"KVCache","offset":T} with K and V, then the
// attachment {"name":"tokens"} with the int32 token ids.
func cacheEntries(c *kvgen.Cache, tokens int) (caches, attachments []jobs.EntrySpec) {
	caches, attachments, _ = kvgen.CacheRequest(c, tokens)
	return caches, attachments
}

// version identifies one write: who wrote it, its sequence number (unique in
// a test) and the tokens saved. The content of a Tiny snapshot depends only
// on Tokens, so Tokens alone says which bytes every slot must hold.
type version struct {
	Writer string
	Seq    int64
	Tokens int
}

func (v version) meta() layout.Meta {
	return layout.Meta{
		"model":  json.RawMessage(strconv.Quote(kvgen.Tiny.Name)),
		"writer": json.RawMessage(strconv.Quote(v.Writer)),
		"seq":    json.RawMessage(strconv.FormatInt(v.Seq, 10)),
		"tokens": json.RawMessage(strconv.Itoa(v.Tokens)),
	}
}

// versionOf decodes a snapshot header's version metadata.
func versionOf(h *layout.Header) (version, error) {
	var v version
	var model string
	for k, dst := range map[string]any{"model": &model, "writer": &v.Writer, "seq": &v.Seq, "tokens": &v.Tokens} {
		raw, ok := h.Meta[k]
		if !ok {
			return v, fmt.Errorf("metadata %q missing", k)
		}
		if err := json.Unmarshal(raw, dst); err != nil {
			return v, fmt.Errorf("metadata %q: %w", k, err)
		}
	}
	if model != kvgen.Tiny.Name || v.Tokens <= 0 {
		return v, fmt.Errorf("metadata names model %q with %d tokens", model, v.Tokens)
	}
	return v, nil
}

var expectedByTokens sync.Map // tokens -> [][]byte

// expectedSlots returns every slot's logical bytes of a Tiny cache of tokens
// tokens (kvgen's element-by-element reference, independent of views).
func expectedSlots(tokens int) [][]byte {
	if v, ok := expectedByTokens.Load(tokens); ok {
		return v.([][]byte)
	}
	c := kvgen.NewCache(kvgen.Tiny, tokens, false, nil)
	out := make([][]byte, c.Slots())
	for i := range out {
		out[i] = c.Expected(i)
	}
	v, _ := expectedByTokens.LoadOrStore(tokens, out)
	return v.([][]byte)
}

// checkContent compares what a read returned with the bytes of a Tiny cache
// of tokens tokens.
func checkContent(dest [][]byte, tokens int) error {
	want := expectedSlots(tokens)
	if len(dest) != len(want) {
		return fmt.Errorf("%d slots, a cache of %d tokens has %d", len(dest), tokens, len(want))
	}
	for i := range want {
		if !bytes.Equal(dest[i], want[i]) {
			return fmt.Errorf("slot %d (%d bytes) differs from the cache of %d tokens (%d bytes)", i, len(dest[i]), tokens, len(want[i]))
		}
	}
	return nil
}

// destFor allocates one buffer per slot of h.
func destFor(h *layout.Header) ([][]byte, error) {
	slots := h.Slots()
	dest := make([][]byte, len(slots))
	for i, s := range slots {
		if s.Bytes < 0 || s.Bytes > 16<<20 {
			return nil, fmt.Errorf("slot %d claims %d bytes", i, s.Bytes)
		}
		dest[i] = make([]byte, s.Bytes)
	}
	return dest, nil
}

// verifySnapshot decodes path, reads it back with verification into buffers
// allocated from its header (jobs.Read, Expect set), and compares every slot
// with the content its metadata names. It returns the snapshot that was read:
// with writers running, it may be a later one than the header it allocated
// for, but then one with the same shapes (Expect), else the error wraps
// jobs.ErrMismatch or jobs.ErrDestination.
func verifySnapshot(cfg *jobs.Config, path string) (*layout.Snapshot, version, error) {
	fsys := cfg.FS
	if fsys == nil {
		fsys = vfs.Default
	}
	snap, err := layout.Load(fsys, path)
	if err != nil {
		return nil, version{}, err
	}
	if _, err := versionOf(snap.Header); err != nil {
		return nil, version{}, fmt.Errorf("%s: %w", path, err)
	}
	dest, err := destFor(snap.Header)
	if err != nil {
		return nil, version{}, fmt.Errorf("%s: %w", path, err)
	}
	rc := *cfg
	rc.Root = filepath.Dir(filepath.Dir(path))
	ref := jobs.Ref{Namespace: filepath.Base(filepath.Dir(path)), Name: filepath.Base(path)}
	got, _, err := jobs.Read(context.Background(), &rc, &jobs.ReadRequest{Ref: ref, Dest: dest, Expect: snap.Header})
	if err != nil {
		return nil, version{}, err
	}
	v, err := versionOf(got.Header)
	if err != nil {
		return nil, version{}, fmt.Errorf("%s: %w", path, err)
	}
	if err := checkContent(dest, v.Tokens); err != nil {
		return nil, version{}, fmt.Errorf("%s (writer %s seq %d): %w", path, v.Writer, v.Seq, err)
	}
	return got, v, nil
}

// scanned is one published snapshot found by scanStore.
type scanned struct {
	v      version
	layout layout.Layout
}

// storeScan is what scanStore found in a store.
type storeScan struct {
	snaps  map[string]scanned // snapshot path -> its version
	temps  []string           // temp files, anywhere
	blocks int                // block files
	refs   map[string]bool    // block file paths named by a manifest
}

// scanStore lists every namespace under root and reads every snapshot back
// verified (verifySnapshot); every failure is a test error. Temp files are
// listed, never decoded; an entry of any other kind is a test error.
func scanStore(t testing.TB, root string) *storeScan {
	t.Helper()
	s := &storeScan{snaps: map[string]scanned{}, refs: map[string]bool{}}
	cfg := &jobs.Config{NoSync: true}
	nss, err := os.ReadDir(root)
	if err != nil {
		t.Fatal(err)
	}
	for _, ns := range nss {
		nsDir := filepath.Join(root, ns.Name())
		if !ns.IsDir() {
			t.Errorf("unexpected file %s in the store root", nsDir)
			continue
		}
		ents, err := os.ReadDir(nsDir)
		if err != nil {
			t.Fatal(err)
		}
		for _, e := range ents {
			name, path := e.Name(), filepath.Join(nsDir, e.Name())
			switch {
			case name == layout.LockName:
			case layout.IsTemp(name):
				s.temps = append(s.temps, path)
			case name == layout.BlocksDirName && e.IsDir():
				s.scanBlocks(t, path)
			case e.Type().IsRegular() && layout.ValidName("snapshot", name) == nil:
				snap, v, err := verifySnapshot(cfg, path)
				if err != nil {
					t.Errorf("published snapshot does not verify: %v", err)
					continue
				}
				s.snaps[path] = scanned{v: v, layout: snap.Layout}
				for _, sl := range snap.Header.Slots() {
					for _, b := range sl.Blocks {
						s.refs[testutil.BlockPath(nsDir, b.Hash)] = true
					}
				}
			default:
				t.Errorf("unexpected entry %s", path)
			}
		}
	}
	return s
}

func (s *storeScan) scanBlocks(t testing.TB, dir string) {
	t.Helper()
	ents, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range ents {
		path := filepath.Join(dir, e.Name())
		switch {
		case layout.IsTemp(e.Name()):
			s.temps = append(s.temps, path)
		case e.IsDir() && len(e.Name()) == 2 && filepath.Base(dir) == layout.BlocksDirName:
			s.scanBlocks(t, path)
		case e.Type().IsRegular() && layout.ValidBlockHash(e.Name()):
			s.blocks++
		default:
			t.Errorf("unexpected entry %s", path)
		}
	}
}

// reverify reads every snapshot of s back again: after a collect, this shows
// that no referenced block was removed.
func (s *storeScan) reverify(t testing.TB) {
	t.Helper()
	cfg := &jobs.Config{NoSync: true}
	for path, want := range s.snaps {
		_, v, err := verifySnapshot(cfg, path)
		if err != nil {
			t.Errorf("after collect: %v", err)
		} else if v != want.v {
			t.Errorf("after collect: %s holds %+v, before it held %+v", path, v, want.v)
		}
	}
}

// helperProc is a running helper process.
type helperProc struct {
	t      testing.TB
	name   string
	cmd    *exec.Cmd
	stdin  io.WriteCloser
	lines  chan string // stdout lines; closed at EOF
	stderr *lockedBuffer
	done   bool
}

type lockedBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *lockedBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *lockedBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

// startHelper starts this test binary as a helper process in mode with args.
// The helper dies with the test (Pdeathsig) and is killed at cleanup if the
// test did not wait for it.
func startHelper(t testing.TB, mode string, args ...string) *helperProc {
	t.Helper()
	cmd := exec.Command(os.Args[0], args...)
	cmd.Env = append(os.Environ(), helperEnv+"="+mode)
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	h := &helperProc{t: t, name: mode, cmd: cmd, lines: make(chan string, 256), stderr: &lockedBuffer{}}
	cmd.Stderr = h.stderr
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if h.stdin, err = cmd.StdinPipe(); err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() { // owned by the process: ends at EOF, when it exits
		defer close(h.lines)
		sc := bufio.NewScanner(stdout)
		for sc.Scan() {
			h.lines <- sc.Text()
		}
	}()
	t.Cleanup(func() {
		if !h.done {
			_ = cmd.Process.Kill()
			h.wait()
		}
	})
	return h
}

// wait reads the rest of the helper's output and waits for it to exit.
func (h *helperProc) wait() (rest []string, state *os.ProcessState) {
	for l := range h.lines {
		rest = append(rest, l)
	}
	_ = h.cmd.Wait()
	h.done = true
	return rest, h.cmd.ProcessState
}

// checkStderr fails the test if the helper reported a data race or a panic.
func (h *helperProc) checkStderr() {
	h.t.Helper()
	if s := h.stderr.String(); strings.Contains(s, "DATA RACE") || strings.Contains(s, "panic") {
		h.t.Errorf("helper %s: %s", h.name, s)
	}
}

// waitOK waits for a helper that exits by itself and fails the test unless
// it exited 0.
func (h *helperProc) waitOK() []string {
	h.t.Helper()
	rest, st := h.wait()
	h.checkStderr()
	if !st.Success() {
		h.t.Fatalf("helper %s: %v; stderr:\n%s", h.name, st, h.stderr.String())
	}
	return rest
}

// Crash test parameters: paths written by the crash helper, the largest
// conversation, the writes in flight.
var crashPaths = []struct {
	ns, name string
	layouts  []layout.Layout
}{
	{"conv-a", "c0", []layout.Layout{layout.Blocks}},
	{"conv-a", "c1", []layout.Layout{layout.Blocks}},
	{"conv-a", "s0", []layout.Layout{layout.Single}},
	{"conv-a", "m0", []layout.Layout{layout.Blocks, layout.Single}},
	{"conv-b", "c0", []layout.Layout{layout.Blocks}},
	{"conv-b", "m1", []layout.Layout{layout.Single, layout.Blocks}},
}

const (
	crashMaxTokens = 2048
	crashInFlight  = 4
)

// crashWriterMain is the crash helper: an engine with fsync on and two
// workers, saving growing conversations (each path's token count grows by up
// to 300 tokens a write and starts over past crashMaxTokens, so consecutive
// versions and paths at similar lengths share their full blocks) with up to
// crashInFlight jobs outstanding (so writes to one path queue behind each
// other), one job in eight a collect. It prints, each as one write(2):
//
//	ready
//	submit <seq> <ns>/<name> <tokens> <layout>   before submitting a write
//	ack <seq> ok | ack <seq> err <message>        when a write is acked
//	collect ok | collect err <message>            when a collect is acked
//
// and runs until it is killed.
func crashWriterMain(args []string) int {
	fl := flag.NewFlagSet("crash-writer", flag.ContinueOnError)
	root := fl.String("root", "", "store root")
	seq := fl.Int64("seq", 0, "first sequence number")
	seed := fl.Uint64("seed", 1, "random seed")
	if err := fl.Parse(args); err != nil {
		return 2
	}
	e, err := engine.New(engine.Config{Root: *root, Workers: 2, BlockBytes: tinyBlockBytes, Logger: discardLogger})
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	cache := kvgen.NewCache(kvgen.Tiny, crashMaxTokens, true, nil)
	rng := rand.New(rand.NewPCG(*seed, 2))
	tokens := make([]int, len(crashPaths))
	for i := range tokens {
		tokens[i] = 1 + rng.IntN(256)
	}
	acks := make(chan engine.Result, crashInFlight)
	seqOf := map[uint64]int64{} // write job ID -> seq
	say := func(format string, a ...any) { fmt.Fprintf(os.Stdout, format+"\n", a...) }
	say("ready")
	inFlight := 0
	for {
		for ; inFlight < crashInFlight; inFlight++ {
			if rng.IntN(8) == 0 {
				var nss []string
				if k := rng.IntN(3); k > 0 {
					nss = []string{crashPaths[0].ns, crashPaths[4].ns}[k-1 : k]
				}
				if _, err := e.Submit(context.Background(), &engine.CollectRequest{Namespaces: nss}, engine.AckTo(acks)); err != nil {
					fmt.Fprintln(os.Stderr, err)
					return 1
				}
				continue
			}
			p := rng.IntN(len(crashPaths))
			cp := crashPaths[p]
			tokens[p] += 1 + rng.IntN(300)
			if tokens[p] > crashMaxTokens {
				tokens[p] = 1 + rng.IntN(256)
			}
			lay := cp.layouts[rng.IntN(len(cp.layouts))]
			*seq++
			v := version{Writer: "crash", Seq: *seq, Tokens: tokens[p]}
			caches, atts := cacheEntries(cache, v.Tokens)
			say("submit %d %s/%s %d %s", v.Seq, cp.ns, cp.name, v.Tokens, lay)
			j, err := e.Submit(context.Background(), &engine.WriteRequest{Ref: engine.Ref{Namespace: cp.ns, Name: cp.name},
				Layout: lay, Meta: v.meta(), Caches: caches, Attachments: atts, Packed: rng.IntN(4) == 0}, engine.AckTo(acks))
			if err != nil {
				fmt.Fprintln(os.Stderr, err)
				return 1
			}
			seqOf[j.ID] = v.Seq
		}
		r := <-acks
		inFlight--
		status := "ok"
		if r.Err != nil {
			status = "err " + strings.ReplaceAll(r.Err.Error(), "\n", " ")
		}
		if r.Kind == engine.KindCollect {
			say("collect %s", status)
		} else {
			say("ack %d %s", seqOf[r.ID], status)
			delete(seqOf, r.ID)
		}
	}
}

// crashSubmit is a write the crash helper announced.
type crashSubmit struct {
	path   string
	tokens int
	layout layout.Layout
}

type crashTally struct {
	kills, killsByTimer, killsAfterAck   int
	submitted, acked, collects           int
	snapshotsVerified, tempsLeft         int
	tempsAged, tempsRemoved, tempsKept   int
	blocksDeleted, maxTempsAfterOneCrash int
	seenTemps                            map[string]bool
}

// TestCrashSIGKILL kills the crash helper (crashWriterMain) at random
// moments, restarting it on the same store each round, and after each kill
// checks that: every published snapshot and manifest decodes, reads back
// verified and holds exactly the bytes of a write the helper announced for
// that path (tokens and layout as announced); every acked write is visible
// (the path holds that version or a later one); a collect keeps every
// referenced block (all snapshots still verify), never takes a temp file for
// a snapshot (ManifestsScanned counts published snapshots only, nothing is
// unreadable) and keeps temp files younger than the grace period; a second
// collect, after some temp files were aged past the grace period with
// os.Chtimes, removes exactly those and keeps the young ones.
func TestCrashSIGKILL(t *testing.T) {
	kills := 8
	if soakLong() {
		kills = 300
	}
	seed := uint64(time.Now().UnixNano())
	t.Logf("seed %d, %d kills", seed, kills)
	rng := rand.New(rand.NewPCG(seed, 1))
	root := t.TempDir()
	submitted := map[int64]crashSubmit{}
	tally := crashTally{seenTemps: map[string]bool{}}
	for round := 0; round < kills && !t.Failed(); round++ {
		lastAck := crashRound(t, rng, root, round, submitted, &tally)
		checkAfterCrash(t, rng, root, submitted, lastAck, &tally)
	}
	t.Logf("%d kills (%d after a random 5-150 ms, %d after the k-th ack): %d writes submitted, %d acked, %d collects acked",
		tally.kills, tally.killsByTimer, tally.killsAfterAck, tally.submitted, tally.acked, tally.collects)
	t.Logf("%d snapshot checks passed; %d temp files left by the crashes (at most %d by one), %d of them aged and removed by collect (%d aged), young ones kept %d times; %d unreferenced blocks collected",
		tally.snapshotsVerified, tally.tempsLeft, tally.maxTempsAfterOneCrash, tally.tempsRemoved, tally.tempsAged, tally.tempsKept, tally.blocksDeleted)
}

// crashRound starts the helper, kills it with SIGKILL 5-150 ms after it is
// ready or right after its k-th ack (k in 1..6), and parses what it printed.
// It returns the last acked write's seq per snapshot path.
func crashRound(t *testing.T, rng *rand.Rand, root string, round int, submitted map[int64]crashSubmit, tally *crashTally) map[string]int64 {
	t.Helper()
	h := startHelper(t, "crash-writer", "-root", root, "-seq", strconv.Itoa((round+1)*1_000_000), "-seed", strconv.FormatUint(rng.Uint64(), 10))
	var lines []string
	if l, ok := <-h.lines; !ok || l != "ready" {
		rest, st := h.wait()
		t.Fatalf("helper did not start: %q %q %v\n%s", l, rest, st, h.stderr.String())
	}
	var timer <-chan time.Time
	killAfterAcks := 0
	if rng.IntN(2) == 0 {
		tm := time.NewTimer(time.Duration(5+rng.IntN(146)) * time.Millisecond)
		defer tm.Stop()
		timer = tm.C
		tally.killsByTimer++
	} else {
		killAfterAcks = 1 + rng.IntN(6)
		tally.killsAfterAck++
	}
	acks := 0
wait:
	for {
		select {
		case l, ok := <-h.lines:
			if !ok {
				break wait // exited by itself: caught below
			}
			lines = append(lines, l)
			if strings.HasPrefix(l, "ack ") {
				if acks++; acks == killAfterAcks {
					break wait
				}
			}
		case <-timer:
			break wait
		}
	}
	if err := h.cmd.Process.Signal(syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	rest, st := h.wait()
	lines = append(lines, rest...)
	h.checkStderr()
	if ws, ok := st.Sys().(syscall.WaitStatus); !ok || !ws.Signaled() || ws.Signal() != syscall.SIGKILL {
		t.Fatalf("helper was not killed by SIGKILL: %v\n%s", st, h.stderr.String())
	}
	tally.kills++

	lastAck := map[string]int64{}
	for _, l := range lines {
		kind, seq, ok := writerLine(t, root, l, submitted)
		switch f := strings.Fields(l); {
		case kind == "submit":
			tally.submitted++
		case kind == "ack":
			if !ok {
				t.Errorf("write failed in the helper: %q", l)
				continue
			}
			p := submitted[seq].path
			lastAck[p] = max(lastAck[p], seq)
			tally.acked++
		case len(f) >= 2 && f[0] == "collect":
			if f[1] != "ok" {
				t.Errorf("collect failed in the helper: %q", l)
			}
			tally.collects++
		default:
			t.Fatalf("unexpected helper output %q", l)
		}
	}
	return lastAck
}

// writerLine parses one line a writer helper printed. "submit <seq> <path
// relative to root> <tokens> <layout>" is added to submitted (kind
// "submit"; a seq announced twice fails the test); "ack <seq> ok" or "ack
// <seq> err ..." of an announced write returns kind "ack", its seq and
// whether it succeeded. Any other line returns kind "".
func writerLine(t *testing.T, root, l string, submitted map[int64]crashSubmit) (kind string, seq int64, ok bool) {
	t.Helper()
	f := strings.Fields(l)
	switch {
	case len(f) == 5 && f[0] == "submit":
		seq, err1 := strconv.ParseInt(f[1], 10, 64)
		tokens, err2 := strconv.Atoi(f[3])
		lay, err3 := layout.ParseLayout(f[4])
		if err := errors.Join(err1, err2, err3); err != nil {
			t.Fatalf("bad line %q: %v", l, err)
		}
		if _, dup := submitted[seq]; dup {
			t.Fatalf("seq %d announced twice", seq)
		}
		submitted[seq] = crashSubmit{path: filepath.Join(root, f[2]), tokens: tokens, layout: lay}
		return "submit", seq, true
	case len(f) >= 3 && f[0] == "ack":
		seq, err := strconv.ParseInt(f[1], 10, 64)
		if _, known := submitted[seq]; err != nil || !known {
			t.Fatalf("ack of an unknown write: %q", l)
		}
		return "ack", seq, f[2] == "ok"
	}
	return "", 0, false
}

// checkAfterCrash checks the store a killed helper left (see TestCrashSIGKILL).
func checkAfterCrash(t *testing.T, rng *rand.Rand, root string, submitted map[int64]crashSubmit, lastAck map[string]int64, tally *crashTally) {
	t.Helper()
	scan := scanStore(t, root)
	for path, s := range scan.snaps {
		sub, ok := submitted[s.v.Seq]
		switch {
		case !ok || s.v.Writer != "crash":
			t.Errorf("%s holds %+v, which the helper never announced", path, s.v)
		case sub.path != path || sub.tokens != s.v.Tokens || sub.layout != s.layout:
			t.Errorf("%s holds seq %d as %d tokens, %s layout; the helper announced %+v", path, s.v.Seq, s.v.Tokens, s.layout, sub)
		}
		tally.snapshotsVerified++
	}
	for path, seq := range lastAck {
		if s, ok := scan.snaps[path]; !ok || s.v.Seq < seq {
			t.Errorf("write seq %d of %s was acked, but the path holds %+v (present: %v)", seq, path, s.v, ok)
		}
	}
	fresh := 0 // temp files this crash left (older ones are still young)
	for _, tmp := range scan.temps {
		if !tally.seenTemps[tmp] {
			tally.seenTemps[tmp] = true
			fresh++
		}
	}
	tally.tempsLeft += fresh
	tally.maxTempsAfterOneCrash = max(tally.maxTempsAfterOneCrash, fresh)

	// A collect right after the crash keeps every temp file younger than the
	// grace period: all of them, unless a long run let some left by an
	// early crash age naturally.
	ctx := context.Background()
	now := time.Now()
	stale, young := splitTemps(t, scan.temps, now)
	m, err := jobs.Collect(ctx, &jobs.Config{Root: root}, &jobs.CollectRequest{Now: now})
	if err != nil {
		t.Fatalf("collect after a crash: %v", err)
	}
	cm := m.Collect
	if len(cm.Unreadable) > 0 || len(cm.UnsweptNamespaces) > 0 || len(cm.Skipped) > 0 {
		t.Errorf("collect after a crash: unreadable %q, unswept %q, skipped %q", cm.Unreadable, cm.UnsweptNamespaces, cm.Skipped)
	}
	if cm.ManifestsScanned != len(scan.snaps) {
		t.Errorf("collect scanned %d snapshots and manifests; %d are published (temp files must not count)", cm.ManifestsScanned, len(scan.snaps))
	}
	var tempsDeleted []string
	for _, d := range cm.Deleted {
		switch {
		case layout.IsTemp(filepath.Base(d)):
			tempsDeleted = append(tempsDeleted, d)
		case scan.refs[d] || !layout.ValidBlockHash(filepath.Base(d)):
			t.Errorf("collect deleted %s, which is not an unreferenced block", d)
		}
	}
	if slices.Sort(tempsDeleted); !slices.Equal(tempsDeleted, stale) || cm.TempRemoved != int64(len(stale)) {
		t.Errorf("collect removed temp files %q (%d); want those older than the grace period, %q", tempsDeleted, cm.TempRemoved, stale)
	}
	tally.blocksDeleted += int(cm.BlocksDeleted)
	scan.reverify(t)
	for _, tmp := range young {
		if _, err := os.Lstat(tmp); err != nil {
			t.Errorf("young temp file %s: %v", tmp, err)
		}
	}

	// Age some temp files past the grace period: collect removes exactly
	// those (and any that aged naturally).
	if len(young) == 0 {
		return
	}
	// Between 1 and n-1 of the n temp files (the one, when n == 1).
	temps := slices.Clone(young)
	rng.Shuffle(len(temps), func(i, j int) { temps[i], temps[j] = temps[j], temps[i] })
	k := 1
	if len(temps) > 1 {
		k = 1 + rng.IntN(len(temps)-1)
	}
	aged := temps[:k]
	old := time.Now().Add(-2 * jobs.DefaultTempGrace)
	for _, tmp := range aged {
		if err := os.Chtimes(tmp, old, old); err != nil {
			t.Fatal(err)
		}
	}
	now = time.Now()
	stale, young = splitTemps(t, temps, now)
	m, err = jobs.Collect(ctx, &jobs.Config{Root: root}, &jobs.CollectRequest{Now: now})
	if err != nil {
		t.Fatalf("second collect: %v", err)
	}
	if got := slices.Sorted(slices.Values(m.Collect.Deleted)); !slices.Equal(got, stale) || m.Collect.TempRemoved != int64(len(stale)) || m.Collect.BlocksDeleted != 0 {
		t.Errorf("second collect deleted %q (%d temp files, %d blocks); want exactly the aged temp files %q", got, m.Collect.TempRemoved, m.Collect.BlocksDeleted, stale)
	}
	for _, tmp := range stale {
		if _, err := os.Lstat(tmp); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("aged temp file %s still there: %v", tmp, err)
		}
	}
	for _, tmp := range young {
		if _, err := os.Lstat(tmp); err != nil {
			t.Errorf("young temp file %s: %v", tmp, err)
		}
	}
	tally.tempsAged += len(aged)
	tally.tempsRemoved += int(m.Collect.TempRemoved)
	tally.tempsKept += len(young)
}

// splitTemps sorts temp files into those a collect at now must remove (last
// modified at least jobs.DefaultTempGrace before now) and those it must keep,
// each sorted.
func splitTemps(t *testing.T, temps []string, now time.Time) (stale, young []string) {
	t.Helper()
	for _, tmp := range temps {
		fi, err := os.Lstat(tmp)
		if err != nil {
			t.Fatalf("temp file %s: %v", tmp, err)
		}
		if now.Sub(fi.ModTime()) >= jobs.DefaultTempGrace {
			stale = append(stale, tmp)
		} else {
			young = append(young, tmp)
		}
	}
	slices.Sort(stale)
	slices.Sort(young)
	return stale, young
}
