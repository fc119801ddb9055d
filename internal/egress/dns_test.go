package egress

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/miekg/dns"
)

// authority is the fake internet's DNS server, on 127.0.0.1: its zone,
// and the log of every question it was asked.
type authority struct {
	mu   sync.Mutex
	log  []string
	zone map[string][]dns.RR // by question "name type"
	addr string
}

func startAuthority(t *testing.T, records ...string) *authority {
	t.Helper()
	a := &authority{zone: map[string][]dns.RR{}}
	for _, s := range records {
		rr, err := dns.NewRR(s)
		if err != nil {
			t.Fatal(err)
		}
		k := strings.ToLower(rr.Header().Name) + " " + dns.TypeToString[rr.Header().Rrtype]
		a.zone[k] = append(a.zone[k], rr)
	}
	h := dns.HandlerFunc(func(w dns.ResponseWriter, q *dns.Msg) {
		m := new(dns.Msg)
		m.SetReply(q)
		m.Authoritative = true
		qq := q.Question[0]
		a.mu.Lock()
		a.log = append(a.log, strings.ToLower(qq.Name))
		a.mu.Unlock()
		name := strings.ToLower(qq.Name)
		for hops := 0; hops < 8; hops++ { // follow CNAMEs inside the zone
			if c := a.zone[name+" CNAME"]; len(c) > 0 && qq.Qtype != dns.TypeCNAME {
				m.Answer = append(m.Answer, c...)
				name = strings.ToLower(c[0].(*dns.CNAME).Target)
				continue
			}
			m.Answer = append(m.Answer, a.zone[name+" "+dns.TypeToString[qq.Qtype]]...)
			// A poisoner's extra: a record for a name not asked.
			m.Answer = append(m.Answer, a.zone["extra.evil.test. A"]...)
			break
		}
		if len(m.Answer) == 0 {
			m.Rcode = dns.RcodeNameError
		}
		if _, udp := w.RemoteAddr().(*net.UDPAddr); udp {
			size := dns.MinMsgSize
			if o := q.IsEdns0(); o != nil {
				size = int(o.UDPSize())
			}
			m.Truncate(min(size, 1232))
		}
		w.WriteMsg(m)
	})
	a.addr = serve(t, h)
	return a
}

