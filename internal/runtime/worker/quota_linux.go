package worker

import (
	"context"
	"fmt"
	"slices"
	"strings"

	"github.com/containerd/errdefs"
	"golang.org/x/sys/unix"

	"github.com/dsec-project/dsec/api"
	"github.com/dsec-project/dsec/internal/auth"
	"github.com/dsec-project/dsec/internal/layer"
	"github.com/dsec-project/dsec/internal/runtime/vm"
)

// What a token of scope sandboxes may ask for (auth.Token.Allow) and
// hold at once (auth.Token.Quota). The admin is bound by neither.

type trustedKey struct{}

// withTrusted marks ctx's create as the admin's spec: an E2B template's
// or a FnCall pool's, which the caller names but did not write. Its
// layers, snapshot, policy and limits are taken as they are; the
// sandbox is still the caller's, counted in its quota.
func withTrusted(ctx context.Context) context.Context {
	return context.WithValue(ctx, trustedKey{}, true)
}

func isTrusted(ctx context.Context) bool { v, _ := ctx.Value(trustedKey{}).(bool); return v }

// tenantOf is the token of ctx's caller when it is a tenant's (scope
// sandboxes), nil for the admin.
func tenantOf(ctx context.Context) *auth.Token {
	if t := tokenOf(ctx); t != nil && t.Scope != auth.Admin {
		return t
	}
	return nil
}

// checkAllowed refuses what a tenant's spec asks beyond its token's
// allowances: a policy of its own, no memory, pids or disk limit; and a
// limit above what the host has (the bound all sandboxes share, or the
// root's file system for a disk), which is none in effect.
func (w *worker) checkAllowed(ctx context.Context, spec api.SandboxSpec) error {
	t := tenantOf(ctx)
	if t == nil {
		return nil
	}
	if spec.Policy != nil && !t.May(auth.AllowPolicy) {
		return errNotAllowed(t, auth.AllowPolicy, "give its sandboxes policies of their own: name a stored policy (policy_name; dsec policy ls lists them)")
	}
	if len(t.Policies) > 0 && spec.PolicyName != "" && !slices.Contains(t.Policies, spec.PolicyName) {
		return fmt.Errorf("token %s may run its sandboxes under the default policy or the stored policies %s alone: %w",
			t.ID, strings.Join(t.Policies, ", "), errdefs.ErrPermissionDenied)
	}
	if t.May(auth.AllowUnlimited) {
		return nil
	}
	if spec.Memory == api.Unlimited || spec.Pids == api.Unlimited || spec.Disk == api.Unlimited {
		return errNotAllowed(t, auth.AllowUnlimited, "ask for no memory, pids or disk limit: give a limit")
	}
	host := w.host.Groups().ParentLimits()
	for _, l := range []struct {
		what  string
		asked int64
		bound func() int64
	}{{"memory", spec.Memory, func() int64 { return host.MemoryBytes }}, {"pids", spec.Pids, func() int64 { return host.Pids }},
		{"disk", spec.Disk, func() int64 { return rootSize(w.cfg.Root) }}} {
		if l.asked <= 0 {
			continue // the default, or none asked
		}
		if bound := l.bound(); bound > 0 && l.asked > bound {
			return errNotAllowed(t, auth.AllowUnlimited, fmt.Sprintf("ask for %s of %d, more than the host has (%d): no limit in effect: give a smaller one", l.what, l.asked, bound))
		}
	}
	return nil
}

// rootSize is the size of the file system under root (0: unknown).
func rootSize(root string) int64 {
	var st unix.Statfs_t
	if unix.Statfs(root, &st) != nil {
		return 0
	}
	return int64(st.Blocks) * st.Bsize
}

func errNotAllowed(t *auth.Token, what, do string) error {
	return fmt.Errorf("token %s may not %s, or ask the admin for a token made with --allow %s: %w", t.ID, do, what, errdefs.ErrPermissionDenied)
}

// memoryBound and diskBound are what a sandbox counts in its owner's
// quota: its memory limit and its disk bound (0: none).
func (w *worker) memoryBound(e *entry) int64 { return w.limits(e.spec, e.req).MemoryBytes }

func (w *worker) diskBound(e *entry) int64 {
	switch d := w.cfg.Defaults.withDefaults().Disk; {
	case e.spec.Disk > 0:
		return e.spec.Disk
	case e.spec.Disk == api.Unlimited || d < 0:
		return 0
	default:
		return d
	}
}

// checkQuota refuses e, a sandbox t's request adds, when t's sandboxes
// would then hold more than its quota allows; w.mu is held. A bound of
// -1 is one the token's sandboxes on other workers used up (a
// gateway's, on behalf of its client: what is left here).
func (w *worker) checkQuota(t *auth.Token, e *entry) error {
	q := t.Quota
	if q.Sandboxes == 0 && q.Memory == 0 && q.Disk == 0 {
		return nil
	}
	n, mem, disk := 1, w.memoryBound(e), w.diskBound(e)
	if q.Memory != 0 && mem == 0 {
		return fmt.Errorf("token %s has a memory quota: each of its sandboxes needs a memory limit (give --memory): %w", t.ID, errdefs.ErrInvalidArgument)
	}
	if q.Disk != 0 && disk == 0 {
		return fmt.Errorf("token %s has a disk quota: each of its sandboxes needs a disk bound (give --disk): %w", t.ID, errdefs.ErrInvalidArgument)
	}
	for _, o := range w.sandboxes {
		if o.account != t.ID || o.gone != nil {
			continue
		}
		n++
		mem += w.memoryBound(o)
		disk += w.diskBound(o)
	}
	over := func(what string, have, bound int64) error {
		if bound < 0 {
			return fmt.Errorf("token %s's quota of %s is held by its sandboxes on the fleet's other workers: remove some of them first (dsec rm): %w",
				t.ID, what, errdefs.ErrResourceExhausted)
		}
		return fmt.Errorf("token %s's quota: its sandboxes would hold %d %s, over its bound of %d: remove some of them first (dsec rm): %w",
			t.ID, have, what, bound, errdefs.ErrResourceExhausted)
	}
	switch {
	case q.Sandboxes != 0 && n > max(q.Sandboxes, 0):
		return over("sandboxes", int64(n), int64(q.Sandboxes))
	case q.Memory != 0 && mem > max(q.Memory, 0):
		return over("bytes of memory limits", mem, q.Memory)
	case q.Disk != 0 && disk > max(q.Disk, 0):
		return over("bytes of disk bounds", disk, q.Disk)
	}
	return nil
}

// snapshotBytes is what the snapshots in a tenant's namespace hold in
// the store: their layers, and a memory snapshot's guest.
func (w *worker) snapshotBytes(ctx context.Context, s scope) (int64, error) {
	all, err := layer.List(ctx, w.host.Store)
	if err != nil {
		return 0, err
	}
	var n int64
	for _, i := range all {
		if !s.ns.Owns(i.Ref) {
			continue
		}
		n += i.Size
		if i.Snapshot != nil && i.Snapshot.Memory != nil {
			for _, d := range i.Snapshot.Memory.Blobs() {
				n += d.Size
			}
		}
	}
	imgs, err := vm.List(ctx, w.host.Store)
	if err != nil {
		return 0, err
	}
	for _, img := range imgs { // a full VM's snapshots: their diffs and saved guests
		if s.ns.Owns(img.Tag) {
			n += img.Blob.Size
			if img.State != nil {
				n += img.State.Size
			}
		}
	}
	return n, nil
}
