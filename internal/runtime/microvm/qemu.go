package microvm

import (
	"fmt"
	"slices"
	"strconv"
	"strings"

	"github.com/dsec-project/dsec/internal/runtime/initproto"
)

// Machine describes a guest as QEMU is to run it: Args is its command
// line, a pure function of it (so what a sandbox runs can be read, and
// tested, without starting anything).
//
// The machine is a q35 with qboot as its firmware (SeaBIOS takes most
// of a -kernel boot's time), no default devices, and only these: each
// layer a read-only virtio-pmem device over its image (share=on: every
// guest on a layer maps the same host page-cache pages, which the guest
// reads through DAX without a page cache of its own), the upper a
// virtio-blk disk, the agent's virtio-serial port, entropy, the
// balloon (free pages reported back to the host; deflated when the
// guest runs out of memory), the serial console, and a NIC only where
// the sandbox has a network. q35 and not QEMU's microvm machine:
// virtio-pmem needs the memory-device region microvm lacks.
type Machine struct {
	QEMU  string // the binary
	Accel string // AccelKVM or AccelTCG
	CPUs  int
	// Memory is the guest's RAM in bytes (a multiple of 1 MiB).
	Memory int64
	// Kernel is the uncompressed kernel (booted through PVH), Initrd
	// the initramfs.
	Kernel, Initrd string
	// Append is added to the kernel's command line.
	Append []string
	// Layers are the sandbox's layer images, topmost first; each
	// Size a multiple of PmemAlign.
	Layers []Pmem
	// Upper is the disk image the guest's upper lives on; Direct opens
	// it with O_DIRECT (cache=none: no second copy of it in the host's
	// page cache).
	Upper  string
	Direct bool
	// AgentFD and QMPFD are descriptors QEMU inherits: connected
	// sockets for the agent's serial port and for QMP.
	AgentFD, QMPFD int
	// NetFD is a tap's descriptor QEMU inherits (0: no NIC), with MAC
	// its address.
	NetFD int
	MAC   string
	// LayerDisks puts the layers on read-only virtio-blk disks (direct
	// I/O: no host page cache) instead of pmem devices: each guest then
	// caches what it reads, the baseline DAX is measured against.
	LayerDisks bool
	// RAMFD is QEMU's fd of a memory file that is the guest's memory,
	// mapped shared: a memory snapshot copies it whole, its device
	// state skipping it (x-ignore-shared); the pages the guest's balloon
	// reports free are holes punched in it. 0: anonymous memory.
	RAMFD int
	// NoFreePageReporting: the balloon does not report the guest's free
	// pages (Settings').
	NoFreePageReporting bool
	// Unplugged: the guest has a NIC, on no network (a hub of no other
	// port), as a restored guest must that had one when its snapshot
	// was taken, its sandbox now reaching nothing.
	Unplugged bool
	// Incoming: QEMU waits for a snapshot's device state (a migration
	// stream, migrate-incoming) before the guest runs.
	Incoming bool
}

// Pmem is a layer image as a virtio-pmem device maps it.
type Pmem struct {
	Path string
	Size int64
}

// PmemAlign is what a virtio-pmem region's size must be a multiple of:
// the guest maps it in 2 MiB sections.
const PmemAlign = 2 << 20

// AgentPort names the agent's virtio-serial port: the guest finds it as
// /sys/class/virtio-ports/*/name.
const AgentPort = "dsec.agent"

// KernelParams are the parameters every guest kernel boots with:
// console on the first serial port, quiet but for warnings; a panic
// ends QEMU (with -no-reboot) at once; no PCI bus scan past bus 0; no
// timer and TSC checks (which TCG makes slow and flaky); no crypto
// self-tests; no bounce buffers (64 MiB of a guest's memory: virtio
// needs none).
var KernelParams = []string{"console=ttyS0", "loglevel=4", "panic=-1", "pci=lastbus=0", "tsc=reliable", "no_timer_check",
	"cryptomgr.notests", "8250.nr_uarts=1", "random.trust_cpu=on", "swiotlb=noforce"}

// Cmdline is a sandbox guest's kernel command line, extra appended:
// KernelParams, and DSEC_GUEST=1, which reaches /init as its
// environment and tells dsec-init it is a guest's pid 1.
func Cmdline(extra ...string) string {
	return strings.Join(slices.Concat(KernelParams, []string{initproto.GuestEnv + "=1"}, extra), " ")
}

