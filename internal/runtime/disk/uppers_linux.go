package disk

import (
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"unsafe"

	"github.com/containerd/errdefs"
	"golang.org/x/sys/unix"

	"github.com/dsec-project/dsec/internal/mount"
)

// Sandboxes without a disk image of their own keep their uppers on one
// file system per root, so that together they cannot fill the host's
// disk: a btrfs image at <root>/uppers.img, sparse and loop-mounted with
// discard at <root>/uppers, so it takes host disk as it is written and
// gives it back as it is freed (async discard: in batches, within
// minutes; discard=sync made every commit wait for its discards, which
// slowed creates and removals as sandboxes accumulated: BENCHMARKS.md). Its size bounds them all; each upper is
// a subvolume whose quota group bounds it alone, inodes included (btrfs
// charges an inode's metadata to the quota: ~46,000 empty files fill
// 16 MiB). A subvolume is made with two ioctls (~0.1 ms) and removed
// with one, whatever it holds: the kernel drops its tree in the
// background. Simple quotas (Linux 6.7+) account as the data is
// written; older kernels get full qgroups.
//
// No library: containerd/btrfs needs cgo, and these are five ioctls.

// The ioctls, from linux/btrfs.h.
const (
	iocResize       = 0x50009403 // _IOW(0x94, 3, struct btrfs_ioctl_vol_args)
	iocSubvolCreate = 0x5000940e // _IOW(0x94, 14, struct btrfs_ioctl_vol_args)
	iocSnapDestroy  = 0x5000940f // _IOW(0x94, 15, struct btrfs_ioctl_vol_args)
	iocInoLookup    = 0xd0009412 // _IOWR(0x94, 18, struct btrfs_ioctl_ino_lookup_args)
	iocFSInfo       = 0x8400941f // _IOR(0x94, 31, struct btrfs_ioctl_fs_info_args)
	iocQuotaCtl     = 0xc0109428 // _IOWR(0x94, 40, struct btrfs_ioctl_quota_ctl_args)
	iocQgroupLimit  = 0x8030942b // _IOR(0x94, 43, struct btrfs_ioctl_qgroup_limit_args)

	quotaEnable       = 1
	quotaEnableSimple = 4
	limitMaxRfer      = 1 // BTRFS_QGROUP_LIMIT_MAX_RFER
	firstFreeObjectID = 256
)

type volArgs struct {
	fd   int64
	name [4088]byte
}

type inoLookupArgs struct {
	treeid, objectid uint64
	name             [4080]byte
}

type fsInfoArgs struct {
	maxID, numDevices uint64
	fsid              [16]byte
	_                 [992]byte
}

type quotaCtlArgs struct{ cmd, status uint64 }

type qgroupLimitArgs struct {
	qgroupid                                 uint64
	flags, maxRfer, maxExcl, rsvRfer, rsvExl uint64
}

func btrfsIoctl(fd int, req uintptr, arg unsafe.Pointer) error {
	if _, _, e := unix.Syscall(unix.SYS_IOCTL, uintptr(fd), req, uintptr(arg)); e != 0 {
		return e
	}
	return nil
}

func uppersImage(root string) string { return filepath.Join(root, "uppers.img") }

// UppersDir is where root's uppers file system is mounted.
func UppersDir(root string) string { return filepath.Join(root, "uppers") }

var uppersMu sync.Mutex

// PrepareUppers makes root's uppers file system, of size bytes (0: the
// free space of root's file system less a GiB, at least 1 GiB), unless
// it exists, and mounts it unless it is mounted. An existing one is
// resized to size, when given: grown at once, shrunk as far as what the
// sandboxes wrote lets it (else an error, and it keeps its size).
func PrepareUppers(root string, size int64) error {
	d, err := MountUppers(root, size)
	if err != nil || size == 0 {
		return err
	}
	uppersMu.Lock()
	defer uppersMu.Unlock()
	return resizeUppers(d, uppersImage(root), size)
}

