package network

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"net/netip"
	"slices"
	"sync/atomic"

	"github.com/google/nftables"
	"github.com/google/nftables/expr"
	"github.com/google/nftables/xt"
	nl "github.com/mdlayher/netlink"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"
)

// The fast path of a sandbox's HTTPS (egress.Gate). A connection a
// sandbox with domain rules makes to TCP 443 of an address its resolver
// answered it (the pair in the map fastMap) is not redirected to its
// proxy: it goes on, its conntrack mark set to fastPending plus the
// queue of the worker that serves the sandbox, its conntrack label to
// the SYN's sequence number, and every later packet of it, both ways
// (but the server's SYN-ACK), goes to that queue, the label's first 32
// bits as its mark, until the worker's verdict. The worker
// passes a flow with the mark PassMark (its conntrack mark becomes
// fastPass: the rest of the flow is not queued), or kills it with
// KillMark (fastKill: this packet and every later one of the flow, both
// ways, answered with a TCP reset). A queue no process binds drops what
// is sent to it: a flow whose worker is gone goes nowhere unread.

// The queues a host's workers take for the fast path: one each, the
// first free from FastQueueBase.
const (
	FastQueueBase uint16 = 0xd5e0
	FastQueues           = 8
)

// Conntrack and packet marks of the fast path.
const (
	fastPending uint32 = 0xd5ec0100 // | queue - FastQueueBase
	fastPass    uint32 = 0xd5ec0200
	fastKill    uint32 = 0xd5ec0300
	// PassMark and KillMark are a verdict's packet marks (Queue.Verdicts).
	PassMark = fastPass
	KillMark = fastKill
	// HostMark marks the worker's own connections to its sandboxes (a
	// sandbox's port route, SO_MARK): their flows take it as their
	// conntrack mark, and a sandbox's answers on them alone reach the
	// host; no other process of the host's reaches a sandbox.
	HostMark uint32 = 0xd5ec0400
)

// ISN is the sequence number of a flow's first SYN, from the mark its
// queued packets carry (the rules copy it there from the flow's
// conntrack label, which holds its bytes as the SYN had them).
func ISN(mark uint32) uint32 {
	return binary.BigEndian.Uint32(binary.NativeEndian.AppendUint32(nil, mark))
}

// fastMap maps a sandbox's address and a destination to the mark its
// flows to TCP 443 there get.
const fastMap = "fast"

// fastChain holds the fast path's forward rules; fastForwardRules is
// how many the forward chain has (its jump there, and the kill of a
// passed flow its server reset).
const (
	fastChain        = "fastpath"
	fastForwardRules = 2
)

// markData is a mark as nftables' registers hold it.
func markData(m uint32) []byte { return binary.NativeEndian.AppendUint32(nil, m) }

// fastPrerouting adds the fast path's map to t, and its rule to pre
// (the nat prerouting chain, before its redirects).
func fastPrerouting(c *nftables.Conn, t *nftables.Table, pre *nftables.Chain, fromSandbox []expr.Any) error {
	m := &nftables.Set{Table: t, Name: fastMap, IsMap: true, Concatenation: true,
		KeyType:  nftables.MustConcatSetType(nftables.TypeIPAddr, nftables.TypeIPAddr),
		DataType: nftables.TypeMark}
	if err := c.AddSet(m, nil); err != nil {
		return err
	}
	// tcp dport 443 ct mark set ip saddr . ip daddr map @fast accept:
	// not redirected (a nat chain sees a flow's first packet only).
	c.AddRule(&nftables.Rule{Table: t, Chain: pre, Exprs: append(slices.Clip(fromSandbox),
		&expr.Meta{Key: expr.MetaKeyL4PROTO, Register: 1},
		&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: []byte{unix.IPPROTO_TCP}},
		&expr.Payload{DestRegister: 1, Base: expr.PayloadBaseTransportHeader, Offset: 2, Len: 2},
		&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: binary.BigEndian.AppendUint16(nil, 443)},
		&expr.Payload{DestRegister: 1, Base: expr.PayloadBaseNetworkHeader, Offset: 12, Len: 4},
		&expr.Payload{DestRegister: 9, Base: expr.PayloadBaseNetworkHeader, Offset: 16, Len: 4},
		&expr.Lookup{SourceRegister: 1, DestRegister: 2, IsDestRegSet: true, SetName: m.Name, SetID: m.ID},
		&expr.Ct{Key: expr.CtKeyMARK, Register: 2, SourceRegister: true},
		// The SYN's sequence number, in the label's first 32 bits: the
		// queue rules hand it to the gate with every packet (isnMark).
		&expr.Immediate{Register: 1, Data: make([]byte, 16)},
		&expr.Payload{DestRegister: 1, Base: expr.PayloadBaseTransportHeader, Offset: 4, Len: 4},
		&expr.Ct{Key: expr.CtKeyLABELS, Register: 1, SourceRegister: true},
		&expr.Verdict{Kind: expr.VerdictAccept})})
	return nil
}

