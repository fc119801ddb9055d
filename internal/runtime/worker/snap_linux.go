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
	"time"

	"github.com/containerd/errdefs"

	"github.com/dsec-project/dsec/api"
	"github.com/dsec-project/dsec/internal/auth"
	"github.com/dsec-project/dsec/internal/layer"
	"github.com/dsec-project/dsec/internal/layer/remote"
	"github.com/dsec-project/dsec/internal/runtime"
	"github.com/dsec-project/dsec/internal/runtime/vm"
	"github.com/dsec-project/dsec/internal/snap"
)

// maxBranches bounds one branch request.
const maxBranches = 1024

func (w *worker) packDiff(r *http.Request, req api.PackRequest) (created[api.Snapshot], error) {
	e, err := w.get(r)
	if err != nil {
		return created[api.Snapshot]{}, err
	}
	if !strings.Contains(req.Tag, ":") {
		return created[api.Snapshot]{}, fmt.Errorf("snapshot tag %q needs a step: NAME:STEP, e.g. %s:1: %w", req.Tag, req.Tag, errdefs.ErrInvalidArgument)
	}
	sc := w.scopeOf(r.Context())
	ref, err := sc.newTag(req.Tag)
	if err != nil {
		return created[api.Snapshot]{}, err
	}
	lim, err := packLimits(w.cfg.SnapLimits, req, sc.admin())
	if err != nil {
		return created[api.Snapshot]{}, err
	}
	if err := w.publishable(r.Context(), ref); err != nil {
		return created[api.Snapshot]{}, fmt.Errorf("snapshot tag %s: %w", sc.show(ref.String()), err)
	}
	t := tenantOf(r.Context())
	var quota int64 // what the tenant's snapshots may still take
	if t != nil && t.Quota.SnapshotBytes > 0 {
		used, err := w.snapshotBytes(r.Context(), sc)
		if err != nil {
			return created[api.Snapshot]{}, err
		}
		if quota = t.Quota.SnapshotBytes - used; quota <= 0 {
			return created[api.Snapshot]{}, errSnapshotQuota(t, used)
		}
		if guest := w.memoryBound(e) + w.diskBound(e); req.Memory && (guest == 0 || guest > quota) {
			return created[api.Snapshot]{}, fmt.Errorf("token %s's snapshot quota leaves %d bytes, less than a memory snapshot of this sandbox may take (its memory limit and disk bound, %d): %w",
				t.ID, quota, guest, errdefs.ErrResourceExhausted)
		}
		lim.MaxBytes = min(lim.MaxBytes, quota)
	}
	e.op.Lock()
	p, err := e.sb.PackDiff(context.WithoutCancel(r.Context()), runtime.PackOptions{Store: w.host.Store, Ref: ref, Limits: lim, Memory: req.Memory})
	e.op.Unlock()
	if err != nil {
		if quota > 0 && errdefs.IsOutOfRange(err) && lim.MaxBytes == quota {
			return created[api.Snapshot]{}, fmt.Errorf("token %s's snapshot quota leaves %d bytes, and %v: remove snapshots first (dsec snap rm): %w",
				t.ID, quota, strings.TrimSuffix(err.Error(), ": out of range"), errdefs.ErrResourceExhausted)
		}
		return created[api.Snapshot]{}, err
	}
	if quota > 0 {
		// The layer (and a guest) may hold more than the files' bytes.
		if used, err := w.snapshotBytes(r.Context(), sc); err == nil && used > t.Quota.SnapshotBytes {
			users, _ := runtime.SnapUsers(w.cfg.Root)
			snap.Remove(context.WithoutCancel(r.Context()), w.host.Store, ref.String(), users, true)
			return created[api.Snapshot]{}, errSnapshotQuota(t, used)
		}
	}
	w.log.Info("packed snapshot", "sandbox", e.sb.Name, "snapshot", ref, "pack", p.Packed, "frozen", p.Frozen)
	if err := w.publish(r.Context(), ref); err != nil {
		return created[api.Snapshot]{}, fmt.Errorf("snapshot %s is packed here, but %w", sc.show(ref.String()), err)
	}
	out := snapshotOf(p.Layer)
	out.Entries, out.Bytes, out.Whiteouts, out.Unchanged = p.Packed.Entries, p.Packed.Bytes, p.Packed.Whiteouts, p.Packed.Unchanged
	out.Dropped, out.FrozenSeconds = p.Packed.Dropped, p.Frozen.Seconds()
	out.BlockDiff = p.Layer.Kind == layer.KindVMImage
	if out.Memory != nil {
		out.Memory.PausedSeconds = p.Paused.Seconds()
	}
	return created[api.Snapshot]{sc.showSnapshot(out)}, nil
}

