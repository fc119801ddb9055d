package egress

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"strings"
	"sync"
	"time"

	"github.com/miekg/dns"
)

// A sandbox's DNS: every query it sends is answered by a Resolver, which
// answers only the names its rules allow (NXDOMAIN for the rest, so a
// name no rule allows never leaves the host: no exfiltration through
// lookups), asks its upstream for those, keeps of the answer only the
// CNAME chain from the question and the chain's last name's A and AAAA
// records outside the closed ranges (no rebinding onto loopback, the
// metadata address, the host or another sandbox: checked on every
// answer, one from its cache too), drops HTTPS and SVCB
// records (their ECH configs would hide a hello's name), and hands the
// addresses it answers to learn before the reply leaves, so a connect
// right after the answer finds them allowed.

// Config configures a host's resolvers for sandboxes (dns: in the
// config file).
type Config struct {
	// Upstream are the servers asked (host:port, or an address: port
	// 53); none: the host's, from /etc/resolv.conf.
	Upstream []string
	// MinTTL is the least time a learned address stays allowed (default
	// 30 s); Grace is added to every TTL (default 30 s).
	MinTTL, Grace time.Duration
}

// Rule is a domain rule as the resolver sees it: its pattern and its
// index in the policy (which says what its addresses open).
type Rule struct {
	Pattern Pattern
	Index   int
}

// Learned is an address an answer gave under a rule, allowed until
// Expires.
type Learned struct {
	Addr    netip.Addr
	Rule    int
	Name    string
	Expires time.Time
}

// Resolver answers a sandbox's queries (see above). Its zero value is
// not ready: Upstream must name at least one server.
type Resolver struct {
	// Upstream are the servers asked, host:port, in turn until one
	// answers.
	Upstream []string
	// Closed says whether an answer's address is one no rule opens: it
	// is dropped from the answer.
	Closed func(netip.Addr) bool
	// MinTTL is the least an address stays learned; Grace is added to
	// its TTL (a client that caches an answer a little past its TTL
	// still connects).
	MinTTL, Grace time.Duration
	// Timeout bounds one question to one upstream (default 2 s).
	Timeout time.Duration
	// MaxAddrs bounds the addresses one answer teaches (default 32):
	// the rest are dropped from it.
	MaxAddrs int

	// cache holds the upstream's answers, by question, until their
	// TTL: a sandbox's repeated lookups (and its proxy's) ask it once.
	// cached counts their bytes.
	mu     sync.Mutex
	cache  map[question]cached
	cached int
}

type question struct {
	name  string // FQDN, lowercase
	qtype uint16
}

// cached is an upstream's answer and when it came.
type cached struct {
	msg *dns.Msg
	at  time.Time
	ttl time.Duration // its records' least
}

// maxCached bounds the bytes of the answers a Resolver remembers (an
// allowed wildcard's names are many, and their answers up to 64 KiB
// each): past it, it forgets them all.
const maxCached = 256 << 10

// query asks the upstream for name's qtype records, or takes its
// answer from the cache while the answer's TTL lasts (with its TTLs
// counted down): a copy the caller may change.
func (r *Resolver) query(ctx context.Context, name string, qtype uint16) (*dns.Msg, error) {
	k := question{dns.Fqdn(name), qtype}
	now := time.Now()
	r.mu.Lock()
	c, ok := r.cache[k]
	r.mu.Unlock()
	if ok && now.Sub(c.at) < c.ttl {
		m := c.msg.Copy()
		age := uint32(now.Sub(c.at) / time.Second)
		for _, rr := range m.Answer {
			rr.Header().Ttl -= min(age, rr.Header().Ttl)
		}
		return m, nil
	}
	up, err := r.ask(ctx, k.name, qtype)
	if err != nil {
		return nil, err
	}
	// Only whole answers with data: an error or an empty answer is
	// asked again.
	if up.Rcode == dns.RcodeSuccess && len(up.Answer) > 0 {
		ttl := uint32(1 << 31)
		for _, rr := range up.Answer {
			ttl = min(ttl, rr.Header().Ttl)
		}
		if size := up.Len(); ttl > 0 && size <= maxCached/16 {
			r.mu.Lock()
			if r.cache == nil || r.cached+size > maxCached {
				r.cache, r.cached = map[question]cached{}, 0
			}
			if old, ok := r.cache[k]; ok {
				r.cached -= old.msg.Len()
			}
			r.cache[k] = cached{msg: up.Copy(), at: now, ttl: time.Duration(ttl) * time.Second}
			r.cached += size
			r.mu.Unlock()
		}
	}
	return up, nil
}

// Answer answers query under rules, calling learn with the addresses
// the reply holds before it returns the reply. It always returns a
// reply: an error (learn's, every upstream's) is SERVFAIL.
func (r *Resolver) Answer(ctx context.Context, query *dns.Msg, rules []Rule, learn func([]Learned) error) *dns.Msg {
	reply := new(dns.Msg)
	reply.SetReply(query)
	reply.RecursionAvailable = true
	reply.Authoritative = false
	if query.Opcode != dns.OpcodeQuery {
		reply.Rcode = dns.RcodeNotImplemented
		return reply
	}
	if len(query.Question) != 1 {
		reply.Rcode = dns.RcodeFormatError
		return reply
	}
	q := query.Question[0]
	name, err := Normalize(q.Name)
	if err != nil || q.Qclass != dns.ClassINET {
		reply.Rcode = dns.RcodeNameError
		return reply
	}
	rule, ok := match(rules, name)
	if !ok {
		reply.Rcode = dns.RcodeNameError
		return reply
	}
	switch q.Qtype {
	case dns.TypeA, dns.TypeAAAA, dns.TypeCNAME:
	default: // HTTPS, SVCB and the rest: no data
		return reply
	}
	up, err := r.query(ctx, name, q.Qtype)
	if err != nil {
		reply.Rcode = dns.RcodeServerFailure
		return reply
	}
	reply.Rcode = up.Rcode
	if up.Rcode == dns.RcodeRefused {
		reply.Rcode = dns.RcodeServerFailure
	}
	var learned []Learned
	reply.Answer, learned = r.keep(up.Answer, name, rule)
	for _, rr := range up.Ns {
		if soa, ok := rr.(*dns.SOA); ok { // negative caching's TTL
			reply.Ns = append(reply.Ns, soa)
		}
	}
	if len(learned) > 0 {
		if err := learn(learned); err != nil {
			reply.Answer, reply.Ns = nil, nil
			reply.Rcode = dns.RcodeServerFailure
		}
	}
	return reply
}