// fastForward adds the fast path's chain to t, and the rules of fw (the
// forward chain, after its guards) that kill a passed flow its server
// reset and jump there: only for a flow pending or killed (a passed
// flow's packets, like any other's, pay those two rules).
func fastForward(c *nftables.Conn, t *nftables.Table, fw *nftables.Chain) error {
	marks := &nftables.Set{Table: t, Anonymous: true, Constant: true, KeyType: nftables.TypeMark}
	if err := c.AddSet(marks, []nftables.SetElement{{Key: markData(fastPending)}, {Key: markData(fastKill)}}); err != nil {
		return err
	}
	fc := c.AddChain(&nftables.Chain{Name: fastChain, Table: t})
	// A passed flow its server resets is killed: conntrack takes the
	// client's next SYN from the same port (within its close timeout)
	// for the old flow, not a new one, and so would pass its hello
	// unread; killed, that SYN is answered with a reset.
	c.AddRule(&nftables.Rule{Table: t, Chain: fw, Exprs: []expr.Any{
		&expr.Ct{Key: expr.CtKeyMARK, Register: 1},
		&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: markData(fastPass)},
		&expr.Ct{Key: expr.CtKeyDIRECTION, Register: 1},
		&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: []byte{1}}, // IP_CT_DIR_REPLY
		&expr.Meta{Key: expr.MetaKeyL4PROTO, Register: 1},
		&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: []byte{unix.IPPROTO_TCP}},
		&expr.Payload{DestRegister: 1, Base: expr.PayloadBaseTransportHeader, Offset: 13, Len: 1},
		&expr.Bitwise{SourceRegister: 1, DestRegister: 1, Len: 1, Mask: []byte{0x04}, Xor: []byte{0}},
		&expr.Cmp{Op: expr.CmpOpNeq, Register: 1, Data: []byte{0}}, // rst
		&expr.Immediate{Register: 1, Data: markData(fastKill)},
		&expr.Ct{Key: expr.CtKeyMARK, Register: 1, SourceRegister: true}}})
	c.AddRule(&nftables.Rule{Table: t, Chain: fw, Exprs: []expr.Any{
		&expr.Ct{Key: expr.CtKeyMARK, Register: 1},
		&expr.Bitwise{SourceRegister: 1, DestRegister: 1, Len: 4, Mask: markData(0xffffff00), Xor: markData(0)},
		&expr.Lookup{SourceRegister: 1, SetName: marks.Name, SetID: marks.ID},
		&expr.Verdict{Kind: expr.VerdictJump, Chain: fastChain}}})
	return fastRules(c, t, fc)
}

