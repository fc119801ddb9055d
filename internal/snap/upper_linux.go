package snap

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path"
	"slices"
	"strconv"
	"strings"

	"github.com/containerd/errdefs"
	"golang.org/x/sys/unix"

	"github.com/dsec-project/dsec/internal/layer"
	"github.com/dsec-project/dsec/internal/layer/erofs"
)

// The overlay markers a diff layer keeps; every other trusted.* xattr
// (overlay's origin, impure, redirect, ... and anything planted) is
// dropped, since a lower layer must not tell overlay where to look.
var keepTrusted = map[string]bool{
	"trusted.overlay.opaque":    true,
	"trusted.overlay.whiteout":  true,
	"trusted.overlay.whiteouts": true,
}

const opaqueXattr = "trusted.overlay.opaque"

// Pack adds the overlay upper dir to w as a diff layer: whiteouts stay
// whiteouts, opaque directories stay opaque, modes, owners, times,
// xattrs and hard links are kept. With prev (the index of the last pack
// of the same upper) only what changed since then is added, plus
// whiteouts for what went away, so the diff stacks over the previous
// one. Every regular file is planned: its bytes are read when w
// finishes, which must happen while the upper is still quiescent.
//
// The upper is hostile: it is walked through directory descriptors,
// never through a symlink, across a mount or past the limits, and what
// a layer may not carry (device nodes, foreign trusted.* xattrs) is
// dropped and reported.
func Pack(ctx context.Context, w *erofs.Writer, upper string, prev Index, lim Limits) (*Packed, error) {
	return pack(ctx, w, upper, prev, lim, "")
}

// Merge adds a mounted diff layer to w over the diffs added before it,
// as overlay would stack them: an opaque directory, or a directory over
// what was no directory, hides what the diffs below put there, and a
// directory opaque below stays opaque. Adding the diffs of a chain
// bottom-up folds them into one diff over the same lower layers.
//
// base is the merged view of the layers the chain stands on: a whiteout
// of what base lacks hides nothing there and is left out, since in a
// directory only one layer has, overlay lists whiteouts as they are.
func Merge(ctx context.Context, w *erofs.Writer, diff, base string) (*Packed, error) {
	return pack(ctx, w, diff, nil, Limits{}, base)
}

func pack(ctx context.Context, w *erofs.Writer, upper string, prev Index, lim Limits, mergeBase string) (*Packed, error) {
	merge := mergeBase != ""
	lim = lim.WithDefaults()
	fd, err := unix.Open(upper, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, &os.PathError{Op: "open", Path: upper, Err: err}
	}
	p := &packer{w: w, upper: upper, root: fd, prev: prev, lim: lim, links: map[uint64]string{},
		out: &Packed{Index: Index{}}, merge: merge, base: mergeBase}
	if merge {
		if p.baseTree, err = openTree(mergeBase); err != nil {
			unix.Close(fd)
			return nil, err
		}
		defer p.baseTree.close()
	}
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		unix.Close(fd)
		return nil, err
	}
	p.dev = st.Dev
	a, err := p.attr(fd, "", &st)
	if err != nil {
		unix.Close(fd)
		return nil, err
	}
	delete(a.Xattrs, opaqueXattr) // the root is never opaque
	if err := w.Mkdir("", a); err != nil {
		unix.Close(fd)
		return nil, err
	}
	// walk closes fd; the planned files are opened from their own root
	// descriptor when the image is written.
	if p.root, err = dupCloexec(fd); err != nil {
		unix.Close(fd)
		return nil, err
	}
	p.out.closeRoot = p.root
	if err := p.walk(ctx, fd, "", 1, prev == nil); err != nil {
		p.out.Close()
		return nil, err
	}
	if err := p.whiteoutGone(); err != nil {
		p.out.Close()
		return nil, err
	}
	return p.out, nil
}

// Packed is what Pack added. Close it once the image is written.
type Packed struct {
	Entries   int      `json:"entries"`             // paths added, whiteouts included
	Bytes     int64    `json:"bytes"`               // file data added
	Whiteouts int      `json:"whiteouts"`           // paths hidden
	Unchanged int      `json:"unchanged,omitempty"` // left out: the previous pack has them
	Dropped   []string `json:"dropped,omitempty"`   // what a layer may not carry
	Index     Index    `json:"-"`                   // for the next pack

	closeRoot int
}

