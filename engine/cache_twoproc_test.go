package engine_test

import (
	"bytes"
	"context"
	"errors"
	"math/rand/v2"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvpersist/kvpersist/engine"
	"github.com/kvpersist/kvpersist/engine/evict"
	"github.com/kvpersist/kvpersist/engine/gather"
	"github.com/kvpersist/kvpersist/engine/jobs"
	"github.com/kvpersist/kvpersist/internal/kvgen"
	"github.com/kvpersist/kvpersist/internal/testutil"
)

// The bounded page cache across processes: a helper (crash-prefix with
// -capacity) saves the crash test's conversations into a cache too small
// for them, evicting all the time.

// evictCounter is a MetricsSink counting evicted pages.
type evictCounter struct {
	engine.NopMetrics
	pages atomic.Int64
}

func (c *evictCounter) Evicted(_ evict.Reason, pages, _ int64) { c.pages.Add(pages) }

// cpPageBytes is the allocated bytes of one full page of the crash
// test's conversations, measured on disk.
func cpPageBytes(t *testing.T, cache *kvgen.Cache) int64 {
	t.Helper()
	root := t.TempDir()
	e, err := engine.New(engine.Config{Root: root, Workers: 1, NoSync: true, Logger: discardLogger})
	if err != nil {
		t.Fatal(err)
	}
	if r := e.Do(context.Background(), cpSave(cache, cpAllTokens(), 0, cpPage)); r.Err != nil {
		t.Fatal(r.Err)
	}
	if err := e.Close(context.Background()); err != nil {
		t.Fatal(err)
	}
	b, _, n, _ := testutil.PageTree(t, root)
	if n != 1 {
		t.Fatalf("%d pages", n)
	}
	return b
}

// checkUsageEqualsDisk opens an engine on root (no capacity: nothing is
// evicted; the default temp grace: the temp page files a kill left are
// kept and counted) and requires its Usage, rebuilt from the disk, to
// equal a walk of the page and temp page files' st_blocks.
func checkUsageEqualsDisk(t *testing.T, root string, round int) {
	t.Helper()
	e, err := engine.New(engine.Config{Root: root, Workers: 1, NoSync: true, Logger: discardLogger})
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close(context.Background())
	u := e.Usage()
	b, tb, n, temps := testutil.PageTree(t, root)
	if u.UsedBytes != b+tb || u.TempBytes != tb || u.Pages != n {
		t.Fatalf("round %d: usage rebuilt at start %d bytes (%d of temp files) in %d pages; the disk %d bytes in %d pages and %d bytes in %d temp files",
			round, u.UsedBytes, u.TempBytes, u.Pages, b, n, tb, temps)
	}
}

