package worker

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/containerd/errdefs"
	"golang.org/x/sys/unix"

	"github.com/dsec-project/dsec/api"
	"github.com/dsec-project/dsec/internal/feature"
	"github.com/dsec-project/dsec/internal/layer/store"
	"github.com/dsec-project/dsec/internal/mount"
	"github.com/dsec-project/dsec/internal/policy"
	"github.com/dsec-project/dsec/internal/runtime"
	"github.com/dsec-project/dsec/internal/runtime/cgroup"
	"github.com/dsec-project/dsec/internal/runtime/container"
	"github.com/dsec-project/dsec/internal/runtime/disk"
	"github.com/dsec-project/dsec/internal/runtime/lower"
)

// Features are the host's features the worker's sandboxes use, each
// probed once: reported in /v1/version, the missing ones logged as the
// worker starts.
var Features = []*feature.Test{mount.HaveEROFS, mount.HaveOverlay, mount.HaveFUSE, mount.HaveBtrfs, mount.HaveIDMap,
	cgroup.Kill, cgroup.Freeze, cgroup.MemoryV2, policy.EgressBPF, policy.DevicesBPF,
	container.Landlock, container.CoreSched, container.MemoryMerge, container.UserNamespaces, runtime.OnlineGrow}

// features describes Features.
func features() []api.Feature {
	out := make([]api.Feature, len(Features))
	for i, f := range Features {
		out[i] = api.Feature{Name: f.Name, Available: true}
		var u *feature.UnsupportedError
		if errors.As(f.Err(), &u) {
			out[i] = api.Feature{Name: f.Name, Reason: u.Reason, Without: u.Without}
		}
	}
	return out
}

// Backends are the kinds of sandbox a worker runs, the default first:
// the runtime's registry (runtime.Backends), where they are listed once.
var Backends = runtime.Backends

type worker struct {
	cfg     Config
	log     *slog.Logger
	mounter runtime.Mounter

	// lineage: creates read it (a sandbox comes to stand on layers),
	// snapshot removal and squash write it.
	lineage sync.RWMutex

	gate *gate
	ctx  context.Context // the worker's life: pools' fillers run in it

	mu        sync.Mutex
	sandboxes map[string]*entry
	pools     map[string]*pool
	lastReq   time.Time
	shutdown  func()
	removing  sync.WaitGroup // removals after an answer (discardLater)
	closing   bool           // no more of those: the worker is exiting
	// frozen are the batch sandboxes the pressure loop froze.
	frozen map[*runtime.Sandbox]bool
}

// entry is a sandbox the worker owns; op serialises its lifecycle
// (create, stop, start, remove). w.mu guards the fields but op and sb.
type entry struct {
	op sync.Mutex
	sb *runtime.Sandbox // nil while being created

	spec    api.SandboxSpec // as asked for
	pending string          // while sb is nil: api.StatusQueued or api.StatusCreating
	since   time.Time       // of pending
	req     request         // what it holds of the host's capacity
	held    bool            // whether it holds req
	pool    string          // the FnCall pool it waits in, warm; callPool or runPool
	gone    chan struct{}   // while it is being discarded: closed when that ends
}

// ErrRunning says another worker serves the root.
var ErrRunning = errors.New("a worker already serves this root")

