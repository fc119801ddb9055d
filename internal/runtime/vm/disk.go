package vm

import (
	"bufio"
	"cmp"
	"context"
	"crypto/rand"
	"crypto/sha256"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"

	"github.com/containerd/errdefs"
	diskfs "github.com/diskfs/go-diskfs"
	"github.com/diskfs/go-diskfs/backend/file"
	"github.com/diskfs/go-diskfs/disk"
	"github.com/diskfs/go-diskfs/filesystem"
	"github.com/diskfs/go-diskfs/partition/gpt"
)

const (
	mib = 1 << 20
	// DefaultESPSize is the EFI system partition's size: a few kernels
	// and their initramfs images, as a guest that updates its kernel
	// keeps the old one beside the new.
	DefaultESPSize = 256 * mib
	// DefaultRoom is the free space the root file system gets beyond
	// what the tree holds: the guest's own writes (packages, data) go
	// there, through the sandbox's copy-on-write overlay of the disk.
	DefaultRoom = 2 << 30
	// LoaderPath is where a tree holds systemd-boot (Debian's
	// systemd-boot-efi package), which becomes the firmware's default
	// loader on the ESP.
	LoaderPath = "usr/lib/systemd/boot/efi/systemd-bootx64.efi"
	// firstPartition is where the ESP starts: 1 MiB, aligned for every
	// disk, after the GPT's own 34 sectors.
	firstPartition = mib
	sector         = 512
)

// MaxSize bounds a disk: 16 TiB, ext4's least bound with 4 KiB blocks.
const MaxSize = 16 << 40

// mibs is n bytes as a user reads a size: in MiB, or bytes under one.
func mibs(n int64) string {
	if n < mib {
		return fmt.Sprintf("%d bytes", n)
	}
	return fmt.Sprintf("%d MiB", (n+mib-1)/mib)
}

// DiskOptions shape a disk image.
type DiskOptions struct {
	// Size is the whole disk's; 0: the ESP, the tree and DefaultRoom.
	Size int64
	// ESPSize is the EFI system partition's; 0: DefaultESPSize.
	ESPSize int64
	// KernelArgs are appended to the kernel's command line.
	KernelArgs []string
	// Seed names the disk's GUIDs (the table's, the partitions' and the
	// root file system's): the same seed gives the same GUIDs. "": random.
	Seed string
}

// Disk is a disk image as BuildDisk laid it out.
type Disk struct {
	Size    int64     `json:"size"`
	Kernel  string    `json:"kernel"` // the version the loader boots (boot/vmlinuz-VERSION)
	Cmdline string    `json:"cmdline"`
	OS      string    `json:"os,omitempty"` // the tree's os-release PRETTY_NAME
	ESP     Partition `json:"esp"`
	Root    Partition `json:"root"`
	// Agent is how dsec's guest agent starts in the guest: "systemd",
	// a service of the tree's systemd (AgentUnits); "": it does not
	// (the tree has no systemd), and the vm backend cannot run it.
	Agent string `json:"agent,omitempty"`
}

// Partition is one partition of a disk image.
type Partition struct {
	Offset int64  `json:"offset"`
	Size   int64  `json:"size"`
	UUID   string `json:"uuid"` // the GPT partition's unique GUID (PARTUUID)
}

// boot is what a tree boots with.
type boot struct {
	tree                            string
	version, kernel, initrd, loader string // paths under tree
}

// openInTree opens the file at path, under tree, as the tree sees it: a
// symbolic link that leads out of the tree (to a host's file, which the
// disk would then carry) is refused, whoever made the tree.
func openInTree(tree, path string) (*os.File, error) {
	rel, err := filepath.Rel(tree, path)
	if err != nil {
		return nil, err
	}
	root, err := os.OpenRoot(tree)
	if err != nil {
		return nil, err
	}
	defer root.Close()
	f, err := root.Open(rel)
	if err != nil {
		return nil, fmt.Errorf("%s in the tree %s: %w", rel, tree, err)
	}
	return f, nil
}

// regularInTree says whether path, under tree, is a regular file as the
// tree sees it.
func regularInTree(tree, path string) bool {
	f, err := openInTree(tree, path)
	if err != nil {
		return false
	}
	defer f.Close()
	st, err := f.Stat()
	return err == nil && st.Mode().IsRegular()
}

