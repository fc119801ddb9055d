// Package archive moves trees as tar streams between two file systems
// that each resolve every name inside a root: the host's (an *os.Root)
// and a sandbox's (the worker's openat2 view of it). It is dsec cp's
// transport; the path rules (docker cp's) are the caller's, through
// Plan.
//
// An archive from the other side is untrusted: an entry never lands
// outside the directory it is extracted into, whatever its name, its
// link target or the symlinks already there (the FS refuses or confines
// them), and a regular file replaces its target only once it is whole.
package archive

import (
	"archive/tar"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path"
	"slices"
	"strings"
	"syscall"
	"time"

	"github.com/containerd/errdefs"
	"golang.org/x/sys/unix"

	"github.com/dsec-project/dsec/api"
)

// FS is a file system whose names (slash-separated, relative to its
// root) never resolve outside it: an *os.Root as Root, a sandbox's
// files as its worker reaches them.
type FS interface {
	Lstat(name string) (fs.FileInfo, error)
	Stat(name string) (fs.FileInfo, error)
	OpenFile(name string, flag int, perm fs.FileMode) (File, error)
	Readlink(name string) (string, error)
	Mkdir(name string, perm fs.FileMode) error
	Symlink(oldname, newname string) error
	Link(oldname, newname string) error
	Remove(name string) error
	Rename(oldname, newname string) error
	Lchown(name string, uid, gid int) error
	Chmod(name string, mode fs.FileMode) error
	Chtimes(name string, atime, mtime time.Time) error
}

// File is an open file of an FS: an *os.File, or one a VM's agent holds.
type File interface {
	io.Reader
	io.Writer
	io.Closer
	Stat() (fs.FileInfo, error)
	Chmod(mode fs.FileMode) error
	Readdirnames(n int) ([]string, error)
}

// Root is an *os.Root as an FS.
type Root struct{ *os.Root }

func (r Root) OpenFile(name string, flag int, perm fs.FileMode) (File, error) {
	f, err := r.Root.OpenFile(name, flag, perm)
	if err != nil {
		return nil, err
	}
	return f, nil
}

// IDMap translates owner ids between two sides (nil: the same ids).
type IDMap func(uid, gid int) (int, int)

// WriteOptions shape the archive Write makes.
type WriteOptions struct {
	// Name is the top entry's name; "." puts a directory's entries at
	// the top (docker cp's SRC/.). Empty: the source's base name.
	Name string
	// Follow follows a symlink at the source itself (cp -L); links
	// below it are always archived as links.
	Follow bool
	// IDs maps the FS's owners to the archive's.
	IDs IDMap
}

// Write writes the tree at src (a file, a link or a directory) to w as
// a tar stream and closes the stream.
func Write(w io.Writer, fsys FS, src string, o WriteOptions) ([]api.Skipped, error) {
	name := o.Name
	if name == "" {
		name = path.Base(src)
	}
	fi, err := fsys.Lstat(src)
	if err == nil && o.Follow && fi.Mode()&fs.ModeSymlink != 0 {
		fi, err = fsys.Stat(src)
	}
	if err != nil {
		return nil, err
	}
	wr := &writer{tw: tar.NewWriter(w), fsys: fsys, ids: o.IDs, links: map[[4]uint64]string{}}
	if fi.IsDir() && name == "." {
		err = wr.dirEntries(src, "", fi, o.Follow)
	} else {
		err = wr.entry(src, name, fi, o.Follow)
	}
	if err == nil {
		err = wr.tw.Close()
	}
	return wr.skipped, err
}

type writer struct {
	tw      *tar.Writer
	fsys    FS
	ids     IDMap
	links   map[[4]uint64]string // a linked file's identity -> its first name
	skipped []api.Skipped
}

