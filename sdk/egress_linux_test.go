package sdk_test

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"fmt"
	"io"
	"math/big"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/miekg/dns"
	"github.com/quic-go/quic-go/http3"
	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netlink/nl"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"

	"github.com/dsec-project/dsec/api"
	"github.com/dsec-project/dsec/internal/egress"
	"github.com/dsec-project/dsec/internal/runtime/runtimetest"
	"github.com/dsec-project/dsec/sdk"
)

// fakeDNS is the outside's DNS server: it answers from a zone (TTL 1)
// and logs every name it is asked.
type fakeDNS struct {
	mu  sync.Mutex
	log []string
}

func (f *fakeDNS) asked(name string) bool {
	f.mu.Lock()
	defer f.mu.Unlock()
	return slices.Contains(f.log, dns.Fqdn(name))
}

// inNetns runs fn in the network namespace of pid (sockets it makes
// stay there).
func inNetns(t testing.TB, pid int, fn func()) {
	t.Helper()
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	orig, err := netns.Get()
	if err != nil {
		t.Fatal(err)
	}
	defer orig.Close()
	ns, err := netns.GetFromPid(pid)
	if err != nil {
		t.Fatal(err)
	}
	defer ns.Close()
	if err := netns.Set(ns); err != nil {
		t.Fatal(err)
	}
	defer netns.Set(orig)
	fn()
}

// serveOutside serves DNS on addr:53 in the network namespace of pid:
// zone maps a name (or *.DOMAIN, for the names one label under it) to
// its records, each an IPv4 address (A), an IPv6 one (AAAA) or "CNAME
// target." (the target's records follow in the answer, as a recursive
// server's do).
func serveOutside(t testing.TB, pid int, addr string, zone map[string][]string) *fakeDNS {
	t.Helper()
	f := &fakeDNS{}
	var pc net.PacketConn
	var l net.Listener
	var perr, lerr error
	inNetns(t, pid, func() {
		pc, perr = net.ListenPacket("udp4", addr+":53")
		l, lerr = net.Listen("tcp4", addr+":53")
	})
	if perr != nil || lerr != nil {
		t.Fatal(perr, lerr)
	}
	h := dns.HandlerFunc(func(w dns.ResponseWriter, q *dns.Msg) {
		m := new(dns.Msg)
		m.SetReply(q)
		name := strings.ToLower(q.Question[0].Name)
		f.mu.Lock()
		f.log = append(f.log, name)
		f.mu.Unlock()
		// A recursive server's answer: the CNAME chain, then the last
		// name's records of the type asked.
		qtype := q.Question[0].Qtype
		key := func(n string) string { return n }
		if _, ok := zone[name]; !ok { // a wildcard's, one label deep
			if _, parent, ok := strings.Cut(name, "."); ok && zone["*."+parent] != nil {
				key = func(n string) string { return strings.Replace(n, name, "*."+parent, 1) }
			}
		}
		for cur, hops := name, 0; hops < 8; hops++ {
			next := ""
			for _, v := range zone[key(cur)] {
				var rr dns.RR
				switch target, ok := strings.CutPrefix(v, "CNAME "); {
				case ok:
					rr, _ = dns.NewRR(fmt.Sprintf("%s 1 IN CNAME %s", cur, target))
					next = target
				case strings.Contains(v, ":") && qtype == dns.TypeAAAA:
					rr, _ = dns.NewRR(fmt.Sprintf("%s 1 IN AAAA %s", cur, v))
				case !strings.Contains(v, ":") && qtype == dns.TypeA:
					rr, _ = dns.NewRR(fmt.Sprintf("%s 1 IN A %s", cur, v))
				}
				if rr != nil {
					m.Answer = append(m.Answer, rr)
				}
			}
			if next == "" {
				break
			}
			cur = next
		}
		if _, ok := zone[key(name)]; !ok {
			m.Rcode = dns.RcodeNameError
		}
		w.WriteMsg(m)
	})
	t.Cleanup(egress.Serve(pc, l, h))
	return f
}