// Serve runs the worker until ctx ends (or a shutdown request, or
// ExitIdle). Sandboxes keep running when it returns.
func Serve(ctx context.Context, cfg Config) error {
	if cfg.Log == nil {
		cfg.Log = slog.New(slog.DiscardHandler)
	}
	initBin, err := container.InitBinary()
	if err != nil {
		return err
	}
	if err := os.MkdirAll(cfg.Root, 0o700); err != nil {
		return err
	}
	lock, err := os.OpenFile(filepath.Join(cfg.Root, "worker.lock"), os.O_CREATE|os.O_RDWR, 0o600)
	if err != nil {
		return err
	}
	defer lock.Close()
	if err := lockRoot(lock, cfg.Root); err != nil {
		return err
	}
	s, err := store.Open(filepath.Join(cfg.Root, "store"))
	if err != nil {
		return err
	}
	if err := cfg.Admission.Validate(); err != nil {
		return err
	}
	if cfg.CgroupParent != "" {
		cgroup.Parent = cfg.CgroupParent
	}
	cpus, mem, err := hostCapacity()
	if err != nil {
		return err
	}
	if err := cgroup.LimitParent(parentLimits(cfg.Admission.withDefaults(), mem)); err != nil {
		// Sandboxes using more than the new bound already: it holds
		// from when they free it; the worker runs on.
		cfg.Log.Warn("cannot bound all sandboxes together yet", "err", err)
	}
	// Sandboxes without a disk quota of their own write to one file
	// system, of a bounded size; each has its bound there.
	if err := disk.PrepareUppers(cfg.Root, cfg.Admission.UppersSize); err != nil {
		if size, _ := disk.UppersSize(cfg.Root); size == 0 {
			return err
		}
		cfg.Log.Warn("the sandboxes' file system keeps its size", "err", err) // a shrink that does not fit
	}
	defer disk.ReleaseUppers(cfg.Root) // when no sandbox is left on it
	w := &worker{cfg: cfg, log: cfg.Log, sandboxes: map[string]*entry{}, pools: map[string]*pool{}, lastReq: time.Now(), frozen: map[*runtime.Sandbox]bool{},
		gate: newGate(cfg.Admission, cpus, mem),
		mounter: runtime.Mounter{Store: s, Remote: cfg.Remote, Insecure: cfg.Insecure, Fetcher: cfg.Fetcher, Cache: cfg.Cache,
			DiskBound: cfg.Defaults.withDefaults().Disk}}
	if err := w.adopt(); err != nil {
		return err
	}
	lower.Of(cfg.Root).Keep(cfg.KeepLayers)
	defer lower.Of(cfg.Root).ReleaseKept() // after the sandboxes' release
	defer w.release()
	defer w.waitRemovals()
	if n := cfg.Admission.withDefaults().Spares; n > 0 {
		w.mounter.Spares = runtime.StartSpares(cfg.Root, n)
		defer w.mounter.Spares.Close()
	}
	if n := cfg.Admission.withDefaults().Primed; n > 0 {
		w.mounter.Primed = runtime.StartPrimed(cfg.Root, w.mounter, n)
		defer w.mounter.Primed.Close()
	}

	sock := filepath.Join(cfg.Root, api.Socket)
	os.Remove(sock) // a dead worker's: we hold the lock
	l, err := net.Listen("unix", sock)
	if err != nil {
		return fmt.Errorf("listen on %s: %w", sock, err)
	}
	defer os.Remove(sock)
	os.Chmod(sock, 0o600)
	if err := os.WriteFile(filepath.Join(cfg.Root, "worker.pid"), []byte(strconv.Itoa(os.Getpid())), 0o600); err != nil {
		return err
	}
	defer os.Remove(filepath.Join(cfg.Root, "worker.pid"))

	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	w.shutdown, w.ctx = cancel, ctx
	if err := w.startPools(ctx); err != nil {
		return err
	}
	defer w.stopPools()
	go w.reclaimLoop(ctx)
	go w.pressureLoop(ctx)
	srv := &http.Server{Handler: w.routes(), ReadHeaderTimeout: 10 * time.Second,
		BaseContext: func(net.Listener) context.Context { return ctx }}
	errc := make(chan error, 1)
	w.mu.Lock()
	n := len(w.sandboxes) // pools fill it meanwhile
	w.mu.Unlock()
	w.log.Info("worker serving", "socket", sock, "sandboxes", n, "init", initBin) // before any request
	go func() { errc <- srv.Serve(l) }()
	go func() { // off the first request's path
		for _, f := range features() {
			if !f.Available {
				w.log.Warn("the host lacks a feature", "feature", f.Name, "why", f.Reason, "so", f.Without)
			}
		}
	}()
	if cfg.Ready != nil {
		cfg.Ready()
	}
	var idle <-chan time.Time
	if cfg.ExitIdle > 0 {
		t := time.NewTicker(min(cfg.ExitIdle/4, 5*time.Second))
		defer t.Stop()
		idle = t.C
	}
	for {
		select {
		case err := <-errc:
			return err
		case <-idle:
			w.mu.Lock()
			quiet := len(w.sandboxes) == 0 && len(w.pools) == 0 && time.Since(w.lastReq) > cfg.ExitIdle
			w.mu.Unlock()
			if !quiet {
				continue
			}
			w.log.Info("worker idle: exiting", "after", cfg.ExitIdle)
		case <-ctx.Done():
		}
		// Requests in flight get a moment; running execs go on in
		// their sandboxes and a later worker collects their results.
		sctx, scancel := context.WithTimeout(context.Background(), 2*time.Second)
		defer scancel()
		srv.Shutdown(sctx)
		return nil
	}
}

