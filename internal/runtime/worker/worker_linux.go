package worker

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/containerd/errdefs"
	"golang.org/x/sync/singleflight"
	"golang.org/x/sys/unix"

	"github.com/dsec-project/dsec/api"
	"github.com/dsec-project/dsec/internal/auth"
	"github.com/dsec-project/dsec/internal/e2b"
	"github.com/dsec-project/dsec/internal/feature"
	"github.com/dsec-project/dsec/internal/layer/store"
	"github.com/dsec-project/dsec/internal/mount"
	"github.com/dsec-project/dsec/internal/policy"
	"github.com/dsec-project/dsec/internal/rootdir"
	"github.com/dsec-project/dsec/internal/runtime"
	"github.com/dsec-project/dsec/internal/runtime/cgroup"
	"github.com/dsec-project/dsec/internal/runtime/container"
	"github.com/dsec-project/dsec/internal/runtime/disk"
	"github.com/dsec-project/dsec/internal/runtime/driver"
	"github.com/dsec-project/dsec/internal/runtime/initproto"
)

// Features are the host's features the worker's sandboxes use, each
// probed once: reported in /v1/version, the missing ones logged as the
// worker starts.
var Features = []*feature.Test{mount.HaveEROFS, mount.HaveOverlay, mount.HaveFUSE, mount.HaveBtrfs, mount.HaveIDMap,
	cgroup.Kill, cgroup.Freeze, cgroup.MemoryV2, policy.EgressBPF, policy.DevicesBPF,
	initproto.Landlock, initproto.CoreSched, initproto.MemoryMerge, initproto.UserNamespaces, runtime.OnlineGrow, runtime.Swap}

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

// Driver is a backend's driver.
type Driver = driver.Driver

type worker struct {
	cfg  Config
	log  *slog.Logger
	host *runtime.Host
	vnc  vncGrants // grants to full VMs' screens over VNC
	// imports bounds the image imports at once (they fetch and write
	// for the host; creates wait for them before admission).
	imports    chan struct{}
	vmPulls    singleflight.Group // VM images pulled from the shared remote (pullVM)
	primeAfter primeAfter         // when the next sandbox is primed after a create

	gate *gate
	ctx  context.Context // the worker's life: pools' fillers run in it
	// forks are its fork groups and leases.
	forks *forkBook

	mu        sync.Mutex
	sandboxes map[string]*entry
	pools     map[string]*pool
	lastReq   time.Time
	shutdown  func()
	removing  sync.WaitGroup // removals after an answer (discardLater)
	closing   bool           // no more of those: the worker is exiting
	making    sync.WaitGroup // creates under way (makeSandbox)
	stopping  bool           // no more creates, no new pool: the worker is exiting
	// frozen are the batch sandboxes the pressure loop froze.
	frozen map[*runtime.Sandbox]bool
	// claims are the names gateways claimed here, released those let go
	// as their sandboxes were removed (fleet_linux.go).
	claims, released map[string]claim
	claimsDirty      bool // not written since they changed

	tokens *auth.Store // the TCP API's (remote_linux.go)
	// front is the E2B front (e2b_linux.go), once the worker serves: it
	// forgets a sandbox the worker removes.
	front atomic.Pointer[e2b.Server]
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
	purpose purpose         // what it is made for: a user's, a pool's, a call's
	gone    chan struct{}   // while it is being discarded: closed when that ends
	owner   string          // the id of the token that made it ("": the admin's)
	// account is the token whose quota holds it: its owner's, or the
	// caller's of a call in a pool's sandbox (the admin's).
	account string
	// evictFailed: when the pressure loop last failed to evict it.
	evictFailed time.Time
}

