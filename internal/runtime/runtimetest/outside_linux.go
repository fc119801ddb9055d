package runtimetest

import (
	"os/exec"
	"syscall"
	"testing"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
)

// Outside starts a server outside the host: in a network namespace of
// the test's own, at net.2 (the host's side of the link, named link,
// net.1; net is the first three octets of a /30), it answers every
// connection to port 8080 with "hello from outside". Tests of packages
// that may run at once give each their own link and net. It returns the
// server's pid: its network namespace is the outside's.
func Outside(t testing.TB, link, net string) int {
	t.Helper()
	srv := exec.Command("/bin/busybox", "sh", "-c", "while :; do echo hello from outside | nc -l -p 8080; done")
	srv.SysProcAttr = &syscall.SysProcAttr{Cloneflags: syscall.CLONE_NEWNET, Setpgid: true}
	if err := srv.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { syscall.Kill(-srv.Process.Pid, syscall.SIGKILL); srv.Wait() })
	peer := link + "i"
	if err := netlink.LinkAdd(&netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: link}, PeerName: peer}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if l, err := netlink.LinkByName(link); err == nil {
			netlink.LinkDel(l)
		}
	})
	host, _ := netlink.LinkByName(link)
	addr, _ := netlink.ParseAddr(net + ".1/30")
	netlink.AddrAdd(host, addr)
	netlink.LinkSetUp(host)
	in, _ := netlink.LinkByName(peer)
	if err := netlink.LinkSetNsPid(in, srv.Process.Pid); err != nil {
		t.Fatal(err)
	}
	ns, err := netns.GetFromPid(srv.Process.Pid)
	if err != nil {
		t.Fatal(err)
	}
	defer ns.Close()
	h, err := netlink.NewHandleAt(ns)
	if err != nil {
		t.Fatal(err)
	}
	defer h.Close()
	in, _ = h.LinkByName(peer)
	addr, _ = netlink.ParseAddr(net + ".2/30")
	if err := h.AddrAdd(in, addr); err != nil {
		t.Fatal(err)
	}
	if err := h.LinkSetUp(in); err != nil {
		t.Fatal(err)
	}
	if lo, err := h.LinkByName("lo"); err == nil {
		h.LinkSetUp(lo)
	}
	return srv.Process.Pid
}
