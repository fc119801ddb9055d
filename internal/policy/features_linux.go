package policy

import (
	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/features"

	"github.com/dsec-project/dsec/internal/feature"
)

// The BPF features policies need (package feature).
var (
	// EgressBPF is cgroup sock_addr programs: the egress allowlist.
	EgressBPF = feature.New("bpf cgroup/sock_addr", "sandboxes cannot be made: every sandbox's egress is held by it", func() error {
		return features.HaveProgramType(ebpf.CGroupSockAddr)
	})
	// DevicesBPF is cgroup device programs: the device allowlist on
	// cgroup v2.
	DevicesBPF = feature.New("bpf cgroup/dev", "sandboxes cannot be made: every sandbox's devices are held by it", func() error {
		return features.HaveProgramType(ebpf.CGroupDevice)
	})
)