// entry archives src under the archive name name. follow: src is the
// copy's source and a symlink there was followed.
func (wr *writer) entry(src, name string, fi fs.FileInfo, follow bool) error {
	hdr := &tar.Header{Name: name, ModTime: fi.ModTime().Truncate(time.Second), Mode: PermBits(fi.Mode()), Format: tar.FormatPAX}
	if st, ok := fi.Sys().(*syscall.Stat_t); ok {
		hdr.Uid, hdr.Gid = int(st.Uid), int(st.Gid)
		if wr.ids != nil {
			hdr.Uid, hdr.Gid = wr.ids(hdr.Uid, hdr.Gid)
		}
	}
	switch m := fi.Mode(); {
	case m&fs.ModeSymlink != 0:
		target, err := wr.fsys.Readlink(src)
		if err != nil {
			return wr.vanished(src, err)
		}
		hdr.Typeflag, hdr.Linkname = tar.TypeSymlink, target
		return wr.tw.WriteHeader(hdr)
	case m.IsDir():
		hdr.Typeflag, hdr.Name = tar.TypeDir, name+"/"
		if err := wr.tw.WriteHeader(hdr); err != nil {
			return err
		}
		return wr.dirEntries(src, name, fi, follow)
	case m.IsRegular():
		return wr.file(src, hdr, follow)
	case m&fs.ModeNamedPipe != 0:
		hdr.Typeflag = tar.TypeFifo
		return wr.tw.WriteHeader(hdr)
	case m&fs.ModeDevice != 0:
		hdr.Typeflag = tar.TypeBlock
		if m&fs.ModeCharDevice != 0 {
			hdr.Typeflag = tar.TypeChar
		}
		if st, ok := fi.Sys().(*syscall.Stat_t); ok {
			hdr.Devmajor, hdr.Devminor = int64(unix.Major(uint64(st.Rdev))), int64(unix.Minor(uint64(st.Rdev)))
		}
		return wr.tw.WriteHeader(hdr)
	default:
		wr.skipped = append(wr.skipped, api.Skipped{Name: name, Reason: "a socket"})
		return nil
	}
}

// file archives a regular file: as a hard link to a name archived
// already when it is one, else its bytes, read from the descriptor
// whose stat the header takes (the agent may swap the name meanwhile).
func (wr *writer) file(src string, hdr *tar.Header, follow bool) error {
	flag := os.O_RDONLY | syscall.O_NONBLOCK
	if !follow {
		flag |= syscall.O_NOFOLLOW
	}
	f, err := wr.fsys.OpenFile(src, flag, 0)
	if err != nil {
		return wr.vanished(hdr.Name, err)
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		return err
	}
	if !fi.Mode().IsRegular() {
		wr.skipped = append(wr.skipped, api.Skipped{Name: hdr.Name, Reason: "changed while it was copied"})
		return nil
	}
	hdr.Typeflag, hdr.Size, hdr.Mode, hdr.ModTime = tar.TypeReg, fi.Size(), PermBits(fi.Mode()), fi.ModTime().Truncate(time.Second)
	if st, ok := fi.Sys().(*syscall.Stat_t); ok && st.Nlink > 1 {
		// Device and inode, and size and time: an overlay of layers on
		// several file systems (xino off) may give two files one inode
		// number.
		id := [4]uint64{uint64(st.Dev), uint64(st.Ino), uint64(fi.Size()), uint64(fi.ModTime().UnixNano())}
		if first, ok := wr.links[id]; ok {
			hdr.Typeflag, hdr.Linkname, hdr.Size = tar.TypeLink, first, 0
			return wr.tw.WriteHeader(hdr)
		}
		wr.links[id] = hdr.Name
	}
	if err := wr.tw.WriteHeader(hdr); err != nil {
		return err
	}
	n, err := io.Copy(wr.tw, io.LimitReader(f, hdr.Size))
	if err == nil && n < hdr.Size {
		err = fmt.Errorf("%s shrank while it was copied", hdr.Name)
	}
	return err
}

// dirEntries archives the entries of the directory src under prefix.
// The directory is read whole and closed before any entry is visited,
// so a deep tree holds one descriptor at a time.
func (wr *writer) dirEntries(src, prefix string, fi fs.FileInfo, follow bool) error {
	flag := os.O_RDONLY | syscall.O_DIRECTORY | syscall.O_NONBLOCK
	if !follow {
		flag |= syscall.O_NOFOLLOW
	}
	d, err := wr.fsys.OpenFile(src, flag, 0)
	if err != nil {
		return wr.vanished(prefix, err)
	}
	names, err := d.Readdirnames(-1)
	d.Close()
	if err != nil {
		return err
	}
	slices.Sort(names)
	for _, n := range names {
		p, a := path.Join(src, n), path.Join(prefix, n)
		fi, err := wr.fsys.Lstat(p)
		if err != nil {
			if err := wr.vanished(a, err); err != nil {
				return err
			}
			continue
		}
		if err := wr.entry(p, a, fi, false); err != nil {
			return err
		}
	}
	return nil
}

// vanished turns the failure to open an entry that is gone or on
// another mount (EXDEV from a sandbox's FS) into a skip.
func (wr *writer) vanished(name string, err error) error {
	switch {
	case errors.Is(err, fs.ErrNotExist):
		wr.skipped = append(wr.skipped, api.Skipped{Name: name, Reason: "vanished while it was copied"})
	case errors.Is(err, syscall.EXDEV):
		wr.skipped = append(wr.skipped, api.Skipped{Name: name, Reason: "on another mount"})
	default:
		return err
	}
	return nil
}