// ErrRootServed says another worker serves the root.
var ErrRootServed = errors.New("a worker already serves this root")

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
	lock, err := claimRoot(cfg)
	if err != nil {
		return err
	}
	defer lock.Close()
	tcp, e2bListener, err := listen(cfg) // first: a bad address fails the start, not a later request
	defer func() {
		for _, l := range append(tcp, e2bListener) {
			if l != nil {
				l.Close()
			}
		}
	}()
	if err != nil {
		return err
	}
	s, err := store.Open(filepath.Join(cfg.Root, "store"))
	if err != nil {
		return err
	}
	if err := checkConfig(cfg); err != nil {
		return err
	}
	h, err := prepareHost(cfg)
	defer h.undo()
	if err != nil {
		return err
	}
	w := newWorker(cfg, s, h)
	if err := w.takeOver(ctx); err != nil {
		return err
	}
	w.host.Lowers().Keep(cfg.KeepLayers)
	defer w.host.Lowers().ReleaseKept() // after the sandboxes' release
	defer w.release()
	defer w.waitRemovals()
	h.drivers.Prepare() // what a dead worker left is swept
	defer h.drivers.Close()
	if n := cfg.Admission.withDefaults().Primed; n > 0 {
		w.host.Primed = w.host.StartPrimed(n)
		defer w.host.Primed.Close()
	}

	sock := filepath.Join(cfg.Root, api.Socket)
	l, err := listenSocket(cfg.Root, sock)
	defer os.Remove(sock)
	defer os.Remove(filepath.Join(cfg.Root, "worker.pid"))
	if err != nil {
		return err
	}

	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	w.shutdown, w.ctx = cancel, ctx
	if err := w.startPools(ctx); err != nil {
		return err
	}
	// A worker that exits takes along what it made ahead of need (its
	// pools' warm sandboxes here, its primed sandboxes and spare inits
	// in the defers above), once the creates under way have finished:
	// a user's sandbox is then whole and named, for the next worker to
	// adopt. What the process does after Serve returns is exit.
	defer w.stopPools()
	defer w.stopMaking()
	go w.reclaimLoop(ctx)
	go w.pressureLoop(ctx)
	go w.leaseLoop(ctx)
	errc, stop, err := w.serve(ctx, l, tcp, e2bListener, sock, initBin)
	if err != nil {
		return err
	}
	if cfg.Ready != nil {
		cfg.Ready()
	}
	if err := w.wait(ctx, errc); err != nil {
		return err
	}
	// Requests in flight get a moment; running execs go on in their
	// sandboxes and a later worker collects their results.
	sctx, scancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer scancel()
	stop(sctx)
	return nil
}

// takeOver takes up what the workers before this one left in its root:
// the admin token file, the owners of older records, the sandboxes and
// the forks.
func (w *worker) takeOver(ctx context.Context) error {
	if w.cfg.AdminTokenFile != "" {
		if err := w.tokens.PinAdminFile(w.cfg.AdminTokenFile); err != nil {
			return err
		}
	}
	if err := migrateOwners(ctx, w.cfg.Root, w.host.Store, w.tokens); err != nil {
		return err
	}
	if err := w.adopt(); err != nil {
		return err
	}
	var err error
	w.forks, err = openForks(w.cfg.Root)
	return err
}

// claimRoot makes the root's files private (saying so if they were
// not) and locks the root for this worker: lock is held until closed.
func claimRoot(cfg Config) (lock *os.File, err error) {
	fixed, err := rootdir.Secure(cfg.Root)
	if err != nil {
		return nil, err
	}
	if len(fixed) > 0 {
		cfg.Log.Warn("made the root's files private: other users could read them", "paths", fixed)
	}
	lock, err = os.OpenFile(filepath.Join(cfg.Root, "worker.lock"), os.O_CREATE|os.O_RDWR, 0o600)
	if err != nil {
		return nil, err
	}
	if err := lockRoot(lock, cfg.Root); err != nil {
		lock.Close()
		return nil, err
	}
	return lock, nil
}

// checkConfig refuses settings that cannot work together.
func checkConfig(cfg Config) error {
	if err := cfg.Admission.Validate(); err != nil {
		return err
	}
	if cfg.PublishSnapshots && cfg.Remote == nil {
		return fmt.Errorf("snap.publish needs a remote to publish snapshots to: give the config a remote (dir:///PATH on a file system every worker mounts, or oci://HOST/REPO): %w", errdefs.ErrInvalidArgument)
	}
	return nil
}

// newWorker is the worker of cfg, on the store s and the host h
// prepared.
func newWorker(cfg Config, s *store.Store, h prepared) *worker {
	return &worker{cfg: cfg, log: cfg.Log, imports: make(chan struct{}, 2), sandboxes: map[string]*entry{}, pools: map[string]*pool{}, lastReq: time.Now(), frozen: map[*runtime.Sandbox]bool{},
		gate: newGate(cfg.Admission, h.cpus, h.mem), tokens: auth.Open(cfg.Root),
		host: &runtime.Host{Root: cfg.Root, Store: s, Remote: cfg.Remote, Insecure: cfg.Insecure, Fetcher: cfg.Fetcher, Cache: cfg.Cache,
			DiskBound: cfg.Defaults.withDefaults().Disk, Drivers: h.drivers}}
}

