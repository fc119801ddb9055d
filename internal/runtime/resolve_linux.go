package runtime

import (
	"cmp"
	"context"
	"fmt"
	"slices"

	"github.com/containerd/errdefs"
	"golang.org/x/sys/unix"

	"github.com/dsec-project/dsec/api"
	"github.com/dsec-project/dsec/internal/layer"
	"github.com/dsec-project/dsec/internal/layer/store"
	"github.com/dsec-project/dsec/internal/policy"
	"github.com/dsec-project/dsec/internal/runtime/cgroup"
	"github.com/dsec-project/dsec/internal/runtime/driver"
	"github.com/dsec-project/dsec/internal/runtime/lower"
)

// What a create resolves of what it asks, before anything is made: the
// layers a snapshot stands on, the limits of its class and policy, its
// disk, its backend's driver, a stack folded to that driver's bound.

// resolved is what a create resolved of what it asks: its layers'
// digests (nil: resolved as they are mounted), the memory snapshot's
// guest it continues (nil: none), its limits and effective policy with
// the egress rules it compiles to, its disk (quota; asked: the disk it
// asked for, 0 none of its own) and its backend's driver.
type resolved struct {
	digests      []string
	mem          *layer.Memory
	limits       cgroup.Limits
	policy       *api.Policy
	allow        []policy.Entry
	quota, asked int64
	d            driver.Driver
}

// resolve resolves o for a create (a snapshot it starts on, its class,
// policy and disk, its backend, a stack folded to the backend's bound)
// and checks its name is free; what it resolves is held by lease.
func resolve(ctx context.Context, o *options, lease *store.Lease) (rs resolved, err error) {
	root := o.Root
	digests, mem, err := onSnapshot(ctx, o, lease) // mem: a memory snapshot's guest, which the sandbox continues
	if err != nil {
		return rs, err
	}
	if len(o.Layers) == 0 {
		return rs, fmt.Errorf("a sandbox needs at least a base layer: %w", errdefs.ErrInvalidArgument)
	}
	limits, err := classLimits(o.Class, o.Limits)
	if err != nil {
		return rs, err
	}
	eff, allow, limits, err := withPolicy(o.Policy, limits)
	if err != nil {
		return rs, err
	}
	quota, err := policyDisk(eff.Resources, o.Disk)
	if err != nil {
		return rs, err
	}
	if err := api.CheckDisk(quota); err != nil {
		return rs, err
	}
	d, err := o.Drivers.Driver(o.Backend)
	if err != nil {
		return rs, err
	}
	if _, own := d.(driver.BaseResolver); own && len(o.Layers) != 1 {
		return rs, fmt.Errorf("a %s sandbox boots one base of its own (%d layers given): give --base alone, no --workspace or --toolkit: %w", d.Name(), len(o.Layers), errdefs.ErrInvalidArgument)
	}
	if mem == nil { // (a memory snapshot's guest has its devices)
		if digests, err = foldDeep(ctx, root, o, d, digests); err != nil {
			return rs, err
		}
	}
	if mem != nil {
		if quota != 0 && quota != mem.DiskBytes {
			return rs, fmt.Errorf("snapshot %s's guest has a disk of %d MiB: a sandbox that continues it has that disk (give no --disk): %w", o.From, mem.DiskBytes>>20, errdefs.ErrInvalidArgument)
		}
		quota = mem.DiskBytes
		if limits.MemoryBytes == 0 {
			limits.MemoryBytes = mem.MemoryBytes
		}
	}
	asked := quota // the disk the create asked for (0: none of its own)
	if _, guest := d.(driver.ImageUpper); guest && quota == 0 {
		// Its upper is a disk image of its own, of the bound's size.
		if quota, err = imageSize(root, cmp.Or(o.Spec.DiskBound, o.Host.DiskBound)); err != nil {
			return rs, err
		}
	}
	if o.Name != "" {
		if err := nameFree(root, o.Name); err != nil {
			return rs, err
		}
	}
	rs = resolved{digests: digests, mem: mem, limits: limits, policy: eff, allow: allow, quota: quota, asked: asked, d: d}
	return rs, nil
}

// onSnapshot resolves a sandbox made on a snapshot (o.From): its layers
// are the snapshot over exactly those it was taken on (a memory
// snapshot's guest's devices, when the sandbox continues its guest),
// and the env, workdir and user it was taken with are the defaults.
// digests are the layers'; mem the guest continued (nil: none).
func onSnapshot(ctx context.Context, o *options, lease *store.Lease) (digests []string, mem *layer.Memory, err error) {
	if o.From == "" {
		return nil, nil, nil
	}
	if len(o.Layers) > 0 {
		return nil, nil, fmt.Errorf("a sandbox starts on a snapshot or on layers, not both: %w", errdefs.ErrInvalidArgument)
	}
	var l *layer.Lineage
	var d string
	if err := leased(o.Store, lease, func() ([]string, error) {
		l, d, err = lower.Lineage(ctx, o.Host.Source(), o.From)
		return []string{d}, err
	}); err != nil {
		return nil, nil, err
	}
	o.Layers, digests = []string{o.From}, []string{d}
	if o.Env == nil {
		o.Env = l.Env
	}
	if o.Workdir == "" {
		o.Workdir = l.Workdir
	}
	if o.User == "" {
		o.User = l.User
	}
	if l.Memory != nil && !o.DiskOnly && o.Backend != "" && o.Backend == o.Drivers.MemoryBackend() {
		// The guest's layer devices, under its own disk.
		mem, o.Layers, digests = l.Memory, nil, nil
		for _, lo := range mem.Layers {
			o.Layers = append(o.Layers, lo.Ref)
			digests = append(digests, lo.Digest.String())
		}
	}
	for _, lo := range l.Lowers {
		if mem != nil {
			break
		}
		if slices.Contains(digests, lo.Digest.String()) {
			return nil, nil, fmt.Errorf("snapshot %s stands on its own image (through %s: an older dsec packed an empty diff over an empty one): it cannot be started; dsec snap rm it and branch from the snapshot under it: %w",
				o.From, lo.Ref, errdefs.ErrInvalidArgument)
		}
		o.Layers = append(o.Layers, lo.Ref)
		digests = append(digests, lo.Digest.String())
	}
	return digests, mem, nil
}

// imageSize is the size of the disk image a sandbox whose backend needs
// one gets without a --disk: the bound (none: the root's free space,
// less the 1 GiB the root keeps).
func imageSize(root string, bound int64) (int64, error) {
	if bound > 0 {
		return bound, nil
	}
	var st unix.Statfs_t
	if err := unix.Statfs(root, &st); err != nil {
		return 0, err
	}
	free := int64(st.Bavail)*st.Bsize - 1<<30
	if free < 16<<20 {
		return 0, fmt.Errorf("the root %s has no room for a sandbox's disk: free some space: %w", root, errdefs.ErrResourceExhausted)
	}
	return free &^ (1<<20 - 1), nil
}

// classLimits adds what a scheduling class means to l: batch sandboxes
// run idle (cpu.idle and SCHED_IDLE), latency ones with 8x the default
// CPU weight, so that an interactive step's wake-up preempts any batch
// work and wins over plain host work.
func classLimits(class string, l cgroup.Limits) (cgroup.Limits, error) {
	if err := api.CheckClass(class); err != nil {
		return l, err
	}
	l.Weight, l.Idle = 800, false
	if classOf(class) == api.SchedBatch {
		l.Weight, l.Idle = 0, true
	}
	return l, nil
}

func classOf(class string) string {
	if class == "" {
		return api.SchedLatency
	}
	return class
}
