package snap

import (
	"os"
	"path"
	"strings"

	"golang.org/x/sys/unix"
)

// tree is a directory tree looked up through its descriptor: no lookup
// follows a symlink on the way, nor leaves the tree or crosses a mount.
// The pristine layers a diff stands on hold symlinks of their own
// (/var/run -> /run), which a lookup by path would follow onto the
// host's files.
type tree struct{ fd int }

func openTree(dir string) (*tree, error) {
	fd, err := unix.Open(dir, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, &os.PathError{Op: "open", Path: dir, Err: err}
	}
	return &tree{fd}, nil
}

func (t *tree) close() {
	if t != nil && t.fd > 0 {
		unix.Close(t.fd)
		t.fd = 0
	}
}

var beneathHow = unix.RESOLVE_BENEATH | unix.RESOLVE_NO_SYMLINKS | unix.RESOLVE_NO_MAGICLINKS | unix.RESOLVE_NO_XDEV

// dir opens the directory rel of the tree ("" itself), through no
// symlink; flags O_PATH for a look-up only.
func (t *tree) dir(rel string, flags int) (int, error) {
	rel = strings.Trim(rel, "/")
	if rel == "" {
		rel = "."
	}
	return unix.Openat2(t.fd, rel, &unix.OpenHow{Flags: uint64(flags | unix.O_DIRECTORY | unix.O_CLOEXEC), Resolve: uint64(beneathHow)})
}

// lstat is rel's own stat (not what a symlink there names); false where
// the tree has no such path, or only through a symlink.
func (t *tree) lstat(rel string) (unix.Stat_t, bool) {
	var st unix.Stat_t
	rel = strings.Trim(rel, "/")
	if rel == "" {
		return st, unix.Fstat(t.fd, &st) == nil
	}
	parent, name := path.Split(rel)
	pfd, err := t.dir(parent, unix.O_PATH)
	if err != nil {
		return st, false
	}
	defer unix.Close(pfd)
	return st, unix.Fstatat(pfd, name, &st, unix.AT_SYMLINK_NOFOLLOW) == nil
}

// entry is a directory entry: its name and whether it is a directory.
type entry struct {
	name string
	dir  bool
}

// list lists the directory rel (nil: none there, or one only through a
// symlink).
func (t *tree) list(rel string) []entry {
	fd, err := t.dir(rel, unix.O_RDONLY)
	if err != nil {
		return nil
	}
	f := os.NewFile(uintptr(fd), rel)
	defer f.Close()
	ents, err := f.ReadDir(-1)
	if err != nil {
		return nil
	}
	out := make([]entry, len(ents))
	for i, e := range ents {
		out[i] = entry{e.Name(), e.IsDir()}
	}
	return out
}
