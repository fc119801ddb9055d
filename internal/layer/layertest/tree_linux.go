package layertest

import (
	"fmt"
	"hash/crc32"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strings"
	"testing"

	"github.com/erofs/go-erofs"
	"golang.org/x/sys/unix"
)

// Entry is what a tree comparison looks at for one path.
type Entry struct {
	Type      string // dir, reg, symlink, char, block, fifo, socket
	Perm      uint32 // mode & 07777
	UID, GID  uint32
	Size      int64  // regular files only
	Sum       string // CRC-32C of the content
	Target    string
	Rdev      string // major:minor of char and block devices
	Mtime     int64
	MtimeNsec int64
	Xattrs    map[string]string
	Link      string // first path (in byte order) sharing this inode
}

// Tree maps slash-separated paths ("" is the root) to entries.
type Tree map[string]Entry

func typeOf(mode uint32) string {
	switch mode & unix.S_IFMT {
	case unix.S_IFDIR:
		return "dir"
	case unix.S_IFREG:
		return "reg"
	case unix.S_IFLNK:
		return "symlink"
	case unix.S_IFCHR:
		return "char"
	case unix.S_IFBLK:
		return "block"
	case unix.S_IFIFO:
		return "fifo"
	case unix.S_IFSOCK:
		return "socket"
	}
	return "unknown"
}

// hashReader sums content with CRC-32C: hardware-accelerated, so
// comparing multi-GiB sparse files stays fast; tests need no
// cryptographic strength.
func hashReader(r io.Reader) (int64, string, error) {
	h := crc32.New(crc32.MakeTable(crc32.Castagnoli))
	n, err := io.CopyBuffer(h, r, make([]byte, 1<<20))
	return n, fmt.Sprintf("%08x", h.Sum32()), err
}

// linkGroups fills Link for entries that share an inode.
func linkGroups(t Tree, ids map[string]string) {
	groups := map[string][]string{}
	for p, id := range ids {
		groups[id] = append(groups[id], p)
	}
	for _, ps := range groups {
		if len(ps) < 2 {
			continue
		}
		slices.Sort(ps)
		for _, p := range ps {
			e := t[p]
			e.Link = ps[0]
			t[p] = e
		}
	}
}

// ScanDir reads a tree from the host (or a kernel mount) with lstat and
// lgetxattr, never following symlinks.
func ScanDir(tb testing.TB, root string) Tree {
	tb.Helper()
	t := Tree{}
	ids := map[string]string{}
	err := filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(root, p)
		if rel == "." {
			rel = ""
		}
		var st unix.Stat_t
		if err := unix.Lstat(p, &st); err != nil {
			return err
		}
		e := Entry{Type: typeOf(st.Mode), Perm: st.Mode & 0o7777, UID: st.Uid, GID: st.Gid,
			Mtime: st.Mtim.Sec, MtimeNsec: st.Mtim.Nsec, Xattrs: hostXattrs(tb, p)}
		switch e.Type {
		case "reg":
			f, err := os.Open(p)
			if err != nil {
				return err
			}
			e.Size, e.Sum, err = hashReader(f)
			f.Close()
			if err != nil {
				return err
			}
			if st.Nlink > 1 {
				ids[rel] = fmt.Sprint(st.Dev, ":", st.Ino)
			}
		case "symlink":
			e.Target, err = os.Readlink(p)
			if err != nil {
				return err
			}
		case "char", "block":
			e.Rdev = fmt.Sprintf("%d:%d", unix.Major(st.Rdev), unix.Minor(st.Rdev))
		}
		t[rel] = e
		return nil
	})
	if err != nil {
		tb.Fatalf("scan %s: %v", root, err)
	}
	linkGroups(t, ids)
	return t
}

func hostXattrs(tb testing.TB, p string) map[string]string {
	buf := make([]byte, 64<<10)
	n, err := unix.Llistxattr(p, buf)
	if err != nil || n == 0 {
		return nil
	}
	out := map[string]string{}
	for _, name := range strings.Split(strings.TrimRight(string(buf[:n]), "\x00"), "\x00") {
		v := make([]byte, 64<<10)
		m, err := unix.Lgetxattr(p, name, v)
		if err != nil {
			tb.Fatalf("lgetxattr %s %s: %v", p, name, err)
		}
		out[name] = string(v[:m])
	}
	return out
}

