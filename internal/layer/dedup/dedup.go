// Package dedup stores the file data of many layers once: it splits each
// regular file of a layer's EROFS image into fixed chunks keyed by their
// content (sha256), writes the chunks no earlier layer had to one new
// blob, and writes a metadata image (the tree, with each file's chunks
// as indexes into blobs) that the kernel mounts directly with the blobs
// as extra devices (package erofs, CreateRef). Two layers that hold the
// same wheel, library or source file share its chunks, in the store and
// in the page cache.
//
// The layer's canonical image stays its identity (its digest, what is
// pushed and verified); the metadata image and the blobs are how a host
// keeps it. Packing the same image against the same index gives the same
// bytes, so the blob a pack writes is named by its digest.
//
// Chunks are fixed, aligned to the file's start, so a file shared
// whole, or a prefix of one, shares its chunks; an insertion in the
// middle of a file does not (content-defined chunking would find it, but
// EROFS chunk indexes address fixed chunk sizes). A chunk of zeros is a
// hole and takes no space.
package dedup

import (
	"cmp"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"hash"
	"io"
	"io/fs"
	"slices"

	"github.com/containerd/errdefs"
	goerofs "github.com/erofs/go-erofs"
	"github.com/opencontainers/go-digest"
	"golang.org/x/sys/unix"

	"github.com/dsec-project/dsec/internal/layer/erofs"
)

const (
	// ChunkBits is log2 of a chunk's blocks: chunks of 64 KiB, small
	// enough that a changed file shares its unchanged parts and that a
	// lazy reader fetches little past what it reads, large enough that
	// a file's chunk indexes are 1/8192 of its size.
	ChunkBits = 4
	// ChunkSize is the bytes of a chunk (the last one of a file may be
	// shorter).
	ChunkSize   = erofs.BlockSize << ChunkBits
	chunkBlocks = ChunkSize / erofs.BlockSize
)

// Sum is a chunk's content key: the sha256 of its bytes.
type Sum [sha256.Size]byte

// Loc is where a blob holds a chunk: its first block.
type Loc struct {
	Blob  digest.Digest
	Block uint32
}

// Index finds chunks already stored. Pack adds nothing to it: the
// caller adds a Result's New entries once the blob is stored.
type Index interface {
	Lookup(Sum) (Loc, bool)
	// Blocks is the size of a blob the index names, in blocks.
	Blocks(digest.Digest) (uint64, error)
}

// Entry is one chunk of a new blob.
type Entry struct {
	Sum    Sum
	Block  uint32
	Blocks uint32
}

// Result says what Pack wrote.
type Result struct {
	// Devices are the blobs the metadata image reads, in the order its
	// device table lists them (the order to mount them in); Blob is
	// among them if it is not empty.
	Devices []digest.Digest
	// Blob is the digest of what Pack wrote to its blob writer, or ""
	// when every chunk was stored already (nothing was written).
	Blob digest.Digest
	// BlobBlocks is its size in blocks; New its chunks.
	BlobBlocks uint64
	New        []Entry
	// Logical is the layer's file data in bytes; Shared of it was
	// found in the index or earlier in the layer, Holes of it is zeros.
	Logical, Shared, Holes int64
	Meta                   erofs.Stats
	// Extents say where the canonical image's file data is in the
	// blobs, in file order: what Rebuild needs, with the image's
	// superblock and metadata, to make the canonical image again.
	Extents []Extent
	// Windows is the new blob's window table (WindowTable): what a
	// host reading the blob lazily checks each window it fetches against.
	Windows []byte
}

// Extent is Blocks blocks of the canonical image from block At, which
// blob Blob holds from block Block.
type Extent struct {
	At     uint32        `json:"at"`
	Blocks uint32        `json:"blocks"`
	Blob   digest.Digest `json:"blob"`
	Block  uint32        `json:"block"`
}

// ErrNotCanonical is wrapped when an image keeps file data other than in
// whole blocks of its own (an inline tail, compressed data): dsec builds
// no such image, and Pack refuses it.
var ErrNotCanonical = errors.New("not an image dsec built")

