// Package agent is a microVM guest's pid 1: it mounts the guest's root
// from its layer devices and upper disk, becomes its init, and serves
// the init protocol (package initproto) to the host's shim over one
// virtio-serial port, running commands with the same job table as a
// container's init.
package agent
