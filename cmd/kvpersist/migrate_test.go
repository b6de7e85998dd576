package main

import (
	"bytes"
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/kvpersist/kvpersist/engine"
	"github.com/kvpersist/kvpersist/internal/testutil"
)

// The original Bun worker's files (see testdata/bun-worker/README.md).
const migFixtures = testutil.BunFixtures

// migLegacyStore lays the fixtures out as a store of the original worker:
// bun-single/snapshot.mlxkv (T=40) and bun-blocks/{snapshot.mlxkv (T=40),
// grown.mlxkv (T=48), blocks/<sha256>}.
func migLegacyStore(t *testing.T) string {
	t.Helper()
	return testutil.BunStore(t, migFixtures, filepath.Join(t.TempDir(), "legacy"))
}

// migWant is a fixture snapshot's content: expected.T40.bin cut at the
// README's offsets, or the README's formula at T = 48 (u16 LE
// l*4096 + kv*2048 + h*512 + t*8 + d for l0K, l0V, l1K, l1V; i32 LE
// 1000 + 7i for the tokens).
func migWant(t *testing.T, T int) [][]byte {
	t.Helper()
	if T == 40 {
		raw, err := os.ReadFile(filepath.Join(migFixtures, "expected.T40.bin"))
		if err != nil || len(raw) != 5280 {
			t.Fatalf("expected.T40.bin: %d bytes, %v", len(raw), err)
		}
		return [][]byte{raw[0:1280], raw[1280:2560], raw[2560:3840], raw[3840:5120], raw[5120:]}
	}
	return testutil.BunFormula(T)
}

var migRefs = []struct {
	ref engine.Ref
	T   int
}{
	{engine.Ref{Namespace: "bun-single", Name: "snapshot.mlxkv"}, 40},
	{engine.Ref{Namespace: "bun-blocks", Name: "snapshot.mlxkv"}, 40},
	{engine.Ref{Namespace: "bun-blocks", Name: "grown.mlxkv"}, 48},
}

// migCheckStore restores each of refs from the kvpersist store at root
// through an engine (Stat, verified read) and compares it with the
// fixture's bytes.
func migCheckStore(t *testing.T, root string, only ...string) {
	t.Helper()
	e, err := engine.New(engine.Config{Root: root, NoSync: true})
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close(context.Background())
	for _, r := range migRefs {
		if len(only) > 0 && !strings.Contains(strings.Join(only, " "), r.ref.String()) {
			continue
		}
		snap, err := e.Stat(r.ref)
		if err != nil {
			t.Fatalf("Stat %s: %v", r.ref, err)
		}
		if snap.Legacy {
			t.Fatalf("%s is still in the original's format", r.ref)
		}
		dest := make([][]byte, len(snap.Header.Slots()))
		for i, tn := range snap.Header.Slots() {
			dest[i] = make([]byte, tn.Bytes)
		}
		if res := e.Do(context.Background(), &engine.ReadRequest{Ref: r.ref, Dest: dest, Expect: snap.Header}); res.Err != nil {
			t.Fatalf("read %s: %v", r.ref, res.Err)
		}
		want := migWant(t, r.T)
		if len(dest) != len(want) {
			t.Fatalf("%s: %d slots", r.ref, len(dest))
		}
		for i := range want {
			if !bytes.Equal(dest[i], want[i]) {
				t.Fatalf("%s slot %d differs from the original's bytes", r.ref, i)
			}
		}
	}
}

func migSameTree(t *testing.T, what string, a, b map[string]string) {
	t.Helper()
	if len(a) != len(b) {
		t.Fatalf("%s: %d entries, then %d", what, len(a), len(b))
	}
	for p, h := range a {
		if b[p] != h {
			t.Fatalf("%s: %s changed", what, p)
		}
	}
}

// migCLI runs the CLI in-process; tty pretends stderr is a terminal.
func migCLI(t *testing.T, tty bool, args ...string) (int, string, string) {
	t.Helper()
	var out, errb bytes.Buffer
	code := run(context.Background(), args, &out, &errb, tty)
	return code, out.String(), errb.String()
}

func migContains(t *testing.T, what, s string, subs ...string) {
	t.Helper()
	for _, sub := range subs {
		if !strings.Contains(s, sub) {
			t.Fatalf("%s lacks %q:\n%s", what, sub, s)
		}
	}
}

