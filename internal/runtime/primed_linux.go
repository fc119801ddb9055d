package runtime

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"

	"github.com/dsec-project/dsec/internal/layer"
	"github.com/dsec-project/dsec/internal/runtime/backend"
	"github.com/dsec-project/dsec/internal/runtime/cgroup"
	"github.com/dsec-project/dsec/internal/runtime/driver"
	"github.com/dsec-project/dsec/internal/runtime/warm"
)

// Primed sandboxes. A spare init saves a create the start of a process
// and its moves into cgroups; a primed sandbox saves it the rest. It is
// a sandbox made ahead of need on the layers the last create stood on,
// with the default of everything else (no policy, class latency, no
// disk bound, no user namespace), its overlay mounted over an empty
// upper and its init set up, without a name. A create that asks for
// exactly that takes it: its limits are written, its host named, its
// state and its name written; nothing is mounted, started or moved.
// A create on other layers makes its own sandbox, and the primed ones
// are made again on its layers.
type Primed struct {
	h    *Host
	pool *warm.Pool[*Sandbox]

	mu  sync.Mutex
	key string // the layers' digests the sandboxes are made on
}

// StartPrimed keeps n sandboxes made ahead on h, on the layers of the
// last create there (h.Primed is then p).
func (h *Host) StartPrimed(n int) *Primed {
	h.init()
	p := &Primed{h: h}
	p.pool = warm.New(warm.Config[*Sandbox]{Size: n, // Make: once a create says on what (take)
		Usable: func(sb *Sandbox) bool { // its init still runs
			select {
			case <-sb.c.Done():
				return false
			default:
				return true
			}
		},
		Discard: func(sb *Sandbox) { sb.Remove() }})
	return p
}

// primeRecipe is what primed sandboxes are made of: their layers, and
// for a backend whose sandboxes' memory and CPUs are fixed when made (a
// microVM's guest) those too.
type primeRecipe struct {
	backend string
	limits  cgroup.Limits // MemoryBytes and CPUMilli: a guest's RAM and vCPUs
	digests []string
}

// make creates a primed sandbox of r on refs, which must still be r's
// layers; one whose backend's warm sandboxes wait paused is paused.
func (p *Primed) make(r primeRecipe, refs []string) (*Sandbox, error) {
	// Not cancelled by Close: the pool removes what a make returns then.
	o := options{Spec: Spec{Layers: refs, Backend: r.backend, Limits: r.limits}, Host: p.h} // no name: takePrimed gives it one
	sb, err := create(context.Background(), o, nil)
	if err != nil {
		return nil, err
	}
	if !slices.Equal(sb.Digests, r.digests) { // a ref was built again meanwhile
		sb.Remove()
		return nil, fmt.Errorf("layers changed")
	}
	if err := sb.PauseWarm(); err != nil {
		sb.Remove()
		return nil, err
	}
	return sb, nil
}

// recipe is what a primed sandbox for o would be made of; not ok when o
// asks for more than a primed sandbox has (a policy, a snapshot, a disk
// quota or bound of its own, a user namespace, class batch, merged
// memory) or a layer is not in the local store.
func (p *Primed) recipe(ctx context.Context, o options, d driver.Driver, limits cgroup.Limits, disk int64) (primeRecipe, bool) {
	if p == nil || o.From != "" || o.Policy != nil || o.UserNS || disk > 0 || o.Spec.DiskBound != 0 || limits.Idle || o.MergeMemory || p.h.Store == nil {
		return primeRecipe{}, false
	}
	r := primeRecipe{backend: d.Name()}
	if _, fixed := d.(driver.ImageUpper); fixed {
		r.limits = cgroup.Limits{MemoryBytes: limits.MemoryBytes, CPUMilli: limits.CPUMilli}
	}
	for _, ref := range o.Layers {
		info, err := layer.Resolve(ctx, p.h.Store, ref)
		if err != nil {
			return primeRecipe{}, false
		}
		r.digests = append(r.digests, info.Digest.String())
	}
	return r, true
}

func (r primeRecipe) key() string {
	return fmt.Sprintf("%s %d %d %s", r.backend, r.limits.MemoryBytes, r.limits.CPUMilli, strings.Join(r.digests, " "))
}

