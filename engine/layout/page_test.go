package layout_test

import (
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"testing"

	"github.com/kvpersist/kvpersist/engine/layout"
)

// The test vector of docs/format/page.md ("Key chain"): identity
// "example-model/bf16/tp0", P = 16, token ids 1000..1039 (two full pages and
// a leaf of 8 tokens).
const (
	vecIdentity = "example-model/bf16/tp0"
	vecP        = 16
	vecK0       = "576af1a90adda4c829fde16c17b67eaeedccc5a9237fabee62c6d914cc66c9bc"
	vecK1       = "c0bdc763a2b2add23ae86c261b955dac56e366cadbc6596cb34212f3cfbd33f0"
	vecK2       = "f4717ac26a9e56d0bd39292c1c0abd4ec0c29d1c8ed86410514716c3f29476f7"
	vecLeaf     = "4ee142e4c42479197888e61f58988bbf1440af708cead2f48dcaf1271f8afe86"
)

func vecTokens() []uint32 {
	t := make([]uint32, 40)
	for i := range t {
		t[i] = uint32(1000 + i)
	}
	return t
}

// handChain computes the documented chain with crypto/sha256 and
// encoding/binary, independently of package layout.
func handChain(identity string, p int, tokens []uint32) []string {
	b := []byte("kvpersist/page/v1\n")
	b = binary.LittleEndian.AppendUint32(b, uint32(len(identity)))
	b = append(b, identity...)
	b = binary.LittleEndian.AppendUint32(b, uint32(p))
	k := sha256.Sum256(b)
	out := []string{hex.EncodeToString(k[:])}
	for i := 0; i < len(tokens); i += p {
		m := append([]byte{}, k[:]...)
		for _, t := range tokens[i:min(i+p, len(tokens))] {
			m = binary.LittleEndian.AppendUint32(m, t)
		}
		k = sha256.Sum256(m)
		out = append(out, hex.EncodeToString(k[:]))
	}
	return out
}

func TestPageKeyVector(t *testing.T) {
	hand := handChain(vecIdentity, vecP, vecTokens())
	want := []string{vecK0, vecK1, vecK2, vecLeaf}
	if fmt.Sprint(hand) != fmt.Sprint(want) {
		t.Fatalf("documented vector %v differs from the hand computation %v", want, hand)
	}
	if got := layout.PageRoot(vecIdentity, vecP).String(); got != vecK0 {
		t.Fatalf("PageRoot = %s, want %s", got, vecK0)
	}
	keys, full, err := layout.PageChain(vecIdentity, vecP, vecTokens())
	if err != nil {
		t.Fatal(err)
	}
	if full != 2 || len(keys) != 3 {
		t.Fatalf("PageChain: %d keys, %d full; want 3 and 2", len(keys), full)
	}
	for i, k := range keys {
		if k.String() != want[i+1] {
			t.Errorf("key %d = %s, want %s", i, k, want[i+1])
		}
	}
}

// Random identities, page sizes and token counts agree with the hand chain.
func TestPageChainMatchesHand(t *testing.T) {
	for _, p := range []int{16, 64, 256, 4096} {
		for _, n := range []int{0, 1, p - 1, p, p + 1, 3*p + 5} {
			toks := make([]uint32, n)
			for i := range toks {
				toks[i] = uint32(i*2654435761) ^ 0xdeadbeef
			}
			id := fmt.Sprintf("id-%d-%d\x00bytes", p, n)
			keys, full, err := layout.PageChain(id, p, toks)
			if err != nil {
				t.Fatal(err)
			}
			hand := handChain(id, p, toks)
			if full != n/p || len(keys) != len(hand)-1 {
				t.Fatalf("P=%d n=%d: %d keys (%d full), hand has %d", p, n, len(keys), full, len(hand)-1)
			}
			for i, k := range keys {
				if k.String() != hand[i+1] {
					t.Fatalf("P=%d n=%d key %d: %s, hand %s", p, n, i, k, hand[i+1])
				}
			}
		}
	}
}

func TestPageChainDistinguishes(t *testing.T) {
	toks := vecTokens()[:32]
	a, _, _ := layout.PageChain("a", 16, toks)
	b, _, _ := layout.PageChain("b", 16, toks)
	c, _, _ := layout.PageChain("a", 32, toks)
	if a[0] == b[0] || a[1] == c[0] {
		t.Fatal("a different identity or page size must give different keys")
	}
	toks2 := append([]uint32{}, toks...)
	toks2[3]++
	d, _, _ := layout.PageChain("a", 16, toks2)
	if d[1] == a[1] {
		t.Fatal("a change in page 0 must change page 1's key (the chain)")
	}
}

func TestCheckPageTokens(t *testing.T) {
	for _, p := range []int{16, 32, 256, 4096} {
		if err := layout.CheckPageTokens(p); err != nil {
			t.Errorf("%d: %v", p, err)
		}
	}
	for _, p := range []int{0, -16, 8, 15, 17, 100, 8192} {
		if err := layout.CheckPageTokens(p); !errors.Is(err, layout.ErrPageTokens) {
			t.Errorf("%d: got %v, want ErrPageTokens", p, err)
		}
	}
	if _, _, err := layout.PageChain("", 16, nil); !errors.Is(err, layout.ErrIdentity) {
		t.Errorf("empty identity: %v", err)
	}
	if _, _, err := layout.PageChain(string(make([]byte, layout.MaxIdentityBytes+1)), 16, nil); !errors.Is(err, layout.ErrIdentity) {
		t.Errorf("long identity: %v", err)
	}
}

func TestPageNextNoAlloc(t *testing.T) {
	if raceEnabled {
		t.Skip("the race detector makes sync.Pool drop items: allocations are not meaningful")
	}
	toks := make([]uint32, 256)
	var k layout.PageKey
	if n := testing.AllocsPerRun(100, func() { k = layout.PageNext(k, toks) }); n != 0 {
		t.Fatalf("PageNext allocates %v times", n)
	}
}

// A key parses from its 64 lowercase hex digits only (where a page file
// lives is engine/store's: store.Namespace.PagePath).
func TestParsePageKey(t *testing.T) {
	k, err := layout.ParsePageKey(vecK1)
	if err != nil || k.String() != vecK1 {
		t.Fatalf("ParsePageKey(%s) = %s, %v", vecK1, k, err)
	}
	if _, err := layout.ParsePageKey("C0" + vecK1[2:]); !errors.Is(err, layout.ErrInvalidHeader) {
		t.Fatalf("uppercase key accepted: %v", err)
	}
}

// The page object's wire form: the documented key order and fields.
func TestPageMetaJSON(t *testing.T) {
	k1, _ := layout.ParsePageKey(vecK1)
	k0, _ := layout.ParsePageKey(vecK0)
	p := layout.Page{Key: k1, Parent: k0, Identity: vecIdentity, PageTokens: 16, Tokens: vecTokens()[:16]}
	if err := p.Check(); err != nil {
		t.Fatal(err)
	}
	var got map[string]any
	if err := json.Unmarshal(p.MetaJSON(), &got); err != nil {
		t.Fatal(err)
	}
	if got["key"] != vecK1 || got["parent"] != vecK0 || got["identity"] != vecIdentity || got["pageTokens"] != 16.0 || got["tokenCount"] != 16.0 || len(got["tokens"].([]any)) != 16 {
		t.Fatalf("page object %v", got)
	}
	p.Tokens = vecTokens()[1:17]
	if err := p.Check(); !errors.Is(err, layout.ErrInvalidHeader) {
		t.Fatalf("a key that is not the chain step passed Check: %v", err)
	}
}
