// Package demo is kvpersist's serving scenario: several conversations that
// share a system prompt, each growing over several turns, saved to the
// prefix cache after every turn and resumed from it (Engine.Lookup, then
// LoadPrefixRequest into fresh capacity-padded buffers) before the next,
// every loaded byte compared with content recomputed independently
// (internal/kvgen). The CLI's `demo` command calls Run; it is product code
// (no test-only package).
//
// The scenario, for conversation c (1..Conversations) and turn k
// (1..Turns), in round-robin order (turn 1 of every conversation, then
// turn 2, ...), as a scheduler serving them side by side would:
//
//  1. The conversation's cache is not in memory (evicted after its last
//     turn). Its prompt is looked up: at turn 1 the prompt (system prompt
//     plus the first message), whose full pages of the shared system prompt
//     another conversation may have stored; at later turns the conversation
//     so far, stored by its previous turn (the leaf included). The longest
//     stored prefix is loaded into a fresh buffer of capacity
//     kvgen.Capacity(tokens after the turn) (filled with kvgen.Padding
//     first), and every byte of the buffer is compared: the loaded tokens
//     with their recomputed content, the rest with the padding.
//  2. The tokens not loaded are "computed": their content is written into
//     the buffer (kvgen.Model.Rows).
//  3. The conversation's tokens are saved to the prefix cache
//     (SavePrefixRequest): only pages not stored yet are written.
//  4. The turn's row is printed.
//
// Then the engine is closed and a new one opened on the same store (its
// index rebuilt from the page files), and every conversation is resumed
// whole (its last, partial page included), loaded and compared again.
//
// Content: token position p of conversation c holds the KV content and
// token id of kvgen token index p when p < SystemTokens (the shared system
// prompt), else p + c<<24 (kvgen.Value and kvgen.TokenID of that index), so
// conversations share exactly their system prompt.
package demo

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	iofs "io/fs"
	"log/slog"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/kvpersist/kvpersist/engine"
	"github.com/kvpersist/kvpersist/engine/jobs"
	"github.com/kvpersist/kvpersist/engine/layout"
	"github.com/kvpersist/kvpersist/engine/store"
	"github.com/kvpersist/kvpersist/internal/kvgen"
)

// Defaults of Options (zero fields take these).
const (
	DefaultNamespace     = "kvpersist-demo"
	DefaultModel         = "llama-3.1-8b"
	DefaultConversations = 4
	DefaultSystemTokens  = 1500
	DefaultTurns         = 4
	DefaultMinTurnTokens = 300
	DefaultMaxTurnTokens = 1000
)

// Limits of Options.
const (
	// MaxConversations: content indices are p + c<<24 (see the package doc).
	MaxConversations = 255
	// MaxConversationTokens is the most tokens one conversation may reach.
	MaxConversationTokens = 1<<24 - 1
)

// Sentinel errors of Run, for errors.Is.
var (
	// ErrInvalidOptions: an Options field is out of range (the message
	// names it).
	ErrInvalidOptions = errors.New("demo: invalid options")
	// ErrNamespaceExists: the namespace exists in the given root and
	// Options.ReuseNamespace is not set; nothing was written.
	ErrNamespaceExists = errors.New("demo: namespace exists")
	// ErrMemory: the scenario needs more memory than MemAvailable
	// (/proc/meminfo); nothing was allocated.
	ErrMemory = errors.New("demo: not enough memory")
	// ErrMismatch: a loaded byte differs from what was saved, or a lookup
	// found less than the demo stored (the message says where).
	ErrMismatch = errors.New("demo: mismatch")
)

