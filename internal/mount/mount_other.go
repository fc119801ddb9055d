//go:build !linux

package mount

import (
	"fmt"

	"github.com/containerd/errdefs"
)

// Mount is not supported off Linux.
func (m Mount) Mount(target string) error {
	return fmt.Errorf("mount %s: %w", m, errdefs.ErrNotImplemented)
}

// Unmount is not supported off Linux.
func Unmount(target string) error {
	return fmt.Errorf("unmount %s: %w", target, errdefs.ErrNotImplemented)
}

// IsNotMounted says whether err only means nothing was mounted.
func IsNotMounted(err error) bool { return false }

// IsMountPoint is not supported off Linux.
func IsMountPoint(dir string) (bool, error) {
	return false, fmt.Errorf("mount point %s: %w", dir, errdefs.ErrNotImplemented)
}
