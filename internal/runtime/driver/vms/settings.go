package vms

import "time"

// VM is the vm backend's name.
const VM = "vm"

// Settings configure the vm backend (the config's vm:).
type Settings struct {
	// Accel is auto (the default), kvm or tcg.
	Accel string `json:"accel,omitempty"`
	// QEMU is the emulator's binary; "": qemu-system-x86_64 on PATH.
	QEMU string `json:"qemu,omitempty"`
	// Agent is the guest's agent (a dsec-init); "": the init binary the
	// containers run.
	Agent string `json:"agent,omitempty"`
	// BootTimeout bounds a boot, firmware to the agent's answer (0:
	// 60 s under KVM, 300 s under TCG).
	BootTimeout time.Duration `json:"boot_timeout,omitempty"`
	// MaxChain is the longest disk chain a snapshot leaves (0 or more
	// than vm.MaxChain: vm.MaxChain): a snapshot of a longer one first
	// flattens it, copying the whole disk into the snapshot, which then
	// stands alone.
	MaxChain int `json:"max_chain,omitempty"`
}
