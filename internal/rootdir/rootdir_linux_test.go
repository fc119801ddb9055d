package rootdir

import (
	"os"
	"path/filepath"
	"slices"
	"syscall"
	"testing"

	"github.com/dsec-project/dsec/internal/testenv"
)

// TestSecureLeavesMounts: a file system mounted in the root (a layer a
// user mounted there, read-only) is not the root's: Secure leaves it and
// does not fail on it.
func TestSecureLeavesMounts(t *testing.T) {
	testenv.RequireRoot(t, "mounts")
	root := t.TempDir()
	m := filepath.Join(root, "mnt")
	if err := os.Mkdir(m, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := syscall.Mount("tmpfs", m, "tmpfs", syscall.MS_RDONLY, "mode=0755"); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { syscall.Unmount(m, syscall.MNT_DETACH) })
	fixed, err := Secure(root)
	if err != nil {
		t.Fatalf("a read-only mount in the root: %v", err)
	}
	if fi, _ := os.Stat(m); fi.Mode().Perm() != 0o755 || slices.Contains(fixed, m) {
		t.Fatalf("the mount was changed (%v) or listed as repaired: %v", fi.Mode(), fixed)
	}
}
