package worker

import (
	"bufio"
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"sort"
	"sync"
	"time"

	"github.com/containerd/errdefs"

	"github.com/dsec-project/dsec/api"
	"github.com/dsec-project/dsec/internal/durable"
	"github.com/dsec-project/dsec/internal/runtime"
	"github.com/dsec-project/dsec/internal/runtime/warm"
)

// The FnCall backend: pools of warm sandboxes, made ahead from a
// template, one taken per call and discarded after it (never reused,
// so nothing of a call reaches the next), refilled in the background.

// purpose is what a sandbox is made for: a user's create (forUser), a
// pool's (the pool's name: a warm sandbox, or one made for a call when
// the pool had none ready), a call no pool served (forCall) or dsec run
// --rm's (forRun, listed). Its text is what the sandbox's state records
// (runtime.Spec.Pool), which a worker that restarts reads back.
type purpose string

const (
	forUser purpose = ""
	forCall purpose = "(call)"
	forRun  purpose = "(run)"
)

// ofPool is the purpose of pool name's sandboxes.
func ofPool(name string) purpose { return purpose(name) }

// warm says whether it is a pool's sandbox (the admin's, made ahead).
func (p purpose) warm() bool { return p != forUser && p != forCall && p != forRun && p != forGrade }

// listed says whether the sandbox is listed without all=1: a user's or
// a run's.
func (p purpose) listed() bool { return p == forUser || p == forRun }

var poolNameRE = sync.OnceValue(func() *regexp.Regexp { return regexp.MustCompile(`^[a-zA-Z0-9][a-zA-Z0-9_.-]{0,39}$`) })

// pool is a FnCall pool: warm sandboxes, by name, made from its
// template. w.mu guards its PoolConfig.
type pool struct {
	PoolConfig
	key  string // the template's identity
	warm *warm.Pool[string]
}

// templateKey identifies a template: its spec without name and backend.
func templateKey(spec api.SandboxSpec) string {
	spec.Name, spec.Backend = "", ""
	b, _ := json.Marshal(spec)
	return string(b)
}

func (p *pool) describe() api.Pool {
	st := p.warm.Stats()
	out := api.Pool{Name: p.Name, Size: p.Size, Warm: st.Ready, Filling: st.Filling, Spec: p.Spec, Calls: st.Takes, Misses: st.Misses}
	if st.Err != nil {
		out.Error = st.Err.Error()
	}
	return out
}

func poolsFile(root string) string { return filepath.Join(root, "pools.json") }

// startPools brings up the configured pools and those a resize stored,
// a stored size winning over the configured one while the template is
// the same.
func (w *worker) startPools(ctx context.Context) error {
	var stored []PoolConfig
	if b, err := os.ReadFile(poolsFile(w.cfg.Root)); err == nil {
		if err := json.Unmarshal(b, &stored); err != nil {
			return fmt.Errorf("%s: %v: remove it to start from the configured pools: %w", poolsFile(w.cfg.Root), err, errdefs.ErrDataLoss)
		}
	}
	byName := map[string]PoolConfig{}
	for _, pc := range stored {
		byName[pc.Name] = pc
	}
	for _, pc := range w.cfg.Pools {
		if err := w.checkPool(pc); err != nil {
			return fmt.Errorf("pool %s in the configuration: %w", pc.Name, err)
		}
		if old, ok := byName[pc.Name]; ok && templateKey(old.Spec) == templateKey(pc.Spec) {
			pc.Size = old.Size
		}
		byName[pc.Name] = pc
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	for _, pc := range byName {
		w.addPool(pc)
	}
	return nil
}

func (w *worker) checkPool(pc PoolConfig) error {
	if !poolNameRE().MatchString(pc.Name) {
		return fmt.Errorf("bad pool name %q: use up to 40 letters, digits, '_', '.' and '-': %w", pc.Name, errdefs.ErrInvalidArgument)
	}
	if pc.Size < 0 || pc.Size > 10000 {
		return fmt.Errorf("pool size %d out of 0-10000: %w", pc.Size, errdefs.ErrInvalidArgument)
	}
	if len(pc.Spec.Layers) == 0 && pc.Spec.Snapshot == "" {
		return fmt.Errorf("a pool's template needs layers (a base at least) or a snapshot: %w", errdefs.ErrInvalidArgument)
	}
	if _, err := w.host.Drivers.Lookup(pc.Spec.Backend); err != nil {
		return fmt.Errorf("a pool's sandboxes: %w", err)
	}
	if pc.Spec.Name != "" {
		return fmt.Errorf("a pool's template names no sandbox (its sandboxes are named after the pool): %w", errdefs.ErrInvalidArgument)
	}
	return checkSpec(&pc.Spec)
}

// addPool starts a pool and its filler; w.mu is held.
func (w *worker) addPool(pc PoolConfig) *pool {
	p := &pool{PoolConfig: pc, key: templateKey(pc.Spec)}
	p.warm = warm.New(warm.Config[string]{Size: pc.Size, RefillOnTake: true,
		Make: func(ctx context.Context) (string, error) {
			// Queued for admission until the worker exits, at most:
			// stopMaking waits for it.
			ctx, cancel := context.WithCancel(ctx)
			defer context.AfterFunc(w.ctx, cancel)()
			defer cancel()
			spec := p.Spec
			spec.Name = runtime.RandomName("pool-" + p.Name + "-")
			sb, err := w.makeSandbox(ctx, spec, ofPool(p.Name))
			if err != nil {
				return "", err
			}
			if err := sb.PauseWarm(); err != nil { // a guest waits paused until a call takes it
				w.discardLater(spec.Name)
				return "", err
			}
			return spec.Name, nil
		},
		Usable: func(name string) bool { // still running
			w.mu.Lock()
			e := w.sandboxes[name]
			w.mu.Unlock()
			return e != nil && e.sb != nil && e.sb.Current().Status == runtime.Running
		},
		Discard: w.discardLater,
		Failed: func(err error, retry time.Duration) {
			if !errors.Is(err, errStopping) {
				w.log.Error("cannot fill pool", "pool", pc.Name, "err", err, "retry in", retry)
			}
		}})
	w.pools[pc.Name] = p
	return p
}

// savePools stores the pools; w.mu is held.
func (w *worker) savePools() error {
	out := []PoolConfig{}
	for _, p := range w.pools {
		out = append(out, p.PoolConfig)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Name < out[j].Name })
	b, _ := json.MarshalIndent(out, "", "  ")
	return durable.WriteFile(poolsFile(w.cfg.Root), b, 0o600)
}