// serve serves the API on the socket's listener l and, through the
// token check and the request slots, on the TCP listeners and the E2B
// front's; errc hears a server that failed, stop shuts the servers down.
func (w *worker) serve(ctx context.Context, l net.Listener, tcp []net.Listener, e2bListener net.Listener, sock, initBin string) (errc chan error, stop func(context.Context), err error) {
	cfg := w.cfg
	routes := w.routes()
	srv := &http.Server{Handler: routes, ReadHeaderTimeout: 10 * time.Second,
		BaseContext: func(net.Listener) context.Context { return ctx }}
	lim := newLimiter(cfg.MaxRequests, cfg.MaxRequestsPerToken) // the TCP API's and the E2B front's
	remote := &http.Server{Handler: w.authed(routes, lim), ReadHeaderTimeout: 10 * time.Second, IdleTimeout: 2 * time.Minute, MaxHeaderBytes: 64 << 10,
		BaseContext: func(net.Listener) context.Context { return ctx },
		ErrorLog:    slog.NewLogLogger(w.log.Handler(), slog.LevelDebug)} // a failed handshake is anyone's knock
	errc = make(chan error, 2+len(tcp))
	w.mu.Lock()
	n := len(w.sandboxes) // pools fill it meanwhile
	w.mu.Unlock()
	var addrs []string
	for _, l := range tcp {
		addrs = append(addrs, l.Addr().String())
	}
	w.log.Info("worker serving", "socket", sock, "listen", addrs, "tls", cfg.TLS.Cert != "", "sandboxes", n, "init", initBin) // before any request
	w.loadClaims()
	stopClaims := w.keepClaims(ctx)
	// The E2B front before the TCP API: a gateway relays to it. Without
	// a listener of its own, one that cannot start (a damaged record)
	// only keeps gateways' E2B requests off this worker.
	front, stopFront, err := w.startFront(ctx, routes, lim)
	switch {
	case err != nil && e2bListener != nil:
		return nil, nil, err
	case err != nil:
		w.log.Error("the worker's E2B front cannot start: gateways' E2B requests for its sandboxes fail", "err", err)
		stopFront = func() {}
	case e2bListener != nil:
		w.serveE2B(ctx, e2bListener, front, errc)
		w.log.Info("serving E2B's API", "listen", e2bListener.Addr().String(), "tls", cfg.TLS.Cert != "")
	}
	go func() { errc <- srv.Serve(l) }()
	for _, l := range tcp {
		go func() { errc <- remote.Serve(l) }()
	}

	go func() { // off the first request's path
		for _, f := range features() {
			if !f.Available {
				w.log.Warn("the host lacks a feature", "feature", f.Name, "why", f.Reason, "so", f.Without)
			}
		}
	}()
	return errc, func(ctx context.Context) {
		srv.Shutdown(ctx)
		remote.Shutdown(ctx)
		stopFront()
		stopClaims()
		w.saveClaims() // (those the requests of the last moment made)
	}, nil
}

// wait returns when the worker is to stop: a server's error, ctx done,
// or (cfg.ExitIdle) no sandbox, pool or request for that long (nil).
func (w *worker) wait(ctx context.Context, errc <-chan error) error {
	var idle <-chan time.Time
	if w.cfg.ExitIdle > 0 {
		t := time.NewTicker(min(w.cfg.ExitIdle/4, 5*time.Second))
		defer t.Stop()
		idle = t.C
	}
	for {
		select {
		case err := <-errc:
			return err
		case <-idle:
			w.mu.Lock()
			quiet := len(w.sandboxes) == 0 && len(w.pools) == 0 && time.Since(w.lastReq) > w.cfg.ExitIdle
			w.mu.Unlock()
			if !quiet {
				continue
			}
			w.log.Info("worker idle: exiting", "after", w.cfg.ExitIdle)
			return nil
		case <-ctx.Done():
			return nil
		}
	}
}