// adopt takes over the sandboxes an earlier worker left.
func (w *worker) adopt() error {
	names, err := runtime.List(w.cfg.Root)
	if err != nil {
		return err
	}
	var live []string   // the IDs of what may still stand on layers
	var groups []string // the groups of the sandboxes kept
	var uppers []string // the uppers of the sandboxes kept
	unknown := false    // a sandbox whose group is unknown
	for _, name := range names {
		sb, err := runtime.Load(w.cfg.Root, name)
		if errdefs.IsNotFound(err) {
			w.log.Info("removed a sandbox a worker died creating", "sandbox", name)
			continue
		}
		if err != nil {
			live, unknown = append(live, runtime.IDOf(w.cfg.Root, name)), true
			w.log.Error("cannot adopt sandbox", "sandbox", name, "err", err)
			continue
		}
		st := sb.Snapshot()
		groups = append(groups, st.CgroupName)
		if st.Pool != "" { // a warm sandbox (or one a call had): made again
			if err := sb.Remove(); err != nil {
				live, uppers = append(live, st.ID), append(uppers, st.UpperFS)
				w.log.Error("cannot remove a pool's sandbox", "sandbox", name, "err", err)
			}
			continue
		}
		live, uppers = append(live, st.ID), append(uppers, st.UpperFS)
		w.log.Info("adopted sandbox", "sandbox", name, "status", st.Status)
		e := &entry{sb: sb, req: request{CPU: st.CPURequest, Memory: st.MemoryRequest}}
		if st.Status == runtime.Running {
			w.gate.hold(e.req)
			e.held = true
		}
		w.sandboxes[name] = e
	}
	if err := runtime.SweepUnnamed(w.cfg.Root); err != nil {
		w.log.Error("cannot remove the primed or half-made sandboxes of a worker that died", "err", err)
	}
	if err := lower.Of(w.cfg.Root).Sweep(live); err != nil {
		w.log.Error("cannot release the layers of sandboxes a worker died making", "err", err)
	}
	if err := runtime.SweepSpares(w.cfg.Root, groups, unknown); err != nil {
		w.log.Error("cannot remove the spare inits of a worker that died", "err", err)
	}
	if !unknown {
		if err := disk.SweepUppers(w.cfg.Root, uppers); err != nil {
			w.log.Error("cannot remove the uppers of sandboxes a worker died making", "err", err)
		}
	}
	return nil
}

// release lets go of every sandbox; they run on.
func (w *worker) release() {
	w.mu.Lock()
	defer w.mu.Unlock()
	for _, e := range w.sandboxes {
		if e.sb != nil {
			e.sb.Close()
		}
	}
}

