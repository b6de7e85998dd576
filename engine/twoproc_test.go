package engine_test

// Two processes on one store: a writer process beside a collector process,
// and two writer processes on the same snapshot paths (with a collector),
// all real processes (this test binary re-executed, see TestMain) sharing a
// root the way an operator's `kvpersist gc` or a second scheduler would. The
// per-namespace flock (<ns>/.lock: shared for writers and readers, exclusive
// for collect) is what keeps them safe; the last tests show, deterministically
// and in one process, what a collect does to a writer without it.

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"io/fs"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvpersist/kvpersist/engine"
	"github.com/kvpersist/kvpersist/engine/jobs"
	"github.com/kvpersist/kvpersist/engine/layout"
	"github.com/kvpersist/kvpersist/engine/vfs"
	"github.com/kvpersist/kvpersist/internal/kvgen"
	"github.com/kvpersist/kvpersist/internal/testutil"
)

// writerMain is the writer helper: n writes of Tiny caches to random paths of
// one namespace, tokens and layout drawn from lists, either through an engine
// (two workers, up to four writes in flight, so writes to one path queue in
// submission order) or, with -engine=false, by two goroutines calling
// jobs.Write directly (-nolock turns the namespace lock off, which only this
// mode can). No fsync: the lock, not durability, is under test. It prints
// "submit <seq> <ns>/<name> <tokens> <layout>" before each write, "ack <seq>
// ok|err <message>" after it, and "done" before exiting 0.
func writerMain(args []string) int {
	fl := flag.NewFlagSet("writer", flag.ContinueOnError)
	root := fl.String("root", "", "store root")
	ns := fl.String("ns", "shared", "namespace")
	pathList := fl.String("paths", "p0", "snapshot names, comma-separated")
	n := fl.Int("n", 100, "writes")
	id := fl.String("id", "A", "writer id (metadata)")
	seq0 := fl.Int64("seq", 0, "first sequence number")
	tokenList := fl.String("tokens", "200,330", "token counts, comma-separated")
	layoutList := fl.String("layouts", "blocks", "layouts, comma-separated")
	useEngine := fl.Bool("engine", true, "write through an engine")
	noLock := fl.Bool("nolock", false, "no namespace lock (direct mode only)")
	seed := fl.Uint64("seed", 1, "random seed")
	if err := fl.Parse(args); err != nil {
		return 2
	}
	names := strings.Split(*pathList, ",")
	var tokens []int
	for _, s := range strings.Split(*tokenList, ",") {
		v, err := strconv.Atoi(s)
		if err != nil || v <= 0 {
			fmt.Fprintf(os.Stderr, "bad -tokens %q\n", *tokenList)
			return 2
		}
		tokens = append(tokens, v)
	}
	var lays []layout.Layout
	for _, s := range strings.Split(*layoutList, ",") {
		l, err := layout.ParseLayout(s)
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			return 2
		}
		lays = append(lays, l)
	}
	maxT := 0
	for _, v := range tokens {
		maxT = max(maxT, v)
	}
	cache := kvgen.NewCache(kvgen.Tiny, maxT, true, nil)
	var mu sync.Mutex
	rng := rand.New(rand.NewPCG(*seed, 3))
	seq := *seq0
	// next draws the next write (under mu) and announces it.
	next := func() (version, string, layout.Layout) {
		mu.Lock()
		defer mu.Unlock()
		seq++
		v := version{Writer: *id, Seq: seq, Tokens: tokens[rng.IntN(len(tokens))]}
		name, lay := names[rng.IntN(len(names))], lays[rng.IntN(len(lays))]
		fmt.Fprintf(os.Stdout, "submit %d %s/%s %d %s\n", v.Seq, *ns, name, v.Tokens, lay)
		return v, name, lay
	}
	report := func(seq int64, err error) {
		if err != nil {
			fmt.Fprintf(os.Stdout, "ack %d err %s\n", seq, strings.ReplaceAll(err.Error(), "\n", " "))
		} else {
			fmt.Fprintf(os.Stdout, "ack %d ok\n", seq)
		}
	}
	if !*useEngine {
		var wg sync.WaitGroup
		for g := 0; g < 2; g++ {
			wg.Go(func() {
				cfg := &jobs.Config{Root: *root, NoSync: true, NoLock: *noLock}
				for i := g; i < *n; i += 2 {
					v, name, lay := next()
					caches, atts := cacheEntries(cache, v.Tokens)
					_, _, err := jobs.Write(context.Background(), cfg, &jobs.WriteRequest{Ref: jobs.Ref{Namespace: *ns, Name: name},
						Layout: lay, Meta: v.meta(), Caches: caches, Attachments: atts, BlockBytes: tinyBlockBytes})
					report(v.Seq, err)
				}
			})
		}
		wg.Wait()
		fmt.Println("done")
		return 0
	}
	if *noLock {
		fmt.Fprintln(os.Stderr, "-nolock needs -engine=false")
		return 2
	}
	e, err := engine.New(engine.Config{Root: *root, Workers: 2, BlockBytes: tinyBlockBytes, NoSync: true, Logger: discardLogger})
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	acks := make(chan engine.Result, 4)
	seqOf := map[uint64]int64{}
	inFlight := 0
	for i := 0; i < *n || inFlight > 0; {
		if i < *n && inFlight < 4 {
			v, name, lay := next()
			caches, atts := cacheEntries(cache, v.Tokens)
			j, err := e.Submit(context.Background(), &engine.WriteRequest{Ref: engine.Ref{Namespace: *ns, Name: name},
				Layout: lay, Meta: v.meta(), Caches: caches, Attachments: atts}, engine.AckTo(acks))
			if err != nil {
				fmt.Fprintln(os.Stderr, err)
				return 1
			}
			seqOf[j.ID] = v.Seq
			i++
			inFlight++
			continue
		}
		r := <-acks
		inFlight--
		report(seqOf[r.ID], r.Err)
	}
	if err := e.Close(context.Background()); err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	fmt.Println("done")
	return 0
}

