package bench

import (
	"context"
	"fmt"
	"os"
	"strconv"
	"testing"
	"time"

	"github.com/kvpersist/kvpersist/engine"
	"github.com/kvpersist/kvpersist/engine/metrics"
	"github.com/kvpersist/kvpersist/internal/kvgen"
	"github.com/kvpersist/kvpersist/internal/serving"
)

// The bounded cache's row: a steady-state serving loop at
// capacity beside the same loop unbounded.

// servingCase is one geometry of the serving row: 2 loops (one per core),
// two system prompts of 256 tokens, 4 turns of 32 to 160 tokens per
// conversation (internal/serving's defaults), Active conversations per
// loop, and a capacity that holds the active conversations' pages but not
// the ended ones'.
type servingCase struct {
	name          string
	opts          serving.Options
	capacityBytes int64
	steps         int // turns per loop and iteration (KVPERSIST_SERVING_STEPS overrides)
}

var servingCases = []servingCase{
	// The tiny model (256 bytes of KV per token), pages of 64 tokens: a
	// page file takes 32 KiB (16 KiB of KV, the rest its header's 16 KiB
	// alignment), a conversation up to 15 pages; 8 MiB holds 256 pages,
	// 16 active conversations' and some. Metadata-bound: each turn
	// writes and fsyncs about 2 small files, and evicts as many.
	{"tiny-P64", serving.Options{Model: kvgen.Tiny, PageTokens: 64, Active: 8}, 8 << 20, 200},
	// Qwen2.5-7B geometry (28 layers, 4 KV heads, head_dim 128, bf16: 56
	// KiB of KV per token), pages of 16 tokens: a page file is about 0.9
	// MB, a turn writes about 6 of them; 4 active conversations per loop
	// (about 0.2 GB of pages) in a 256 MiB capacity.
	{"qwen2.5-7b-P16", serving.Options{Model: kvgen.Qwen25_7B, PageTokens: 16, Active: 4}, 256 << 20, 50},
}

// servingStreams is how many loops run side by side
// ($KVPERSIST_SERVING_STREAMS, default 2: one per core).
var servingStreams = envInt("KVPERSIST_SERVING_STREAMS", 2)

// envInt is the positive integer in environment variable name, or def.
func envInt(name string, def int) int {
	if s := os.Getenv(name); s != "" {
		if n, err := strconv.Atoi(s); err == nil && n > 0 {
			return n
		}
		panic(fmt.Sprintf("%s=%q: want a positive integer", name, s))
	}
	return def
}

// servingSteps is the turns each side serves per loop and iteration
// ($KVPERSIST_SERVING_STEPS, default the case's).
func servingSteps(c servingCase) int { return envInt("KVPERSIST_SERVING_STEPS", c.steps) }

// servingSide is one engine and its loops; stats counts the timed
// iterations only.
type servingSide struct {
	e       *engine.Engine
	rec     *metrics.Recorder
	loops   []*serving.Loop
	stats   serving.Stats
	evicted int64 // pages evicted in the counted iterations
}

func newServingSide(b *testing.B, root string, c servingCase, capacity int64) *servingSide {
	s := &servingSide{}
	var err error
	if s.rec, err = metrics.New(metrics.Options{}); err != nil {
		b.Fatal(err)
	}
	// Both sides record metrics (a few atomic adds a job), so that the
	// bounded side's evictions can be counted at equal cost.
	if s.e, err = engine.New(engine.Config{Root: root, Logger: quietLogger, CapacityBytes: capacity, Metrics: s.rec}); err != nil {
		b.Fatal(err)
	}
	for i := range servingStreams {
		o := c.opts
		o.Stream, o.Streams, o.Seed = i, servingStreams, 42
		l, err := serving.New(o)
		if err != nil {
			b.Fatal(err)
		}
		s.loops = append(s.loops, l)
	}
	return s
}

// run serves steps turns per loop; iteration i < 0 (a warm-up) is not
// counted.
func (s *servingSide) run(b *testing.B, steps, i int) {
	ev := s.evictedPages()
	st, err := serving.Run(context.Background(), s.e, s.loops, steps)
	if err != nil {
		b.Fatal(err)
	}
	if i >= 0 {
		s.stats.Add(st)
		s.evicted += s.evictedPages() - ev
	}
}

// evictedPages is the pages the engine evicted so far, every reason.
func (s *servingSide) evictedPages() int64 {
	var n int64
	for _, ev := range s.rec.Snapshot().Evicted {
		n += ev.Pages
	}
	return n
}

// BenchmarkServing: the serving loop (internal/serving: lookup, verified
// load of the stored prefix, save, per turn; 2 loops side by side) on a
// cache bounded to the case's capacity, filled to capacity before the
// timing starts (so evictions run throughout), beside the same loop (same
// seeds: the same conversations and turns) on an unbounded cache, in
// alternating order, fsync on, for each geometry of servingCases. Reports
// saves/s, loads/s and hit-rate (tokens found / tokens looked up) of both
// sides, the bounded side's pages evicted and written per turn and its used
// MiB at the end, and x-limit = unbounded time / bounded time for the same
// turns (goal ≥ 0.9).
func BenchmarkServing(b *testing.B) {
	for _, c := range servingCases {
		b.Run(c.name, func(b *testing.B) { benchServing(b, c) })
	}
}

func benchServing(b *testing.B, c servingCase) {
	turns := servingSteps(c)
	bounded := newServingSide(b, mkdir(b, "serving-bounded"), c, c.capacityBytes)
	defer closeEngine(b, bounded.e)
	unbounded := newServingSide(b, mkdir(b, "serving-unbounded"), c, 0)
	defer closeEngine(b, unbounded.e)
	// Fill the bounded cache to capacity, then as many turns unbounded:
	// both sides start the timing with the same history.
	warm := 0
	for ; bounded.e.Usage().UsedBytes < c.capacityBytes*9/10; warm += 10 {
		if warm >= 2000 {
			b.Fatalf("the bounded cache holds %d bytes after %d turns per loop: not filling to its %d", bounded.e.Usage().UsedBytes, warm, c.capacityBytes)
		}
		bounded.run(b, 10, -1)
	}
	unbounded.run(b, warm, -1)
	m := alternate(b, steps{
		ours:  func(i int) { bounded.run(b, turns, i) },
		limit: func(i int) { unbounded.run(b, turns, i) },
	})
	report := func(prefix string, st serving.Stats, d time.Duration) {
		b.ReportMetric(serving.Rate(st.Saves, d), prefix+"saves/s")
		b.ReportMetric(serving.Rate(st.Loads, d), prefix+"loads/s")
		b.ReportMetric(st.HitRate(), prefix+"hit-rate")
	}
	report("", bounded.stats, m.ours)
	report("unbounded-", unbounded.stats, m.limit)
	if m.ours > 0 && m.limit > 0 {
		b.ReportMetric(float64(m.limit)/float64(m.ours), "x-limit")
	}
	if bounded.stats.Turns > 0 {
		b.ReportMetric(float64(bounded.evicted)/float64(bounded.stats.Turns), "evicted/turn")
		b.ReportMetric(float64(bounded.stats.PagesWritten)/float64(bounded.stats.Turns), "written/turn")
	}
	b.ReportMetric(float64(bounded.e.Usage().UsedBytes)/(1<<20), "used-MiB")
	if bounded.stats.SavesRefused != 0 || unbounded.stats.SavesRefused != 0 {
		b.Fatalf("saves refused: %d bounded, %d unbounded (nothing is pinned for long: want 0)", bounded.stats.SavesRefused, unbounded.stats.SavesRefused)
	}
}
