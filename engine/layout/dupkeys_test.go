package layout

import (
	"bytes"
	"encoding/json"
	"testing"
)

// dupByTokens is an independent reference for duplicateKey: it walks the
// document with encoding/json's tokenizer (which unescapes keys) and keeps
// one key set per open object.
func dupByTokens(t *testing.T, js []byte) (string, bool) {
	d := json.NewDecoder(bytes.NewReader(js))
	type frame struct {
		obj  bool
		keys map[string]bool
		key  bool // the next string token of this object is a key
	}
	var stack []*frame
	for {
		tok, err := d.Token()
		if err != nil {
			return "", false
		}
		var top *frame
		if len(stack) > 0 {
			top = stack[len(stack)-1]
		}
		switch v := tok.(type) {
		case json.Delim:
			switch v {
			case '{':
				if top != nil && top.obj {
					top.key = true
				}
				stack = append(stack, &frame{obj: true, keys: map[string]bool{}, key: true})
				continue
			case '[':
				if top != nil && top.obj {
					top.key = true
				}
				stack = append(stack, &frame{})
				continue
			default:
				stack = stack[:len(stack)-1]
				continue
			}
		case string:
			if top != nil && top.obj && top.key {
				if top.keys[v] {
					return v, true
				}
				top.keys[v] = true
				top.key = false
				continue
			}
		}
		if top != nil && top.obj {
			top.key = true // a value ended: a key comes next
		}
	}
}

func FuzzDuplicateKey(f *testing.F) {
	for _, s := range []string{
		`{"a":1,"a":2}`, `{"a":1,"\u0061":2}`, `{"a":{"b":1},"c":{"b":2}}`, `[{"a":1},{"a":1}]`,
		`{"a":"a","b":["a","a"]}`, `"x"`, `{"a\"":1,"a\u0022":1}`, `{"":1,"":2}`, `{"x":[{"y":{"z":1,"z":1}}]}`,
		"{\"\xff\":1,\"\xfe\":2}", "{\"\\ufffd\":1,\"\xc0\":2}",
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, js []byte) {
		if !json.Valid(js) {
			return
		}
		k, _, got := duplicateKey(js)
		want, wantDup := dupByTokens(t, js)
		if got != wantDup || got && k != want {
			t.Fatalf("%s: duplicateKey = %q %v, the tokenizer says %q %v", js, k, got, want, wantDup)
		}
	})
}
