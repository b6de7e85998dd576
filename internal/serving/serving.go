// Package serving is a steady-state serving loop on kvpersist's prefix
// cache: conversations that share system prompts, each growing over a few
// turns and then replaced by a new one, served side by side as a scheduler
// serves them. Every turn looks the conversation's prompt up
// (Engine.Lookup), loads the stored prefix into a capacity-padded buffer
// (LoadPrefixRequest, verified), "computes" the tokens not loaded and saves
// the conversation (SavePrefixRequest). The working set grows without end
// (new conversations keep coming), so a bounded cache reaches its capacity
// and evicts from then on. The benchmark (bench: BenchmarkServing) and the
// soak (engine: TestServingSoakSIGKILL, `make soak`) run it; it is product
// code (no test-only package) so both can.
//
// # Token ids are content
//
// A token's id is also the kvgen token index whose KV content it holds
// (kvgen.Model.Rows with first = id), so the KV of any page can be
// recomputed from the token ids in its header alone (PageContent), without
// knowing which conversation wrote it:
//
//   - position p < SystemTokens of a conversation using system prompt s
//     holds id s·SystemTokens + p (< 2^PositionBits: SystemPrompts ×
//     SystemTokens ≤ 2^PositionBits);
//   - position p ≥ SystemTokens of conversation g (1 ≤ g < 2^(32 −
//     PositionBits)) holds id g·2^PositionBits + p.
//
// So conversations share exactly their system prompt, and the ids of one
// conversation are two runs of consecutive content indices. Conversation
// numbers wrap around (a new conversation may reuse the number of an old
// one, and then finds the old one's pages: the same ids, the same content).
package serving

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"sync"
	"time"

	"github.com/kvpersist/kvpersist/engine"
	"github.com/kvpersist/kvpersist/engine/evict"
	"github.com/kvpersist/kvpersist/engine/layout"
	"github.com/kvpersist/kvpersist/internal/kvgen"
)

// PositionBits is the bits of a token id that hold its position in its
// conversation: a conversation holds at most MaxTokens tokens.
const PositionBits = 12

// MaxTokens is the most tokens a conversation reaches (2^PositionBits − 1).
const MaxTokens = 1<<PositionBits - 1

// maxConversation is the largest conversation number (ids are uint32).
const maxConversation = 1<<(32-PositionBits) - 1

// Defaults of Options (zero fields take these).
const (
	DefaultNamespace     = "serving"
	DefaultPageTokens    = 64
	DefaultSystemPrompts = 2
	DefaultSystemTokens  = 256
	DefaultActive        = 8
	DefaultTurns         = 4
	DefaultMinTurnTokens = 32
	DefaultMaxTurnTokens = 160
	// Identity is the identity of every page the loop saves.
	Identity = "kvpersist-serving/tiny/bf16"
)

// ErrOptions: an Options field is out of range (the message names it).
var ErrOptions = errors.New("serving: invalid options")

// ErrMismatch: a loaded byte differs from the content its token id stands
// for, or a load reported more tokens than the lookup found (the message
// says where).
var ErrMismatch = errors.New("serving: mismatch")

// Options configure a Loop. Zero fields take the defaults above.
type Options struct {
	// Namespace of the prefix cache (default DefaultNamespace).
	Namespace string
	// Model is the KV geometry (default kvgen.Tiny: 2 layers, 2 KV heads,
	// head_dim 16, bf16: 256 bytes per token over its 4 tensors).
	Model kvgen.Model
	// PageTokens is P, tokens per page (default 64: with the tiny model a
	// page file is then 32 KiB allocated, 16 KiB of it KV; at 16 tokens it
	// would be 29 KiB for 4 KiB of KV, the header's 16 KiB alignment and
	// each tensor's 4 KiB alignment dominating).
	PageTokens int
	// SystemPrompts distinct system prompts of SystemTokens tokens each
	// (SystemPrompts × SystemTokens ≤ 2^PositionBits); conversation g uses
	// prompt g mod SystemPrompts.
	SystemPrompts, SystemTokens int
	// Active conversations are served side by side; each step serves one
	// of them, chosen at random. After Turns turns (or once it would pass
	// MaxTokens) a conversation ends and a new one takes its slot.
	Active, Turns int
	// A turn adds MinTurnTokens to MaxTurnTokens tokens (uniform).
	MinTurnTokens, MaxTurnTokens int
	// Stream tells apart loops that run side by side on one namespace
	// (0, 1, ...): loop s numbers its conversations s+1, s+1+Streams, ...
	// so that no two loops serve the same conversation. Streams ≥ 1
	// (default 1).
	Stream, Streams int
	// Seed makes the choices (conversation served, turn lengths)
	// reproducible.
	Seed uint64
	// Verify compares every loaded byte with the content its token id
	// stands for (PageContent); a difference is ErrMismatch.
	Verify bool
}

