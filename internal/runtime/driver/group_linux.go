package driver

import (
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"sync"

	"github.com/dsec-project/dsec/internal/policy"
	"github.com/dsec-project/dsec/internal/runtime/cgroup"
	"github.com/dsec-project/dsec/internal/runtime/initproto"
	"github.com/dsec-project/dsec/internal/runtime/network"
)

// NewGroup makes a sandbox's cgroup, held to the device allowlist
// before any process is in it: the cgroup2 program at once, the v1
// devices controller's lines (defence in depth, where the host mounts
// one) by devices, which writes them meanwhile and says how that went.
// extra are the devices its backend needs beyond a sandbox's own
// (/dev/kvm for a hypervisor). It is made in t.
func NewGroup(t *cgroup.Tree, name string, l cgroup.Limits, extra ...policy.Device) (g *cgroup.Group, devices func() error, err error) {
	g, err = t.New(name, WithInit(l))
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

// GroupSuffix ends the name of every group of root's sandboxes: the
// root's identity (RootID).
func GroupSuffix(root string) string { return "-" + RootID(root) }

// RootID is the root's identity on its host, 8 hex digits, so that two
// roots on one kernel never name their sandboxes' groups alike, even at
// one path (two pods' containers, each with its /var/lib/dsec): drawn at
// random and kept in <root>/root-id the first time it is asked. A root
// used before it (whose sandboxes or spares have groups already) keeps
// what their names bear, the hash of its path; so does a root that does
// not exist yet.
func RootID(root string) string {
	abs, _ := filepath.Abs(root)
	if id, ok := rootIDs.Load(abs); ok {
		return id.(string)
	}
	h := sha256.Sum256([]byte(abs))
	byPath := hex.EncodeToString(h[:4])
	p := filepath.Join(abs, "root-id")
	b, err := os.ReadFile(p)
	if errors.Is(err, fs.ErrNotExist) {
		if st, serr := os.Stat(abs); serr != nil || !st.IsDir() {
			return byPath // (not kept: the root may be made later)
		}
		id := byPath
		old, _ := os.ReadDir(filepath.Join(abs, "sandboxes"))
		// (An older dsec's groups, named by the path: under the default
		// parent, as those of a root without a root-id always were.)
		if groups, _ := (*cgroup.Tree)(nil).List("", "-"+byPath); len(old) == 0 && len(groups) == 0 {
			id = RandomName("")[:8]
		}
		// Published whole (a link fails if another made it meanwhile),
		// then read back: whoever made it first.
		tmp := p + "." + RandomName("")
		if werr := os.WriteFile(tmp, []byte(id+"\n"), 0o600); werr == nil {
			os.Link(tmp, p)
		}
		os.Remove(tmp)
		b, err = os.ReadFile(p)
	}
	id := strings.TrimSpace(string(b))
	if err != nil || len(id) != 8 || strings.Trim(id, "0123456789abcdef") != "" {
		return byPath // (unreadable or not ours: not kept, asked again)
	}
	rootIDs.Store(abs, id)
	return id
}

// rootIDs are the roots' identities, once read.
var rootIDs sync.Map

// UpNIC is a VM's network in network mode nat (StartSpec.NAT): a tap
// on the host for slot (network.UpTap), filtered by the sandbox's
// allowlist in group g (policy.ApplyTap), and the guest's end of it.
// QEMU gets the tap, which the caller closes once QEMU holds it; the
// NAT is the sandbox's way out (Started.NAT), whatever fails after.
func UpNIC(g *cgroup.Group, slot string) (*network.NAT, *os.File, *initproto.GuestNet, error) {
	nat, tap, err := network.UpTap(slot)
	if err != nil {
		return nil, nil, nil, err
	}
	if err := policy.ApplyTap(g.Path(), nat.Link); err != nil {
		tap.Close()
		return nat, nil, nil, err
	}
	return nat, tap, &initproto.GuestNet{Addr: nat.Sandbox + "/30", Gateway: nat.Host, MAC: nat.MAC()}, nil
}
