package layer_test

import (
	"bufio"
	"bytes"
	"compress/gzip"
	"context"
	"encoding/binary"
	"errors"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"testing/fstest"
	"time"

	"github.com/containerd/errdefs"
	goerofs "github.com/erofs/go-erofs"
	"github.com/opencontainers/go-digest"

	"github.com/dsec-project/dsec/internal/layer"
	"github.com/dsec-project/dsec/internal/layer/layertest"
	"github.com/dsec-project/dsec/internal/layer/store"
	"github.com/dsec-project/dsec/internal/mount"
)

func newStore(t *testing.T) *store.Store {
	t.Helper()
	s, err := store.Open(filepath.Join(t.TempDir(), "store"))
	if err != nil {
		t.Fatal(err)
	}
	return s
}

func build(t *testing.T, s *store.Store, src, tag string, stdin io.Reader) *layer.Info {
	t.Helper()
	ref, err := layer.ParseRef(tag)
	if err != nil {
		t.Fatal(err)
	}
	info, err := layer.Build(context.Background(), s, layer.BuildOptions{Source: src, Stdin: stdin, Kind: layer.KindBase, Ref: ref})
	if err != nil {
		t.Fatalf("build %s: %v", src, err)
	}
	return info
}

func imagePath(s *store.Store, i *layer.Info) string { return s.BlobPath(i.Digest) }

func fsck(t *testing.T, image string) {
	t.Helper()
	out, err := exec.Command("fsck.erofs", image).CombinedOutput()
	if err != nil {
		t.Fatalf("fsck.erofs rejects %s: %v\n%s", image, err, out)
	}
}

func assertSame(t *testing.T, what string, want, got layertest.Tree) {
	t.Helper()
	if d := layertest.Diff(want, got); len(d) > 0 {
		if len(d) > 30 {
			d = d[:30]
		}
		t.Fatalf("%s differs from the source:\n%s", what, strings.Join(d, "\n"))
	}
}

// mountImage mounts a layer file-backed and checks no loop device is used.
func mountImage(t *testing.T, image string) string {
	t.Helper()
	dir := t.TempDir()
	if err := mount.EROFS(image).Mount(dir); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := mount.Unmount(dir); err != nil {
			t.Error(err)
		}
	})
	info, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range strings.Split(string(info), "\n") {
		f := strings.Fields(line)
		if len(f) > 4 && f[4] == dir {
			if i := strings.Index(line, " - "); i < 0 || !strings.Contains(line[i:], "erofs "+image) {
				t.Fatalf("mount of %s is not file-backed: %s", image, line)
			}
			return dir
		}
	}
	t.Fatalf("mount %s not in mountinfo", dir)
	return ""
}

func TestBuildDirRoundTrip(t *testing.T) {
	layertest.RequireRoot(t)
	src := t.TempDir()
	layertest.MakeRich(t, src, layertest.Options{Sockets: true})
	want := layertest.ScanDir(t, src)

	s := newStore(t)
	info := build(t, s, src, "rich:1", nil)
	img := imagePath(s, info)
	if info.Size > 32<<20 {
		t.Errorf("image is %d bytes: sparse files were materialized", info.Size)
	}
	if info.Files != uint64(len(want)) {
		t.Errorf("files = %d, the tree has %d paths", info.Files, len(want))
	}
	fsck(t, img)
	assertSame(t, "go-erofs view", want, layertest.ScanEROFS(t, img))
	assertSame(t, "kernel mount", want, layertest.ScanDir(t, mountImage(t, img)))
}

