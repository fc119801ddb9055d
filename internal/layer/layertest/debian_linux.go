package layertest

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"

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
	cache, err := os.UserCacheDir()
	if err != nil {
		return "", err
	}
	dir := filepath.Join(cache, "dsec") // shared with make demo
	root := filepath.Join(dir, "debian-"+debianSuite+"-minbase")
	if _, err := os.Stat(filepath.Join(root, "bin", "bash")); err == nil {
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
	if _, err := os.Stat(filepath.Join(root, "bin", "bash")); err == nil {
		return root, nil // another caller bootstrapped it meanwhile
	}
	tmp := root + ".tmp"
	os.RemoveAll(tmp)
	out, err := exec.Command("debootstrap", "--variant=minbase", debianSuite, tmp, "http://deb.debian.org/debian").CombinedOutput()
	if err != nil {
		os.RemoveAll(tmp)
		return "", fmt.Errorf("debootstrap a Debian %s root (make deps installs debootstrap): %v\n%s", debianSuite, err, out)
	}
	os.RemoveAll(root)
	return root, os.Rename(tmp, root)
}
