package archive

import (
	"archive/tar"
	"bytes"
	"errors"
	"io"
	"io/fs"
	"net"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/containerd/errdefs"

	"github.com/dsec-project/dsec/internal/testenv"
)

func TestPlan(t *testing.T) {
	for _, c := range []struct {
		src              string
		srcDir           bool
		dst              string
		exists, dstDir   bool
		dir, name, fails string
	}{
		{src: "f.txt", dst: "/root", exists: true, dstDir: true, dir: "/root", name: "f.txt"},
		{src: "f.txt", dst: "/root/", exists: true, dstDir: true, dir: "/root/", name: "f.txt"},
		{src: "a/f.txt", dst: "/root/g", exists: true, dir: "/root", name: "g"},
		{src: "a/f.txt", dst: "/root/g", dir: "/root", name: "g"},
		{src: "f.txt", dst: "/root/new/", fails: "does not exist"},
		{src: "f.txt/", dst: "/x", fails: "not a directory"},
		{src: "dir", srcDir: true, dst: "/x", exists: true, dstDir: true, dir: "/x", name: "dir"},
		{src: "dir/", srcDir: true, dst: "/x", exists: true, dstDir: true, dir: "/x", name: "dir"},
		{src: "dir/.", srcDir: true, dst: "/x", exists: true, dstDir: true, dir: "/x", name: "."},
		{src: "/", srcDir: true, dst: "/x", exists: true, dstDir: true, dir: "/x", name: "."},
		{src: "dir", srcDir: true, dst: "/x/new", dir: "/x", name: "new"},
		{src: "dir/.", srcDir: true, dst: "/x/new/", dir: "/x", name: "new"},
		{src: "dir", srcDir: true, dst: "/x/file", exists: true, fails: "onto file"},
	} {
		dir, name, err := Plan(c.src, c.srcDir, c.dst, c.exists, c.dstDir)
		if c.fails != "" {
			if err == nil || !strings.Contains(err.Error(), c.fails) {
				t.Errorf("Plan(%q, %q): %v, want an error with %q", c.src, c.dst, err, c.fails)
			}
			continue
		}
		if err != nil || dir != c.dir || name != c.name {
			t.Errorf("Plan(%q, %v, %q, %v, %v) = %q, %q, %v; want %q, %q", c.src, c.srcDir, c.dst, c.exists, c.dstDir, dir, name, err, c.dir, c.name)
		}
	}
}

func openRoot(t *testing.T, dir string) Root {
	t.Helper()
	r, err := os.OpenRoot(dir)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { r.Close() })
	return Root{r}
}

