package main

import (
	"strconv"
	"unicode/utf8"
)

// quote returns s as is when every character is printable (strconv.IsPrint)
// and it is valid UTF-8, else quoted with Go escapes (strconv.Quote). Names
// in a store come from whoever wrote it: a crafted file name or metadata
// value must not reach the terminal raw (escape sequences could rewrite
// what the operator sees).
func quote(s string) string {
	if !utf8.ValidString(s) {
		return strconv.Quote(s)
	}
	for _, r := range s {
		if !strconv.IsPrint(r) {
			return strconv.Quote(s)
		}
	}
	return s
}
