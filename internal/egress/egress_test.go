package egress

import (
	"crypto/tls"
	"encoding/binary"
	"errors"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/dsec-project/dsec/internal/egress/egresstest"
)

func TestNormalize(t *testing.T) {
	for in, want := range map[string]string{
		"allowed.test":        "allowed.test",
		"ALLOWED.TEST.":       "allowed.test",
		"Bücher.example":      "xn--bcher-kva.example",
		"xn--bcher-kva.EXAMP": "xn--bcher-kva.examp",
		"_srv._tcp.x.test":    "_srv._tcp.x.test",
		"a-b.c1.test":         "a-b.c1.test",
		"localhost":           "localhost",
	} {
		if got, err := Normalize(in); err != nil || got != want {
			t.Errorf("Normalize(%q) = %q, %v; want %q", in, got, err, want)
		}
	}
	for _, in := range []string{"", ".", "a..b", "-a.test", "a-.test", "a b.test", "a/b.test", "10.0.0.1", "1.2.3",
		"::1", "[::1]", "a.test:443", strings.Repeat("a", 64) + ".test", strings.Repeat("abcdefgh.", 32) + "test",
		"a\x00.test", "evil.test\n", "*.test"} {
		if got, err := Normalize(in); err == nil {
			t.Errorf("Normalize(%q) = %q, want an error", in, got)
		}
	}
}

// TestPattern is the brief's name table: exact names, one-label and
// any-depth wildcards, look-alikes that must not match.
func TestPattern(t *testing.T) {
	type row struct {
		name string
		want bool
	}
	for pat, rows := range map[string][]row{
		"allowed.test": {{"allowed.test", true}, {"a.allowed.test", false}, {"allowed.test.evil.test", false},
			{"evilallowed.test", false}, {"allowed.tes", false}},
		"*.allowed.test": {{"a.allowed.test", true}, {"allowed.test", false}, {"a.b.allowed.test", false},
			{"evilallowed.test", false}, {"a.allowed.test.evil.test", false}, {"xn--bcher-kva.allowed.test", true}},
		"**.githubusercontent.com": {{"raw.githubusercontent.com", true}, {"a.b.c.githubusercontent.com", true},
			{"githubusercontent.com", false}, {"evilgithubusercontent.com", false}},
		"*.Bücher.example.": {{"a.xn--bcher-kva.example", true}, {"xn--bcher-kva.example", false}},
	} {
		p, err := ParsePattern(pat)
		if err != nil {
			t.Fatalf("ParsePattern(%q): %v", pat, err)
		}
		if q, err := ParsePattern(p.String()); err != nil || q != p {
			t.Errorf("%q: its String %q reads back as %+v, %v", pat, p.String(), q, err)
		}
		for _, r := range rows {
			n, err := Normalize(r.name)
			if err != nil {
				t.Fatal(err)
			}
			if p.Match(n) != r.want {
				t.Errorf("%q matches %q: %v, want %v", pat, r.name, !r.want, r.want)
			}
		}
	}
	for _, pat := range []string{"*", "**", "*.com", "**.test", "*.", "a.*.test", "*a.test", "a*.test", "***.a.test",
		"*.*.a.test", "", "1.2.3.4", "*.a..test"} {
		if p, err := ParsePattern(pat); err == nil {
			t.Errorf("ParsePattern(%q) = %+v, want an error", pat, p)
		}
	}
}

// clientHello is the first flight of Go's TLS client with cfg, as it
// sends it.
func clientHello(t testing.TB, cfg *tls.Config) []byte {
	t.Helper()
	c, s := net.Pipe()
	defer s.Close()
	go func() {
		tls.Client(c, cfg).Handshake()
		c.Close()
	}()
	var b []byte
	buf := make([]byte, 4096)
	s.SetDeadline(time.Now().Add(5 * time.Second))
	for {
		n, err := s.Read(buf)
		b = append(b, buf[:n]...)
		if _, perr := ParseHello(b); !errors.Is(perr, ErrShort) {
			return b
		}
		if err != nil {
			t.Fatalf("the client's hello: %v after %d bytes", err, len(b))
		}
	}
}

// reframe puts a hello's handshake message into records of at most n
// bytes each.
func reframe(t *testing.T, b []byte, n int) []byte {
	t.Helper()
	var msg []byte
	for len(b) > 0 {
		l := int(binary.BigEndian.Uint16(b[3:5]))
		msg = append(msg, b[5:5+l]...)
		b = b[5+l:]
	}
	var out []byte
	for len(msg) > 0 {
		k := min(n, len(msg))
		out = append(out, recordHandshake, 3, 1, byte(k>>8), byte(k))
		out = append(out, msg[:k]...)
		msg = msg[k:]
	}
	return out
}

