package egress

import (
	"encoding/binary"
	"errors"
	"fmt"
	"net/netip"
	"time"
)

// A Gate is the fast path of a sandbox's HTTPS: a connection to an
// address the sandbox's resolver answered it for a name (the host knows
// the pair) is not redirected to the Proxy but let through, and its
// packets after the SYN are queued to the Gate, both ways (but the
// server's SYN-ACK), until the Gate has decided it; the host keeps the
// SYN's sequence number and hands it over with each. The client's bytes
// must come in order from there, and they go on as they come, but for
// the segment that completes its ClientHello: on that one, Decide says
// whether the hello's name may go to that address (a domain rule allows
// the name, and the address is one the sandbox's resolver answered for
// that very name). Allowed, it goes on; refused, the connection is
// killed (the host resets it both ways), and the server never had a
// whole hello. Until the server acknowledges the hello's last byte,
// every segment over bytes already seen must carry the very same bytes,
// so what the server takes is what the Gate read (a segment the server
// dropped — a bad checksum, an old timestamp, a TTL that ran out —
// cannot be followed by other bytes). Then the flow passes: the host
// lets the rest of it through in the kernel, unread.
//
// The bytes before the hello's last segment reach the server undecided:
// only a server at an address the sandbox's resolver gave it for an
// allowed name, which its allowed connections reach with any bytes, and
// never a whole hello. They are not held because a client that leaves
// Nagle's algorithm on sends a hello's last, short segment only once
// the server acknowledged the one before.
//
// What ends a flow (Kill): a segment out of order (bytes before it the
// Gate did not see: let through before it knew the flow) or overlapping
// seen bytes with others, urgent data (a server takes it out of the
// stream), a SYN with another sequence number, a FIN or reset before
// the hello is whole, a hello that is no hello, has no name, hides its
// name (ECH) or exceeds MaxHello, a server's packet of a flow the Gate
// does not know, a reset either way before the flow passed (the reset
// goes on), a flow not passed after Timeout, and a client's flow past
// MaxGatedPerClient under way at once. Data in a SYN (TCP Fast Open)
// is dropped: the client sends it again after the handshake.

// Verdict is what becomes of one queued packet.
type Verdict uint8

const (
	// Accept lets the packet go on; its flow stays queued.
	Accept Verdict = iota
	// Pass lets the packet go on and the rest of its flow unqueued.
	Pass
	// Drop drops the packet.
	Drop
	// Kill drops the packet and ends its flow: the host resets it.
	Kill
)

func (v Verdict) String() string {
	return [...]string{"accept", "pass", "drop", "kill"}[v]
}

// Flow is a connection as the Gate knows it: its client (the sandbox's
// end) and server.
type Flow struct {
	Client, Server netip.AddrPort
}

// Gate decides a sandbox's HTTPS flows by their hello (see above). Not
// safe for concurrent use.
type Gate struct {
	// Decide says whether the flow's hello, naming name (ASCII form),
	// may go to its server: nil, or why not.
	Decide func(f Flow, name string) error
	// IsClient says whether an address is a client's (a sandbox's).
	IsClient func(netip.Addr) bool
	// Passed, if set, is told of each flow passed, with its name.
	Passed func(f Flow, name string)
	// Killed, if set, is told of each flow killed, and why.
	Killed func(f Flow, name string, why error)
	// Timeout bounds how long a flow may stay undecided (default 10 s).
	Timeout time.Duration

	flows   map[Flow]*gated
	clients map[netip.Addr]int // flows by client address
}

// gated is a flow in the Gate.
type gated struct {
	isn     uint32 // the client's initial sequence number
	buf     []byte // the client's bytes from isn+1 up to its hello's end
	hello   HelloReader
	name    string // decided: the hello's name
	decided bool
	passed  bool      // its packets queued before the pass still come
	dead    bool      // not decided in time: its next packet is killed
	since   time.Time // its first packet's, or its pass's
}

// MaxGated bounds the flows a Gate tracks at once, MaxGatedPerClient
// those of one client: a new one past either is killed.
const (
	MaxGated          = 1 << 16
	MaxGatedPerClient = 1024
)

// TCP flags.
const (
	tcpFIN = 0x01
	tcpSYN = 0x02
	tcpRST = 0x04
	tcpACK = 0x10
	tcpURG = 0x20
)

// segment is what the Gate reads of an IPv4 TCP packet.
type segment struct {
	src, dst netip.AddrPort
	seq, ack uint32
	flags    uint8
	payload  []byte
}

