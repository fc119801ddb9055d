// Package e2btest installs the official E2B JavaScript SDK for the
// tests and benchmarks that drive dsec's E2B front with it.
package e2btest

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"

	"golang.org/x/sys/unix"
)

// Install installs e2b@version from npm, once, into the user cache, and
// returns its node_modules directory (NODE_PATH for a CommonJS script).
func Install(version string) (string, error) {
	cache, err := os.UserCacheDir()
	if err != nil {
		return "", err
	}
	dir := filepath.Join(cache, "dsec", "e2b-"+version) // shared with make demo
	mods := filepath.Join(dir, "node_modules")
	if _, err := os.Stat(filepath.Join(mods, "e2b", "package.json")); err == nil {
		return mods, nil
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return "", err
	}
	lock, err := os.OpenFile(dir+".lock", os.O_CREATE|os.O_RDWR, 0o644)
	if err != nil {
		return "", err
	}
	defer lock.Close()
	if err := unix.Flock(int(lock.Fd()), unix.LOCK_EX); err != nil {
		return "", err
	}
	if _, err := os.Stat(filepath.Join(mods, "e2b", "package.json")); err == nil {
		return mods, nil
	}
	cmd := exec.Command("npm", "install", "--no-audit", "--no-fund", "--no-save", "--prefix", dir, "e2b@"+version)
	if out, err := cmd.CombinedOutput(); err != nil {
		os.RemoveAll(mods)
		return "", fmt.Errorf("npm install e2b@%s (make deps installs npm): %v\n%s", version, err, out)
	}
	return mods, nil
}
