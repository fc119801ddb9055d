package runtime

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"log/slog"
	"net"
	"net/netip"
	"os"
	"slices"
	"strconv"
	"sync/atomic"
	"time"

	"github.com/containerd/errdefs"
	"github.com/miekg/dns"
	"golang.org/x/sys/unix"

	"github.com/dsec-project/dsec/api"
	"github.com/dsec-project/dsec/internal/egress"
	"github.com/dsec-project/dsec/internal/policy"
	"github.com/dsec-project/dsec/internal/runtime/network"
)

// Domain rules. A sandbox in network mode nat whose policy has domain
// rules (to: a name, *.domain, **.domain) gets a resolver of its own in
// the worker, on its gateway's port 53: the host sends every DNS packet
// of the sandbox there, whatever server it names (network.Resolve). The
// resolver answers only names its rules allow (egress.Resolver) and,
// before each answer leaves, adds the answer's addresses to the
// sandbox's allowlist, on the rule's ports, until the answer's TTL (at
// least MinTTL) and a grace have passed. A connect to an address no
// answer gave, or given under another rule's ports, fails as before.
// Its web ports (TCP 80 and 443, to any address) go to its proxy on the
// gateway (egress.Proxy), which decides by the name the connection asks
// for and dials that name itself.

// dnsConfig is the worker's (SetDNS); nil: no resolvers (not a worker).
var dnsConfig atomic.Pointer[egress.Config]

// SetDNS makes this process serve sandboxes' DNS (a worker does, as it
// starts).
func SetDNS(c egress.Config) {
	c.MinTTL = cmpDuration(c.MinTTL, 30*time.Second)
	c.Grace = cmpDuration(c.Grace, 30*time.Second)
	dnsConfig.Store(&c)
}

func cmpDuration(d, def time.Duration) time.Duration {
	if d == 0 {
		return def
	}
	return d
}

// MaxLearned bounds a sandbox's learned addresses: past it, the ones
// soonest to expire go first.
const MaxLearned = 1024

// upstreams are c's servers as host:port, or the host's.
func upstreams(c *egress.Config) ([]string, error) {
	servers := c.Upstream
	if len(servers) == 0 {
		var err error
		if servers, err = hostResolvers("/etc/resolv.conf"); err != nil {
			return nil, err
		}
	}
	out := make([]string, 0, len(servers))
	for _, s := range servers {
		if a, err := netip.ParseAddr(s); err == nil {
			s = netip.AddrPortFrom(a, 53).String()
		}
		out = append(out, s)
	}
	if len(out) == 0 {
		return nil, errors.New("no upstream DNS server: /etc/resolv.conf names none; give dns.upstream")
	}
	return out, nil
}

// hostResolvers are the nameservers of a resolv.conf.
func hostResolvers(path string) ([]string, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("the host's DNS servers: %w", err)
	}
	var out []string
	for _, a := range egress.Nameservers(b) {
		out = append(out, a.String())
	}
	return out, nil
}

// resolver is a sandbox's resolver while it serves.
type resolver struct {
	proxy       *egress.Proxy
	stopServers func()
	listeners   []net.Listener // the proxy's
	closed      atomic.Bool
	done        chan struct{}
}

// hasDomains says whether eff has domain rules.
func hasDomains(eff *api.Policy) bool {
	return eff != nil && eff.Network != nil && len(policy.Domains(eff.Network.Egress)) > 0
}

