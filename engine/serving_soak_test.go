package engine_test

import (
	"bytes"
	"context"
	"errors"
	"flag"
	"fmt"
	"io/fs"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strconv"
	"syscall"
	"testing"
	"time"

	"github.com/kvpersist/kvpersist/engine"
	"github.com/kvpersist/kvpersist/engine/layout"
	"github.com/kvpersist/kvpersist/engine/metrics"
	"github.com/kvpersist/kvpersist/engine/vfs"
	"github.com/kvpersist/kvpersist/internal/kvgen"
	"github.com/kvpersist/kvpersist/internal/serving"
	"github.com/zeebo/xxh3"
)

// The serving soak (issue 13): the serving loop (internal/serving) at
// capacity in a helper process, fsync on, killed with SIGKILL at random
// moments; after every kill the store is walked and reopened.

const (
	// soakCapacityBytes bounds the helper's page cache: 32 page files of
	// the tiny model at 64 tokens per page (32 KiB allocated each), fewer
	// than the 8 active conversations hold, so evictions start within the
	// first dozen turns and never stop.
	soakCapacityBytes = 1 << 20
	// soakLoops serving loops run side by side in the helper: at most
	// that many saves are in flight at once.
	soakLoops = 2
)

// soakFigures is what the helper reports on each "stats" line (totals
// since it started).
type soakFigures struct {
	turns, saves, refused, loads, hit, miss, evicted int64
}

func (f soakFigures) line() string {
	return fmt.Sprintf("stats %d %d %d %d %d %d %d", f.turns, f.saves, f.refused, f.loads, f.hit, f.miss, f.evicted)
}

func parseSoakFigures(l string) (soakFigures, bool) {
	var f soakFigures
	_, err := fmt.Sscanf(l, "stats %d %d %d %d %d %d %d", &f.turns, &f.saves, &f.refused, &f.loads, &f.hit, &f.miss, &f.evicted)
	return f, err == nil
}

func (f *soakFigures) add(o soakFigures) {
	f.turns += o.turns
	f.saves += o.saves
	f.refused += o.refused
	f.loads += o.loads
	f.hit += o.hit
	f.miss += o.miss
	f.evicted += o.evicted
}

// servingSoakMain is the soak helper: an engine bounded to
// soakCapacityBytes (fsync on, two workers, metrics recorded) and
// soakLoops serving loops, every loaded byte compared with the content of
// its token ids. It prints "ready", then after every turn of each loop a
// "stats" line of its totals (soakFigures), and runs until killed. A
// mismatch or an engine error ends it with status 1.
func servingSoakMain(args []string) int {
	fl := flag.NewFlagSet("serving-soak", flag.ContinueOnError)
	root := fl.String("root", "", "store root")
	seed := fl.Uint64("seed", 1, "random seed")
	if err := fl.Parse(args); err != nil {
		return 2
	}
	rec, err := metrics.New(metrics.Options{})
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	e, err := engine.New(engine.Config{Root: *root, Workers: 2, Logger: discardLogger, CapacityBytes: soakCapacityBytes, Metrics: rec})
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	var loops []*serving.Loop
	for s := range soakLoops {
		l, err := serving.New(serving.Options{Stream: s, Streams: soakLoops, Seed: *seed, Verify: true, Active: 4})
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			return 1
		}
		loops = append(loops, l)
	}
	fmt.Println("ready")
	var total serving.Stats
	for {
		st, err := serving.Run(context.Background(), e, loops, 1)
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			return 1
		}
		total.Add(st)
		var evicted int64
		for _, ev := range rec.Snapshot().Evicted {
			evicted += ev.Pages
		}
		fmt.Println(soakFigures{total.Turns, total.Saves, total.SavesRefused, total.Loads, total.HitTokens, total.MissTokens, evicted}.line())
	}
}

// soakDuration is how long the long soak runs ($KVPERSIST_SOAK_DURATION,
// a Go duration; default 5 minutes).
func soakDuration(t *testing.T) time.Duration {
	d := 5 * time.Minute
	if s := os.Getenv("KVPERSIST_SOAK_DURATION"); s != "" {
		var err error
		if d, err = time.ParseDuration(s); err != nil || d <= 0 {
			t.Fatalf("KVPERSIST_SOAK_DURATION=%q: want a positive Go duration", s)
		}
	}
	return d
}