func match(rules []Rule, name string) (Rule, bool) {
	for _, r := range rules {
		if r.Pattern.Match(name) {
			return r, true
		}
	}
	return Rule{}, false
}

// keep is what of an answer goes to the sandbox: the CNAME chain that
// starts at name, then the A and AAAA records of its last name that are
// not closed; each address learned under rule.
func (r *Resolver) keep(answer []dns.RR, name string, rule Rule) ([]dns.RR, []Learned) {
	var out []dns.RR
	cur := dns.Fqdn(name)
	for hops := 0; hops < 16; hops++ {
		var next string
		for _, rr := range answer {
			if c, ok := rr.(*dns.CNAME); ok && strings.EqualFold(c.Hdr.Name, cur) {
				out = append(out, rr)
				next = c.Target
				break
			}
		}
		if next == "" {
			break
		}
		cur = next
	}
	maxAddrs := r.MaxAddrs
	if maxAddrs == 0 {
		maxAddrs = 32
	}
	var learned []Learned
	now := time.Now()
	for _, rr := range answer {
		if !strings.EqualFold(rr.Header().Name, cur) || len(learned) >= maxAddrs {
			continue
		}
		var ip net.IP
		switch a := rr.(type) {
		case *dns.A:
			ip = a.A
		case *dns.AAAA:
			ip = a.AAAA
		default:
			continue
		}
		addr, ok := netip.AddrFromSlice(ip)
		if !ok {
			continue
		}
		addr = addr.Unmap()
		if addr.IsLoopback() || addr.IsUnspecified() || r.Closed != nil && r.Closed(addr) {
			continue
		}
		ttl := max(time.Duration(rr.Header().Ttl)*time.Second, r.MinTTL)
		learned = append(learned, Learned{Addr: addr, Rule: rule.Index, Name: name, Expires: now.Add(ttl + r.Grace)})
		out = append(out, rr)
	}
	return out, learned
}

// ask puts one question to the upstream servers in turn, over UDP and,
// when its answer is truncated, TCP.
func (r *Resolver) ask(ctx context.Context, name string, qtype uint16) (*dns.Msg, error) {
	if len(r.Upstream) == 0 {
		return nil, errors.New("no upstream DNS server")
	}
	m := new(dns.Msg)
	m.SetQuestion(name, qtype)
	m.SetEdns0(dns.DefaultMsgSize, false)
	timeout := r.Timeout
	if timeout == 0 {
		timeout = 2 * time.Second
	}
	var errs []error
	for _, s := range r.Upstream {
		c := &dns.Client{Net: "udp", Timeout: timeout}
		in, _, err := c.ExchangeContext(ctx, m, s)
		if err == nil && in.Truncated {
			c.Net = "tcp"
			in, _, err = c.ExchangeContext(ctx, m, s)
		}
		if err == nil && in.Id != m.Id {
			err = fmt.Errorf("an answer to another question")
		}
		if err == nil {
			return in, nil
		}
		errs = append(errs, fmt.Errorf("%s: %w", s, err))
	}
	return nil, errors.Join(errs...)
}

// Handler serves a sandbox's queries: rules says its policy's domain
// rules now (a policy applied live changes them), learn takes what an
// answer teaches.
func (r *Resolver) Handler(rules func() []Rule, learn func([]Learned) error) dns.Handler {
	return dns.HandlerFunc(func(w dns.ResponseWriter, q *dns.Msg) {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		reply := r.Answer(ctx, q, rules(), learn)
		if _, udp := w.RemoteAddr().(*net.UDPAddr); udp {
			size := dns.MinMsgSize
			if o := q.IsEdns0(); o != nil {
				size = max(int(o.UDPSize()), dns.MinMsgSize)
				reply.SetEdns0(uint16(min(size, dns.DefaultMsgSize)), false)
			}
			reply.Truncate(size)
		}
		w.WriteMsg(reply)
	})
}

// Serve serves h on pc (UDP) and l (TCP) until stop, which waits up to
// a second for the queries in flight.
func Serve(pc net.PacketConn, l net.Listener, h dns.Handler) (stop func()) {
	var servers []*dns.Server
	for _, s := range []*dns.Server{{PacketConn: pc, Handler: h}, {Listener: l, Handler: h}} {
		started := make(chan struct{})
		s.NotifyStartedFunc = func() { close(started) }
		go s.ActivateAndServe()
		<-started
		servers = append(servers, s)
	}
	return func() {
		for _, s := range servers {
			ctx, cancel := context.WithTimeout(context.Background(), time.Second)
			s.ShutdownContext(ctx)
			cancel()
		}
	}
}
