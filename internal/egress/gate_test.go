package egress

import (
	"crypto/tls"
	"encoding/binary"
	"errors"
	"fmt"
	"net/netip"
	"strings"
	"testing"
	"time"
)

// conn writes the packets of one TCP connection between a sandbox and
// a server, as a gate sees them.
type conn struct {
	client, server netip.AddrPort
	isn, sisn      uint32
}

var (
	sandboxAddr = netip.MustParseAddrPort("10.200.0.2:40000")
	serverAddr  = netip.MustParseAddrPort("192.0.2.7:443")
)

func newConn() *conn {
	return &conn{client: sandboxAddr, server: serverAddr, isn: 0xfffffff0, sisn: 77} // (sequence numbers wrap)
}

// packet is an IPv4 TCP packet.
func packet(src, dst netip.AddrPort, seq, ack uint32, flags byte, payload []byte) []byte {
	p := make([]byte, 40, 40+len(payload))
	p[0] = 0x45
	binary.BigEndian.PutUint16(p[2:4], uint16(40+len(payload)))
	p[8], p[9] = 64, 6
	copy(p[12:16], src.Addr().AsSlice())
	copy(p[16:20], dst.Addr().AsSlice())
	t := p[20:]
	binary.BigEndian.PutUint16(t[0:2], src.Port())
	binary.BigEndian.PutUint16(t[2:4], dst.Port())
	binary.BigEndian.PutUint32(t[4:8], seq)
	binary.BigEndian.PutUint32(t[8:12], ack)
	t[12], t[13] = 5<<4, flags
	return append(p, payload...)
}

// data is the client's segment of b at offset off of its stream.
func (c *conn) data(off int, b []byte) []byte {
	return packet(c.client, c.server, c.isn+1+uint32(off), c.sisn+1, tcpACK, b)
}

// ack is the server's acknowledgement of the client's first n bytes.
func (c *conn) ack(n int) []byte {
	return packet(c.server, c.client, c.sisn+1, c.isn+1+uint32(n), tcpACK, nil)
}

// gateFor is a gate whose sandbox is allowed names and may reach them
// at serverAddr; it records what it was told.
func gateFor(names ...string) (*Gate, *[]string) {
	var log []string
	g := &Gate{
		IsClient: func(a netip.Addr) bool { return a == sandboxAddr.Addr() },
		Decide: func(f Flow, name string) error {
			for _, n := range names {
				if n == name {
					return nil
				}
			}
			return fmt.Errorf("no rule allows %s", name)
		},
		Passed: func(f Flow, name string) { log = append(log, "passed "+name) },
		Killed: func(f Flow, name string, why error) { log = append(log, "killed: "+why.Error()) },
	}
	return g, &log
}