func TestParseHello(t *testing.T) {
	b := clientHello(t, &tls.Config{ServerName: "Allowed.Test"})
	h, err := ParseHello(b)
	if err != nil || h.ServerName != "Allowed.Test" || h.ECH || h.Len != len(b) {
		t.Fatalf("ParseHello: %+v %v (%d bytes)", h, err, len(b))
	}
	// Go's hello carries a post-quantum key share: more than a packet.
	if len(b) < 1500 {
		t.Errorf("Go's ClientHello is %d bytes: the test means one larger than a packet", len(b))
	}
	// A byte at a time: short until its last.
	for i := range len(b) - 1 {
		if _, err := ParseHello(b[:i]); !errors.Is(err, ErrShort) {
			t.Fatalf("the first %d bytes: %v, want ErrShort", i, err)
		}
	}
	// What follows the hello is not its.
	if h2, err := ParseHello(append(b[:len(b):len(b)], "more"...)); err != nil || h2 != h {
		t.Errorf("the hello and more: %+v %v", h2, err)
	}
	// Across records, one handshake message.
	for _, n := range []int{1, 7, 100, 512} {
		r := reframe(t, b, n)
		h, err := ParseHello(r)
		if err != nil || h.ServerName != "Allowed.Test" || h.Len != len(r) {
			t.Errorf("in records of %d bytes: %+v %v", n, h, err)
		}
	}
	// No name: a client to an address sends none.
	if h, err := ParseHello(clientHello(t, &tls.Config{ServerName: "192.0.2.1"})); err != nil || h.ServerName != "" {
		t.Errorf("a hello to an address: %+v %v", h, err)
	}
	// Not a hello.
	for _, bad := range [][]byte{
		[]byte("GET / HTTP/1.1\r\nHost: a.test\r\n\r\n"),
		{recordHandshake, 3, 1, 0, 0},
		{recordHandshake, 3, 1, 0, 4, 2, 0, 0, 0}, // a ServerHello
		{23, 3, 3, 0, 1, 0},                       // application data
		{recordHandshake, 3, 1, 0, 4, typeClientHello, 0, 0, 0},
		append([]byte{recordHandshake, 3, 1, 0, 5}, typeClientHello, 0xff, 0xff, 0xff, 0),
	} {
		if h, err := ParseHello(bad); err == nil || errors.Is(err, ErrShort) {
			t.Errorf("ParseHello(%q) = %+v, %v: want an error", bad, h, err)
		}
	}
	// A slow or endless stream of records is cut at MaxHello.
	endless := []byte{recordHandshake, 3, 1, 0x40, 0, typeClientHello, 0, 0xff, 0xff}
	endless = append(endless, make([]byte, 0x4000-4)...)
	for len(endless) < 2*MaxHello {
		endless = append(endless, recordHandshake, 3, 1, 0x40, 0)
		endless = append(endless, make([]byte, 0x4000)...)
	}
	if _, err := ParseHello(endless); err == nil || errors.Is(err, ErrShort) {
		t.Errorf("a hello past MaxHello: %v", err)
	}
}

func TestParseHelloECH(t *testing.T) {
	b := clientHello(t, &tls.Config{ServerName: "evil.test", MinVersion: tls.VersionTLS13,
		EncryptedClientHelloConfigList: egresstest.ECHConfigList("allowed.test")})
	h, err := ParseHello(b)
	if err != nil || !h.ECH || h.ServerName != "allowed.test" {
		t.Fatalf("an ECH hello: %+v %v", h, err)
	}
}

func TestParseRequest(t *testing.T) {
	for in, want := range map[string]string{
		"GET / HTTP/1.1\r\nHost: Allowed.Test\r\n\r\n":                        "Allowed.Test",
		"GET / HTTP/1.1\r\nHost: allowed.test:8080\r\nX: y\r\n\r\nbody":       "allowed.test",
		"GET http://evil.test/ HTTP/1.1\r\nHost: allowed.test\r\n\r\n":        "evil.test",
		"POST /x HTTP/1.0\r\nhost: [2001:db8::1]:80\r\n\r\n":                  "2001:db8::1",
		"CONNECT allowed.test:443 HTTP/1.1\r\nHost: allowed.test:443\r\n\r\n": "allowed.test",
	} {
		r, err := ParseRequest([]byte(in))
		if err != nil || r.Host != want || r.Len != strings.Index(in, "\r\n\r\n")+4 {
			t.Errorf("ParseRequest(%q) = %+v, %v; want %q", in, r, err, want)
		}
	}
	for _, in := range []string{
		"GET / HTTP/1.1\r\n\r\n",
		"GET / HTTP/1.1\r\nHost: a.test\r\nHost: b.test\r\n\r\n",
		"\x16\x03\x01\x00\x05hello\r\n\r\n",
		"GET / HTTP/1.1\r\nHost: a test\r\n\r\n",
		"GET / HTTP/1.1\r\n Host: a.test\r\n\r\n",
	} {
		if r, err := ParseRequest([]byte(in)); err == nil {
			t.Errorf("ParseRequest(%q) = %+v: want an error", in, r)
		}
	}
	if _, err := ParseRequest([]byte("GET / HTTP/1.1\r\nHost: a.test\r\n")); !errors.Is(err, ErrShort) {
		t.Errorf("a head without its end: %v", err)
	}
	if _, err := ParseRequest([]byte(strings.Repeat("x", MaxHead))); err == nil || errors.Is(err, ErrShort) {
		t.Errorf("a head past MaxHead: %v", err)
	}
}