// TestCrashEvictSIGKILL: a process saving into a full cache (every save
// evicts) is killed at random moments; after every kill each page file
// left is whole and right, and the accounting an engine rebuilds equals
// the disk (temp page files the kills left included). The page files and
// the temp page files together, sampled while the process runs and after
// each kill, never exceed the capacity by more than the bound (2 saves in
// flight × one page), however many kills left temp files: each start
// removes those older than the grace and counts the others.
func TestCrashEvictSIGKILL(t *testing.T) {
	kills, rng := crashRounds(t, 24, 100, 14)
	cache := kvgen.NewCache(kvgen.Tiny, cpMaxTokens, true, nil)
	pb := cpPageBytes(t, cache)
	capacity := 24 * pb
	root := t.TempDir()
	where := cpWhere()
	evicted := 0   // summed over the rounds
	tempsLeft := 0 // temp page files found after the kills
	var round int
	checkBound := func(when string) {
		t.Helper()
		pages, temps, _, n := testutil.PageTree(t, root)
		if bound := capacity + 2*pb; pages+temps > bound {
			t.Fatalf("round %d, %s: page files take %d bytes and %d temp page files %d bytes, above capacity %d + 2 saves × %d",
				round, when, pages, n, temps, capacity, pb)
		}
	}
	for round = range kills {
		roundEvicted := 0
		h := startHelper(t, "crash-prefix", "-root", root, "-seed", strconv.FormatUint(rng.Uint64(), 10),
			"-capacity", strconv.FormatInt(capacity, 10), "-nosync", "-tempgrace", "50ms")
		if l, ok := <-h.lines; !ok || l != "ready" {
			rest, st := h.wait()
			t.Fatalf("helper did not start: %q %q %v\n%s", l, rest, st, h.stderr.String())
		}
		guard := time.After(60 * time.Second)
		sample := time.NewTicker(5 * time.Millisecond)
		for k := 4 + rng.IntN(12); k > 0; {
			select {
			case <-sample.C:
				checkBound("while saving")
			case l, ok := <-h.lines:
				if !ok {
					k = 0
					break
				}
				if strings.HasPrefix(l, "ack ") {
					k--
				}
				if n, ok := strings.CutPrefix(l, "evicted "); ok {
					roundEvicted, _ = strconv.Atoi(n)
				}
			case <-guard:
				k = 0
			}
		}
		sample.Stop()
		time.Sleep(time.Duration(rng.IntN(30)) * time.Millisecond)
		_ = h.cmd.Process.Kill()
		rest, _ := h.wait()
		for _, l := range rest {
			if n, ok := strings.CutPrefix(l, "evicted "); ok {
				roundEvicted, _ = strconv.Atoi(n)
			}
		}
		evicted += roundEvicted
		h.checkStderr()
		checkBound("after the kill")
		_, _, _, temps := testutil.PageTree(t, root)
		tempsLeft += temps
		cpCheckPages(t, root, cache, where, round)
		checkUsageEqualsDisk(t, root, round)
	}
	t.Logf("%d kills, %d pages evicted, %d temp page files left by the kills", kills, evicted, tempsLeft)
	if evicted == 0 {
		t.Fatal("the helper never evicted: the test checked nothing of eviction")
	}
}

