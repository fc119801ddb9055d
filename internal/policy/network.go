package policy

import (
	"fmt"
	"net/netip"
	"slices"

	"github.com/containerd/errdefs"

	"github.com/dsec-project/dsec/api"
	"github.com/dsec-project/dsec/internal/egress"
)

// Protocols a port rule allows, as bits.
const (
	ProtoTCP uint8 = 1 << iota
	ProtoUDP
)

// MaxPortRules bounds the port rules one address range carries (its
// own and those of every range that contains it).
const MaxPortRules = 16

// PortRule allows ports Low..High over the protocols in Protos.
type PortRule struct {
	Low, High uint16
	Protos    uint8
}

// Entry is one allowlist entry: an address range, as a 16-byte IPv6
// prefix (IPv4 as ::ffff:a.b.c.d/96+n, so IPv4-mapped IPv6 addresses
// match IPv4 rules), and the port rules that apply to addresses in it.
type Entry struct {
	Prefix netip.Prefix
	Rules  []PortRule
}

// NATPool holds the addresses of network mode nat: each sandbox's /30,
// the host's gateway address in it and the sandbox's own.
var NATPool = netip.MustParsePrefix("10.200.0.0/16")

// DenySet are the ranges no egress rule opens, whatever it allows
// around them: link-local (the cloud metadata address 169.254.169.254
// among them), the NAT pool (the host's gateway addresses and every
// other sandbox), 0.0.0.0/8, multicast and broadcast. The host's own
// addresses join them for a sandbox in network mode nat (Allowlist's
// host). The host's loopback needs no
// entry: a sandbox's 127.0.0.0/8 is its own network namespace's. A rule
// inside one of these is refused by Validate.
var DenySet = []netip.Prefix{
	netip.MustParsePrefix("169.254.0.0/16"), netip.MustParsePrefix("fe80::/10"), NATPool,
	netip.MustParsePrefix("0.0.0.0/8"), netip.MustParsePrefix("224.0.0.0/4"), netip.MustParsePrefix("ff00::/8"),
	netip.MustParsePrefix("255.255.255.255/32"),
}

// Private are the ranges a rule that only contains them (0.0.0.0/0, ::/0)
// does not open: a rule must name the range or a part of it.
var Private = []netip.Prefix{
	netip.MustParsePrefix("10.0.0.0/8"), netip.MustParsePrefix("172.16.0.0/12"), netip.MustParsePrefix("192.168.0.0/16"),
	netip.MustParsePrefix("100.64.0.0/10"), netip.MustParsePrefix("fc00::/7"),
}

// denied says which deny-set range (or host address) holds pfx, if any.
func denied(pfx netip.Prefix, host []netip.Addr) (netip.Prefix, bool) {
	pfx = unmapped(mapped(pfx))
	for _, d := range DenySet {
		if d.Bits() <= pfx.Bits() && d.Contains(pfx.Addr()) {
			return d, true
		}
	}
	for _, a := range host {
		a = a.Unmap()
		if pfx.Bits() == a.BitLen() && pfx.Addr().Unmap() == a {
			return netip.PrefixFrom(a, a.BitLen()), true
		}
	}
	return netip.Prefix{}, false
}