// TestDomainEgress: a sandbox whose policy allows names reaches them
// once it resolved them, through its own resolver in the worker, and
// nothing else: not a name's address before the answer, not another
// name (never even asked upstream), not a name's address past its TTL,
// not a name's rebinding onto the host's or link-local addresses; its
// DNS to any server goes to its resolver; a policy applied live revokes
// what a removed rule learned; a worker that restarts serves it again.
func TestDomainEgress(t *testing.T) {
	cfg := runtimetest.Config{DNS: egress.Config{Upstream: []string{"10.204.0.2"}, MinTTL: time.Second, Grace: time.Second}}
	w, c := setupWith(t, cfg)
	pid := runtimetest.Outside(t, "dsecdns", "10.204.0")
	auth := serveOutside(t, pid, "10.204.0.2", map[string][]string{
		"allowed.test.":        {"10.204.0.2", "2001:db8::2"},
		"evil.test.":           {"10.204.0.2"},
		"a.allowed.test.":      {"10.204.0.2"},
		"all.ports.test.":      {"10.204.0.2"},
		"rebind.allowed.test.": {"127.0.0.1", "169.254.169.254", "10.200.0.1", "::1", "::ffff:127.0.0.1", "::ffff:169.254.169.254", "fe80::1"},
		// A CNAME out of the allowed names: its target's address is
		// learned under the rule the question matched.
		"cdn.allowed.test.":          {"CNAME edge.cdn-elsewhere.test."},
		"edge.cdn-elsewhere.test.":   {"10.204.0.2"},
		"cdn-rebind.allowed.test.":   {"CNAME inside.cdn-elsewhere.test."},
		"inside.cdn-elsewhere.test.": {"127.0.0.1", "::ffff:10.200.0.1"},
	})
	// A server that takes connections at once, one after another (the
	// outside's nc listens again only a moment after each).
	var ln net.Listener
	inNetns(t, pid, func() { ln, _ = net.Listen("tcp4", "10.204.0.2:8081") })
	if ln == nil {
		t.Fatal("listen on 10.204.0.2:8081")
	}
	t.Cleanup(func() { ln.Close() })
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			c.Write([]byte("hello from outside\n"))
			c.Close()
		}
	}()
	ctx := context.Background()
	pol := func(rules ...api.EgressRule) *api.Policy {
		return &api.Policy{APIVersion: api.PolicyVersion, Kind: "Policy", Network: &api.NetworkPolicy{Mode: api.NetworkNAT, Egress: rules}}
	}
	web := []api.PortRange{{Low: 8080, High: 8081}}
	// The outside's /24 is private: named (on another port), so a name
	// may resolve into it.
	allowed := pol(api.EgressRule{To: "allowed.test", Ports: web}, api.EgressRule{To: "*.allowed.test", Ports: web},
		api.EgressRule{To: "10.204.0.0/24", Ports: []api.PortRange{{Low: 9, High: 9}}}, api.EgressRule{To: "all.ports.test"})
	sb := create(t, c, api.SandboxSpec{Name: "names", Policy: allowed})
	putWebclient(t, sb)
	const connect = "nc -w 2 10.204.0.2 8080 </dev/null 2>&1"
	reach := func(id string) bool {
		out, res := run(t, sb, "reach-"+id, connect)
		return res.ExitCode == 0 && strings.Contains(out, "hello from outside")
	}
	lookup := func(id, name, server string) string {
		out, _ := run(t, sb, "lookup-"+id, "nslookup "+name+" "+server+" 2>&1")
		return out
	}
	if reach("before") {
		t.Fatal("the address was reached before any answer gave it")
	}
	// Its layer has no /etc/resolv.conf: it got one naming its
	// resolver, and resolves with no server named.
	if out, res := run(t, sb, "resolv.conf", "cat /etc/resolv.conf; nslookup allowed.test 2>&1"); res.ExitCode != 0 ||
		!strings.Contains(out, "# written by dsec") || !strings.Contains(out, "Address: 10.204.0.2") {
		t.Errorf("a sandbox without /etc/resolv.conf: %q %+v", out, res)
	}
	// Any server named: the answer is the sandbox's resolver's.
	if out := lookup("resolve", "allowed.test", "192.0.2.53"); !strings.Contains(out, "10.204.0.2") {
		t.Fatalf("nslookup allowed.test: %q", out)
	}
	if !reach("after") {
		t.Fatal("the answered address is not reached")
	}
	// DNS over TCP too: to its resolver, whatever server it names;
	// a name no rule allows is not answered.
	if out, res := run(t, sb, "tcp-dns", "webclient -dns allowed.test -tcp 192.0.2.53:53 && ! webclient -dns evil.test -tcp 10.204.0.2:53"); res.ExitCode != 0 || !strings.Contains(out, "dns-p50-us") {
		t.Errorf("DNS over TCP: %q %+v", out, res)
	}
	if out, res := run(t, sb, "other-port", "nc -w 2 10.204.0.2 8082 </dev/null 2>&1"); res.ExitCode == 0 || strings.Contains(out, "refused") {
		t.Errorf("a port the rule does not name: %q %+v", out, res)
	}
	// Names no rule allows never leave the host, whichever server is
	// named: the outside's own included.
	for _, n := range []string{"evil.test", "secret-4242.attacker.test"} {
		for _, server := range []string{"192.0.2.53", "10.204.0.2"} {
			if out := lookup("deny-"+n+server, n, server); strings.Contains(out, "10.204.0.2\n") && strings.Contains(out, "Name:") {
				t.Errorf("nslookup %s %s answered: %q", n, server, out)
			}
		}
		if auth.asked(n) {
			t.Errorf("the outside's DNS server was asked %s", n)
		}
	}
	if !auth.asked("allowed.test") {
		t.Error("the outside's DNS server was never asked allowed.test")
	}
	// Rebinding: loopback, link-local and the NAT pool are dropped from
	// answers, as IPv6 and IPv4-mapped too, and at a CNAME's end.
	for _, n := range []string{"rebind.allowed.test", "cdn-rebind.allowed.test"} {
		if out := lookup("rebind-"+n, n, "192.0.2.53"); strings.Contains(out, "127.0.0.1\n") || strings.Contains(out, "169.254.169.254") ||
			strings.Contains(out, "10.200.0.1\n") || strings.Contains(out, "::1\n") || strings.Contains(out, "::ffff:") || strings.Contains(out, "fe80:") {
			t.Errorf("a rebinding answer for %s: %q", n, out)
		}
	}
	// IPv6: an AAAA answer passes, and opens nothing: a sandbox reaches
	// out over IPv4 only (no IPv6 route; the host's end of its link
	// has no IPv6), and an IPv4-mapped address is its IPv4 address.
	if out := lookup("aaaa", "allowed.test", "192.0.2.53"); !strings.Contains(out, "2001:db8::2") {
		t.Errorf("the AAAA answer: %q", out)
	}
	if out, res := run(t, sb, "v6", "nc -w 2 2001:db8::2 8080 </dev/null 2>&1"); res.ExitCode == 0 || strings.Contains(out, "hello") {
		t.Errorf("IPv6 to an answered address: %q %+v", out, res)
	}
	if out, res := run(t, sb, "v4mapped", "nc -w 2 ::ffff:10.204.0.2 8082 </dev/null 2>&1"); res.ExitCode == 0 || strings.Contains(out, "hello") {
		t.Errorf("IPv4-mapped to a port no rule opens: %q %+v", out, res)
	}
	if out, res := run(t, sb, "v4mapped-ok", "nc -w 2 ::ffff:10.204.0.2 8080 </dev/null 2>&1"); res.ExitCode != 0 || !strings.Contains(out, "hello from outside") {
		t.Errorf("IPv4-mapped to the answered address: %q %+v", out, res)
	}
	// A rule with every port still leaves DNS over TLS (853) and QUIC
	// (UDP 443) closed; other UDP is open.
	lookup("all-ports", "all.ports.test", "192.0.2.53")
	for _, c := range []struct {
		args string
		ok   bool
	}{{"nc -w 1 10.204.0.2 853", false}, {"webclient -dns x.test 10.204.0.2:443", false}, {"webclient -dns x.test 10.204.0.2:5000", true}} {
		// (UDP through the web client, whose DNS query is any datagram:
		// the one to 5000 goes out, and no answer comes.)
		out, _ := run(t, sb, "udp-"+strings.ReplaceAll(strings.ReplaceAll(c.args, " ", "_"), "-", ""), c.args+" </dev/null 2>&1")
		if denied := strings.Contains(strings.ToLower(out), "not permitted"); denied == c.ok {
			t.Errorf("%s: %q", c.args, out)
		}
	}
	// Resolve, then connect at once, 1,000 times: the address is open
	// before the answer arrives, every time (its 1 s TTL expires along
	// the way, so answers keep opening it anew).
	if out, res := run(t, sb, "race", `fail=0; for i in $(seq 1000); do
		nslookup a.allowed.test 192.0.2.53 >/dev/null 2>&1 && nc -w 2 10.204.0.2 8081 </dev/null 2>/dev/null | grep -q hello || fail=$((fail+1)); done
		echo failures $fail`); res.ExitCode != 0 || out != "failures 0\n" {
		t.Errorf("resolve then connect, 1,000 times: %q %+v", out, res)
	}
	// Past the TTL (1 s), the floor and the grace (1 s each): gone.
	deadline := time.Now().Add(10 * time.Second)
	for i := 0; reach(fmt.Sprint("expiring-", i)); i++ {
		if time.Now().After(deadline) {
			t.Fatal("the address is still reached 10 s after its answer expired")
		}
		time.Sleep(500 * time.Millisecond)
	}
	// A CNAME chain: the answer keeps it, and its end's address is
	// reached.
	if out := lookup("cname", "cdn.allowed.test", "192.0.2.53"); !strings.Contains(out, "10.204.0.2") {
		t.Fatalf("nslookup cdn.allowed.test: %q", out)
	}
	if !reach("cname") {
		t.Error("the address at a CNAME's end is not reached")
	}
	// A worker that restarts serves the sandbox's DNS again.
	w.Kill()
	runtimetest.StartWorkerWith(t, w.Root, cfg)
	if out := lookup("restarted", "a.allowed.test", "192.0.2.53"); !strings.Contains(out, "10.204.0.2") {
		t.Fatalf("nslookup after a worker restart: %q", out)
	}
	if !reach("restarted") {
		t.Fatal("not reached after a worker restart")
	}
	// Revoked live: the rule gone, what it learned goes with it.
	if _, err := sb.ApplyPolicy(ctx, api.PolicyRequest{Policy: pol(api.EgressRule{To: "other.test", Ports: web})}); err != nil {
		t.Fatal(err)
	}
	if reach("revoked") {
		t.Error("reached after its rule was removed")
	}
	if out := lookup("revoked", "allowed.test", "192.0.2.53"); strings.Contains(out, "Name:") {
		t.Errorf("a revoked name resolves: %q", out)
	}
	// No domain rules left: no resolver, and DNS goes where it is sent
	// again (here, where a CIDR rule lets it).
	if _, err := sb.ApplyPolicy(ctx, api.PolicyRequest{Policy: pol(api.EgressRule{To: "10.204.0.0/24", Ports: []api.PortRange{{Low: 53, High: 53}}})}); err != nil {
		t.Fatal(err)
	}
	if out := lookup("direct", "evil.test", "10.204.0.2"); !strings.Contains(out, "Name:") || !auth.asked("evil.test") {
		t.Errorf("DNS once no domain rule is left: %q (asked upstream: %v)", out, auth.asked("evil.test"))
	}
	// Domain rules applied live: a resolv.conf naming only loopback
	// (systemd-resolved's stub, which nothing serves here) is replaced,
	// its search and options kept; one naming a server elsewhere is
	// kept (its DNS reaches the resolver all the same).
	cidr := pol(api.EgressRule{To: "10.204.0.0/24", Ports: []api.PortRange{{Low: 53, High: 53}}})
	for i, c := range []struct{ conf, want string }{
		{"nameserver 127.0.0.53\noptions edns0\nsearch corp.test\n", "nameserver 192.0.2.53\n"},
		{"nameserver 198.51.100.53\n", "nameserver 198.51.100.53\n"},
	} {
		if err := sb.WriteFile(ctx, "/etc/resolv.conf", strings.NewReader(c.conf), 0o644); err != nil {
			t.Fatal(err)
		}
		if _, err := sb.ApplyPolicy(ctx, api.PolicyRequest{Policy: allowed}); err != nil {
			t.Fatal(err)
		}
		out, res := run(t, sb, fmt.Sprint("live-resolv.conf-", i), "cat /etc/resolv.conf; nslookup allowed.test 2>&1")
		if res.ExitCode != 0 || !strings.Contains(out, c.want) || !strings.Contains(out, "Address: 10.204.0.2") ||
			i == 0 && !strings.Contains(out, "options edns0\nsearch corp.test\n") {
			t.Errorf("resolv.conf %q, domain rules applied live: %q %+v", c.conf, out, res)
		}
		if _, err := sb.ApplyPolicy(ctx, api.PolicyRequest{Policy: cidr}); err != nil {
			t.Fatal(err)
		}
	}
}

