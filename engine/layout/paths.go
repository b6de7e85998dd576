package layout

import (
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"path/filepath"
	"regexp"
	"strings"
)

// ErrBadName is returned for a namespace or snapshot name that is not a
// plain file name kvpersist accepts (see ValidName).
var ErrBadName = errors.New("invalid name")

var nameRE = regexp.MustCompile(`^[A-Za-z0-9_][A-Za-z0-9._-]{0,199}$`)

// BlocksDirName is the directory of a namespace holding its blocks.
const BlocksDirName = "blocks"

// PagesDirName is the directory of a namespace holding the pages of the
// prefix page cache.
const PagesDirName = "pages"

// LockName is the per-namespace advisory lock file (flock): writers and
// readers hold it shared, collect holds it exclusive.
const LockName = ".lock"

// RecencyName is the per-namespace checkpoint of the page cache's recency
// (docs/format/recency-checkpoint.md): <namespace>/.recency, written atomically and durably by the
// engine, never a snapshot (a dot name is never a valid snapshot name) and
// never deleted by collect.
const RecencyName = ".recency"

// UploadsName is the per-namespace journal of the remote tier's pending
// uploads (docs/format/uploads-journal.md): <namespace>/.uploads,
// appended by every engine on the root (under the namespace's shared
// lock), compacted atomically and durably (under its exclusive lock), and
// replayed by the next engine on the root; never a snapshot (a dot name)
// and never deleted by collect.
const UploadsName = ".uploads"

// PageLogName is the root's shared page log (engine/pagecache): <root>/.pagelog,
// appended by every engine on the root with the page files it commits and
// unlinks and the accesses of its loads, read by the others so that each
// bounds and orders the root's page files, not only its own. Not a
// namespace (a dot name); replaced when it grows, never deleted by
// collect.
const PageLogName = ".pagelog"

// ValidName checks a namespace or snapshot name: 1 to 200 characters of
// [A-Za-z0-9._-], not starting with '.' or '-', and not "blocks" or
// "pages" (the directories of a namespace). Such a name is one path
// element, so root/namespace/name never leaves the root, and it can never
// be taken for a temp file (those start with '.').
func ValidName(kind, s string) error {
	if !nameRE.MatchString(s) || s == BlocksDirName || s == PagesDirName {
		return fmt.Errorf("%w: %s %s (want 1-200 of [A-Za-z0-9._-], not starting with '.' or '-', not %q or %q)", ErrBadName, kind, quoteCapped(s), BlocksDirName, PagesDirName)
	}
	return nil
}

// tempMarker separates a target's name from the random part of its temp file.
const tempMarker = ".tmp-"

// TempPath returns a unique temp file path beside target:
// dir/.<base>.tmp-<16 random hex digits>. The leading dot keeps it from ever
// being taken for a snapshot or block.
func TempPath(target string) string {
	var r [8]byte
	if _, err := rand.Read(r[:]); err != nil {
		panic(err) // crypto/rand never fails on Linux
	}
	dir, base := filepath.Split(target)
	return filepath.Join(dir, "."+base+tempMarker+hex.EncodeToString(r[:]))
}

// IsTemp reports whether a file name is a kvpersist temp file.
func IsTemp(name string) bool {
	i := strings.LastIndex(name, tempMarker)
	if !strings.HasPrefix(name, ".") || i <= 0 || len(name)-i-len(tempMarker) != 16 {
		return false
	}
	for _, c := range name[i+len(tempMarker):] {
		if (c < '0' || c > '9') && (c < 'a' || c > 'f') {
			return false
		}
	}
	return true
}
