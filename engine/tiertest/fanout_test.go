package tiertest

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// TestStrayFanoutEndsFetchedPrefixThere: a stray file at pages/<xx> where
// the fan-out directory of page i of an uploaded chain belongs, on a new
// root, fails page i alone: a load fetches the pages before it, loads
// them, and ends there with a Stop naming the path (the stray entry does
// not stop the fetch of the whole chain).
func TestStrayFanoutEndsFetchedPrefixThere(t *testing.T) {
	const i, n = 2, 5 * ptoks
	// A chain whose page i alone starts with its key's two hex digits.
	base := 1
	for ; ; base += n {
		keys := keysOf(t, seq(base, n))
		alone := true
		for j, k := range keys {
			alone = alone && (j == i || k.String()[:2] != keys[i].String()[:2])
		}
		if alone {
			break
		}
	}
	prefix, _, conv, keys := uploadedConv(t, base, n)
	rootB := t.TempDir()
	fan := filepath.Dir(pagePath(rootB, keys[i]))
	if err := os.MkdirAll(filepath.Dir(fan), 0o750); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(fan, []byte("stray"), 0o640); err != nil {
		t.Fatal(err)
	}
	b := newEngine(t, rootB, prefix, newRecorder(t), nil)
	res, c := load(t, b, conv)
	if res.Prefix.Tokens != i*ptoks || res.Prefix.Stop == nil || !strings.Contains(res.Prefix.Stop.Error(), fan) {
		t.Fatalf("load: %d tokens, stop %v; want %d tokens and a stop naming %s (remote: %+v)",
			res.Prefix.Tokens, res.Prefix.Stop, i*ptoks, fan, res.Remote)
	}
	c.checkLoaded(t, conv, i*ptoks)
	if res.Remote == nil || res.Remote.PagesFetched != i {
		t.Fatalf("remote report %+v, want %d pages fetched", res.Remote, i)
	}
}
