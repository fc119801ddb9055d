package container

import (
	"errors"
	"fmt"
	"path"
	"runtime"
	"slices"
	"strings"

	"golang.org/x/sys/unix"
)

// Protect makes paths of the sandbox's root read-only (and nosuid,
// nodev) and hides others, with mounts in the sandbox's mount namespace:
// every process sees them at once, and no process of the sandbox can
// undo them (it has no CAP_SYS_ADMIN, and the syscall profile denies the
// mount API). A read-only path's ancestors are made mount points too, so
// renaming one of them cannot swap another tree in under the path. A
// hidden directory shows an empty read-only directory, a hidden file is
// a nodev /dev/null that cannot be opened. Paths are resolved in the sandbox's root without following
// symbolic links (one is an error); a path that does not exist is
// returned in missing, and nothing is mounted for it.
func (s *Conn) Protect(readOnly, hidden []string) (missing []string, err error) {
	if len(readOnly) == 0 && len(hidden) == 0 {
		return nil, nil
	}
	type result struct {
		missing []string
		err     error
	}
	var r result
	OnSpentThread(func() { // it enters the sandbox's mount namespace
		r.missing, r.err = ProtectPaths(s.Pid(), readOnly, hidden)
	})
	return r.missing, r.err
}

// OnSpentThread runs fn on an OS thread that ends with it, for work that
// changes its thread for good (a sandbox's namespace). Go ends the
// thread of a goroutine that exits locked to it, but parks the main
// thread instead, for good and as it is: the namespace fn left it in
// would live as long as the process, and every mount in it (a
// sandbox's overlay, its disk's loop device with it). So on the main
// thread fn runs on another one.
func OnSpentThread(fn func()) {
	done := make(chan struct{})
	go func() {
		runtime.LockOSThread()
		spend(fn, done)
	}()
	<-done
}

// spend runs fn on the thread the caller is locked to, which then ends
// with the caller's goroutine; on the main thread, on one of its own.
func spend(fn func(), done chan<- struct{}) {
	defer close(done)
	if unix.Gettid() == unix.Getpid() {
		OnSpentThread(fn) // this thread is locked here: another runs it
		runtime.UnlockOSThread()
		return
	}
	fn()
}

func ProtectPaths(pid int, readOnly, hidden []string) (missing []string, err error) {
	ns, err := unix.Open(fmt.Sprintf("/proc/%d/ns/mnt", pid), unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("the sandbox's mount namespace: %w", err)
	}
	defer unix.Close(ns)
	// A hidden file gets the host's /dev/null, cloned before this
	// thread leaves the host's namespace (the sandbox's /dev is its own).
	var nulls []int
	defer func() {
		for _, fd := range nulls {
			unix.Close(fd)
		}
	}()
	for range hidden {
		fd, err := unix.OpenTree(unix.AT_FDCWD, "/dev/null", unix.OPEN_TREE_CLONE|unix.OPEN_TREE_CLOEXEC)
		if err != nil {
			return nil, fmt.Errorf("clone /dev/null: %w", err)
		}
		nulls = append(nulls, fd)
	}
	if err := unix.Unshare(unix.CLONE_FS); err != nil {
		return nil, err
	}
	if err := unix.Setns(ns, unix.CLONE_NEWNS); err != nil {
		return nil, fmt.Errorf("enter the sandbox's mount namespace: %w", err)
	}
	root, err := unix.Open("/", unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, err
	}
	defer unix.Close(root)
	// Ancestors first, shallowest first, so each path below resolves
	// through the mounts made above it.
	for _, d := range ancestorsOf(readOnly) {
		fd, st, err := resolveIn(root, d)
		if err != nil {
			return nil, err
		}
		if fd < 0 {
			continue
		}
		if st.Attributes_mask&unix.STATX_ATTR_MOUNT_ROOT == 0 || st.Attributes&unix.STATX_ATTR_MOUNT_ROOT == 0 {
			err = bindOver(d, fd, 0)
		}
		unix.Close(fd)
		if err != nil {
			return nil, err
		}
	}
	const locked = unix.MOUNT_ATTR_RDONLY | unix.MOUNT_ATTR_NOSUID | unix.MOUNT_ATTR_NODEV
	for _, p := range readOnly {
		fd, _, err := resolveIn(root, p)
		if err != nil {
			return nil, err
		}
		if fd < 0 {
			missing = append(missing, p)
			continue
		}
		err = bindOver(p, fd, locked)
		unix.Close(fd)
		if err != nil {
			return nil, err
		}
	}
	for i, p := range hidden {
		fd, st, err := resolveIn(root, p)
		if err != nil {
			return nil, err
		}
		if fd < 0 {
			missing = append(missing, p)
			continue
		}
		if st.Mode&unix.S_IFMT == unix.S_IFDIR {
			err = hideDir(p, fd)
		} else {
			err = attach(p, nulls[i], fd, locked|unix.MOUNT_ATTR_NOEXEC)
		}
		unix.Close(fd)
		if err != nil {
			return nil, err
		}
	}
	return missing, nil
}

