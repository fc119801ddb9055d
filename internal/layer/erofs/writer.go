package erofs

import (
	"bufio"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"os"
	"slices"
	"sort"
	"strings"
)

const (
	// BlockSize is the block size of every image this package writes.
	BlockSize = 4096
	blkBits   = 12

	// HoleSize is the granularity of holes: a file with an aligned
	// HoleSize run of zeros is stored chunk-based with chunks of this
	// size, so its chunk map stays small and each data chunk is one
	// fetch window of a lazily loaded layer.
	HoleSize = 1 << holeBits
	holeBits = 20

	// MaxNameLen is the longest name a directory entry may carry.
	MaxNameLen = 255

	magic     = 0xE0F5E1E2
	sbOffset  = 1024
	inodeSize = 64 // extended inode
	slotSize  = 32
	// nidBase is the first inode's NID: the inode area starts one block
	// past meta_blkaddr.
	nidBase          = BlockSize / slotSize
	direntSize       = 12
	xattrHeaderSize  = 12
	nullAddr         = 0xFFFFFFFF
	incompatChunked  = 0x4
	formatExtended   = 1
	layoutFlatPlain  = 0
	layoutFlatInline = 2
	layoutChunked    = 4
)

// Unix file type bits, as in stat(2).
const (
	S_IFMT   = 0o170000
	S_IFSOCK = 0o140000
	S_IFLNK  = 0o120000
	S_IFREG  = 0o100000
	S_IFBLK  = 0o060000
	S_IFDIR  = 0o040000
	S_IFCHR  = 0o020000
	S_IFIFO  = 0o010000
)

// ErrInvalid is wrapped by every error caused by the caller's input (a
// bad path, an unsupported xattr) rather than by I/O.
var ErrInvalid = errors.New("invalid entry")

// Attr describes an inode. Mode carries the type bits (S_IFREG, ...) and
// the permission bits including setuid, setgid and sticky.
type Attr struct {
	Mode      uint32
	UID, GID  uint32
	Mtime     int64
	MtimeNsec uint32
	Rdev      uint64 // Linux dev_t, for S_IFCHR and S_IFBLK
	Xattrs    map[string][]byte
}

// Region is a byte range of the image.
type Region struct {
	Offset int64 `json:"offset"`
	Size   int64 `json:"size"`
}

// Stats describes a finished image.
type Stats struct {
	Size     int64  // image size in bytes, a multiple of BlockSize
	Inodes   uint64 // inodes written
	Entries  uint64 // paths, counting every hard link and the root
	Data     Region // file data blocks
	Metadata Region // directory blocks, long symlinks and the inode area
	// Hot is the start of the data region that holds the files named by
	// SetOrder, in that order (zero when none was given or planned).
	Hot Region
}

type inode struct {
	Attr
	nlink  uint32
	size   uint64
	target string // symlink target

	// file data placement
	blkaddr   uint32   // first data block (flat layouts)
	nblocks   uint32   // data blocks written for a flat file
	tail      []byte   // inline tail of a directory or symlink
	chunkBits uint8    // chunk-based: log2 blocks per chunk
	chunks    []uint32 // chunk-based: block address per chunk or nullAddr

	plan *Planned // planned mode: where the data comes from
	rank int      // planned mode: position in the SetOrder list, or past its end
	// planned mode: Prefetch was called
	prefetched bool

	// set by Finish
	order  int
	nid    uint64
	layout uint16
	xattr  []byte   // encoded inline xattr body
	meta   []byte   // dirents or symlink target, placed by Finish
	dirent []dirent // directories only
}

type node struct {
	name     string
	parent   *node
	children map[string]*node
	ino      *inode
}

type dirent struct {
	name string
	n    *node
}

// Writer builds one EROFS image. It is not safe for concurrent use.
type Writer struct {
	f       File
	bw      *bufio.Writer
	nextBlk uint32 // next free data block
	root    *node
	zero    []byte
	buf     []byte
	err     error
	done    bool

	started bool           // block 0 was reserved: streaming mode
	planned []*inode       // planned mode: files whose data Finish emits
	rank    map[string]int // SetOrder: position of a path
	hot     [][]BlockRange // SetOrder: per position, the hot blocks (nil: all)
	observe Observer
}

// File is where an image is written: sequentially, plus one WriteAt of
// the superblock when the image is streamed.
type File interface {
	io.Writer
	io.WriterAt
}

// NewWriter starts an image in f, which must be empty and positioned at 0.
func NewWriter(f File) (*Writer, error) {
	w := &Writer{
		f:       f,
		bw:      bufio.NewWriterSize(f, 1<<20),
		nextBlk: 1,
		zero:    make([]byte, BlockSize),
		buf:     make([]byte, 1<<20),
	}
	w.root = &node{children: map[string]*node{}, ino: &inode{Attr: Attr{Mode: S_IFDIR | 0o755}, nlink: 1}}
	return w, nil
}

