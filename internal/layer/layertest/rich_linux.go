package layertest

import (
	"github.com/dsec-project/dsec/internal/testenv"

	"archive/tar"
	"bytes"
	"encoding/binary"
	"errors"
	"io"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// RequireRoot skips a test that needs root, saying so loudly. dsec's CI
// runs as root, so there these tests always run.
func RequireRoot(tb testing.TB) {
	tb.Helper()
	testenv.RequireRoot(tb, "mknod, chown, trusted.* xattrs, mount")
}

// Options select the optional parts of a rich tree.
type Options struct {
	Sockets bool // a unix socket (tar cannot carry one)
}

func must(tb testing.TB, err error) {
	tb.Helper()
	if err != nil {
		tb.Fatal(err)
	}
}

// capV2 is a security.capability value granting cap_net_bind_service.
func capV2() []byte {
	b := make([]byte, 20)
	binary.LittleEndian.PutUint32(b[0:], 0x02000000|1) // revision 2, effective
	binary.LittleEndian.PutUint32(b[4:], 1<<10)        // permitted: CAP_NET_BIND_SERVICE
	return b
}

// aclAccess is a system.posix_acl_access value: u::rw-,u:1000:r--,g::r--,m::r--,o::---.
func aclAccess() []byte {
	var b bytes.Buffer
	le := binary.LittleEndian
	binary.Write(&b, le, uint32(2))
	for _, e := range []struct {
		tag, perm uint16
		id        uint32
	}{{1, 6, 0xffffffff}, {2, 4, 1000}, {4, 4, 0xffffffff}, {0x10, 4, 0xffffffff}, {0x20, 0, 0xffffffff}} {
		binary.Write(&b, le, e.tag)
		binary.Write(&b, le, e.perm)
		binary.Write(&b, le, e.id)
	}
	return b.Bytes()
}

// MakeRich fills dir with every kind of entry a layer must preserve:
// setuid/setgid/sticky modes, large owners, nanosecond mtimes, user.,
// trusted., security. and ACL xattrs, hard links, symlinks (short, long,
// dangling), devices, fifos, whiteouts, an opaque directory, empty
// directories and files, a 255-byte name, a non-UTF-8 name, sparse files
// and a directory spanning several blocks. It needs root.
func MakeRich(tb testing.TB, dir string, o Options) {
	tb.Helper()
	RequireRoot(tb)
	file := func(p string, perm os.FileMode, data string) {
		full := filepath.Join(dir, p)
		must(tb, os.MkdirAll(filepath.Dir(full), 0o755))
		must(tb, os.WriteFile(full, []byte(data), perm))
		must(tb, os.Chmod(full, perm))
	}
	mkdir := func(p string, perm os.FileMode) {
		full := filepath.Join(dir, p)
		must(tb, os.MkdirAll(full, 0o755))
		must(tb, os.Chmod(full, perm))
	}
	chown := func(p string, uid, gid int) { must(tb, os.Lchown(filepath.Join(dir, p), uid, gid)) }
	xattr := func(p, name string, v []byte) { must(tb, unix.Lsetxattr(filepath.Join(dir, p), name, v, 0)) }
	node := func(p string, mode uint32, dev uint64) {
		full := filepath.Join(dir, p)
		must(tb, os.MkdirAll(filepath.Dir(full), 0o755))
		must(tb, unix.Mknod(full, mode, int(dev)))
	}
	symlink := func(target, p string) {
		full := filepath.Join(dir, p)
		must(tb, os.MkdirAll(filepath.Dir(full), 0o755))
		must(tb, os.Symlink(target, full))
	}

	file("bin/tool", 0o755, "#!/bin/sh\necho tool\n")
	must(tb, os.Chmod(filepath.Join(dir, "bin/tool"), os.ModeSetuid|0o755))
	xattr("bin/tool", "security.capability", capV2())
	file("etc/passwd", 0o644, "root:x:0:0:root:/root:/bin/sh\nagent:x:1000:1000::/home/agent:/bin/sh\n")
	xattr("etc/passwd", "user.note", []byte("hello"))
	xattr("etc/passwd", "user.big", bytes.Repeat([]byte("x"), 3000))
	xattr("etc/passwd", "trusted.dsec", []byte{0, 1, 2, 255})
	file("etc/acl", 0o640, "acl\n")
	xattr("etc/acl", "system.posix_acl_access", aclAccess())
	mkdir("home/agent", 0o700)
	file("home/agent/.bashrc", 0o600, "export PS1='$ '\n")
	chown("home/agent/.bashrc", 1000, 1000)
	chown("home/agent", 1000, 1000)
	mkdir("tmp", 0o777|os.ModeSticky)
	must(tb, os.Chmod(filepath.Join(dir, "tmp"), 0o777|os.ModeSticky))
	mkdir("data/shared", 0o775)
	must(tb, os.Chmod(filepath.Join(dir, "data/shared"), 0o775|os.ModeSetgid))
	chown("data/shared", 0, 50)
	file("data/big-owner", 0o644, "owned by a large id\n")
	chown("data/big-owner", 100000, 200000)

	file("links/a", 0o644, "linked content\n")
	must(tb, os.MkdirAll(filepath.Join(dir, "links/sub"), 0o755))
	must(tb, os.Link(filepath.Join(dir, "links/a"), filepath.Join(dir, "links/b")))
	must(tb, os.Link(filepath.Join(dir, "links/a"), filepath.Join(dir, "links/sub/c")))
	symlink("a", "links/sym")
	symlink("/etc/passwd", "links/abs")
	symlink("nowhere/at/all", "links/dangling")
	symlink(strings.Repeat("long/", 818), "links/long-target") // 4090 bytes: not inline

	node("dev/null", unix.S_IFCHR|0o666, unix.Mkdev(1, 3))
	node("dev/loop7", unix.S_IFBLK|0o660, unix.Mkdev(7, 7))
	node("dev/wide", unix.S_IFCHR|0o600, unix.Mkdev(511, 70000))
	node("run/fifo", unix.S_IFIFO|0o644, 0)
	if o.Sockets {
		node("run/sock", unix.S_IFSOCK|0o755, 0)
	}
	node("whiteouts/gone", unix.S_IFCHR, 0)
	mkdir("whiteouts/opaque", 0o755)
	xattr("whiteouts/opaque", "trusted.overlay.opaque", []byte("y"))
	file("whiteouts/opaque/kept", 0o644, "new\n")

	mkdir("empty", 0o755)
	file("empty-file", 0o644, "")
	file("n/"+strings.Repeat("a", 255), 0o644, "long name\n")
	file("n/\xff\xfe-not-utf8", 0o644, "bytes\n")
	file("sizes/4096", 0o644, string(bytes.Repeat([]byte{'a'}, 4096)))
	file("sizes/4097", 0o644, string(bytes.Repeat([]byte{'b'}, 4097)))
	file("sizes/1MiB+1", 0o644, string(bytes.Repeat([]byte{'c'}, 1<<20+1)))
	zeros := make([]byte, 3<<20)
	zeros[len(zeros)-1] = 'z'
	file("sizes/zero-run", 0o644, string(zeros)) // holes written by content, not seek
	for i := 0; i < 300; i++ {
		file(filepath.Join("many", strings.Repeat("f", 40)+string(rune('a'+i%26))+string(rune('a'+i/26))), 0o644, "x")
	}
	sparse := func(p string, size int64, at ...int64) {
		f, err := os.Create(filepath.Join(dir, p))
		must(tb, err)
		defer f.Close()
		must(tb, f.Truncate(size))
		for _, off := range at {
			_, err := f.WriteAt([]byte("data@"+time.Duration(off).String()), off)
			must(tb, err)
		}
	}
	sparse("sparse", 64<<20, 0, 40<<20, 64<<20-20)
	SetMtimes(tb, dir)
}

// SetMtimes gives every entry below dir (and dir) a distinct mtime with
// nanoseconds, children before parents so the parents' stick.
func SetMtimes(tb testing.TB, dir string) {
	tb.Helper()
	must(tb, Touch(dir))
}

// Touch is SetMtimes for callers without a testing.TB.
func Touch(dir string) error {
	var paths []string
	err := filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		paths = append(paths, p)
		return err
	})
	if err != nil {
		return err
	}
	sort.Sort(sort.Reverse(sort.StringSlice(paths)))
	for i, p := range paths {
		ts := []unix.Timespec{{Sec: 1700000000 + int64(i), Nsec: 123456789}, {Sec: 1700000000 + int64(i), Nsec: 987654321}}
		if err := unix.UtimesNanoAt(unix.AT_FDCWD, p, ts, unix.AT_SYMLINK_NOFOLLOW); err != nil {
			return err
		}
	}
	return nil
}