// collectorMain is the collector helper, an operator's `kvpersist gc` in a
// loop: jobs.Collect over the whole root (-tempgrace, default the default;
// -blockgrace for blocks) until its stdin is closed, at least once. It prints "collect ok
// <blocks deleted>" or "collect err <message>" per collect.
func collectorMain(args []string) int {
	fl := flag.NewFlagSet("collector", flag.ContinueOnError)
	root := fl.String("root", "", "store root")
	noLock := fl.Bool("nolock", false, "no namespace lock")
	blockGrace := fl.Duration("blockgrace", 0, "collect's BlockGrace")
	tempGrace := fl.Duration("tempgrace", 0, "collect's TempGrace (negative: every temp file)")
	if err := fl.Parse(args); err != nil {
		return 2
	}
	stop := make(chan struct{})
	go func() { // ends at EOF; the process exits right after
		_, _ = io.Copy(io.Discard, os.Stdin)
		close(stop)
	}()
	cfg := &jobs.Config{Root: *root, NoSync: true, NoLock: *noLock}
	for {
		m, err := jobs.Collect(context.Background(), cfg, &jobs.CollectRequest{BlockGrace: *blockGrace, TempGrace: *tempGrace})
		if err != nil {
			fmt.Fprintf(os.Stdout, "collect err %s\n", strings.ReplaceAll(err.Error(), "\n", " "))
		} else if cm := m.Collect; len(cm.Unreadable) > 0 || len(cm.Skipped) > 0 {
			fmt.Fprintf(os.Stdout, "collect err unreadable %q skipped %q\n", cm.Unreadable, cm.Skipped)
		} else {
			fmt.Fprintf(os.Stdout, "collect ok %d\n", cm.BlocksDeleted)
		}
		select {
		case <-stop:
			return 0
		default:
		}
	}
}

// writerLog is what a writer helper printed.
type writerLog struct {
	submitted map[int64]crashSubmit // seq -> the write
	lastAck   map[string]int64      // path -> seq of the last acked write
	ok        map[int64]bool        // seqs acked without error
	acked     int
	failed    []string // "ack <seq> err ..." lines
}