// Observer sees every byte of a planned image in order as it is
// written. Write gets bytes it must copy. Lend and Take let the writer
// read file data straight into the observer's memory: Lend returns an
// empty buffer of at least HoleSize capacity, Take hands it back filled
// with the next bytes of the image, after they were written.
type Observer interface {
	Write(b []byte)
	Lend() []byte
	Take(b []byte)
}

// Observe registers o. Only a planned image (see Plan) is written in
// order; Finish fails for a streamed one with an observer.
func (w *Writer) Observe(o Observer) { w.observe = o }

// start reserves block 0 for the superblock of a streamed image.
func (w *Writer) start() error {
	if len(w.planned) > 0 {
		return errors.New("erofs: Create after Plan: an image is either streamed or planned")
	}
	if !w.started {
		w.started = true
		if _, err := w.bw.Write(w.zero); err != nil {
			w.err = err
			return err
		}
	}
	return nil
}

// ReadAtCloser is an open planned file.
type ReadAtCloser interface {
	io.ReaderAt
	io.Closer
}

// Planned is a regular file whose bytes Finish reads, so that the whole
// image, superblock first, is written in one sequential pass an observer
// can hash as it goes.
type Planned struct {
	// Open opens the file when its data is due.
	Open func() (ReadAtCloser, error)
	// Prefetch, if set, asks for the file's data to be read ahead; it
	// runs on another goroutine, a bounded distance before Open.
	Prefetch func()
	// Holes marks the HoleSize units that are all zeros (nil: none).
	// The last unit counts only if a hole precedes it, as when streaming.
	Holes []bool
}

// Plan adds a regular file whose data is read by Finish. Finish assigns
// its blocks: without SetOrder the same blocks Create would for the same
// content, so a planned image and a streamed one of the same tree are
// byte-identical.
func (w *Writer) Plan(p string, a Attr, size int64, pl Planned) error {
	if w.started {
		return errors.New("erofs: Plan after Create: an image is either streamed or planned")
	}
	if size < 0 {
		return fmt.Errorf("%w: %q: negative size", ErrInvalid, p)
	}
	a.Mode = a.Mode&^S_IFMT | S_IFREG
	ino := &inode{Attr: a, size: uint64(size), plan: &pl}
	if err := checkAttr(p, &ino.Attr); err != nil {
		return err
	}
	if _, _, err := w.lookup(p); err != nil {
		return err
	}
	units := (ino.size + HoleSize - 1) / HoleSize
	if pl.Holes != nil && uint64(len(pl.Holes)) != units {
		return fmt.Errorf("erofs: plan %q: %d hole flags for %d units", p, len(pl.Holes), units)
	}
	ino.rank = len(w.rank)
	if parts, err := SplitPath(p); err == nil {
		if r, ok := w.rank[strings.Join(parts, "/")]; ok {
			ino.rank = r
		}
	}
	if err := w.place(p, ino); err != nil {
		return err
	}
	w.planned = append(w.planned, ino)
	return nil
}

// Hot names a planned file for SetOrder and the parts of it that go
// first: Blocks are ranges of the file's BlockSize blocks; nil means the
// whole file.
type Hot struct {
	Path   string
	Blocks []BlockRange
}

// BlockRange is Count blocks of a file from block Start.
type BlockRange struct{ Start, Count uint64 }

// SetOrder asks Finish to place the data named in hot first, in that
// order, ahead of every other block (the rest keep plan order). A run
// that reads those parts then reads one contiguous range of the image
// instead of spots scattered over it: the layout a recorded access
// profile asks for. A file only partly named is stored chunk-based with
// one chunk per block, so its named blocks can be hot and the others
// cold. Paths never planned are ignored. It must be called before Plan.
func (w *Writer) SetOrder(hot []Hot) error {
	if len(w.planned) > 0 {
		return errors.New("erofs: SetOrder after Plan")
	}
	w.rank = make(map[string]int, len(hot))
	w.hot = nil
	for _, h := range hot {
		parts, err := SplitPath(h.Path)
		if err != nil {
			return err
		}
		k := strings.Join(parts, "/")
		if r, ok := w.rank[k]; ok {
			if w.hot[r] != nil && h.Blocks != nil {
				w.hot[r] = append(w.hot[r], h.Blocks...)
			} else {
				w.hot[r] = nil // the whole file
			}
			continue
		}
		w.rank[k] = len(w.rank)
		w.hot = append(w.hot, h.Blocks)
	}
	return nil
}

