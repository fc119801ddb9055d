package disk

import (
	"bufio"
	"bytes"
	"fmt"
	"os"
	"os/exec"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
	"unsafe"

	"github.com/containerd/errdefs"
	"golang.org/x/sys/unix"

	"github.com/dsec-project/dsec/internal/layer/layertest"
	"github.com/dsec-project/dsec/internal/mount"
)

// TestDiskTemplate: the second image of a size is a copy of the first's
// data extents: the same bytes, sparse, a file system e2fsck finds clean.
func TestDiskTemplate(t *testing.T) {
	layertest.RequireRoot(t)
	const size = 3 << 30 // a size no other test uses
	a, b := t.TempDir(), t.TempDir()
	if err := Make(a, size); err != nil {
		t.Fatal(err)
	}
	if _, ok := diskTemplates.Load(int64(size)); !ok {
		t.Fatal("no template kept after the first image")
	}
	if err := Make(b, size); err != nil {
		t.Fatal(err)
	}
	ea, err := readSparse(Image(a))
	if err != nil {
		t.Fatal(err)
	}
	eb, err := readSparse(Image(b))
	if err != nil {
		t.Fatal(err)
	}
	same := slices.EqualFunc(ea, eb, func(x, y extent) bool { return x.off == y.off && bytes.Equal(x.data, y.data) })
	if !same || len(ea) == 0 {
		t.Errorf("the copy differs: %d extents vs %d", len(eb), len(ea))
	}
	var st syscall.Stat_t
	if err := syscall.Stat(Image(b), &st); err != nil || st.Size != size || st.Blocks*512 > 1<<20 {
		t.Errorf("the copy: size %d, %d bytes on the host, %v", st.Size, st.Blocks*512, err)
	}
	if out, err := exec.Command("e2fsck", "-f", "-n", Image(b)).CombinedOutput(); err != nil {
		t.Errorf("e2fsck on the copy: %v: %s", err, out)
	}
	if err := Make(b, size); err == nil {
		t.Error("made a disk over an existing one")
	}
}

// TestImageHeld: a disk image whose file system outlives its unmount
// here (a detached copy of the mount still holds it, as an overlay's
// private mount of its upper or another namespace's copy does) is not
// grown, checked or mounted again until it is released: touching it
// meanwhile would write under a live superblock.
func TestImageHeld(t *testing.T) {
	layertest.RequireRoot(t)
	dir := t.TempDir()
	if err := Make(dir, 64<<20); err != nil {
		t.Fatal(err)
	}
	if err := Mount(dir, true); err != nil {
		t.Fatal(err)
	}
	defer Unmount(dir)
	clone, err := unix.OpenTree(unix.AT_FDCWD, Dir(dir), unix.OPEN_TREE_CLONE|unix.OPEN_TREE_CLOEXEC)
	if err != nil {
		t.Fatal(err)
	}
	defer func() {
		if clone >= 0 {
			unix.Close(clone)
		}
	}()
	if err := unix.Unmount(Dir(dir), 0); err != nil {
		t.Fatal(err)
	}
	if err := waitImageFreeFor(Image(dir), 100*time.Millisecond); err == nil || !errdefs.IsUnavailable(err) || !strings.Contains(err.Error(), "/dev/loop") {
		t.Fatalf("an image a live file system holds: %v", err)
	}
	// Released, it is free again, and mounts clean.
	unix.Close(clone)
	clone = -1
	if err := waitImageFree(Image(dir)); err != nil {
		t.Fatal(err)
	}
	if err := Mount(dir, false); err != nil {
		t.Fatal(err)
	}
	if err := Grow(dir, 96<<20, false); err != nil {
		t.Fatal(err)
	}
	var fs unix.Statfs_t
	if err := unix.Statfs(Dir(dir), &fs); err != nil || int64(fs.Blocks)*fs.Bsize < 80<<20 {
		t.Errorf("grown offline to 96 MiB: %d blocks of %d, %v", fs.Blocks, fs.Bsize, err)
	}
}