// publishable refuses a new snapshot's tag that the shared remote holds,
// when the worker publishes its snapshots there (snap.publish): a tag
// is the fleet's, and one another worker published (or this one, of a
// snapshot removed since) names that snapshot still.
func (w *worker) publishable(ctx context.Context, ref layer.Ref) error {
	if !w.cfg.PublishSnapshots || w.host.Remote == nil {
		return nil
	}
	return remoteFree(ctx, w.host.Remote, ref)
}

// publish pushes the snapshot ref, made here, to the shared remote when
// the worker publishes its snapshots (snap.publish): before it is
// answered, so that once made any worker of the remote branches it.
func (w *worker) publish(ctx context.Context, ref layer.Ref) error {
	if !w.cfg.PublishSnapshots || w.host.Remote == nil {
		return nil
	}
	t0 := time.Now()
	push := remote.Copy
	if _, err := vm.Lookup(ctx, w.host.Store, ref.String()); err == nil { // a full VM's snapshot
		push = vm.Copy
	}
	if _, err := push(context.WithoutCancel(ctx), remote.Local(w.host.Store), w.host.Remote, ref, false, nil); err != nil {
		return fmt.Errorf("not published to %s (snap.publish): %v: %w", w.host.Remote, err, errdefs.ErrUnavailable)
	}
	w.log.Info("published snapshot", "snapshot", ref, "remote", w.host.Remote, "took", time.Since(t0))
	return nil
}

// packLimits are a pack-diff's bounds: the worker's (snap.max_*), which
// a request may lower; only the admin's may raise them.
func packLimits(worker snap.Limits, req api.PackRequest, admin bool) (snap.Limits, error) {
	if req.MaxBytes < 0 || req.MaxEntries < 0 || req.MaxDepth < 0 {
		return snap.Limits{}, fmt.Errorf("negative pack limit (max bytes %d, entries %d, depth %d): %w", req.MaxBytes, req.MaxEntries, req.MaxDepth, errdefs.ErrInvalidArgument)
	}
	if worker.MaxBytes < 0 || worker.MaxEntries < 0 || worker.MaxDepth < 0 {
		return snap.Limits{}, fmt.Errorf("negative pack limit in the worker's configuration (%+v): %w", worker, errdefs.ErrInvalidArgument)
	}
	lim := worker.WithDefaults()
	pick := func(asked, bound int64) int64 {
		if asked == 0 || !admin && asked > bound {
			return bound
		}
		return asked
	}
	lim.MaxBytes = pick(req.MaxBytes, lim.MaxBytes)
	lim.MaxEntries = int(pick(int64(req.MaxEntries), int64(lim.MaxEntries)))
	lim.MaxDepth = int(pick(int64(req.MaxDepth), int64(lim.MaxDepth)))
	return lim, nil
}

func errSnapshotQuota(t *auth.Token, used int64) error {
	return fmt.Errorf("token %s's quota: its snapshots hold %d bytes, its bound is %d: remove some first (dsec snap rm): %w",
		t.ID, used, t.Quota.SnapshotBytes, errdefs.ErrResourceExhausted)
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
	if req.First < 0 {
		return created[[]api.Sandbox]{}, fmt.Errorf("branch number %d: give 1 or more: %w", req.First, errdefs.ErrInvalidArgument)
	}
	prefix := req.NamePrefix
	if prefix == "" {
		prefix = api.BranchPrefix(req.Snapshot)
	}
	names, err := w.branchNames(prefix, req.N, req.First, req.NamePrefix == "")
	if err != nil {
		return created[[]api.Sandbox]{}, err
	}
	spec := req.Spec
	ctx := context.WithoutCancel(r.Context())
	if req.Like != "" {
		like, err := w.like(r, req.Like)
		if err != nil {
			return created[[]api.Sandbox]{}, err
		}
		spec = like
	} else if err := w.checkAllowed(ctx, spec); err != nil {
		return created[[]api.Sandbox]{}, err
	}
	spec.Layers, spec.Snapshot = nil, req.Snapshot
	if bb := w.host.Drivers.BaseBackend(); bb != "" && w.vmSnapshot(ctx, req.Snapshot) { // its branches boot its disk
		if spec.Backend != "" && spec.Backend != bb {
			return created[[]api.Sandbox]{}, fmt.Errorf("snapshot %s is a full VM's disk: its branches are %s sandboxes, not %s: %w", req.Snapshot, bb, spec.Backend, errdefs.ErrInvalidArgument)
		}
		spec.Backend, spec.Layers, spec.Snapshot = bb, []string{req.Snapshot}, ""
	}
	// Resolved once, for all: each branch then stands on what it named.
	if err := w.scopeOf(ctx).resolveSpec(ctx, &spec); err != nil {
		return created[[]api.Sandbox]{}, err
	}
	ctx = withTrusted(ctx)
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
	sc := w.scopeOf(ctx)
	for i, sb := range sbs {
		out[i] = sc.showSandbox(w.describe(sb))
	}
	w.log.Info("branched", "snapshot", req.Snapshot, "n", req.N, "prefix", prefix)
	return created[[]api.Sandbox]{out}, nil
}