// ExtractOptions shape what Extract makes.
type ExtractOptions struct {
	// Owners keeps the archive's owners (cp -a; the FS's Lchown maps
	// them where its ids differ); else what is made belongs to whoever
	// the FS makes files as.
	Owners bool
	// NoSetID clears the set-user-id and set-group-id bits.
	NoSetID bool
}

// Extract extracts the tar stream r into the directory dir of fsys, as
// docker cp does: directories merge, a file replaces a file (whole, by
// rename), and neither replaces the other.
func Extract(r io.Reader, fsys FS, dir string, o ExtractOptions) ([]api.Skipped, error) {
	fi, err := fsys.Stat(dir)
	if err != nil {
		return nil, err
	}
	if !fi.IsDir() {
		return nil, fmt.Errorf("%s is not a directory: %w", dir, errdefs.ErrInvalidArgument)
	}
	ex := &extractor{fsys: fsys, dir: dir, o: o}
	tr := tar.NewReader(r)
	for {
		hdr, err := tr.Next()
		if err == io.EOF {
			break
		}
		if err != nil {
			return ex.skipped, fmt.Errorf("read the archive: %v: %w", err, errdefs.ErrInvalidArgument)
		}
		if err := ex.entry(hdr, tr); err != nil {
			return ex.skipped, err
		}
	}
	// Directory modes and times last: a read-only directory takes its
	// entries first, and its time is not moved by them.
	for _, d := range slices.Backward(ex.dirs) {
		if err := fsys.Chmod(d.name, d.mode); err != nil {
			return ex.skipped, err
		}
		if err := fsys.Chtimes(d.name, d.mtime, d.mtime); err != nil {
			return ex.skipped, err
		}
	}
	return ex.skipped, nil
}

type extractor struct {
	fsys    FS
	dir     string
	o       ExtractOptions
	dirs    []dirMode
	skipped []api.Skipped
}

type dirMode struct {
	name  string
	mode  fs.FileMode
	mtime time.Time
}

// entryName cleans an archive entry's name, refusing one that climbs out of
// the directory the archive is extracted into.
func entryName(name string) (string, error) {
	c := path.Clean(name)
	if path.IsAbs(c) || c == ".." || strings.HasPrefix(c, "../") {
		return "", fmt.Errorf("bad archive entry %q: names stay inside the archive: %w", name, errdefs.ErrInvalidArgument)
	}
	return c, nil
}

func (ex *extractor) entry(hdr *tar.Header, r io.Reader) error {
	rel, err := entryName(hdr.Name)
	if err != nil {
		return err
	}
	target := path.Join(ex.dir, rel)
	mode := fileMode(hdr.Mode)
	if ex.o.NoSetID {
		mode &^= fs.ModeSetuid | fs.ModeSetgid
	}
	existing, err := ex.fsys.Lstat(target)
	exists := err == nil
	if err != nil && !errors.Is(err, fs.ErrNotExist) {
		return err
	}
	if exists && existing.IsDir() != (hdr.Typeflag == tar.TypeDir) {
		what := "a directory"
		if !existing.IsDir() {
			what = "a file"
		}
		return fmt.Errorf("%s is %s: cp does not replace a directory with a file or a file with a directory; remove it first: %w", target, what, errdefs.ErrAlreadyExists)
	}
	switch hdr.Typeflag {
	case tar.TypeDir:
		if rel == "." { // the directory extracted into: not the archive's to change
			return nil
		}
		if !exists {
			if err := ex.fsys.Mkdir(target, 0o700); err != nil {
				return err
			}
		}
		if err := ex.chown(target, hdr); err != nil {
			return err
		}
		ex.dirs = append(ex.dirs, dirMode{target, mode, hdr.ModTime})
		return nil
	case tar.TypeReg:
		return ex.file(target, hdr, mode, r)
	case tar.TypeSymlink, tar.TypeLink:
		if exists {
			if err := ex.fsys.Remove(target); err != nil {
				return err
			}
		}
		if hdr.Typeflag == tar.TypeSymlink {
			err = ex.fsys.Symlink(hdr.Linkname, target)
		} else if old, nerr := entryName(hdr.Linkname); nerr != nil {
			err = nerr
		} else {
			err = ex.fsys.Link(path.Join(ex.dir, old), target)
		}
		if err != nil {
			return err
		}
		if hdr.Typeflag == tar.TypeSymlink {
			return ex.chown(target, hdr)
		}
		return nil
	default:
		ex.skipped = append(ex.skipped, api.Skipped{Name: rel, Reason: fmt.Sprintf("a %s: cp makes files, directories and links only", typeName(hdr.Typeflag))})
		return nil
	}
}