// resizeUppers resizes the mounted uppers file system at d, and its
// image img, to size bytes: the image and its loop device first when it
// grows, last when it shrinks.
func resizeUppers(d, img string, size int64) error {
	fi, err := os.Stat(img)
	if err != nil || fi.Size() == size {
		return err
	}
	src, _, err := mountDevice(d)
	if err != nil {
		return err
	}
	dev, err := os.Open(src)
	if err != nil {
		return fmt.Errorf("the uppers file system's loop device: %w", err)
	}
	defer dev.Close()
	fd, err := unix.Open(d, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return err
	}
	defer unix.Close(fd)
	image := func() error {
		if err := os.Truncate(img, size); err != nil {
			return err
		}
		if err := setLoopCapacity(dev); err != nil {
			return fmt.Errorf("the uppers file system: %w", err)
		}
		return nil
	}
	fs := func() error {
		var a volArgs
		copy(a.name[:], strconv.FormatInt(size, 10))
		if err := btrfsIoctl(fd, iocResize, unsafe.Pointer(&a)); err != nil {
			return fmt.Errorf("resize the uppers file system %s from %d to %d bytes: %w (what the sandboxes wrote may not fit: remove some, or give a larger admission.uppers_size)",
				d, fi.Size(), size, err)
		}
		return nil
	}
	if size > fi.Size() {
		if err := image(); err != nil {
			return err
		}
		return fs()
	}
	if err := fs(); err != nil {
		return err
	}
	return image()
}

// MountUppers is PrepareUppers, returning the mount point.
func MountUppers(root string, size int64) (string, error) {
	uppersMu.Lock()
	defer uppersMu.Unlock()
	d := UppersDir(root)
	if mounted, err := mount.IsMountPoint(d); err != nil || mounted {
		return d, err
	}
	img := uppersImage(root)
	fresh := false
	if _, err := os.Stat(img); errors.Is(err, os.ErrNotExist) {
		if err := makeUppers(img, size); err != nil {
			return "", err
		}
		fresh = true
	} else if err != nil {
		return "", err
	}
	if err := os.MkdirAll(d, 0o700); err != nil {
		return "", err
	}
	if !fresh {
		if err := waitImageFree(img); err != nil {
			return "", fmt.Errorf("the uppers file system: %w", err)
		}
	}
	m := mount.Mount{Type: "btrfs", Source: img, Options: []string{"loop", "nodev", "nosuid", "noatime", "discard=async"}}
	if err := m.Mount(d); errors.Is(err, unix.ENODEV) {
		return "", fmt.Errorf("the sandboxes' file system %s needs btrfs, which this kernel lacks: load its module (modprobe btrfs): %w", img, errdefs.ErrFailedPrecondition)
	} else if err != nil {
		return "", fmt.Errorf("the uppers file system %s: %w", img, err)
	}
	// Quotas are on from the start; a host that went down between the
	// image and them gets them now.
	if fresh || !quotaOn(d) {
		if err := enableQuota(d); err != nil {
			unmountLoop(d)
			if fresh {
				os.Remove(img)
			}
			return "", err
		}
	}
	return d, nil
}

// makeUppers makes the image whole under a temporary name and renames
// it into place, so a crash leaves either none or a usable one.
func makeUppers(img string, size int64) error {
	if size == 0 {
		var st unix.Statfs_t
		if err := unix.Statfs(filepath.Dir(img), &st); err != nil {
			return err
		}
		size = max(int64(st.Bavail)*st.Bsize-1<<30, 1<<30)
	}
	tmp := img + ".new"
	os.Remove(tmp)
	if err := os.WriteFile(tmp, nil, 0o600); err != nil {
		return err
	}
	defer os.Remove(tmp)
	if err := os.Truncate(tmp, size); err != nil {
		return fmt.Errorf("the uppers file system: %w", err)
	}
	// One copy of the metadata: the image is one file on one disk.
	out, err := exec.Command("mkfs.btrfs", "-q", "-f", "-m", "single", "-d", "single", tmp).CombinedOutput()
	if errors.Is(err, exec.ErrNotFound) {
		return fmt.Errorf("the uppers file system: mkfs.btrfs is missing: install btrfs-progs (make deps): %w", errdefs.ErrFailedPrecondition)
	}
	if err != nil {
		return fmt.Errorf("the uppers file system: mkfs.btrfs: %v: %s", err, strings.TrimSpace(string(out)))
	}
	return os.Rename(tmp, img)
}

