package lazy

import (
	"bufio"
	"bytes"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"unsafe"

	"github.com/containerd/errdefs"
	"github.com/opencontainers/go-digest"
	"golang.org/x/sys/unix"

	"github.com/dsec-project/dsec/internal/layer/erofs"
	"github.com/dsec-project/dsec/internal/mount"
)

// Profile turns the access record of a layer's last recorded run on this
// host (layer mount --record) into the files it read and the blocks of
// each, in first touch order: the profile layer build --order takes, so
// a rebuilt layer keeps exactly those blocks together at the front of its
// data. It mounts the host cache's copy of the image (its metadata is
// always there) and asks the kernel where each file's data lies
// (FIEMAP), so no code of ours parses the image. Paths are absolute
// within the layer; a file read whole has no block ranges.
func Profile(root string, d digest.Digest) ([]erofs.Hot, error) {
	dir := Dir(root, d)
	if err := uncompressed(filepath.Join(dir, "image"), d); err != nil && !os.IsNotExist(err) {
		return nil, err
	}
	ranges, err := readAccess(filepath.Join(dir, "access"))
	if os.IsNotExist(err) {
		return nil, fmt.Errorf("layer %s has no recorded run on this host: mount it with --record and run the workload first: %w", d, errdefs.ErrNotFound)
	}
	if err != nil {
		return nil, err
	}
	mnt, err := os.MkdirTemp(dir, "profile-")
	if err != nil {
		return nil, err
	}
	defer os.Remove(mnt)
	if err := mount.EROFS(filepath.Join(dir, "image")).Mount(mnt); err != nil {
		return nil, err
	}
	defer mount.Unmount(mnt)
	exts, err := fileExtents(mnt)
	if err != nil {
		return nil, err
	}
	return pathsOf(ranges, exts), nil
}

// uncompressed refuses a compressed layer's image: FIEMAP gives a
// compressed file's extents in its own bytes, not in the image's, so a
// recorded run could not be put on its files.
func uncompressed(img string, d digest.Digest) error {
	f, err := os.Open(img)
	if err != nil {
		return err
	}
	defer f.Close()
	if z, err := erofs.Compressed(f); err != nil || !z {
		return err
	}
	return fmt.Errorf("layer %s is compressed, and a recorded run cannot be put on its compressed files: record it on the layer built without --compress: %w", d, errdefs.ErrNotImplemented)
}

// readAccess parses an access record: "offset size" a line.
func readAccess(p string) ([]erofs.Region, error) {
	b, err := os.ReadFile(p)
	if err != nil {
		return nil, err
	}
	var rs []erofs.Region
	sc := bufio.NewScanner(bytes.NewReader(b))
	for n := 1; sc.Scan(); n++ {
		f := strings.Fields(sc.Text())
		var off, size int64
		if len(f) == 2 {
			off, err = strconv.ParseInt(f[0], 10, 64)
			if err == nil {
				size, err = strconv.ParseInt(f[1], 10, 64)
			}
		}
		if len(f) != 2 || err != nil || off < 0 || size <= 0 {
			return nil, fmt.Errorf("%s line %d: %q is not \"offset size\" (record the run again): %w", p, n, sc.Text(), errdefs.ErrDataLoss)
		}
		rs = append(rs, erofs.Region{Offset: off, Size: size})
	}
	return rs, nil
}

// extent is where a piece of a file's data lies in the image.
type extent struct {
	erofs.Region
	logical int64 // offset in the file
	path    string
}

// fileExtents lists the data extents of every regular file under mnt,
// sorted by image offset.
func fileExtents(mnt string) ([]extent, error) {
	var exts []extent
	err := filepath.WalkDir(mnt, func(p string, de fs.DirEntry, err error) error {
		if err != nil || !de.Type().IsRegular() {
			return err
		}
		rs, err := fiemap(p)
		if err != nil {
			return err
		}
		rel := "/" + strings.TrimPrefix(p, mnt+"/")
		for _, r := range rs {
			exts = append(exts, extent{Region: erofs.Region{Offset: r.Physical, Size: r.Length}, logical: r.Logical, path: rel})
		}
		return nil
	})
	sort.Slice(exts, func(i, j int) bool { return exts[i].Offset < exts[j].Offset })
	return exts, err
}

