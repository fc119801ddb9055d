package layer

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/dsec-project/dsec/internal/layer/erofs"
	"github.com/dsec-project/dsec/internal/layer/layertest"
)

// checkImage finishes w and reads every entry back: whatever a source
// let through must make an image the reader accepts.
func checkImage(t *testing.T, f *os.File, w *erofs.Writer) {
	if _, err := w.Finish(); err != nil {
		t.Fatalf("finish: %v", err)
	}
	fsys, err := OpenFS(f)
	if err != nil {
		t.Fatalf("image does not open: %v", err)
	}
	err = fs.WalkDir(fsys, ".", func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.Type().IsRegular() {
			r, err := fsys.Open(p)
			if err != nil {
				return err
			}
			defer r.Close()
			_, err = io.Copy(io.Discard, r)
			return err
		}
		return nil
	})
	if err != nil {
		t.Fatalf("image does not read back: %v", err)
	}
}

// memFile is a memfd: a temporary directory per fuzz execution slows the
// fuzzing engine to a crawl.
func memFile(t *testing.T, name string) *os.File {
	fd, err := unix.MemfdCreate(name, unix.MFD_CLOEXEC)
	if err != nil {
		t.Fatal(err)
	}
	f := os.NewFile(uintptr(fd), name)
	t.Cleanup(func() { f.Close() })
	return f
}

func newImage(t *testing.T) (*os.File, *erofs.Writer) {
	f := memFile(t, "img")
	w, err := erofs.NewWriter(f)
	if err != nil {
		t.Fatal(err)
	}
	return f, w
}

func FuzzTar(f *testing.F) {
	for _, l := range layertest.FlattenLayers {
		f.Add(l)
	}
	f.Add(layertest.Tar(layertest.File{Name: "a", Body: "x", PAX: map[string]string{"SCHILY.xattr.user.k": "v"}}))
	f.Add([]byte{})
	f.Fuzz(func(t *testing.T, data []byte) {
		img, w := newImage(t)
		if err := w.Mkdir("", erofs.Attr{Mode: 0o755}); err != nil {
			t.Fatal(err)
		}
		ta := newTarAdder(w, noProgress{})
		ta.maxSize = 1 << 20 // zeros of sparse entries are slow under coverage instrumentation
		err := ta.addLayer(context.Background(), bytes.NewReader(data), nil)
		if err != nil {
			if !errors.Is(err, ErrBadSource) {
				t.Fatalf("unclassified error for bad input: %v", err)
			}
			return
		}
		checkImage(t, img, w)
	})
}

func FuzzImageArchive(f *testing.F) {
	f.Add(layertest.DockerArchive(layertest.FlattenLayers...))
	f.Add(layertest.OCIArchive(true, layertest.FlattenLayers...))
	f.Fuzz(func(t *testing.T, data []byte) {
		a := memFile(t, "archive")
		if _, err := a.Write(data); err != nil {
			t.Fatal(err)
		}
		src, err := openSource(fmt.Sprintf("/proc/self/fd/%d", a.Fd()), nil)
		if err != nil {
			if !errors.Is(err, ErrBadSource) {
				t.Fatalf("unclassified error for bad input: %v", err)
			}
			return
		}
		defer src.close()
		img, w := newImage(t)
		if err := src.add(context.Background(), w, noProgress{}); err != nil {
			if !errors.Is(err, ErrBadSource) {
				t.Fatalf("unclassified error for bad input: %v", err)
			}
			return
		}
		checkImage(t, img, w)
	})
}