func TestGate(t *testing.T) {
	hello := clientHello(t, &tls.Config{ServerName: "allowed.test"})
	evil := clientHello(t, &tls.Config{ServerName: "evil.test"})
	now := time.Now()
	type step struct {
		pkt  func(c *conn) []byte
		want Verdict
	}
	whole := func(h []byte) step { return step{func(c *conn) []byte { return c.data(0, h) }, Accept} }
	handshake := step{func(c *conn) []byte { return packet(c.client, c.server, c.isn+1, c.sisn+1, tcpACK, nil) }, Accept}
	for _, tc := range []struct {
		name  string
		steps []step
		log   string
	}{
		{"passes once the server has the hello", []step{handshake, whole(hello),
			{func(c *conn) []byte { return c.ack(len(hello) - 1) }, Accept},  // not all of it yet
			{func(c *conn) []byte { return c.data(0, hello[:100]) }, Accept}, // sent again, the same
			{func(c *conn) []byte { return c.ack(len(hello)) }, Pass},
			{func(c *conn) []byte { return c.data(len(hello), []byte("after")) }, Accept}, // queued before the pass
		}, "passed allowed.test"},
		{"a hello in segments of 7 bytes, the first without a handshake ACK before it", func() []step {
			var s []step
			for off := 0; off < len(hello); off += 7 {
				seg := hello[off:min(off+7, len(hello))]
				s = append(s, step{func(c *conn) []byte { return c.data(off, seg) }, Accept})
			}
			return append(s, step{func(c *conn) []byte { return c.ack(len(hello)) }, Pass})
		}(), "passed allowed.test"},
		{"a name no rule allows", []step{handshake, {func(c *conn) []byte { return c.data(0, evil) }, Kill},
			{func(c *conn) []byte { return c.ack(len(evil)) }, Kill}}, "killed: no rule allows evil.test|killed: a server's packet of a flow the gate does not know"},
		{"the allowed hello's bytes sent again as another's", []step{whole(hello),
			{func(c *conn) []byte { return c.data(0, evil) }, Kill}}, "killed: a segment that overlaps the hello with other bytes"},
		{"a segment out of order", []step{{func(c *conn) []byte { return c.data(100, hello[100:]) }, Kill}}, "killed: a segment out of order"},
		{"bytes before the stream's start", []step{{func(c *conn) []byte {
			return packet(c.client, c.server, c.isn-9, c.sisn+1, tcpACK, append(make([]byte, 10), hello...))
		}, Kill}}, "killed: a segment before the stream's start"},
		{"urgent data", []step{{func(c *conn) []byte {
			p := c.data(0, hello)
			p[33] |= tcpURG
			return p
		}, Kill}}, "killed: urgent data in the hello"},
		{"a SYN with another sequence number", []step{handshake, {func(c *conn) []byte {
			return packet(c.client, c.server, c.isn+5, 0, tcpSYN, nil)
		}, Kill}}, "killed: a SYN in an open flow"},
		{"the SYN sent again, and with data", []step{
			{func(c *conn) []byte { return packet(c.client, c.server, c.isn, 0, tcpSYN, nil) }, Accept},
			{func(c *conn) []byte { return packet(c.client, c.server, c.isn, 0, tcpSYN, hello) }, Drop},
			whole(hello)}, ""},
		{"a FIN before the hello is whole", []step{{func(c *conn) []byte {
			p := c.data(0, hello[:50])
			p[33] |= tcpFIN
			return p
		}, Kill}}, "killed: the connection ended before its hello"},
		{"no hello", []step{{func(c *conn) []byte { return c.data(0, []byte("GET / HTTP/1.1\r\n\r\n")) }, Kill}}, "killed: a TLS record of type 71"},
		{"a server's packet first", []step{{func(c *conn) []byte { return c.ack(0) }, Kill}}, "killed: a server's packet"},
		{"a reset before the pass", []step{whole(hello[:20]), {func(c *conn) []byte { return packet(c.client, c.server, c.isn+21, 0, tcpRST, nil) }, Kill}},
			"killed: reset by the client"},
		{"a reset by the server", []step{whole(hello[:20]), {func(c *conn) []byte { return packet(c.server, c.client, c.sisn+1, 0, tcpRST, nil) }, Kill}},
			"killed: reset by the server"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			g, log := gateFor("allowed.test")
			c := newConn()
			for i, s := range tc.steps {
				if got := g.Packet(s.pkt(c), c.isn, now); got != s.want {
					t.Fatalf("packet %d: %v, want %v (%q)", i, got, s.want, *log)
				}
			}
			got := strings.Join(*log, "|")
			if !strings.HasPrefix(got, tc.log) || tc.log == "" && got != "" {
				t.Errorf("told %q, want %q", got, tc.log)
			}
		})
	}
}

