package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"text/tabwriter"

	"github.com/kvpersist/kvpersist/engine/jobs"
	"github.com/kvpersist/kvpersist/engine/layout"
	"github.com/kvpersist/kvpersist/engine/vfs"
	"github.com/spf13/cobra"
)

// Names of the magics, as inspect prints them.
const (
	magicKV     = "kvpersist"
	magicLegacy = "Bun worker (legacy)"
)

// inspectTensor is one tensor slot as inspect reports it.
type inspectTensor struct {
	Slot   int     `json:"slot"`
	Group  string  `json:"group"` // "cache" or "attachment"
	Entry  int     `json:"entry"` // index of the cache or attachment
	Index  int     `json:"index"` // tensor index within the entry
	DType  string  `json:"dtype"`
	Shape  []int64 `json:"shape"` // elements
	Bytes  int64   `json:"bytes"`
	Off    *int64  `json:"off,omitempty"`    // single file: offset from the data start
	Blocks *int    `json:"blocks,omitempty"` // block manifest: number of blocks
	Pages  *int    `json:"pages,omitempty"`  // page manifest's cache tensor: number of pages holding it
	Hash   string  `json:"hash,omitempty"`   // single file: xxh3-64 (Bun.hash for legacy files)
	// BlockList is every block, with --blocks.
	BlockList []layout.BlockRef `json:"blockList,omitempty"`
	// Meta is the entry's metadata (on the entry's first tensor) and the
	// tensor's own unknown keys.
	Meta layout.Meta `json:"meta,omitempty"`
}

// inspectReport is what inspect --json prints.
type inspectReport struct {
	Path      string `json:"path"`
	FileBytes int64  `json:"fileBytes"`
	// Magic is "kvpersist", "Bun worker (legacy)" or "" when unrecognised.
	Magic  string `json:"magic"`
	Legacy bool   `json:"legacy"`
	// Prefix fields (bytes).
	HeaderLen  uint32 `json:"headerLen"`
	DataStart  uint32 `json:"dataStart"`
	HeaderHash string `json:"headerHash"` // as stored: 16 hex digits of the u64
	// ComputedHeaderHash is the hash of the header as read; "" when the
	// header could not be read at all.
	ComputedHeaderHash string `json:"computedHeaderHash,omitempty"`
	HeaderHashOK       bool   `json:"headerHashOK"`
	HeaderHashRule     string `json:"headerHashRule"`
	FormatVersion      *int   `json:"formatVersion"`
	// Layout is "single", "blocks", "page" (a page file of the prefix
	// cache, formatVersion 6) or "pages" (a page manifest, 7).
	Layout string `json:"layout,omitempty"`
	// Verified: every check of layout.Decode passed. When false,
	// FailedCheck names the check and the header fields below, if any,
	// come from an unverified parse.
	Verified     bool            `json:"verified"`
	FailedCheck  string          `json:"failedCheck,omitempty"`
	Error        string          `json:"error,omitempty"`
	LogicalBytes int64           `json:"logicalBytes"`
	Meta         layout.Meta     `json:"meta"`   // caller metadata (top level)
	Header       json.RawMessage `json:"header"` // the header JSON as stored
	// HeaderText is, when the stored header is not valid JSON, its first
	// bytes (up to 1 KiB) as text, and HeaderJSONError the parse error.
	HeaderText      string          `json:"headerText,omitempty"`
	HeaderJSONError string          `json:"headerJSONError,omitempty"`
	Tensors         []inspectTensor `json:"tensors"`
	// Page is the page object of a page file of the prefix page cache
	// (format 6), nil for any other file. When a check failed it is the
	// header's page object read leniently (Verified false).
	Page *inspectPage `json:"page,omitempty"`
	// Pages is the page list of a page manifest (format 7), nil for any
	// other file; read leniently when a check failed.
	Pages *inspectPages `json:"pages,omitempty"`
}

// inspectPages is a page manifest's page list as inspect reports it.
type inspectPages struct {
	Identity   string   `json:"identity"`
	PageTokens int      `json:"pageTokens"` // tokens per page
	Tokens     int      `json:"tokens"`     // the snapshot's tokens
	Keys       []string `json:"keys"`       // page keys in chain order, the leaf last
	// LeafTokens is the last page's token count when it is a partial
	// (leaf) page, else 0.
	LeafTokens int `json:"leafTokens"`
}

