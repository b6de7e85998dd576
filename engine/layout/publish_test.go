package layout_test

import (
	"errors"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/kvpersist/kvpersist/engine/layout"
	"github.com/kvpersist/kvpersist/engine/vfs"
)

func dirNames(t *testing.T, dir string) []string {
	t.Helper()
	ents, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, e := range ents {
		out = append(out, e.Name())
	}
	return out
}

func TestPublishSuccessLeavesOnlyTarget(t *testing.T) {
	dir := t.TempDir()
	target := filepath.Join(dir, "snap")
	for round, content := range []string{"first version", "second, longer version"} {
		err := layout.Publish(vfs.Default, target, layout.PublishOptions{Sync: true, SyncDir: true, Size: int64(len(content))},
			func(f vfs.File) error { return layout.WriteFull(f, []byte(content), 0) })
		if err != nil {
			t.Fatalf("round %d: %v", round, err)
		}
		got, err := os.ReadFile(target)
		if err != nil || string(got) != content {
			t.Fatalf("round %d: target holds %q, %v", round, got, err)
		}
		if names := dirNames(t, dir); !slices.Equal(names, []string{"snap"}) {
			t.Fatalf("round %d: directory holds %v", round, names)
		}
		st, _ := os.Stat(target)
		if st.Mode().Perm() != layout.FilePerm {
			t.Fatalf("mode %v, want %v", st.Mode().Perm(), layout.FilePerm)
		}
	}
}

func TestPublishWriteErrorKeepsOldTarget(t *testing.T) {
	dir := t.TempDir()
	target := filepath.Join(dir, "snap")
	if err := os.WriteFile(target, []byte("old content"), 0o600); err != nil {
		t.Fatal(err)
	}
	boom := errors.New("boom")
	var tmpSeen string
	err := layout.Publish(vfs.Default, target, layout.PublishOptions{Sync: true, SyncDir: true, Size: 1 << 16},
		func(f vfs.File) error {
			tmpSeen = f.Name()
			if err := layout.WriteFull(f, []byte("half-written new content"), 0); err != nil {
				return err
			}
			return boom
		})
	if !errors.Is(err, boom) {
		t.Fatalf("Publish error %v, want the callback's", err)
	}
	if filepath.Dir(tmpSeen) != dir || !layout.IsTemp(filepath.Base(tmpSeen)) {
		t.Fatalf("temp file %q is not a temp file beside the target", tmpSeen)
	}
	if _, err := os.Lstat(tmpSeen); !os.IsNotExist(err) {
		t.Fatalf("temp file %s left behind: %v", tmpSeen, err)
	}
	got, _ := os.ReadFile(target)
	if string(got) != "old content" {
		t.Fatalf("target now holds %q", got)
	}
	if names := dirNames(t, dir); !slices.Equal(names, []string{"snap"}) {
		t.Fatalf("directory holds %v", names)
	}
}

func TestTempPathUniqueAndRecognised(t *testing.T) {
	target := filepath.Join("/store", "ns", "snapshot-1")
	seen := map[string]bool{}
	for range 2000 {
		p := layout.TempPath(target)
		if seen[p] {
			t.Fatalf("TempPath repeated %s", p)
		}
		seen[p] = true
		base := filepath.Base(p)
		if filepath.Dir(p) != filepath.Dir(target) || !strings.HasPrefix(base, ".snapshot-1.tmp-") {
			t.Fatalf("TempPath %s not beside the target", p)
		}
		if !layout.IsTemp(base) {
			t.Fatalf("IsTemp(%q) = false", base)
		}
		if layout.ValidName("snapshot", base) == nil {
			t.Fatalf("temp name %q is a valid snapshot name", base)
		}
	}
	for _, name := range []string{
		"snapshot-1", ".lock", "blocks", "x.tmp-0123456789abcdef", ".x.tmp-0123456789abcde", ".x.tmp-0123456789abcdef0",
		".tmp-0123456789abcdef", ".x.tmp-0123456789abcdeg", ".x.tmp-0123456789ABCDEF", ".x.tmp-../../../../etc/",
	} {
		if layout.IsTemp(name) {
			t.Errorf("IsTemp(%q) = true", name)
		}
	}
	if !layout.IsTemp(".x.tmp-0123456789abcdef") {
		t.Error("IsTemp rejects a well-formed temp name")
	}
}

func TestValidName(t *testing.T) {
	bad := []string{"", ".x", "..", "../x", "a/b", "blocks", strings.Repeat("a", 201), "-x", "a b", "a\x00", "é", ".lock"}
	for _, s := range bad {
		err := layout.ValidName("snapshot", s)
		if !errors.Is(err, layout.ErrBadName) {
			t.Errorf("ValidName(%q) = %v, want ErrBadName", s, err)
		}
	}
	good := []string{"a", "snapshot.mlxkv", "conv_1-2.v3", strings.Repeat("a", 200), "_x", "blocks2", "0"}
	for _, s := range good {
		if err := layout.ValidName("snapshot", s); err != nil {
			t.Errorf("ValidName(%q) = %v", s, err)
		}
	}
}