// listen opens the TCP API's listeners and the E2B front's, those that
// it opened before a failure included.
func listen(cfg Config) (tcp []net.Listener, e2b net.Listener, err error) {
	for _, addr := range cfg.Listen {
		l, err := ListenTCP(addr, cfg.TLS, false)
		if err != nil {
			return tcp, nil, err
		}
		tcp = append(tcp, l)
	}
	if cfg.E2B.Listen != "" {
		if e2b, err = ListenTCP("tcp://"+strings.TrimPrefix(cfg.E2B.Listen, "tcp://"), cfg.TLS, cfg.E2B.HTTP2); err != nil {
			return tcp, nil, fmt.Errorf("e2b listener: %w", err)
		}
	}
	return tcp, e2b, nil
}

// listenSocket listens on the root's socket (a dead worker's is
// removed: the caller holds the lock) and writes the worker's pid.
func listenSocket(root, sock string) (net.Listener, error) {
	os.Remove(sock)
	l, err := net.Listen("unix", sock)
	if err != nil {
		return nil, fmt.Errorf("listen on %s: %w", sock, err)
	}
	os.Chmod(sock, 0o600)
	if err := os.WriteFile(filepath.Join(root, "worker.pid"), []byte(strconv.Itoa(os.Getpid())), 0o600); err != nil {
		l.Close()
		return nil, err
	}
	return l, nil
}

// prepared is what prepareHost readied: the drivers (their sandboxes'
// groups in the tree of the configured parent), the host's capacity,
// and undo, which gives back what it took (the sandboxes' file system
// once no sandbox is left on it, the worker's protected group).
type prepared struct {
	drivers *runtime.Drivers
	cpus    int
	mem     int64
	undo    func()
}

// prepareHost readies the host for sandboxes: the control groups'
// parent, bounded, and the worker's protection; the resolver settings;
// the drivers; the sandboxes' shared file system. undo is set on an
// error too.
func prepareHost(cfg Config) (h prepared, err error) {
	var undo []func()
	h.undo = func() {
		for _, f := range slices.Backward(undo) {
			f()
		}
	}
	groups := cgroup.NewTree(cfg.CgroupParent)
	// Early, for what the worker holds before the move stays charged
	// where it was (cgroup2 does not move charges).
	if p, ok := cfg.Admission.protection(); ok {
		if dir, err := groups.Protect(p); err != nil {
			cfg.Log.Info("the worker's memory is not protected", "why", err)
		} else {
			cfg.Log.Info("the worker's memory is protected", "group", dir, "min", p.Min, "low", p.Low)
			undo = append(undo, func() {
				if err := groups.Unprotect(); err != nil {
					cfg.Log.Warn("the worker's group", "err", err)
				}
			})
		}
	}
	h.drivers = runtime.NewDrivers(runtime.DriverConfig{Root: cfg.Root, Spares: cfg.Admission.withDefaults().Spares, MicroVM: cfg.MicroVM, VM: cfg.VM, Extra: cfg.Drivers,
		DNS: &cfg.DNS, Groups: groups})
	if m, err := h.drivers.MicroVMHost(); err != nil {
		cfg.Log.Info("this host runs no microVMs", "why", err)
	} else {
		cfg.Log.Info("microVMs run", "accel", m.Accel.Name, "why", m.Accel.Why, "kernel", m.Kernel.String(), "qemu", m.QEMUVersion)
	}
	if h.cpus, h.mem, err = runtime.HostCapacity(); err != nil {
		return h, err
	}
	if err := groups.LimitParent(parentLimits(cfg.Admission.withDefaults(), h.mem)); err != nil {
		// Sandboxes using more than the new bound already: it holds
		// from when they free it; the worker runs on.
		cfg.Log.Warn("cannot bound all sandboxes together yet", "err", err)
	}
	// Sandboxes without a disk quota of their own write to one file
	// system, of a bounded size; each has its bound there.
	if err := disk.PrepareUppers(cfg.Root, cfg.Admission.UppersSize); err != nil {
		if size, _ := disk.UppersSize(cfg.Root); size == 0 {
			return h, err
		}
		cfg.Log.Warn("the sandboxes' file system keeps its size", "err", err) // a shrink that does not fit
	}
	undo = append(undo, func() { disk.ReleaseUppers(cfg.Root) }) // when no sandbox is left on it
	return h, nil
}

