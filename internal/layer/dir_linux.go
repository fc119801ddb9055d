package layer

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path"
	"slices"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/dsec-project/dsec/internal/layer/erofs"
)

type inodeKey struct{ dev, ino uint64 }

// addDir walks root depth first in byte order of names and adds every
// entry to w. Regular files are planned: their data is read when the
// image is written, and progress is reported then. It never follows a symlink, reads every xattr, and keeps
// hard links (same device and inode) as one inode.
func addDir(ctx context.Context, w *erofs.Writer, root string, _ Progress) error {
	st, err := lstat(root)
	if err != nil {
		return err
	}
	if st.Mode&unix.S_IFMT != unix.S_IFDIR {
		return fmt.Errorf("%s is not a directory", root)
	}
	d := &dirWalker{w: w, links: map[inodeKey]string{}, buf: make([]byte, 0, 4096)}
	a, err := d.attr(root, st)
	if err != nil {
		return err
	}
	if err := w.Mkdir("", a); err != nil {
		return err
	}
	return d.walk(ctx, root, "")
}

type dirWalker struct {
	w     *erofs.Writer
	links map[inodeKey]string
	buf   []byte
}

func lstat(p string) (*unix.Stat_t, error) {
	var st unix.Stat_t
	if err := unix.Lstat(p, &st); err != nil {
		return nil, &os.PathError{Op: "lstat", Path: p, Err: err}
	}
	return &st, nil
}

func (d *dirWalker) walk(ctx context.Context, host, rel string) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	f, err := os.Open(host)
	if err != nil {
		return err
	}
	names, err := f.Readdirnames(-1)
	f.Close()
	if err != nil {
		return fmt.Errorf("read directory %s: %w", host, err)
	}
	slices.Sort(names)
	for _, name := range names {
		hp := host + "/" + name
		rp := path.Join(rel, name)
		st, err := lstat(hp)
		if err != nil {
			return err
		}
		if err := d.add(ctx, hp, rp, st); err != nil {
			return err
		}
	}
	return nil
}

func (d *dirWalker) add(ctx context.Context, hp, rp string, st *unix.Stat_t) error {
	a, err := d.attr(hp, st)
	if err != nil {
		return err
	}
	typ := st.Mode & unix.S_IFMT
	if typ != unix.S_IFDIR && st.Nlink > 1 {
		k := inodeKey{uint64(st.Dev), st.Ino}
		if first, ok := d.links[k]; ok {
			return d.w.Link(rp, first)
		}
		d.links[k] = rp
	}
	switch typ {
	case unix.S_IFDIR:
		if err := d.w.Mkdir(rp, a); err != nil {
			return err
		}
		return d.walk(ctx, hp, rp)
	case unix.S_IFREG:
		holes, err := findHoles(hp, st)
		if err != nil {
			return err
		}
		return d.w.Plan(rp, a, st.Size, erofs.Planned{Open: opener(hp), Prefetch: prefetcher(hp), Holes: holes})
	case unix.S_IFLNK:
		target, err := os.Readlink(hp)
		if err != nil {
			return err
		}
		return d.w.Symlink(rp, target, a)
	default:
		return d.w.Mknod(rp, a)
	}
}

// attr reads the inode attributes and every xattr of p without following
// a symlink.
func (d *dirWalker) attr(p string, st *unix.Stat_t) (erofs.Attr, error) {
	a := erofs.Attr{
		Mode:      st.Mode,
		UID:       st.Uid,
		GID:       st.Gid,
		Mtime:     st.Mtim.Sec,
		MtimeNsec: uint32(st.Mtim.Nsec),
		Rdev:      st.Rdev,
	}
	x, err := d.xattrs(p)
	if err != nil {
		return a, err
	}
	a.Xattrs = x
	return a, nil
}

func (d *dirWalker) xattrs(p string) (map[string][]byte, error) {
	buf := d.buf[:cap(d.buf)]
	var n int
	var err error
	for {
		n, err = unix.Llistxattr(p, buf)
		if errors.Is(err, unix.ERANGE) {
			buf = make([]byte, len(buf)*2)
			continue
		}
		break
	}
	if errors.Is(err, unix.ENOTSUP) {
		return nil, nil
	}
	if err != nil {
		return nil, &os.PathError{Op: "llistxattr", Path: p, Err: err}
	}
	if n == 0 {
		return nil, nil
	}
	out := map[string][]byte{}
	for _, name := range strings.Split(strings.TrimRight(string(buf[:n]), "\x00"), "\x00") {
		v, err := getxattr(p, name)
		if errors.Is(err, unix.ENODATA) { // removed since the list was read
			continue
		}
		if err != nil {
			return nil, &os.PathError{Op: "lgetxattr " + name, Path: p, Err: err}
		}
		out[name] = v
	}
	return out, nil
}