// Options configure Run. Zero fields take the defaults above.
type Options struct {
	// Root is the store's root directory. "" means a new temporary
	// directory, removed at the end unless Keep.
	Root string
	// Keep keeps the temporary root (ignored when Root is given: a given
	// root is never removed).
	Keep bool
	// Namespace is the namespace the demo writes its pages to (default
	// DefaultNamespace). If it exists under Root, Run refuses
	// (ErrNamespaceExists) unless ReuseNamespace; pages found stored then
	// count as reused.
	Namespace      string
	ReuseNamespace bool
	// Model is a kvgen model name (default DefaultModel, Llama-3.1-8B
	// geometry).
	Model string
	// Conversations (1..MaxConversations), each starting with the same
	// SystemTokens tokens (>= 0) of system prompt, then Turns turns (>= 1)
	// each adding between MinTurnTokens and MaxTurnTokens tokens (>= 1; a
	// deterministic choice per conversation and turn; equal values make
	// every turn that long).
	Conversations                int
	SystemTokens                 int
	Turns                        int
	MinTurnTokens, MaxTurnTokens int
	// PageTokens is P, tokens per page (default 256, a power of two from
	// 16 to 4,096).
	PageTokens int
	// Workers is the engine's pool size (default GOMAXPROCS).
	Workers int
	// NoSync turns fsync off (tmpfs and tests only: the save rates then
	// flatter the disk).
	NoSync bool
	// Progress is where progress bars of long saves and loads are drawn
	// (typically os.Stderr). A bar is drawn only when Progress is a
	// terminal (an *os.File for which term.IsTerminal) and the job runs
	// longer than ProgressDelay; nil draws none.
	Progress io.Writer
	// ExactBytes prints sizes as byte counts instead of MiB.
	ExactBytes bool
	// Logger receives the engine's events (engine.Config.Logger); nil
	// means slog.Default().
	Logger *slog.Logger
}

// ProgressDelay is how long a save or load runs before its progress bar
// appears.
const ProgressDelay = 300 * time.Millisecond

// scenario is Options resolved: the model, the per-conversation token
// counts after each turn, the content mapping.
type scenario struct {
	o        Options
	m        kvgen.Model
	identity string
	p        int
	perToken int64   // bytes of one token in every tensor
	tokens   [][]int // tokens[c][k]: conversation c's tokens after turn k+1
	maxCap   int     // the largest buffer capacity, in tokens
}

func resolve(o Options) (*scenario, error) {
	def := func(v *int, d int) {
		if *v == 0 {
			*v = d
		}
	}
	if o.Namespace == "" {
		o.Namespace = DefaultNamespace
	}
	if o.Model == "" {
		o.Model = DefaultModel
	}
	def(&o.Conversations, DefaultConversations)
	def(&o.Turns, DefaultTurns)
	def(&o.MinTurnTokens, DefaultMinTurnTokens)
	def(&o.MaxTurnTokens, DefaultMaxTurnTokens)
	def(&o.PageTokens, layout.DefaultPageTokens)
	if o.SystemTokens == 0 {
		o.SystemTokens = DefaultSystemTokens
	}
	bad := func(format string, a ...any) error {
		return fmt.Errorf("%w: %s", ErrInvalidOptions, fmt.Sprintf(format, a...))
	}
	m, err := kvgen.ModelByName(o.Model)
	if err != nil {
		return nil, bad("%v", err)
	}
	if err := layout.ValidName("namespace", o.Namespace); err != nil {
		return nil, bad("%v", err)
	}
	if err := layout.CheckPageTokens(o.PageTokens); err != nil {
		return nil, bad("page tokens: %v", err)
	}
	switch {
	case o.Conversations < 1 || o.Conversations > MaxConversations:
		return nil, bad("conversations %d: want 1 to %d", o.Conversations, MaxConversations)
	case o.SystemTokens < 0:
		return nil, bad("system tokens %d: want >= 0 (0 means %d)", o.SystemTokens, DefaultSystemTokens)
	case o.Turns < 1:
		return nil, bad("turns %d: want >= 1", o.Turns)
	case o.MinTurnTokens < 1 || o.MaxTurnTokens < o.MinTurnTokens:
		return nil, bad("turn tokens %d to %d: want 1 <= min <= max", o.MinTurnTokens, o.MaxTurnTokens)
	case o.Workers < 0:
		return nil, bad("workers %d: want >= 0", o.Workers)
	}
	s := &scenario{
		o: o, m: m, p: o.PageTokens,
		identity: fmt.Sprintf("kvpersist-demo/%s/%s", m.Name, m.DType),
		perToken: int64(2 * m.Layers * m.TensorBytes(1)),
	}
	for c := 1; c <= o.Conversations; c++ {
		t := o.SystemTokens
		var ts []int
		for k := 1; k <= o.Turns; k++ {
			t += TurnTokens(o.MinTurnTokens, o.MaxTurnTokens, c, k)
			if t > MaxConversationTokens {
				return nil, bad("conversation %d reaches %d tokens (at most %d)", c, t, MaxConversationTokens)
			}
			ts = append(ts, t)
		}
		s.tokens = append(s.tokens, ts)
		s.maxCap = max(s.maxCap, kvgen.Capacity(t))
	}
	return s, nil
}

