// Package disk holds what sandboxes write: a disk image of its own for
// a sandbox with a quota (an ext4 file system on a loop device), and the
// one btrfs file system, a subvolume per sandbox under a simple quota,
// for the others (the uppers).
package disk

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"

	"github.com/containerd/errdefs"
	"golang.org/x/sys/unix"

	"github.com/dsec-project/dsec/api"
	"github.com/dsec-project/dsec/internal/mount"
)

// A sandbox with a disk quota keeps its upper and overlay work directory
// on a file system of exactly that size: an ext4 image (sparse: it takes
// host disk as it is written) loop-mounted at <dir>/disk. Project quotas
// would be cheaper but this kernel has neither XFS quota nor ext4's
// quota format; an image works on every kernel and also bounds inodes.

// ext4ResizeFS is EXT4_IOC_RESIZE_FS: grow a mounted ext4 to N blocks.
const ext4ResizeFS = 0x40086610

func Image(dir string) string { return filepath.Join(dir, "disk.img") }
func Dir(dir string) string   { return filepath.Join(dir, "disk") }

// Make makes the sandbox's disk image of size bytes. The file is
// sparse, so it is known to read zeros: mke2fs need not write the inode
// tables, and the kernel does not zero them later. No journal: it would
// take 4 MiB of a 16 MiB quota and a kernel thread per sandbox, and the
// upper is checked (e2fsck) before it is mounted again after a crash. No
// reserved descriptor blocks for growth (resize_inode): 4 MiB of a 10 GiB
// image; resize2fs grows it without. The first image of a size is made by
// mkfs.ext4; the rest are copies of the few hundred KiB it wrote (the
// same file system, UUID included: nothing here needs them to differ).
func Make(dir string, size int64) error {
	if err := api.CheckDisk(size); err != nil {
		return err
	}
	img := Image(dir)
	if t, ok := diskTemplates.Load(size); ok {
		return writeSparse(img, size, t.([]extent))
	}
	f, err := os.OpenFile(img, os.O_CREATE|os.O_EXCL|os.O_WRONLY, 0o600)
	if err != nil {
		return err
	}
	err = f.Truncate(size)
	f.Close()
	if err != nil {
		return fmt.Errorf("disk quota: %w", err)
	}
	out, err := exec.Command("mkfs.ext4", "-q", "-F", "-m", "0", "-b", "4096", "-O", "^has_journal,^resize_inode",
		"-E", "assume_storage_prezeroed=1,root_owner=0:0", img).CombinedOutput()
	if errors.Is(err, exec.ErrNotFound) {
		return fmt.Errorf("disk quota: mkfs.ext4 is missing: install e2fsprogs (make deps): %w", errdefs.ErrFailedPrecondition)
	}
	if err != nil {
		return fmt.Errorf("disk quota: mkfs.ext4: %v: %s", err, strings.TrimSpace(string(out)))
	}
	if n := templateCount.Add(1); n <= maxTemplates {
		if t, err := readSparse(img); err == nil {
			diskTemplates.Store(size, t)
		}
	}
	return nil
}

// Fresh images by size, as the data extents mkfs.ext4 wrote; a few
// sizes only (a fleet uses a handful).
var (
	diskTemplates sync.Map // int64 -> []extent
	templateCount atomic.Int32
)

const (
	maxTemplates     = 16
	maxTemplateBytes = 16 << 20
)

type extent struct {
	off  int64
	data []byte
}

// readSparse reads the data extents of a sparse file.
func readSparse(path string) ([]extent, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	var out []extent
	total := 0
	for off := int64(0); ; {
		data, err := unix.Seek(int(f.Fd()), off, unix.SEEK_DATA)
		if errors.Is(err, unix.ENXIO) { // no data past off
			return out, nil
		}
		if err != nil {
			return nil, err
		}
		hole, err := unix.Seek(int(f.Fd()), data, unix.SEEK_HOLE)
		if err != nil {
			return nil, err
		}
		if total += int(hole - data); total > maxTemplateBytes {
			return nil, fmt.Errorf("%s has over %d bytes of data", path, maxTemplateBytes)
		}
		b := make([]byte, hole-data)
		if _, err := f.ReadAt(b, data); err != nil {
			return nil, err
		}
		out = append(out, extent{data, b})
		off = hole
	}
}

