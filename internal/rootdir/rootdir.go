// Package rootdir keeps a dsec root private. Under the root lie every
// layer of the store, every sandbox's files, its upper, its journal and
// its disk image, tokens' hashes and the E2B front's records: none of it
// is another host user's to read. The root is the host root's alone,
// 0700, and so is everything directly in it (a directory or a file an
// older dsec, an earlier layer build or a hand left open), made so when
// it is made and repaired when dsec finds it otherwise. Nothing below
// is reachable through a root no one else may enter, so deeper modes
// stay as they are: the store's layout keeps its own, as a dir: remote
// on a shared file system needs.
package rootdir

import (
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"syscall"
)

// Secure makes root (0700) unless it exists, and takes group and other
// users' access away from it and from every directory and file directly
// in it. It returns the paths it repaired.
func Secure(root string) ([]string, error) {
	if err := os.MkdirAll(root, 0o700); err != nil {
		return nil, fmt.Errorf("make the root %s: %w", root, err)
	}
	var fixed []string
	repair := func(p string, fi fs.FileInfo) error {
		if fi.Mode()&0o077 == 0 || fi.Mode()&fs.ModeSymlink != 0 || fi.Mode()&fs.ModeSocket != 0 {
			return nil
		}
		if err := os.Chmod(p, fi.Mode().Perm()&0o700|fi.Mode()&(fs.ModeSetuid|fs.ModeSetgid|fs.ModeSticky)); err != nil {
			return fmt.Errorf("make %s private: %w", p, err)
		}
		fixed = append(fixed, p)
		return nil
	}
	fi, err := os.Lstat(root)
	if err != nil {
		return nil, err
	}
	if !fi.IsDir() {
		return nil, fmt.Errorf("the root %s is not a directory", root)
	}
	if err := repair(root, fi); err != nil {
		return nil, err
	}
	rootFi := fi
	ents, err := os.ReadDir(root)
	if err != nil {
		return nil, err
	}
	for _, e := range ents {
		p := filepath.Join(root, e.Name())
		fi, err := os.Lstat(p)
		if err != nil {
			continue // gone meanwhile
		}
		if !sameDevice(fi, rootFi) {
			continue // a file system mounted there (a layer mounted in the root) is not the root's to change
		}
		if err := repair(p, fi); err != nil {
			return fixed, err
		}
	}
	return fixed, nil
}

// sameDevice says whether a and b lie on one file system.
func sameDevice(a, b fs.FileInfo) bool {
	sa, okA := a.Sys().(*syscall.Stat_t)
	sb, okB := b.Sys().(*syscall.Stat_t)
	return !okA || !okB || sa.Dev == sb.Dev
}