func (o *Options) resolve() error {
	def := func(v *int, d int) {
		if *v == 0 {
			*v = d
		}
	}
	if o.Namespace == "" {
		o.Namespace = DefaultNamespace
	}
	if o.Model.Name == "" {
		o.Model = kvgen.Tiny
	}
	def(&o.PageTokens, DefaultPageTokens)
	def(&o.SystemPrompts, DefaultSystemPrompts)
	def(&o.SystemTokens, DefaultSystemTokens)
	def(&o.Active, DefaultActive)
	def(&o.Turns, DefaultTurns)
	def(&o.MinTurnTokens, DefaultMinTurnTokens)
	def(&o.MaxTurnTokens, DefaultMaxTurnTokens)
	def(&o.Streams, 1)
	bad := func(format string, a ...any) error {
		return fmt.Errorf("%w: %s", ErrOptions, fmt.Sprintf(format, a...))
	}
	switch {
	case layout.ValidName("namespace", o.Namespace) != nil:
		return bad("%v", layout.ValidName("namespace", o.Namespace))
	case o.Model.ItemSize != 2 || o.Model.Layers < 1 || o.Model.KVHeads < 1 || o.Model.HeadDim < 1:
		return bad("model %+v: want 2-byte elements and a positive geometry", o.Model)
	case layout.CheckPageTokens(o.PageTokens) != nil:
		return bad("page tokens: %v", layout.CheckPageTokens(o.PageTokens))
	case o.SystemPrompts < 1 || o.SystemTokens < 0 || o.SystemPrompts*o.SystemTokens > 1<<PositionBits:
		return bad("%d system prompts of %d tokens: want ≥ 1 prompt, ≥ 0 tokens, at most %d tokens in all", o.SystemPrompts, o.SystemTokens, 1<<PositionBits)
	case o.SystemTokens+o.MaxTurnTokens > MaxTokens:
		return bad("system tokens %d + a turn of %d tokens pass the %d tokens of a conversation", o.SystemTokens, o.MaxTurnTokens, MaxTokens)
	case o.Active < 1 || o.Turns < 1:
		return bad("active %d, turns %d: want ≥ 1", o.Active, o.Turns)
	case o.MinTurnTokens < 1 || o.MaxTurnTokens < o.MinTurnTokens:
		return bad("turn tokens %d to %d: want 1 ≤ min ≤ max", o.MinTurnTokens, o.MaxTurnTokens)
	case o.Streams < 1 || o.Stream < 0 || o.Stream >= o.Streams || o.Streams > maxConversation:
		return bad("stream %d of %d: want 0 ≤ stream < streams", o.Stream, o.Streams)
	}
	return nil
}

// Stats counts what loops did. Tokens are tokens, bytes bytes.
type Stats struct {
	Turns   int64 // steps served
	Lookups int64 // one per turn
	// HitTokens + MissTokens = the tokens of every prompt looked up;
	// HitTokens were found stored (Engine.Lookup).
	HitTokens, MissTokens int64
	Loads                 int64 // loads run (turns whose lookup found something)
	LoadedTokens          int64 // tokens the loads loaded (≤ HitTokens: a page evicted between lookup and load is a miss)
	LoadedBytes           int64 // bytes the loads read (Result.Metrics.ReadBytes)
	Saves                 int64 // saves acked without error
	// SavesRefused: saves that failed with evict.ErrNoSpace (nothing
	// written: the cache could not make room).
	SavesRefused              int64
	PagesWritten, PagesReused int64
	BytesWritten, BytesReused int64
	Conversations             int64 // conversations started
}

