package microvm

import (
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"

	"github.com/containerd/errdefs"
	"golang.org/x/sys/unix"
)

// PmemImage is the image a virtio-pmem device maps for the layer image
// src, named name (its digest) in dir: src itself when its size is a
// multiple of PmemAlign, else a copy of it padded with zeros (a hole)
// to the next multiple, made once per layer and host (a reflink where
// the file system has them, so it costs no space). A layer image is
// read-only, and so is the copy; every microVM on the layer maps the
// same file, so all of them share its pages in the host's page cache.
//
// An image whose size is not a multiple of the page size is no layer
// dsec made, and DAX could not map its last page: it is refused.
func PmemImage(dir, name, src string) (string, int64, error) {
	fi, err := os.Stat(src)
	if err != nil {
		return "", 0, err
	}
	size := fi.Size()
	if size == 0 || size%int64(os.Getpagesize()) != 0 {
		return "", 0, fmt.Errorf("layer image %s is %d bytes, not a multiple of the page size (%d): it is no EROFS layer dsec built, and a microVM cannot map it: rebuild it with dsec layer build: %w",
			name, size, os.Getpagesize(), errdefs.ErrInvalidArgument)
	}
	if size%PmemAlign == 0 {
		return src, size, nil
	}
	padded := (size + PmemAlign - 1) / PmemAlign * PmemAlign
	out := filepath.Join(dir, name+".pmem")
	if fi, err := os.Stat(out); err == nil && fi.Size() == padded {
		return out, padded, nil
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return "", 0, err
	}
	tmp, err := os.CreateTemp(dir, ".pmem-*")
	if err != nil {
		return "", 0, err
	}
	defer os.Remove(tmp.Name())
	in, err := os.Open(src)
	if err != nil {
		tmp.Close()
		return "", 0, err
	}
	err = unix.IoctlFileClone(int(tmp.Fd()), int(in.Fd()))
	if err != nil { // no reflinks here: a copy (copy_file_range)
		if _, err = io.Copy(tmp, in); err == nil {
			// What the copy cached is not what guests will read yet:
			// written out and given back, not held twice.
			if err = tmp.Sync(); err == nil {
				unix.Fadvise(int(tmp.Fd()), 0, 0, unix.FADV_DONTNEED)
			}
		}
	}
	in.Close()
	if err == nil {
		err = tmp.Truncate(padded)
	}
	if err == nil {
		err = tmp.Chmod(0o400)
	}
	if cerr := tmp.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return "", 0, fmt.Errorf("pad layer %s for a microVM: %w", name, err)
	}
	// A cache: lost in a crash, it is made again.
	if err := os.Rename(tmp.Name(), out); err != nil && !errors.Is(err, os.ErrExist) {
		return "", 0, err
	}
	return out, padded, nil
}
