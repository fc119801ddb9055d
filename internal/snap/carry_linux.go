package snap

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"io"
	"os"
	"path"
	"slices"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/dsec-project/dsec/internal/grade"
	"github.com/dsec-project/dsec/internal/layer/erofs"
)

// CarryOptions says what Carry takes of a diff.
type CarryOptions struct {
	Rules *grade.Rules
	// Base is the merged view of the pristine layers the diff stands
	// on: what a path the grade leaves out shows, and what a carried
	// deletion hides.
	Base string
	// MaxFileBytes: a carried file larger is left out (0: no bound).
	MaxFileBytes int64
	Limits       Limits
}

// Change is one path of the diff the grade left out.
type Change struct {
	Path   string
	Change string // added, modified, removed
	Type   string // file, dir, symlink, hardlink, device, fifo, socket
	Size   int64
	Digest string
	Target string
	Group  string // set for what the rules took but the grade refused
	Why    string
}

// Carried is what Carry added, and what it left out.
type Carried struct {
	Paths   int
	Bytes   int64
	Changes []Change
	// More is how many changes were left out past the report's bound.
	More int

	closeRoot int
}

// Close releases the diff's descriptor the carried files are read from.
func (c *Carried) Close() {
	if c.closeRoot > 0 {
		unix.Close(c.closeRoot)
		c.closeRoot = 0
	}
}

const (
	maxChanges   = 1000     // paths a report lists
	maxDigest    = 64 << 20 // bytes a reported file is hashed up to
	maxHashTotal = 1 << 30  // bytes hashed for one report
)

// Carry adds to w, as a diff over the pristine layers (o.Base), what
// the carry rules take of the diff dir (an overlay upper, or a mounted
// diff layer): every carried path as the agent left it, and whiteouts
// for the carried paths it removed. Nothing else the diff holds reaches
// w: a directory on the way to a carried path is the pristine one, an
// opaque directory hides only its carried paths, and a carried symlink
// out of the carried paths, a device node, a fifo, a socket, a file
// over the size bound or a hard link to a path not carried is left out.
// What is left out is returned as changes, to report. The diff is
// hostile, walked as Pack walks it.
func Carry(ctx context.Context, w *erofs.Writer, diff string, o CarryOptions) (*Carried, error) {
	fd, err := unix.Open(diff, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, &os.PathError{Op: "open", Path: diff, Err: err}
	}
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		unix.Close(fd)
		return nil, err
	}
	c := &carrier{packer: packer{w: w, upper: diff, root: fd, dev: st.Dev, lim: o.Limits.WithDefaults(), links: map[uint64]string{}, out: &Packed{Index: Index{}}},
		o: o, out: &Carried{closeRoot: fd}, inodes: map[uint64][]linkName{}}
	if c.base, err = openTree(o.Base); err != nil {
		c.out.Close()
		return nil, err
	}
	defer c.base.close()
	if c.diff, err = openTree(diff); err != nil {
		c.out.Close()
		return nil, err
	}
	defer c.diff.close()
	if err := w.Mkdir("", c.baseAttr("", erofs.Attr{Mode: unix.S_IFDIR | 0o755})); err != nil {
		c.out.Close()
		return nil, err
	}
	dup, err := dupCloexec(fd)
	if err != nil {
		c.out.Close()
		return nil, err
	}
	if err := c.walk(ctx, dup, "", 1, false); err != nil {
		c.out.Close()
		return nil, err
	}
	c.linked()
	return c.out, nil
}

type carrier struct {
	packer
	o      CarryOptions
	out    *Carried
	hashed int64
	walked int // entries walked, carried or not
	// base is the pristine view, diff the diff, both looked up through
	// no symlink.
	base, diff *tree
	// inodes are the regular files with more than one link, by inode.
	inodes map[uint64][]linkName
}

type linkName struct {
	path    string
	carried bool
}

