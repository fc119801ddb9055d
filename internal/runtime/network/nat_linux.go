// Package network connects sandboxes to the host in network mode nat: a
// veth pair per sandbox, a /30 of the NAT pool each, and one masquerade
// rule for them all.
package network

import (
	"encoding/binary"
	"errors"
	"fmt"
	"log/slog"
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
	n := slot(idx)
	host := netip.MustParseAddr(n.Host)
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
	if err := ensureTable(true); err != nil {
		return nil, err
	}
	return n, nil
}

// UpTap connects a microVM's guest to the host: it takes a /30 of the
// pool for owner and makes a tap on the host (named as a container's
// host side is, so the host's guards hold it alike) with the gateway's
// address; the guest's NIC is its other end, with the sandbox's address
// (the guest sets it: GuestNet). The tap is not persistent: it goes when
// the last descriptor of it closes (the one returned, which QEMU gets),
// and Down removes what is left of it.
func UpTap(owner string) (_ *NAT, tap *os.File, err error) {
	unlock, err := natSlots.Lock()
	if err != nil {
		return nil, nil, err
	}
	defer unlock()
	idx, err := natSlots.Take(owner)
	if err != nil {
		return nil, nil, err
	}
	if idx < 0 {
		return nil, nil, fmt.Errorf("network mode nat: all %d addresses of %s are taken: %w", natSlots.N, natPool, errdefs.ErrResourceExhausted)
	}
	n := slot(idx)
	defer func() {
		if err != nil {
			if tap != nil {
				tap.Close()
			}
			natRelease(n)
		}
	}()
	if l, err := netlink.LinkByName(n.Link); err == nil { // left by a killed worker
		netlink.LinkDel(l)
	}
	fd, err := unix.Open("/dev/net/tun", unix.O_RDWR|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, nil, fmt.Errorf("network mode nat: open /dev/net/tun: %w", err)
	}
	tap = os.NewFile(uintptr(fd), "tap")
	ifr, err := unix.NewIfreq(n.Link)
	if err != nil {
		return nil, nil, err
	}
	ifr.SetUint16(unix.IFF_TAP | unix.IFF_NO_PI)
	if err := unix.IoctlIfreq(fd, unix.TUNSETIFF, ifr); err != nil {
		return nil, nil, fmt.Errorf("network mode nat: make the tap %s: %w", n.Link, err)
	}
	l, err := netlink.LinkByName(n.Link)
	if err != nil {
		return nil, nil, err
	}
	if err := netlink.AddrAdd(l, &netlink.Addr{IPNet: ipNet(netip.MustParseAddr(n.Host), 30)}); err != nil {
		return nil, nil, fmt.Errorf("network mode nat: host address: %w", err)
	}
	if err := os.WriteFile("/proc/sys/net/ipv6/conf/"+n.Link+"/disable_ipv6", []byte("1"), 0o644); err != nil && !errors.Is(err, os.ErrNotExist) {
		return nil, nil, fmt.Errorf("network mode nat: disable IPv6 on %s: %w", n.Link, err)
	}
	if err := netlink.LinkSetUp(l); err != nil {
		return nil, nil, err
	}
	if err := os.WriteFile("/proc/sys/net/ipv4/ip_forward", []byte("1"), 0o644); err != nil {
		return nil, nil, fmt.Errorf("network mode nat: enable forwarding: %w", err)
	}
	if err := ensureTable(true); err != nil {
		return nil, nil, err
	}
	return n, tap, nil
}

// slot is the NAT of the pool's /30 number idx.
func slot(idx int) *NAT {
	base := natPool.Addr().As4()
	off := uint32(idx) * 4
	base[2], base[3] = byte(off>>8), byte(off)
	host := netip.AddrFrom4(base).Next()
	return &NAT{Index: idx, Link: fmt.Sprintf("dsec%04x", idx), Host: host.String(), Sandbox: host.Next().String()}
}

