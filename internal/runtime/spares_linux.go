package runtime

import (
	"context"
	"errors"
	"fmt"
	"path/filepath"
	"slices"
	"sync"

	"github.com/dsec-project/dsec/internal/policy"
	"github.com/dsec-project/dsec/internal/runtime/cgroup"
	"github.com/dsec-project/dsec/internal/runtime/container"
	"github.com/dsec-project/dsec/internal/runtime/warm"
)

// Spares are sandbox inits a worker starts ahead of need, each already in
// a cgroup of its own. Most of what starting a sandbox costs is starting
// the re-executed binary and moving it into its cgroups (on cgroup v1
// every move waits for an RCU grace period, ~10 ms here for the five
// hierarchies); a spare has done both before the create comes, which
// then only writes the group's limits and hands the init its root.
// Latency-class sandboxes take spares; batch ones, whose CPU group lives
// under the idle parent, start their own.
type Spares struct {
	root string
	pool *warm.Pool[*spare]
}

// spare is an init in the group of the sandbox ID id, which the sandbox
// that takes it has.
type spare struct {
	init *container.Spare
	g    *cgroup.Group
	id   string
}

// Groups names the groups of root's sandboxes that an older dsec did
// not make, and of its spares, waiting or taken: named by an ID.
func Groups(root string) ([]string, error) {
	return cgroup.List("sb-"+idTag, CgroupSuffix(root))
}

// CgroupSuffix ends the name of every group of root's sandboxes.
func CgroupSuffix(root string) string { return "-" + rootHash(root) }

// StartSpares keeps n spare inits ready for the sandboxes of root.
// Creates start their own inits while there are none, and meet the
// host's error, if making spares fails for the host's sake, themselves.
func StartSpares(root string, n int) *Spares {
	s := &Spares{root: root}
	s.pool = warm.New(warm.Config[*spare]{Size: n, Make: s.start, RefillOnTake: true,
		Usable:  func(sp *spare) bool { return sp.init.Alive() },
		Discard: (*spare).discard})
	return s
}

func (s *Spares) start(context.Context) (*spare, error) {
	id := newID()
	g, devices, err := newGroup(cgroupName(s.root, id), cgroup.Limits{})
	if err == nil {
		if err = devices(); err != nil {
			g.Remove()
		}
	}
	if err != nil {
		return nil, err
	}
	init, err := container.Prestart(g.Add, nil)
	if err != nil {
		g.Kill()
		g.Remove()
		return nil, fmt.Errorf("spare init: %w", err)
	}
	return &spare{init: init, g: g, id: id}, nil
}

// newGroup makes a sandbox's cgroup, held to the device allowlist before
// any process is in it: the cgroup2 program at once, the v1 devices
// controller's lines (defence in depth, where the host mounts one) by
// the time devices returns, which the caller waits for before the
// sandbox runs anything of its own (the lines cost ~0.3 ms of writes,
// which overlap the init's start). Every sandbox gets its group here, a
// spare's included, and a re-adopted one keeps what it was given.
func newGroup(name string, l cgroup.Limits, extra ...policy.Device) (g *cgroup.Group, devices func() error, err error) {
	g, err = cgroup.New(name, withInit(l))
	if err != nil {
		return nil, nil, err
	}
	if noDevices { // a benchmark's baseline only
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

// InitPids is what a sandbox's pids limit holds for its init's own
// threads (a Go program: 9 on this 2-CPU host) on top of the user's: a
// sandbox made with --pids N runs N processes and threads of its own.
const InitPids = 16

// withInit is l as its group takes it: the pids limit with the init's
// share added.
func withInit(l cgroup.Limits) cgroup.Limits {
	if l.Pids > 0 {
		l.Pids += InitPids
	}
	return l
}

// noDevices leaves the device allowlist out: BenchmarkDevices' baseline,
// set by its test file alone.
var noDevices bool

// take returns a ready spare, or nil when none is.
func (s *Spares) take() *spare {
	if s == nil {
		return nil
	}
	sp, _ := s.pool.Take()
	return sp
}

func (sp *spare) discard() {
	sp.init.Discard()
	sp.g.Kill()
	sp.g.Remove()
}

// Ready counts the spares waiting to be taken. Nil-safe.
func (s *Spares) Ready() int {
	if s == nil {
		return 0
	}
	return s.pool.Stats().Ready
}

// Close stops making spares and kills those waiting.
func (s *Spares) Close() {
	for _, sp := range s.pool.Close() {
		sp.discard()
	}
}

// SweepSpares removes the groups named by an ID that a worker of root
// left when it died (its spares exit when it does; their groups stay;
// and a sandbox's, a worker died making), but for those keep names, the
// groups of the sandboxes kept. With spareLive a group that still holds
// processes is left alone: a worker that could not read every sandbox's
// state does not know all it keeps.
func SweepSpares(root string, keep []string, spareLive bool) error {
	names, err := Groups(root)
	if err != nil {
		return err
	}
	var errs []error
	for _, name := range names {
		if slices.Contains(keep, name) {
			continue
		}
		g, err := cgroup.Open(name)
		if err != nil { // only v1 directories left (an older worker's Remove)
			if err := cgroup.RemoveLeftover(name); err != nil {
				errs = append(errs, fmt.Errorf("group %s: %w", filepath.Base(name), err))
			}
			continue
		}
		if pids, _ := g.Pids(); spareLive && len(pids) > 0 {
			continue
		}
		if err := errors.Join(g.Kill(), g.Remove()); err != nil {
			errs = append(errs, fmt.Errorf("group %s: %w", filepath.Base(name), err))
		}
	}
	return errors.Join(errs...)
}
