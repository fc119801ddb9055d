package network

import (
	"cmp"
	"encoding/binary"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/netip"
	"os"
	"slices"
	"strconv"
	"sync/atomic"
	"time"

	"github.com/miekg/dns"
	"golang.org/x/sys/unix"

	"github.com/dsec-project/dsec/api"
	"github.com/dsec-project/dsec/internal/egress"
	"github.com/dsec-project/dsec/internal/policy"
)

// Domain rules. A sandbox in network mode nat whose policy has domain
// rules (to: a name, *.domain, **.domain) gets a resolver of its own in
// the worker, on its gateway's port 53: the host sends every DNS packet
// of the sandbox there, whatever server it names (Resolve). The
// resolver answers only names its rules allow (egress.Resolver) and,
// before each answer leaves, adds the answer's addresses to the
// sandbox's allowlist, on the rule's ports, until the answer's TTL (at
// least MinTTL) and a grace have passed. A connect to an address no
// answer gave, or given under another rule's ports, fails as before.
// Its web ports (TCP 80 and 443, to any address) go to its proxy on the
// gateway (egress.Proxy), which decides by the name the connection asks
// for and dials that name itself; its HTTPS to an address an answer gave
// may go on in the kernel instead, past the gate (gate_linux.go).
//
// Egress is that service, one per worker: a sandbox holds a Link to it
// while its resolver serves, as a program holds a link to a hook.

// Egress is a worker's egress service: the configuration of its
// sandboxes' resolvers, and the fast path's gate (one netfilter queue
// for all of them, bound on first use).
type Egress struct {
	cfg  egress.Config
	gate gate
}

// NewEgress is the egress service of a worker whose resolvers follow c
// (its zero MinTTL and Grace: 30 s each).
func NewEgress(c egress.Config) *Egress {
	c.MinTTL = cmp.Or(c.MinTTL, 30*time.Second)
	c.Grace = cmp.Or(c.Grace, 30*time.Second)
	return &Egress{cfg: c}
}

// Close lets go of the fast path's netfilter queue, if the service
// bound one (the sandboxes' links are closed first, or their fast flows
// under way go nowhere until another worker binds the queue).
func (e *Egress) Close() error { return e.gate.close() }

// MaxLearned bounds a sandbox's learned addresses: past it, the ones
// soonest to expire go first.
const MaxLearned = 1024

// Client is what the service asks of a sandbox it serves.
type Client interface {
	// View is the sandbox's policy now, compiled.
	View() *View
	// Learn adds what an answer of l's resolver taught to the
	// sandbox's allowlist, before the answer leaves; an error holds the
	// answer back.
	Learn(l *Link, learned []egress.Learned) error
	// ClosedTo says whether an answer's address is closed to the
	// sandbox (its deny set, the host's addresses, private ranges its
	// rules do not open).
	ClosedTo(a netip.Addr) bool
}

// Link is a sandbox's hold on the egress service: its resolver on its
// gateway's port 53, its proxy on the web ports, and its place in the
// fast path's gate. Close lets go of all of them.
type Link struct {
	e           *Egress
	name        string
	nat         *NAT
	self        netip.Addr
	proxy       *egress.Proxy
	stopServers func()
	listeners   []net.Listener // the proxy's
	closed      atomic.Bool
	done        chan struct{}
	// fast is what the gate asks of the sandbox while it has a fast
	// path (Sync).
	fast atomic.Pointer[fastView]
}