func (w *worker) routes() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("GET /v1/version", handle(w.version))
	mux.HandleFunc("POST /v1/shutdown", w.shutdownReq)
	mux.HandleFunc("POST /v1/sandboxes", handle(w.create))
	mux.HandleFunc("GET /v1/sandboxes", handle(w.list))
	mux.HandleFunc("GET /v1/sandboxes/{name}", handle(w.inspect))
	mux.HandleFunc("POST /v1/sandboxes/{name}/stop", handle(w.lifecycle(w.stop)))
	mux.HandleFunc("POST /v1/sandboxes/{name}/start", handle(w.lifecycle(w.start)))
	mux.HandleFunc("DELETE /v1/sandboxes/{name}", handle(w.remove))
	mux.HandleFunc("POST /v1/sandboxes/{name}/exec", w.exec)
	mux.HandleFunc("GET /v1/sandboxes/{name}/execs/{id}", w.logs)
	mux.HandleFunc("PUT /v1/sandboxes/{name}/files", w.putFile)
	mux.HandleFunc("GET /v1/sandboxes/{name}/files", w.getFile)
	mux.HandleFunc("GET /v1/sandboxes/{name}/stat", w.statPath)
	mux.HandleFunc("GET /v1/sandboxes/{name}/archive", w.statPath)
	mux.HandleFunc("PUT /v1/sandboxes/{name}/archive", w.putArchive)
	mux.HandleFunc("POST /v1/sandboxes/{name}/snapshots", handle(w.packDiff))
	mux.HandleFunc("POST /v1/branches", handle(w.branch))
	mux.HandleFunc("GET /v1/snapshots", handle(w.snapshots))
	mux.HandleFunc("DELETE /v1/snapshots/{ref...}", handle(w.removeSnapshot))
	mux.HandleFunc("POST /v1/squash", handle(w.squash))
	mux.HandleFunc("POST /v1/sandboxes/{name}/policy", handle(w.applyPolicy))
	mux.HandleFunc("GET /v1/policies", handle(w.policies))
	mux.HandleFunc("GET /v1/policies/{name}", handle(w.getPolicy))
	mux.HandleFunc("PUT /v1/policies/{name}", handle(w.putPolicy))
	mux.HandleFunc("DELETE /v1/policies/{name}", handle(w.deletePolicy))
	mux.HandleFunc("POST /v1/calls", w.call)
	mux.HandleFunc("GET /v1/pools", handle(w.listPools))
	mux.HandleFunc("PUT /v1/pools/{name}", handle(w.putPool))
	mux.HandleFunc("DELETE /v1/pools/{name}", handle(w.deletePool))
	mux.HandleFunc("/", func(rw http.ResponseWriter, r *http.Request) {
		fail(rw, fmt.Errorf("no API call %s %s (this worker speaks %s): %w", r.Method, r.URL.Path, api.Version, errdefs.ErrNotFound))
	})
	return http.HandlerFunc(func(rw http.ResponseWriter, r *http.Request) {
		t0 := time.Now()
		w.mu.Lock()
		w.lastReq = t0
		w.mu.Unlock()
		mux.ServeHTTP(rw, r)
		w.log.Debug("request", "method", r.Method, "path", r.URL.Path, "took", time.Since(t0))
	})
}

func apiError(err error) *api.Error {
	e, _ := api.ErrorOf(err)
	return e
}

func (w *worker) version(*http.Request, none) (api.VersionInfo, error) {
	p, d := cgroup.ParentLimits(), w.cfg.Defaults.withDefaults()
	uppers, _ := disk.UppersSize(w.cfg.Root)
	return api.VersionInfo{API: api.Version, Version: w.cfg.Version, Pid: os.Getpid(), Backends: Backends.Names(),
		Limits: &api.HostLimits{MemoryBytes: p.MemoryBytes, Pids: p.Pids, HostReserve: w.cfg.Admission.withDefaults().HostReserve,
			DefaultMemory: max(d.Memory, 0), DefaultPids: max(d.Pids, 0), DefaultDisk: max(d.Disk, 0), DiskBytes: uppers},
		Features: features(), Warm: &api.Warm{Spares: w.mounter.Spares.Ready(), Primed: w.mounter.Primed.Ready()}}, nil
}

// parentLimits bound all sandboxes together: the host's memory less the
// reserve, and the host's threads less an eighth of them (at least 4096)
// for its own processes.
func parentLimits(a Admission, mem int64) cgroup.Limits {
	l := cgroup.Limits{MemoryBytes: max(mem-a.HostReserve, 64<<20)}
	threads := int64(0)
	for _, f := range []string{"/proc/sys/kernel/threads-max", "/proc/sys/kernel/pid_max"} {
		if b, err := os.ReadFile(f); err == nil {
			if n, err := strconv.ParseInt(strings.TrimSpace(string(b)), 10, 64); err == nil && (threads == 0 || n < threads) {
				threads = n
			}
		}
	}
	if threads > 0 {
		l.Pids = max(threads-max(threads/8, 4096), 1024)
	}
	return l
}

