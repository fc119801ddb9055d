package layer

import (
	"fmt"
	"regexp"
	"slices"

	"github.com/containerd/errdefs"

	"github.com/dsec-project/dsec/api"
	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
)

// Media types of a memory snapshot's blobs.
const (
	// MediaTypeVMState is QEMU's migration stream of a guest's devices
	// (and of its RAM, when the guest's RAM is not a file of its own).
	MediaTypeVMState = "application/vnd.dsec.microvm.state.v1"
	// MediaTypeVMRAM and MediaTypeVMDisk are sparse images (package
	// sparse) of the guest's RAM and of its upper's disk.
	MediaTypeVMRAM  = "application/vnd.dsec.microvm.ram.v1+sparse"
	MediaTypeVMDisk = "application/vnd.dsec.microvm.disk.v1+sparse"
)

// Memory is what a memory snapshot (a microVM's, pack-diff --memory)
// keeps beside its disk diff: the guest as it was, devices, RAM and
// disk, and the machine a host must run to start it again where it
// stopped. The snapshot's layer (the diff) still starts a sandbox of
// any backend on its files alone.
type Memory struct {
	State ocispec.Descriptor  `json:"state"`
	RAM   *ocispec.Descriptor `json:"ram,omitempty"` // none: in State
	Disk  ocispec.Descriptor  `json:"disk"`
	// Layers are the guest's layer devices, topmost first: every one
	// is among the lineage's Lowers.
	Layers []Lower `json:"layers"`
	// DiskBytes is the size of its upper's disk.
	DiskBytes int64 `json:"disk_bytes"`
	Machine
	// Policy is the sandbox's effective policy: its file and syscall
	// rules are in the guest's memory, and hold in every branch.
	Policy *api.Policy `json:"policy,omitempty"`
	// Nonce is what the guest's agent waits for, to take a new session.
	Nonce string `json:"nonce"`
}

// Machine is a microVM as its sandbox ran it, what a guest saved from
// it needs again: its RAM, vCPUs and devices, and the accelerator,
// guest kernel and QEMU, each by name and by the digest of its file
// (another build of either does not take the guest's state, or runs
// other code over its memory).
type Machine struct {
	MemoryBytes int64  `json:"memory_bytes"`
	CPUs        int    `json:"cpus"`
	LayerDisks  bool   `json:"layer_disks,omitempty"`
	MAC         string `json:"mac,omitempty"` // its NIC's ("": none)
	// RAMFile: its RAM is a memory file (saved as an image of its own),
	// not anonymous memory (saved in the device state: KSM merges it).
	RAMFile      bool          `json:"ram_file,omitempty"`
	Accel        string        `json:"accel"`
	Kernel       string        `json:"kernel"`
	KernelDigest digest.Digest `json:"kernel_digest"`
	QEMU         string        `json:"qemu"`
	QEMUDigest   digest.Digest `json:"qemu_digest"`
	// Agent is the disk of the host's the guest reads its agent from
	// (a full VM's; a microVM's is in its RAM).
	Agent digest.Digest `json:"agent,omitempty"`
	// CPU is the host's processor as the guest saw it under KVM (its
	// model and a digest of its features: -cpu host shows the host's
	// own); "" under TCG, whose processor is the same on every host.
	CPU string `json:"cpu,omitempty"`
}

// MaxCPU bounds what a machine says of its processor (untrusted in a
// pulled snapshot).
const MaxCPU = 256

// macAddr is a NIC's address as a machine records it: QEMU's command
// line takes it, so nothing but the address may pass.
var macAddr = regexp.MustCompile(`^[0-9a-f]{2}(:[0-9a-f]{2}){5}$`)

// CheckMAC refuses a NIC's address that is not one ("": no NIC).
func CheckMAC(mac string) error {
	if mac != "" && !macAddr.MatchString(mac) {
		return fmt.Errorf("its NIC's address %q is not a hardware address (six lower-case hex pairs): %w", mac, errdefs.ErrInvalidArgument)
	}
	return nil
}

