package network

import (
	"errors"
	"net"
	"net/netip"
	"testing"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/dsec-project/dsec/internal/egress"
)

// TestKillPending: the flows an earlier process left pending on a queue
// get the kill mark (the host resets their next packets); others, and
// flows pending on another queue, keep theirs; a flow the host does not
// track is ENOENT to KillFlow.
func TestKillPending(t *testing.T) {
	inOwnNetns(t)
	flow := func(sport uint16, mark uint32) *netlink.ConntrackFlow {
		f := &netlink.ConntrackFlow{FamilyType: unix.AF_INET, Mark: mark, TimeOut: 100,
			Forward:   netlink.IPTuple{SrcIP: net.IPv4(10, 200, 0, 2), DstIP: net.IPv4(192, 0, 2, 7), SrcPort: sport, DstPort: 443, Protocol: unix.IPPROTO_TCP},
			Reverse:   netlink.IPTuple{SrcIP: net.IPv4(192, 0, 2, 7), DstIP: net.IPv4(192, 0, 2, 1), SrcPort: 443, DstPort: sport, Protocol: unix.IPPROTO_TCP},
			ProtoInfo: &netlink.ProtoInfoTCP{State: 3}} // established
		if err := netlink.ConntrackCreate(netlink.ConntrackTable, unix.AF_INET, f); err != nil {
			t.Fatalf("conntrack create: %v", err)
		}
		return f
	}
	flow(40001, fastPending|2)
	flow(40002, fastPending|3)
	flow(40003, fastPass)
	if err := KillPending(&Queue{num: FastQueueBase + 2}); err != nil {
		t.Fatal(err)
	}
	flows, err := netlink.ConntrackTableList(netlink.ConntrackTable, unix.AF_INET)
	if err != nil {
		t.Fatal(err)
	}
	got := map[uint16]uint32{}
	for _, f := range flows {
		got[f.Forward.SrcPort] = f.Mark
	}
	if got[40001] != fastKill || got[40002] != fastPending|3 || got[40003] != fastPass {
		t.Errorf("marks after KillPending of queue 2: %x", got)
	}
	err = KillFlow(netip.MustParseAddrPort("10.200.0.2:40009"), netip.MustParseAddrPort("192.0.2.7:443"))
	if !errors.Is(err, unix.ENOENT) {
		t.Errorf("KillFlow of a flow not tracked: %v", err)
	}
}

// TestEgressQueues: two egress services in one process bind a queue
// each, and one closed lets go of its own, which a third binds again;
// a closed service's gate has no queue.
func TestEgressQueues(t *testing.T) {
	inOwnNetns(t)
	a, b := NewEgress(egress.Config{}), NewEgress(egress.Config{})
	t.Cleanup(func() { a.Close(); b.Close() })
	qa, qb := a.gate.queue(), b.gate.queue()
	if qa == nil || qb == nil || qa.Num() == qb.Num() {
		t.Fatalf("queues of two services: %v %v", qa != nil, qb != nil)
	}
	num := qa.Num()
	if err := a.Close(); err != nil {
		t.Fatal(err)
	}
	if a.gate.queue() != nil {
		t.Error("a closed service's gate still has its queue")
	}
	c := NewEgress(egress.Config{})
	t.Cleanup(func() { c.Close() })
	if qc := c.gate.queue(); qc == nil || qc.Num() != num {
		t.Errorf("a third service's queue: %v, want %d (the closed one's)", qc != nil, num)
	}
}
