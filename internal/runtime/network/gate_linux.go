package network

import (
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/netip"
	"runtime"
	"slices"
	"sync"
	"time"

	"golang.org/x/sys/unix"

	"github.com/dsec-project/dsec/internal/egress"
)

// The fast path of domain rules' HTTPS (egress.Gate, Fast). A sandbox's
// connection to TCP 443 of an address its resolver answered it for an
// allowed name goes on in the kernel, not through its proxy: the
// service's gate reads its hello as it passes and decides it by name and
// address, then lets the rest of the flow through unread. The addresses
// are the sandbox's learned ones whose rule opens 443; any other (a
// hard-coded address, an /etc/hosts entry, an answer expired) still
// goes to the proxy. One gate (one netfilter queue) serves every
// sandbox of the service: its state is by flow, and a flow is decided
// by its own sandbox's rules and answers only.

// gate is the service's fast path, once a sandbox with domain rules
// starts (nil queue: the fast path is off, and every web connection
// goes to the proxies).
type gate struct {
	once      sync.Once
	q         *Queue
	done      chan struct{} // closed by close
	closeOnce sync.Once
	mu        sync.Mutex // guards gate, bySrc and passed
	gate      egress.Gate
	bySrc     map[netip.Addr]*Link // the sandboxes it serves, by address
	// passed are the flows passed and the names they asked, for
	// Flows; a flow long ended is forgotten past maxPassed.
	passed map[egress.Flow]string
}

// maxPassed bounds the passed flows remembered.
const maxPassed = 1 << 16

// queue is the gate's queue, bound on first use; nil: off (or closed).
func (g *gate) queue() *Queue {
	g.once.Do(func() {
		var errs []error
		for i := range FastQueues {
			q, err := OpenQueue(FastQueueBase + uint16(i))
			if err == nil {
				g.q = q
				break
			}
			errs = append(errs, err)
			// (The kernel says EPERM of a queue another socket has.)
			if !errors.Is(err, unix.EPERM) && !errors.Is(err, unix.EBUSY) {
				break
			}
		}
		if g.q == nil {
			slog.Warn("no netfilter queue for the fast path of domain rules: every web connection goes through the proxy",
				"err", errors.Join(errs...))
			return
		}
		// Flows a process gone left undecided on this queue: their bytes
		// so far are unknown here, so they are reset.
		if err := KillPending(g.q); err != nil {
			slog.Warn("flows left undecided by an earlier worker stay", "err", err)
		}
		g.gate = egress.Gate{
			Decide:   g.decide,
			IsClient: func(a netip.Addr) bool { return g.bySrc[a] != nil },
			Passed: func(f egress.Flow, name string) {
				if len(g.passed) >= maxPassed {
					clear(g.passed) // the oldest are long gone; a reset misses the rest
				}
				g.passed[f] = name
			},
		}
		g.bySrc = map[netip.Addr]*Link{}
		g.passed = map[egress.Flow]string{}
		g.done = make(chan struct{})
		go g.serve()
	})
	if g.q != nil && g.q.closed.Load() {
		return nil
	}
	return g.q
}

// close unbinds the gate's queue, if it has one, and stops serving it
// (never bound after): flows under way on it go nowhere until another
// worker binds it and kills them (KillPending).
func (g *gate) close() (err error) {
	g.once.Do(func() {})
	if g.q == nil {
		return nil
	}
	g.closeOnce.Do(func() {
		close(g.done)
		err = g.q.Close()
	})
	return err
}

