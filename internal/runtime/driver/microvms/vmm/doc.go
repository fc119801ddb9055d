// Package vmm is a microVM's shim: a process on the host, started per
// sandbox (dsec-init re-executed as dsec-vmm), that runs QEMU, speaks
// QMP to it (memory snapshots, the balloon), and forwards the init
// protocol (package initproto) between the worker and the guest's agent
// over one virtio-serial port. VM is the worker's side of it.
package vmm
