package microvm

import (
	"bufio"
	"crypto/sha256"
	"debug/elf"
	"encoding/hex"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"

	"github.com/containerd/errdefs"
)

// The guest's initramfs, which dsec builds itself: the agent as /init
// (dsec-init, static, which a guest runs as its pid 1: it loads the
// modules, mounts the sandbox's layers and upper, and serves the same
// init protocol as in a container), the modules it loads in order
// (/modules/NNN-NAME.ko), and busybox-static as /bin/busybox with a
// /bin/sh (a shell to look around a guest by hand; the sandbox never
// sees it: its root is its layers).

// Initramfs is the guest's initramfs for kernel k and agent (the path of
// a static dsec-init): built once into dir as initramfs-HASH.cpio, HASH
// over everything in it, and found there after.
func Initramfs(dir string, k *Kernel, agent string) (string, error) {
	if err := staticBinary(agent); err != nil {
		return "", err
	}
	busybox, err := exec.LookPath("busybox")
	if err != nil {
		return "", fmt.Errorf("busybox-static is missing (the guest's shell): install it (make deps): %w", errdefs.ErrNotImplemented)
	}
	if err := staticBinary(busybox); err != nil {
		return "", fmt.Errorf("%w: install busybox-static (make deps)", err)
	}
	mods, err := ResolveModules(k.Modules(), GuestModules)
	if err != nil {
		return "", err
	}
	h := sha256.New()
	fmt.Fprintf(h, "dsec initramfs 1\n%s %s\n", k.Release, k.Package)
	for _, p := range append([]string{agent, busybox}, mods...) {
		f, err := os.Open(p)
		if err != nil {
			return "", err
		}
		fmt.Fprintf(h, "%s\n", filepath.Base(p))
		_, err = io.Copy(h, f)
		f.Close()
		if err != nil {
			return "", err
		}
	}
	out := filepath.Join(dir, "initramfs-"+hex.EncodeToString(h.Sum(nil))[:16]+".cpio")
	if _, err := os.Stat(out); err == nil {
		return out, nil
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return "", err
	}
	tmp, err := os.CreateTemp(dir, ".initramfs-*")
	if err != nil {
		return "", err
	}
	defer os.Remove(tmp.Name())
	bw := bufio.NewWriterSize(tmp, 1<<20)
	if err := writeInitramfs(bw, agent, busybox, mods); err != nil {
		tmp.Close()
		return "", err
	}
	if err := bw.Flush(); err != nil {
		tmp.Close()
		return "", err
	}
	if err := tmp.Close(); err != nil {
		return "", err
	}
	if err := os.Chmod(tmp.Name(), 0o600); err != nil {
		return "", err
	}
	// A cache: a crash that loses it costs a rebuild.
	if err := os.Rename(tmp.Name(), out); err != nil {
		return "", err
	}
	return out, nil
}

func writeInitramfs(w io.Writer, agent, busybox string, mods []string) error {
	c := newCpio(w)
	for _, d := range []string{"bin", "dev", "proc", "sys", "modules", "mnt", "run"} {
		if err := c.Dir(d, 0o755); err != nil {
			return err
		}
	}
	add := func(name, p string) error {
		b, err := os.ReadFile(p)
		if err != nil {
			return err
		}
		return c.File(name, 0o755, b)
	}
	if err := add("init", agent); err != nil {
		return err
	}
	if err := add("bin/busybox", busybox); err != nil {
		return err
	}
	if err := c.Symlink("bin/sh", "busybox"); err != nil {
		return err
	}
	for i, m := range mods {
		if err := add(fmt.Sprintf("modules/%03d-%s", i, filepath.Base(m)), m); err != nil {
			return err
		}
	}
	return c.Close()
}

// staticBinary says why p cannot run in the guest, which has no shared
// libraries: it must be a static executable.
func staticBinary(p string) error {
	f, err := elf.Open(p)
	if err != nil {
		return fmt.Errorf("the microVM guest's agent %s: %v: %w", p, err, errdefs.ErrNotImplemented)
	}
	defer f.Close()
	for _, ph := range f.Progs {
		if ph.Type == elf.PT_INTERP {
			return fmt.Errorf("%s is linked dynamically, and a microVM guest has no libraries: use a static dsec-init (make build; DSEC_MICROVM_AGENT): %w", p, errdefs.ErrNotImplemented)
		}
	}
	return nil
}