// inspectPage is a page file's page object as inspect reports it.
type inspectPage struct {
	Key string `json:"key"`
	// Parent is the parent page's key; for a first page, the chain's root
	// key (SHA-256 of the identity and page size), and FirstPage is true.
	Parent     string `json:"parent"`
	FirstPage  bool   `json:"firstPage"`
	Identity   string `json:"identity"`
	PageTokens int    `json:"pageTokens"` // the chain's page size, tokens
	TokenCount int    `json:"tokenCount"` // token ids in this page
	FirstToken uint32 `json:"firstToken"`
	LastToken  uint32 `json:"lastToken"`
	// KeyMatchesChain: the key is SHA-256 of the parent and the token ids
	// (layout checks it at decode: always true in a verified report).
	KeyMatchesChain bool `json:"keyMatchesChain"`
	// NameMatchesKey: the file's name is the key (false for a page file
	// copied or renamed elsewhere; verify reports it as corrupt-page
	// inside pages/).
	NameMatchesKey bool `json:"nameMatchesKey"`
}

// pageReport renders a page object for inspect (decoded, or read
// leniently from a header that failed a check: then the key and parent
// are shown as stored).
func pageReport(in *layout.Inspection) *inspectPage {
	p := in.Page
	r := &inspectPage{Key: in.PageKeyText, Parent: in.PageParentText, FirstPage: p.FirstPage(), Identity: p.Identity,
		PageTokens: p.PageTokens, TokenCount: len(p.Tokens), KeyMatchesChain: p.Check() == nil,
		NameMatchesKey: filepath.Base(in.Path) == in.PageKeyText}
	if len(p.Tokens) > 0 {
		r.FirstToken, r.LastToken = p.Tokens[0], p.Tokens[len(p.Tokens)-1]
	}
	return r
}

// pagesReport renders a page manifest's page list for inspect.
func pagesReport(l *layout.PageList) *inspectPages {
	r := &inspectPages{Identity: l.Identity, PageTokens: l.PageTokens, Tokens: l.Tokens, Keys: make([]string, len(l.Keys))}
	for i, k := range l.Keys {
		r.Keys[i] = k.String()
	}
	if l.PageTokens > 0 && l.Tokens%l.PageTokens != 0 {
		r.LeafTokens = l.Tokens % l.PageTokens
	}
	return r
}

// layoutName is the name inspect gives a file's layout: page files and
// page manifests by what they are.
func layoutName(lay layout.Layout, version int) string {
	if version == layout.FormatPage {
		return "page"
	}
	return lay.String()
}

// tensorRows lists a header's slots for inspect.
func tensorRows(h *layout.Header, lay layout.Layout, withBlocks bool, pages int) []inspectTensor {
	var out []inspectTensor
	slot := 0
	for gi, group := range [][]layout.Entry{h.Caches, h.Attachments} {
		gname := "cache"
		if gi == 1 {
			gname = "attachment"
		}
		for ei, e := range group {
			for ti, t := range e.Tensors {
				r := inspectTensor{Slot: slot, Group: gname, Entry: ei, Index: ti, DType: t.DType,
					Shape: append([]int64{}, t.Shape...), Bytes: t.Bytes, Hash: t.Hash}
				if lay == layout.Blocks {
					n := len(t.Blocks)
					r.Blocks = &n
					if withBlocks {
						r.BlockList = append([]layout.BlockRef{}, t.Blocks...)
					}
				} else if lay == layout.Pages && gi == 0 {
					r.Pages = &pages // the cache: stored in the listed pages
				} else {
					off := t.Off
					r.Off = &off
				}
				meta := layout.Meta{}
				if ti == 0 {
					for k, v := range e.Meta {
						meta[k] = v
					}
				}
				for k, v := range t.Meta {
					meta[k] = v
				}
				if len(meta) > 0 {
					r.Meta = meta
				}
				out = append(out, r)
				slot++
			}
		}
	}
	return out
}

// formatMeta renders metadata as sorted k=v pairs of compact JSON, each
// value cut to max bytes.
func formatMeta(m layout.Meta, max int) string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	var parts []string
	for _, k := range keys {
		var b bytes.Buffer
		v := []byte(m[k])
		if json.Compact(&b, v) == nil {
			v = b.Bytes()
		}
		s := string(v)
		if len(s) > max {
			s = fmt.Sprintf("%s…(%d bytes)", s[:max], len(v))
		}
		parts = append(parts, quote(k)+"="+quote(s))
	}
	return strings.Join(parts, " ")
}

