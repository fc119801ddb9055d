package egress

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"sync"
	"time"

	"github.com/miekg/dns"
)

// A sandbox's web ports (TCP 80 and 443) go through a Proxy: the host
// redirects every such connection to it, whatever address it was for.
// A connection to an address a CIDR rule allows goes on there unread.
// Any other is read until its TLS ClientHello's server name (443) or
// its HTTP request's host (80) is in, refused unless a domain rule
// allows that name on that port (a hello without a name, or with
// encrypted_client_hello, is refused), and then dialled by name: the
// Proxy resolves the name itself (its Lookup, the trusted upstream) and
// connects there, never to the address the sandbox chose, so a spoofed
// name towards another address, or another name on a shared address,
// reaches nothing else. It does not terminate TLS: what the hello said
// is all it knows (a server that routes by the inner Host header can be
// fronted).

// Web ports: what the Proxy reads the name of.
const (
	PortHTTP  = 80
	PortHTTPS = 443
)

// Proxy relays a sandbox's web connections by name (see above).
type Proxy struct {
	// Direct says whether the sandbox's CIDR rules allow dst itself:
	// relayed there unread.
	Direct func(dst netip.AddrPort) bool
	// Allow says whether a domain rule allows name (ASCII form) on port.
	Allow func(name string, port uint16) bool
	// Lookup resolves an allowed name to the addresses it may be
	// dialled at (the trusted upstream's answer, closed ranges left
	// out): Resolver.Lookup.
	Lookup func(ctx context.Context, name string) ([]netip.Addr, error)
	// Timeout bounds the wait for the name (default 10 s) and each
	// dial (the same).
	Timeout time.Duration
	// Refused, if set, is told of each connection refused, and why.
	Refused func(dst netip.AddrPort, name string, why error)
	// Reset, if set, is told of each connection of the sandbox's it
	// reset (refused, or cut), once the reset is sent: the host may
	// forget the flow, so that a new connection from the same port is
	// decided afresh rather than taken for the one reset.
	Reset func(c net.Conn, dst netip.AddrPort)

	mu   sync.Mutex
	live map[net.Conn]flow // the connections it relays, by the sandbox's end
}

// flow is a relayed connection: what it was let through for.
type flow struct {
	name string // "": a CIDR rule's destination, relayed unread
	dst  netip.AddrPort
	up   net.Conn
}

// Cut ends the relayed connections still no longer allows (name is ""
// for one relayed unread to dst), and returns how many.
func (p *Proxy) Cut(still func(name string, dst netip.AddrPort) bool) int {
	p.mu.Lock()
	var gone []net.Conn
	var dsts []netip.AddrPort
	for c, f := range p.live {
		if !still(f.name, f.dst) {
			gone = append(gone, c, f.up)
			dsts = append(dsts, f.dst)
			delete(p.live, c)
		}
	}
	p.mu.Unlock()
	for i, c := range gone {
		if tc, ok := c.(*net.TCPConn); ok {
			tc.SetLinger(0) // a reset, as a refusal
		}
		c.Close()
		if i%2 == 0 && p.Reset != nil { // the sandbox's end
			p.Reset(c, dsts[i/2])
		}
	}
	return len(gone) / 2
}

// relay relays c and up as a flow for name and dst until both are done.
func (p *Proxy) relay(c, up net.Conn, name string, dst netip.AddrPort) {
	p.mu.Lock()
	if p.live == nil {
		p.live = map[net.Conn]flow{}
	}
	p.live[c] = flow{name: name, dst: dst, up: up}
	p.mu.Unlock()
	relay(c, up)
	p.mu.Lock()
	delete(p.live, c)
	p.mu.Unlock()
}

// MaxFirst bounds what the Proxy reads for a name: a hello or a
// request head larger than this is refused.
const MaxFirst = 64 << 10

