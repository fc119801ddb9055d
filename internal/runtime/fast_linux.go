package runtime

import (
	"errors"
	"fmt"
	"log/slog"
	"net/netip"
	"runtime"
	"slices"
	"sync"
	"time"

	"golang.org/x/sys/unix"

	"github.com/dsec-project/dsec/internal/egress"
	"github.com/dsec-project/dsec/internal/runtime/network"
)

// The fast path of domain rules' HTTPS (egress.Gate, network.Fast). A
// sandbox's connection to TCP 443 of an address its resolver answered it
// for an allowed name goes on in the kernel, not through its proxy: this
// process's gate reads its hello as it passes and decides it by name and
// address, then lets the rest of the flow through unread. The addresses
// are the sandbox's learned ones whose rule opens 443; any other (a
// hard-coded address, an /etc/hosts entry, an answer expired) still
// goes to the proxy. One gate (one netfilter queue) serves every
// sandbox of the process: its state is by flow, and a flow is decided
// by its own sandbox's rules and answers only.

// fastPath is this process's gate, once a sandbox with domain rules
// starts (nil queue: the fast path is off, and every web connection
// goes to the proxies).
var fastPath struct {
	once  sync.Once
	q     *network.Queue
	mu    sync.Mutex // guards gate, bySrc and passed
	gate  egress.Gate
	bySrc map[netip.Addr]*Sandbox // the sandboxes it serves, by address
	// passed are the flows passed and the names they asked, for
	// ResetConnections; a flow long ended is forgotten past maxPassed.
	passed map[egress.Flow]string
}

// maxPassed bounds the passed flows remembered.
const maxPassed = 1 << 16

// fastQueue is the process's queue, bound on first use; nil: off.
func fastQueue() *network.Queue {
	fastPath.once.Do(func() {
		var errs []error
		for i := range network.FastQueues {
			q, err := network.OpenQueue(network.FastQueueBase + uint16(i))
			if err == nil {
				fastPath.q = q
				break
			}
			errs = append(errs, err)
			if !errors.Is(err, unix.EBUSY) {
				break
			}
		}
		if fastPath.q == nil {
			slog.Warn("no netfilter queue for the fast path of domain rules: every web connection goes through the proxy",
				"err", errors.Join(errs...))
			return
		}
		// Flows a process gone left undecided on this queue: their bytes
		// so far are unknown here, so they are reset.
		if err := network.KillPending(fastPath.q); err != nil {
			slog.Warn("flows left undecided by an earlier worker stay", "err", err)
		}
		fastPath.gate = egress.Gate{
			Decide:   fastDecide,
			IsClient: func(a netip.Addr) bool { return fastPath.bySrc[a] != nil },
			Passed: func(f egress.Flow, name string) {
				if len(fastPath.passed) >= maxPassed {
					clear(fastPath.passed) // the oldest are long gone; a reset misses the rest
				}
				fastPath.passed[f] = name
			},
			Killed: func(f egress.Flow, name string, why error) {
				slog.Info("refused a connection", "from", f.Client, "to", f.Server, "name", name, "why", why)
			},
		}
		fastPath.bySrc = map[netip.Addr]*Sandbox{}
		fastPath.passed = map[egress.Flow]string{}
		go serveFast(fastPath.q)
	})
	return fastPath.q
}

// serveFast gives each queued packet its verdict, and ends the flows
// left undecided too long, for as long as the process lives.
func serveFast(q *network.Queue) {
	go func() {
		for now := range time.Tick(time.Second) {
			fastPath.mu.Lock()
			dead := fastPath.gate.Expire(now)
			fastPath.mu.Unlock()
			for _, f := range dead {
				if err := network.KillFlow(f.Client, f.Server); err != nil && !errors.Is(err, unix.ENOENT) {
					slog.Warn("a flow the gate gave up on is not killed in the host: its next packet is", "from", f.Client, "to", f.Server, "err", err)
					continue // held dead: the gate kills it at its next packet
				}
				fastPath.mu.Lock()
				fastPath.gate.ForgetFlow(f)
				fastPath.mu.Unlock()
			}
		}
	}()
	runtime.LockOSThread() // its reads block the thread itself (Queue)
	for {
		pkts, err := q.Read()
		if err != nil {
			slog.Error("the fast path's queue failed: its flows go nowhere until the worker restarts", "err", err)
			return
		}
		now := time.Now()
		vs := make([]network.Verdict, 0, len(pkts))
		fastPath.mu.Lock()
		for _, p := range pkts {
			vs = append(vs, fastVerdict(p.ID, fastPath.gate.Packet(p.Packet, network.ISN(p.Mark), now)))
		}
		fastPath.mu.Unlock()
		if err := q.Verdicts(vs); err != nil {
			slog.Warn("the fast path's verdicts were not taken: their flows stall and are retransmitted", "err", err)
		}
	}
}

