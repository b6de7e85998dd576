package engine_test

import (
	"bufio"
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
	"strings"
	"testing"
	"time"

	"github.com/kvpersist/kvpersist/engine"
	"github.com/kvpersist/kvpersist/engine/gather"
	"github.com/kvpersist/kvpersist/engine/jobs"
	"github.com/kvpersist/kvpersist/engine/layout"
	"github.com/kvpersist/kvpersist/engine/vfs"
	"github.com/kvpersist/kvpersist/internal/kvgen"
	"github.com/kvpersist/kvpersist/internal/testutil"
	"github.com/zeebo/xxh3"
)

// The prefix cache under SIGKILL: a helper saves growing conversations that
// share a 200-token system prompt (fsync on, pages of 64 tokens); the test
// kills it at random moments and checks every page file left.

const (
	cpConvs     = 4
	cpMaxTokens = 1024
	cpPage      = 64
	cpIdentity  = "tiny/bf16"
)

// cpTokens is conversation c's token ids: a shared 200-token prompt, then
// its own.
func cpTokens(c int) []uint32 {
	out := make([]uint32, cpMaxTokens)
	for i := range out {
		if i < 200 {
			out[i] = uint32(50000 + i)
		} else {
			out[i] = uint32(c*100000 + i)
		}
	}
	return out
}

// cpAllTokens is every conversation's token ids (cpTokens).
func cpAllTokens() [][]uint32 {
	toks := make([][]uint32, cpConvs)
	for c := range toks {
		toks[c] = cpTokens(c)
	}
	return toks
}

// cpSave is the prefix save of the first n tokens of conversation c
// (cpAllTokens), the KV from cache.
func cpSave(cache *kvgen.Cache, toks [][]uint32, c, n int) *engine.SavePrefixRequest {
	return &engine.SavePrefixRequest{Namespace: "p", Identity: cpIdentity,
		Tokens: toks[c][:n], Tensors: cpTensors(cache, n), PageTokens: cpPage}
}

// cpCheckAcked loads the acked save a ("<conv> <tokens>") of root's
// namespace p into fresh row-major destinations, verified, and fails the
// test unless every token loads and holds exactly the KV cache saved.
func cpCheckAcked(t *testing.T, root string, cache *kvgen.Cache, a string) {
	t.Helper()
	var c, n int
	if _, err := fmt.Sscanf(a, "%d %d", &c, &n); err != nil {
		t.Fatalf("bad ack %q", a)
	}
	m := kvgen.Tiny
	shape := []int{1, m.KVHeads, n, m.HeadDim}
	dest := make([]jobs.TensorSpec, 2*m.Layers)
	for i := range dest {
		dest[i] = jobs.TensorSpec{DType: m.DType, View: gather.View{Base: make([]byte, m.KVHeads*n*m.HeadDim*2),
			Shape: shape, Strides: gather.RowMajor(shape), ItemSize: 2}}
	}
	res, _, err := jobs.LoadPrefix(context.Background(), &jobs.Config{Root: root, NoSync: true}, &jobs.LoadPrefixRequest{
		Namespace: "p", Identity: cpIdentity, Tokens: cpTokens(c)[:n], Dest: dest, PageTokens: cpPage}, nil)
	if err != nil || res.Tokens != n {
		t.Fatalf("acked save %s loads %+v %v", a, res, err)
	}
	for i, d := range dest {
		want, _, err := cache.ViewsAt(n)[i].Gather(make([]byte, d.View.Bytes()))
		if err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(d.View.Base, want) {
			t.Fatalf("acked save %s: tensor %d differs from the KV saved", a, i)
		}
	}
}

func cpTensors(cache *kvgen.Cache, n int) []jobs.TensorSpec {
	vs := cache.ViewsAt(n)
	out := make([]jobs.TensorSpec, 2*cache.Model.Layers)
	for i := range out {
		out[i] = jobs.TensorSpec{DType: cache.Model.DType, View: vs[i]}
	}
	return out
}