// parseSegment reads an IPv4 packet carrying a whole TCP segment.
func parseSegment(p []byte) (segment, error) {
	if len(p) < 20 || p[0]>>4 != 4 {
		return segment{}, errors.New("not an IPv4 packet")
	}
	ihl := int(p[0]&0x0f) * 4
	total := int(binary.BigEndian.Uint16(p[2:4]))
	switch {
	case ihl < 20 || total < ihl || total > len(p):
		return segment{}, fmt.Errorf("an IPv4 header of %d bytes in a packet of %d (%d here)", ihl, total, len(p))
	case p[9] != 6:
		return segment{}, fmt.Errorf("IP protocol %d, not TCP", p[9])
	case binary.BigEndian.Uint16(p[6:8])&0x3fff != 0:
		return segment{}, errors.New("a fragment")
	}
	t := p[ihl:total]
	if len(t) < 20 {
		return segment{}, errors.New("a TCP header cut short")
	}
	doff := int(t[12]>>4) * 4
	if doff < 20 || doff > len(t) {
		return segment{}, fmt.Errorf("a TCP header of %d bytes in a segment of %d", doff, len(t))
	}
	src, dst := netip.AddrFrom4([4]byte(p[12:16])), netip.AddrFrom4([4]byte(p[16:20]))
	return segment{
		src:     netip.AddrPortFrom(src, binary.BigEndian.Uint16(t[0:2])),
		dst:     netip.AddrPortFrom(dst, binary.BigEndian.Uint16(t[2:4])),
		seq:     binary.BigEndian.Uint32(t[4:8]),
		ack:     binary.BigEndian.Uint32(t[8:12]),
		flags:   t[13],
		payload: t[doff:],
	}, nil
}

// Packet takes a queued packet (an IPv4 packet of a gated flow, either
// way) and the sequence number of its flow's first SYN (the host keeps
// it: the SYN itself is not queued), and says what becomes of it.
func (g *Gate) Packet(pkt []byte, isn uint32, now time.Time) Verdict {
	s, err := parseSegment(pkt)
	if err != nil {
		return Drop
	}
	if g.flows == nil {
		g.flows = map[Flow]*gated{}
		g.clients = map[netip.Addr]int{}
	}
	for _, f := range []Flow{{Client: s.src, Server: s.dst}, {Client: s.dst, Server: s.src}} {
		switch fl := g.flows[f]; {
		case fl == nil:
			continue
		case fl.passed:
			return Accept
		case fl.dead:
			g.forget(f) // killed: the host resets the rest
			return Kill
		case f.Client == s.src:
			return g.fromClient(f, fl, s)
		default:
			return g.fromServer(f, fl, s, now)
		}
	}
	// A flow the Gate does not know yet: its client's packet after its
	// SYN (what the client sent before reached the server only through
	// the Gate, so bytes of it before this one end the flow as out of
	// order, whoever let them through), or a flow it forgot.
	f := Flow{Client: s.src, Server: s.dst}
	switch {
	case s.flags&tcpRST != 0:
		return Accept
	case !g.IsClient(s.src.Addr()):
		return g.kill(nil, Flow{Client: s.dst, Server: s.src}, errors.New("a server's packet of a flow the gate does not know"))
	case g.clients[s.src.Addr()] >= MaxGatedPerClient || len(g.flows) >= MaxGated:
		return g.kill(nil, f, errors.New("too many connections under way at once"))
	}
	fl := &gated{isn: isn, since: now}
	g.flows[f] = fl
	g.clients[s.src.Addr()]++
	return g.fromClient(f, fl, s)
}

