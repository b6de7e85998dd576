package main

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"hash"
	"path/filepath"
	"runtime"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvpersist/kvpersist/engine/jobs"
	"github.com/kvpersist/kvpersist/engine/layout"
	"github.com/kvpersist/kvpersist/engine/vfs"
	"github.com/kvpersist/kvpersist/internal/bunhash"
	"github.com/zeebo/xxh3"
)

func init() {
	register(&command{
		name: "verify", args: "ROOT|PATH",
		summary: "re-read and re-hash a whole store (or one snapshot): headers, tensors, blocks, orphans, stale temp files",
		example: "kvpersist verify /var/lib/kvcache\n  kvpersist verify --json /var/lib/kvcache/conv-42/turn-7",
		run:     runVerify,
	})
}

// Problem kinds reported by verify.
const (
	probUnreadable    = "unreadable"     // a snapshot file or manifest does not decode (path: the file)
	probCorruptTensor = "corrupt-tensor" // a single-file tensor's hash differs (path: the file; detail names the slot)
	probCorruptBlock  = "corrupt-block"  // a block's SHA-256 differs from its name (path: the block)
	probMissingBlock  = "missing-block"  // a block a manifest names does not exist (path: where it should be)
	probBlockSize     = "block-size"     // a block's size differs from its manifest entry (path: the block)
	probOrphanBlock   = "orphan-block"   // a block no manifest names (gc deletes it)
	probStaleTemp     = "stale-temp"     // a temp file older than the grace period (gc deletes it)
	probIO            = "io-error"       // something could not be read (exit status 2)
)

// problemRank orders the report: data that cannot be restored first, then
// what gc cleans up.
var problemRank = map[string]int{probIO: 0, probUnreadable: 1, probCorruptTensor: 2, probCorruptBlock: 3,
	probMissingBlock: 4, probBlockSize: 5, probStaleTemp: 6, probOrphanBlock: 7}

// verifyProblem is one problem verify found.
type verifyProblem struct {
	Kind   string `json:"kind"`
	Path   string `json:"path"`
	Detail string `json:"detail"`
}

// verifyReport is what verify --json prints.
type verifyReport struct {
	Target string `json:"target"`
	Clean  bool   `json:"clean"`
	// Problems, by kind (io-error, unreadable, corrupt-tensor,
	// corrupt-block, missing-block, block-size, stale-temp, orphan-block),
	// then path.
	Problems []verifyProblem `json:"problems"`
	Checked  struct {
		Namespaces int   `json:"namespaces"`
		Snapshots  int   `json:"snapshots"` // decoded snapshot files and manifests
		Tensors    int   `json:"tensors"`   // single-file tensors re-hashed
		Blocks     int   `json:"blocks"`    // distinct block files re-hashed
		Bytes      int64 `json:"bytes"`     // bytes re-hashed
	} `json:"checked"`
	// Notes say what was not checked and why (e.g. orphans of a namespace
	// holding an unreadable manifest).
	Notes []string `json:"notes"`
	// Skipped lists entries kvpersist does not recognise (never touched).
	Skipped []string `json:"skipped"`
}

// verifyTask is one file region to re-hash.
type verifyTask struct {
	path  string
	off   int64 // byte offset in the file
	size  int64 // bytes to hash
	want  string
	block bool   // SHA-256 of a whole block file (want is its name)
	bun   bool   // Bun.hash of a legacy single-file tensor
	slot  string // tensor: slot name
	refs  []string
}

// blockUse is a block named by manifests of one namespace.
type blockUse struct {
	hash  string
	bytes int64
	refs  []string // "name slot 3 block 2"
}

// verifier collects problems; it is safe for concurrent use.
type verifier struct {
	c         *cli
	fsys      vfs.FS
	tempGrace time.Duration
	now       time.Time
	lock      bool

	mu  sync.Mutex
	rep verifyReport
}

func (v *verifier) problem(kind, path, format string, a ...any) {
	p := verifyProblem{Kind: kind, Path: path, Detail: fmt.Sprintf(format, a...)}
	if kind == probIO {
		v.c.log.Warn("verify: I/O error", "path", path, "err", p.Detail)
	} else {
		v.c.log.Debug("verify: problem", "kind", kind, "path", path, "detail", p.Detail)
	}
	v.mu.Lock()
	v.rep.Problems = append(v.rep.Problems, p)
	v.mu.Unlock()
}

