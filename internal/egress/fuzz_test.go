package egress

import (
	"context"
	"crypto/tls"
	"errors"
	"strings"
	"testing"

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