// chunkRef is a file's chunk before the devices are numbered: a blob
// ("" for the new one) and a block, or a hole.
type chunkRef struct {
	blob  digest.Digest
	block uint32
	hole  bool
}

// entry is one path of the layer, to be added to the metadata image.
type entry struct {
	path   string
	attr   erofs.Attr
	link   string // hard link to this earlier path
	target string // symlink target
	size   int64
	chunks []chunkRef
}

// ErrCompressed is Pack's refusal of a compressed layer: the kernel
// reads a packed file's chunks from the blobs as they are, uncompressed.
var ErrCompressed = fmt.Errorf("the layer's files are compressed, and a packed layer's chunks are not: it stays whole: %w", errdefs.ErrNotImplemented)

// Pack reads the canonical EROFS image img and writes the metadata image
// to meta and the chunks idx lacks to blob, block-aligned, from its
// start. blob must be empty; when the result's Blob is "", it is still
// empty and the caller discards it.
func Pack(img io.ReaderAt, meta erofs.File, blob io.Writer, idx Index) (*Result, error) {
	if z, err := erofs.Compressed(img); err != nil {
		return nil, fmt.Errorf("read the superblock: %w", err)
	} else if z {
		return nil, ErrCompressed
	}
	fsys, err := goerofs.Open(img)
	if err != nil {
		return nil, fmt.Errorf("open EROFS image: %w", err)
	}
	metaBlk, err := metaBlkaddr(img)
	if err != nil {
		return nil, err
	}
	p := &packer{idx: idx, blob: blob, hash: sha256.New(), win: &Windows{}, local: map[Sum]uint32{}, used: map[digest.Digest]bool{}, res: &Result{}}
	var ents []entry
	first := map[int64]string{} // inode (NID) -> first path, for hard links
	err = fs.WalkDir(fsys, ".", func(name string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		info, err := d.Info()
		if err != nil {
			return err
		}
		st, ok := info.Sys().(*goerofs.Stat)
		if !ok {
			return fmt.Errorf("pack %s: no inode attributes", name)
		}
		e := entry{path: name, attr: AttrOf(st)}
		if name == "." {
			e.path = ""
		}
		if !info.IsDir() && st.Nlink > 1 {
			if f, ok := first[st.Ino]; ok {
				e.link = f
				ents = append(ents, e)
				return nil
			}
			first[st.Ino] = e.path
		}
		switch {
		case info.Mode()&fs.ModeSymlink != 0:
			e.target, err = fs.ReadLink(fsys, name)
		case info.Mode().IsRegular():
			e.size = info.Size()
			var at func(int64) (int64, bool)
			if e.size == 0 {
				break
			}
			if at, err = canonicalAt(img, metaBlk, st, info); err == nil {
				e.chunks, err = p.file(img, e.size, at)
			}
		}
		if err != nil {
			return fmt.Errorf("pack %s: %w", name, err)
		}
		ents = append(ents, e)
		return nil
	})
	if err != nil {
		return nil, err
	}
	return p.finish(meta, ents)
}

type packer struct {
	idx  Index
	blob io.Writer
	hash interface {
		io.Writer
		Sum([]byte) []byte
	}
	win     *Windows
	next    uint32                 // next free block of the new blob
	local   map[Sum]uint32         // chunks written to the new blob
	used    map[digest.Digest]bool // blobs of the index the layer reads
	res     *Result
	extents []Extent
	buf     [ChunkSize]byte
	zero    [erofs.BlockSize]byte
}

// MaxDevices bounds the chunk blobs one layer reads, its own included:
// each is a device= option of its mount, and mount(2) takes one page of
// options. A chunk in a blob past the bound is stored again, in the
// layer's own blob.
const MaxDevices = 64

// use says whether the layer may read chunks of blob b: it does
// already, or it reads fewer than MaxDevices-1 others.
func (p *packer) use(b digest.Digest) bool {
	if p.used[b] {
		return true
	}
	if len(p.used) >= MaxDevices-1 {
		return false
	}
	p.used[b] = true
	return true
}