// TestRoundTrip copies a tree through a tar stream and back: modes,
// times, symlinks (kept as links), hard links (kept as one inode), and
// set-id bits only when asked.
func TestRoundTrip(t *testing.T) {
	src, dst := t.TempDir(), t.TempDir()
	must := func(err error) {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
	}
	must(os.MkdirAll(filepath.Join(src, "tree/sub"), 0o755))
	must(os.WriteFile(filepath.Join(src, "tree/a"), []byte("a\n"), 0o644))
	must(os.WriteFile(filepath.Join(src, "tree/sub/run"), []byte("#!/bin/sh\n"), 0o750))
	must(os.Chmod(filepath.Join(src, "tree/sub/run"), 0o750|fs.ModeSetuid))
	must(os.Link(filepath.Join(src, "tree/a"), filepath.Join(src, "tree/hard")))
	must(os.Symlink("/etc/passwd", filepath.Join(src, "tree/abs")))
	must(os.Symlink("a", filepath.Join(src, "tree/rel")))
	must(os.Chmod(filepath.Join(src, "tree/sub"), 0o500)) // read-only: takes its entries first
	old := time.Date(2020, 1, 2, 3, 4, 5, 0, time.UTC)
	must(os.Chtimes(filepath.Join(src, "tree/a"), old, old))
	must(os.Chtimes(filepath.Join(src, "tree/sub"), old, old))
	t.Cleanup(func() {
		os.Chmod(filepath.Join(src, "tree/sub"), 0o755)
		os.Chmod(filepath.Join(dst, "copy/sub"), 0o755)
	})

	for _, noSetID := range []bool{false, true} {
		var buf bytes.Buffer
		if _, err := Write(&buf, openRoot(t, src), "tree", WriteOptions{Name: "copy"}); err != nil {
			t.Fatal(err)
		}
		os.Chmod(filepath.Join(dst, "copy/sub"), 0o755)
		os.RemoveAll(filepath.Join(dst, "copy"))
		if _, err := Extract(&buf, openRoot(t, dst), ".", ExtractOptions{NoSetID: noSetID}); err != nil {
			t.Fatal(err)
		}
		check := func(name string, mode fs.FileMode) fs.FileInfo {
			t.Helper()
			fi, err := os.Lstat(filepath.Join(dst, "copy", name))
			if err != nil {
				t.Fatal(err)
			}
			if mode != 0 && fi.Mode() != mode {
				t.Errorf("%s: mode %v, want %v", name, fi.Mode(), mode)
			}
			return fi
		}
		if fi := check("a", 0o644); !fi.ModTime().Equal(old) {
			t.Errorf("a: mtime %v, want %v", fi.ModTime(), old)
		}
		if fi := check("sub", fs.ModeDir|0o500); !fi.ModTime().Equal(old) {
			t.Errorf("sub: mtime %v, want %v (its entries moved it)", fi.ModTime(), old)
		}
		want := 0o750 | fs.ModeSetuid
		if noSetID {
			want = 0o750
		}
		check("sub/run", want)
		a, h := check("a", 0).Sys().(*syscall.Stat_t), check("hard", 0).Sys().(*syscall.Stat_t)
		if a.Ino != h.Ino {
			t.Errorf("hard link came back a copy")
		}
		for name, target := range map[string]string{"abs": "/etc/passwd", "rel": "a"} {
			if got, err := os.Readlink(filepath.Join(dst, "copy", name)); err != nil || got != target {
				t.Errorf("%s: %q %v, want a link to %q", name, got, err, target)
			}
		}
	}
}

// TestOwners: -a keeps the archive's uid and gid, and a set-uid file
// stays set-uid (a chown after the chmod would clear it).
func TestOwners(t *testing.T) {
	testenv.RequireRoot(t, "giving files to other users")
	src, dst := t.TempDir(), t.TempDir()
	os.WriteFile(filepath.Join(src, "run"), []byte("x"), 0o755)
	os.Lchown(filepath.Join(src, "run"), 7, 8)
	os.Chmod(filepath.Join(src, "run"), 0o755|fs.ModeSetuid)
	var buf bytes.Buffer
	if _, err := Write(&buf, openRoot(t, src), "run", WriteOptions{IDs: func(u, g int) (int, int) { return u + 1, g + 1 }}); err != nil {
		t.Fatal(err)
	}
	if _, err := Extract(&buf, openRoot(t, dst), ".", ExtractOptions{Owners: true}); err != nil {
		t.Fatal(err)
	}
	fi, err := os.Lstat(filepath.Join(dst, "run"))
	if err != nil {
		t.Fatal(err)
	}
	if st := fi.Sys().(*syscall.Stat_t); st.Uid != 8 || st.Gid != 9 || fi.Mode() != 0o755|fs.ModeSetuid {
		t.Errorf("run: %d:%d %v, want 8:9 -rwsr-xr-x", st.Uid, st.Gid, fi.Mode())
	}
}

