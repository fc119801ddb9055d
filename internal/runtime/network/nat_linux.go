// Package network connects sandboxes to the host in network mode nat: a
// veth pair per sandbox, a /30 of the NAT pool each, and one masquerade
// rule for them all.
package network

import (
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"slices"

	"github.com/containerd/errdefs"
	"github.com/google/nftables"
	"github.com/google/nftables/expr"
	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"

	"github.com/dsec-project/dsec/internal/policy"
	"github.com/dsec-project/dsec/internal/runtime/hostslot"
)

// NAT is a sandbox's way out in network mode nat: a veth pair, eth0 in
// the sandbox with Sandbox/30 and a default route through Host, the host
// side masquerading what leaves. The egress allowlist still decides what
// a process may reach.
type NAT struct {
	Index   int    `json:"index"`   // the /30 of the pool
	Link    string `json:"link"`    // the host side's interface
	Host    string `json:"host"`    // the gateway, on the host side
	Sandbox string `json:"sandbox"` // eth0's address
}

// natPool holds every nat sandbox's /30; natSlots (host-wide, like the
// interfaces, and gone with them at boot) records who holds which.
var (
	natPool  = policy.NATPool
	natSlots = hostslot.Table{Dir: "/run/dsec/nat", N: 1 << (32 - natPool.Bits() - 2)}
)

const natTable = "dsec"

// Up connects the sandbox whose init is pid to the host: it takes a
// /30 of the pool for owner (the sandbox's root and name), makes the
// veth pair and installs the masquerade rule if it is not there yet.
func Up(owner string, pid int) (_ *NAT, err error) {
	// The lock also covers the masquerade table, which the last one out
	// removes.
	unlock, err := natSlots.Lock()
	if err != nil {
		return nil, err
	}
	defer unlock()
	idx, err := natSlots.Take(owner)
	if err != nil {
		return nil, err
	}
	if idx < 0 {
		return nil, fmt.Errorf("network mode nat: all %d addresses of %s are taken: %w", natSlots.N, natPool, errdefs.ErrResourceExhausted)
	}
	base := natPool.Addr().As4()
	off := uint32(idx) * 4
	base[2], base[3] = byte(off>>8), byte(off)
	host := netip.AddrFrom4(base).Next()
	n := &NAT{Index: idx, Link: fmt.Sprintf("dsec%04x", idx), Host: host.String(), Sandbox: host.Next().String()}
	defer func() {
		if err != nil {
			natRelease(n)
		}
	}()
	peer := fmt.Sprintf("dsecp%04x", idx)
	if l, err := netlink.LinkByName(n.Link); err == nil { // left by a killed worker
		netlink.LinkDel(l)
	}
	veth := &netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: n.Link}, PeerName: peer}
	if err := netlink.LinkAdd(veth); err != nil {
		return nil, fmt.Errorf("network mode nat: make the veth pair: %w", err)
	}
	hl, err := netlink.LinkByName(n.Link)
	if err != nil {
		return nil, err
	}
	if err := netlink.AddrAdd(hl, &netlink.Addr{IPNet: ipNet(host, 30)}); err != nil {
		return nil, fmt.Errorf("network mode nat: host address: %w", err)
	}
	// No IPv6 on the host's side: the sandbox's link-local address
	// reaches nothing of the host's over the pair.
	if err := os.WriteFile("/proc/sys/net/ipv6/conf/"+n.Link+"/disable_ipv6", []byte("1"), 0o644); err != nil && !errors.Is(err, os.ErrNotExist) {
		return nil, fmt.Errorf("network mode nat: disable IPv6 on %s: %w", n.Link, err)
	}
	if err := netlink.LinkSetUp(hl); err != nil {
		return nil, err
	}
	pl, err := netlink.LinkByName(peer)
	if err != nil {
		return nil, err
	}
	if err := netlink.LinkSetNsPid(pl, pid); err != nil {
		return nil, fmt.Errorf("network mode nat: move the veth into the sandbox: %w", err)
	}
	ns, err := netns.GetFromPid(pid)
	if err != nil {
		return nil, err
	}
	defer ns.Close()
	h, err := netlink.NewHandleAt(ns)
	if err != nil {
		return nil, err
	}
	defer h.Close()
	sl, err := h.LinkByName(peer)
	if err != nil {
		return nil, err
	}
	if err := h.LinkSetName(sl, "eth0"); err != nil {
		return nil, err
	}
	if err := h.AddrAdd(sl, &netlink.Addr{IPNet: ipNet(host.Next(), 30)}); err != nil {
		return nil, fmt.Errorf("network mode nat: sandbox address: %w", err)
	}
	if err := h.LinkSetUp(sl); err != nil {
		return nil, err
	}
	if err := h.RouteAdd(&netlink.Route{LinkIndex: sl.Attrs().Index, Gw: net.IP(host.AsSlice())}); err != nil {
		return nil, fmt.Errorf("network mode nat: default route: %w", err)
	}
	if err := os.WriteFile("/proc/sys/net/ipv4/ip_forward", []byte("1"), 0o644); err != nil {
		return nil, fmt.Errorf("network mode nat: enable forwarding: %w", err)
	}
	if err := masquerade(true); err != nil {
		return nil, err
	}
	return n, nil
}

