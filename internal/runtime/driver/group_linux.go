package driver

import (
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"path/filepath"
	"sync"

	"github.com/dsec-project/dsec/internal/policy"
	"github.com/dsec-project/dsec/internal/runtime/cgroup"
)

// NewGroup makes a sandbox's cgroup, held to the device allowlist
// before any process is in it: the cgroup2 program at once, the v1
// devices controller's lines (defence in depth, where the host mounts
// one) by devices, which writes them meanwhile and says how that went.
// extra are the devices its backend needs beyond a sandbox's own
// (/dev/kvm for a hypervisor).
func NewGroup(name string, l cgroup.Limits, extra ...policy.Device) (g *cgroup.Group, devices func() error, err error) {
	g, err = cgroup.New(name, WithInit(l))
	if err != nil {
		return nil, nil, err
	}
	if NoDevices { // a benchmark's baseline only
		return g, func() error { return nil }, nil
	}
	if err := policy.ApplyDevices(g.Path(), extra...); err != nil {
		g.Remove()
		return nil, nil, err
	}
	done := make(chan error, 1)
	go func() { done <- g.AllowDevices(policy.DevicesV1(extra...)) }()
	return g, sync.OnceValue(func() error { return <-done }), nil
}

// Adder is g.Add once devices (NewGroup's) has written the group's v1
// device lines: a process put in the group before them could open a
// device in the moment between the v1 controller's deny-all and its
// allow lines (a container init's /dev/null, EPERM, under a burst).
func Adder(g *cgroup.Group, devices func() error) func(pid int) error {
	return func(pid int) error {
		if err := devices(); err != nil {
			return fmt.Errorf("device allowlist: %w", err)
		}
		return g.Add(pid)
	}
}

// NoDevices leaves the device allowlist out of new groups: a
// benchmark's baseline, set by a test alone.
var NoDevices bool

// InitPids is what a sandbox's pids limit holds for its init's own
// threads (a Go program: 9 on this 2-CPU host) on top of the user's: a
// sandbox made with --pids N runs N processes and threads of its own.
const InitPids = 16

// WithInit is l as a sandbox's group takes it: the pids limit with the
// init's share added.
func WithInit(l cgroup.Limits) cgroup.Limits {
	if l.Pids > 0 {
		l.Pids += InitPids
	}
	return l
}

// IDTag starts every sandbox ID: no name starts with it.
const IDTag = "_"

// NewID is a new sandbox ID.
func NewID() string { return RandomName(IDTag) }

// RandomName is prefix and 12 random hex digits: a name for a sandbox,
// a spare's group or a primed sandbox that no other takes.
func RandomName(prefix string) string {
	b := make([]byte, 6)
	rand.Read(b)
	return prefix + hex.EncodeToString(b)
}

// GroupName is the group of the sandbox id, unique per root, so that
// two roots on a host (two workers, two test runs) never share a group.
func GroupName(root, id string) string { return "sb-" + id + GroupSuffix(root) }

// GroupSuffix ends the name of every group of root's sandboxes.
func GroupSuffix(root string) string {
	abs, _ := filepath.Abs(root)
	h := sha256.Sum256([]byte(abs))
	return "-" + hex.EncodeToString(h[:4])
}
