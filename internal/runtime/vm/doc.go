// Package vm holds what the full-VM backend needs of the host to run a
// sandbox as a whole operating system booted through UEFI firmware: the
// bootable disk image a tree becomes (BuildDisk: a GPT disk, an EFI
// system partition holding the tree's own boot loader, kernel and
// initramfs, and a root file system made from the tree) and its record
// in the store (Save, Lookup, List, Remove), which the backend's disks
// are copy-on-write overlays of.
//
// Terms:
//
//   - disk image: a GPT disk as the firmware sees it, built raw (sparse)
//     and stored as qcow2 (what its partitions hold), a blob named by a
//     tag of kind vm-image in the same index as layers and images.
//   - ESP: the EFI system partition (FAT32, written by go-diskfs), with
//     systemd-boot as the firmware's default loader (EFI/BOOT/BOOTX64.EFI)
//     and one entry that boots the tree's newest kernel.
//   - root: an ext4 file system made from the tree by mke2fs -d, at its
//     partition's offset in the disk (no mount, no loop device).
package vm
