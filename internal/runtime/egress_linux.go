package runtime

import (
	"errors"
	"fmt"
	"io"
	"io/fs"
	"log/slog"
	"net/netip"
	"os"
	"slices"
	"time"

	"github.com/containerd/errdefs"
	"github.com/dsec-project/dsec/api"
	"github.com/dsec-project/dsec/internal/egress"
	"github.com/dsec-project/dsec/internal/policy"
	"github.com/dsec-project/dsec/internal/runtime/driver"
	"github.com/dsec-project/dsec/internal/runtime/network"
	"golang.org/x/sys/unix"
)

// A sandbox's side of its worker's egress service (network.Egress): the
// service serves its resolver and proxy and decides its fast path; the
// sandbox keeps what they learned (State.Learned) and applies it as its
// allowlist (policy.ApplyNetwork), saved with its state.

// hasDomains says whether eff has domain rules.
func hasDomains(eff *api.Policy) bool {
	return eff != nil && eff.Network != nil && len(policy.Domains(eff.Network.Egress)) > 0
}

// startDNS opens sb's link to the egress service (its resolver and
// proxy) if eff (its policy, or the one about to be) needs one; sb.mu is
// held.
func (sb *Sandbox) startDNS(eff *api.Policy) error {
	if sb.link != nil || sb.NAT == nil || !hasDomains(eff) {
		return nil
	}
	if sb.egress == nil { // its DNS would go out unresolved: fail closed
		return fmt.Errorf("sandbox %s has domain rules, which only a worker serves (dsec daemon): %w", sb.Name, errdefs.ErrFailedPrecondition)
	}
	l, err := sb.egress.Open(sb.Name, sb.NAT, egressClient{sb})
	if err != nil {
		return err
	}
	go sb.expire(l)
	sb.link = l
	sb.syncFast()
	return nil
}

// stopDNS closes sb's link to the egress service, which sends its DNS
// and web ports where they were for again; sb.mu is held.
func (sb *Sandbox) stopDNS() error {
	if sb.link == nil {
		return nil
	}
	err := sb.link.Close()
	sb.link = nil
	return err
}

// egressClient is what the egress service asks of a sandbox.
type egressClient struct{ sb *Sandbox }

func (c egressClient) View() *network.View        { return c.sb.view() }
func (c egressClient) ClosedTo(a netip.Addr) bool { return c.sb.closedTo(a) }
func (c egressClient) Learn(l *network.Link, learned []egress.Learned) error {
	return c.sb.learn(l, learned)
}

// resolvConf gives sb, if its resolver serves, a /etc/resolv.conf its
// DNS can use when its own names no server it may send DNS to
// (egress.ResolvConf): a layer without one, or one naming
// systemd-resolved's 127.0.0.53, resolves nothing in a sandbox
// otherwise. Written like a file put through the API, so it is the
// sandbox's own from then on (pack-diff keeps it). Not for a paused
// sandbox (a frozen guest answers no file request); sb.mu is not held.
func (sb *Sandbox) resolvConf() {
	sb.mu.Lock()
	skip := sb.link == nil || sb.Status != Running || sb.Paused || sb.g != nil && sb.g.Frozen()
	sb.mu.Unlock()
	if skip {
		return
	}
	if err := sb.writeResolvConf(); err != nil {
		slog.Warn("no /etc/resolv.conf written: the sandbox resolves names only through servers it names itself",
			"sandbox", sb.Name, "err", err)
	}
}