// resolveIn opens p (an O_PATH descriptor, and its type) in the root
// dir root, following no symbolic link: -1 if it does not exist.
func resolveIn(root int, p string) (int, *unix.Statx_t, error) {
	fd, err := unix.Openat2(root, "."+p, &unix.OpenHow{Flags: unix.O_PATH | unix.O_NOFOLLOW | unix.O_CLOEXEC,
		Resolve: unix.RESOLVE_IN_ROOT | unix.RESOLVE_NO_SYMLINKS | unix.RESOLVE_NO_MAGICLINKS})
	switch {
	case errors.Is(err, unix.ENOENT) || errors.Is(err, unix.ENOTDIR):
		return -1, nil, nil
	case errors.Is(err, unix.ELOOP):
		return -1, nil, fmt.Errorf("%s passes a symbolic link in the sandbox: name the path it points to", p)
	case err != nil:
		return -1, nil, fmt.Errorf("%s: %w", p, err)
	}
	var st unix.Statx_t
	if err := unix.Statx(fd, "", unix.AT_EMPTY_PATH, unix.STATX_TYPE, &st); err != nil {
		unix.Close(fd)
		return -1, nil, fmt.Errorf("%s: %w", p, err)
	}
	if st.Mode&unix.S_IFMT == unix.S_IFLNK {
		unix.Close(fd)
		return -1, nil, fmt.Errorf("%s is a symbolic link in the sandbox: name the path it points to", p)
	}
	return fd, &st, nil
}

// attach mounts the detached tree m over the object fd, p, with the
// mount attributes attr.
func attach(p string, m, fd int, attr uint64) error {
	if attr != 0 {
		if err := unix.MountSetattr(m, "", unix.AT_EMPTY_PATH|unix.AT_RECURSIVE, &unix.MountAttr{Attr_set: attr}); err != nil {
			return fmt.Errorf("%s: set mount attributes: %w", p, err)
		}
	}
	if err := unix.MoveMount(m, "", fd, "", unix.MOVE_MOUNT_F_EMPTY_PATH|unix.MOVE_MOUNT_T_EMPTY_PATH); err != nil {
		return fmt.Errorf("%s: mount: %w", p, err)
	}
	return nil
}

// bindOver mounts a clone of the tree at fd, p, over it, with the mount
// attributes attr.
func bindOver(p string, fd int, attr uint64) error {
	m, err := unix.OpenTree(fd, "", unix.OPEN_TREE_CLONE|unix.OPEN_TREE_CLOEXEC|unix.AT_EMPTY_PATH|unix.AT_RECURSIVE)
	if err != nil {
		return fmt.Errorf("%s: clone: %w", p, err)
	}
	defer unix.Close(m)
	return attach(p, m, fd, attr)
}

// ancestorsOf are the directories above the paths readOnly, each once,
// shallowest first.
func ancestorsOf(readOnly []string) []string {
	var ancestors []string
	for _, p := range readOnly {
		for d := path.Dir(p); d != "/" && d != "."; d = path.Dir(d) {
			if !slices.Contains(ancestors, d) {
				ancestors = append(ancestors, d)
			}
		}
	}
	slices.SortFunc(ancestors, func(a, b string) int { return strings.Count(a, "/") - strings.Count(b, "/") })
	return ancestors
}

// hideDir mounts an empty read-only tmpfs over the directory fd.
func hideDir(p string, fd int) error {
	fs, err := unix.Fsopen("tmpfs", unix.FSOPEN_CLOEXEC)
	if err != nil {
		return fmt.Errorf("%s: %w", p, err)
	}
	defer unix.Close(fs)
	for k, v := range map[string]string{"mode": "0555", "size": "4k", "nr_inodes": "1"} {
		if err := unix.FsconfigSetString(fs, k, v); err != nil {
			return fmt.Errorf("%s: tmpfs %s: %w", p, k, err)
		}
	}
	if err := unix.FsconfigCreate(fs); err != nil {
		return fmt.Errorf("%s: tmpfs: %w", p, err)
	}
	const hidden = unix.MOUNT_ATTR_RDONLY | unix.MOUNT_ATTR_NOSUID | unix.MOUNT_ATTR_NODEV | unix.MOUNT_ATTR_NOEXEC
	m, err := unix.Fsmount(fs, unix.FSMOUNT_CLOEXEC, hidden)
	if err != nil {
		return fmt.Errorf("%s: tmpfs: %w", p, err)
	}
	defer unix.Close(m)
	return attach(p, m, fd, 0)
}

// SetHostname names the sandbox's host from outside: the sandbox's
// processes have no CAP_SYS_ADMIN to do it, and the name of a sandbox
// made ahead of need is known only when it is taken.
func (s *Conn) SetHostname(name string) error {
	c := make(chan error, 1)
	go func() {
		runtime.LockOSThread()
		if unix.Gettid() == unix.Getpid() {
			// Go parks, rather than ends, a main thread left locked: one
			// that could not come back would stay in the sandbox's
			// namespace for good. Another thread does it.
			c <- s.SetHostname(name)
			runtime.UnlockOSThread()
			return
		}
		back, err := setHostname(s.Pid(), name)
		if back { // the thread is the host's again: it may serve others
			runtime.UnlockOSThread()
		}
		c <- err
	}()
	return <-c
}

// setHostname enters pid's UTS namespace, names it, and comes back;
// back reports whether the thread is in the host's namespace again.
func setHostname(pid int, name string) (back bool, err error) {
	host, err := unix.Open("/proc/thread-self/ns/uts", unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return true, fmt.Errorf("the host's UTS namespace: %w", err)
	}
	defer unix.Close(host)
	ns, err := unix.Open(fmt.Sprintf("/proc/%d/ns/uts", pid), unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return true, fmt.Errorf("the sandbox's UTS namespace: %w", err)
	}
	defer unix.Close(ns)
	if err := unix.Setns(ns, unix.CLONE_NEWUTS); err != nil {
		return true, fmt.Errorf("enter the sandbox's UTS namespace: %w", err)
	}
	err = unix.Sethostname([]byte(name))
	if err != nil {
		err = fmt.Errorf("sethostname: %w", err)
	}
	return unix.Setns(host, unix.CLONE_NEWUTS) == nil, err
}