// TestWriteContents: NAME "." archives a directory's entries at the top
// (docker's SRC/.), and a socket is left out with the reason.
func TestWriteContents(t *testing.T) {
	src := t.TempDir()
	os.WriteFile(filepath.Join(src, "f"), []byte("x"), 0o600)
	l, err := net.Listen("unix", filepath.Join(src, "sock"))
	if err == nil {
		defer l.Close()
	}
	var buf bytes.Buffer
	skipped, err := Write(&buf, openRoot(t, src), ".", WriteOptions{Name: "."})
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	tr := tar.NewReader(&buf)
	for {
		h, err := tr.Next()
		if err != nil {
			break
		}
		names = append(names, h.Name)
	}
	if strings.Join(names, ",") != "f" {
		t.Errorf("entries %q, want just f", names)
	}
	if l != nil && (len(skipped) != 1 || skipped[0].Name != "sock") {
		t.Errorf("skipped %v, want the socket", skipped)
	}
}

func tarOf(t *testing.T, entries ...*tar.Header) *bytes.Buffer {
	t.Helper()
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	for _, h := range entries {
		body := ""
		if h.Typeflag == tar.TypeReg {
			body = "planted\n"
			h.Size = int64(len(body))
		}
		if h.Mode == 0 {
			h.Mode = 0o644
		}
		if err := tw.WriteHeader(h); err != nil {
			t.Fatal(err)
		}
		io.WriteString(tw, body)
	}
	tw.Close()
	return &buf
}

// TestHostileArchive: an archive from the other side never puts a byte
// outside the directory it is extracted into.
func TestHostileArchive(t *testing.T) {
	for name, entries := range map[string][]*tar.Header{
		"dotdot":       {{Name: "../escaped", Typeflag: tar.TypeReg}},
		"absolute":     {{Name: "/escaped", Typeflag: tar.TypeReg}},
		"through link": {{Name: "l", Typeflag: tar.TypeSymlink, Linkname: ".."}, {Name: "l/escaped", Typeflag: tar.TypeReg}},
		"through abs":  {{Name: "l", Typeflag: tar.TypeSymlink, Linkname: "OUTSIDE"}, {Name: "l/escaped", Typeflag: tar.TypeReg}},
		"hard link":    {{Name: "h", Typeflag: tar.TypeLink, Linkname: "../outside/secret"}},
		"hard via sym": {{Name: "l", Typeflag: tar.TypeSymlink, Linkname: "OUTSIDE"}, {Name: "h", Typeflag: tar.TypeLink, Linkname: "l/secret"}},
		"file on link": {{Name: "l", Typeflag: tar.TypeSymlink, Linkname: "OUTSIDE/escaped"}, {Name: "l", Typeflag: tar.TypeReg}},
	} {
		t.Run(name, func(t *testing.T) {
			top := t.TempDir()
			outside, dst := filepath.Join(top, "outside"), filepath.Join(top, "dst")
			os.Mkdir(outside, 0o755)
			os.Mkdir(dst, 0o755)
			os.WriteFile(filepath.Join(outside, "secret"), []byte("secret\n"), 0o600)
			for _, h := range entries {
				h.Linkname = strings.ReplaceAll(h.Linkname, "OUTSIDE", outside)
			}
			Extract(tarOf(t, entries...), openRoot(t, dst), ".", ExtractOptions{})
			ents, _ := os.ReadDir(outside)
			if len(ents) != 1 {
				t.Errorf("outside now holds %v", ents)
			}
			if _, err := os.Stat(filepath.Join(top, "escaped")); err == nil {
				t.Errorf("a file landed beside the destination")
			}
			if b, _ := os.ReadFile(filepath.Join(outside, "secret")); string(b) != "secret\n" {
				t.Errorf("the file outside was changed: %q", b)
			}
			if fi, err := os.Stat(filepath.Join(dst, "h")); err == nil && fi.Sys().(*syscall.Stat_t).Nlink > 1 {
				t.Errorf("a hard link to a file outside was made")
			}
		})
	}
}