// serve gives each queued packet its verdict, and ends the flows left
// undecided too long, until the gate is closed.
func (g *gate) serve() {
	go func() {
		tick := time.NewTicker(time.Second)
		defer tick.Stop()
		for {
			var now time.Time
			select {
			case <-g.done:
				return
			case now = <-tick.C:
			}
			g.mu.Lock()
			dead := g.gate.Expire(now)
			g.mu.Unlock()
			for _, f := range dead {
				if err := KillFlow(f.Client, f.Server); err != nil && !errors.Is(err, unix.ENOENT) {
					slog.Warn("a flow the gate gave up on is not killed in the host: its next packet is", "from", f.Client, "to", f.Server, "err", err)
					continue // held dead: the gate kills it at its next packet
				}
				g.mu.Lock()
				g.gate.ForgetFlow(f)
				g.mu.Unlock()
			}
		}
	}()
	runtime.LockOSThread() // its reads block the thread itself (Queue)
	for {
		pkts, err := g.q.Read()
		if errors.Is(err, net.ErrClosed) {
			return
		}
		if err != nil {
			slog.Error("the fast path's queue failed: its flows go nowhere until the worker restarts", "err", err)
			return
		}
		now := time.Now()
		vs := make([]Verdict, 0, len(pkts))
		g.mu.Lock()
		for _, p := range pkts {
			vs = append(vs, verdictOf(p.ID, g.gate.Packet(p.Packet, ISN(p.Mark), now)))
		}
		g.mu.Unlock()
		if err := g.q.Verdicts(vs); err != nil {
			slog.Warn("the fast path's verdicts were not taken: their flows stall and are retransmitted", "err", err)
		}
	}
}

// verdictOf is the queue's verdict for the gate's v on packet id.
func verdictOf(id uint32, v egress.Verdict) Verdict {
	switch v {
	case egress.Accept:
		return Verdict{ID: id, Accept: true}
	case egress.Pass:
		return Verdict{ID: id, Mark: PassMark}
	case egress.Kill:
		return Verdict{ID: id, Mark: KillMark}
	}
	return Verdict{ID: id}
}

// decide says whether a flow's hello, naming name, may go to its
// server: a domain rule of the flow's sandbox allows name on the port,
// and the server's address is one the sandbox's resolver answered for
// that name, not yet expired; g.mu is held.
func (g *gate) decide(f egress.Flow, name string) error {
	l := g.bySrc[f.Client.Addr()]
	if l == nil {
		return errors.New("no sandbox of this worker's has this address")
	}
	fv := l.fast.Load()
	if fv != nil && fv.view.Direct(f.Server) {
		return nil // a CIDR rule's: any name
	}
	if fv == nil || !fv.view.Allows(name, f.Server.Port()) {
		return fmt.Errorf("no rule allows %s on port %d", name, f.Server.Port())
	}
	if !fv.answers.gave(name, f.Server.Addr(), time.Now()) {
		return fmt.Errorf("%s is not an address the sandbox's resolver gave for %s", f.Server.Addr(), name)
	}
	return nil
}

// fastView is what the gate asks of a sandbox: its policy as compiled,
// as of its last change, and the names its resolver answered with each
// address, until when (the gate never waits for the sandbox's lock).
type fastView struct {
	view    *View
	answers *answers
}

// answers are the addresses a sandbox's resolver answered for each
// name, each until the latest answer's expiry: unlike its learned
// addresses (one entry per address and rule), every name that shares
// an address has it.
type answers struct {
	mu     sync.Mutex
	byName map[string]map[netip.Addr]time.Time
	n      int
}

// maxAnswers bounds the names and addresses a sandbox's answers hold:
// past it, the expired go, then (a flood of names) all.
const maxAnswers = 4 * MaxLearned

// add records what an answer taught.
func (a *answers) add(learned []egress.Learned) {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.byName == nil {
		a.byName = map[string]map[netip.Addr]time.Time{}
	}
	for _, l := range learned {
		addrs := a.byName[l.Name]
		if addrs == nil {
			addrs = map[netip.Addr]time.Time{}
			a.byName[l.Name] = addrs
		}
		if _, ok := addrs[l.Addr]; !ok {
			a.n++
		}
		if l.Expires.After(addrs[l.Addr]) {
			addrs[l.Addr] = l.Expires
		}
	}
	if a.n > maxAnswers {
		a.prune(time.Now())
		if a.n > maxAnswers {
			clear(a.byName)
			a.n = 0
		}
	}
}

