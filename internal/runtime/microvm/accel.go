package microvm

import (
	"bytes"
	"fmt"
	"os"
	"sync"

	"github.com/containerd/errdefs"
)

// Accel is how QEMU runs a guest's CPU: "kvm" (hardware virtualization:
// at speed) or "tcg" (QEMU's translator: the same guest, devices and
// code paths, some 20-50 times slower), and why this host runs it so.
type Accel struct {
	Name string `json:"name"`
	Why  string `json:"why"`
}

// Accelerators a configuration may name.
const (
	AccelAuto = "auto"
	AccelKVM  = "kvm"
	AccelTCG  = "tcg"
)

// DetectAccel picks the accelerator the host can run a Debian guest
// with: KVM where /dev/kvm is hardware virtualization (vmx or svm in
// the CPU's flags), else TCG. A /dev/kvm from PVM (a software KVM,
// /sys/module/kvm_pvm) boots only guest kernels patched for it, and a
// stock kernel hangs there: it is not used.
var DetectAccel = sync.OnceValue(func() Accel {
	return detectAccel("/dev/kvm", "/proc/cpuinfo", "/sys/module/kvm_pvm")
})

func detectAccel(kvm, cpuinfo, pvm string) Accel {
	f, err := os.OpenFile(kvm, os.O_RDWR, 0)
	if err != nil {
		return Accel{AccelTCG, fmt.Sprintf("no usable %s (%v)", kvm, err)}
	}
	f.Close()
	if _, err := os.Stat(pvm); err == nil {
		return Accel{AccelTCG, kvm + " is PVM, a software KVM that boots only guest kernels patched for it; a stock kernel hangs there"}
	}
	b, _ := os.ReadFile(cpuinfo)
	for _, l := range bytes.Split(b, []byte{'\n'}) {
		if !bytes.HasPrefix(l, []byte("flags")) {
			continue
		}
		for _, fl := range bytes.Fields(l) {
			if string(fl) == "vmx" || string(fl) == "svm" {
				return Accel{AccelKVM, "hardware virtualization (" + string(fl) + ")"}
			}
		}
		break
	}
	return Accel{AccelTCG, "the CPU has no hardware virtualization (no vmx or svm flag)"}
}

// ChooseAccel is the accelerator a configuration asks for (auto, kvm,
// tcg, or "" for auto). Asking for kvm where the host has no /dev/kvm
// is an error; where it has one DetectAccel would not use (PVM), it is
// the user's choice, and a guest that does not come up in time says so.
func ChooseAccel(want string) (Accel, error) {
	switch want {
	case "", AccelAuto:
		return DetectAccel(), nil
	case AccelTCG:
		return Accel{AccelTCG, "asked for (microvm.accel)"}, nil
	case AccelKVM:
		if f, err := os.OpenFile("/dev/kvm", os.O_RDWR, 0); err != nil {
			return Accel{}, fmt.Errorf("microvm.accel is kvm, but /dev/kvm cannot be opened (%v): use auto or tcg: %w", err, errdefs.ErrNotImplemented)
		} else {
			f.Close()
		}
		return Accel{AccelKVM, "asked for (microvm.accel)"}, nil
	}
	return Accel{}, fmt.Errorf("microvm.accel %q: give auto, kvm or tcg: %w", want, errdefs.ErrInvalidArgument)
}