// walk goes through the diff's directory fd (rel; closed after). whole:
// the directory's entries in the diff are all it has (it is opaque, new,
// or below one that is), so a carried path the base has and the diff
// lacks was removed.
func (c *carrier) walk(ctx context.Context, fd int, rel string, depth int, whole bool) error {
	f := os.NewFile(uintptr(fd), path.Join(c.upper, rel))
	defer f.Close()
	if err := ctx.Err(); err != nil {
		return err
	}
	if depth > c.lim.MaxDepth {
		return limitErr("the sandbox's files nest deeper than %d directories (at /%s)", c.lim.MaxDepth, rel[:min(len(rel), 200)])
	}
	names, err := f.Readdirnames(-1)
	if err != nil {
		return fmt.Errorf("read directory %s: %w", f.Name(), err)
	}
	slices.Sort(names)
	for _, name := range names {
		var st unix.Stat_t
		if err := unix.Fstatat(fd, name, &st, unix.AT_SYMLINK_NOFOLLOW); err != nil {
			return fmt.Errorf("stat %s: %w", path.Join(f.Name(), name), err)
		}
		if c.walked++; c.walked > c.lim.MaxEntries {
			return limitErr("the sandbox changed more than %d paths (at /%s)", c.lim.MaxEntries, path.Join(rel, name))
		}
		if err := c.add(ctx, fd, name, path.Join(rel, name), &st, depth, whole); err != nil {
			return err
		}
	}
	if whole {
		return c.hideRemoved(rel, names)
	}
	return nil
}

func (c *carrier) add(ctx context.Context, dirfd int, name, rp string, st *unix.Stat_t, depth int, whole bool) error {
	if st.Dev != c.dev {
		return fmt.Errorf("/%s is on another file system than the diff: refusing to read across mounts", rp)
	}
	typ := st.Mode & unix.S_IFMT
	isDir, whiteout := typ == unix.S_IFDIR, typ == unix.S_IFCHR && st.Rdev == 0
	p := "/" + rp
	// (What stands where the pristine layers have a directory is decided
	// as that directory: on the way to carried paths, it is kept.)
	switch c.o.Rules.Decide(p, isDir || whiteout || c.baseDir(rp)) {
	case grade.Carry:
		return c.carry(ctx, dirfd, name, rp, st, depth, whole)
	case grade.Through:
		return c.through(ctx, dirfd, name, rp, st, depth, whole)
	case grade.Never:
		return c.leave(ctx, dirfd, name, rp, st, depth, "", "never carried: it runs code around the tests (the policy's grading.never)")
	}
	return c.leave(ctx, dirfd, name, rp, st, depth, "", "")
}

// carry adds a path the rules take.
func (c *carrier) carry(ctx context.Context, dirfd int, name, rp string, st *unix.Stat_t, depth int, whole bool) error {
	typ := st.Mode & unix.S_IFMT
	refuse := func(group, why string) error { return c.leave(ctx, dirfd, name, rp, st, depth, group, why) }
	switch {
	case typ == unix.S_IFCHR && st.Rdev == 0: // a whiteout
		if c.inBase(rp) {
			return c.remove(rp)
		}
		return nil
	case typ != unix.S_IFDIR && c.baseDir(rp) && c.o.Rules.Guards("/"+rp):
		return refuse("other", "it stands where the pristine layers have a directory holding paths never carried")
	case typ == unix.S_IFCHR || typ == unix.S_IFBLK:
		return refuse("special", "a device node: never carried")
	case typ == unix.S_IFIFO || typ == unix.S_IFSOCK:
		return refuse("special", "a fifo or socket: never carried")
	}
	a, err := c.attr(dirfd, name, st)
	if err != nil {
		return err
	}
	switch typ {
	case unix.S_IFDIR:
		c.out.Paths++
		opaque := string(a.Xattrs[opaqueXattr]) == "y"
		delete(a.Xattrs, opaqueXattr) // what it hides that is not carried shows
		if c.baseDir(rp) && c.o.Rules.Guards("/"+rp) {
			// It holds what no grade carries (the tests): their
			// directory as the pristine layers have it, not as the
			// agent left it (chmod 000, say).
			a = c.baseAttr(rp, erofs.Attr{})
		}
		if err := c.w.Mkdir(rp, a); err != nil {
			return err
		}
		return c.descend(ctx, dirfd, name, rp, st, depth, whole || opaque || !c.baseDir(rp))
	case unix.S_IFREG:
		if c.o.MaxFileBytes > 0 && st.Size > c.o.MaxFileBytes {
			return refuse("huge", fmt.Sprintf("larger than the grade's bound of %d bytes (grading.maxFileBytes)", c.o.MaxFileBytes))
		}
		if st.Nlink > 1 {
			c.inodes[st.Ino] = append(c.inodes[st.Ino], linkName{rp, true})
		}
		c.out.Paths++
		c.out.Bytes += st.Size
		if c.out.Bytes > c.lim.MaxBytes {
			return limitErr("the carried files hold more than %d bytes (at /%s)", c.lim.MaxBytes, rp)
		}
		// A copy of its own: a hard link is not kept across what is
		// carried and what is not.
		return c.w.Plan(rp, a, st.Size, erofs.Planned{Open: c.opener(rp, st)})
	case unix.S_IFLNK:
		target, err := readlinkat(dirfd, name)
		if err != nil {
			return fmt.Errorf("readlink /%s in the diff: %w", rp, err)
		}
		if why := c.linkOut(rp, target); why != "" {
			return refuse("links", why)
		}
		c.out.Paths++
		return c.w.Symlink(rp, target, a)
	}
	return refuse("special", "a file of an unknown type")
}