// TurnTokens is how many tokens turn k (from 1) of conversation c (from 1)
// adds: min + splitmix64(c<<32 | k) mod (max-min+1).
func TurnTokens(min, max, c, k int) int {
	return min + int(splitmix64(uint64(c)<<32|uint64(k))%uint64(max-min+1))
}

func splitmix64(x uint64) uint64 {
	x += 0x9E3779B97F4A7C15
	x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9
	x = (x ^ (x >> 27)) * 0x94D049BB133111EB
	return x ^ (x >> 31)
}

// contentIndex is the kvgen token index whose content and id token
// position pos of conversation c (from 1) holds.
func (s *scenario) contentIndex(c, pos int) int {
	if pos < s.o.SystemTokens {
		return pos
	}
	return pos + c<<24
}

// ids returns conversation c's token ids for positions [0, n).
func (s *scenario) ids(c, n int) []uint32 {
	out := make([]uint32, n)
	for i := range out {
		out[i] = uint32(kvgen.TokenID(s.contentIndex(c, i)))
	}
	return out
}

// NeedBytes is the memory, in bytes, the scenario of o allocates: one
// capacity-padded buffer for the largest conversation (the live cache, and
// the destination of every load), per worker one row buffer for the
// comparisons and the engine's scratch (jobs.ChunkBytes), and the token
// ids.
func NeedBytes(o Options) (int64, error) {
	s, err := resolve(o)
	if err != nil {
		return 0, err
	}
	return s.needBytes(), nil
}

func (s *scenario) needBytes() int64 {
	w := int64(s.workers())
	rowBytes := int64(s.m.HeadDim * s.m.ItemSize)
	return int64(s.maxCap)*s.perToken + w*(int64(s.maxCap)*rowBytes+jobs.ChunkBytes) + int64(s.maxCap)*8
}

func (s *scenario) workers() int {
	if s.o.Workers > 0 {
		return s.o.Workers
	}
	return runtime.GOMAXPROCS(0)
}

// memAvailable returns MemAvailable from /proc/meminfo in bytes; ok is
// false where it cannot be read (the check is then skipped). Tests replace it.
var memAvailable = func() (int64, bool) {
	f, err := os.Open("/proc/meminfo")
	if err != nil {
		return 0, false
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		fs := strings.Fields(sc.Text())
		if len(fs) == 3 && fs[0] == "MemAvailable:" && fs[2] == "kB" {
			kb, err := strconv.ParseInt(fs[1], 10, 64)
			return kb << 10, err == nil
		}
	}
	return 0, false
}