// writeSparse makes path, size bytes of zeros but for the extents, and
// takes host disk for the extents only.
func writeSparse(path string, size int64, ext []extent) error {
	f, err := os.OpenFile(path, os.O_CREATE|os.O_EXCL|os.O_WRONLY, 0o600)
	if err != nil {
		return err
	}
	defer f.Close()
	if err := f.Truncate(size); err != nil {
		return fmt.Errorf("disk quota: %w", err)
	}
	for _, e := range ext {
		if _, err := f.WriteAt(e.data, e.off); err != nil {
			return fmt.Errorf("disk quota: %w", err)
		}
	}
	return f.Close()
}

// Mount mounts the sandbox's disk image, unless it is mounted
// already (a stopped sandbox keeps it, so its files stay readable), and
// makes the upper and work directories on it. An image that is not
// fresh is checked first: a host that went down with it mounted left
// it unclean.
func Mount(dir string, fresh bool) error {
	d := Dir(dir)
	if err := os.MkdirAll(d, 0o700); err != nil {
		return err
	}
	if mounted, err := mount.IsMountPoint(d); err != nil || !mounted {
		if err != nil {
			return err
		}
		if !fresh {
			if err := waitImageFree(Image(dir)); err != nil {
				return fmt.Errorf("disk quota: %w", err)
			}
			if err := e2fsck(dir); err != nil {
				return err
			}
		}
		m := mount.Mount{Type: "ext4", Source: Image(dir), Options: []string{"loop", "nodev", "nosuid", "noatime"}}
		if err := m.Mount(d); err != nil {
			return fmt.Errorf("disk quota: %w", err)
		}
	}
	for _, s := range []string{"upper", "work"} {
		if err := os.Mkdir(filepath.Join(d, s), 0o755); err != nil && !errors.Is(err, os.ErrExist) {
			return err
		}
	}
	return nil
}

// Unmount unmounts the disk image, if the sandbox has one mounted.
func Unmount(dir string) error { return unmountLoop(Dir(dir)) }

// UnmountImage unmounts the loop-mounted image at d (if one is) and
// waits for its loop device to detach.
func UnmountImage(d string) error { return unmountLoop(d) }

// unmountLoop unmounts the loop-mounted image at d, if one is, and
// waits for its loop device to detach: the kernel clears an autoclear
// loop device from a work queue after its last close, so without the
// wait a removed image could still be attached. Under load (CI's
// race-detector run on 2 cores) that took over 5 s once, with no mount
// of the device left in any task's namespace.
func unmountLoop(d string) error {
	if mounted, err := mount.IsMountPoint(d); err != nil || !mounted {
		return nil
	}
	src, dev, err := mountDevice(d)
	if err != nil {
		return err
	}
	attached := fmt.Sprintf("/sys/dev/block/%d:%d/loop/backing_file", unix.Major(dev), unix.Minor(dev))
	held, _ := os.ReadFile(attached)
	if err := mount.Unmount(d); err != nil {
		return err
	}
	if unix.Major(dev) != loopMajor || len(held) == 0 {
		return nil
	}
	for deadline := time.Now().Add(30 * time.Second); time.Now().Before(deadline); time.Sleep(time.Millisecond) {
		if b, err := os.ReadFile(attached); err != nil || !bytes.Equal(b, held) {
			return nil
		}
	}
	return fmt.Errorf("loop device %d:%d still holds %s 30 s after the unmount (mounted in the namespaces of: %s)",
		unix.Major(dev), unix.Minor(dev), strings.TrimSpace(string(held)), strings.Join(mountHolders(src), ", "))
}