// findBoot finds the tree's newest kernel with its initramfs, and
// systemd-boot.
func findBoot(tree string) (boot, error) {
	kernels, _ := filepath.Glob(filepath.Join(tree, "boot", "vmlinuz-*"))
	var versions []string
	for _, k := range kernels {
		v := strings.TrimPrefix(filepath.Base(k), "vmlinuz-")
		if regularInTree(tree, filepath.Join(tree, "boot", "initrd.img-"+v)) && regularInTree(tree, k) {
			versions = append(versions, v)
		}
	}
	if len(versions) == 0 {
		return boot{}, fmt.Errorf("%s has no kernel with its initramfs (boot/vmlinuz-VERSION and boot/initrd.img-VERSION): install one in the tree (Debian: linux-image-amd64, as debootstrap --include=linux-image-amd64 does): %w", tree, errdefs.ErrInvalidArgument)
	}
	slices.SortFunc(versions, compareVersions)
	v := versions[len(versions)-1]
	b := boot{tree: tree, version: v, kernel: filepath.Join(tree, "boot", "vmlinuz-"+v), initrd: filepath.Join(tree, "boot", "initrd.img-"+v),
		loader: filepath.Join(tree, LoaderPath)}
	if !regularInTree(tree, b.loader) {
		return boot{}, fmt.Errorf("%s has no UEFI boot loader (%s): install systemd-boot in the tree (Debian: systemd-boot-efi): %w", tree, LoaderPath, errdefs.ErrInvalidArgument)
	}
	// The firmware runs PE images: the loader, and the kernel through
	// its EFI stub (every x86-64 Debian kernel has one).
	for _, f := range []struct{ what, path string }{{"boot loader", b.loader}, {"kernel", b.kernel}} {
		if !isPE(tree, f.path) {
			return boot{}, fmt.Errorf("%s's %s %s is no UEFI (PE) image: install a real one (Debian: systemd-boot-efi, linux-image-amd64): %w", tree, f.what, f.path, errdefs.ErrInvalidArgument)
		}
	}
	init := false
	for _, p := range []string{"sbin/init", "usr/sbin/init", "lib/systemd/systemd", "usr/lib/systemd/systemd"} {
		if _, err := os.Lstat(filepath.Join(tree, p)); err == nil {
			init = true
			break
		}
	}
	if !init {
		return boot{}, fmt.Errorf("%s has no init (sbin/init): install one in the tree (Debian: systemd-sysv): %w", tree, errdefs.ErrInvalidArgument)
	}
	return b, nil
}

// isPE says whether the file at path, under tree, starts as a PE image
// does ("MZ").
func isPE(tree, path string) bool {
	f, err := openInTree(tree, path)
	if err != nil {
		return false
	}
	defer f.Close()
	var b [2]byte
	_, err = io.ReadFull(f, b[:])
	return err == nil && string(b[:]) == "MZ"
}

// compareVersions orders kernel versions as dpkg mostly would: numeric
// runs by value, the rest by bytes.
func compareVersions(a, b string) int {
	for a != "" && b != "" {
		na, ra := leadingDigits(a)
		nb, rb := leadingDigits(b)
		if na != "" && nb != "" {
			na, nb = strings.TrimLeft(na, "0"), strings.TrimLeft(nb, "0")
			if c := cmp.Or(cmp.Compare(len(na), len(nb)), strings.Compare(na, nb)); c != 0 {
				return c
			}
			a, b = ra, rb
			continue
		}
		if a[0] != b[0] {
			return cmp.Compare(a[0], b[0])
		}
		a, b = a[1:], b[1:]
	}
	return cmp.Compare(len(a), len(b))
}

func leadingDigits(s string) (digits, rest string) {
	i := 0
	for i < len(s) && s[i] >= '0' && s[i] <= '9' {
		i++
	}
	return s[:i], s[i:]
}

// treeSize is about what an ext4 file system needs to hold tree: every
// file's data in 4 KiB blocks and an inode's worth per entry.
func treeSize(ctx context.Context, tree string) (int64, error) {
	var n int64
	err := filepath.WalkDir(tree, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if err := ctx.Err(); err != nil {
			return err
		}
		n += 4096 // its inode and directory entry, roughly
		if d.Type().IsRegular() {
			fi, err := d.Info()
			if err != nil {
				return err
			}
			n += (fi.Size() + 4095) &^ 4095
		}
		return nil
	})
	return n, err
}

// uuidOf is a version-4-shaped GUID named by seed and what it is for.
func uuidOf(seed, what string) string {
	var b [16]byte
	if seed == "" {
		rand.Read(b[:])
	} else {
		h := sha256.Sum256([]byte(seed + "\x00" + what))
		copy(b[:], h[:16])
	}
	b[6] = b[6]&0x0f | 0x40
	b[8] = b[8]&0x3f | 0x80
	return fmt.Sprintf("%x-%x-%x-%x-%x", b[0:4], b[4:6], b[6:8], b[8:10], b[10:16])
}

