package containers

import (
	"io/fs"
	"os"
	"path"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/dsec-project/dsec/internal/archive"
	"github.com/dsec-project/dsec/internal/runtime/backend"
	"github.com/dsec-project/dsec/internal/runtime/container"
	"github.com/dsec-project/dsec/internal/runtime/idmap"
)

// hostFiles is a container's files as the sandbox resolves them, seen
// from the host: every name resolves inside its root (symlinks,
// absolute ones included, and ".." stay there), never through a magic
// link and never onto another mount (the sandbox's /proc, /sys, /dev),
// so a path the agent planted never leads the worker to a host file.
// What it makes belongs to the sandbox's root; ids it is given are the
// sandbox's and map to the host's ids of a --userns sandbox.
type hostFiles struct {
	ids0 *container.IDMap // the sandbox's ids (nil: the host's)
	root int              // O_PATH descriptor of the sandbox's root
	ids  *[2]int64        // host id of the sandbox's id 0 and the range's size; nil: the host's ids
}

var _ backend.Files = (*hostFiles)(nil)

const inRoot = unix.RESOLVE_IN_ROOT | unix.RESOLVE_NO_MAGICLINKS | unix.RESOLVE_NO_XDEV

// HostFiles opens the files of a running sandbox whose root the host
// sees at rootfs (composed there), as its processes resolve them; m
// are its ids (nil: the host's).
func HostFiles(rootfs string, m *container.IDMap) (backend.Files, error) {
	return openHostFiles(rootfs, m)
}

func openHostFiles(rootfs string, m *container.IDMap) (*hostFiles, error) {
	root, err := unix.Open(rootfs, unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, err
	}
	s := &hostFiles{ids0: m, root: root}
	if m != nil {
		s.ids = &[2]int64{int64(m.Host), int64(m.Size)}
	}
	return s, nil
}

func (s *hostFiles) Close() error { return unix.Close(s.root) }

// kernelViews are the sandbox's mounts of its kernel's views: the
// worker sees only the directories under them, so a copy there would
// not be what the sandbox sees.
var kernelViews = map[string]bool{"proc": true, "sys": true, "dev": true}

// open resolves name inside the root.
func (s *hostFiles) open(op, name string, flags int, mode uint32) (int, error) {
	if top, _, _ := strings.Cut(path.Clean("/" + name)[1:], "/"); kernelViews[top] {
		return -1, &fs.PathError{Op: op, Path: "/" + name, Err: unix.EXDEV}
	}
	how := &unix.OpenHow{Flags: uint64(flags | unix.O_CLOEXEC), Mode: uint64(mode), Resolve: inRoot}
	for tries := 0; ; tries++ {
		fd, err := unix.Openat2(s.root, "/"+name, how)
		// EAGAIN: a rename or mount anywhere on the host raced a ".." of
		// the path, and the kernel could not be sure it stayed inside:
		// asked again, as openat2(2) says (a busy host's renames are
		// many; an agent cannot keep this up for long on its own).
		if err == unix.EAGAIN && tries < 128 {
			continue
		}
		if err != nil {
			return -1, &fs.PathError{Op: op, Path: "/" + name, Err: err}
		}
		return fd, nil
	}
}

// at resolves the directory of name inside the root and calls fn with
// it and name's last element ("." for the root itself).
func (s *hostFiles) at(op, name string, fn func(dir int, base string) error) error {
	dir, err := s.open(op, path.Dir(path.Clean("/" + name))[1:], unix.O_PATH|unix.O_DIRECTORY, 0)
	if err != nil {
		return err
	}
	defer unix.Close(dir)
	if err := fn(dir, path.Base(path.Clean("/"+name))); err != nil {
		return &fs.PathError{Op: op, Path: "/" + name, Err: err}
	}
	return nil
}

// onPath resolves name itself (a symlink is not followed) and calls fn
// with an O_PATH descriptor of it.
func (s *hostFiles) onPath(op, name string, fn func(fd int) error) error {
	fd, err := s.open(op, name, unix.O_PATH|unix.O_NOFOLLOW, 0)
	if err != nil {
		return err
	}
	defer unix.Close(fd)
	if err := fn(fd); err != nil {
		return &fs.PathError{Op: op, Path: "/" + name, Err: err}
	}
	return nil
}

func (s *hostFiles) stat(op, name string, flags int) (fs.FileInfo, error) {
	fd, err := s.open(op, name, unix.O_PATH|flags, 0)
	if err != nil {
		return nil, err
	}
	f := os.NewFile(uintptr(fd), "/"+name)
	defer f.Close()
	return f.Stat()
}

func (s *hostFiles) Lstat(name string) (fs.FileInfo, error) {
	return s.stat("lstat", name, unix.O_NOFOLLOW)
}