// soakDisk is a walk of the page files of a store's namespace.
type soakDisk struct {
	pages, temps         int
	pageBytes, tempBytes int64 // allocated bytes (st_blocks × 512)
	maxPageBytes         int64
	verified             int
	tensorBytesVerified  int64
	firstProblem         error
	problems             int
}

// walkSoakStore walks the page tree of root's serving namespace: every
// published page file decodes (layout.Load: header, validation, key = the
// chain step from its parent over its token ids), is named by its key,
// every tensor verifies (xxh3-64) and holds the content of the page's token
// ids (serving.PageContent); it sums allocated bytes (st_blocks × 512) of
// the page files and, apart, of the temp files.
func walkSoakStore(t *testing.T, root string) soakDisk {
	t.Helper()
	var d soakDisk
	m := kvgen.Tiny
	problem := func(err error) {
		d.problems++
		if d.firstProblem == nil {
			d.firstProblem = err
		}
	}
	dir := filepath.Join(root, serving.DefaultNamespace, layout.PagesDirName)
	err := filepath.WalkDir(dir, func(p string, de fs.DirEntry, err error) error {
		if err != nil {
			if errors.Is(err, fs.ErrNotExist) && p == dir {
				return fs.SkipDir
			}
			return err
		}
		if !de.Type().IsRegular() {
			return nil
		}
		fi, err := de.Info()
		if err != nil {
			return err
		}
		alloc, _ := vfs.AllocatedBytes(fi)
		if layout.IsTemp(de.Name()) {
			d.temps++
			d.tempBytes += alloc
			return nil
		}
		d.pages++
		d.pageBytes += alloc
		d.maxPageBytes = max(d.maxPageBytes, alloc)
		snap, err := layout.Load(vfs.Default, p)
		if err != nil {
			problem(err)
			return nil
		}
		if snap.Page == nil || snap.Page.Key.String() != de.Name() {
			problem(fmt.Errorf("%s: not the page its name says", p))
			return nil
		}
		raw, err := os.ReadFile(p)
		if err != nil {
			return err
		}
		for i, tt := range snap.Header.Slots() {
			data := raw[int64(snap.DataStart)+tt.Off:][:tt.Bytes]
			if got := layout.TensorHash(xxh3.Hash(data)); got != tt.Hash {
				problem(fmt.Errorf("%s tensor %d: xxh3 %s, header %s", p, i, got, tt.Hash))
				return nil
			}
			if !bytes.Equal(data, serving.PageContent(m, snap.Page.Tokens, i)) {
				problem(fmt.Errorf("%s tensor %d: not the KV of its token ids", p, i))
				return nil
			}
			d.tensorBytesVerified += tt.Bytes
		}
		d.verified++
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return d
}

// TestServingSoakSIGKILL: the serving loop at capacity (soakCapacityBytes)
// in a helper process, killed with SIGKILL after a random number of turns
// (a few in `make test`; for KVPERSIST_SOAK_DURATION, default 5 minutes,
// in `make soak`). After every kill:
//   - every published page file decodes, is named by its key, verifies and
//     holds the KV of its token ids;
//   - the published page files' allocated bytes stay within the bound of
//     engine.Config.CapacityBytes: capacity + soakLoops saves in flight ×
//     the largest page file (temp files a killed save left are counted
//     apart: no live engine accounts them until collect removes them);
//   - an engine reopened on the store (unbounded, so nothing is evicted
//     while it is compared) accounts exactly the page files found:
//     Usage().UsedBytes equals their st_blocks × 512, Pages their count.
//
// The figures (turns, evictions, kills, pages verified) are logged.
func TestServingSoakSIGKILL(t *testing.T) {
	seed := uint64(time.Now().UnixNano())
	t.Logf("seed %d", seed)
	rng := rand.New(rand.NewPCG(seed, 13))
	root := t.TempDir()
	long := soakLong()
	var deadline time.Time
	rounds := 4
	if long {
		deadline = time.Now().Add(soakDuration(t))
		rounds = 1 << 30
	}
	start := time.Now()
	var total soakFigures
	kills, verified, temps := 0, 0, 0
	var tempBytes int64
	var verifiedBytes int64
	for round := 0; round < rounds && (deadline.IsZero() || time.Now().Before(deadline)); round++ {
		h := startHelper(t, "serving-soak", "-root", root, "-seed", strconv.FormatUint(rng.Uint64(), 10))
		if l, ok := <-h.lines; !ok || l != "ready" {
			rest, st := h.wait()
			t.Fatalf("helper did not start: %q %q %v\n%s", l, rest, st, h.stderr.String())
		}
		// Kill after k stats lines (turns), then 0-50 ms more.
		k := 3 + rng.IntN(8)
		if long {
			k = 5 + rng.IntN(60)
		}
		var last soakFigures
		guard := time.After(2 * time.Minute)
	wait:
		for k > 0 {
			select {
			case l, ok := <-h.lines:
				if !ok {
					break wait
				}
				if f, ok := parseSoakFigures(l); ok {
					last = f
					k--
				}
			case <-guard:
				break wait
			}
		}
		time.Sleep(time.Duration(rng.IntN(50)) * time.Millisecond)
		if err := h.cmd.Process.Signal(syscall.SIGKILL); err != nil {
			t.Fatal(err)
		}
		rest, st := h.wait()
		for _, l := range rest {
			if f, ok := parseSoakFigures(l); ok {
				last = f
			}
		}
		h.checkStderr()
		if ws, ok := st.Sys().(syscall.WaitStatus); !ok || !ws.Signaled() || ws.Signal() != syscall.SIGKILL {
			t.Fatalf("round %d: helper ended by itself, not by SIGKILL: %v\n%s", round, st, h.stderr.String())
		}
		kills++
		total.add(last)

		d := walkSoakStore(t, root)
		if d.firstProblem != nil {
			t.Fatalf("round %d: %d bad page files; first: %v", round, d.problems, d.firstProblem)
		}
		verified += d.verified
		verifiedBytes += d.tensorBytesVerified
		// The bound holds for the page files and the temp page files a
		// killed save left (the next engine counts them until it removes
		// them after the grace).
		if bound := int64(soakCapacityBytes) + soakLoops*d.maxPageBytes; d.pageBytes+d.tempBytes > bound {
			t.Errorf("round %d: page files take %d allocated bytes and temp page files %d: more than capacity %d + %d saves in flight × %d",
				round, d.pageBytes, d.tempBytes, soakCapacityBytes, soakLoops, d.maxPageBytes)
		}
		temps, tempBytes = d.temps, d.tempBytes
		// The accounting, rebuilt from the disk by a new engine.
		e, err := engine.New(engine.Config{Root: root, Logger: discardLogger})
		if err != nil {
			t.Fatal(err)
		}
		u := e.Usage()
		if err := e.Close(context.Background()); err != nil {
			t.Fatal(err)
		}
		if u.UsedBytes != d.pageBytes+d.tempBytes || u.TempBytes != d.tempBytes || u.Pages != d.pages {
			t.Fatalf("round %d: reopened engine accounts %d pages, %d bytes (%d of temp files); the disk holds %d page files of %d allocated bytes and %d bytes of temp files",
				round, u.Pages, u.UsedBytes, u.TempBytes, d.pages, d.pageBytes, d.tempBytes)
		}
	}
	summary := fmt.Sprintf("serving soak: %s, %d kills, %d turns (%d saves, %d refused, %d loads, %d lookups; hit rate %.3f in tokens), %d pages evicted, %d page checks (%d MiB of KV compared), %d temp files (%d KiB) left by the kills",
		time.Since(start).Round(time.Second), kills, total.turns, total.saves, total.refused, total.loads, total.turns,
		float64(total.hit)/float64(max(total.hit+total.miss, 1)), total.evicted, verified, verifiedBytes>>20, temps, tempBytes>>10)
	t.Log(summary)
	if long {
		fmt.Println(summary) // make soak's closing figures
	}
	if total.saves == 0 || verified == 0 {
		t.Fatalf("nothing was saved and checked: %s", summary)
	}
	if total.evicted == 0 {
		t.Fatalf("no page was evicted: the soak did not run at capacity: %s", summary)
	}
}
