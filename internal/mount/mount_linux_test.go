package mount_test

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/containerd/errdefs"
	"golang.org/x/sys/unix"

	"github.com/dsec-project/dsec/internal/layer"
	"github.com/dsec-project/dsec/internal/layer/layertest"
	"github.com/dsec-project/dsec/internal/layer/store"
	"github.com/dsec-project/dsec/internal/mount"
)

func build(t *testing.T, s *store.Store, tag string, files ...layertest.File) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), "l.tar")
	os.WriteFile(p, layertest.Tar(files...), 0o644)
	ref, _ := layer.ParseRef(tag)
	info, err := layer.Build(context.Background(), s, layer.BuildOptions{Source: p, Kind: layer.KindBase, Ref: ref})
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	if err := mount.EROFS(s.BlobPath(info.Digest)).Mount(dir); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { mount.Unmount(dir) })
	return dir
}

// TestOverlayComposition stacks toolkit over workspace over base with an
// upper and checks what a sandbox would see, whiteouts included.
func TestOverlayComposition(t *testing.T) {
	layertest.RequireRoot(t)
	s, err := store.Open(filepath.Join(t.TempDir(), "store"))
	if err != nil {
		t.Fatal(err)
	}
	base := build(t, s, "base:1", layertest.File{Name: "bin/sh", Body: "shell"}, layertest.File{Name: "etc/answer", Body: "42"},
		layertest.File{Name: "opt/old/x", Body: "x"})
	ws := build(t, s, "ws:1", layertest.File{Name: "src/main.go", Body: "package main"}, layertest.File{Name: "etc/.wh.answer"},
		layertest.File{Name: "opt/old/.wh..wh..opq"}, layertest.File{Name: "opt/old/y", Body: "y"})
	tk := build(t, s, "tk:1", layertest.File{Name: "opt/harness/run", Body: "run"})
	rw := t.TempDir()
	upper, work, merged := filepath.Join(rw, "upper"), filepath.Join(rw, "work"), t.TempDir()
	os.Mkdir(upper, 0o755)
	os.Mkdir(work, 0o755)
	if err := mount.Overlay([]string{tk, ws, base}, upper, work).Mount(merged); err != nil {
		t.Fatal(err)
	}
	defer mount.Unmount(merged)
	for p, want := range map[string]string{"bin/sh": "shell", "src/main.go": "package main", "opt/harness/run": "run", "opt/old/y": "y"} {
		if b, err := os.ReadFile(filepath.Join(merged, p)); err != nil || string(b) != want {
			t.Errorf("%s = %q, %v", p, b, err)
		}
	}
	for _, p := range []string{"etc/answer", "opt/old/x"} {
		if _, err := os.Lstat(filepath.Join(merged, p)); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("%s should be hidden by a whiteout: %v", p, err)
		}
	}
	// Writes land in the upper; a directory rename is EXDEV (no redirects).
	if err := os.WriteFile(filepath.Join(merged, "bin/sh"), []byte("evil"), 0o755); err != nil {
		t.Fatal(err)
	}
	if b, _ := os.ReadFile(filepath.Join(upper, "bin/sh")); string(b) != "evil" {
		t.Fatal("write did not land in the upper")
	}
	if b, _ := os.ReadFile(filepath.Join(base, "bin/sh")); string(b) != "shell" {
		t.Fatal("the base layer changed")
	}
	if err := os.Rename(filepath.Join(merged, "src"), filepath.Join(merged, "src2")); !errors.Is(err, unix.EXDEV) {
		t.Fatalf("directory rename: %v, want EXDEV", err)
	}
}

// TestMountIDMappedRefuses: only an overlay with an upper whose work
// directory shares its parent, and no option but dsec's own, is
// idmapped; anything else is refused before anything is opened.
func TestMountIDMappedRefuses(t *testing.T) {
	dir := t.TempDir()
	ok := mount.Overlay([]string{"/l"}, filepath.Join(dir, "upper"), filepath.Join(dir, "work"))
	odd := ok
	odd.Options = append(append([]string{}, ok.Options...), "volatile")
	for what, m := range map[string]mount.Mount{
		"erofs":              mount.EROFS("/x.img"),
		"no upper":           mount.Overlay([]string{"/l"}, "", ""),
		"work elsewhere":     mount.Overlay([]string{"/l"}, filepath.Join(dir, "upper"), "/elsewhere/work"),
		"an option unmapped": odd,
	} {
		if err := m.MountIDMapped(dir, -1, 0); err == nil {
			t.Errorf("%s: idmapped", what)
		}
	}
}

// TestOverlayManyLayers: an overlay stacks as many layers as their
// descriptors' paths fit in a page, however long their own paths are
// (an image of Docker's most, 127 layers, with room to spare); past
// that the error says so.
func TestOverlayManyLayers(t *testing.T) {
	layertest.RequireRoot(t)
	base := filepath.Join(t.TempDir(), strings.Repeat("a-long-directory-name-", 4))
	var lowers []string
	for i := range 300 {
		d := filepath.Join(base, fmt.Sprintf("layer-%03d", i))
		if err := os.MkdirAll(d, 0o755); err != nil {
			t.Fatal(err)
		}
		os.WriteFile(filepath.Join(d, fmt.Sprintf("f%03d", i)), []byte("x"), 0o644)
		lowers = append(lowers, d)
	}
	rw := t.TempDir()
	upper, work := filepath.Join(rw, "upper"), filepath.Join(rw, "work")
	os.Mkdir(upper, 0o755)
	os.Mkdir(work, 0o755)
	merged := t.TempDir()
	if err := mount.Overlay(lowers[:150], upper, work).Mount(merged); err != nil {
		t.Fatalf("150 layers of %d-byte paths: %v", len(lowers[0]), err)
	}
	ents, _ := os.ReadDir(merged)
	mount.Unmount(merged)
	if len(ents) != 150 {
		t.Errorf("the stack of 150 shows %d files", len(ents))
	}
	err := mount.Overlay(lowers, upper, work).Mount(merged)
	if !errdefs.IsOutOfRange(err) || !strings.Contains(err.Error(), "300 layers are too many to stack") {
		mount.Unmount(merged)
		t.Fatalf("300 layers: %v", err)
	}
}
