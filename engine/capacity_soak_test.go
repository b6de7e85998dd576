package engine_test

import (
	"fmt"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/kvpersist/kvpersist/internal/kvgen"
	"github.com/kvpersist/kvpersist/internal/testutil"
)

// capSoakProcs is how many helper processes share the root in
// TestTwoProcessCapacitySoakSIGKILL; each keeps 2 saves in flight.
const capSoakProcs = 2

// TestTwoProcessCapacitySoakSIGKILL: two helper processes (crash-prefix)
// on one root, each an engine with the same CapacityBytes C = 24 pages,
// save distinct conversations, and are killed with SIGKILL (one, or both
// at once) after a random number of acks and started again. The parent
// samples the root's page files and temp page files (lstat, st_blocks ×
// 512) every 5 ms, and after every kill: their total never exceeds the
// documented bound, C + (the saves in flight of both engines, 2 each, and
// one background victim each) × one page: the engines share C through the root's page log, and the temp
// page files a kill left are counted by the survivor and swept by the
// next start. After the last kill every page file is whole and right and
// an engine's accounting rebuilt from the disk equals it.
//
// A few kills in `make test`; for KVPERSIST_SOAK_DURATION (default 5
// minutes) under KVPERSIST_SOAK=long, where its closing line (kills,
// saves, samples, the largest total seen against the bound) is printed.
func TestTwoProcessCapacitySoakSIGKILL(t *testing.T) {
	kills, rng := crashRounds(t, 6, 1<<30, 24)
	long := soakLong()
	var deadline time.Time
	if long {
		deadline = time.Now().Add(soakDuration(t))
	}
	cache := kvgen.NewCache(kvgen.Tiny, cpMaxTokens, true, nil)
	pb := cpPageBytes(t, cache)
	capacity := 24 * pb
	// The documented bound, C + S×P + E: S = 2 saves in flight per
	// process, and E (a background eviction's victims not yet unlinked)
	// allowed one page per process.
	bound := capacity + capSoakProcs*2*pb + capSoakProcs*pb
	root := t.TempDir()
	convs := [capSoakProcs][2]string{{"0", "2"}, {"2", "4"}}
	start := time.Now()

	var hs [capSoakProcs]*helperProc
	var left [capSoakProcs]int // acks until the helper is killed
	launch := func(i int) {
		t.Helper()
		h := startHelper(t, "crash-prefix", "-root", root, "-seed", strconv.FormatUint(rng.Uint64(), 10),
			"-capacity", strconv.FormatInt(capacity, 10), "-nosync", "-tempgrace", "50ms",
			"-minconv", convs[i][0], "-maxconv", convs[i][1])
		if l, ok := <-h.lines; !ok || l != "ready" {
			rest, st := h.wait()
			t.Fatalf("helper %d did not start: %q %q %v\n%s", i, l, rest, st, h.stderr.String())
		}
		hs[i] = h
		left[i] = 3 + rng.IntN(12)
		if long {
			left[i] = 5 + rng.IntN(60)
		}
	}
	saves, refused, samples, killed, tempsLeft := 0, 0, 0, 0, 0
	var maxSeen int64
	sample := func(when string) {
		t.Helper()
		pages, temps, n, tn := testutil.PageTree(t, root)
		samples++
		maxSeen = max(maxSeen, pages+temps)
		if pages+temps > bound {
			t.Fatalf("%s (after %d kills): %d page files of %d bytes and %d temp page files of %d bytes, above capacity %d + %d pages in flight × %d",
				when, killed, n, pages, tn, temps, capacity, capSoakProcs*3, pb)
		}
	}
	count := func(l string) {
		switch {
		case strings.HasPrefix(l, "ack "):
			saves++
		case strings.HasPrefix(l, "nospace "):
			refused++
		}
	}
	kill := func(i int) {
		t.Helper()
		h := hs[i]
		if err := h.cmd.Process.Signal(syscall.SIGKILL); err != nil {
			t.Fatal(err)
		}
		rest, st := h.wait()
		for _, l := range rest {
			count(l)
		}
		h.checkStderr()
		if ws, ok := st.Sys().(syscall.WaitStatus); !ok || !ws.Signaled() || ws.Signal() != syscall.SIGKILL {
			t.Fatalf("helper %d ended by itself, not by SIGKILL: %v\n%s", i, st, h.stderr.String())
		}
		hs[i] = nil
		killed++
	}
	// line takes helper i's output line l (ok false: its output ended) and
	// returns i once its acks ran out, else -1.
	line := func(i int, l string, ok bool) int {
		t.Helper()
		if !ok {
			t.Fatalf("helper %d ended: %s", i, hs[i].stderr.String())
		}
		count(l)
		if strings.HasPrefix(l, "ack ") || strings.HasPrefix(l, "nospace ") {
			if left[i]--; left[i] <= 0 {
				return i
			}
		}
		return -1
	}
	for i := range hs {
		launch(i)
	}
	tick := time.NewTicker(5 * time.Millisecond)
	defer tick.Stop()
	more := func() bool {
		if long {
			return time.Now().Before(deadline)
		}
		return killed < kills
	}
	for more() {
		guard := time.After(2 * time.Minute)
		// Wait for one helper's acks to run out, sampling meanwhile.
		victim := -1
		for victim < 0 {
			select {
			case l, ok := <-hs[0].lines:
				victim = line(0, l, ok)
			case l, ok := <-hs[1].lines:
				victim = line(1, l, ok)
			case <-tick.C:
				sample("while both save")
			case <-guard:
				t.Fatalf("no helper acked its saves in 2 minutes (%d saves so far)", saves)
			}
		}
		time.Sleep(time.Duration(rng.IntN(30)) * time.Millisecond)
		kill(victim)
		both := rng.IntN(3) == 0
		if both {
			kill(1 - victim)
		}
		sample("after a kill")
		_, _, _, temps := testutil.PageTree(t, root)
		tempsLeft += temps
		// The survivor saves on, evicting, while the victim restarts.
		for i := range hs {
			if hs[i] == nil {
				launch(i)
			}
		}
	}
	for i := range hs {
		kill(i)
	}
	sample("after both are killed")
	cpCheckPages(t, root, cache, cpWhere(), killed)
	checkUsageEqualsDisk(t, root, killed)

	summary := fmt.Sprintf("two-process capacity soak: %s, %d kills, %d saves (%d refused), %d samples, %d temp page files seen after kills, max on disk %d bytes, bound %d (capacity %d + %d pages in flight × %d), max/bound %.3f",
		time.Since(start).Round(time.Second), killed, saves, refused, samples, tempsLeft, maxSeen, bound, capacity, capSoakProcs*3, pb, float64(maxSeen)/float64(bound))
	t.Log(summary)
	if long {
		fmt.Println(summary) // make soak's closing figures
	}
	if saves == 0 {
		t.Fatalf("nothing was saved: %s", summary)
	}
	if maxSeen < capacity-capSoakProcs*2*pb {
		t.Fatalf("the root never came near the capacity: %s", summary)
	}
}
