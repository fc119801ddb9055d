package erofs_test

import (
	"bytes"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	goerofs "github.com/erofs/go-erofs"
	"golang.org/x/sys/unix"

	"github.com/dsec-project/dsec/internal/layer/erofs"
	"github.com/dsec-project/dsec/internal/mount"
	"github.com/dsec-project/dsec/internal/testenv"
)

// image runs fill against a new writer and returns the image path and
// the go-erofs view of it, after fsck.erofs has accepted it.
func image(t *testing.T, fill func(w *erofs.Writer)) (string, fs.FS) {
	t.Helper()
	p, fsys, _ := imageStats(t, fill)
	return p, fsys
}

// imageStats is image that also returns the writer's figures.
func imageStats(t *testing.T, fill func(w *erofs.Writer)) (string, fs.FS, erofs.Stats) {
	t.Helper()
	p := filepath.Join(t.TempDir(), "img.erofs")
	f, err := os.Create(p)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { f.Close() })
	w, err := erofs.NewWriter(f)
	if err != nil {
		t.Fatal(err)
	}
	fill(w)
	st, err := w.Finish()
	if err != nil {
		t.Fatal(err)
	}
	if fi, _ := f.Stat(); fi.Size() != st.Size || st.Size%erofs.BlockSize != 0 {
		t.Fatalf("image is %d bytes, stats say %d", fi.Size(), st.Size)
	}
	if out, err := exec.Command("fsck.erofs", p).CombinedOutput(); err != nil {
		t.Fatalf("fsck.erofs: %v\n%s", err, out)
	}
	fsys, err := goerofs.Open(f)
	if err != nil {
		t.Fatal(err)
	}
	return p, fsys, st
}

// canMount says whether the test may mount the image to check the
// kernel's view of it (root): CI must, so there it fails the test.
func canMount(t *testing.T) bool {
	t.Helper()
	if os.Geteuid() == 0 {
		return true
	}
	if testenv.MustRun() {
		t.Fatal("the kernel's view needs root to mount, and CI must check it: run the tests as root")
	}
	t.Log("SKIPPED the kernel's view of the image: mounting needs root; CI runs it as root")
	return false
}

func must(t *testing.T, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}

func file(t *testing.T, w *erofs.Writer, p, body string) {
	t.Helper()
	must(t, w.Create(p, erofs.Attr{Mode: 0o644}, int64(len(body)), strings.NewReader(body)))
}

func read(t *testing.T, fsys fs.FS, p string) string {
	t.Helper()
	b, err := fs.ReadFile(fsys, p)
	if err != nil {
		t.Fatalf("read %s: %v", p, err)
	}
	return string(b)
}

func TestSplitPath(t *testing.T) {
	for in, want := range map[string]string{
		"": "", ".": "", "./": "", "/": "", "a": "a", "./a/b/": "a/b", "/a//b": "a/b", "a/./b": "a/b",
	} {
		got, err := erofs.SplitPath(in)
		if err != nil || strings.Join(got, "/") != want {
			t.Errorf("SplitPath(%q) = %q, %v; want %q", in, got, err, want)
		}
	}
	for _, bad := range []string{"..", "a/../b", "../x", "a/\x00b", strings.Repeat("n", 256)} {
		if _, err := erofs.SplitPath(bad); !errors.Is(err, erofs.ErrInvalid) {
			t.Errorf("SplitPath(%.20q) = %v, want ErrInvalid", bad, err)
		}
	}
}

func TestEmptyImage(t *testing.T) {
	_, fsys := image(t, func(w *erofs.Writer) {})
	ents, err := fs.ReadDir(fsys, ".")
	if err != nil || len(ents) != 0 {
		t.Fatalf("root = %v, %v", ents, err)
	}
}