func (w *worker) shutdownReq(rw http.ResponseWriter, r *http.Request) {
	rw.WriteHeader(http.StatusNoContent)
	w.shutdown()
}

// get finds a sandbox the worker owns.
func (w *worker) get(name string) (*entry, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if e := w.sandboxes[name]; e != nil && e.sb != nil && e.gone == nil {
		return e, nil
	}
	if err := api.ValidName(name); err != nil {
		return nil, err
	}
	return nil, fmt.Errorf("no sandbox %s (dsec ps lists them): %w", name, errdefs.ErrNotFound)
}

func decode(r *http.Request, v any) error {
	dec := json.NewDecoder(io.LimitReader(r.Body, 1<<20))
	dec.DisallowUnknownFields()
	if err := dec.Decode(v); err != nil {
		return fmt.Errorf("bad request body: %v: %w", err, errdefs.ErrInvalidArgument)
	}
	return nil
}

func (w *worker) create(r *http.Request, spec api.SandboxSpec) (created[api.Sandbox], error) {
	defer time.AfterFunc(afterAnswer, w.mounter.Primed.Refill)
	sb, err := w.createSandbox(r.Context(), spec)
	if err != nil {
		return created[api.Sandbox]{}, err
	}
	return created[api.Sandbox]{w.describe(sb)}, nil
}

// limits are the cgroup limits of a sandbox made for spec: what it
// asked, else the worker's defaults.
func (w *worker) limits(spec api.SandboxSpec, req request) cgroup.Limits {
	d := w.cfg.Defaults.withDefaults()
	return cgroup.Limits{MemoryBytes: limit(spec.Memory, req.Memory, d.Memory), CPUMilli: int64(spec.CPU * 1000), Pids: limit(spec.Pids, 0, d.Pids)}
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
	return w.makeSandbox(ctx, spec, "")
}

// makeSandbox makes a sandbox once the gate admits it; pool names the
// FnCall pool it is made for.
func (w *worker) makeSandbox(ctx context.Context, spec api.SandboxSpec, pool string) (*runtime.Sandbox, error) {
	if spec.Backend == "fncall" { // what DESIGN and the CLI call one
		return nil, fmt.Errorf("fncall is not a backend but calls in warm sandboxes of one, discarded after each: use dsec run --backend fncall -- CMD, or the SDK's Call: %w", errdefs.ErrInvalidArgument)
	}
	b, err := Backends.Usable(spec.Backend)
	if err != nil {
		return nil, err
	}
	spec.Backend = b.Name()
	if err := checkSpec(&spec); err != nil {
		return nil, err
	}
	if err := w.cfg.Admission.checkDisk(w.cfg.Root); err != nil {
		return nil, err
	}
	if spec.Disk <= 0 { // it writes to the shared file system
		size, free := disk.UppersSize(w.cfg.Root)
		if err := w.cfg.Admission.checkUppers(disk.UppersDir(w.cfg.Root), size, free); err != nil {
			return nil, err
		}
	}
	if spec.Name == "" {
		spec.Name = runtime.RandomName("sb-")
	}
	if err := api.ValidName(spec.Name); err != nil {
		return nil, err
	}
	// Reserve the name: a second create of it fails at once.
	e := &entry{spec: spec, pending: api.StatusCreating, since: time.Now(), req: requestOf(spec), pool: pool}
	e.op.Lock()
	defer e.op.Unlock()
	w.mu.Lock()
	for {
		old, taken := w.sandboxes[spec.Name]
		if !taken {
			break
		}
		gone := old.gone
		if gone == nil {
			w.mu.Unlock()
			return nil, fmt.Errorf("sandbox %s already exists: give another --name, or remove it first (dsec rm): %w", spec.Name, errdefs.ErrAlreadyExists)
		}
		w.mu.Unlock() // the name's sandbox is going: wait for it
		select {
		case <-gone:
		case <-ctx.Done():
			return nil, ctx.Err()
		}
		w.mu.Lock()
	}
	w.sandboxes[spec.Name] = e
	w.mu.Unlock()
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
	// Not while queued: snapshot removal and squash wait for this.
	m := w.mounter
	if pool != "" && pool != runPool && pool != callPool { // a pool's filler: not what users create next
		m.Primed = nil
	}
	w.lineage.RLock()
	t0 := time.Now()
	sb, err := runtime.Create(context.WithoutCancel(ctx), w.cfg.Root, runtime.Options{Mounter: m, Spec: runtime.Spec{
		Name: spec.Name, Backend: spec.Backend, Layers: spec.Layers, From: spec.Snapshot, Hostname: spec.Hostname, Env: spec.Env,
		Workdir: spec.Workdir, Policy: pol, Limits: w.limits(spec, e.req), Class: spec.Class, UserNS: spec.UserNS,
		Disk:          max(spec.Disk, 0),
		DiskBound:     min(spec.Disk, 0), // api.Unlimited, or the default
		CPURequest:    e.req.CPU,
		MemoryRequest: e.req.Memory,
		MergeMemory:   w.cfg.Reclaim.KSM,
		Pool:          pool,
	}})
	w.lineage.RUnlock()
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
	w.log.Info("created sandbox", "sandbox", spec.Name, "layers", spec.Layers, "pool", pool, "took", time.Since(t0))
	return sb, nil
}

