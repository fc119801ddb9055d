package initproto

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"net"
	"os"
	"path"
	"slices"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/dsec-project/dsec/internal/archive"
)

// The file protocol: a microVM's files as the worker reaches them (for
// cp, reading and writing files, listings), served by the guest's agent
// on a stream of its own (opFiles), one request at a time: a request
// frame (fsRequest), for a write a data frame after it, and a reply
// frame (fsReply), for a read a data frame after it. Names are relative
// to the sandbox's root, which is the guest's: nothing they resolve to
// is outside the sandbox. The agent keeps the files a stream opened by
// handle until the stream closes.

type fsRequest struct {
	Op    string `json:"op"`
	Name  string `json:"name,omitempty"`
	To    string `json:"to,omitempty"` // rename, link, symlink's new name
	Flag  int    `json:"flag,omitempty"`
	Perm  uint32 `json:"perm,omitempty"`
	UID   int    `json:"uid,omitempty"`
	GID   int    `json:"gid,omitempty"`
	Atime int64  `json:"atime,omitempty"`
	Mtime int64  `json:"mtime,omitempty"`
	H     int    `json:"h,omitempty"` // a file's handle
	N     int    `json:"n,omitempty"` // bytes to read, names to list
}

type fsReply struct {
	Errno  int      `json:"errno,omitempty"`
	Error  string   `json:"error,omitempty"`
	Stat   *fsStat  `json:"stat,omitempty"`
	H      int      `json:"h,omitempty"`
	Names  []string `json:"names,omitempty"`
	Target string   `json:"target,omitempty"`
	EOF    bool     `json:"eof,omitempty"`
}

// fsStat is a stat(2) of the guest's.
type fsStat struct {
	Mode  uint32 `json:"mode"` // st_mode
	Size  int64  `json:"size"`
	Mtime int64  `json:"mtime"` // ns
	UID   uint32 `json:"uid"`
	GID   uint32 `json:"gid"`
	Nlink uint64 `json:"nlink"`
	Dev   uint64 `json:"dev"`
	Ino   uint64 `json:"ino"`
	Rdev  uint64 `json:"rdev"`
}

// maxIO bounds a read or write request.
const maxIO = 1 << 20

// kernelView reports whether name is under the sandbox's /proc, /sys or
// /dev, which copies do not reach (as from a container's host side).
func kernelView(name string) bool {
	top, _, _ := strings.Cut(path.Clean("/" + name)[1:], "/")
	return top == "proc" || top == "sys" || top == "dev"
}

func statOf(fi fs.FileInfo) *fsStat {
	st := &fsStat{Size: fi.Size(), Mtime: fi.ModTime().UnixNano()}
	if s, ok := fi.Sys().(*syscall.Stat_t); ok {
		st.Mode, st.UID, st.GID, st.Nlink, st.Dev, st.Ino, st.Rdev = s.Mode, s.Uid, s.Gid, uint64(s.Nlink), s.Dev, s.Ino, s.Rdev
	}
	return st
}