func (c *cli) inspectCommand() *cobra.Command {
	cmd := c.command("inspect PATH", "decode one snapshot file or manifest: prefix, header hash, metadata, one row per tensor", `Reads the prefix and header only (no tensor data; 'kvpersist verify PATH'
re-hashes the data). Prints the magic (kvpersist, or "Bun worker (legacy)"
for files of the original worker), the format version, the header length and
data start (bytes), the stored header hash and whether it matches the header,
the caller metadata, and one row per tensor slot (caches, then attachments):
entry, dtype, shape (elements), bytes, and the offset from the data start
(single file) or the number of blocks (manifest), and the tensor hash.

A page file of the prefix page cache (ROOT/<namespace>/pages/<2>/<key>) also
shows its page: key (and that it matches the chain: SHA-256 of the parent key
and the token ids, checked at decode; and whether the file's name is the
key), parent key (or "none: first page" when the parent is the chain's root
key), identity (quoted), page tokens (the chain's page size), token count
(fewer for a partial last page) and the first and last token ids; its
format reads "6 (page)". A page manifest (a named snapshot stored as
token pages, "7 (pages)") shows its page list: how many pages of how many
tokens (and the partial last page), the tokens in all, the identity and
the first and last page keys (every key with --json); its cache tensors'
rows say how many pages hold them. When the header fails its check, the
page object or page list is still shown, marked UNVERIFIED.

If a check fails (magic, lengths, header hash, format version, validation),
inspect still prints what it could read, says which check failed, marks any
tensor rows as unverified, and exits 1. Exit status: 0 when every check
passed, 1 when one failed, 2 on usage or I/O errors.`,
		"kvpersist inspect /var/lib/kvcache/conv-42/turn-7\nkvpersist inspect --json /var/lib/kvcache/conv-42/turn-7 | jq '.tensors[0]'",
		cobra.ExactArgs(1))
	fs := cmd.Flags()
	asJSON := fs.Bool("json", false, "print the prefix fields, the header as stored (\"header\"), the caller metadata and the tensor rows as JSON")
	withBlocks := fs.Bool("blocks", false, "also list every block (SHA-256, bytes and, for formatVersion 8, xxh3-64) of every tensor of a manifest")
	runs(cmd, func(ctx context.Context, args []string) error {
		path := args[0]
		rep, ioErr := inspectFile(vfs.Default, path, *withBlocks)
		if ioErr != nil {
			return fmt.Errorf("inspect %s", quote(fmt.Sprintf("%s: %v", path, ioErr)))
		}
		if *asJSON {
			if err := c.writeJSON(rep); err != nil {
				return fmt.Errorf("writing JSON: %w", err)
			}
		} else {
			printInspect(c, rep)
		}
		if !rep.Verified {
			return errProblems
		}
		return nil
	})
	return cmd
}

// inspectFile decodes path as far as it can (layout.Inspect). A non-nil
// error is an I/O error (the file could not be opened or read); a file
// that fails a check is a report with Verified false.
func inspectFile(fsys vfs.FS, path string, withBlocks bool) (*inspectReport, error) {
	f, err := fsys.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	in, err := layout.Inspect(f, path)
	if err != nil {
		return nil, err
	}
	rep := &inspectReport{Path: path, FileBytes: in.Size, Meta: layout.Meta{}, Tensors: []inspectTensor{}}
	switch in.Magic {
	case layout.Magic:
		rep.Magic = magicKV
	case layout.LegacyMagic:
		rep.Magic, rep.Legacy = magicLegacy, true
	}
	if rep.Magic != "" {
		p := in.Prefix
		rep.HeaderLen, rep.DataStart = p.HeaderLen, p.DataStart
		rep.HeaderHash = fmt.Sprintf("%016x", p.HeaderHash)
		rep.HeaderHashRule = p.HeaderHashRule()
	}
	if in.JSON != nil {
		rep.ComputedHeaderHash = fmt.Sprintf("%016x", in.ComputedHash)
		rep.HeaderHashOK = in.HashOK()
	}
	if snap := in.Snapshot; snap != nil {
		rep.Verified = true
		if v := snap.Header.FormatVersion; v != 0 || !snap.Legacy {
			rep.FormatVersion = &v // the Bun worker's single files carry none
		}
		rep.Layout = layoutName(snap.Layout, snap.Header.FormatVersion)
		rep.Header = json.RawMessage(snap.JSON)
		if snap.Header.Meta != nil {
			rep.Meta = snap.Header.Meta
		}
		rep.LogicalBytes = logicalBytes(snap.Header)
		addPages(rep, in)
		rep.Tensors = tensorRows(snap.Header, snap.Layout, withBlocks, pageCount(rep))
		return rep, nil
	}
	rep.FailedCheck = jobs.FailedCheck(in.Err)
	rep.Error = in.Err.Error()
	if in.JSON != nil && !json.Valid(in.JSON) {
		var x any
		rep.HeaderJSONError = fmt.Sprint(json.Unmarshal(in.JSON, &x))
		rep.HeaderText = string(in.JSON[:min(len(in.JSON), 1024)])
	}
	if in.JSON != nil && json.Valid(in.JSON) {
		rep.Header = json.RawMessage(in.JSON)
		if h := in.Loose; h != nil {
			rep.FormatVersion = in.LooseVersion
			version := 0
			if in.LooseVersion != nil {
				version = *in.LooseVersion
			}
			rep.Layout = layoutName(in.LooseLayout, version)
			rep.Meta = h.Meta
			addPages(rep, in)
			rep.LogicalBytes = logicalBytes(h)
			rep.Tensors = tensorRows(h, in.LooseLayout, withBlocks, pageCount(rep))
		}
	}
	return rep, nil
}