func (sb *Sandbox) writeResolvConf() error {
	s, err := sb.Files()
	if err != nil {
		return err
	}
	defer s.Close()
	var old []byte
	// Non-blocking and only a regular file: the sandbox's own fifo or
	// device there stalls nothing.
	if f, err := s.OpenFile("etc/resolv.conf", os.O_RDONLY|unix.O_NONBLOCK, 0); err == nil {
		if fi, err := f.Stat(); err == nil && fi.Mode().IsRegular() {
			old, _ = io.ReadAll(io.LimitReader(f, 64<<10))
		}
		f.Close()
	}
	conf, changed := egress.ResolvConf(old, sb.closedTo)
	if !changed {
		return nil
	}
	if err := s.Mkdir("etc", 0o755); err != nil && !errors.Is(err, fs.ErrExist) {
		return err
	}
	tmp := "etc/.dsec-resolv-" + RandomName("")
	f, err := s.OpenFile(tmp, os.O_WRONLY|os.O_CREATE|os.O_EXCL|unix.O_NOFOLLOW, 0o644)
	if err != nil {
		return err
	}
	_, err = f.Write(conf)
	if err == nil {
		err = f.Chmod(0o644)
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = s.Rename(tmp, "etc/resolv.conf") // a symlink there is replaced, not followed
	}
	if err != nil {
		s.Remove(tmp)
	}
	return err
}

// lockFor takes sb.mu for the link l, unless l is closed meanwhile
// (its close may wait, holding sb.mu, for the query that asks) or it
// takes too long.
func (sb *Sandbox) lockFor(l *network.Link) bool {
	deadline := time.Now().Add(3 * time.Second)
	for !sb.mu.TryLock() {
		if l.Closed() || time.Now().After(deadline) {
			return false
		}
		time.Sleep(2 * time.Millisecond)
	}
	if l.Closed() {
		sb.mu.Unlock()
		return false
	}
	return true
}

// view is sb's policy now, compiled (a policy applied live changes it).
func (sb *Sandbox) view() *network.View {
	sb.mu.Lock()
	eff := sb.Policy
	sb.mu.Unlock()
	if v := sb.netView.Load(); v != nil && v.Policy() == eff {
		return v
	}
	v := network.NewView(eff)
	sb.netView.Store(v)
	return v
}

// closedTo says whether an answer's address is closed to sb (its deny
// set, the host's addresses, private ranges its rules do not open).
func (sb *Sandbox) closedTo(a netip.Addr) bool {
	host, err := sb.view().Host()
	sb.mu.Lock()
	entries := sb.Allowlist
	sb.mu.Unlock()
	return err != nil || policy.Closed(entries, host)(a)
}

// learn adds what an answer of l's resolver taught to sb's allowlist
// before the answer leaves.
func (sb *Sandbox) learn(l *network.Link, learned []egress.Learned) error {
	if !sb.lockFor(l) {
		return errors.New("the sandbox is busy")
	}
	defer sb.mu.Unlock()
	l.Answered(learned)
	changed := false
	for _, a := range learned {
		i := slices.IndexFunc(sb.Learned, func(o egress.Learned) bool { return o.Addr == a.Addr && o.Rule == a.Rule })
		switch {
		case i < 0:
			sb.Learned = append(sb.Learned, a)
			changed = true
		case a.Expires.After(sb.Learned[i].Expires):
			sb.Learned[i].Expires = a.Expires // no new address: no new list
		}
	}
	if !changed {
		return nil
	}
	if len(sb.Learned) > network.MaxLearned {
		slices.SortFunc(sb.Learned, func(a, b egress.Learned) int { return b.Expires.Compare(a.Expires) })
		sb.Learned = sb.Learned[:network.MaxLearned]
	}
	return sb.relearn()
}

// relearn applies sb's policy and learned addresses as its allowlist;
// sb.mu is held.
func (sb *Sandbox) relearn() error {
	entries, err := allowlist(sb.Policy, sb.Learned)
	if err != nil {
		return err
	}
	if sb.g != nil {
		if err := policy.ApplyNetwork(sb.g.Path(), sb.Allowlist, entries); err != nil {
			return err
		}
	}
	sb.Allowlist = entries
	sb.syncFast()
	return sb.save()
}