// waitImageFree waits until no loop device holds the image file img,
// and fails after 30 s. A file system unmounted here can live on for a
// while (an overlay's private mount of its upper is released from a
// work queue, an init may not have left a copy of the host's mounts
// yet), and its loop device with it; checking, resizing or mounting the
// image again meanwhile would write under a live superblock, which
// then writes its own state back over what was done.
func waitImageFree(img string) error { return waitImageFreeFor(img, 30*time.Second) }

func waitImageFreeFor(img string, timeout time.Duration) error {
	var st unix.Stat_t
	if err := unix.Stat(img, &st); err != nil {
		return err
	}
	for deadline := time.Now().Add(timeout); ; time.Sleep(time.Millisecond) {
		dev := loopOf(st.Dev, st.Ino)
		if dev == "" {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("%s is still held by %s %v after its file system was unmounted (mounted in the namespaces of: %s): it is not touched while it is: %w",
				img, dev, timeout, strings.Join(mountHolders(dev), ", "), errdefs.ErrUnavailable)
		}
	}
}

// loopOf names the loop device attached to the file (dev, ino), if one is.
func loopOf(dev, ino uint64) string {
	held, _ := filepath.Glob("/sys/block/loop*/loop/backing_file")
	for _, b := range held {
		name := "/dev/" + filepath.Base(filepath.Dir(filepath.Dir(b)))
		fd, err := unix.Open(name, unix.O_RDONLY|unix.O_CLOEXEC, 0)
		if err != nil {
			continue
		}
		info, err := unix.IoctlLoopGetStatus64(fd)
		unix.Close(fd)
		if err == nil && info.Device == dev && info.Inode == ino {
			return name
		}
	}
	return ""
}

// mountDevice is the device mounted at d, as mountinfo names it, and
// its number: a btrfs's files are on an anonymous device, not its own.
// This thread's mounts: the main thread's (/proc/self) may have joined
// a sandbox's namespace (files_linux.go) and stayed there.
func mountDevice(d string) (string, uint64, error) {
	b, err := os.ReadFile("/proc/thread-self/mountinfo")
	if err != nil {
		return "", 0, err
	}
	src := ""
	for _, line := range strings.Split(string(b), "\n") {
		f := strings.Fields(line)
		if len(f) < 5 || f[4] != d {
			continue
		}
		if i := slices.Index(f, "-"); i > 0 && i+2 < len(f) {
			src = f[i+2] // the last mount there is the one seen
		}
	}
	var st unix.Stat_t
	if src == "" || unix.Stat(src, &st) != nil || st.Mode&unix.S_IFMT != unix.S_IFBLK {
		return src, 0, nil
	}
	return src, st.Rdev, nil
}

// mountHolders names the processes whose mount namespaces still have
// the device src (/dev/loopN) mounted, "none" if no process does (then
// an open file or a working directory on it keeps it).
func mountHolders(src string) []string {
	id := " " + src + " "
	var out []string
	pids, _ := filepath.Glob("/proc/[0-9]*")
	for _, p := range pids {
		b, err := os.ReadFile(p + "/mountinfo")
		if err != nil || !bytes.Contains(b, []byte(id)) {
			continue
		}
		comm, _ := os.ReadFile(p + "/comm")
		out = append(out, fmt.Sprintf("%s (%s)", filepath.Base(p), strings.TrimSpace(string(comm))))
	}
	if len(out) == 0 {
		return []string{"none"}
	}
	return out
}

// loopMajor is the block major number of loop devices.
const loopMajor = 7

