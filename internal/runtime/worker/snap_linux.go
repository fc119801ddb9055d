package worker

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"

	"github.com/containerd/errdefs"

	"github.com/dsec-project/dsec/api"
	"github.com/dsec-project/dsec/internal/auth"
	"github.com/dsec-project/dsec/internal/layer"
	"github.com/dsec-project/dsec/internal/runtime"
	"github.com/dsec-project/dsec/internal/snap"
)

// maxBranches bounds one branch request.
const maxBranches = 1024

func (w *worker) packDiff(r *http.Request, req api.PackRequest) (created[api.Snapshot], error) {
	e, err := w.get(r)
	if err != nil {
		return created[api.Snapshot]{}, err
	}
	ref, err := layer.ParseRef(req.Tag)
	if err != nil {
		return created[api.Snapshot]{}, err
	}
	if !strings.Contains(req.Tag, ":") {
		return created[api.Snapshot]{}, fmt.Errorf("snapshot tag %q needs a step: NAME:STEP, e.g. %s:1: %w", req.Tag, req.Tag, errdefs.ErrInvalidArgument)
	}
	lim := w.cfg.SnapLimits
	if req.MaxBytes != 0 {
		lim.MaxBytes = req.MaxBytes
	}
	if req.MaxEntries != 0 {
		lim.MaxEntries = req.MaxEntries
	}
	if req.MaxDepth != 0 {
		lim.MaxDepth = req.MaxDepth
	}
	if lim.MaxBytes < 0 || lim.MaxEntries < 0 || lim.MaxDepth < 0 {
		return created[api.Snapshot]{}, fmt.Errorf("negative pack limit (%+v): %w", lim, errdefs.ErrInvalidArgument)
	}
	e.op.Lock()
	p, err := e.sb.PackDiff(context.WithoutCancel(r.Context()), runtime.PackOptions{Store: w.mounter.Store, Ref: ref, Limits: lim, Memory: req.Memory})
	e.op.Unlock()
	if err != nil {
		return created[api.Snapshot]{}, err
	}
	if t := tokenOf(r.Context()); t != nil {
		if err := w.owners.set(ref.String(), t.ID); err != nil {
			w.log.Error("cannot record the snapshot's token", "snapshot", ref, "err", err)
		}
	}
	w.log.Info("packed snapshot", "sandbox", e.sb.Name, "snapshot", ref, "pack", p.Packed, "frozen", p.Frozen)
	out := snapshotOf(p.Layer)
	out.Entries, out.Bytes, out.Whiteouts, out.Unchanged = p.Packed.Entries, p.Packed.Bytes, p.Packed.Whiteouts, p.Packed.Unchanged
	out.Dropped, out.FrozenSeconds = p.Packed.Dropped, p.Frozen.Seconds()
	if out.Memory != nil {
		out.Memory.PausedSeconds = p.Paused.Seconds()
	}
	return created[api.Snapshot]{out}, nil
}

func snapshotOf(l *layer.Info) api.Snapshot {
	out := api.Snapshot{Name: l.Ref, Digest: l.Digest.String(), Size: l.Size, Parent: l.Snapshot.Parent().Ref,
		Sandbox: l.Snapshot.Sandbox, Incremental: l.Snapshot.Incremental, Created: l.Created}
	for _, lo := range l.Snapshot.Lowers {
		out.Layers = append(out.Layers, lo.Ref)
	}
	if m := l.Snapshot.Memory; m != nil {
		out.Memory = &api.SnapshotMemory{MemoryBytes: m.MemoryBytes, CPUs: m.CPUs, Accel: m.Accel, Kernel: m.Kernel, QEMU: m.QEMU,
			StateBytes: m.State.Size, DiskBytes: m.Disk.Size}
		if m.RAM != nil {
			out.Memory.RAMBytes = m.RAM.Size
		}
	}
	return out
}

