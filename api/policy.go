package api

import (
	"fmt"
	"strconv"
	"strings"
)

// PolicyVersion is the apiVersion of policy documents this API reads.
const PolicyVersion = "dsec/v1"

// Policy is a sandbox policy document (YAML or JSON; kind: Policy). A
// section left out keeps the secure default's; see dsec policy(5).
type Policy struct {
	APIVersion string          `json:"apiVersion" jsonschema:"enum=dsec/v1"`
	Kind       string          `json:"kind" jsonschema:"enum=Policy"`
	Metadata   *PolicyMetadata `json:"metadata,omitempty"`
	Files      *FilePolicy     `json:"files,omitempty"`
	Syscalls   *SyscallPolicy  `json:"syscalls,omitempty"`
	Network    *NetworkPolicy  `json:"network,omitempty"`
	Resources  *ResourcePolicy `json:"resources,omitempty"`
	Grading    *GradingPolicy  `json:"grading,omitempty"`
}

// PolicyMetadata names a policy.
type PolicyMetadata struct {
	Name string `json:"name,omitempty"`
}

// FilePolicy says what processes in the sandbox may do with paths of
// its root. Paths are absolute, inside the sandbox.
type FilePolicy struct {
	// ReadOnly paths (and what is under them) may be read and run,
	// never written, renamed or removed: read-only, nosuid bind mounts
	// in the sandbox's mount namespace, for every process at once.
	ReadOnly []string `json:"readOnly,omitempty"`
	// Hidden paths show nothing: an empty read-only directory, or a
	// file that cannot be opened, mounted over them, for every process
	// at once.
	Hidden []string `json:"hidden,omitempty"`
	// ReadWrite, when given, are the only trees processes may change
	// (create, write, truncate, rename, remove in); everything else is
	// read-only to them (Landlock, for the processes started after it
	// is applied). /dev and /proc stay writable as devices and procfs
	// allow.
	ReadWrite []string `json:"readWrite,omitempty"`
	// ToolkitWritable lifts the default that the toolkit layer's
	// paths are read-only (and nosuid).
	ToolkitWritable bool `json:"toolkitWritable,omitempty"`
}

// SyscallPolicy tightens the seccomp allowlist every sandbox runs under.
type SyscallPolicy struct {
	// Deny lists more system calls (by name, native architecture) that
	// fail with EPERM.
	Deny []string `json:"deny,omitempty"`
}

// NetworkPolicy is the sandbox's egress allowlist: what is not allowed
// is denied (connect and sendmsg fail with EPERM).
type NetworkPolicy struct {
	// Mode is how the sandbox is connected: loopback (the default: its
	// own loopback only) or nat (also eth0, a veth pair to the host,
	// masqueraded out). Either way the egress allowlist decides what its
	// processes may reach. It is fixed when the sandbox starts.
	Mode   string       `json:"mode,omitempty" jsonschema:"enum=loopback,enum=nat"`
	Egress []EgressRule `json:"egress"`
}

// Network modes.
const (
	NetworkLoopback = "loopback"
	NetworkNAT      = "nat"
)

// EgressRule allows traffic to an address range.
type EgressRule struct {
	// To is a CIDR (v4 or v6), an address, or a domain rule: a name
	// (pypi.org), "*.NAME" (exactly one label in front of NAME) or
	// "**.NAME" (any depth), NAME of two labels or more; names are
	// matched lowercase, without a trailing dot, internationalised ones
	// as punycode. A domain rule needs network mode nat: the sandbox's
	// DNS (any server it names) goes to a resolver of its own in the
	// worker, which answers only the names its domain rules allow
	// (NXDOMAIN for the rest, which never leave the host) and opens the
	// addresses it answers on the rule's ports until the answer's TTL
	// (at least dns.min_ttl) and dns.grace have passed; DNS over TLS
	// (853) and QUIC (UDP 443) stay closed to them. TCP 80 and 443 go by
	// name: the worker's proxy reads the TLS server name or HTTP Host,
	// refuses a name no rule allows there, and dials the name itself.
	// Other ports are address-level: another name on an address a rule's
	// name resolved to is reachable too on them. No rule opens the
	// deny set: link-local 169.254.0.0/16 (the metadata address) and
	// fe80::/10, dsec's NAT pool 10.200.0.0/16 (the host's gateways and
	// every other sandbox), multicast, 0.0.0.0/8 and broadcast, and, in
	// mode nat, every address of the host; a rule inside it is refused.
	// The private ranges 10/8, 172.16/12, 192.168/16, 100.64/10 and
	// fc00::/7 open only to a rule that names them or a part of them,
	// not to one that merely contains them (0.0.0.0/0).
	To string `json:"to"`
	// Ports are port numbers or "LOW-HIGH" ranges; none: every port.
	Ports []PortRange `json:"ports,omitempty"`
	// Protocol is tcp or udp; empty: both.
	Protocol string `json:"protocol,omitempty" jsonschema:"enum=tcp,enum=udp"`
}

// PortRange is a port or an inclusive range of ports.
type PortRange struct {
	Low, High uint16
}

// ResourcePolicy bounds what the sandbox may use; zero: no bound beyond
// the sandbox's own limits.
type ResourcePolicy struct {
	Pids   int     `json:"pids,omitempty"`
	Memory string  `json:"memory,omitempty"` // bytes, or with a unit: 512M, 2G
	CPU    float64 `json:"cpu,omitempty"`    // cores
	// Disk bounds what the sandbox writes (its upper): bytes or 16M, 10G.
	// At least 16 MiB. Applied to a running sandbox with a disk quota it
	// grows the quota at once; it cannot shrink one, or add one to a
	// sandbox made without.
	Disk string `json:"disk,omitempty"`
}

// MinDisk is the smallest disk quota: the file system holding the upper
// needs a few MiB of its own.
const MinDisk = 16 << 20

// PolicyReport says what applying a policy to a running sandbox did.
type PolicyReport struct {
	// Now: what took effect for every process of the sandbox at once.
	Now []string `json:"now"`
	// NewProcesses: what holds for processes started from now on only
	// (Landlock and seccomp cannot reach processes already running).
	NewProcesses []string `json:"new_processes"`
	// Unchanged: sections the new policy could not loosen.
	Unchanged []string `json:"unchanged,omitempty"`
}

// MarshalJSON writes a port as a number and a range as "LOW-HIGH".
func (p PortRange) MarshalJSON() ([]byte, error) {
	if p.Low == p.High {
		return strconv.AppendUint(nil, uint64(p.Low), 10), nil
	}
	return []byte(fmt.Sprintf(`"%d-%d"`, p.Low, p.High)), nil
}

// UnmarshalJSON reads 443, "443" or "8000-8100".
func (p *PortRange) UnmarshalJSON(b []byte) error {
	s := strings.Trim(string(b), `"`)
	lo, hi, isRange := strings.Cut(s, "-")
	if !isRange {
		hi = lo
	}
	l, err1 := strconv.ParseUint(strings.TrimSpace(lo), 10, 16)
	h, err2 := strconv.ParseUint(strings.TrimSpace(hi), 10, 16)
	if err1 != nil || err2 != nil || l == 0 || h < l {
		return fmt.Errorf("bad port %s: give a port 1-65535 or a range \"LOW-HIGH\"", b)
	}
	p.Low, p.High = uint16(l), uint16(h)
	return nil
}
