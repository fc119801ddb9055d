package erofs

import (
	"bufio"
	"errors"
	"io"

	"github.com/pierrec/lz4/v4"
)

// ErrInvalid is wrapped by every error caused by the caller's input (a
// bad path, an unsupported xattr) rather than by I/O.
var ErrInvalid = errors.New("invalid entry")

// ErrTooMany is returned once a source adds more entries than the
// writer's bound (SetMaxEntries).
var ErrTooMany = errors.New("too many entries")

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
	// Compressed counts the regular files stored compressed (SetCompress).
	Compressed uint64
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
	implied func(p string) (Attr, bool) // SetImplied

	maxEntries, placed int // SetMaxEntries

	devices []Device // AddDevice: the extra devices, in table order

	compress bool            // SetCompress
	lz4      *lz4.Compressor // SetCompress: its hash table, reused
	zbuf     []byte          // SetCompress: a compressed extent
	// zeroPcluster is the block of the pcluster of a whole extent of
	// zeros, once one was written (0: none yet).
	zeroPcluster uint32
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
