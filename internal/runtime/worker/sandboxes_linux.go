package worker

import (
	"cmp"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"sort"
	"time"

	"github.com/containerd/errdefs"

	"github.com/dsec-project/dsec/api"
	"github.com/dsec-project/dsec/internal/e2b"
	"github.com/dsec-project/dsec/internal/runtime"
	"github.com/dsec-project/dsec/internal/runtime/cgroup"
	"github.com/dsec-project/dsec/internal/runtime/disk"
	"github.com/dsec-project/dsec/internal/runtime/vm"
)

// get finds the sandbox r names ({name}), if r's caller may see it: to
// another token's, it does not exist.
func (w *worker) get(r *http.Request) (*entry, error) {
	name := r.PathValue("name")
	w.mu.Lock()
	defer w.mu.Unlock()
	if e := w.sandboxes[name]; e != nil && e.sb != nil && e.gone == nil && mayUse(r.Context(), e.owner) {
		return e, nil
	}
	if err := api.ValidName(name); err != nil {
		return nil, err
	}
	return nil, fmt.Errorf("no sandbox %s (dsec ps lists them): %w", name, errdefs.ErrNotFound)
}

// maxBody bounds a request's JSON body (a spec with its policy, say).
const maxBody = 1 << 20

func decode(r *http.Request, v any) error {
	lr := &io.LimitedReader{R: r.Body, N: maxBody + 1}
	dec := json.NewDecoder(lr)
	dec.DisallowUnknownFields()
	if err := dec.Decode(v); err != nil {
		if lr.N == 0 {
			return fmt.Errorf("request body over %d KiB: send less (a policy's rules, a spec's env): %w", maxBody>>10, errdefs.ErrOutOfRange)
		}
		return fmt.Errorf("bad request body: %v: %w", err, errdefs.ErrInvalidArgument)
	}
	return nil
}

func (w *worker) create(r *http.Request, spec api.SandboxSpec) (created[api.Sandbox], error) {
	if rec := r.Header.Get(e2b.HeaderRecord); rec != "" {
		defer time.AfterFunc(afterAnswer, w.host.Primed.Refill)
		return w.createForE2B(r, spec, rec)
	}
	w.primeAfter.creating()
	var sb *runtime.Sandbox
	defer func() {
		if sb == nil { // (a panic too)
			time.AfterFunc(afterAnswer, w.host.Primed.Refill)
		}
	}()
	sb, err := w.createSandbox(r.Context(), spec)
	if err != nil {
		sb = nil
		return created[api.Sandbox]{}, err
	}
	w.primeAfter.created(sb.Name, w.host.Primed.Refill)
	return created[api.Sandbox]{w.scopeOf(r.Context()).showSandbox(w.describe(sb))}, nil
}

// createForE2B is a create a gateway's E2B front sent with its record
// (e2b.HeaderRecord): this worker's front keeps the record from before
// the sandbox runs, and the answer holds its access token.
func (w *worker) createForE2B(r *http.Request, spec api.SandboxSpec, rec string) (created[api.Sandbox], error) {
	front := w.front.Load()
	switch {
	case !vouched(r):
		return created[api.Sandbox]{}, fmt.Errorf("a token of scope %s cannot send an E2B record: use an admin token (a gateway's): %w", tokenOf(r.Context()).Scope, errdefs.ErrPermissionDenied)
	case front == nil:
		return created[api.Sandbox]{}, fmt.Errorf("this worker serves no E2B front (its log says why): %w", errdefs.ErrUnavailable)
	case spec.Name == "":
		return created[api.Sandbox]{}, fmt.Errorf("a create with an E2B record must name its sandbox: %w", errdefs.ErrInvalidArgument)
	}
	pending, err := front.Adopt(rec, spec.Name, ownerOf(r.Context()))
	if err != nil {
		return created[api.Sandbox]{}, err
	}
	made := false
	defer func() {
		if !made { // (a panic too)
			pending.Drop()
		}
	}()
	sb, err := w.createSandbox(r.Context(), spec)
	if err != nil {
		return created[api.Sandbox]{}, err
	}
	st, err := pending.Made(sb.ID)
	if err != nil { // not the sandbox the gateway asked for: none is
		w.discard(sb.Name)
		return created[api.Sandbox]{}, err
	}
	made = true
	out := w.scopeOf(r.Context()).showSandbox(w.describe(sb))
	out.E2B = st
	return created[api.Sandbox]{out}, nil
}

