package erofs

import (
	"encoding/binary"
	"errors"
	"slices"
	"strings"
)

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
	order, entries := w.orderInodes()
	sizeMeta(order)
	pos, err := w.placeInodes(order)
	if err != nil {
		return Stats{}, err
	}
	// The device table, if any, starts the metadata region; directory
	// blocks and long symlinks follow it.
	devs := w.deviceTable()
	slotOff, err := devSlotOff(dataEnd)
	if err != nil && len(devs) > 0 {
		return Stats{}, err
	}
	metaBlk := dataEnd + uint32(len(devs))
	metaBlocks := append(devs, spillMeta(order, metaBlk)...)
	inodeBlk := dataEnd + uint32(len(metaBlocks))
	area := w.inodeArea(order, pos)
	total := inodeBlk + uint32(len(area)/BlockSize)
	sb := make([]byte, BlockSize)
	// meta_blkaddr is the block before the inode area, so that the
	// root's NID (and inode number: the kernel's is the NID) is
	// nidBase, never 0, which glibc's readdir would hide ('.' and '..'
	// of the root) and stat would report; as mkfs.erofs, no inode is 0.
	w.encodeSuper(sb[sbOffset:], order, total, inodeBlk-1, slotOff)
	if err := w.write(sb, metaBlocks, area); err != nil {
		return Stats{}, err
	}
	return Stats{
		Size:       int64(total) * BlockSize,
		Inodes:     uint64(len(order)),
		Entries:    entries,
		Data:       Region{Offset: BlockSize, Size: int64(dataEnd-1) * BlockSize},
		Metadata:   Region{Offset: int64(dataEnd) * BlockSize, Size: int64(total-dataEnd) * BlockSize},
		Hot:        Region{Offset: BlockSize, Size: int64(hotEnd-1) * BlockSize},
		Compressed: compressedFiles(order),
	}, nil
}

// compressedFiles counts the inodes of compressed files.
func compressedFiles(order []*inode) (n uint64) {
	for _, ino := range order {
		if ino.layout == layoutCompressedFull {
			n++
		}
	}
	return n
}

// orderInodes numbers the inodes breadth first (children of one
// directory are contiguous, so listing a directory reads neighbouring
// inodes) and fills each directory's entries, sorted by name.
func (w *Writer) orderInodes() (order []*inode, entries uint64) {
	entries = 1
	queue := []*node{w.root}
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
	return order, entries
}

// sizeMeta sizes directories and symlinks.
func sizeMeta(order []*inode) {
	for _, ino := range order {
		switch ino.Mode & S_IFMT {
		case S_IFDIR:
			ino.size = dirSize(ino.dirent)
		case S_IFLNK:
			ino.meta = []byte(ino.target)
		}
	}
}

// placeInodes decides what goes inline and places each inode in the
// inode area; it returns the area's length.
func (w *Writer) placeInodes(order []*inode) (int64, error) {
	pos := int64(0)
	for _, ino := range order {
		fixed := int64(inodeSize + len(ino.xattr))
		inline := 0
		switch ino.Mode & S_IFMT {
		case S_IFREG:
			switch {
			case ino.extents != nil:
				ino.layout = layoutCompressedFull
				fixed = align(fixed, 8) + compressedMeta(ino)
			case ino.refs != nil:
				ino.layout = layoutChunked
				fixed = align(fixed, chunkIndexSize) + int64(chunkIndexSize*len(ino.refs))
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
		return 0, errors.New("erofs: root inode out of range")
	}
	return pos, nil
}

// spillMeta lays out, from block metaBlk, the directory and symlink
// blocks that are not inline, and keeps the inline tails on their inodes.
func spillMeta(order []*inode, metaBlk uint32) (metaBlocks [][]byte) {
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
	return metaBlocks
}

// inodeArea encodes every inode at its place in an area of pos bytes,
// rounded up to a block.
func (w *Writer) inodeArea(order []*inode, pos int64) []byte {
	area := make([]byte, align(pos, BlockSize))
	for _, ino := range order {
		off := int((ino.nid - nidBase) * slotSize)
		w.encodeInode(area[off:], ino)
	}
	return area
}

// write writes what Finish laid out: a planned image in one sequential
// pass, a streamed one by appending the metadata and patching block 0.
func (w *Writer) write(sb []byte, metaBlocks [][]byte, area []byte) error {
	streamed := w.started || len(w.planned) == 0 && w.nextBlk == 1 && w.observe == nil
	if streamed && w.observe != nil {
		return errors.New("erofs: an observer needs a planned image")
	}
	if !streamed {
		if err := w.emit(sb); err != nil {
			return err
		}
		if err := w.emitPlanned(); err != nil {
			return err
		}
	} else if !w.started {
		if err := w.start(); err != nil {
			return err
		}
	}
	for _, b := range metaBlocks {
		if err := w.emit(b); err != nil {
			return err
		}
	}
	if err := w.emit(area); err != nil {
		return err
	}
	if err := w.bw.Flush(); err != nil {
		return err
	}
	if streamed { // the superblock and what follows it (compression's configuration)
		if _, err := w.f.WriteAt(sb[sbOffset:sbOffset+128+comprCfgsSize], sbOffset); err != nil {
			return err
		}
	}
	return nil
}

func (w *Writer) encodeSuper(sb []byte, order []*inode, total, inodeBlk uint32, slotOff uint16) {
	le := binary.LittleEndian
	le.PutUint32(sb[0:], magic)
	sb[12] = blkBits
	le.PutUint16(sb[14:], uint16(w.root.ino.nid))
	le.PutUint64(sb[16:], uint64(len(order)))
	le.PutUint32(sb[36:], total)
	le.PutUint32(sb[40:], inodeBlk)
	var incompat uint32
	for _, ino := range order {
		switch ino.layout {
		case layoutChunked:
			incompat |= incompatChunked
		case layoutCompressedFull:
			incompat |= incompatZeroPadding | incompatBigPcluster
		}
	}
	if incompat&incompatBigPcluster != 0 {
		le.PutUint16(sb[84:], 1<<algLZ4) // available_compr_algs
		encodeComprCfgs(sb[128:])
	}
	if len(w.devices) > 0 {
		incompat |= incompatDeviceTable
		le.PutUint16(sb[86:], uint16(len(w.devices)))
		le.PutUint16(sb[88:], slotOff)
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
		if ino.layout == layoutCompressedFull {
			iu = ino.nblocks // compressed_blocks: what stat counts
		}
		if ino.layout == layoutChunked {
			iu = uint32(ino.chunkBits)
			if ino.refs != nil {
				iu |= chunkFormatIndexes
			}
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
	if ino.layout == layoutChunked && ino.refs != nil {
		off = int(align(int64(off), chunkIndexSize))
		encodeRefs(b[off:], ino.refs)
	} else if ino.layout == layoutChunked {
		off = int(align(int64(off), 4))
		for _, c := range ino.chunks {
			le.PutUint32(b[off:], c)
			off += 4
		}
	}
	if ino.layout == layoutCompressedFull {
		encodeCompressedMap(b[align(int64(off), 8):], ino)
	}
	if ino.layout == layoutFlatInline {
		copy(b[off:], ino.tail)
	}
}
