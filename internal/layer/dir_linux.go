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
// entry to w. It never follows a symlink, reads every xattr, and keeps
// hard links (same device and inode) as one inode.
func addDir(ctx context.Context, w *erofs.Writer, root string, p Progress) error {
	st, err := lstat(root)
	if err != nil {
		return err
	}
	if st.Mode&unix.S_IFMT != unix.S_IFDIR {
		return fmt.Errorf("%s is not a directory", root)
	}
	d := &dirWalker{w: w, links: map[inodeKey]string{}, p: p, buf: make([]byte, 0, 4096)}
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
	p     Progress
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
		f, err := os.OpenFile(hp, os.O_RDONLY|unix.O_NOFOLLOW|unix.O_NOATIME, 0)
		if errors.Is(err, unix.EPERM) { // O_NOATIME needs ownership or CAP_FOWNER
			f, err = os.OpenFile(hp, os.O_RDONLY|unix.O_NOFOLLOW, 0)
		}
		if err != nil {
			return err
		}
		defer f.Close()
		var src io.Reader = f
		if st.Blocks*512 < st.Size {
			src = sparseFile{f, st.Size}
		}
		if err := d.w.Create(rp, a, st.Size, src); err != nil {
			return err
		}
		d.p.Add(st.Size)
		return nil
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

// sparseFile finds holes with SEEK_DATA.
type sparseFile struct {
	f    *os.File
	size int64
}

func (s sparseFile) Read(p []byte) (int, error)              { return s.f.Read(p) }
func (s sparseFile) ReadAt(p []byte, off int64) (int, error) { return s.f.ReadAt(p, off) }

func (s sparseFile) DataAfter(off int64) (int64, error) {
	next, err := unix.Seek(int(s.f.Fd()), off, unix.SEEK_DATA)
	if errors.Is(err, unix.ENXIO) {
		return s.size, nil
	}
	if err != nil {
		return 0, &os.PathError{Op: "lseek SEEK_DATA", Path: s.f.Name(), Err: err}
	}
	return next, nil
}
