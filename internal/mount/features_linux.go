package mount

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/dsec-project/dsec/internal/feature"
)

// The file systems and mount calls sandboxes stand on (package feature).
var (
	HaveEROFS   = fsFeature("erofs", "layers cannot be mounted: no sandbox starts")
	HaveOverlay = fsFeature("overlay", "layers cannot be composed: no sandbox starts")
	HaveFUSE    = fsFeature("fuse", "layers missing from the local store cannot be mounted lazily: pull them first (dsec layer pull)")
	HaveBtrfs   = fsFeature("btrfs", "sandboxes without --disk cannot be bounded by the shared uppers file system")
	// HaveIDMap is mount_setattr(2), which idmapped mounts (a user
	// namespace sandbox's layers) need.
	HaveIDMap = feature.New("idmapped mounts", "a sandbox asking for a user namespace (userns) fails to start", func() error {
		err := unix.MountSetattr(-1, "", 0, &unix.MountAttr{})
		if errors.Is(err, unix.ENOSYS) {
			return fmt.Errorf("mount_setattr: %w", err)
		}
		return nil // EBADF: the call exists
	})
)

// fsFeature is the kernel's support of file system fs.
func fsFeature(fs, without string) *feature.Test {
	return feature.New(fs, without, func() error {
		b, err := os.ReadFile("/proc/filesystems")
		if err != nil {
			return err
		}
		for _, line := range strings.Split(string(b), "\n") {
			if slices.Contains(strings.Fields(line), fs) {
				return nil
			}
		}
		// A module the kernel loads at the first mount is not listed yet.
		if m, _ := filepath.Glob(filepath.Join("/lib/modules", feature.Kernel(), "kernel/fs/*", fs+".ko*")); len(m) > 0 {
			return nil
		}
		return errors.New("neither in /proc/filesystems nor a module of this kernel")
	})
}