// fromClient decides a packet of the client's.
func (g *Gate) fromClient(f Flow, fl *gated, s segment) Verdict {
	switch {
	case s.flags&tcpRST != 0:
		// The flow ends here, both ways (a reset the server ignores,
		// out of its window, must not end only the Gate's part).
		return g.kill(fl, f, errors.New("reset by the client"))
	case s.flags&tcpURG != 0:
		return g.kill(fl, f, errors.New("urgent data in the hello"))
	case s.flags&tcpSYN != 0:
		switch {
		case s.seq != fl.isn || len(fl.buf) > 0:
			return g.kill(fl, f, errors.New("a SYN in an open flow"))
		case len(s.payload) > 0:
			return Drop // data in a SYN (TCP Fast Open): sent again without
		}
		return Accept // sent again
	case len(s.payload) == 0:
		if s.flags&tcpFIN != 0 && !fl.decided {
			return g.kill(fl, f, errors.New("the connection ended before its hello"))
		}
		return Accept
	}
	off := s.seq - (fl.isn + 1) // where in the stream the payload starts
	if int32(off) < 0 {
		return g.kill(fl, f, errors.New("a segment before the stream's start"))
	}
	if int(off) < len(fl.buf) {
		old := fl.buf[off:]
		n := min(len(old), len(s.payload))
		if string(old[:n]) != string(s.payload[:n]) {
			return g.kill(fl, f, errors.New("a segment that overlaps the hello with other bytes"))
		}
	}
	end := int(off) + len(s.payload)
	switch {
	case fl.decided || end <= len(fl.buf):
		return Accept // past the decided hello (not read), or sent again
	case int(off) > len(fl.buf):
		return g.kill(fl, f, errors.New("a segment out of order"))
	case end > MaxHello:
		return g.kill(fl, f, fmt.Errorf("no whole hello in the first %d bytes", MaxHello))
	}
	fl.buf = append(fl.buf, s.payload[len(fl.buf)-int(off):]...)
	h, err := fl.hello.Parse(fl.buf)
	switch {
	case errors.Is(err, ErrShort):
		if s.flags&tcpFIN != 0 {
			return g.kill(fl, f, errors.New("the connection ended before its hello"))
		}
		return Accept // not a whole hello yet
	case err != nil:
	case h.ECH:
		err = errors.New("an encrypted ClientHello (ECH): its server name is hidden")
	case h.ServerName == "":
		err = errors.New("a ClientHello without a server name")
	default:
		fl.name, err = Normalize(h.ServerName)
		if err == nil {
			err = g.Decide(f, fl.name)
		}
	}
	if err != nil {
		return g.kill(fl, f, err)
	}
	fl.decided = true
	return Accept
}

// fromServer decides a packet of the server's: the one that
// acknowledges the decided bytes passes the flow.
func (g *Gate) fromServer(f Flow, fl *gated, s segment, now time.Time) Verdict {
	if s.flags&tcpRST != 0 {
		return g.kill(fl, f, errors.New("reset by the server"))
	}
	if fl.decided && s.flags&tcpACK != 0 && int32(s.ack-(fl.isn+1+uint32(len(fl.buf)))) >= 0 {
		// Kept a while: the packets queued behind this one still come.
		fl.passed, fl.since, fl.buf, fl.hello = true, now, nil, HelloReader{}
		if g.Passed != nil {
			g.Passed(f, fl.name)
		}
		return Pass
	}
	return Accept
}

// kill ends the flow f (fl: its state, if the Gate has it).
func (g *Gate) kill(fl *gated, f Flow, why error) Verdict {
	name := ""
	if fl != nil {
		name = fl.name
		g.forget(f)
	}
	if g.Killed != nil {
		g.Killed(f, name, why)
	}
	return Kill
}

// Expire ends the flows not passed for longer than Timeout: each is
// held dead (its next packet killed: its bytes so far are the server's,
// and only this Gate knows them, so it must not take the flow for a new
// one) and returned, for the host to kill it (network.KillFlow), and
// then ForgetFlow. It forgets the flows passed as long ago.
func (g *Gate) Expire(now time.Time) []Flow {
	timeout := g.Timeout
	if timeout == 0 {
		timeout = 10 * time.Second
	}
	var out []Flow
	for f, fl := range g.flows {
		switch {
		case fl.dead || now.Sub(fl.since) <= timeout:
		case fl.passed:
			g.forget(f)
		default:
			fl.dead, fl.buf, fl.hello = true, nil, HelloReader{}
			out = append(out, f)
			if g.Killed != nil {
				g.Killed(f, fl.name, errors.New("no decision in time"))
			}
		}
	}
	return out
}

// ForgetFlow forgets the flow f (one Expire returned, once the host
// killed it).
func (g *Gate) ForgetFlow(f Flow) { g.forget(f) }

// Forget forgets the flows of the client at addr (a sandbox gone).
func (g *Gate) Forget(addr netip.Addr) {
	for f := range g.flows {
		if f.Client.Addr() == addr {
			g.forget(f)
		}
	}
}

// forget drops the flow f.
func (g *Gate) forget(f Flow) {
	if g.flows[f] == nil {
		return
	}
	delete(g.flows, f)
	if g.clients[f.Client.Addr()]--; g.clients[f.Client.Addr()] <= 0 {
		delete(g.clients, f.Client.Addr())
	}
}

// Len is how many flows the Gate tracks.
func (g *Gate) Len() int { return len(g.flows) }