func TestMigrateCommand(t *testing.T) {
	src := migLegacyStore(t)
	dst := filepath.Join(t.TempDir(), "kv")
	before := testutil.TreeDigest(t, src)
	code, out, errs := migCLI(t, false, "migrate", src, dst, "--no-sync")
	if code != exitOK || errs != "" {
		t.Fatalf("exit %d\nstdout:\n%s\nstderr:\n%s", code, out, errs)
	}
	migContains(t, "stdout", out,
		"3 legacy snapshot(s), 16.5 KiB of tensors",
		"migrated  bun-blocks/grown.mlxkv     blocks  6.2 KiB",
		"migrated  bun-blocks/snapshot.mlxkv  blocks  5.2 KiB  4.5 KiB written, 4.0 KiB reused",
		"migrated  bun-single/snapshot.mlxkv  single  5.2 KiB",
		"3 snapshot(s): 3 migrated, 0 skipped, 0 failed; 16.5 KiB of tensors migrated",
		"4.0 KiB reused (dedup); 0 other entries left alone")
	migCheckStore(t, dst)
	migSameTree(t, "source", before, testutil.TreeDigest(t, src))

	// A re-run skips everything and changes nothing.
	after := testutil.TreeDigest(t, dst)
	code, out, errs = migCLI(t, false, "migrate", "--no-sync", src, dst)
	if code != exitOK || errs != "" {
		t.Fatalf("re-run: exit %d\n%s\n%s", code, out, errs)
	}
	migContains(t, "re-run stdout", out, "skipped  bun-single/snapshot.mlxkv  single  5.2 KiB  already migrated",
		"3 snapshot(s): 0 migrated, 3 skipped, 0 failed; 0 B of tensors migrated, 0 B written")
	migSameTree(t, "destination after a re-run", after, testutil.TreeDigest(t, dst))
	migSameTree(t, "source", before, testutil.TreeDigest(t, src))
}

// A corrupt source snapshot is reported (exit 1) and the others migrate.
func TestMigrateCommandCorruptSource(t *testing.T) {
	src := migLegacyStore(t)
	grown := filepath.Join(src, "bun-blocks", "grown.mlxkv")
	b, err := os.ReadFile(grown)
	if err != nil {
		t.Fatal(err)
	}
	b[500] ^= 1 // inside the header JSON
	if err := os.WriteFile(grown, b, 0o644); err != nil {
		t.Fatal(err)
	}
	dst := filepath.Join(t.TempDir(), "kv")
	code, out, errs := migCLI(t, false, "migrate", "--no-sync", src, dst)
	if code != exitProblems {
		t.Fatalf("exit %d, want %d\n%s\n%s", code, exitProblems, out, errs)
	}
	migContains(t, "stderr", errs, "FAILED    bun-blocks/grown.mlxkv: layout: ", "header hash mismatch",
		"1 snapshot(s) failed")
	migContains(t, "stdout", out, "3 snapshot(s): 2 migrated, 0 skipped, 1 failed")
	migCheckStore(t, dst, "bun-single/snapshot.mlxkv", "bun-blocks/snapshot.mlxkv")
	if _, err := os.Lstat(filepath.Join(dst, "bun-blocks", "grown.mlxkv")); !os.IsNotExist(err) {
		t.Fatalf("corrupt snapshot published: %v", err)
	}
}

func TestMigrateCommandOptions(t *testing.T) {
	src := migLegacyStore(t)
	// --ns, --quiet, and a terminal (progress bar on stderr).
	dst := filepath.Join(t.TempDir(), "kv")
	code, out, errs := migCLI(t, true, "migrate", "--no-sync", "--quiet", "--ns", "bun-single", src, dst)
	if code != exitOK || strings.Contains(out, "migrated  ") {
		t.Fatalf("exit %d\nstdout:\n%s\nstderr:\n%s", code, out, errs)
	}
	migContains(t, "stdout", out, "1 legacy snapshot(s), 5.2 KiB of tensors", "1 snapshot(s): 1 migrated, 0 skipped, 0 failed")
	migCheckStore(t, dst, "bun-single/snapshot.mlxkv")
	if _, err := os.Lstat(filepath.Join(dst, "bun-blocks")); !os.IsNotExist(err) {
		t.Fatalf("--ns bun-single migrated bun-blocks: %v", err)
	}
	// --block-bytes re-cuts the manifests; the bytes stay the same.
	dst2 := filepath.Join(t.TempDir(), "kv")
	code, out, errs = migCLI(t, false, "migrate", "--no-sync", "--block-bytes", "4096", src, dst2)
	if code != exitOK {
		t.Fatalf("exit %d\n%s\n%s", code, out, errs)
	}
	migContains(t, "stdout", out, "re-cut (source blocks up to 256 B)")
	migCheckStore(t, dst2)
}

func TestMigrateCommandUsage(t *testing.T) {
	src := migLegacyStore(t)
	dir := t.TempDir()
	for _, args := range [][]string{
		{"migrate"},
		{"migrate", src},
		{"migrate", src, src},
		{"migrate", src, filepath.Join(src, "kv")},
		{"migrate", filepath.Join(dir, "missing"), filepath.Join(dir, "kv")},
		{"migrate", "--block-bytes", "256", src, filepath.Join(dir, "kv")},
		{"migrate", "--ns", "../x", src, filepath.Join(dir, "kv")},
		{"migrate", "--bogus", src, filepath.Join(dir, "kv")},
	} {
		if code, out, errs := migCLI(t, false, args...); code != exitUsage || errs == "" {
			t.Errorf("%v: exit %d, want %d\n%s\n%s", args, code, exitUsage, out, errs)
		}
	}
	if code, out, _ := migCLI(t, false, "migrate", "--help"); code != exitOK || !strings.Contains(out, "kvpersist migrate /var/lib/mlx-kv /var/lib/kvpersist") {
		t.Fatalf("--help: exit %d\n%s", code, out)
	}
	if _, err := os.Lstat(filepath.Join(src, "kv")); !os.IsNotExist(err) {
		t.Fatalf("a refused migration created its destination: %v", err)
	}
}
