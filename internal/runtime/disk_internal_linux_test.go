package runtime

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

	"golang.org/x/sys/unix"

	"github.com/dsec-project/dsec/internal/layer/layertest"
)

// TestDiskTemplate: the second image of a size is a copy of the first's
// data extents: the same bytes, sparse, a file system e2fsck finds clean.
func TestDiskTemplate(t *testing.T) {
	layertest.RequireRoot(t)
	const size = 3 << 30 // a size no other test uses
	a, b := t.TempDir(), t.TempDir()
	if err := makeDisk(a, size); err != nil {
		t.Fatal(err)
	}
	if _, ok := diskTemplates.Load(int64(size)); !ok {
		t.Fatal("no template kept after the first image")
	}
	if err := makeDisk(b, size); err != nil {
		t.Fatal(err)
	}
	ea, err := readSparse(diskImage(a))
	if err != nil {
		t.Fatal(err)
	}
	eb, err := readSparse(diskImage(b))
	if err != nil {
		t.Fatal(err)
	}
	same := slices.EqualFunc(ea, eb, func(x, y extent) bool { return x.off == y.off && bytes.Equal(x.data, y.data) })
	if !same || len(ea) == 0 {
		t.Errorf("the copy differs: %d extents vs %d", len(eb), len(ea))
	}
	var st syscall.Stat_t
	if err := syscall.Stat(diskImage(b), &st); err != nil || st.Size != size || st.Blocks*512 > 1<<20 {
		t.Errorf("the copy: size %d, %d bytes on the host, %v", st.Size, st.Blocks*512, err)
	}
	if out, err := exec.Command("e2fsck", "-f", "-n", diskImage(b)).CombinedOutput(); err != nil {
		t.Errorf("e2fsck on the copy: %v: %s", err, out)
	}
	if err := makeDisk(b, size); err == nil {
		t.Error("made a disk over an existing one")
	}
}

// TestMountHolders: a file system mounted in another mount namespace
// names that namespace's process, not this one's. (The device number of
// a tmpfs is reused once it goes, so the test holds it while it looks.)
func TestMountHolders(t *testing.T) {
	layertest.RequireRoot(t)
	cmd := exec.Command("unshare", "-m", "--propagation", "private", "sh", "-c",
		`mount -t tmpfs t "$0" && mountpoint -d "$0" && exec sleep 60`, t.TempDir())
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() { _ = cmd.Process.Kill(); _ = cmd.Wait() }()
	line, err := bufio.NewReader(out).ReadString('\n')
	var major, minor uint32
	if _, err2 := fmt.Sscanf(line, "%d:%d", &major, &minor); err != nil || err2 != nil {
		t.Fatalf("the child's mount: %q, %v, %v", line, err, err2)
	}
	h := mountHolders(unix.Mkdev(major, minor))
	has := func(pid int) bool {
		return slices.ContainsFunc(h, func(s string) bool { return strings.HasPrefix(s, strconv.Itoa(pid)+" (") })
	}
	if !has(cmd.Process.Pid) || has(os.Getpid()) {
		t.Errorf("holders of %d:%d are %v: want the child %d, not this process %d", major, minor, h, cmd.Process.Pid, os.Getpid())
	}
	if h := mountHolders(unix.Mkdev(0, 0)); !slices.Equal(h, []string{"none"}) {
		t.Errorf("holders of a device nothing mounts: %v", h)
	}
}
