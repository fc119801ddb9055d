package containers

import (
	"context"
	"fmt"

	"github.com/dsec-project/dsec/internal/runtime/cgroup"
	"github.com/dsec-project/dsec/internal/runtime/container"
	"github.com/dsec-project/dsec/internal/runtime/driver"
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
	t    *cgroup.Tree
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

// StartSpares keeps n spare inits ready for the sandboxes of root, their
// groups in t.
// Creates start their own inits while there are none, and meet the
// host's error, if making spares fails for the host's sake, themselves.
func StartSpares(t *cgroup.Tree, root string, n int) *Spares {
	s := &Spares{t: t, root: root}
	s.pool = warm.New(warm.Config[*spare]{Size: n, Make: s.start, RefillOnTake: true,
		Usable:  func(sp *spare) bool { return sp.init.Alive() },
		Discard: (*spare).Discard})
	return s
}

func (s *Spares) start(context.Context) (*spare, error) {
	id := driver.NewID()
	g, devices, err := driver.NewGroup(s.t, driver.GroupName(s.root, id), cgroup.Limits{})
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

// take returns a ready spare, or nil when none is.
func (s *Spares) take() *spare {
	if s == nil {
		return nil
	}
	sp, _ := s.pool.Take()
	return sp
}

// Discard drops a spare no Start took.
func (sp *spare) Discard() {
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

// Close stops making spares and kills those waiting. Nil-safe.
func (s *Spares) Close() {
	if s == nil {
		return
	}
	for _, sp := range s.pool.Close() {
		sp.Discard()
	}
}