// branch makes N sandboxes on one snapshot, concurrently; if one
// fails, those made are removed again.
func (w *worker) branch(r *http.Request, req api.BranchRequest) (created[[]api.Sandbox], error) {
	if req.Snapshot == "" {
		return created[[]api.Sandbox]{}, fmt.Errorf("branch needs a snapshot (NAME:STEP; dsec snap ls lists them): %w", errdefs.ErrInvalidArgument)
	}
	if req.N < 1 || req.N > maxBranches {
		return created[[]api.Sandbox]{}, fmt.Errorf("branch count %d: give 1 to %d: %w", req.N, maxBranches, errdefs.ErrInvalidArgument)
	}
	prefix := req.NamePrefix
	if prefix == "" {
		prefix = strings.NewReplacer("/", "-", ":", "-").Replace(req.Snapshot)
	}
	names, err := w.branchNames(prefix, req.N, req.NamePrefix == "")
	if err != nil {
		return created[[]api.Sandbox]{}, err
	}
	spec := req.Spec
	spec.Layers, spec.Snapshot = nil, req.Snapshot
	ctx := context.WithoutCancel(r.Context())
	// The first branch mounts the layers; the others then only stack
	// their own upper over the shared mounts, 8 at a time.
	sbs := make([]*runtime.Sandbox, req.N)
	errs := make([]error, req.N)
	spec.Name = names[0]
	sbs[0], errs[0] = w.createSandbox(ctx, spec)
	if errs[0] == nil {
		var wg sync.WaitGroup
		sem := make(chan struct{}, 8)
		for i := 1; i < req.N; i++ {
			wg.Add(1)
			sem <- struct{}{}
			go func(i int, spec api.SandboxSpec) {
				defer wg.Done()
				defer func() { <-sem }()
				spec.Name = names[i]
				sbs[i], errs[i] = w.createSandbox(ctx, spec)
			}(i, spec)
		}
		wg.Wait()
	}
	if err := errors.Join(errs...); err != nil {
		for i, sb := range sbs {
			if sb != nil {
				w.removeSandbox(names[i], sb)
			}
		}
		return created[[]api.Sandbox]{}, firstErr(errs)
	}
	out := make([]api.Sandbox, len(sbs))
	for i, sb := range sbs {
		out[i] = w.describe(sb)
	}
	w.log.Info("branched", "snapshot", req.Snapshot, "n", req.N, "prefix", prefix)
	return created[[]api.Sandbox]{out}, nil
}

// branchNames names n branches PREFIX-I. A default prefix takes the
// indices after the highest its branches hold now, so a second branch of
// a snapshot never meets the first's; a prefix the user gave is refused
// whole, before anything is made, if any of its names is taken.
func (w *worker) branchNames(prefix string, n int, next bool) ([]string, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	first := 1
	if next {
		for name := range w.sandboxes {
			if i, err := strconv.Atoi(strings.TrimPrefix(name, prefix+"-")); err == nil && strings.HasPrefix(name, prefix+"-") && i >= first {
				first = i + 1
			}
		}
	}
	names := make([]string, n)
	for i := range names {
		names[i] = fmt.Sprintf("%s-%d", prefix, first+i)
		if err := api.ValidName(names[i]); err != nil {
			return nil, fmt.Errorf("branch names %s-%d..%d: %w (give --name-prefix)", prefix, first, first+n-1, err)
		}
		if _, taken := w.sandboxes[names[i]]; taken {
			return nil, fmt.Errorf("sandbox %s already exists: give another --name-prefix (nothing was made): %w", names[i], errdefs.ErrAlreadyExists)
		}
	}
	return names, nil
}

// firstErr is the first error, with how many more there were.
func firstErr(errs []error) error {
	var first error
	n := 0
	for _, err := range errs {
		if err != nil {
			if first == nil {
				first = err
			}
			n++
		}
	}
	if n > 1 {
		return fmt.Errorf("%w (and %d more branches failed; none was kept)", first, n-1)
	}
	return first
}

