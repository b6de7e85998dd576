package layout

import (
	"encoding/json"
	"math"
	"math/rand/v2"
	"testing"
)

// The header writer's strings and integers are byte for byte what
// encoding/json writes (its fast path for printable ASCII must escape
// exactly what json.Marshal escapes), over every single byte and random
// strings mixing ASCII, escapes, multi-byte and invalid UTF-8.
func TestJSONWriterMatchesMarshal(t *testing.T) {
	check := func(s string) {
		t.Helper()
		var w jsonWriter
		w.str(s)
		want, _ := json.Marshal(s)
		if w.String() != string(want) {
			t.Fatalf("str(%q) = %s, json.Marshal %s", s, w.String(), want)
		}
	}
	for c := range 256 {
		check(string([]byte{byte(c)}))
		check("ab" + string([]byte{byte(c)}) + "cd")
	}
	alphabet := []string{"a", "Z", "0", " ", "~", "\"", "\\", "<", ">", "&", "\n", "\x00", "\x7f", "é", "\u2028", "\u2029", "\xff", "/", "日"}
	r := rand.New(rand.NewPCG(1, 2))
	for range 5000 {
		s := ""
		for range r.IntN(12) {
			s += alphabet[r.IntN(len(alphabet))]
		}
		check(s)
	}
	for _, v := range []int64{0, 1, -1, 9, 10, 4096, -4096, math.MaxInt64, math.MinInt64, 1 << 40} {
		var w jsonWriter
		w.int(v)
		want, _ := json.Marshal(v)
		if w.String() != string(want) {
			t.Fatalf("int(%d) = %s, json.Marshal %s", v, w.String(), want)
		}
	}
}