// ServeFiles answers file requests on a stream until it closes (the
// guest's side).
func ServeFiles(st io.ReadWriteCloser, fr *FrameReader, fw *FrameWriter) {
	files := map[int]*os.File{}
	next := 1
	defer func() {
		for _, f := range files {
			f.Close()
		}
	}()
	buf := make([]byte, maxIO)
	for {
		kind, b, err := fr.Next()
		if err != nil || kind != FrameRequest {
			return
		}
		var q fsRequest
		if json.Unmarshal(b, &q) != nil {
			return
		}
		var data []byte
		if q.Op == "write" {
			k, d, err := fr.Next()
			if err != nil || k != FrameStdin {
				return
			}
			data = d
		}
		var r fsReply
		var out []byte
		p := "/" + q.Name
		err = nil
		named := []string{q.Name, q.To} // what the request changes or reads
		switch q.Op {
		case "symlink": // Name is the link's target, not a path it reaches
			named = named[1:]
		case "read", "write", "fstat", "fchmod", "readdirnames", "close":
			named = nil
		}
		if slices.ContainsFunc(named, func(n string) bool { return n != "" && kernelView(n) }) {
			err = &fs.PathError{Op: q.Op, Path: p, Err: syscall.EXDEV}
		} else {
			switch q.Op {
			case "lstat", "stat":
				var fi fs.FileInfo
				if q.Op == "lstat" {
					fi, err = os.Lstat(p)
				} else {
					fi, err = os.Stat(p)
				}
				if err == nil {
					r.Stat = statOf(fi)
				}
			case "open":
				var f *os.File
				if f, err = os.OpenFile(p, q.Flag, fs.FileMode(q.Perm)); err == nil {
					files[next], r.H = f, next
					next++
				}
			case "readlink":
				r.Target, err = os.Readlink(p)
			case "mkdir":
				err = os.Mkdir(p, fs.FileMode(q.Perm))
			case "symlink":
				err = os.Symlink(q.Name, "/"+q.To) // q.Name is the target, as given
			case "link":
				err = os.Link(p, "/"+q.To)
			case "remove":
				err = os.Remove(p)
			case "rename":
				err = os.Rename(p, "/"+q.To)
			case "lchown":
				err = os.Lchown(p, q.UID, q.GID)
			case "chmod":
				err = os.Chmod(p, fs.FileMode(q.Perm))
			case "chtimes":
				err = os.Chtimes(p, time.Unix(0, q.Atime), time.Unix(0, q.Mtime))
			case "read", "write", "fstat", "fchmod", "readdirnames", "close":
				out, err = onFile(files, q, data, buf, &r)
			default:
				err = fmt.Errorf("unknown file request %q", q.Op)
			}
		}
		if err != nil {
			r.Error = err.Error()
			var errno syscall.Errno
			if errors.As(err, &errno) {
				r.Errno = int(errno)
			}
		}
		if fw.JSON(FrameReply, r) != nil {
			return
		}
		if q.Op == "read" && r.Error == "" {
			if fw.Frame(FrameStdout, out) != nil {
				return
			}
		}
	}
}

// onFile answers q, a request on a file the stream opened (its handle
// q.H, data a write's): the reply's fields in r, a read's data in out,
// read into buf.
func onFile(files map[int]*os.File, q fsRequest, data, buf []byte, r *fsReply) (out []byte, err error) {
	f := files[q.H]
	if f == nil {
		return nil, fmt.Errorf("no open file %d", q.H)
	}
	switch q.Op {
	case "read":
		var n int
		n, err = f.Read(buf[:min(max(q.N, 1), maxIO)])
		out = buf[:n]
		if err == io.EOF {
			r.EOF, err = true, nil
		}
	case "write":
		_, err = f.Write(data)
	case "fstat":
		var fi fs.FileInfo
		if fi, err = f.Stat(); err == nil {
			r.Stat = statOf(fi)
		}
	case "fchmod":
		err = f.Chmod(fs.FileMode(q.Perm))
	case "readdirnames":
		r.Names, err = f.Readdirnames(q.N)
		if err == io.EOF {
			r.EOF, err = true, nil
		}
	case "close":
		err = f.Close()
		delete(files, q.H)
	}
	return out, err
}

// RemoteFiles are a microVM's files, reached through its agent: an
// archive.FS. Files it opens keep the connection until they close too.
type RemoteFiles struct {
	mu   sync.Mutex
	conn net.Conn
	fr   *FrameReader
	fw   *FrameWriter
	refs int // the FS and its open files
	ids  archive.IDMap
}

var _ archive.FS = (*RemoteFiles)(nil)

// DialFiles connects to the files socket of a microVM's shim.
func DialFiles(socket string) (*RemoteFiles, error) {
	c, err := net.Dial("unix", socket)
	if err != nil {
		return nil, fmt.Errorf("%w: %v", ErrSandboxDied, err)
	}
	return &RemoteFiles{conn: c, fr: NewFrameReader(c), fw: NewFrameWriter(c), refs: 1}, nil
}