func parseWriterLog(t *testing.T, root string, lines []string) *writerLog {
	t.Helper()
	w := &writerLog{submitted: map[int64]crashSubmit{}, lastAck: map[string]int64{}, ok: map[int64]bool{}}
	for _, l := range lines {
		switch kind, seq, ok := writerLine(t, root, l, w.submitted); {
		case kind == "submit":
		case kind == "ack" && !ok:
			w.failed = append(w.failed, l)
		case kind == "ack":
			w.acked++
			w.ok[seq] = true
			// An engine acks one path's writes in submission order.
			p := w.submitted[seq].path
			w.lastAck[p] = max(w.lastAck[p], seq)
		case l == "done":
		default:
			t.Fatalf("unexpected writer output %q", l)
		}
	}
	return w
}

// collectorLog counts a collector helper's collects.
type collectorLog struct {
	collects, deleting int
	blocksDeleted      int64
	failed             []string
}

func parseCollectorLog(t *testing.T, lines []string) *collectorLog {
	t.Helper()
	c := &collectorLog{}
	for _, l := range lines {
		f := strings.Fields(l)
		switch {
		case len(f) == 3 && f[0] == "collect" && f[1] == "ok":
			n, err := strconv.ParseInt(f[2], 10, 64)
			if err != nil {
				t.Fatalf("bad line %q", l)
			}
			c.collects++
			c.blocksDeleted += n
			if n > 0 {
				c.deleting++
			}
		case len(f) >= 2 && f[0] == "collect":
			c.failed = append(c.failed, l)
		default:
			t.Fatalf("unexpected collector output %q", l)
		}
	}
	return c
}

// storeReader reads the store's snapshots back verified, in a loop, while
// the helpers run: the test process as a third party (a restore).
type storeReader struct {
	stop     chan struct{}
	done     chan struct{}
	mu       sync.Mutex
	verified int      // reads that returned a version's exact bytes
	replaced int      // reads refused because the snapshot changed shape (ErrMismatch/ErrDestination)
	failures []string // anything else: missing or corrupt blocks, undecodable files
}

func startReader(paths []string, noLock bool) *storeReader {
	r := &storeReader{stop: make(chan struct{}), done: make(chan struct{})}
	go func() { // owned by the test: stopped by finish
		defer close(r.done)
		cfg := &jobs.Config{NoSync: true, NoLock: noLock}
		for i := 0; ; i++ {
			select {
			case <-r.stop:
				return
			default:
			}
			_, _, err := verifySnapshot(cfg, paths[i%len(paths)])
			r.mu.Lock()
			switch {
			case err == nil:
				r.verified++
			case errors.Is(err, fs.ErrNotExist):
			case errors.Is(err, jobs.ErrMismatch) || errors.Is(err, jobs.ErrDestination):
				r.replaced++
			default:
				r.failures = append(r.failures, err.Error())
			}
			r.mu.Unlock()
		}
	}()
	return r
}

func (r *storeReader) finish() {
	close(r.stop)
	<-r.done
}

// twoProcRun is one run of writer helpers beside a collector helper and the
// test process reading.
type twoProcRun struct {
	writers   []*writerLog
	collector *collectorLog
	reader    *storeReader
	scan      *storeScan
}

// runTwoProc starts the collector, then every writer (each given its args
// after -root), reads the store while they run, waits for the writers, stops
// the collector, and scans the store (every published snapshot must verify).
func runTwoProc(t *testing.T, root string, paths []string, noLock bool, collectorArgs []string, writerArgs ...[]string) *twoProcRun {
	t.Helper()
	col := startHelper(t, "collector", append([]string{"-root", root}, collectorArgs...)...)
	var ws []*helperProc
	for _, a := range writerArgs {
		ws = append(ws, startHelper(t, "writer", append([]string{"-root", root}, a...)...))
	}
	reader := startReader(paths, noLock)
	run := &twoProcRun{reader: reader}
	for _, w := range ws {
		run.writers = append(run.writers, parseWriterLog(t, root, w.waitOK()))
	}
	reader.finish()
	if err := col.stdin.Close(); err != nil {
		t.Fatal(err)
	}
	run.collector = parseCollectorLog(t, col.waitOK())
	run.scan = scanStore(t, root)
	return run
}