// file splits one regular file into chunks and stores the new ones,
// reading them from the image img; at says where a byte of the file is
// in it (false: in none of its blocks, a hole, which is not read).
func (p *packer) file(img io.ReaderAt, size int64, at func(int64) (int64, bool)) ([]chunkRef, error) {
	var out []chunkRef
	for off := int64(0); off < size; off += ChunkSize {
		b := p.buf[:min(ChunkSize, size-off)]
		p.res.Logical += int64(len(b))
		if _, ok := at(off); !ok { // a chunk lies in one unit of a block map
			p.res.Holes += int64(len(b))
			out = append(out, chunkRef{hole: true})
			continue
		}
		n := uint32((len(b) + erofs.BlockSize - 1) / erofs.BlockSize)
		// Where each block of the chunk is in the image: one run, or
		// several (a file in a profile's hot region in part).
		var runs []Extent
		for j := uint32(0); j < n; j++ {
			canon, ok := at(off + int64(j)*erofs.BlockSize)
			if !ok || canon%erofs.BlockSize != 0 {
				return nil, fmt.Errorf("%w: data at %d is not in whole blocks of the image", ErrNotCanonical, off+int64(j)*erofs.BlockSize)
			}
			blk := uint32(canon / erofs.BlockSize)
			if r := len(runs) - 1; r >= 0 && runs[r].At+runs[r].Blocks == blk {
				runs[r].Blocks++
				continue
			}
			runs = append(runs, Extent{At: blk, Blocks: 1, Block: j})
		}
		for _, r := range runs {
			from := int(r.Block) * erofs.BlockSize
			dst := b[from:min(len(b), from+int(r.Blocks)*erofs.BlockSize)]
			if _, err := img.ReadAt(dst, int64(r.At)*erofs.BlockSize); err != nil {
				return nil, fmt.Errorf("read image: %w", err)
			}
		}
		if erofs.IsZero(b) {
			p.res.Holes += int64(len(b))
			out = append(out, chunkRef{hole: true})
			continue
		}
		sum := Sum(sha256.Sum256(b))
		var c chunkRef
		if blk, ok := p.local[sum]; ok {
			p.res.Shared += int64(len(b))
			c = chunkRef{block: blk}
		} else if l, ok := p.idx.Lookup(sum); ok && p.use(l.Blob) {
			p.res.Shared += int64(len(b))
			c = chunkRef{blob: l.Blob, block: l.Block}
		} else {
			if err := p.write(b, int(n)*erofs.BlockSize-len(b)); err != nil {
				return nil, err
			}
			p.local[sum] = p.next
			p.res.New = append(p.res.New, Entry{Sum: sum, Block: p.next, Blocks: n})
			c = chunkRef{block: p.next}
			p.next += n
		}
		out = append(out, c)
		for _, r := range runs {
			r.Blob, r.Block = c.blob, c.block+r.Block
			p.extents = append(p.extents, r)
		}
	}
	return out, nil
}

func (p *packer) write(b []byte, pad int) error {
	for _, x := range [][]byte{b, p.zero[:pad]} {
		if _, err := p.blob.Write(x); err != nil {
			return fmt.Errorf("write blob: %w", err)
		}
		p.hash.Write(x)
		p.win.Write(x)
	}
	return nil
}