// assignPlanned gives every planned file its blocks and returns the end
// of the hot ones (1 when none): first the parts SetOrder named, in its
// order, then every other file whole in plan order, then the rest of the
// files SetOrder named only in part. Without SetOrder the blocks follow
// plan order, as Create would assign them.
func (w *Writer) assignPlanned() (uint32, error) {
	slices.SortStableFunc(w.planned, func(a, b *inode) int { return a.rank - b.rank })
	var split, cold []*inode
	rest := w.planned
	for len(rest) > 0 && rest[0].rank < len(w.rank) {
		ino := rest[0]
		rest = rest[1:]
		if ranges := w.hot[ino.rank]; ranges == nil || w.coversAll(ino, ranges) {
			if err := w.assignWhole(ino); err != nil {
				return 0, err
			}
			continue
		}
		// One chunk per block: 0 (block 0 is the superblock) marks one
		// not assigned yet.
		ino.chunkBits = 0
		ino.chunks = make([]uint32, (ino.size+BlockSize-1)/BlockSize)
		start := w.nextBlk
		for _, r := range w.hot[ino.rank] {
			for b := r.Start; b < min(r.Start+r.Count, uint64(len(ino.chunks))); b++ {
				if ino.chunks[b] == 0 && !ino.holeBlock(b) {
					ino.chunks[b] = w.nextBlk
					if err := w.reserve(BlockSize); err != nil {
						return 0, err
					}
				}
			}
		}
		if w.nextBlk == start { // the ranges name no data it has: not hot at all
			ino.chunks = nil
			cold = append(cold, ino)
			continue
		}
		split = append(split, ino)
	}
	hotEnd := w.nextBlk
	if len(w.rank) == 0 {
		// No order, no hot region: in a streamed image the data is
		// all written by now, and would have been taken for it.
		hotEnd = 1
	}
	for _, ino := range append(cold, rest...) {
		if err := w.assignWhole(ino); err != nil {
			return 0, err
		}
	}
	for _, ino := range split {
		for b, c := range ino.chunks {
			switch {
			case ino.holeBlock(uint64(b)):
				ino.chunks[b] = nullAddr
			case c == 0:
				ino.chunks[b] = w.nextBlk
				if err := w.reserve(BlockSize); err != nil {
					return 0, err
				}
			}
		}
	}
	return hotEnd, nil
}

// coversAll says whether ranges name every data block of ino.
func (w *Writer) coversAll(ino *inode, ranges []BlockRange) bool {
	n := (ino.size + BlockSize - 1) / BlockSize
	seen := make([]bool, n)
	for _, r := range ranges {
		for b := r.Start; b < min(r.Start+r.Count, n); b++ {
			seen[b] = true
		}
	}
	for b := range seen {
		if !seen[b] && !ino.holeBlock(uint64(b)) {
			return false
		}
	}
	return true
}

// holeBlock says whether block b of a planned file lies in a hole unit.
func (ino *inode) holeBlock(b uint64) bool {
	u := b * BlockSize / HoleSize
	return ino.plan.Holes != nil && ino.plan.Holes[u]
}

// assignWhole gives a planned file its blocks in file order.
func (w *Writer) assignWhole(ino *inode) error {
	var bp blockPlan
	bp.begin(w)
	units := (ino.size + HoleSize - 1) / HoleSize
	for u := uint64(0); u < units; u++ {
		n := min(HoleSize, ino.size-u*HoleSize)
		if bp.hole(w, n, ino.plan.Holes != nil && ino.plan.Holes[u]) {
			continue
		}
		if err := w.reserve(n); err != nil {
			return err
		}
	}
	bp.end(w, ino)
	return nil
}

// segment is a run of a planned file's bytes stored at consecutive
// blocks of the image.
type segment struct {
	ino    *inode
	off, n uint64 // bytes of the file
	blk    uint32 // where they go
	last   bool   // the file's last segment: prefetch credit is due
}

// segments lists where every planned byte goes, in image order.
func (w *Writer) segments() []segment {
	var segs []segment
	for _, ino := range w.planned {
		first := len(segs)
		switch {
		case ino.chunks != nil:
			per := uint64(BlockSize) << ino.chunkBits
			for c, addr := range ino.chunks {
				off := uint64(c) * per
				if addr == nullAddr || off >= ino.size {
					continue
				}
				n := min(per, ino.size-off)
				if l := len(segs) - 1; l >= first && segs[l].off+segs[l].n == off &&
					segs[l].blk+uint32(segs[l].n/BlockSize) == addr && segs[l].n%BlockSize == 0 {
					segs[l].n += n
					continue
				}
				segs = append(segs, segment{ino: ino, off: off, n: n, blk: addr})
			}
		case ino.size > 0:
			segs = append(segs, segment{ino: ino, n: ino.size, blk: ino.blkaddr})
		}
		if len(segs) > first {
			segs[len(segs)-1].last = true
		}
	}
	slices.SortStableFunc(segs, func(a, b segment) int { return int(a.blk) - int(b.blk) })
	return segs
}