// stopPools stops the fillers, each once the sandbox it is making is
// made, and discards the warm sandboxes: made ahead of need, they go
// with a worker that exits (one killed leaves them to the next, which
// removes them as it adopts, and fills its pools anew). Call it after
// stopMaking: no pool is made after it.
func (w *worker) stopPools() {
	w.mu.Lock()
	var ps []*pool
	for _, p := range w.pools {
		ps = append(ps, p)
	}
	w.mu.Unlock()
	var wg sync.WaitGroup
	for _, p := range ps {
		wg.Go(func() {
			for _, name := range p.warm.Close() {
				wg.Go(func() { w.discard(name) })
			}
		})
	}
	wg.Wait()
}

// errStopping refuses a create, or a new pool, to a worker that exits.
var errStopping = fmt.Errorf("the worker is exiting: %w", errdefs.ErrUnavailable)

// stopMaking refuses creates from now on and waits for those under
// way, once the worker's context has ended (those still queued for
// admission give up).
func (w *worker) stopMaking() {
	w.shutdown()
	w.mu.Lock()
	w.stopping = true
	w.mu.Unlock()
	w.making.Wait()
}

// discard removes a sandbox no request holds: a pool's, a call's once it
// ended, or one made for an E2B record that is gone.
func (w *worker) discard(name string) {
	w.mu.Lock()
	e := w.going(name)
	w.mu.Unlock()
	if e != nil {
		w.drop(name, e)
	}
}

// afterAnswer is how long work a request started but its answer does
// not wait for (removing a call's sandbox, priming the next) waits: the
// client wakes, reads the answer and exits in about that time, and on a
// small host that work would take the CPUs it needs (2.3-2.8 ms of a
// CLI run --rm with runs 50 ms apart, BENCHMARKS.md).
const afterAnswer = 3 * time.Millisecond

// primeBy bounds how long the next sandbox's priming waits for a
// create's first exec to end.
const primeBy = 50 * time.Millisecond

// primeAfter primes the next sandbox afterAnswer after a user's create
// (POST /v1/sandboxes), as other work after an answer waits, unless the
// created sandbox's first exec is running then (a client's exec most
// often follows its create at once): then once that exec has ended, at
// most primeBy after the create. Made beside that exec, on a small host,
// the priming took the CPUs the exec needs (create to first exec
// 0.72-0.74x, BENCHMARKS.md). A user's create that starts or ends while
// a priming waits primes at once. The zero value waits afterAnswer and
// primeBy; a test sets wait and by.
type primeAfter struct {
	wait, by time.Duration

	mu      sync.Mutex
	gen     uint64 // the priming that waits: its create's number
	name    string // its sandbox
	running bool   // its sandbox's first exec runs
	due     bool   // wait has passed: the exec's end primes
	timers  [2]*time.Timer
	prime   func() // nil: none waits
}