// TestHugeSparseFile checks a 5 GiB sparse file: 64-bit size, chunk
// addresses past 4 GiB, holes kept, data where it was.
func TestHugeSparseFile(t *testing.T) {
	layertest.RequireRoot(t)
	src := t.TempDir()
	f, err := os.Create(filepath.Join(src, "huge"))
	if err != nil {
		t.Fatal(err)
	}
	const size, at = 5 << 30, 4<<30 + 512<<20 + 4096
	f.Truncate(size)
	f.WriteAt([]byte("far away"), at)
	f.Close()
	s := newStore(t)
	start := time.Now()
	info := build(t, s, src, "huge:1", nil)
	if info.Size > 8<<20 {
		t.Fatalf("image is %d bytes for 8 bytes of data", info.Size)
	}
	if d := time.Since(start); d > 5*time.Second {
		t.Errorf("building a 5 GiB sparse file took %v: holes were read", d)
	}
	fsck(t, imagePath(s, info))
	mnt := mountImage(t, imagePath(s, info))
	g, err := os.Open(filepath.Join(mnt, "huge"))
	if err != nil {
		t.Fatal(err)
	}
	defer g.Close()
	st, _ := g.Stat()
	if st.Size() != size {
		t.Fatalf("size %d, want %d", st.Size(), size)
	}
	buf := make([]byte, 16)
	for _, c := range []struct {
		off  int64
		want string
	}{{at, "far away\x00\x00\x00\x00\x00\x00\x00\x00"}, {0, strings.Repeat("\x00", 16)}, {at - 8, "\x00\x00\x00\x00\x00\x00\x00\x00far away"}, {size - 16, strings.Repeat("\x00", 16)}} {
		if _, err := g.ReadAt(buf, c.off); err != nil {
			t.Fatal(err)
		}
		if string(buf) != c.want {
			t.Fatalf("at %d: %q, want %q", c.off, buf, c.want)
		}
	}
}

func TestMetadataIsContiguousAndWindowed(t *testing.T) {
	layertest.RequireRoot(t)
	src := t.TempDir()
	layertest.MakeRich(t, src, layertest.Options{})
	s := newStore(t)
	info := build(t, s, src, "rich:1", nil)
	m := info.Metadata
	if m.Offset%4096 != 0 || m.Offset+m.Size != info.Size || m.Size <= 0 {
		t.Fatalf("metadata %+v is not the aligned tail of a %d-byte image", m, info.Size)
	}
	// The metadata region holds no file bytes: zero the data region and
	// every path must still list, stat and readlink the same.
	img := imagePath(s, info)
	b, err := os.ReadFile(img)
	if err != nil {
		t.Fatal(err)
	}
	for i := int64(4096); i < m.Offset; i++ {
		b[i] = 0
	}
	meta := filepath.Join(t.TempDir(), "meta-only.erofs")
	if err := os.WriteFile(meta, b, 0o644); err != nil {
		t.Fatal(err)
	}
	dir := mountImage(t, meta)
	want := layertest.ScanDir(t, src)
	for p, e := range want {
		var st os.FileInfo
		if st, err = os.Lstat(filepath.Join(dir, p)); err != nil {
			t.Fatalf("stat %q without data: %v", p, err)
		}
		if e.Type == "symlink" {
			if target, err := os.Readlink(filepath.Join(dir, p)); err != nil || target != e.Target {
				t.Fatalf("readlink %q without data: %q, %v", p, target, err)
			}
		}
		if e.Type == "reg" && st.Size() != e.Size {
			t.Fatalf("%q: size %d without data, want %d", p, st.Size(), e.Size)
		}
	}
	// The image passes the io/fs conformance suite (which opens through
	// symlinks, so dangling ones go, and reads every file many times).
	for _, p := range []string{"links/dangling", "links/long-target", "sparse", "sizes", "n"} {
		if err := os.RemoveAll(filepath.Join(src, p)); err != nil {
			t.Fatal(err)
		}
	}
	f, err := os.Open(imagePath(s, build(t, s, src, "rich:2", nil)))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	fsys, err := layer.OpenFS(f)
	if err != nil {
		t.Fatal(err)
	}
	if err := fstest.TestFS(fsys, "etc/passwd", "links/a", "links/sub/c", "links/sym", "many", "dev/null"); err != nil {
		t.Fatal(err)
	}
	// go-erofs alone accepts non-canonical names; OpenFS must not.
	raw, _ := goerofs.Open(f)
	if _, err := raw.Open("etc/../etc/passwd"); err != nil {
		t.Log("go-erofs now rejects non-canonical names; OpenFS's wrapper may go")
	}
	if _, err := fsys.Open("etc/../etc/passwd"); err == nil {
		t.Fatal("OpenFS accepted a non-canonical name")
	}
	// The window table covers the image in 1 MiB windows.
	table, err := s.ReadBlob(info.Windows.Digest, 1<<20)
	if err != nil {
		t.Fatal(err)
	}
	if info.Windows.Count != int((info.Size+layer.WindowSize-1)/layer.WindowSize) || len(table) != 32*info.Windows.Count {
		t.Fatalf("window table: %d windows, %d bytes, image %d bytes", info.Windows.Count, len(table), info.Size)
	}
	orig, _ := os.ReadFile(img)
	for w := 0; w < info.Windows.Count; w++ {
		end := min(int64(w+1)*layer.WindowSize, info.Size)
		if got := digest.FromBytes(orig[int64(w)*layer.WindowSize : end]).Encoded(); got != digestHex(table[32*w:32*w+32]) {
			t.Fatalf("window %d hash mismatch", w)
		}
	}
}

