package microvm

import (
	"fmt"
	"io"
	"io/fs"
	"strings"
)

// cpioWriter writes a cpio archive in the "newc" format, the one the
// kernel unpacks as an initramfs: per entry a 110-byte ASCII header of
// thirteen 8-digit hex fields, the name (NUL-terminated) and the data,
// each padded to 4 bytes; a TRAILER!!! entry ends it. Every entry is
// owned by root with mtime 0, so the same contents give the same bytes.
type cpioWriter struct {
	w   io.Writer
	n   int64 // bytes written
	ino uint32
	err error
}

func newCpio(w io.Writer) *cpioWriter { return &cpioWriter{w: w} }

func (c *cpioWriter) write(b []byte) {
	if c.err != nil {
		return
	}
	var n int
	n, c.err = c.w.Write(b)
	c.n += int64(n)
}

func (c *cpioWriter) pad() {
	if r := c.n % 4; r != 0 {
		c.write(make([]byte, 4-r))
	}
}

// entry writes one entry: name (relative, no leading slash), its mode
// (the file type bits as stat(2) has them, and the permissions) and its
// data (a symlink's target).
func (c *cpioWriter) entry(name string, mode uint32, data []byte) error {
	if strings.HasPrefix(name, "/") || name == "" {
		return fmt.Errorf("cpio: bad name %q", name)
	}
	c.ino++
	nlink := 1
	if mode&sIFMT == sIFDIR {
		nlink = 2
	}
	hdr := fmt.Sprintf("070701%08x%08x%08x%08x%08x%08x%08x%08x%08x%08x%08x%08x%08x",
		c.ino, mode, 0, 0, nlink, 0, len(data), 0, 0, 0, 0, len(name)+1, 0)
	c.write([]byte(hdr))
	c.write(append([]byte(name), 0))
	c.pad()
	c.write(data)
	c.pad()
	return c.err
}

const (
	sIFMT  = 0o170000
	sIFDIR = 0o040000
	sIFREG = 0o100000
	sIFLNK = 0o120000
)

// Dir adds a directory.
func (c *cpioWriter) Dir(name string, perm fs.FileMode) error {
	return c.entry(name, sIFDIR|uint32(perm.Perm()), nil)
}

// File adds a regular file.
func (c *cpioWriter) File(name string, perm fs.FileMode, data []byte) error {
	return c.entry(name, sIFREG|uint32(perm.Perm()), data)
}

// Symlink adds a symbolic link to target.
func (c *cpioWriter) Symlink(name, target string) error {
	return c.entry(name, sIFLNK|0o777, []byte(target))
}

// Close ends the archive.
func (c *cpioWriter) Close() error {
	c.ino = 0
	return c.entry("TRAILER!!!", 0, nil)
}