// WriteTar writes dir as a PAX tar in the order the directory walker uses
// (depth first, names in byte order), with xattrs, nanosecond mtimes,
// hard links and devices. Sockets are left out: tar cannot hold them.
func WriteTar(tb testing.TB, dir string, w io.Writer) {
	tb.Helper()
	tw := tar.NewWriter(w)
	links := map[[2]uint64]string{}
	must(tb, filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(dir, p)
		var st unix.Stat_t
		must(tb, unix.Lstat(p, &st))
		h := &tar.Header{Name: rel, Mode: int64(st.Mode & 0o7777), Uid: int(st.Uid), Gid: int(st.Gid),
			ModTime: time.Unix(st.Mtim.Sec, st.Mtim.Nsec), Format: tar.FormatPAX, PAXRecords: map[string]string{}}
		if rel == "." {
			h.Name = "./"
		}
		for k, v := range hostXattrs(tb, p) {
			h.PAXRecords["SCHILY.xattr."+k] = v
		}
		var body io.Reader
		switch st.Mode & unix.S_IFMT {
		case unix.S_IFDIR:
			h.Typeflag = tar.TypeDir
			if rel != "." {
				h.Name += "/"
			}
		case unix.S_IFREG:
			key := [2]uint64{st.Dev, st.Ino}
			if first, ok := links[key]; ok && st.Nlink > 1 {
				h.Typeflag, h.Linkname = tar.TypeLink, first
				break
			}
			links[key] = rel
			h.Typeflag, h.Size = tar.TypeReg, st.Size
			f, err := os.Open(p)
			must(tb, err)
			defer f.Close()
			body = f
		case unix.S_IFLNK:
			target, err := os.Readlink(p)
			must(tb, err)
			h.Typeflag, h.Linkname = tar.TypeSymlink, target
		case unix.S_IFCHR, unix.S_IFBLK:
			h.Typeflag = tar.TypeChar
			if st.Mode&unix.S_IFMT == unix.S_IFBLK {
				h.Typeflag = tar.TypeBlock
			}
			h.Devmajor, h.Devminor = int64(unix.Major(st.Rdev)), int64(unix.Minor(st.Rdev))
		case unix.S_IFIFO:
			h.Typeflag = tar.TypeFifo
		default:
			return nil
		}
		must(tb, tw.WriteHeader(h))
		if body != nil {
			_, err := io.Copy(tw, body)
			must(tb, err)
		}
		return nil
	}))
	must(tb, tw.Close())
}