func TestReplaceRemoveAndLink(t *testing.T) {
	_, fsys := image(t, func(w *erofs.Writer) {
		file(t, w, "a/f", "one")
		file(t, w, "a/f", "two") // a later entry replaces an earlier one
		file(t, w, "a/sub/keep", "k")
		must(t, w.Mkdir("a", erofs.Attr{Mode: 0o700})) // a directory over a directory keeps children
		file(t, w, "b/dir/x", "x")
		file(t, w, "b/dir", "now a file") // a file over a directory drops the tree
		file(t, w, "c/gone/y", "y")
		must(t, w.Remove("c/gone"))
		must(t, w.Remove("c/never-there"))
		file(t, w, "l/target", "shared")
		must(t, w.Link("l/one", "l/target"))
		must(t, w.Link("l/two", "l/one"))
		if err := w.Link("l/bad", "l/missing"); !errors.Is(err, erofs.ErrInvalid) {
			t.Errorf("link to missing target: %v", err)
		}
		if err := w.Link("l/bad", "a"); !errors.Is(err, erofs.ErrInvalid) {
			t.Errorf("link to a directory: %v", err)
		}
		if err := w.Create("b/dir/under-file", erofs.Attr{}, 0, strings.NewReader("")); !errors.Is(err, erofs.ErrInvalid) {
			t.Errorf("entry below a file: %v", err)
		}
	})
	if got := read(t, fsys, "a/f"); got != "two" {
		t.Errorf("a/f = %q", got)
	}
	if got := read(t, fsys, "a/sub/keep"); got != "k" {
		t.Errorf("a/sub/keep = %q", got)
	}
	if st, _ := fs.Stat(fsys, "a"); st.Mode().Perm() != 0o700 {
		t.Errorf("a mode %v", st.Mode())
	}
	if got := read(t, fsys, "b/dir"); got != "now a file" {
		t.Errorf("b/dir = %q", got)
	}
	if _, err := fs.Stat(fsys, "c/gone"); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("c/gone: %v", err)
	}
	var ino int64
	for _, p := range []string{"l/target", "l/one", "l/two"} {
		st, err := fs.Stat(fsys, p)
		if err != nil {
			t.Fatal(err)
		}
		s := st.Sys().(*goerofs.Stat)
		if s.Nlink != 3 {
			t.Errorf("%s nlink %d, want 3", p, s.Nlink)
		}
		if ino == 0 {
			ino = s.Ino
		} else if s.Ino != ino {
			t.Errorf("%s is inode %d, want %d: hard links must share one inode", p, s.Ino, ino)
		}
	}
	if st, _ := fs.Stat(fsys, "a"); st.Sys().(*goerofs.Stat).Nlink != 3 { // ., .. of sub, entry in root
		t.Errorf("a nlink %d, want 3", st.Sys().(*goerofs.Stat).Nlink)
	}
}

func TestInvalidInput(t *testing.T) {
	image(t, func(w *erofs.Writer) {
		if err := w.Create("x", erofs.Attr{Xattrs: map[string][]byte{"system.nfs4_acl": {1}}}, 1, strings.NewReader("x")); !errors.Is(err, erofs.ErrInvalid) {
			t.Errorf("unknown xattr namespace: %v", err)
		}
		if err := w.Create("x", erofs.Attr{Xattrs: map[string][]byte{"user.v": make([]byte, 70000)}}, 0, strings.NewReader("")); !errors.Is(err, erofs.ErrInvalid) {
			t.Errorf("oversized xattr: %v", err)
		}
		if err := w.Create("short", erofs.Attr{}, 10, strings.NewReader("abc")); !errors.Is(err, erofs.ErrInvalid) {
			t.Errorf("short data: %v", err)
		}
		if err := w.Symlink("s", "", erofs.Attr{}); !errors.Is(err, erofs.ErrInvalid) {
			t.Errorf("empty symlink target: %v", err)
		}
		if err := w.Mknod("n", erofs.Attr{Mode: erofs.S_IFREG}); !errors.Is(err, erofs.ErrInvalid) {
			t.Errorf("mknod of a regular file: %v", err)
		}
		if err := w.Create("", erofs.Attr{}, 0, strings.NewReader("")); !errors.Is(err, erofs.ErrInvalid) {
			t.Errorf("regular file as root: %v", err)
		}
	})
}

