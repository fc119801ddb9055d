package mount

import (
	"errors"
	"fmt"
	"os"

	"golang.org/x/sys/unix"
)

// attachLoop attaches file to a free loop device set to detach itself
// when its last user goes away, and returns the device open.
func attachLoop(file string, readOnly bool) (*os.File, error) {
	mode := os.O_RDWR
	var flags uint32 = unix.LO_FLAGS_AUTOCLEAR
	if readOnly {
		mode, flags = os.O_RDONLY, flags|unix.LO_FLAGS_READ_ONLY
	}
	backing, err := os.OpenFile(file, mode|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, err
	}
	defer backing.Close()
	ctl, err := os.OpenFile("/dev/loop-control", os.O_RDWR|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("loop devices: %w", err)
	}
	defer ctl.Close()
	// Another process may take the free device between asking and
	// configuring it: ask again.
	for range 100 {
		n, err := unix.IoctlRetInt(int(ctl.Fd()), unix.LOOP_CTL_GET_FREE)
		if err != nil {
			return nil, fmt.Errorf("no free loop device: %w", err)
		}
		dev, err := os.OpenFile(fmt.Sprintf("/dev/loop%d", n), mode|unix.O_CLOEXEC, 0)
		if errors.Is(err, os.ErrNotExist) { // no udev: make the node
			if err = unix.Mknod(fmt.Sprintf("/dev/loop%d", n), unix.S_IFBLK|0o660, int(unix.Mkdev(7, uint32(n)))); err == nil || errors.Is(err, os.ErrExist) {
				dev, err = os.OpenFile(fmt.Sprintf("/dev/loop%d", n), mode|unix.O_CLOEXEC, 0)
			}
		}
		if err != nil {
			return nil, err
		}
		cfg := unix.LoopConfig{Fd: uint32(backing.Fd())}
		cfg.Info.Flags = flags
		err = unix.IoctlLoopConfigure(int(dev.Fd()), &cfg)
		if err == nil {
			return dev, nil
		}
		dev.Close()
		if !errors.Is(err, unix.EBUSY) {
			return nil, fmt.Errorf("attach %s to a loop device: %w", file, err)
		}
	}
	return nil, fmt.Errorf("attach %s to a loop device: every free one was taken first", file)
}