// created primes with prime after name's answer, as above; a priming
// that still waits is done now.
func (p *primeAfter) created(name string, prime func()) {
	p.mu.Lock()
	earlier := p.take(0)
	p.gen++
	gen := p.gen
	p.name, p.prime, p.running, p.due = name, prime, false, false
	p.timers[0] = time.AfterFunc(cmp.Or(p.wait, afterAnswer), func() {
		p.mu.Lock()
		wait := gen == p.gen && p.running // its exec's end primes
		if wait {
			p.due = true
		}
		p.mu.Unlock()
		if !wait {
			p.fire(gen)
		}
	})
	p.timers[1] = time.AfterFunc(cmp.Or(p.by, primeBy), func() { p.fire(gen) })
	p.mu.Unlock()
	if earlier != nil {
		earlier()
	}
}

// creating primes at once if a priming waits.
func (p *primeAfter) creating() { p.fire(p.current()) }

// execStarted notes that an exec of name started.
func (p *primeAfter) execStarted(name string) {
	p.mu.Lock()
	if p.prime != nil && p.name == name {
		p.running = true
	}
	p.mu.Unlock()
}

// execEnded primes if name's first exec was awaited, or lets the priming
// come after wait if it has not passed yet.
func (p *primeAfter) execEnded(name string) {
	p.mu.Lock()
	var prime func()
	if p.prime != nil && p.name == name {
		if p.due {
			prime = p.take(p.gen)
		}
		p.running = false
	}
	p.mu.Unlock()
	if prime != nil {
		prime()
	}
}

// current is the priming that waits (0: none).
func (p *primeAfter) current() uint64 {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.prime == nil {
		return 0
	}
	return p.gen
}

// fire primes if the priming gen still waits.
func (p *primeAfter) fire(gen uint64) {
	if gen == 0 {
		return
	}
	p.mu.Lock()
	prime := p.take(gen)
	p.mu.Unlock()
	if prime != nil {
		prime()
	}
}

// take ends the priming gen (0: whichever waits) and returns it to be
// called, nil if it does not wait. The caller holds p.mu.
func (p *primeAfter) take(gen uint64) func() {
	prime := p.prime
	if prime == nil || gen != 0 && gen != p.gen {
		return nil
	}
	for _, t := range p.timers {
		t.Stop()
	}
	p.name, p.prime, p.running, p.due = "", nil, false, false
	return prime
}

// discardLater discards a sandbox in the background (after a call's
// answer: the answer's end reaches the client once the sandbox is out of
// sight). An exiting worker waits for those it started and leaves any
// later ones to the next worker, which removes a call's sandboxes.
func (w *worker) discardLater(name string) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.closing {
		return
	}
	if e := w.going(name); e != nil {
		w.removing.Go(func() {
			time.Sleep(afterAnswer)
			w.drop(name, e)
		})
	}
}

// going marks name's sandbox as being discarded, nil if it is gone or
// going already: the API no longer shows it and a create of its name
// waits. The caller holds w.mu.
func (w *worker) going(name string) *entry {
	e := w.sandboxes[name]
	if e == nil || e.gone != nil {
		return nil
	}
	e.gone = make(chan struct{})
	return e
}

// drop removes a sandbox marked going; if that fails the API shows it
// again (dsec rm -f takes it then).
func (w *worker) drop(name string, e *entry) {
	defer func() {
		w.mu.Lock()
		gone := e.gone
		e.gone = nil
		w.mu.Unlock()
		close(gone)
	}()
	e.op.Lock()
	defer e.op.Unlock()
	if e.sb == nil {
		return
	}
	if err := w.removeSandbox(name, e.sb); err != nil {
		w.log.Error("cannot discard a call's sandbox", "sandbox", name, "err", err)
	}
}

// waitRemovals waits for the background discards of an exiting worker.
func (w *worker) waitRemovals() {
	w.mu.Lock()
	w.closing = true
	w.mu.Unlock()
	w.removing.Wait()
}

// take hands out p's oldest warm sandbox that still runs, nil if none
// (a miss).
func (w *worker) take(p *pool) (string, *runtime.Sandbox) {
	name, ok := p.warm.Take()
	if !ok {
		return "", nil
	}
	w.mu.Lock()
	e := w.sandboxes[name]
	w.mu.Unlock()
	if e == nil || e.sb == nil {
		return "", nil // gone since Usable looked: a miss
	}
	if err := e.sb.ResumeWarm(); err != nil {
		w.log.Error("cannot resume a pool's sandbox", "sandbox", name, "err", err)
		w.discardLater(name)
		return "", nil
	}
	return name, e.sb
}