// TestExtractReplaces: a file replaces a file only once whole (a cut
// stream leaves the old one), and neither a file nor a directory
// replaces the other.
func TestExtractReplaces(t *testing.T) {
	dst := t.TempDir()
	os.WriteFile(filepath.Join(dst, "f"), []byte("old\n"), 0o644)
	os.Mkdir(filepath.Join(dst, "d"), 0o755)
	full := tarOf(t, &tar.Header{Name: "f", Typeflag: tar.TypeReg}).Bytes()
	if _, err := Extract(bytes.NewReader(full[:512+4]), openRoot(t, dst), ".", ExtractOptions{}); err == nil {
		t.Fatal("a cut archive extracted without an error")
	}
	if b, _ := os.ReadFile(filepath.Join(dst, "f")); string(b) != "old\n" {
		t.Errorf("a cut copy changed the target: %q", b)
	}
	if ents, _ := os.ReadDir(dst); len(ents) != 2 {
		t.Errorf("a cut copy left %v", ents)
	}
	if _, err := Extract(bytes.NewReader(full), openRoot(t, dst), ".", ExtractOptions{}); err != nil {
		t.Fatal(err)
	}
	if b, _ := os.ReadFile(filepath.Join(dst, "f")); string(b) != "planted\n" {
		t.Errorf("f: %q after the copy", b)
	}
	_, err := Extract(tarOf(t, &tar.Header{Name: "d", Typeflag: tar.TypeReg}), openRoot(t, dst), ".", ExtractOptions{})
	if !errdefs.IsAlreadyExists(err) {
		t.Errorf("a file over a directory: %v", err)
	}
	_, err = Extract(tarOf(t, &tar.Header{Name: "f", Typeflag: tar.TypeDir, Mode: 0o755}), openRoot(t, dst), ".", ExtractOptions{})
	if !errdefs.IsAlreadyExists(err) {
		t.Errorf("a directory over a file: %v", err)
	}
	skipped, err := Extract(tarOf(t, &tar.Header{Name: "dev", Typeflag: tar.TypeChar, Devmajor: 1, Devminor: 3}), openRoot(t, dst), ".", ExtractOptions{})
	if err != nil || len(skipped) != 1 {
		t.Errorf("a device node: %v %v, want it left out", skipped, err)
	}
	if _, err := os.Lstat(filepath.Join(dst, "dev")); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("a device node was made: %v", err)
	}
}

// FuzzExtract: whatever the archive, nothing lands outside the
// destination and nothing panics.
func FuzzExtract(f *testing.F) {
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	tw.WriteHeader(&tar.Header{Name: "d/", Typeflag: tar.TypeDir, Mode: 0o755})
	tw.WriteHeader(&tar.Header{Name: "d/f", Typeflag: tar.TypeReg, Mode: 0o644, Size: 1})
	tw.Write([]byte("x"))
	tw.WriteHeader(&tar.Header{Name: "l", Typeflag: tar.TypeSymlink, Linkname: "../.."})
	tw.WriteHeader(&tar.Header{Name: "h", Typeflag: tar.TypeLink, Linkname: "d/f"})
	tw.Close()
	f.Add(buf.Bytes())
	f.Fuzz(func(t *testing.T, b []byte) {
		for tr := tar.NewReader(bytes.NewReader(b)); ; { // sparse entries of terabytes of zeros: slow, not wrong
			h, err := tr.Next()
			if err != nil {
				break
			}
			if h.Size > 1<<20 {
				t.Skip()
			}
		}
		top := t.TempDir()
		dst := filepath.Join(top, "dst")
		os.Mkdir(dst, 0o755)
		Extract(bytes.NewReader(b), openRoot(t, dst), ".", ExtractOptions{})
		if ents, _ := os.ReadDir(top); len(ents) != 1 {
			t.Fatalf("the archive put %v beside the destination", ents)
		}
		filepath.WalkDir(dst, func(p string, d fs.DirEntry, err error) error {
			if err == nil && d.IsDir() {
				os.Chmod(p, 0o755) // so that the test's cleanup can remove it
			}
			return nil
		})
	})
}