func (v *verifier) unreadable(path string, err error) {
	if isDecodeError(err) {
		msg := strings.TrimPrefix(err.Error(), "layout: "+path+": ")
		v.problem(probUnreadable, path, "%s check failed: %s", failedCheck(err), msg)
	} else {
		v.problem(probIO, path, "%v", err)
	}
}

func runVerify(ctx context.Context, c *cli, args []string) int {
	cmd := commands["verify"]
	fs := c.docFlags(cmd, `Given a store ROOT (the directory above the namespaces), verify checks every
namespace; given a snapshot file or manifest PATH, that snapshot only.

  - every header: prefix, header hash, validation (as 'kvpersist inspect');
  - every tensor of a single-file snapshot: re-read and re-hashed (xxh3-64;
    Bun.hash for the Bun worker's files) against its header hash;
  - every block a manifest names: present, of the size the manifest says,
    and its SHA-256 equal to its name. Each distinct block is read once per
    namespace however many manifests name it; blocks of the Bun worker's
    manifests are looked for in blocks/<sha> (kvpersist's in blocks/<2>/<sha>);
  - orphan blocks (ROOT only): block files no manifest names, which 'gc'
    deletes. A namespace holding an unreadable manifest has no orphans:
    the blocks that manifest names cannot be known, so gc does not sweep
    that namespace either; its unnamed blocks are still re-hashed against
    their names, and a note says so;
  - stale temp files (ROOT only): leftovers of interrupted writes older than
    --temp-grace (younger ones may belong to a running write).

While it lists a namespace, verify holds the namespace lock exclusively
(as gc does), so a write in progress finishes first and its blocks are not
taken for orphans; it then re-hashes without the lock. Problems are listed
as KIND PATH DETAIL; kinds: unreadable, corrupt-tensor, corrupt-block,
missing-block, block-size, orphan-block, stale-temp, io-error.

Exit status: 0 when clean, 1 when problems were found, 2 on usage or I/O
errors (io-error problems included).`)
	asJSON := fs.Bool("json", false, "print a JSON report: {target, clean, problems: [{kind, path, detail}], checked, notes, skipped}")
	tempGrace := fs.Duration("temp-grace", jobs.DefaultTempGrace, "report temp files older than this as stale (0: every temp file)")
	noLock := fs.Bool("no-lock", false, "do not wait for the namespace lock (writes in progress may then show as orphan blocks)")
	workers := fs.Int("workers", runtime.GOMAXPROCS(0), "goroutines re-hashing in parallel")
	pos, code := c.parse(fs, args)
	if code >= 0 {
		return code
	}
	if len(pos) != 1 || *workers < 1 || *tempGrace < 0 {
		fs.Usage()
		return exitUsage
	}
	target := pos[0]
	v := &verifier{c: c, fsys: vfs.Default, tempGrace: *tempGrace, now: time.Now(), lock: !*noLock}
	v.rep.Target = target
	st, err := v.fsys.Lstat(target)
	if err != nil {
		return c.fail("verify: %v", err)
	}
	var tasks []verifyTask
	switch {
	case st.Mode().IsRegular():
		tasks, err = v.planSnapshot(ctx, target)
	case st.IsDir():
		tasks, err = v.planRoot(ctx, target)
	default:
		err = fmt.Errorf("%s is neither a store root nor a snapshot file", target)
	}
	if err != nil {
		return c.fail("verify: %v", err)
	}
	if err := v.run(ctx, tasks, *workers); err != nil {
		return c.fail("verify %s: %v", target, err)
	}
	r := &v.rep
	sort.Slice(r.Problems, func(i, j int) bool {
		a, b := r.Problems[i], r.Problems[j]
		if ra, rb := problemRank[a.Kind], problemRank[b.Kind]; ra != rb {
			return ra < rb
		}
		return a.Path < b.Path
	})
	if r.Problems == nil {
		r.Problems = []verifyProblem{}
	}
	if r.Notes == nil {
		r.Notes = []string{}
	}
	if r.Skipped == nil {
		r.Skipped = []string{}
	}
	r.Clean = len(r.Problems) == 0
	if *asJSON {
		if code := c.writeJSON(r); code >= 0 {
			return code
		}
	} else {
		v.print()
	}
	exit := exitOK
	for _, p := range r.Problems {
		if p.Kind == probIO {
			return exitUsage
		}
		exit = exitProblems
	}
	return exit
}