// TestGateExpire: a flow undecided past the timeout is killed at its
// next packet (never taken for a new flow from its next bytes); one
// passed is forgotten; a client's flows are bounded.
func TestGateExpire(t *testing.T) {
	hello := clientHello(t, &tls.Config{ServerName: "allowed.test"})
	evil := clientHello(t, &tls.Config{ServerName: "evil.test"})
	g, log := gateFor("allowed.test")
	now := time.Now()
	c := newConn()
	if v := g.Packet(c.data(0, evil[:10]), c.isn, now); v != Accept {
		t.Fatal(v)
	}
	if dead := g.Expire(now.Add(11 * time.Second)); len(dead) != 1 || dead[0] != (Flow{Client: c.client, Server: c.server}) {
		t.Fatalf("expired: %v", dead)
	}
	// The allowed hello from the start, before the host killed the
	// flow: killed, not read as a new flow's.
	if v := g.Packet(c.data(0, hello), c.isn, now.Add(12*time.Second)); v != Kill || g.Len() != 0 {
		t.Fatalf("after the timeout: %v, %d flows (%q)", v, g.Len(), *log)
	}
	// Dead until forgotten, then gone.
	g.Packet(c.data(0, evil[:10]), c.isn, now)
	g.Expire(now.Add(11 * time.Second))
	if g.Len() != 1 {
		t.Fatalf("%d flows after the second expiry", g.Len())
	}
	g.ForgetFlow(Flow{Client: c.client, Server: c.server})
	if g.Len() != 0 {
		t.Fatalf("%d flows after ForgetFlow", g.Len())
	}
	d := &conn{client: netip.MustParseAddrPort("10.200.0.2:40001"), server: serverAddr, isn: 5}
	g.Packet(d.data(0, hello), d.isn, now)
	if v := g.Packet(d.ack(len(hello)), d.isn, now); v != Pass {
		t.Fatal(v)
	}
	g.Expire(now.Add(11 * time.Second))
	if g.Len() != 0 {
		t.Errorf("a passed flow is remembered past the timeout")
	}
	for i := range MaxGatedPerClient + 1 {
		e := &conn{client: netip.AddrPortFrom(sandboxAddr.Addr(), uint16(1000+i)), server: serverAddr, isn: 5}
		want := Accept
		if i == MaxGatedPerClient {
			want = Kill
		}
		if v := g.Packet(e.data(0, hello[:10]), e.isn, now); v != want {
			t.Fatalf("flow %d: %v, want %v", i, v, want)
		}
	}
	g.Forget(sandboxAddr.Addr())
	if g.Len() != 0 {
		t.Errorf("%d flows after the sandbox's are forgotten", g.Len())
	}
}

// FuzzGate: whatever packets come, in whatever order, the gate never
// passes a flow whose server may have taken a hello it did not decide
// on: every byte the server acknowledged went through the gate, equal
// to what it read, and the hello it read is allowed.
func FuzzGate(f *testing.F) {
	hello := clientHello(f, &tls.Config{ServerName: "allowed.test"})
	evil := clientHello(f, &tls.Config{ServerName: "evil.test"})
	f.Add(hello, uint16(0), uint16(200), uint16(len(hello)), byte(tcpACK), uint16(len(hello)))
	f.Add(evil, uint16(0), uint16(7), uint16(len(evil)), byte(tcpACK|tcpURG), uint16(3))
	f.Fuzz(func(t *testing.T, stream []byte, first, size, last uint16, flags byte, acked uint16) {
		if len(stream) == 0 {
			return
		}
		g, _ := gateFor("allowed.test")
		c := newConn()
		now := time.Now()
		// What the server took, in stream order, from what the gate
		// let through.
		var server []byte
		send := func(off int, b []byte, fl byte) {
			p := packet(c.client, c.server, c.isn+1+uint32(off), c.sisn+1, fl, b)
			v := g.Packet(p, c.isn, now)
			if (v == Accept || v == Pass) && off <= len(server) && off+len(b) > len(server) {
				server = append(server, b[len(server)-off:]...)
			}
		}
		// Segments from first, of size, then one at last (it may go
		// back), with flags on the last.
		step := max(int(size)%len(stream), 1)
		for off := int(first) % len(stream); off < len(stream); off += step {
			send(off, stream[off:min(off+step, len(stream))], tcpACK)
		}
		off := int(last) % len(stream)
		send(off, stream[off:], flags&^(tcpSYN|tcpRST))
		n := min(int(acked), len(server))
		if v := g.Packet(c.ack(n), c.isn, now); v == Pass {
			h, err := ParseHello(server)
			if err != nil || h.ServerName != "allowed.test" || h.ECH || h.Len > n {
				t.Fatalf("passed, the server having taken %q (%v)", server[:n], errors.Join(err))
			}
		}
	})
}
