package container

import (
	"fmt"
	"os"
	"path/filepath"

	"golang.org/x/sys/unix"
)

type mnt struct {
	src, target, fstype string
	flags               uintptr
	data                string
}

// leaveHostMounts gives the init a root of its own, an empty tmpfs, and
// drops every mount of the host from its namespace.
func leaveHostMounts(userns bool) error {
	if err := unix.Mount("", "/", "", unix.MS_REC|unix.MS_PRIVATE, ""); err != nil {
		return fmt.Errorf("make mounts private: %w", err)
	}
	// In a user namespace the kernel lets /proc and /sys be mounted only
	// while the host's are visible, and device nodes are not made but
	// bound from the host's: all staged before the pivot.
	var devs map[string]int
	if userns {
		var err error
		if devs, err = cloneDevices(); err != nil {
			return err
		}
	}
	const dir = "/tmp" // any directory: the tmpfs covers it in this namespace only
	if err := unix.Mount("tmpfs", dir, "tmpfs", unix.MS_NOSUID|unix.MS_NODEV|unix.MS_NOEXEC, "mode=700,size=64k"); err != nil {
		return fmt.Errorf("mount the spare root: %w", err)
	}
	if err := StageKernelFS(dir, devs); err != nil {
		return err
	}
	return pivot(dir)
}

// cloneDevices clones the host's device nodes (detached mounts), for a
// namespace whose root may not make them.
func cloneDevices() (map[string]int, error) {
	devs := map[string]int{}
	for _, d := range Devices {
		fd, err := unix.OpenTree(unix.AT_FDCWD, "/dev/"+d.Name, unix.OPEN_TREE_CLONE|unix.OPEN_TREE_CLOEXEC)
		if err != nil {
			return nil, fmt.Errorf("clone the host's /dev/%s: %w", d.Name, err)
		}
		devs[d.Name] = fd
	}
	return devs, nil
}

// pivot makes dir the root and detaches the old one.
func pivot(dir string) error {
	if err := unix.Chdir(dir); err != nil {
		return err
	}
	// pivot_root(".", "."): the old root goes under the new one, and is
	// detached there, without a directory made for it in the new root.
	if err := unix.PivotRoot(".", "."); err != nil {
		return fmt.Errorf("pivot_root: %w", err)
	}
	if err := unix.Unmount(".", unix.MNT_DETACH); err != nil {
		return fmt.Errorf("detach the old root: %w", err)
	}
	return unix.Chdir("/")
}

// StageKernelFS mounts what a sandbox's root gets of the kernel (/proc
// of its pid namespace, with what it must not see masked or read-only, a
// minimal /dev, a read-only /sys) in the spare's own root (dir), ahead of
// the sandbox: a claim only moves them into the sandbox's root. The
// device nodes are made, or bound from devs (cloneDevices) when given.
func StageKernelFS(dir string, devs map[string]int) error {
	const nodev = unix.MS_NOSUID | unix.MS_NODEV | unix.MS_NOEXEC
	for _, m := range []mnt{
		{"proc", "/proc", "proc", nodev, ""},
		{"tmpfs", "/dev", "tmpfs", unix.MS_NOSUID | unix.MS_STRICTATIME, "mode=755,size=65536k"},
		{"devpts", "/dev/pts", "devpts", unix.MS_NOSUID | unix.MS_NOEXEC, "newinstance,ptmxmode=0666,mode=0620"},
		{"shm", "/dev/shm", "tmpfs", nodev, "mode=1777,size=65536k"},
		{"mqueue", "/dev/mqueue", "mqueue", nodev, ""},
		{"sysfs", "/sys", "sysfs", nodev | unix.MS_RDONLY, ""},
	} {
		target := dir + m.target
		if err := os.MkdirAll(target, 0o755); err != nil {
			return err
		}
		if err := unix.Mount(m.src, target, m.fstype, m.flags, m.data); err != nil {
			return fmt.Errorf("mount %s: %w", m.target, err)
		}
	}
	for _, d := range Devices {
		p := filepath.Join(dir, "dev", d.Name)
		if fd, ok := devs[d.Name]; ok {
			if err := os.WriteFile(p, nil, 0o666); err != nil {
				return err
			}
			if err := unix.MoveMount(fd, "", unix.AT_FDCWD, p, unix.MOVE_MOUNT_F_EMPTY_PATH); err != nil {
				return fmt.Errorf("bind /dev/%s: %w", d.Name, err)
			}
			unix.Close(fd)
			continue
		}
		if err := unix.Mknod(p, unix.S_IFCHR|0o666, int(unix.Mkdev(d.Major, d.Minor))); err != nil {
			return fmt.Errorf("mknod /dev/%s: %w", d.Name, err)
		}
		os.Chmod(p, 0o666)
		// Each node is a mount of its own, so /dev itself can be nodev.
		if err := unix.Mount(p, p, "", unix.MS_BIND, ""); err != nil {
			return fmt.Errorf("bind /dev/%s: %w", d.Name, err)
		}
	}
	// A node a sandbox makes in /dev never opens (nor anywhere else it
	// can write: every writable mount of a sandbox is nodev).
	if err := unix.Mount("", dir+"/dev", "", unix.MS_REMOUNT|unix.MS_BIND|unix.MS_NOSUID|unix.MS_NODEV|unix.MS_STRICTATIME, ""); err != nil {
		return fmt.Errorf("make /dev nodev: %w", err)
	}
	for link, target := range map[string]string{"ptmx": "pts/ptmx", "fd": "/proc/self/fd", "stdin": "/proc/self/fd/0",
		"stdout": "/proc/self/fd/1", "stderr": "/proc/self/fd/2"} {
		if err := os.Symlink(target, filepath.Join(dir, "dev", link)); err != nil {
			return err
		}
	}
	return maskProc(dir)
}

