package erofs

import (
	"encoding/binary"
	"errors"
	"fmt"
)

// An image may keep its file data on extra devices instead of in its own
// data region: the superblock lists them in a device table, and a
// regular file added with CreateRef is chunk-based, each chunk an index
// (device, block) into one of them. The kernel mounts such an image
// with one device= option per extra device, in table order (a file-
// backed mount takes files there); fsck.erofs and go-erofs read it with
// the devices given the same way. This is how one blob of file data is
// shared by the images of many layers: each image holds its tree and
// its chunk indexes, and the blobs hold each distinct chunk once.

const (
	devSlotSize         = 128    // struct erofs_deviceslot
	maxDevSlotOff       = 0xFFFF // devt_slotoff is 16 bits, in slots
	incompatDeviceTable = 0x8
	chunkFormatIndexes  = 0x20 // EROFS_CHUNK_FORMAT_INDEXES
	chunkIndexSize      = 8    // struct erofs_inode_chunk_index
	maxChunkBits        = 31 - blkBits
)

// NullBlock is a Chunk's Block for a hole: Count blocks of zeros.
const NullBlock = nullAddr

// Device is an extra device of an image: its tag (at most 64 bytes, a
// blob's digest hex for instance) and its size in blocks.
type Device struct {
	Tag    string
	Blocks uint64
}

// Chunk locates one chunk of a file added by CreateRef: Block on extra
// device Device (1 for the first AddDevice), or NullBlock for a hole.
type Chunk struct {
	Device uint16
	Block  uint32
}

// AddDevice appends an extra device to the image's table and returns
// its number for Chunk.Device.
func (w *Writer) AddDevice(d Device) (uint16, error) {
	if len(d.Tag) > 64 {
		return 0, fmt.Errorf("%w: device tag of %d bytes (64 at most)", ErrInvalid, len(d.Tag))
	}
	if len(w.devices) >= 0xFFFE {
		return 0, fmt.Errorf("%w: more than %d extra devices", ErrInvalid, 0xFFFE)
	}
	w.devices = append(w.devices, d)
	return uint16(len(w.devices)), nil
}

// CreateRef adds a regular file of size bytes whose data is on extra
// devices, in chunks of BlockSize<<chunkBits bytes: chunks[i] holds
// bytes [i*chunk, (i+1)*chunk) of it, the last chunk only up to size.
// The file takes no block of this image.
func (w *Writer) CreateRef(p string, a Attr, size int64, chunkBits uint8, chunks []Chunk) error {
	if w.err != nil {
		return w.err
	}
	if size < 0 {
		return fmt.Errorf("%w: %q: negative size", ErrInvalid, p)
	}
	if chunkBits > maxChunkBits {
		return fmt.Errorf("%w: %q: chunk bits %d (at most %d)", ErrInvalid, p, chunkBits, maxChunkBits)
	}
	csize := int64(BlockSize) << chunkBits
	if want := (size + csize - 1) / csize; int64(len(chunks)) != want {
		return fmt.Errorf("%w: %q: %d chunks for %d bytes in chunks of %d", ErrInvalid, p, len(chunks), size, csize)
	}
	for i, c := range chunks {
		if c.Block == NullBlock {
			continue
		}
		if c.Device == 0 || int(c.Device) > len(w.devices) {
			return fmt.Errorf("%w: %q: chunk %d on device %d of %d", ErrInvalid, p, i, c.Device, len(w.devices))
		}
		n := min(csize, size-int64(i)*csize)
		end := uint64(c.Block) + uint64((n+BlockSize-1)/BlockSize)
		if end > w.devices[c.Device-1].Blocks {
			return fmt.Errorf("%w: %q: chunk %d ends at block %d of device %d, which has %d", ErrInvalid, p, i, end, c.Device, w.devices[c.Device-1].Blocks)
		}
	}
	a.Mode = a.Mode&^S_IFMT | S_IFREG
	ino := &inode{Attr: a, size: uint64(size), chunkBits: chunkBits}
	if size > 0 {
		ino.refs = chunks
	}
	return w.place(p, ino)
}

// deviceTable encodes the device slots, padded to whole blocks.
func (w *Writer) deviceTable() [][]byte {
	if len(w.devices) == 0 {
		return nil
	}
	b := make([]byte, align(int64(len(w.devices)*devSlotSize), BlockSize))
	le := binary.LittleEndian
	for i, d := range w.devices {
		s := b[i*devSlotSize:]
		copy(s[:64], d.Tag)
		le.PutUint32(s[64:], uint32(d.Blocks))
		le.PutUint32(s[72:], uint32(d.Blocks>>32))
	}
	var out [][]byte
	for off := 0; off < len(b); off += BlockSize {
		out = append(out, b[off:off+BlockSize])
	}
	return out
}

// devSlotOff is the table's place in slots, for a table at block blk.
func devSlotOff(blk uint32) (uint16, error) {
	off := uint64(blk) * BlockSize / devSlotSize
	if off > maxDevSlotOff {
		return 0, errors.New("erofs: the device table would start past 8 MiB: an image with extra devices must keep less data of its own")
	}
	return uint16(off), nil
}

// encodeRefs writes a CreateRef file's chunk indexes at b.
func encodeRefs(b []byte, refs []Chunk) {
	le := binary.LittleEndian
	for i, c := range refs {
		x := b[i*chunkIndexSize:]
		if c.Block == NullBlock {
			le.PutUint16(x[0:], 0xFFFF)
			le.PutUint16(x[2:], 0)
			le.PutUint32(x[4:], nullAddr)
			continue
		}
		le.PutUint16(x[0:], 0)
		le.PutUint16(x[2:], c.Device)
		le.PutUint32(x[4:], c.Block)
	}
}
