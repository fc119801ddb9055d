package runtime

import (
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"

	"github.com/containerd/errdefs"
	"github.com/google/nftables"
	"github.com/google/nftables/expr"
	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"
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
	natPool  = netip.MustParsePrefix("10.200.0.0/16")
	natSlots = hostSlots{dir: "/run/dsec/nat", n: 1 << (32 - natPool.Bits() - 2)}
)

const natTable = "dsec"

// natUp connects the sandbox whose init is pid to the host: it takes a
// /30 of the pool for owner (the sandbox's root and name), makes the
// veth pair and installs the masquerade rule if it is not there yet.
func natUp(owner string, pid int) (_ *NAT, err error) {
	// The lock also covers the masquerade table, which the last one out
	// removes.
	unlock, err := natSlots.lock()
	if err != nil {
		return nil, err
	}
	defer unlock()
	idx, err := natSlots.take(owner)
	if err != nil {
		return nil, err
	}
	if idx < 0 {
		return nil, fmt.Errorf("network mode nat: all %d addresses of %s are taken: %w", natSlots.n, natPool, errdefs.ErrResourceExhausted)
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

// natDown gives back every /30 owner holds (a worker killed before it
// saved one leaves it recorded only here), taking its pair away if the
// sandbox's net namespace did not take it already; the last one out
// removes the masquerade rule.
func natDown(owner string) error {
	return natSlots.giveBack(owner, func(idx int) error {
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
	if err := natSlots.free(n.Index); err != nil {
		errs = append(errs, err)
	}
	if natSlots.empty() {
		errs = append(errs, masquerade(false))
	}
	return errors.Join(errs...)
}

// masquerade installs (or removes) table ip dsec: what the pool sends
// out leaves with the outgoing interface's address.
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
	case on && have == nil:
		t := c.AddTable(&nftables.Table{Family: nftables.TableFamilyIPv4, Name: natTable})
		ch := c.AddChain(&nftables.Chain{Name: "postrouting", Table: t, Type: nftables.ChainTypeNAT,
			Hooknum: nftables.ChainHookPostrouting, Priority: nftables.ChainPriorityNATSource})
		mask := net.CIDRMask(natPool.Bits(), 32)
		c.AddRule(&nftables.Rule{Table: t, Chain: ch, Exprs: []expr.Any{
			&expr.Payload{DestRegister: 1, Base: expr.PayloadBaseNetworkHeader, Offset: 12, Len: 4}, // saddr
			&expr.Bitwise{SourceRegister: 1, DestRegister: 1, Len: 4, Mask: mask, Xor: []byte{0, 0, 0, 0}},
			&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: natPool.Addr().AsSlice()},
			&expr.Masq{},
		}})
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