// limits are the cgroup limits of a sandbox made for spec: what it
// asked, else the worker's defaults.
func (w *worker) limits(spec api.SandboxSpec, req request) cgroup.Limits {
	d := w.cfg.Defaults.withDefaults()
	return cgroup.Limits{MemoryBytes: limit(spec.Memory, req.Memory, d.Memory), CPUMilli: int64(spec.CPU * 1000), Pids: limit(spec.Pids, 0, d.Pids)}
}

// makeOnHost makes the sandbox s on the worker's host: one made ahead
// of need (a pool's filler) never takes a primed sandbox, which is for
// the creates users make next.
func (w *worker) makeOnHost(ctx context.Context, why purpose, s runtime.Spec) (*runtime.Sandbox, error) {
	if why.warm() {
		return w.host.CreateAhead(ctx, s)
	}
	return w.host.Create(ctx, s)
}

// checkSpec refuses a spec no worker could make.
func checkSpec(spec *api.SandboxSpec) error { return spec.Validate() }

// requestOf is what a sandbox reserves: its requests, or its limits.
func requestOf(spec api.SandboxSpec) request {
	r := request{CPU: spec.CPURequest, Memory: spec.MemoryRequest}
	if r.CPU == 0 {
		r.CPU = spec.CPU
	}
	if r.Memory == 0 {
		r.Memory = spec.Memory
	}
	return r
}

// createSandbox makes a sandbox a user asked for (a pool's are made by
// its filler): one primed ahead serves it when it is what was primed.
func (w *worker) createSandbox(ctx context.Context, spec api.SandboxSpec) (*runtime.Sandbox, error) {
	return w.makeSandbox(ctx, spec, forUser)
}

// makeSandbox makes a sandbox once the gate admits it; pool names the
// FnCall pool it is made for.
func (w *worker) makeSandbox(ctx context.Context, spec api.SandboxSpec, why purpose) (*runtime.Sandbox, error) {
	if err := w.resolve(ctx, &spec); err != nil {
		return nil, err
	}
	e, err := w.reserve(ctx, spec, why)
	if err != nil {
		return nil, err
	}
	defer e.op.Unlock()
	defer w.making.Done()
	forget := func() {
		w.mu.Lock()
		delete(w.sandboxes, spec.Name)
		w.mu.Unlock()
	}
	pol, err := w.policyOf(spec.Policy, spec.PolicyName)
	if err != nil {
		forget()
		return nil, err
	}
	// A client that goes away while its creation is queued takes it out
	// of the queue; once admitted, the sandbox is made for its retry.
	err = w.gate.admit(ctx, e.req, func() {
		w.mu.Lock()
		e.pending, e.since = api.StatusQueued, time.Now()
		w.mu.Unlock()
		w.log.Info("sandbox queued for admission", "sandbox", spec.Name)
	})
	if err != nil {
		forget()
		return nil, err
	}
	w.mu.Lock()
	e.pending, e.held = api.StatusCreating, true
	w.mu.Unlock()
	t0 := time.Now()
	sb, err := w.makeOnHost(context.WithoutCancel(ctx), why, runtime.Spec{
		Name: spec.Name, Backend: spec.Backend, Layers: spec.Layers, From: spec.Snapshot, Hostname: spec.Hostname, Env: spec.Env,
		Workdir: spec.Workdir, User: spec.User, Image: spec.Image, Policy: pol, Limits: w.limits(spec, e.req), Class: spec.Class, UserNS: spec.UserNS,
		Disk:          max(spec.Disk, 0),
		DiskBound:     min(spec.Disk, 0), // api.Unlimited, or the default
		CPURequest:    e.req.CPU,
		MemoryRequest: e.req.Memory,
		MergeMemory:   w.cfg.Reclaim.KSM,
		Pool:          string(why),
		Owner:         e.owner,
		DiskOnly:      spec.DiskOnly,
	})
	// The entry leaves "creating" before the slot goes to the next
	// creation: ps never shows more being made than max_creating.
	w.mu.Lock()
	if err != nil {
		delete(w.sandboxes, spec.Name)
	} else {
		e.sb, e.pending = sb, ""
	}
	w.mu.Unlock()
	w.gate.created()
	if err != nil {
		w.gate.release(e.req)
		return nil, err
	}
	w.log.Info("created sandbox", "sandbox", spec.Name, "layers", spec.Layers, "pool", string(why), "took", time.Since(t0))
	return sb, nil
}

