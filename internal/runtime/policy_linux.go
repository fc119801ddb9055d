package runtime

import (
	"cmp"
	"context"
	"fmt"
	"io/fs"
	"math"
	"os"
	"path"
	"path/filepath"
	"slices"
	"strings"
	"sync"

	"github.com/containerd/errdefs"

	"github.com/dsec-project/dsec/api"
	"github.com/dsec-project/dsec/internal/egress"
	"github.com/dsec-project/dsec/internal/layer"
	"github.com/dsec-project/dsec/internal/policy"
	"github.com/dsec-project/dsec/internal/runtime/backend"
	"github.com/dsec-project/dsec/internal/runtime/cgroup"
	"github.com/dsec-project/dsec/internal/runtime/disk"
	"github.com/dsec-project/dsec/internal/runtime/driver"
	"github.com/dsec-project/dsec/internal/runtime/network"
	"github.com/dsec-project/dsec/internal/units"
)

// withPolicy compiles p (nil: the default) for a sandbox being made:
// its effective form, its egress allowlist (domain rules learn their
// addresses as it runs) and its resource limits folded into l.
func withPolicy(p *api.Policy, l cgroup.Limits) (*api.Policy, []policy.Entry, cgroup.Limits, error) {
	eff := policy.Effective(p)
	if err := policy.Validate(eff); err != nil {
		return nil, nil, l, err
	}
	entries, err := allowlist(eff, nil)
	if err != nil {
		return nil, nil, l, err
	}
	l, err = policyLimits(eff.Resources, l)
	return eff, entries, l, err
}

// allowlist compiles eff's egress rules and the addresses its domain
// rules learned; in network mode nat the host's own addresses are
// closed to them too (a loopback sandbox cannot leave its namespace to
// reach them). With domain rules, DNS and the web ports may go anywhere:
// the host sends them to the sandbox's resolver and proxy (network.Egress).
func allowlist(eff *api.Policy, learned []egress.Learned) ([]policy.Entry, error) {
	host, err := network.HostAddrs(eff.Network.Mode)
	if err != nil {
		return nil, err
	}
	rules := eff.Network.Egress
	if hasDomains(eff) {
		rules = append(slices.Clip(rules), policy.ResolverRule, policy.WebRule)
		rules = append(rules, policy.Learned(eff.Network.Egress, learned)...)
	}
	return policy.Allowlist(rules, host)
}

// policyLimits tightens l by the policy's resources: the lower of the two
// where both set one.
func policyLimits(r *api.ResourcePolicy, l cgroup.Limits) (cgroup.Limits, error) {
	tighter := func(cur, lim int64) int64 {
		if lim > 0 && (cur == 0 || lim < cur) {
			return lim
		}
		return cur
	}
	l.Pids = tighter(l.Pids, int64(r.Pids))
	l.CPUMilli = tighter(l.CPUMilli, int64(math.Ceil(r.CPU*1000)))
	if r.Memory != "" {
		m, err := units.ParseBytes(r.Memory)
		if err != nil {
			return l, err
		}
		l.MemoryBytes = tighter(l.MemoryBytes, m)
	}
	return l, nil
}

// policyDisk is the disk quota: the lower of cur and the policy's where
// both set one.
func policyDisk(r *api.ResourcePolicy, cur int64) (int64, error) {
	d, err := diskOf(r)
	if d > 0 && (cur == 0 || d < cur) {
		return d, err
	}
	return cur, err
}

// nextDisk is the disk quota a policy applied to a sandbox with quota
// cur asks for: the policy's, which may grow it but not shrink it or
// add one (the upper of a sandbox made without cannot move). One bound
// on the shared uppers file system keeps none.
func nextDisk(name string, cur int64, shared bool, r *api.ResourcePolicy) (int64, error) {
	d, err := diskOf(r)
	switch {
	case err != nil || d == 0 || shared:
		return cur, err
	case cur == 0:
		return 0, fmt.Errorf("resources.disk: sandbox %s was made without a disk quota and its files cannot move under one while it lives: give one when it is made (dsec run --disk, or a policy with resources.disk): %w", name, errdefs.ErrFailedPrecondition)
	case d < cur:
		return 0, fmt.Errorf("resources.disk %s is below sandbox %s's quota of %d bytes: a disk quota can grow, never shrink: %w", r.Disk, name, cur, errdefs.ErrFailedPrecondition)
	}
	return d, nil
}