// Run plays the scenario (see the package doc) and writes its report to w:
// a header, one row per turn printed as soon as the turn completes, one row
// per conversation resumed after the restart, and a summary.
//
// Before allocating it checks the options (ErrInvalidOptions), the memory
// it needs against MemAvailable (ErrMemory, naming both figures), and that
// the namespace does not exist in a given Root (ErrNamespaceExists unless
// ReuseNamespace). It returns ErrMismatch (wrapped, naming the tensor,
// head, token and byte) if a loaded byte differs from the recomputed
// content or a padding byte was written, ctx's error when ctx ends, or the
// engine's error. A temporary root is removed when Run returns (unless
// Keep), whatever the outcome.
func Run(ctx context.Context, o Options, w io.Writer) (err error) {
	s, err := resolve(o)
	if err != nil {
		return err
	}
	o = s.o
	need := s.needBytes()
	if avail, ok := memAvailable(); ok && avail < need {
		return fmt.Errorf("%w: the scenario needs %s (%d bytes: a %d-token buffer of %s), MemAvailable is %s; use fewer or shorter turns, fewer system tokens, or a smaller model",
			ErrMemory, mib(need), need, s.maxCap, s.m.Name, mib(avail))
	}
	root := o.Root
	if root != "" && !o.ReuseNamespace {
		// The store may be the operator's: never write into a namespace the
		// demo did not make.
		if _, err := os.Lstat(filepath.Join(root, o.Namespace)); err == nil {
			return fmt.Errorf("%w: namespace %s in %s; pick another namespace or reuse it explicitly", ErrNamespaceExists, o.Namespace, root)
		} else if !errors.Is(err, iofs.ErrNotExist) {
			return fmt.Errorf("demo: %w", err)
		}
	}
	if root == "" {
		if root, err = os.MkdirTemp("", "kvpersist-demo-"); err != nil {
			return fmt.Errorf("demo: %w", err)
		}
		if !o.Keep {
			defer func() {
				if rerr := os.RemoveAll(root); rerr != nil && err == nil {
					err = fmt.Errorf("demo: remove %s: %w", root, rerr)
				}
			}()
		}
	}
	r := &runner{s: s, w: w, root: root, owner: map[layout.PageKey]int{}}
	r.arena = make([]byte, int64(s.maxCap)*s.perToken)
	for range s.workers() {
		r.rows = append(r.rows, make([]byte, s.maxCap*s.m.HeadDim*s.m.ItemSize))
	}
	return r.run(ctx)
}

// runner is one Run's state.
type runner struct {
	s     *scenario
	w     io.Writer
	root  string
	e     *engine.Engine
	arena []byte                 // the live cache and load destination
	rows  [][]byte               // per worker: one head's rows, recomputed
	owner map[layout.PageKey]int // which conversation first wrote each page

	// totals
	written, reused, shared int64
	loadBytes               int64
	loadTime                time.Duration
}

func (r *runner) openEngine() error {
	e, err := engine.New(engine.Config{Root: r.root, Workers: r.s.o.Workers, NoSync: r.s.o.NoSync, Logger: r.s.o.Logger})
	if err != nil {
		return fmt.Errorf("demo: %w", err)
	}
	r.e = e
	return nil
}

func (r *runner) closeEngine(ctx context.Context) error {
	if r.e == nil {
		return nil
	}
	e := r.e
	r.e = nil
	if err := e.Close(context.WithoutCancel(ctx)); err != nil {
		return fmt.Errorf("demo: close engine: %w", err)
	}
	return nil
}

func (r *runner) run(ctx context.Context) (err error) {
	s, o := r.s, r.s.o
	if err := r.openEngine(); err != nil {
		return err
	}
	defer func() {
		if cerr := r.closeEngine(ctx); err == nil {
			err = cerr
		}
	}()
	m := s.m
	fmt.Fprintf(r.w, "kvpersist demo: %d conversations on %s geometry (%d layers, %d KV heads, head_dim %d, %s: %s per token), sharing a %d-token system prompt, %d turns of %d to %d tokens each\n",
		o.Conversations, m.Name, m.Layers, m.KVHeads, m.HeadDim, m.DType, human(s.perToken), o.SystemTokens, o.Turns, o.MinTurnTokens, o.MaxTurnTokens)
	fmt.Fprintf(r.w, "prefix cache: %d tokens per page, identity %q, store %s, namespace %s; memory %s\n",
		s.p, s.identity, r.root, o.Namespace, mib(s.needBytes()))
	fmt.Fprintf(r.w, "each turn: look up the conversation, load the stored prefix into a fresh padded buffer and compare every byte, compute the rest, save\n")
	fmt.Fprintln(r.w, header)
	prev := make([]int, o.Conversations)
	for k := 1; k <= o.Turns; k++ {
		for c := 1; c <= o.Conversations; c++ {
			t := s.tokens[c-1][k-1]
			if err := r.turn(ctx, c, k, prev[c-1], t); err != nil {
				return err
			}
			prev[c-1] = t
		}
	}
	fmt.Fprintf(r.w, "saved: %s written, %s reused (%s of it shared between conversations)\n", r.total(r.written), r.total(r.reused), r.total(r.shared))

	// Restart: a new engine builds its index from the page files.
	if err := r.closeEngine(ctx); err != nil {
		return err
	}
	if err := r.openEngine(); err != nil {
		return err
	}
	fmt.Fprintf(r.w, "engine restarted (index rebuilt from the page files); every conversation resumed whole:\n")
	fmt.Fprintln(r.w, resumeHeader)
	var logical int64
	for c := 1; c <= o.Conversations; c++ {
		t := s.tokens[c-1][o.Turns-1]
		logical += int64(t) * s.perToken
		ids := s.ids(c, t)
		loaded, el, err := r.load(ctx, c, ids, t, fmt.Sprintf("resume conversation %d", c))
		if err != nil {
			return err
		}
		if loaded != t {
			return fmt.Errorf("%w: conversation %d: %d of its %d tokens found after the restart", ErrMismatch, c, loaded, t)
		}
		fmt.Fprintf(r.w, "%5d %8d %8d %10s\n", c, t, loaded, rate(int64(loaded)*s.perToken, el))
	}
	files, onDisk, err := pageFiles(filepath.Join(r.root, o.Namespace))
	if err != nil {
		return err
	}
	fmt.Fprintf(r.w, "store: %d page files, %s on disk for %s of KV in the conversations' last turns (%.2fx); %s loaded in all at %s MB/s\n",
		files, r.total(onDisk), r.total(logical), float64(logical)/float64(max(onDisk, 1)), r.total(r.loadBytes), rate(r.loadBytes, r.loadTime))
	fmt.Fprintf(r.w, "every loaded byte matched what was saved.\n")
	if o.Root != "" || o.Keep {
		fmt.Fprintf(r.w, "the store is kept in %s (kvpersist ls / du / verify %s)\n", r.root, r.root)
	}
	return nil
}

