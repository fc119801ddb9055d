package runtime

import (
	"errors"
	"fmt"
	"net"
	"net/netip"
	"slices"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"

	"github.com/dsec-project/dsec/internal/egress"
	"github.com/dsec-project/dsec/internal/policy"
)

// ResetConnections ends the sandbox's connections that its allowlist in
// force no longer allows (policy apply --reset), and says how many: the
// ones its proxy relays by a name no rule allows any more (or to an
// address no CIDR rule does), reset; the ones its fast path passed for
// such a name (or to an address no longer its answer), as its own; a
// container's own TCP sockets to an address and port the allowlist no
// longer lets it connect to, destroyed (SOCK_DESTROY: the process sees ECONNABORTED and its peer a
// reset); and, for a microVM, whose sockets are the guest's, the host's
// connection tracking of its flows so closed, whose packets the host
// then drops (the guest's connection stalls until it times out).
func (sb *Sandbox) ResetConnections() (int, error) {
	sb.mu.Lock()
	defer sb.mu.Unlock()
	if sb.Status != Running || sb.NAT == nil || sb.Paused {
		return 0, nil
	}
	n := 0
	v := newView(sb.Policy)
	if sb.dns != nil {
		n += sb.dns.proxy.Cut(func(name string, dst netip.AddrPort) bool {
			if name == "" {
				return v.direct(dst)
			}
			return v.allows(name, dst.Port())
		})
	}
	gw := netip.MustParseAddr(sb.NAT.Host)
	fast := fastFlows(netip.MustParseAddr(sb.NAT.Sandbox))
	closed := func(src, dst netip.AddrPort, proto uint8) bool {
		src, dst = netip.AddrPortFrom(src.Addr().Unmap(), src.Port()), netip.AddrPortFrom(dst.Addr().Unmap(), dst.Port())
		if name, ok := fast[egress.Flow{Client: src, Server: dst}]; ok && proto == policy.ProtoTCP {
			// Passed by the gate for name: closed unless a rule
			// allows it still and the address is still its answer.
			return !v.allows(name, dst.Port()) || !slices.ContainsFunc(sb.Learned, func(l egress.Learned) bool {
				return l.Name == name && l.Addr == dst.Addr()
			})
		}
		a := dst.Addr()
		return !a.IsLoopback() && a != gw && !policy.Allows(sb.Allowlist, a, dst.Port(), proto)
	}
	var err error
	var k int
	if sb.Backend == "" || sb.Backend == "container" {
		k, err = destroySockets(sb.Pid, closed)
	} else {
		k, err = forgetFlows(netip.MustParseAddr(sb.NAT.Sandbox), closed)
	}
	return n + k, err
}

// destroySockets destroys the established TCP sockets over IPv4 in the
// network namespace of pid whose destination closed says is closed.
func destroySockets(pid int, closed func(src, dst netip.AddrPort, proto uint8) bool) (int, error) {
	ns, err := netns.GetFromPid(pid)
	if err != nil {
		return 0, fmt.Errorf("the sandbox's network namespace: %w", err)
	}
	defer ns.Close()
	h, err := netlink.NewHandleAt(ns, unix.NETLINK_INET_DIAG)
	if err != nil {
		return 0, err
	}
	defer h.Close()
	socks, err := h.SocketDiagTCP(unix.AF_INET)
	if err != nil {
		return 0, fmt.Errorf("the sandbox's sockets: %w", err)
	}
	n := 0
	var errs []error
	for _, s := range socks {
		src, sok := netip.AddrFromSlice(s.ID.Source)
		dst, ok := netip.AddrFromSlice(s.ID.Destination)
		if !ok || !sok || s.State != unix.BPF_TCP_ESTABLISHED ||
			!closed(netip.AddrPortFrom(src, s.ID.SourcePort), netip.AddrPortFrom(dst, s.ID.DestinationPort), policy.ProtoTCP) {
			continue
		}
		local := &net.TCPAddr{IP: s.ID.Source, Port: int(s.ID.SourcePort)}
		remote := &net.TCPAddr{IP: s.ID.Destination, Port: int(s.ID.DestinationPort)}
		if err := h.SocketDestroy(local, remote); err != nil {
			errs = append(errs, fmt.Errorf("destroy the socket to %s: %w", remote, err))
			continue
		}
		n++
	}
	return n, errors.Join(errs...)
}

// flows matches the conntrack flows from a sandbox's address to a
// closed destination.
type flows struct {
	from   netip.Addr
	closed func(src, dst netip.AddrPort, proto uint8) bool
}

func (f flows) MatchConntrackFlow(fl *netlink.ConntrackFlow) bool {
	src, ok := netip.AddrFromSlice(fl.Forward.SrcIP)
	if !ok || src.Unmap() != f.from {
		return false
	}
	dst, ok := netip.AddrFromSlice(fl.Forward.DstIP)
	proto := map[uint8]uint8{unix.IPPROTO_TCP: policy.ProtoTCP, unix.IPPROTO_UDP: policy.ProtoUDP}[fl.Forward.Protocol]
	return ok && proto != 0 && f.closed(netip.AddrPortFrom(src, fl.Forward.SrcPort), netip.AddrPortFrom(dst, fl.Forward.DstPort), proto)
}

// forgetFlows deletes the host's conntrack entries of the flows from
// the address from to a closed destination.
func forgetFlows(from netip.Addr, closed func(src, dst netip.AddrPort, proto uint8) bool) (int, error) {
	n, err := netlink.ConntrackDeleteFilters(netlink.ConntrackTable, unix.AF_INET, flows{from: from, closed: closed})
	if err != nil {
		return int(n), fmt.Errorf("the sandbox's connection tracking: %w", err)
	}
	return int(n), nil
}