// diskOf is the policy's disk quota in bytes, 0 when it sets none.
func diskOf(r *api.ResourcePolicy) (int64, error) {
	if r.Disk == "" {
		return 0, nil
	}
	d, err := units.ParseBytes(r.Disk)
	if err != nil {
		return 0, fmt.Errorf("resources.disk: %w", err)
	}
	return d, nil
}

// restrictions are what the init holds every command to.
func restrictions(eff *api.Policy) (*backend.Restrictions, error) {
	prog, err := policy.Seccomp(eff.Syscalls.Deny)
	if err != nil {
		return nil, err
	}
	return &backend.Restrictions{Seccomp: prog, Writable: eff.Files.ReadWrite}, nil
}

// ApplyPolicy makes p (nil: the default) the sandbox's policy. The
// network allowlist and resource limits change at once for every
// process; file and syscall rules can only tighten, and only for the
// processes started from now on. A stopped sandbox takes all of it when
// it starts. The report says which is which.
func (sb *Sandbox) ApplyPolicy(ctx context.Context, p *api.Policy) (*api.PolicyReport, error) {
	rep, err := sb.applyPolicy(ctx, p)
	if err == nil {
		sb.resolvConf() // domain rules it gained need a resolv.conf that works
	}
	return rep, err
}

func (sb *Sandbox) applyPolicy(ctx context.Context, p *api.Policy) (*api.PolicyReport, error) {
	sb.mu.Lock()
	defer sb.mu.Unlock()
	cur := sb.Policy
	if cur == nil {
		cur = policy.Effective(nil)
	}
	eff, entries, limits, err := withPolicy(p, sb.Limits)
	if err != nil {
		return nil, err
	}
	if err := policy.Tightens(cur, eff); err != nil {
		return nil, err
	}
	if mode := func(p *api.Policy) string { return cmp.Or(p.Network.Mode, api.NetworkLoopback) }; mode(cur) != mode(eff) {
		return nil, fmt.Errorf("network.mode %s is fixed when a sandbox is made: dsec rm it and dsec run --policy to have %s: %w",
			mode(cur), mode(eff), errdefs.ErrFailedPrecondition)
	}
	// What its domain rules learned stays where a rule of the new
	// policy still allows the name.
	learned := relearned(eff, sb.Learned)
	if len(learned) > 0 {
		if entries, err = allowlist(eff, learned); err != nil {
			return nil, err
		}
	}
	rep := &api.PolicyReport{Now: []string{}, NewProcesses: []string{}}
	// On the shared uppers file system the bound is its quota group's
	// limit: it may grow or shrink (below what is written: no more
	// writes until files go).
	if d, err := diskOf(eff.Resources); err != nil {
		return nil, err
	} else if sb.UpperFS != "" && d > 0 && d != sb.DiskBound {
		if err := api.CheckDisk(d); err != nil {
			return nil, err
		}
		if err := disk.SetUpperLimit(sb.root(), sb.UpperFS, d); err != nil {
			return nil, err
		}
		sb.DiskBound = d
		rep.Now = append(rep.Now, fmt.Sprintf("resources: disk bound set to %d bytes, for every process", d))
	}
	quota, err := nextDisk(sb.Name, sb.Disk, sb.UpperFS != "", eff.Resources)
	if err != nil {
		return nil, err
	}
	if quota != sb.Disk { // first: it is the step most likely to fail
		if err := disk.Grow(sb.dir, quota, sb.Status != Stopped); err != nil {
			return nil, err
		}
		sb.Disk = quota
		rep.Now = append(rep.Now, fmt.Sprintf("resources: disk quota grown to %d bytes, for every process", quota))
	}
	running := sb.Status == Running && sb.c != nil && sb.g != nil
	if !running {
		rep.NewProcesses = append(rep.NewProcesses, fmt.Sprintf("all of it, when the %s sandbox starts", sb.Status))
	} else {
		// Its resolver and proxy first: the allowlist of a policy with
		// domain rules opens DNS and the web ports to every address,
		// which only their redirect makes safe.
		hadDNS := sb.link != nil
		if err := sb.startDNS(eff); err != nil {
			return nil, err
		}
		if err := policy.ApplyNetwork(sb.g.Path(), sb.Allowlist, entries); err != nil {
			if !hadDNS {
				sb.stopDNS()
			}
			return nil, err
		}
		rep.Now = append(rep.Now, fmt.Sprintf("network: egress allowlist of %d address ranges, for every process", len(entries)))
		if limits != sb.Limits {
			if err := sb.g.SetLimits(driver.WithInit(limits)); err != nil {
				return nil, fmt.Errorf("resources: %w", err)
			}
			rep.Now = append(rep.Now, fmt.Sprintf("resources: memory %d bytes, cpu %d millicores, pids %d (0: no limit)",
				limits.MemoryBytes, limits.CPUMilli, limits.Pids))
		} else {
			rep.Unchanged = append(rep.Unchanged, "resources")
		}
		if err := sb.tighten(ctx, cur, eff, rep); err != nil {
			return nil, err
		}
	}
	sb.Policy, sb.Allowlist, sb.Limits, sb.Learned = eff, entries, limits, learned
	sb.syncFast()
	if running && !hasDomains(eff) { // no domain rules now: no resolver
		if err := sb.stopDNS(); err != nil {
			return nil, err
		}
	}
	if err := sb.save(); err != nil {
		return nil, err
	}
	return rep, nil
}

