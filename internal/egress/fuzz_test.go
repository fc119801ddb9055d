package egress

import (
	"context"
	"crypto/tls"
	"errors"
	"net"
	"net/netip"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/miekg/dns"
)

// FuzzParseHello: no input panics the parser or makes it claim bytes it
// was not given; a hello it reads reads the same from its own bytes.
func FuzzParseHello(f *testing.F) {
	b := clientHello(f, &tls.Config{ServerName: "allowed.test"})
	f.Add(b)
	f.Add(b[:100])
	f.Add([]byte{recordHandshake, 3, 1, 0, 4, typeClientHello, 0, 0, 0})
	f.Fuzz(func(t *testing.T, b []byte) {
		h, err := ParseHello(b)
		if err != nil {
			return
		}
		if h.Len <= 0 || h.Len > len(b) {
			t.Fatalf("a hello of %d bytes in %d", h.Len, len(b))
		}
		if again, err := ParseHello(b[:h.Len]); err != nil || again != h {
			t.Fatalf("its own bytes: %+v %v, was %+v", again, err, h)
		}
		if _, err := ParseHello(b[:h.Len-1]); !errors.Is(err, ErrShort) {
			t.Fatalf("its bytes but the last: %v", err)
		}
		// A HelloReader given the bytes a few at a time: short until
		// they are all in, then the same hello.
		var r HelloReader
		step := 1 + int(b[0])%13
		for n := step; ; n += step {
			got, err := r.Parse(b[:min(n, h.Len)])
			if n >= h.Len {
				if err != nil || got != h {
					t.Fatalf("read %d bytes at a time: %+v %v, want %+v", step, got, err, h)
				}
				break
			}
			if !errors.Is(err, ErrShort) {
				t.Fatalf("read %d bytes at a time, the first %d: %v", step, n, err)
			}
		}
	})
}

// FuzzParseRequest: no input panics it; a host it finds is one line's.
func FuzzParseRequest(f *testing.F) {
	f.Add([]byte("GET / HTTP/1.1\r\nHost: allowed.test:80\r\n\r\n"))
	f.Add([]byte("GET http://a.test/ HTTP/1.1\r\nHost: b.test\r\n\r\n"))
	f.Fuzz(func(t *testing.T, b []byte) {
		r, err := ParseRequest(b)
		if err != nil {
			return
		}
		if r.Host == "" || strings.ContainsAny(r.Host, "\r\n ") || r.Len > len(b) {
			t.Fatalf("%q: %+v", b, r)
		}
	})
}

// FuzzPattern: a pattern reads back from its String; its match agrees
// with matching label by label; a name Normalize accepts is a fixed
// point of it.
func FuzzPattern(f *testing.F) {
	for _, s := range []string{"allowed.test", "*.a.test", "**.b.c.test", "Bücher.example", "*.com"} {
		f.Add(s, "x.a.test")
	}
	f.Fuzz(func(t *testing.T, pat, name string) {
		if n, err := Normalize(name); err == nil {
			if again, err := Normalize(n); err != nil || again != n {
				t.Fatalf("Normalize(%q) = %q, and of that %q, %v", name, n, again, err)
			}
			name = n
		}
		p, err := ParsePattern(pat)
		if err != nil {
			return
		}
		if q, err := ParsePattern(p.String()); err != nil || q != p {
			t.Fatalf("%q reads back as %+v, %v", p.String(), q, err)
		}
		want := false
		nl, pl := strings.Split(name, "."), strings.Split(p.Name, ".")
		if extra := len(nl) - len(pl); extra >= 0 && strings.Join(nl[extra:], ".") == p.Name {
			switch p.Depth {
			case Exact:
				want = extra == 0
			case One:
				want = extra == 1 && nl[0] != ""
			case Any:
				want = extra >= 1 && !strings.Contains(strings.Join(nl[:extra], "."), "..") && nl[0] != "" && nl[extra-1] != ""
			}
		}
		if got := p.Match(name); got != want {
			t.Fatalf("%v matches %q: %v, label by label %v", p, name, got, want)
		}
	})
}