// resolve makes spec what the sandbox is made of: a tenant's refs
// checked and resolved, an image's layers and defaults taken, the
// backend chosen (a memory snapshot's microVM by default), the host's
// disk checked, a name given.
func (w *worker) resolve(ctx context.Context, spec *api.SandboxSpec) error {
	if spec.Backend == "fncall" { // what DESIGN and the CLI call one
		return fmt.Errorf("fncall is not a backend but calls in warm sandboxes of one, discarded after each: use dsec run --backend fncall -- CMD, or the SDK's Call: %w", errdefs.ErrInvalidArgument)
	}
	if !isTrusted(ctx) { // the caller's own spec, not a template's or a pool's
		if err := w.checkAllowed(ctx, *spec); err != nil {
			return err
		}
		if err := w.scopeOf(ctx).resolveSpec(ctx, spec); err != nil {
			return err
		}
	}
	if err := w.withImage(ctx, spec); err != nil {
		return err
	}
	if mb := w.host.Drivers.MemoryBackend(); spec.Snapshot != "" && !spec.DiskOnly && mb != "" && (spec.Backend == "" || spec.Backend == mb) {
		// A memory snapshot's branch continues its guest, a microVM of
		// its RAM, by default.
		mem, err := w.host.MemoryOf(ctx, spec.Snapshot)
		if err != nil && !errdefs.IsNotFound(err) {
			return err
		}
		if mem != nil {
			spec.Backend = mb
			if spec.Memory == 0 {
				spec.Memory = mem.MemoryBytes
			}
		}
	}
	if err := w.withBase(ctx, spec); err != nil {
		return err
	}
	b, err := w.host.Drivers.Usable(spec.Backend)
	if err != nil {
		return err
	}
	spec.Backend = b.Name()
	if err := checkSpec(spec); err != nil {
		return err
	}
	if err := w.cfg.Admission.checkDisk(w.cfg.Root); err != nil {
		return err
	}
	if spec.Disk <= 0 { // it writes to the shared file system
		size, free := disk.UppersSize(w.cfg.Root)
		if err := w.cfg.Admission.checkUppers(disk.UppersDir(w.cfg.Root), size, free); err != nil {
			return err
		}
	}
	if spec.Name == "" {
		spec.Name = runtime.RandomName("sb-")
	}
	return api.ValidName(spec.Name)
}

// withBase pulls the VM image a sandbox of a backend that boots one
// (a full VM's) names, when the shared remote holds it and the store
// does not, and takes the RAM its memory snapshot had.
func (w *worker) withBase(ctx context.Context, spec *api.SandboxSpec) error {
	if len(spec.Layers) != 1 || !w.host.Drivers.BootsBase(spec.Backend) {
		return nil
	}
	if _, err := w.host.Drivers.Usable(spec.Backend); err != nil { // before anything is pulled for it
		return err
	}
	if err := w.pullVM(ctx, spec.Layers[0]); err != nil {
		return err
	}
	if !spec.DiskOnly && spec.Memory == 0 && w.host.Store != nil {
		// A full VM's memory snapshot continues with the RAM it had.
		if img, err := vm.Lookup(ctx, w.host.Store, spec.Layers[0]); err == nil && img.Memory != nil {
			spec.Memory = img.Memory.Machine.MemoryBytes
		}
	}
	return nil
}