// finish numbers the devices in order of first use and writes the
// metadata image.
func (p *packer) finish(meta erofs.File, ents []entry) (*Result, error) {
	res := p.res
	if p.next > 0 {
		res.Blob = digest.NewDigestFromBytes(digest.SHA256, p.hash.Sum(nil))
		res.BlobBlocks = uint64(p.next)
		res.Windows = p.win.Table()
	}
	for i := range p.extents {
		if p.extents[i].Blob == "" {
			p.extents[i].Blob = res.Blob
		}
	}
	res.Extents = p.extents
	w, err := erofs.NewWriter(meta)
	if err != nil {
		return nil, err
	}
	dev := map[digest.Digest]uint16{}
	device := func(d digest.Digest) (uint16, error) {
		if id, ok := dev[d]; ok {
			return id, nil
		}
		blocks := res.BlobBlocks
		if d != res.Blob {
			if blocks, err = p.idx.Blocks(d); err != nil {
				return 0, err
			}
		}
		id, err := w.AddDevice(erofs.Device{Tag: d.Encoded(), Blocks: blocks})
		if err != nil {
			return 0, err
		}
		dev[d] = id
		res.Devices = append(res.Devices, d)
		return id, nil
	}
	for _, e := range ents {
		if err := p.add(w, e, device); err != nil {
			return nil, fmt.Errorf("pack %s: %w", "/"+e.path, err)
		}
	}
	if res.Meta, err = w.Finish(); err != nil {
		return nil, err
	}
	return res, nil
}

func (p *packer) add(w *erofs.Writer, e entry, device func(digest.Digest) (uint16, error)) error {
	a := e.attr
	switch {
	case e.link != "":
		return w.Link(e.path, e.link)
	case a.Mode&erofs.S_IFMT == erofs.S_IFDIR:
		return w.Mkdir(e.path, a)
	case a.Mode&erofs.S_IFMT == erofs.S_IFLNK:
		return w.Symlink(e.path, e.target, a)
	case a.Mode&erofs.S_IFMT == erofs.S_IFREG:
		chunks := make([]erofs.Chunk, len(e.chunks))
		for i, c := range e.chunks {
			if c.hole {
				chunks[i] = erofs.Chunk{Block: erofs.NullBlock}
				continue
			}
			b := c.blob
			if b == "" {
				b = p.res.Blob
			}
			id, err := device(b)
			if err != nil {
				return err
			}
			chunks[i] = erofs.Chunk{Device: id, Block: c.block}
		}
		return w.CreateRef(e.path, a, e.size, ChunkBits, chunks)
	default:
		return w.Mknod(e.path, a)
	}
}

// AttrOf is an entry's attributes as go-erofs reads them, for the
// writer: its mode from the Stat (go-erofs' FileInfo.Mode drops setuid,
// setgid and sticky), its device number decoded, its ACLs named as
// the kernel names them.
func AttrOf(st *goerofs.Stat) erofs.Attr {
	m := st.Mode
	a := erofs.Attr{Mode: uint32(m.Perm()), UID: st.UID, GID: st.GID, Mtime: int64(st.Mtime), MtimeNsec: st.MtimeNs}
	switch {
	case m.IsDir():
		a.Mode |= erofs.S_IFDIR
	case m&fs.ModeSymlink != 0:
		a.Mode |= erofs.S_IFLNK
	case m&fs.ModeCharDevice != 0:
		a.Mode |= erofs.S_IFCHR
	case m&fs.ModeDevice != 0:
		a.Mode |= erofs.S_IFBLK
	case m&fs.ModeNamedPipe != 0:
		a.Mode |= erofs.S_IFIFO
	case m&fs.ModeSocket != 0:
		a.Mode |= erofs.S_IFSOCK
	default:
		a.Mode |= erofs.S_IFREG
	}
	if m&fs.ModeSetuid != 0 {
		a.Mode |= 0o4000
	}
	if m&fs.ModeSetgid != 0 {
		a.Mode |= 0o2000
	}
	if m&fs.ModeSticky != 0 {
		a.Mode |= 0o1000
	}
	if a.Mode&erofs.S_IFMT == erofs.S_IFCHR || a.Mode&erofs.S_IFMT == erofs.S_IFBLK {
		d := st.Rdev // the kernel's new_encode_dev
		major, minor := uint64(d&0xfff00)>>8, uint64(d&0xff|(d>>12)&0xfff00)
		a.Rdev = unix.Mkdev(uint32(major), uint32(minor))
	}
	for k, v := range st.Xattrs {
		// go-erofs names ACLs with a trailing dot.
		if k == "system.posix_acl_access." || k == "system.posix_acl_default." {
			k = k[:len(k)-1]
		}
		if a.Xattrs == nil {
			a.Xattrs = map[string][]byte{}
		}
		a.Xattrs[k] = []byte(v)
	}
	return a
}