// addPages puts in's page object or page list into the report and takes
// it out of the caller metadata shown (it is the format's, not the
// caller's).
func addPages(rep *inspectReport, in *layout.Inspection) {
	if in.Page == nil && in.Pages == nil {
		return
	}
	if in.Page != nil {
		rep.Page = pageReport(in)
	}
	if in.Pages != nil {
		rep.Pages = pagesReport(in.Pages)
	}
	meta := layout.Meta{}
	for k, v := range rep.Meta {
		if (k != "page" || in.Page == nil) && (k != "pages" || in.Pages == nil) {
			meta[k] = v
		}
	}
	rep.Meta = meta
}

// pageCount is the number of pages a page manifest lists (0 otherwise).
func pageCount(rep *inspectReport) int {
	if rep.Pages == nil {
		return 0
	}
	return len(rep.Pages.Keys)
}

func printInspect(c *cli, r *inspectReport) {
	w := c.stdout
	kv := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintf(kv, "path\t%s\n", quote(r.Path))
	magic := r.Magic
	if magic == "" {
		magic = "unrecognised (not a kvpersist file)"
	}
	fmt.Fprintf(kv, "magic\t%s\n", magic)
	if r.FormatVersion != nil {
		fmt.Fprintf(kv, "format\t%d (%s)\n", *r.FormatVersion, r.Layout)
	} else if r.Layout != "" {
		fmt.Fprintf(kv, "format\tnone (%s, the Bun worker's single file)\n", r.Layout)
	}
	fmt.Fprintf(kv, "file size\t%d bytes\n", r.FileBytes)
	if r.Magic != "" {
		fmt.Fprintf(kv, "header\t%d bytes at offset %d; data start %d\n", r.HeaderLen, layout.PrefixLen, r.DataStart)
		switch {
		case r.ComputedHeaderHash == "":
			fmt.Fprintf(kv, "header hash\t%s (%s): not checked, the header could not be read\n", r.HeaderHash, r.HeaderHashRule)
		case r.HeaderHashOK:
			fmt.Fprintf(kv, "header hash\t%s (%s): matches\n", r.HeaderHash, r.HeaderHashRule)
		default:
			fmt.Fprintf(kv, "header hash\t%s stored, %s computed (%s): MISMATCH\n", r.HeaderHash, r.ComputedHeaderHash, r.HeaderHashRule)
		}
	}
	if len(r.Meta) > 0 {
		fmt.Fprintf(kv, "metadata\t%s\n", formatMeta(r.Meta, 80))
	}
	unverified := ""
	if !r.Verified {
		unverified = " (UNVERIFIED: the header failed its check)"
	}
	if p := r.Pages; p != nil {
		leaf := ""
		if p.LeafTokens > 0 {
			leaf = fmt.Sprintf(", the last a partial page of %d", p.LeafTokens)
		}
		fmt.Fprintf(kv, "pages\t%d of %d tokens%s, %d tokens in all%s\n", len(p.Keys), p.PageTokens, leaf, p.Tokens, unverified)
		fmt.Fprintf(kv, "identity\t%s\n", strconv.Quote(p.Identity))
		if len(p.Keys) > 0 {
			fmt.Fprintf(kv, "first page\t%s\n", p.Keys[0])
			fmt.Fprintf(kv, "last page\t%s\n", p.Keys[len(p.Keys)-1])
		}
	}
	if p := r.Page; p != nil {
		key := p.Key + unverified
		if p.KeyMatchesChain {
			key += " (key matches chain)"
		} else {
			key += " (key DOES NOT match the chain of its parent and tokens)"
		}
		if !p.NameMatchesKey {
			key += "; the file's name is not the key"
		}
		fmt.Fprintf(kv, "page key\t%s\n", key)
		if p.FirstPage {
			fmt.Fprintf(kv, "parent\tnone: first page (root key %s)\n", p.Parent)
		} else {
			fmt.Fprintf(kv, "parent\t%s\n", p.Parent)
		}
		fmt.Fprintf(kv, "identity\t%s\n", strconv.Quote(p.Identity))
		fmt.Fprintf(kv, "page tokens\t%d\n", p.PageTokens)
		partial := ""
		if p.TokenCount < p.PageTokens {
			partial = " (a partial last page)"
		}
		fmt.Fprintf(kv, "token count\t%d%s; token ids %d ... %d\n", p.TokenCount, partial, p.FirstToken, p.LastToken)
	}
	if len(r.Tensors) > 0 {
		nb := 0
		for _, t := range r.Tensors {
			if t.Blocks != nil {
				nb += *t.Blocks
			}
		}
		line := fmt.Sprintf("%d, %d bytes (%s) logical", len(r.Tensors), r.LogicalBytes, humanBytes(r.LogicalBytes))
		if r.Layout == "blocks" {
			line += fmt.Sprintf(", %d block references", nb)
		}
		fmt.Fprintf(kv, "tensors\t%s\n", line)
	}
	if !r.Verified {
		fmt.Fprintf(kv, "CHECK FAILED\t%s: %s\n", r.FailedCheck, quote(strings.TrimPrefix(r.Error, "layout: "+r.Path+": ")))
	}
	if r.HeaderJSONError != "" {
		fmt.Fprintf(kv, "header JSON\tnot valid JSON (%s); its first %d bytes:\n", r.HeaderJSONError, len(r.HeaderText))
	}
	kv.Flush()
	if r.HeaderText != "" {
		fmt.Fprintf(w, "%q\n", r.HeaderText)
	}
	if len(r.Tensors) == 0 {
		return
	}
	fmt.Fprintln(w)
	if !r.Verified {
		fmt.Fprintln(w, "tensors as the header says, UNVERIFIED (the header failed its check):")
	}
	var table bytes.Buffer
	tw := tabwriter.NewWriter(&table, 0, 0, 2, ' ', 0)
	where := "OFFSET"
	if r.Layout == "blocks" {
		where = "BLOCKS"
	}
	fmt.Fprintf(tw, "SLOT\tENTRY\tTENSOR\tDTYPE\tSHAPE\tBYTES\t%s\tHASH\tMETA\n", where)
	for _, t := range r.Tensors {
		loc := "-"
		if t.Off != nil {
			loc = fmt.Sprint(*t.Off)
		} else if t.Blocks != nil {
			loc = fmt.Sprint(*t.Blocks)
		} else if t.Pages != nil {
			loc = fmt.Sprintf("%d pages", *t.Pages)
		}
		hash := t.Hash
		if hash == "" {
			hash = "-"
		}
		fmt.Fprintf(tw, "%d\t%s %d\t%d\t%s\t%v\t%d\t%s\t%s\t%s\n", t.Slot, t.Group, t.Entry, t.Index, quote(t.DType), t.Shape, t.Bytes, loc, quote(hash), formatMeta(t.Meta, 40))
	}
	tw.Flush()
	for _, line := range strings.SplitAfter(table.String(), "\n") {
		// tabwriter pads the cell before an empty META: drop the padding.
		if trimmed := strings.TrimRight(line, " \n"); trimmed != "" {
			fmt.Fprintln(w, trimmed)
		}
	}
	for _, t := range r.Tensors {
		if len(t.BlockList) == 0 {
			continue
		}
		fmt.Fprintf(w, "\nblocks of slot %d (%s %d tensor %d):\n", t.Slot, t.Group, t.Entry, t.Index)
		var off int64
		for i, b := range t.BlockList {
			xx := ""
			if b.XXH3 != "" {
				xx = "  xxh3 " + quote(b.XXH3)
			}
			fmt.Fprintf(w, "  %4d  %s  %8d bytes at %d%s\n", i, quote(b.Hash), b.Bytes, off, xx)
			off += b.Bytes
		}
	}
}