// webOutside serves HTTPS on addr:443 (a certificate for each name
// asked, self-signed), HTTP/3 on UDP addr:443 and HTTP on addr:80 in the network namespace of
// pid: each answer says the server name and Host it was asked for. It
// returns the server names its hellos carried.
func webOutside(t testing.TB, pid int, addr string) func() []string {
	t.Helper()
	var mu sync.Mutex
	var snis []string
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	cfg := &tls.Config{GetCertificate: func(h *tls.ClientHelloInfo) (*tls.Certificate, error) {
		mu.Lock()
		snis = append(snis, h.ServerName)
		mu.Unlock()
		tmpl := &x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: h.ServerName},
			DNSNames: []string{h.ServerName}, NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour)}
		der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
		return &tls.Certificate{Certificate: [][]byte{der}, PrivateKey: key}, err
	}}
	answer := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		switch r.URL.Path {
		case "/big": // 64 MiB, for throughput
			io.CopyN(w, zeros{}, 64<<20)
			return
		case "/rst": // the server resets the connection
			c, _, err := w.(http.Hijacker).Hijack()
			if err != nil {
				return
			}
			if tc, ok := c.(*tls.Conn); ok {
				c = tc.NetConn()
			}
			c.(*net.TCPConn).SetLinger(0)
			c.Close()
			return
		case "/slow": // a line every 100 ms for a minute
			for range 600 {
				if _, err := w.Write([]byte("tick\n")); err != nil {
					return
				}
				w.(http.Flusher).Flush()
				time.Sleep(100 * time.Millisecond)
			}
			return
		}
		sni := "-"
		if r.TLS != nil {
			sni = r.TLS.ServerName
		}
		fmt.Fprintf(w, "sni=%s host=%s\n", sni, r.Host)
	})
	var ls, ls2, lt net.Listener
	var lq net.PacketConn
	var errS, errS2, errT, errQ error
	inNetns(t, pid, func() {
		ls, errS = net.Listen("tcp4", addr+":443")
		ls2, errS2 = net.Listen("tcp4", addr+":8443") // HTTPS a CIDR rule may allow, not proxied
		lt, errT = net.Listen("tcp4", addr+":80")
		lq, errQ = net.ListenPacket("udp4", addr+":443") // HTTP/3
	})
	if errS != nil || errS2 != nil || errT != nil || errQ != nil {
		t.Fatal(errS, errS2, errT, errQ)
	}
	h3 := &http3.Server{Handler: answer, TLSConfig: http3.ConfigureTLSConfig(cfg)}
	go h3.Serve(lq)
	t.Cleanup(func() { h3.Close(); lq.Close() })
	for _, srv := range []struct {
		l net.Listener
		s *http.Server
	}{{tls.NewListener(ls, cfg), &http.Server{Handler: answer}}, {tls.NewListener(ls2, cfg), &http.Server{Handler: answer}},
		{lt, &http.Server{Handler: answer}}} {
		go srv.s.Serve(srv.l)
		t.Cleanup(func() { srv.s.Close() })
	}
	return func() []string {
		mu.Lock()
		defer mu.Unlock()
		return slices.Clone(snis)
	}
}

