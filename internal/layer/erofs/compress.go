package erofs

import (
	"encoding/binary"
	"io"

	"github.com/pierrec/lz4/v4"
)

// Compressed files (SetCompress): a regular file's data is cut into
// extents of up to extentSize bytes, each LZ4-compressed into a physical
// cluster of whole blocks ("big pclusters", which mkfs.erofs -zlz4 -C
// writes too), and indexed by full (non-compact) logical-cluster indexes,
// one per 4 KiB of the file:
//
//	HEAD1    the first lcluster of a compressed extent: its pcluster's block
//	NONHEAD  the others: the first gives the pcluster's block count
//	         (CBLKCNT), each the distances to its head and the next head
//	PLAIN    an lcluster stored as it is (an extent that saves no block),
//	         each its own head and block
//
// The compressed bytes sit at the end of their pcluster behind zeros (the
// zero-padding feature), so the kernel finds their exact length and can
// decompress in place. Whole extents of zeros all reference one pcluster.
// A file no extent of which saves a block is written flat, as without
// compression: the plain lclusters are its blocks in order. Only
// streamed files (Create) are compressed; planned ones, kept in a chosen
// order for lazy fetching, stay as they are.
//
// LZ4 is the algorithm every kernel with EROFS_FS_ZIP reads (the guests'
// 6.1 too); DEFLATE and zstd need 6.6 and 6.10.
const (
	extentSize   = 16 * BlockSize // input of one compressed extent
	maxPcluster  = extentSize / BlockSize
	lclusterSize = BlockSize // logical clusters of 4 KiB (h_clusterbits 0)

	incompatZeroPadding = 0x1
	incompatBigPcluster = 0x2 // also COMPR_CFGS: the configurations after the superblock
	algLZ4              = 0

	layoutCompressedFull = 1

	lcPlain   = 0
	lcHead1   = 1
	lcNonhead = 2
	d0Cblkcnt = 1 << 11

	adviseBigPcluster1 = 0x2

	// compressedMapSize is the map header and the 8 bytes the kernel
	// skips before a full layout's first index (Z_EROFS_FULL_INDEX_ALIGN).
	compressedMapSize = 16
	lclusterIndexSize = 8
	comprCfgsSize     = 16 // one record: its length, then 14 bytes
)

// SetCompress has every regular file streamed from now on (Create)
// stored LZ4-compressed where that saves a block.
func (w *Writer) SetCompress(on bool) {
	w.compress = on
	if on && w.lz4 == nil {
		w.lz4 = &lz4.Compressor{}
	}
}

// extent is one run of a compressed file's lclusters.
type extent struct {
	lcn, n  uint32 // first lcluster, lclusters
	blkaddr uint32 // first block of its pcluster (plain: of its blocks)
	cblks   uint32 // compressed: the pcluster's blocks; 0: plain
}

// writeCompressed streams a file of more than BlockSize bytes as
// extents; when no extent saved a block the file is flat.
func (w *Writer) writeCompressed(p string, ino *inode, r io.Reader) error {
	start := w.nextBlk
	if cap(w.zbuf) < lz4.CompressBlockBound(extentSize) {
		w.zbuf = make([]byte, lz4.CompressBlockBound(extentSize))
	}
	var exts []extent
	compressed := false
	for off := uint64(0); off < ino.size; off += extentSize {
		b := w.buf[:min(extentSize, ino.size-off)]
		if _, err := io.ReadFull(r, b); err != nil {
			return shortRead(p, err)
		}
		e := extent{lcn: uint32(off / lclusterSize), n: uint32((uint64(len(b)) + lclusterSize - 1) / lclusterSize), blkaddr: w.nextBlk}
		if len(b) == extentSize && w.zeroPcluster != 0 && isZero(b) {
			// Every whole extent of zeros in the image decodes from one
			// pcluster (the kernel takes a pcluster that several extents
			// reference whole since 6.0): sparse files stay small.
			e.blkaddr, e.cblks = w.zeroPcluster, 1
			compressed = true
			exts = append(exts, e)
			continue
		}
		blocks := e.n // what it takes plain
		c, err := w.lz4.CompressBlock(b, w.zbuf)
		// A pcluster that saves a block; its first byte must not be
		// zero, or the kernel would take it for padding (an LZ4 block
		// starts with a token of at least one literal, never zero).
		if err == nil && c > 0 && w.zbuf[0] != 0 && e.n > 1 {
			if cblks := uint32((c + BlockSize - 1) / BlockSize); cblks < blocks {
				e.cblks = cblks
				if err := w.appendPadded(int(cblks)*BlockSize-c, w.zbuf[:c]); err != nil {
					return err
				}
				if len(b) == extentSize && cblks == 1 && w.zeroPcluster == 0 && isZero(b) {
					w.zeroPcluster = e.blkaddr
				}
				compressed = true
				exts = append(exts, e)
				continue
			}
		}
		if err := w.appendData(b); err != nil {
			return err
		}
		exts = append(exts, e)
	}
	if err := checkEOF(p, r); err != nil {
		return err
	}
	if !compressed { // the plain lclusters are a flat file's blocks
		ino.blkaddr, ino.nblocks = start, w.nextBlk-start
		return nil
	}
	ino.extents = exts
	ino.nblocks = w.nextBlk - start
	return nil
}