func (s *hostFiles) Stat(name string) (fs.FileInfo, error) { return s.stat("stat", name, 0) }

func (s *hostFiles) OpenFile(name string, flag int, perm fs.FileMode) (archive.File, error) {
	var fd int
	open := func() (err error) {
		fd, err = s.open("open", name, flag, uint32(perm.Perm()))
		return err
	}
	var err error
	if flag&os.O_CREATE != 0 { // what it makes is the sandbox root's
		err = idmap.AsRoot(s.ids0, open)
	} else {
		err = open()
	}
	if err != nil {
		return nil, err
	}
	return os.NewFile(uintptr(fd), "/"+name), nil
}

func (s *hostFiles) Readlink(name string) (string, error) {
	var target string
	return target, s.onPath("readlink", name, func(fd int) error {
		buf := make([]byte, unix.PathMax)
		n, err := unix.Readlinkat(fd, "", buf)
		target = string(buf[:max(n, 0)])
		return err
	})
}

func (s *hostFiles) Mkdir(name string, perm fs.FileMode) error {
	return s.at("mkdir", name, func(dir int, base string) error {
		return idmap.AsRoot(s.ids0, func() error { return unix.Mkdirat(dir, base, uint32(perm.Perm())) })
	})
}

func (s *hostFiles) Symlink(oldname, newname string) error {
	return s.at("symlink", newname, func(dir int, base string) error {
		return idmap.AsRoot(s.ids0, func() error { return unix.Symlinkat(oldname, dir, base) })
	})
}

// Link links newname to oldname, both resolved inside the root; it
// runs as the host's root (linking by descriptor takes
// CAP_DAC_READ_SEARCH) and makes no inode, so no owner to get wrong.
func (s *hostFiles) Link(oldname, newname string) error {
	return s.onPath("link", oldname, func(old int) error {
		return s.at("link", newname, func(dir int, base string) error {
			return unix.Linkat(old, "", dir, base, unix.AT_EMPTY_PATH)
		})
	})
}

func (s *hostFiles) Remove(name string) error {
	return s.at("remove", name, func(dir int, base string) error {
		err := unix.Unlinkat(dir, base, 0)
		if err == unix.EISDIR {
			err = unix.Unlinkat(dir, base, unix.AT_REMOVEDIR)
		}
		return err
	})
}

func (s *hostFiles) Rename(oldname, newname string) error {
	return s.at("rename", oldname, func(odir int, obase string) error {
		return s.at("rename", newname, func(ndir int, nbase string) error {
			return unix.Renameat(odir, obase, ndir, nbase)
		})
	})
}

// Lchown gives name to the sandbox's uid and gid (not the host's).
func (s *hostFiles) Lchown(name string, uid, gid int) error {
	if s.ids != nil {
		if int64(uid) >= s.ids[1] || int64(gid) >= s.ids[1] || uid < 0 || gid < 0 {
			return &fs.PathError{Op: "chown", Path: "/" + name, Err: unix.EINVAL}
		}
		uid, gid = int(s.ids[0])+uid, int(s.ids[0])+gid
	}
	return s.onPath("chown", name, func(fd int) error {
		return unix.Fchownat(fd, "", uid, gid, unix.AT_EMPTY_PATH|unix.AT_SYMLINK_NOFOLLOW)
	})
}

// Chmod changes name's mode; name is not followed if it is a symlink
// (fchmodat2 refuses to change a link, whose mode means nothing).
func (s *hostFiles) Chmod(name string, mode fs.FileMode) error {
	m := uint32(archive.PermBits(mode))
	return s.onPath("chmod", name, func(fd int) error { return unix.Fchmodat(fd, "", m, unix.AT_EMPTY_PATH) })
}

func (s *hostFiles) Chtimes(name string, atime, mtime time.Time) error {
	return s.onPath("chtimes", name, func(fd int) error {
		ts := []unix.Timespec{unix.NsecToTimespec(atime.UnixNano()), unix.NsecToTimespec(mtime.UnixNano())}
		return unix.UtimesNanoAt(fd, "", ts, unix.AT_EMPTY_PATH|unix.AT_SYMLINK_NOFOLLOW)
	})
}

// IDs maps a --userns sandbox's host ids to the ids its processes see
// (the host's overflow id 65534 for one outside its range).
func (s *hostFiles) IDs() archive.IDMap {
	if s.ids == nil {
		return nil
	}
	base, size := s.ids[0], s.ids[1]
	in := func(id int) int {
		if v := int64(id) - base; v >= 0 && v < size {
			return int(v)
		}
		return 65534
	}
	return func(uid, gid int) (int, int) { return in(uid), in(gid) }
}
