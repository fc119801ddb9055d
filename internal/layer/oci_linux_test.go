package layer_test

import (
	"archive/tar"
	"context"
	"io/fs"
	"os"
	"path/filepath"
	"testing"

	goerofs "github.com/erofs/go-erofs"

	"github.com/dsec-project/dsec/internal/layer"
	"github.com/dsec-project/dsec/internal/layer/layertest"
)

func tarOf(t *testing.T, files map[string]string) []byte {
	var fs []layertest.File
	for name, body := range files {
		fs = append(fs, layertest.File{Name: name, Body: body})
	}
	return layertest.Tar(fs...)
}

func tarWithPAX(t *testing.T, name string, pax map[string]string) []byte {
	return layertest.Tar(layertest.File{Name: name, Body: "x", PAX: pax})
}

// flatView reads an image into path -> content ("dir" for directories).
func flatView(t *testing.T, image string) map[string]string {
	t.Helper()
	f, err := os.Open(image)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	fsys, err := goerofs.Open(f)
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]string{}
	err = fs.WalkDir(fsys, ".", func(p string, d fs.DirEntry, err error) error {
		if err != nil || p == "." {
			return err
		}
		if d.IsDir() {
			out[p] = "dir"
			return nil
		}
		b, err := fs.ReadFile(fsys, p)
		out[p] = string(b)
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	return out
}

func TestImageArchivesFlatten(t *testing.T) {
	s := newStore(t)
	tmp := t.TempDir()
	archives := map[string][]byte{
		"docker-save":   layertest.DockerArchive(layertest.FlattenLayers...),
		"oci-layout":    layertest.OCIArchive(false, layertest.FlattenLayers...),
		"oci-layout-gz": layertest.OCIArchive(true, layertest.FlattenLayers...),
	}
	var first *layer.Info
	for name, b := range archives {
		t.Run(name, func(t *testing.T) {
			info := build(t, s, writeFile(t, filepath.Join(tmp, name+".tar"), b), "img:"+name, nil)
			if info.Source != "image-archive" {
				t.Fatalf("source detected as %q", info.Source)
			}
			img := imagePath(s, info)
			fsck(t, img)
			got := flatView(t, img)
			for p, want := range layertest.FlattenWant {
				if got[p] != want {
					t.Errorf("%s = %q, want %q", p, got[p], want)
				}
			}
			for p := range got {
				if _, ok := layertest.FlattenWant[p]; !ok {
					t.Errorf("unexpected %s", p)
				}
			}
			if first == nil {
				first = info
			} else if first.Digest != info.Digest {
				t.Errorf("%s flattens to %s, another format to %s", name, info.Digest, first.Digest)
			}
		})
	}
}

func TestImageArchiveDigestMismatch(t *testing.T) {
	s := newStore(t)
	layers := [][]byte{layertest.Tar(layertest.File{Name: "a", Body: "a"})}
	b := layertest.DockerArchive(layers...)
	// Flip a byte of the layer's file content inside the archive.
	i := indexOf(b, []byte("a\x00\x00\x00"))
	if i < 0 {
		t.Fatal("layer content not found")
	}
	b[i] = 'b'
	p := writeFile(t, filepath.Join(t.TempDir(), "bad.tar"), b)
	ref, _ := layer.ParseRef("bad:1")
	_, err := layer.Build(context.Background(), s, layer.BuildOptions{Source: p, Kind: layer.KindBase, Ref: ref})
	if !isBad(err) {
		t.Fatalf("err = %v, want a bad-source digest error", err)
	}
}

func indexOf(b, sub []byte) int {
	for i := 512; i+len(sub) <= len(b); i++ {
		if string(b[i:i+len(sub)]) == string(sub) {
			return i
		}
	}
	return -1
}

func TestPlainTarWhiteoutsBecomeOverlayWhiteouts(t *testing.T) {
	s := newStore(t)
	b := layertest.Tar(layertest.File{Name: "etc/.wh.passwd"}, layertest.File{Name: "opt/.wh..wh..opq"},
		layertest.File{Name: "opt/new", Body: "n"}, layertest.File{Name: "x/.wh..wh.plnk", Type: tar.TypeDir})
	info := build(t, s, writeFile(t, filepath.Join(t.TempDir(), "w.tar"), b), "wh:1", nil)
	tree := layertest.ScanEROFS(t, imagePath(s, info))
	if e := tree["etc/passwd"]; e.Type != "char" || e.Rdev != "0:0" {
		t.Errorf("etc/passwd = %+v, want a 0:0 whiteout", e)
	}
	if e := tree["opt"]; e.Xattrs["trusted.overlay.opaque"] != "y" {
		t.Errorf("opt xattrs = %v, want trusted.overlay.opaque=y", e.Xattrs)
	}
	if _, ok := tree["x/.wh..wh.plnk"]; ok {
		t.Errorf("AUFS bookkeeping entry kept")
	}
}