// Add adds o's counts to s.
func (s *Stats) Add(o Stats) {
	s.Turns += o.Turns
	s.Lookups += o.Lookups
	s.HitTokens += o.HitTokens
	s.MissTokens += o.MissTokens
	s.Loads += o.Loads
	s.LoadedTokens += o.LoadedTokens
	s.LoadedBytes += o.LoadedBytes
	s.Saves += o.Saves
	s.SavesRefused += o.SavesRefused
	s.PagesWritten += o.PagesWritten
	s.PagesReused += o.PagesReused
	s.BytesWritten += o.BytesWritten
	s.BytesReused += o.BytesReused
	s.Conversations += o.Conversations
}

// HitRate is HitTokens / (HitTokens + MissTokens): the share of prompt
// tokens found in the cache (0 before any lookup).
func (s Stats) HitRate() float64 {
	if s.HitTokens+s.MissTokens == 0 {
		return 0
	}
	return float64(s.HitTokens) / float64(s.HitTokens+s.MissTokens)
}

// conv is an active conversation.
type conv struct {
	g      uint32 // conversation number
	turn   int    // turns served
	tokens int    // tokens after the last turn
}

// Loop is one serving loop: Active conversations and the buffer of the
// one being served (capacity-padded for the longest conversation the
// options allow: SystemTokens + Turns × MaxTurnTokens tokens, at most
// MaxTokens). It is not safe for concurrent use; run loops side by
// side with distinct Streams (Run).
type Loop struct {
	o     Options
	rng   *rand.Rand
	convs []conv
	next  uint32 // the next conversation number of this stream
	arena []byte // one capacity-padded buffer per tensor, carved in order
	row   []byte // one head's expected rows (Verify)
	ids   []uint32
	Stats Stats
}

// New returns a loop. Error: ErrOptions.
func New(o Options) (*Loop, error) {
	if err := o.resolve(); err != nil {
		return nil, err
	}
	m := o.Model
	l := &Loop{o: o, rng: rand.New(rand.NewPCG(o.Seed, uint64(o.Stream)+1)), next: uint32(o.Stream + 1)}
	capTok := kvgen.Capacity(min(MaxTokens, o.SystemTokens+o.Turns*o.MaxTurnTokens))
	l.arena = make([]byte, 2*m.Layers*m.TensorBytes(capTok))
	l.row = make([]byte, capTok*m.HeadDim*m.ItemSize)
	l.ids = make([]uint32, MaxTokens)
	for range o.Active {
		l.convs = append(l.convs, l.newConv())
	}
	return l, nil
}

// Options returns the loop's options, defaults filled in.
func (l *Loop) Options() Options { return l.o }

func (l *Loop) newConv() conv {
	c := conv{g: l.next}
	l.next += uint32(l.o.Streams)
	if l.next > maxConversation || l.next < uint32(l.o.Streams) {
		l.next = uint32(l.o.Stream + 1) // wrap: see the package doc
	}
	l.Stats.Conversations++
	return c
}

// TokenIDs writes into dst the token ids of positions [0, len(dst)) of
// conversation g (≥ 1) using system prompt s (see the package doc).
func TokenIDs(dst []uint32, g uint32, s, systemTokens int) {
	for p := range dst {
		if p < systemTokens {
			dst[p] = uint32(s*systemTokens + p)
		} else {
			dst[p] = g<<PositionBits | uint32(p)
		}
	}
}

