// Package gateway serves a worker's API for a fleet of workers (dsec
// gateway): a request about a sandbox goes to the worker that holds it,
// a create or a call to the worker with the most room, a list to every
// worker. It keeps no state of its own but its cordons (Config.Cordons):
// the workers' lists, asked at every heartbeat, say where each sandbox
// is, so a gateway started again (or a second one beside it) routes as
// the first did.
//
// Clients hold the gateway's own tokens (<root>/tokens.json, dsec
// token create on its root); the gateway speaks to each worker with an
// admin token of that worker's, and names the client's token on every
// request (auth.OnBehalfHeader), which the worker serves as that
// token's: its scope, what it may do, its quota (per worker) and its
// sandboxes alone. A worker that does not answer its heartbeats for
// DownAfter is down: its sandboxes are listed as unreachable and a
// request about one is an infrastructure failure (503), at once, and
// no create goes there until it answers again.
package gateway

import (
	"bytes"
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httputil"
	"net/url"
	"os"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/containerd/errdefs"

	"github.com/dsec-project/dsec/api"
	"github.com/dsec-project/dsec/internal/auth"
	"github.com/dsec-project/dsec/internal/e2b"
)

// Worker is a worker of the fleet, as the gateway reaches it.
type Worker struct {
	// URL is its TCP API: tcp://HOST:PORT (dsec daemon --listen).
	URL string `json:"url"`
	// Token is an admin token of the worker's.
	Token string `json:"token"`
	// CA is the PEM file its certificate is checked against; none:
	// plain HTTP to a loopback address, else the system's roots.
	CA string `json:"ca,omitempty"`
	// Cert and Key are the gateway's client certificate, for a worker
	// that asks for one (dsec daemon --tls-client-ca).
	Cert string `json:"cert,omitempty"`
	Key  string `json:"key,omitempty"`
	// ServerName is the name its certificate must bear ("": the host
	// of URL).
	ServerName string `json:"server_name,omitempty"`
}

// Config is a gateway's configuration.
type Config struct {
	Workers []Worker
	// Discover, if any, finds the fleet's workers besides Workers (its
	// Kubernetes Service's endpoints): it calls found with all of them
	// at each change until ctx ends (Kubernetes).
	Discover func(ctx context.Context, found func([]Worker)) error
	// Tokens are the gateway's clients' tokens.
	Tokens *auth.Store
	// Heartbeat is how often each worker is asked how it is and what it
	// holds (default 2 s); DownAfter how long one may not answer before
	// it is down (default three heartbeats).
	Heartbeat, DownAfter time.Duration

	Version string
	Log     *slog.Logger
}

// Gateway serves the API for the fleet (ServeHTTP) while Run heartbeats.
type Gateway struct {
	cfg   Config
	fleet atomic.Pointer[[]*node] // all's
	mux   *http.ServeMux

	joining sync.Mutex      // one change of the fleet at a time
	ctx     context.Context // Run's, once it runs (under joining)
	beating sync.WaitGroup  // the heartbeats' loops

	placing   sync.Mutex // one placement at a time
	mu        sync.Mutex
	routes    map[string]*node          // a sandbox's name: its worker's
	making    map[string]bool           // names a create through this gateway is making
	estimates map[estimateKey]estimated // (near.go) by worker, tenant and layers
	next      int                       // the node a tie of placement goes to

	settling settling // (claims.go) the claims of creates made, to settle
}

// node is one worker, as the gateway knows it.
type node struct {
	Worker
	host  string   // HOST:PORT
	base  *url.URL // scheme://HOST:PORT
	rt    http.RoundTripper
	proxy *httputil.ReverseProxy

	mu       sync.Mutex
	seen     time.Time // its last answer
	err      error     // its last heartbeat's failure
	down     bool
	cordoned bool
	absent   time.Time // since when discovery no longer names it
	info     api.VersionInfo
	held     []api.Sandbox // as of its last answer
	// pending are the creates sent its way that its list does not show
	// yet, by sandbox name (or, while under way, a reservation's key):
	// the memory each may take.
	pending map[string]pend
	reserve int // the last reservation's number
	// changed are the sandboxes this gateway made (true) or removed
	// (false) there lately, and when: a list asked for before may not
	// show it (beat).
	changed map[string]change
}

// change is a sandbox a gateway made or removed on a worker, and when.
type change struct {
	made bool
	at   time.Time
}

// pend is a create sent to a worker, not yet in its list: its memory
// limit and its requests.
type pend struct {
	mem  int64
	req  request
	sent time.Time
}

// request is what a create asks of a worker's admission: CPUs and
// memory (its requests, else its limits, as the worker counts them).
type request struct {
	cpu float64
	mem int64
}

// demand is what a create (or a branch of N) asks: its memory limit,
// against a worker's room, and its requests, against its admission.
type demand struct {
	mem int64
	req request
	// layers are the ones it stands on, as its caller names them: a
	// worker that holds them goes before one that would fetch them.
	layers []string
}

// demandOf is what spec asks, n times over.
func demandOf(spec api.SandboxSpec, n int) demand {
	r := request{cpu: cmp.Or(spec.CPURequest, spec.CPU), mem: cmp.Or(spec.MemoryRequest, spec.Memory)}
	return demand{mem: spec.Memory * int64(n), req: request{cpu: r.cpu * float64(n), mem: r.mem * int64(n)}, layers: spec.Layers}
}

// pendFor bounds how long a create sent is counted without its
// worker's list showing it (a sandbox removed meanwhile never shows).
const pendFor = time.Minute

// New is a gateway of cfg's workers; Run starts their heartbeats.
func New(cfg Config) (*Gateway, error) {
	if len(cfg.Workers) == 0 && cfg.Discover == nil {
		return nil, fmt.Errorf("a gateway needs workers: give --worker tcp://HOST:PORT (one per worker), or --kubernetes-service NAMESPACE/NAME: %w", errdefs.ErrInvalidArgument)
	}
	cfg.Heartbeat = cmp.Or(cfg.Heartbeat, 2*time.Second)
	cfg.DownAfter = cmp.Or(cfg.DownAfter, 3*cfg.Heartbeat)
	cfg.Log = cmp.Or(cfg.Log, slog.Default())
	g := &Gateway{cfg: cfg, routes: map[string]*node{}, making: map[string]bool{}, estimates: map[estimateKey]estimated{}}
	g.fleet.Store(&[]*node{})
	var nodes []*node
	for _, w := range cfg.Workers {
		n, err := g.newNode(w)
		if err != nil {
			return nil, err
		}
		if slices.ContainsFunc(nodes, func(o *node) bool { return o.host == n.host }) {
			return nil, fmt.Errorf("worker %s is named twice: %w", w.URL, errdefs.ErrInvalidArgument)
		}
		nodes = append(nodes, n)
	}
	g.fleet.Store(&nodes)
	g.mux = g.routesMux()
	return g, nil
}

