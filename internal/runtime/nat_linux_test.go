package runtime_test

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/google/nftables"
	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"

	"github.com/dsec-project/dsec/api"
	"github.com/dsec-project/dsec/internal/policy"
	dsecrt "github.com/dsec-project/dsec/internal/runtime"
	"github.com/dsec-project/dsec/internal/runtime/runtimetest"
)

// outside starts a server in a network namespace of its own, reachable
// from the host at 10.201.0.2 over a veth pair, with no route back to
// the sandboxes' pool: only masqueraded traffic gets an answer.
func outside(t *testing.T) {
	t.Helper()
	runtimetest.Outside(t, "dsectout", "10.201.0")
}

// TestNATMode: a sandbox in network mode nat reaches a server outside
// the host through its veth pair and the masquerade rule, only where
// the allowlist lets it; one in the default mode under the same
// allowlist has no route (the positive control that nat, not the
// allowlist, gives the way out). Removal takes the pair, the address
// and the rule away.
func TestNATMode(t *testing.T) {
	f := newSnapFixture(t)
	outside(t)
	natPol, err := policy.Parse([]byte("apiVersion: dsec/v1\nkind: Policy\nnetwork:\n  mode: nat\n  egress:\n  - to: 10.201.0.2\n    ports: [8080]\n    protocol: tcp\n"))
	if err != nil {
		t.Fatal(err)
	}
	loPol := *natPol
	loPol.Network = &api.NetworkPolicy{Egress: natPol.Network.Egress}
	sb := f.create(dsecrt.Spec{Name: "nat", Layers: []string{"bb:1"}, Policy: natPol})
	lo := f.create(dsecrt.Spec{Name: "lo", Layers: []string{"bb:1"}, Policy: &loPol})
	const dial = "for i in 1 2 3 4 5 6 7 8 9 10; do nc -w 2 10.201.0.2 %d </dev/null 2>&1 && exit 0; sleep 0.2; done; exit 1"
	out, code := sh(t, sb, "out", fmt.Sprintf(dial, 8080))
	if code != 0 || !strings.Contains(out, "hello from outside") {
		t.Fatalf("nat: the allowed server said %q (exit %d)", out, code)
	}
	if out, _ := sh(t, sb, "denied", "nc -w 1 10.201.0.2 8081 </dev/null"); !strings.Contains(out, "Operation not permitted") {
		t.Errorf("nat: a port the allowlist does not name: %q", out)
	}
	if out, _ := sh(t, sb, "eth0", "cat /sys/class/net/eth0/operstate"); strings.TrimSpace(out) != "up" {
		t.Errorf("nat: eth0 is %q", out)
	}
	if out, code := sh(t, lo, "out", "nc -w 1 10.201.0.2 8080 </dev/null"); code == 0 || !strings.Contains(out, "unreachable") {
		t.Errorf("loopback mode reached outside: %q (exit %d)", out, code)
	}
	n := sb.Current().NAT
	if n == nil || n.Sandbox == "" {
		t.Fatalf("state: %+v", n)
	}
	if _, err := sb.ApplyPolicy(context.Background(), &loPol); err == nil || !strings.Contains(err.Error(), "network.mode nat is fixed") {
		t.Errorf("changing the mode live: %v", err)
	}
	if err := sb.Remove(); err != nil {
		t.Fatal(err)
	}
	if _, err := netlink.LinkByName(n.Link); err == nil {
		t.Errorf("%s is left after remove", n.Link)
	}
	c, _ := nftables.New()
	tables, _ := c.ListTablesOfFamily(nftables.TableFamilyIPv4)
	for _, tb := range tables {
		if tb.Name == "dsec" {
			if held, _ := filepath.Glob("/run/dsec/nat/[0-9]*"); len(held) == 0 {
				t.Errorf("the masquerade table outlived the last nat sandbox")
			}
		}
	}
}