// BuildDisk writes a bootable disk image of tree into f, an empty file:
// a GPT disk whose EFI system partition holds the tree's systemd-boot as
// the firmware's default loader, with one entry that boots the tree's
// newest kernel and initramfs with the root partition as root, and whose
// root partition is an ext4 file system made from the tree (owners,
// modes, xattrs and special files as they are there). The file is
// sparse: what no partition uses takes no space. mke2fs (e2fsprogs) must
// be on PATH.
func BuildDisk(ctx context.Context, tree string, f *os.File, o DiskOptions) (Disk, error) {
	if st, err := os.Stat(tree); errors.Is(err, fs.ErrNotExist) {
		return Disk{}, fmt.Errorf("no directory %s: give the root of a tree to boot: %w", tree, errdefs.ErrNotFound)
	} else if err != nil || !st.IsDir() {
		return Disk{}, fmt.Errorf("%s is not a directory: give the root of a tree to boot: %w", tree, errdefs.ErrInvalidArgument)
	}
	b, err := findBoot(tree)
	if err != nil {
		return Disk{}, err
	}
	esp := cmp.Or(o.ESPSize, DefaultESPSize)
	if esp < 64*mib || esp%mib != 0 {
		return Disk{}, fmt.Errorf("an EFI system partition of %s: give at least 64 MiB (FAT32's least), in MiB: %w", mibs(esp), errdefs.ErrInvalidArgument)
	}
	if o.Size > MaxSize || esp > MaxSize {
		return Disk{}, fmt.Errorf("a disk of %s: give at most %s: %w", mibs(max(o.Size, esp)), mibs(MaxSize), errdefs.ErrInvalidArgument)
	}
	for _, a := range o.KernelArgs {
		if a == "" || strings.ContainsAny(a, " \t\n") {
			return Disk{}, fmt.Errorf("kernel parameter %q: give one parameter, without spaces, to each --kernel-arg: %w", a, errdefs.ErrInvalidArgument)
		}
	}
	need, err := treeSize(ctx, tree)
	if err != nil {
		return Disk{}, err
	}
	need = need + need/16 + 64*mib // ext4's own metadata, journal and reserve
	size := o.Size
	if size == 0 {
		size = firstPartition + esp + need + DefaultRoom + mib
	}
	size = (size + mib - 1) / mib * mib
	rootOff := int64(firstPartition + esp)
	rootSize := size - mib - rootOff // the last MiB holds the backup GPT
	if rootSize < need {
		return Disk{}, fmt.Errorf("a disk of %s cannot hold the EFI system partition (%s) and the tree (%s with ext4's own): give at least %s: %w",
			mibs(o.Size), mibs(esp), mibs(need), mibs(rootOff+need+mib), errdefs.ErrInvalidArgument)
	}
	d := Disk{Size: size, Kernel: b.version, OS: prettyName(tree),
		ESP:  Partition{Offset: firstPartition, Size: esp, UUID: uuidOf(o.Seed, "esp")},
		Root: Partition{Offset: rootOff, Size: rootSize, UUID: uuidOf(o.Seed, "root")}}
	d.Cmdline = strings.Join(append([]string{"root=PARTUUID=" + d.Root.UUID, "rw", "console=tty0", "console=ttyS0"}, o.KernelArgs...), " ")
	if err := f.Truncate(size); err != nil {
		return Disk{}, err
	}
	if err := writeESP(f.Name(), d, b, uuidOf(o.Seed, "disk")); err != nil {
		return Disk{}, fmt.Errorf("write the EFI system partition: %w", err)
	}
	if err := makeRoot(ctx, f.Name(), tree, d.Root, uuidOf(o.Seed, "rootfs")); err != nil {
		return Disk{}, err
	}
	if hasSystemd(tree) {
		if err := installAgent(ctx, f.Name(), d.Root, inTree(tree)); err != nil {
			return Disk{}, err
		}
		d.Agent = AgentSystemd
	}
	return d, nil
}

