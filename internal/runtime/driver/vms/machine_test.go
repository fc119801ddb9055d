package vms

import (
	"slices"
	"strings"
	"testing"

	"github.com/dsec-project/dsec/internal/runtime/microvm"
)

// TestMachineArgs: the machine boots through the firmware (code
// read-only, its own variables) from its top over the image's chain
// (stacked base first, read-only, whatever the images name), with the agent's disk
// read-only under the serial udev names, the agent's port and QMP on
// the descriptors given, KVM only where asked, a NIC only with a tap
// (or unplugged, a saved guest's), -incoming only for a saved guest,
// and paths with commas quoted as QEMU reads them.
func TestMachineArgs(t *testing.T) {
	m := Machine{QEMU: "/usr/bin/qemu-system-x86_64", Accel: microvm.AccelTCG, CPUs: 2, Memory: 1 << 30, Code: "/fw/code.fd", Vars: "/sb/vars,1.fd",
		Base: []string{"/store/diff2", "/store/diff1", "/store/disk"}, Disk: "/sb/upper/disk.3.qcow2", AgentDisk: "/root/vm/agent.img", AgentFD: 3, QMPFD: 4}
	a := strings.Join(m.Args(), " ")
	for _, want := range []string{
		"-machine q35 -accel tcg,tb-size=64 -cpu qemu64 -smp 2 -m 1024M",
		"-drive if=pflash,format=raw,unit=0,readonly=on,file=/fw/code.fd",
		"-drive if=pflash,format=raw,unit=1,file=/sb/vars,,1.fd",
		`-blockdev {"backing":null,"driver":"qcow2","file":{"aio":"threads","driver":"file","filename":"/store/disk"},"node-name":"base0","read-only":true}`,
		`-blockdev {"backing":"base0","driver":"qcow2","file":{"aio":"threads","driver":"file","filename":"/store/diff1"},"node-name":"base1","read-only":true}`,
		`-blockdev {"backing":"base1","driver":"qcow2","file":{"aio":"threads","driver":"file","filename":"/store/diff2"},"node-name":"base2","read-only":true}`,
		`-blockdev {"backing":"base2","discard":"unmap","driver":"qcow2","file":{"aio":"threads","discard":"unmap","driver":"file","filename":"/sb/upper/disk.3.qcow2"},"node-name":"top3"}`,
		"virtio-blk-pci,id=vdisk,drive=top3,bootindex=0,werror=report",
		"file=/root/vm/agent.img,if=none,id=agent,format=raw,readonly=on",
		"virtio-blk-pci,drive=agent,serial=dsec-agent,addr=0x7",
		"-chardev socket,id=agent,fd=3",
		"virtserialport,chardev=agent,name=dsec.agent",
		"-chardev socket,id=qmp,fd=4 -mon chardev=qmp,mode=control",
		"-sandbox on,",
	} {
		if !strings.Contains(a, want) {
			t.Errorf("args lack %q:\n%s", want, a)
		}
	}
	if strings.Contains(a, "-netdev") || strings.Contains(a, "kvm") {
		t.Errorf("a machine without a tap, under TCG: %s", a)
	}
	if strings.Contains(a, "-vnc") || strings.Contains(a, "-incoming") {
		t.Errorf("a machine without a VNC socket serves VNC, or one booted waits for a saved guest: %s", a)
	}
	m.Accel, m.NetFD, m.MAC, m.VNC = microvm.AccelKVM, 5, "02:00:00:00:00:01", "/sb/v,nc.sock"
	args := m.Args()
	if i := slices.Index(args, "-accel"); i < 0 || args[i+1] != "kvm" || args[slices.Index(args, "-cpu")+1] != "host" {
		t.Errorf("under KVM: %v", args)
	}
	if a := strings.Join(args, " "); !strings.Contains(a, "-netdev tap,id=net0,fd=5,vhost=off") || !strings.Contains(a, "mac=02:00:00:00:00:01,addr=0x6") {
		t.Errorf("with a tap: %s", a)
	}
	if a := strings.Join(args, " "); !strings.Contains(a, "-vnc unix:/sb/v,,nc.sock") {
		t.Errorf("with a VNC socket: %s", a)
	}
	// A saved guest continued: QEMU waits for its state; its NIC stays,
	// on no network, when the sandbox has none.
	m.NetFD, m.Unplugged, m.Incoming = 0, true, true
	if a := strings.Join(m.Args(), " "); !strings.Contains(a, "-netdev hubport,id=net0,hubid=0") || !strings.Contains(a, "mac=02:00:00:00:00:01,addr=0x6") ||
		!strings.HasSuffix(a, "-incoming defer") || strings.Contains(a, "tap,") {
		t.Errorf("a saved guest's machine, unplugged: %s", a)
	}
}