// Close releases the upper's descriptor the planned files are opened from.
func (p *Packed) Close() {
	if p.closeRoot > 0 {
		unix.Close(p.closeRoot)
		p.closeRoot = 0
	}
}

type packer struct {
	w        *erofs.Writer
	upper    string
	root     int
	dev      uint64
	prev     Index
	lim      Limits
	links    map[uint64]string // inode -> first path, for hard links
	out      *Packed
	buf      []byte
	merge    bool   // over earlier diffs (Merge)
	base     string // Merge's base
	baseTree *tree  // it, looked up through no symlink
}

func limitErr(format string, args ...any) error {
	return fmt.Errorf("%s: %w", fmt.Sprintf(format, args...), errdefs.ErrOutOfRange)
}

// walk adds the entries of the directory open as fd, then closes it.
// all: add everything below (the directory is new since the last pack).
func (p *packer) walk(ctx context.Context, fd int, rel string, depth int, all bool) error {
	f := os.NewFile(uintptr(fd), path.Join(p.upper, rel))
	defer f.Close()
	if err := ctx.Err(); err != nil {
		return err
	}
	names, err := f.Readdirnames(-1)
	if err != nil {
		return fmt.Errorf("read directory %s: %w", f.Name(), err)
	}
	slices.Sort(names)
	for _, name := range names {
		var st unix.Stat_t
		if err := unix.Fstatat(fd, name, &st, unix.AT_SYMLINK_NOFOLLOW); err != nil {
			return fmt.Errorf("stat %s: %w", path.Join(f.Name(), name), err)
		}
		rp := path.Join(rel, name)
		if err := p.add(ctx, fd, name, rp, &st, depth, all); err != nil {
			return err
		}
	}
	return nil
}

