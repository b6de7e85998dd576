package main

import (
	"bytes"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"syscall"
	"testing"
)

// diskPage is a page file as the test reads it from disk, without the
// library: its name, size, and the parent and token ids found in its raw
// header JSON.
type diskPage struct {
	key, path, parent string
	size              int64
	tokens            []uint32
}

var (
	rawParent = regexp.MustCompile(`"parent":"([0-9a-f]{64})"`)
	rawTokens = regexp.MustCompile(`"tokens":\[([0-9,]*)\]`)
)

// pageStore runs the serving demo into a fresh root (tiny model, 16-token
// pages) and returns the root and its namespace's page files read from disk.
func pageStore(t *testing.T, conversations int) (string, map[string]diskPage) {
	t.Helper()
	root := t.TempDir()
	mustRun(t, exitOK, "demo", "--model", "tiny", "--conversations", strconv.Itoa(conversations), "--system-tokens", "40",
		"--turns", "2", "--turn-tokens", "20", "--page-tokens", "16", "--no-sync", "--root", root)
	pages := map[string]diskPage{}
	dir := filepath.Join(root, defaultDemoNamespace, "pages")
	err := filepath.WalkDir(dir, func(path string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() {
			return err
		}
		b, err := os.ReadFile(path)
		if err != nil {
			return err
		}
		head := b[:min(len(b), 16384)]
		pm, tm := rawParent.FindSubmatch(head), rawTokens.FindSubmatch(head)
		if pm == nil || tm == nil {
			return fmt.Errorf("%s: no parent or tokens in its header", path)
		}
		p := diskPage{key: d.Name(), path: path, parent: string(pm[1]), size: int64(len(b))}
		for _, s := range bytes.Split(tm[1], []byte(",")) {
			v, err := strconv.ParseUint(string(s), 10, 32)
			if err != nil {
				return err
			}
			p.tokens = append(p.tokens, uint32(v))
		}
		pages[p.key] = p
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if len(pages) == 0 {
		t.Fatalf("no page files under %s", dir)
	}
	return root, pages
}

// sharedByBranches is du's shared rule computed another way: a page is
// shared when two distinct pages descending from it (strictly) have the
// same parent and token ids that diverge (neither a prefix of the other).
func sharedByBranches(pages map[string]diskPage) (n int, size int64) {
	descends := func(a, p string) bool { // a strictly below p
		for cur, ok := pages[a]; ok; cur, ok = pages[cur.parent] {
			if cur.parent == p {
				return true
			}
		}
		return false
	}
	prefix := func(a, b []uint32) bool {
		return len(a) <= len(b) && slicesEqual(a, b[:len(a)])
	}
	for pk, p := range pages {
		shared := false
		for ak, a := range pages {
			for bk, b := range pages {
				if ak < bk && a.parent == b.parent && descends(ak, pk) && descends(bk, pk) &&
					!prefix(a.tokens, b.tokens) && !prefix(b.tokens, a.tokens) {
					shared = true
				}
			}
		}
		if shared {
			n++
			size += p.size
		}
	}
	return n, size
}

func slicesEqual(a, b []uint32) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}

func TestPageStoreLsDuVerify(t *testing.T) {
	for _, conv := range []int{1, 2} {
		t.Run(fmt.Sprintf("%d-conversations", conv), func(t *testing.T) {
			root, pages := pageStore(t, conv)
			var files, tokens int64
			partial := 0
			for _, p := range pages {
				files += p.size
				tokens += int64(len(p.tokens))
				if len(p.tokens) < 16 {
					partial++
				}
			}
			if partial == 0 {
				t.Fatalf("no partial page: the test would not exercise an extended last page")
			}
			wantShared, wantSharedBytes := sharedByBranches(pages)
			if conv == 1 && wantShared != 0 {
				t.Fatalf("one conversation: %d shared pages by the independent rule", wantShared)
			}
			if conv == 2 && (wantShared == 0 || wantShared == len(pages)) {
				t.Fatalf("two conversations sharing a system prompt: %d of %d pages shared", wantShared, len(pages))
			}

			var du duReport
			runJSON(t, exitOK, &du, "du", root)
			r := du.Total
			if r.Pages != len(pages) || r.PageFileBytes != files || r.PhysicalBytes != files ||
				r.SharedPages != wantShared || r.SharedPageBytes != wantSharedBytes {
				t.Errorf("du: pages %d, %d bytes, physical %d, shared %d pages %d bytes; on disk: %d pages, %d bytes, shared %d pages %d bytes",
					r.Pages, r.PageFileBytes, r.PhysicalBytes, r.SharedPages, r.SharedPageBytes, len(pages), files, wantShared, wantSharedBytes)
			}
			out := mustRun(t, exitOK, "du", "--bytes", root)
			total := ""
			for _, line := range strings.Split(out, "\n") {
				if f := strings.Fields(line); len(f) > 4 && f[0] == "TOTAL" {
					total = strings.Join(f[len(f)-4:], " ")
				}
			}
			var alloc int64
			for _, p := range pages {
				var st syscall.Stat_t
				if err := syscall.Stat(p.path, &st); err != nil {
					t.Fatal(err)
				}
				alloc += st.Blocks * 512
			}
			if want := fmt.Sprintf("%d %d %d %d", len(pages), files, alloc, wantSharedBytes); !strings.Contains(out, "PAGE BYTES") || total != want {
				t.Errorf("du --bytes: TOTAL ends %q, want %q (pages, bytes, allocated bytes, shared):\n%s", total, want, out)
			}

			var ls lsReport
			runJSON(t, exitOK, &ls, "ls", "--pages", root)
			if len(ls.Pages) != 1 {
				t.Fatalf("ls: %d page cache rows, want 1", len(ls.Pages))
			}
			lp := ls.Pages[0]
			if lp.Pages != len(pages) || lp.FileBytes != files || lp.Tokens != tokens || len(lp.Files) != len(pages) {
				t.Errorf("ls: %d pages, %d bytes, %d tokens, %d files; on disk %d pages, %d bytes, %d tokens", lp.Pages, lp.FileBytes, lp.Tokens, len(lp.Files), len(pages), files, tokens)
			}
			for _, f := range lp.Files {
				p, ok := pages[f.Key]
				if !ok {
					t.Errorf("ls lists page %s, not on disk", f.Key)
					continue
				}
				_, parentStored := pages[p.parent]
				wantParent := p.parent
				if f.Parent == "" && !parentStored {
					wantParent = "" // a first page: its parent is the root key
				}
				if f.Parent != wantParent || f.FileBytes != p.size || f.Tokens != len(p.tokens) || f.Path != p.path {
					t.Errorf("ls page %s: parent %q, %d bytes, %d tokens, path %s; on disk parent %s, %d bytes, %d tokens, %s",
						f.Key, f.Parent, f.FileBytes, f.Tokens, f.Path, p.parent, p.size, len(p.tokens), p.path)
				}
			}
			text := mustRun(t, exitOK, "ls", root)
			want := fmt.Sprintf("%s: %d pages (prefix page cache), %d tokens", defaultDemoNamespace, len(pages), tokens)
			if !strings.Contains(text, want) {
				t.Errorf("ls lacks %q:\n%s", want, text)
			}

			out = mustRun(t, exitOK, "verify", root)
			if want := fmt.Sprintf("and %d pages re-hashed", len(pages)); !strings.Contains(out, want) {
				t.Errorf("verify lacks %q:\n%s", want, out)
			}
		})
	}
}

func TestInspectPageFile(t *testing.T) {
	_, pages := pageStore(t, 2)
	firsts := 0
	for _, p := range pages {
		out := mustRun(t, exitOK, "inspect", p.path)
		if want := "page key     " + p.key + " (key matches chain)\n"; !strings.Contains(out, want) {
			t.Errorf("inspect %s lacks %q:\n%s", p.path, want, out)
		}
		want := "parent       " + p.parent + "\n"
		if _, stored := pages[p.parent]; !stored {
			firsts++
			want = "parent       none: first page (root key " + p.parent + ")\n"
		}
		if !strings.Contains(out, want) {
			t.Errorf("inspect %s lacks %q:\n%s", p.path, want, out)
		}
		tok := fmt.Sprintf("token count  %d", len(p.tokens))
		ids := fmt.Sprintf("token ids %d ... %d\n", p.tokens[0], p.tokens[len(p.tokens)-1])
		if !strings.Contains(out, tok) || !strings.Contains(out, ids) || !strings.Contains(out, "page tokens  16\n") {
			t.Errorf("inspect %s lacks %q, %q or the page size:\n%s", p.path, tok, ids, out)
		}
		if !strings.Contains(out, "identity     \""+defaultDemoNamespace) {
			t.Errorf("inspect %s lacks the quoted identity:\n%s", p.path, out)
		}
	}
	if firsts == 0 {
		t.Fatal("no first page in the store")
	}
}