func (run *twoProcRun) logFigures(t *testing.T) {
	t.Helper()
	acked := 0
	for _, w := range run.writers {
		acked += w.acked
	}
	t.Logf("%d writer process(es): %d writes acked; collector process: %d collects (%d deleted blocks, %d blocks in all); test process: %d verified reads, %d refused as replaced, %d failed",
		len(run.writers), acked, run.collector.collects, run.collector.deleting, run.collector.blocksDeleted,
		run.reader.verified, run.reader.replaced, len(run.reader.failures))
}

// checkHelpersClean fails the test for any failed write, collect or read.
func (run *twoProcRun) checkHelpersClean(t *testing.T) {
	t.Helper()
	for _, w := range run.writers {
		for _, f := range w.failed {
			t.Errorf("writer: %s", f)
		}
	}
	for _, f := range run.collector.failed {
		t.Errorf("collector: %s", f)
	}
	for i, f := range run.reader.failures {
		if i == 5 {
			t.Errorf("... and %d more failed reads", len(run.reader.failures)-i)
			break
		}
		t.Errorf("read while the helpers ran: %s", f)
	}
}

// finalCollect collects the quiet store and reads every snapshot back.
func finalCollect(t *testing.T, root string, scan *storeScan) {
	t.Helper()
	m, err := jobs.Collect(context.Background(), &jobs.Config{Root: root, NoSync: true}, &jobs.CollectRequest{})
	if err != nil {
		t.Fatal(err)
	}
	if m.Collect.ManifestsScanned != len(scan.snaps) || len(m.Collect.Unreadable) > 0 {
		t.Errorf("final collect scanned %d manifests (want %d), unreadable %q", m.Collect.ManifestsScanned, len(scan.snaps), m.Collect.Unreadable)
	}
	for _, d := range m.Collect.Deleted {
		if scan.refs[d] {
			t.Errorf("final collect deleted referenced block %s", d)
		}
	}
	scan.reverify(t)
}

func nsPaths(root, ns string, names ...string) []string {
	out := make([]string, len(names))
	for i, n := range names {
		out[i] = filepath.Join(root, ns, n)
	}
	return out
}

// The writer's token counts: each pair of neighbours shares full blocks
// (128 tokens a block), and every count has partial blocks no other count
// has, so each overwrite leaves blocks unreferenced that a later write of the
// same count will want again: the dedup-versus-collect race.
const twoProcTokens = "200,256,330,384,460,520"

// TestTwoProcessWriteCollect runs a writer process saving in a loop (both
// layouts, three paths of one namespace) and a second one saving single
// files only (a namespace that never has blocks/) beside a collector
// process (jobs.Collect of the whole root in a loop, every temp file taken
// for stale: `gc --temp-grace 0`) while the test process reads.
// The writer is an engine ("engine") or two goroutines calling jobs.Write
// directly ("jobs.Write"), both holding the namespace lock shared. Every
// read during the run returns one version's exact bytes or is refused as
// replaced; at the end every published snapshot verifies and holds an acked
// write of that path (tokens and layout as submitted), through an engine
// exactly the last one acked; a final collect loses no referenced block.
func TestTwoProcessWriteCollect(t *testing.T) {
	n := 150
	if soakLong() {
		n = 3000
	}
	for _, mode := range []string{"engine", "jobs.Write"} {
		t.Run(mode, func(t *testing.T) {
			root := t.TempDir()
			paths := nsPaths(root, "shared", "p0", "p1", "p2")
			flat := nsPaths(root, "flat", "f0")
			run := runTwoProc(t, root, append(paths, flat...), false, []string{"-tempgrace", "-1ns"},
				[]string{"-ns", "shared", "-paths", "p0,p1,p2", "-n", strconv.Itoa(n), "-id", "A", "-seq", "1000000",
					"-tokens", twoProcTokens, "-layouts", "blocks,blocks,single", "-engine=" + strconv.FormatBool(mode == "engine"),
					"-seed", strconv.FormatInt(time.Now().UnixNano(), 10)},
				[]string{"-ns", "flat", "-paths", "f0", "-n", strconv.Itoa(n / 3), "-id", "B", "-seq", "2000000",
					"-tokens", twoProcTokens, "-layouts", "single", "-engine=" + strconv.FormatBool(mode == "engine"),
					"-seed", strconv.FormatInt(time.Now().UnixNano()+1, 10)})
			run.logFigures(t)
			run.checkHelpersClean(t)
			if w := run.writers[1]; w.acked != n/3 {
				t.Errorf("namespace without blocks/: %d of %d writes acked", w.acked, n/3)
			}
			if _, err := os.Lstat(filepath.Join(root, "flat", "blocks")); !os.IsNotExist(err) {
				t.Errorf("the single-file namespace has blocks/ (%v)", err)
			}
			w := run.writers[0]
			if w.acked != n {
				t.Errorf("%d of %d writes acked", w.acked, n)
			}
			for _, p := range paths {
				s, ok := run.scan.snaps[p]
				_, acked := w.lastAck[p]
				switch {
				case !acked:
					if ok {
						t.Errorf("%s holds %+v but no write to it was acked", p, s.v)
					}
				case !ok || s.v.Writer != "A" || !w.ok[s.v.Seq] || w.submitted[s.v.Seq].path != p:
					t.Errorf("%s holds %+v (present %v), no acked write of that path", p, s.v, ok)
				case mode == "engine" && s.v.Seq != w.lastAck[p]:
					t.Errorf("%s holds seq %d, want the last acked write, seq %d", p, s.v.Seq, w.lastAck[p])
				case w.submitted[s.v.Seq].tokens != s.v.Tokens || w.submitted[s.v.Seq].layout != s.layout:
					t.Errorf("%s holds %d tokens, %s layout; seq %d was submitted as %+v", p, s.v.Tokens, s.layout, s.v.Seq, w.submitted[s.v.Seq])
				}
			}
			finalCollect(t, root, run.scan)
		})
	}
}

