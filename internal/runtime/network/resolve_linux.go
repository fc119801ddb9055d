package network

import (
	"errors"
	"fmt"
	"log/slog"
	"net/netip"
	"sync"
	"time"

	"github.com/google/nftables"
	"golang.org/x/sys/unix"
)

// A sandbox with domain rules may send DNS and the web ports anywhere
// (its allowlist opens them) only because the host redirects them to its
// resolver and proxy: the redirect lost is its DNS and web traffic let
// out unread. So this process remembers the sandboxes it resolves: a
// table it makes anew (one another program changed: an older dsec's
// worker, a hand) holds them from the start, and a watch puts back
// within a second or two what another program took out of the set.

// resolving are the sandboxes this process redirects.
var resolving struct {
	sync.Mutex
	addrs map[netip.Addr]bool
	watch sync.Once
}

// nftNS are the options of every nftables connection: none, the
// host's namespace (a test's: its own).
var nftNS []nftables.ConnOption

// tableMu orders this process's changes of the table: two made at once
// would both find it missing and add their rules twice.
var tableMu sync.Mutex

// resolvingElements is what resolving holds, as the set's elements.
func resolvingElements() []nftables.SetElement {
	resolving.Lock()
	defer resolving.Unlock()
	var el []nftables.SetElement
	for a := range resolving.addrs {
		el = append(el, nftables.SetElement{Key: a.AsSlice()})
	}
	return el
}

// Resolve sends all DNS (UDP and TCP port 53) and web connections (TCP
// 80 and 443) of the sandbox n, to any address, to its gateway, where
// the worker's resolver and proxy for it listen; off, they go where they
// were sent again (if its allowlist lets them).
func Resolve(n *NAT, on bool) error {
	a := netip.MustParseAddr(n.Sandbox)
	resolving.Lock()
	if on {
		if resolving.addrs == nil {
			resolving.addrs = map[netip.Addr]bool{}
		}
		resolving.addrs[a] = true
	} else {
		delete(resolving.addrs, a)
	}
	resolving.Unlock()
	if on {
		resolving.watch.Do(func() { go watchResolved(2 * time.Second) })
	}
	tableMu.Lock()
	defer tableMu.Unlock()
	if err := setResolved([]nftables.SetElement{{Key: n.sandboxKey()}}, on); err != nil {
		if on { // not resolved after all: the watch leaves it be
			resolving.Lock()
			delete(resolving.addrs, a)
			resolving.Unlock()
		}
		return fmt.Errorf("nftables: the sandbox's DNS to its resolver: %w", err)
	}
	return nil
}

// setResolved adds (or takes out) el in the set; a missing set or
// element is nothing to take out.
func setResolved(el []nftables.SetElement, on bool) error {
	c, err := nftables.New(nftNS...)
	if err != nil {
		return err
	}
	set, err := c.GetSetByName(&nftables.Table{Family: nftables.TableFamilyIPv4, Name: natTable}, resolvedSet)
	if err != nil {
		if !on {
			return nil
		}
		return fmt.Errorf("the set of sandboxes with a resolver: %w", err)
	}
	if on {
		err = c.SetAddElements(set, el)
	} else {
		err = c.SetDeleteElements(set, el)
	}
	if err == nil {
		err = c.Flush()
	}
	if !on && errors.Is(err, unix.ENOENT) {
		return nil
	}
	return err
}

// watchResolved checks every period that the table's set holds every
// sandbox this process resolves, and restores what is missing (the
// table too, if it went), saying so.
func watchResolved(period time.Duration) {
	for range time.Tick(period) {
		if missing := checkResolved(); missing != "" {
			slog.Warn("another program changed the host's table ip dsec: the redirect of sandboxes' DNS and web ports is restored", "missing", missing)
		}
	}
}

// checkResolved restores what the table lacks of resolving, and says
// what that was ("": nothing).
func checkResolved() string {
	want := resolvingElements()
	if len(want) == 0 {
		return ""
	}
	tableMu.Lock()
	defer tableMu.Unlock()
	c, err := nftables.New(nftNS...)
	if err != nil {
		return ""
	}
	set, err := c.GetSetByName(&nftables.Table{Family: nftables.TableFamilyIPv4, Name: natTable}, resolvedSet)
	if err != nil {
		if err := masquerade(true); err != nil { // with resolving's elements in its set
			slog.Error("the host's table ip dsec cannot be made again: sandboxes with domain rules have no redirect", "err", err)
		}
		return "the table"
	}
	have, err := c.GetSetElements(set)
	if err != nil {
		return ""
	}
	in := map[netip.Addr]bool{}
	for _, e := range have {
		if a, ok := netip.AddrFromSlice(e.Key); ok {
			in[a] = true
		}
	}
	var lost []nftables.SetElement
	for _, e := range want {
		if a, _ := netip.AddrFromSlice(e.Key); !in[a] {
			lost = append(lost, e)
		}
	}
	if len(lost) == 0 {
		return ""
	}
	if err := setResolved(lost, true); err != nil {
		slog.Error("the redirect of sandboxes' DNS and web ports cannot be restored", "err", err)
	}
	return fmt.Sprintf("%d sandboxes' redirect", len(lost))
}

func (n *NAT) sandboxKey() []byte { return netip.MustParseAddr(n.Sandbox).AsSlice() }