func TestFileGrowingWhileReadIsAnError(t *testing.T) {
	p := filepath.Join(t.TempDir(), "f")
	must(t, os.WriteFile(p, []byte("0123456789"), 0o644))
	f, _ := os.Open(p)
	defer f.Close()
	image(t, func(w *erofs.Writer) {
		if err := w.Create("f", erofs.Attr{}, 5, f); !errors.Is(err, erofs.ErrInvalid) {
			t.Errorf("file longer than its size: %v", err)
		}
	})
}

func TestLargeDirectoryAndXattrs(t *testing.T) {
	big := map[string][]byte{}
	for i := range 5 {
		big[fmt.Sprintf("user.x%d", i)] = bytes.Repeat([]byte{byte('a' + i)}, 2000)
	}
	p, fsys := image(t, func(w *erofs.Writer) {
		for i := range 5000 {
			file(t, w, fmt.Sprintf("d/%05d-%s", i, strings.Repeat("n", i%200)), fmt.Sprint(i))
		}
		// 10 KB of xattrs: the inode spans blocks.
		must(t, w.Create("x", erofs.Attr{Mode: 0o600, Xattrs: big}, 3, strings.NewReader("xyz")))
		file(t, w, "after-x", "after")
	})
	ents, err := fs.ReadDir(fsys, "d")
	if err != nil || len(ents) != 5000 {
		t.Fatalf("d has %d entries: %v", len(ents), err)
	}
	for _, i := range []int{0, 1234, 4999} {
		name := fmt.Sprintf("d/%05d-%s", i, strings.Repeat("n", i%200))
		if got := read(t, fsys, name); got != fmt.Sprint(i) {
			t.Fatalf("%s = %q", name, got)
		}
	}
	st, _ := fs.Stat(fsys, "x")
	if x := st.Sys().(*goerofs.Stat).Xattrs; len(x) != 5 || x["user.x4"] != string(big["user.x4"]) {
		t.Fatalf("xattrs of x: %d names", len(x))
	}
	if read(t, fsys, "after-x") != "after" {
		t.Fatal("inode after a block-spanning one is wrong")
	}
	if !canMount(t) {
		return
	}
	mnt := t.TempDir()
	must(t, mount.EROFS(p).Mount(mnt))
	defer mount.Unmount(mnt)
	buf := make([]byte, 4096)
	n, err := unix.Lgetxattr(filepath.Join(mnt, "x"), "user.x3", buf)
	if err != nil || !bytes.Equal(buf[:n], big["user.x3"]) {
		t.Fatalf("kernel: user.x3 = %d bytes, %v", n, err)
	}
	names, _ := os.ReadDir(filepath.Join(mnt, "d"))
	if len(names) != 5000 {
		t.Fatalf("kernel lists %d entries", len(names))
	}
	if b, err := os.ReadFile(filepath.Join(mnt, "d", "04999-"+strings.Repeat("n", 4999%200))); err != nil || string(b) != "4999" {
		t.Fatalf("kernel lookup: %q %v", b, err)
	}
}

func TestSameCallsSameBytes(t *testing.T) {
	fill := func(w *erofs.Writer) {
		file(t, w, "b", "b")
		file(t, w, "a/z", "z")
		must(t, w.Symlink("s", "a/z", erofs.Attr{Mode: 0o777, Mtime: 5}))
		must(t, w.Mkdir("a", erofs.Attr{Mode: 0o755, Xattrs: map[string][]byte{"user.b": {2}, "user.a": {1}, "trusted.c": {3}}}))
	}
	p1, _ := image(t, fill)
	p2, _ := image(t, fill)
	b1, _ := os.ReadFile(p1)
	b2, _ := os.ReadFile(p2)
	if !bytes.Equal(b1, b2) {
		t.Fatal("same calls gave different images")
	}
}