// TestCacheTwoProcessEviction: one process evicts (the helper, its cache
// full) while another saves and loads in the same namespace and keeps a
// named snapshot of pages (layout.Pages) that the evicting process also
// saves and so tracks. Every load of the second process succeeds with
// exactly the KV saved (the namespace's shared lock held during a load's
// reads keeps the evictor, which deletes under the exclusive lock, out),
// and the named snapshot reads back whole: the evictor, under its
// exclusive lock, scans the page manifests written since it started and
// leaves their pages (pins do not cross processes; the manifest does).
func TestCacheTwoProcessEviction(t *testing.T) {
	cache := kvgen.NewCache(kvgen.Tiny, cpMaxTokens, true, nil)
	pb := cpPageBytes(t, cache)
	root := t.TempDir()
	toks := cpAllTokens()
	e, err := engine.New(engine.Config{Root: root, Workers: 2, NoSync: true, Logger: discardLogger})
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close(context.Background())
	// Conversation 0's first 512 tokens (8 pages) are stored before the
	// evictor starts: it tracks them from its start, as its oldest pages.
	const named = 512
	if r := e.Do(context.Background(), cpSave(cache, toks, 0, named)); r.Err != nil {
		t.Fatal(r.Err)
	}
	h := startHelper(t, "crash-prefix", "-root", root, "-seed", "7", "-capacity", strconv.FormatInt(24*pb, 10), "-nosync", "-wait", "-minconv", "1")
	if l, ok := <-h.lines; !ok || l != "ready" {
		rest, st := h.wait()
		t.Fatalf("helper did not start: %q %q %v\n%s", l, rest, st, h.stderr.String())
	}
	lines := make(chan string, 1024)
	go func() { // owned by the helper: ends when its output does
		defer close(lines)
		for l := range h.lines {
			lines <- l
		}
	}()
	// Then a named snapshot of those pages (the manifest alone is new):
	// the evictor learns of it only by scanning under its lock.
	w := e.Do(context.Background(), &engine.WriteRequest{Ref: engine.Ref{Namespace: "p", Name: "keep"}, Layout: engine.Pages,
		Identity: cpIdentity, Tokens: toks[0][:named], PageTokens: cpPage,
		Caches: []jobs.EntrySpec{{Tensors: cpTensors(cache, named)}}})
	if w.Err != nil || w.Metrics.BlocksWritten != 0 {
		t.Fatalf("named pages write: %v (%d pages written)", w.Err, w.Metrics.BlocksWritten)
	}
	if _, err := h.stdin.Write([]byte("go\n")); err != nil {
		t.Fatal(err)
	}
	// Saves and loads beside the evictor until it has evicted 40 pages
	// (its oldest, and first candidates, are the named snapshot's).
	rng := rand.New(rand.NewPCG(3, 9))
	loads, loaded, evicted := 0, 0, 0
	guard := time.After(2 * time.Minute)
	for i := 0; evicted < 40; i++ {
		select {
		case l, ok := <-lines:
			if !ok {
				rest, st := h.wait()
				t.Fatalf("the evictor exited: %q %v\n%s", rest, st, h.stderr.String())
			}
			if s, ok := strings.CutPrefix(l, "evicted "); ok {
				evicted, _ = strconv.Atoi(s)
			}
			continue
		case <-guard:
			t.Fatalf("the evictor evicted only %d pages", evicted)
		default:
		}
		c, n := rng.IntN(cpConvs), 1+rng.IntN(cpMaxTokens)
		if i%3 == 0 {
			c = 1 + rng.IntN(cpConvs-1) // never conversation 0: its pages must survive by the manifest alone
			if r := e.Do(context.Background(), cpSave(cache, toks, c, n)); r.Err != nil {
				t.Fatalf("save beside the evictor: %v", r.Err)
			}
			continue
		}
		loaded += cpLoadPartial(t, e, cache, toks[c][:n])
		loads++
	}
	_ = h.cmd.Process.Kill()
	for range lines {
	}
	h.wait()
	h.checkStderr()
	dest := make([][]byte, 2*cache.Model.Layers)
	for i := range dest {
		dest[i] = make([]byte, cache.Model.KVHeads*named*cache.Model.HeadDim*cache.Model.ItemSize)
	}
	if r := e.Do(context.Background(), &engine.ReadRequest{Ref: engine.Ref{Namespace: "p", Name: "keep"}, Dest: dest}); r.Err != nil {
		t.Fatalf("the named snapshot after the other process's evictions: %v", r.Err)
	}
	for i := range dest {
		if want := cpGather(t, cache, i, 0, named); !bytes.Equal(dest[i], want) {
			t.Fatalf("named snapshot tensor %d differs", i)
		}
	}
	t.Logf("%d loads (%d tokens) beside %d evictions", loads, loaded, evicted)
}

