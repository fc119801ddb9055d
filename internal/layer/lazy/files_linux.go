package lazy

import (
	"cmp"
	"context"
	"errors"
	"io/fs"
	"slices"
	"time"

	goerofs "github.com/erofs/go-erofs"

	"github.com/dsec-project/dsec/internal/layer/erofs"
)

// extentsOf is where each regular file's data lies in the image: sorted,
// [start, end) in bytes. A read ahead after a second miss in a region
// takes the region's part of the file read, not the neighbours a layout
// put beside it (BENCHMARKS.md, Lazy loading).
type extentsOf [][2]int64

// file is the extent of the file whose data holds off, if any.
func (e extentsOf) file(off int64) ([2]int64, bool) {
	i, _ := slices.BinarySearchFunc(e, off, func(x [2]int64, o int64) int {
		switch {
		case x[1] <= o:
			return -1
		case x[0] > o:
			return 1
		}
		return 0
	})
	if i < len(e) && e[i][0] <= off && off < e[i][1] {
		return e[i], true
	}
	return [2]int64{}, false
}

// errNotLocal says a read of the file map wanted a window not cached.
var errNotLocal = errors.New("not in the host cache")

// localImage reads the image from the host cache alone: the file map
// reads the metadata, whose windows are fetched before the mount and
// never evicted; it never fetches.
type localImage struct{ f *fetcher }

func (l localImage) ReadAt(p []byte, off int64) (int, error) {
	if off < 0 || off >= l.f.spec.Size {
		return 0, errNotLocal
	}
	end := min(off+int64(len(p)), l.f.spec.Size)
	l.f.evict.RLock()
	defer l.f.evict.RUnlock()
	for w := int(off / l.f.spec.Windows.Size); int64(w)*l.f.spec.Windows.Size < end; w++ {
		if !l.f.c.has(w) {
			return 0, errNotLocal
		}
	}
	n, err := l.f.c.img.ReadAt(p[:end-off], off)
	if err == nil && n < len(p) {
		return n, errors.New("read past the image's end")
	}
	return n, err
}

// mapFiles reads every regular file's extents from the image's metadata
// (go-erofs, over the host cache) and publishes them for extent. It runs
// once a first region is read ahead (about 50 ms of CPU for 14,000 files:
// a mount that reads a file or two never pays it); until it is done, or
// if it fails (the metadata is not where block 0 says), a read ahead
// takes the whole region.
func (f *fetcher) mapFiles(ctx context.Context) {
	start := time.Now()
	fsys, err := goerofs.Open(erofs.MetadataView(localImage{f})) // a compressed file maps to nothing
	var out extentsOf
	if err == nil {
		err = fs.WalkDir(fsys, ".", func(p string, d fs.DirEntry, err error) error {
			if err != nil || ctx.Err() != nil {
				return cmp.Or(err, ctx.Err())
			}
			if !d.Type().IsRegular() {
				return nil
			}
			fi, err := d.Info()
			if err != nil {
				return err
			}
			r, ok := fi.(interface{ DataRange() []goerofs.DataRange })
			if !ok {
				return nil
			}
			for _, x := range r.DataRange() {
				if x.Device == 0 && x.Offset >= 0 && x.Size > 0 {
					out = append(out, [2]int64{x.Offset, x.Offset + x.Size})
				}
			}
			return nil
		})
	}
	if err != nil {
		f.log.Warn("no file map: a read ahead takes whole regions", "layer", f.spec.Ref, "err", err)
		return
	}
	slices.SortFunc(out, func(a, b [2]int64) int { return cmp.Compare(a[0], b[0]) })
	f.mu.Lock()
	f.files = out
	f.mu.Unlock()
	f.c.count(func(s *Stats) { s.FileExtents = int64(len(out)) })
	f.writeStats()
	f.log.Debug("file map read", "layer", f.spec.Ref, "extents", len(out), "seconds", time.Since(start).Seconds())
}