// Step serves one turn of one active conversation (chosen at random):
// lookup of its prompt (the conversation so far plus the turn's new
// tokens), load of the stored prefix, verified, into the loop's
// capacity-padded buffer (compared byte by byte with Verify), computation
// of the rest, save. A save refused with evict.ErrNoSpace is counted
// (Stats.SavesRefused), not returned. Errors: ctx's, the engine's,
// ErrMismatch.
func (l *Loop) Step(ctx context.Context, e *engine.Engine) error {
	o := &l.o
	i := l.rng.IntN(len(l.convs))
	c := &l.convs[i]
	t := min(c.tokens+o.MinTurnTokens+l.rng.IntN(o.MaxTurnTokens-o.MinTurnTokens+1), MaxTokens)
	if c.turn == 0 {
		t = max(t, o.SystemTokens+o.MinTurnTokens)
	}
	sys := int(c.g) % o.SystemPrompts
	ids := l.ids[:t]
	TokenIDs(ids, c.g, sys, o.SystemTokens)
	capTok := kvgen.Capacity(t)

	found, err := e.Lookup(o.Namespace, Identity, o.PageTokens, ids)
	if err != nil {
		return fmt.Errorf("serving: lookup: %w", err)
	}
	l.Stats.Turns++
	l.Stats.Lookups++
	l.Stats.HitTokens += int64(found)
	l.Stats.MissTokens += int64(t - found)
	loaded := 0
	if found > 0 {
		res := e.Do(ctx, &engine.LoadPrefixRequest{Namespace: o.Namespace, Identity: Identity, Tokens: ids,
			Dest: l.views(capTok, capTok), PageTokens: o.PageTokens})
		if res.Err != nil {
			return fmt.Errorf("serving: load: %w", res.Err)
		}
		if res.Prefix.Stop != nil {
			return fmt.Errorf("%w: conversation %d: the load stopped after %d tokens: %v", ErrMismatch, c.g, res.Prefix.Tokens, res.Prefix.Stop)
		}
		loaded = res.Prefix.Tokens
		if loaded > found {
			return fmt.Errorf("%w: conversation %d: lookup found %d tokens, the load loaded %d", ErrMismatch, c.g, found, loaded)
		}
		l.Stats.Loads++
		l.Stats.LoadedTokens += int64(loaded)
		l.Stats.LoadedBytes += res.Metrics.ReadBytes
		if o.Verify {
			if err := l.compare(ids[:loaded], capTok); err != nil {
				return fmt.Errorf("conversation %d: %w", c.g, err)
			}
		}
	}
	l.compute(ids, capTok, loaded)
	res := e.Do(ctx, &engine.SavePrefixRequest{Namespace: o.Namespace, Identity: Identity, Tokens: ids,
		Tensors: l.views(capTok, t), PageTokens: o.PageTokens})
	switch {
	case res.Err == nil:
		l.Stats.Saves++
		p := res.Prefix
		l.Stats.PagesWritten += int64(p.PagesWritten)
		l.Stats.PagesReused += int64(p.PagesReused)
		l.Stats.BytesWritten += p.BytesWritten
		l.Stats.BytesReused += p.BytesReused
	case errors.Is(res.Err, evict.ErrNoSpace):
		l.Stats.SavesRefused++
	default:
		return fmt.Errorf("serving: save: %w", res.Err)
	}
	c.turn++
	c.tokens = t
	if c.turn >= o.Turns || t+o.MaxTurnTokens > MaxTokens {
		*c = l.newConv()
	}
	return nil
}

// views returns the views of the first tokens tokens of capacity-padded
// buffers of capTok tokens carved from the arena (kvgen.Model.ArenaViews).
func (l *Loop) views(capTok, tokens int) []engine.TensorSpec {
	return l.o.Model.ArenaViews(l.arena, capTok, tokens)
}

// runs calls fn for each run of consecutive ids: its first position, its
// length and its first id (the kvgen token index of its content).
func runs(ids []uint32, fn func(pos, n int, first uint32)) {
	for pos := 0; pos < len(ids); {
		end := pos + 1
		for end < len(ids) && ids[end] == ids[end-1]+1 {
			end++
		}
		fn(pos, end-pos, ids[pos])
		pos = end
	}
}

// compute writes the content of tokens [from, len(ids)) into the buffers of
// capacity capTok: what a model's prefill would produce.
func (l *Loop) compute(ids []uint32, capTok, from int) {
	m := l.o.Model
	rowBytes := m.HeadDim * m.ItemSize
	tb := m.TensorBytes(capTok)
	for i := range 2 * m.Layers {
		buf := l.arena[i*tb : (i+1)*tb]
		for h := range m.KVHeads {
			base := h * capTok * rowBytes
			runs(ids[from:], func(pos, n int, first uint32) {
				p := from + pos
				m.Rows(buf[base+p*rowBytes:base+(p+n)*rowBytes], i/2, i%2, h, int(first))
			})
		}
	}
}

