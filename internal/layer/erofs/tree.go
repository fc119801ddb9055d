package erofs

import (
	"fmt"
	"io"
	"strings"
)

// SplitPath cleans an archive path into its components. It accepts
// "./a/b", "/a/b/" and "a//b" alike and rejects "..", NUL bytes and names
// longer than MaxNameLen. The root is the empty slice.
func SplitPath(p string) ([]string, error) {
	var out []string
	for _, c := range strings.Split(p, "/") {
		switch {
		case c == "" || c == ".":
		case c == "..":
			return nil, fmt.Errorf("%w: path %q leaves the root", ErrInvalid, p)
		case len(c) > MaxNameLen:
			return nil, fmt.Errorf("%w: name %.40q... is %d bytes, the limit is %d", ErrInvalid, c, len(c), MaxNameLen)
		case strings.IndexByte(c, 0) >= 0:
			return nil, fmt.Errorf("%w: path %q holds a NUL byte", ErrInvalid, p)
		default:
			out = append(out, c)
		}
	}
	return out, nil
}

// Implied returns the attributes of a directory the image holds only
// because something is added below it, as SetImplied says.
func (w *Writer) Implied(p string) Attr {
	if w.implied != nil {
		if a, ok := w.implied(p); ok {
			a.Mode = a.Mode&^S_IFMT | S_IFDIR
			return a
		}
	}
	return Attr{Mode: S_IFDIR | 0o755}
}

// SetMaxEntries bounds the entries added (n <= 0: no bound): the tree
// is held in memory until Finish.
func (w *Writer) SetMaxEntries(n int) { w.maxEntries = n }

// SetImplied gives the attributes of the directories the image holds
// only because something is added below them (and of its root): f's,
// where it says so; else mode 0755, owner 0, mtime 0. A layer that goes
// over others takes them from those (a tar names only what changed).
func (w *Writer) SetImplied(f func(p string) (Attr, bool)) { w.implied = f }

// lookup walks to p; with create it makes missing parent directories
// (as Implied says). It returns the parent and the final name.
func (w *Writer) lookup(p string) (parent *node, name string, err error) {
	parts, err := SplitPath(p)
	if err != nil {
		return nil, "", err
	}
	if len(parts) == 0 {
		return nil, "", nil
	}
	dir := w.root
	for i, c := range parts[:len(parts)-1] {
		next := dir.children[c]
		if next == nil {
			next = &node{name: c, parent: dir, children: map[string]*node{},
				ino: &inode{Attr: w.Implied(strings.Join(parts[:i+1], "/")), nlink: 1}}
			dir.children[c] = next
		} else if next.ino.Mode&S_IFMT != S_IFDIR {
			return nil, "", fmt.Errorf("%w: %q: %q is not a directory", ErrInvalid, p, c)
		}
		dir = next
	}
	return dir, parts[len(parts)-1], nil
}

// Exists reports whether p names an entry.
func (w *Writer) Exists(p string) bool {
	n, _ := w.find(p)
	return n != nil
}

// IsDir reports whether p names a directory.
func (w *Writer) IsDir(p string) bool {
	n, _ := w.find(p)
	return n != nil && n.ino.Mode&S_IFMT == S_IFDIR
}

func (w *Writer) find(p string) (*node, error) {
	parts, err := SplitPath(p)
	if err != nil {
		return nil, err
	}
	n := w.root
	for _, c := range parts {
		if n.children == nil {
			return nil, nil
		}
		if n = n.children[c]; n == nil {
			return nil, nil
		}
	}
	return n, nil
}

func unlinkTree(n *node) {
	n.ino.nlink--
	for _, c := range n.children {
		unlinkTree(c)
	}
}

// place puts a new entry at p, replacing what was there. A directory
// placed over a directory keeps the old one's children, as tar does.
func (w *Writer) place(p string, ino *inode) error {
	if w.maxEntries > 0 {
		if w.placed++; w.placed > w.maxEntries {
			return fmt.Errorf("%w: more than %d", ErrTooMany, w.maxEntries)
		}
	}
	if err := checkAttr(p, &ino.Attr); err != nil {
		return err
	}
	ino.xattr = encodeXattrs(ino.Xattrs)
	parent, name, err := w.lookup(p)
	if err != nil {
		return err
	}
	isDir := ino.Mode&S_IFMT == S_IFDIR
	if parent == nil { // the root
		if !isDir {
			return fmt.Errorf("%w: the root must be a directory", ErrInvalid)
		}
		ino.nlink = 1
		w.root.ino = ino
		return nil
	}
	ino.nlink++
	if old := parent.children[name]; old != nil {
		if isDir && old.ino.Mode&S_IFMT == S_IFDIR {
			old.ino = ino // new attributes, same children
			return nil
		}
		unlinkTree(old)
	}
	n := &node{name: name, parent: parent, ino: ino}
	if isDir {
		n.children = map[string]*node{}
	}
	parent.children[name] = n
	return nil
}