func digestHex(b []byte) string {
	const hexd = "0123456789abcdef"
	out := make([]byte, 0, 64)
	for _, c := range b {
		out = append(out, hexd[c>>4], hexd[c&15])
	}
	return string(out)
}

func writeFile(t *testing.T, p string, b []byte) string {
	t.Helper()
	if err := os.WriteFile(p, b, 0o644); err != nil {
		t.Fatal(err)
	}
	return p
}

func TestBuildTarRoundTrip(t *testing.T) {
	layertest.RequireRoot(t)
	src := t.TempDir()
	layertest.MakeRich(t, src, layertest.Options{})
	want := layertest.ScanDir(t, src)
	var plain bytes.Buffer
	layertest.WriteTar(t, src, &plain)

	gz, zst := layertest.Compressed(plain.Bytes())

	s := newStore(t)
	dirDigest := build(t, s, src, "dir:1", nil).Digest
	tmp := t.TempDir()
	cases := []struct {
		name  string
		src   string
		stdin io.Reader
	}{
		{"tar", writeFile(t, filepath.Join(tmp, "l.tar"), plain.Bytes()), nil},
		{"tar.gz", writeFile(t, filepath.Join(tmp, "l.tar.gz"), gz), nil},
		{"tar.zst", writeFile(t, filepath.Join(tmp, "l.tar.zst"), zst), nil},
		{"stdin", "-", bytes.NewReader(gz)},
	}
	for i, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			info := build(t, s, c.src, "tar:"+string(rune('a'+i)), c.stdin)
			img := imagePath(s, info)
			fsck(t, img)
			assertSame(t, "go-erofs view", want, layertest.ScanEROFS(t, img))
			assertSame(t, "kernel mount", want, layertest.ScanDir(t, mountImage(t, img)))
			if info.Digest != dirDigest {
				t.Errorf("tar in walk order gives %s, the directory gives %s", info.Digest, dirDigest)
			}
		})
	}
}

func TestBuildIsDeterministic(t *testing.T) {
	layertest.RequireRoot(t)
	a, b := t.TempDir(), t.TempDir()
	layertest.MakeRich(t, a, layertest.Options{})
	// The same tree created in another order, so readdir order and inode
	// numbers differ.
	names := []string{"zeta", "alpha", "mid/x", "mid/a", "beta"}
	for i, dir := range []string{a, b} {
		order := names
		if i == 1 {
			order = []string{"beta", "mid/a", "mid/x", "alpha", "zeta"}
		}
		for _, n := range order {
			os.MkdirAll(filepath.Join(dir, filepath.Dir(n)), 0o755)
			writeFile(t, filepath.Join(dir, n), []byte(n))
		}
	}
	os.RemoveAll(filepath.Join(b, "x"))
	cp := exec.Command("cp", "-a", a+"/.", b)
	if out, err := cp.CombinedOutput(); err != nil {
		t.Fatalf("cp: %v %s", err, out)
	}
	layertest.SetMtimes(t, a)
	layertest.SetMtimes(t, b)
	s := newStore(t)
	d1 := build(t, s, a, "a:1", nil)
	time.Sleep(1100 * time.Millisecond)
	d2 := build(t, s, b, "b:1", nil)
	if d1.Digest != d2.Digest {
		t.Fatalf("same tree, different digests: %s vs %s", d1.Digest, d2.Digest)
	}
	if d1.Created.Equal(d2.Created) {
		t.Fatalf("build times should differ")
	}
	// A one-byte change must change the digest.
	writeFile(t, filepath.Join(b, "alpha"), []byte("alphb"))
	layertest.SetMtimes(t, b)
	if d3 := build(t, s, b, "b:2", nil); d3.Digest == d1.Digest {
		t.Fatal("changed tree, same digest")
	}
}