// reserve takes spec's name for a sandbox being made (a second create
// of it fails at once; one whose sandbox is being removed waits), within
// the tenant's quota. The entry comes back with its op held and the
// worker's making counted: the caller lets both go.
func (w *worker) reserve(ctx context.Context, spec api.SandboxSpec, why purpose) (*entry, error) {
	owner := ownerOf(ctx)
	if why.warm() { // a pool's sandbox: the admin's
		owner = ""
	}
	// Queued until the gate admits it: only so many are creating.
	e := &entry{spec: spec, pending: api.StatusQueued, since: time.Now(), req: requestOf(spec), purpose: why, owner: owner}
	t := tenantOf(ctx)
	if t != nil { // a pool's sandbox for its call too
		e.account = t.ID
	}
	e.op.Lock()
	fail := func(err error) (*entry, error) {
		e.op.Unlock()
		return nil, err
	}
	w.mu.Lock()
	for {
		if w.stopping {
			w.mu.Unlock()
			return fail(errStopping)
		}
		old, taken := w.sandboxes[spec.Name]
		if !taken {
			break
		}
		gone := old.gone
		if gone == nil {
			w.mu.Unlock()
			return fail(fmt.Errorf("sandbox %s already exists: give another --name, or remove it first (dsec rm): %w", spec.Name, errdefs.ErrAlreadyExists))
		}
		w.mu.Unlock() // the name's sandbox is going: wait for it
		select {
		case <-gone:
		case <-ctx.Done():
			return fail(ctx.Err())
		}
		w.mu.Lock()
	}
	if t != nil {
		if err := w.checkQuota(t, e); err != nil {
			w.mu.Unlock()
			return fail(err)
		}
	}
	w.sandboxes[spec.Name] = e
	w.making.Add(1) // before stopMaking waits: w.stopping is false
	w.mu.Unlock()
	return e, nil
}