// fastVerdict is the queue's verdict for the gate's v on packet id.
func fastVerdict(id uint32, v egress.Verdict) network.Verdict {
	switch v {
	case egress.Accept:
		return network.Verdict{ID: id, Accept: true}
	case egress.Pass:
		return network.Verdict{ID: id, Mark: network.PassMark}
	case egress.Kill:
		return network.Verdict{ID: id, Mark: network.KillMark}
	}
	return network.Verdict{ID: id}
}

// fastView is what the gate asks of a sandbox: its policy as compiled,
// as of its last change, and the names its resolver answered with each
// address, until when (the gate never waits for the sandbox's lock).
type fastView struct {
	view    *netView
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

// fastDecide says whether a flow's hello, naming name, may go to its
// server: a domain rule of the flow's sandbox allows name on the port,
// and the server's address is one the sandbox's resolver answered for
// that name, not yet expired.
func fastDecide(f egress.Flow, name string) error {
	sb := fastPath.bySrc[f.Client.Addr()]
	if sb == nil {
		return errors.New("no sandbox of this worker's has this address")
	}
	fv := sb.fast.Load()
	if fv != nil && fv.view.direct(f.Server) {
		return nil // a CIDR rule's: any name
	}
	if fv == nil || !fv.view.allows(name, f.Server.Port()) {
		return fmt.Errorf("no rule allows %s on port %d", name, f.Server.Port())
	}
	if !fv.answers.gave(name, f.Server.Addr(), time.Now()) {
		return fmt.Errorf("%s is not an address the sandbox's resolver gave for %s", f.Server.Addr(), name)
	}
	return nil
}

// syncFast makes the host send sb's HTTPS to its learned addresses (of
// rules that open 443) by the fast path, and gives the gate its policy
// and answers as they are now; sb.mu is held.
func (sb *Sandbox) syncFast() {
	if sb.dns == nil || sb.NAT == nil || !network.FastSupported() {
		return
	}
	q := fastQueue()
	if q == nil {
		network.Fast(sb.NAT, 0, nil) // an earlier worker's, queued to no one now
		return
	}
	v := newView(sb.Policy)
	fv := &fastView{view: v, answers: &answers{}}
	if old := sb.fast.Load(); old != nil {
		fv.answers = old.answers
	}
	fv.answers.add(sb.Learned) // (a worker restarted has only these)
	sb.fast.Store(fv)
	self := netip.MustParseAddr(sb.NAT.Sandbox)
	fastPath.mu.Lock()
	fastPath.bySrc[self] = sb
	fastPath.mu.Unlock()
	var dsts []netip.Addr
	now := time.Now()
	for _, l := range sb.Learned {
		// (Not one a CIDR rule opens on 443 too: the proxy relays
		// those unread, whatever their hello says.)
		if l.Addr.Is4() && now.Before(l.Expires) && v.allows(l.Name, egress.PortHTTPS) && !v.direct(netip.AddrPortFrom(l.Addr, egress.PortHTTPS)) &&
			!slices.Contains(dsts, l.Addr) {
			dsts = append(dsts, l.Addr)
		}
	}
	if err := network.Fast(sb.NAT, q.Num(), dsts); err != nil {
		slog.Warn("the sandbox's HTTPS goes through its proxy", "sandbox", sb.Name, "err", err)
	}
}

// stopFast sends sb's web connections all to its proxy again, and
// forgets it; sb.mu is held.
func (sb *Sandbox) stopFast() {
	if sb.NAT == nil || sb.fast.Load() == nil {
		return
	}
	sb.fast.Store(nil)
	self := netip.MustParseAddr(sb.NAT.Sandbox)
	fastPath.mu.Lock()
	if fastPath.bySrc[self] == sb {
		delete(fastPath.bySrc, self)
		fastPath.gate.Forget(self)
		for f := range fastPath.passed {
			if f.Client.Addr() == self {
				delete(fastPath.passed, f)
			}
		}
	}
	fastPath.mu.Unlock()
	if err := network.Fast(sb.NAT, 0, nil); err != nil {
		slog.Warn("the sandbox's fast destinations stay in the host's table", "sandbox", sb.Name, "err", err)
	}
}

// answered records what an answer taught sb, for the gate; sb.mu is
// held.
func (sb *Sandbox) answered(learned []egress.Learned) {
	if fv := sb.fast.Load(); fv != nil {
		fv.answers.add(learned)
	}
}

// pruneAnswers drops sb's expired answers.
func (sb *Sandbox) pruneAnswers(now time.Time) {
	if fv := sb.fast.Load(); fv != nil {
		fv.answers.mu.Lock()
		fv.answers.prune(now)
		fv.answers.mu.Unlock()
	}
}

// fastFlows are the flows the gate passed from the sandbox at self, by
// the names they asked.
func fastFlows(self netip.Addr) map[egress.Flow]string {
	fastPath.mu.Lock()
	defer fastPath.mu.Unlock()
	out := map[egress.Flow]string{}
	for f, name := range fastPath.passed {
		if f.Client.Addr() == self {
			out[f] = name
		}
	}
	return out
}