func TestConcurrentBuildsShareOneBlob(t *testing.T) {
	src := t.TempDir()
	for i := 0; i < 50; i++ {
		writeFile(t, filepath.Join(src, "f"+string(rune('a'+i%26))+string(rune('a'+i/26))), bytes.Repeat([]byte{byte(i)}, 10000*i))
	}
	s := newStore(t)
	var wg sync.WaitGroup
	digests := make([]digest.Digest, 6)
	errs := make([]error, 6)
	for i := range 6 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			tag := "same:1" // half the builds share a tag: identical content retags as a no-op
			if i%2 == 1 {
				tag = "other:" + string(rune('a'+i))
			}
			ref, _ := layer.ParseRef(tag)
			info, err := layer.Build(context.Background(), s, layer.BuildOptions{Source: src, Kind: layer.KindWorkspace, Ref: ref})
			errs[i] = err
			if err == nil {
				digests[i] = info.Digest
			}
		}()
	}
	wg.Wait()
	for i, err := range errs {
		if err != nil && !errdefs.IsAlreadyExists(err) {
			t.Fatalf("build %d: %v", i, err)
		}
	}
	var layers int
	ents, _ := os.ReadDir(filepath.Join(s.Dir(), "blobs", "sha256"))
	for _, e := range ents {
		b, _ := os.ReadFile(filepath.Join(s.Dir(), "blobs", "sha256", e.Name()))
		if len(b) > 1028 && bytes.Equal(b[1024:1028], []byte{0xe2, 0xe1, 0xf5, 0xe0}) {
			layers++
		}
	}
	if layers != 1 {
		t.Fatalf("%d EROFS blobs for one content", layers)
	}
	all, err := layer.List(context.Background(), s)
	if err != nil {
		t.Fatal(err)
	}
	if len(all) != 4 { // same:1 and three others
		t.Fatalf("%d tags, want 4", len(all))
	}
	for _, i := range all {
		if i.Digest != all[0].Digest {
			t.Fatalf("tags name different layers")
		}
	}
}

// storeState is what a failed build must not change.
func storeState(t *testing.T, s *store.Store) string {
	t.Helper()
	var b strings.Builder
	filepath.WalkDir(s.Dir(), func(p string, d os.DirEntry, err error) error {
		if err != nil || d.IsDir() || strings.HasSuffix(p, "lock") {
			return err
		}
		data, _ := os.ReadFile(p)
		rel, _ := filepath.Rel(s.Dir(), p)
		b.WriteString(rel + " " + digest.FromBytes(data).String() + "\n")
		return nil
	})
	return b.String()
}

