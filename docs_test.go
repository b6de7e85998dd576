// Package kvpersist_test keeps the repository's documents within their
// budgets: a newcomer reads README.md and ARCHITECTURE.md in one sitting,
// and every relative link in them and in docs/ leads somewhere.
package kvpersist_test

import (
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
)

// docBudgets are the size limits, in bytes, of the documents a newcomer
// reads first. Detail goes to docs/ (formats, operating, performance).
var docBudgets = map[string]int64{
	"README.md":       20_000,
	"ARCHITECTURE.md": 40_000,
}

func TestDocSizes(t *testing.T) {
	for name, limit := range docBudgets {
		fi, err := os.Stat(name)
		if err != nil {
			t.Fatal(err)
		}
		if fi.Size() > limit {
			t.Errorf("%s is %d bytes, over its budget of %d: move detail to docs/", name, fi.Size(), limit)
		}
	}
}

// mdLink is a Markdown link's target: [text](target).
var mdLink = regexp.MustCompile(`\]\(([^)\s]+)\)`)

// pendingDocs may be linked to before they exist: another change of the
// same series writes them.
var pendingDocs = map[string]bool{}

// docFiles are the documents: the top-level ones and every .md under docs/.
func docFiles(t *testing.T) []string {
	t.Helper()
	files := []string{"README.md", "ARCHITECTURE.md", "CHANGELOG.md"}
	err := filepath.WalkDir("docs", func(path string, d os.DirEntry, err error) error {
		if err == nil && !d.IsDir() && strings.HasSuffix(path, ".md") {
			files = append(files, path)
		}
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	return files
}

// TestNoGoBlocksOutsideREADME: Go code in the docs is README.md's alone,
// where engine's TestREADMECodeIsTheExamples compiles and runs every
// block; a sketch elsewhere would go stale unchecked.
func TestNoGoBlocksOutsideREADME(t *testing.T) {
	for _, f := range docFiles(t) {
		if f == "README.md" {
			continue
		}
		text, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		if strings.Contains(string(text), "```go\n") {
			t.Errorf("%s has a ```go block: show Go code in README.md, as a checked example", f)
		}
	}
}

func TestDocLinks(t *testing.T) {
	for _, f := range docFiles(t) {
		text, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		for _, m := range mdLink.FindAllStringSubmatch(string(text), -1) {
			target, _, _ := strings.Cut(m[1], "#")
			if target == "" || strings.Contains(target, "://") || strings.HasPrefix(target, "mailto:") {
				continue
			}
			path := filepath.Join(filepath.Dir(f), target)
			if _, err := os.Stat(path); err != nil && !pendingDocs[filepath.ToSlash(path)] {
				t.Errorf("%s links to %s, which does not exist", f, m[1])
			}
		}
	}
}

// TestShellBlocksParse: the set-up commands the docs give (```sh blocks;
// transcripts, "$ " blocks, are run by cmd/kvpersist's TestDocSamples)
// are valid bash, every `go run ./DIR` names a command of this module,
// and every `make TARGET` a target of the Makefile.
func TestShellBlocksParse(t *testing.T) {
	makefile, err := os.ReadFile("Makefile")
	if err != nil {
		t.Fatal(err)
	}
	goRun := regexp.MustCompile(`go run (\./[^\s)]+)`)
	makeTarget := regexp.MustCompile(`(?:^|\s)make ([a-z][a-z-]*)`)
	for _, f := range docFiles(t) {
		text, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		rest := string(text)
		for {
			var block string
			var ok bool
			if _, rest, ok = strings.Cut(rest, "```sh\n"); !ok {
				break
			}
			block, rest, _ = strings.Cut(rest, "```\n")
			cmd := exec.Command("bash", "-n")
			cmd.Stdin = strings.NewReader(block)
			if out, err := cmd.CombinedOutput(); err != nil {
				t.Errorf("%s: a ```sh block is not valid bash: %v\n%s\n%s", f, err, out, block)
			}
			for _, m := range goRun.FindAllStringSubmatch(block, -1) {
				if fi, err := os.Stat(filepath.Join(m[1], "main.go")); err != nil || !fi.Mode().IsRegular() {
					t.Errorf("%s: `go run %s`: no command there", f, m[1])
				}
			}
			for _, m := range makeTarget.FindAllStringSubmatch(block, -1) {
				if !regexp.MustCompile(`(?m)^` + regexp.QuoteMeta(m[1]) + `:`).Match(makefile) {
					t.Errorf("%s: `make %s`: no such target in the Makefile", f, m[1])
				}
			}
		}
	}
}
