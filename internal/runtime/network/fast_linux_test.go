package network

import (
	"errors"
	"net"
	"net/netip"
	"testing"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"
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