// startDNS starts sb's resolver and proxy if eff (its policy, or the one
// about to be) needs them and this process is a worker; sb.mu is held.
func (sb *Sandbox) startDNS(eff *api.Policy) error {
	cfg := dnsConfig.Load()
	if sb.dns != nil || sb.NAT == nil || !hasDomains(eff) {
		return nil
	}
	if cfg == nil { // its DNS would go out unresolved: fail closed
		return fmt.Errorf("sandbox %s has domain rules, which only a worker serves (dsec daemon): %w", sb.Name, errdefs.ErrFailedPrecondition)
	}
	up, err := upstreams(cfg)
	if err != nil {
		return err
	}
	gw, self := sb.NAT.Host, netip.MustParseAddr(sb.NAT.Sandbox)
	pc, err := net.ListenPacket("udp4", net.JoinHostPort(gw, "53"))
	if err != nil {
		return fmt.Errorf("the sandbox's resolver: %w", err)
	}
	l, err := net.Listen("tcp4", net.JoinHostPort(gw, "53"))
	if err != nil {
		pc.Close()
		return fmt.Errorf("the sandbox's resolver: %w", err)
	}
	r := &resolver{done: make(chan struct{})}
	res := &egress.Resolver{Upstream: up, MinTTL: cfg.MinTTL, Grace: cfg.Grace, Closed: sb.closedTo}
	inner := res.Handler(func() []egress.Rule { return sb.view().domains }, func(l []egress.Learned) error { return sb.learn(r, l) })
	h := dns.HandlerFunc(func(w dns.ResponseWriter, q *dns.Msg) {
		// Only its own sandbox: another's queries never reach this
		// address (its allowlist and the host's table), and would learn
		// for the wrong one.
		if addrOf(w.RemoteAddr()) != self {
			return
		}
		inner.ServeDNS(w, q)
	})
	r.stopServers = egress.Serve(pc, l, h)
	r.proxy = &egress.Proxy{
		Direct: func(dst netip.AddrPort) bool { return sb.view().direct(dst) },
		Allow:  func(name string, port uint16) bool { return sb.view().allows(name, port) },
		Lookup: res.Lookup,
		Refused: func(dst netip.AddrPort, name string, why error) {
			slog.Info("refused a connection", "sandbox", sb.Name, "to", dst, "name", name, "why", why)
		}}
	for _, port := range []int{egress.PortHTTP, egress.PortHTTPS} {
		l, err := net.Listen("tcp4", net.JoinHostPort(gw, strconv.Itoa(port)))
		if err != nil {
			r.stop()
			return fmt.Errorf("the sandbox's proxy: %w", err)
		}
		r.listeners = append(r.listeners, l)
		go serveProxy(l, self, r.proxy)
	}
	if err := network.Resolve(sb.NAT, true); err != nil {
		r.stop()
		return err
	}
	go sb.expire(r)
	sb.dns = r
	sb.syncFast()
	return nil
}

// resolvConf gives sb, if its resolver serves, a /etc/resolv.conf its
// DNS can use when its own names no server it may send DNS to
// (egress.ResolvConf): a layer without one, or one naming
// systemd-resolved's 127.0.0.53, resolves nothing in a sandbox
// otherwise. Written like a file put through the API, so it is the
// sandbox's own from then on (pack-diff keeps it). Not for a paused
// sandbox (a frozen guest answers no file request); sb.mu is not held.
func (sb *Sandbox) resolvConf() {
	sb.mu.Lock()
	skip := sb.dns == nil || sb.Status != Running || sb.Paused || sb.g != nil && sb.g.Frozen()
	sb.mu.Unlock()
	if skip {
		return
	}
	if err := sb.writeResolvConf(); err != nil {
		slog.Warn("no /etc/resolv.conf written: the sandbox resolves names only through servers it names itself",
			"sandbox", sb.Name, "err", err)
	}
}

func (sb *Sandbox) writeResolvConf() error {
	s, err := sb.Files()
	if err != nil {
		return err
	}
	defer s.Close()
	var old []byte
	// Non-blocking and only a regular file: the sandbox's own fifo or
	// device there stalls nothing.
	if f, err := s.OpenFile("etc/resolv.conf", os.O_RDONLY|unix.O_NONBLOCK, 0); err == nil {
		if fi, err := f.Stat(); err == nil && fi.Mode().IsRegular() {
			old, _ = io.ReadAll(io.LimitReader(f, 64<<10))
		}
		f.Close()
	}
	conf, changed := egress.ResolvConf(old, sb.closedTo)
	if !changed {
		return nil
	}
	if err := s.Mkdir("etc", 0o755); err != nil && !errors.Is(err, fs.ErrExist) {
		return err
	}
	tmp := "etc/.dsec-resolv-" + RandomName("")
	f, err := s.OpenFile(tmp, os.O_WRONLY|os.O_CREATE|os.O_EXCL|unix.O_NOFOLLOW, 0o644)
	if err != nil {
		return err
	}
	_, err = f.Write(conf)
	if err == nil {
		err = f.Chmod(0o644)
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = s.Rename(tmp, "etc/resolv.conf") // a symlink there is replaced, not followed
	}
	if err != nil {
		s.Remove(tmp)
	}
	return err
}