// all is the fleet's workers as of now (a slice never changed: one
// joining or leaving makes another).
func (g *Gateway) all() []*node { return *g.fleet.Load() }

// Discovered makes ws the fleet (cfg.Discover's answer): a worker new
// to it joins at once; one no longer named leaves once it does not
// answer, so that a worker's restart (its pod replaced: gone from the
// list for a moment) loses none of its sandboxes' routes. A worker named
// wrong is logged and left out.
func (g *Gateway) Discovered(ws []Worker) {
	g.joining.Lock()
	defer g.joining.Unlock()
	old := g.all()
	nodes := make([]*node, 0, len(old)+len(ws))
	for _, n := range old {
		i := slices.IndexFunc(ws, func(w Worker) bool { return w.URL == n.URL })
		n.mu.Lock()
		if i >= 0 {
			n.absent = time.Time{}
		} else if n.absent.IsZero() {
			n.absent = time.Now()
		}
		n.mu.Unlock()
		nodes = append(nodes, n)
	}
	for _, w := range ws {
		if slices.ContainsFunc(old, func(n *node) bool { return n.URL == w.URL }) {
			continue
		}
		n, err := g.newNode(w)
		if err != nil {
			g.cfg.Log.Error("a worker discovered is left out", "worker", w.URL, "err", err)
			continue
		}
		g.cfg.Log.Info("a worker joins the fleet", "worker", w.URL)
		nodes = append(nodes, n)
		g.start(n)
	}
	g.fleet.Store(&nodes)
}

// leave drops n from the fleet: gone from discovery and not answering.
func (g *Gateway) leave(n *node) {
	g.joining.Lock()
	defer g.joining.Unlock()
	nodes := slices.DeleteFunc(slices.Clone(g.all()), func(o *node) bool { return o == n })
	g.fleet.Store(&nodes)
	g.cfg.Log.Warn("a worker leaves the fleet: no longer discovered, and silent", "worker", n.URL)
	g.mu.Lock()
	for name, o := range g.routes {
		if o == n {
			delete(g.routes, name)
		}
	}
	g.mu.Unlock()
}

// newNode is the node of w, with its proxy.
func (g *Gateway) newNode(w Worker) (*node, error) {
	n, err := newNode(w)
	if err != nil {
		return nil, err
	}
	n.proxy = &httputil.ReverseProxy{Transport: n.rt, FlushInterval: -1,
		Rewrite: func(pr *httputil.ProxyRequest) {
			pr.SetURL(n.base)
			pr.Out.Host = n.host
			// On the request as it leaves, after the headers its
			// Connection names are gone: never the client's to drop.
			n.authorize(pr.Out.Header, tokenOf(pr.In))
			if h := pr.In.Header.Get("X-Forwarded-Host"); h != "" && strings.Contains(pr.In.URL.Path, "/ports/") {
				pr.Out.Header.Set("X-Forwarded-Host", h) // (the Host a sandbox's server is asked for)
			}
			if set, ok := pr.In.Context().Value(relayKey{}).(http.Header); ok { // an E2B front's relay
				for _, h := range relayHeaders {
					pr.Out.Header.Del(h)
				}
				for h, vs := range set {
					pr.Out.Header[h] = vs
				}
			}
		},
		ModifyResponse: func(resp *http.Response) error {
			// The worker's own 401 (its realm), not a sandbox server's
			// through the port route.
			if resp.StatusCode == http.StatusUnauthorized && resp.Header.Get("WWW-Authenticate") == `Bearer realm="dsec"` {
				resp.Body.Close()
				return n.refused()
			}
			if r := resp.Request; r.Method == http.MethodDelete && resp.StatusCode/100 == 2 {
				name, ok := strings.CutPrefix(r.URL.Path, "/"+api.Version+"/sandboxes/")
				if !ok { // E2B's kill, relayed to the worker's front
					name, ok = strings.CutPrefix(r.URL.Path, e2bPrefix+"/control/sandboxes/")
				}
				if ok && !strings.Contains(name, "/") {
					g.forget(n, name)
					g.freed(name)
				}
			}
			return nil
		},
		ErrorHandler: func(rw http.ResponseWriter, r *http.Request, err error) {
			// The transport may still read the request's body after
			// RoundTrip failed (an exec's input, full duplex): this
			// connection serves no next request, which it would read
			// at once.
			if r.ProtoMajor == 1 {
				rw.Header().Set("Connection", "close")
			}
			answer := func(err error) { fail(rw, err) }
			if f, ok := r.Context().Value(failKey{}).(func(error)); ok { // (an E2B front's relay: its own form)
				answer = f
			}
			if errors.Is(err, errRefused) {
				answer(err)
				return
			}
			if r.Context().Err() == nil { // (not the client's going)
				g.lost(n, err)
			}
			answer(n.unreachable(err))
		}}
	return n, nil
}

// newNode is w, parsed, with its transport.
func newNode(w Worker) (*node, error) {
	hostport, ok := strings.CutPrefix(w.URL, "tcp://")
	if !ok {
		return nil, fmt.Errorf("bad worker %q: give tcp://HOST:PORT: %w", w.URL, errdefs.ErrInvalidArgument)
	}
	host, _, err := net.SplitHostPort(hostport)
	if err != nil {
		return nil, fmt.Errorf("bad worker %q: %v: give tcp://HOST:PORT: %w", w.URL, err, errdefs.ErrInvalidArgument)
	}
	if w.Token == "" {
		return nil, fmt.Errorf("worker %s has no token: give an admin token of its (dsec token create --scope admin on its host): %w", w.URL, errdefs.ErrInvalidArgument)
	}
	t := &http.Transport{DialContext: (&net.Dialer{Timeout: 5 * time.Second, KeepAlive: 30 * time.Second}).DialContext,
		DisableCompression: true, MaxIdleConnsPerHost: 256, IdleConnTimeout: 90 * time.Second, ResponseHeaderTimeout: 0}
	scheme := "http"
	ip := net.ParseIP(host)
	if w.CA != "" || w.Cert != "" || w.ServerName != "" || !(host == "localhost" || ip != nil && ip.IsLoopback()) {
		cfg, err := auth.ClientTLS(w.CA, w.Cert, w.Key)
		if err != nil {
			return nil, fmt.Errorf("worker %s: %w", w.URL, err)
		}
		cfg.ServerName = w.ServerName
		t.TLSClientConfig, scheme = cfg, "https"
	}
	return &node{Worker: w, host: hostport, base: &url.URL{Scheme: scheme, Host: hostport}, rt: t}, nil
}

// Run heartbeats each worker every Heartbeat until ctx ends, each on
// its own (one slow to answer delays no other's), and, with
// cfg.Discover, follows the fleet's workers as they join and leave. A
// gateway heartbeats once (Heartbeat) before it serves, so that it
// routes from its first request.
func (g *Gateway) Run(ctx context.Context) {
	g.joining.Lock()
	g.ctx = ctx
	for _, n := range g.all() {
		g.start(n)
	}
	g.joining.Unlock()
	if g.cfg.Discover != nil {
		if err := g.cfg.Discover(ctx, g.Discovered); err != nil && ctx.Err() == nil {
			g.cfg.Log.Error("the fleet's workers are no longer discovered", "err", err)
		}
	}
	<-ctx.Done()
	g.beating.Wait()
}