// FuzzAnswer: no query a sandbox sends panics the resolver, and each
// gets a reply to it that a name no rule allows never gets past.
func FuzzAnswer(f *testing.F) {
	for _, n := range []string{"allowed.test.", "evil.test.", "a.sub.allowed.test."} {
		q := new(dns.Msg)
		q.SetQuestion(n, dns.TypeA)
		b, _ := q.Pack()
		f.Add(b)
	}
	r := &Resolver{} // no upstream: an allowed name's answer is SERVFAIL
	rs := []Rule{{Pattern: Pattern{Exact, "allowed.test"}}, {Pattern: Pattern{Any, "sub.allowed.test"}, Index: 1}}
	f.Fuzz(func(t *testing.T, b []byte) {
		q := new(dns.Msg)
		if q.Unpack(b) != nil {
			return
		}
		m := r.Answer(context.Background(), q, rs, func([]Learned) error { t.Fatal("learned with no upstream"); return nil })
		if m.Id != q.Id || !m.Response || len(m.Answer) != 0 {
			t.Fatalf("%v -> %v", q, m)
		}
		if _, err := m.Pack(); err != nil {
			t.Fatalf("the reply does not pack: %v", err)
		}
	})
}

// FuzzHandle: the proxy's whole read path, on bytes a sandbox sends in
// pieces of any size: it never panics or hangs, refuses each connection
// once (no upstream here), looks up only a name a rule allows, and only
// when the bytes sent, read whole, name it: the pieces never change
// what it decides.
func FuzzHandle(f *testing.F) {
	hello := clientHello(f, &tls.Config{ServerName: "allowed.test"})
	f.Add(hello, uint8(6), true)
	f.Add(hello[:len(hello)/2], uint8(255), true)
	f.Add(clientHello(f, &tls.Config{ServerName: "Allowed.Test."}), uint8(0), true)
	f.Add([]byte("GET / HTTP/1.1\r\nHost: allowed.test:80\r\n\r\n"), uint8(2), false)
	f.Add([]byte("GET / HTTP/1.1\r\nHost: evil.test\r\n\r\n"), uint8(9), false)
	f.Fuzz(func(t *testing.T, b []byte, piece uint8, tlsPort bool) {
		port := uint16(PortHTTP)
		if tlsPort {
			port = PortHTTPS
		}
		var mu sync.Mutex
		var looked []string
		refused := 0
		p := &Proxy{
			Allow: func(n string, pt uint16) bool { return n == "allowed.test" && pt == port },
			Lookup: func(_ context.Context, n string) ([]netip.Addr, error) {
				mu.Lock()
				looked = append(looked, n)
				mu.Unlock()
				return nil, errors.New("no upstream here")
			},
			Timeout: 30 * time.Millisecond,
			Refused: func(netip.AddrPort, string, error) { mu.Lock(); refused++; mu.Unlock() },
		}
		client, server := net.Pipe()
		go func() { // (then closed: the proxy's wait on a silent client is TestProxyRefuses's)
			defer client.Close()
			for rest := b; len(rest) > 0; {
				n := min(len(rest), int(piece)+1)
				if _, err := client.Write(rest[:n]); err != nil {
					return
				}
				rest = rest[n:]
			}
		}()
		done := make(chan struct{})
		go func() { p.Handle(server, netip.AddrPortFrom(netip.MustParseAddr("192.0.2.1"), port)); close(done) }()
		select {
		case <-done:
		case <-time.After(5 * time.Second):
			t.Fatal("Handle did not return in 5 s")
		}
		mu.Lock()
		defer mu.Unlock()
		if refused != 1 || len(looked) > 1 || len(looked) == 1 && looked[0] != "allowed.test" {
			t.Fatalf("refused %d times, looked up %q", refused, looked)
		}
		// Read whole, what the bytes name.
		whole := ""
		if tlsPort {
			if h, err := ParseHello(b); err == nil && !h.ECH {
				whole = h.ServerName
			}
		} else if r, err := ParseRequest(b); err == nil {
			whole = r.Host
		}
		whole, _ = Normalize(whole)
		if (len(looked) == 1) != (whole == "allowed.test") {
			t.Fatalf("looked up %q; the bytes read whole name %q", looked, whole)
		}
	})
}
