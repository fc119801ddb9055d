package erofs

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
	refs      []Chunk  // CreateRef: chunk indexes into extra devices
	extents   []extent // SetCompress: a compressed file's extents

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