// call sends q (and data, a write's) and returns the reply (and a read's
// data, valid until the next call; the caller holds c.mu).
func (c *RemoteFiles) call(q fsRequest, data []byte) (fsReply, []byte, error) {
	var r fsReply
	if err := c.fw.JSON(FrameRequest, q); err != nil {
		return r, nil, fmt.Errorf("%w: %v", ErrSandboxDied, err)
	}
	if q.Op == "write" {
		if err := c.fw.Frame(FrameStdin, data); err != nil {
			return r, nil, fmt.Errorf("%w: %v", ErrSandboxDied, err)
		}
	}
	kind, b, err := c.fr.Next()
	if err == nil && (kind != FrameReply || json.Unmarshal(b, &r) != nil) {
		err = errors.New("a reply that is none")
	}
	if err != nil {
		return r, nil, fmt.Errorf("%w: the guest's files: %v", ErrSandboxDied, err)
	}
	var out []byte
	if q.Op == "read" && r.Error == "" {
		if kind, out, err = c.fr.Next(); err != nil || kind != FrameStdout || len(out) > max(q.N, 1) {
			return r, nil, fmt.Errorf("%w: the guest's files: a read's data: %v", ErrSandboxDied, err)
		}
	}
	if r.Error != "" {
		e := error(errors.New(r.Error))
		if r.Errno != 0 {
			e = syscall.Errno(r.Errno)
		}
		return r, nil, &fs.PathError{Op: q.Op, Path: "/" + q.Name, Err: e}
	}
	return r, out, nil
}

func (c *RemoteFiles) do(q fsRequest) (fsReply, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	r, _, err := c.call(q, nil)
	return r, err
}

func (c *RemoteFiles) stat(op, name string) (fs.FileInfo, error) {
	r, err := c.do(fsRequest{Op: op, Name: name})
	if err != nil {
		return nil, err
	}
	if r.Stat == nil {
		return nil, &fs.PathError{Op: op, Path: "/" + name, Err: errors.New("no stat in the reply")}
	}
	return &remoteInfo{name: path.Base("/" + name), st: *r.Stat}, nil
}

func (c *RemoteFiles) Lstat(name string) (fs.FileInfo, error) { return c.stat("lstat", name) }
func (c *RemoteFiles) Stat(name string) (fs.FileInfo, error)  { return c.stat("stat", name) }

func (c *RemoteFiles) OpenFile(name string, flag int, perm fs.FileMode) (archive.File, error) {
	r, err := c.do(fsRequest{Op: "open", Name: name, Flag: flag, Perm: uint32(perm)})
	if err != nil {
		return nil, err
	}
	c.mu.Lock()
	c.refs++
	c.mu.Unlock()
	return &remoteFile{c: c, h: r.H, name: name}, nil
}

func (c *RemoteFiles) Readlink(name string) (string, error) {
	r, err := c.do(fsRequest{Op: "readlink", Name: name})
	return r.Target, err
}

func (c *RemoteFiles) Mkdir(name string, perm fs.FileMode) error {
	_, err := c.do(fsRequest{Op: "mkdir", Name: name, Perm: uint32(perm)})
	return err
}

func (c *RemoteFiles) Symlink(oldname, newname string) error {
	_, err := c.do(fsRequest{Op: "symlink", Name: oldname, To: newname})
	return err
}

func (c *RemoteFiles) Link(oldname, newname string) error {
	_, err := c.do(fsRequest{Op: "link", Name: oldname, To: newname})
	return err
}

func (c *RemoteFiles) Remove(name string) error {
	_, err := c.do(fsRequest{Op: "remove", Name: name})
	return err
}

func (c *RemoteFiles) Rename(oldname, newname string) error {
	_, err := c.do(fsRequest{Op: "rename", Name: oldname, To: newname})
	return err
}

func (c *RemoteFiles) Lchown(name string, uid, gid int) error {
	_, err := c.do(fsRequest{Op: "lchown", Name: name, UID: uid, GID: gid})
	return err
}

func (c *RemoteFiles) Chmod(name string, mode fs.FileMode) error {
	_, err := c.do(fsRequest{Op: "chmod", Name: name, Perm: uint32(mode)})
	return err
}

func (c *RemoteFiles) Chtimes(name string, atime, mtime time.Time) error {
	_, err := c.do(fsRequest{Op: "chtimes", Name: name, Atime: atime.UnixNano(), Mtime: mtime.UnixNano()})
	return err
}

// IDs: a guest's ids are the sandbox's own.
func (c *RemoteFiles) IDs() archive.IDMap { return nil }

// Close lets go of the FS; the connection closes with the last file.
func (c *RemoteFiles) Close() error { return c.unref() }

func (c *RemoteFiles) unref() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.refs--; c.refs == 0 {
		return c.conn.Close()
	}
	return nil
}

// remoteFile is a file the guest's agent holds open.
type remoteFile struct {
	c      *RemoteFiles
	h      int
	name   string
	eof    bool
	closed bool
}

