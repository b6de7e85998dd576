package main

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"sort"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/kvpersist/kvpersist/engine/jobs"
	"github.com/kvpersist/kvpersist/engine/layout"
	"github.com/kvpersist/kvpersist/engine/vfs"
	"github.com/kvpersist/kvpersist/internal/kvgen"
	"github.com/kvpersist/kvpersist/internal/testutil"
	"go.uber.org/goleak"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m, goleak.IgnoreCurrent())
}

// cliRun runs the CLI in-process (no terminal) and returns its exit code,
// stdout and stderr.
func cliRun(t *testing.T, args ...string) (int, string, string) {
	t.Helper()
	var out, errb bytes.Buffer
	code := run(context.Background(), args, &out, &errb, false)
	return code, out.String(), errb.String()
}

// mustRun runs the CLI and fails the test unless it exits with want.
func mustRun(t *testing.T, want int, args ...string) string {
	t.Helper()
	code, out, errs := cliRun(t, args...)
	if code != want {
		t.Fatalf("kvpersist %s: exit %d, want %d\nstdout:\n%s\nstderr:\n%s", strings.Join(args, " "), code, want, out, errs)
	}
	return out
}

// runJSON runs a command with --json and decodes its stdout into v.
func runJSON(t *testing.T, want int, v any, args ...string) {
	t.Helper()
	out := mustRun(t, want, append(args, "--json")...)
	if err := json.Unmarshal([]byte(out), v); err != nil {
		t.Fatalf("kvpersist %s --json: %v\n%s", strings.Join(args, " "), err, out)
	}
}

type snapSpec struct {
	ns, name string
	tokens   int
	layout   string
}

// testStore is the store every test starts from: namespace a holds four
// block manifests sharing blocks (t1 and t3 are the same 300 tokens, t2
// and t4 grow it), namespace b a single-file snapshot and a manifest.
var testStore = []snapSpec{
	{"a", "t1", 300, "blocks"}, {"a", "t2", 400, "blocks"}, {"a", "t3", 300, "blocks"}, {"a", "t4", 500, "blocks"},
	{"b", "s1", 300, "single"}, {"b", "m1", 200, "blocks"},
}

func synthStore(t *testing.T, specs []snapSpec) string {
	t.Helper()
	root := t.TempDir()
	for _, s := range specs {
		mustRun(t, exitOK, "synth", "--root", root, "--ns", s.ns, "--name", s.name, "--model", "tiny",
			"--tokens", strconv.Itoa(s.tokens), "--layout", s.layout, "--no-sync", "--block-bytes", "4096")
	}
	return root
}

// fileState is a file's size and SHA-256, to compare directory listings.
type fileState struct {
	size int64
	sum  string
}

// listing maps every regular file under root (relative path) to its state.
func listing(t *testing.T, root string) map[string]fileState {
	t.Helper()
	out := map[string]fileState{}
	err := filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
		if err != nil || !d.Type().IsRegular() {
			return err
		}
		b, err := os.ReadFile(p)
		if err != nil {
			return err
		}
		s := sha256.Sum256(b)
		rel, _ := filepath.Rel(root, p)
		out[rel] = fileState{int64(len(b)), hex.EncodeToString(s[:])}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return out
}

// blockUsers loads the named manifests of a namespace and maps each block
// hash to the manifests naming it.
func blockUsers(t *testing.T, nsDir string, names ...string) map[string][]string {
	t.Helper()
	users := map[string][]string{}
	for _, n := range names {
		snap, err := layout.Load(vfs.Default, filepath.Join(nsDir, n))
		if err != nil {
			t.Fatal(err)
		}
		for _, s := range snap.Header.Slots() {
			for _, b := range s.Blocks {
				if !slices.Contains(users[b.Hash], n) {
					users[b.Hash] = append(users[b.Hash], n)
				}
			}
		}
	}
	return users
}

func flipByte(t *testing.T, path string, off int64) {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	b[off] ^= 0x40
	if err := os.WriteFile(path, b, 0o640); err != nil {
		t.Fatal(err)
	}
}

type problemSet map[[2]string]string // {kind, path} -> detail

func problemsOf(t *testing.T, rep verifyReport) problemSet {
	t.Helper()
	ps := problemSet{}
	for _, p := range rep.Problems {
		k := [2]string{p.Kind, p.Path}
		if _, dup := ps[k]; dup {
			t.Errorf("problem reported twice: %s %s", p.Kind, p.Path)
		}
		ps[k] = p.Detail
	}
	return ps
}

func keys(ps problemSet) []string {
	var out []string
	for k := range ps {
		out = append(out, k[0]+" "+k[1])
	}
	sort.Strings(out)
	return out
}

func TestHelpPrintsExample(t *testing.T) {
	for _, name := range []string{"inspect", "ls", "verify", "gc", "du"} {
		code, out, errs := cliRun(t, name, "--help")
		if code != exitOK || errs != "" || !strings.Contains(out, "Examples:\n  kvpersist "+name) || !strings.Contains(out, "Usage:\n  kvpersist "+name) {
			t.Errorf("%s --help: exit %d, stdout:\n%s\nstderr:\n%s", name, code, out, errs)
		}
		if code, out2, errs := cliRun(t, "help", name); code != exitOK || errs != "" || out2 != out {
			t.Errorf("help %s: exit %d (stdout differs from --help's: %v), stderr:\n%s", name, code, out2 != out, errs)
		}
	}
	if _, out, _ := cliRun(t, "help"); !strings.Contains(out, "verify") || !strings.Contains(out, "inspect") {
		t.Errorf("help does not list the commands:\n%s", out)
	}
}

