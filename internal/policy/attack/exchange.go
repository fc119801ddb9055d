//go:build linux

package main

import (
	"bytes"
	"compress/zlib"
	"encoding/binary"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"unsafe"

	"golang.org/x/sys/unix"
)

// The content-exchange ioctls, each made for real on a file system of
// its kind with arguments the kernel accepts: with no filter in the way
// each one changes the files ("ok"), so a refusal under the policy is
// the policy's.

const blk = 4096

// pair makes dir/name.a and dir/name.b, one block each of a and b.
func pair(dir, name string, a, b byte) (*os.File, *os.File, error) {
	var fs []*os.File
	for i, c := range []byte{a, b} {
		p := filepath.Join(dir, fmt.Sprintf("%s.%c", name, 'a'+i))
		os.Remove(p)
		f, err := os.OpenFile(p, os.O_RDWR|os.O_CREATE, 0o644)
		if err != nil {
			return nil, nil, err
		}
		if _, err := f.Write(bytes.Repeat([]byte{c}, blk)); err != nil {
			return nil, nil, err
		}
		if err := f.Sync(); err != nil {
			return nil, nil, err
		}
		fs = append(fs, f)
	}
	return fs[0], fs[1], nil
}

func ioctlPtr(fd uintptr, req uint32, arg unsafe.Pointer) error {
	if _, _, e := unix.Syscall(unix.SYS_IOCTL, fd, uintptr(req), uintptr(arg)); e != 0 {
		return e
	}
	return nil
}

// changed says whether b now begins with a's contents.
func changed(b *os.File, want byte) error {
	got := make([]byte, 1)
	if _, err := b.ReadAt(got, 0); err != nil {
		return err
	}
	if got[0] != want {
		return fmt.Errorf("went through, changed nothing")
	}
	return nil
}

func withPair(dir, name string, a, b byte, f func(a, b *os.File) error) func() error {
	return func() error {
		fa, fb, err := pair(dir, name, a, b)
		if err != nil {
			return err
		}
		defer fa.Close()
		defer fb.Close()
		return f(fa, fb)
	}
}

// Requests, as the kernel's headers define them.
const (
	reqXFSSwapext       = 0xc0c0586d // _IOWR('X', 109, struct xfs_swapext)
	reqXFSExchangeRange = 0x40285881 // _IOW('X', 129, struct xfs_exchange_range)
	reqXFSStartCommit   = 0x80585882 // _IOR('X', 130, struct xfs_commit_range)
	reqXFSCommitRange   = 0x40585883 // _IOW('X', 131, struct xfs_commit_range)
	reqExt4MoveExt      = 0xc028660f // _IOWR('f', 15, struct move_extent)
	reqExt4SwapBoot     = 0x6611     // _IO('f', 17)
	reqBtrfsEncodedWr   = 0x40809440 // _IOW(0x94, 64, struct btrfs_ioctl_encoded_io_args)
)

// cloneAttempts are the generic clone and dedupe family (Btrfs' own
// CLONE, CLONE_RANGE and FILE_EXTENT_SAME are the same requests).
func cloneAttempts(dir, fs string) []attempt {
	return []attempt{
		{fs + " FICLONE", withPair(dir, "ficlone", 'A', 'B', func(a, b *os.File) error {
			if err := unix.IoctlFileClone(int(b.Fd()), int(a.Fd())); err != nil {
				return err
			}
			return changed(b, 'A')
		})},
		{fs + " FICLONERANGE", withPair(dir, "ficlonerange", 'A', 'B', func(a, b *os.File) error {
			r := unix.FileCloneRange{Src_fd: int64(a.Fd()), Src_length: blk}
			if err := unix.IoctlFileCloneRange(int(b.Fd()), &r); err != nil {
				return err
			}
			return changed(b, 'A')
		})},
		{fs + " FIDEDUPERANGE", withPair(dir, "fidedupe", 'A', 'A', func(a, b *os.File) error {
			r := unix.FileDedupeRange{Src_length: blk, Info: []unix.FileDedupeRangeInfo{{Dest_fd: int64(b.Fd())}}}
			if err := unix.IoctlFileDedupeRange(int(a.Fd()), &r); err != nil {
				return err
			}
			if r.Info[0].Status != 0 || r.Info[0].Bytes_deduped != blk {
				return fmt.Errorf("deduped %d bytes, status %d", r.Info[0].Bytes_deduped, r.Info[0].Status)
			}
			return nil
		})},
	}
}

// xfsCommitRange is struct xfs_commit_range (and, in its first 40
// bytes, struct xfs_exchange_range).
type xfsCommitRange struct {
	File1FD     int32
	Pad         uint32
	File1Offset uint64
	File2Offset uint64
	Length      uint64
	Flags       uint64
	Freshness   [6]uint64
}