// tighten takes a running sandbox's files and syscalls rules from cur
// to eff (which Tightens allowed).
func (sb *Sandbox) tighten(ctx context.Context, cur, eff *api.Policy, rep *api.PolicyReport) error {
	if err := sb.applyFiles(ctx, cur.Files, eff.Files, rep); err != nil {
		return err
	}
	var added []string
	for _, s := range eff.Syscalls.Deny {
		if !slices.Contains(cur.Syscalls.Deny, s) {
			added = append(added, s)
		}
	}
	if len(added) == 0 {
		rep.Unchanged = append(rep.Unchanged, "syscalls")
		return nil
	}
	prog, err := policy.SeccompDeny(added)
	if err != nil {
		return err
	}
	r, err := ability[backend.Restricter](sb, "deny more syscalls")
	if err != nil {
		return err
	}
	if err := r.Restrict(ctx, backend.Restrictions{Seccomp: prog}); err != nil {
		return fmt.Errorf("syscalls: %w", err)
	}
	rep.NewProcesses = append(rep.NewProcesses, "syscalls: also denied "+strings.Join(added, ", "))
	return nil
}

// applyFiles takes a running sandbox from the file rules cur to next
// (which Tightens allowed): new read-only and hidden paths are mounts,
// in force for every process at once; a new readWrite list is one more
// Landlock domain for the processes started from now on.
func (sb *Sandbox) applyFiles(ctx context.Context, cur, next *api.FilePolicy, rep *api.PolicyReport) error {
	var readOnly, hidden []string
	if cur.ToolkitWritable && !next.ToolkitWritable {
		readOnly = append(readOnly, sb.Toolkit...)
	}
	for _, q := range next.ReadOnly {
		if !slices.Contains(cur.ReadOnly, q) {
			readOnly = append(readOnly, q)
		}
	}
	for _, q := range next.Hidden {
		if !slices.Contains(cur.Hidden, q) {
			hidden = append(hidden, q)
		}
	}
	var missing []string
	if len(readOnly)+len(hidden) > 0 {
		p, err := ability[backend.Protecter](sb, "make paths read-only or hidden")
		if err != nil {
			return err
		}
		if missing, err = p.Protect(readOnly, hidden); err != nil {
			return fmt.Errorf("files: %w", err)
		}
	}
	changed := false
	if len(readOnly) > 0 {
		rep.Now = append(rep.Now, "files: read-only "+strings.Join(readOnly, ", ")+", for every process (descriptors open for writing already keep writing)")
		changed = true
	}
	if len(hidden) > 0 {
		rep.Now = append(rep.Now, "files: hidden "+strings.Join(hidden, ", ")+", for every process (descriptors open already keep reading)")
		changed = true
	}
	if len(missing) > 0 {
		rep.Now = append(rep.Now, "files: nothing mounted for "+strings.Join(missing, ", ")+": not in the sandbox")
	}
	if !slices.Equal(cur.ReadWrite, next.ReadWrite) {
		r, err := ability[backend.Restricter](sb, "confine writes")
		if err != nil {
			return err
		}
		if err := r.Restrict(ctx, backend.Restrictions{Writable: next.ReadWrite}); err != nil {
			return fmt.Errorf("files: %w", err)
		}
		rep.NewProcesses = append(rep.NewProcesses, "files: writes confined to "+strings.Join(next.ReadWrite, ", ")+" (and /dev, /proc)")
		changed = true
	}
	if !changed {
		rep.Unchanged = append(rep.Unchanged, "files")
	}
	return nil
}