type memFile struct{ *strings.Reader }

func (memFile) Close() error { return nil }

func plan(t *testing.T, w *erofs.Writer, p, body string) {
	t.Helper()
	open := func() (erofs.ReadAtCloser, error) { return memFile{strings.NewReader(body)}, nil }
	must(t, w.Plan(p, erofs.Attr{Mode: 0o644}, int64(len(body)), erofs.Planned{Open: open}))
}

// TestSetOrder: the files an access profile names come first in the data
// region, in its order; the others follow in plan order; the tree reads
// the same and the hot region covers exactly the named files.
func TestSetOrder(t *testing.T) {
	body := map[string]string{
		"a": strings.Repeat("a", 8192), "b": strings.Repeat("b", 5000), "c/d": strings.Repeat("d", 4096), "e": "e",
	}
	p, fsys, st := imageStats(t, func(w *erofs.Writer) {
		must(t, w.SetOrder([]erofs.Hot{{Path: "/c/d"}, {Path: "missing"}, {Path: "b"}, {Path: "./b"}}))
		must(t, w.Mkdir("c", erofs.Attr{Mode: 0o755}))
		for _, n := range []string{"a", "b", "c/d", "e"} {
			plan(t, w, n, body[n])
		}
		if err := w.SetOrder(nil); err == nil {
			t.Error("SetOrder after Plan: no error")
		}
	})
	for n, want := range body {
		if got := read(t, fsys, n); got != want {
			t.Errorf("%s reads %d bytes, want %d", n, len(got), len(want))
		}
	}
	img, err := os.ReadFile(p)
	must(t, err)
	blk := func(i int) byte { return img[i*erofs.BlockSize] }
	// d (1 block), b (2 blocks), then a (2), e (1).
	if got := string([]byte{blk(1), blk(2), blk(3), blk(4), blk(5), blk(6)}); got != "dbbaae" {
		t.Errorf("data blocks hold %q, want dbbaae", got)
	}
	if st.Hot != (erofs.Region{Offset: erofs.BlockSize, Size: 3 * erofs.BlockSize}) {
		t.Errorf("hot region %+v, want blocks 1-3", st.Hot)
	}
}

// TestNoOrderNoHot: without SetOrder nothing is hot and planned files
// keep plan order.
func TestNoOrderNoHot(t *testing.T) {
	p, _, st := imageStats(t, func(w *erofs.Writer) {
		plan(t, w, "x", "x")
		plan(t, w, "y", "y")
	})
	img, err := os.ReadFile(p)
	must(t, err)
	if st.Hot.Size != 0 || img[erofs.BlockSize] != 'x' || img[2*erofs.BlockSize] != 'y' {
		t.Errorf("hot %+v, blocks %q %q", st.Hot, img[erofs.BlockSize], img[2*erofs.BlockSize])
	}
}