// TestDomainEgressWeb: a sandbox's web connections go by name: HTTPS
// and HTTP to an allowed name reach it, whatever address the sandbox
// dialled (the proxy dials the name itself: a spoofed address sends its
// bytes to the real server), a hello over many segments too; a name no
// rule allows, on the allowed name's very address, a hello with no name
// or an encrypted one, is refused before any of its bytes reach a
// server; an address and port a CIDR rule allows is reached unread.
func TestDomainEgressWeb(t *testing.T) {
	cfg := runtimetest.Config{DNS: egress.Config{Upstream: []string{"10.206.0.2"}}}
	_, c := setupWith(t, cfg)
	pid := runtimetest.Outside(t, "dsecweb", "10.206.0")
	serveOutside(t, pid, "10.206.0.2", map[string][]string{
		"allowed.test.": {"10.206.0.2"}, "evil.test.": {"10.206.0.2"}, "spoofed.allowed.test.": {"10.206.0.2"},
		"other.allowed.test.": {"10.206.0.2"},
	})
	snis := webOutside(t, pid, "10.206.0.2")
	pol := &api.Policy{APIVersion: api.PolicyVersion, Kind: "Policy", Network: &api.NetworkPolicy{Mode: api.NetworkNAT, Egress: []api.EgressRule{
		{To: "allowed.test", Ports: []api.PortRange{{Low: 80, High: 80}, {Low: 443, High: 443}}},
		{To: "*.allowed.test", Ports: []api.PortRange{{Low: 443, High: 443}}},
		{To: "10.206.0.0/24", Ports: []api.PortRange{{Low: 80, High: 80}, {Low: 8443, High: 8443}}},
	}}}
	sb := create(t, c, api.SandboxSpec{Name: "web", Policy: pol})
	client := putWebclient(t, sb)
	n := 0
	get := func(args string) (string, bool) {
		n++
		out, res := run(t, sb, fmt.Sprint("get-", n), "webclient "+args+" 2>&1")
		return out, res.ExitCode == 0
	}
	for _, c := range []struct{ args, want string }{
		{"-sni allowed.test 10.206.0.2:443", "sni=allowed.test host=allowed.test\n"},
		{"-http -host allowed.test 10.206.0.2:80", "sni=- host=allowed.test\n"},
		// Dialled anywhere (here where nothing is): dialled by name.
		{"-sni spoofed.allowed.test 192.0.2.99:443", "sni=spoofed.allowed.test host=spoofed.allowed.test\n"},
		{"-http -host allowed.test 192.0.2.99:80", "sni=- host=allowed.test\n"},
		// A hello over many segments.
		{"-chunk 7 -sni allowed.test 10.206.0.2:443", "sni=allowed.test host=allowed.test\n"},
		// A CIDR rule's address and port: unread, where it was dialled.
		{"-http -host whatever.test 10.206.0.2:80", "sni=- host=whatever.test\n"},
	} {
		if out, ok := get(c.args); !ok || out != c.want {
			t.Errorf("webclient %s: %q (ok %v), want %q", c.args, out, ok, c.want)
		}
	}
	// evil.test on allowed.test's very address, a hello with no name, a
	// look-alike name, an encrypted hello whose outer name is allowed,
	// a Host no rule allows on an address no CIDR rule opens: refused,
	// and no hello of theirs reaches the server.
	refusals := []string{"-sni evil.test 10.206.0.2:443", "10.206.0.2:443", "-sni allowed.test.evil.test 10.206.0.2:443",
		"-sni allowed.test -ech-public allowed.test 10.206.0.2:443", "-http -host evil.test 192.0.2.99:80",
		"-sni a.b.allowed.test 10.206.0.2:443", "-chunk 7 -sni evil.test 10.206.0.2:443",
		// DNS over HTTPS to a resolver no rule names, at its address or
		// any other.
		"-sni doh.test -path /dns-query?dns=AAABAAABAAAAAAAAA3d3dwdleGFtcGxlA2NvbQAAAQAB 10.206.0.2:443",
		"-sni doh.test -path /dns-query 192.0.2.99:443"}
	refused := func(args []string) {
		t.Helper()
		for _, args := range args {
			if out, ok := get(args); ok || strings.Contains(out, "sni=") {
				t.Errorf("webclient %s: %q (ok %v)", args, out, ok)
			}
		}
	}
	refused(refusals)
	// QUIC: a real HTTP/3 client, the way browsers go, falls back to
	// TCP (UDP 443 stays closed with a domain rule on 443), and gets
	// there through the proxy by name; from the host, the same client
	// speaks HTTP/3 to the same server.
	if out, err := exec.Command(client, "-h3", "-sni", "allowed.test", "10.206.0.2:443").CombinedOutput(); err != nil ||
		string(out) != "via HTTP/3\nsni=allowed.test host=allowed.test\n" {
		t.Errorf("HTTP/3 from the host: %q %v", out, err)
	}
	start := time.Now()
	if out, ok := get("-h3 -sni allowed.test 10.206.0.2:443"); !ok || !strings.HasPrefix(out, "via TCP (HTTP/3: ") ||
		!strings.HasSuffix(out, ")\nsni=allowed.test host=allowed.test\n") {
		t.Errorf("HTTP/3 from the sandbox: %q (ok %v), want its fallback to TCP", out, ok)
	} else {
		t.Logf("HTTP/3 from the sandbox, in %v: %q", time.Since(start), out)
	}
	// Slow hellos: forty connections that never send one hold nothing
	// up (a request beside them is answered at once), and are cut once
	// the proxy's wait for a name (10 s) is over.
	out, res := run(t, sb, "stalled", `start=$(date +%s); for i in $(seq 40); do sleep 60 | (nc 10.206.0.2 443 >/dev/null 2>&1; echo cut >>/tmp/stalled) & done
		sleep 1; webclient -sni allowed.test 10.206.0.2:443 && echo $(cat /tmp/stalled 2>/dev/null | wc -l) cut at once
		for i in $(seq 150); do [ "$(grep -c cut /tmp/stalled 2>/dev/null)" = 40 ] && break; sleep 0.1; done
		echo $(grep -c cut /tmp/stalled) cut after $(( $(date +%s) - start )) s`)
	var cut, after int
	if _, err := fmt.Sscanf(strings.TrimPrefix(out, "sni=allowed.test host=allowed.test\n0 cut at once\n"), "%d cut after %d s", &cut, &after); err != nil ||
		res.ExitCode != 0 || cut != 40 || after < 9 {
		t.Errorf("forty stalled hellos: %q %+v", out, res)
	}
	// The fast path: once its resolver has answered allowed.test, the
	// sandbox's HTTPS to that address is not proxied but goes on in the
	// kernel, read by the worker's gate until the server has its hello
	// (the flow's conntrack mark says it passed). The same refusals
	// hold there, reset before the server has a whole hello; and so
	// does an allowed name on an address its resolver gave only for
	// another name.
	if out, res := run(t, sb, "learn", "nslookup allowed.test 2>&1"); res.ExitCode != 0 || !strings.Contains(out, "10.206.0.2") {
		t.Fatalf("nslookup allowed.test: %q %+v", out, res)
	}
	// A connection that sends no hello: the gate gives up on it after
	// 10 s and has the host kill it (its conntrack mark), though no
	// packet of it came since.
	idle := time.Now()
	if out, res := run(t, sb, "idle", "(sleep 40 | nc 10.206.0.2 443 >/dev/null 2>&1 &)"); res.ExitCode != 0 {
		t.Fatalf("the idle connection: %q %+v", out, res)
	}
	for _, args := range []string{"-sni allowed.test 10.206.0.2:443", "-chunk 7 -sni allowed.test 10.206.0.2:443"} {
		if out, ok := get(args); !ok || out != "sni=allowed.test host=allowed.test\n" {
			t.Errorf("webclient %s by the fast path: %q (ok %v)", args, out, ok)
		}
	}
	refused(append(refusals, "-sni spoofed.allowed.test 10.206.0.2:443"))
	// (Those to 10.206.0.2:443 were the gate's to refuse: their flows'
	// conntrack marks say it killed them.)
	if n := fastFlowsMarked(t, "10.206.0.2", 0xd5ec0300); n < 8 {
		t.Errorf("%d flows killed by the gate, want 8", n)
	}
	// Two names of one rule on one address, both answered: each passes
	// by its own answer.
	if out, res := run(t, sb, "learn-two", "nslookup spoofed.allowed.test && nslookup other.allowed.test"); res.ExitCode != 0 {
		t.Fatalf("nslookup: %q %+v", out, res)
	}
	for _, name := range []string{"spoofed.allowed.test", "other.allowed.test"} {
		if out, ok := get("-sni " + name + " 10.206.0.2:443"); !ok || out != "sni="+name+" host="+name+"\n" {
			t.Errorf("%s by the fast path: %q (ok %v)", name, out, ok)
		}
	}
	for _, n := range snis() {
		if n != "allowed.test" && n != "spoofed.allowed.test" && n != "other.allowed.test" {
			t.Errorf("the server got a hello for %q", n)
		}
	}
	// Two long downloads, one through the proxy by name, one direct to
	// an address and port a CIDR rule allows: a policy without either
	// rule leaves them be, unless applied with Reset, which ends both.
	if out, res := run(t, sb, "slow", `for p in 443 8443; do (webclient -sni allowed.test -path /slow 10.206.0.2:$p >/tmp/slow.$p 2>&1; echo $? >/tmp/rc.$p) & done
		sleep 1; cat /tmp/slow.443 /tmp/slow.8443 | grep -c tick`); res.ExitCode != 0 || out == "0\n" {
		t.Fatalf("the long downloads: %q %+v", out, res)
	}
	if fastFlowsMarked(t, "10.206.0.2", 0xd5ec0200) == 0 {
		t.Error("the download from allowed.test's address did not pass by the fast path")
	}
	time.Sleep(time.Until(idle.Add(12 * time.Second)))
	if n := fastFlowsMarked(t, "10.206.0.2", 0xd5ec0300, nl.TCP_CONNTRACK_ESTABLISHED); n != 1 {
		t.Errorf("%d open flows killed by the gate 12 s after one sent no hello, want 1", n)
	}
	ctx := context.Background()
	other := &api.Policy{APIVersion: api.PolicyVersion, Kind: "Policy", Network: &api.NetworkPolicy{Mode: api.NetworkNAT,
		Egress: []api.EgressRule{{To: "other.test", Ports: []api.PortRange{{Low: 443, High: 443}}}}}}
	if _, err := sb.ApplyPolicy(ctx, api.PolicyRequest{Policy: other}); err != nil {
		t.Fatal(err)
	}
	if out, _ := run(t, sb, "kept", "sleep 1; ls /tmp/rc.* 2>/dev/null; echo checked"); out != "checked\n" {
		t.Errorf("a policy applied without reset ended a connection: %q", out)
	}
	rep, err := sb.ApplyPolicy(ctx, api.PolicyRequest{Policy: other, Reset: true})
	if err != nil {
		t.Fatal(err)
	}
	// (Three: the two downloads, and the idle connection the gate gave
	// up on, whose socket lives on until its next packet.)
	if !slices.Contains(rep.Now, "network: 3 connections the policy no longer allows reset") {
		t.Errorf("apply with reset: %+v", rep)
	}
	if out, res := run(t, sb, "reset", `for i in $(seq 50); do [ -e /tmp/rc.443 ] && [ -e /tmp/rc.8443 ] && break; sleep 0.1; done; cat /tmp/rc.443 /tmp/rc.8443`); res.ExitCode != 0 || out != "1\n1\n" {
		t.Errorf("the downloads after a reset: %q %+v", out, res)
	}
}