func xfsAttempts(dir string) []attempt {
	return append(cloneAttempts(dir, "xfs"),
		attempt{"xfs XFS_IOC_SWAPEXT", withPair(dir, "swapext", 'A', 'B', func(a, b *os.File) error {
			// struct xfs_swapext: version, target, tmp, offset, length,
			// pad[16], then struct xfs_bstat, whose mtime (at 56) and
			// ctime (at 72) must be the target's.
			var st unix.Statx_t
			if err := unix.Statx(int(a.Fd()), "", unix.AT_EMPTY_PATH, unix.STATX_MTIME|unix.STATX_CTIME, &st); err != nil {
				return err
			}
			sx := make([]byte, 192)
			binary.NativeEndian.PutUint64(sx[8:], uint64(a.Fd()))
			binary.NativeEndian.PutUint64(sx[16:], uint64(b.Fd()))
			binary.NativeEndian.PutUint64(sx[32:], blk)
			bs := sx[56:]
			binary.NativeEndian.PutUint64(bs[56:], uint64(st.Mtime.Sec))
			binary.NativeEndian.PutUint32(bs[64:], st.Mtime.Nsec)
			binary.NativeEndian.PutUint64(bs[72:], uint64(st.Ctime.Sec))
			binary.NativeEndian.PutUint32(bs[80:], st.Ctime.Nsec)
			if err := ioctlPtr(a.Fd(), reqXFSSwapext, unsafe.Pointer(&sx[0])); err != nil {
				return err
			}
			return changed(a, 'B')
		})},
		attempt{"xfs XFS_IOC_EXCHANGE_RANGE", withPair(dir, "exchange", 'A', 'B', func(a, b *os.File) error {
			r := xfsCommitRange{File1FD: int32(a.Fd()), Length: blk}
			if err := ioctlPtr(b.Fd(), reqXFSExchangeRange, unsafe.Pointer(&r)); err != nil {
				return err
			}
			return changed(b, 'A')
		})},
		attempt{"xfs XFS_IOC_START_COMMIT", withPair(dir, "startcommit", 'A', 'B', func(a, b *os.File) error {
			var r xfsCommitRange
			return ioctlPtr(b.Fd(), reqXFSStartCommit, unsafe.Pointer(&r))
		})},
		attempt{"xfs XFS_IOC_COMMIT_RANGE", withPair(dir, "commit", 'A', 'B', func(a, b *os.File) error {
			// Its freshness comes from START_COMMIT, which the filter may
			// refuse: then the stale (zero) freshness gets EBUSY from XFS
			// without one, and EPERM from the filter with one.
			r := xfsCommitRange{File1FD: int32(a.Fd()), Length: blk}
			ioctlPtr(b.Fd(), reqXFSStartCommit, unsafe.Pointer(&r))
			r.File1FD, r.Length = int32(a.Fd()), blk
			if err := ioctlPtr(b.Fd(), reqXFSCommitRange, unsafe.Pointer(&r)); err != nil {
				return err
			}
			return changed(b, 'A')
		})},
	)
}

// ext4Attempts are ext4's own (it has no reflink: the generic family
// is tried on XFS and Btrfs).
func ext4Attempts(dir string) []attempt {
	return append([]attempt(nil),
		attempt{"ext4 EXT4_IOC_MOVE_EXT", withPair(dir, "moveext", 'A', 'B', func(a, b *os.File) error {
			// struct move_extent: reserved, donor fd, orig start, donor
			// start, length in blocks, moved (out).
			before, err := physical(a)
			if err != nil {
				return err
			}
			me := make([]byte, 40)
			binary.NativeEndian.PutUint32(me[4:], uint32(b.Fd()))
			binary.NativeEndian.PutUint64(me[24:], 1)
			if err := ioctlPtr(a.Fd(), reqExt4MoveExt, unsafe.Pointer(&me[0])); err != nil {
				return err
			}
			if moved := binary.NativeEndian.Uint64(me[32:]); moved != 1 {
				return fmt.Errorf("moved %d blocks", moved)
			}
			// The data stays (what e4defrag relies on); the blocks
			// holding it move.
			if after, err := physical(a); err != nil || after == before {
				return fmt.Errorf("the original's block is still at %d (%v)", before, err)
			}
			return nil
		})},
		attempt{"ext4 EXT4_IOC_SWAP_BOOT", withPair(dir, "swapboot", 'A', 'B', func(a, b *os.File) error {
			return ioctlPtr(a.Fd(), reqExt4SwapBoot, nil)
		})},
	)
}

