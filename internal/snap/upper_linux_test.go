package snap_test

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/containerd/errdefs"
	"golang.org/x/sys/unix"

	"github.com/dsec-project/dsec/internal/layer/erofs"
	"github.com/dsec-project/dsec/internal/layer/layertest"
	"github.com/dsec-project/dsec/internal/snap"
)

// pack packs upper into an image and reads the image back.
func pack(t *testing.T, upper string, prev snap.Index, lim snap.Limits) (layertest.Tree, *snap.Packed, error) {
	t.Helper()
	img, p, err := packImage(t, upper, prev, lim)
	if err != nil {
		return nil, p, err
	}
	return layertest.ScanEROFS(t, img), p, nil
}

func packImage(t *testing.T, upper string, prev snap.Index, lim snap.Limits) (string, *snap.Packed, error) {
	t.Helper()
	img := filepath.Join(t.TempDir(), "diff.erofs")
	f, err := os.Create(img)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	w, err := erofs.NewWriter(f)
	if err != nil {
		t.Fatal(err)
	}
	p, err := snap.Pack(context.Background(), w, upper, prev, lim)
	if err != nil {
		return "", nil, err
	}
	defer p.Close()
	st, err := w.Finish()
	if err != nil {
		return "", p, err
	}
	if st.Entries != uint64(p.Entries-p.Unchanged)+1 {
		t.Fatalf("the image has %d paths, the pack added %d and the root", st.Entries, p.Entries)
	}
	return img, p, nil
}

func must(t *testing.T, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}

// The upper is hostile: what it plants must not reach the host, and what
// a layer may not carry is dropped and reported.
func TestPackHostileUpper(t *testing.T) {
	layertest.RequireRoot(t)
	up := t.TempDir()
	secret := filepath.Join(t.TempDir(), "secret")
	must(t, os.WriteFile(secret, []byte("host secret"), 0o600))
	must(t, os.Symlink(secret, filepath.Join(up, "to-host-file")))
	must(t, os.Symlink(filepath.Dir(secret), filepath.Join(up, "to-host-dir")))
	must(t, os.Symlink("../../../../../../../../"+secret, filepath.Join(up, "climb")))
	must(t, unix.Mkfifo(filepath.Join(up, "fifo"), 0o644)) // a reader would block forever
	must(t, unix.Mknod(filepath.Join(up, "mem"), unix.S_IFCHR|0o600, int(unix.Mkdev(1, 1))))
	must(t, unix.Mknod(filepath.Join(up, "disk"), unix.S_IFBLK|0o600, int(unix.Mkdev(7, 0))))
	must(t, unix.Mknod(filepath.Join(up, "gone"), unix.S_IFCHR, 0)) // a whiteout
	must(t, os.Mkdir(filepath.Join(up, "opq"), 0o755))
	must(t, unix.Lsetxattr(filepath.Join(up, "opq"), "trusted.overlay.opaque", []byte("y"), 0))
	must(t, unix.Lsetxattr(filepath.Join(up, "opq"), "trusted.overlay.origin", []byte("fh"), 0))
	must(t, unix.Lsetxattr(filepath.Join(up, "opq"), "trusted.evil", []byte("1"), 0))
	must(t, unix.Lsetxattr(filepath.Join(up, "opq"), "user.fine", []byte("ok"), 0))
	must(t, os.WriteFile(filepath.Join(up, "opq", "f"), []byte("data"), 0o644))

	tr, p, err := pack(t, up, nil, snap.Limits{})
	if err != nil {
		t.Fatal(err)
	}
	for name, target := range map[string]string{"to-host-file": secret, "to-host-dir": filepath.Dir(secret), "climb": "../../../../../../../../" + secret} {
		if e := tr[name]; e.Type != "symlink" || e.Target != target {
			t.Errorf("%s: %+v, want a symlink to %s", name, e, target)
		}
	}
	for p := range tr {
		if strings.HasPrefix(p, "to-host-dir/") {
			t.Errorf("the walk followed a symlink: %s", p)
		}
	}
	if tr["fifo"].Type != "fifo" || tr["gone"].Type != "char" || tr["gone"].Rdev != "0:0" {
		t.Errorf("fifo %+v, whiteout %+v", tr["fifo"], tr["gone"])
	}
	if _, ok := tr["mem"]; ok {
		t.Error("a device node was packed")
	}
	if _, ok := tr["disk"]; ok {
		t.Error("a block device was packed")
	}
	if len(p.Dropped) != 2 || !strings.Contains(strings.Join(p.Dropped, " "), "/mem: device node 1:1") {
		t.Errorf("dropped %q", p.Dropped)
	}
	want := map[string]string{"trusted.overlay.opaque": "y", "user.fine": "ok"}
	if got := tr["opq"].Xattrs; fmt.Sprint(got) != fmt.Sprint(want) {
		t.Errorf("xattrs %v, want %v", got, want)
	}
	if tr["opq/f"].Size != 4 {
		t.Errorf("opq/f %+v", tr["opq/f"])
	}
}