// stop stops a sandbox and gives back what it held of the host.
func (w *worker) stop(_ context.Context, e *entry) error {
	w.vnc.revoke(e.sb.Name)
	if err := e.sb.Stop(); err != nil {
		return err
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	if e.held {
		w.gate.release(e.req)
		e.held = false
	}
	return nil
}

// start starts a stopped sandbox once the gate admits it again.
func (w *worker) start(ctx context.Context, e *entry) error {
	if e.sb.Current().Status == runtime.Running {
		return fmt.Errorf("sandbox %s is already running: %w", e.sb.Name, errdefs.ErrFailedPrecondition)
	}
	w.mu.Lock()
	held := e.held
	w.mu.Unlock()
	if !held {
		if err := w.gate.admit(ctx, e.req, nil); err != nil {
			return err
		}
		defer w.gate.created()
	}
	err := e.sb.Start(context.WithoutCancel(ctx))
	w.mu.Lock()
	defer w.mu.Unlock()
	if err != nil { // it is stopped now, a dead one too: it holds nothing
		w.gate.release(e.req)
		e.held = false
		return err
	}
	e.held = true
	return nil
}

// pause and resume freeze a running sandbox and let it run on (an
// evicted one's guest restored).
func (w *worker) pause(_ context.Context, e *entry) error { return e.sb.Pause() }

// idle takes a trainer's hint that the sandbox waits for the model: one
// expected to wait at least idle.min_wait is frozen until its next exec.
func (w *worker) idle(r *http.Request, req api.IdleRequest) (api.IdleReport, error) {
	if req.ExpectedSeconds < 0 || req.ExpectedSeconds > 30*24*3600 {
		return api.IdleReport{}, fmt.Errorf("expected wait %gs: give 0 to 30 days in seconds: %w", req.ExpectedSeconds, errdefs.ErrInvalidArgument)
	}
	e, err := w.get(r)
	if err != nil {
		return api.IdleReport{}, err
	}
	e.op.Lock()
	least := w.cfg.Reclaim.withDefaults().HintMin
	if least < 0 {
		least = time.Duration(1<<63 - 1) // (hints ignored)
	}
	rep, err := e.sb.Hint(context.WithoutCancel(r.Context()), time.Duration(req.ExpectedSeconds*float64(time.Second)), least)
	e.op.Unlock()
	if err != nil {
		return api.IdleReport{}, err
	}
	return api.IdleReport{Frozen: rep.Paused, MemoryBefore: rep.Before, MemoryAfter: rep.After}, nil
}
func (w *worker) resume(ctx context.Context, e *entry) error {
	return e.sb.Resume(context.WithoutCancel(ctx))
}

// evict pauses a running microVM (a paused one stays so) and saves its
// guest to its directory, its memory given back to the host.
func (w *worker) evict(ctx context.Context, e *entry) error {
	if err := e.sb.Evict(context.WithoutCancel(ctx)); err != nil {
		return err
	}
	w.log.Info("evicted a paused microVM", "sandbox", e.sb.Name)
	return nil
}

// describe is a sandbox as the API shows it: its state, and what it
// uses now (runtime's Stats).
func (w *worker) describe(sb *runtime.Sandbox) api.Sandbox { return w.describeAs(sb, true) }

// describeAs is describe, with what the sandbox uses now only if stats
// (each read from its groups and disk): a brief list's leaves it out.
func (w *worker) describeAs(sb *runtime.Sandbox, stats bool) api.Sandbox {
	st := sb.Current()
	var use runtime.Stats
	if stats {
		use = sb.Stats()
	}
	out := api.Sandbox{
		SandboxSpec: api.SandboxSpec{Name: st.Name, Backend: cmp.Or(st.Backend, w.host.Drivers.Default()), Layers: st.Layers, CPU: float64(st.Limits.CPUMilli) / 1000,
			Memory: st.Limits.MemoryBytes, Pids: st.Limits.Pids, Disk: st.Disk, Env: st.Env, Workdir: st.Workdir, User: st.User, Image: st.Image, Hostname: st.Hostname, Snapshot: st.From,
			Policy: st.Policy, UserNS: st.UserNS},
		ID: st.ID, Owner: st.Owner, Status: st.Status, Pid: st.Pid, Digests: st.Digests, Created: st.Created, Execs: use.Execs,
		DiskUsed: use.DiskUsed, DiskLimit: cmp.Or(st.Disk, st.DiskBound), IdleSeconds: use.Idle.Seconds(),
		Cgroup: use.Cgroup, MemoryBytes: use.MemoryBytes, OOMKills: use.OOMKills, MemoryLimit: use.MemoryLimit, PidsLimit: use.PidsLimit,
		Frozen: use.Frozen, CPUSeconds: use.CPUSeconds,
	}
	if st.VM != nil {
		vm := *st.VM
		vm.Evicted = st.Saved != nil
		vm.GuestMemory, vm.GuestMemoryUsed = use.GuestMemory, use.GuestMemoryUsed
		out.VM = &vm
	}
	switch {
	case st.Paused && st.Hinted:
		out.Hinted = true // (running, as far as its user is concerned)
	case st.Paused:
		out.Status = api.StatusPaused
	}
	showMark(&out, purpose(st.Pool))
	out.Class, out.CPURequest, out.MemoryRequest = st.Class, st.CPURequest, st.MemoryRequest
	if !use.Reclaimed.IsZero() {
		out.Reclaimed = &use.Reclaimed
	}
	if st.NAT != nil {
		out.Address, out.Gateway = st.NAT.Sandbox, st.NAT.Host
	}
	if st.IDs != nil {
		out.HostID = st.IDs.Host
	}
	if f := w.front.Load(); f != nil && stats {
		out.E2B = f.State(st.Name, st.ID)
	}
	return out
}

// showMark shows what a sandbox was made for: a FnCall pool (or a call)
// by name, a run --rm as Rm.
func showMark(sb *api.Sandbox, why purpose) {
	if why == forRun {
		sb.Rm = true
		return
	}
	sb.Pool = string(why)
}

// list lists the sandboxes, queued and being made ones included; warm
// pool sandboxes only with all=1.
func (w *worker) list(r *http.Request, _ none) ([]api.Sandbox, error) {
	all := r.URL.Query().Get("all") == "1"
	// ?brief=1: without what each uses now (a gateway's heartbeat: what
	// a worker holds, not what it costs to read every group each time).
	brief := r.URL.Query().Get("brief") == "1"
	out := []api.Sandbox{}
	w.mu.Lock()
	var sbs []*runtime.Sandbox
	for _, e := range w.sandboxes {
		switch {
		case !mayUse(r.Context(), e.owner): // another token's
		case e.gone != nil: // being removed
		case !e.purpose.listed() && !all:
		case e.sb != nil:
			sbs = append(sbs, e.sb)
		default:
			spec := e.spec
			spec.Policy = nil
			// (Its owner's too, while it is made: a gateway counts it in
			// the token's quota from such a list.)
			sb := api.Sandbox{SandboxSpec: spec, Owner: e.owner, Status: e.pending, Created: e.since, Digests: []string{}}
			showMark(&sb, e.purpose)
			out = append(out, sb)
		}
	}
	w.mu.Unlock()
	for _, sb := range sbs {
		out = append(out, w.describeAs(sb, !brief))
	}
	sc := w.scopeOf(r.Context())
	for i := range out {
		out[i] = sc.showSandbox(out[i])
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Created.Before(out[j].Created) })
	return out, nil
}