func TestUsageAndIOErrors(t *testing.T) {
	root := synthStore(t, testStore[:1])
	missing := filepath.Join(t.TempDir(), "nope")
	for _, args := range [][]string{
		{"verify", missing}, {"ls", missing}, {"du", missing}, {"inspect", missing}, {"gc", missing},
		{"verify"}, {"ls", root, root}, {"inspect"}, {"gc"}, {"du"},
		{"gc", filepath.Join(root, "a")}, {"ls", filepath.Join(root, "a")}, {"du", filepath.Join(root, "a")}, // a namespace, not a root
		{"verify", "--bogus", root},
	} {
		code, _, errs := cliRun(t, args...)
		if code != exitUsage {
			t.Errorf("%v: exit %d, want %d; stderr:\n%s", args, code, exitUsage, errs)
		}
	}
	if _, err := os.Lstat(missing); !os.IsNotExist(err) {
		t.Errorf("gc created the missing root %s (%v)", missing, err)
	}
	if _, errs := mustRunErr(t, "verify", missing); !strings.Contains(errs, missing) {
		t.Errorf("the error does not name the file: %s", errs)
	}
	if _, errs := mustRunErr(t, "gc", filepath.Join(root, "a")); !strings.Contains(errs, "is a namespace") {
		t.Errorf("gc on a namespace: %s", errs)
	}
}

func mustRunErr(t *testing.T, args ...string) (string, string) {
	t.Helper()
	_, out, errs := cliRun(t, args...)
	return out, errs
}

// distinctBlockFiles returns every block file under root's namespaces.
func distinctBlockFiles(t *testing.T, root string) (n int, bytes int64) {
	t.Helper()
	for rel, st := range listing(t, root) {
		if strings.Contains(rel, string(filepath.Separator)+layout.BlocksDirName+string(filepath.Separator)) {
			n++
			bytes += st.size
		}
	}
	return n, bytes
}

func TestVerifyCleanStore(t *testing.T) {
	root := synthStore(t, testStore)
	out := mustRun(t, exitOK, "verify", root)
	if !strings.Contains(out, "clean: no problems found") {
		t.Errorf("verify output:\n%s", out)
	}
	var rep verifyReport
	runJSON(t, exitOK, &rep, "verify", root)
	nBlocks, blockBytes := distinctBlockFiles(t, root)
	if nBlocks == 0 {
		t.Fatal("the store has no blocks")
	}
	// Every block file once, and the 5 tensors of the single file.
	tensorBytes := int64(kvgen.Tiny.CacheBytes(300))
	if !rep.Clean || len(rep.Problems) != 0 || rep.Checked.Namespaces != 2 || rep.Checked.Snapshots != len(testStore) ||
		rep.Checked.Blocks != nBlocks || rep.Checked.Tensors != 5 || rep.Checked.Bytes != blockBytes+tensorBytes {
		t.Errorf("report %+v; want clean, 2 namespaces, %d snapshots, %d blocks, 5 tensors, %d bytes",
			rep, len(testStore), nBlocks, blockBytes+tensorBytes)
	}
	// One snapshot: its blocks only.
	var one verifyReport
	runJSON(t, exitOK, &one, "verify", filepath.Join(root, "a", "t2"))
	users := blockUsers(t, filepath.Join(root, "a"), "t2")
	if one.Checked.Snapshots != 1 || one.Checked.Blocks != len(users) || !one.Clean {
		t.Errorf("verify a/t2: %+v, want 1 snapshot and %d blocks", one.Checked, len(users))
	}
}