// stop stops a sandbox and gives back what it held of the host.
func (w *worker) stop(_ context.Context, e *entry) error {
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
	if e.sb.Snapshot().Status == runtime.Running {
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
	err := e.sb.Start(context.WithoutCancel(ctx), w.mounter)
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

// describe is a sandbox as the API shows it.
func (w *worker) describe(sb *runtime.Sandbox) api.Sandbox {
	st := sb.Snapshot()
	out := api.Sandbox{
		SandboxSpec: api.SandboxSpec{Name: st.Name, Backend: cmp.Or(st.Backend, Backends.Names()[0]), Layers: st.Layers, CPU: float64(st.Limits.CPUMilli) / 1000,
			Memory: st.Limits.MemoryBytes, Pids: st.Limits.Pids, Disk: st.Disk, Env: st.Env, Workdir: st.Workdir, Hostname: st.Hostname, Snapshot: st.From,
			Policy: st.Policy, UserNS: st.UserNS},
		ID: st.ID, Status: st.Status, Pid: st.Pid, Digests: st.Digests, Created: st.Created, Execs: sb.ExecCount(),
		DiskUsed: sb.DiskUsed(), DiskLimit: cmp.Or(st.Disk, st.DiskBound), IdleSeconds: sb.Idle().Seconds(),
	}
	showMark(&out, st.Pool)
	out.Class, out.CPURequest, out.MemoryRequest = st.Class, st.CPURequest, st.MemoryRequest
	if t := sb.Reclaimed(); !t.IsZero() {
		out.Reclaimed = &t
	}
	if st.NAT != nil {
		out.Address, out.Gateway = st.NAT.Sandbox, st.NAT.Host
	}
	if st.IDs != nil {
		out.HostID = st.IDs.Host
	}
	if g := sb.Cgroup(); g != nil && st.Status == runtime.Running {
		out.Cgroup = g.Path()
		out.MemoryBytes, _ = g.MemoryCharged()
		out.OOMKills = g.OOMKills()
		out.MemoryLimit, out.PidsLimit = g.Limits()
		out.Frozen = g.Frozen()
		if out.PidsLimit > 0 { // the user's count, the init's share left out
			out.PidsLimit = max(out.PidsLimit-runtime.InitPids, 1)
		}
		if used, err := g.CPUUsage(); err == nil {
			out.CPUSeconds = used.Seconds()
		}
	}
	return out
}

// showMark shows what a sandbox was made for: a FnCall pool (or a call)
// by name, a run --rm as Rm.
func showMark(sb *api.Sandbox, mark string) {
	if mark == runPool {
		sb.Rm = true
		return
	}
	sb.Pool = mark
}

// list lists the sandboxes, queued and being made ones included; warm
// pool sandboxes only with all=1.
func (w *worker) list(r *http.Request, _ none) ([]api.Sandbox, error) {
	all := r.URL.Query().Get("all") == "1"
	out := []api.Sandbox{}
	w.mu.Lock()
	var sbs []*runtime.Sandbox
	for _, e := range w.sandboxes {
		switch {
		case e.gone != nil: // being removed
		case e.pool != "" && e.pool != runPool && !all:
		case e.sb != nil:
			sbs = append(sbs, e.sb)
		default:
			spec := e.spec
			spec.Policy = nil
			sb := api.Sandbox{SandboxSpec: spec, Status: e.pending, Created: e.since, Digests: []string{}}
			showMark(&sb, e.pool)
			out = append(out, sb)
		}
	}
	w.mu.Unlock()
	for _, sb := range sbs {
		out = append(out, w.describe(sb))
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Created.Before(out[j].Created) })
	return out, nil
}

func (w *worker) inspect(r *http.Request, _ none) (api.Sandbox, error) {
	e, err := w.get(r.PathValue("name"))
	if err != nil {
		return api.Sandbox{}, err
	}
	return w.describe(e.sb), nil
}

// lifecycle serves stop and start: one operation on the sandbox under
// its lifecycle lock, answered with the sandbox as it is then.
func (w *worker) lifecycle(op func(ctx context.Context, e *entry) error) func(*http.Request, none) (api.Sandbox, error) {
	return func(r *http.Request, _ none) (api.Sandbox, error) {
		e, err := w.get(r.PathValue("name"))
		if err != nil {
			return api.Sandbox{}, err
		}
		e.op.Lock()
		err = op(r.Context(), e)
		e.op.Unlock()
		if err != nil {
			return api.Sandbox{}, err
		}
		return w.describe(e.sb), nil
	}
}

func (w *worker) remove(r *http.Request, _ none) (none, error) {
	name := r.PathValue("name")
	e, err := w.get(name)
	if err != nil {
		return none{}, err
	}
	force := r.URL.Query().Get("force") == "1"
	e.op.Lock()
	defer e.op.Unlock()
	if st := e.sb.Snapshot().Status; st == runtime.Running && !force {
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
	w.mu.Lock()
	if e := w.sandboxes[name]; e != nil && e.held {
		w.gate.release(e.req)
	}
	delete(w.sandboxes, name)
	w.mu.Unlock()
	w.log.Info("removed sandbox", "sandbox", name, "took", time.Since(t0))
	return nil
}

// Serving reports whether a worker runs on root: whether it holds the
// root's lock, where a dead worker's copy of it (see lockRoot) does not
// count once it is gone.
func Serving(root string) bool {
	f, err := os.Open(filepath.Join(root, "worker.lock"))
	if err != nil {
		return false
	}
	defer f.Close() // the lock goes with it
	return lockRoot(f, root) != nil
}

// lockRoot takes the root's worker lock. A worker killed a moment ago
// may hold it still, through a copy of the descriptor in a child it was
// starting (between clone and exec, which closes it): while the worker
// worker.pid names is dead, wait for the copy to go.
func lockRoot(lock *os.File, root string) error {
	for deadline := time.Now().Add(2 * time.Second); ; {
		err := unix.Flock(int(lock.Fd()), unix.LOCK_EX|unix.LOCK_NB)
		if !errors.Is(err, unix.EWOULDBLOCK) {
			return err
		}
		b, _ := os.ReadFile(filepath.Join(root, "worker.pid"))
		pid, perr := strconv.Atoi(strings.TrimSpace(string(b)))
		if perr == nil && pid > 0 && unix.Kill(pid, 0) != unix.ESRCH || time.Now().After(deadline) {
			return fmt.Errorf("%w (%s, pid %s): %w", ErrRunning, root, strings.TrimSpace(string(b)), errdefs.ErrAlreadyExists)
		}
		time.Sleep(10 * time.Millisecond)
	}
}