// TestNATDenySet: a nat sandbox whose allowlist allows every address
// still reaches neither the host (its gateway, the host's other
// addresses, TCP or UDP), nor another sandbox, nor link-local addresses,
// nor the host's loopback, nor a private range its rules do not name;
// naming one opens it. The host's guard (nftables) holds on its own too:
// a socket in the sandbox's network namespace but outside its cgroup
// (no allowlist) gets no answer from the host.
func TestNATDenySet(t *testing.T) {
	f := newSnapFixture(t)
	outside(t)
	// The host's services: TCP and UDP on every address.
	ln, err := net.Listen("tcp4", "0.0.0.0:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			c.Write([]byte("HOST-SERVICE\n"))
			c.Close()
		}
	}()
	pc, err := net.ListenPacket("udp4", "0.0.0.0:0")
	if err != nil {
		t.Fatal(err)
	}
	defer pc.Close()
	got := make(chan string, 16)
	go func() {
		b := make([]byte, 64)
		for {
			n, from, err := pc.ReadFrom(b)
			if err != nil {
				return
			}
			got <- fmt.Sprintf("%s from %s", b[:n], from)
		}
	}()
	tcpPort, udpPort := ln.Addr().(*net.TCPAddr).Port, pc.LocalAddr().(*net.UDPAddr).Port
	var hostAddr string
	addrs, _ := net.InterfaceAddrs()
	for _, a := range addrs {
		if n, ok := a.(*net.IPNet); ok && n.IP.To4() != nil && !n.IP.IsLoopback() && !strings.HasPrefix(n.IP.String(), "10.20") {
			hostAddr = n.IP.String()
			break
		}
	}
	if hostAddr == "" {
		t.Fatal("the host has no IPv4 address but loopback")
	}

	all := "apiVersion: dsec/v1\nkind: Policy\nnetwork:\n  mode: nat\n  egress:\n  - to: 0.0.0.0/0\n  - to: ::/0\n"
	allPol, err := policy.Parse([]byte(all))
	if err != nil {
		t.Fatal(err)
	}
	namedPol, err := policy.Parse([]byte(all + "  - to: 10.201.0.0/16\n"))
	if err != nil {
		t.Fatal(err)
	}
	buildAttacker(t, f)
	a := f.create(dsecrt.Spec{Name: "nat-a", Layers: []string{"attack:1", "bb:1"}, Policy: namedPol})
	b := f.create(dsecrt.Spec{Name: "nat-b", Layers: []string{"bb:1"}, Policy: allPol})
	na, nb := a.Current().NAT, b.Current().NAT
	if _, _, err := b.Run(context.Background(), dsecrt.ExecSpec{ID: "listen", Args: []string{"/bin/sh", "-c", "while :; do echo PEER | nc -l -p 7000; done"}}); err != nil {
		t.Fatal(err)
	}
	// The positive controls: a private range named opens; the host's
	// own listener answers a process of the host.
	const dial = "for i in 1 2 3 4 5 6 7 8 9 10; do nc -w 2 10.201.0.2 8080 </dev/null 2>&1 && exit 0; sleep 0.2; done; exit 1"
	if out, code := sh(t, a, "named", dial); code != 0 || !strings.Contains(out, "hello from outside") {
		t.Fatalf("a private range a rule names: %q (exit %d)", out, code)
	}
	if out, _ := sh(t, b, "unnamed", "nc -w 1 10.201.0.2 8080 </dev/null"); !strings.Contains(out, "Operation not permitted") {
		t.Errorf("a private range only 0.0.0.0/0 contains: %q", out)
	}
	for _, c := range []struct{ what, script string }{
		{"the gateway, TCP", fmt.Sprintf("nc -w 1 %s %d </dev/null", na.Host, tcpPort)},
		{"the host's address, TCP", fmt.Sprintf("nc -w 1 %s %d </dev/null", hostAddr, tcpPort)},
		{"the other sandbox", fmt.Sprintf("nc -w 1 %s 7000 </dev/null", nb.Sandbox)},
		{"the other sandbox's gateway", fmt.Sprintf("nc -w 1 %s %d </dev/null", nb.Host, tcpPort)},
		{"the metadata address", "nc -w 1 169.254.169.254 80 </dev/null"},
		{"the gateway, UDP", fmt.Sprintf("/opt/attack/attack -udp %s:%d | grep 'sendto udp'", na.Host, udpPort)},
		{"the host's address, UDP", fmt.Sprintf("/opt/attack/attack -udp %s:%d | grep 'sendto udp'", hostAddr, udpPort)},
		{"link-local IPv6", fmt.Sprintf("nc -w 1 fe80::1%%eth0 %d </dev/null", tcpPort)},
	} {
		out, _ := sh(t, a, "deny-"+strings.NewReplacer(" ", "-", ",", "", "'", "").Replace(c.what), c.script)
		if !strings.Contains(out, "Operation not permitted") && !strings.Contains(out, "sendto udp\tEPERM") || strings.Contains(out, "HOST-SERVICE") || strings.Contains(out, "PEER") {
			t.Errorf("%s from a sandbox allowing every address: %q", c.what, out)
		}
	}
	if out, _ := sh(t, a, "loopback", fmt.Sprintf("nc -w 1 127.0.0.1 %d </dev/null", tcpPort)); strings.Contains(out, "HOST-SERVICE") || !strings.Contains(out, "refused") {
		t.Errorf("the host's loopback from the sandbox: %q (want its own loopback, refused)", out)
	}

	// The host's guard alone: a thread in A's network namespace, outside
	// its cgroup.
	ns, err := netns.GetFromPid(a.Current().Pid)
	if err != nil {
		t.Fatal(err)
	}
	defer ns.Close()
	res := make(chan error)
	go func() {
		runtime.LockOSThread() // never unlocked: the thread dies in the namespace
		if err := netns.Set(ns); err != nil {
			res <- err
			return
		}
		for _, to := range []string{na.Host, hostAddr} {
			c, err := net.DialTimeout("tcp4", net.JoinHostPort(to, fmt.Sprint(tcpPort)), 500*time.Millisecond)
			if err == nil {
				c.Close()
				res <- fmt.Errorf("%s answered", to)
				return
			}
			if !errors.Is(err, os.ErrDeadlineExceeded) && !strings.Contains(err.Error(), "timeout") {
				res <- fmt.Errorf("%s: %v, want no answer (dropped)", to, err)
				return
			}
			u, _ := net.Dial("udp4", net.JoinHostPort(to, fmt.Sprint(udpPort)))
			u.Write([]byte("GUARD-UDP"))
			u.Close()
		}
		res <- nil
	}()
	if err := <-res; err != nil {
		t.Errorf("the host's guard: %v", err)
	}
	time.Sleep(200 * time.Millisecond)
	select {
	case m := <-got:
		t.Errorf("the host's UDP service got %q from a sandbox", m)
	default:
	}
	// The positive control of the UDP check: the host's own datagram.
	u, _ := net.Dial("udp4", fmt.Sprintf("127.0.0.1:%d", udpPort))
	u.Write([]byte("CONTROL"))
	u.Close()
	select {
	case <-got:
	case <-time.After(2 * time.Second):
		t.Errorf("positive control: the host's UDP service got nothing from the host")
	}

	// A rule inside the deny set is refused.
	for _, to := range []string{"169.254.169.254", "10.200.0.0/24", "fe80::/64", "::ffff:169.254.0.0/112"} {
		_, err := policy.Parse([]byte("apiVersion: dsec/v1\nkind: Policy\nnetwork:\n  egress:\n  - to: " + to + "\n"))
		if err == nil || !strings.Contains(err.Error(), "which no rule opens") {
			t.Errorf("a rule to %s: %v", to, err)
		}
	}
}
