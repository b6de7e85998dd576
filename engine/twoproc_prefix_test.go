package engine_test

import (
	"context"
	"flag"
	"fmt"
	"math/rand/v2"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/kvpersist/kvpersist/engine"
	"github.com/kvpersist/kvpersist/engine/jobs"
	"github.com/kvpersist/kvpersist/internal/kvgen"
)

// Two processes saving the same prefix pages beside a third collecting:
// the prefix cache's share of the two-process tests. Both writers save the
// conversations of the crash test (cpTokens: a shared 200-token prompt,
// then each conversation's own tokens) to one namespace, so they race to
// create the same page files; the collector deletes every temp file it
// may (-tempgrace -1ns), which it may only under the namespace's exclusive
// lock, never a writer's in-flight page.

// prefixWriterMain is the prefix-writer helper: n prefix saves through an
// engine (two in flight, no fsync: the lock is under test), conversation
// and length drawn at random. It prints "ack <conv> <tokens>" per
// successful save, "fail <conv> <tokens> <message>" per failed one, and
// "done" before exiting 0.
func prefixWriterMain(args []string) int {
	fl := flag.NewFlagSet("prefix-writer", flag.ContinueOnError)
	root := fl.String("root", "", "store root")
	n := fl.Int("n", 100, "saves")
	seed := fl.Uint64("seed", 1, "random seed")
	if err := fl.Parse(args); err != nil {
		return 2
	}
	e, err := engine.New(engine.Config{Root: *root, Workers: 2, NoSync: true, Logger: discardLogger})
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	cache := kvgen.NewCache(kvgen.Tiny, cpMaxTokens, true, nil)
	rng := rand.New(rand.NewPCG(*seed, 5))
	toks := cpAllTokens()
	acks := make(chan engine.Result, 2)
	what := map[uint64]string{}
	inFlight := 0
	for i := 0; i < *n || inFlight > 0; {
		if i < *n && inFlight < 2 {
			c, k := rng.IntN(cpConvs), 1+rng.IntN(cpMaxTokens)
			j, err := e.Submit(context.Background(), cpSave(cache, toks, c, k), engine.AckTo(acks))
			if err != nil {
				fmt.Fprintln(os.Stderr, err)
				return 1
			}
			what[j.ID] = fmt.Sprintf("%d %d", c, k)
			i++
			inFlight++
			continue
		}
		r := <-acks
		inFlight--
		if r.Err != nil {
			fmt.Printf("fail %s %s\n", what[r.ID], strings.ReplaceAll(r.Err.Error(), "\n", " "))
		} else {
			fmt.Printf("ack %s\n", what[r.ID])
		}
		delete(what, r.ID)
	}
	if err := e.Close(context.Background()); err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	fmt.Println("done")
	return 0
}

// TestTwoProcessPrefixSaveCollect: two writer processes save the same
// conversations' prefix pages while a collector process loops
// jobs.Collect over the root with every temp file taken for stale. No save
// fails and no collect fails; afterwards every acked save loads back
// whole, verified, holding exactly the KV of its tokens, and VerifyStore
// finds every page file whole (key chain, name, tensor hashes) and no
// problem at all.
func TestTwoProcessPrefixSaveCollect(t *testing.T) {
	n := 60
	if soakLong() {
		n = 1000
	}
	root := t.TempDir()
	col := startHelper(t, "collector", "-root", root, "-tempgrace", "-1ns")
	seed := uint64(time.Now().UnixNano())
	t.Logf("seed %d", seed)
	var ws []*helperProc
	for i := range 2 {
		ws = append(ws, startHelper(t, "prefix-writer", "-root", root, "-n", strconv.Itoa(n), "-seed", strconv.FormatUint(seed+uint64(i), 10)))
	}
	acked := map[string]bool{}
	nAcked := 0
	for _, w := range ws {
		for _, l := range w.waitOK() {
			switch {
			case strings.HasPrefix(l, "ack "):
				acked[strings.TrimPrefix(l, "ack ")] = true
				nAcked++
			case l == "done":
			default:
				t.Errorf("writer: %s", l)
			}
		}
	}
	if err := col.stdin.Close(); err != nil {
		t.Fatal(err)
	}
	collects := 0
	for _, l := range col.waitOK() {
		if strings.HasPrefix(l, "collect ok ") {
			collects++
		} else {
			t.Errorf("collector: %s", l)
		}
	}
	if nAcked != 2*n {
		t.Errorf("%d of %d saves acked", nAcked, 2*n)
	}
	if collects == 0 {
		t.Fatal("the collector never collected")
	}
	// Every acked save loads back whole, verified, with its own KV.
	cache := kvgen.NewCache(kvgen.Tiny, cpMaxTokens, true, nil)
	for a := range acked {
		cpCheckAcked(t, root, cache, a)
	}
	r, err := jobs.VerifyStore(context.Background(), &jobs.Config{NoSync: true}, &jobs.VerifySpec{Target: root, TempGrace: -1})
	if err != nil {
		t.Fatal(err)
	}
	if len(r.Problems) != 0 || r.Checked.Pages == 0 {
		t.Fatalf("verify after the run: %d pages checked, problems %v", r.Checked.Pages, r.Problems)
	}
	t.Logf("2 writer processes: %d saves acked (%d distinct); collector process: %d collects; %d page files verified",
		nAcked, len(acked), collects, r.Checked.Pages)
}