// serve serves h on 127.0.0.1 (UDP and TCP, one port) until the test
// ends, and returns its address.
func serve(t *testing.T, h dns.Handler) string {
	t.Helper()
	pc, err := net.ListenPacket("udp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	l, err := net.Listen("tcp", pc.LocalAddr().String())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(Serve(pc, l, h))
	return pc.LocalAddr().String()
}

func (a *authority) asked(name string) bool {
	a.mu.Lock()
	defer a.mu.Unlock()
	return slices.Contains(a.log, dns.Fqdn(name))
}

func rules(t *testing.T, pats ...string) []Rule {
	var rs []Rule
	for i, s := range pats {
		p, err := ParsePattern(s)
		if err != nil {
			t.Fatal(err)
		}
		rs = append(rs, Rule{Pattern: p, Index: i})
	}
	return rs
}

var closed = []netip.Prefix{netip.MustParsePrefix("10.0.0.0/8"), netip.MustParsePrefix("169.254.0.0/16"),
	netip.MustParsePrefix("fe80::/10"), netip.MustParsePrefix("203.0.113.66/32")}

func isClosed(a netip.Addr) bool {
	return slices.ContainsFunc(closed, func(p netip.Prefix) bool { return p.Contains(a) })
}

// TestResolver: the resolver between a sandbox and its upstream: what
// it answers, what it learns, and what never reaches the upstream.
func TestResolver(t *testing.T) {
	var big []string
	for i := range 120 {
		big = append(big, fmt.Sprintf("big.allowed.test. 60 IN A 198.51.100.%d", i+1))
	}
	auth := startAuthority(t, append(big,
		"allowed.test. 60 IN A 192.0.2.10",
		"allowed.test. 60 IN HTTPS 1 . ech=AEX+DQBBAQAgACA=",
		"evil.test. 60 IN A 192.0.2.10",
		"extra.evil.test. 60 IN A 192.0.2.99",
		"a.sub.allowed.test. 1 IN A 192.0.2.11",
		"cdn.allowed.test. 300 IN CNAME edge.cdn.other.test.",
		"edge.cdn.other.test. 30 IN A 198.51.100.200",
		"rebind.sub.allowed.test. 60 IN A 127.0.0.1",
		"rebind.sub.allowed.test. 60 IN A 10.1.2.3",
		"rebind.sub.allowed.test. 60 IN A 169.254.169.254",
		"rebind.sub.allowed.test. 60 IN A 203.0.113.66",
		"rebind.sub.allowed.test. 60 IN A 0.0.0.0",
		"rebind.sub.allowed.test. 60 IN A 192.0.2.12",
		"v6.sub.allowed.test. 60 IN AAAA 2001:db8::1",
		"v6.sub.allowed.test. 60 IN AAAA ::ffff:127.0.0.1",
		"v6.sub.allowed.test. 60 IN AAAA ::1",
		"v6.sub.allowed.test. 60 IN AAAA fe80::1",
	)...)
	r := &Resolver{Upstream: []string{auth.addr}, Closed: isClosed, MinTTL: 5 * time.Second, Grace: time.Second, MaxAddrs: 200}
	rs := rules(t, "allowed.test", "**.sub.allowed.test", "cdn.allowed.test", "big.allowed.test")
	ctx := context.Background()
	ask := func(name string, qtype uint16) (*dns.Msg, []Learned) {
		t.Helper()
		q := new(dns.Msg)
		q.SetQuestion(name, qtype)
		var got []Learned
		reply := r.Answer(ctx, q, rs, func(l []Learned) error { got = append(got, l...); return nil })
		if reply.Id != q.Id || !reply.Response {
			t.Fatalf("%s: not a reply to the question: %v", name, reply)
		}
		return reply, got
	}
	addrs := func(m *dns.Msg) (out []string) {
		for _, rr := range m.Answer {
			switch a := rr.(type) {
			case *dns.A:
				out = append(out, a.A.String())
			case *dns.AAAA:
				out = append(out, a.AAAA.String())
			case *dns.CNAME:
				out = append(out, "cname "+a.Target)
			}
		}
		return out
	}

	// An allowed name: its address, learned under its rule; the
	// poisoner's extra record for another name is dropped.
	m, l := ask("ALLOWED.test.", dns.TypeA)
	if m.Rcode != dns.RcodeSuccess || !slices.Equal(addrs(m), []string{"192.0.2.10"}) || len(l) != 1 ||
		l[0].Addr != netip.MustParseAddr("192.0.2.10") || l[0].Rule != 0 || l[0].Name != "allowed.test" {
		t.Errorf("allowed.test: %v, learned %+v", m, l)
	}
	if d := time.Until(l[0].Expires); d < 60*time.Second || d > 62*time.Second {
		t.Errorf("allowed.test's 60 s TTL + 1 s grace: learned for %v", d)
	}
	// A TTL below the floor is raised to it.
	if _, l := ask("a.sub.allowed.test.", dns.TypeA); len(l) != 1 || time.Until(l[0].Expires) < 5*time.Second {
		t.Errorf("a 1 s TTL: %+v", l)
	}
	// Names no rule allows: NXDOMAIN, and the upstream never hears
	// them (no exfiltration by lookup).
	for _, n := range []string{"evil.test.", "secret-1234.attacker.test.", "sub.allowed.test.", "x.allowed.test.",
		"allowed.test.evil.test.", "bad..name.", "1.0.0.10.in-addr.arpa."} {
		m, l := ask(n, dns.TypeA)
		if m.Rcode != dns.RcodeNameError || len(m.Answer) != 0 || len(l) != 0 {
			t.Errorf("%s: %v, learned %v", n, m, l)
		}
		if auth.asked(n) {
			t.Errorf("the upstream was asked %s", n)
		}
	}
	// HTTPS, SVCB and other types: no data, nothing asked.
	for _, qt := range []uint16{dns.TypeHTTPS, dns.TypeSVCB, dns.TypeTXT, dns.TypeANY} {
		if m, l := ask("allowed.test.", qt); m.Rcode != dns.RcodeSuccess || len(m.Answer) != 0 || len(l) != 0 {
			t.Errorf("type %s: %v", dns.TypeToString[qt], m)
		}
	}
	// A CNAME chain: the target's address is learned for this name
	// only; the target asked directly is not allowed.
	m, l = ask("cdn.allowed.test.", dns.TypeA)
	if !slices.Equal(addrs(m), []string{"cname edge.cdn.other.test.", "198.51.100.200"}) || len(l) != 1 || l[0].Rule != 2 {
		t.Errorf("a CNAME chain: %v, learned %+v", m, l)
	}
	if m, _ := ask("edge.cdn.other.test.", dns.TypeA); m.Rcode != dns.RcodeNameError {
		t.Errorf("the CNAME's target asked directly: %v", m)
	}
	// Rebinding: loopback, closed ranges, the unspecified address go.
	if m, l := ask("rebind.sub.allowed.test.", dns.TypeA); !slices.Equal(addrs(m), []string{"192.0.2.12"}) || len(l) != 1 {
		t.Errorf("rebinding answers: %v, learned %+v", m, l)
	}
	if m, l := ask("v6.sub.allowed.test.", dns.TypeAAAA); !slices.Equal(addrs(m), []string{"2001:db8::1"}) || len(l) != 1 {
		t.Errorf("IPv6 answers: %v, learned %+v", m, l)
	}
	// An answer too big for UDP comes over TCP, whole.
	if m, l := ask("big.allowed.test.", dns.TypeA); len(m.Answer) != 120 || len(l) != 120 {
		t.Errorf("a big answer: %d records, %d learned", len(m.Answer), len(l))
	}
	// What learn refuses is not answered.
	q := new(dns.Msg)
	q.SetQuestion("allowed.test.", dns.TypeA)
	if m := r.Answer(ctx, q, rs, func([]Learned) error { return errors.New("full") }); m.Rcode != dns.RcodeServerFailure || len(m.Answer) != 0 {
		t.Errorf("learn failed: %v", m)
	}
	// Not a query, two questions.
	q.Opcode = dns.OpcodeUpdate
	if m := r.Answer(ctx, q, rs, nil); m.Rcode != dns.RcodeNotImplemented {
		t.Errorf("an update: %v", m)
	}
	q.Opcode = dns.OpcodeQuery
	q.Question = append(q.Question, q.Question[0])
	if m := r.Answer(ctx, q, rs, nil); m.Rcode != dns.RcodeFormatError {
		t.Errorf("two questions: %v", m)
	}
	// An upstream that does not answer: SERVFAIL, in time.
	dead, err := net.ListenPacket("udp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer dead.Close()
	r2 := &Resolver{Upstream: []string{dead.LocalAddr().String()}, Timeout: 200 * time.Millisecond}
	q.Question = q.Question[:1]
	start := time.Now()
	if m := r2.Answer(ctx, q, rs, nil); m.Rcode != dns.RcodeServerFailure || time.Since(start) > 2*time.Second {
		t.Errorf("a dead upstream: %v after %v", m, time.Since(start))
	}
}

// TestResolverServer: the resolver as a sandbox meets it, over UDP and
// TCP on its own address, its rules read per query (a live update
// takes effect on the next one).
func TestResolverServer(t *testing.T) {
	auth := startAuthority(t, "allowed.test. 60 IN A 192.0.2.10", "later.test. 60 IN A 192.0.2.20")
	r := &Resolver{Upstream: []string{auth.addr}}
	var mu sync.Mutex
	rs := rules(t, "allowed.test")
	var learned []Learned
	h := r.Handler(func() []Rule { mu.Lock(); defer mu.Unlock(); return rs },
		func(l []Learned) error { mu.Lock(); defer mu.Unlock(); learned = append(learned, l...); return nil })
	addr := serve(t, h)
	for _, network := range []string{"udp", "tcp"} {
		c := &dns.Client{Net: network, Timeout: 2 * time.Second}
		q := new(dns.Msg)
		q.SetQuestion("allowed.test.", dns.TypeA)
		m, _, err := c.Exchange(q, addr)
		if err != nil || len(m.Answer) != 1 {
			t.Fatalf("%s: %v %v", network, m, err)
		}
		q.SetQuestion("later.test.", dns.TypeA)
		if m, _, err := c.Exchange(q, addr); err != nil || m.Rcode != dns.RcodeNameError {
			t.Fatalf("%s, later.test before it is allowed: %v %v", network, m, err)
		}
	}
	mu.Lock()
	rs = rules(t, "allowed.test", "later.test")
	n := len(learned)
	mu.Unlock()
	q := new(dns.Msg)
	q.SetQuestion("later.test.", dns.TypeA)
	if m, _, err := (&dns.Client{Timeout: 2 * time.Second}).Exchange(q, addr); err != nil || len(m.Answer) != 1 {
		t.Fatalf("later.test once allowed: %v %v", m, err)
	}
	mu.Lock()
	defer mu.Unlock()
	if n != 2 || len(learned) != 3 || learned[2].Addr != netip.MustParseAddr("192.0.2.20") {
		t.Errorf("learned: %+v", learned)
	}
}

func (a *authority) count(name string) int {
	a.mu.Lock()
	defer a.mu.Unlock()
	n := 0
	for _, l := range a.log {
		if l == dns.Fqdn(name) {
			n++
		}
	}
	return n
}

// TestResolverCache: an answer is asked upstream once while its TTL
// lasts, for the sandbox's queries and its proxy's lookups alike; from
// the cache its TTLs count down and it still opens its addresses
// (until what is left of the TTL, the floor and the grace), filtered as
// the closed ranges are now; past the TTL it is asked again; a
// negative answer is not kept.
func TestResolverCache(t *testing.T) {
	auth := startAuthority(t, "cached.test. 2 IN A 192.0.2.7", "cached.test. 2 IN A 10.9.9.9")
	shut := true
	r := &Resolver{Upstream: []string{auth.addr}, Closed: func(a netip.Addr) bool { return shut && isClosed(a) }}
	rs := rules(t, "cached.test", "missing.test")
	ask := func(name string) (*dns.Msg, []Learned) {
		q := new(dns.Msg)
		q.SetQuestion(name, dns.TypeA)
		var learned []Learned
		m := r.Answer(context.Background(), q, rs, func(l []Learned) error { learned = l; return nil })
		return m, learned
	}
	m, l := ask("cached.test.")
	if len(m.Answer) != 1 || len(l) != 1 || auth.count("cached.test") != 1 {
		t.Fatalf("first: %v %v", m, l)
	}
	time.Sleep(1100 * time.Millisecond)
	shut = false // a CIDR rule now names 10/8: its address is no longer dropped
	m, l = ask("cached.test.")
	if len(m.Answer) != 2 || len(l) != 2 || auth.count("cached.test") != 1 {
		t.Fatalf("from the cache: %v %v (asked %d times)", m, l, auth.count("cached.test"))
	}
	if ttl := m.Answer[0].Header().Ttl; ttl != 1 {
		t.Errorf("the cached answer's TTL: %d, want 1", ttl)
	}
	if until := time.Until(l[0].Expires); until > 1100*time.Millisecond {
		t.Errorf("a cached answer opens its address for %v more (1 s of TTL left)", until)
	}
	if addrs, err := r.Lookup(context.Background(), "cached.test"); err != nil || len(addrs) != 2 || auth.count("cached.test") != 1 {
		t.Errorf("the proxy's lookup: %v %v (asked %d times)", addrs, err, auth.count("cached.test"))
	}
	time.Sleep(1000 * time.Millisecond)
	if ask("cached.test."); auth.count("cached.test") != 2 {
		t.Errorf("past its TTL, asked %d times", auth.count("cached.test"))
	}
	for range 2 {
		if m, _ := ask("missing.test."); m.Rcode != dns.RcodeNameError {
			t.Errorf("missing.test: %v", m)
		}
	}
	if n := auth.count("missing.test"); n != 2 {
		t.Errorf("a negative answer asked %d times, want 2 (not kept)", n)
	}
}

// TestResolverCacheBounded: answers an allowed wildcard's many names
// bring (large ones, from a server that answers anything) never keep
// more than maxCached bytes, and the cache still serves.
func TestResolverCacheBounded(t *testing.T) {
	var mu sync.Mutex
	asked := 0
	addr := serve(t, dns.HandlerFunc(func(w dns.ResponseWriter, q *dns.Msg) {
		mu.Lock()
		asked++
		mu.Unlock()
		m := new(dns.Msg)
		m.SetReply(q)
		for i := range 120 {
			rr, _ := dns.NewRR(fmt.Sprintf("%s 300 IN A 198.51.100.%d", q.Question[0].Name, i+1))
			m.Answer = append(m.Answer, rr)
		}
		w.WriteMsg(m)
	}))
	r := &Resolver{Upstream: []string{addr}}
	for i := range 400 {
		if _, err := r.query(context.Background(), fmt.Sprintf("n%d.wild.test", i), dns.TypeA); err != nil {
			t.Fatal(err)
		}
		if r.cached > maxCached {
			t.Fatalf("after %d names the cache holds %d bytes (bound %d)", i+1, r.cached, maxCached)
		}
	}
	mu.Lock()
	before := asked
	mu.Unlock()
	if _, err := r.query(context.Background(), "n399.wild.test", dns.TypeA); err != nil {
		t.Fatal(err)
	}
	mu.Lock()
	defer mu.Unlock()
	if asked != before || r.cached == 0 {
		t.Errorf("the last name was asked again (%d bytes cached)", r.cached)
	}
}