func (v *verifier) print() {
	r, w := &v.rep, v.c.stdout
	fmt.Fprintf(w, "verify %s: %s, %s; %s and %s re-hashed (%s)\n", r.Target,
		nounCount(r.Checked.Namespaces, "namespace"), nounCount(r.Checked.Snapshots, "snapshot"),
		nounCount(r.Checked.Tensors, "tensor"), nounCount(r.Checked.Blocks, "block"), humanBytes(r.Checked.Bytes))
	for _, n := range r.Notes {
		fmt.Fprintf(w, "note: %s\n", n)
	}
	for _, s := range r.Skipped {
		fmt.Fprintf(w, "skipped (not a kvpersist file, not checked): %s\n", s)
	}
	if r.Clean {
		fmt.Fprintln(w, "clean: no problems found")
		return
	}
	fmt.Fprintf(w, "%s:\n", nounCount(len(r.Problems), "problem"))
	for _, p := range r.Problems {
		fmt.Fprintf(w, "  %-14s %s\n      %s\n", p.Kind, p.Path, p.Detail)
	}
}

// planSnapshot plans the checks of one snapshot file or manifest.
func (v *verifier) planSnapshot(ctx context.Context, path string) ([]verifyTask, error) {
	nsDir := filepath.Dir(path)
	if v.lock {
		unlock, err := lockNamespace(ctx, v.c, nsDir, false)
		if err != nil {
			return nil, err
		}
		defer unlock()
	}
	snap, err := layout.Load(v.fsys, path)
	if err != nil {
		v.unreadable(path, err)
		return nil, nil
	}
	v.rep.Checked.Snapshots++
	uses := map[string]*blockUse{}
	tasks := v.planSnap(snap, filepath.Base(path), uses)
	return append(tasks, v.planBlocks(uses, nil)...), nil
}

// planSnap adds a decoded snapshot: tensor tasks for a single file, block
// uses (by path) for a manifest.
func (v *verifier) planSnap(snap *layout.Snapshot, name string, uses map[string]*blockUse) []verifyTask {
	var tasks []verifyTask
	nsDir := filepath.Dir(snap.Path)
	names := snap.Header.SlotIndex() // O(1) per slot
	for i, t := range snap.Header.Slots() {
		if snap.Layout == layout.Single || (snap.Layout == layout.Pages && t.Hash != "") { // a page manifest's attachments
			tasks = append(tasks, verifyTask{path: snap.Path, off: int64(snap.DataStart) + t.Off, size: t.Bytes,
				want: t.Hash, bun: snap.Legacy, slot: names.Name(i)})
			continue
		}
		for b, ref := range t.Blocks {
			p := layout.BlockPath(nsDir, ref.Hash)
			if snap.Legacy {
				p = layout.LegacyBlockPath(nsDir, ref.Hash)
			}
			u := uses[p]
			if u == nil {
				u = &blockUse{hash: ref.Hash, bytes: ref.Bytes}
				uses[p] = u
			}
			if u.bytes != ref.Bytes {
				v.problem(probBlockSize, p, "manifests disagree on its size: %d bytes (%s) and %d bytes (%s slot %d block %d)",
					u.bytes, strings.Join(u.refs, ", "), ref.Bytes, name, i, b)
			}
			u.refs = append(u.refs, fmt.Sprintf("%s slot %d block %d", name, i, b))
		}
	}
	return tasks
}

// planBlocks checks the blocks named by manifests against the files on disk
// (presence, size) and plans re-hashing those that are there. onDisk, when
// non-nil, is the namespace's block files by path (from a scan); nil means
// look each one up.
func (v *verifier) planBlocks(uses map[string]*blockUse, onDisk map[string]scanBlock) []verifyTask {
	paths := make([]string, 0, len(uses))
	for p := range uses {
		paths = append(paths, p)
	}
	sort.Strings(paths)
	var tasks []verifyTask
	for _, p := range paths {
		u := uses[p]
		size, found := int64(0), false
		if onDisk != nil {
			var b scanBlock
			b, found = onDisk[p]
			size = b.Size
		}
		if !found {
			st, err := v.fsys.Lstat(p)
			switch {
			case vfs.IsNotExist(err):
				v.problem(probMissingBlock, p, "named by %s", refList(u.refs))
				continue
			case err != nil:
				v.problem(probIO, p, "%v", err)
				continue
			case !st.Mode().IsRegular():
				v.problem(probBlockSize, p, "not a regular file (%v); named by %s", st.Mode().Type(), refList(u.refs))
				continue
			}
			size = st.Size()
		}
		if size != u.bytes {
			v.problem(probBlockSize, p, "%d bytes, the manifest says %d; named by %s", size, u.bytes, refList(u.refs))
			continue
		}
		tasks = append(tasks, verifyTask{path: p, size: size, want: u.hash, block: true, refs: u.refs})
	}
	return tasks
}