// MAC is the hardware address a microVM's NIC has on n: locally
// administered, one per /30.
func (n *NAT) MAC() string {
	return fmt.Sprintf("52:54:00:d5:%02x:%02x", n.Index>>8&0xff, n.Index&0xff)
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
		return natRelease(slot(idx))
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
	if err := Resolve(n, false); err != nil {
		errs = append(errs, err)
	}
	if err := natSlots.Free(n.Index); err != nil {
		errs = append(errs, err)
	}
	if natSlots.Empty() {
		errs = append(errs, ensureTable(false))
	}
	return errors.Join(errs...)
}

// ensureTable is masquerade under tableMu.
func ensureTable(on bool) error {
	tableMu.Lock()
	defer tableMu.Unlock()
	return masquerade(on)
}

// masquerade installs (or removes) table ip dsec: what the pool sends
// out leaves with the outgoing interface's address; what a sandbox sends
// to the host itself (any of its addresses, any port, TCP, UDP or ICMP),
// to another sandbox or to link-local addresses is dropped, whatever its
// allowlist says (the allowlist's deny set holds the same in the
// sandbox; this holds for addresses the host gains later too).
func masquerade(on bool) error {
	c, err := nftables.New(nftNS...)
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
		current, err := natTableCurrent(c, have)
		if err != nil {
			return err
		}
		if current {
			return nil
		}
		c.DelTable(have) // an older worker's, without the guards: made anew
		fallthrough
	case on:
		if err := addNATTable(c); err != nil {
			return err
		}
	case !on && have != nil:
		c.DelTable(have)
	default:
		return nil
	}
	if err := c.Flush(); err != nil {
		if on && !fastOff.Load() {
			// Another kernel may lack what the fast path's rules use
			// (nft compat, xt NFQUEUE, conntrack labels): the table
			// without them, and HTTPS by name through the proxies.
			fastOff.Store(true)
			if masquerade(on) == nil {
				slog.Warn("the host's kernel refuses the rules of domain rules' fast path: HTTPS by name goes through the proxy", "err", err)
				return nil
			}
		}
		return fmt.Errorf("nftables masquerade: %w", err)
	}
	return nil
}

// natTableCurrent says whether have, the table there is, is this
// worker's: its chains and the rules of its forward and input chains
// all there (the fast path's too, unless it is off).
func natTableCurrent(c *nftables.Conn, have *nftables.Table) (bool, error) {
	chains, err := c.ListChainsOfTableFamily(nftables.TableFamilyIPv4)
	if err != nil {
		return false, fmt.Errorf("nftables: %w", err)
	}
	n := 0
	var fw, in *nftables.Chain
	for _, ch := range chains {
		if ch.Table.Name == natTable {
			n++
			switch ch.Name {
			case "forward":
				fw = ch
			case "input":
				in = ch
			}
		}
	}
	wantChains := 6 // (the fast path's too)
	if fastOff.Load() {
		wantChains = 5
	}
	if fw != nil && in != nil && n == wantChains {
		fr, ferr := c.GetRules(have, fw)
		ir, ierr := c.GetRules(have, in)
		want := forwardRules
		if fastOff.Load() {
			want -= fastForwardRules
		}
		if ferr == nil && ierr == nil && len(fr) == want && len(ir) == len(redirects)+2 {
			return true, nil
		}
	}
	return false, nil
}

// addNATTable adds table ip dsec to c's batch: the masquerade of the
// pool, the redirects of its sandboxes' DNS and web ports, and the
// guards of the host and of the forward chain, in this order.
func addNATTable(c *nftables.Conn) error {
	t := c.AddTable(&nftables.Table{Family: nftables.TableFamilyIPv4, Name: natTable})
	ch := c.AddChain(&nftables.Chain{Name: "postrouting", Table: t, Type: nftables.ChainTypeNAT,
		Hooknum: nftables.ChainHookPostrouting, Priority: nftables.ChainPriorityNATSource})
	c.AddRule(&nftables.Rule{Table: t, Chain: ch, Exprs: append(inPrefix(12, natPool), &expr.Masq{})})
	fromSandbox := append([]expr.Any{
		&expr.Meta{Key: expr.MetaKeyIIFNAME, Register: 1},
		&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: []byte("dsec")}, // iifname "dsec*"
	}, inPrefix(12, natPool)...)
	in, err := addRedirects(c, t, fromSandbox)
	if err != nil {
		return err
	}
	addHostGuards(c, t, in, fromSandbox)
	return addForwardGuards(c, t, fromSandbox)
}

