package vms

import (
	"encoding/json"
	"fmt"
	"strconv"
	"strings"

	"github.com/dsec-project/dsec/internal/runtime/initproto"
	"github.com/dsec-project/dsec/internal/runtime/microvm"
	"github.com/dsec-project/dsec/internal/runtime/vm"
)

// Machine is a full VM's QEMU machine: q35 booted through UEFI firmware
// (OVMF) from its own disk, the copy-on-write overlay of its image, with
// the agent's disk and port beside it.
type Machine struct {
	QEMU   string
	Accel  string // microvm.AccelKVM or AccelTCG
	CPUs   int
	Memory int64 // bytes
	// Code and Vars are the firmware's code (read-only, shared) and the
	// machine's own copy of its variable store.
	Code, Vars string
	// Base is the image's disk, a chain of qcow2 images topmost first
	// (read-only, shared); Disk the sandbox's own top over it, which the
	// guest boots from and writes; AgentDisk the read-only disk holding
	// the agent (vm.AgentDiskSerial).
	Base            []string
	Disk, AgentDisk string
	// AgentFD and QMPFD are QEMU's fds of the agent's port and of QMP.
	AgentFD, QMPFD int
	// VNC is the unix socket QEMU's VNC server listens on ("": none),
	// which only the worker reaches (a grant's WebSocket).
	VNC string
	// NetFD is the tap's fd (0: no NIC), MAC its guest's address.
	NetFD int
	MAC   string
	// Unplugged: the guest has a NIC on no network (a saved guest's
	// that had one, its sandbox now reaching nothing).
	Unplugged bool
	// Incoming: QEMU waits for a saved guest's device state and RAM (a
	// migration stream, migrate-incoming) before the guest runs.
	Incoming bool
}

// Args is QEMU's command line for m.
func (m Machine) Args() []string {
	accel, cpu := "tcg,tb-size=64", "qemu64" // a 64 MiB code cache, not the default 1 GiB
	if m.Accel == microvm.AccelKVM {
		accel, cpu = "kvm", "host"
	}
	a := []string{m.QEMU, "-nodefaults", "-no-user-config", "-display", "none", "-no-reboot",
		"-sandbox", "on,obsolete=deny,elevateprivileges=deny,spawn=deny,resourcecontrol=deny",
		"-machine", "q35", "-accel", accel, "-cpu", cpu,
		"-smp", strconv.Itoa(max(m.CPUs, 1)), "-m", fmt.Sprintf("%dM", m.Memory>>20),
		"-drive", "if=pflash,format=raw,unit=0,readonly=on,file=" + opt(m.Code),
		"-drive", "if=pflash,format=raw,unit=1,file=" + opt(m.Vars),
		"-serial", "stdio",
		"-chardev", fmt.Sprintf("socket,id=agent,fd=%d", m.AgentFD),
		"-device", fmt.Sprintf("virtio-serial-pci,id=serial0,addr=%#x", initproto.SerialSlot),
		"-device", "virtserialport,chardev=agent,name=" + microvm.AgentPort,
		"-chardev", fmt.Sprintf("socket,id=qmp,fd=%d", m.QMPFD),
		"-mon", "chardev=qmp,mode=control",
		"-device", fmt.Sprintf("virtio-rng-pci,addr=%#x", initproto.RNGSlot),
		// The screen (std VGA: OVMF's and Linux's framebuffer), and a
		// tablet for the pointer's absolute moves; the keyboard is the
		// machine's own (PS/2).
		"-device", fmt.Sprintf("VGA,addr=%#x", displaySlot), "-device", fmt.Sprintf("virtio-tablet-pci,addr=%#x", displaySlot+1),
		"-device", fmt.Sprintf("virtio-balloon-pci,id=balloon0,free-page-reporting=on,deflate-on-oom=on,addr=%#x", initproto.BalloonSlot),
	}
	// The disk's chain, stacked here (no image of it names its backing
	// file), base first; past the disk bound the guest gets an I/O error
	// (werror=report), not a paused VM.
	backing := any(nil)
	for i := len(m.Base) - 1; i >= 0; i-- {
		name := fmt.Sprintf("base%d", len(m.Base)-1-i)
		a = append(a, "-blockdev", blockdev(map[string]any{"driver": "qcow2", "node-name": name, "read-only": true, "backing": backing,
			"file": map[string]any{"driver": "file", "filename": m.Base[i], "aio": "threads"}}))
		backing = name
	}
	top := TopNode(len(m.Base))
	a = append(a, "-blockdev", blockdev(map[string]any{"driver": "qcow2", "node-name": top, "backing": backing, "discard": "unmap",
		"file": map[string]any{"driver": "file", "filename": m.Disk, "aio": "threads", "discard": "unmap"}}),
		"-device", fmt.Sprintf("virtio-blk-pci,id=vdisk,drive=%s,bootindex=0,werror=report,addr=%#x", top, initproto.UpperSlot),
		"-drive", fmt.Sprintf("file=%s,if=none,id=agent,format=raw,readonly=on", opt(m.AgentDisk)),
		"-device", fmt.Sprintf("virtio-blk-pci,drive=agent,serial=%s,addr=%#x", vm.AgentDiskSerial, agentDiskSlot))
	if m.VNC != "" {
		a = append(a, "-vnc", "unix:"+opt(m.VNC))
	}
	a = append(a, microvm.NICArgs(m.NetFD, m.Unplugged, m.MAC)...)
	if m.Incoming {
		a = append(a, "-incoming", "defer")
	}
	return a
}

// TopNode is QEMU's name of the top of a disk whose chain below it is
// depth images: the machine's, and each a snapshot stacks (depth+1),
// so that the worker names the top its state says.
func TopNode(depth int) string { return fmt.Sprintf("top%d", depth) }

// agentDiskSlot is the agent's disk's PCI slot: the one initproto's
// slots leave free between the NIC's and the first layer's.
const agentDiskSlot = initproto.NetSlot + 1

// displaySlot is the display's PCI slot, and the tablet's the next: the
// layers' slots (initproto.FirstLayerSlot on), which a full VM, booting
// its own disk, leaves free.
const displaySlot = initproto.FirstLayerSlot

// blockdev is a -blockdev option in QEMU's JSON form (no quoting of
// paths, a null backing).
func blockdev(o map[string]any) string {
	b, _ := json.Marshal(o)
	return string(b)
}

// opt quotes a value of a QEMU option: a comma is doubled.
func opt(s string) string { return strings.ReplaceAll(s, ",", ",,") }