// TestVerifyReportsExactlyTheDamage damages three blocks and one manifest's
// header and expects those four problems and nothing else: in particular no
// orphan blocks, since the unreadable manifest may name any unnamed block
// (jobs.Collect does not sweep that namespace either).
func TestVerifyReportsExactlyTheDamage(t *testing.T) {
	root := synthStore(t, testStore)
	nsDir := filepath.Join(root, "a")
	users := blockUsers(t, nsDir, "t1", "t2", "t3", "t4")
	// Blocks the corrupted manifest (t4) does not name: shared by t1 and t3
	// (to see one report per block, not per manifest), and t2's own.
	var shared, other []string
	onlyT4 := 0
	for h, us := range users {
		switch {
		case slices.Contains(us, "t4"):
			if len(us) == 1 {
				onlyT4++
			}
		case slices.Equal(us, []string{"t1", "t3"}):
			shared = append(shared, h)
		default:
			other = append(other, h)
		}
	}
	sort.Strings(shared)
	sort.Strings(other)
	if len(shared) < 2 || len(other) < 1 || onlyT4 == 0 {
		t.Fatalf("store shape: %d blocks of t1+t3 only, %d others not in t4, %d of t4 only", len(shared), len(other), onlyT4)
	}
	flipped, truncated, deleted := testutil.BlockPath(nsDir, shared[0]), testutil.BlockPath(nsDir, shared[1]), testutil.BlockPath(nsDir, other[0])
	flipByte(t, flipped, 100)
	st, err := os.Stat(truncated)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.Truncate(truncated, st.Size()-1); err != nil {
		t.Fatal(err)
	}
	if err := os.Remove(deleted); err != nil {
		t.Fatal(err)
	}
	// A JSON byte of t4's header: the digit of "tokens":500 (still valid JSON).
	manifest := filepath.Join(nsDir, "t4")
	b, err := os.ReadFile(manifest)
	if err != nil {
		t.Fatal(err)
	}
	i := bytes.Index(b, []byte(`"tokens":500`))
	if i < 0 {
		t.Fatal("no tokens key in t4")
	}
	b[i+len(`"tokens":`)] = '6'
	if err := os.WriteFile(manifest, b, 0o640); err != nil {
		t.Fatal(err)
	}

	var rep verifyReport
	runJSON(t, exitProblems, &rep, "verify", root)
	got := problemsOf(t, rep)
	want := []string{
		jobs.ProblemBlockSize + " " + truncated, jobs.ProblemCorruptBlock + " " + flipped,
		jobs.ProblemMissingBlock + " " + deleted, jobs.ProblemUnreadable + " " + manifest,
	}
	sort.Strings(want)
	if !slices.Equal(keys(got), want) {
		t.Fatalf("problems:\n  %s\nwant:\n  %s", strings.Join(keys(got), "\n  "), strings.Join(want, "\n  "))
	}
	if d := got[[2]string{jobs.ProblemCorruptBlock, flipped}]; !strings.Contains(d, "t1 slot") || !strings.Contains(d, "t3 slot") {
		t.Errorf("corrupt-block detail does not name both manifests: %s", d)
	}
	if d := got[[2]string{jobs.ProblemBlockSize, truncated}]; !strings.Contains(d, fmt.Sprintf("%d bytes, the manifest says %d", st.Size()-1, st.Size())) {
		t.Errorf("block-size detail: %s", d)
	}
	if d := got[[2]string{jobs.ProblemUnreadable, manifest}]; !strings.Contains(d, "header hash") {
		t.Errorf("unreadable detail: %s", d)
	}
	if len(rep.Notes) != 1 || !strings.Contains(rep.Notes[0], "orphan blocks not reported") || !strings.Contains(rep.Notes[0], "t4") {
		t.Errorf("notes: %q", rep.Notes)
	}
	// The text report lists the same four, and exits 1.
	out := mustRun(t, exitProblems, "verify", root)
	for _, p := range []string{flipped, truncated, deleted, manifest} {
		if !strings.Contains(out, p) {
			t.Errorf("text report misses %s:\n%s", p, out)
		}
	}
	// gc agrees: namespace a is not swept at all, t4's own blocks stay.
	before := listing(t, root)
	var g gcReport
	runJSON(t, exitProblems, &g, "gc", root)
	if !slices.Equal(g.UnsweptNamespaces, []string{nsDir}) || len(g.Unreadable) != 1 || len(g.Deleted) != 0 {
		t.Errorf("gc: unswept %q, unreadable %q, deleted %q", g.UnsweptNamespaces, g.Unreadable, g.Deleted)
	}
	if after := listing(t, root); len(after) != len(before) {
		t.Errorf("gc changed the store: %d files before, %d after", len(before), len(after))
	}
}

// TestVerifyCorruptSingleFileTensor: a corrupt tensor is found whether
// verify is given the root, the namespace (here one without blocks/, which
// is still a namespace: it holds a snapshot and a .lock) or the file.
func TestVerifyCorruptSingleFileTensor(t *testing.T) {
	root := synthStore(t, testStore[4:5])
	path := filepath.Join(root, "b", "s1")
	snap, err := layout.Load(vfs.Default, path)
	if err != nil {
		t.Fatal(err)
	}
	slot := snap.Header.Slots()[3]
	flipByte(t, path, int64(snap.DataStart)+slot.Off+slot.Bytes-1) // the slot's last byte
	for _, target := range []string{root, filepath.Join(root, "b"), path} {
		var rep verifyReport
		runJSON(t, exitProblems, &rep, "verify", target)
		if len(rep.Problems) != 1 {
			t.Fatalf("verify %s: problems %+v, want one", target, rep.Problems)
		}
		p := rep.Problems[0]
		if p.Kind != jobs.ProblemCorruptTensor || p.Path != path || !strings.HasPrefix(p.Detail, "cache 1 tensor 1 (slot 3): xxh3 ") ||
			!strings.Contains(p.Detail, "the header says "+slot.Hash) {
			t.Errorf("verify %s: %+v", target, p)
		}
		if rep.Checked.Tensors != 5 {
			t.Errorf("verify %s re-hashed %d tensors, want 5", target, rep.Checked.Tensors)
		}
	}
}