// prune drops what expired before now; a.mu is held.
func (a *answers) prune(now time.Time) {
	for name, addrs := range a.byName {
		for addr, exp := range addrs {
			if now.After(exp) {
				delete(addrs, addr)
				a.n--
			}
		}
		if len(addrs) == 0 {
			delete(a.byName, name)
		}
	}
}

// gave says whether the resolver answered name with addr, unexpired.
func (a *answers) gave(name string, addr netip.Addr, now time.Time) bool {
	a.mu.Lock()
	defer a.mu.Unlock()
	exp, ok := a.byName[name][addr]
	return ok && now.Before(exp)
}

// Sync makes the host send the sandbox's HTTPS to its learned addresses
// (of rules that open 443) by the fast path, and gives the gate its
// policy v and answers as they are now. The sandbox's changes are
// serialized by its caller.
func (l *Link) Sync(v *View, learned []egress.Learned) {
	if l.Closed() || !FastSupported() {
		return
	}
	g := &l.e.gate
	q := g.queue()
	if q == nil {
		Fast(l.nat, 0, nil) // an earlier worker's, queued to no one now
		return
	}
	fv := &fastView{view: v, answers: &answers{}}
	if old := l.fast.Load(); old != nil {
		fv.answers = old.answers
	}
	fv.answers.add(learned) // (a worker restarted has only these)
	l.fast.Store(fv)
	g.mu.Lock()
	g.bySrc[l.self] = l
	g.mu.Unlock()
	var dsts []netip.Addr
	now := time.Now()
	for _, a := range learned {
		// (Not one a CIDR rule opens on 443 too: the proxy relays
		// those unread, whatever their hello says.)
		if a.Addr.Is4() && now.Before(a.Expires) && v.Allows(a.Name, egress.PortHTTPS) && !v.Direct(netip.AddrPortFrom(a.Addr, egress.PortHTTPS)) &&
			!slices.Contains(dsts, a.Addr) {
			dsts = append(dsts, a.Addr)
		}
	}
	if err := Fast(l.nat, q.Num(), dsts); err != nil {
		slog.Warn("the sandbox's HTTPS goes through its proxy", "sandbox", l.name, "err", err)
	}
}

// stopFast sends the sandbox's web connections all to its proxy again,
// and takes it out of the gate.
func (l *Link) stopFast() {
	if l.fast.Load() == nil {
		return
	}
	l.fast.Store(nil)
	g := &l.e.gate
	g.mu.Lock()
	if g.bySrc[l.self] == l {
		delete(g.bySrc, l.self)
		g.gate.Forget(l.self)
		for f := range g.passed {
			if f.Client.Addr() == l.self {
				delete(g.passed, f)
			}
		}
	}
	g.mu.Unlock()
	if err := Fast(l.nat, 0, nil); err != nil {
		slog.Warn("the sandbox's fast destinations stay in the host's table", "sandbox", l.name, "err", err)
	}
}

// Answered records what an answer taught, for the gate.
func (l *Link) Answered(learned []egress.Learned) {
	if fv := l.fast.Load(); fv != nil {
		fv.answers.add(learned)
	}
}

// Prune drops the expired answers.
func (l *Link) Prune(now time.Time) {
	if fv := l.fast.Load(); fv != nil {
		fv.answers.mu.Lock()
		fv.answers.prune(now)
		fv.answers.mu.Unlock()
	}
}

// Flows are the flows the gate passed from the sandbox, by the names
// they asked.
func (l *Link) Flows() map[egress.Flow]string {
	g := &l.e.gate
	g.mu.Lock()
	defer g.mu.Unlock()
	out := map[egress.Flow]string{}
	for f, name := range g.passed {
		if f.Client.Addr() == l.self {
			out[f] = name
		}
	}
	return out
}