func btrfsAttempts(dir string) []attempt {
	return append(cloneAttempts(dir, "btrfs"),
		attempt{"btrfs BTRFS_IOC_ENCODED_WRITE", withPair(dir, "encoded", 'A', 'B', func(a, b *os.File) error {
			// One block of 'E', zlib-compressed, written as the extent
			// itself (struct btrfs_ioctl_encoded_io_args).
			var z bytes.Buffer
			w := zlib.NewWriter(&z)
			w.Write(bytes.Repeat([]byte{'E'}, blk))
			w.Close()
			data := z.Bytes()
			iov := unix.Iovec{Base: &data[0]}
			iov.SetLen(len(data))
			args := make([]byte, 128)
			binary.NativeEndian.PutUint64(args[0:], uint64(uintptr(unsafe.Pointer(&iov))))
			binary.NativeEndian.PutUint64(args[8:], 1)
			binary.NativeEndian.PutUint64(args[32:], blk) // len
			binary.NativeEndian.PutUint64(args[40:], blk) // unencoded_len
			binary.NativeEndian.PutUint32(args[56:], 1)   // BTRFS_ENCODED_IO_COMPRESSION_ZLIB
			err := ioctlPtr(a.Fd(), reqBtrfsEncodedWr, unsafe.Pointer(&args[0]))
			runtime.KeepAlive(data)
			runtime.KeepAlive(&iov)
			if err != nil {
				return err
			}
			return changed(a, 'E')
		})},
	)
}

// physical is where f's first block lies on its device (FIEMAP).
func physical(f *os.File) (uint64, error) {
	// struct fiemap (32 bytes) and one struct fiemap_extent (56).
	buf := make([]byte, 32+56)
	binary.NativeEndian.PutUint64(buf[8:], ^uint64(0))
	binary.NativeEndian.PutUint32(buf[16:], 1) // FIEMAP_FLAG_SYNC
	binary.NativeEndian.PutUint32(buf[24:], 1)
	if err := ioctlPtr(f.Fd(), 0xc020660b /* FS_IOC_FIEMAP */, unsafe.Pointer(&buf[0])); err != nil {
		return 0, err
	}
	if binary.NativeEndian.Uint32(buf[20:]) == 0 {
		return 0, fmt.Errorf("no extent")
	}
	return binary.NativeEndian.Uint64(buf[32+8:]), nil
}

// exchangeRequests are every request above, by name.
var exchangeRequests = map[string]uint32{
	"FICLONE": unix.FICLONE, "FICLONERANGE": unix.FICLONERANGE, "FIDEDUPERANGE": unix.FIDEDUPERANGE,
	"XFS_IOC_SWAPEXT": reqXFSSwapext, "XFS_IOC_EXCHANGE_RANGE": reqXFSExchangeRange,
	"XFS_IOC_START_COMMIT": reqXFSStartCommit, "XFS_IOC_COMMIT_RANGE": reqXFSCommitRange,
	"EXT4_IOC_MOVE_EXT": reqExt4MoveExt, "EXT4_IOC_SWAP_BOOT": reqExt4SwapBoot,
	"BTRFS_IOC_ENCODED_WRITE": reqBtrfsEncodedWr, "TIOCSTI": unix.TIOCSTI, "TIOCLINUX": unix.TIOCLINUX,
}

// variantAttempts make each denied request with other direction and
// size bits: a filter must refuse the type and number, not one encoding.
func variantAttempts(file string, reqs map[string]uint32) []attempt {
	var as []attempt
	for name, req := range reqs {
		for i, v := range []uint32{req & 0xffff, req&0xffff | 3<<30 | 8<<16, req ^ 1<<30 ^ 0x100<<16} {
			as = append(as, attempt{fmt.Sprintf("%s variant %d", name, i), ioctlOn(file, uint64(v))})
		}
	}
	return as
}

// quotaAttempts try to lift a disk bound from inside: the Btrfs quota
// and subvolume ioctls on dir (a sandbox's upper lies on a Btrfs
// subvolume under a quota group). Named what, they must never succeed
// in a sandbox; on the host's Btrfs they reach the kernel.
func quotaAttempts(dir, what string) []attempt {
	ioc := func(req uint32, arg unsafe.Pointer) func() error {
		return func() error {
			d, err := os.Open(dir)
			if err != nil {
				return err
			}
			defer d.Close()
			return ioctlPtr(d.Fd(), req, arg)
		}
	}
	var vol [4096]byte // struct btrfs_ioctl_vol_args: a name that is not there
	copy(vol[8:], "dsec-attack-none")
	ctl := [2]uint64{2, 0} // BTRFS_QUOTA_CTL_DISABLE
	var limit [6]uint64    // qgroup 0 (the fd's subvolume), no limit flags: lifted
	resize := vol          // BTRFS_IOC_RESIZE "max"
	copy(resize[8:], "max\x00")
	return []attempt{
		{what + " QUOTA_CTL disable", ioc(0xc0109428, unsafe.Pointer(&ctl))},
		{what + " QGROUP_LIMIT lifted", ioc(0x8030942b, unsafe.Pointer(&limit))},
		{what + " SNAP_DESTROY", ioc(0x5000940f, unsafe.Pointer(&vol))},
		{what + " RESIZE", ioc(0x50009403, unsafe.Pointer(&resize))},
	}
}