// TestTwoProcessSamePath runs two writer processes (two engines) saving to
// the same two snapshot paths, with different token counts and layouts, beside
// a collector process, while the test process reads. Every read returns one
// complete version or is refused as replaced; at the end every snapshot
// verifies and is exactly one writer's last acked version of that path (the
// last rename wins; nothing is mixed), and a final collect loses nothing.
func TestTwoProcessSamePath(t *testing.T) {
	root := t.TempDir()
	n := 100
	if soakLong() {
		n = 2000
	}
	paths := nsPaths(root, "shared", "p0", "p1")
	seed := time.Now().UnixNano()
	run := runTwoProc(t, root, paths, false, nil,
		[]string{"-ns", "shared", "-paths", "p0,p1", "-n", strconv.Itoa(n), "-id", "A", "-seq", "1000000",
			"-tokens", "200,330,460", "-layouts", "blocks", "-seed", strconv.FormatInt(seed, 10)},
		[]string{"-ns", "shared", "-paths", "p0,p1", "-n", strconv.Itoa(n), "-id", "B", "-seq", "2000000",
			"-tokens", "256,384,520", "-layouts", "blocks,single", "-seed", strconv.FormatInt(seed+1, 10)})
	run.logFigures(t)
	run.checkHelpersClean(t)
	byID := map[string]*writerLog{"A": run.writers[0], "B": run.writers[1]}
	wins := map[string]int{}
	for _, p := range paths {
		s, ok := run.scan.snaps[p]
		if !ok {
			t.Errorf("%s missing", p)
			continue
		}
		w := byID[s.v.Writer]
		switch {
		case w == nil:
			t.Errorf("%s holds %+v, written by neither writer", p, s.v)
		case s.v.Seq != w.lastAck[p]:
			t.Errorf("%s holds writer %s's seq %d; its last acked write there is seq %d, the other's seq %d",
				p, s.v.Writer, s.v.Seq, w.lastAck[p], byID[map[string]string{"A": "B", "B": "A"}[s.v.Writer]].lastAck[p])
		case w.submitted[s.v.Seq].tokens != s.v.Tokens || w.submitted[s.v.Seq].layout != s.layout:
			t.Errorf("%s holds %d tokens, %s layout; writer %s submitted seq %d as %+v", p, s.v.Tokens, s.layout, s.v.Writer, s.v.Seq, w.submitted[s.v.Seq])
		default:
			wins[s.v.Writer]++
		}
	}
	t.Logf("final versions: %v", wins)
	finalCollect(t, root, run.scan)
}