func TestBadSourcesLeaveStoreUnchanged(t *testing.T) {
	s := newStore(t)
	good := t.TempDir()
	writeFile(t, filepath.Join(good, "a"), []byte("a"))
	build(t, s, good, "good:1", nil)
	before := storeState(t, s)

	tmp := t.TempDir()
	var full bytes.Buffer
	src := t.TempDir()
	writeFile(t, filepath.Join(src, "big"), bytes.Repeat([]byte("data"), 100000))
	layertest.WriteTar(t, src, &full)
	truncated := writeFile(t, filepath.Join(tmp, "trunc.tar"), full.Bytes()[:full.Len()/2])
	var gz bytes.Buffer
	zw := gzip.NewWriter(&gz)
	zw.Write(full.Bytes())
	zw.Close()
	corruptGz := gz.Bytes()
	corruptGz[len(corruptGz)/2] ^= 0xff
	escape := tarOf(t, map[string]string{"../../etc/evil": "x"})
	badXattr := tarWithPAX(t, "f", map[string]string{"SCHILY.xattr.system.nfs4_acl": "x"})
	unsupported := layertest.Tar(layertest.File{Name: "vol", Type: 'V'})

	cases := []struct {
		name, src string
		stdin     io.Reader
		is        func(error) bool
	}{
		{"missing", filepath.Join(tmp, "nope"), nil, errdefs.IsNotFound},
		{"not a tar", writeFile(t, filepath.Join(tmp, "junk"), bytes.Repeat([]byte("junk"), 300)), nil, isBad},
		{"truncated tar", truncated, nil, isBad},
		{"truncated stdin", "-", bytes.NewReader(full.Bytes()[:full.Len()/2]), isBad},
		{"corrupt gzip", writeFile(t, filepath.Join(tmp, "c.tar.gz"), corruptGz), nil, isBad},
		{"path escape", writeFile(t, filepath.Join(tmp, "esc.tar"), escape), nil, isBad},
		{"bad xattr", writeFile(t, filepath.Join(tmp, "x.tar"), badXattr), nil, isBad},
		{"unsupported entry", writeFile(t, filepath.Join(tmp, "v.tar"), unsupported), nil, isBad},
		{"empty file", writeFile(t, filepath.Join(tmp, "empty"), nil), nil, isBad},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			ref, _ := layer.ParseRef("bad:1")
			_, err := layer.Build(context.Background(), s, layer.BuildOptions{Source: c.src, Stdin: c.stdin, Kind: layer.KindBase, Ref: ref})
			if err == nil || !c.is(err) {
				t.Fatalf("err = %v", err)
			}
			if strings.Contains(err.Error(), "\n") {
				t.Errorf("error is not one line: %q", err)
			}
			if after := storeState(t, s); after != before {
				t.Fatalf("store changed:\nbefore:\n%s\nafter:\n%s", before, after)
			}
		})
	}
	// The same build again under its tag is a no-op; other content under
	// it is refused, the store unchanged.
	ref, _ := layer.ParseRef("good:1")
	was, err := layer.Resolve(context.Background(), s, "good:1")
	if err != nil {
		t.Fatal(err)
	}
	again, err := layer.Build(context.Background(), s, layer.BuildOptions{Source: good, Kind: layer.KindBase, Ref: ref})
	if err != nil || again.Digest != was.Digest || again.Manifest != was.Manifest {
		t.Fatalf("the same build again: %+v, %v; want the layer there (%s)", again, err, was.Digest)
	}
	other := t.TempDir()
	os.WriteFile(filepath.Join(other, "f"), []byte("other"), 0o644)
	_, err = layer.Build(context.Background(), s, layer.BuildOptions{Source: other, Kind: layer.KindBase, Ref: ref})
	if !errdefs.IsAlreadyExists(err) {
		t.Fatalf("other content under an existing tag: %v", err)
	}
	if now, _ := layer.Resolve(context.Background(), s, "good:1"); now == nil || now.Digest != was.Digest {
		t.Fatalf("the tag moved: %+v", now)
	}
}

func isBad(err error) bool { return errors.Is(err, layer.ErrBadSource) }

func TestNoSpaceLeavesStoreUnchanged(t *testing.T) {
	layertest.RequireRoot(t)
	dir := t.TempDir()
	if err := (mount.Mount{Type: "tmpfs", Source: "tmpfs", Options: []string{"size=2m"}}).Mount(dir); err != nil {
		t.Fatal(err)
	}
	defer mount.Unmount(dir)
	s, err := store.Open(filepath.Join(dir, "store"))
	if err != nil {
		t.Fatal(err)
	}
	src := t.TempDir()
	writeFile(t, filepath.Join(src, "big"), bytes.Repeat([]byte("0123456789abcdef"), 1<<18)) // 4 MiB
	before := storeState(t, s)
	ref, _ := layer.ParseRef("big:1")
	_, err = layer.Build(context.Background(), s, layer.BuildOptions{Source: src, Kind: layer.KindBase, Ref: ref})
	if !errors.Is(err, store.ErrNoSpace) {
		t.Fatalf("err = %v, want ErrNoSpace", err)
	}
	if after := storeState(t, s); after != before {
		t.Fatalf("store changed:\n%s\n%s", before, after)
	}
}

