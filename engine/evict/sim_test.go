package evict

import (
	"crypto/sha256"
	"encoding/binary"
	"errors"
	"math/rand/v2"
	"testing"
)

// simResult is the outcome of one simulated serving run at capacity.
type simResult struct {
	hitPages, lookupPages int64
	refused               int
	// orphanPageSteps sums, after every 8th request, the stored pages
	// whose parent is not stored: bytes kept that no lookup can reach.
	orphanPageSteps int64
}

func (r simResult) hitRate() float64 { return float64(r.hitPages) / float64(r.lookupPages) }

// simulate runs a serving loop against the policy alone (no disk): each
// request continues a conversation (or starts one) that begins with one of
// a few shared system prompts; it looks up the conversation's chain (hit =
// the stored pages from its start, in a row), pins and touches them, then
// saves the rest of the chain (reserving, removing the victims at once,
// committing the pages), and unpins. With chained false, pages are given
// to the policy without their parents: plain LRU, blind to the chain.
func simulate(t *testing.T, chained bool, seed uint64) simResult {
	const (
		pageBytes   = 4096
		capacity    = 400 * pageBytes
		prompts     = 3
		promptPages = 8
		requests    = 2000
	)
	c, err := New(Config{CapacityBytes: capacity})
	if err != nil {
		t.Fatal(err)
	}
	rng := rand.New(rand.NewPCG(seed, 11))
	type conv struct{ prompt, pages int }
	var convs []conv
	keyOf := func(ci, i int) Key {
		var b [24]byte
		cv := convs[ci]
		if i < promptPages { // the prompt's pages: shared by its conversations
			binary.LittleEndian.PutUint64(b[:], uint64(cv.prompt))
			binary.LittleEndian.PutUint64(b[8:], uint64(i))
			b[16] = 1
		} else {
			binary.LittleEndian.PutUint64(b[:], uint64(ci))
			binary.LittleEndian.PutUint64(b[8:], uint64(i))
			b[16] = 2
		}
		return sha256.Sum256(b[:])
	}
	parentOf := map[Key]Key{} // the chain, as the simulation knows it
	var res simResult
	for now := int64(1); now <= requests; now++ {
		ci := len(convs)
		if len(convs) > 0 && rng.IntN(4) > 0 { // 3 in 4 requests continue a recent conversation
			ci = len(convs) - 1 - min(rng.IntN(12), len(convs)-1)
		} else {
			convs = append(convs, conv{prompt: rng.IntN(prompts), pages: promptPages})
		}
		convs[ci].pages += 1 + rng.IntN(3) // the new turn's tokens
		n := convs[ci].pages
		keys := make([]Key, n)
		for i := range keys {
			keys[i] = keyOf(ci, i)
		}
		// Lookup: stored pages from the start, in a row; pin them.
		hit := 0
		for hit < n {
			if _, ok := c.Lookup("ns", keys[hit]); !ok {
				break
			}
			hit++
		}
		pinned := c.PinPrefix("ns", keys[:hit])
		if pinned != hit {
			t.Fatalf("pinned %d of %d stored pages", pinned, hit)
		}
		res.hitPages += int64(hit)
		res.lookupPages += int64(n)
		c.TouchAll("ns", keys[:hit], now)
		// Save the rest of the chain (pages stored beyond the hit are
		// unreachable: the save writes them again).
		r, err := c.Reserve(Want{Namespace: "ns", Bytes: int64(n-hit) * pageBytes, AvailBytes: -1})
		if errors.Is(err, ErrNoSpace) {
			res.refused++
		} else if err != nil {
			t.Fatal(err)
		} else {
			for _, v := range r.Victims {
				c.Removed(v.Namespace, v.Key)
			}
			for i := hit; i < n; i++ {
				p := Page{Namespace: "ns", Key: keys[i], Bytes: pageBytes, Access: now}
				if i > 0 {
					parentOf[keys[i]] = keys[i-1]
					if chained {
						p.Parent, p.HasParent = keys[i-1], true
					}
				}
				if err := r.Commit(p); err != nil {
					t.Fatal(err)
				}
			}
			r.Release()
		}
		if err := c.UnpinAll("ns", keys[:hit]); err != nil {
			t.Fatal(err)
		}
		if u := c.Usage(); u.UsedBytes > capacity || u.ReservedBytes != 0 || u.EvictingBytes != 0 {
			t.Fatalf("request %d: usage %+v above capacity %d", now, u, capacity)
		}
		if now%8 != 0 {
			continue
		}
		for _, rec := range c.Checkpoint("ns", nil) {
			if parent, ok := parentOf[rec.Key]; ok {
				if _, stored := c.Lookup("ns", parent); !stored {
					res.orphanPageSteps++
				}
			}
		}
	}
	return res
}

// TestServingLoopAtCapacity: a serving loop at capacity with conversations
// sharing system prompts, once with the policy (leaves first) and once with
// LRU blind to the chain. With the policy no save is refused, the cache
// never exceeds its capacity, and no stored page is ever an orphan (a page
// whose parent is gone: bytes no lookup can reach); it serves at least as
// many tokens from the cache as chain-blind LRU. The figures are logged
// (go test -v).
func TestServingLoopAtCapacity(t *testing.T) {
	for seed := range uint64(2) {
		leaves, blind := simulate(t, true, seed), simulate(t, false, seed)
		t.Logf("seed %d: hit rate in pages: leaves first %.3f (%d of %d), chain-blind LRU %.3f; orphaned page-steps: %d and %d",
			seed, leaves.hitRate(), leaves.hitPages, leaves.lookupPages, blind.hitRate(), leaves.orphanPageSteps, blind.orphanPageSteps)
		if leaves.refused != 0 || leaves.orphanPageSteps != 0 {
			t.Fatalf("seed %d: leaves first refused %d saves, left %d orphaned page-steps", seed, leaves.refused, leaves.orphanPageSteps)
		}
		if leaves.hitRate() < blind.hitRate() {
			t.Fatalf("seed %d: leaves first hit %.3f, chain-blind LRU %.3f", seed, leaves.hitRate(), blind.hitRate())
		}
	}
}