// fastFlowsMarked counts the host's tracked flows to addr:443 with the
// conntrack mark (the fast path's: network.fastPass, fastKill).
// With a state, only the flows in it count.
func fastFlowsMarked(t *testing.T, addr string, mark uint32, state ...uint8) int {
	t.Helper()
	flows, err := netlink.ConntrackTableList(netlink.ConntrackTable, unix.AF_INET)
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	for _, f := range flows {
		if !f.Forward.DstIP.Equal(net.ParseIP(addr)) || f.Forward.DstPort != 443 || f.Mark != mark {
			continue
		}
		if tcp, ok := f.ProtoInfo.(*netlink.ProtoInfoTCP); len(state) > 0 && (!ok || tcp.State != state[0]) {
			continue
		}
		n++
	}
	return n
}

type zeros struct{}

func (zeros) Read(b []byte) (int, error) { clear(b); return len(b), nil }

// putWebclient builds the web client statically into /bin/webclient of
// each sandbox, and returns where it built it.
func putWebclient(t testing.TB, sbs ...*sdk.Sandbox) string {
	t.Helper()
	client := filepath.Join(t.TempDir(), "webclient")
	build := exec.Command("go", "build", "-o", client, "github.com/dsec-project/dsec/internal/egress/webclient")
	build.Env = append(os.Environ(), "CGO_ENABLED=0")
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("build the web client: %v: %s", err, out)
	}
	for _, sb := range sbs {
		f, err := os.Open(client)
		if err != nil {
			t.Fatal(err)
		}
		err = sb.WriteFile(context.Background(), "/bin/webclient", f, 0o755)
		f.Close()
		if err != nil {
			t.Fatal(err)
		}
	}
	return client
}