// TestOrphansTempsAndGC: orphans and stale temp files are what gc deletes;
// --dry-run deletes nothing and lists exactly what gc then deletes.
func TestOrphansTempsAndGC(t *testing.T) {
	root := synthStore(t, testStore)
	nsDir := filepath.Join(root, "a")
	if err := os.Remove(filepath.Join(nsDir, "t2")); err != nil {
		t.Fatal(err)
	}
	// The orphans, found independently: block files of a whose hash no
	// remaining manifest names.
	live := blockUsers(t, nsDir, "t1", "t3", "t4")
	var orphans []string
	var orphanBytes int64
	for rel, st := range listing(t, nsDir) {
		if h := filepath.Base(rel); layout.ValidBlockHash(h) && live[h] == nil {
			orphans = append(orphans, filepath.Join(nsDir, rel))
			orphanBytes += st.size
		}
	}
	if len(orphans) == 0 {
		t.Fatal("removing t2 left no orphan")
	}
	// A stale temp file, a young one, and an unrecognised file in blocks/.
	stale := layout.TempPath(filepath.Join(nsDir, "t5"))
	young := layout.TempPath(testutil.BlockPath(nsDir, strings.Repeat("ab", 32)))
	stray := filepath.Join(nsDir, "blocks", "README")
	for _, p := range []string{stale, young, stray} {
		if err := os.MkdirAll(filepath.Dir(p), 0o750); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, []byte("partial"), 0o640); err != nil {
			t.Fatal(err)
		}
	}
	old := time.Now().Add(-time.Hour)
	if err := os.Chtimes(stale, old, old); err != nil {
		t.Fatal(err)
	}

	var rep verifyReport
	runJSON(t, exitProblems, &rep, "verify", root)
	want := []string{jobs.ProblemStaleTemp + " " + stale}
	for _, o := range orphans {
		want = append(want, jobs.ProblemOrphanBlock+" "+o)
	}
	sort.Strings(want)
	if got := keys(problemsOf(t, rep)); !slices.Equal(got, want) {
		t.Fatalf("problems:\n  %s\nwant:\n  %s", strings.Join(got, "\n  "), strings.Join(want, "\n  "))
	}
	if !slices.Equal(rep.Skipped, []string{stray}) {
		t.Errorf("skipped %q, want %q", rep.Skipped, stray)
	}
	// --temp-grace 2h: the hour-old temp file is no longer stale.
	var rep2 verifyReport
	runJSON(t, exitProblems, &rep2, "verify", "--temp-grace", "2h", root)
	if len(rep2.Problems) != len(orphans) {
		t.Errorf("with --temp-grace 2h: %d problems, want %d orphans", len(rep2.Problems), len(orphans))
	}
	// --temp-grace none: the young temp file is stale too.
	var rep3 verifyReport
	runJSON(t, exitProblems, &rep3, "verify", "--temp-grace", "none", root)
	if got := keys(problemsOf(t, rep3)); !slices.Contains(got, jobs.ProblemStaleTemp+" "+young) || len(got) != len(want)+1 {
		t.Errorf("with --temp-grace none: problems %q, want those of the default and %s", got, young)
	}

	// du: what gc would free is the orphans' bytes.
	var du duReport
	runJSON(t, exitOK, &du, "du", root)
	if du.Namespaces[0].ReclaimableBytes != orphanBytes || du.Namespaces[0].TempFiles != 2 {
		t.Errorf("du a: reclaimable %d (want %d), temp files %d (want 2)", du.Namespaces[0].ReclaimableBytes, orphanBytes, du.Namespaces[0].TempFiles)
	}

	before := listing(t, root)
	var dry gcReport
	runJSON(t, exitOK, &dry, "gc", "--dry-run", root)
	if !maps(before, listing(t, root)) {
		t.Fatal("gc --dry-run changed the store")
	}
	wantDeleted := append(append([]string{}, orphans...), stale)
	sort.Strings(wantDeleted)
	if !slices.Equal(dry.Deleted, wantDeleted) || dry.BytesFreed != orphanBytes || dry.BlocksDeleted != int64(len(orphans)) ||
		dry.TempRemoved != 1 || !dry.DryRun {
		t.Errorf("gc --dry-run: deleted %q (%d blocks, %d bytes, %d temps), want %q (%d bytes)",
			dry.Deleted, dry.BlocksDeleted, dry.BytesFreed, dry.TempRemoved, wantDeleted, orphanBytes)
	}
	if !slices.Contains(dry.Skipped, stray) {
		t.Errorf("gc skipped %q, want %s among them", dry.Skipped, stray)
	}
	out := mustRun(t, exitOK, "gc", "--dry-run", root)
	if !strings.Contains(out, "would delete "+stale) || !strings.Contains(out, "dry run: nothing was deleted") {
		t.Errorf("gc --dry-run text:\n%s", out)
	}
	var none gcReport
	runJSON(t, exitOK, &none, "gc", "--dry-run", "--temp-grace", "none", root)
	if none.TempRemoved != 2 || !slices.Contains(none.Deleted, young) {
		t.Errorf("gc --dry-run --temp-grace none: %d temps, deleted %q, want both temp files", none.TempRemoved, none.Deleted)
	}

	var real gcReport
	runJSON(t, exitOK, &real, "gc", root)
	if !slices.Equal(real.Deleted, dry.Deleted) || real.BytesFreed != dry.BytesFreed {
		t.Errorf("gc deleted %q (%d bytes), the dry run listed %q (%d bytes)", real.Deleted, real.BytesFreed, dry.Deleted, dry.BytesFreed)
	}
	after := listing(t, root)
	for _, p := range real.Deleted {
		rel, _ := filepath.Rel(root, p)
		if _, ok := after[rel]; ok {
			t.Errorf("%s still exists", p)
		}
		delete(before, rel)
	}
	if !maps(before, after) {
		t.Errorf("gc touched files it did not list")
	}
	// Now clean (the young temp file is within its grace).
	mustRun(t, exitOK, "verify", root)
}

func maps(a, b map[string]fileState) bool {
	if len(a) != len(b) {
		return false
	}
	for k, v := range a {
		if b[k] != v {
			return false
		}
	}
	return true
}

