package runtime

import (
	"context"
	"fmt"
	"math"
	"slices"
	"strings"

	"github.com/dsec-project/dsec/api"
	"github.com/dsec-project/dsec/internal/policy"
	"github.com/dsec-project/dsec/internal/runtime/cgroup"
	"github.com/dsec-project/dsec/internal/runtime/container"
	"github.com/dsec-project/dsec/internal/units"
)

// withPolicy compiles p (nil: the default) for a sandbox being made:
// its effective form, its egress allowlist (host names resolved now and
// pinned) and its resource limits folded into l.
func withPolicy(p *api.Policy, l cgroup.Limits) (*api.Policy, []policy.Entry, cgroup.Limits, error) {
	eff := policy.Effective(p)
	if err := policy.Validate(eff); err != nil {
		return nil, nil, l, err
	}
	if err := policy.Enforceable(eff); err != nil {
		return nil, nil, l, err
	}
	entries, err := policy.Allowlist(eff.Network.Egress)
	if err != nil {
		return nil, nil, l, err
	}
	l, err = policyLimits(eff.Resources, l)
	return eff, entries, l, err
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

// restrictions are what the init holds every command to.
func restrictions(eff *api.Policy) (*container.Restrictions, error) {
	prog, err := policy.Seccomp(eff.Syscalls.Deny)
	if err != nil {
		return nil, err
	}
	return &container.Restrictions{Seccomp: prog}, nil
}

// ApplyPolicy makes p (nil: the default) the sandbox's policy. The
// network allowlist and resource limits change at once for every
// process; file and syscall rules can only tighten, and only for the
// processes started from now on. A stopped sandbox takes all of it when
// it starts. The report says which is which.
func (sb *Sandbox) ApplyPolicy(ctx context.Context, p *api.Policy) (*api.PolicyReport, error) {
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
	rep := &api.PolicyReport{Now: []string{}, NewProcesses: []string{}}
	running := sb.Status == Running && sb.c != nil && sb.g != nil
	if !running {
		rep.NewProcesses = append(rep.NewProcesses, fmt.Sprintf("all of it, when the %s sandbox starts", sb.Status))
	} else {
		if err := policy.ApplyNetwork(sb.g.Path(), sb.Allowlist, entries); err != nil {
			return nil, err
		}
		rep.Now = append(rep.Now, fmt.Sprintf("network: egress allowlist of %d address ranges, for every process", len(entries)))
		if limits != sb.Limits {
			if err := sb.g.SetLimits(limits); err != nil {
				return nil, fmt.Errorf("resources: %w", err)
			}
			rep.Now = append(rep.Now, fmt.Sprintf("resources: memory %d bytes, cpu %d millicores, pids %d (0: no limit)",
				limits.MemoryBytes, limits.CPUMilli, limits.Pids))
		} else {
			rep.Unchanged = append(rep.Unchanged, "resources")
		}
		var added []string
		for _, s := range eff.Syscalls.Deny {
			if !slices.Contains(cur.Syscalls.Deny, s) {
				added = append(added, s)
			}
		}
		if len(added) > 0 {
			prog, err := policy.SeccompDeny(added)
			if err != nil {
				return nil, err
			}
			if err := sb.c.Restrict(ctx, container.Restrictions{Seccomp: prog}); err != nil {
				return nil, fmt.Errorf("syscalls: %w", err)
			}
			rep.NewProcesses = append(rep.NewProcesses, "syscalls: also denied "+strings.Join(added, ", "))
		} else {
			rep.Unchanged = append(rep.Unchanged, "syscalls")
		}
	}
	sb.Policy, sb.Allowlist, sb.Limits = eff, entries, limits
	if err := sb.save(); err != nil {
		return nil, err
	}
	return rep, nil
}
