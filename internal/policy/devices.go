package policy

import (
	"fmt"
	"slices"

	"github.com/dsec-project/dsec/internal/runtime/backend"
)

// Device is a device number a sandbox may open; Minor -1: any minor.
type Device struct {
	Name         string
	Major, Minor int
}

// DeviceAllow are the character devices a sandbox may open: the nodes
// of its minimal /dev (backend.DevNodes: null, zero, full, random,
// urandom, tty), its devpts instance's ptmx, and pseudo-terminal slaves
// (major 136, UNIX98_PTY_SLAVE_MAJOR, whose 2^20 minors hold every pty
// the kernel makes). Nothing else opens, whatever node a process makes:
// no block device (loop devices hold other sandboxes' disks), no
// /dev/kvm, /dev/fuse, /dev/loop-control, /dev/net/tun, /dev/kmsg,
// /dev/mem, /dev/port, input or host tty. mknod itself is allowed, as
// Docker allows it: archives and package installs that carry device
// nodes unpack, and what they make never opens (the sandbox's writable
// mounts are nodev too).
var DeviceAllow = func() []Device {
	var out []Device
	for _, d := range backend.DevNodes {
		out = append(out, Device{d.Name, int(d.Major), int(d.Minor)})
	}
	return append(out, Device{"ptmx", 5, 2}, Device{"pts", 136, -1})
}()

// KVM is /dev/kvm, which a microVM's QEMU opens on a host with
// hardware virtualization (its sandbox's allowlist has it besides).
var KVM = Device{"kvm", 10, 232}

// DevicesV1 are the lines the v1 devices controller takes for the same
// list (and extra): everything denied, then mknod of any node and the
// allowlist.
func DevicesV1(extra ...Device) (deny string, allow []string) {
	allow = []string{"c *:* m", "b *:* m"}
	for _, d := range append(slices.Clip(DeviceAllow), extra...) {
		minor := "*"
		if d.Minor >= 0 {
			minor = fmt.Sprint(d.Minor)
		}
		allow = append(allow, fmt.Sprintf("c %d:%s rw", d.Major, minor))
	}
	return "a", allow
}