// writeESP partitions the disk at path and writes its ESP (go-diskfs:
// the table and FAT32 written directly, nothing mounted).
func writeESP(path string, d Disk, b boot, diskGUID string) error {
	bf, err := os.OpenFile(path, os.O_RDWR, 0)
	if err != nil {
		return err
	}
	dk, err := diskfs.OpenBackend(file.New(bf, false))
	if err != nil {
		bf.Close()
		return err
	}
	defer dk.Close()
	table := &gpt.Table{LogicalSectorSize: sector, PhysicalSectorSize: sector, ProtectiveMBR: true, GUID: diskGUID,
		Partitions: []*gpt.Partition{
			{Index: 1, Start: uint64(d.ESP.Offset / sector), End: uint64((d.ESP.Offset+d.ESP.Size)/sector - 1),
				Type: gpt.EFISystemPartition, Name: "ESP", GUID: d.ESP.UUID},
			{Index: 2, Start: uint64(d.Root.Offset / sector), End: uint64((d.Root.Offset+d.Root.Size)/sector - 1),
				Type: gpt.LinuxRootX86_64, Name: "root", GUID: d.Root.UUID},
		}}
	if err := dk.Partition(table); err != nil {
		return err
	}
	fsys, err := dk.CreateFilesystem(disk.FilesystemSpec{Partition: 1, FSType: filesystem.TypeFat32, VolumeLabel: "ESP", Reproducible: true})
	if err != nil {
		return err
	}
	for _, dir := range []string{"/EFI", "/EFI/BOOT", "/loader", "/loader/entries"} {
		if err := fsys.Mkdir(dir); err != nil {
			return err
		}
	}
	kernel, initrd := "/vmlinuz-"+b.version, "/initrd.img-"+b.version
	for dst, src := range map[string]string{"/EFI/BOOT/BOOTX64.EFI": b.loader, kernel: b.kernel, initrd: b.initrd} {
		if err := copyIn(fsys, dst, b.tree, src); err != nil {
			return err
		}
	}
	title := cmp.Or(d.OS, "Linux "+b.version)
	files := map[string]string{
		"/loader/loader.conf":       "default dsec.conf\ntimeout 0\n",
		"/loader/entries/dsec.conf": fmt.Sprintf("title %s\nlinux %s\ninitrd %s\noptions %s\n", title, kernel, initrd, d.Cmdline),
	}
	for dst, s := range files {
		if err := writeIn(fsys, dst, strings.NewReader(s)); err != nil {
			return err
		}
	}
	return nil
}

func copyIn(fsys filesystem.FileSystem, dst, tree, src string) error {
	sf, err := openInTree(tree, src)
	if err != nil {
		return err
	}
	defer sf.Close()
	return writeIn(fsys, dst, bufio.NewReaderSize(sf, mib))
}

func writeIn(fsys filesystem.FileSystem, dst string, r io.Reader) error {
	df, err := fsys.OpenFile(dst, os.O_CREATE|os.O_RDWR)
	if err != nil {
		return fmt.Errorf("%s: %w", dst, err)
	}
	if _, err := io.Copy(df, r); err != nil {
		df.Close()
		return fmt.Errorf("%s: %w", dst, err)
	}
	return df.Close()
}

// makeRoot makes the root partition's ext4 file system from tree with
// mke2fs -d, at its offset in the disk at path. go-diskfs's ext4 writer
// copies no xattrs, devices or hard links; mke2fs does, without a mount.
func makeRoot(ctx context.Context, path, tree string, p Partition, fsUUID string) error {
	cmd := exec.CommandContext(ctx, "mke2fs", "-q", "-F", "-t", "ext4", "-L", "root", "-U", fsUUID,
		"-E", fmt.Sprintf("offset=%d,hash_seed=%s", p.Offset, fsUUID), "-d", tree, path, fmt.Sprintf("%dk", p.Size/1024))
	cmd.Env = append(os.Environ(), "E2FSPROGS_FAKE_TIME=1") // no build time in the superblock
	out, err := cmd.CombinedOutput()
	if errors.Is(err, exec.ErrNotFound) {
		return fmt.Errorf("make the root file system: mke2fs is missing: install e2fsprogs (make deps does)")
	}
	if err != nil {
		return fmt.Errorf("make the root file system from %s: mke2fs: %v: %s", tree, err, strings.TrimSpace(string(out)))
	}
	return nil
}

// prettyName is the tree's os-release PRETTY_NAME, if any.
func prettyName(tree string) string {
	for _, p := range []string{"usr/lib/os-release", "etc/os-release"} {
		f, err := openInTree(tree, filepath.Join(tree, p))
		if err != nil {
			continue
		}
		b, err := io.ReadAll(io.LimitReader(f, 64<<10))
		f.Close()
		if err != nil {
			continue
		}
		for line := range strings.Lines(string(b)) {
			if v, ok := strings.CutPrefix(strings.TrimSpace(line), "PRETTY_NAME="); ok {
				return strings.Trim(v, `"'`)
			}
		}
	}
	return ""
}

// The UEFI firmware a VM boots through: Debian's ovmf, its code read-only
// and a copy of its variable store per machine.
const (
	OVMFCode = "/usr/share/OVMF/OVMF_CODE_4M.fd"
	OVMFVars = "/usr/share/OVMF/OVMF_VARS_4M.fd"
)