// TestKillMidBuild kills a build with SIGKILL while it reads its source:
// no blob, no tag, and gc removes the leftover ingest.
func TestKillMidBuild(t *testing.T) {
	s := newStore(t)
	cmd := exec.Command(os.Args[0])
	cmd.Env = append(os.Environ(), "DSEC_HELPER_STORE="+s.Dir())
	stdin, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	stderr, _ := cmd.StderrPipe()
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	before := storeState(t, s)
	// Half a tar: the build blocks reading the rest.
	src := t.TempDir()
	writeFile(t, filepath.Join(src, "big"), bytes.Repeat([]byte("data"), 1<<20))
	var full bytes.Buffer
	layertest.WriteTar(t, src, &full)
	stdin.Write(full.Bytes()[:full.Len()/2])
	deadline := time.Now().Add(10 * time.Second)
	for {
		ents, _ := os.ReadDir(filepath.Join(s.Dir(), "ingest"))
		if len(ents) > 0 {
			break
		}
		if time.Now().After(deadline) {
			b, _ := io.ReadAll(bufio.NewReader(stderr))
			t.Fatalf("build never started writing: %s", b)
		}
		time.Sleep(10 * time.Millisecond)
	}
	time.Sleep(100 * time.Millisecond)
	cmd.Process.Kill()
	cmd.Wait()
	stdin.Close()

	if _, err := s.Resolve(context.Background(), "half:1"); !errdefs.IsNotFound(err) {
		t.Fatalf("killed build left a tag: %v", err)
	}
	ents, _ := os.ReadDir(filepath.Join(s.Dir(), "blobs", "sha256"))
	if len(ents) != 0 {
		t.Fatalf("killed build left %d blobs", len(ents))
	}
	res, err := layer.GC(context.Background(), s, nil)
	if err != nil {
		t.Fatal(err)
	}
	if res.Ingests != 1 {
		t.Fatalf("gc removed %d ingests, want 1", res.Ingests)
	}
	if after := storeState(t, s); after != before {
		t.Fatalf("store not restored by gc:\n%s\n%s", before, after)
	}
}

// TestNoInodeZero: no inode of a built layer has number 0 through the
// kernel, the root's included: glibc's readdir hides entries whose inode
// is 0, so a root at NID 0 showed no '.' or '..' (issue 29, item 11).
func TestNoInodeZero(t *testing.T) {
	layertest.RequireRoot(t)
	src := t.TempDir()
	layertest.MakeRich(t, src, layertest.Options{})
	s := newStore(t)
	dir := mountImage(t, imagePath(s, build(t, s, src, "ino:1", nil)))
	n := 0
	err := filepath.Walk(dir, func(p string, fi os.FileInfo, err error) error {
		if err != nil {
			return err
		}
		n++
		if ino := fi.Sys().(*syscall.Stat_t).Ino; ino == 0 {
			t.Errorf("%s has inode 0", p)
		}
		return nil
	})
	if err != nil || n < 10 {
		t.Fatalf("walked %d entries: %v", n, err)
	}
	// The root's own entries, as getdents gives them.
	f, err := os.Open(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	buf := make([]byte, 1<<16)
	nb, err := syscall.Getdents(int(f.Fd()), buf)
	if err != nil {
		t.Fatal(err)
	}
	seen := map[string]uint64{}
	for off := 0; off < nb; {
		ino := binary.NativeEndian.Uint64(buf[off:])
		reclen := int(binary.NativeEndian.Uint16(buf[off+16:]))
		name := string(bytes.TrimRight(buf[off+19:off+reclen], "\x00"))
		seen[name] = ino
		off += reclen
	}
	for _, name := range []string{".", ".."} {
		if ino, ok := seen[name]; !ok || ino == 0 {
			t.Errorf("the root's %q: inode %d (listed: %v)", name, ino, ok)
		}
	}
}