// reuseRace is the dedup-versus-collect race, set up deterministically: the
// snapshot at path was saved with 200 tokens, then overwritten with 256, so
// the blocks only the 200-token version has (its partial last block of each
// head, its token ids) are unreferenced: orphans. Saving 200 tokens again
// reuses them if they are still there.
type reuseRace struct {
	root, path string
	ref        jobs.Ref // path under root
	cache      *kvgen.Cache
	orphans    map[string]bool // block file paths
}

func newReuseRace(t *testing.T) *reuseRace {
	t.Helper()
	r := &reuseRace{root: t.TempDir(), cache: kvgen.NewCache(kvgen.Tiny, 256, true, nil), orphans: map[string]bool{}}
	r.ref = jobs.Ref{Namespace: "ns", Name: "conv"}
	r.path = filepath.Join(r.root, r.ref.Namespace, r.ref.Name)
	blocks := func(h *layout.Header) map[string]bool {
		out := map[string]bool{}
		for _, s := range h.Slots() {
			for _, b := range s.Blocks {
				out[testutil.BlockPath(filepath.Dir(r.path), b.Hash)] = true
			}
		}
		return out
	}
	h200, err := r.write(&jobs.Config{NoSync: true}, 200, 1)
	if err != nil {
		t.Fatal(err)
	}
	h256, err := r.write(&jobs.Config{NoSync: true}, 256, 2)
	if err != nil {
		t.Fatal(err)
	}
	keep := blocks(h256)
	for b := range blocks(h200) {
		if !keep[b] {
			r.orphans[b] = true
		}
	}
	if len(r.orphans) == 0 {
		t.Fatal("the 200-token version has no block of its own")
	}
	return r
}

func (r *reuseRace) write(cfg *jobs.Config, tokens int, seq int64) (*layout.Header, error) {
	caches, atts := cacheEntries(r.cache, tokens)
	c := *cfg
	c.Root = r.root
	h, _, err := jobs.Write(context.Background(), &c, &jobs.WriteRequest{Ref: r.ref, Layout: layout.Blocks,
		Meta: version{Writer: "A", Seq: seq, Tokens: tokens}.meta(), Caches: caches, Attachments: atts, BlockBytes: tinyBlockBytes})
	return h, err
}

// rewritePaused saves the 200-token version again on a goroutine (cfg.FS is
// replaced) that stops right after its Lstat found the first orphan present,
// i.e. after the writer decided to reuse it. The orphan's path arrives on
// reached; closing resume lets the writer go on; done receives its error.
func (r *reuseRace) rewritePaused(cfg jobs.Config) (reached <-chan string, resume chan<- struct{}, done <-chan error) {
	reachedC, resumeC, doneC := make(chan string, 1), make(chan struct{}), make(chan error, 1)
	var once sync.Once
	cfg.FS = &testutil.HookFS{FS: vfs.Default, AfterLstat: func(name string, err error) {
		if err == nil && r.orphans[name] {
			once.Do(func() {
				reachedC <- name
				<-resumeC
			})
		}
	}}
	go func() { // owned by the test: it closes resume and receives done
		_, err := r.write(&cfg, 200, 3)
		doneC <- err
	}()
	return reachedC, resumeC, doneC
}