// snapshots lists the lineage DAG.
func (w *worker) snapshots(r *http.Request, _ none) ([]api.SnapshotNode, error) {
	w.lineage.RLock()
	defer w.lineage.RUnlock()
	nodes, err := w.tree(r.Context())
	if err != nil {
		return nil, err
	}
	out := []api.SnapshotNode{}
	for _, n := range nodes {
		if v, ok := w.visible(r.Context(), n.SnapshotNode); ok {
			out = append(out, v)
		}
	}
	return out, nil
}

func (w *worker) tree(ctx context.Context) ([]*snap.Node, error) {
	users, err := runtime.SnapUsers(w.cfg.Root)
	if err != nil {
		return nil, err
	}
	return snap.Tree(ctx, w.mounter.Store, users)
}

// removeSnapshot untags a snapshot nothing stands on (or, forced, one
// something does); no sandbox comes to stand on it meanwhile.
func (w *worker) removeSnapshot(r *http.Request, _ none) (none, error) {
	if !w.mayUseSnapshot(r.Context(), r.PathValue("ref")) {
		return none{}, errNoSnapshot(r.PathValue("ref"))
	}
	w.lineage.Lock()
	defer w.lineage.Unlock()
	users, err := runtime.SnapUsers(w.cfg.Root)
	if err != nil {
		return none{}, err
	}
	if _, err := snap.Remove(r.Context(), w.mounter.Store, r.PathValue("ref"), users, r.URL.Query().Get("force") == "1"); err != nil {
		return none{}, err
	}
	w.owners.set(r.PathValue("ref"), "")
	w.log.Info("removed snapshot", "snapshot", r.PathValue("ref"))
	return none{}, nil
}

// squash folds a chain of snapshots into a new one.
func (w *worker) squash(r *http.Request, req api.SquashRequest) (created[api.Snapshot], error) {
	if req.Snapshot == "" || req.Tag == "" {
		return created[api.Snapshot]{}, fmt.Errorf("squash needs the snapshot and the new tag (NAME:STEP): %w", errdefs.ErrInvalidArgument)
	}
	to, err := layer.ParseRef(req.Tag)
	if err != nil {
		return created[api.Snapshot]{}, err
	}
	w.lineage.Lock()
	defer w.lineage.Unlock()
	tmp, err := os.MkdirTemp(w.cfg.Root, "squash-")
	if err != nil {
		return created[api.Snapshot]{}, err
	}
	defer os.RemoveAll(tmp) // Squash unmounts what it mounted there first
	info, n, err := snap.Squash(context.WithoutCancel(r.Context()), w.mounter.Store, req.Snapshot, to, tmp)
	if err != nil {
		return created[api.Snapshot]{}, err
	}
	out := snapshotOf(info)
	out.Folded, out.Entries, out.Whiteouts, out.Bytes = n.Folded, n.Entries, n.Whiteouts, n.Bytes
	w.log.Info("squashed", "snapshot", req.Snapshot, "to", info.Ref, "folded", n.Folded)
	return created[api.Snapshot]{out}, nil
}

// visible is n as ctx's caller sees it, if it may: a token of scope
// sandboxes sees its own snapshots, and of each only its own children
// and sandboxes.
func (w *worker) visible(ctx context.Context, n api.SnapshotNode) (api.SnapshotNode, bool) {
	if t := tokenOf(ctx); t == nil || t.Scope == auth.Admin {
		return n, true
	}
	if !w.mayUseSnapshot(ctx, n.Name) {
		return n, false
	}
	n.Children = slices.DeleteFunc(slices.Clone(n.Children), func(c string) bool { return !w.mayUseSnapshot(ctx, c) })
	mine := func(name string) bool {
		w.mu.Lock()
		defer w.mu.Unlock()
		e := w.sandboxes[name]
		return e != nil && mayUse(ctx, e.owner)
	}
	n.Branches = slices.DeleteFunc(slices.Clone(n.Branches), func(s string) bool { return !mine(s) })
	n.Sandboxes = slices.DeleteFunc(slices.Clone(n.Sandboxes), func(s string) bool { return !mine(s) })
	if !mine(n.Sandbox) {
		n.Sandbox = ""
	}
	return n, true
}