// start heartbeats n every Heartbeat once Run runs (under joining),
// until n leaves the fleet or Run's context ends.
func (g *Gateway) start(n *node) {
	if g.ctx == nil {
		return
	}
	ctx := g.ctx
	g.beating.Go(func() {
		tick := time.NewTicker(g.cfg.Heartbeat)
		defer tick.Stop()
		for {
			select {
			case <-ctx.Done():
				return
			case <-tick.C:
			}
			g.beat(ctx, n)
			n.mu.Lock()
			leaves := !n.absent.IsZero() && (n.down || n.seen.IsZero() && time.Since(n.absent) >= g.cfg.DownAfter)
			n.mu.Unlock()
			if leaves {
				g.leave(n)
				return
			}
		}
	})
}

// Heartbeat asks every worker at once how it is and what it holds,
// waiting DownAfter at most.
func (g *Gateway) Heartbeat(ctx context.Context) {
	var wg sync.WaitGroup
	for _, n := range g.all() {
		wg.Go(func() { g.beat(ctx, n) })
	}
	wg.Wait()
}

// beat asks n how it is and what it holds. An answer, even busy, says
// it lives; none within DownAfter counts against it (lost).
func (g *Gateway) beat(ctx context.Context, n *node) {
	bctx, cancel := context.WithTimeout(ctx, g.cfg.DownAfter)
	defer cancel()
	var info api.VersionInfo
	var held []api.Sandbox
	asked := time.Now()
	// The list first: a sandbox made between the two is then counted in
	// the capacity the version says as well as pending (twice, until the
	// next heartbeat), never in neither.
	err := n.get(bctx, "/"+api.Version+"/sandboxes?brief=1", nil, &held) // (what it holds, not what each uses)
	if err == nil {
		err = n.get(bctx, "/"+api.Version+"/version", nil, &info)
	}
	if answered(err) {
		n.mu.Lock()
		n.seen = time.Now() // (busy: what it holds is as last said)
		n.mu.Unlock()
		return
	}
	if err != nil {
		if ctx.Err() == nil {
			g.lost(n, err)
		}
		return
	}
	n.mu.Lock()
	if n.down {
		g.cfg.Log.Info("a worker answers again", "worker", n.URL)
	}
	// What this gateway made or removed there since it asked: as done,
	// whatever the list says (the worker may have listed before).
	for name, c := range n.changed {
		i := slices.IndexFunc(held, func(s api.Sandbox) bool { return s.Name == name })
		switch {
		case c.at.Before(asked):
			delete(n.changed, name) // (the list shows it)
		case !c.made && i >= 0:
			held = slices.Delete(held, i, i+1)
		case c.made && i < 0:
			if j := slices.IndexFunc(n.held, func(s api.Sandbox) bool { return s.Name == name }); j >= 0 {
				held = append(held, n.held[j])
			}
		}
	}
	n.seen, n.err, n.down, n.info, n.held = time.Now(), nil, false, info, held
	n.cordoned = info.Cordoned
	for name, p := range n.pending {
		if !strings.HasPrefix(name, "?") && (time.Since(p.sent) > pendFor || slices.ContainsFunc(held, func(s api.Sandbox) bool { return s.Name == name })) {
			delete(n.pending, name)
		}
	}
	n.mu.Unlock()
	g.mu.Lock()
	for name, o := range g.routes {
		if o == n && !slices.ContainsFunc(held, func(s api.Sandbox) bool { return s.Name == name }) {
			delete(g.routes, name)
		}
	}
	for _, s := range held {
		g.routes[s.Name] = n
	}
	g.mu.Unlock()
}

// answered says whether err is a worker's answer (a failure it said),
// not its silence.
func answered(err error) bool {
	var e *api.Error
	return errors.As(err, &e)
}

// lost records that n did not answer: down once it has not for
// DownAfter (or never has).
func (g *Gateway) lost(n *node, err error) {
	n.mu.Lock()
	defer n.mu.Unlock()
	n.err = err
	if !n.down && time.Since(n.seen) >= g.cfg.DownAfter {
		n.down = true
		g.cfg.Log.Warn("a worker is down: its sandboxes are unreachable, and no create goes there", "worker", n.URL, "err", err)
	}
}

// errRefused marks a worker's refusal of the gateway's own token.
var errRefused = errors.New("refuses the gateway's token for it")

// refused is the infrastructure failure of a worker's 401 to the
// gateway: its token for the worker is wrong, not the client's.
func (n *node) refused() error {
	return fmt.Errorf("worker %s %w (--worker-token: an admin token of that worker's): %w", n.URL, errRefused, errdefs.ErrUnavailable)
}

// unreachable is the infrastructure failure of a request n did not
// answer.
func (n *node) unreachable(err error) error {
	n.mu.Lock()
	seen := n.seen
	n.mu.Unlock()
	since := "never answered"
	if !seen.IsZero() {
		since = "last answered " + seen.UTC().Format(time.RFC3339)
	}
	return fmt.Errorf("worker %s does not answer (%s): %v: %w", n.URL, since, err, errdefs.ErrUnavailable)
}

// get asks n for path as its admin (or on behalf of t) and decodes
// its JSON answer into out.
func (n *node) get(ctx context.Context, path string, t *auth.Token, out any) error {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, n.base.String()+path, nil)
	if err != nil {
		return err
	}
	n.authorize(req.Header, t)
	resp, err := n.rt.RoundTrip(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	switch resp.StatusCode {
	case http.StatusOK:
		return json.NewDecoder(io.LimitReader(resp.Body, 64<<20)).Decode(out)
	case http.StatusUnauthorized:
		return n.refused()
	}
	return errorOf(resp)
}

// authorize makes h n's admin's, on behalf of t (nil: the admin).
func (n *node) authorize(h http.Header, t *auth.Token) {
	h.Set("Authorization", "Bearer "+n.Token)
	h.Del(auth.OnBehalfHeader)
	h.Del(e2b.HeaderActAs) // (an E2B front's, never a client's to send on)
	h.Del(e2b.HeaderTemplate)
	h.Del(e2b.HeaderRecord)
	if t != nil && t.Scope != auth.Admin {
		h.Set(auth.OnBehalfHeader, auth.OnBehalf(*t))
	}
}

// errorOf is the error a worker's answer of a failure says.
func errorOf(resp *http.Response) error {
	var e api.Error
	if err := json.NewDecoder(io.LimitReader(resp.Body, 1<<20)).Decode(&e); err != nil || e.Class == "" {
		e = api.Error{Class: api.ClassOfStatus(resp.StatusCode), Message: resp.Status}
	}
	return &e
}