func (w *worker) inspect(r *http.Request, _ none) (api.Sandbox, error) {
	e, err := w.get(r)
	if err != nil {
		return api.Sandbox{}, err
	}
	return w.scopeOf(r.Context()).showSandbox(w.describe(e.sb)), nil
}

// lifecycle serves stop and start: one operation on the sandbox under
// its lifecycle lock, answered with the sandbox as it is then.
func (w *worker) lifecycle(op func(ctx context.Context, e *entry) error) func(*http.Request, none) (api.Sandbox, error) {
	return func(r *http.Request, _ none) (api.Sandbox, error) {
		e, err := w.get(r)
		if err != nil {
			return api.Sandbox{}, err
		}
		e.op.Lock()
		err = op(r.Context(), e)
		e.op.Unlock()
		if err != nil {
			return api.Sandbox{}, err
		}
		return w.scopeOf(r.Context()).showSandbox(w.describe(e.sb)), nil
	}
}

func (w *worker) remove(r *http.Request, _ none) (none, error) {
	name := r.PathValue("name")
	e, err := w.get(r)
	if err != nil {
		return none{}, err
	}
	force := r.URL.Query().Get("force") == "1"
	e.op.Lock()
	defer e.op.Unlock()
	if st := e.sb.Current().Status; st == runtime.Running && !force {
		return none{}, fmt.Errorf("sandbox %s is running: stop it first, or force the removal (dsec rm -f): %w", name, errdefs.ErrFailedPrecondition)
	}
	return none{}, w.removeSandbox(name, e.sb)
}

// removeSandbox removes a sandbox and forgets it; the caller holds its
// lifecycle lock, or made it and nobody else knows it yet.
func (w *worker) removeSandbox(name string, sb *runtime.Sandbox) error {
	t0 := time.Now()
	if err := sb.Remove(); err != nil {
		return fmt.Errorf("remove sandbox %s: %w", name, err)
	}
	if f := w.front.Load(); f != nil { // before the name is free again
		f.Forget(sb.ID)
	}
	w.vnc.revoke(name)
	w.mu.Lock()
	if e := w.sandboxes[name]; e != nil && e.held {
		w.gate.release(e.req)
	}
	delete(w.sandboxes, name)
	w.mu.Unlock()
	w.log.Info("removed sandbox", "sandbox", name, "took", time.Since(t0))
	return nil
}