// TestSetOrderBlocks: a file named only in part is split: its named blocks
// go to the hot region in the order named, the others after every
// unnamed file; it reads the same, holes included, and the kernel
// agrees (fsck.erofs ran in image).
func TestSetOrderBlocks(t *testing.T) {
	blk := func(c byte) string { return strings.Repeat(string(c), erofs.BlockSize) }
	big := blk('0') + blk('1') + blk('2') + blk('3') + "tail"
	sparse := blk('s') + strings.Repeat("\x00", 2*erofs.HoleSize-erofs.BlockSize) + blk('t')
	p, fsys, st := imageStats(t, func(w *erofs.Writer) {
		must(t, w.SetOrder([]erofs.Hot{
			{Path: "big", Blocks: []erofs.BlockRange{{Start: 3, Count: 2}}},
			{Path: "small"},
			{Path: "big", Blocks: []erofs.BlockRange{{Start: 1, Count: 1}, {Start: 9, Count: 5}}},
			{Path: "sparse", Blocks: []erofs.BlockRange{{Start: 512, Count: 1}}},
			{Path: "past", Blocks: []erofs.BlockRange{{Start: 5, Count: 1}}},
		}))
		plan(t, w, "big", big)
		plan(t, w, "past", "p") // named with blocks it does not have: stays flat and cold
		plan(t, w, "other", "o")
		plan(t, w, "small", "m")
		open := func() (erofs.ReadAtCloser, error) { return memFile{strings.NewReader(sparse)}, nil }
		holes := []bool{false, true, false} // 1 MiB units: the second is all zeros
		must(t, w.Plan("sparse", erofs.Attr{Mode: 0o644}, int64(len(sparse)), erofs.Planned{Open: open, Holes: holes}))
	})
	for n, want := range map[string]string{"big": big, "past": "p", "other": "o", "small": "m", "sparse": sparse} {
		if got := read(t, fsys, n); got != want {
			t.Errorf("%s reads %d bytes, want %d", n, len(got), len(want))
		}
	}
	img, err := os.ReadFile(p)
	must(t, err)
	var got []byte
	for i := int64(1); i < st.Metadata.Offset/erofs.BlockSize; i++ {
		got = append(got, img[i*erofs.BlockSize])
	}
	// hot: big 3, big 4 (tail), big 1 (a file named again keeps its first
	// place), small, sparse 512 (t); cold: past, other, big 0, big 2,
	// sparse's first unit (s and 255 blocks of zeros); its second unit is
	// a hole
	if want := "3t1mtpo02s" + strings.Repeat("\x00", 255); string(got) != want {
		t.Errorf("data blocks hold %q, want %q", got, want)
	}
	if st.Hot.Size != 5*erofs.BlockSize {
		t.Errorf("hot region %+v, want 5 blocks", st.Hot)
	}
	// The kernel reads it too.
	mnt := t.TempDir()
	must(t, mount.EROFS(p).Mount(mnt))
	defer mount.Unmount(mnt)
	for n, want := range map[string]string{"big": big, "sparse": sparse} {
		if b, err := os.ReadFile(filepath.Join(mnt, n)); err != nil || string(b) != want {
			t.Errorf("kernel read of %s: %d bytes, %v", n, len(b), err)
		}
	}
}

