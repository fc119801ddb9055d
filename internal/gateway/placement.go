package gateway

import (
	"cmp"
	"fmt"
	"slices"
	"time"

	"github.com/containerd/errdefs"

	"github.com/dsec-project/dsec/api"
)

// Placement: the worker a create goes to. A worker's room (memory left
// under its bound) and its admission (requests, as its capacity said)
// count the creates sent its way that its list does not show yet, so a
// burst spreads.

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