const (
	header       = " conv  turn   tokens      new   loaded    written     reused     shared  save MB/s  load MB/s"
	resumeHeader = " conv   tokens   loaded  load MB/s"
)

// turn plays turn k of conversation c, which had prev tokens and ends with t.
func (r *runner) turn(ctx context.Context, c, k, prev, t int) error {
	s := r.s
	ids := s.ids(c, t)
	query := ids[:prev] // the conversation so far
	if k == 1 {
		query = ids // a new conversation: its whole prompt
	}
	loaded, loadEl, err := r.load(ctx, c, query, t, fmt.Sprintf("conversation %d turn %d: load", c, k))
	if err != nil {
		return err
	}
	if k > 1 && loaded != prev {
		return fmt.Errorf("%w: conversation %d turn %d: lookup found %d of the %d tokens its previous turn saved", ErrMismatch, c, k, loaded, prev)
	}
	capTok := kvgen.Capacity(t)
	r.compute(c, capTok, loaded, t)

	views := r.views(capTok, t)
	bar := newBar(s.o.Progress, int64(t)*s.perToken, fmt.Sprintf("conversation %d turn %d: save", c, k))
	start := time.Now()
	res := r.e.Do(ctx, &engine.SavePrefixRequest{
		Namespace: s.o.Namespace, Identity: s.identity, Tokens: ids, Tensors: views, PageTokens: s.p, Progress: bar.add,
	})
	saveEl := time.Since(start)
	bar.done()
	if res.Err != nil {
		return fmt.Errorf("demo: conversation %d turn %d: save: %w", c, k, res.Err)
	}
	pr := res.Prefix
	var shared int64
	for _, key := range pr.Keys {
		first, ok := r.owner[key]
		if !ok {
			r.owner[key] = c
			continue
		}
		if first != c {
			fi, err := os.Lstat(store.NamespaceAt(filepath.Join(r.root, s.o.Namespace), store.Options{}).PagePath(key))
			if err != nil {
				return fmt.Errorf("demo: %w", err)
			}
			shared += fi.Size()
		}
	}
	r.written += pr.BytesWritten
	r.reused += pr.BytesReused
	r.shared += shared
	load := "-"
	if loaded > 0 {
		load = rate(int64(loaded)*s.perToken, loadEl)
	}
	fmt.Fprintf(r.w, "%5d %5d %8d %8d %8d %10s %10s %10s %10s %10s\n", c, k, t, t-prev, loaded,
		r.size(pr.BytesWritten), r.size(pr.BytesReused), r.size(shared), rate(pr.BytesWritten, saveEl), load)
	return nil
}