// Open starts the resolver and proxy of the sandbox named name, at nat,
// for c, and sends its DNS to them.
func (e *Egress) Open(name string, nat *NAT, c Client) (*Link, error) {
	up, err := upstreams(&e.cfg)
	if err != nil {
		return nil, err
	}
	gw, self := nat.Host, netip.MustParseAddr(nat.Sandbox)
	pc, err := net.ListenPacket("udp4", net.JoinHostPort(gw, "53"))
	if err != nil {
		return nil, fmt.Errorf("the sandbox's resolver: %w", err)
	}
	l, err := net.Listen("tcp4", net.JoinHostPort(gw, "53"))
	if err != nil {
		pc.Close()
		return nil, fmt.Errorf("the sandbox's resolver: %w", err)
	}
	k := &Link{e: e, name: name, nat: nat, self: self, done: make(chan struct{})}
	res := &egress.Resolver{Upstream: up, MinTTL: e.cfg.MinTTL, Grace: e.cfg.Grace, Closed: c.ClosedTo}
	inner := res.Handler(func() []egress.Rule { return c.View().domains }, func(l []egress.Learned) error { return c.Learn(k, l) })
	h := dns.HandlerFunc(func(w dns.ResponseWriter, q *dns.Msg) {
		// Only its own sandbox: another's queries never reach this
		// address (its allowlist and the host's table), and would learn
		// for the wrong one.
		if addrOf(w.RemoteAddr()) != self {
			return
		}
		inner.ServeDNS(w, q)
	})
	k.stopServers = egress.Serve(pc, l, h)
	k.proxy = &egress.Proxy{
		Direct: func(dst netip.AddrPort) bool { return c.View().Direct(dst) },
		Allow:  func(name string, port uint16) bool { return c.View().Allows(name, port) },
		Lookup: res.Lookup,
		Refused: func(dst netip.AddrPort, host string, why error) {
			slog.Info("refused a connection", "sandbox", name, "to", dst, "name", host, "why", why)
		},
		// Or the sandbox's next connection from that port would go to
		// the proxy again by the flow's entry, whatever the fast path
		// says of it now.
		Reset: func(c net.Conn, dst netip.AddrPort) {
			ap, _ := netip.ParseAddrPort(c.RemoteAddr().String())
			client := netip.AddrPortFrom(ap.Addr().Unmap(), ap.Port())
			if err := ForgetFlow(client, dst); err != nil && !errors.Is(err, unix.ENOENT) {
				slog.Debug("a connection the proxy reset stays in the host's flows", "sandbox", name, "from", client, "to", dst, "err", err)
			}
		}}
	for _, port := range []int{egress.PortHTTP, egress.PortHTTPS} {
		l, err := net.Listen("tcp4", net.JoinHostPort(gw, strconv.Itoa(port)))
		if err != nil {
			k.stop()
			return nil, fmt.Errorf("the sandbox's proxy: %w", err)
		}
		k.listeners = append(k.listeners, l)
		go serveProxy(l, self, k.proxy)
	}
	if err := Resolve(nat, true); err != nil {
		k.stop()
		return nil, err
	}
	return k, nil
}

// Done is closed once l is closed.
func (l *Link) Done() <-chan struct{} { return l.done }

// Closed says whether l is closed (or being closed).
func (l *Link) Closed() bool { return l.closed.Load() }

// Cut resets the connections l's proxy relays that keep no longer
// allows (by the name asked, "" for one relayed by address), and says
// how many.
func (l *Link) Cut(keep func(name string, dst netip.AddrPort) bool) int { return l.proxy.Cut(keep) }

// Close stops l's resolver and proxy, takes the sandbox out of the
// gate, and sends its DNS and web ports where they were for again.
func (l *Link) Close() error {
	l.stopFast()
	l.stop()
	return Resolve(l.nat, false)
}

func (l *Link) stop() {
	if l.closed.Swap(true) {
		return
	}
	close(l.done)
	l.stopServers()
	for _, ln := range l.listeners {
		ln.Close()
	}
}

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

// addrOf is a socket address's IP address, unmapped.
func addrOf(a net.Addr) netip.Addr {
	ap, _ := netip.ParseAddrPort(a.String())
	return ap.Addr().Unmap()
}

// View is what the resolver, the proxy and the gate ask of a policy,
// compiled once per policy (they ask on every query and connection).
type View struct {
	eff     *api.Policy
	err     error          // the host's addresses could not be read: all closed
	host    []netip.Addr   // the host's addresses
	static  []policy.Entry // its CIDR rules' allowlist
	domains []egress.Rule
}

// NewView compiles eff, a policy of network mode nat.
func NewView(eff *api.Policy) *View {
	v := &View{eff: eff, domains: policy.Domains(eff.Network.Egress)}
	if v.host, v.err = HostAddrs(api.NetworkNAT); v.err == nil {
		v.static, v.err = policy.Allowlist(eff.Network.Egress, v.host) // domain rules left out
	}
	return v
}

// Policy is the policy v compiles.
func (v *View) Policy() *api.Policy { return v.eff }

// Host are the host's addresses, and why they are unknown (then every
// address is closed).
func (v *View) Host() ([]netip.Addr, error) { return v.host, v.err }

// Direct says whether the CIDR rules allow dst over TCP itself.
// (Never the host's loopback: the proxy dials from the host.)
func (v *View) Direct(dst netip.AddrPort) bool {
	a := dst.Addr().Unmap()
	return v.err == nil && !a.IsLoopback() && !a.IsUnspecified() && policy.Allows(v.static, a, dst.Port(), policy.ProtoTCP)
}

// Allows says whether a domain rule allows name on port over TCP.
func (v *View) Allows(name string, port uint16) bool {
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

// HostAddrs are the host's addresses a sandbox in network mode mode may
// not reach (loopback's: none).
func HostAddrs(mode string) ([]netip.Addr, error) {
	if mode != api.NetworkNAT {
		return nil, nil
	}
	addrs, err := net.InterfaceAddrs()
	if err != nil {
		return nil, fmt.Errorf("the host's addresses: %w", err)
	}
	var host []netip.Addr
	for _, a := range addrs {
		if n, ok := a.(*net.IPNet); ok {
			if ip, ok := netip.AddrFromSlice(n.IP); ok && !ip.IsLoopback() {
				host = append(host, ip.Unmap())
			}
		}
	}
	return host, nil
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
