package main

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/kvpersist/kvpersist/engine/layout"
	"github.com/kvpersist/kvpersist/engine/remote"
	"github.com/kvpersist/kvpersist/internal/faultproxy"
	"github.com/kvpersist/kvpersist/internal/seaweedfs"
	"github.com/kvpersist/kvpersist/internal/testutil"
)

// TestRemoteCommands runs ls, du, verify and gc --remote against a real
// SeaweedFS holding a namespace as the write-behind lays it out (6 pages,
// 2 page manifests, uploaded from a local store), and checks what they
// report against what was uploaded: names, counts and bytes; that gc
// --remote deletes nothing without --delete, and with it exactly the
// unreferenced page older than the grace by the store's clock (a proxy
// moves the store's Date 2 h ahead, so no test waits an hour); that an
// unreadable manifest stops gc in its namespace and is verify's problem,
// as is a corrupt page; and the usage rules of the remote flags.
func TestRemoteCommands(t *testing.T) {
	srv := seaweedfs.StartTB(t)
	t.Setenv(remote.EnvAccessKey, srv.AccessKey)
	t.Setenv(remote.EnvSecretKey, srv.SecretKey)
	root := t.TempDir()
	keys := testutil.PageManifests(t, root, "ns")
	s, err := remote.New(remote.Config{Endpoint: srv.Endpoint, Bucket: srv.Bucket, Prefix: "fleet/a"})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	ctx := context.Background()
	objs := testutil.UploadNamespace(t, s, root, "ns")
	var pageBytes int64
	pages := map[string]bool{}
	for _, ks := range keys {
		for _, k := range ks {
			if n, _ := s.PageName("ns", k); !pages[n] {
				pages[n] = true
				pageBytes += int64(len(objs[n]))
			}
		}
	}
	man1, _ := s.ManifestName("ns", "turn-1")
	man2, _ := s.ManifestName("ns", "turn-2")
	// The store's clock 2 h ahead: every object is then 2 h old for gc.
	p := faultproxy.Start(t, srv.Endpoint)
	p.Set(faultproxy.Rule{Kinds: faultproxy.Any, Fault: faultproxy.ShiftDate, Delay: 2 * time.Hour})
	direct := []string{"--remote", "--endpoint", strings.TrimPrefix(srv.Endpoint, "http://"), "--insecure", "--bucket", srv.Bucket, "--prefix", "fleet/a"}
	ahead := []string{"--remote", "--endpoint", p.Endpoint, "--bucket", srv.Bucket, "--prefix", "fleet/a"}
	cmd := func(name string, flags []string, extra ...string) []string {
		return append(append([]string{name}, flags...), extra...)
	}

	// ls --remote
	var ls remoteLsReport
	runJSON(t, exitOK, &ls, cmd("ls", direct, "--pages")...)
	if len(ls.Manifests) != 2 || ls.Manifests[0].Object != man1 || ls.Manifests[1].Name != "turn-2" ||
		ls.Manifests[0].Bytes != int64(len(objs[man1])) || ls.Manifests[1].Bytes != int64(len(objs[man2])) {
		t.Fatalf("ls --remote manifests %+v", ls.Manifests)
	}
	if len(ls.Pages) != 1 || ls.Pages[0].Pages != 6 || ls.Pages[0].Bytes != pageBytes || len(ls.Pages[0].Files) != 6 {
		t.Fatalf("ls --remote pages %+v, want 6 pages of %d bytes", ls.Pages, pageBytes)
	}
	for _, f := range ls.Pages[0].Files {
		if !pages[f.Object] || f.Bytes != int64(len(objs[f.Object])) {
			t.Fatalf("ls --remote page %+v was not uploaded so", f)
		}
	}
	if out := mustRun(t, exitOK, cmd("ls", direct)...); !strings.Contains(out, "2 manifests in 1 namespace at s3://"+srv.Bucket+"/fleet/a\nns: 6 pages, ") {
		t.Fatalf("ls --remote:\n%s", out)
	}

	// An unreferenced page, just uploaded: young by the store's own
	// clock, 2 h old through the proxy.
	orphan := remotePage(t, s, seedKey("orphan"))
	if _, err := s.Put(ctx, orphan, bytes.NewReader([]byte("orphan page")), 11); err != nil {
		t.Fatal(err)
	}
	var du remoteGCReport
	runJSON(t, exitOK, &du, cmd("du", direct)...)
	if r := du.Rows; len(r) != 1 || r[0].Manifests != 2 || r[0].Pages != 7 || r[0].Live != 6 || r[0].LiveBytes != pageBytes ||
		r[0].Young != 1 || r[0].YoungBytes != 11 || r[0].Reclaimable != 0 || r[0].PageBytes != pageBytes+11 ||
		r[0].ManifestBytes != int64(len(objs[man1])+len(objs[man2])) {
		t.Fatalf("du --remote %+v", du.Rows)
	}
	runJSON(t, exitOK, &du, cmd("du", ahead)...)
	if r := du.Rows; r[0].Reclaimable != 1 || r[0].ReclaimableBytes != 11 || r[0].Young != 0 {
		t.Fatalf("du --remote with the store 2 h ahead %+v", du.Rows)
	}

	// gc --remote: a dry run unless --delete.
	all := testutil.ObjectNames(t, s, "ns")
	out := mustRun(t, exitOK, cmd("gc", ahead)...)
	if !strings.Contains(out, "would delete "+orphan+"\n") || !strings.Contains(out, "dry run: nothing was deleted") {
		t.Fatalf("gc --remote (dry run):\n%s", out)
	}
	if got := testutil.ObjectNames(t, s, "ns"); !slices.Equal(got, all) {
		t.Fatalf("the dry run deleted: %v -> %v", all, got)
	}
	out = mustRun(t, exitOK, cmd("gc", direct, "--delete")...)
	if strings.HasPrefix(out, "deleted ") || strings.Contains(out, "\ndeleted ") || !strings.Contains(out, "deleted 0 pages") {
		t.Fatalf("gc --remote --delete deleted a page younger than the grace:\n%s", out)
	}
	out = mustRun(t, exitOK, cmd("gc", ahead, "--delete", "ns")...)
	if !strings.Contains(out, "deleted "+orphan+"\n") || !strings.Contains(out, "deleted 1 pages, freed 11 B (11 bytes)") {
		t.Fatalf("gc --remote --delete:\n%s", out)
	}
	if got := testutil.ObjectNames(t, s, "ns"); len(got) != len(all)-1 || slices.Contains(got, orphan) {
		t.Fatalf("after gc --remote --delete: %v", got)
	}

	// verify --remote: clean, then a corrupt page and an unreadable
	// manifest, which also stops gc in that namespace.
	var vr remoteVerifyReport
	runJSON(t, exitOK, &vr, cmd("verify", direct)...)
	if !vr.Clean || vr.Checked.Pages != 6 || vr.Checked.Manifests != 2 || vr.Checked.Bytes != pageBytes+int64(len(objs[man1])+len(objs[man2])) {
		t.Fatalf("verify --remote %+v", vr)
	}
	bad := remotePage(t, s, keys["turn-1"][0])
	replaceObject(t, s, bad, flip(objs[bad], len(objs[bad])-1))
	replaceObject(t, s, man2, flip(objs[man2], 30))
	orphan2 := remotePage(t, s, seedKey("orphan-2"))
	if _, err := s.Put(ctx, orphan2, bytes.NewReader([]byte("x")), 1); err != nil {
		t.Fatal(err)
	}
	runJSON(t, exitProblems, &vr, cmd("verify", direct, "--workers", "3")...)
	if vr.Clean || len(vr.Problems) != 3 {
		t.Fatalf("verify --remote after damage: %+v", vr.Problems)
	}
	wantKinds := map[string]string{bad: remote.ProblemCorruptPage, man2: remote.ProblemUnreadable, orphan2: remote.ProblemCorruptPage}
	for _, pr := range vr.Problems {
		if wantKinds[pr.Name] != pr.Kind || pr.Namespace != "ns" {
			t.Errorf("problem %+v", pr)
		}
	}
	// verify --remote --repair-from ROOT: the corrupt page is replaced by
	// the local page of its key (which verifies); orphan-2 has none there
	// and stays, as does the unreadable manifest (not a page).
	runJSON(t, exitProblems, &vr, cmd("verify", direct, "--repair-from", root)...)
	local := testutil.PagePath(filepath.Join(root, "ns"), mustPageKey(t, keys["turn-1"][0]))
	repaired := map[string]remoteRepair{}
	for _, r := range vr.Repaired {
		repaired[r.Object] = r
	}
	if r, o := repaired[bad], repaired[orphan2]; len(vr.Repaired) != 2 || !r.Replaced || r.From != local || o.Replaced || o.Err == "" {
		t.Fatalf("verify --remote --repair-from: %+v", vr.Repaired)
	}
	if got := testutil.ObjectBytes(t, s, bad); !bytes.Equal(got, objs[bad]) {
		t.Fatalf("the repaired object: %d bytes, not the page uploaded (%d bytes)", len(got), len(objs[bad]))
	}
	runJSON(t, exitProblems, &vr, cmd("verify", direct)...)
	if len(vr.Problems) != 2 || vr.Problems[0].Name == bad || vr.Problems[1].Name == bad {
		t.Fatalf("verify --remote after the repair: %+v", vr.Problems)
	}
	out = mustRun(t, exitProblems, cmd("gc", ahead, "--delete")...)
	if !strings.Contains(out, "not collected (a manifest is unreadable") || strings.Contains(out, "deleted "+orphan2) {
		t.Fatalf("gc --remote with an unreadable manifest:\n%s", out)
	}
	if _, err := s.Stat(ctx, orphan2); err != nil {
		t.Fatalf("gc deleted in a namespace with an unreadable manifest: %v", err)
	}

	// Usage.
	for _, c := range []struct {
		args  []string
		first string
	}{
		{[]string{"ls", "--endpoint", "x", root}, "kvpersist ls: --endpoint needs --remote"},
		{[]string{"gc", "--remote", "--bucket", "b"}, "kvpersist gc: --remote needs --endpoint and --bucket"},
		{cmd("gc", direct, "--delete", "--dry-run"), "kvpersist gc: --delete and --dry-run contradict each other"},
		{cmd("gc", direct, "--grace", "10s"), "kvpersist gc: --grace 10s: the minimum is 1m (machines may be uploading pages for a manifest to come)"},
		{cmd("verify", direct, "--no-lock"), "kvpersist verify: --no-lock applies to a local ROOT, not with --remote"},
		{[]string{"verify", "--repair-from", root, root}, "kvpersist verify: --repair-from needs --remote"},
		{[]string{"gc", "--delete", root}, "kvpersist gc: --grace and --delete need --remote (a local gc deletes unless --dry-run)"},
		{[]string{"ls", "--remote", "--endpoint", "s3.example.com:9000", "--insecure", "--bucket", "b"},
			`kvpersist: ls --remote: remote: invalid config: Endpoint "http://s3.example.com:9000": plain http is allowed only for a loopback host`},
		{cmd("ls", direct, "../x"), `kvpersist: ls --remote: remote: invalid object name: invalid name: namespace "../x" (want 1-200 of [A-Za-z0-9._-], not starting with '.' or '-', not "blocks" or "pages")`},
	} {
		code, stdout, errs := cliRun(t, c.args...)
		first, _, _ := strings.Cut(errs, "\n")
		if code != exitUsage || stdout != "" || first != c.first {
			t.Errorf("%q: exit %d, stdout %q, stderr first line:\n%s\nwant:\n%s", c.args, code, stdout, first, c.first)
		}
	}
}

// mustPageKey parses a page key (64 lowercase hex digits).
func mustPageKey(t *testing.T, s string) layout.PageKey {
	t.Helper()
	k, err := layout.ParsePageKey(s)
	if err != nil {
		t.Fatal(err)
	}
	return k
}

// remotePage is the object name of page key in namespace ns.
func remotePage(t *testing.T, s *remote.Store, key string) string {
	t.Helper()
	n, err := s.PageName("ns", key)
	if err != nil {
		t.Fatal(err)
	}
	return n
}

func flip(b []byte, at int) []byte {
	c := slices.Clone(b)
	c[at] ^= 0x10
	return c
}

// replaceObject deletes name and creates it again with b (objects are
// create-only: damage is simulated this way).
func replaceObject(t *testing.T, s *remote.Store, name string, b []byte) {
	t.Helper()
	ctx := context.Background()
	if err := s.Delete(ctx, name); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Put(ctx, name, bytes.NewReader(b), int64(len(b))); err != nil {
		t.Fatal(err)
	}
}

// seedKey is a page key made from seed (any 64 hex digits name a page).
func seedKey(seed string) string {
	h := sha256.Sum256([]byte(seed))
	return hex.EncodeToString(h[:])
}
