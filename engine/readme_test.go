package engine_test

import (
	"bytes"
	"go/parser"
	"go/token"
	"os"
	"strconv"
	"strings"
	"testing"
)

// The README's embedding sketch is engine/example_test.go's Example, line
// for line (between its README:begin and README:end markers), under the one
// import it needs; and the Example imports no kvpersist package but engine.
func TestREADMEEmbeddingIsTheExample(t *testing.T) {
	src, err := os.ReadFile("example_test.go")
	if err != nil {
		t.Fatal(err)
	}
	f, err := parser.ParseFile(token.NewFileSet(), "example_test.go", src, parser.ImportsOnly)
	if err != nil {
		t.Fatal(err)
	}
	var ours []string
	for _, imp := range f.Imports {
		p, _ := strconv.Unquote(imp.Path.Value)
		if strings.HasPrefix(p, "github.com/kvpersist/kvpersist") {
			ours = append(ours, p)
		}
	}
	if len(ours) != 1 || ours[0] != "github.com/kvpersist/kvpersist/engine" {
		t.Fatalf("the example imports %v, want the engine package alone", ours)
	}
	_, rest, ok := bytes.Cut(src, []byte("// README:begin"))
	if !ok {
		t.Fatal("example_test.go has no README:begin marker")
	}
	_, rest, _ = bytes.Cut(rest, []byte("\n"))
	body, _, ok := bytes.Cut(rest, []byte("\t// README:end"))
	if !ok {
		t.Fatal("example_test.go has no README:end marker")
	}
	var want strings.Builder
	want.WriteString("import \"github.com/kvpersist/kvpersist/engine\"\n\n")
	for _, line := range strings.SplitAfter(string(body), "\n") {
		want.WriteString(strings.TrimPrefix(line, "\t"))
	}

	readme, err := os.ReadFile("../README.md")
	if err != nil {
		t.Fatal(err)
	}
	_, sec, ok := strings.Cut(string(readme), "\n## Embedding\n")
	if !ok {
		t.Fatal(`README.md has no "## Embedding" section`)
	}
	_, block, ok := strings.Cut(sec, "```go\n")
	if !ok {
		t.Fatal("README.md's Embedding section has no ```go block")
	}
	block, _, _ = strings.Cut(block, "```\n")
	if block != want.String() {
		t.Errorf("README.md's embedding sketch differs from the example; want exactly:\n%s", want.String())
	}
}
