package mount

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"strings"

	"github.com/containerd/errdefs"
	"golang.org/x/sys/unix"
)

var flagWords = map[string]uintptr{
	"ro":      unix.MS_RDONLY,
	"nodev":   unix.MS_NODEV,
	"nosuid":  unix.MS_NOSUID,
	"noexec":  unix.MS_NOEXEC,
	"noatime": unix.MS_NOATIME,
}

// Mount mounts m on target. An EROFS source that is a regular file is
// mounted file-backed by the kernel (Linux >= 6.12): no loop device.
// With the option "loop", the source file is attached to a loop device
// first, which goes away when target is unmounted.
func (m Mount) Mount(target string) error {
	var flags uintptr
	var data []string
	loop := false
	for _, o := range m.Options {
		if f, ok := flagWords[o]; ok {
			flags |= f
		} else if o == "loop" {
			loop = true
		} else {
			data = append(data, o)
		}
	}
	if m.Type == "overlay" || m.Type == "erofs" {
		fds, err := layersByDescriptor(data)
		defer func() {
			for _, fd := range fds {
				unix.Close(fd)
			}
		}()
		if err != nil {
			return fmt.Errorf("mount %s on %s: %w", m, target, err)
		}
		// Each layer takes ~17 bytes as a descriptor's path: some 240
		// fit the page mount(2) takes (overlayfs stacks 500 at most).
		n := len(strings.Join(data, ","))
		if n >= os.Getpagesize() && m.Type == "erofs" {
			return fmt.Errorf("mount %s on %s: %d extra devices are too many for mount(2)'s options: %w", m.Source, target, len(fds), errdefs.ErrOutOfRange)
		}
		if n >= os.Getpagesize() {
			return fmt.Errorf("%d layers are too many to stack (overlay's options would take %d bytes): %w", lowerCount(data), n, errdefs.ErrOutOfRange)
		}
	}
	source := m.Source
	if loop {
		dev, err := attachLoop(m.Source, flags&unix.MS_RDONLY != 0)
		if err != nil {
			return fmt.Errorf("mount %s on %s: %w", m, target, err)
		}
		// The mount holds the device; closing it here lets autoclear
		// detach it at unmount (or now, if the mount fails).
		defer dev.Close()
		source = dev.Name()
	}
	err := unix.Mount(source, target, m.Type, flags, strings.Join(data, ","))
	if err != nil {
		if m.Type == "erofs" && (errors.Is(err, unix.ENOTBLK) || errors.Is(err, unix.ENODEV)) {
			return fmt.Errorf("mount %s on %s: %w (this kernel cannot mount EROFS images from files; Linux 6.12+ with CONFIG_EROFS_FS_BACKED_BY_FILE can)", m, target, err)
		}
		return fmt.Errorf("mount %s on %s: %w", m, target, err)
	}
	return nil
}

// IsNotMounted says whether err, from an unmount, only means there was
// nothing mounted there (EINVAL) or no such path (ENOENT).
func IsNotMounted(err error) bool {
	return errors.Is(err, unix.EINVAL) || errors.Is(err, unix.ENOENT)
}

// Unmount unmounts target, detaching it if it is busy.
func Unmount(target string) error {
	err := unix.Unmount(target, 0)
	if errors.Is(err, unix.EBUSY) {
		err = unix.Unmount(target, unix.MNT_DETACH)
	}
	if err != nil {
		return fmt.Errorf("unmount %s: %w", target, err)
	}
	return nil
}

// IsMountPoint says whether dir is the root of a mount (a path that
// does not exist is none).
func IsMountPoint(dir string) (bool, error) {
	var st unix.Statx_t
	if err := unix.Statx(unix.AT_FDCWD, dir, unix.AT_SYMLINK_NOFOLLOW, 0, &st); err != nil {
		if errors.Is(err, unix.ENOENT) {
			return false, nil
		}
		return false, &fs.PathError{Op: "statx", Path: dir, Err: err}
	}
	if st.Attributes_mask&unix.STATX_ATTR_MOUNT_ROOT == 0 {
		return false, fmt.Errorf("statx %s: this kernel does not say whether it is a mount point: %w", dir, errdefs.ErrNotImplemented)
	}
	return st.Attributes&unix.STATX_ATTR_MOUNT_ROOT != 0, nil
}

// layersByDescriptor hands an overlay its layers, and an EROFS image its
// extra devices, as /proc/self/fd/N of descriptors opened here,
// rewriting data in place: overlayfs shows its layer options as given
// in every mountinfo that lists it, the sandbox's own included, and a
// descriptor's name says nothing of the host's paths (and is short: a
// device's path may not hold the comma that separates options). It
// returns the descriptors to close after the mount.
func layersByDescriptor(data []string) ([]int, error) {
	var fds []int
	open := func(dir string) (string, error) {
		return openFD(&fds, dir, unix.O_PATH|unix.O_DIRECTORY)
	}
	for i, o := range data {
		if v, ok := strings.CutPrefix(o, "device="); ok {
			p, err := openFD(&fds, v, unix.O_RDONLY)
			if err != nil {
				return fds, err
			}
			data[i] = "device=" + p
		}
	}
	for i, o := range data {
		key, v, _ := strings.Cut(o, "=")
		switch key {
		case "lowerdir":
			dirs := splitLowers(v)
			for j, d := range dirs {
				p, err := open(d)
				if err != nil {
					return fds, err
				}
				dirs[j] = p
			}
			data[i] = key + "=" + strings.Join(dirs, ":")
		case "upperdir", "workdir":
			p, err := open(v)
			if err != nil {
				return fds, err
			}
			data[i] = key + "=" + p
		}
	}
	return fds, nil
}

// openFD opens p with flags and appends the descriptor to fds; it
// returns the descriptor's /proc/self/fd path.
func openFD(fds *[]int, p string, flags int) (string, error) {
	fd, err := unix.Open(p, flags|unix.O_CLOEXEC, 0)
	if err != nil {
		return "", &fs.PathError{Op: "open", Path: p, Err: err}
	}
	*fds = append(*fds, fd)
	return fmt.Sprintf("/proc/self/fd/%d", fd), nil
}

// lowerCount is how many layers an overlay's options stack.
func lowerCount(data []string) int {
	for _, o := range data {
		if v, ok := strings.CutPrefix(o, "lowerdir="); ok {
			return len(splitLowers(v))
		}
	}
	return 0
}

// splitLowers undoes escapeLowers.
func splitLowers(v string) []string {
	var out []string
	var cur strings.Builder
	for i := 0; i < len(v); i++ {
		switch c := v[i]; {
		case c == '\\' && i+1 < len(v):
			i++
			cur.WriteByte(v[i])
		case c == ':':
			out = append(out, cur.String())
			cur.Reset()
		default:
			cur.WriteByte(c)
		}
	}
	return append(out, cur.String())
}