// linkOut says why the symlink rp -> target leads out of the carried
// paths ("": it does not): its target, resolved as the grader's view
// would (the carried diff over the pristine layers), must pass only
// through directories of their own (no symlink, which the agent may
// have planted, nor what is not a directory), and be carried, and not
// be a directory holding what no grade carries.
func (c *carrier) linkOut(rp, target string) string {
	abs := target
	if !path.IsAbs(abs) {
		abs = "/" + path.Dir(rp) + "/" + target
	}
	final := path.Clean(abs)
	segs := strings.Split(abs, "/")
	var cur []string
	for i, s := range segs {
		if i == len(segs)-1 {
			break // the target itself may be anything carried
		}
		switch s {
		case "", ".":
		case "..":
			if len(cur) > 0 {
				cur = cur[:len(cur)-1]
			}
		default:
			cur = append(cur, s)
			if !c.realDir(strings.Join(cur, "/")) {
				return "a symlink to " + final + " through /" + strings.Join(cur, "/") + ", which is no directory of its own"
			}
		}
	}
	switch {
	case c.o.Rules.Decide(final, false) != grade.Carry:
		return "a symlink to " + final + ", which is not carried"
	case c.o.Rules.Guards(final) && (c.realDir(strings.TrimPrefix(final, "/")) || final == "/"):
		return "a symlink to " + final + ", a directory holding paths never carried"
	}
	return ""
}

// realDir says whether rel is a directory of its own (through no
// symlink) in the grader's view: the diff's, else the pristine one.
func (c *carrier) realDir(rel string) bool {
	// (Its parents were checked first: a symlink among them was refused.)
	if st, ok := c.diff.lstat(rel); ok {
		return st.Mode&unix.S_IFMT == unix.S_IFDIR
	}
	st, ok := c.base.lstat(rel)
	return ok && st.Mode&unix.S_IFMT == unix.S_IFDIR
}

// through adds a directory on the way to carried paths: the pristine
// one, with what the diff carries below it. What stands there in the
// diff instead (a file, a whiteout) is left out, and the carried paths
// below the pristine one hidden.
func (c *carrier) through(ctx context.Context, dirfd int, name, rp string, st *unix.Stat_t, depth int, whole bool) error {
	typ := st.Mode & unix.S_IFMT
	if typ != unix.S_IFDIR {
		if err := c.leave(ctx, dirfd, name, rp, st, depth, "", ""); err != nil {
			return err
		}
		if !c.baseDir(rp) {
			return nil
		}
		if err := c.w.Mkdir(rp, c.baseAttr(rp, erofs.Attr{})); err != nil {
			return err
		}
		return c.hideRemoved(rp, nil)
	}
	var opaque bool
	if a, err := c.attr(dirfd, name, st); err == nil {
		opaque = string(a.Xattrs[opaqueXattr]) == "y"
	}
	if !c.baseDir(rp) {
		// New: its own attributes, none of which is carried but that it
		// is a directory.
		if err := c.w.Mkdir(rp, erofs.Attr{Mode: unix.S_IFDIR | 0o755}); err != nil {
			return err
		}
	} else if err := c.w.Mkdir(rp, c.baseAttr(rp, erofs.Attr{})); err != nil {
		return err
	}
	return c.descend(ctx, dirfd, name, rp, st, depth, whole || opaque)
}