// Handle serves one connection the sandbox made to dst (its original
// destination), and closes it.
func (p *Proxy) Handle(c net.Conn, dst netip.AddrPort) {
	defer c.Close()
	timeout := p.Timeout
	if timeout == 0 {
		timeout = 10 * time.Second
	}
	if p.Direct != nil && p.Direct(dst) {
		up, err := net.DialTimeout("tcp", dst.String(), timeout)
		if err != nil {
			p.refuse(c, dst, "", err)
			return
		}
		p.relay(c, up, "", dst)
		return
	}
	name, first, err := readName(c, dst.Port(), timeout)
	if err != nil {
		p.refuse(c, dst, name, err)
		return
	}
	if !p.Allow(name, dst.Port()) {
		p.refuse(c, dst, name, fmt.Errorf("no rule allows %s on port %d", name, dst.Port()))
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	addrs, err := p.Lookup(ctx, name)
	if err == nil && len(addrs) == 0 {
		err = fmt.Errorf("%s has no address the sandbox may reach", name)
	}
	if err != nil {
		p.refuse(c, dst, name, err)
		return
	}
	var up net.Conn
	var errs []error
	for _, a := range addrs {
		d := net.Dialer{Timeout: timeout}
		if up, err = d.DialContext(ctx, "tcp", netip.AddrPortFrom(a, dst.Port()).String()); err == nil {
			break
		}
		errs = append(errs, err)
	}
	if up == nil {
		p.refuse(c, dst, name, errors.Join(errs...))
		return
	}
	if _, err := up.Write(first); err != nil {
		up.Close()
		p.refuse(c, dst, name, err)
		return
	}
	p.relay(c, up, name, dst)
}

// readName reads from c until the name it asks for is in: a TLS
// hello's server name on 443, an HTTP request's host on 80. It returns
// the bytes read, to be sent on.
func readName(c net.Conn, port uint16, timeout time.Duration) (string, []byte, error) {
	c.SetReadDeadline(time.Now().Add(timeout))
	defer c.SetReadDeadline(time.Time{})
	var b []byte
	var hr HelloReader
	buf := make([]byte, 4096)
	for {
		n, rerr := c.Read(buf)
		b = append(b, buf[:n]...)
		var name string
		var err error
		switch port {
		case PortHTTPS:
			var h Hello
			h, err = hr.Parse(b)
			switch {
			case err != nil:
			case h.ECH:
				return h.ServerName, nil, errors.New("an encrypted ClientHello (ECH): its server name is hidden")
			case h.ServerName == "":
				return "", nil, errors.New("a ClientHello without a server name")
			}
			name = h.ServerName
		case PortHTTP:
			var r Request
			r, err = ParseRequest(b)
			name = r.Host
		default:
			return "", nil, fmt.Errorf("port %d is not a web port", port)
		}
		if err == nil {
			n, nerr := Normalize(name)
			if nerr != nil {
				return name, nil, nerr
			}
			return n, b, nil
		}
		if !errors.Is(err, ErrShort) {
			return "", nil, err
		}
		if len(b) >= MaxFirst {
			return "", nil, fmt.Errorf("no name in the first %d bytes", MaxFirst)
		}
		if rerr != nil {
			return "", nil, fmt.Errorf("the connection ended before its name: %w", rerr)
		}
	}
}

// refuse resets c: the client sees its connection fail, never a
// server's answer.
func (p *Proxy) refuse(c net.Conn, dst netip.AddrPort, name string, why error) {
	if tc, ok := c.(*net.TCPConn); ok {
		tc.SetLinger(0)
	}
	c.Close()
	if p.Refused != nil {
		p.Refused(dst, name, why)
	}
	if p.Reset != nil {
		p.Reset(c, dst)
	}
}

// relay copies both ways until both ends are done, passing a half
// close on.
func relay(a, b net.Conn) {
	defer b.Close()
	var wg sync.WaitGroup
	wg.Add(2)
	half := func(dst, src net.Conn) {
		defer wg.Done()
		io.Copy(dst, src)
		if tc, ok := dst.(interface{ CloseWrite() error }); ok {
			tc.CloseWrite()
		} else {
			dst.Close()
		}
	}
	go half(a, b)
	go half(b, a)
	wg.Wait()
}

// Lookup resolves name (ASCII form) through the upstream: its A
// records, the closed ranges left out (IPv4 only: sandboxes reach out
// over IPv4); an answer is reused until its TTL.
func (r *Resolver) Lookup(ctx context.Context, name string) ([]netip.Addr, error) {
	up, err := r.query(ctx, name, dns.TypeA)
	if err != nil {
		return nil, err
	}
	if up.Rcode != dns.RcodeSuccess {
		return nil, fmt.Errorf("%s: %s", name, dns.RcodeToString[up.Rcode])
	}
	_, learned := r.keep(up.Answer, name, Rule{})
	out := make([]netip.Addr, 0, len(learned))
	for _, l := range learned {
		if l.Addr.Is4() {
			out = append(out, l.Addr)
		}
	}
	return out, nil
}