func TestDuPhysicalIsBytesOnDisk(t *testing.T) {
	root := synthStore(t, testStore)
	var rep duReport
	runJSON(t, exitOK, &rep, "du", root)
	if len(rep.Namespaces) != 2 {
		t.Fatalf("namespaces %+v", rep.Namespaces)
	}
	var total int64
	for _, row := range rep.Namespaces {
		// Measured independently: every file of the namespace but .lock.
		var disk int64
		for rel, st := range listing(t, filepath.Join(root, row.Namespace)) {
			if rel != layout.LockName {
				disk += st.size
			}
		}
		var logical int64
		n := 0
		for _, s := range testStore {
			if s.ns == row.Namespace {
				logical += int64(kvgen.Tiny.CacheBytes(s.tokens))
				n++
			}
		}
		if row.PhysicalBytes != disk || row.LogicalBytes != logical || row.Snapshots != n ||
			row.DedupRatio != float64(logical)/float64(disk) || row.ReclaimableBytes != 0 {
			t.Errorf("du %s: %+v; want physical %d, logical %d, %d snapshots, dedup %.4f",
				row.Namespace, row, disk, logical, n, float64(logical)/float64(disk))
		}
		total += disk
	}
	if rep.Total.PhysicalBytes != total {
		t.Errorf("total physical %d, want %d", rep.Total.PhysicalBytes, total)
	}
	// Namespace a dedups (t3 repeats t1): its ratio is above 1.
	if rep.Namespaces[0].DedupRatio <= 1 {
		t.Errorf("namespace a dedup ratio %.2f, want > 1", rep.Namespaces[0].DedupRatio)
	}
	out := mustRun(t, exitOK, "du", "--bytes", root)
	if !strings.Contains(out, strconv.FormatInt(rep.Namespaces[0].PhysicalBytes, 10)) {
		t.Errorf("du --bytes does not print %d:\n%s", rep.Namespaces[0].PhysicalBytes, out)
	}
}

func TestLsListsEverySnapshot(t *testing.T) {
	root := synthStore(t, testStore)
	var rep lsReport
	runJSON(t, exitOK, &rep, "ls", root)
	if len(rep.Snapshots) != len(testStore) {
		t.Fatalf("ls: %d rows, want %d", len(rep.Snapshots), len(testStore))
	}
	byName := map[string]lsRow{}
	for _, r := range rep.Snapshots {
		byName[r.Namespace+"/"+r.Name] = r
	}
	for _, s := range testStore {
		r, ok := byName[s.ns+"/"+s.name]
		st, err := os.Stat(filepath.Join(root, s.ns, s.name))
		if err != nil {
			t.Fatal(err)
		}
		if !ok || r.LogicalBytes != int64(kvgen.Tiny.CacheBytes(s.tokens)) || r.Layout != s.layout || r.Tensors != 5 ||
			r.Error != nil || r.FileBytes != st.Size() || !r.Modified.Equal(st.ModTime()) {
			t.Errorf("ls %s/%s: %+v (found %v), want logical %d, layout %s", s.ns, s.name, r, ok, kvgen.Tiny.CacheBytes(s.tokens), s.layout)
		}
	}
	out := mustRun(t, exitOK, "ls", root)
	for _, s := range testStore {
		if !regexp.MustCompile(`(?m)^` + s.ns + `\s+` + s.name + `\s+` + s.layout + `\s+5\s`).MatchString(out) {
			t.Errorf("ls text misses %s/%s:\n%s", s.ns, s.name, out)
		}
	}
	// An unreadable file is listed with its error, and ls exits 1.
	flipByte(t, filepath.Join(root, "b", "m1"), layout.PrefixLen+3)
	rep = lsReport{}
	runJSON(t, exitProblems, &rep, "ls", root)
	if len(rep.Snapshots) != len(testStore) {
		t.Fatalf("ls: %d rows, want %d", len(rep.Snapshots), len(testStore))
	}
	for _, r := range rep.Snapshots {
		if bad := r.Namespace == "b" && r.Name == "m1"; bad != (r.Error != nil) || bad && !strings.Contains(*r.Error, "header hash mismatch") {
			t.Errorf("ls row %+v", r)
		}
	}
}

// inspectJSON mirrors inspect --json for decoding, independently of the
// command's own types.
type inspectJSON struct {
	Path, Magic, HeaderHash, ComputedHeaderHash, Layout, FailedCheck string
	HeaderLen, DataStart                                             uint32
	FileBytes, LogicalBytes                                          int64
	HeaderHashOK, Verified, Legacy                                   bool
	FormatVersion                                                    *int
	Meta                                                             map[string]json.RawMessage
	Header                                                           struct {
		FormatVersion       int
		Caches, Attachments []struct {
			Tensors []struct {
				Off, Bytes  int64
				Hash, DType string
				Shape       []int64
				Blocks      []struct {
					Hash  string
					Bytes int64
				}
			}
		}
	}
	Tensors []struct {
		Slot, Entry, Index int
		Group, DType, Hash string
		Shape              []int64
		Bytes              int64
		Off                *int64
		Blocks             *int
	}
}

var rowRE = regexp.MustCompile(`(?m)^(\d+)\s+(cache|attachment) (\d+)\s+(\d+)\s+(\S+)\s+\[([0-9 ]+)\]\s+(\d+)\s+(\d+)\s+(\S+)`)