func (c *carrier) descend(ctx context.Context, dirfd int, name, rp string, st *unix.Stat_t, depth int, whole bool) error {
	fd, err := unix.Openat(dirfd, name, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("open /%s in the diff: %w", rp, err)
	}
	if err := sameInode(fd, st, rp); err != nil {
		unix.Close(fd)
		return err
	}
	return c.walk(ctx, fd, rp, depth+1, whole)
}

// hideRemoved hides, below the pristine directory rel, the carried
// paths the diff's directory (holding names) does not have: the agent
// removed them.
func (c *carrier) hideRemoved(rel string, names []string) error {
	if depth := strings.Count(rel, "/") + 1; depth > c.lim.MaxDepth {
		return limitErr("the pristine files nest deeper than %d directories (at /%s)", c.lim.MaxDepth, rel[:min(len(rel), 200)])
	}
	for _, e := range c.base.list(rel) { // (none: the base has no such directory)
		if slices.Contains(names, e.name) {
			continue
		}
		if c.walked++; c.walked > c.lim.MaxEntries {
			return limitErr("the sandbox changed more than %d paths (at /%s)", c.lim.MaxEntries, path.Join(rel, e.name))
		}
		rp := path.Join(rel, e.name)
		switch c.o.Rules.Decide("/"+rp, e.dir) {
		case grade.Carry:
			if err := c.remove(rp); err != nil {
				return err
			}
		case grade.Through:
			if !e.dir {
				continue
			}
			if err := c.w.Mkdir(rp, c.baseAttr(rp, erofs.Attr{})); err != nil {
				return err
			}
			if err := c.hideRemoved(rp, nil); err != nil {
				return err
			}
		default: // removed by the agent, there for the grade
			c.report(Change{Path: "/" + rp, Change: "removed", Type: c.baseType(rp)})
		}
	}
	return nil
}

// remove hides the pristine path rp, which the agent removed: with a
// whiteout, or, a directory holding paths never carried, with a
// whiteout of each carried path below it.
func (c *carrier) remove(rp string) error {
	c.out.Paths++
	if c.baseDir(rp) && c.o.Rules.Guards("/"+rp) {
		if err := c.w.Mkdir(rp, c.baseAttr(rp, erofs.Attr{})); err != nil {
			return err
		}
		return c.hideRemoved(rp, nil)
	}
	return c.w.Whiteout(rp, erofs.Attr{})
}

// leave reports a path of the diff the grade does not carry, and what
// the diff holds below it. group and why are set when the rules take
// it but the grade refused it.
func (c *carrier) leave(ctx context.Context, dirfd int, name, rp string, st *unix.Stat_t, depth int, group, why string) error {
	typ := st.Mode & unix.S_IFMT
	ch := Change{Path: "/" + rp, Change: "modified", Group: group, Why: why}
	switch {
	case typ == unix.S_IFCHR && st.Rdev == 0:
		ch.Change, ch.Type = "removed", c.baseType(rp)
		if ch.Type == "" {
			return nil // a whiteout of nothing pristine: the agent's own
		}
	case typ == unix.S_IFDIR:
		ch.Type = "dir"
	case typ == unix.S_IFREG:
		ch.Type, ch.Size = "file", st.Size
		if st.Nlink > 1 {
			c.inodes[st.Ino] = append(c.inodes[st.Ino], linkName{rp, false})
		}
		ch.Digest = c.digest(dirfd, name, st)
	case typ == unix.S_IFLNK:
		ch.Type = "symlink"
		ch.Target, _ = readlinkat(dirfd, name)
	case typ == unix.S_IFCHR || typ == unix.S_IFBLK:
		ch.Type = "device"
	case typ == unix.S_IFIFO:
		ch.Type = "fifo"
	case typ == unix.S_IFSOCK:
		ch.Type = "socket"
	}
	if ch.Change != "removed" && !c.inBase(rp) {
		ch.Change = "added"
	}
	// A directory the agent only wrote below is no change of its own.
	if ch.Type != "dir" || ch.Change == "added" || why != "" {
		c.report(ch)
	}
	if typ != unix.S_IFDIR {
		return nil
	}
	if depth > c.lim.MaxDepth || c.walked > c.lim.MaxEntries {
		c.out.More++
		return nil // (what is below goes unreported)
	}
	fd, err := unix.Openat(dirfd, name, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("open /%s in the diff: %w", rp, err)
	}
	f := os.NewFile(uintptr(fd), rp)
	defer f.Close()
	names, err := f.Readdirnames(-1)
	if err != nil {
		return fmt.Errorf("read directory /%s in the diff: %w", rp, err)
	}
	slices.Sort(names)
	for _, n := range names {
		var cst unix.Stat_t
		if err := unix.Fstatat(fd, n, &cst, unix.AT_SYMLINK_NOFOLLOW); err != nil {
			return err
		}
		if err := ctx.Err(); err != nil {
			return err
		}
		c.walked++
		if err := c.leave(ctx, fd, n, path.Join(rp, n), &cst, depth+1, "", ""); err != nil {
			return err
		}
	}
	return nil
}