// call runs one command in a fresh sandbox and discards it.
func (w *worker) call(rw http.ResponseWriter, r *http.Request) {
	body := bufio.NewReaderSize(r.Body, 64<<10)
	var req api.CallRequest
	done := readBy(rw)
	err := firstLine(body, "call", &req)
	done()
	if err != nil {
		fail(rw, err)
		return
	}
	p, spec, why, err := w.callTarget(req)
	if err != nil {
		fail(rw, err)
		return
	}
	info := &api.CallInfo{Warm: true}
	var sb *runtime.Sandbox
	if p != nil {
		info.Pool = p.Name
		info.Sandbox, sb = w.take(p)
	}
	if t := tenantOf(r.Context()); sb != nil && t != nil {
		// The pool's sandbox is the admin's; the caller's quota holds it
		// while the call runs.
		w.mu.Lock()
		e := w.sandboxes[info.Sandbox]
		err := w.checkQuota(t, e)
		if err == nil {
			e.account = t.ID
		}
		w.mu.Unlock()
		if err != nil {
			w.discardLater(info.Sandbox)
			fail(rw, err)
			return
		}
	}
	if sb == nil { // no pool, or it was empty: a sandbox made for the call
		info.Warm = false
		switch {
		case why != forRun:
			spec.Name = runtime.RandomName("call-")
		case spec.Name == "":
			spec.Name = runtime.RandomName("sb-")
		}
		defer time.AfterFunc(afterAnswer, w.host.Primed.Refill)
		ctx := r.Context()
		if p != nil { // the pool's template: the admin's
			ctx = withTrusted(ctx)
		}
		var err error
		if sb, err = w.makeSandbox(ctx, spec, why); err != nil {
			fail(rw, err)
			return
		}
		info.Sandbox = spec.Name
	}
	defer w.discardLater(info.Sandbox)
	if req.ID == "" {
		req.ID = "call"
	}
	w.serveExec(rw, r, sb, req.ExecRequest, body, api.Frame{Call: info})
}