func (w *worker) routes() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("GET /v1/version", handle(w.version))
	mux.HandleFunc("POST /v1/shutdown", adminOnly("stop the worker", w.shutdownReq))
	mux.HandleFunc("POST /v1/sandboxes", handle(w.create))
	mux.HandleFunc("GET /v1/sandboxes", handle(w.list))
	mux.HandleFunc("GET /v1/sandboxes/{name}", handle(w.inspect))
	mux.HandleFunc("POST /v1/sandboxes/{name}/stop", handle(w.lifecycle(w.stop)))
	mux.HandleFunc("POST /v1/sandboxes/{name}/start", handle(w.lifecycle(w.start)))
	mux.HandleFunc("POST /v1/sandboxes/{name}/pause", handle(w.lifecycle(w.pause)))
	mux.HandleFunc("POST /v1/sandboxes/{name}/resume", handle(w.lifecycle(w.resume)))
	mux.HandleFunc("POST /v1/sandboxes/{name}/idle", handle(w.idle))
	mux.HandleFunc("POST /v1/sandboxes/{name}/evict", handle(w.lifecycle(w.evict)))
	mux.HandleFunc("DELETE /v1/sandboxes/{name}", handle(w.remove))
	mux.HandleFunc("POST /v1/sandboxes/{name}/exec", w.exec)
	mux.HandleFunc("GET /v1/sandboxes/{name}/execs/{id}", w.logs)
	mux.HandleFunc("POST /v1/sandboxes/{name}/execs/{id}/signal", handle(w.signal))
	mux.HandleFunc("PUT /v1/sandboxes/{name}/files", w.putFile)
	mux.HandleFunc("GET /v1/sandboxes/{name}/files", w.getFile)
	mux.HandleFunc("GET /v1/sandboxes/{name}/screen", w.screenshot)
	mux.HandleFunc("POST /v1/sandboxes/{name}/input", handle(w.input))
	mux.HandleFunc("POST /v1/sandboxes/{name}/vnc", handle(w.grantVNC))
	mux.HandleFunc("DELETE /v1/sandboxes/{name}/vnc", handle(w.revokeVNC))
	mux.HandleFunc("GET /v1/vnc/{name}", w.vncSocket)
	mux.HandleFunc("GET /v1/sandboxes/{name}/stat", w.statPath)
	mux.HandleFunc("GET /v1/sandboxes/{name}/dir", handle(w.listDir))
	mux.HandleFunc("POST /v1/sandboxes/{name}/mkdir", handle(w.makeDir))
	mux.HandleFunc("POST /v1/sandboxes/{name}/rename", handle(w.renamePath))
	mux.HandleFunc("DELETE /v1/sandboxes/{name}/files", handle(w.removePath))
	mux.HandleFunc("GET /v1/sandboxes/{name}/archive", w.statPath)
	mux.HandleFunc("PUT /v1/sandboxes/{name}/archive", w.putArchive)
	mux.HandleFunc("POST /v1/sandboxes/{name}/snapshots", handle(w.packDiff))
	mux.HandleFunc("/v1/sandboxes/{name}/ports/{port}/{path...}", w.port)
	mux.HandleFunc("POST /v1/branches", handle(w.branch))
	mux.HandleFunc("POST /v1/sandboxes/{name}/grade", handle(w.grade))
	mux.HandleFunc("POST /v1/sandboxes/{name}/fork", handle(w.fork))
	mux.HandleFunc("GET /v1/groups", handle(w.listGroups))
	mux.HandleFunc("GET /v1/groups/{id}", handle(w.showGroup))
	mux.HandleFunc("DELETE /v1/groups/{id}", handle(w.removeGroup))
	mux.HandleFunc("POST /v1/groups/{id}/keep", handle(w.keepMember))
	mux.HandleFunc("POST /v1/leases", handle(w.createLease))
	mux.HandleFunc("GET /v1/leases", handle(w.listLeases))
	mux.HandleFunc("GET /v1/leases/{id}", handle(w.showLease))
	mux.HandleFunc("POST /v1/leases/{id}/renew", handle(w.renewLease))
	mux.HandleFunc("DELETE /v1/leases/{id}", handle(w.removeLease))
	mux.HandleFunc("GET /v1/snapshots", handle(w.snapshots))
	mux.HandleFunc("DELETE /v1/snapshots/{ref...}", handle(w.removeSnapshot))
	mux.HandleFunc("POST /v1/squash", adminOnly("squash snapshots", handle(w.squash)))
	mux.HandleFunc("POST /v1/estimates", adminOnly("ask what a create would fetch", handle(w.estimate)))
	mux.HandleFunc("POST /v1/claims", adminOnly("claim sandbox names for a fleet", handle(w.claimNames)))
	mux.HandleFunc("PUT /v1/cordon", adminOnly("cordon the worker", handle(w.cordon)))
	mux.HandleFunc("/v1/e2b/", w.e2bRelayed)
	mux.HandleFunc("POST /v1/sandboxes/{name}/policy", handle(w.applyPolicy))
	mux.HandleFunc("GET /v1/policies", handle(w.policies))
	mux.HandleFunc("GET /v1/policies/{name}", handle(w.getPolicy))
	mux.HandleFunc("PUT /v1/policies/{name}", adminOnly("store policies", handle(w.putPolicy)))
	mux.HandleFunc("DELETE /v1/policies/{name}", adminOnly("remove stored policies", handle(w.deletePolicy)))
	mux.HandleFunc("POST /v1/calls", w.call)
	mux.HandleFunc("POST /v1/batches", w.batch)
	mux.HandleFunc("GET /v1/pools", handle(w.listPools))
	mux.HandleFunc("PUT /v1/pools/{name}", adminOnly("make or resize pools", handle(w.putPool)))
	mux.HandleFunc("DELETE /v1/pools/{name}", adminOnly("remove pools", handle(w.deletePool)))
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

