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

// readmeExamples are the runnable (or compiled) examples whose lines
// between README:begin and README:end the README shows, by the README
// section ("## title") whose first ```go block shows them.
var readmeExamples = []struct{ file, section string }{
	{"example_prefix_test.go", "Prefix cache"},
	{"example_test.go", "Named snapshots"},
	{"example_metrics_test.go", "Metrics"},
	{"example_remote_test.go", "Object-store tier"},
	{"example_events_test.go", "KV events"},
}

// TestREADMECodeIsTheExamples: each README sketch is its example's lines,
// under the example file's non-standard imports, so every sketch compiles
// (and all but the object-store one run with their output checked).
func TestREADMECodeIsTheExamples(t *testing.T) {
	readme, err := os.ReadFile("../README.md")
	if err != nil {
		t.Fatal(err)
	}
	for _, ex := range readmeExamples {
		want := exampleSketch(t, ex.file)
		_, sec, ok := strings.Cut(string(readme), "\n## "+ex.section+"\n")
		if !ok {
			t.Errorf("README.md has no %q section", "## "+ex.section)
			continue
		}
		sec, _, _ = strings.Cut(sec, "\n## ")
		_, block, ok := strings.Cut(sec, "```go\n")
		if !ok {
			t.Errorf("README.md's %s section has no ```go block", ex.section)
			continue
		}
		block, _, _ = strings.Cut(block, "```\n")
		if block != want {
			t.Errorf("README.md's %s sketch differs from %s; want exactly:\n%s", ex.section, ex.file, want)
		}
	}
}

// TestREADMEGoBlocksAreChecked: no ```go block of README.md escapes
// TestREADMECodeIsTheExamples (a sketch nobody compiles goes stale). The
// other documents have none (TestNoGoBlocksOutsideREADME, in the
// repository's root).
func TestREADMEGoBlocksAreChecked(t *testing.T) {
	checked := map[string]bool{}
	for _, ex := range readmeExamples {
		checked[exampleSketch(t, ex.file)] = true
	}
	text, err := os.ReadFile("../README.md")
	if err != nil {
		t.Fatal(err)
	}
	rest := string(text)
	for {
		var block string
		var ok bool
		if _, rest, ok = strings.Cut(rest, "```go\n"); !ok {
			break
		}
		block, rest, _ = strings.Cut(rest, "```\n")
		if !checked[block] {
			t.Errorf("README.md has a ```go block that no example checks:\n%s", block)
		}
	}
}

// exampleSketch is file's lines between README:begin and README:end, one
// tab of indentation removed, under an import of the file's non-standard
// packages (the kvpersist ones and their dependencies, such as
// prometheus).
func exampleSketch(t *testing.T, file string) string {
	t.Helper()
	src, err := os.ReadFile(file)
	if err != nil {
		t.Fatal(err)
	}
	f, err := parser.ParseFile(token.NewFileSet(), file, src, parser.ImportsOnly)
	if err != nil {
		t.Fatal(err)
	}
	var imports []string
	for _, imp := range f.Imports {
		p, _ := strconv.Unquote(imp.Path.Value)
		if first, _, _ := strings.Cut(p, "/"); strings.Contains(first, ".") {
			imports = append(imports, p)
		}
	}
	if len(imports) == 0 || imports[0] != "github.com/kvpersist/kvpersist/engine" {
		t.Fatalf("%s imports %v, want package engine first", file, imports)
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
	if len(imports) == 1 {
		want.WriteString("import " + strconv.Quote(imports[0]) + "\n\n")
	} else {
		want.WriteString("import (\n")
		for _, p := range imports {
			want.WriteString("\t" + strconv.Quote(p) + "\n")
		}
		want.WriteString(")\n\n")
	}
	for _, line := range strings.SplitAfter(string(body), "\n") {
		want.WriteString(strings.TrimPrefix(line, "\t"))
	}
	return want.String()
}
