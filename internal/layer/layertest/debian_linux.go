package layertest

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"

	"golang.org/x/sys/unix"
)

// debianSuite is the Debian release DebianRoot bootstraps.
const debianSuite = "bookworm"

// DebianRoot is a Debian root file system (debootstrap's minbase
// variant: bash, coreutils, apt), bootstrapped once into the user cache
// from Debian's archive (debootstrap checks it against the archive's
// signed Release file) and shared by every test and run after: what the
// E2B SDKs' commands need (/bin/bash -l -c). Concurrent callers wait
// for the one that bootstraps. make deps installs debootstrap.
func DebianRoot() (string, error) {
	return debootstrap("minbase", "bin/bash")
}

// BootablePackages are what DebianBootable adds to minbase.
var BootablePackages = []string{"linux-image-amd64", "systemd-sysv", "systemd-boot-efi", "udev", "initramfs-tools"}

// DebianBootable is a Debian root file system that boots as a whole
// machine: minbase with Debian's kernel and initramfs, systemd as init
// and systemd-boot (BootablePackages), bootstrapped once into the user
// cache as DebianRoot is.
func DebianBootable() (string, error) {
	return debootstrap("bootable", "usr/lib/systemd/boot/efi/systemd-bootx64.efi", BootablePackages...)
}

// DesktopPackages are what DebianDesktop adds to a bootable root: X
// (Xorg, its modesetting driver for the VM's display, libinput for its
// keyboard and tablet, xinit) and Xfce with its terminal.
var DesktopPackages = []string{"xserver-xorg-core", "xserver-xorg-input-libinput", "xinit", "xfce4-session", "xfwm4",
	"xfce4-panel", "xfdesktop4", "xfce4-terminal", "dbus-x11", "fonts-dejavu-core", "xfconf"}

// DebianDesktop is DebianBootable with an Xfce desktop
// (DesktopPackages), bootstrapped once into the user cache as
// DebianRoot is.
func DebianDesktop() (string, error) {
	return debootstrap("desktop", "usr/bin/startxfce4", append(slices.Clone(BootablePackages), DesktopPackages...)...)
}

// debootstrap bootstraps minbase and include into the cache directory
// debian-SUITE-name once; check is a file that says it is done.
func debootstrap(name, check string, include ...string) (string, error) {
	cache, err := os.UserCacheDir()
	if err != nil {
		return "", err
	}
	dir := filepath.Join(cache, "dsec") // shared with make demo
	root := filepath.Join(dir, "debian-"+debianSuite+"-"+name)
	if _, err := os.Stat(filepath.Join(root, check)); err == nil {
		return root, nil
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return "", err
	}
	lock, err := os.OpenFile(filepath.Join(dir, "debian.lock"), os.O_CREATE|os.O_RDWR, 0o644)
	if err != nil {
		return "", err
	}
	defer lock.Close()
	if err := unix.Flock(int(lock.Fd()), unix.LOCK_EX); err != nil {
		return "", err
	}
	if _, err := os.Stat(filepath.Join(root, check)); err == nil {
		return root, nil // another caller bootstrapped it meanwhile
	}
	tmp := root + ".tmp"
	os.RemoveAll(tmp)
	args := []string{"--variant=minbase"}
	if len(include) > 0 {
		args = append(args, "--include="+strings.Join(include, ","))
	}
	out, err := exec.Command("debootstrap", append(args, debianSuite, tmp, "http://deb.debian.org/debian")...).CombinedOutput()
	if err != nil {
		os.RemoveAll(tmp)
		return "", fmt.Errorf("debootstrap a Debian %s root (make deps installs debootstrap): %v\n%s", debianSuite, err, out)
	}
	os.RemoveAll(root)
	return root, os.Rename(tmp, root)
}