// compare checks tokens [0, len(ids)) of every tensor's buffer of capacity
// capTok against the content of their ids.
func (l *Loop) compare(ids []uint32, capTok int) error {
	m := l.o.Model
	rowBytes := m.HeadDim * m.ItemSize
	tb := m.TensorBytes(capTok)
	want := l.row[:len(ids)*rowBytes]
	for i := range 2 * m.Layers {
		buf := l.arena[i*tb : (i+1)*tb]
		for h := range m.KVHeads {
			base := h * capTok * rowBytes
			PageContentHead(m, ids, i, h, want)
			if got := buf[base : base+len(want)]; string(got) != string(want) {
				j := 0
				for got[j] == want[j] {
					j++
				}
				return fmt.Errorf("%w: layer %d %s, head %d, token %d (id %d): byte %d of the row is %#02x, want %#02x",
					ErrMismatch, i/2, "KV"[i%2:i%2+1], h, j/rowBytes, ids[j/rowBytes], j%rowBytes, got[j], want[j])
			}
		}
	}
	return nil
}

// PageContentHead writes into out (len(ids) rows of HeadDim elements) the
// KV content of one head of tensor tensor (layer tensor/2, K when even, V
// when odd) for the token ids ids (see the package doc: an id is the kvgen
// token index of its content).
func PageContentHead(m kvgen.Model, ids []uint32, tensor, head int, out []byte) {
	rowBytes := m.HeadDim * m.ItemSize
	runs(ids, func(pos, n int, first uint32) {
		m.Rows(out[pos*rowBytes:(pos+n)*rowBytes], tensor/2, tensor%2, head, int(first))
	})
}

// PageContent returns the bytes tensor tensor of a page holding the token
// ids ids must hold: row-major [1, KVHeads, len(ids), HeadDim], as a page
// file stores it.
func PageContent(m kvgen.Model, ids []uint32, tensor int) []byte {
	rowBytes := m.HeadDim * m.ItemSize
	out := make([]byte, m.KVHeads*len(ids)*rowBytes)
	for h := range m.KVHeads {
		PageContentHead(m, ids, tensor, h, out[h*len(ids)*rowBytes:(h+1)*len(ids)*rowBytes])
	}
	return out
}

// Run runs loops side by side on e, one goroutine each (started and
// joined here), each for steps steps (steps ≤ 0: until ctx ends, which
// then is no error). It returns the loops' summed Stats and their first
// error other than the end of ctx.
func Run(ctx context.Context, e *engine.Engine, loops []*Loop, steps int) (Stats, error) {
	errs := make([]error, len(loops))
	before := make([]Stats, len(loops))
	var wg sync.WaitGroup
	for i, l := range loops {
		before[i] = l.Stats
		wg.Go(func() {
			for n := 0; steps <= 0 || n < steps; n++ {
				if ctx.Err() != nil {
					if steps > 0 {
						errs[i] = ctx.Err()
					}
					return
				}
				if err := l.Step(ctx, e); err != nil {
					if steps > 0 || ctx.Err() == nil {
						errs[i] = err
					}
					return
				}
			}
		})
	}
	wg.Wait()
	var s Stats
	for i, l := range loops {
		d := l.Stats
		d.sub(before[i])
		s.Add(d)
	}
	return s, errors.Join(errs...)
}

func (s *Stats) sub(o Stats) {
	neg := o
	neg.neg()
	s.Add(neg)
}

func (s *Stats) neg() {
	for _, p := range []*int64{&s.Turns, &s.Lookups, &s.HitTokens, &s.MissTokens, &s.Loads, &s.LoadedTokens,
		&s.LoadedBytes, &s.Saves, &s.SavesRefused, &s.PagesWritten, &s.PagesReused, &s.BytesWritten,
		&s.BytesReused, &s.Conversations} {
		*p = -*p
	}
}

// Rate is count per second of d (0 when d ≤ 0).
func Rate(count int64, d time.Duration) float64 {
	if d <= 0 {
		return 0
	}
	return float64(count) / d.Seconds()
}
