package layer

import (
	"archive/tar"
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"math"
	"path"
	"strings"

	"github.com/klauspost/compress/gzip"
	"github.com/klauspost/compress/zstd"

	"github.com/dsec-project/dsec/internal/layer/erofs"
)

const (
	whiteoutPrefix = ".wh."
	whiteoutOpaque = ".wh..wh..opq"
	opaqueXattr    = "trusted.overlay.opaque"
	paxXattr       = "SCHILY.xattr."
)

// MaxTarEntrySize is the largest file a tar entry may hold (64 GiB).
const MaxTarEntrySize = 64 << 30

// decompress sniffs gzip and zstd and returns a reader of the plain
// stream. The returned closer releases decoder resources.
func decompress(r io.Reader) (io.Reader, func(), error) {
	br := bufio.NewReaderSize(r, 1<<20)
	head, err := br.Peek(4)
	if err != nil && !errors.Is(err, io.EOF) {
		return nil, nil, err
	}
	switch {
	case len(head) >= 2 && head[0] == 0x1f && head[1] == 0x8b:
		zr, err := gzip.NewReader(br)
		if err != nil {
			return nil, nil, fmt.Errorf("%w: gzip: %v", ErrBadSource, err)
		}
		return zr, func() { zr.Close() }, nil
	case bytes.Equal(head, []byte{0x28, 0xb5, 0x2f, 0xfd}):
		zr, err := zstd.NewReader(br, zstd.WithDecoderConcurrency(1))
		if err != nil {
			return nil, nil, fmt.Errorf("%w: zstd: %v", ErrBadSource, err)
		}
		return zr, zr.Close, nil
	}
	return br, func() {}, nil
}

// entryAttr turns a tar header into inode attributes.
func entryAttr(h *tar.Header) (erofs.Attr, error) {
	if h.Uid < 0 || h.Gid < 0 || int64(h.Uid) > math.MaxUint32 || int64(h.Gid) > math.MaxUint32 {
		return erofs.Attr{}, fmt.Errorf("%w: %q: owner %d:%d out of range", ErrBadSource, h.Name, h.Uid, h.Gid)
	}
	a := erofs.Attr{
		Mode:      uint32(h.Mode) & 0o7777,
		UID:       uint32(h.Uid),
		GID:       uint32(h.Gid),
		Mtime:     h.ModTime.Unix(),
		MtimeNsec: uint32(h.ModTime.Nanosecond()),
	}
	for k, v := range h.PAXRecords {
		if name, ok := strings.CutPrefix(k, paxXattr); ok {
			if a.Xattrs == nil {
				a.Xattrs = map[string][]byte{}
			}
			a.Xattrs[name] = []byte(v)
		}
	}
	switch h.Typeflag {
	case tar.TypeChar, tar.TypeBlock:
		if h.Devmajor < 0 || h.Devminor < 0 || h.Devmajor > 0xfff || h.Devminor > 0xfffff {
			return a, fmt.Errorf("%w: %q: device %d:%d out of range", ErrBadSource, h.Name, h.Devmajor, h.Devminor)
		}
		a.Rdev = mkdev(uint32(h.Devmajor), uint32(h.Devminor))
	}
	return a, nil
}

// mkdev is glibc's makedev.
func mkdev(major, minor uint32) uint64 {
	return uint64(minor&0xff) | uint64(major&0xfff)<<8 | uint64(minor&^0xff)<<12 | uint64(major&^0xfff)<<32
}

// tarAdder applies tar entries to a writer. With flatten set it is one
// layer of an image being flattened from the top: entries that upper
// layers replaced or deleted are skipped and whiteouts are recorded for
// the layers below. Without it, AUFS whiteouts become overlayfs ones.
type tarAdder struct {
	w *erofs.Writer
	p Progress

	// maxSize bounds the size a tar header may claim. Sparse entries
	// read as zeros cost time in proportion to their size, so an archive
	// of a few bytes must not claim a petabyte.
	maxSize int64

	flatten bool
	layer   int             // index of the layer being added, 0 = bottom
	defined map[string]int  // path -> layer that defined it explicitly
	dirs    map[string]bool // explicitly defined path is a directory
	deleted map[string]bool // whited out by an upper layer
	opaque  map[string]bool // made opaque by an upper layer
	pending map[string][]string
	// found in this layer, applied to lower ones once it is done
	newDeleted, newOpaque []string
	opaqueDirs            []string // plain tar: dirs to mark opaque
}

func newTarAdder(w *erofs.Writer, p Progress) *tarAdder {
	return &tarAdder{w: w, p: p, maxSize: MaxTarEntrySize, defined: map[string]int{}, dirs: map[string]bool{},
		deleted: map[string]bool{}, opaque: map[string]bool{}}
}

func cleanName(name string) (string, error) {
	parts, err := erofs.SplitPath(name)
	if err != nil {
		return "", fmt.Errorf("%w: %v", ErrBadSource, err)
	}
	return strings.Join(parts, "/"), nil
}

// masked reports whether an upper layer hides p.
func (t *tarAdder) masked(p string) bool {
	if !t.flatten {
		return false
	}
	if t.deleted[p] {
		return true
	}
	for a := p; a != ""; {
		a = parentPath(a)
		if t.opaque[a] {
			return true // an upper layer made an ancestor opaque
		}
		if a == "" {
			break
		}
		if t.deleted[a] {
			return true
		}
		if l, ok := t.defined[a]; ok && l > t.layer && !t.dirs[a] {
			return true // an upper layer put a non-directory there
		}
	}
	return false
}