// ScanEROFS reads a tree from an image with go-erofs, the independent
// reader every image this project writes is checked against.
func ScanEROFS(tb testing.TB, image string) Tree {
	tb.Helper()
	f, err := os.Open(image)
	if err != nil {
		tb.Fatal(err)
	}
	defer f.Close()
	fsys, err := erofs.Open(f)
	if err != nil {
		tb.Fatalf("go-erofs: open %s: %v", image, err)
	}
	t := Tree{}
	ids := map[string]string{}
	err = fs.WalkDir(fsys, ".", func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		info, err := fs.Lstat(fsys, p)
		if err != nil {
			return err
		}
		st, ok := info.Sys().(*erofs.Stat)
		if !ok {
			return fmt.Errorf("%s: no erofs.Stat", p)
		}
		rel := p
		if rel == "." {
			rel = ""
		}
		mode := unixMode(st.Mode)
		e := Entry{Type: typeOf(mode), Perm: mode & 0o7777, UID: st.UID, GID: st.GID,
			Mtime: int64(st.Mtime), MtimeNsec: int64(st.MtimeNs)}
		if len(st.Xattrs) > 0 {
			e.Xattrs = map[string]string{}
			for k, v := range st.Xattrs {
				// go-erofs v0.3.1 names ACLs with the prefix of the other
				// namespaces, a trailing dot included.
				if k == "system.posix_acl_access." || k == "system.posix_acl_default." {
					k = k[:len(k)-1]
				}
				e.Xattrs[k] = v
			}
		}
		switch e.Type {
		case "reg":
			r, err := fsys.Open(p)
			if err != nil {
				return err
			}
			e.Size, e.Sum, err = hashReader(r)
			r.Close()
			if err != nil {
				return err
			}
			if st.Nlink > 1 {
				ids[rel] = fmt.Sprint(st.Ino)
			}
		case "symlink":
			e.Target, err = fs.ReadLink(fsys, p)
			if err != nil {
				return err
			}
		case "char", "block":
			d := st.Rdev // the kernel's new_encode_dev
			e.Rdev = fmt.Sprintf("%d:%d", (d&0xfff00)>>8, d&0xff|(d>>12)&0xfff00)
		}
		t[rel] = e
		return nil
	})
	if err != nil {
		tb.Fatalf("go-erofs: walk %s: %v", image, err)
	}
	linkGroups(t, ids)
	return t
}

// Diff lists the differences between want and got, one line each.
func Diff(want, got Tree) []string {
	var out []string
	keys := map[string]bool{}
	for k := range want {
		keys[k] = true
	}
	for k := range got {
		keys[k] = true
	}
	sorted := make([]string, 0, len(keys))
	for k := range keys {
		sorted = append(sorted, k)
	}
	sort.Strings(sorted)
	for _, k := range sorted {
		w, inW := want[k]
		g, inG := got[k]
		switch {
		case !inW:
			out = append(out, fmt.Sprintf("%q: unexpected %s", k, g.Type))
		case !inG:
			out = append(out, fmt.Sprintf("%q: missing %s", k, w.Type))
		default:
			if d := diffEntry(w, g); d != "" {
				out = append(out, fmt.Sprintf("%q: %s", k, d))
			}
		}
	}
	return out
}

func diffEntry(w, g Entry) string {
	var d []string
	f := func(name string, a, b any) {
		if fmt.Sprint(a) != fmt.Sprint(b) {
			d = append(d, fmt.Sprintf("%s %v != %v", name, a, b))
		}
	}
	f("type", w.Type, g.Type)
	f("perm", fmt.Sprintf("%o", w.Perm), fmt.Sprintf("%o", g.Perm))
	f("owner", fmt.Sprint(w.UID, ":", w.GID), fmt.Sprint(g.UID, ":", g.GID))
	f("size", w.Size, g.Size)
	f("content", w.Sum, g.Sum)
	f("target", w.Target, g.Target)
	f("rdev", w.Rdev, g.Rdev)
	f("mtime", fmt.Sprint(w.Mtime, ".", w.MtimeNsec), fmt.Sprint(g.Mtime, ".", g.MtimeNsec))
	f("xattrs", sortedMap(w.Xattrs), sortedMap(g.Xattrs))
	f("hardlink", w.Link, g.Link)
	return strings.Join(d, "; ")
}

func sortedMap(m map[string]string) string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	var b strings.Builder
	for _, k := range keys {
		fmt.Fprintf(&b, "%s=%q ", k, m[k])
	}
	return b.String()
}

// Paths lists a tree's paths in order, for messages.
func (t Tree) Paths() []string {
	out := make([]string, 0, len(t))
	for p := range t {
		out = append(out, p)
	}
	sort.Strings(out)
	return out
}

// Without returns a copy of t without p and anything below it.
func (t Tree) Without(p string) Tree {
	out := Tree{}
	for k, v := range t {
		if k == p || strings.HasPrefix(k, p+"/") {
			continue
		}
		out[k] = v
	}
	return out
}

// unixMode turns an fs.FileMode into stat(2) mode bits.
func unixMode(m fs.FileMode) uint32 {
	out := uint32(m.Perm())
	if m&fs.ModeSetuid != 0 {
		out |= unix.S_ISUID
	}
	if m&fs.ModeSetgid != 0 {
		out |= unix.S_ISGID
	}
	if m&fs.ModeSticky != 0 {
		out |= unix.S_ISVTX
	}
	switch {
	case m&fs.ModeDir != 0:
		out |= unix.S_IFDIR
	case m&fs.ModeSymlink != 0:
		out |= unix.S_IFLNK
	case m&fs.ModeCharDevice != 0:
		out |= unix.S_IFCHR
	case m&fs.ModeDevice != 0:
		out |= unix.S_IFBLK
	case m&fs.ModeNamedPipe != 0:
		out |= unix.S_IFIFO
	case m&fs.ModeSocket != 0:
		out |= unix.S_IFSOCK
	default:
		out |= unix.S_IFREG
	}
	return out
}