// Grow grows the disk image to size bytes. Online (the sandbox
// runs on it): the file, the loop device's capacity, then the mounted
// file system, which takes CAP_SYS_RESOURCE. Offline (a stopped
// sandbox): unmounted, checked and grown by resize2fs, mounted again.
func Grow(dir string, size int64, online bool) error {
	if !online {
		if err := Unmount(dir); err != nil {
			return fmt.Errorf("disk quota: unmount to grow: %w", err)
		}
		if err := waitImageFree(Image(dir)); err != nil {
			return fmt.Errorf("disk quota: %w", err)
		}
		if err := os.Truncate(Image(dir), size); err != nil {
			return err
		}
		if err := e2fsck(dir, "-f"); err != nil {
			return err
		}
		if out, err := exec.Command("resize2fs", Image(dir)).CombinedOutput(); err != nil {
			return fmt.Errorf("disk quota: resize2fs: %v: %s", err, strings.TrimSpace(string(out)))
		}
		return Mount(dir, true)
	}
	if !HasCapSysResource() {
		return errNoResize
	}
	if err := Mount(dir, false); err != nil { // a dead sandbox's, after a host restart
		return err
	}
	d := Dir(dir)
	var st unix.Stat_t
	if err := unix.Stat(d, &st); err != nil {
		return err
	}
	uevent, err := os.ReadFile(fmt.Sprintf("/sys/dev/block/%d:%d/uevent", unix.Major(st.Dev), unix.Minor(st.Dev)))
	if err != nil {
		return fmt.Errorf("disk quota: the loop device: %w", err)
	}
	_, name, _ := strings.Cut(string(uevent), "DEVNAME=")
	name, _, _ = strings.Cut(name, "\n")
	if !strings.HasPrefix(name, "loop") {
		return fmt.Errorf("disk quota: %s is on %q, not a loop device: %w", d, name, errdefs.ErrFailedPrecondition)
	}
	dev, err := os.Open("/dev/" + name)
	if err != nil {
		return fmt.Errorf("disk quota: the loop device: %w", err)
	}
	defer dev.Close()
	fsd, err := os.Open(d)
	if err != nil {
		return err
	}
	defer fsd.Close()
	if err := os.Truncate(Image(dir), size); err != nil {
		return err
	}
	if err := setLoopCapacity(dev); err != nil {
		return fmt.Errorf("disk quota: %w", err)
	}
	blocks := uint64(size / 4096)
	if _, _, e := unix.Syscall(unix.SYS_IOCTL, fsd.Fd(), ext4ResizeFS, uintptr(unsafe.Pointer(&blocks))); e != 0 {
		if e == unix.EPERM { // the file system grows when next grown offline
			return errNoResize
		}
		return fmt.Errorf("disk quota: grow the file system: %w", e)
	}
	return nil
}

// setLoopCapacity makes the loop device dev take its backing file's
// new size.
func setLoopCapacity(dev *os.File) error {
	if _, _, e := unix.Syscall(unix.SYS_IOCTL, dev.Fd(), unix.LOOP_SET_CAPACITY, 0); e != 0 {
		return fmt.Errorf("loop device capacity: %w", e)
	}
	return nil
}

var errNoResize = fmt.Errorf("disk quota: growing a mounted file system takes CAP_SYS_RESOURCE, which this worker lacks: dsec stop the sandbox, apply the policy, dsec start it: %w", errdefs.ErrFailedPrecondition)

// HasCapSysResource reports whether this process may grow a mounted
// ext4 (some hosts drop CAP_SYS_RESOURCE even from root).
func HasCapSysResource() bool {
	hdr := unix.CapUserHeader{Version: unix.LINUX_CAPABILITY_VERSION_3}
	var data [2]unix.CapUserData
	if err := unix.Capget(&hdr, &data[0]); err != nil {
		return false
	}
	return data[unix.CAP_SYS_RESOURCE/32].Effective&(1<<(unix.CAP_SYS_RESOURCE%32)) != 0
}

// e2fsck checks the disk image and repairs what is safe to repair; exit
// codes below 4 mean it is fine now.
func e2fsck(dir string, args ...string) error {
	out, err := exec.Command("e2fsck", append(append([]string{"-p"}, args...), Image(dir))...).CombinedOutput()
	var exit *exec.ExitError
	if errors.As(err, &exit) && exit.ExitCode() < 4 {
		return nil
	}
	if err != nil {
		return fmt.Errorf("disk quota: e2fsck %s: %v: %s: %w", Image(dir), err, strings.TrimSpace(string(out)), errdefs.ErrDataLoss)
	}
	return nil
}