// ErrCorrupt is wrapped by errors about an index's bytes.
var ErrCorrupt = errors.New("corrupt chunk index")

// HotIn is where the bytes of region hot of a canonical image lie in
// chunk blob blob, by the image's extents: the one region of the blob
// that holds them all, or none (Size 0) if it holds none of them, or if
// that region is over twice their size (they are scattered among other
// chunks: prefetching it would fetch more than it saves).
func HotIn(extents []Extent, hot erofs.Region, blob digest.Digest) erofs.Region {
	lo, hi, n := int64(-1), int64(0), int64(0)
	for _, e := range extents {
		if e.Blob != blob {
			continue
		}
		at, end := int64(e.At)*erofs.BlockSize, (int64(e.At)+int64(e.Blocks))*erofs.BlockSize
		a, b := max(at, hot.Offset), min(end, hot.Offset+hot.Size)
		if a >= b {
			continue
		}
		off := int64(e.Block)*erofs.BlockSize + a - at
		if lo < 0 || off < lo {
			lo = off
		}
		hi = max(hi, off+b-a)
		n += b - a
	}
	if n == 0 || hi-lo > 2*n {
		return erofs.Region{}
	}
	return erofs.Region{Offset: lo, Size: hi - lo}
}

// WindowSize is the window of a chunk blob's window table: a chunk's
// size, the unit a lazy host fetches and checks.
const WindowSize = ChunkSize

// Windows hashes what is written to it in windows of WindowSize: a
// chunk blob's window table, the sha256 of each window in order (the
// last one may be short), as layer.WindowTable makes a layer's.
type Windows struct {
	h     hash.Hash
	n     int
	table []byte
}

func (w *Windows) Write(b []byte) (int, error) {
	if w.h == nil {
		w.h = sha256.New()
	}
	k := len(b)
	for len(b) > 0 {
		m := min(len(b), WindowSize-w.n)
		w.h.Write(b[:m])
		w.n += m
		b = b[m:]
		if w.n == WindowSize {
			w.table, w.n = w.h.Sum(w.table), 0
			w.h.Reset()
		}
	}
	return k, nil
}

// Table ends the last window and returns the table.
func (w *Windows) Table() []byte {
	if w.n > 0 {
		w.table, w.n = w.h.Sum(w.table), 0
		w.h.Reset()
	}
	return w.table
}

// WindowTable is the window table of what r reads, to its end.
func WindowTable(r io.Reader) ([]byte, error) {
	var w Windows
	if _, err := io.CopyBuffer(&w, r, make([]byte, WindowSize)); err != nil {
		return nil, err
	}
	return w.Table(), nil
}

// entrySize is an encoded Entry: sum, block, blocks.
const entrySize = sha256.Size + 8

// EncodeEntries encodes a blob's chunk list, to keep beside the blob.
func EncodeEntries(es []Entry) []byte {
	out := make([]byte, 0, len(es)*entrySize)
	for _, e := range es {
		out = append(out, e.Sum[:]...)
		out = append(out, byte(e.Block), byte(e.Block>>8), byte(e.Block>>16), byte(e.Block>>24))
		out = append(out, byte(e.Blocks), byte(e.Blocks>>8), byte(e.Blocks>>16), byte(e.Blocks>>24))
	}
	return out
}

// DecodeEntries decodes what EncodeEntries made for a blob of blocks
// blocks: each chunk lies inside the blob.
func DecodeEntries(b []byte, blocks uint64) ([]Entry, error) {
	if len(b)%entrySize != 0 {
		return nil, fmt.Errorf("%w: %d bytes is not a whole number of entries", ErrCorrupt, len(b))
	}
	out := make([]Entry, 0, len(b)/entrySize)
	for ; len(b) > 0; b = b[entrySize:] {
		var e Entry
		copy(e.Sum[:], b)
		x := b[sha256.Size:]
		e.Block = uint32(x[0]) | uint32(x[1])<<8 | uint32(x[2])<<16 | uint32(x[3])<<24
		e.Blocks = uint32(x[4]) | uint32(x[5])<<8 | uint32(x[6])<<16 | uint32(x[7])<<24
		if e.Blocks == 0 || e.Blocks > chunkBlocks || uint64(e.Block)+uint64(e.Blocks) > blocks {
			return nil, fmt.Errorf("%w: chunk %s at block %d of %d blocks in a blob of %d", ErrCorrupt, hex.EncodeToString(e.Sum[:6]), e.Block, e.Blocks, blocks)
		}
		out = append(out, e)
	}
	return out, nil
}