// room says whether n is up, and how much memory it has left to give:
// its bound on all sandboxes less what its sandboxes may use and what
// creates sent its way may.
func (n *node) room() (up bool, free int64, count int) {
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.down || n.seen.IsZero() || n.cordoned {
		return false, 0, 0
	}
	if n.info.Limits != nil {
		free = n.info.Limits.MemoryBytes
	}
	for _, s := range n.held {
		if s.Status == api.StatusRunning || s.Status == api.StatusPaused || s.Status == api.StatusCreating || s.Status == api.StatusQueued {
			free -= max(s.MemoryLimit, s.Memory)
		}
	}
	count = len(n.held)
	for name, p := range n.pending {
		if !slices.ContainsFunc(n.held, func(s api.Sandbox) bool { return s.Name == name }) {
			free -= p.mem
			count++
		}
	}
	return true, free, count
}

// admits says whether n's admission would take r now, as its last
// heartbeat said (with the creates sent its way since): no queue, the
// requests within what it admits, no disk below its floor. A worker
// that says nothing of it (an older one) admits all.
func (n *node) admits(r request) bool {
	n.mu.Lock()
	defer n.mu.Unlock()
	c := n.info.Capacity
	if c == nil {
		return true
	}
	if c.DiskFull != "" || c.Queued > 0 {
		return false
	}
	// Every create sent since: one the gateway has seen made is in held
	// before its worker's capacity says so; a heartbeat that lists it
	// (the list asked before the capacity) ends its pending.
	cpu, mem := c.CPURequestsUsed+r.cpu, c.MemoryRequestsUsed+r.mem
	for _, p := range n.pending {
		cpu, mem = cpu+p.req.cpu, mem+p.req.mem
	}
	return cpu <= c.CPURequests+1e-9 && mem <= c.MemoryRequests
}

// reserved counts d against n's room and admission while a create of
// that much is under way; settle (nil if failed) ends the reservation.
func (n *node) reserved(d demand) (settle func(name string)) {
	n.mu.Lock()
	defer n.mu.Unlock()
	mem := d.mem
	if mem <= 0 && n.info.Limits != nil { // (none asked: the worker's default limit)
		mem = n.info.Limits.DefaultMemory
	}
	n.reserve++
	key := fmt.Sprint("?", n.reserve)
	if n.pending == nil {
		n.pending = map[string]pend{}
	}
	n.pending[key] = pend{mem: mem, req: d.req, sent: time.Now()}
	return func(name string) {
		n.mu.Lock()
		defer n.mu.Unlock()
		p := n.pending[key]
		delete(n.pending, key)
		if name != "" && !slices.ContainsFunc(n.held, func(s api.Sandbox) bool { return s.Name == name }) {
			n.pending[name] = p
		}
	}
}

// place orders the workers a create asking d may go to (those only
// takes; nil: any): those whose admission takes it now first (the rest
// would queue it, or refuse it for a full disk), then the one with the
// most memory left (ties: the fewest sandboxes, then in turn), and
// reserves d on the first (settled as reserved says); none up is an
// infrastructure failure.
func (g *Gateway) place(d demand, only func(*node) bool) ([]*node, func(string), error) {
	return g.placeNear(d, only, nil)
}

// placeNear is place, a worker nearer the create's layers (near, by
// nearness: none, all alike) going before a farther one among those
// whose admission takes it.
func (g *Gateway) placeNear(d demand, only func(*node) bool, near map[*node]int) ([]*node, func(string), error) {
	type cand struct {
		n      *node
		admits bool
		near   int
		free   int64
		count  int
		turn   int
	}
	// One placement at a time: each sees the reservations of those
	// before it (a burst spreads).
	g.placing.Lock()
	defer g.placing.Unlock()
	g.mu.Lock()
	start := g.next
	g.next++
	g.mu.Unlock()
	var cs []cand
	nodes := g.all()
	for i := range nodes {
		n := nodes[(start+i)%len(nodes)]
		if up, free, count := n.room(); up && (only == nil || only(n)) {
			cs = append(cs, cand{n, n.admits(d.req), near[n], free, count, i})
		}
	}
	if len(cs) == 0 && only != nil {
		return nil, nil, fmt.Errorf("no worker up that may take it (of those that hold its snapshot or share it through their remote, or, for an E2B sandbox, whose E2B front serves gateways; dsec node ls): %w", errdefs.ErrUnavailable)
	}
	if len(cs) == 0 {
		return nil, nil, fmt.Errorf("no worker of the %d is up to take it (dsec node ls): %w", len(nodes), errdefs.ErrUnavailable)
	}
	slices.SortStableFunc(cs, func(a, b cand) int {
		return cmp.Or(-cmpBool(a.admits, b.admits), cmp.Compare(a.near, b.near), cmp.Compare(b.free, a.free), cmp.Compare(a.count, b.count), cmp.Compare(a.turn, b.turn))
	})
	out := make([]*node, len(cs))
	for i, c := range cs {
		out[i] = c.n
	}
	return out, out[0].reserved(d), nil
}

// cmpBool orders false before true.
func cmpBool(a, b bool) int {
	switch {
	case a == b:
		return 0
	case a:
		return 1
	}
	return -1
}

// ServeHTTP serves r for the fleet, behind the gateway's tokens.
func (g *Gateway) ServeHTTP(rw http.ResponseWriter, r *http.Request) {
	secret, _ := strings.CutPrefix(r.Header.Get("Authorization"), "Bearer ")
	t, err := g.cfg.Tokens.Check(secret, time.Now())
	if err != nil {
		rw.Header().Set("WWW-Authenticate", `Bearer realm="dsec"`)
		if r.ProtoMajor == 1 {
			rw.Header().Set("Connection", "close") // its body unread
		}
		answer(rw, http.StatusUnauthorized, api.Error{Class: api.ClassUnauthorized, Message: "unauthorized"})
		return
	}
	g.mux.ServeHTTP(rw, r.WithContext(context.WithValue(r.Context(), tokenKey{}, &t)))
}

type tokenKey struct{}

// templateKey marks a create whose spec is the E2B front's template of
// that name: the gateway's configuration, not its caller's; recordKey
// one the front sends with its record (e2b.HeaderRecord).
type (
	templateKey struct{}
	recordKey   struct{}
)

