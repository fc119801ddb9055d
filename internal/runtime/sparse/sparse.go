// Package sparse reads and writes sparse images: the data of a file,
// its holes and all-zero pages left out, as one stream. A microVM's
// memory snapshot keeps the guest's RAM and disk so: a guest of 2 GiB
// that touched 200 MiB is an image of some 200 MiB, hashed, stored and
// moved as that.
//
// An image is the magic "DSECSPR1", the file's size (8 bytes, big
// endian), then its extents in order: each an offset and a length (8
// bytes each, big endian) and that many bytes of data. Offsets are
// whole pages (4096 bytes); extents never overlap, never run past the
// size and come in increasing order. Anything else is a corrupt image.
package sparse

import (
	"bufio"
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"os"

	"github.com/containerd/errdefs"
	"golang.org/x/sys/unix"
)

// Magic starts every image.
const Magic = "DSECSPR1"

const (
	// PageSize is the granularity of extents, and of the zeros left out.
	PageSize = 4096
	// MaxSize bounds the size an image may claim (of a guest's RAM or
	// disk).
	MaxSize = 1 << 40
	chunk   = 1 << 20
)

// Stats are an image's figures: the file's size, and the data its
// extents hold (what the image costs, headers aside).
type Stats struct {
	Size    int64 `json:"size"`
	Data    int64 `json:"data"`
	Extents int   `json:"extents"`
}

var zeroPage = make([]byte, PageSize)

// Write writes the image of src to w: src's data, read between its
// holes (SEEK_DATA), with its all-zero pages left out too.
func Write(w io.Writer, src *os.File) (Stats, error) {
	fi, err := src.Stat()
	if err != nil {
		return Stats{}, err
	}
	st := Stats{Size: fi.Size()}
	if st.Size > MaxSize {
		return st, fmt.Errorf("%s is %d bytes: a sparse image holds at most %d", src.Name(), st.Size, int64(MaxSize))
	}
	bw := bufio.NewWriterSize(w, chunk)
	hdr := make([]byte, 16)
	copy(hdr, Magic)
	binary.BigEndian.PutUint64(hdr[8:], uint64(st.Size))
	if _, err := bw.Write(hdr[:16]); err != nil {
		return st, err
	}
	// An extent is written once its end is known: pending holds its
	// start and the data so far (at most a chunk; a longer run is
	// written as several extents).
	var pending []byte
	pendingOff := int64(-1)
	flush := func() error {
		if len(pending) == 0 {
			return nil
		}
		var h [16]byte
		binary.BigEndian.PutUint64(h[:], uint64(pendingOff))
		binary.BigEndian.PutUint64(h[8:], uint64(len(pending)))
		if _, err := bw.Write(h[:]); err != nil {
			return err
		}
		if _, err := bw.Write(pending); err != nil {
			return err
		}
		st.Data += int64(len(pending))
		st.Extents++
		pending, pendingOff = pending[:0], -1
		return nil
	}
	buf := make([]byte, chunk)
	pending = make([]byte, 0, chunk)
	fd := int(src.Fd())
	for off := int64(0); off < st.Size; {
		data, err := unix.Seek(fd, off, unix.SEEK_DATA)
		if errors.Is(err, unix.ENXIO) { // no data past off
			break
		}
		if err != nil {
			return st, fmt.Errorf("read %s: %w", src.Name(), err)
		}
		data &^= PageSize - 1
		hole, err := unix.Seek(fd, data, unix.SEEK_HOLE)
		if err != nil {
			return st, fmt.Errorf("read %s: %w", src.Name(), err)
		}
		hole = min(hole, st.Size)
		for p := data; p < hole; {
			n, err := src.ReadAt(buf[:min(int64(len(buf)), hole-p)], p)
			if n == 0 {
				if err == nil || err == io.EOF {
					err = io.ErrUnexpectedEOF
				}
				return st, fmt.Errorf("read %s: %w", src.Name(), err)
			}
			for c := 0; c < n; c += PageSize {
				page := buf[c:min(n, c+PageSize)]
				at := p + int64(c)
				if bytes.Equal(page, zeroPage[:len(page)]) {
					if err := flush(); err != nil {
						return st, err
					}
					continue
				}
				if pendingOff >= 0 && (pendingOff+int64(len(pending)) != at || len(pending)+len(page) > chunk) {
					if err := flush(); err != nil {
						return st, err
					}
				}
				if pendingOff < 0 {
					pendingOff = at
				}
				pending = append(pending, page...)
			}
			p += int64(n)
		}
		if err := flush(); err != nil {
			return st, err
		}
		off = max(hole, off+PageSize)
	}
	if err := flush(); err != nil {
		return st, err
	}
	return st, bw.Flush()
}

// corrupt is the error of a bad image.
func corrupt(format string, a ...any) error {
	return fmt.Errorf("sparse image: "+format+": it is corrupt or was not written by dsec: %w", append(a, errdefs.ErrDataLoss)...)
}

// ReadHeader reads an image's header: the size of its file.
func ReadHeader(r io.Reader) (int64, error) {
	var hdr [16]byte
	if _, err := io.ReadFull(r, hdr[:]); err != nil {
		return 0, corrupt("header: %v", err)
	}
	if string(hdr[:8]) != Magic {
		return 0, corrupt("no magic")
	}
	size := binary.BigEndian.Uint64(hdr[8:])
	if size > MaxSize {
		return 0, corrupt("a size of %d bytes (at most %d)", size, int64(MaxSize))
	}
	return int64(size), nil
}

// Read writes the image r holds into dst, a file of no data: it is
// truncated to the image's size and gets the extents; the rest reads
// as zeros and takes no space. A corrupt image is an error, never a
// write outside the size.
func Read(dst *os.File, r io.Reader) (Stats, error) {
	br := bufio.NewReaderSize(r, chunk)
	size, err := ReadHeader(br)
	if err != nil {
		return Stats{}, err
	}
	st := Stats{Size: size}
	if err := dst.Truncate(size); err != nil {
		return st, err
	}
	buf := make([]byte, chunk)
	end := int64(0) // where the last extent ended
	for {
		var h [16]byte
		n, err := io.ReadFull(br, h[:])
		if n == 0 && err == io.EOF {
			return st, nil
		}
		if err != nil {
			return st, corrupt("extent %d: %v", st.Extents, err)
		}
		off, length := binary.BigEndian.Uint64(h[:]), binary.BigEndian.Uint64(h[8:])
		switch {
		case off%PageSize != 0:
			return st, corrupt("extent %d at %d: not a whole page", st.Extents, off)
		case length == 0 || off > uint64(size) || length > uint64(size)-off:
			return st, corrupt("extent %d of %d bytes at %d: outside the %d bytes", st.Extents, length, off, size)
		case int64(off) < end:
			return st, corrupt("extent %d at %d: before the end of the one before (%d)", st.Extents, off, end)
		}
		for p := int64(off); p < int64(off+length); {
			k := min(int64(len(buf)), int64(off+length)-p)
			if _, err := io.ReadFull(br, buf[:k]); err != nil {
				return st, corrupt("extent %d: %v", st.Extents, err)
			}
			if _, err := dst.WriteAt(buf[:k], p); err != nil {
				return st, err
			}
			p += k
		}
		end = int64(off + length)
		st.Data += int64(length)
		st.Extents++
	}
}
