package layer

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"

	"github.com/containerd/errdefs"

	"github.com/dsec-project/dsec/internal/layer/erofs"
)

// source is an opened build source.
type source struct {
	kind    string // dir, tar or image-archive
	planned bool   // add plans every file: the image is hashed as written
	add     func(context.Context, *erofs.Writer, Progress) error
	close   func()
}

// openSource decides what SRC is: a directory, an image archive file
// (docker save or an OCI layout tarball), a plain or compressed tar file,
// or "-" for a tar stream on stdin.
func openSource(src string, stdin io.Reader) (*source, error) {
	if src == "-" {
		if f, ok := stdin.(*os.File); ok {
			if st, err := f.Stat(); err == nil && st.Mode().IsRegular() {
				return openFile(f, "stdin", func() {})
			}
		}
		br := bufio.NewReader(stdin)
		if _, err := br.Peek(1); err == io.EOF {
			return nil, fmt.Errorf("stdin is empty: pipe a tar stream or an image archive into it, or give a directory: %w", ErrBadSource)
		}
		return &source{kind: "tar", close: func() {},
			add: func(ctx context.Context, w *erofs.Writer, p Progress) error { return addTar(ctx, w, br, p) }}, nil
	}
	if src == "" {
		return nil, fmt.Errorf("the source is an empty argument (an unset variable?): give a directory, a tar, tar.gz or tar.zst file, an image archive or -: %w", errdefs.ErrInvalidArgument)
	}
	st, err := os.Stat(src)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, fmt.Errorf("source %s does not exist: give a directory, a tar, tar.gz or tar.zst file, an image archive or -: %w", src, errdefs.ErrNotFound)
	}
	if err != nil {
		return nil, fmt.Errorf("source: %w", err)
	}
	if st.IsDir() {
		return &source{kind: "dir", close: func() {}, planned: true,
			add: func(ctx context.Context, w *erofs.Writer, p Progress) error { return addDir(ctx, w, src, p) }}, nil
	}
	if !st.Mode().IsRegular() {
		return nil, fmt.Errorf("source %s is neither a directory nor a regular file: %w", src, errdefs.ErrInvalidArgument)
	}
	f, err := os.Open(src)
	if err != nil {
		return nil, fmt.Errorf("source: %w", err)
	}
	return openFile(f, src, func() { f.Close() })
}

func openFile(f *os.File, name string, done func()) (*source, error) {
	var head [512]byte
	n, err := f.ReadAt(head[:], 0)
	if err != nil && err != io.EOF {
		done()
		return nil, fmt.Errorf("read %s: %w", name, err)
	}
	if n == 0 {
		done()
		return nil, fmt.Errorf("%s is empty: give a tar stream, an image archive or a directory: %w", name, ErrBadSource)
	}
	compressed := n >= 2 && head[0] == 0x1f && head[1] == 0x8b || n >= 4 && bytes.Equal(head[:4], []byte{0x28, 0xb5, 0x2f, 0xfd})
	stream := func(ctx context.Context, w *erofs.Writer, p Progress) error {
		if _, err := f.Seek(0, io.SeekStart); err != nil {
			return err
		}
		return addTar(ctx, w, f, p)
	}
	if compressed {
		return &source{kind: "tar", add: stream, close: done}, nil
	}
	if n < 512 || !isTarHeader(head[:]) {
		done()
		return nil, fmt.Errorf("%w: %s is not a tar, tar.gz or tar.zst archive", ErrBadSource, name)
	}
	st, err := f.Stat()
	if err != nil {
		done()
		return nil, err
	}
	members, err := indexTar(f, st.Size())
	if err != nil {
		done()
		return nil, fmt.Errorf("%s: %w", name, err)
	}
	if isImageArchive(members) {
		ar := &imageArchive{ra: f, members: members}
		return &source{kind: "image-archive", close: done,
			add: func(ctx context.Context, w *erofs.Writer, p Progress) error { return addImageArchive(ctx, w, ar, p) }}, nil
	}
	return &source{kind: "tar", add: stream, close: done}, nil
}

// isTarHeader checks the header checksum of a tar block.
func isTarHeader(b []byte) bool {
	var sum int64
	for i, c := range b[:512] {
		if i >= 148 && i < 156 {
			c = ' '
		}
		sum += int64(c)
	}
	field := bytes.TrimRight(bytes.TrimLeft(b[148:156], " \x00"), " \x00")
	var want int64
	for _, c := range field {
		if c < '0' || c > '7' {
			return false
		}
		want = want*8 + int64(c-'0')
	}
	return len(field) > 0 && want == sum
}
