package layer

import (
	"strings"
	"testing"
)

// TestMachineRuns: a saved guest runs only on the machine it was saved
// on (accelerator, QEMU build, kernel or firmware, layer devices, the
// agent a full VM reads from the host's disk, the processor a guest saw
// under KVM), and never with a NIC's
// address that is no address (it goes on QEMU's command line).
func TestMachineRuns(t *testing.T) {
	here := Machine{Accel: "tcg", QEMU: "8.2", QEMUDigest: "sha256:q", Kernel: "ovmf", KernelDigest: "sha256:k", Agent: "sha256:a"}
	for _, c := range []struct {
		saved func(*Machine)
		says  string
	}{
		{func(*Machine) {}, ""},
		{func(m *Machine) { m.MAC = "02:00:00:00:00:01" }, ""},
		{func(m *Machine) { m.Accel = "kvm" }, "it ran under kvm"},
		{func(m *Machine) { m.QEMUDigest = "sha256:other" }, "another QEMU build"},
		{func(m *Machine) { m.KernelDigest = "sha256:other" }, "another guest kernel"},
		{func(m *Machine) { m.Agent = "sha256:other" }, "agent's disk was another"},
		{func(m *Machine) { m.MAC = "02:00:00:00:00:01,romfile=/etc/shadow" }, "not a hardware address"},
		{func(m *Machine) { m.MAC = "02:00:00:00:00:0G" }, "not a hardware address"},
		{func(m *Machine) { m.MAC = "02:00:00:00:00:01\n" }, "not a hardware address"},
		{func(m *Machine) { m.Accel, m.CPU = "kvm", "GenuineIntel Xeon [flags 01]" }, "it ran under kvm"},
	} {
		saved := here
		c.saved(&saved)
		if why := saved.Runs(here); c.says == "" && why != "" || !strings.Contains(why, c.says) {
			t.Errorf("%+v on %+v: %q, want %q", saved, here, why, c.says)
		}
	}
	// Under KVM, the processor ("": saved by an older dsec, which did
	// not record it).
	kvm := here
	kvm.Accel, kvm.CPU = "kvm", "GenuineIntel Xeon [flags 01]"
	for cpu, says := range map[string]string{
		"GenuineIntel Xeon [flags 01]": "",
		"":                             "",
		"GenuineIntel Xeon [flags 02]": "another processor (GenuineIntel Xeon [flags 02]), this host's is GenuineIntel Xeon [flags 01]",
		"AuthenticAMD EPYC [flags 01]": "another processor",
	} {
		saved := kvm
		saved.CPU = cpu
		if why := saved.Runs(kvm); says == "" && why != "" || !strings.Contains(why, says) {
			t.Errorf("saved on %q, here %q: %q, want %q", cpu, kvm.CPU, why, says)
		}
	}
}
