package network

import (
	"errors"
	"fmt"
	"net"
	"net/netip"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"

	"github.com/dsec-project/dsec/internal/policy"
)

// Resets: what a sandbox's allowlist no longer allows is ended in the
// host (policy apply --reset), a container's own sockets destroyed, a
// microVM's flows forgotten by connection tracking.

// DestroySockets destroys the established TCP sockets over IPv4 in the
// network namespace of pid whose destination closed says is closed.
func DestroySockets(pid int, closed func(src, dst netip.AddrPort, proto uint8) bool) (int, error) {
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

// ForgetFlows deletes the host's conntrack entries of the flows from
// the address from to a closed destination.
func ForgetFlows(from netip.Addr, closed func(src, dst netip.AddrPort, proto uint8) bool) (int, error) {
	n, err := netlink.ConntrackDeleteFilters(netlink.ConntrackTable, unix.AF_INET, flows{from: from, closed: closed})
	if err != nil {
		return int(n), fmt.Errorf("the sandbox's connection tracking: %w", err)
	}
	return int(n), nil
}