// fastRules fills fc, the fast path's chain: a verdict's mark put on its
// flow (a killed flow's packets answered with a reset), a server's
// SYN-ACK and a client's first SYN let by, and every other packet of a
// pending flow queued to its worker's queue.
func fastRules(c *nftables.Conn, t *nftables.Table, fc *nftables.Chain) error {
	ctMark := func(m uint32) []expr.Any {
		return []expr.Any{&expr.Ct{Key: expr.CtKeyMARK, Register: 1}, &expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: markData(m)}}
	}
	isTCP := []expr.Any{&expr.Meta{Key: expr.MetaKeyL4PROTO, Register: 1}, &expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: []byte{unix.IPPROTO_TCP}}}
	reset := &expr.Reject{Type: unix.NFT_REJECT_TCP_RST}
	// A verdict's mark: taken off the packet, put on its flow.
	verdict := func(m uint32) []expr.Any {
		return []expr.Any{
			&expr.Meta{Key: expr.MetaKeyMARK, Register: 1},
			&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: markData(m)},
			&expr.Immediate{Register: 1, Data: markData(m)},
			&expr.Ct{Key: expr.CtKeyMARK, Register: 1, SourceRegister: true},
			&expr.Immediate{Register: 1, Data: markData(0)},
			&expr.Meta{Key: expr.MetaKeyMARK, Register: 1, SourceRegister: true},
		}
	}
	// (A reset itself goes on: both ends learn the flow is over.)
	notReset := []expr.Any{
		&expr.Payload{DestRegister: 1, Base: expr.PayloadBaseTransportHeader, Offset: 13, Len: 1},
		&expr.Bitwise{SourceRegister: 1, DestRegister: 1, Len: 1, Mask: []byte{0x04}, Xor: []byte{0}},
		&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: []byte{0}},
	}
	c.AddRule(&nftables.Rule{Table: t, Chain: fc, Exprs: slices.Concat(ctMark(fastKill), isTCP, notReset, []expr.Any{reset})})
	c.AddRule(&nftables.Rule{Table: t, Chain: fc, Exprs: verdict(fastPass)})
	c.AddRule(&nftables.Rule{Table: t, Chain: fc, Exprs: slices.Concat(verdict(fastKill), isTCP, notReset, []expr.Any{reset})})
	// A server's SYN-ACK is not queued: the gate has nothing to read in
	// it, and one trip less is on every connection's way.
	c.AddRule(&nftables.Rule{Table: t, Chain: fc, Exprs: append(slices.Clip(isTCP),
		&expr.Ct{Key: expr.CtKeyMARK, Register: 1},
		&expr.Bitwise{SourceRegister: 1, DestRegister: 1, Len: 4, Mask: markData(0xffffff00), Xor: markData(0)},
		&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: markData(fastPending)},
		&expr.Ct{Key: expr.CtKeyDIRECTION, Register: 1},
		&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: []byte{1}}, // IP_CT_DIR_REPLY
		&expr.Payload{DestRegister: 1, Base: expr.PayloadBaseTransportHeader, Offset: 13, Len: 1},
		&expr.Bitwise{SourceRegister: 1, DestRegister: 1, Len: 1, Mask: []byte{0x17}, Xor: []byte{0}}, // fin|syn|rst|ack
		&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: []byte{0x12}},                                  // syn|ack
		&expr.Verdict{Kind: expr.VerdictAccept})})
	// Nor is the client's first SYN, if it carries no data (its IP and
	// TCP headers are all its length): the label's bit synSeen says it
	// went. Another SYN (sent again, or with another sequence number)
	// goes to the gate, which has its first's in the label.
	if err := fastFirstSYN(c, t, fc, isTCP); err != nil {
		return err
	}
	for i := range FastQueues {
		// xt_NFQ_info (revision 0): the queue's number, host order.
		info := xt.Unknown(binary.NativeEndian.AppendUint16(nil, FastQueueBase+uint16(i)))
		c.AddRule(&nftables.Rule{Table: t, Chain: fc, Exprs: append(ctMark(fastPending|uint32(i)),
			&expr.Ct{Key: expr.CtKeyLABELS, Register: 1},
			&expr.Meta{Key: expr.MetaKeyMARK, Register: 1, SourceRegister: true}, // the label's first 32 bits
			&expr.Target{Name: "NFQUEUE", Rev: 0, Info: &info})})
	}
	return nil
}