// appendPadded writes pad zero bytes, then b, ending on a block
// boundary: a pcluster with its bytes at the end.
func (w *Writer) appendPadded(pad int, b []byte) error {
	if err := w.reserve(uint64(pad + len(b))); err != nil {
		return err
	}
	for pad > 0 {
		n, err := w.bw.Write(w.zero[:min(pad, BlockSize)])
		if err != nil {
			w.err = err
			return err
		}
		pad -= n
	}
	if _, err := w.bw.Write(b); err != nil {
		w.err = err
		return err
	}
	return nil
}

// compressedMeta is the size of a compressed inode's map: after its
// inode and xattrs (aligned to 8), the map header, the skipped 8 bytes
// and an index per lcluster.
func compressedMeta(ino *inode) int64 {
	return compressedMapSize + lclusterIndexSize*int64(lclusters(ino.size))
}

func lclusters(size uint64) uint32 { return uint32((size + lclusterSize - 1) / lclusterSize) }

// encodeCompressedMap writes the map header and the lcluster indexes of
// ino at b (aligned to 8 past its inode and xattrs).
func encodeCompressedMap(b []byte, ino *inode) {
	le := binary.LittleEndian
	le.PutUint16(b[4:], adviseBigPcluster1) // h_advise
	b[6] = algLZ4 | algLZ4<<4               // h_algorithmtype: HEAD1, HEAD2
	b[7] = 0                                // h_clusterbits: 4 KiB lclusters
	idx := b[compressedMapSize:]
	for _, e := range ino.extents {
		next := e.lcn + e.n // the next head, or the end
		for i := uint32(0); i < e.n; i++ {
			x := idx[uint64(e.lcn+i)*lclusterIndexSize:]
			switch {
			case e.cblks == 0: // plain: every lcluster its own head
				le.PutUint16(x[0:], lcPlain)
				le.PutUint32(x[4:], e.blkaddr+i)
			case i == 0:
				le.PutUint16(x[0:], lcHead1)
				le.PutUint32(x[4:], e.blkaddr)
			default:
				le.PutUint16(x[0:], lcNonhead)
				d0 := uint16(i)
				if i == 1 {
					d0 = d0Cblkcnt | uint16(e.cblks)
				}
				le.PutUint16(x[4:], d0)
				le.PutUint16(x[6:], uint16(next-e.lcn-i)) // distance to the next head
			}
		}
	}
}

// encodeComprCfgs is the LZ4 configuration record that follows the
// superblock when BIG_PCLUSTER (COMPR_CFGS) is set: its length, the
// largest match distance and the largest pcluster in blocks.
func encodeComprCfgs(b []byte) {
	le := binary.LittleEndian
	le.PutUint16(b[0:], 14)
	le.PutUint16(b[2:], 65535)
	le.PutUint16(b[4:], maxPcluster)
}

// Compressed says whether the image r holds compressed files (its
// superblock names an algorithm or zero padding).
func Compressed(r io.ReaderAt) (bool, error) {
	var b [6]byte
	if _, err := r.ReadAt(b[:], sbOffset+80); err != nil {
		return false, err
	}
	le := binary.LittleEndian
	return le.Uint32(b[0:])&(incompatZeroPadding|incompatBigPcluster) != 0 || le.Uint16(b[4:]) != 0, nil
}

// MetadataView is r as a reader that knows no compression sees it: its
// superblock without the compression features, so go-erofs (which
// refuses a compressed image whole) lists, stats and reads its
// directories, links, xattrs and uncompressed files. A compressed
// file's data stays unreadable there: go-erofs refuses its layout.
func MetadataView(r io.ReaderAt) io.ReaderAt { return metadataView{r} }

type metadataView struct{ r io.ReaderAt }

// The superblock's feature_incompat and available_compr_algs, as bytes
// of the image.
const (
	incompatAt = sbOffset + 80
	comprAlgAt = sbOffset + 84
)

func (v metadataView) ReadAt(p []byte, off int64) (int, error) {
	n, err := v.r.ReadAt(p, off)
	mask := func(at int64, keep byte) {
		if at >= off && at < off+int64(n) {
			p[at-off] &= keep
		}
	}
	mask(incompatAt, ^byte(incompatZeroPadding|incompatBigPcluster)) // its low byte holds both
	mask(comprAlgAt, 0)
	mask(comprAlgAt+1, 0)
	return n, err
}