// file writes a regular file under a temporary name beside its target
// and renames it over the target once whole.
func (ex *extractor) file(target string, hdr *tar.Header, mode fs.FileMode, r io.Reader) error {
	var rnd [6]byte
	rand.Read(rnd[:])
	tmp := path.Join(path.Dir(target), ".dsec-cp-"+hex.EncodeToString(rnd[:]))
	f, err := ex.fsys.OpenFile(tmp, os.O_WRONLY|os.O_CREATE|os.O_EXCL|syscall.O_NOFOLLOW, 0o600)
	if err != nil {
		return err
	}
	_, err = io.Copy(f, r)
	if err == nil {
		err = ex.chown(tmp, hdr) // before the mode: a chown clears set-id bits
	}
	if err == nil {
		err = f.Chmod(mode) // past the umask
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = ex.fsys.Chtimes(tmp, hdr.ModTime, hdr.ModTime)
	}
	if err == nil {
		err = ex.fsys.Rename(tmp, target)
	}
	if err != nil {
		ex.fsys.Remove(tmp)
	}
	return err
}

func (ex *extractor) chown(name string, hdr *tar.Header) error {
	if !ex.o.Owners {
		return nil
	}
	return ex.fsys.Lchown(name, hdr.Uid, hdr.Gid)
}

func typeName(t byte) string {
	switch t {
	case tar.TypeChar:
		return "character device"
	case tar.TypeBlock:
		return "block device"
	case tar.TypeFifo:
		return "fifo"
	}
	return fmt.Sprintf("tar entry of type %q", t)
}

// PermBits are m's permission, set-id and sticky bits as tar headers
// and chmod(2) have them (07777).
func PermBits(m fs.FileMode) int64 {
	v := int64(m.Perm())
	if m&fs.ModeSetuid != 0 {
		v |= 0o4000
	}
	if m&fs.ModeSetgid != 0 {
		v |= 0o2000
	}
	if m&fs.ModeSticky != 0 {
		v |= 0o1000
	}
	return v
}

func fileMode(v int64) fs.FileMode {
	m := fs.FileMode(v) & fs.ModePerm
	if v&0o4000 != 0 {
		m |= fs.ModeSetuid
	}
	if v&0o2000 != 0 {
		m |= fs.ModeSetgid
	}
	if v&0o1000 != 0 {
		m |= fs.ModeSticky
	}
	return m
}

// Plan applies docker cp's path rules to a copy of src (a directory
// when srcDir) to dst (what is there: dstExists, dstDir). It returns
// the directory to extract into and the name the source's top entry
// takes there ("." for a directory's entries: SRC/. onto a directory).
//
//	a file onto a directory      DST/base(SRC)
//	a file onto a file           replaces it
//	a file onto nothing          DST, unless DST ends in / (then an error)
//	a directory onto a directory DST/base(SRC); SRC/. merges its entries into DST
//	a directory onto a file      an error
//	a directory onto nothing     DST, a copy of it
func Plan(src string, srcDir bool, dst string, dstExists, dstDir bool) (dir, name string, err error) {
	if assertsDir(src) && !srcDir {
		return "", "", fmt.Errorf("%s is not a directory: %w", src, errdefs.ErrInvalidArgument)
	}
	cleanDst := path.Clean(dst)
	switch {
	case dstExists && dstDir:
		if srcDir && (strings.HasSuffix(src, "/.") || path.Clean(src) == "/") {
			return dst, ".", nil
		}
		return dst, path.Base(path.Clean(src)), nil
	case dstExists && srcDir:
		return "", "", fmt.Errorf("cannot copy directory %s onto file %s: %w", src, dst, errdefs.ErrAlreadyExists)
	case dstExists:
		return path.Dir(cleanDst), path.Base(cleanDst), nil
	case !srcDir && assertsDir(dst):
		return "", "", fmt.Errorf("directory %s does not exist: make it first, or name the file without a trailing /: %w", dst, errdefs.ErrNotFound)
	}
	return path.Dir(cleanDst), path.Base(cleanDst), nil
}

func assertsDir(p string) bool {
	return strings.HasSuffix(p, "/") || strings.HasSuffix(p, "/.") || p == "."
}