// Runs says why a guest saved on m cannot run on n ("": it can).
func (m Machine) Runs(n Machine) string {
	switch {
	case m.Accel != n.Accel:
		return fmt.Sprintf("it ran under %s, this host runs %s", m.Accel, n.Accel)
	case m.QEMUDigest != n.QEMUDigest:
		return fmt.Sprintf("it ran on another QEMU build (%s, %s), this host runs %s (%s)", m.QEMU, m.QEMUDigest, n.QEMU, n.QEMUDigest)
	case m.KernelDigest != n.KernelDigest:
		return fmt.Sprintf("it ran another guest kernel (%s, %s), this host runs %s (%s)", m.Kernel, m.KernelDigest, n.Kernel, n.KernelDigest)
	case m.LayerDisks != n.LayerDisks:
		return "its layers were other devices (microvm.layer_disks differs)"
	case m.Agent != n.Agent:
		return fmt.Sprintf("its guest agent's disk was another (%s), this host's is %s: another dsec's agent, or another mke2fs", m.Agent, n.Agent)
	case m.CPU != n.CPU && m.CPU != "" && n.CPU != "": // ("": an older dsec's record)
		return fmt.Sprintf("it ran on another processor (%s), this host's is %s: under KVM a guest sees its host's own, and may use what this one lacks", m.CPU, n.CPU)
	case CheckMAC(m.MAC) != nil:
		return CheckMAC(m.MAC).Error()
	}
	return ""
}

// Blobs are the memory snapshot's blobs.
func (m *Memory) Blobs() []ocispec.Descriptor {
	out := []ocispec.Descriptor{m.State, m.Disk}
	if m.RAM != nil {
		out = append(out, *m.RAM)
	}
	return out
}

// Bounds on what a memory snapshot may say.
const (
	maxVMBytes = 1 << 40
	maxVMCPUs  = 1024
)

// check validates a memory snapshot's record against its lineage, as
// untrusted input.
func (m *Memory) check(l *Lineage) error {
	bad := func(format string, a ...any) error {
		return fmt.Errorf("snapshot config: memory: "+format+": %w", append(a, errdefs.ErrDataLoss)...)
	}
	blob := func(d ocispec.Descriptor, mt string) error {
		if d.MediaType != mt || d.Digest.Validate() != nil || d.Size < 0 || d.Size > maxVMBytes {
			return bad("blob %s %q of %d bytes (want a %s)", d.MediaType, d.Digest, d.Size, mt)
		}
		return nil
	}
	if err := blob(m.State, MediaTypeVMState); err != nil {
		return err
	}
	if err := blob(m.Disk, MediaTypeVMDisk); err != nil {
		return err
	}
	if m.RAM != nil {
		if err := blob(*m.RAM, MediaTypeVMRAM); err != nil {
			return err
		}
	}
	if (m.RAM != nil) != m.RAMFile {
		return bad("a RAM image %v for a RAM file %v", m.RAM != nil, m.RAMFile)
	}
	if err := CheckMAC(m.MAC); err != nil {
		return bad("%v", err)
	}
	if len(m.CPU) > MaxCPU {
		return bad("a processor's description of %d bytes", len(m.CPU))
	}
	if m.MemoryBytes <= 0 || m.MemoryBytes > maxVMBytes || m.DiskBytes <= 0 || m.DiskBytes > maxVMBytes || m.CPUs < 1 || m.CPUs > maxVMCPUs {
		return bad("a machine of %d bytes of RAM, %d of disk and %d vCPUs", m.MemoryBytes, m.DiskBytes, m.CPUs)
	}
	if len(m.Layers) == 0 || len(m.Layers) > len(l.Lowers) {
		return bad("%d layer devices over a lineage of %d layers", len(m.Layers), len(l.Lowers))
	}
	for _, lo := range m.Layers {
		if !slices.Contains(l.Lowers, lo) {
			return bad("layer device %s@%s is not in its lineage", lo.Ref, lo.Digest)
		}
	}
	if m.KernelDigest.Validate() != nil || m.QEMUDigest.Validate() != nil || m.Nonce == "" || len(m.Nonce) > 128 {
		return bad("no kernel, QEMU or nonce")
	}
	return nil
}
