package microvm

import "time"

// Settings configure the microVM backend (the config's microvm:).
type Settings struct {
	// Kernel is the guest kernel's directory (make kernel); "": the
	// first of KernelDirs that has one.
	Kernel string `json:"kernel,omitempty"`
	// Accel is auto (the default), kvm or tcg.
	Accel string `json:"accel,omitempty"`
	// QEMU is the emulator's binary; "": qemu-system-x86_64 on PATH.
	QEMU string `json:"qemu,omitempty"`
	// Agent is the guest's agent: a static dsec-init; "": the init
	// binary the containers run, which make build makes static.
	Agent string `json:"agent,omitempty"`
	// BootTimeout bounds a guest's boot to its agent's setup (0: 10 s
	// under KVM, 90 s under TCG).
	BootTimeout time.Duration `json:"boot_timeout,omitempty"`
	// LayerDisks puts layers on virtio-blk disks instead of pmem devices
	// read with DAX: the baseline of BenchmarkMicroVMDAX, not a mode for
	// use (every guest then keeps its own copy of what it reads).
	LayerDisks bool `json:"layer_disks,omitempty"`
	// NoFreePageReporting turns the balloon's free page reporting off:
	// what the guest frees stays the host's to hold (the baseline of
	// BenchmarkMicroVMBalloon, not a mode for use).
	NoFreePageReporting bool `json:"no_free_page_reporting,omitempty"`
}