// like is what a branch takes of the caller's sandbox name
// (BranchRequest.Like): as it runs, its policy the effective one.
func (w *worker) like(r *http.Request, name string) (api.SandboxSpec, error) {
	w.mu.Lock()
	e := w.sandboxes[name]
	w.mu.Unlock()
	if e == nil || e.sb == nil || e.gone != nil || !mayUse(r.Context(), e.owner) {
		if err := api.ValidName(name); err != nil {
			return api.SandboxSpec{}, err
		}
		return api.SandboxSpec{}, fmt.Errorf("no sandbox %s (dsec ps lists them): %w", name, errdefs.ErrNotFound)
	}
	return specOf(e.sb.Current()), nil
}

// specOf is what a sandbox of state st was made with, as a spec: its
// limits in force (none: unlimited; the default memory limit, as it
// asked for none), requests, class, env, workdir,
// backend, user namespace and effective policy.
func specOf(st runtime.State) api.SandboxSpec {
	none := func(n int64) int64 {
		if n == 0 {
			return api.Unlimited
		}
		return n
	}
	disk := st.Disk
	if disk == 0 && st.UpperFS == "" {
		disk = api.Unlimited // no bound of its own, nor the default's
	}
	memory := none(st.Limits.MemoryBytes)
	if st.MemoryRequest == 0 && st.Limits.MemoryBytes > 0 {
		// It asked for no memory (its limit is the default, and it
		// reserved nothing): neither does the branch, whose limit is the
		// default too; asking for the limit would reserve it, K times.
		memory = 0
	}
	return api.SandboxSpec{CPU: float64(st.Limits.CPUMilli) / 1000, Memory: memory, Pids: none(st.Limits.Pids), Disk: disk,
		CPURequest: st.CPURequest, MemoryRequest: st.MemoryRequest, Class: st.Class, Env: st.Env, Workdir: st.Workdir, User: st.User,
		Backend: st.Backend, Policy: st.Policy, UserNS: st.UserNS}
}

// branchNames names n branches PREFIX-I. A default prefix takes the
// indices after the highest its branches hold now, so a second branch of
// a snapshot never meets the first's; a prefix the user gave is refused
// whole, before anything is made, if any of its names is taken.
func (w *worker) branchNames(prefix string, n, first int, next bool) ([]string, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if first > 0 {
		next = false
	}
	first = max(first, 1)
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
	out := []api.SnapshotNode{}
	// ?name=REF: that snapshot's node alone, if the caller sees one of
	// that name. What names no snapshot (an E2B template ID that is a
	// layer's, at every create) is answered without the lineage, which
	// reads every layer and sandbox.
	name := r.URL.Query().Get("name")
	if name != "" && !w.isSnapshot(r.Context(), name) {
		return out, nil
	}
	nodes, err := w.tree(r.Context())
	if err != nil {
		return nil, err
	}
	for _, n := range nodes {
		n.HeldBy = w.forks.holders(n.Name)
		if v, ok := w.visible(r.Context(), n.SnapshotNode); ok && (name == "" || v.Name == name) {
			out = append(out, v)
		}
	}
	return out, nil
}

// isSnapshot says whether ref, as ctx's caller names it, is a snapshot
// in the local store.
func (w *worker) isSnapshot(ctx context.Context, ref string) bool {
	tag, ok := w.scopeOf(ctx).snapshotTag(ref)
	if !ok {
		return false
	}
	if img, err := vm.Lookup(ctx, w.host.Store, tag); err == nil {
		return img.Sandbox != ""
	}
	i, err := layer.Resolve(ctx, w.host.Store, tag)
	return err == nil && i.Kind == layer.KindSnapshot
}

// vmSnapshot says whether ref, as ctx's caller names it, is a full VM's
// snapshot (a VM image a sandbox's disk became), which its branches
// boot as their base.
func (w *worker) vmSnapshot(ctx context.Context, ref string) bool {
	tag, ok := w.scopeOf(ctx).snapshotTag(ref)
	if !ok || w.host.Store == nil {
		return false
	}
	if img, err := vm.Lookup(ctx, w.host.Store, tag); err == nil {
		return img.Sandbox != ""
	}
	if _, err := w.host.Store.Resolve(ctx, tag); err == nil { // a layer's
		return false
	}
	rec, ok := w.remoteVM(ctx, tag) // published by a worker: pulled by the branch's create
	return ok && rec.Sandbox != ""
}

