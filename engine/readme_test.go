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
	checkREADMEBlock(t, "example_test.go", "Embedding")
}

// The README's prefix-cache sketch is example_prefix_test.go's Example.
func TestREADMEPrefixCacheIsTheExample(t *testing.T) {
	checkREADMEBlock(t, "example_prefix_test.go", "Prefix cache")
}

// checkREADMEBlock checks that the first ```go block of the README's
// "## section" is file's lines between README:begin and README:end, under
// the one kvpersist import the file may have (engine).
func checkREADMEBlock(t *testing.T, file, section string) {
	t.Helper()
	src, err := os.ReadFile(file)
	if err != nil {
		t.Fatal(err)
	}
	f, err := parser.ParseFile(token.NewFileSet(), file, src, parser.ImportsOnly)
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
		t.Fatalf("%s imports %v, want the engine package alone", file, ours)
	}
	_, rest, ok := bytes.Cut(src, []byte("// README:begin"))
	if !ok {
		t.Fatalf("%s has no README:begin marker", file)
	}
	_, rest, _ = bytes.Cut(rest, []byte("\n"))
	body, _, ok := bytes.Cut(rest, []byte("\t// README:end"))
	if !ok {
		t.Fatalf("%s has no README:end marker", file)
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
	_, sec, ok := strings.Cut(string(readme), "\n## "+section+"\n")
	if !ok {
		t.Fatalf("README.md has no %q section", "## "+section)
	}
	_, block, ok := strings.Cut(sec, "```go\n")
	if !ok {
		t.Fatalf("README.md's %s section has no ```go block", section)
	}
	block, _, _ = strings.Cut(block, "```\n")
	if block != want.String() {
		t.Errorf("README.md's %s sketch differs from %s; want exactly:\n%s", section, file, want.String())
	}
}