// ActAs serves the fleet's API to an E2B front in this process
// (e2b.InProcess): each request with the authority e2b.HeaderActAs
// names, a gateway token's ID or e2b.ActAsAdmin, which only such a
// request carries (the front checked the caller's key itself). A create
// the front marks as its template's (e2b.HeaderTemplate) is sent to its
// worker as the admin's spec on behalf of the caller, as a worker's own
// front makes one.
func (g *Gateway) ActAs() http.Handler {
	return http.HandlerFunc(func(rw http.ResponseWriter, r *http.Request) {
		id := r.Header.Get(e2b.HeaderActAs)
		if id == "" {
			answer(rw, http.StatusUnauthorized, api.Error{Class: api.ClassUnauthorized, Message: "unauthorized"})
			return
		}
		ctx := context.WithValue(r.Context(), tokenKey{}, g.actingAs(id))
		if name := r.Header.Get(e2b.HeaderTemplate); name != "" {
			ctx = context.WithValue(ctx, templateKey{}, name)
		}
		if rec := r.Header.Get(e2b.HeaderRecord); rec != "" {
			ctx = context.WithValue(ctx, recordKey{}, rec)
		}
		g.mux.ServeHTTP(rw, r.WithContext(ctx))
		// What a worker answered before it read all (a file past a full
		// disk) is read here, in process, so that the front reads the
		// answer, not a connection closed under its write.
		io.Copy(io.Discard, r.Body)
	})
}

// actingAs is the token an E2B front acts as: the gateway's token of id
// (a removed one's: its own sandboxes only, as scope sandboxes), or the
// admin's (e2b.ActAsAdmin).
func (g *Gateway) actingAs(id string) *auth.Token {
	if id == e2b.ActAsAdmin {
		return &auth.Token{Scope: auth.Admin}
	}
	if t, ok := g.cfg.Tokens.Lookup(id); ok {
		return &t
	}
	return &auth.Token{ID: id, Scope: auth.Sandboxes}
}

func tokenOf(r *http.Request) *auth.Token { return r.Context().Value(tokenKey{}).(*auth.Token) }

func (g *Gateway) routesMux() *http.ServeMux {
	v := "/" + api.Version
	mux := http.NewServeMux()
	mux.HandleFunc("GET "+v+"/version", g.version)
	mux.HandleFunc("GET "+v+"/nodes", g.adminOnly("list the workers", g.listNodes))
	mux.HandleFunc("POST "+v+"/nodes/{node}/cordon", g.adminOnly("cordon workers", g.cordon(true)))
	mux.HandleFunc("POST "+v+"/nodes/{node}/uncordon", g.adminOnly("uncordon workers", g.cordon(false)))
	mux.HandleFunc("POST "+v+"/sandboxes", g.create)
	mux.HandleFunc("GET "+v+"/sandboxes", g.list)
	mux.HandleFunc("GET "+v+"/sandboxes/{name}", g.inspect)
	mux.HandleFunc(v+"/sandboxes/{name}", g.toHolder)
	mux.HandleFunc(v+"/sandboxes/{name}/{rest...}", g.toHolder)
	mux.HandleFunc("POST "+v+"/calls", g.call)
	mux.HandleFunc("POST "+v+"/batches", g.batch)
	mux.HandleFunc("POST "+v+"/branches", g.branch)
	mux.HandleFunc("GET "+v+"/snapshots", g.snapshots)
	mux.HandleFunc("DELETE "+v+"/snapshots/{ref...}", g.removeSnapshot)
	mux.HandleFunc("POST "+v+"/squash", g.adminOnly("squash snapshots", g.squash))
	mux.HandleFunc("GET "+v+"/policies", g.policies)
	mux.HandleFunc("GET "+v+"/policies/{name}", g.policy)
	mux.HandleFunc("PUT "+v+"/policies/{name}", g.adminOnly("store policies", g.putPolicy))
	mux.HandleFunc("DELETE "+v+"/policies/{name}", g.adminOnly("remove stored policies", g.removeAll("policy")))
	mux.HandleFunc("GET "+v+"/pools", g.pools)
	mux.HandleFunc("PUT "+v+"/pools/{name}", g.adminOnly("make or resize pools", g.putPool))
	mux.HandleFunc("DELETE "+v+"/pools/{name}", g.adminOnly("remove pools", g.removeAll("pool")))
	mux.HandleFunc("/", func(rw http.ResponseWriter, r *http.Request) {
		fail(rw, fmt.Errorf("the gateway does not serve %s %s: ask a worker of the fleet for it (dsec --host tcp://WORKER): %w",
			r.Method, r.URL.Path, errdefs.ErrNotImplemented))
	})
	return mux
}

func (g *Gateway) adminOnly(what string, h http.HandlerFunc) http.HandlerFunc {
	return func(rw http.ResponseWriter, r *http.Request) {
		if t := tokenOf(r); t.Scope != auth.Admin {
			fail(rw, fmt.Errorf("a token of scope %s cannot %s: use an admin token of the gateway's: %w", t.Scope, what, errdefs.ErrPermissionDenied))
			return
		}
		h(rw, r)
	}
}

// version is the gateway's: the API it speaks, and every backend some
// worker up runs.
func (g *Gateway) version(rw http.ResponseWriter, r *http.Request) {
	v := api.VersionInfo{API: api.Version, Version: g.cfg.Version, Pid: os.Getpid(), Gateway: true}
	for _, n := range g.all() {
		n.mu.Lock()
		if !n.down {
			for _, b := range n.info.Backends {
				if !slices.Contains(v.Backends, b) {
					v.Backends = append(v.Backends, b)
				}
			}
		}
		n.mu.Unlock()
	}
	answer(rw, http.StatusOK, v)
}

// listNodes says how each worker is (dsec node ls).
func (g *Gateway) listNodes(rw http.ResponseWriter, r *http.Request) {
	out := []api.Node{}
	for _, n := range g.all() {
		_, free, _ := n.room()
		n.mu.Lock()
		s := api.Node{URL: n.URL, Up: !n.down && !n.seen.IsZero(), Cordoned: n.cordoned, Sandboxes: len(n.held),
			Version: n.info.Version, Backends: n.info.Backends, MemoryFree: max(free, 0)}
		if !n.seen.IsZero() {
			s.Seen = n.seen.UTC()
		}
		if n.err != nil {
			s.Error = n.err.Error()
		}
		if n.info.Limits != nil {
			s.MemoryBytes = n.info.Limits.MemoryBytes
		}
		s.Capacity = n.info.Capacity
		n.mu.Unlock()
		out = append(out, s)
	}
	answer(rw, http.StatusOK, out)
}

// cordon stops (or starts again) placing creates on a worker: the
// worker keeps it (PUT /v1/cordon), so that every gateway of the fleet,
// and this one started again, places none there.
func (g *Gateway) cordon(on bool) http.HandlerFunc {
	return func(rw http.ResponseWriter, r *http.Request) {
		n := g.node(r.PathValue("node"))
		if n == nil {
			fail(rw, fmt.Errorf("no worker %s in the fleet (dsec node ls): %w", r.PathValue("node"), errdefs.ErrNotFound))
			return
		}
		if err := n.send(r.Context(), http.MethodPut, "/"+api.Version+"/cordon", api.CordonRequest{Cordoned: on}, nil); err != nil {
			if !answered(err) {
				err = n.unreachable(err)
			}
			fail(rw, fmt.Errorf("worker %s keeps its cordon, and did not take this one: %w", n.URL, err))
			return
		}
		n.mu.Lock()
		n.cordoned = on
		n.mu.Unlock()
		rw.WriteHeader(http.StatusNoContent)
	}
}

