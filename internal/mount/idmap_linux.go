package mount

import (
	"errors"
	"fmt"
	"path/filepath"
	"runtime"
	"slices"
	"strings"

	"golang.org/x/sys/unix"
)

// IDMapped clones the mount at path (that mount alone, from path down,
// detached) with its ids mapped into the user namespace userns (an open
// /proc/PID/ns/user): a file stored as uid k shows, through the clone,
// as the namespace's k, and what the namespace's k creates is stored as
// k. The caller closes the returned descriptor, which is the clone.
func IDMapped(path string, userns int) (int, error) {
	tree, err := unix.OpenTree(unix.AT_FDCWD, path, unix.OPEN_TREE_CLONE|unix.OPEN_TREE_CLOEXEC)
	if err != nil {
		return -1, fmt.Errorf("clone the mount at %s: %w", path, err)
	}
	err = unix.MountSetattr(tree, "", unix.AT_EMPTY_PATH, &unix.MountAttr{Attr_set: unix.MOUNT_ATTR_IDMAP, Userns_fd: uint64(userns)})
	if err != nil {
		unix.Close(tree)
		if errors.Is(err, unix.EINVAL) {
			return -1, fmt.Errorf("idmap the mount at %s: %w: its file system cannot be idmapped on this kernel (user namespaces need --root and layers on ext4, xfs, btrfs, tmpfs or EROFS)", path, err)
		}
		return -1, fmt.Errorf("idmap the mount at %s: %w", path, err)
	}
	return tree, nil
}

// Attach attaches a detached mount (IDMapped's) at target.
func Attach(tree int, target string) error {
	if err := unix.MoveMount(tree, "", unix.AT_FDCWD, target, unix.MOVE_MOUNT_F_EMPTY_PATH); err != nil {
		return fmt.Errorf("attach a mount at %s: %w", target, err)
	}
	return nil
}

// MountIDMapped mounts m, an overlay (Overlay's, nodev or not), on
// target with every layer and its upper idmapped into userns, whose root
// is the host's id root: the namespace's root owns what the host's root
// owns in the layers, and what it writes is stored as the host's root
// would have it. Its upper and work directory must share a parent. The
// layers are handed to overlayfs as descriptors of detached idmapped
// clones (Linux >= 6.13); nothing is attached on the host but the
// overlay itself, nodev: a device node made in the sandbox never opens.
func (m Mount) MountIDMapped(target string, userns int, root uint32) (err error) {
	var lowers []string
	var upper, work string
	for _, o := range m.Options {
		k, v, _ := strings.Cut(o, "=")
		switch {
		case k == "lowerdir":
			lowers = splitLowers(v)
		case k == "upperdir":
			upper = v
		case k == "workdir":
			work = v
		case o != "nodev" && !slices.Contains(overlayFlags, o):
			return fmt.Errorf("idmap %s: option %s cannot be idmapped", m, o)
		}
	}
	if m.Type != "overlay" || len(lowers) == 0 || upper == "" || filepath.Dir(upper) != filepath.Dir(work) {
		return fmt.Errorf("idmap %s: only an overlay whose upper and work directory share a parent can be idmapped", m)
	}
	var fds []int
	defer func() {
		for _, fd := range fds {
			unix.Close(fd)
		}
	}()
	fs, err := unix.Fsopen("overlay", unix.FSOPEN_CLOEXEC)
	if err != nil {
		return fmt.Errorf("overlay: %w", err)
	}
	fds = append(fds, fs)
	set := func(key string, fd int) error {
		if err := unix.FsconfigSetFd(fs, key, fd); err != nil {
			return fmt.Errorf("overlay %s: %w (layers given as descriptors need Linux 6.13+)", key, err)
		}
		return nil
	}
	for _, l := range lowers {
		tree, err := IDMapped(l, userns)
		if err != nil {
			return err
		}
		fds = append(fds, tree)
		if err := set("lowerdir+", tree); err != nil {
			return err
		}
	}
	rw, err := IDMapped(filepath.Dir(upper), userns)
	if err != nil {
		return err
	}
	fds = append(fds, rw)
	for _, kd := range [][2]string{{"upperdir", upper}, {"workdir", work}} {
		key, d := kd[0], kd[1]
		fd, err := unix.Openat(rw, filepath.Base(d), unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
		if err != nil {
			return fmt.Errorf("overlay %s: %w", d, err)
		}
		fds = append(fds, fd)
		if err := set(key, fd); err != nil {
			return err
		}
	}
	for _, o := range overlayFlags {
		k, v, _ := strings.Cut(o, "=")
		if err := unix.FsconfigSetString(fs, k, v); err != nil {
			return fmt.Errorf("overlay %s: %w", o, err)
		}
	}
	// overlayfs works in its upper with its creator's credentials, which
	// the idmapped upper must map: the namespace root's ids, with the
	// host root's capabilities (a copy-up reads files of any owner).
	if err := asCreator(root, func() error { return unix.FsconfigCreate(fs) }); err != nil {
		return fmt.Errorf("overlay on %s: %w", target, err)
	}
	mnt, err := unix.Fsmount(fs, unix.FSMOUNT_CLOEXEC, unix.MOUNT_ATTR_NODEV)
	if err != nil {
		return fmt.Errorf("overlay on %s: %w", target, err)
	}
	fds = append(fds, mnt)
	return Attach(mnt, target)
}

// asCreator runs fn on a thread whose file system ids are id, its
// capabilities kept: setfsuid drops the file capabilities from the
// effective set, and capset raises them again from the permitted one.
func asCreator(id uint32, fn func() error) error {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	if err := unix.Setfsgid(int(id)); err != nil {
		return err
	}
	defer unix.Setfsgid(0)
	if err := unix.Setfsuid(int(id)); err != nil {
		return err
	}
	defer unix.Setfsuid(0)
	hdr := unix.CapUserHeader{Version: unix.LINUX_CAPABILITY_VERSION_3}
	var caps [2]unix.CapUserData
	if err := unix.Capget(&hdr, &caps[0]); err != nil {
		return err
	}
	for i := range caps {
		caps[i].Effective = caps[i].Permitted
	}
	if err := unix.Capset(&hdr, &caps[0]); err != nil {
		return err
	}
	return fn()
}