func getxattr(p, name string) ([]byte, error) {
	size := 256
	for {
		buf := make([]byte, size)
		n, err := unix.Lgetxattr(p, name, buf)
		if errors.Is(err, unix.ERANGE) {
			size *= 4
			if size > 1<<20 {
				return nil, err
			}
			continue
		}
		if err != nil {
			return nil, err
		}
		return buf[:n], nil
	}
}

// opener opens a planned file when its data is due, without following
// a symlink that replaced it since the walk.
func opener(p string) func() (erofs.ReadAtCloser, error) {
	return func() (erofs.ReadAtCloser, error) {
		fd, err := unix.Open(p, unix.O_RDONLY|unix.O_NOFOLLOW|unix.O_NOATIME|unix.O_CLOEXEC, 0)
		if errors.Is(err, unix.EPERM) { // O_NOATIME needs ownership or CAP_FOWNER
			fd, err = unix.Open(p, unix.O_RDONLY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
		}
		if err != nil {
			return nil, &os.PathError{Op: "open", Path: p, Err: err}
		}
		return fdFile{fd, p}, nil
	}
}

// prefetcher starts the kernel's readahead of a whole file.
func prefetcher(p string) func() {
	return func() {
		fd, err := unix.Open(p, unix.O_RDONLY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
		if err != nil {
			return // the writer's own open reports it
		}
		_ = unix.Fadvise(fd, 0, 0, unix.FADV_WILLNEED)
		unix.Close(fd)
	}
}

// fdFile reads with pread(2) on a raw descriptor: an os.File costs an
// fcntl and an epoll registration attempt per file.
type fdFile struct {
	fd   int
	name string
}

func (f fdFile) ReadAt(b []byte, off int64) (int, error) {
	n := 0
	for n < len(b) {
		m, err := unix.Pread(f.fd, b[n:], off+int64(n))
		if errors.Is(err, unix.EINTR) {
			continue
		}
		if err != nil {
			return n, &os.PathError{Op: "read", Path: f.name, Err: err}
		}
		if m == 0 {
			return n, io.EOF
		}
		n += m
	}
	return n, nil
}

func (f fdFile) Close() error { return unix.Close(f.fd) }

// FDReader reads an open file descriptor, named name in errors, with
// pread(2), and closes it on Close.
func FDReader(fd int, name string) erofs.ReadAtCloser { return fdFile{fd, name} }

// findHoles marks the 1 MiB units of a file that are all zeros. Units a
// sparse file has no data in are holes without being read; the others
// are scanned through a read-only mapping, which stops at the first
// non-zero byte, so a dense file costs about one page per MiB.
func findHoles(p string, st *unix.Stat_t) ([]bool, error) {
	if st.Size < erofs.HoleSize {
		return nil, nil // a unit counts as a hole only after a full one
	}
	fd, err := unix.Open(p, unix.O_RDONLY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, &os.PathError{Op: "open", Path: p, Err: err}
	}
	defer unix.Close(fd)
	m, err := unix.Mmap(fd, 0, int(st.Size), unix.PROT_READ, unix.MAP_SHARED)
	if err != nil {
		return nil, &os.PathError{Op: "mmap", Path: p, Err: err}
	}
	defer unix.Munmap(m)
	sparse := st.Blocks*512 < st.Size
	units := (st.Size + erofs.HoleSize - 1) / erofs.HoleSize
	holes := make([]bool, units)
	any := false
	for u := int64(0); u < units; u++ {
		off := u * erofs.HoleSize
		end := min(off+erofs.HoleSize, st.Size)
		if sparse {
			next, err := unix.Seek(fd, off, unix.SEEK_DATA)
			if errors.Is(err, unix.ENXIO) || err == nil && next >= end {
				holes[u], any = true, true
				continue
			}
		}
		if erofs.IsZero(m[off:end]) {
			holes[u], any = true, true
		}
	}
	if !any {
		return nil, nil
	}
	return holes, nil
}