// Args is QEMU's command line for m.
func (m Machine) Args() []string {
	var pmem int64
	for _, l := range m.Layers {
		if !m.LayerDisks {
			pmem += l.Size
		}
	}
	accel := "tcg,tb-size=64" // a 64 MiB code cache, not the default 1 GiB
	cpu := "qemu64"
	if m.Accel == AccelKVM {
		accel, cpu = "kvm", "host"
	}
	a := []string{m.QEMU, "-nodefaults", "-no-user-config", "-display", "none", "-no-reboot",
		"-sandbox", "on,obsolete=deny,elevateprivileges=deny,spawn=deny,resourcecontrol=deny",
		"-machine", machine(m.RAMFD > 0), "-accel", accel, "-cpu", cpu, "-bios", Firmware,
		"-smp", strconv.Itoa(max(m.CPUs, 1)),
		"-m", memory(m.Memory, pmem, len(m.Layers)),
		"-kernel", m.Kernel, "-initrd", m.Initrd, "-append", Cmdline(m.Append...),
		"-serial", "stdio",
		"-chardev", fmt.Sprintf("socket,id=agent,fd=%d", m.AgentFD),
		"-device", fmt.Sprintf("virtio-serial-pci,id=serial0,addr=%#x", initproto.SerialSlot),
		"-device", "virtserialport,chardev=agent,name=" + AgentPort,
		"-chardev", fmt.Sprintf("socket,id=qmp,fd=%d", m.QMPFD),
		"-mon", "chardev=qmp,mode=control",
		"-device", fmt.Sprintf("virtio-rng-pci,addr=%#x", initproto.RNGSlot),
		"-device", fmt.Sprintf("virtio-balloon-pci,id=balloon0,free-page-reporting=%s,deflate-on-oom=on,addr=%#x", onOff(!m.NoFreePageReporting), initproto.BalloonSlot),
	}
	if m.RAMFD > 0 {
		a = append(a, "-object", fmt.Sprintf("memory-backend-file,id=ram0,size=%dM,mem-path=/proc/self/fd/%d,share=on", m.Memory>>20, m.RAMFD))
	}
	if m.Incoming {
		a = append(a, "-incoming", "defer")
	}
	for i, l := range m.Layers {
		if m.LayerDisks {
			a = append(a,
				"-drive", fmt.Sprintf("file=%s,if=none,id=layer%d,format=raw,readonly=on,cache=none,aio=threads", qemuOpt(l.Path), i),
				"-device", fmt.Sprintf("virtio-blk-pci,drive=layer%d,addr=%#x", i, initproto.FirstLayerSlot+i))
			continue
		}
		a = append(a,
			"-object", fmt.Sprintf("memory-backend-file,id=layer%d,share=on,readonly=on,mem-path=%s,size=%d", i, qemuOpt(l.Path), l.Size),
			"-device", fmt.Sprintf("virtio-pmem-pci,memdev=layer%d,id=pmem%d,addr=%#x", i, i, initproto.FirstLayerSlot+i))
	}
	cache := "writeback"
	if m.Direct {
		cache = "none"
	}
	a = append(a,
		"-drive", fmt.Sprintf("file=%s,if=none,id=upper,format=raw,cache=%s,aio=threads,discard=unmap", qemuOpt(m.Upper), cache),
		"-device", fmt.Sprintf("virtio-blk-pci,drive=upper,serial=dsec-upper,addr=%#x", initproto.UpperSlot))
	return append(a, NICArgs(m.NetFD, m.Unplugged, m.MAC)...)
}

// NICArgs are QEMU's options of a guest's NIC (a microVM's or a full
// VM's): on the tap QEMU holds as fd, or unplugged (a hub of no other
// port: a saved guest's NIC, its sandbox reaching nothing); none with
// neither. mac is a checked address (layer.CheckMAC).
func NICArgs(fd int, unplugged bool, mac string) []string {
	var a []string
	switch {
	case fd > 0:
		a = append(a, "-netdev", fmt.Sprintf("tap,id=net0,fd=%d,vhost=off", fd))
	case unplugged:
		a = append(a, "-netdev", "hubport,id=net0,hubid=0")
	default:
		return nil
	}
	return append(a, "-device", fmt.Sprintf("virtio-net-pci,netdev=net0,romfile=,mac=%s,addr=%#x", mac, initproto.NetSlot))
}

func onOff(b bool) string {
	if b {
		return "on"
	}
	return "off"
}

// machine is -machine's value: q35, its RAM the backend ram0 when the
// guest's memory is a file.
func machine(ramFile bool) string {
	if ramFile {
		return "q35,memory-backend=ram0"
	}
	return "q35"
}

// memory is -m's value: the guest's RAM, and room past it for the pmem
// devices' regions (a slot each).
func memory(ram, pmem int64, n int) string {
	if pmem == 0 {
		return fmt.Sprintf("%dM", ram>>20)
	}
	return fmt.Sprintf("%dM,slots=%d,maxmem=%dM", ram>>20, n, (ram+pmem)>>20)
}

// qemuOpt escapes a value for QEMU's option syntax, where a comma is
// written twice.
func qemuOpt(s string) string { return strings.ReplaceAll(s, ",", ",,") }

// Firmware is the BIOS the guests boot through: qboot, which QEMU ships
// (qemu-system-data).
const Firmware = "/usr/share/qemu/qboot.rom"
