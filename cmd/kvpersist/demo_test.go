package main

import (
	"crypto/sha256"
	"encoding/hex"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/kvpersist/kvpersist/engine/layout"
)

// demoArgs runs a small, quick demo (tiny model, two turns, 4 KiB blocks).
var demoArgs = []string{"demo", "snapshots", "--model", "tiny", "--tokens", "300,600", "--block-bytes", "4096", "--no-sync"}

// The demo pointed at an operator's store (--root) writes, deletes and
// collects only in a namespace of its own: the user's snapshots, even ones
// named like the demo's turns (conversation/turn-01), and an unreferenced
// block in another namespace are left byte for byte as they were. A second
// run refuses the now existing namespace unless --reuse-ns is given.
func TestDemoTouchesOnlyItsNamespace(t *testing.T) {
	root := synthStore(t, []snapSpec{
		{"conversation", "turn-01", 300, "blocks"}, {"conversation", "turn-02", 400, "blocks"},
		{"other", "s1", 300, "single"},
	})
	// An unreferenced block: a collect of the whole root would delete it.
	orphan := []byte("a block no manifest names")
	sum := sha256.Sum256(orphan)
	h := hex.EncodeToString(sum[:])
	orphanPath := filepath.Join(root, "other", "blocks", h[:2], h)
	if err := os.MkdirAll(filepath.Dir(orphanPath), 0o750); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(orphanPath, orphan, 0o640); err != nil {
		t.Fatal(err)
	}
	before := listing(t, root)

	out := mustRun(t, exitOK, append(demoArgs, "--root", root)...)
	if !strings.Contains(out, "namespace "+defaultDemoNamespace) {
		t.Errorf("demo output does not name its namespace %s:\n%s", defaultDemoNamespace, out)
	}
	after := listing(t, root)
	for p, st := range before {
		if got, ok := after[p]; !ok || got != st {
			t.Errorf("%s: the demo changed or removed it (before %+v, after %+v, present %v)", p, st, got, ok)
		}
	}
	for p := range after {
		if _, ok := before[p]; !ok && strings.Split(p, string(filepath.Separator))[0] != defaultDemoNamespace {
			t.Errorf("%s: the demo wrote outside its namespace", p)
		}
	}
	if _, ok := after[filepath.Join(defaultDemoNamespace, "turn-02")]; !ok {
		t.Errorf("the demo's last turn is not in %s", defaultDemoNamespace)
	}

	// Again on the same store: its namespace exists now.
	code, out, errs := cliRun(t, append(demoArgs, "--root", root)...)
	if code != exitUsage || !strings.Contains(errs, "namespace "+defaultDemoNamespace+" already exists") || !strings.Contains(errs, "--reuse-ns") {
		t.Fatalf("second run: exit %d, want %d naming the namespace and --reuse-ns\nstdout:\n%s\nstderr:\n%s", code, exitUsage, out, errs)
	}
	if again := listing(t, root); !maps(again, after) {
		t.Fatalf("a refused demo changed the store")
	}
	// A user's namespace is refused as well, and taken only when asked.
	if code, _, errs := cliRun(t, append(demoArgs, "--root", root, "--ns", "conversation")...); code != exitUsage || !strings.Contains(errs, "namespace conversation already exists") {
		t.Fatalf("--ns conversation: exit %d, want %d\n%s", code, exitUsage, errs)
	}
	mustRun(t, exitOK, append(demoArgs, "--root", root, "--reuse-ns")...)
	final := listing(t, root)
	for p, st := range before {
		if got, ok := final[p]; !ok || got != st {
			t.Errorf("%s: the demo run with --reuse-ns changed or removed it", p)
		}
	}
}

// servingArgs runs a small serving demo on the prefix cache.
var servingArgs = []string{"demo", "--model", "tiny", "--conversations", "3", "--system-tokens", "40",
	"--turns", "2", "--turn-tokens", "20", "--page-tokens", "16", "--no-sync", "--bytes"}

// `demo` is the serving scenario (internal/demo): it exits 0 when every
// loaded byte matched, prints one row per turn, writes only in its own
// namespace of a given root (page files under it), and refuses that
// namespace once it exists.
func TestDemoServesFromThePrefixCache(t *testing.T) {
	root := t.TempDir()
	out := mustRun(t, exitOK, append(servingArgs, "--root", root)...)
	if !strings.Contains(out, "every loaded byte matched what was saved") {
		t.Fatalf("demo output lacks its verdict:\n%s", out)
	}
	// 3 conversations x 2 turns: six rows whose first two fields are conv and turn.
	rows := 0
	for _, line := range strings.Split(out, "\n") {
		f := strings.Fields(line)
		if len(f) == 10 && f[0] >= "1" && f[0] <= "3" && (f[1] == "1" || f[1] == "2") {
			rows++
		}
	}
	if rows != 6 {
		t.Errorf("%d turn rows, want 6:\n%s", rows, out)
	}
	entries, err := os.ReadDir(root)
	// The namespace, and the page log the engines on a root share.
	entries = slices.DeleteFunc(entries, func(e os.DirEntry) bool { return e.Name() == layout.PageLogName && e.Type().IsRegular() })
	if err != nil || len(entries) != 1 || entries[0].Name() != defaultDemoNamespace {
		t.Fatalf("root holds %v (%v), want only %s and %s", entries, err, defaultDemoNamespace, layout.PageLogName)
	}
	pages, _ := filepath.Glob(filepath.Join(root, defaultDemoNamespace, "pages", "*", "*"))
	if len(pages) == 0 {
		t.Fatalf("no page files under %s", root)
	}
	code, _, errs := cliRun(t, append(servingArgs, "--root", root)...)
	if code != exitUsage || !strings.Contains(errs, "namespace "+defaultDemoNamespace) {
		t.Fatalf("second run: exit %d, want %d naming the namespace:\n%s", code, exitUsage, errs)
	}
}
