package runtime

import (
	"bytes"
	"os"
	"os/exec"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"

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

// TestMountHolders: a file system mounted in a namespace is found in its
// processes' mount tables, and in none once unmounted.
func TestMountHolders(t *testing.T) {
	layertest.RequireRoot(t)
	d := t.TempDir()
	if err := syscall.Mount("tmpfs", d, "tmpfs", 0, ""); err != nil {
		t.Fatal(err)
	}
	var st syscall.Stat_t
	if err := syscall.Stat(d, &st); err != nil {
		t.Fatal(err)
	}
	self := strconv.Itoa(os.Getpid()) + " ("
	if h := mountHolders(st.Dev); !slices.ContainsFunc(h, func(s string) bool { return strings.HasPrefix(s, self) }) {
		t.Errorf("mounted, holders %v do not name this process %s", h, self)
	}
	if err := syscall.Unmount(d, 0); err != nil {
		t.Fatal(err)
	}
	if h := mountHolders(st.Dev); !slices.Equal(h, []string{"none"}) {
		t.Errorf("unmounted, holders %v", h)
	}
}