// cpGather is tokens [lo, hi) of tensor i of cache, row-major.
func cpGather(t *testing.T, cache *kvgen.Cache, i, lo, hi int) []byte {
	t.Helper()
	v := cache.ViewsAt(cpMaxTokens)[i]
	var shp [4]int
	sub, err := v.SliceAxis(2, lo, hi, shp[:])
	if err != nil {
		t.Fatal(err)
	}
	b, _, err := sub.Gather(make([]byte, sub.Bytes()))
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// cpLoadPartial loads the longest stored prefix of prompt into fresh
// row-major destinations, verified: the load must succeed with no page
// failing (a miss may end the prefix), and the tokens it loaded must hold
// exactly the KV saved. It returns the tokens loaded.
func cpLoadPartial(t *testing.T, e *engine.Engine, cache *kvgen.Cache, prompt []uint32) int {
	t.Helper()
	m := cache.Model
	n := len(prompt)
	dest := make([]jobs.TensorSpec, 2*m.Layers)
	bufs := make([][]byte, len(dest))
	for i := range dest {
		bufs[i] = make([]byte, m.KVHeads*n*m.HeadDim*m.ItemSize)
		shape := []int{1, m.KVHeads, n, m.HeadDim}
		dest[i] = jobs.TensorSpec{DType: m.DType, View: gather.View{Base: bufs[i], Shape: shape, Strides: gather.RowMajor(shape), ItemSize: m.ItemSize}}
	}
	r := e.Do(context.Background(), &engine.LoadPrefixRequest{Namespace: "p", Identity: cpIdentity, Tokens: prompt, Dest: dest, PageTokens: cpPage})
	if r.Err != nil || r.Prefix.Stop != nil {
		t.Fatalf("load beside the evictor: %v (stop %v)", r.Err, errors.Unwrap(r.Prefix.Stop))
	}
	got := r.Prefix.Tokens
	row := m.HeadDim * m.ItemSize
	for i := range bufs {
		want := cpGather(t, cache, i, 0, got)
		for hd := range m.KVHeads {
			if !bytes.Equal(bufs[i][hd*n*row:][:got*row], want[hd*got*row:][:got*row]) {
				t.Fatalf("load of %d tokens beside the evictor: tensor %d head %d differs", got, i, hd)
			}
		}
	}
	return got
}

// TestCacheTwoProcessesShareCapacity: two processes on one root, each an
// engine with CapacityBytes C = 24 pages, save distinct conversations (29
// pages each, the 3 pages of their shared system prompt included) at full
// speed. Sampled on disk while they run and after both are killed, the
// root's page files and temp page files never exceed C by more than the
// saves in flight of both (2 each × one page): each engine counts and
// evicts the pages of the other (the root's page log), where each used to
// fill C of its own.
func TestCacheTwoProcessesShareCapacity(t *testing.T) {
	cache := kvgen.NewCache(kvgen.Tiny, cpMaxTokens, true, nil)
	pb := cpPageBytes(t, cache)
	capacity := 24 * pb
	bound := capacity + 4*pb
	root := t.TempDir()
	var hs []*helperProc
	for i, convs := range [][2]string{{"0", "2"}, {"2", "4"}} {
		h := startHelper(t, "crash-prefix", "-root", root, "-seed", strconv.Itoa(i+1),
			"-capacity", strconv.FormatInt(capacity, 10), "-nosync", "-minconv", convs[0], "-maxconv", convs[1])
		if l, ok := <-h.lines; !ok || l != "ready" {
			rest, st := h.wait()
			t.Fatalf("helper %d did not start: %q %q %v\n%s", i, l, rest, st, h.stderr.String())
		}
		hs = append(hs, h)
	}
	acks := make([]int, len(hs))
	maxSeen := int64(0)
	sample := func(when string) {
		t.Helper()
		pages, temps, n, tn := testutil.PageTree(t, root)
		maxSeen = max(maxSeen, pages+temps)
		if pages+temps > bound {
			t.Fatalf("%s: %d page files of %d bytes and %d temp page files of %d bytes, above capacity %d + 4 saves × %d",
				when, n, pages, tn, temps, capacity, pb)
		}
	}
	tick := time.NewTicker(5 * time.Millisecond)
	defer tick.Stop()
	guard := time.After(90 * time.Second)
	for acks[0] < 60 || acks[1] < 60 {
		select {
		case l, ok := <-hs[0].lines:
			if !ok {
				t.Fatalf("helper 0 ended: %s", hs[0].stderr.String())
			}
			if strings.HasPrefix(l, "ack ") {
				acks[0]++
			}
		case l, ok := <-hs[1].lines:
			if !ok {
				t.Fatalf("helper 1 ended: %s", hs[1].stderr.String())
			}
			if strings.HasPrefix(l, "ack ") {
				acks[1]++
			}
		case <-tick.C:
			sample("while both save")
		case <-guard:
			t.Fatalf("acks %v after 90 s", acks)
		}
	}
	for _, h := range hs {
		_ = h.cmd.Process.Kill()
		h.wait()
	}
	sample("after both are killed")
	t.Logf("acks %v; at most %d bytes on disk, %.2f × the capacity", acks, maxSeen, float64(maxSeen)/float64(capacity))
	if maxSeen < capacity-4*pb {
		t.Fatalf("the root never came near the capacity (%d of %d bytes): the test shows nothing", maxSeen, capacity)
	}
}