// maxToolkitPaths bounds the mounts that pin a toolkit read-only.
const maxToolkitPaths = 1024

// toolkitPaths are the sandbox paths the toolkit layers bring (lowers
// and kinds topmost first): each tree no layer below has, taken whole,
// and each file it puts in a directory the layers below share. Symbolic
// links are left out: a mount cannot pin one.
// The answer depends only on the layers, and a lower's mount is named by
// its digest: it is worked out once per stack, not per sandbox.
func toolkitPaths(lowers []string, kinds []layer.Kind) ([]string, error) {
	if !slices.Contains(kinds, layer.KindToolkit) {
		return nil, nil
	}
	key := strings.Join(lowers, "\x00")
	if v, ok := toolkitCache.Load(key); ok {
		return v.([]string), nil
	}
	out, err := walkToolkit(lowers, kinds)
	if err == nil {
		toolkitCache.Store(key, out)
	}
	return out, err
}

var toolkitCache sync.Map // lowers joined -> []string

func walkToolkit(lowers []string, kinds []layer.Kind) ([]string, error) {
	var out []string
	for i, k := range kinds {
		if k != layer.KindToolkit {
			continue
		}
		var walk func(rel string) error
		walk = func(rel string) error {
			ents, err := os.ReadDir(filepath.Join(lowers[i], rel))
			if err != nil {
				return err
			}
			for _, e := range ents {
				p := path.Join(rel, e.Name())
				if e.Type()&(fs.ModeSymlink|fs.ModeCharDevice) != 0 { // links and whiteouts
					continue
				}
				dirBelow := false
				for _, b := range lowers[i+1:] {
					if fi, err := os.Lstat(filepath.Join(b, p)); err == nil && fi.IsDir() {
						dirBelow = true
					}
				}
				if e.IsDir() && dirBelow {
					if err := walk(p); err != nil {
						return err
					}
					continue
				}
				if !slices.Contains(out, p) {
					out = append(out, p)
				}
			}
			return nil
		}
		if err := walk("/"); err != nil {
			return nil, fmt.Errorf("toolkit layer: %w", err)
		}
		if len(out) > maxToolkitPaths {
			return nil, fmt.Errorf("the toolkit layers put %d files among the directories of the layers below, more than the %d dsec pins read-only: put them under a directory of their own (such as /opt/NAME), or set files.toolkitWritable: %w",
				len(out), maxToolkitPaths, errdefs.ErrOutOfRange)
		}
	}
	return out, nil
}