// views returns the views of the first tokens tokens of capacity-padded
// buffers of capTok tokens carved from the arena (kvgen.Model.ArenaViews).
func (r *runner) views(capTok, tokens int) []engine.TensorSpec {
	return r.s.m.ArenaViews(r.arena, capTok, tokens)
}

// load prepares a fresh buffer of capacity Capacity(t) (every byte
// kvgen.Padding), looks query up and loads the stored prefix into it, and
// compares every byte of the buffer: the loaded tokens with conversation
// c's content, the rest with the padding. It returns the tokens loaded and
// the load's wall time.
func (r *runner) load(ctx context.Context, c int, query []uint32, t int, what string) (int, time.Duration, error) {
	s := r.s
	capTok := kvgen.Capacity(t)
	r.forTensors(func(_, i int) error {
		tb := s.m.TensorBytes(capTok)
		kvgen.FillPadding(r.arena[i*tb : (i+1)*tb])
		return nil
	})
	found, err := r.e.Lookup(s.o.Namespace, s.identity, s.p, query)
	if err != nil {
		return 0, 0, fmt.Errorf("demo: %s: lookup: %w", what, err)
	}
	loaded := 0
	var el time.Duration
	if found > 0 {
		bar := newBar(s.o.Progress, int64(found)*s.perToken, what)
		start := time.Now()
		res := r.e.Do(ctx, &engine.LoadPrefixRequest{
			Namespace: s.o.Namespace, Identity: s.identity, Tokens: query, Dest: r.views(capTok, capTok),
			PageTokens: s.p, Progress: bar.add,
		})
		el = time.Since(start)
		bar.done()
		if res.Err != nil {
			return 0, 0, fmt.Errorf("demo: %s: %w", what, res.Err)
		}
		if res.Prefix.Stop != nil {
			return 0, 0, fmt.Errorf("%w: %s: the load stopped after %d tokens: %v", ErrMismatch, what, res.Prefix.Tokens, res.Prefix.Stop)
		}
		loaded = res.Prefix.Tokens
		if loaded != found {
			return 0, 0, fmt.Errorf("%w: %s: lookup found %d tokens, the load loaded %d", ErrMismatch, what, found, loaded)
		}
		r.loadBytes += int64(loaded) * s.perToken
		r.loadTime += el
	}
	if testHookAfterLoad != nil {
		testHookAfterLoad(r.arena)
	}
	if err := r.compare(c, capTok, loaded); err != nil {
		return 0, 0, fmt.Errorf("%s: %w", what, err)
	}
	return loaded, el, nil
}

// testHookAfterLoad, when set by a test, sees the arena after each load
// and before its comparison.
var testHookAfterLoad func(arena []byte)

// compute writes conversation c's content for tokens [from, to) into the
// buffer of capacity capTok: what a model's prefill would produce.
func (r *runner) compute(c, capTok, from, to int) {
	m := r.s.m
	rowBytes := m.HeadDim * m.ItemSize
	tb := m.TensorBytes(capTok)
	r.forTensors(func(_, i int) error {
		buf := r.arena[i*tb : (i+1)*tb]
		for h := 0; h < m.KVHeads; h++ {
			base := h * capTok * rowBytes
			r.s.spans(c, from, to, func(pos, n, first int) {
				m.Rows(buf[base+pos*rowBytes:base+(pos+n)*rowBytes], i/2, i%2, h, first)
			})
		}
		return nil
	})
}

// spans calls fn for the runs of positions [from, to) of conversation c
// whose content indices are consecutive: position pos, n positions, first
// content index.
func (s *scenario) spans(c, from, to int, fn func(pos, n, first int)) {
	for pos := from; pos < to; {
		end := to
		if pos < s.o.SystemTokens {
			end = min(to, s.o.SystemTokens)
		}
		fn(pos, end-pos, s.contentIndex(c, pos))
		pos = end
	}
}