// Allowlist compiles egress rules into allowlist entries; domain rules
// are left out (Domains, Learned). Because a lookup
// finds only the longest matching prefix, an entry carries the rules of
// every entry that contains it too. The deny set, the private ranges no
// rule names and the host's addresses host (nil: none) are entries with
// no rules, wherever a rule's range contains them. A rule (or a host
// name's address) inside the deny set is an error.
func Allowlist(rules []api.EgressRule, host []netip.Addr) ([]Entry, error) {
	byPrefix := map[netip.Prefix][]PortRule{}
	var order []netip.Prefix
	for i, r := range rules {
		pfx, err := parseTo(r.To)
		if err != nil { // a domain rule: its addresses are learned (Learned)
			continue
		}
		pfxs := []netip.Prefix{pfx}
		protos := ProtoTCP | ProtoUDP
		switch r.Protocol {
		case "tcp":
			protos = ProtoTCP
		case "udp":
			protos = ProtoUDP
		}
		ports := r.Ports
		if len(ports) == 0 {
			ports = []api.PortRange{{Low: 0, High: 65535}}
		}
		for _, pfx := range pfxs {
			if d, ok := denied(pfx, host); ok {
				return nil, fmt.Errorf("network.egress[%d].to: %s is in %s, which no rule opens (link-local and metadata addresses, the NAT pool of the host's gateways and other sandboxes, the host's own addresses): %w",
					i, pfx, d, errdefs.ErrInvalidArgument)
			}
			pfx = mapped(pfx)
			if _, ok := byPrefix[pfx]; !ok {
				order = append(order, pfx)
			}
			for _, p := range ports {
				pr := PortRule{Low: p.Low, High: p.High, Protos: protos}
				if !slices.Contains(byPrefix[pfx], pr) {
					byPrefix[pfx] = append(byPrefix[pfx], pr)
				}
			}
		}
	}
	// Closed ranges inside a rule's: no rules of their own, and none
	// taken from the ranges containing them.
	closed := map[netip.Prefix]bool{}
	var shut []netip.Prefix
	shut = append(shut, DenySet...)
	for _, p := range Private {
		if _, named := byPrefix[mapped(p)]; !named {
			shut = append(shut, p)
		}
	}
	for _, a := range host {
		a = a.Unmap()
		shut = append(shut, netip.PrefixFrom(a, a.BitLen()))
	}
	for _, d := range shut {
		d = mapped(d)
		for _, pfx := range order {
			if !closed[d] && pfx.Bits() <= d.Bits() && pfx.Contains(d.Addr()) {
				closed[d] = true
				order = append(order, d)
			}
		}
	}
	// The ranges containing a prefix are its own address masked to each
	// prefix length in use, no longer than its own.
	var lengths []int
	for _, pfx := range order {
		if !slices.Contains(lengths, pfx.Bits()) {
			lengths = append(lengths, pfx.Bits())
		}
	}
	slices.Sort(lengths)
	out := make([]Entry, 0, len(order))
	for _, pfx := range order {
		if closed[pfx] {
			out = append(out, Entry{Prefix: pfx})
			continue
		}
		var rs []PortRule
		for _, bits := range lengths {
			if bits > pfx.Bits() {
				break
			}
			if other, err := pfx.Addr().Prefix(bits); err == nil {
				for _, r := range byPrefix[other] {
					if !slices.Contains(rs, r) {
						rs = append(rs, r)
					}
				}
			}
		}
		if len(rs) > MaxPortRules {
			return nil, fmt.Errorf("network.egress: %s carries %d port rules (its own and those of the ranges that contain it), more than %d: merge ports into ranges: %w",
				unmapped(pfx), len(rs), MaxPortRules, errdefs.ErrInvalidArgument)
		}
		out = append(out, Entry{Prefix: pfx, Rules: rs})
	}
	return out, nil
}

// mapped turns an IPv4 prefix into its IPv4-mapped IPv6 form.
func mapped(p netip.Prefix) netip.Prefix {
	if p.Addr().Is4() {
		return netip.PrefixFrom(netip.AddrFrom16(p.Addr().As16()), 96+p.Bits())
	}
	return p
}

func unmapped(p netip.Prefix) netip.Prefix {
	if p.Addr().Is4In6() && p.Bits() >= 96 {
		return netip.PrefixFrom(p.Addr().Unmap(), p.Bits()-96)
	}
	return p
}

// Allows says whether the entries allow a connection to addr:port over
// proto: the lookup the BPF programs do, for tests and for dsec policy
// check.
func Allows(entries []Entry, addr netip.Addr, port uint16, proto uint8) bool {
	best := longest(entries, addr)
	if best == nil {
		return false
	}
	for _, r := range best.Rules {
		if r.Protos&proto != 0 && r.Low <= port && port <= r.High {
			return true
		}
	}
	return false
}