// refList names up to 4 references.
func refList(refs []string) string {
	if len(refs) <= 4 {
		return strings.Join(refs, ", ")
	}
	return fmt.Sprintf("%s and %d more", strings.Join(refs[:4], ", "), len(refs)-4)
}

// planRoot scans every namespace of a store root.
func (v *verifier) planRoot(ctx context.Context, root string) ([]verifyTask, error) {
	names, skipped, err := scanRootDir(v.fsys, root)
	if err != nil {
		return nil, err
	}
	v.rep.Skipped = append(v.rep.Skipped, skipped...)
	var tasks []verifyTask
	for _, n := range names {
		if err := ctx.Err(); err != nil {
			return nil, err
		}
		t, err := v.planNamespace(ctx, root, n)
		if err != nil {
			return nil, err
		}
		tasks = append(tasks, t...)
	}
	return tasks, nil
}

// planNamespace lists and decodes one namespace under its exclusive lock
// and plans its checks.
func (v *verifier) planNamespace(ctx context.Context, root, name string) ([]verifyTask, error) {
	dir := filepath.Join(root, name)
	if v.lock {
		unlock, err := lockNamespace(ctx, v.c, dir, true)
		if err != nil {
			return nil, err
		}
		defer unlock()
	}
	ns := scanNamespace(v.fsys, root, name, true)
	v.rep.Checked.Namespaces++
	if ns.Err != nil {
		v.problem(probIO, dir, "listing the namespace: %v", ns.Err)
		return nil, nil
	}
	v.rep.Skipped = append(v.rep.Skipped, ns.Skipped...)
	grace := v.tempGrace
	for _, t := range ns.Temps {
		if age := v.now.Sub(t.ModTime); age >= grace {
			v.problem(probStaleTemp, t.Path, "temp file of an interrupted write, %s old (grace %s), %d bytes; gc removes it",
				age.Round(time.Second), grace, t.Size)
		}
	}
	uses := map[string]*blockUse{}
	live := map[string]bool{}
	var tasks []verifyTask
	var bad []string
	for _, s := range ns.Snaps {
		if s.Err != nil {
			v.unreadable(s.Path, s.Err)
			bad = append(bad, s.Name)
			continue
		}
		v.rep.Checked.Snapshots++
		tasks = append(tasks, v.planSnap(s.Snap, s.Name, uses)...)
		for _, t := range s.Snap.Header.Slots() {
			for _, b := range t.Blocks {
				live[b.Hash] = true
			}
		}
	}
	onDisk := make(map[string]scanBlock, len(ns.Blocks))
	for _, b := range ns.Blocks {
		onDisk[b.Path] = b
	}
	tasks = append(tasks, v.planBlocks(uses, onDisk)...)
	// Blocks no manifest names at their path. As jobs.Collect: a block is
	// live when a readable manifest names its hash (wherever it lies), and
	// nothing is an orphan in a namespace holding an unreadable manifest.
	unnamed := 0
	for _, b := range ns.Blocks {
		if _, ok := uses[b.Path]; ok {
			continue
		}
		if live[b.Hash] || len(bad) > 0 {
			unnamed++
			tasks = append(tasks, verifyTask{path: b.Path, size: b.Size, want: b.Hash, block: true})
			continue
		}
		v.problem(probOrphanBlock, b.Path, "%d bytes, named by no manifest; gc deletes it", b.Size)
	}
	if len(bad) > 0 {
		v.rep.Notes = append(v.rep.Notes, fmt.Sprintf("namespace %s: orphan blocks not reported: %d unreadable manifest(s) (%s) may name them, so gc will not sweep this namespace until they are repaired or removed; %d unnamed block(s) were re-hashed against their names",
			dir, len(bad), strings.Join(bad, ", "), unnamed))
	}
	return tasks, nil
}