// compare checks every byte of the buffer of capacity capTok: tokens
// [0, loaded) hold conversation c's content, recomputed row by row with
// kvgen.Model.Rows; tokens [loaded, capTok) hold kvgen.Padding.
func (r *runner) compare(c, capTok, loaded int) error {
	m := r.s.m
	rowBytes := m.HeadDim * m.ItemSize
	tb := m.TensorBytes(capTok)
	pad := make([]byte, rowBytes)
	kvgen.FillPadding(pad)
	return r.forTensors(func(wi, i int) error {
		buf := r.arena[i*tb : (i+1)*tb]
		want := r.rows[wi][:loaded*rowBytes]
		for h := 0; h < m.KVHeads; h++ {
			base := h * capTok * rowBytes
			r.s.spans(c, 0, loaded, func(pos, n, first int) {
				m.Rows(want[pos*rowBytes:(pos+n)*rowBytes], i/2, i%2, h, first)
			})
			if j := firstDiff(buf[base:base+loaded*rowBytes], want); j >= 0 {
				return fmt.Errorf("%w: conversation %d, layer %d %s, head %d, token %d: byte %d of the row is %#02x, saved %#02x",
					ErrMismatch, c, i/2, "KV"[i%2:i%2+1], h, j/rowBytes, j%rowBytes, buf[base+j], want[j])
			}
			for tok := loaded; tok < capTok; tok++ {
				row := buf[base+tok*rowBytes : base+(tok+1)*rowBytes]
				if j := firstDiff(row, pad); j >= 0 {
					return fmt.Errorf("%w: conversation %d, layer %d %s, head %d, token %d (past the %d loaded): byte %d was written (%#02x)",
						ErrMismatch, c, i/2, "KV"[i%2:i%2+1], h, tok, loaded, j, row[j])
				}
			}
		}
		return nil
	})
}

func firstDiff(a, b []byte) int {
	if string(a) == string(b) {
		return -1
	}
	for i := range a {
		if a[i] != b[i] {
			return i
		}
	}
	return len(a)
}

// forTensors runs fn for every tensor index i on up to workers goroutines
// (wi, from 0, names the goroutine: it owns r.rows[wi]), started and joined
// here; it returns every goroutine's first error.
func (r *runner) forTensors(fn func(wi, i int) error) error {
	n := 2 * r.s.m.Layers
	workers := min(r.s.workers(), n)
	errs := make([]error, workers)
	var wg sync.WaitGroup
	for wi := range workers {
		wg.Go(func() {
			for i := wi; i < n; i += workers {
				if err := fn(wi, i); err != nil {
					errs[wi] = err
					return
				}
			}
		})
	}
	wg.Wait()
	return errors.Join(errs...)
}

// pageFiles counts the page files of the namespace at nsDir (as the store
// model lists them) and sums their sizes.
func pageFiles(nsDir string) (int, int64, error) {
	l, err := store.NamespaceAt(nsDir, store.Options{}).List(false)
	if err != nil {
		return 0, 0, fmt.Errorf("demo: %w", err)
	}
	total := int64(0)
	for _, pg := range l.Pages {
		total += pg.Size
	}
	return len(l.Pages), total, nil
}

// size formats bytes for the table: MiB with one decimal, or the exact
// count with Options.ExactBytes.
func (r *runner) size(n int64) string {
	if r.s.o.ExactBytes {
		return strconv.FormatInt(n, 10)
	}
	return mib(n)
}

// total formats bytes for the summary lines: human, or the exact count
// with Options.ExactBytes.
func (r *runner) total(n int64) string {
	if r.s.o.ExactBytes {
		return strconv.FormatInt(n, 10) + " bytes"
	}
	return human(n)
}

func mib(n int64) string { return fmt.Sprintf("%.1f MiB", float64(n)/(1<<20)) }

// human formats bytes in the largest binary unit (B, KiB, MiB, GiB) that
// leaves at least 1.
func human(n int64) string {
	switch {
	case n >= 1<<30:
		return fmt.Sprintf("%.1f GiB", float64(n)/(1<<30))
	case n >= 1<<20:
		return mib(n)
	case n >= 1<<10:
		return fmt.Sprintf("%.1f KiB", float64(n)/(1<<10))
	}
	return fmt.Sprintf("%d B", n)
}

// rate is bytes per wall time in MB/s (10^6 bytes per second).
func rate(bytes int64, el time.Duration) string {
	if el <= 0 {
		return "-"
	}
	return fmt.Sprintf("%.0f", float64(bytes)/1e6/el.Seconds())
}