// addrOf is a socket address's IP address, unmapped.
func addrOf(a net.Addr) netip.Addr {
	ap, _ := netip.ParseAddrPort(a.String())
	return ap.Addr().Unmap()
}

func (r *resolver) stop() {
	if r.closed.Swap(true) {
		return
	}
	close(r.done)
	r.stopServers()
	for _, l := range r.listeners {
		l.Close()
	}
}

// stopDNS stops sb's resolver and proxy, and sends its DNS and web
// ports where they were for again; sb.mu is held.
func (sb *Sandbox) stopDNS() error {
	if sb.dns == nil {
		return nil
	}
	sb.stopFast()
	sb.dns.stop()
	sb.dns = nil
	if sb.NAT == nil {
		return nil
	}
	return network.Resolve(sb.NAT, false)
}

// lock takes sb.mu for the resolver r, unless r is stopped meanwhile
// (its stop may wait, holding sb.mu, for the query that asks) or it
// takes too long.
func (sb *Sandbox) lockFor(r *resolver) bool {
	deadline := time.Now().Add(3 * time.Second)
	for !sb.mu.TryLock() {
		if r.closed.Load() || time.Now().After(deadline) {
			return false
		}
		time.Sleep(2 * time.Millisecond)
	}
	if r.closed.Load() {
		sb.mu.Unlock()
		return false
	}
	return true
}

// netView is what the resolver and proxy ask of a policy, compiled once
// per policy (they ask on every query and connection).
type netView struct {
	eff     *api.Policy
	err     error          // the host's addresses could not be read: all closed
	host    []netip.Addr   // the host's addresses
	static  []policy.Entry // its CIDR rules' allowlist
	domains []egress.Rule
}

func newView(eff *api.Policy) *netView {
	v := &netView{eff: eff, domains: policy.Domains(eff.Network.Egress)}
	if v.host, v.err = hostAddrs(api.NetworkNAT); v.err == nil {
		v.static, v.err = policy.Allowlist(eff.Network.Egress, v.host) // domain rules left out
	}
	return v
}

// direct says whether the CIDR rules allow dst over TCP itself.
// (Never the host's loopback: the proxy dials from the host.)
func (v *netView) direct(dst netip.AddrPort) bool {
	a := dst.Addr().Unmap()
	return v.err == nil && !a.IsLoopback() && !a.IsUnspecified() && policy.Allows(v.static, a, dst.Port(), policy.ProtoTCP)
}

// allows says whether a domain rule allows name on port over TCP.
func (v *netView) allows(name string, port uint16) bool {
	for _, d := range v.domains {
		r := v.eff.Network.Egress[d.Index]
		if !d.Pattern.Match(name) || r.Protocol == "udp" {
			continue
		}
		if len(r.Ports) == 0 || slices.ContainsFunc(r.Ports, func(p api.PortRange) bool { return p.Low <= port && port <= p.High }) {
			return true
		}
	}
	return false
}

// view is sb's policy now, compiled (a policy applied live changes it).
func (sb *Sandbox) view() *netView {
	sb.mu.Lock()
	eff := sb.Policy
	sb.mu.Unlock()
	if v := sb.netView.Load(); v != nil && v.eff == eff {
		return v
	}
	v := newView(eff)
	sb.netView.Store(v)
	return v
}

// closedTo says whether an answer's address is closed to sb (its deny
// set, the host's addresses, private ranges its rules do not open).
func (sb *Sandbox) closedTo(a netip.Addr) bool {
	v := sb.view()
	sb.mu.Lock()
	entries := sb.Allowlist
	sb.mu.Unlock()
	return v.err != nil || policy.Closed(entries, v.host)(a)
}

