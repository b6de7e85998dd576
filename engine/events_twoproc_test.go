package engine_test

import (
	"bufio"
	"context"
	"encoding/binary"
	"flag"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"testing"
	"time"

	"github.com/go-zeromq/zmq4"
	"github.com/kvpersist/kvpersist/engine"
	"github.com/kvpersist/kvpersist/engine/events"
	"github.com/kvpersist/kvpersist/engine/layout"
	"github.com/kvpersist/kvpersist/internal/kvgen"
	"github.com/kvpersist/kvpersist/internal/testutil"
	"github.com/vmihailenco/msgpack/v5"
)

// Two engines on one root announce KV events: each page file removed is
// announced once, as BlockRemoved, by the process that removed it.

// evPages is the pages of each conversation of these tests (no leaf).
const evPages = 4

// evTokens is conversation c's token ids: evPages full pages, shared with
// no other conversation.
func evTokens(c int) []uint32 {
	out := make([]uint32, evPages*cpPage)
	for i := range out {
		out[i] = uint32(c*100000 + i)
	}
	return out
}

// evLoopback returns a loopback TCP endpoint no one listens on now.
func evLoopback(t *testing.T) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return "tcp://" + l.Addr().String()
}

// evEvents is the KV events configuration of these tests' engines.
func evEvents(pod, endpoint, replay string) *events.Config {
	return &events.Config{Endpoint: endpoint, ReplayEndpoint: replay, Topic: events.Topic(pod, "tiny")}
}

// evSettle waits until e's publisher has sent every event offered (its
// counters stay still for 200 ms).
func evSettle(e *engine.Engine) {
	var last events.Stats
	for still := 0; still < 4; time.Sleep(50 * time.Millisecond) {
		st, _ := e.EventStats()
		if st == last {
			still++
		} else {
			still, last = 0, st
		}
	}
}

// evReplay asks a replay endpoint for every batch kept from sequence 0
// and returns the hashes stored and removed, each removal counted; it
// fails on a gap in the sequence.
func evReplay(t *testing.T, endpoint string) (stored map[uint64]bool, removed map[uint64]int) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	d := zmq4.NewDealer(ctx)
	defer d.Close()
	if err := d.Dial(endpoint); err != nil {
		t.Fatal(err)
	}
	if err := d.SendMulti(zmq4.NewMsgFrom(nil, make([]byte, 8))); err != nil {
		t.Fatal(err)
	}
	stored, removed = map[uint64]bool{}, map[uint64]int{}
	next := uint64(0)
	for {
		m, err := d.Recv()
		if err != nil {
			t.Fatal(err)
		}
		seq := binary.BigEndian.Uint64(m.Frames[1])
		if int64(seq) == -1 {
			return stored, removed
		}
		if seq != next {
			t.Fatalf("%s: batch %d after %d", endpoint, seq, next-1)
		}
		next++
		var b struct {
			_      struct{} `msgpack:",array"`
			TS     float64
			Events [][]msgpack.RawMessage
			Rank   int
		}
		if err := msgpack.Unmarshal(m.Frames[2], &b); err != nil {
			t.Fatal(err)
		}
		for _, ev := range b.Events {
			var tag string
			var hashes []uint64
			if len(ev) < 2 || msgpack.Unmarshal(ev[0], &tag) != nil || msgpack.Unmarshal(ev[1], &hashes) != nil {
				t.Fatalf("%s: event %v", endpoint, ev)
			}
			for _, h := range hashes {
				switch tag {
				case "BlockStored":
					stored[h] = true
				case "BlockRemoved":
					removed[h]++
				}
			}
		}
	}
}

