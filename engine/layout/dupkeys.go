package layout

import (
	"bytes"
	"encoding/json"
	"unicode/utf8"
)

// duplicateKey reports the first key that appears twice in one object of
// js, anywhere in the document (caller metadata included), comparing keys
// as encoding/json decodes them ("\u0063aches" is "caches", and each
// byte of invalid UTF-8 is U+FFFD), with the byte offset of
// the second occurrence. js must be valid JSON (json.Valid); encoding/json
// alone keeps the last of two equal keys, so a header could say one thing
// to kvpersist and another to a reader that keeps the first.
func duplicateKey(js []byte) (key string, off int, found bool) {
	type object struct {
		keys      [][]byte            // keys so far, while few
		set       map[string]struct{} // all keys, once there are many
		expectKey bool
	}
	const linear = 16 // compare linearly up to this many keys, then hash
	var stack []*object
	var free []*object // reused objects: a manifest has one per block
	for i := 0; i < len(js); i++ {
		switch js[i] {
		case '{':
			var o *object
			if n := len(free); n > 0 {
				o, free = free[n-1], free[:n-1]
				o.keys, o.set = o.keys[:0], nil
			} else {
				o = &object{}
			}
			o.expectKey = true
			stack = append(stack, o)
		case '[':
			stack = append(stack, nil)
		case '}', ']':
			if o := stack[len(stack)-1]; o != nil {
				free = append(free, o)
			}
			stack = stack[:len(stack)-1]
		case ',':
			if o := stack[len(stack)-1]; o != nil {
				o.expectKey = true
			}
		case '"':
			start := i
			escaped := false
			for i++; js[i] != '"'; i++ {
				switch {
				case js[i] == '\\':
					escaped = true
					i++
				case js[i] >= utf8.RuneSelf:
					// Possibly invalid UTF-8, which encoding/json reads as
					// U+FFFD: compare the key as it decodes it.
					escaped = true
				}
			}
			if len(stack) == 0 {
				continue // the document is a string
			}
			o := stack[len(stack)-1]
			if o == nil || !o.expectKey {
				continue // a string value
			}
			o.expectKey = false
			k := js[start+1 : i]
			if escaped {
				var s string
				if json.Unmarshal(js[start:i+1], &s) != nil {
					return string(k), start, true // cannot happen for valid JSON
				}
				k = []byte(s)
			}
			if o.set != nil {
				if _, dup := o.set[string(k)]; dup {
					return string(k), start, true
				}
				o.set[string(k)] = struct{}{}
				continue
			}
			for _, prev := range o.keys {
				if bytes.Equal(prev, k) {
					return string(k), start, true
				}
			}
			o.keys = append(o.keys, k)
			if len(o.keys) > linear {
				o.set = make(map[string]struct{}, 2*len(o.keys))
				for _, prev := range o.keys {
					o.set[string(prev)] = struct{}{}
				}
			}
		}
	}
	return "", 0, false
}