// prefetchAhead bounds how far ahead of the writer Prefetch runs.
const prefetchAhead = 64 << 20

// emitPlanned writes the data of every planned file in image order,
// while another goroutine prefetches the files ahead of it, so a cold
// source is read with many requests in flight instead of one.
func (w *Writer) emitPlanned() error {
	segs := w.segments()
	credit := make(chan int64, len(segs)+1)
	stop := make(chan struct{})
	defer close(stop)
	go func() {
		var ahead int64
		for _, sg := range segs {
			if sg.ino.plan.Prefetch == nil || sg.ino.prefetched {
				continue
			}
			for ahead > prefetchAhead {
				select {
				case n := <-credit:
					ahead -= n
				case <-stop:
					return
				}
			}
			sg.ino.prefetched = true
			sg.ino.plan.Prefetch()
			ahead += int64(sg.ino.size)
		}
	}()
	var (
		cur *inode
		f   ReadAtCloser
	)
	defer func() {
		if f != nil {
			f.Close()
		}
	}()
	for _, sg := range segs {
		if sg.ino != cur {
			if f != nil {
				f.Close()
				f = nil
			}
			var err error
			if f, err = sg.ino.plan.Open(); err != nil {
				return err
			}
			cur = sg.ino
		}
		if err := w.emitSegment(f, sg); err != nil {
			return err
		}
		if sg.last && sg.ino.plan.Prefetch != nil {
			credit <- int64(sg.ino.size)
		}
	}
	return nil
}

// emitSegment copies a segment's bytes from f, padding the file's last
// block with zeros.
func (w *Writer) emitSegment(f ReadAtCloser, sg segment) error {
	for done := uint64(0); done < sg.n; {
		n := min(uint64(len(w.buf)), sg.n-done)
		b := w.buf[:n]
		if w.observe != nil {
			b = w.observe.Lend()[:n]
		}
		if _, err := f.ReadAt(b, int64(sg.off+done)); err != nil {
			if errors.Is(err, io.EOF) {
				return fmt.Errorf("%w: a file shrank while the layer was built; build again from a tree nothing writes to", ErrInvalid)
			}
			return err
		}
		if _, err := w.bw.Write(b); err != nil {
			w.err = err
			return err
		}
		if w.observe != nil {
			w.observe.Take(b)
		}
		done += n
	}
	if pad := int(-sg.n & (BlockSize - 1)); pad > 0 {
		return w.emit(w.zero[:pad])
	}
	return nil
}

// emit writes b in image order and shows it to the observer.
func (w *Writer) emit(b []byte) error {
	if w.observe != nil {
		w.observe.Write(b)
	}
	if _, err := w.bw.Write(b); err != nil {
		w.err = err
		return err
	}
	return nil
}

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