func TestInspect(t *testing.T) {
	root := synthStore(t, testStore)
	m := kvgen.Tiny
	for _, tc := range []struct {
		path   string
		tokens int
	}{{filepath.Join(root, "b", "s1"), 300}, {filepath.Join(root, "a", "t2"), 400}} {
		snap, err := layout.Load(vfs.Default, tc.path)
		if err != nil {
			t.Fatal(err)
		}
		slots := snap.Header.Slots()
		single := snap.Layout == layout.Single
		kvShape := fmt.Sprint([]int64{1, int64(m.KVHeads), int64(tc.tokens), int64(m.HeadDim)})
		out := mustRun(t, exitOK, "inspect", tc.path)
		rows := rowRE.FindAllStringSubmatch(out, -1)
		if len(rows) != 5 {
			t.Fatalf("inspect %s: %d tensor rows, want 5:\n%s", tc.path, len(rows), out)
		}
		for i, r := range rows {
			wantDType, wantShape, wantBytes := "bfloat16", kvShape, m.TensorBytes(tc.tokens)
			wantEntry := fmt.Sprintf("cache %d %d", i/2, i%2)
			if i == 4 {
				wantDType, wantShape, wantBytes, wantEntry = "int32", fmt.Sprintf("[%d]", tc.tokens), tc.tokens*kvgen.IDSize, "attachment 0 0"
			}
			where := strconv.Itoa(len(slots[i].Blocks))
			hash := "-"
			if single {
				where, hash = strconv.FormatInt(slots[i].Off, 10), slots[i].Hash
			}
			got := fmt.Sprintf("%s %s %s %s %s [%s] %s %s %s", r[1], r[2], r[3], r[4], r[5], r[6], r[7], r[8], r[9])
			want := fmt.Sprintf("%d %s %s %s %d %s %s", i, wantEntry, wantDType, wantShape, wantBytes, where, hash)
			if got != want {
				t.Errorf("inspect %s row %d: %q, want %q", tc.path, i, got, want)
			}
		}
		for _, s := range []string{"magic        kvpersist", "header hash  " + fmt.Sprintf("%016x", snap.HeaderHash), "matches", `model="tiny" tokens=` + strconv.Itoa(tc.tokens)} {
			if !strings.Contains(out, s) {
				t.Errorf("inspect %s: output lacks %q:\n%s", tc.path, s, out)
			}
		}

		var js inspectJSON
		runJSON(t, exitOK, &js, "inspect", tc.path)
		if js.Magic != magicKV || js.Legacy || js.HeaderLen != snap.HeaderLen || js.DataStart != snap.DataStart ||
			js.HeaderHash != fmt.Sprintf("%016x", snap.HeaderHash) || !js.HeaderHashOK || !js.Verified ||
			js.FormatVersion == nil || *js.FormatVersion != snap.Header.FormatVersion || js.Layout != snap.Layout.String() ||
			js.FileBytes != snap.Size || js.LogicalBytes != int64(m.CacheBytes(tc.tokens)) || string(js.Meta["tokens"]) != strconv.Itoa(tc.tokens) {
			t.Errorf("inspect --json %s prefix: %+v", tc.path, js)
		}
		// The header parses back to the same values.
		var hs []struct {
			Off, Bytes  int64
			Hash, DType string
			Shape       []int64
			Blocks      []struct {
				Hash  string
				Bytes int64
			}
		}
		for _, e := range append(js.Header.Caches, js.Header.Attachments...) {
			hs = append(hs, e.Tensors...)
		}
		if js.Header.FormatVersion != snap.Header.FormatVersion || len(hs) != len(slots) || len(js.Tensors) != len(slots) {
			t.Fatalf("inspect --json %s: %d header tensors, %d rows, want %d", tc.path, len(hs), len(js.Tensors), len(slots))
		}
		for i, s := range slots {
			h, r := hs[i], js.Tensors[i]
			if h.Off != s.Off || h.Bytes != s.Bytes || h.Hash != s.Hash || h.DType != s.DType || !slices.Equal(h.Shape, s.Shape) || len(h.Blocks) != len(s.Blocks) {
				t.Errorf("header slot %d: %+v, want %+v", i, h, s)
			}
			for b := range s.Blocks {
				if h.Blocks[b].Hash != s.Blocks[b].Hash || h.Blocks[b].Bytes != s.Blocks[b].Bytes {
					t.Errorf("header slot %d block %d: %+v, want %+v", i, b, h.Blocks[b], s.Blocks[b])
				}
			}
			if r.Slot != i || r.DType != s.DType || r.Bytes != s.Bytes || !slices.Equal(r.Shape, s.Shape) || r.Hash != s.Hash ||
				(single && (r.Off == nil || *r.Off != s.Off || r.Blocks != nil)) || (!single && (r.Blocks == nil || *r.Blocks != len(s.Blocks) || r.Off != nil)) {
				t.Errorf("row %d: %+v, want %+v", i, r, s)
			}
		}
	}

	// A corrupted header: the prefix is still shown, the check named, exit 1.
	path := filepath.Join(root, "a", "t1")
	snap, err := layout.Load(vfs.Default, path)
	if err != nil {
		t.Fatal(err)
	}
	digit := layout.PrefixLen + int64(bytes.Index(snap.JSON, []byte(`"tokens":300`))+len(`"tokens":3`))
	flipByte(t, path, digit) // '0' ^ 0x40 = 'p': no longer JSON
	out := mustRun(t, exitProblems, "inspect", path)
	for _, s := range []string{`magic\s+kvpersist\n`, "MISMATCH", `CHECK FAILED\s+header hash`, `header JSON\s+not valid JSON`, `tokens\\":3p0`} {
		if !regexp.MustCompile(s).MatchString(out) {
			t.Errorf("inspect of a corrupt header lacks %q:\n%s", s, out)
		}
	}
	flipByte(t, path, digit)
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	b[digit] = '7' // "tokens":370: valid JSON, wrong hash
	if err := os.WriteFile(path, b, 0o640); err != nil {
		t.Fatal(err)
	}
	out = mustRun(t, exitProblems, "inspect", path)
	for _, s := range []string{`magic\s+kvpersist\n`, fmt.Sprintf("%016x stored", snap.HeaderHash), "MISMATCH", `CHECK FAILED\s+header hash`, "UNVERIFIED", "tokens=370", `offset=300 type="KVCache"`} {
		if !regexp.MustCompile(s).MatchString(out) {
			t.Errorf("inspect of a corrupt header lacks %q:\n%s", s, out)
		}
	}
	if len(rowRE.FindAllString(out, -1)) != 5 {
		t.Errorf("inspect of a corrupt header: want the 5 unverified rows:\n%s", out)
	}
	var js inspectJSON
	runJSON(t, exitProblems, &js, "inspect", path)
	if js.Verified || js.HeaderHashOK || js.FailedCheck != "header hash" || js.HeaderHash != fmt.Sprintf("%016x", snap.HeaderHash) ||
		js.ComputedHeaderHash == js.HeaderHash || js.HeaderLen != snap.HeaderLen || len(js.Tensors) != 5 {
		t.Errorf("inspect --json of a corrupt header: %+v", js)
	}

	// A file of the Bun worker.
	legacy := filepath.Join(testutil.BunFixtures, "single", "snapshot.mlxkv")
	js = inspectJSON{}
	runJSON(t, exitOK, &js, "inspect", legacy)
	if js.Magic != magicLegacy || !js.Legacy || !js.HeaderHashOK || js.FormatVersion != nil || js.Layout != "single" || len(js.Tensors) != 5 {
		t.Errorf("inspect --json %s: %+v", legacy, js)
	}
	if out := mustRun(t, exitOK, "inspect", legacy); !strings.Contains(out, "magic        Bun worker (legacy)") {
		t.Errorf("inspect %s:\n%s", legacy, out)
	}
}