// callTarget is what a call runs in: a pool's sandbox (p: the pool
// named, or one whose template is the call's spec), or one made of the
// call's spec; why is what that sandbox is made for.
func (w *worker) callTarget(req api.CallRequest) (p *pool, spec api.SandboxSpec, why purpose, err error) {
	if req.Detach {
		return nil, spec, why, fmt.Errorf("a call runs to its end (its sandbox is discarded after it): no detach: %w", errdefs.ErrInvalidArgument)
	}
	if req.Run && (req.Spec == nil || req.Pool != "") {
		return nil, spec, why, fmt.Errorf("a run (dsec run --rm) makes its sandbox from the call's spec: give a spec and no pool: %w", errdefs.ErrInvalidArgument)
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	switch {
	case req.Pool != "":
		if p = w.pools[req.Pool]; p == nil {
			return nil, spec, why, fmt.Errorf("no pool %s (dsec pool ls lists them): %w", req.Pool, errdefs.ErrNotFound)
		}
		if req.Spec != nil && templateKey(*req.Spec) != p.key {
			return nil, spec, why, fmt.Errorf("the call's sandbox spec differs from pool %s's template: give one or the other: %w", req.Pool, errdefs.ErrInvalidArgument)
		}
	case req.Run:
		// dsec run --rm: a sandbox of its own, never a pool's.
	case req.Spec != nil:
		key := templateKey(*req.Spec)
		for _, q := range w.pools {
			if q.key == key {
				p = q
			}
		}
	default:
		return nil, spec, why, fmt.Errorf("a call needs a pool or a sandbox spec: %w", errdefs.ErrInvalidArgument)
	}
	spec, why = api.SandboxSpec{}, forCall
	switch {
	case p != nil:
		spec, why = p.Spec, ofPool(p.Name)
	case req.Run:
		spec, why = *req.Spec, forRun
	default:
		spec = *req.Spec
	}
	return p, spec, why, nil
}

// listPools lists the pools; a tenant, which may call any of them,
// sees each without what tells of others' use (its calls, misses and
// the filler's error).
func (w *worker) listPools(r *http.Request, _ none) ([]api.Pool, error) {
	tenant := tenantOf(r.Context()) != nil
	w.mu.Lock()
	out := []api.Pool{}
	for _, p := range w.pools {
		d := p.describe()
		if tenant {
			d.Calls, d.Misses, d.Error = 0, 0, ""
		}
		out = append(out, d)
	}
	w.mu.Unlock()
	sort.Slice(out, func(i, j int) bool { return out[i].Name < out[j].Name })
	return out, nil
}

// putPool creates a pool (its first sandbox is made before the answer,
// so a template that cannot run is refused at once) or resizes one.
func (w *worker) putPool(r *http.Request, ps api.PoolSpec) (api.Pool, error) {
	name := r.PathValue("name")
	w.mu.Lock()
	p := w.pools[name]
	w.mu.Unlock()
	if p == nil {
		if ps.Spec == nil {
			return api.Pool{}, fmt.Errorf("no pool %s: to create it give its sandboxes' layers (dsec pool resize %s N --base REF ...): %w", name, name, errdefs.ErrNotFound)
		}
		pc := PoolConfig{Name: name, Size: ps.Size, Spec: *ps.Spec}
		if err := w.checkPool(pc); err != nil {
			return api.Pool{}, err
		}
		first := ""
		if pc.Size > 0 { // the template must work before the pool exists
			spec := pc.Spec
			spec.Name = runtime.RandomName("pool-" + name + "-")
			if _, err := w.makeSandbox(r.Context(), spec, ofPool(name)); err != nil {
				return api.Pool{}, fmt.Errorf("pool %s: its first sandbox: %w", name, err)
			}
			first = spec.Name
		}
		w.mu.Lock()
		if w.pools[name] != nil || w.stopping {
			err := fmt.Errorf("pool %s was created meanwhile: %w", name, errdefs.ErrAlreadyExists)
			if w.stopping { // its filler would outlive stopPools
				err = errStopping
			}
			w.mu.Unlock()
			w.discard(first)
			return api.Pool{}, err
		}
		p = w.addPool(pc)
		if first != "" {
			p.warm.Put(first)
		}
	} else {
		if ps.Spec != nil && templateKey(*ps.Spec) != p.key {
			return api.Pool{}, fmt.Errorf("pool %s has another template: delete it first (dsec pool rm %s) to change its sandboxes: %w", name, name, errdefs.ErrAlreadyExists)
		}
		if err := w.checkPool(PoolConfig{Name: name, Size: ps.Size, Spec: p.Spec}); err != nil {
			return api.Pool{}, err
		}
		w.mu.Lock()
		p.Size = ps.Size
	}
	err := w.savePools()
	w.mu.Unlock()
	// Shrunk: the oldest warm sandboxes beyond the size go now, so the
	// answer tells the pool as it is.
	p.warm.Resize(ps.Size)
	w.mu.Lock()
	out := p.describe()
	w.mu.Unlock()
	if err != nil {
		return api.Pool{}, err
	}
	w.log.Info("pool sized", "pool", name, "size", ps.Size)
	return out, nil
}

// deletePool stops a pool and discards its warm sandboxes.
func (w *worker) deletePool(r *http.Request, _ none) (none, error) {
	name := r.PathValue("name")
	w.mu.Lock()
	p := w.pools[name]
	if p == nil {
		w.mu.Unlock()
		return none{}, fmt.Errorf("no pool %s (dsec pool ls lists them): %w", name, errdefs.ErrNotFound)
	}
	delete(w.pools, name)
	err := w.savePools()
	w.mu.Unlock()
	for _, n := range p.warm.Close() {
		w.discard(n)
	}
	if err != nil {
		return none{}, err
	}
	return none{}, nil
}

// reclaimLoop takes back the memory of sandboxes idle for longer than
// Reclaim.IdleAfter, once per idle spell.
func (w *worker) reclaimLoop(ctx context.Context) {
	after := w.cfg.Reclaim.IdleAfter
	if after == 0 {
		after = 10 * time.Minute
	}
	if after < 0 {
		return
	}
	t := time.NewTicker(min(max(after/4, 10*time.Millisecond), 30*time.Second))
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		w.mu.Lock()
		var sbs []*runtime.Sandbox
		for _, e := range w.sandboxes {
			if e.sb != nil && e.purpose == forUser {
				sbs = append(sbs, e.sb)
			}
		}
		w.mu.Unlock()
		for _, sb := range sbs {
			idle := sb.Idle()
			if idle < after || sb.Current().Status != runtime.Running {
				continue
			}
			// Once per idle spell: not again unless an exec came since.
			if last := sb.Reclaimed(); !last.IsZero() && time.Since(last) < idle {
				continue
			}
			if err := sb.Reclaim(); err != nil {
				w.log.Error("cannot reclaim an idle sandbox's memory", "sandbox", sb.Name, "err", err)
				continue
			}
			w.log.Debug("reclaimed an idle sandbox's memory", "sandbox", sb.Name, "idle", idle)
		}
	}
}