// pathsOf names the files whose data the ranges touch and the blocks of
// each, in range order, each file once. Ranges outside every file
// (block 0, metadata) name none.
func pathsOf(ranges []erofs.Region, exts []extent) []erofs.Hot {
	var out []erofs.Hot
	at := map[string]int{}
	read := map[string]int64{}  // bytes of the file read
	total := map[string]int64{} // bytes of the file's extents
	for _, e := range exts {
		total[e.path] += e.Size
	}
	for _, r := range ranges {
		// the first extent that ends after r starts
		i := sort.Search(len(exts), func(i int) bool { return exts[i].Offset+exts[i].Size > r.Offset })
		for ; i < len(exts) && exts[i].Offset < r.Offset+r.Size; i++ {
			e := exts[i]
			lo, hi := max(r.Offset, e.Offset), min(r.Offset+r.Size, e.Offset+e.Size)
			k, ok := at[e.path]
			if !ok {
				k = len(out)
				at[e.path] = k
				out = append(out, erofs.Hot{Path: e.path})
			}
			read[e.path] += hi - lo
			start := uint64(e.logical+lo-e.Offset) / erofs.BlockSize
			count := (uint64(e.logical+hi-e.Offset)+erofs.BlockSize-1)/erofs.BlockSize - start
			bs := out[k].Blocks
			if l := len(bs) - 1; l >= 0 && bs[l].Start+bs[l].Count == start {
				bs[l].Count += count
			} else {
				bs = append(bs, erofs.BlockRange{Start: start, Count: count})
			}
			out[k].Blocks = bs
		}
	}
	for k := range out {
		if read[out[k].Path] >= total[out[k].Path] {
			out[k].Blocks = nil // read whole
		}
	}
	return out
}

const (
	fsIocFiemap    = 0xc020660b // _IOWR('f', 11, struct fiemap)
	fiemapFlagSync = 0x1
	fiemapLast     = 0x1 // FIEMAP_EXTENT_LAST
	fiemapBatch    = 64
)

// fiemapHdr and fiemapExtent are struct fiemap and struct fiemap_extent.
type fiemapHdr struct {
	Start, Length                uint64
	Flags, Mapped, Count, Unused uint32
}

type fiemapExtent struct {
	Logical, Physical, Length uint64
	_                         [2]uint64
	Flags                     uint32
	_                         [3]uint32
}

// fiemapExt is one extent of a file: where its bytes lie in the image.
type fiemapExt struct{ Logical, Physical, Length int64 }

// fiemap asks the kernel for the physical extents of a file.
func fiemap(p string) ([]fiemapExt, error) {
	f, err := os.Open(p)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	buf := make([]byte, int(unsafe.Sizeof(fiemapHdr{}))+fiemapBatch*int(unsafe.Sizeof(fiemapExtent{})))
	var out []fiemapExt
	for start := uint64(0); ; {
		clear(buf)
		hdr := (*fiemapHdr)(unsafe.Pointer(&buf[0]))
		hdr.Start, hdr.Length, hdr.Flags, hdr.Count = start, ^uint64(0)-start, fiemapFlagSync, fiemapBatch
		if _, _, e := unix.Syscall(unix.SYS_IOCTL, f.Fd(), fsIocFiemap, uintptr(unsafe.Pointer(&buf[0]))); e != 0 {
			return nil, &os.PathError{Op: "FIEMAP", Path: p, Err: e}
		}
		if hdr.Mapped == 0 {
			return out, nil
		}
		exts := unsafe.Slice((*fiemapExtent)(unsafe.Pointer(&buf[unsafe.Sizeof(fiemapHdr{})])), hdr.Mapped)
		for _, e := range exts {
			out = append(out, fiemapExt{int64(e.Logical), int64(e.Physical), int64(e.Length)})
		}
		last := exts[len(exts)-1]
		if last.Flags&fiemapLast != 0 {
			return out, nil
		}
		start = last.Logical + last.Length
	}
}