// syncFast gives the fast path sb's policy and learned addresses as
// they are now; sb.mu is held.
func (sb *Sandbox) syncFast() {
	if sb.link != nil {
		sb.link.Sync(network.NewView(sb.Policy), sb.Learned)
	}
}

// expire drops sb's learned addresses as they expire, until l closes.
func (sb *Sandbox) expire(l *network.Link) {
	tick := time.NewTicker(time.Second)
	defer tick.Stop()
	for {
		select {
		case <-l.Done():
			return
		case <-tick.C:
		}
		if !sb.lockFor(l) {
			continue
		}
		now := time.Now()
		l.Prune(now)
		n := len(sb.Learned)
		sb.Learned = slices.DeleteFunc(sb.Learned, func(a egress.Learned) bool { return now.After(a.Expires) })
		if len(sb.Learned) != n {
			if err := sb.relearn(); err != nil {
				slog.Warn("the sandbox's expired addresses stay allowed", "sandbox", sb.Name, "err", err)
			}
		}
		sb.mu.Unlock()
	}
}

// relearned are learned as the policy eff has them: each under the
// first of its domain rules that still allows its name (nil: none
// does).
func relearned(eff *api.Policy, learned []egress.Learned) []egress.Learned {
	rules := policy.Domains(eff.Network.Egress)
	var out []egress.Learned
	for _, l := range learned {
		for _, r := range rules {
			if r.Pattern.Match(l.Name) {
				l.Rule = r.Index
				out = append(out, l)
				break
			}
		}
	}
	return out
}

// ResetConnections ends the sandbox's connections that its allowlist in
// force no longer allows (policy apply --reset), and says how many: the
// ones its proxy relays by a name no rule allows any more (or to an
// address no CIDR rule does), reset; the ones its fast path passed for
// such a name (or to an address no longer its answer), as its own; its
// own TCP sockets to an address and port the allowlist no longer lets
// it connect to, closed by its driver where they are the host's (a
// container's: driver.SocketCloser); and, where they are a guest's (a
// microVM's, a full VM's), the host's connection tracking of its flows
// so closed, whose packets the host then drops (the guest's connection
// stalls until it times out).
func (sb *Sandbox) ResetConnections() (int, error) {
	sb.mu.Lock()
	defer sb.mu.Unlock()
	if sb.Status != Running || sb.NAT == nil || sb.Paused {
		return 0, nil
	}
	n := 0
	v := network.NewView(sb.Policy)
	var fast map[egress.Flow]string
	if sb.link != nil {
		n += sb.link.Cut(func(name string, dst netip.AddrPort) bool {
			if name == "" {
				return v.Direct(dst)
			}
			return v.Allows(name, dst.Port())
		})
		fast = sb.link.Flows()
	}
	gw := netip.MustParseAddr(sb.NAT.Host)
	closed := func(src, dst netip.AddrPort, proto uint8) bool {
		src, dst = netip.AddrPortFrom(src.Addr().Unmap(), src.Port()), netip.AddrPortFrom(dst.Addr().Unmap(), dst.Port())
		if name, ok := fast[egress.Flow{Client: src, Server: dst}]; ok && proto == policy.ProtoTCP {
			// Passed by the gate for name: closed unless a rule
			// allows it still and the address is still its answer.
			return !v.Allows(name, dst.Port()) || !slices.ContainsFunc(sb.Learned, func(l egress.Learned) bool {
				return l.Name == name && l.Addr == dst.Addr()
			})
		}
		a := dst.Addr()
		return !a.IsLoopback() && a != gw && !policy.Allows(sb.Allowlist, a, dst.Port(), proto)
	}
	var err error
	var k int
	if c, ok := sb.d.(driver.SocketCloser); ok {
		k, err = c.CloseSockets(sb.handle(), closed)
	} else {
		k, err = network.ForgetFlows(netip.MustParseAddr(sb.NAT.Sandbox), closed)
	}
	return n + k, err
}