// BusyboxRoot fills dir with a root file system of Debian's
// busybox-static: /bin/busybox and a symlink per applet.
func BusyboxRoot(tb testing.TB, dir string) string {
	tb.Helper()
	must(tb, MakeBusyboxRoot(dir))
	return dir
}

// MakeBusyboxRoot is BusyboxRoot for callers without a testing.TB: a
// root with busybox and its applets' links in /bin and the usual empty
// mount points.
func MakeBusyboxRoot(dir string) error {
	bb, err := exec.LookPath("busybox")
	if err != nil {
		return errors.New("busybox-static is missing: make deps installs it")
	}
	b, err := os.ReadFile(bb)
	if err != nil {
		return err
	}
	for _, d := range []string{"bin", "etc", "proc", "sys", "dev", "tmp", "root"} {
		if err := os.MkdirAll(filepath.Join(dir, d), 0o755); err != nil {
			return err
		}
	}
	if err := os.WriteFile(filepath.Join(dir, "bin", "busybox"), b, 0o755); err != nil {
		return err
	}
	out, err := exec.Command(bb, "--list").Output()
	if err != nil {
		return err
	}
	for _, a := range strings.Fields(string(out)) {
		if a != "busybox" {
			if err := os.Symlink("busybox", filepath.Join(dir, "bin", a)); err != nil {
				return err
			}
		}
	}
	return nil
}