func TestPackLimits(t *testing.T) {
	layertest.RequireRoot(t)
	up := t.TempDir()
	deep := up
	for range 40 {
		deep = filepath.Join(deep, "d")
	}
	must(t, os.MkdirAll(deep, 0o755))
	must(t, os.WriteFile(filepath.Join(up, "f"), make([]byte, 10000), 0o644))
	if _, _, err := pack(t, up, nil, snap.Limits{MaxDepth: 40}); err != nil {
		t.Fatalf("40 levels within a limit of 40: %v", err)
	}
	for _, c := range []struct {
		lim  snap.Limits
		flag string
	}{
		{snap.Limits{MaxDepth: 39}, "--max-depth"},
		{snap.Limits{MaxEntries: 40}, "--max-entries"},
		{snap.Limits{MaxBytes: 9999}, "--max-bytes"},
	} {
		_, _, err := pack(t, up, nil, c.lim)
		if !errdefs.IsOutOfRange(err) || !strings.Contains(err.Error(), c.flag) || strings.Contains(err.Error(), "\n") {
			t.Errorf("%+v: %v", c.lim, err)
		}
	}
}

// A tree deeper than PATH_MAX allows to name in one path is walked and
// its files read through directory descriptors.
func TestPackBeyondPathMax(t *testing.T) {
	layertest.RequireRoot(t)
	up := t.TempDir()
	name := strings.Repeat("n", 250)
	fd, err := unix.Open(up, unix.O_RDONLY|unix.O_DIRECTORY, 0)
	must(t, err)
	for range 20 { // 20 * 251 bytes > 4096
		must(t, unix.Mkdirat(fd, name, 0o755))
		next, err := unix.Openat(fd, name, unix.O_RDONLY|unix.O_DIRECTORY, 0)
		must(t, err)
		unix.Close(fd)
		fd = next
	}
	ffd, err := unix.Openat(fd, "leaf", unix.O_CREAT|unix.O_WRONLY, 0o644)
	must(t, err)
	unix.Write(ffd, []byte("deep"))
	unix.Close(ffd)
	unix.Close(fd)
	t.Cleanup(func() { removeDeep(up, name) })
	tr, _, err := pack(t, up, nil, snap.Limits{})
	if err != nil {
		t.Fatal(err)
	}
	leaf := strings.TrimPrefix(strings.Repeat("/"+name, 20)+"/leaf", "/")
	if e := tr[leaf]; e.Type != "reg" || e.Size != 4 {
		t.Fatalf("leaf %+v", e)
	}
}

// removeDeep removes a tree too deep for os.RemoveAll's paths.
func removeDeep(dir, name string) {
	for {
		p := dir
		n := 0
		for {
			if _, err := os.Lstat(p + "/" + name); err != nil {
				break
			}
			p += "/" + name
			n++
			if len(p) > 3000 {
				break
			}
		}
		if n == 0 {
			return
		}
		if err := os.RemoveAll(p); err != nil {
			// deeper than a path reaches: move the tail up, then retry
			os.Rename(p, dir+"/tail")
			removeDeep(dir+"/tail", name)
			os.Remove(dir + "/tail")
		}
	}
}