// TestDomainEgressPortReuse: a connection from the port of one that
// ended by a reset is a new flow to the host, decided afresh, whatever
// conntrack kept of the old one: after the proxy refused one, the same
// port's next connection to an address its resolver has since answered
// takes the fast path; after a server reset one the gate passed, the
// same port's next hello (for a name no rule allows) is refused, never
// passed unread.
func TestDomainEgressPortReuse(t *testing.T) {
	cfg := runtimetest.Config{DNS: egress.Config{Upstream: []string{"10.206.0.2"}}}
	_, c := setupWith(t, cfg)
	pid := runtimetest.Outside(t, "dsecweb", "10.206.0")
	serveOutside(t, pid, "10.206.0.2", map[string][]string{"allowed.test.": {"10.206.0.2"}, "evil.test.": {"10.206.0.2"}})
	snis := webOutside(t, pid, "10.206.0.2")
	pol := &api.Policy{APIVersion: api.PolicyVersion, Kind: "Policy", Network: &api.NetworkPolicy{Mode: api.NetworkNAT, Egress: []api.EgressRule{
		{To: "allowed.test", Ports: []api.PortRange{{Low: 443, High: 443}}},
		{To: "10.206.0.0/24", Ports: []api.PortRange{{Low: 80, High: 80}}}}}}
	sb := create(t, c, api.SandboxSpec{Name: "reuse", Policy: pol})
	putWebclient(t, sb)
	markOf := func(port uint16) (uint32, bool) {
		flows, err := netlink.ConntrackTableList(netlink.ConntrackTable, unix.AF_INET)
		if err != nil {
			t.Fatal(err)
		}
		for _, f := range flows {
			if f.Forward.DstIP.Equal(net.ParseIP("10.206.0.2")) && f.Forward.DstPort == 443 && f.Forward.SrcPort == port {
				return f.Mark, true
			}
		}
		return 0, false
	}
	if out, res := run(t, sb, "refused", "webclient -port 40001 -sni evil.test 10.206.0.2:443 2>&1"); res.ExitCode == 0 {
		t.Fatalf("evil.test through the proxy: %q", out)
	}
	if out, res := run(t, sb, "learn", "nslookup allowed.test 2>&1"); res.ExitCode != 0 || !strings.Contains(out, "10.206.0.2") {
		t.Fatalf("nslookup allowed.test: %q %+v", out, res)
	}
	if out, res := run(t, sb, "again", "webclient -port 40001 -sni allowed.test 10.206.0.2:443 2>&1"); res.ExitCode != 0 || out != "sni=allowed.test host=allowed.test\n" {
		t.Errorf("allowed.test from the refused one's port: %q %+v", out, res)
	}
	if m, ok := markOf(40001); !ok || m != 0xd5ec0200 {
		t.Errorf("allowed.test from the refused one's port: flow tracked %v, mark %x, want the fast path's pass (d5ec0200)", ok, m)
	}
	out, res := run(t, sb, "reset", "webclient -port 40000 -sni allowed.test -path /rst 10.206.0.2:443 2>&1; webclient -port 40000 -sni evil.test 10.206.0.2:443 2>&1")
	if res.ExitCode == 0 || strings.Contains(out, "sni=evil.test") {
		t.Errorf("evil.test from the port of a passed flow its server reset: %q %+v", out, res)
	}
	for _, n := range snis() {
		if n != "allowed.test" {
			t.Errorf("the server got a hello for %q", n)
		}
	}
	if out, res := run(t, sb, "after", "webclient -sni allowed.test 10.206.0.2:443 2>&1"); res.ExitCode != 0 || out != "sni=allowed.test host=allowed.test\n" {
		t.Errorf("allowed.test after: %q %+v", out, res)
	}
}