// learn adds what an answer taught to sb's allowlist before the answer
// leaves.
func (sb *Sandbox) learn(r *resolver, learned []egress.Learned) error {
	if !sb.lockFor(r) {
		return errors.New("the sandbox is busy")
	}
	defer sb.mu.Unlock()
	sb.answered(learned)
	changed := false
	for _, l := range learned {
		i := slices.IndexFunc(sb.Learned, func(o egress.Learned) bool { return o.Addr == l.Addr && o.Rule == l.Rule })
		switch {
		case i < 0:
			sb.Learned = append(sb.Learned, l)
			changed = true
		case l.Expires.After(sb.Learned[i].Expires):
			sb.Learned[i].Expires = l.Expires // no new address: no new list
		}
	}
	if !changed {
		return nil
	}
	if len(sb.Learned) > MaxLearned {
		slices.SortFunc(sb.Learned, func(a, b egress.Learned) int { return b.Expires.Compare(a.Expires) })
		sb.Learned = sb.Learned[:MaxLearned]
	}
	return sb.relearn()
}

// relearn applies sb's policy and learned addresses as its allowlist;
// sb.mu is held.
func (sb *Sandbox) relearn() error {
	entries, err := allowlist(sb.Policy, sb.Learned)
	if err != nil {
		return err
	}
	if sb.g != nil {
		if err := policy.ApplyNetwork(sb.g.Path(), sb.Allowlist, entries); err != nil {
			return err
		}
	}
	sb.Allowlist = entries
	sb.syncFast()
	return sb.save()
}

// expire drops sb's learned addresses as they expire, until r stops.
func (sb *Sandbox) expire(r *resolver) {
	tick := time.NewTicker(time.Second)
	defer tick.Stop()
	for {
		select {
		case <-r.done:
			return
		case <-tick.C:
		}
		if !sb.lockFor(r) {
			continue
		}
		now := time.Now()
		sb.pruneAnswers(now)
		n := len(sb.Learned)
		sb.Learned = slices.DeleteFunc(sb.Learned, func(l egress.Learned) bool { return now.After(l.Expires) })
		if len(sb.Learned) != n {
			if err := sb.relearn(); err != nil {
				slog.Warn("the sandbox's expired addresses stay allowed", "sandbox", sb.Name, "err", err)
			}
		}
		sb.mu.Unlock()
	}
}

// relearned are learned as the policy eff has them: each under the
// first of its domain rules that still allows its name (nil: none
// does).
func relearned(eff *api.Policy, learned []egress.Learned) []egress.Learned {
	rules := policy.Domains(eff.Network.Egress)
	var out []egress.Learned
	for _, l := range learned {
		for _, r := range rules {
			if r.Pattern.Match(l.Name) {
				l.Rule = r.Index
				out = append(out, l)
				break
			}
		}
	}
	return out
}

// serveProxy hands the proxy each connection the sandbox at self makes
// to a web port (the host redirected it here), with its original
// destination.
func serveProxy(l net.Listener, self netip.Addr, p *egress.Proxy) {
	for {
		c, err := l.Accept()
		if err != nil {
			if errors.Is(err, net.ErrClosed) {
				return
			}
			continue
		}
		dst, err := originalDst(c)
		if err != nil || addrOf(c.RemoteAddr()) != self {
			c.Close()
			continue
		}
		go p.Handle(c, dst)
	}
}

// originalDst is where a redirected connection was for (conntrack's
// SO_ORIGINAL_DST).
func originalDst(c net.Conn) (netip.AddrPort, error) {
	tc, ok := c.(*net.TCPConn)
	if !ok {
		return netip.AddrPort{}, errors.New("not a TCP connection")
	}
	raw, err := tc.SyscallConn()
	if err != nil {
		return netip.AddrPort{}, err
	}
	var dst netip.AddrPort
	cerr := raw.Control(func(fd uintptr) {
		// struct sockaddr_in, in an ipv6_mreq's 20 bytes.
		var m *unix.IPv6Mreq
		if m, err = unix.GetsockoptIPv6Mreq(int(fd), unix.SOL_IP, unix.SO_ORIGINAL_DST); err == nil {
			a := m.Multiaddr
			dst = netip.AddrPortFrom(netip.AddrFrom4([4]byte(a[4:8])), binary.BigEndian.Uint16(a[2:4]))
		}
	})
	return dst, errors.Join(cerr, err)
}
