package egress

import (
	"bufio"
	"bytes"
	"fmt"
	"net/netip"
	"strings"
)

// Nameservers are the servers a resolv.conf names, in order.
func Nameservers(conf []byte) []netip.Addr {
	var out []netip.Addr
	sc := bufio.NewScanner(bytes.NewReader(conf))
	for sc.Scan() {
		if f := strings.Fields(sc.Text()); len(f) >= 2 && f[0] == "nameserver" {
			if a, err := netip.ParseAddr(f[1]); err == nil {
				out = append(out, a)
			}
		}
	}
	return out
}

// Nameserver is the server the resolv.conf ResolvConf writes names:
// 192.0.2.53, in TEST-NET-1 (RFC 5737), routed nowhere. What answers
// it is the host's redirect of every DNS packet of the sandbox to its
// resolver; unlike the sandbox's gateway, it is the same for every
// sandbox, so a snapshot's file still serves its branches anywhere.
var Nameserver = netip.MustParseAddr("192.0.2.53")

// ResolvConf is what a sandbox with domain rules needs of its
// resolv.conf: conf itself when it names a server the sandbox may send
// DNS to (any address but loopback, unspecified and what closed says no
// rule opens: every such packet goes to the sandbox's resolver), else
// (no file, no server, or only loopback ones such as systemd-resolved's
// 127.0.0.53, which nothing serves in the sandbox, or another
// sandbox's gateway) one naming Nameserver, conf's search, domain and
// options lines kept. changed says which.
func ResolvConf(conf []byte, closed func(netip.Addr) bool) (out []byte, changed bool) {
	for _, a := range Nameservers(conf) {
		if a = a.Unmap(); !a.IsLoopback() && !a.IsUnspecified() && !closed(a) {
			return conf, false
		}
	}
	var b bytes.Buffer
	fmt.Fprintf(&b, "# written by dsec: the sandbox's DNS goes to its own resolver, whatever server it names\nnameserver %s\n", Nameserver)
	sc := bufio.NewScanner(bytes.NewReader(conf))
	for sc.Scan() {
		if f := strings.Fields(sc.Text()); len(f) > 0 && (f[0] == "search" || f[0] == "domain" || f[0] == "options") {
			b.WriteString(strings.TrimSpace(sc.Text()) + "\n")
		}
	}
	return b.Bytes(), true
}