// TestExtraDevices writes an image whose files are chunk indexes into
// two blob files, beside a file of its own, and reads it back through
// go-erofs, fsck.erofs and the kernel, each given the blobs as devices.
func TestExtraDevices(t *testing.T) {
	dir := t.TempDir()
	blk := func(c byte, n int) []byte { return bytes.Repeat([]byte{c}, n*erofs.BlockSize) }
	// blob a: blocks 0-1 'a', 2-3 'b'; blob b: blocks 0-1 'c', block 2 a short tail "tail"
	blobA := append(blk('a', 2), blk('b', 2)...)
	blobB := append(blk('c', 2), append([]byte("tail"), make([]byte, erofs.BlockSize-4)...)...)
	pa, pb := filepath.Join(dir, "a"), filepath.Join(dir, "b")
	must(t, os.WriteFile(pa, blobA, 0o644))
	must(t, os.WriteFile(pb, blobB, 0o644))
	want := map[string][]byte{
		"own":          []byte("in the image itself"),
		"d/ab":         append(blk('a', 2), blk('b', 2)...),
		"d/ca-tail":    append(append(blk('c', 2), blk('a', 2)...), "tail"...),
		"d/hole-b":     append(make([]byte, 2*erofs.BlockSize), blk('b', 1)...),
		"empty":        {},
		"d/ab-link":    append(blk('a', 2), blk('b', 2)...),
		"d/b-tail-odd": append(blk('b', 1), blk('b', 1)[:100]...),
	}
	p := filepath.Join(dir, "meta.erofs")
	f, err := os.Create(p)
	must(t, err)
	defer f.Close()
	w, err := erofs.NewWriter(f)
	must(t, err)
	file(t, w, "own", string(want["own"]))
	da, err := w.AddDevice(erofs.Device{Tag: "blob-a", Blocks: 4})
	must(t, err)
	db, err := w.AddDevice(erofs.Device{Tag: "blob-b", Blocks: 3})
	must(t, err)
	reg := erofs.Attr{Mode: 0o644}
	must(t, w.Mkdir("d", erofs.Attr{Mode: 0o755}))
	// chunks of two blocks (chunk bits 1)
	must(t, w.CreateRef("d/ab", reg, 4*erofs.BlockSize, 1, []erofs.Chunk{{da, 0}, {da, 2}}))
	must(t, w.CreateRef("d/ca-tail", reg, 4*erofs.BlockSize+4, 1, []erofs.Chunk{{db, 0}, {da, 0}, {db, 2}}))
	must(t, w.CreateRef("d/hole-b", reg, 3*erofs.BlockSize, 1, []erofs.Chunk{{Block: erofs.NullBlock}, {da, 2}}))
	must(t, w.CreateRef("empty", reg, 0, 1, nil))
	must(t, w.Link("d/ab-link", "d/ab"))
	// chunks of one block; the second ends mid-block
	must(t, w.CreateRef("d/b-tail-odd", reg, erofs.BlockSize+100, 0, []erofs.Chunk{{da, 2}, {da, 3}}))
	for _, bad := range []struct {
		chunks []erofs.Chunk
		size   int64
	}{
		{[]erofs.Chunk{{da, 0}}, 3 * erofs.BlockSize},   // too few chunks
		{[]erofs.Chunk{{3, 0}}, erofs.BlockSize},        // no such device
		{[]erofs.Chunk{{0, 0}}, erofs.BlockSize},        // the image itself
		{[]erofs.Chunk{{db, 2}, {db, 3}}, 3 * 4096 / 2}, // past the device's end
	} {
		if err := w.CreateRef("bad", reg, bad.size, 0, bad.chunks); !errors.Is(err, erofs.ErrInvalid) {
			t.Errorf("CreateRef(%v, %d) = %v, want ErrInvalid", bad.chunks, bad.size, err)
		}
	}
	if _, err := w.Finish(); err != nil {
		t.Fatal(err)
	}
	if out, err := exec.Command("fsck.erofs", "--device="+pa, "--device="+pb, p).CombinedOutput(); err != nil {
		t.Fatalf("fsck.erofs: %v\n%s", err, out)
	}
	ra, _ := os.Open(pa)
	defer ra.Close()
	rb, _ := os.Open(pb)
	defer rb.Close()
	fsys, err := goerofs.Open(f, goerofs.WithExtraDevices(ra, rb))
	must(t, err)
	for n, body := range want {
		if got := read(t, fsys, n); got != string(body) {
			t.Errorf("go-erofs: %s is %d bytes, want %d", n, len(got), len(body))
		}
	}
	if !canMount(t) {
		return
	}
	mnt := t.TempDir()
	if err := mount.EROFS(p).Mount(mnt); err == nil {
		b, err := os.ReadFile(filepath.Join(mnt, "d/ab"))
		mount.Unmount(mnt)
		t.Logf("without its devices: %d bytes %q..., %v", len(b), b[:min(len(b), 8)], err)
	}
	must(t, mount.EROFSDevices(p, []string{pa, pb}).Mount(mnt))
	defer mount.Unmount(mnt)
	for n, body := range want {
		if b, err := os.ReadFile(filepath.Join(mnt, n)); err != nil || !bytes.Equal(b, body) {
			t.Errorf("kernel: %s is %d bytes (%v), want %d", n, len(b), err, len(body))
		}
	}
	var st unix.Stat_t
	must(t, unix.Stat(filepath.Join(mnt, "d/ab-link"), &st))
	if st.Nlink != 2 {
		t.Errorf("kernel: the hard link has %d links", st.Nlink)
	}
}
