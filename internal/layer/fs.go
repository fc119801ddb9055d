package layer

import (
	"fmt"
	"io"
	"io/fs"

	goerofs "github.com/erofs/go-erofs"

	"github.com/dsec-project/dsec/internal/layer/erofs"
)

// OpenFS reads an EROFS image as an fs.FS. It is go-erofs, which accepts
// non-canonical names such as "/a", "a/./b" and "a/../a"; the wrapper
// rejects them as fs.FS requires (fs.ValidPath), so a path that is not
// canonical can never alias another.
//
// devices are the image's extra devices, in the order of its table (a
// packed layer's chunk blobs: store.OpenLayer).
//
// A compressed layer's metadata reads as any other's, but the data of
// its compressed files does not: go-erofs cannot decompress (opening
// such a file fails). Mount the layer to read those.
func OpenFS(r io.ReaderAt, devices ...io.ReaderAt) (fs.FS, error) {
	fsys, err := goerofs.Open(erofs.MetadataView(r), goerofs.WithExtraDevices(devices...))
	if err != nil {
		return nil, fmt.Errorf("open EROFS image: %w", err)
	}
	return validFS{fsys}, nil
}

type validFS struct{ fs fs.FS }

func invalid(op, name string) error {
	return &fs.PathError{Op: op, Path: name, Err: fs.ErrInvalid}
}

func (v validFS) Open(name string) (fs.File, error) {
	if !fs.ValidPath(name) {
		return nil, invalid("open", name)
	}
	return v.fs.Open(name)
}

func (v validFS) ReadLink(name string) (string, error) {
	if !fs.ValidPath(name) {
		return "", invalid("readlink", name)
	}
	return fs.ReadLink(v.fs, name)
}

func (v validFS) Lstat(name string) (fs.FileInfo, error) {
	if !fs.ValidPath(name) {
		return nil, invalid("lstat", name)
	}
	return fs.Lstat(v.fs, name)
}