func (w *worker) tree(ctx context.Context) ([]*snap.Node, error) {
	users, err := runtime.SnapUsers(w.cfg.Root)
	if err != nil {
		return nil, err
	}
	// (Creates under way are no sandboxes to list yet.)
	users = slices.DeleteFunc(users, func(u snap.User) bool { return u.Lease })
	return snap.Tree(ctx, w.host.Store, users)
}

// removeSnapshot untags a snapshot nothing stands on (or, forced, one
// something does); a create under way counts by its lease.
func (w *worker) removeSnapshot(r *http.Request, _ none) (none, error) {
	sc := w.scopeOf(r.Context())
	ref, ok := sc.snapshotTag(r.PathValue("ref"))
	if !ok {
		return none{}, errNoSnapshot(r.PathValue("ref"))
	}
	// Its users are every sandbox's state and the creates' leases
	// (store leases): a create that resolves it after they are read
	// stands on it untagged, as after a forced removal, and a collection
	// keeps it while it does.
	users, err := runtime.SnapUsers(w.cfg.Root)
	if err != nil {
		return none{}, err
	}
	if _, err := snap.Remove(r.Context(), w.host.Store, ref, users, r.URL.Query().Get("force") == "1"); err != nil {
		switch {
		case errdefs.IsNotFound(err) && !sc.admin():
			return none{}, errNoSnapshot(r.PathValue("ref"))
		case errdefs.IsFailedPrecondition(err) && !sc.admin(): // what stands on it may be others'
			return none{}, fmt.Errorf("snapshot %s is still stood on by snapshots or sandboxes (dsec snap ls --tree shows yours): remove those first, or force the removal (the tag goes; gc keeps the snapshot while they stand on it): %w",
				canonical(r.PathValue("ref")), errdefs.ErrFailedPrecondition)
		}
		return none{}, err
	}
	w.log.Info("removed snapshot", "snapshot", ref)
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
	if err := w.publishable(r.Context(), to); err != nil {
		return created[api.Snapshot]{}, fmt.Errorf("snapshot tag %s: %w", to, err)
	}
	// No collection while it reads the chain (a removal may untag a
	// link of it meanwhile: its blobs stay).
	unlock, err := w.host.Store.Writer()
	if err != nil {
		return created[api.Snapshot]{}, err
	}
	defer unlock()
	tmp, err := os.MkdirTemp(w.cfg.Root, "squash-")
	if err != nil {
		return created[api.Snapshot]{}, err
	}
	defer os.RemoveAll(tmp) // Squash unmounts what it mounted there first
	info, n, err := snap.Squash(context.WithoutCancel(r.Context()), w.host.Store, req.Snapshot, to, tmp)
	if err != nil {
		return created[api.Snapshot]{}, err
	}
	out := snapshotOf(info)
	out.Folded, out.Entries, out.Whiteouts, out.Bytes = n.Folded, n.Entries, n.Whiteouts, n.Bytes
	w.log.Info("squashed", "snapshot", req.Snapshot, "to", info.Ref, "folded", n.Folded)
	if err := w.publish(r.Context(), to); err != nil {
		return created[api.Snapshot]{}, fmt.Errorf("snapshot %s is squashed here, but %w", to, err)
	}
	return created[api.Snapshot]{out}, nil
}

// visible is n as ctx's caller sees it, if it may: a token of scope
// sandboxes sees its own snapshots, and of each only its own children
// and sandboxes.
func (w *worker) visible(ctx context.Context, n api.SnapshotNode) (api.SnapshotNode, bool) {
	sc := w.scopeOf(ctx)
	if sc.admin() {
		return n, true
	}
	if !sc.owns(n.Name) {
		return n, false
	}
	n.Children = sc.showAll(slices.DeleteFunc(slices.Clone(n.Children), func(c string) bool { return !sc.owns(c) }))
	n.Name, n.Parent, n.Layers = sc.show(n.Name), sc.show(n.Parent), sc.showAll(n.Layers)
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

// remoteFree says whether ref is free in t: an error if it names a layer
// there, or t cannot say.
func remoteFree(ctx context.Context, t remote.Target, ref layer.Ref) error {
	repo, err := t.Repo(ctx, ref)
	if err == nil {
		_, err = repo.Resolve(ctx)
	}
	switch {
	case errdefs.IsNotFound(err):
		return nil
	case err != nil:
		return fmt.Errorf("the shared remote %s cannot say whether it is taken (snap.publish): %v: %w", t, err, errdefs.ErrUnavailable)
	}
	return fmt.Errorf("taken in the shared remote %s (a snapshot packed on another worker, or one removed here since): give another step: %w", t, errdefs.ErrAlreadyExists)
}
