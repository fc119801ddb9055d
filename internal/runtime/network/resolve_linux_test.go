package network

import (
	"net/netip"
	"os"
	"runtime"
	"slices"
	"testing"

	"github.com/google/nftables"
	"github.com/vishvananda/netns"
)

// inOwnNetns points this package's nftables connections at a network
// namespace of the test's own for its duration (the host's table is
// never touched).
func inOwnNetns(t *testing.T) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("nftables needs root; CI runs as root, so this never skips there")
	}
	// netns.New moves the calling thread into the namespace: the test
	// stays locked to it, and the thread, never handed back, ends with
	// the test.
	runtime.LockOSThread()
	ns, err := netns.New()
	if err != nil {
		t.Fatal(err)
	}
	tableMu.Lock() // (the watch reads it under tableMu)
	nftNS = []nftables.ConnOption{nftables.WithNetNSFd(int(ns))}
	tableMu.Unlock()
	t.Cleanup(func() { tableMu.Lock(); nftNS = nil; tableMu.Unlock(); ns.Close() })
	resolving.Lock()
	saved := resolving.addrs
	resolving.addrs = nil
	resolving.Unlock()
	t.Cleanup(func() { resolving.Lock(); resolving.addrs = saved; resolving.Unlock() })
}

func setElements(t *testing.T) []netip.Addr {
	t.Helper()
	c, err := nftables.New(nftNS...)
	if err != nil {
		t.Fatal(err)
	}
	set, err := c.GetSetByName(&nftables.Table{Family: nftables.TableFamilyIPv4, Name: natTable}, resolvedSet)
	if err != nil {
		return nil
	}
	el, err := c.GetSetElements(set)
	if err != nil {
		t.Fatal(err)
	}
	var out []netip.Addr
	for _, e := range el {
		a, _ := netip.AddrFromSlice(e.Key)
		out = append(out, a)
	}
	slices.SortFunc(out, netip.Addr.Compare)
	return out
}

// TestResolvedSurvives: the redirect of a sandbox with domain rules
// outlives another program's change of the table: a table made anew
// holds the sandboxes this process resolves from the start, and what is
// taken out of the set, or the table whole, is put back by the check.
func TestResolvedSurvives(t *testing.T) {
	inOwnNetns(t)
	a, b := &NAT{Sandbox: "10.200.0.2"}, &NAT{Sandbox: "10.200.0.6"}
	want := []netip.Addr{netip.MustParseAddr("10.200.0.2"), netip.MustParseAddr("10.200.0.6")}
	if err := ensureTable(true); err != nil {
		t.Fatal(err)
	}
	defer ensureTable(false)
	for _, n := range []*NAT{a, b} {
		if err := Resolve(n, true); err != nil {
			t.Fatal(err)
		}
	}
	if got := setElements(t); !slices.Equal(got, want) {
		t.Fatalf("the set: %v", got)
	}
	// Another program takes one out: put back.
	if err := setResolved([]nftables.SetElement{{Key: a.sandboxKey()}}, false); err != nil {
		t.Fatal(err)
	}
	if missing := checkResolved(); missing != "1 sandboxes' redirect" {
		t.Errorf("the check after an element went: %q", missing)
	}
	if got := setElements(t); !slices.Equal(got, want) {
		t.Fatalf("the set after the check: %v", got)
	}
	// Another program deletes the table (an older dsec makes its own
	// without the set): made anew, with both.
	c, _ := nftables.New(nftNS...)
	c.DelTable(&nftables.Table{Family: nftables.TableFamilyIPv4, Name: natTable})
	if err := c.Flush(); err != nil {
		t.Fatal(err)
	}
	if missing := checkResolved(); missing != "the table" {
		t.Errorf("the check after the table went: %q", missing)
	}
	if got := setElements(t); !slices.Equal(got, want) {
		t.Fatalf("the set of the table made anew: %v", got)
	}
	if missing := checkResolved(); missing != "" {
		t.Errorf("a check with nothing missing: %q", missing)
	}
	// One no longer resolved is not put back.
	if err := Resolve(a, false); err != nil {
		t.Fatal(err)
	}
	checkResolved()
	if got := setElements(t); !slices.Equal(got, want[1:]) {
		t.Fatalf("the set after one stopped: %v", got)
	}
}