// quotaOn reports whether the btrfs mounted at d has quotas on.
func quotaOn(d string) bool {
	fsid, err := btrfsFSID(d)
	if err != nil {
		return false
	}
	b, err := os.ReadFile("/sys/fs/btrfs/" + fsid + "/qgroups/enabled")
	return err == nil && strings.TrimSpace(string(b)) == "1"
}

// enableQuota turns quotas on: simple ones where the kernel has them.
func enableQuota(d string) error {
	fd, err := unix.Open(d, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return err
	}
	defer unix.Close(fd)
	a := quotaCtlArgs{cmd: quotaEnableSimple}
	if err := btrfsIoctl(fd, iocQuotaCtl, unsafe.Pointer(&a)); err == nil {
		return nil
	}
	a = quotaCtlArgs{cmd: quotaEnable}
	if err := btrfsIoctl(fd, iocQuotaCtl, unsafe.Pointer(&a)); err != nil {
		return fmt.Errorf("the uppers file system: enable quotas: %w", err)
	}
	return nil
}

// NewUpperName is a new upper's name.
func NewUpperName() string {
	b := make([]byte, 8)
	rand.Read(b)
	return "u" + hex.EncodeToString(b)
}

// NewUpper makes the subvolume name for a sandbox's upper and work
// directories on root's uppers file system, bounded by limit bytes (0:
// by the file system's size only).
func NewUpper(root, name string, limit int64) error {
	d, err := subvolume(root, iocSubvolCreate, name)
	if err != nil {
		return fmt.Errorf("an upper on %s: %w", d, err)
	}
	err = func() error {
		if err := SetUpperLimit(root, name, limit); err != nil {
			return err
		}
		for _, s := range []string{"upper", "work"} {
			if err := os.Mkdir(filepath.Join(d, name, s), 0o755); err != nil {
				return err
			}
		}
		return nil
	}()
	if err != nil {
		RemoveUpper(root, name)
	}
	return err
}

// SetUpperLimit bounds the upper name at limit bytes (0: no bound).
func SetUpperLimit(root, name string, limit int64) error {
	fd, err := unix.Open(filepath.Join(UppersDir(root), name), unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return err
	}
	defer unix.Close(fd)
	// qgroupid 0: the subvolume of fd; no flag: no limit.
	a := qgroupLimitArgs{}
	if limit > 0 {
		a.flags, a.maxRfer = limitMaxRfer, uint64(limit)
	}
	if err := btrfsIoctl(fd, iocQgroupLimit, unsafe.Pointer(&a)); err != nil {
		return fmt.Errorf("bound the upper %s at %d bytes: %w", name, limit, err)
	}
	return nil
}

// RemoveUpper removes the upper name, whatever it holds.
func RemoveUpper(root, name string) error {
	if !validUpper(name) {
		return fmt.Errorf("upper %q: not a name dsec gives: %w", name, errdefs.ErrInvalidArgument)
	}
	if d, err := subvolume(root, iocSnapDestroy, name); err != nil && !errors.Is(err, unix.ENOENT) {
		return fmt.Errorf("remove the upper %s: %w", filepath.Join(d, name), err)
	}
	return nil
}