func (p *packer) add(ctx context.Context, dirfd int, name, rp string, st *unix.Stat_t, depth int, all bool) error {
	p.out.Entries++
	if p.out.Entries > p.lim.MaxEntries {
		return limitErr("the sandbox changed more than %d paths (at /%s): raise --max-entries or snapshot more often", p.lim.MaxEntries, rp)
	}
	typ := st.Mode & unix.S_IFMT
	seen := Entry{Ino: st.Ino, Ctime: st.Ctim.Nano(), Dir: typ == unix.S_IFDIR}
	old, had := p.prev[rp]
	p.out.Index[rp] = seen
	same := !all && had && old == seen
	if same && typ != unix.S_IFDIR {
		p.out.Unchanged++ // a directory is added again: its children may have changed
		return nil
	}
	if st.Dev != p.dev {
		return fmt.Errorf("/%s is on another file system than the upper: refusing to pack across mounts: %w", rp, errdefs.ErrInvalidArgument)
	}
	if (typ == unix.S_IFCHR || typ == unix.S_IFBLK) && !(typ == unix.S_IFCHR && st.Rdev == 0) {
		p.out.Entries--
		delete(p.out.Index, rp)
		p.drop("/%s: device node %d:%d", rp, unix.Major(st.Rdev), unix.Minor(st.Rdev))
		return nil
	}
	a, err := p.attr(dirfd, name, st)
	if err != nil {
		return err
	}
	if typ != unix.S_IFDIR && st.Nlink > 1 {
		if first, ok := p.links[st.Ino]; ok {
			return p.w.Link(rp, first)
		}
		p.links[st.Ino] = rp
	}
	switch typ {
	case unix.S_IFDIR:
		if depth > p.lim.MaxDepth {
			return limitErr("the sandbox's files nest deeper than %d directories (at /%s): raise --max-depth", p.lim.MaxDepth, rp[:min(len(rp), 200)])
		}
		if same {
			// Opacity was recorded by the pack that first saw this
			// directory; repeating it would hide that pack's files.
			delete(a.Xattrs, opaqueXattr)
		}
		if p.merge {
			p.mergeDir(rp, &a)
		}
		if err := p.w.Mkdir(rp, a); err != nil {
			return err
		}
		fd, err := unix.Openat(dirfd, name, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
		if err != nil {
			return fmt.Errorf("open /%s in the upper: %w", rp, err)
		}
		if err := sameInode(fd, st, rp); err != nil {
			unix.Close(fd)
			return err
		}
		// A directory that is new since the last pack (not one whose
		// entries changed) is added whole.
		return p.walk(ctx, fd, rp, depth+1, all || !had || old.Ino != seen.Ino || !old.Dir)
	case unix.S_IFREG:
		p.out.Bytes += st.Size
		if p.out.Bytes > p.lim.MaxBytes {
			return limitErr("the sandbox changed more than %d bytes of files (at /%s): raise --max-bytes or snapshot more often", p.lim.MaxBytes, rp)
		}
		return p.w.Plan(rp, a, st.Size, erofs.Planned{Open: p.opener(rp, st)})
	case unix.S_IFLNK:
		target, err := readlinkat(dirfd, name)
		if err != nil {
			return fmt.Errorf("readlink /%s in the upper: %w", rp, err)
		}
		return p.w.Symlink(rp, target, a)
	case unix.S_IFCHR:
		if p.merge {
			if _, ok := p.baseTree.lstat(rp); !ok {
				return p.w.Remove(rp) // what the diffs below added, gone
			}
		}
		p.out.Whiteouts++
		return p.w.Whiteout(rp, a)
	default: // fifo, socket
		return p.w.Mknod(rp, a)
	}
}

// mergeDir prepares the writer for directory rp of a diff stacked over
// what it holds.
func (p *packer) mergeDir(rp string, a *erofs.Attr) {
	old, had := p.w.Attr(rp)
	opaque := func() {
		if a.Xattrs == nil {
			a.Xattrs = map[string][]byte{}
		}
		a.Xattrs[opaqueXattr] = []byte("y")
	}
	switch {
	case string(a.Xattrs[opaqueXattr]) == "y":
		p.w.Remove(rp)
	case had && old.Mode&unix.S_IFMT != unix.S_IFDIR: // over a whiteout or a file
		p.w.Remove(rp)
		opaque()
	case had && string(old.Xattrs[opaqueXattr]) == "y":
		opaque()
	}
}

func (p *packer) drop(format string, args ...any) {
	const show = 100
	if len(p.out.Dropped) < show {
		p.out.Dropped = append(p.out.Dropped, fmt.Sprintf(format, args...))
	}
}

// whiteoutGone hides what the previous pack added and the upper no
// longer has: overlay removes an entry of the upper without a whiteout
// when no lower has it, but the previous diff is a lower now. Only the
// topmost missing path of a subtree needs one.
func (p *packer) whiteoutGone() error {
	var gone []string
	for rp := range p.prev {
		if _, ok := p.out.Index[rp]; !ok {
			gone = append(gone, rp)
		}
	}
	slices.Sort(gone)
	for _, rp := range gone {
		if dir := path.Dir(rp); dir != "." && !p.w.IsDir(dir) {
			continue // its parent went too, or is no directory now
		}
		if p.w.Exists(rp) {
			continue
		}
		if err := p.w.Whiteout(rp, erofs.Attr{}); err != nil {
			return err
		}
		p.out.Whiteouts++
		p.out.Entries++
	}
	return nil
}

// opener opens a planned file when its bytes are due: below the upper's
// descriptor, through no symlink, no magic link and no mount, and only
// if it is still the inode the walk saw.
func (p *packer) opener(rp string, st *unix.Stat_t) func() (erofs.ReadAtCloser, error) {
	ino, size := st.Ino, st.Size
	return func() (erofs.ReadAtCloser, error) {
		fd, err := openBeneath(p.root, rp)
		if err != nil {
			return nil, fmt.Errorf("open /%s in the upper: %w", rp, err)
		}
		var now unix.Stat_t
		if err := unix.Fstat(fd, &now); err != nil || now.Ino != ino || now.Size != size {
			unix.Close(fd)
			return nil, fmt.Errorf("/%s changed while the sandbox was being packed (is something outside it writing its upper?): %w", rp, errdefs.ErrAborted)
		}
		return layer.FDReader(fd, rp), nil
	}
}

// openBeneath opens rel below dirfd read-only, refusing symlinks in any
// component. A path longer than openat2 takes is opened a component at
// a time.
func openBeneath(dirfd int, rel string) (int, error) {
	how := &unix.OpenHow{Flags: unix.O_RDONLY | unix.O_NOFOLLOW | unix.O_CLOEXEC | unix.O_NOCTTY | unix.O_NONBLOCK,
		Resolve: unix.RESOLVE_BENEATH | unix.RESOLVE_NO_SYMLINKS | unix.RESOLVE_NO_MAGICLINKS | unix.RESOLVE_NO_XDEV}
	if len(rel) < unix.PathMax-1 {
		return unix.Openat2(dirfd, rel, how)
	}
	parts := strings.Split(rel, "/")
	cur := dirfd
	for i, part := range parts {
		h := *how
		if i < len(parts)-1 {
			h.Flags = unix.O_PATH | unix.O_DIRECTORY | unix.O_NOFOLLOW | unix.O_CLOEXEC
		}
		fd, err := unix.Openat2(cur, part, &h)
		if cur != dirfd {
			unix.Close(cur)
		}
		if err != nil {
			return -1, err
		}
		cur = fd
	}
	return cur, nil
}

// dupCloexec duplicates fd close-on-exec. dup(2) clears the flag: a
// process the worker started meanwhile (a microVM's shim and its QEMU,
// made ahead of need) kept the upper open for its whole life, so a
// guest's disk image mounted for a pack-diff could not be unmounted
// (detached instead) and its loop device stayed attached.
func dupCloexec(fd int) (int, error) { return unix.FcntlInt(uintptr(fd), unix.F_DUPFD_CLOEXEC, 0) }

func sameInode(fd int, st *unix.Stat_t, rp string) error {
	var now unix.Stat_t
	if err := unix.Fstat(fd, &now); err != nil {
		return err
	}
	if now.Ino != st.Ino || now.Dev != st.Dev {
		return fmt.Errorf("/%s was replaced while the sandbox was being packed: %w", rp, errdefs.ErrAborted)
	}
	return nil
}

func readlinkat(dirfd int, name string) (string, error) {
	for size := 256; ; size *= 4 {
		buf := make([]byte, size)
		n, err := unix.Readlinkat(dirfd, name, buf)
		if err != nil {
			return "", err
		}
		if n < size {
			return string(buf[:n]), nil
		}
		if size > unix.PathMax {
			return "", unix.ENAMETOOLONG
		}
	}
}

// attr reads the attributes and the xattrs a layer may carry of the
// entry name in dirfd ("" for dirfd itself), without following it.
func (p *packer) attr(dirfd int, name string, st *unix.Stat_t) (erofs.Attr, error) {
	a := erofs.Attr{Mode: st.Mode, UID: st.Uid, GID: st.Gid, Mtime: st.Mtim.Sec, MtimeNsec: uint32(st.Mtim.Nsec), Rdev: st.Rdev}
	// The l*xattr calls take a path: one through our own descriptor
	// of the directory, whose last component is not followed.
	proc := "/proc/self/fd/" + strconv.Itoa(dirfd)
	if name != "" {
		proc += "/" + name
	}
	names, err := p.listxattr(proc)
	if err != nil {
		return a, fmt.Errorf("list xattrs of %s: %w", name, err)
	}
	for _, x := range names {
		if strings.HasPrefix(x, "trusted.") && !keepTrusted[x] {
			continue
		}
		v, err := lgetxattr(proc, x)
		if errors.Is(err, unix.ENODATA) {
			continue
		}
		if err != nil {
			return a, fmt.Errorf("read xattr %s of %s: %w", x, name, err)
		}
		if a.Xattrs == nil {
			a.Xattrs = map[string][]byte{}
		}
		a.Xattrs[x] = v
	}
	return a, nil
}

func (p *packer) listxattr(path string) ([]string, error) {
	if p.buf == nil {
		p.buf = make([]byte, 4096)
	}
	for {
		n, err := unix.Llistxattr(path, p.buf)
		if errors.Is(err, unix.ERANGE) {
			p.buf = make([]byte, len(p.buf)*4)
			continue
		}
		if errors.Is(err, unix.ENOTSUP) || n == 0 {
			return nil, nil
		}
		if err != nil {
			return nil, err
		}
		return strings.Split(strings.TrimRight(string(p.buf[:n]), "\x00"), "\x00"), nil
	}
}

func lgetxattr(path, name string) ([]byte, error) {
	for size := 256; ; size *= 4 {
		buf := make([]byte, size)
		n, err := unix.Lgetxattr(path, name, buf)
		if errors.Is(err, unix.ERANGE) && size <= 1<<16 {
			continue
		}
		if err != nil {
			return nil, err
		}
		return buf[:n], nil
	}
}

// String describes a pack for a log line.
func (p *Packed) String() string {
	return fmt.Sprintf("%d paths, %d bytes, %d whiteouts, %d unchanged, %d dropped", p.Entries, p.Bytes, p.Whiteouts, p.Unchanged, len(p.Dropped))
}