// MapIndex is an Index in memory.
type MapIndex struct {
	Chunks map[Sum]Loc
	Sizes  map[digest.Digest]uint64
}

// NewMapIndex returns an empty index.
func NewMapIndex() *MapIndex {
	return &MapIndex{Chunks: map[Sum]Loc{}, Sizes: map[digest.Digest]uint64{}}
}

func (m *MapIndex) Lookup(s Sum) (Loc, bool) { l, ok := m.Chunks[s]; return l, ok }

func (m *MapIndex) Blocks(d digest.Digest) (uint64, error) {
	n, ok := m.Sizes[d]
	if !ok {
		return 0, fmt.Errorf("blob %s is not in the chunk index", d)
	}
	return n, nil
}

// Add records a stored blob's chunks; a chunk already indexed keeps its
// first place.
func (m *MapIndex) Add(blob digest.Digest, blocks uint64, es []Entry) {
	m.Sizes[blob] = blocks
	for _, e := range es {
		if _, ok := m.Chunks[e.Sum]; !ok {
			m.Chunks[e.Sum] = Loc{Blob: blob, Block: e.Block}
		}
	}
}

// metaBlkaddr reads the superblock's meta_blkaddr.
func metaBlkaddr(img io.ReaderAt) (int64, error) {
	var b [4]byte
	if _, err := img.ReadAt(b[:], 1024+40); err != nil {
		return 0, fmt.Errorf("read superblock: %w", err)
	}
	return int64(binary.LittleEndian.Uint32(b[:])), nil
}

// canonicalAt says where each byte of a regular file is in the image:
// after one start for a flat file, unit by unit for a chunk-based one
// (a block map: dsec's writer stores a file with holes so).
func canonicalAt(img io.ReaderAt, metaBlk int64, st *goerofs.Stat, info fs.FileInfo) (func(int64) (int64, bool), error) {
	if dr, ok := info.(interface{ DataRange() []goerofs.DataRange }); ok {
		if r := dr.DataRange(); len(r) == 1 && r[0].Device == 0 && r[0].Offset >= 0 && r[0].Size == info.Size() {
			base := r[0].Offset
			return func(off int64) (int64, bool) { return base + off, true }, nil
		}
	}
	const layoutChunked = 4
	if st.InodeLayout != layoutChunked {
		return nil, fmt.Errorf("%w: layout %d", ErrNotCanonical, st.InodeLayout)
	}
	ipos := metaBlk*erofs.BlockSize + st.Ino*32
	var ino [64]byte
	if _, err := img.ReadAt(ino[:], ipos); err != nil {
		return nil, fmt.Errorf("read inode %d: %w", st.Ino, err)
	}
	le := binary.LittleEndian
	isize := int64(32)
	if le.Uint16(ino[0:])&1 != 0 {
		isize = 64
	}
	xsize := int64(0)
	if n := int64(le.Uint16(ino[2:])); n > 0 {
		xsize = 12 + (n-1)*4
	}
	format := le.Uint32(ino[16:])
	if format&chunkFormatIndexes != 0 {
		return nil, fmt.Errorf("%w: chunk indexes", ErrNotCanonical)
	}
	unit := int64(erofs.BlockSize) << (format & 0x1f)
	n := (info.Size() + unit - 1) / unit
	if n > 1<<24 {
		return nil, fmt.Errorf("%w: %d chunks", ErrNotCanonical, n)
	}
	raw := make([]byte, 4*n)
	pos := (ipos + isize + xsize + 3) &^ 3
	if _, err := img.ReadAt(raw, pos); err != nil {
		return nil, fmt.Errorf("read block map of inode %d: %w", st.Ino, err)
	}
	return func(off int64) (int64, bool) {
		a := le.Uint32(raw[4*(off/unit):])
		if a == erofs.NullBlock {
			return 0, false
		}
		return int64(a)*erofs.BlockSize + off%unit, true
	}, nil
}

