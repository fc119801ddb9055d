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
)

// TestProxyRefuses: what the proxy refuses, and that it refuses in
// time: a client that never sends (slow), one that sends endless bytes,
// a hello for a name no rule allows, an encrypted hello, a request with
// no name; none is dialled anywhere.
func TestProxyRefuses(t *testing.T) {
	var mu sync.Mutex
	var why []string
	p := &Proxy{
		Allow: func(name string, port uint16) bool { return name == "allowed.test" && port == PortHTTPS },
		Lookup: func(context.Context, string) ([]netip.Addr, error) {
			t.Error("a refused connection was looked up")
			return nil, errors.New("no")
		},
		Timeout: 300 * time.Millisecond,
		Refused: func(_ netip.AddrPort, _ string, err error) { mu.Lock(); why = append(why, err.Error()); mu.Unlock() },
	}
	https := netip.MustParseAddrPort("192.0.2.1:443")
	http := netip.MustParseAddrPort("192.0.2.1:80")
	for _, c := range []struct {
		name string
		dst  netip.AddrPort
		send func(net.Conn)
		want string
	}{
		{"slow", https, func(net.Conn) {}, "timeout"},
		{"endless", https, func(c net.Conn) {
			rec := []byte{recordHandshake, 3, 1, 0x40, 0}
			c.Write(append(rec, typeClientHello, 0, 0xff, 0xff))
			for {
				if _, err := c.Write(append(rec, make([]byte, 0x4000)...)); err != nil {
					return
				}
			}
		}, "ClientHello of"},
		{"evil", https, func(c net.Conn) { tls.Client(c, &tls.Config{ServerName: "evil.test"}).Handshake() }, "no rule allows evil.test"},
		{"no name", https, func(c net.Conn) {
			tls.Client(c, &tls.Config{ServerName: "192.0.2.1", InsecureSkipVerify: true}).Handshake()
		}, "without a server name"},
		{"no host", http, func(c net.Conn) { c.Write([]byte("GET / HTTP/1.0\r\n\r\n")) }, "host"},
	} {
		client, server := net.Pipe()
		go c.send(client)
		start := time.Now()
		p.Handle(server, c.dst)
		client.Close()
		if took := time.Since(start); took > 2*time.Second {
			t.Errorf("%s: refused after %v", c.name, took)
		}
		mu.Lock()
		last := ""
		if len(why) > 0 {
			last = why[len(why)-1]
		}
		why = nil
		mu.Unlock()
		if !strings.Contains(last, c.want) {
			t.Errorf("%s: refused for %q, want %q", c.name, last, c.want)
		}
	}
}