// TestCollectWithoutLockLosesReusedBlock is the documented negative test: it
// shows, deterministically, what the namespace lock prevents. A writer
// without the lock finds a block present and reuses it; a collect without
// the lock, running at that moment (as `kvpersist gc` in another process
// would), sees no manifest naming the block (the snapshot still holds the
// other version) and deletes it; the writer then publishes a manifest naming
// the deleted block, and the snapshot no longer reads: ErrMissingBlock. This
// is the lost-block failure of a content-addressed store collected beside
// writers that do not exclude each other.
//
// BlockGrace does not close the hole for such writers: it spares blocks by
// their modification time, and a writer that reuses a block does not refresh
// it, so an old block reused after a long pause is as exposed as without a
// grace period (the second subtest); only the lock protects reuse.
func TestCollectWithoutLockLosesReusedBlock(t *testing.T) {
	for _, tc := range []struct {
		name       string
		blockGrace time.Duration
		ageBlocks  bool
	}{
		{"no grace", 0, false},
		{"BlockGrace, old blocks", time.Hour, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := newReuseRace(t)
			if tc.ageBlocks { // the blocks were stored long ago
				old := time.Now().Add(-2 * tc.blockGrace)
				for b := range r.orphans {
					if err := os.Chtimes(b, old, old); err != nil {
						t.Fatal(err)
					}
				}
			}
			reached, resume, done := r.rewritePaused(jobs.Config{NoSync: true, NoLock: true})
			orphan := <-reached
			m, err := jobs.Collect(context.Background(), &jobs.Config{Root: r.root, NoSync: true, NoLock: true},
				&jobs.CollectRequest{BlockGrace: tc.blockGrace})
			close(resume)
			werr := <-done
			if err != nil || werr != nil {
				t.Fatalf("collect: %v; write: %v", err, werr)
			}
			deleted := false
			for _, d := range m.Collect.Deleted {
				deleted = deleted || d == orphan
			}
			if !deleted {
				t.Fatalf("collect did not delete the block being reused (%s): deleted %q", orphan, m.Collect.Deleted)
			}
			_, _, err = verifySnapshot(&jobs.Config{NoSync: true}, r.path)
			if !errors.Is(err, jobs.ErrMissingBlock) {
				t.Fatalf("read after the race: %v, want ErrMissingBlock", err)
			}
			t.Logf("as expected without the lock: %v", err)
		})
	}
}

// TestCollectLockProtectsReusedBlock is the same race with the namespace lock
// (the default): the collect, started while the writer holds the lock shared
// and has just decided to reuse a block, waits for the exclusive lock, then
// sees the new manifest and keeps every block it names; the snapshot reads
// back verified. Without the lock, a BlockGrace spares blocks written
// recently (fresh mtime), which is the only case it covers.
func TestCollectLockProtectsReusedBlock(t *testing.T) {
	for _, tc := range []struct {
		name       string
		noLock     bool
		blockGrace time.Duration
	}{
		{"lock", false, 0},
		{"no lock, BlockGrace, fresh blocks", true, time.Hour},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := newReuseRace(t)
			reached, resume, done := r.rewritePaused(jobs.Config{NoSync: true, NoLock: tc.noLock})
			orphan := <-reached
			locking := make(chan struct{})
			var once sync.Once
			colFS := &testutil.HookFS{FS: vfs.Default, BeforeLock: func(string, bool) { once.Do(func() { close(locking) }) }}
			type result struct {
				m   jobs.Metrics
				err error
			}
			colDone := make(chan result, 1)
			go func() { // owned by the test: it receives colDone
				m, err := jobs.Collect(context.Background(), &jobs.Config{Root: r.root, FS: colFS, NoSync: true, NoLock: tc.noLock},
					&jobs.CollectRequest{BlockGrace: tc.blockGrace})
				colDone <- result{m, err}
			}()
			if tc.noLock {
				res := <-colDone // nothing to wait for: it runs inside the writer's window
				close(resume)
				if err := <-done; err != nil || res.err != nil {
					t.Fatalf("write: %v; collect: %v", err, res.err)
				}
				if res.m.Collect.BlocksDeleted != 0 {
					t.Errorf("collect deleted %q despite BlockGrace", res.m.Collect.Deleted)
				}
			} else {
				select {
				case <-locking: // the collect is taking its lock; the writer holds it shared
				case res := <-colDone:
					close(resume)
					<-done
					t.Fatalf("collect finished (%v, deleted %q) while the writer held the namespace lock", res.err, res.m.Collect.Deleted)
				}
				close(resume)
				if err := <-done; err != nil {
					t.Fatalf("write: %v", err)
				}
				res := <-colDone
				if res.err != nil {
					t.Fatalf("collect: %v", res.err)
				}
				if res.m.Collect.ManifestsScanned != 1 {
					t.Errorf("collect scanned %d manifests, want 1", res.m.Collect.ManifestsScanned)
				}
				for _, d := range res.m.Collect.Deleted {
					if d == orphan || r.orphans[d] {
						t.Errorf("collect deleted %s, named by the manifest the writer published", d)
					}
				}
			}
			_, v, err := verifySnapshot(&jobs.Config{NoSync: true}, r.path)
			if err != nil || v.Tokens != 200 || v.Seq != 3 {
				t.Fatalf("read after the race: %+v, %v; want the 200-token rewrite (seq 3)", v, err)
			}
		})
	}
}