func (f *remoteFile) Read(p []byte) (int, error) {
	if f.closed {
		return 0, os.ErrClosed
	}
	if f.eof || len(p) == 0 {
		if f.eof {
			return 0, io.EOF
		}
		return 0, nil
	}
	f.c.mu.Lock()
	defer f.c.mu.Unlock()
	r, data, err := f.c.call(fsRequest{Op: "read", Name: f.name, H: f.h, N: min(len(p), maxIO)}, nil)
	if err != nil {
		return 0, err
	}
	n := copy(p, data)
	if r.EOF && n == 0 {
		f.eof = true
		return 0, io.EOF
	}
	return n, nil
}

func (f *remoteFile) Write(p []byte) (int, error) {
	if f.closed {
		return 0, os.ErrClosed
	}
	f.c.mu.Lock()
	defer f.c.mu.Unlock()
	n := 0
	for len(p) > 0 {
		chunk := p[:min(len(p), maxIO)]
		if _, _, err := f.c.call(fsRequest{Op: "write", Name: f.name, H: f.h}, chunk); err != nil {
			return n, err
		}
		n, p = n+len(chunk), p[len(chunk):]
	}
	return n, nil
}

func (f *remoteFile) Stat() (fs.FileInfo, error) {
	r, err := f.c.do(fsRequest{Op: "fstat", Name: f.name, H: f.h})
	if err != nil {
		return nil, err
	}
	if r.Stat == nil {
		return nil, errors.New("no stat in the reply")
	}
	return &remoteInfo{name: path.Base("/" + f.name), st: *r.Stat}, nil
}

func (f *remoteFile) Chmod(mode fs.FileMode) error {
	_, err := f.c.do(fsRequest{Op: "fchmod", Name: f.name, H: f.h, Perm: uint32(mode)})
	return err
}

func (f *remoteFile) Readdirnames(n int) ([]string, error) {
	r, err := f.c.do(fsRequest{Op: "readdirnames", Name: f.name, H: f.h, N: n})
	if err != nil {
		return nil, err
	}
	if r.EOF && n > 0 {
		return r.Names, io.EOF
	}
	return r.Names, nil
}

func (f *remoteFile) Close() error {
	if f.closed {
		return os.ErrClosed
	}
	f.closed = true
	_, err := f.c.do(fsRequest{Op: "close", Name: f.name, H: f.h})
	f.c.unref()
	return err
}

// remoteInfo is an fs.FileInfo of the guest's; Sys is a *syscall.Stat_t.
type remoteInfo struct {
	name string
	st   fsStat
}

func (i *remoteInfo) Name() string       { return i.name }
func (i *remoteInfo) Size() int64        { return i.st.Size }
func (i *remoteInfo) ModTime() time.Time { return time.Unix(0, i.st.Mtime) }
func (i *remoteInfo) IsDir() bool        { return i.Mode().IsDir() }
func (i *remoteInfo) Mode() fs.FileMode  { return modeOf(i.st.Mode) }
func (i *remoteInfo) Sys() any {
	return &syscall.Stat_t{Mode: i.st.Mode, Size: i.st.Size, Uid: i.st.UID, Gid: i.st.GID, Nlink: i.st.Nlink, Dev: i.st.Dev,
		Ino: i.st.Ino, Rdev: i.st.Rdev, Mtim: syscall.NsecToTimespec(i.st.Mtime)}
}

// modeOf is st_mode as an fs.FileMode, as os's stat makes it.
func modeOf(m uint32) fs.FileMode {
	mode := fs.FileMode(m & 0o777)
	switch m & syscall.S_IFMT {
	case syscall.S_IFBLK:
		mode |= fs.ModeDevice
	case syscall.S_IFCHR:
		mode |= fs.ModeDevice | fs.ModeCharDevice
	case syscall.S_IFDIR:
		mode |= fs.ModeDir
	case syscall.S_IFIFO:
		mode |= fs.ModeNamedPipe
	case syscall.S_IFLNK:
		mode |= fs.ModeSymlink
	case syscall.S_IFSOCK:
		mode |= fs.ModeSocket
	}
	if m&syscall.S_ISGID != 0 {
		mode |= fs.ModeSetgid
	}
	if m&syscall.S_ISUID != 0 {
		mode |= fs.ModeSetuid
	}
	if m&syscall.S_ISVTX != 0 {
		mode |= fs.ModeSticky
	}
	return mode
}