// TestEventsTwoProcessRemovals: this process saves 4 conversations, then
// a helper on the same root with room for 5 conversations saves 8 more
// and evicts; this process then loads its conversations (finding the
// pages the helper evicted gone, which it does not announce). Every page
// file gone is announced removed exactly once, by the helper; this
// process announces no removal; the pages on disk are announced by no
// one as removed.
func TestEventsTwoProcessRemovals(t *testing.T) {
	cache := kvgen.NewCache(kvgen.Tiny, cpMaxTokens, true, nil)
	pb := cpPageBytes(t, cache)
	root := t.TempDir()
	replayA := evLoopback(t)
	e, err := engine.New(engine.Config{Root: root, Workers: 1, NoSync: true, Logger: discardLogger,
		Events: evEvents("a", "tcp://127.0.0.1:0", replayA)})
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close(context.Background())
	save := func(c int) {
		toks := evTokens(c)
		if r := e.Do(context.Background(), &engine.SavePrefixRequest{Namespace: "p", Identity: cpIdentity,
			Tokens: toks, Tensors: cpTensors(cache, len(toks)), PageTokens: cpPage}); r.Err != nil {
			t.Fatal(r.Err)
		}
	}
	for c := range 4 {
		save(c)
	}

	replayB := evLoopback(t)
	h := startHelper(t, "events-evictor", "-root", root, "-capacity", strconv.FormatInt(5*evPages*pb, 10),
		"-endpoint", evLoopback(t), "-replay", replayB)
	if l, ok := <-h.lines; !ok || l != "done" {
		rest, st := h.wait()
		t.Fatalf("helper: %q %q %v\n%s", l, rest, st, h.stderr.String())
	}
	for c := range 4 { // finds the evicted pages gone: forgotten, not announced
		cpLoadPartial(t, e, cache, evTokens(c))
	}
	evSettle(e)
	storedA, removedA := evReplay(t, replayA)
	storedB, removedB := evReplay(t, replayB)
	if _, err := h.stdin.Write([]byte("quit\n")); err != nil {
		t.Fatal(err)
	}
	h.waitOK()

	if len(removedA) != 0 {
		t.Fatalf("this process announced %d removals; it removed no page", len(removedA))
	}
	gone, goneOfA := 0, 0
	for c := range 12 {
		keys, _, err := layout.PageChain(cpIdentity, cpPage, evTokens(c))
		if err != nil {
			t.Fatal(err)
		}
		for i, k := range keys {
			hash := events.Hash64(k)
			if c < 4 && !storedA[hash] || c >= 4 && !storedB[hash] {
				t.Fatalf("conversation %d page %d: not announced stored by its saver", c, i)
			}
			_, statErr := os.Lstat(testutil.PagePath(filepath.Join(root, "p"), k))
			onDisk := statErr == nil
			switch n := removedB[hash]; {
			case onDisk && n != 0, !onDisk && n != 1:
				t.Fatalf("conversation %d page %d: on disk %v, announced removed %d times", c, i, onDisk, n)
			case !onDisk:
				gone++
				if c < 4 {
					goneOfA++
				}
			}
		}
	}
	if goneOfA == 0 || gone < 7*evPages {
		t.Fatalf("the helper evicted %d pages, %d of this process's", gone, goneOfA)
	}
	t.Logf("the helper evicted %d pages, %d of this process's", gone, goneOfA)
}

// eventsEvictorMain is the helper of TestEventsTwoProcessRemovals: an
// engine with -capacity bytes on -root publishing on -endpoint (replay
// on -replay) saves conversations 4 to 11, waits until its events are
// sent, prints "done", and closes when stdin says "quit".
func eventsEvictorMain(args []string) int {
	fs := flag.NewFlagSet("events-evictor", flag.ContinueOnError)
	root := fs.String("root", "", "")
	capacity := fs.Int64("capacity", 0, "")
	endpoint := fs.String("endpoint", "", "")
	replay := fs.String("replay", "", "")
	if err := fs.Parse(args); err != nil {
		return 2
	}
	cache := kvgen.NewCache(kvgen.Tiny, cpMaxTokens, true, nil)
	e, err := engine.New(engine.Config{Root: *root, Workers: 1, NoSync: true, Logger: discardLogger,
		CapacityBytes: *capacity, Events: evEvents("b", *endpoint, *replay)})
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	for c := 4; c < 12; c++ {
		toks := evTokens(c)
		if r := e.Do(context.Background(), &engine.SavePrefixRequest{Namespace: "p", Identity: cpIdentity,
			Tokens: toks, Tensors: cpTensors(cache, len(toks)), PageTokens: cpPage}); r.Err != nil {
			fmt.Fprintln(os.Stderr, r.Err)
			return 1
		}
	}
	evSettle(e)
	fmt.Println("done")
	sc := bufio.NewScanner(os.Stdin)
	for sc.Scan() && sc.Text() != "quit" {
	}
	if err := e.Close(context.Background()); err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	return 0
}