// fastFirstSYN adds to fc the rule that lets a client's first SYN
// without data by, unqueued, its flow's label's bit synSeen set; isTCP
// matches a TCP packet.
func fastFirstSYN(c *nftables.Conn, t *nftables.Table, fc *nftables.Chain, isTCP []expr.Any) error {
	synSeen := make([]byte, 16)
	synSeen[4] = 1
	noData := &nftables.Set{Table: t, Anonymous: true, Constant: true, Concatenation: true,
		KeyType: nftables.MustConcatSetType(nftables.TypeInetProto, nftables.TypeInetService)}
	var lengths []nftables.SetElement
	for doff := 5; doff <= 15; doff++ {
		lengths = append(lengths, nftables.SetElement{Key: []byte{byte(doff << 4), 0, 0, 0, 0, byte(20 + 4*doff), 0, 0}})
	}
	if err := c.AddSet(noData, lengths); err != nil {
		return err
	}
	c.AddRule(&nftables.Rule{Table: t, Chain: fc, Exprs: append(slices.Clip(isTCP),
		&expr.Ct{Key: expr.CtKeyMARK, Register: 1},
		&expr.Bitwise{SourceRegister: 1, DestRegister: 1, Len: 4, Mask: markData(0xffffff00), Xor: markData(0)},
		&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: markData(fastPending)},
		&expr.Payload{DestRegister: 1, Base: expr.PayloadBaseTransportHeader, Offset: 13, Len: 1},
		&expr.Bitwise{SourceRegister: 1, DestRegister: 1, Len: 1, Mask: []byte{0x17}, Xor: []byte{0}},
		&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: []byte{0x02}}, // syn alone
		&expr.Payload{DestRegister: 1, Base: expr.PayloadBaseNetworkHeader, Offset: 0, Len: 1},
		&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: []byte{0x45}}, // no IP options
		&expr.Payload{DestRegister: 1, Base: expr.PayloadBaseTransportHeader, Offset: 12, Len: 1},
		&expr.Bitwise{SourceRegister: 1, DestRegister: 1, Len: 1, Mask: []byte{0xf0}, Xor: []byte{0}},
		&expr.Payload{DestRegister: 9, Base: expr.PayloadBaseNetworkHeader, Offset: 2, Len: 2},
		&expr.Lookup{SourceRegister: 1, SetName: noData.Name, SetID: noData.ID}, // th doff . ip length: no data
		&expr.Ct{Key: expr.CtKeyLABELS, Register: 1},
		&expr.Bitwise{SourceRegister: 1, DestRegister: 1, Len: 16, Mask: synSeen, Xor: make([]byte, 16)},
		&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: make([]byte, 16)},
		&expr.Immediate{Register: 1, Data: synSeen},
		&expr.Ct{Key: expr.CtKeyLABELS, Register: 1, SourceRegister: true}, // (labels are set by or)
		&expr.Verdict{Kind: expr.VerdictAccept})})
	return nil
}

// fastOff says this kernel refused the fast path's rules: the table is
// made without them (masquerade).
var fastOff atomic.Bool

// FastSupported says whether the host's kernel takes the fast path's
// rules (true until a table made with them was refused).
func FastSupported() bool { return !fastOff.Load() }

// Fast makes dsts the addresses whose TCP 443 the sandbox n reaches by
// the fast path, its flows queued to queue; none: its web connections
// all go to its proxy again.
func Fast(n *NAT, queue uint16, dsts []netip.Addr) error {
	tableMu.Lock()
	defer tableMu.Unlock()
	c, err := nftables.New(nftNS...)
	if err != nil {
		return fmt.Errorf("nftables: %w", err)
	}
	m, err := c.GetSetByName(&nftables.Table{Family: nftables.TableFamilyIPv4, Name: natTable}, fastMap)
	if err != nil {
		if len(dsts) == 0 {
			return nil
		}
		return fmt.Errorf("nftables: the map of fast destinations: %w", err)
	}
	have, err := c.GetSetElements(m)
	if err != nil {
		return fmt.Errorf("nftables: the map of fast destinations: %w", err)
	}
	self := n.sandboxKey()
	mark := markData(fastPending | uint32(queue-FastQueueBase))
	want := map[netip.Addr]bool{}
	for _, d := range dsts {
		want[d] = true
	}
	var del, add []nftables.SetElement
	for _, e := range have {
		if len(e.Key) != 8 || !bytes.Equal(e.Key[:4], self) {
			continue
		}
		d := netip.AddrFrom4([4]byte(e.Key[4:8]))
		if want[d] && bytes.Equal(e.Val, mark) {
			delete(want, d)
			continue
		}
		del = append(del, nftables.SetElement{Key: e.Key})
	}
	for d := range want {
		add = append(add, nftables.SetElement{Key: append(slices.Clip(self), d.AsSlice()...), Val: mark})
	}
	if len(del) == 0 && len(add) == 0 {
		return nil
	}
	if len(del) > 0 {
		if err := c.SetDeleteElements(m, del); err != nil {
			return err
		}
	}
	if len(add) > 0 {
		if err := c.SetAddElements(m, add); err != nil {
			return err
		}
	}
	if err := c.Flush(); err != nil {
		return fmt.Errorf("nftables: the sandbox's fast destinations: %w", err)
	}
	return nil
}

