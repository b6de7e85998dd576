package layout

import (
	"errors"
	"fmt"
	"io"
	"strings"

	"github.com/kvpersist/kvpersist/engine/vfs"
)

// Snapshot is a decoded, validated snapshot file or block manifest.
type Snapshot struct {
	Path   string
	Prefix        // magic kind, header length, data start, stored hash
	Layout Layout // Single or Blocks
	Size   int64  // file size in bytes
	Header *Header
	JSON   []byte // the header JSON as stored
	// Page is the page object of a page file (FormatPage), nil otherwise;
	// it is removed from Header.Meta.
	Page *Page
	// Pages is the page list of a page manifest (FormatPages), nil
	// otherwise; it is removed from Header.Meta.
	Pages *PageList
}

// Decode reads and validates the prefix and header of an open file, before
// any tensor data is read: magic, header length (capped at MaxHeaderLen),
// header hash, format version, and every tensor's extent (see Validate). The
// errors wrap ErrBadMagic, ErrTruncated, ErrHeaderTooLarge, ErrHeaderHash,
// ErrFormatVersion or ErrInvalidHeader and name the path.
func Decode(f vfs.File, path string) (*Snapshot, error) {
	return decode(f, path, MaxHeaderLen)
}

// DecodePage is Decode for a file that must be a page (under pages/, or a
// page object): its header may be at most MaxPageHeaderLen bytes, checked
// from the prefix before anything else is read or allocated, so that
// what decoding one page allocates (the JSON read and what is parsed from
// it) is bounded by a small multiple of MaxPageHeaderLen whatever the file
// holds. A longer header is an ErrHeaderTooLarge error naming the path.
// It does not check that the file is a page (Snapshot.Page non-nil): the
// caller does.
func DecodePage(f vfs.File, path string) (*Snapshot, error) {
	return decode(f, path, MaxPageHeaderLen)
}

func decode(f vfs.File, path string, maxHeader uint32) (*Snapshot, error) {
	st, err := f.Stat()
	if err != nil {
		return nil, err
	}
	if !st.Mode().IsRegular() {
		return nil, fmt.Errorf("layout: %s: %w: not a regular file", path, ErrInvalidHeader)
	}
	size := st.Size()
	var pb [PrefixLen]byte
	if size < PrefixLen {
		// Too short for a prefix: is it a torn file of ours, or not ours?
		head := pb[:min(size, int64(len(Magic)))]
		if err := readFull(f, head, 0); err != nil {
			return nil, fmt.Errorf("layout: %s: reading prefix: %w", path, err)
		}
		if !isMagicPrefix(head) {
			return nil, fmt.Errorf("layout: %s: %w: starts with %q", path, ErrBadMagic, head)
		}
		return nil, fmt.Errorf("layout: %s: %w: %d bytes, the prefix needs %d", path, ErrTruncated, size, PrefixLen)
	}
	if err := readFull(f, pb[:], 0); err != nil {
		return nil, fmt.Errorf("layout: %s: reading prefix: %w", path, err)
	}
	p, err := ParsePrefix(pb[:])
	if err != nil {
		return nil, fmt.Errorf("layout: %s: %w", path, err)
	}
	if p.HeaderLen > maxHeader {
		return nil, fmt.Errorf("layout: %s: %w: %d bytes (limit %d for this kind of file)", path, ErrHeaderTooLarge, p.HeaderLen, maxHeader)
	}
	if int64(PrefixLen)+int64(p.HeaderLen) > size {
		return nil, fmt.Errorf("layout: %s: %w: header of %d bytes ends past the file's %d bytes", path, ErrTruncated, p.HeaderLen, size)
	}
	js := make([]byte, p.HeaderLen) // bounded: HeaderLen <= MaxHeaderLen and <= size
	if err := readFull(f, js, PrefixLen); err != nil {
		return nil, fmt.Errorf("layout: %s: reading header: %w", path, err)
	}
	if err := p.CheckHeaderHash(js); err != nil {
		return nil, fmt.Errorf("layout: %s: %w", path, err)
	}
	h, err := parseHeader(js, p)
	if err != nil {
		return nil, fmt.Errorf("layout: %s: %w", path, err)
	}
	lay, err := Validate(p, h, size)
	if err != nil {
		return nil, fmt.Errorf("layout: %s: %w", path, err)
	}
	snap := &Snapshot{Path: path, Prefix: p, Layout: lay, Size: size, Header: h, JSON: js}
	if h.FormatVersion == FormatPage {
		if snap.Page, err = parsePage(h); err != nil {
			return nil, fmt.Errorf("layout: %s: %w", path, err)
		}
	}
	if lay == Pages {
		if snap.Pages, err = parsePageList(h); err != nil {
			return nil, fmt.Errorf("layout: %s: %w", path, err)
		}
	}
	return snap, nil
}

// Load opens path (not following a final symlink), decodes it and closes it.
func Load(fsys vfs.FS, path string) (*Snapshot, error) {
	f, err := fsys.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	return Decode(f, path)
}

// readFull reads len(b) bytes at off or fails with ErrTruncated.
func readFull(f vfs.File, b []byte, off int64) error {
	for len(b) > 0 {
		n, err := f.ReadAt(b, off)
		b, off = b[n:], off+int64(n)
		if len(b) == 0 {
			return nil
		}
		if err != nil {
			if errors.Is(err, io.EOF) {
				return fmt.Errorf("%w: unexpected end of file at byte %d", ErrTruncated, off)
			}
			return err
		}
		if n == 0 {
			return fmt.Errorf("%w: no progress at byte %d", ErrTruncated, off)
		}
	}
	return nil
}

// ReadFull reads exactly len(b) bytes at off; a short file is ErrTruncated.
func ReadFull(f vfs.File, b []byte, off int64) error { return readFull(f, b, off) }

// isMagicPrefix reports whether b is a prefix of Magic or LegacyMagic
// (an empty b is: a zero-length file may be a torn file of ours).
func isMagicPrefix(b []byte) bool {
	return strings.HasPrefix(Magic, string(b)) || strings.HasPrefix(LegacyMagic, string(b))
}