func ipNet(a netip.Addr, bits int) *net.IPNet {
	return &net.IPNet{IP: net.IP(a.AsSlice()), Mask: net.CIDRMask(bits, 32)}
}

// Down gives back every /30 owner holds (a worker killed before it
// saved one leaves it recorded only here), taking its pair away if the
// sandbox's net namespace did not take it already; the last one out
// removes the masquerade rule.
func Down(owner string) error {
	return natSlots.GiveBack(owner, func(idx int) error {
		return natRelease(&NAT{Index: idx, Link: fmt.Sprintf("dsec%04x", idx)})
	})
}

func natRelease(n *NAT) error {
	var errs []error
	if l, err := netlink.LinkByName(n.Link); err == nil {
		// ENODEV: the pair went with the sandbox's network namespace
		// meanwhile (the kernel frees it after the init's death).
		if err := netlink.LinkDel(l); err != nil && !errors.Is(err, unix.ENODEV) {
			errs = append(errs, fmt.Errorf("remove %s: %w", n.Link, err))
		}
	}
	if err := natSlots.Free(n.Index); err != nil {
		errs = append(errs, err)
	}
	if natSlots.Empty() {
		errs = append(errs, masquerade(false))
	}
	return errors.Join(errs...)
}

// masquerade installs (or removes) table ip dsec: what the pool sends
// out leaves with the outgoing interface's address; what a sandbox sends
// to the host itself (any of its addresses, any port, TCP, UDP or ICMP),
// to another sandbox or to link-local addresses is dropped, whatever its
// allowlist says (the allowlist's deny set holds the same in the
// sandbox; this holds for addresses the host gains later too).
func masquerade(on bool) error {
	c, err := nftables.New()
	if err != nil {
		return fmt.Errorf("nftables: %w", err)
	}
	tables, err := c.ListTablesOfFamily(nftables.TableFamilyIPv4)
	if err != nil {
		return fmt.Errorf("nftables: %w", err)
	}
	var have *nftables.Table
	for _, t := range tables {
		if t.Name == natTable {
			have = t
		}
	}
	switch {
	case on && have != nil:
		chains, err := c.ListChainsOfTableFamily(nftables.TableFamilyIPv4)
		if err != nil {
			return fmt.Errorf("nftables: %w", err)
		}
		n := 0
		for _, ch := range chains {
			if ch.Table.Name == natTable {
				n++
			}
		}
		if n == 3 {
			return nil
		}
		c.DelTable(have) // an older worker's, without the guards: made anew
		fallthrough
	case on:
		t := c.AddTable(&nftables.Table{Family: nftables.TableFamilyIPv4, Name: natTable})
		ch := c.AddChain(&nftables.Chain{Name: "postrouting", Table: t, Type: nftables.ChainTypeNAT,
			Hooknum: nftables.ChainHookPostrouting, Priority: nftables.ChainPriorityNATSource})
		c.AddRule(&nftables.Rule{Table: t, Chain: ch, Exprs: append(inPrefix(12, natPool), &expr.Masq{})})
		drop := &expr.Verdict{Kind: expr.VerdictDrop}
		fromSandbox := append([]expr.Any{
			&expr.Meta{Key: expr.MetaKeyIIFNAME, Register: 1},
			&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: []byte("dsec")}, // iifname "dsec*"
		}, inPrefix(12, natPool)...)
		in := c.AddChain(&nftables.Chain{Name: "input", Table: t, Type: nftables.ChainTypeFilter,
			Hooknum: nftables.ChainHookInput, Priority: nftables.ChainPriorityFilter})
		c.AddRule(&nftables.Rule{Table: t, Chain: in, Exprs: append(slices.Clip(fromSandbox), drop)})
		fw := c.AddChain(&nftables.Chain{Name: "forward", Table: t, Type: nftables.ChainTypeFilter,
			Hooknum: nftables.ChainHookForward, Priority: nftables.ChainPriorityFilter})
		for _, to := range []netip.Prefix{natPool, netip.MustParsePrefix("169.254.0.0/16")} {
			c.AddRule(&nftables.Rule{Table: t, Chain: fw, Exprs: append(append(slices.Clip(fromSandbox), inPrefix(16, to)...), drop)})
		}
	case !on && have != nil:
		c.DelTable(have)
	default:
		return nil
	}
	if err := c.Flush(); err != nil {
		return fmt.Errorf("nftables masquerade: %w", err)
	}
	return nil
}

// inPrefix matches an IPv4 header's address at off (12: source, 16:
// destination) in p.
func inPrefix(off uint32, p netip.Prefix) []expr.Any {
	return []expr.Any{
		&expr.Payload{DestRegister: 1, Base: expr.PayloadBaseNetworkHeader, Offset: off, Len: 4},
		&expr.Bitwise{SourceRegister: 1, DestRegister: 1, Len: 4, Mask: net.CIDRMask(p.Bits(), 32), Xor: []byte{0, 0, 0, 0}},
		&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: p.Addr().AsSlice()},
	}
}