// KillPending kills the flows queued to q and not decided (another
// process had q before, and only it knew what they sent): their next
// packets, either way, are answered with resets, never taken for new
// flows.
func KillPending(q *Queue) error {
	flows, err := netlink.ConntrackTableList(netlink.ConntrackTable, unix.AF_INET)
	if err != nil {
		return err
	}
	var errs []error
	for _, f := range flows {
		if f.Mark != fastPending|uint32(q.Num()-FastQueueBase) || f.Forward.Protocol != unix.IPPROTO_TCP {
			continue
		}
		src, _ := netip.AddrFromSlice(f.Forward.SrcIP.To4())
		dst, _ := netip.AddrFromSlice(f.Forward.DstIP.To4())
		if err := KillFlow(netip.AddrPortFrom(src, f.Forward.SrcPort), netip.AddrPortFrom(dst, f.Forward.DstPort)); err != nil && !errors.Is(err, unix.ENOENT) {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

// KillFlow sets the conntrack mark of the flow from client to server
// to fastKill: its next packet, either way, is answered with a reset.
func KillFlow(client, server netip.AddrPort) error {
	ae := flowTuple(client, server)
	ae.Bytes(8, binary.BigEndian.AppendUint32(nil, fastKill)) // CTA_MARK
	// IPCTNL_MSG_CT_NEW without NLM_F_CREATE: an update.
	return conntrack(0, ae)
}

// ForgetFlow deletes the host's conntrack entry of the TCP flow from
// client to server (as the client sent it, before any redirect): the
// client's next SYN from that port opens a new flow, decided afresh,
// where the entry of one reset from the other end would have taken it
// (conntrack reopens a flow only after a FIN, or after a reset the
// client sent).
func ForgetFlow(client, server netip.AddrPort) error {
	return conntrack(2, flowTuple(client, server)) // IPCTNL_MSG_CT_DELETE
}

// flowTuple encodes the original tuple of the TCP flow from client to
// server (CTA_TUPLE_ORIG).
func flowTuple(client, server netip.AddrPort) *nl.AttributeEncoder {
	ae := nl.NewAttributeEncoder()
	ae.Nested(1, func(ae *nl.AttributeEncoder) error { // CTA_TUPLE_ORIG
		ae.Nested(1, func(ae *nl.AttributeEncoder) error { // CTA_TUPLE_IP
			ae.Bytes(1, client.Addr().AsSlice()) // CTA_IP_V4_SRC
			ae.Bytes(2, server.Addr().AsSlice()) // CTA_IP_V4_DST
			return nil
		})
		ae.Nested(2, func(ae *nl.AttributeEncoder) error { // CTA_TUPLE_PROTO
			ae.Uint8(1, unix.IPPROTO_TCP)                                  // CTA_PROTO_NUM
			ae.Bytes(2, binary.BigEndian.AppendUint16(nil, client.Port())) // CTA_PROTO_SRC_PORT
			ae.Bytes(3, binary.BigEndian.AppendUint16(nil, server.Port())) // CTA_PROTO_DST_PORT
			return nil
		})
		return nil
	})
	return ae
}

// conntrack sends ctnetlink the message msg (IPCTNL_MSG_CT_*) of ae's
// attributes, and waits for its answer.
func conntrack(msg uint16, ae *nl.AttributeEncoder) error {
	b, err := ae.Encode()
	if err != nil {
		return err
	}
	c, err := nl.Dial(unix.NETLINK_NETFILTER, nil)
	if err != nil {
		return err
	}
	defer c.Close()
	_, err = c.Execute(nl.Message{
		Header: nl.Header{Type: nl.HeaderType(1<<8 | msg), Flags: nl.Request | nl.Acknowledge}, // NFNL_SUBSYS_CTNETLINK
		Data:   append([]byte{unix.AF_INET, 0, 0, 0}, b...),
	})
	return err
}