// TestMountHolders: a file system mounted in another mount namespace
// names that namespace's process, not this one's.
func TestMountHolders(t *testing.T) {
	layertest.RequireRoot(t)
	src := fmt.Sprintf("dsec-holders-%d", os.Getpid())
	cmd := exec.Command("unshare", "-m", "--propagation", "private", "sh", "-c",
		`mount -t tmpfs "$1" "$0" && echo mounted && exec sleep 60`, t.TempDir(), src)
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() { _ = cmd.Process.Kill(); _ = cmd.Wait() }()
	if line, err := bufio.NewReader(out).ReadString('\n'); line != "mounted\n" {
		t.Fatalf("the child's mount: %q, %v", line, err)
	}
	h := mountHolders(src)
	has := func(pid int) bool {
		return slices.ContainsFunc(h, func(s string) bool { return strings.HasPrefix(s, strconv.Itoa(pid)+" (") })
	}
	if !has(cmd.Process.Pid) || has(os.Getpid()) {
		t.Errorf("holders of %s are %v: want the child %d, not this process %d", src, h, cmd.Process.Pid, os.Getpid())
	}
	if h := mountHolders(src + "-none"); !slices.Equal(h, []string{"none"}) {
		t.Errorf("holders of a device nothing mounts: %v", h)
	}
}

// TestSweepUppers: the uppers no sandbox names (a worker killed between
// making one and saving its sandbox) go, the named ones stay; the file
// system is unmounted only once none is left; a name dsec never gives
// is never removed.
func TestSweepUppers(t *testing.T) {
	layertest.RequireRoot(t)
	root := t.TempDir()
	if err := PrepareUppers(root, 256<<20); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unmountLoop(UppersDir(root)) })
	kept, orphan := NewUpperName(), NewUpperName()
	for _, n := range []string{kept, orphan} {
		if err := NewUpper(root, n, 16<<20); err != nil {
			t.Fatal(err)
		}
	}
	if err := RemoveUpper(root, "../x"); err == nil {
		t.Error("removed an upper named ../x")
	}
	if err := SweepUppers(root, []string{kept}); err != nil {
		t.Fatal(err)
	}
	if names, err := uppers(root); err != nil || !slices.Equal(names, []string{kept}) {
		t.Fatalf("uppers after the sweep: %v, %v; want %s", names, err, kept)
	}
	if err := ReleaseUppers(root); err != nil {
		t.Fatal(err)
	}
	if mounted, _ := mount.IsMountPoint(UppersDir(root)); !mounted {
		t.Fatal("released the uppers file system with an upper on it")
	}
	if err := RemoveUpper(root, kept); err != nil {
		t.Fatal(err)
	}
	if err := ReleaseUppers(root); err != nil {
		t.Fatal(err)
	}
	if mounted, _ := mount.IsMountPoint(UppersDir(root)); mounted {
		t.Fatal("the uppers file system is still mounted with none on it")
	}
	// Mounted again on its next use, with what it held.
	if err := PrepareUppers(root, 0); err != nil {
		t.Fatal(err)
	}
	if size, _ := UppersSize(root); size != 256<<20 {
		t.Errorf("mounted again at %d bytes, want its 256 MiB", size)
	}
	// Quotas off (a host that went down between making the image and
	// turning them on): on again when it is next mounted.
	if !quotaOn(UppersDir(root)) {
		t.Fatal("quotas are off on a fresh uppers file system")
	}
	fd, err := unix.Open(UppersDir(root), unix.O_RDONLY|unix.O_DIRECTORY, 0)
	if err != nil {
		t.Fatal(err)
	}
	a := quotaCtlArgs{cmd: 2} // BTRFS_QUOTA_CTL_DISABLE
	err = btrfsIoctl(fd, iocQuotaCtl, unsafe.Pointer(&a))
	unix.Close(fd)
	if err != nil || quotaOn(UppersDir(root)) {
		t.Fatalf("quotas still on after disabling them: %v", err)
	}
	if err := ReleaseUppers(root); err != nil {
		t.Fatal(err)
	}
	if err := PrepareUppers(root, 0); err != nil {
		t.Fatal(err)
	}
	if !quotaOn(UppersDir(root)) {
		t.Fatal("quotas are still off after a mount")
	}
	n := NewUpperName()
	if err := NewUpper(root, n, 16<<20); err != nil {
		t.Fatal(err)
	}
	if err := RemoveUpper(root, n); err != nil {
		t.Fatal(err)
	}
}
