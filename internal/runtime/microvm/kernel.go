package microvm

import (
	"debug/elf"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"

	"github.com/containerd/errdefs"
)

// Kernel is a guest kernel as scripts/microvm-kernel.sh (make kernel)
// unpacks Debian's: Dir/vmlinux, the kernel uncompressed; Dir/modules,
// its modules; Dir/release, its release and package version.
type Kernel struct {
	Dir string
	// Release is the kernel's (uname -r in the guest), Package the
	// Debian package version it came from: what dsec version and every
	// microVM sandbox's state record.
	Release, Package string
}

// Vmlinux is the kernel image QEMU boots.
func (k *Kernel) Vmlinux() string { return filepath.Join(k.Dir, "vmlinux") }

// Modules is the kernel's modules directory.
func (k *Kernel) Modules() string { return filepath.Join(k.Dir, "modules") }

// String names the kernel as dsec reports it.
func (k *Kernel) String() string { return k.Release + " (" + k.Package + ")" }

// OpenKernel reads the kernel unpacked in dir.
func OpenKernel(dir string) (*Kernel, error) {
	b, err := os.ReadFile(filepath.Join(dir, "release"))
	if errors.Is(err, os.ErrNotExist) {
		return nil, fmt.Errorf("no microVM guest kernel in %s: run make kernel (or point microvm.kernel at one): %w", dir, errdefs.ErrNotImplemented)
	}
	if err != nil {
		return nil, err
	}
	f := strings.Fields(string(b))
	if len(f) != 2 {
		return nil, fmt.Errorf("%s: want \"RELEASE VERSION\", found %q: unpack the kernel again (make kernel)", filepath.Join(dir, "release"), b)
	}
	k := &Kernel{Dir: dir, Release: f[0], Package: f[1]}
	e, err := elf.Open(k.Vmlinux())
	if err != nil {
		return nil, fmt.Errorf("guest kernel %s: %v: unpack it again (make kernel): %w", k.Vmlinux(), err, errdefs.ErrNotImplemented)
	}
	e.Close()
	if fi, err := os.Stat(k.Modules()); err != nil || !fi.IsDir() {
		return nil, fmt.Errorf("guest kernel %s has no modules directory: unpack it again (make kernel): %w", dir, errdefs.ErrNotImplemented)
	}
	return k, nil
}

// KernelDirs are where a worker looks for the guest kernel when its
// configuration names none, in order: beside its binary (make build
// puts it in bin/microvm), then where make install puts it.
func KernelDirs() []string {
	self, err := os.Executable()
	if err != nil {
		return nil
	}
	d := filepath.Dir(self)
	return []string{filepath.Join(d, "microvm"), filepath.Join(d, "..", "lib", "dsec", "microvm")}
}

// FindKernel opens the kernel in dir, or ("") the first of KernelDirs
// that holds one.
func FindKernel(dir string) (*Kernel, error) {
	if dir != "" {
		return OpenKernel(dir)
	}
	dirs := KernelDirs()
	for _, d := range dirs {
		if _, err := os.Stat(filepath.Join(d, "release")); err == nil {
			return OpenKernel(d)
		}
	}
	return nil, fmt.Errorf("no microVM guest kernel (looked in %s): run make kernel, or point microvm.kernel at one: %w", strings.Join(dirs, ", "), errdefs.ErrNotImplemented)
}