// TestVerifyBunWorkerStore verifies a store written by the original worker:
// flat blocks/<sha>, legacy magic, Bun.hash tensor hashes.
func TestVerifyBunWorkerStore(t *testing.T) {
	root := t.TempDir()
	src := testutil.BunFixtures
	if err := os.CopyFS(filepath.Join(root, "legacy"), os.DirFS(filepath.Join(src, "blocks"))); err != nil {
		t.Fatal(err)
	}
	if err := os.CopyFS(filepath.Join(root, "single"), os.DirFS(filepath.Join(src, "single"))); err != nil {
		t.Fatal(err)
	}
	var rep verifyReport
	runJSON(t, exitOK, &rep, "verify", root)
	nBlocks, _ := distinctBlockFiles(t, root)
	if rep.Checked.Snapshots != 3 || rep.Checked.Blocks != nBlocks || rep.Checked.Tensors != 5 || nBlocks == 0 {
		t.Errorf("verify: %+v, want 3 snapshots, %d blocks, 5 tensors", rep.Checked, nBlocks)
	}
	nsDir := filepath.Join(root, "legacy")
	users := blockUsers(t, nsDir, "snapshot.mlxkv")
	var h string
	for k := range users {
		if h == "" || k < h {
			h = k
		}
	}
	block := testutil.LegacyBlockPath(nsDir, h)
	flipByte(t, block, 0)
	single := filepath.Join(root, "single", "snapshot.mlxkv")
	snap, err := layout.Load(vfs.Default, single)
	if err != nil {
		t.Fatal(err)
	}
	flipByte(t, single, int64(snap.DataStart)+snap.Header.Slots()[4].Off)
	rep = verifyReport{}
	runJSON(t, exitProblems, &rep, "verify", root)
	got := problemsOf(t, rep)
	want := []string{jobs.ProblemCorruptBlock + " " + block, jobs.ProblemCorruptTensor + " " + single}
	if !slices.Equal(keys(got), want) {
		t.Fatalf("problems %q, want %q", keys(got), want)
	}
	if d := got[[2]string{jobs.ProblemCorruptTensor, single}]; !strings.HasPrefix(d, "attachment 0 tensor 0 (slot 4): Bun.hash ") {
		t.Errorf("detail: %s", d)
	}
}

// TestVerifyProgressOnTerminal runs verify as if stderr were a terminal:
// the progress bar goes to stderr, the report to stdout is unchanged.
func TestVerifyProgressOnTerminal(t *testing.T) {
	root := synthStore(t, testStore[:2])
	_, plain, _ := cliRun(t, "verify", root)
	var out, errb bytes.Buffer
	if code := run(context.Background(), []string{"verify", root}, &out, &errb, true); code != exitOK {
		t.Fatalf("exit %d: %s", code, errb.String())
	}
	if out.String() != plain || !strings.Contains(errb.String(), "verify") {
		t.Errorf("stdout:\n%s\nwant:\n%s\nstderr: %q", out.String(), plain, errb.String())
	}
}

// writeManifest publishes a hand-made manifest of one uint8 tensor whose
// blocks are refs (valid: the counts sum to the tensor's bytes).
func writeManifest(t *testing.T, path string, meta layout.Meta, refs []layout.BlockRef) {
	t.Helper()
	var n int64
	for _, r := range refs {
		n += r.Bytes
	}
	h := &layout.Header{FormatVersion: layout.FormatBlocks, Meta: meta, Caches: []layout.Entry{{Tensors: []layout.Tensor{
		{Bytes: n, DType: "uint8", Shape: []int64{n}, Blocks: refs}}}}}
	js, err := h.Encode()
	if err != nil {
		t.Fatal(err)
	}
	if err := os.MkdirAll(filepath.Dir(path), 0o750); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(path, layout.EncodePrefix(js, uint32(layout.PrefixLen+len(js))), 0o640); err != nil {
		t.Fatal(err)
	}
}