const chunkFormatIndexes = 0x20

// Head writes to out what the canonical image img (of size bytes) holds
// besides the file data extents cover: its superblock, directories and
// inodes. out must read zeros where nothing is written (a new file
// truncated to size): blocks of zeros are not written either, so out
// stays sparse and takes about the metadata's size on disk.
func Head(out io.WriterAt, img io.ReaderAt, size int64, extents []Extent) error {
	covered := coverage(size, extents)
	buf := make([]byte, erofs.BlockSize)
	for blk := int64(0); blk*erofs.BlockSize < size; blk++ {
		if covered[blk] {
			continue
		}
		if _, err := img.ReadAt(buf, blk*erofs.BlockSize); err != nil {
			return fmt.Errorf("read image: %w", err)
		}
		if erofs.IsZero(buf) {
			continue
		}
		if _, err := out.WriteAt(buf, blk*erofs.BlockSize); err != nil {
			return fmt.Errorf("write head: %w", err)
		}
	}
	return nil
}

// Rebuild writes the canonical image of size bytes to w, in order, from
// its head and its extents in the blobs blob opens: what no extent
// covers is the head's. The caller checks the digest of what it wrote.
func Rebuild(w io.Writer, head io.ReaderAt, size int64, extents []Extent, blob func(digest.Digest) (io.ReaderAt, error)) error {
	if size%erofs.BlockSize != 0 {
		return fmt.Errorf("%w: an image of %d bytes", ErrCorrupt, size)
	}
	ex := slices.Clone(extents)
	slices.SortFunc(ex, func(a, b Extent) int { return cmp.Compare(a.At, b.At) })
	buf := make([]byte, 1<<20)
	copyHead := func(from, to int64) error { // bytes [from, to) of the head
		for off := from; off < to; {
			n := min(int64(len(buf)), to-off)
			if _, err := head.ReadAt(buf[:n], off); err != nil && !errors.Is(err, io.EOF) {
				return fmt.Errorf("read head: %w", err)
			}
			if _, err := w.Write(buf[:n]); err != nil {
				return err
			}
			off += n
		}
		return nil
	}
	open := map[digest.Digest]io.ReaderAt{}
	pos := int64(0)
	for _, e := range ex {
		at, n := int64(e.At)*erofs.BlockSize, int64(e.Blocks)*erofs.BlockSize
		if at < pos || at+n > size || e.Blocks == 0 || e.Blocks > chunkBlocks {
			return fmt.Errorf("%w: extent of %d blocks at block %d of an image of %d bytes", ErrCorrupt, e.Blocks, e.At, size)
		}
		if err := copyHead(pos, at); err != nil {
			return err
		}
		r, ok := open[e.Blob]
		if !ok {
			var err error
			if r, err = blob(e.Blob); err != nil {
				return err
			}
			open[e.Blob] = r
		}
		if _, err := r.ReadAt(buf[:n], int64(e.Block)*erofs.BlockSize); err != nil {
			return fmt.Errorf("read blob %s: %w", e.Blob, err)
		}
		if _, err := w.Write(buf[:n]); err != nil {
			return err
		}
		pos = at + n
	}
	return copyHead(pos, size)
}

// coverage marks the blocks of an image of size bytes that extents
// cover.
func coverage(size int64, extents []Extent) []bool {
	c := make([]bool, (size+erofs.BlockSize-1)/erofs.BlockSize)
	for _, e := range extents {
		for b := int64(e.At); b < int64(e.At)+int64(e.Blocks) && b < int64(len(c)); b++ {
			c[b] = true
		}
	}
	return c
}
