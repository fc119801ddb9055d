package erofs

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"os"
)

// writeData streams the file's data into the data region in HoleSize
// units. A unit of zeros becomes a hole (after the first full one), and
// a file with a hole is stored chunk-based with HoleSize chunks, each
// chunk either a hole or written whole. Other files are flat.
func (w *Writer) writeData(p string, ino *inode, r io.Reader) error {
	if w.compress && ino.size > BlockSize {
		return w.writeCompressed(p, ino, r)
	}
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