// node is the worker named by its URL or HOST:PORT.
func (g *Gateway) node(name string) *node {
	for _, n := range g.all() {
		if n.URL == name || n.host == name {
			return n
		}
	}
	return nil
}

// maxBody bounds a create's or call's body (a worker's bound too).
const maxBody = 1 << 20

// readBody reads r's body, maxBody at most; false: it is answered.
func readBody(rw http.ResponseWriter, r *http.Request) ([]byte, bool) {
	body, err := io.ReadAll(io.LimitReader(r.Body, maxBody+1))
	if err != nil || len(body) > maxBody {
		fail(rw, fmt.Errorf("request body over %d KiB, or unread: %v: %w", maxBody>>10, err, errdefs.ErrOutOfRange))
		return nil, false
	}
	return body, true
}

// create places a sandbox: a name taken anywhere in the fleet is
// refused as a worker refuses one it holds; else the workers in the
// order of place, the next when one is busy (429) or does not answer.
func (g *Gateway) create(rw http.ResponseWriter, r *http.Request) {
	body, ok := readBody(rw, r)
	if !ok {
		return
	}
	var spec api.SandboxSpec
	json.Unmarshal(body, &spec) // (a bad body is the worker's to refuse)
	var only func(*node) bool
	if spec.Snapshot != "" {
		var err error
		if only, err = g.snapshotTakers(r.Context(), tokenOf(r), spec.Snapshot); err != nil {
			fail(rw, err)
			return
		}
	}
	// made: the sandbox may stand (made, or its answer lost on the way:
	// its claim is kept until the heartbeats say).
	made := true
	if spec.Name != "" {
		c, err := g.claim(r.Context(), []string{spec.Name})
		if err != nil {
			fail(rw, err)
			return
		}
		defer func() { c.done(func(string) bool { return made }) }()
	}
	last, n, settle, err := g.createOne(r.Context(), tokenOf(r), r.URL.RequestURI(), body, demandOf(spec, 1), only)
	if err != nil {
		made = errdefs.IsUnavailable(err) || r.Context().Err() != nil
		fail(rw, err)
		return
	}
	defer last.Body.Close()
	if last.StatusCode != http.StatusCreated {
		made = false
		relay(rw, last)
		return
	}
	sb, err := n.described(last)
	if err != nil {
		settle("")
		fail(rw, err)
		return
	}
	b, _ := json.Marshal(sb)
	var sandbox api.Sandbox
	json.Unmarshal(b, &sandbox)
	sandbox.E2B = nil // (its access token: the caller's alone, never kept here)
	settle(sandbox.Name)
	g.made(n, sandbox)
	answer(rw, http.StatusCreated, sb)
}

// made records a sandbox n made: routed there, and in its list until
// its next heartbeat says (its worker may die before).
func (g *Gateway) made(n *node, sb api.Sandbox) {
	g.mu.Lock()
	g.routes[sb.Name] = n
	g.mu.Unlock()
	n.mu.Lock()
	if !slices.ContainsFunc(n.held, func(s api.Sandbox) bool { return s.Name == sb.Name }) {
		n.held = append(slices.Clip(n.held), sb)
	}
	n.noteChange(sb.Name, true)
	// Pending until a heartbeat lists it: one whose list was asked for
	// before it was made must not take it for gone.
	if _, ok := n.pending[sb.Name]; !ok {
		if n.pending == nil {
			n.pending = map[string]pend{}
		}
		n.pending[sb.Name] = pend{sent: time.Now()}
	}
	n.mu.Unlock()
}

// noteChange notes that this gateway made (or removed) the sandbox name
// on n now; n.mu is held.
func (n *node) noteChange(name string, made bool) {
	if n.changed == nil {
		n.changed = map[string]change{}
	}
	n.changed[name] = change{made: made, at: time.Now()}
}

// forget records that n removed the sandbox name: its name is free at
// once, and its memory no longer counted.
func (g *Gateway) forget(n *node, name string) {
	g.mu.Lock()
	if g.routes[name] == n {
		delete(g.routes, name)
	}
	g.mu.Unlock()
	n.mu.Lock()
	n.held = slices.DeleteFunc(slices.Clone(n.held), func(s api.Sandbox) bool { return s.Name == name })
	n.noteChange(name, false)
	delete(n.pending, name)
	n.mu.Unlock()
}

// createOne sends a create (body, to path) to the workers in the order
// of place, each reserving mem until it answers: the next only when one
// surely never got it (no connection). It returns the answer (its body
// the caller's to close), the worker, and how to settle the
// reservation once the sandbox's name is known (201 only: else it is
// settled).
func (g *Gateway) createOne(ctx context.Context, t *auth.Token, path string, body []byte, d demand, only func(*node) bool) (*http.Response, *node, func(string), error) {
	if rec, _ := ctx.Value(recordKey{}).(string); rec != "" {
		// An E2B front's: to a worker whose front keeps its record (not
		// one older than this gateway, nor one whose front failed).
		only = withE2B(only)
	}
	nodes, settle, err := g.placeNear(d, only, g.nearness(ctx, t, d.layers, only))
	if err != nil {
		return nil, nil, nil, err
	}
	for i, n := range nodes {
		if i > 0 {
			settle = n.reserved(d)
		}
		req, err := http.NewRequestWithContext(ctx, http.MethodPost, n.base.String()+path, bytes.NewReader(body))
		if err != nil {
			settle("")
			return nil, nil, nil, err
		}
		req.Header.Set("Content-Type", "application/json")
		tq, err := g.quotaOn(t, n)
		if err != nil { // (used up on the others)
			settle("")
			return nil, nil, nil, err
		}
		n.authorize(req.Header, tq)
		if name, _ := ctx.Value(templateKey{}).(string); name != "" && t.Scope != auth.Admin {
			req.Header.Set(e2b.HeaderTemplate, name) // the admin's spec, vouched for as the worker's own front does
		}
		if rec, _ := ctx.Value(recordKey{}).(string); rec != "" {
			req.Header.Set(e2b.HeaderRecord, rec) // the E2B front's record, for the worker's front to keep
		}
		resp, err := n.rt.RoundTrip(req)
		if err != nil {
			settle("")
			if ctx.Err() != nil {
				return nil, nil, nil, ctx.Err()
			}
			g.lost(n, err)
			// (Only a create that surely never arrived goes elsewhere:
			// one lost on the way may have been made.)
			var op *net.OpError
			if !errors.As(err, &op) || op.Op != "dial" {
				return nil, nil, nil, n.unreachable(err)
			}
			continue
		}
		if resp.StatusCode != http.StatusCreated {
			settle("")
		}
		if resp.StatusCode == http.StatusUnauthorized {
			resp.Body.Close()
			return nil, nil, nil, n.refused()
		}
		// (A worker's busy or quota refusal is the client's answer.)
		return resp, n, settle, nil
	}
	return nil, nil, nil, fmt.Errorf("no worker took the sandbox: none answered (dsec node ls): %w", errdefs.ErrUnavailable)
}

