package main

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
)

// sampleDocs are the documents whose transcripts TestDocSamples checks
// (and, with KVPERSIST_UPDATE_DOCS=1, regenerates:
// scripts/doc-samples.sh): a section ("## title") of a file, or the whole
// file when section is empty. Each runs on a fresh store of its own.
var sampleDocs = []struct{ path, section string }{
	{"../../README.md", "Command line"},
	{"../../docs/operating.md", ""},
}

// Output that varies from run to run, replaced by fixed text before the
// comparison: the elapsed time gc and the demo print, and the modification
// time ls prints. docs/operating.md says so.
var (
	sampleElapsed  = regexp.MustCompile(` in [0-9.]+(ns|µs|ms|s)$`)
	sampleModified = regexp.MustCompile(`\d{4}-\d{2}-\d{2} \d{2}:\d{2}:\d{2}`)
)

const (
	sampleElapsedText  = " in 5ms"
	sampleModifiedText = "2026-12-01 12:00:00"
)

// TestDocSamples runs every transcript of each sample document (a ```
// block whose first line starts with "$ ") on a fresh store, in order,
// with the kvpersist binary built from this tree on PATH, and checks that
// each command's output (stdout and stderr) is what the document shows.
// /tmp/kvstore in a command is a temp directory; it is printed back as
// /tmp/kvstore. testdata/ is the repository's testdata directory. "$ echo
// $?" sees the previous command's exit status. Between a command that
// printed something and the next, a transcript has one blank line.
func TestDocSamples(t *testing.T) {
	bin := buildCLI(t)
	testdata, err := filepath.Abs("../../testdata")
	if err != nil {
		t.Fatal(err)
	}
	for _, doc := range sampleDocs {
		t.Run(filepath.Base(doc.path), func(t *testing.T) {
			checkDocSamples(t, bin, testdata, doc.path, doc.section)
		})
	}
}

func checkDocSamples(t *testing.T, bin, testdata, path, section string) {
	raw, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	text := string(raw)
	start, end := 0, len(text)
	if section != "" {
		heading := "\n## " + section + "\n"
		start = strings.Index(text, heading)
		if start < 0 {
			t.Fatalf("%s has no %q section", path, strings.TrimSpace(heading))
		}
		if e := strings.Index(text[start+len(heading):], "\n## "); e >= 0 {
			end = e + start + len(heading)
		}
	}
	work := t.TempDir()
	if err := os.Symlink(testdata, filepath.Join(work, "testdata")); err != nil {
		t.Fatal(err)
	}
	root := filepath.Join(work, "kvstore")
	env := append(os.Environ(), "PATH="+filepath.Dir(bin)+string(os.PathListSeparator)+os.Getenv("PATH"), "TZ=UTC")
	status, transcripts := 0, 0
	runOne := func(command string) string {
		cmd := exec.Command("bash", "-c", fmt.Sprintf("(exit %d); %s", status, strings.ReplaceAll(command, "/tmp/kvstore", root)))
		cmd.Dir, cmd.Env = work, env
		out, err := cmd.CombinedOutput()
		status = 0
		var ee *exec.ExitError
		if errors.As(err, &ee) {
			status = ee.ExitCode()
		} else if err != nil {
			t.Fatalf("%s: %v", command, err)
		}
		lines := strings.SplitAfter(strings.ReplaceAll(string(out), root, "/tmp/kvstore"), "\n")
		for i, l := range lines {
			body, nl := strings.CutSuffix(l, "\n")
			body = sampleElapsed.ReplaceAllString(body, sampleElapsedText)
			body = sampleModified.ReplaceAllString(body, sampleModifiedText)
			if nl {
				body += "\n"
			}
			lines[i] = body
		}
		return strings.Join(lines, "")
	}

	var got strings.Builder
	lines := strings.SplitAfter(text[start:end], "\n")
	for i := 0; i < len(lines); {
		if lines[i] != "```\n" || i+1 >= len(lines) || !strings.HasPrefix(lines[i+1], "$ ") {
			got.WriteString(lines[i])
			i++
			continue
		}
		transcripts++
		got.WriteString(lines[i])
		var commands []string
		for i++; i < len(lines) && lines[i] != "```\n"; i++ {
			if c, ok := strings.CutPrefix(lines[i], "$ "); ok {
				commands = append(commands, strings.TrimSuffix(c, "\n"))
			}
		}
		printed := false
		for _, c := range commands {
			if printed {
				got.WriteString("\n")
			}
			out := runOne(c)
			got.WriteString("$ " + c + "\n" + out)
			printed = out != ""
		}
		got.WriteString("```\n")
		i++
	}
	if transcripts == 0 {
		t.Fatalf("%s has no transcript", path)
	}
	want := text[start:end]
	if got.String() == want {
		return
	}
	if os.Getenv("KVPERSIST_UPDATE_DOCS") != "" {
		if err := os.WriteFile(path, []byte(text[:start]+got.String()+text[end:]), 0o644); err != nil {
			t.Fatal(err)
		}
		t.Logf("%s regenerated (%d transcripts)", path, transcripts)
		return
	}
	g, w := strings.Split(got.String(), "\n"), strings.Split(want, "\n")
	for k := 0; k < max(len(g), len(w)); k++ {
		var gl, wl string
		if k < len(g) {
			gl = g[k]
		}
		if k < len(w) {
			wl = w[k]
		}
		if gl != wl {
			t.Fatalf("%s is stale (run scripts/doc-samples.sh); first difference at line %d of the checked part:\ndoc:     %q\nprinted: %q",
				path, k+1, wl, gl)
		}
	}
}