func TestPack100kFiles(t *testing.T) {
	layertest.RequireRoot(t)
	if testing.Short() {
		t.Skip("-short: 10^5 files")
	}
	// tmpfs: 10^5 creates on this VM's disk take most of a minute.
	up, err := os.MkdirTemp("/dev/shm", "dsec-snap-test-")
	if err != nil {
		up = t.TempDir()
	}
	t.Cleanup(func() { os.RemoveAll(up) })
	for d := range 100 {
		dir := filepath.Join(up, fmt.Sprint(d))
		must(t, os.Mkdir(dir, 0o755))
		for i := range 1000 {
			must(t, os.WriteFile(filepath.Join(dir, fmt.Sprint(i)), []byte{byte(i)}, 0o644))
		}
	}
	start := time.Now()
	_, p, err := packImage(t, up, nil, snap.Limits{})
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("10^5 files packed in %v", time.Since(start))
	if p.Entries != 100100 {
		t.Fatalf("%d entries packed", p.Entries)
	}
	// One new file: the increment holds it and the directories, not
	// the 1000 unchanged files beside it.
	must(t, os.WriteFile(filepath.Join(up, "0", "new"), []byte("twelve bytes"), 0o644))
	_, p2, err := packImage(t, up, p.Index, snap.Limits{})
	if err != nil {
		t.Fatal(err)
	}
	if p2.Unchanged != 100000 || p2.Bytes != 12 {
		t.Fatalf("increment after adding a file: %v", p2)
	}
}

func TestIndexRoundTrip(t *testing.T) {
	p := filepath.Join(t.TempDir(), "index")
	idx := snap.Index{"a": {Ino: 1, Ctime: -5, Dir: true}, "a/b c": {Ino: 1 << 60, Ctime: 1 << 62}}
	must(t, snap.WriteIndex(p, "sha256:aa", idx))
	got, err := snap.ReadIndex(p, "sha256:aa")
	if err != nil || fmt.Sprint(got) != fmt.Sprint(idx) {
		t.Fatalf("%v %v", got, err)
	}
	if got, _ := snap.ReadIndex(p, "sha256:bb"); got != nil {
		t.Fatal("another snapshot's index was used")
	}
	b, _ := os.ReadFile(p)
	os.WriteFile(p, b[:len(b)-3], 0o600)
	if got, _ := snap.ReadIndex(p, "sha256:aa"); got != nil {
		t.Fatal("a truncated index was used")
	}
}

// TestPackLeaksNoDescriptor: a process started while a pack holds the
// upper open (from Pack until the image is written) inherits no
// descriptor of it. The worker starts microVM shims and their QEMU
// meanwhile; one that kept a guest's upper open kept its disk image
// mounted (the unmount could only detach it) and its loop device
// attached for as long as the VM lived. (Carry duplicates its root the
// same way, dupCloexec, but holds it only during its walk, which a test
// cannot start a process inside.)
func TestPackLeaksNoDescriptor(t *testing.T) {
	up := t.TempDir()
	writeFile(t, up, "dir/a", "a")
	writeFile(t, up, "b", "b")
	f, err := os.Create(filepath.Join(t.TempDir(), "img"))
	must(t, err)
	defer f.Close()
	w, err := erofs.NewWriter(f)
	must(t, err)
	p, err := snap.Pack(context.Background(), w, up, nil, snap.Limits{})
	must(t, err)
	defer p.Close()
	out, err := exec.Command("sh", "-c", `for f in /proc/$$/fd/*; do readlink "$f" || :; done`).Output()
	must(t, err)
	for _, l := range strings.Fields(string(out)) {
		if strings.HasPrefix(l, up) {
			t.Errorf("a process started during a pack holds %s", l)
		}
	}
	_, err = w.Finish()
	must(t, err)
}