func (w *worker) version(r *http.Request, _ none) (api.VersionInfo, error) {
	p, d := w.host.Groups().ParentLimits(), w.cfg.Defaults.withDefaults()
	wp, wg := cgroup.Protected()
	uppers, _ := disk.UppersSize(w.cfg.Root)
	return api.VersionInfo{API: api.Version, Version: w.cfg.Version, Pid: os.Getpid(), Backends: w.host.Drivers.Names(),
		Limits: &api.HostLimits{MemoryBytes: p.MemoryBytes, Pids: p.Pids, HostReserve: w.cfg.Admission.withDefaults().HostReserve,
			DefaultMemory: max(d.Memory, 0), DefaultPids: max(d.Pids, 0), DefaultDisk: max(d.Disk, 0), DiskBytes: uppers,
			WorkerGroup: wg, WorkerMemoryMin: wp.Min, WorkerMemoryLow: wp.Low},
		Features: features(), Warm: &api.Warm{Spares: w.host.Drivers.Ready(), Primed: w.host.Primed.Ready()}, MicroVM: w.microVMHost(),
		PublishesSnapshots: w.cfg.PublishSnapshots && w.host.Remote != nil, Capacity: w.capacity(), Cordoned: w.cordoned(),
		TokenID: ownerOf(r.Context()), E2B: w.front.Load() != nil}, nil
}

// capacity is what the worker's admission holds now, and whether a
// disk of its refuses creates.
func (w *worker) capacity() *api.Capacity {
	c := w.gate.capacity()
	if err := w.cfg.Admission.checkDisk(w.cfg.Root); err != nil {
		c.DiskFull = err.Error()
	} else if size, free := disk.UppersSize(w.cfg.Root); size > 0 {
		if err := w.cfg.Admission.checkUppers(disk.UppersDir(w.cfg.Root), size, free); err != nil {
			c.DiskFull = err.Error()
		}
	}
	return &c
}

// microVMHost describes what the microvm backend runs with here.
func (w *worker) microVMHost() *api.MicroVMHost {
	h, err := w.host.Drivers.MicroVMHost()
	if err != nil {
		return &api.MicroVMHost{Error: err.Error()}
	}
	return &api.MicroVMHost{Accel: h.Accel.Name, AccelWhy: h.Accel.Why, Kernel: h.Kernel.String(), QEMU: h.QEMUVersion}
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
			return fmt.Errorf("%w (%s, pid %s): stop it first (dsec daemon stop), or give another --root: %w", ErrRootServed, root, strings.TrimSpace(string(b)), errdefs.ErrAlreadyExists)
		}
		time.Sleep(10 * time.Millisecond)
	}
}