// subvolume makes (iocSubvolCreate) or removes (iocSnapDestroy) the
// subvolume name of root's uppers file system, mounted first if need
// be, and returns where that is mounted.
func subvolume(root string, req uintptr, name string) (string, error) {
	d, err := MountUppers(root, 0)
	if err != nil {
		return d, err
	}
	fd, err := unix.Open(d, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return d, err
	}
	defer unix.Close(fd)
	var a volArgs
	copy(a.name[:], name)
	return d, btrfsIoctl(fd, req, unsafe.Pointer(&a))
}

func validUpper(name string) bool {
	if len(name) != 17 || name[0] != 'u' {
		return false
	}
	_, err := hex.DecodeString(name[1:])
	return err == nil
}

// UpperUsed is what the upper name holds, in bytes, as its quota counts
// it, what is still to be written back included (-1: unknown).
func UpperUsed(root, name string) int64 {
	d := UppersDir(root)
	fsid, err := btrfsFSID(d)
	if err != nil {
		return -1
	}
	fd, err := unix.Open(filepath.Join(d, name), unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return -1
	}
	defer unix.Close(fd)
	a := inoLookupArgs{objectid: firstFreeObjectID}
	if btrfsIoctl(fd, iocInoLookup, unsafe.Pointer(&a)) != nil {
		return -1
	}
	// What is on disk, and what is written but not yet (delayed
	// allocation): the quota holds both to the limit.
	var n int64
	for _, f := range []string{"referenced", "rsv_data"} {
		b, err := os.ReadFile(fmt.Sprintf("/sys/fs/btrfs/%s/qgroups/0_%d/%s", fsid, a.treeid, f))
		if err != nil {
			return -1
		}
		v, err := strconv.ParseInt(strings.TrimSpace(string(b)), 10, 64)
		if err != nil {
			return -1
		}
		n += v
	}
	return n
}

// btrfsFSID is the UUID of the btrfs mounted at d, as sysfs names it.
func btrfsFSID(d string) (string, error) {
	fd, err := unix.Open(d, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return "", err
	}
	defer unix.Close(fd)
	var a fsInfoArgs
	if err := btrfsIoctl(fd, iocFSInfo, unsafe.Pointer(&a)); err != nil {
		return "", err
	}
	u := hex.EncodeToString(a.fsid[:])
	return u[:8] + "-" + u[8:12] + "-" + u[12:16] + "-" + u[16:20] + "-" + u[20:], nil
}

// UppersSize is the size of root's uppers file system and what is free
// on it, in bytes; 0, 0 when it is not mounted.
func UppersSize(root string) (size, free int64) {
	d := UppersDir(root)
	if mounted, _ := mount.IsMountPoint(d); !mounted {
		return 0, 0
	}
	var st unix.Statfs_t
	if unix.Statfs(d, &st) != nil {
		return 0, 0
	}
	return int64(st.Blocks) * st.Bsize, int64(st.Bavail) * st.Bsize
}

// SweepUppers removes the uppers of root that no sandbox names (live:
// the uppers of the sandboxes there), which a worker killed between
// making one and saving its sandbox left.
func SweepUppers(root string, live []string) error {
	names, err := uppers(root)
	var errs []error
	for _, n := range names {
		if !slices.Contains(live, n) {
			errs = append(errs, RemoveUpper(root, n))
		}
	}
	return errors.Join(append(errs, err)...)
}

// ReleaseUppers unmounts root's uppers file system when it holds no
// upper (a worker that stops, a test's cleanup); the image stays for
// the next.
func ReleaseUppers(root string) error {
	uppersMu.Lock()
	defer uppersMu.Unlock()
	if names, err := uppers(root); err != nil || len(names) > 0 {
		return err
	}
	return unmountLoop(UppersDir(root))
}

// uppers lists the uppers on root's uppers file system, none when it is
// not mounted.
func uppers(root string) ([]string, error) {
	d := UppersDir(root)
	if mounted, err := mount.IsMountPoint(d); err != nil || !mounted {
		return nil, err
	}
	entries, err := os.ReadDir(d)
	var names []string
	for _, e := range entries {
		if validUpper(e.Name()) {
			names = append(names, e.Name())
		}
	}
	return names, err
}