func (c *carrier) report(ch Change) {
	if len(c.out.Changes) >= maxChanges {
		c.out.More++
		return
	}
	c.out.Changes = append(c.out.Changes, ch)
}

// linked reports each carried file that shared its inode with a path
// not carried (a hard link to a test, say): carried as a copy, the link
// itself left out.
func (c *carrier) linked() {
	for _, names := range c.inodes {
		i := slices.IndexFunc(names, func(n linkName) bool { return !n.carried })
		if i < 0 {
			continue
		}
		for _, n := range names {
			if n.carried {
				change := "added"
				if c.inBase(n.path) {
					change = "modified"
				}
				c.report(Change{Path: "/" + n.path, Change: change, Type: "hardlink", Group: "links",
					Why: "a hard link to /" + names[i].path + ", which is not carried: carried as a copy of its own"})
			}
		}
	}
}

// digest is the sha256 of a reported regular file's bytes, "" past the
// bounds.
func (c *carrier) digest(dirfd int, name string, st *unix.Stat_t) string {
	if st.Size > maxDigest || c.hashed+st.Size > maxHashTotal {
		return ""
	}
	fd, err := unix.Openat(dirfd, name, unix.O_RDONLY|unix.O_NOFOLLOW|unix.O_CLOEXEC|unix.O_NONBLOCK|unix.O_NOCTTY, 0)
	if err != nil {
		return ""
	}
	f := os.NewFile(uintptr(fd), name)
	defer f.Close()
	h := sha256.New()
	n, err := io.Copy(h, io.LimitReader(f, maxDigest))
	c.hashed += n
	if err != nil {
		return ""
	}
	return "sha256:" + hex.EncodeToString(h.Sum(nil))
}

// inBase says whether the pristine layers have rp.
func (c *carrier) inBase(rp string) bool { return c.baseType(rp) != "" }

func (c *carrier) baseDir(rp string) bool { return c.baseType(rp) == "dir" }

// baseType is the type of rp in the pristine layers ("": none).
func (c *carrier) baseType(rp string) string {
	st, ok := c.base.lstat(rp)
	if !ok {
		return ""
	}
	switch st.Mode & unix.S_IFMT {
	case unix.S_IFDIR:
		return "dir"
	case unix.S_IFLNK:
		return "symlink"
	case unix.S_IFREG:
		return "file"
	}
	return "device"
}

// baseAttr is the pristine directory rp's attributes (def without one).
func (c *carrier) baseAttr(rp string, def erofs.Attr) erofs.Attr {
	st, ok := c.base.lstat(rp)
	if !ok || st.Mode&unix.S_IFMT != unix.S_IFDIR {
		if def.Mode == 0 {
			def.Mode = unix.S_IFDIR | 0o755
		}
		return def
	}
	return erofs.Attr{Mode: st.Mode, UID: st.Uid, GID: st.Gid, Mtime: st.Mtim.Sec, MtimeNsec: uint32(st.Mtim.Nsec)}
}