// crashPrefixMain saves conversations, two saves in flight, printing
// "ready", then "ack <conv> <tokens>" for each successful save; it runs
// until killed. With -capacity (a bounded page cache) a save refused
// with ErrNoSpace prints "nospace <conv> <tokens>", and every ack is
// followed by "evicted <pages evicted so far>". With -wait it reads a
// line from stdin after "ready" before it starts; with -minconv c it
// saves only conversations c and later.
func crashPrefixMain(args []string) int {
	fl := flag.NewFlagSet("crash-prefix", flag.ContinueOnError)
	root := fl.String("root", "", "store root")
	seed := fl.Uint64("seed", 1, "random seed")
	capacity := fl.Int64("capacity", 0, "page cache capacity in bytes (0: unbounded)")
	nosync := fl.Bool("nosync", false, "no fsync")
	wait := fl.Bool("wait", false, "after \"ready\", wait for a line on stdin before saving")
	minConv := fl.Int("minconv", 0, "save only conversations from this one on")
	maxConv := fl.Int("maxconv", cpConvs, "save only conversations before this one")
	tempGrace := fl.Duration("tempgrace", 0, "Config.TempGrace (0: the default)")
	if err := fl.Parse(args); err != nil {
		return 2
	}
	ev := &evictCounter{}
	e, err := engine.New(engine.Config{Root: *root, Workers: 2, Logger: discardLogger, CapacityBytes: *capacity, NoSync: *nosync, Metrics: ev, TempGrace: *tempGrace})
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	cache := kvgen.NewCache(kvgen.Tiny, cpMaxTokens, true, nil)
	rng := rand.New(rand.NewPCG(*seed, 3))
	toks := cpAllTokens()
	acks := make(chan engine.Result, 2)
	what := map[uint64]string{}
	fmt.Println("ready")
	if *wait {
		if _, err := bufio.NewReader(os.Stdin).ReadString('\n'); err != nil {
			fmt.Fprintln(os.Stderr, err)
			return 1
		}
	}
	inFlight := 0
	for {
		for ; inFlight < 2; inFlight++ {
			c, n := *minConv+rng.IntN(*maxConv-*minConv), 1+rng.IntN(cpMaxTokens)
			j, err := e.Submit(context.Background(), cpSave(cache, toks, c, n), engine.AckTo(acks))
			if err != nil {
				fmt.Fprintln(os.Stderr, err)
				return 1
			}
			what[j.ID] = fmt.Sprintf("%d %d", c, n)
		}
		r := <-acks
		inFlight--
		if r.Err != nil && !(*capacity > 0 && errors.Is(r.Err, engine.ErrNoSpace)) {
			fmt.Fprintln(os.Stderr, r.Err)
			return 1
		}
		if r.Err != nil {
			fmt.Printf("nospace %s\n", what[r.ID])
		} else {
			fmt.Printf("ack %s\n", what[r.ID])
		}
		if *capacity > 0 {
			fmt.Printf("evicted %d\n", ev.pages.Load())
		}
		delete(what, r.ID)
	}
}

// TestCrashPrefixSIGKILL: after every kill, every page file decodes, is
// named by its key, verifies, and holds exactly the KV of the tokens its key
// stands for; every acked save loads back whole, verified.
func TestCrashPrefixSIGKILL(t *testing.T) {
	kills, rng := crashRounds(t, 6, 100, 4)
	root := t.TempDir()
	where := cpWhere()
	cache := kvgen.NewCache(kvgen.Tiny, cpMaxTokens, true, nil)
	acked := map[string]bool{}
	pagesSeen := 0
	for round := range kills {
		h := startHelper(t, "crash-prefix", "-root", root, "-seed", strconv.FormatUint(rng.Uint64(), 10))
		if l, ok := <-h.lines; !ok || l != "ready" {
			rest, st := h.wait()
			t.Fatalf("helper did not start: %q %q %v\n%s", l, rest, st, h.stderr.String())
		}
		// Kill after k acks (k in 0..3: saves are slow under -race with
		// fsync on a loaded machine), then a random 0-100 ms more.
		var rest []string
		guard := time.After(60 * time.Second)
		for k := rng.IntN(4); k > 0; {
			select {
			case l, ok := <-h.lines:
				if !ok {
					k = 0
					break
				}
				rest = append(rest, l)
				if strings.HasPrefix(l, "ack ") {
					k--
				}
			case <-guard:
				k = 0
			}
		}
		time.Sleep(time.Duration(rng.IntN(100)) * time.Millisecond)
		_ = h.cmd.Process.Kill()
		more, _ := h.wait()
		rest = append(rest, more...)
		h.checkStderr()
		for _, l := range rest {
			if a, ok := strings.CutPrefix(l, "ack "); ok {
				acked[a] = true
			}
		}
		// Every page file left is whole and right.
		pagesSeen += cpCheckPages(t, root, cache, where, round)
		// Every acked save loads back whole, with the KV saved.
		for a := range acked {
			cpCheckAcked(t, root, cache, a)
		}
	}
	t.Logf("%d kills, %d saves acked, %d page file checks", kills, len(acked), pagesSeen)
	if len(acked) == 0 {
		t.Fatal("no save was acked before a kill: the test checked nothing of durability")
	}
}

