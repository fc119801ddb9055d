package policy

import (
	"fmt"
	"os"
	"slices"
	"sync"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/asm"
	"github.com/cilium/ebpf/link"
)

// The device allowlist is a BPF_PROG_TYPE_CGROUP_DEVICE program on each
// sandbox's cgroup2 directory: the kernel asks it before any open of a
// device node and any mknod, whichever hierarchy the sandbox's other
// controllers live in (on hybrid hosts it runs ahead of the v1 devices
// controller, which DevicesV1 sets too). One program serves every
// sandbox; like the egress programs it is attached without flags, so it
// stays with the cgroup when the worker dies and no sub-cgroup can
// replace it.

// struct bpf_cgroup_dev_ctx: access_type (type in the low 16 bits,
// access in the high), major, minor.
const (
	devCtxAccess = 0
	devCtxMajor  = 4
	devCtxMinor  = 8

	devTypeChar = 2 // BPF_DEVCG_DEV_CHAR
	accMknod    = 1 // BPF_DEVCG_ACC_MKNOD
)

func deviceProgram(allowed []Device) asm.Instructions {
	ins := asm.Instructions{
		asm.LoadMem(asm.R2, asm.R1, devCtxAccess, asm.Word),
		asm.Mov.Reg(asm.R3, asm.R2),
		asm.RSh.Imm(asm.R3, 16),
		// mknod alone is allowed: the node it makes opens only if
		// it is on the list below.
		asm.JEq.Imm(asm.R3, accMknod, "allow"),
		asm.And.Imm(asm.R2, 0xffff),
		asm.JNE.Imm(asm.R2, devTypeChar, "deny"),
		asm.LoadMem(asm.R4, asm.R1, devCtxMajor, asm.Word),
		asm.LoadMem(asm.R5, asm.R1, devCtxMinor, asm.Word),
	}
	for i, d := range allowed {
		next := fmt.Sprintf("dev%d", i+1)
		first := asm.JNE.Imm(asm.R4, int32(d.Major), next)
		if i > 0 {
			first = first.WithSymbol(fmt.Sprintf("dev%d", i))
		}
		ins = append(ins, first)
		if d.Minor >= 0 {
			ins = append(ins, asm.JNE.Imm(asm.R5, int32(d.Minor), next))
		}
		ins = append(ins, asm.Ja.Label("allow"))
	}
	return append(ins,
		asm.Mov.Imm(asm.R0, 0).WithSymbol(fmt.Sprintf("dev%d", len(allowed))),
		asm.Return(),
		asm.Mov.Imm(asm.R0, 0).WithSymbol("deny"),
		asm.Return(),
		asm.Mov.Imm(asm.R0, 1).WithSymbol("allow"),
		asm.Return(),
	)
}

// devicePrograms are the loaded programs, one per list of extra
// devices (almost always none).
var (
	deviceProgsMu sync.Mutex
	deviceProgs   = map[string]*ebpf.Program{}
)

func deviceProg(extra []Device) (*ebpf.Program, error) {
	key := fmt.Sprint(extra)
	deviceProgsMu.Lock()
	defer deviceProgsMu.Unlock()
	if p := deviceProgs[key]; p != nil {
		return p, nil
	}
	p, err := ebpf.NewProgram(&ebpf.ProgramSpec{Name: "dsec_devices", Type: ebpf.CGroupDevice,
		AttachType: ebpf.AttachCGroupDevice, Instructions: deviceProgram(append(slices.Clip(DeviceAllow), extra...)), License: "GPL"})
	if err != nil {
		return nil, fmt.Errorf("load the device allowlist: %w", notSupported(err))
	}
	deviceProgs[key] = p
	return p, nil
}

// ApplyDevices holds the cgroup2 directory cg to the device allowlist,
// and extra. A cgroup that carries a device program already (a worker
// since dead put it there) keeps it.
func ApplyDevices(cg string, extra ...Device) error {
	dir, err := os.Open(cg)
	if err != nil {
		return fmt.Errorf("open the sandbox's cgroup: %w", err)
	}
	defer dir.Close()
	if DevicesAttached(cg) {
		return nil
	}
	prog, err := deviceProg(extra)
	if err != nil {
		return err
	}
	if err := link.RawAttachProgram(link.RawAttachProgramOptions{Target: int(dir.Fd()), Program: prog, Attach: ebpf.AttachCGroupDevice}); err != nil {
		return fmt.Errorf("attach the device allowlist: %w", notSupported(err))
	}
	return nil
}

// DevicesAttached says whether the cgroup carries a device program.
func DevicesAttached(cg string) bool { return attachedAll(cg, ebpf.AttachCGroupDevice) }