// Attr returns the attributes of the entry at p, if there is one.
func (w *Writer) Attr(p string) (Attr, bool) {
	n, err := w.find(p)
	if err != nil || n == nil {
		return Attr{}, false
	}
	return n.ino.Attr, true
}

// Mkdir adds or updates a directory.
func (w *Writer) Mkdir(p string, a Attr) error {
	a.Mode = a.Mode&^S_IFMT | S_IFDIR
	return w.place(p, &inode{Attr: a})
}

// Symlink adds a symbolic link to target.
func (w *Writer) Symlink(p, target string, a Attr) error {
	if target == "" || len(target) >= BlockSize {
		return fmt.Errorf("%w: symlink %q: target of %d bytes (must be 1 to %d)", ErrInvalid, p, len(target), BlockSize-1)
	}
	a.Mode = a.Mode&^S_IFMT | S_IFLNK
	return w.place(p, &inode{Attr: a, target: target, size: uint64(len(target))})
}

// Mknod adds a character or block device, a fifo or a socket.
func (w *Writer) Mknod(p string, a Attr) error {
	switch a.Mode & S_IFMT {
	case S_IFCHR, S_IFBLK, S_IFIFO, S_IFSOCK:
	default:
		return fmt.Errorf("%w: mknod %q: mode %o is not a device, fifo or socket", ErrInvalid, p, a.Mode)
	}
	if t := a.Mode & S_IFMT; t == S_IFIFO || t == S_IFSOCK {
		a.Rdev = 0
	}
	return w.place(p, &inode{Attr: a})
}

// Tally counts what the image holds so far: its paths (the root left
// out, every hard link counted), the whiteouts among them, and the
// bytes of regular file data (each inode once).
func (w *Writer) Tally() (paths, whiteouts int, bytes int64) {
	seen := map[*inode]bool{}
	var walk func(n *node)
	walk = func(n *node) {
		for _, c := range n.children {
			paths++
			switch t := c.ino.Mode & S_IFMT; {
			case t == S_IFCHR && c.ino.Rdev == 0:
				whiteouts++
			case t == S_IFREG && !seen[c.ino]:
				seen[c.ino] = true
				bytes += int64(c.ino.size)
			}
			walk(c)
		}
	}
	if w.root != nil {
		walk(w.root)
	}
	return paths, whiteouts, bytes
}

// Whiteout adds an overlayfs whiteout (a 0/0 character device).
func (w *Writer) Whiteout(p string, a Attr) error {
	a.Mode = S_IFCHR | a.Mode&0o7777
	a.Rdev = 0
	return w.place(p, &inode{Attr: a})
}

// Link adds p as a hard link to the existing non-directory target.
func (w *Writer) Link(p, target string) error {
	t, err := w.find(target)
	if err != nil {
		return err
	}
	if t == nil {
		return fmt.Errorf("%w: hard link %q: target %q does not exist", ErrInvalid, p, target)
	}
	if t.ino.Mode&S_IFMT == S_IFDIR {
		return fmt.Errorf("%w: hard link %q: target %q is a directory", ErrInvalid, p, target)
	}
	if cur, _ := w.find(p); cur == t {
		return nil
	}
	return w.place(p, t.ino)
}

// Remove deletes p and everything below it. Removing a missing path is
// not an error.
func (w *Writer) Remove(p string) error {
	parts, err := SplitPath(p)
	if err != nil || len(parts) == 0 {
		return err
	}
	n, _ := w.find(p)
	if n == nil {
		return nil
	}
	unlinkTree(n)
	delete(n.parent.children, n.name)
	return nil
}

// Create adds a regular file of exactly size bytes read from r.
func (w *Writer) Create(p string, a Attr, size int64, r io.Reader) error {
	if w.err != nil {
		return w.err
	}
	if size < 0 {
		return fmt.Errorf("%w: %q: negative size", ErrInvalid, p)
	}
	a.Mode = a.Mode&^S_IFMT | S_IFREG
	ino := &inode{Attr: a, size: uint64(size)}
	if err := checkAttr(p, &ino.Attr); err != nil {
		return err
	}
	if _, _, err := w.lookup(p); err != nil {
		return err
	}
	if err := w.start(); err != nil {
		return err
	}
	if err := w.writeData(p, ino, r); err != nil {
		return err
	}
	return w.place(p, ino)
}