// cpWhere maps every key a save of the conversations can produce to the
// token range [lo, hi) it covers.
func cpWhere() map[layout.PageKey][2]int {
	where := map[layout.PageKey][2]int{}
	for c := range cpConvs {
		toks := cpTokens(c)
		keys, _, _ := layout.PageChain(cpIdentity, cpPage, toks)
		for i, k := range keys {
			where[k] = [2]int{i * cpPage, (i + 1) * cpPage}
		}
		for n := 1; n <= cpMaxTokens; n++ {
			if n%cpPage != 0 {
				full := n / cpPage
				parent := layout.PageRoot(cpIdentity, cpPage)
				if full > 0 {
					parent = keys[full-1]
				}
				where[layout.PageNext(parent, toks[full*cpPage:n])] = [2]int{full * cpPage, n}
			}
		}
	}
	return where
}

// cpCheckPages checks every page file of root's namespace p: it decodes,
// is named by its key, is a page of a conversation (where), verifies,
// and holds exactly the KV of the tokens its key stands for. It returns
// how many it checked.
func cpCheckPages(t *testing.T, root string, cache *kvgen.Cache, where map[layout.PageKey][2]int, round int) int {
	t.Helper()
	pagesSeen := 0
	err := filepath.WalkDir(testutil.PagesDir(filepath.Join(root, "p")), func(p string, d fs.DirEntry, err error) error {
		if err != nil || !d.Type().IsRegular() || layout.IsTemp(d.Name()) {
			return err
		}
		pagesSeen++
		snap, err := layout.Load(vfs.Default, p)
		if err != nil {
			return fmt.Errorf("round %d: %w", round, err)
		}
		if snap.Page.Key.String() != d.Name() {
			return fmt.Errorf("round %d: %s holds key %s", round, p, snap.Page.Key)
		}
		span, ok := where[snap.Page.Key]
		if !ok {
			return fmt.Errorf("round %d: %s is no page of any conversation", round, p)
		}
		raw, err := os.ReadFile(p)
		if err != nil {
			return err
		}
		dest := make([][]byte, len(snap.Header.Slots()))
		for i, tt := range snap.Header.Slots() { // every tensor verifies
			dest[i] = raw[int64(snap.DataStart)+tt.Off:][:tt.Bytes]
			if got := layout.TensorHash(xxh3.Hash(dest[i])); got != tt.Hash {
				return fmt.Errorf("round %d: %s tensor %d: xxh3 %s, header %s", round, p, i, got, tt.Hash)
			}
		}
		for i := range dest {
			v := cache.ViewsAt(cpMaxTokens)[i]
			var shp [4]int
			sub, err := v.SliceAxis(2, span[0], span[1], shp[:])
			if err != nil {
				return err
			}
			want, _, err := sub.Gather(make([]byte, sub.Bytes()))
			if err != nil {
				return err
			}
			if !bytes.Equal(dest[i], want) {
				return fmt.Errorf("round %d: %s tensor %d differs from tokens [%d, %d)", round, p, i, span[0], span[1])
			}
		}
		return nil
	})
	if err != nil && !os.IsNotExist(err) {
		t.Fatal(err)
	}
	return pagesSeen
}

// crashRounds is a crash loop's number of kills (long under make soak)
// and its random source, seeded from the clock (logged, to replay).
func crashRounds(t *testing.T, kills, long int, stream uint64) (int, *rand.Rand) {
	if soakLong() {
		kills = long
	}
	seed := uint64(time.Now().UnixNano())
	t.Logf("seed %d", seed)
	return kills, rand.New(rand.NewPCG(seed, stream))
}