// take returns a primed sandbox made on key, or nil when none is ready.
// Either way the sandboxes made next are made on key, once Refill says:
// those made on other layers are removed.
func (p *Primed) take(r primeRecipe, refs []string) *Sandbox {
	key := r.key()
	p.mu.Lock()
	if p.key != key {
		p.key = key
		p.mu.Unlock()
		p.pool.Reset(func(context.Context) (*Sandbox, error) { return p.make(r, refs) })
		return nil
	}
	p.mu.Unlock()
	sb, _ := p.pool.Take()
	return sb
}

// Refill has the sandboxes taken made again. A worker calls it once
// the request that created is answered: made meanwhile, they would take
// the CPUs (and the spare init) that request's create and first command
// need. Nil-safe.
func (p *Primed) Refill() {
	if p != nil {
		p.pool.Kick()
	}
}

// Ready counts the primed sandboxes waiting to be taken. Nil-safe.
func (p *Primed) Ready() int {
	if p == nil {
		return 0
	}
	return p.pool.Stats().Ready
}

// Close stops making primed sandboxes and removes those ready.
func (p *Primed) Close() {
	for _, sb := range p.pool.Close() {
		sb.Remove()
	}
}

// takePrimed makes the primed sandbox pr the sandbox o names: its limits,
// host name and state, then its name. A sandbox made for one call
// (o.Pool: run --rm, a FnCall call no pool served) gets its limits and
// host name only: it never outlives its worker (a worker that starts
// removes the call sandboxes of one that died, and SweepUnnamed the
// primed ones), so neither its state nor its name is written: ext4
// metadata updates that took 0.7-0.8 ms of a run --rm (BENCHMARKS.md).
// On an error pr is removed.
func takePrimed(pr *Sandbox, root string, o options, st State) (_ *Sandbox, err error) {
	defer func() {
		if err != nil {
			pr.Remove() // its state's name is the one it claimed, if any
		}
	}()
	if err := pr.ResumeWarm(); err != nil {
		return nil, err
	}
	if _, fixed := pr.d.(driver.ImageUpper); !fixed { // a guest's are its own, and the recipe's
		if err := pr.g.SetLimits(driver.WithInit(st.Limits)); err != nil {
			return nil, err
		}
	}
	r, err := ability[backend.Renamer](pr, "set its host name")
	if err != nil {
		return nil, err
	}
	if err := r.SetHostname(st.Hostname); err != nil {
		return nil, err
	}
	pr.mu.Lock()
	primed := pr.State
	pr.State = running(st, primed)
	pr.mu.Unlock()
	if o.Pool != "" {
		pr.touch()
		return pr, nil
	}
	// The primed state is moved aside, not written over: on ext4 a file
	// replaced (or removed) so soon after it was written costs 0.3-1 ms
	// (its delayed allocation is settled then), an unused name 0.1.
	aside := filepath.Join(pr.dir, "state.primed")
	if err := os.Rename(filepath.Join(pr.dir, "state.json"), aside); err != nil {
		return nil, err
	}
	if err := pr.save(); err != nil {
		return nil, err
	}
	// The name last: a worker killed before leaves a sandbox no name
	// points at, which the next one removes.
	if err := claimName(root, o.Name, pr.ID); err != nil {
		pr.mu.Lock()
		pr.Name = "" // another's
		pr.mu.Unlock()
		return nil, err
	}
	go os.Remove(aside)
	pr.touch()
	return pr, nil
}

// running is st, the state a create asked for, on the primed sandbox
// whose state is primed: its init, group, layers and enforcement.
func running(st, primed State) State {
	st.ID, st.Pid, st.CgroupName, st.Digests, st.Policy, st.Allowlist, st.Toolkit = primed.ID, primed.Pid, primed.CgroupName, primed.Digests, primed.Policy, primed.Allowlist, primed.Toolkit
	st.UpperFS, st.DiskBound = primed.UpperFS, primed.DiskBound
	st.Disk, st.VM, st.Machine = primed.Disk, primed.VM, primed.Machine
	st.Status = Running
	return st
}