// withE2B is only, of the workers whose E2B front serves gateways.
func withE2B(only func(*node) bool) func(*node) bool {
	return func(n *node) bool {
		n.mu.Lock()
		e2b := n.info.E2B
		n.mu.Unlock()
		return e2b && (only == nil || only(n))
	}
}

// quotaOn is t as worker n is to see it: its quota less what its
// sandboxes hold on the other workers, as their lists say, so that n's
// check holds the quota across the fleet (to within the creates in
// flight to other workers meanwhile). A bound they fill is -1 (none
// left: n refuses whatever would add to it), with an error that says
// so.
func (g *Gateway) quotaOn(t *auth.Token, n *node) (*auth.Token, error) {
	q := t.Quota
	if t.Scope == auth.Admin || q.Sandboxes == 0 && q.Memory == 0 && q.Disk == 0 {
		return t, nil
	}
	var count, mem, disk int64
	for _, o := range g.all() {
		if o == n {
			continue
		}
		o.mu.Lock()
		for _, s := range o.held { // (a worker down's too: they still stand)
			if s.Owner == t.ID {
				count, mem, disk = count+1, mem+s.Memory, disk+cmp.Or(s.DiskLimit, s.Disk)
			}
		}
		o.mu.Unlock()
	}
	left := *t
	var err error
	for _, b := range []struct {
		what        string
		bound, have int64
		left        func(int64)
	}{
		{"sandboxes", int64(q.Sandboxes), count, func(v int64) { left.Quota.Sandboxes = int(v) }},
		{"bytes of memory limits", q.Memory, mem, func(v int64) { left.Quota.Memory = v }},
		{"bytes of disk bounds", q.Disk, disk, func(v int64) { left.Quota.Disk = v }},
	} {
		switch {
		case b.bound == 0:
		case b.have >= b.bound:
			b.left(-1)
			err = cmp.Or(err, fmt.Errorf("token %s's quota: its sandboxes on the fleet hold %d %s, its bound: remove some of them first (dsec rm): %w",
				t.ID, b.have, b.what, errdefs.ErrResourceExhausted))
		default:
			b.left(b.bound - b.have)
		}
	}
	return &left, err
}

// described is the sandbox n's answer describes, with its node.
func (n *node) described(resp *http.Response) (map[string]json.RawMessage, error) {
	var sb map[string]json.RawMessage
	b, err := io.ReadAll(io.LimitReader(resp.Body, 16<<20))
	if err == nil {
		err = json.Unmarshal(b, &sb)
	}
	if err != nil {
		return nil, fmt.Errorf("worker %s's description of a sandbox: %v: %w", n.URL, err, errdefs.ErrUnavailable)
	}
	sb["node"], _ = json.Marshal(n.URL)
	return sb, nil
}

// inspect is the sandbox's worker's description of it, with its node.
func (g *Gateway) inspect(rw http.ResponseWriter, r *http.Request) {
	n := g.holderUp(rw, r)
	if n == nil {
		return
	}
	req, err := http.NewRequestWithContext(r.Context(), http.MethodGet, n.base.String()+r.URL.RequestURI(), nil)
	if err != nil {
		fail(rw, err)
		return
	}
	n.authorize(req.Header, tokenOf(r))
	resp, err := n.rt.RoundTrip(req)
	if err != nil {
		if r.Context().Err() == nil {
			g.lost(n, err)
		}
		fail(rw, n.unreachable(err))
		return
	}
	defer resp.Body.Close()
	if resp.StatusCode == http.StatusUnauthorized {
		fail(rw, n.refused())
		return
	}
	if resp.StatusCode != http.StatusOK {
		relay(rw, resp)
		return
	}
	sb, err := n.described(resp)
	if err != nil {
		fail(rw, err)
		return
	}
	answer(rw, http.StatusOK, sb)
}

// batch makes a batch's sandboxes over the fleet: each a create placed
// as one is (so a burst spreads by the room each worker has left, its
// creates under way counted), all at once, answered as JSON lines as
// each is made or fails. Its names are checked against the workers'
// last lists, not asked of each.
func (g *Gateway) batch(rw http.ResponseWriter, r *http.Request) {
	var req api.BatchRequest
	lr := &io.LimitedReader{R: r.Body, N: maxBody + 1}
	dec := json.NewDecoder(lr)
	dec.DisallowUnknownFields()
	if err := dec.Decode(&req); err != nil {
		if lr.N == 0 {
			fail(rw, fmt.Errorf("request body over %d KiB: send less: %w", maxBody>>10, errdefs.ErrOutOfRange))
			return
		}
		fail(rw, fmt.Errorf("bad request body: %v: %w", err, errdefs.ErrInvalidArgument))
		return
	}
	if err := req.Validate(); err != nil {
		fail(rw, err)
		return
	}
	var mu sync.Mutex
	made := map[string]bool{} // (under mu)
	if req.Spec.Name != "" {
		names := make([]string, req.Count)
		for i := range names {
			names[i] = api.BatchName(req.Spec.Name, i)
		}
		c, err := g.claim(r.Context(), names)
		if err != nil {
			fail(rw, err)
			return
		}
		defer func() {
			mu.Lock()
			defer mu.Unlock()
			c.done(func(name string) bool { return made[name] })
		}()
	}
	t := tokenOf(r)
	var only func(*node) bool
	if req.Spec.Snapshot != "" {
		var err error
		if only, err = g.snapshotTakers(r.Context(), t, req.Spec.Snapshot); err != nil {
			fail(rw, err)
			return
		}
	}
	rw.Header().Set("Content-Type", "application/x-ndjson")
	rw.WriteHeader(http.StatusOK)
	flush := http.NewResponseController(rw)
	flush.Flush()
	enc := json.NewEncoder(rw)
	var wg sync.WaitGroup
	// So many under way at once, as a worker's own admission would take
	// them (more only wait there, holding the token's request slots).
	under := make(chan struct{}, maxBatchUnderWay)
	for i := range req.Count {
		under <- struct{}{}
		wg.Go(func() {
			defer func() { <-under }()
			item := g.batchItem(r.Context(), t, req.Spec, i, only)
			mu.Lock()
			defer mu.Unlock()
			if item.Sandbox != nil {
				made[item.Sandbox.Name] = true
			}
			enc.Encode(item)
			flush.Flush()
		})
	}
	wg.Wait()
}