func (t *tarAdder) add(h *tar.Header, r io.Reader) error {
	if h.Typeflag == tar.TypeXGlobalHeader {
		return nil
	}
	p, err := cleanName(h.Name)
	if err != nil {
		return err
	}
	dir, base := path.Split(p)
	dir = strings.TrimSuffix(dir, "/")
	if strings.HasPrefix(base, whiteoutPrefix) {
		return t.whiteout(h, dir, base)
	}
	if t.masked(p) {
		return nil
	}
	if l, ok := t.defined[p]; ok && l > t.layer {
		// An upper layer defined p. Lower directories still merge
		// their children; their own attributes lose.
		return nil
	}
	a, err := entryAttr(h)
	if err != nil {
		return err
	}
	switch h.Typeflag {
	case tar.TypeReg, tar.TypeRegA:
		if h.Size < 0 || h.Size > t.maxSize {
			return fmt.Errorf("%w: %q claims %d bytes, outside 0 to %d", ErrBadSource, h.Name, h.Size, t.maxSize)
		}
		err = t.w.Create(p, a, h.Size, r)
		t.p.Add(h.Size)
	case tar.TypeDir:
		err = t.w.Mkdir(p, a)
	case tar.TypeSymlink:
		err = t.w.Symlink(p, h.Linkname, a)
	case tar.TypeLink:
		target, cerr := cleanName(h.Linkname)
		if cerr != nil {
			return cerr
		}
		if t.flatten && t.defined[target] != t.layer {
			// The target was replaced or removed above: link to this
			// layer's copy, read again once the layer is done.
			t.pending[target] = append(t.pending[target], p)
			t.define(p, false)
			return nil
		}
		err = t.w.Link(p, target)
	case tar.TypeChar, tar.TypeBlock, tar.TypeFifo:
		mode := map[byte]uint32{tar.TypeChar: erofs.S_IFCHR, tar.TypeBlock: erofs.S_IFBLK, tar.TypeFifo: erofs.S_IFIFO}[h.Typeflag]
		a.Mode |= mode
		err = t.w.Mknod(p, a)
	default:
		return fmt.Errorf("%w: %q: unsupported tar entry type %q", ErrBadSource, h.Name, h.Typeflag)
	}
	if err != nil {
		var re *erofs.ReadError
		if errors.Is(err, erofs.ErrInvalid) || errors.As(err, &re) {
			return fmt.Errorf("%w: %v (truncated or corrupt archive?)", ErrBadSource, err)
		}
		return err
	}
	t.define(p, h.Typeflag == tar.TypeDir)
	return nil
}

func (t *tarAdder) define(p string, dir bool) {
	t.defined[p] = t.layer
	t.dirs[p] = dir
}

func parentPath(p string) string {
	if i := strings.LastIndexByte(p, '/'); i >= 0 {
		return p[:i]
	}
	return ""
}

func (t *tarAdder) whiteout(h *tar.Header, dir, base string) error {
	a, err := entryAttr(h)
	if err != nil {
		return err
	}
	switch {
	case base == whiteoutOpaque:
		if t.flatten {
			t.newOpaque = append(t.newOpaque, dir)
			return nil
		}
		t.opaqueDirs = append(t.opaqueDirs, dir)
		return nil
	case strings.HasPrefix(base, whiteoutPrefix+whiteoutPrefix):
		return nil // AUFS bookkeeping (.wh..wh.plnk, .wh..wh.aufs)
	}
	target := path.Join(dir, strings.TrimPrefix(base, whiteoutPrefix))
	if t.flatten {
		t.newDeleted = append(t.newDeleted, target)
		return nil
	}
	if err := t.w.Whiteout(target, a); err != nil {
		return fmt.Errorf("%w: %v", ErrBadSource, err)
	}
	return nil
}

// finishLayer applies what this layer's whiteouts say about lower layers.
func (t *tarAdder) finishLayer() error {
	for _, d := range t.opaqueDirs {
		if !t.w.IsDir(d) {
			if err := t.w.Mkdir(d, erofs.Attr{Mode: 0o755}); err != nil {
				return err
			}
		}
		if err := t.w.SetXattr(d, opaqueXattr, []byte("y")); err != nil {
			return err
		}
	}
	t.opaqueDirs = nil
	for _, d := range t.newDeleted {
		if !t.masked(d) {
			t.deleted[d] = true
		}
	}
	for _, d := range t.newOpaque {
		t.opaque[d] = true
	}
	t.newDeleted, t.newOpaque = nil, nil
	return nil
}

// addTar converts a plain or compressed tar stream.
func addTar(ctx context.Context, w *erofs.Writer, r io.Reader, p Progress) error {
	plain, done, err := decompress(r)
	if err != nil {
		return err
	}
	defer done()
	if err := w.Mkdir("", w.Implied("")); err != nil {
		return err
	}
	if err := newTarAdder(w, p).addLayer(ctx, plain, nil); err != nil {
		return err
	}
	// An image archive piped in would become a layer of its own files.
	if w.Exists("manifest.json") && (w.IsDir("blobs") || w.Exists("repositories")) || w.Exists("oci-layout") && w.Exists("index.json") {
		return fmt.Errorf("%w: the stream is an image archive (docker save or OCI layout); save it to a file and build from the file, which dsec flattens", ErrBadSource)
	}
	return nil
}

// Decompress returns the plain stream of r, gzip or zstd or neither, as
// the layer's own sources are read; done releases the decoder.
func Decompress(r io.Reader) (plain io.Reader, done func(), err error) { return decompress(r) }