// run re-hashes every task on up to workers goroutines (joined before it
// returns), with a progress bar by bytes on a terminal. Mismatches and read
// failures become problems; the error is ctx's.
func (v *verifier) run(ctx context.Context, tasks []verifyTask, workers int) error {
	var total int64
	for _, t := range tasks {
		total += t.size
	}
	bar := v.c.progress(total, "verify")
	defer bar.Done()
	var next atomic.Int64
	var wg sync.WaitGroup
	var tensors, blocks atomic.Int64
	var hashed atomic.Int64
	work := func() {
		defer wg.Done()
		buf := make([]byte, 1<<20)
		for ctx.Err() == nil {
			i := int(next.Add(1) - 1)
			if i >= len(tasks) {
				return
			}
			t := &tasks[i]
			n, err := v.check(ctx, t, buf, bar)
			hashed.Add(n)
			if err != nil && ctx.Err() == nil {
				v.problem(probIO, t.path, "%v", err)
			}
			if t.block {
				blocks.Add(1)
			} else {
				tensors.Add(1)
			}
		}
	}
	n := min(workers, len(tasks))
	wg.Add(n)
	for range n {
		go work()
	}
	wg.Wait()
	v.rep.Checked.Tensors += int(tensors.Load())
	v.rep.Checked.Blocks += int(blocks.Load())
	v.rep.Checked.Bytes += hashed.Load()
	return ctx.Err()
}

// check re-hashes one task, reporting a mismatch as a problem. It returns
// the bytes hashed and an I/O error, if any.
func (v *verifier) check(ctx context.Context, t *verifyTask, buf []byte, bar *progress) (int64, error) {
	f, err := v.fsys.Open(t.path)
	if err != nil {
		if t.block && vfs.IsNotExist(err) {
			v.problem(probMissingBlock, t.path, "vanished while verifying; named by %s", refList(t.refs))
			return 0, nil
		}
		return 0, err
	}
	defer f.Close()
	if t.block {
		st, err := f.Stat()
		if err != nil {
			return 0, err
		}
		if st.Size() != t.size {
			v.problem(probBlockSize, t.path, "%d bytes, expected %d", st.Size(), t.size)
			return 0, nil
		}
	}
	if t.bun {
		// Bun.hash has no streaming form: the legacy tensor is read whole.
		data := make([]byte, t.size)
		if err := layout.ReadFull(f, data, t.off); err != nil {
			return 0, err
		}
		bar.Add(t.size)
		if got := bunhash.Hex(data); got != t.want {
			v.problem(probCorruptTensor, t.path, "%s: Bun.hash %s, the header says %s", t.slot, got, t.want)
		}
		return t.size, nil
	}
	var h hash.Hash
	var xh *xxh3.Hasher
	if t.block {
		h = sha256.New()
	} else {
		xh = xxh3.New()
		h = xh
	}
	var done int64
	for done < t.size {
		if err := ctx.Err(); err != nil {
			return done, err
		}
		n := min(int64(len(buf)), t.size-done)
		if err := layout.ReadFull(f, buf[:n], t.off+done); err != nil {
			if errors.Is(err, layout.ErrTruncated) {
				if t.block {
					v.problem(probBlockSize, t.path, "shrank while verifying: %v", err)
				} else {
					v.problem(probCorruptTensor, t.path, "%s: %v", t.slot, err)
				}
				return done, nil
			}
			return done, err
		}
		h.Write(buf[:n])
		done += n
		bar.Add(n)
	}
	if t.block {
		if got := hex.EncodeToString(h.Sum(nil)); got != t.want {
			detail := fmt.Sprintf("SHA-256 %s differs from its name", got)
			if len(t.refs) > 0 {
				detail += "; named by " + refList(t.refs)
			} else {
				detail += "; named by no readable manifest"
			}
			v.problem(probCorruptBlock, t.path, "%s", detail)
		}
		return done, nil
	}
	if got := layout.TensorHash(xh.Sum64()); got != t.want {
		v.problem(probCorruptTensor, t.path, "%s: xxh3 %s, the header says %s", t.slot, got, t.want)
	}
	return done, nil
}
