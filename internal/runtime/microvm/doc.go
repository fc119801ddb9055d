// Package microvm holds what the microvm backend needs of the host to
// run a sandbox as a QEMU guest: the guest kernel (Debian's, unpacked by
// make kernel: Kernel), the initramfs dsec builds for it (Initramfs: its
// agent dsec-init as /init, busybox-static, the modules it loads in the
// order their depends= give), each layer's image as a virtio-pmem device
// maps it (PmemImage: padded to 2 MiB), the accelerator (DetectAccel:
// KVM where the CPU has hardware virtualization, else QEMU's TCG), and
// QEMU's command line (Machine.Args). It starts nothing itself: the
// runtime's microvm driver does, through package container's VM (the
// guest's shim and agent, which speak the init protocol).
//
// Terms:
//
//   - guest: the kernel and processes QEMU runs for one sandbox; its
//     pid 1 is dsec-init (package container's agent), which mounts the
//     layers (EROFS with DAX, every guest on a layer mapping the same
//     host page-cache pages) under an overlay whose upper is the
//     sandbox's disk image (ext4 on virtio-blk), and runs its commands.
//   - shim: dsec-init on the host, QEMU's parent, the sandbox's init as
//     the worker sees it (its socket, its pid).
//   - accelerator: kvm, or tcg: QEMU's translator, which runs the same
//     guest 20-50 times slower; these machines' /dev/kvm is PVM, which
//     boots no stock kernel, so their guests run under TCG.
package microvm