// TestVerifyReportIsBoundedWhenManifestsDisagree: manifests that disagree
// on a block's size make one problem for that block, naming a bounded
// number of referrers, however many references there are.
func TestVerifyReportIsBoundedWhenManifestsDisagree(t *testing.T) {
	root := t.TempDir()
	nsDir := filepath.Join(root, "ns")
	data := bytes.Repeat([]byte("a"), 4096)
	sum := sha256.Sum256(data)
	h := hex.EncodeToString(sum[:])
	block := testutil.BlockPath(nsDir, h)
	if err := os.MkdirAll(filepath.Dir(block), 0o750); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(block, data, 0o640); err != nil {
		t.Fatal(err)
	}
	writeManifest(t, filepath.Join(nsDir, "a"), nil, []layout.BlockRef{{Hash: h, Bytes: 4096}})
	const refs = 2000
	many := make([]layout.BlockRef, refs)
	for i := range many {
		many[i] = layout.BlockRef{Hash: h, Bytes: 1}
	}
	writeManifest(t, filepath.Join(nsDir, "b"), nil, many)
	var rep verifyReport
	runJSON(t, exitProblems, &rep, "verify", root)
	ps := problemsOf(t, rep)
	if len(ps) != 1 {
		t.Fatalf("%d problems, want 1: %v", len(ps), keys(ps))
	}
	d, ok := ps[[2]string{jobs.ProblemBlockSize, block}]
	if !ok || len(d) > 400 || !strings.Contains(d, "4096 bytes (a slot 0 block 0) and 1 bytes (b slot 0 block 0)") {
		t.Errorf("detail (%d bytes): %.500s", len(d), d)
	}
}

// TestNamesReachTheTerminalQuoted: file names and metadata keys holding
// control characters are printed quoted by ls, verify, gc and inspect, so
// a crafted store cannot send escape sequences to the operator's terminal.
func TestNamesReachTheTerminalQuoted(t *testing.T) {
	root := synthStore(t, testStore[4:5])
	nsDir := filepath.Join(root, "b")
	evil := filepath.Join(nsDir, "evil\x1b[2Jname")
	if err := os.WriteFile(evil, []byte(layout.Magic+"torn"), 0o640); err != nil {
		t.Fatal(err)
	}
	junk := filepath.Join(nsDir, "junk\x07")
	if err := os.WriteFile(junk, []byte("hello"), 0o640); err != nil {
		t.Fatal(err)
	}
	withMeta := filepath.Join(root, "m", "snap")
	writeManifest(t, withMeta, layout.Meta{"key\x1b]0;title\x07": json.RawMessage(`"v"`)}, nil)
	for _, args := range [][]string{{"ls", root}, {"verify", root}, {"gc", "--dry-run", root}, {"inspect", withMeta}, {"inspect", evil}, {"du", root}} {
		_, out, errs := cliRun(t, args...)
		if strings.ContainsAny(out+errs, "\x1b\x07") {
			t.Errorf("%v printed a raw control character:\n%q", args[:1], out+errs)
		}
		if args[0] != "inspect" && args[0] != "du" && !strings.Contains(out, `evil\x1b[2Jname`) {
			t.Errorf("%v does not name the file, quoted:\n%s", args[:1], out)
		}
	}
	if out := mustRun(t, exitOK, "inspect", withMeta); !strings.Contains(out, `"key\x1b]0;title\a"="v"`) {
		t.Errorf("inspect does not show the key quoted:\n%s", out)
	}
}

// TestEveryCommandAcceptsASymlinkedRoot: the root may be a symlink, or sit
// below a symlinked directory (the operator's choice).
func TestEveryCommandAcceptsASymlinkedRoot(t *testing.T) {
	root := synthStore(t, testStore[:1])
	dir := t.TempDir()
	link := filepath.Join(dir, "link")
	if err := os.Symlink(root, link); err != nil {
		t.Fatal(err)
	}
	parentLink := filepath.Join(dir, "parent")
	if err := os.Symlink(filepath.Dir(root), parentLink); err != nil {
		t.Fatal(err)
	}
	for i, r := range []string{link, filepath.Join(parentLink, filepath.Base(root))} {
		for _, cmd := range []string{"ls", "du", "verify", "gc"} {
			out := mustRun(t, exitOK, cmd, r)
			if want := fmt.Sprintf("%d snapshots in %d namespaces", i+1, i+1); cmd == "ls" && i > 0 && !strings.Contains(out, want) {
				t.Errorf("ls %s:\n%s\nwant %q", r, out, want)
			}
		}
		mustRun(t, exitOK, "synth", "--root", r, "--ns", fmt.Sprint("c", i), "--name", "x", "--model", "tiny", "--tokens", "10", "--no-sync")
	}
	mustRun(t, exitOK, "synth", "--root", filepath.Join(parentLink, "new-root"), "--ns", "c", "--name", "x", "--model", "tiny", "--tokens", "10", "--no-sync")
	if _, err := os.Stat(filepath.Join(filepath.Dir(root), "new-root", "c", "x")); err != nil {
		t.Errorf("a new root below a symlinked parent: %v", err)
	}
}