// addRedirects adds to t the chains prerouting and input, and their
// rules for the DNS and web ports of a sandbox with domain rules (its
// address in the set): every query and web connection, whatever address
// it was for, to its gateway, where its resolver and proxy listen
// (Resolve); and that is all of the host it reaches. (The fast path's
// rule goes first.) It returns the input chain.
func addRedirects(c *nftables.Conn, t *nftables.Table, fromSandbox []expr.Any) (*nftables.Chain, error) {
	resolved := &nftables.Set{Table: t, Name: resolvedSet, KeyType: nftables.TypeIPAddr}
	if err := c.AddSet(resolved, resolvingElements()); err != nil {
		return nil, fmt.Errorf("nftables: %w", err)
	}
	redirected := func(proto byte, port uint16) []expr.Any {
		return append(slices.Clip(fromSandbox),
			&expr.Payload{DestRegister: 1, Base: expr.PayloadBaseNetworkHeader, Offset: 12, Len: 4},
			&expr.Lookup{SourceRegister: 1, SetName: resolved.Name, SetID: resolved.ID},
			&expr.Meta{Key: expr.MetaKeyL4PROTO, Register: 1},
			&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: []byte{proto}},
			&expr.Payload{DestRegister: 1, Base: expr.PayloadBaseTransportHeader, Offset: 2, Len: 2},
			&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: binary.BigEndian.AppendUint16(nil, port)})
	}
	pre := c.AddChain(&nftables.Chain{Name: "prerouting", Table: t, Type: nftables.ChainTypeNAT,
		Hooknum: nftables.ChainHookPrerouting, Priority: nftables.ChainPriorityNATDest})
	in := c.AddChain(&nftables.Chain{Name: "input", Table: t, Type: nftables.ChainTypeFilter,
		Hooknum: nftables.ChainHookInput, Priority: nftables.ChainPriorityFilter})
	if !fastOff.Load() {
		if err := fastPrerouting(c, t, pre, fromSandbox); err != nil {
			return nil, fmt.Errorf("nftables: %w", err)
		}
	}
	for _, r := range redirects {
		c.AddRule(&nftables.Rule{Table: t, Chain: pre, Exprs: append(redirected(r.proto, r.port), &expr.Redir{})})
		c.AddRule(&nftables.Rule{Table: t, Chain: in, Exprs: append(redirected(r.proto, r.port), &expr.Verdict{Kind: expr.VerdictAccept})})
	}
	return in, nil
}

// addHostGuards adds to t the chain output, and to in (the input chain,
// after its redirects) the rules that keep a sandbox off the host:
// answers on what the worker opened to a sandbox (its port route,
// HostMark) come back; nothing a sandbox opens does, nor answers to
// another process of the host's.
func addHostGuards(c *nftables.Conn, t *nftables.Table, in *nftables.Chain, fromSandbox []expr.Any) {
	drop := &expr.Verdict{Kind: expr.VerdictDrop}
	out := c.AddChain(&nftables.Chain{Name: "output", Table: t, Type: nftables.ChainTypeFilter,
		Hooknum: nftables.ChainHookOutput, Priority: nftables.ChainPriorityFilter})
	c.AddRule(&nftables.Rule{Table: t, Chain: out, Exprs: []expr.Any{
		&expr.Meta{Key: expr.MetaKeyMARK, Register: 1},
		&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: markData(HostMark)},
		&expr.Ct{Key: expr.CtKeyMARK, Register: 1, SourceRegister: true}}})
	c.AddRule(&nftables.Rule{Table: t, Chain: in, Exprs: slices.Concat(fromSandbox, ctState(expr.CtStateBitESTABLISHED), []expr.Any{
		&expr.Ct{Key: expr.CtKeyMARK, Register: 1},
		&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: markData(HostMark)},
		&expr.Verdict{Kind: expr.VerdictAccept}})})
	c.AddRule(&nftables.Rule{Table: t, Chain: in, Exprs: append(slices.Clip(fromSandbox), drop)})
}