// Domains are the domain rules among rules (those whose to is a name
// pattern), each with its index in rules.
func Domains(rules []api.EgressRule) []egress.Rule {
	var out []egress.Rule
	for i, r := range rules {
		if _, err := parseTo(r.To); err == nil {
			continue
		}
		if p, err := egress.ParsePattern(r.To); err == nil {
			out = append(out, egress.Rule{Pattern: p, Index: i})
		}
	}
	return out
}

// ResolverRule lets a sandbox with domain rules send DNS (port 53, TCP
// and UDP) to any address outside the closed ranges: the host redirects
// all of it to the sandbox's resolver (network's Resolve), whatever
// server it names.
var ResolverRule = api.EgressRule{To: "0.0.0.0/0", Ports: []api.PortRange{{Low: 53, High: 53}}}

// WebRule lets a sandbox with domain rules open TCP 80 and 443 to any
// address outside the closed ranges: the host redirects all of it to the
// sandbox's proxy (network's Resolve), which decides by name.
var WebRule = api.EgressRule{To: "0.0.0.0/0", Ports: []api.PortRange{{Low: 80, High: 80}, {Low: 443, High: 443}}, Protocol: "tcp"}

// Learned are the rules a domain rule's learned addresses add: each
// address (a /32 or /128) on the rule's ports and protocols, but for DNS
// over TLS or QUIC (853) and QUIC (UDP 443), which only a CIDR rule
// opens: they would carry what the resolver and the proxy never see.
func Learned(rules []api.EgressRule, learned []egress.Learned) []api.EgressRule {
	var out []api.EgressRule
	for _, l := range learned {
		if l.Rule < 0 || l.Rule >= len(rules) {
			continue
		}
		r := rules[l.Rule]
		ports := r.Ports
		if len(ports) == 0 {
			ports = []api.PortRange{{Low: 1, High: 65535}}
		}
		to := l.Addr.String()
		tcp := without(ports, 853)
		udp := without(tcp, 443)
		if r.Protocol != "udp" && len(tcp) > 0 {
			out = append(out, api.EgressRule{To: to, Ports: tcp, Protocol: "tcp"})
		}
		if r.Protocol != "tcp" && len(udp) > 0 {
			out = append(out, api.EgressRule{To: to, Ports: udp, Protocol: "udp"})
		}
	}
	return out
}

// without is ranges less port.
func without(ranges []api.PortRange, port uint16) []api.PortRange {
	var out []api.PortRange
	for _, r := range ranges {
		if r.Low <= port && port <= r.High {
			if r.Low < port {
				out = append(out, api.PortRange{Low: r.Low, High: port - 1})
			}
			if port < r.High {
				out = append(out, api.PortRange{Low: port + 1, High: r.High})
			}
			continue
		}
		out = append(out, r)
	}
	return out
}

// Closed says which addresses a DNS answer may not open for a sandbox
// whose CIDR rules compiled to entries: loopback, unspecified, the deny
// set, the host's own addresses host, and the private ranges where no
// rule of the sandbox's opens them (a name must not rebind onto them).
func Closed(entries []Entry, host []netip.Addr) func(netip.Addr) bool {
	return func(a netip.Addr) bool {
		a = a.Unmap()
		if a.IsLoopback() || a.IsUnspecified() {
			return true
		}
		if _, ok := denied(netip.PrefixFrom(a, a.BitLen()), host); ok {
			return true
		}
		for _, p := range Private {
			if p.Contains(a) {
				return !opens(entries, a)
			}
		}
		return false
	}
}

// opens says whether the entry that holds a (the longest match) has
// rules.
func opens(entries []Entry, a netip.Addr) bool {
	best := longest(entries, a)
	return best != nil && len(best.Rules) > 0
}

// longest is the entry whose prefix holds addr longest, nil if none.
func longest(entries []Entry, addr netip.Addr) *Entry {
	a := netip.AddrFrom16(addr.As16())
	var best *Entry
	for i := range entries {
		e := &entries[i]
		if e.Prefix.Contains(a) && (best == nil || e.Prefix.Bits() > best.Prefix.Bits()) {
			best = e
		}
	}
	return best
}