// lookup walks to p; with create it makes missing parent directories
// (mode 0755, owner 0, mtime 0). It returns the parent and the final name.
func (w *Writer) lookup(p string) (parent *node, name string, err error) {
	parts, err := SplitPath(p)
	if err != nil {
		return nil, "", err
	}
	if len(parts) == 0 {
		return nil, "", nil
	}
	dir := w.root
	for _, c := range parts[:len(parts)-1] {
		next := dir.children[c]
		if next == nil {
			next = &node{name: c, parent: dir, children: map[string]*node{},
				ino: &inode{Attr: Attr{Mode: S_IFDIR | 0o755}, nlink: 1}}
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

// writeData streams the file's data into the data region in HoleSize
// units. A unit of zeros becomes a hole (after the first full one), and
// a file with a hole is stored chunk-based with HoleSize chunks, each
// chunk either a hole or written whole. Other files are flat.
func (w *Writer) writeData(p string, ino *inode, r io.Reader) error {
	var bp blockPlan
	bp.begin(w)
	for off := uint64(0); off < ino.size; off += HoleSize {
		b := w.buf[:min(HoleSize, ino.size-off)]
		if _, err := io.ReadFull(r, b); err != nil {
			return shortRead(p, err)
		}
		if bp.hole(w, uint64(len(b)), isZero(b)) {
			continue
		}
		if err := w.appendData(b); err != nil {
			return err
		}
	}
	if err := checkEOF(p, r); err != nil {
		return err
	}
	bp.end(w, ino)
	return nil
}

// blockPlan assigns a file's blocks unit by unit, the same way whether
// the data is streamed now (Create) or read later (Plan).
type blockPlan struct {
	start  uint32
	chunks []uint32 // per unit: first block or nullAddr; nil while no hole
}

func (bp *blockPlan) begin(w *Writer) { bp.start = w.nextBlk }

// hole records the next unit of n bytes. A zero unit is a hole if it is
// full or a hole came before; then it reports true and takes no blocks.
// Otherwise the caller gives the unit blocks at w.nextBlk.
func (bp *blockPlan) hole(w *Writer, n uint64, zero bool) bool {
	if zero && (n == HoleSize || bp.chunks != nil) {
		if bp.chunks == nil {
			for c := bp.start; c < w.nextBlk; c += HoleSize / BlockSize {
				bp.chunks = append(bp.chunks, c)
			}
		}
		bp.chunks = append(bp.chunks, nullAddr)
		return true
	}
	if bp.chunks != nil {
		bp.chunks = append(bp.chunks, w.nextBlk)
	}
	return false
}

// end sets the inode's layout: chunk-based after a hole, else flat.
func (bp *blockPlan) end(w *Writer, ino *inode) {
	if bp.chunks != nil {
		ino.chunkBits = holeBits - blkBits
		ino.chunks = bp.chunks
		return
	}
	if ino.nblocks = w.nextBlk - bp.start; ino.nblocks > 0 {
		ino.blkaddr = bp.start
	}
}

// reserve takes the blocks for n bytes of a planned file.
func (w *Writer) reserve(n uint64) error {
	blocks := uint32((n + BlockSize - 1) / BlockSize)
	if uint64(w.nextBlk)+uint64(blocks) >= nullAddr {
		w.err = fmt.Errorf("image exceeds %d blocks of %d bytes", uint32(nullAddr-1), BlockSize)
		return w.err
	}
	w.nextBlk += blocks
	return nil
}

// appendData writes b padded to whole blocks.
func (w *Writer) appendData(b []byte) error {
	start := w.nextBlk
	if err := w.reserve(uint64(len(b))); err != nil {
		return err
	}
	pad := int(w.nextBlk-start)*BlockSize - len(b)
	if _, err := w.bw.Write(b); err != nil {
		w.err = err
		return err
	}
	if _, err := w.bw.Write(w.zero[:pad]); err != nil {
		w.err = err
		return err
	}
	return nil
}

func shortRead(p string, err error) error {
	if errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) {
		return fmt.Errorf("%w: %q: data is shorter than its recorded size (file changed or archive truncated?)", ErrInvalid, p)
	}
	return &ReadError{Path: p, Err: err}
}

// ReadError is a failure to read a file's data from its source, as
// opposed to a failure to write the image. For a stream it means the
// stream is corrupt; for a directory, an I/O error.
type ReadError struct {
	Path string
	Err  error
}

func (e *ReadError) Error() string { return fmt.Sprintf("read %q: %v", e.Path, e.Err) }
func (e *ReadError) Unwrap() error { return e.Err }

// checkEOF makes sure a file's reader is exhausted when it is backed by a
// file whose size could have grown since it was stat'ed.
func checkEOF(p string, r io.Reader) error {
	if _, ok := r.(*os.File); !ok {
		return nil
	}
	var one [1]byte
	n, err := r.Read(one[:])
	if n > 0 {
		return fmt.Errorf("%w: %q grew while it was being read; build again from a tree nothing writes to", ErrInvalid, p)
	}
	if err != nil && err != io.EOF {
		return fmt.Errorf("read %q: %w", p, err)
	}
	return nil
}

func padBlock(b []byte) []byte {
	out := make([]byte, BlockSize)
	copy(out, b)
	return out
}

func isZero(b []byte) bool {
	for len(b) >= 8 {
		if binary.LittleEndian.Uint64(b) != 0 {
			return false
		}
		b = b[8:]
	}
	for _, c := range b {
		if c != 0 {
			return false
		}
	}
	return true
}

// IsZero reports whether b holds only zero bytes.
func IsZero(b []byte) bool { return isZero(b) }

var xattrPrefixes = []struct {
	prefix string
	index  uint8
	whole  bool // the name is the prefix itself
}{
	{"user.", 1, false},
	{"system.posix_acl_access", 2, true},
	{"system.posix_acl_default", 3, true},
	{"trusted.", 4, false},
	{"security.", 6, false},
}

type xattrKey struct {
	index uint8
	name  string
}

func splitXattr(name string) (xattrKey, bool) {
	for _, p := range xattrPrefixes {
		if p.whole && name == p.prefix {
			return xattrKey{p.index, ""}, true
		}
		if !p.whole && strings.HasPrefix(name, p.prefix) && len(name) > len(p.prefix) {
			return xattrKey{p.index, name[len(p.prefix):]}, true
		}
	}
	return xattrKey{}, false
}

func checkAttr(p string, a *Attr) error {
	for name, v := range a.Xattrs {
		k, ok := splitXattr(name)
		if !ok {
			return fmt.Errorf("%w: %q: xattr %q is outside the user., trusted., security. and system.posix_acl_* namespaces", ErrInvalid, p, name)
		}
		if len(k.name) > 255 {
			return fmt.Errorf("%w: %q: xattr name %q is longer than 255 bytes", ErrInvalid, p, name)
		}
		if len(v) > 0xFFFF {
			return fmt.Errorf("%w: %q: xattr %q value of %d bytes exceeds 65535", ErrInvalid, p, name, len(v))
		}
	}
	if t := a.Mode & S_IFMT; t != S_IFCHR && t != S_IFBLK {
		a.Rdev = 0
	}
	return nil
}

func encodeXattrs(m map[string][]byte) []byte {
	if len(m) == 0 {
		return nil
	}
	type kv struct {
		k xattrKey
		v []byte
	}
	list := make([]kv, 0, len(m))
	for name, v := range m {
		k, _ := splitXattr(name)
		list = append(list, kv{k, v})
	}
	sort.Slice(list, func(i, j int) bool {
		if list[i].k.index != list[j].k.index {
			return list[i].k.index < list[j].k.index
		}
		return list[i].k.name < list[j].k.name
	})
	out := make([]byte, xattrHeaderSize)
	for _, e := range list {
		var h [4]byte
		h[0] = uint8(len(e.k.name))
		h[1] = e.k.index
		binary.LittleEndian.PutUint16(h[2:], uint16(len(e.v)))
		out = append(out, h[:]...)
		out = append(out, e.k.name...)
		out = append(out, e.v...)
		for len(out)%4 != 0 {
			out = append(out, 0)
		}
	}
	return out
}

// Finish lays out and writes the metadata region and the superblock, and
// flushes the image. The Writer cannot be used afterwards.
func (w *Writer) Finish() (Stats, error) {
	if w.err != nil {
		return Stats{}, w.err
	}
	if w.done {
		return Stats{}, errors.New("erofs: Finish called twice")
	}
	w.done = true
	hotEnd, err := w.assignPlanned()
	if err != nil {
		return Stats{}, err
	}
	dataEnd := w.nextBlk

	// 1. Order inodes breadth first; children of one directory are
	// contiguous, so listing a directory reads neighbouring inodes.
	var (
		order   []*inode
		entries uint64 = 1
		queue          = []*node{w.root}
	)
	w.root.ino.order = 0
	order = append(order, w.root.ino)
	seen := map[*inode]bool{w.root.ino: true}
	for len(queue) > 0 {
		dir := queue[0]
		queue = queue[1:]
		names := make([]string, 0, len(dir.children))
		for name := range dir.children {
			names = append(names, name)
		}
		slices.Sort(names)
		ents := make([]dirent, 0, len(names)+2)
		ents = append(ents, dirent{".", dir}, dirent{"..", parentOf(dir)})
		subdirs := uint32(0)
		for _, name := range names {
			c := dir.children[name]
			ents = append(ents, dirent{name, c})
			entries++
			if !seen[c.ino] {
				seen[c.ino] = true
				c.ino.order = len(order)
				order = append(order, c.ino)
			}
			if c.ino.Mode&S_IFMT == S_IFDIR {
				subdirs++
				queue = append(queue, c)
			}
		}
		slices.SortFunc(ents, func(a, b dirent) int { return strings.Compare(a.name, b.name) })
		dir.ino.dirent = ents
		dir.ino.nlink = 2 + subdirs
	}

	// 2. Size directories and symlinks, and decide what goes inline.
	metaBlk := dataEnd // directory blocks and long symlinks start here
	var metaBlocks [][]byte
	for _, ino := range order {
		switch ino.Mode & S_IFMT {
		case S_IFDIR:
			ino.size = dirSize(ino.dirent)
		case S_IFLNK:
			ino.meta = []byte(ino.target)
		}
	}

	// 3. Assign inode positions in the inode area.
	pos := int64(0)
	for _, ino := range order {
		fixed := int64(inodeSize + len(ino.xattr))
		inline := 0
		switch ino.Mode & S_IFMT {
		case S_IFREG:
			switch {
			case ino.chunks != nil:
				ino.layout = layoutChunked
				fixed = align(fixed, 4) + int64(4*len(ino.chunks))
			default:
				ino.layout = layoutFlatPlain
			}
		case S_IFDIR, S_IFLNK:
			t := int(ino.size % BlockSize)
			if t > 0 && fixed+int64(t) <= BlockSize {
				ino.layout = layoutFlatInline
				inline = t
			} else {
				ino.layout = layoutFlatPlain
			}
		default:
			ino.layout = layoutFlatPlain
		}
		pos = align(pos, slotSize)
		// Keep an inode, its xattrs and inline data inside one block;
		// only an inode whose xattrs or chunk map exceed a block crosses.
		need := fixed + int64(inline)
		if off := pos % BlockSize; off != 0 && off+need > BlockSize {
			pos = align(pos, BlockSize)
		}
		ino.nid = nidBase + uint64(pos/slotSize)
		pos += need
	}
	if w.root.ino.nid > 0xFFFF {
		return Stats{}, errors.New("erofs: root inode out of range")
	}

	// 4. Directory and symlink blocks that are not inline, then tails of
	// regular files that did not fit inline.
	for _, ino := range order {
		var content []byte
		switch ino.Mode & S_IFMT {
		case S_IFDIR:
			content = encodeDir(ino.dirent)
		case S_IFLNK:
			content = ino.meta
		default:
			continue
		}
		full := len(content) / BlockSize
		if ino.layout == layoutFlatPlain {
			full = (len(content) + BlockSize - 1) / BlockSize
		}
		if full > 0 {
			ino.blkaddr = metaBlk + uint32(len(metaBlocks))
		}
		for b := 0; b < full; b++ {
			end := min((b+1)*BlockSize, len(content))
			metaBlocks = append(metaBlocks, padBlock(content[b*BlockSize:end]))
		}
		if ino.layout == layoutFlatInline {
			ino.tail = content[full*BlockSize:]
		}
		ino.meta = nil
	}

	inodeBlk := metaBlk + uint32(len(metaBlocks))

	// 5. The inode area.
	area := make([]byte, align(pos, BlockSize))
	for _, ino := range order {
		off := int((ino.nid - nidBase) * slotSize)
		w.encodeInode(area[off:], ino)
	}
	total := inodeBlk + uint32(len(area)/BlockSize)

	// 6. The superblock.
	sb := make([]byte, BlockSize)
	// meta_blkaddr is the block before the inode area, so that the
	// root's NID (and inode number: the kernel's is the NID) is
	// nidBase, never 0, which glibc's readdir would hide ('.' and '..'
	// of the root) and stat would report; as mkfs.erofs, no inode is 0.
	w.encodeSuper(sb[sbOffset:], order, total, inodeBlk-1)

	// 7. Write: a planned image in one sequential pass, a streamed one
	// by appending the metadata and patching block 0.
	streamed := w.started || len(w.planned) == 0 && w.nextBlk == 1 && w.observe == nil
	if streamed && w.observe != nil {
		return Stats{}, errors.New("erofs: an observer needs a planned image")
	}
	if !streamed {
		if err := w.emit(sb); err != nil {
			return Stats{}, err
		}
		if err := w.emitPlanned(); err != nil {
			return Stats{}, err
		}
	} else if !w.started {
		if err := w.start(); err != nil {
			return Stats{}, err
		}
	}
	for _, b := range metaBlocks {
		if err := w.emit(b); err != nil {
			return Stats{}, err
		}
	}
	if err := w.emit(area); err != nil {
		return Stats{}, err
	}
	if err := w.bw.Flush(); err != nil {
		return Stats{}, err
	}
	if streamed {
		if _, err := w.f.WriteAt(sb[sbOffset:sbOffset+128], sbOffset); err != nil {
			return Stats{}, err
		}
	}
	return Stats{
		Size:     int64(total) * BlockSize,
		Inodes:   uint64(len(order)),
		Entries:  entries,
		Data:     Region{Offset: BlockSize, Size: int64(dataEnd-1) * BlockSize},
		Metadata: Region{Offset: int64(dataEnd) * BlockSize, Size: int64(total-dataEnd) * BlockSize},
		Hot:      Region{Offset: BlockSize, Size: int64(hotEnd-1) * BlockSize},
	}, nil
}

func (w *Writer) encodeSuper(sb []byte, order []*inode, total, inodeBlk uint32) {
	le := binary.LittleEndian
	le.PutUint32(sb[0:], magic)
	sb[12] = blkBits
	le.PutUint16(sb[14:], uint16(w.root.ino.nid))
	le.PutUint64(sb[16:], uint64(len(order)))
	le.PutUint32(sb[36:], total)
	le.PutUint32(sb[40:], inodeBlk)
	var incompat uint32
	for _, ino := range order {
		if ino.layout == layoutChunked {
			incompat |= incompatChunked
		}
	}
	le.PutUint32(sb[80:], incompat)
}

func parentOf(n *node) *node {
	if n.parent == nil {
		return n
	}
	return n.parent
}

func align(v, a int64) int64 { return (v + a - 1) / a * a }

// dirBlocks splits sorted entries into directory blocks.
func dirBlocks(ents []dirent) [][]dirent {
	var out [][]dirent
	used, first := 0, 0
	for i, e := range ents {
		need := direntSize + len(e.name)
		if used+need > BlockSize {
			out = append(out, ents[first:i])
			first, used = i, 0
		}
		used += need
	}
	return append(out, ents[first:])
}

func dirSize(ents []dirent) uint64 {
	blocks := dirBlocks(ents)
	last := blocks[len(blocks)-1]
	used := 0
	for _, e := range last {
		used += direntSize + len(e.name)
	}
	return uint64(len(blocks)-1)*BlockSize + uint64(used)
}

func encodeDir(ents []dirent) []byte {
	var out []byte
	blocks := dirBlocks(ents)
	for bi, blk := range blocks {
		b := make([]byte, 0, BlockSize)
		nameOff := direntSize * len(blk)
		for _, e := range blk {
			var d [direntSize]byte
			binary.LittleEndian.PutUint64(d[0:], e.n.ino.nid)
			binary.LittleEndian.PutUint16(d[8:], uint16(nameOff))
			d[10] = fileType(e.n.ino.Mode)
			b = append(b, d[:]...)
			nameOff += len(e.name)
		}
		for _, e := range blk {
			b = append(b, e.name...)
		}
		if bi < len(blocks)-1 {
			b = append(b, make([]byte, BlockSize-len(b))...)
		}
		out = append(out, b...)
	}
	return out
}

func fileType(mode uint32) uint8 {
	switch mode & S_IFMT {
	case S_IFREG:
		return 1
	case S_IFDIR:
		return 2
	case S_IFCHR:
		return 3
	case S_IFBLK:
		return 4
	case S_IFIFO:
		return 5
	case S_IFSOCK:
		return 6
	case S_IFLNK:
		return 7
	}
	return 0
}

// encodeDev is the kernel's new_encode_dev for a Linux dev_t.
func encodeDev(rdev uint64) uint32 {
	major := uint32((rdev>>8)&0xfff) | uint32((rdev>>32)&^0xfff)
	minor := uint32(rdev&0xff) | uint32((rdev>>12)&^0xff)
	return (minor & 0xff) | (major << 8) | ((minor &^ 0xff) << 12)
}

func (w *Writer) encodeInode(b []byte, ino *inode) {
	le := binary.LittleEndian
	le.PutUint16(b[0:], formatExtended|ino.layout<<1)
	if len(ino.xattr) > 0 {
		le.PutUint16(b[2:], uint16((len(ino.xattr)-xattrHeaderSize)/4+1))
	}
	le.PutUint16(b[4:], uint16(ino.Mode))
	le.PutUint64(b[8:], ino.size)
	var iu uint32
	switch ino.Mode & S_IFMT {
	case S_IFCHR, S_IFBLK:
		iu = encodeDev(ino.Rdev)
	case S_IFREG, S_IFDIR, S_IFLNK:
		iu = ino.blkaddr
		if ino.layout == layoutChunked {
			iu = uint32(ino.chunkBits)
		}
	}
	le.PutUint32(b[16:], iu)
	le.PutUint32(b[20:], uint32(ino.order+1))
	le.PutUint32(b[24:], ino.UID)
	le.PutUint32(b[28:], ino.GID)
	le.PutUint64(b[32:], uint64(ino.Mtime))
	le.PutUint32(b[40:], ino.MtimeNsec)
	le.PutUint32(b[44:], ino.nlink)
	off := inodeSize
	off += copy(b[off:], ino.xattr)
	if ino.layout == layoutChunked {
		off = int(align(int64(off), 4))
		for _, c := range ino.chunks {
			le.PutUint32(b[off:], c)
			off += 4
		}
	}
	if ino.layout == layoutFlatInline {
		copy(b[off:], ino.tail)
	}
}

// SetXattr sets one xattr on an existing entry.
func (w *Writer) SetXattr(p, name string, value []byte) error {
	n, err := w.find(p)
	if err != nil {
		return err
	}
	if n == nil {
		return fmt.Errorf("%w: setxattr %q: no such entry", ErrInvalid, p)
	}
	a := n.ino.Attr
	x := make(map[string][]byte, len(a.Xattrs)+1)
	for k, v := range a.Xattrs {
		x[k] = v
	}
	x[name] = value
	a.Xattrs = x
	if err := checkAttr(p, &a); err != nil {
		return err
	}
	n.ino.Attr = a
	n.ino.xattr = encodeXattrs(x)
	return nil
}