// addForwardGuards adds to t the chain forward: what a sandbox sends to
// another sandbox or to link-local addresses is dropped, and so is what
// its allowlist did not let open; then the fast path's rules.
func addForwardGuards(c *nftables.Conn, t *nftables.Table, fromSandbox []expr.Any) error {
	drop := &expr.Verdict{Kind: expr.VerdictDrop}
	fw := c.AddChain(&nftables.Chain{Name: "forward", Table: t, Type: nftables.ChainTypeFilter,
		Hooknum: nftables.ChainHookForward, Priority: nftables.ChainPriorityFilter})
	for _, to := range []netip.Prefix{natPool, netip.MustParsePrefix("169.254.0.0/16")} {
		c.AddRule(&nftables.Rule{Table: t, Chain: fw, Exprs: append(append(slices.Clip(fromSandbox), inPrefix(16, to)...), drop)})
	}
	// Only connections the sandbox's allowlist let open go on: a
	// packet conntrack cannot place, and a TCP segment that opens
	// nothing (no SYN alone) yet is new, go nowhere. A container's
	// kernel sends neither; a microVM's guest, whose every packet
	// its tap's filter sees, checked only at SYN, could.
	c.AddRule(&nftables.Rule{Table: t, Chain: fw, Exprs: append(append(slices.Clip(fromSandbox), ctState(expr.CtStateBitINVALID)...), drop)})
	c.AddRule(&nftables.Rule{Table: t, Chain: fw, Exprs: append(append(append(slices.Clip(fromSandbox),
		&expr.Meta{Key: expr.MetaKeyL4PROTO, Register: 1},
		&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: []byte{unix.IPPROTO_TCP}},
		&expr.Payload{DestRegister: 1, Base: expr.PayloadBaseTransportHeader, Offset: 13, Len: 1},
		&expr.Bitwise{SourceRegister: 1, DestRegister: 1, Len: 1, Mask: []byte{0x17}, Xor: []byte{0}}, // fin|syn|rst|ack
		&expr.Cmp{Op: expr.CmpOpNeq, Register: 1, Data: []byte{0x02}}),                                // not syn alone
		ctState(expr.CtStateBitNEW)...), drop)})
	if !fastOff.Load() {
		if err := fastForward(c, t, fw); err != nil {
			return fmt.Errorf("nftables: %w", err)
		}
	}
	return nil
}

// forwardRules is how many rules the forward chain holds (the input
// chain: one per redirect, the answers to the host's, and its drop): a
// table with others (or other chains) is an older worker's, made anew.
const forwardRules = 4 + fastForwardRules

// resolvedSet holds the addresses of the sandboxes whose DNS and web
// ports go to their resolvers and proxies.
const resolvedSet = "resolved"

// redirects are what goes to a resolved sandbox's gateway: DNS (UDP and
// TCP 53) and the web ports (TCP 80 and 443).
var redirects = []struct {
	proto byte
	port  uint16
}{{unix.IPPROTO_UDP, 53}, {unix.IPPROTO_TCP, 53}, {unix.IPPROTO_TCP, 80}, {unix.IPPROTO_TCP, 443}}

// ctState matches a packet whose conntrack state has the bit.
func ctState(bit uint32) []expr.Any {
	mask := binary.NativeEndian.AppendUint32(nil, bit)
	return []expr.Any{
		&expr.Ct{Register: 1, Key: expr.CtKeySTATE},
		&expr.Bitwise{SourceRegister: 1, DestRegister: 1, Len: 4, Mask: mask, Xor: []byte{0, 0, 0, 0}},
		&expr.Cmp{Op: expr.CmpOpNeq, Register: 1, Data: []byte{0, 0, 0, 0}},
	}
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