// batchItem makes a batch's sandbox i of spec.
func (g *Gateway) batchItem(ctx context.Context, t *auth.Token, spec api.SandboxSpec, i int, only func(*node) bool) api.BatchItem {
	item := api.BatchItem{Index: i}
	if spec.Name != "" {
		spec.Name = api.BatchName(spec.Name, i)
	}
	body, _ := json.Marshal(spec)
	resp, n, settle, err := g.createOne(ctx, t, "/"+api.Version+"/sandboxes", body, demandOf(spec, 1), only)
	if err != nil {
		item.Error, _ = api.ErrorOf(err)
		return item
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusCreated {
		item.Error, _ = api.ErrorOf(errorOf(resp))
		return item
	}
	var sb api.Sandbox
	if err := json.NewDecoder(io.LimitReader(resp.Body, 16<<20)).Decode(&sb); err != nil {
		settle("")
		item.Error, _ = api.ErrorOf(fmt.Errorf("worker %s's description of a sandbox: %v: %w", n.URL, err, errdefs.ErrUnavailable))
		return item
	}
	settle(sb.Name)
	g.made(n, sb)
	sb.Node = n.URL
	item.Sandbox = &sb
	return item
}

// call places a call (a sandbox for one command, streamed) as a create
// is placed: on the first worker of place's order.
func (g *Gateway) call(rw http.ResponseWriter, r *http.Request) {
	nodes, settle, err := g.place(demand{}, nil)
	if err != nil {
		fail(rw, err)
		return
	}
	defer settle("") // (a call's sandbox is gone when it answers)
	g.relayTo(nodes[0], rw, r)
}

// maxBatchUnderWay bounds a batch's creates under way at once through a
// gateway.
const maxBatchUnderWay = 64

// list is every worker's list, on behalf of the caller: a down
// worker's sandboxes as it last listed them, unreachable. A worker's
// refusal (busy: the caller's requests at once) is the list's.
func (g *Gateway) list(rw http.ResponseWriter, r *http.Request) {
	t := tokenOf(r)
	nodes := g.all()
	lists := make([][]api.Sandbox, len(nodes))
	errs := make([]error, len(nodes))
	var wg sync.WaitGroup
	for i, n := range nodes {
		wg.Go(func() {
			n.mu.Lock()
			down, held := n.down, n.held
			n.mu.Unlock()
			var got []api.Sandbox
			var err error
			if !down {
				ctx, cancel := context.WithTimeout(r.Context(), g.cfg.DownAfter)
				err = n.get(ctx, r.URL.RequestURI(), t, &got)
				cancel()
				if answered(err) {
					errs[i] = err
					return
				}
				if err != nil && r.Context().Err() == nil {
					g.lost(n, err)
				}
			}
			if down || err != nil {
				got = nil
				for _, s := range held {
					if t.Scope == auth.Admin || s.Owner == t.ID {
						s.Status = api.StatusUnreachable
						got = append(got, s)
					}
				}
			}
			for i := range got {
				got[i].Node = n.URL
			}
			lists[i] = got
		})
	}
	wg.Wait()
	for _, err := range errs {
		if err != nil {
			fail(rw, err)
			return
		}
	}
	out := slices.Concat(lists...)
	if out == nil {
		out = []api.Sandbox{}
	}
	slices.SortStableFunc(out, func(a, b api.Sandbox) int { return a.Created.Compare(b.Created) })
	answer(rw, http.StatusOK, out)
}

// toHolder relays a request about a sandbox to its worker.
func (g *Gateway) toHolder(rw http.ResponseWriter, r *http.Request) {
	if n := g.holderUp(rw, r); n != nil {
		g.relayTo(n, rw, r)
	}
}

// holderUp is the worker up that holds r's sandbox, or nil once rw
// has the answer: not found, or its worker down.
func (g *Gateway) holderUp(rw http.ResponseWriter, r *http.Request) *node {
	return g.holderNamed(rw, r, r.PathValue("name"))
}

// holderNamed is holderUp of the sandbox name.
func (g *Gateway) holderNamed(rw http.ResponseWriter, r *http.Request, name string) *node {
	n, err := g.holderOf(r.Context(), name, tokenOf(r))
	if err != nil {
		fail(rw, err)
	}
	return n
}

// holderOf is the worker up that holds the sandbox name, as t sees it:
// else not found, or its worker down.
func (g *Gateway) holderOf(ctx context.Context, name string, t *auth.Token) (*node, error) {
	notFound := fmt.Errorf("no sandbox %s (dsec ps lists them): %w", name, errdefs.ErrNotFound)
	n := g.holder(ctx, name, t)
	if n == nil {
		return nil, notFound
	}
	n.mu.Lock()
	down, err := n.down, n.err
	// Another's sandbox on a worker down is not found, as on one up.
	mine := t.Scope == auth.Admin || slices.ContainsFunc(n.held, func(s api.Sandbox) bool { return s.Name == name && s.Owner == t.ID })
	n.mu.Unlock()
	switch {
	case down && !mine:
		return nil, notFound
	case down:
		return nil, fmt.Errorf("sandbox %s: %w", name, n.unreachable(err))
	}
	return n, nil
}

// holder is the worker that holds the sandbox name: as the last
// heartbeat said, or else as the workers up say now to t (one made
// through another gateway since; t's own only).
func (g *Gateway) holder(ctx context.Context, name string, t *auth.Token) *node {
	g.mu.Lock()
	n := g.routes[name]
	g.mu.Unlock()
	if n != nil {
		return n
	}
	ctx, cancel := context.WithTimeout(ctx, g.cfg.DownAfter)
	defer cancel()
	nodes := g.all()
	found := make(chan *node, len(nodes))
	var wg sync.WaitGroup
	for _, o := range nodes {
		o.mu.Lock()
		down := o.down
		o.mu.Unlock()
		if down {
			continue
		}
		wg.Go(func() {
			var sb api.Sandbox
			if o.get(ctx, "/"+api.Version+"/sandboxes/"+url.PathEscape(name), t, &sb) == nil {
				found <- o
			}
		})
	}
	go func() { wg.Wait(); close(found) }()
	n, ok := <-found
	if !ok {
		return nil
	}
	g.mu.Lock()
	g.routes[name] = n
	g.mu.Unlock()
	return n
}

// relayTo relays r to n as the caller's (n.proxy's Rewrite), streaming
// both ways (an exec's input and output at once).
func (g *Gateway) relayTo(n *node, rw http.ResponseWriter, r *http.Request) {
	http.NewResponseController(rw).EnableFullDuplex()
	n.proxy.ServeHTTP(rw, r)
}

// relay copies a worker's answer to rw as it is.
func relay(rw http.ResponseWriter, resp *http.Response) {
	for k, vs := range resp.Header {
		for _, v := range vs {
			rw.Header().Add(k, v)
		}
	}
	rw.WriteHeader(resp.StatusCode)
	io.Copy(rw, resp.Body)
}

func answer(rw http.ResponseWriter, status int, v any) {
	rw.Header().Set("Content-Type", "application/json")
	rw.WriteHeader(status)
	json.NewEncoder(rw).Encode(v)
}

// fail answers err as a worker would (api.ErrorOf).
func fail(rw http.ResponseWriter, err error) {
	body, status := api.ErrorOf(err)
	answer(rw, status, body)
}