// setupRoot attaches the sandbox's root (tree, a detached mount), moves
// the staged /proc, /dev and /sys into it and pivots into it.
func setupRoot(tree int) error {
	const root = "/root"
	if err := os.Mkdir(root, 0o755); err != nil {
		return err
	}
	if err := unix.MoveMount(tree, "", unix.AT_FDCWD, root, unix.MOVE_MOUNT_F_EMPTY_PATH); err != nil {
		return fmt.Errorf("attach the sandbox root: %w", err)
	}
	unix.Close(tree)
	// A clone of a shared mount is its peer (the worker's root shared, as
	// a Kubernetes hostPath with Bidirectional propagation is), and
	// pivot_root refuses a shared root (EINVAL): this one is private, and
	// nothing the sandbox mounts reaches the host.
	if err := unix.Mount("", root, "", unix.MS_REC|unix.MS_PRIVATE, ""); err != nil {
		return fmt.Errorf("make the sandbox root private: %w", err)
	}
	for _, d := range []string{"/proc", "/dev", "/sys"} {
		target := root + d
		if err := os.MkdirAll(target, 0o755); err != nil {
			return err
		}
		if err := unix.Mount(d, target, "", unix.MS_MOVE, ""); err != nil {
			return fmt.Errorf("move %s into the root: %w", d, err)
		}
	}
	return pivot(root)
}

// maskProc hides kernel interfaces a sandbox has no business reading and
// makes the ones that change the host read-only, as runc's defaults do.
func maskProc(dir string) error {
	for _, p := range []string{"/proc/kcore", "/proc/keys", "/proc/timer_list", "/proc/sched_debug", "/proc/sysrq-trigger",
		"/proc/latency_stats", "/proc/kallsyms", "/proc/kpagecount", "/proc/kpageflags", "/proc/kpagecgroup"} {
		p = dir + p
		if _, err := os.Stat(p); err != nil {
			continue
		}
		if err := unix.Mount(dir+"/dev/null", p, "", unix.MS_BIND, ""); err != nil {
			return fmt.Errorf("mask %s: %w", p, err)
		}
	}
	for _, p := range []string{"/proc/acpi", "/proc/scsi", "/sys/firmware"} {
		p = dir + p
		if _, err := os.Stat(p); err != nil {
			continue
		}
		if err := unix.Mount("tmpfs", p, "tmpfs", unix.MS_RDONLY, "size=0"); err != nil {
			return fmt.Errorf("mask %s: %w", p, err)
		}
	}
	for _, p := range []string{"/proc/sys", "/proc/irq", "/proc/bus", "/proc/fs"} {
		p = dir + p
		if _, err := os.Stat(p); err != nil {
			continue
		}
		if err := unix.Mount(p, p, "", unix.MS_BIND|unix.MS_REC, ""); err != nil {
			return fmt.Errorf("bind %s: %w", p, err)
		}
		if err := unix.Mount(p, p, "", unix.MS_BIND|unix.MS_REMOUNT|unix.MS_RDONLY|unix.MS_REC, ""); err != nil {
			return fmt.Errorf("make %s read-only: %w", p, err)
		}
	}
	return nil
}
