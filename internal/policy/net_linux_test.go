package policy

import (
	"bufio"
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/dsec-project/dsec/api"
)

// The child side of the network tests: it runs in the test's cgroup and
// tries what DSEC_NET_PROBES lists ("tcp ADDR", "udp ADDR", or "until
// tcp ADDR": retry until it connects), printing one line each.
func init() {
	probes := os.Getenv("DSEC_NET_PROBES")
	if probes == "" {
		return
	}
	for _, p := range strings.Split(probes, ";") {
		f := strings.Fields(p)
		if f[0] == "bench" {
			n, _ := strconv.Atoi(f[4])
			fmt.Println(benchConnect(f[1], f[2], f[3], n))
			continue
		}
		if f[0] == "until" {
			denied := 0
			for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); {
				c, err := net.Dial(f[1], f[2])
				if err == nil {
					c.Close()
					fmt.Printf("%s ok after %d denied\n", p, denied)
					break
				}
				if errors.Is(err, unix.EPERM) {
					denied++
					if denied == 1 {
						fmt.Println("denied once") // the parent updates the list now
					}
				}
				time.Sleep(5 * time.Millisecond)
			}
			continue
		}
		var err error
		switch f[0] {
		case "tcp":
			var c net.Conn
			if c, err = net.DialTimeout("tcp", f[1], time.Second); err == nil {
				c.Close()
			}
		case "udp":
			var c net.Conn
			if c, err = net.Dial("udp", f[1]); err == nil {
				// An unconnected send goes through sendmsg's hook.
				c.Close()
				var pc net.PacketConn
				if pc, err = net.ListenPacket("udp", ":0"); err == nil {
					_, err = pc.WriteTo([]byte("x"), net.UDPAddrFromAddrPort(netip.MustParseAddrPort(f[1])))
					pc.Close()
				}
			}
		}
		switch {
		case err == nil:
			fmt.Println(p, "ok")
		case errors.Is(err, unix.EPERM):
			fmt.Println(p, "EPERM")
		default:
			fmt.Println(p, "error", err)
		}
	}
	os.Exit(0)
}

// benchConnect times connects to addr (a closed port: refused),
// alternating between cgroups a and b in rounds of 1,000 so that drift
// in the machine's speed falls on both alike, and prints the mean
// nanoseconds of the connect calls alone in each.
func benchConnect(a, b, addr string, n int) string {
	ap := netip.MustParseAddrPort(addr)
	sa := &unix.SockaddrInet4{Port: int(ap.Port()), Addr: ap.Addr().As4()}
	var total [2]time.Duration
	const round = 1000
	for i := 0; i < n; i += round {
		for k, cg := range []string{a, b} {
			if err := os.WriteFile(filepath.Join(cg, "cgroup.procs"), []byte(strconv.Itoa(os.Getpid())), 0); err != nil {
				return "error " + err.Error()
			}
			for range min(round, n-i) {
				fd, err := unix.Socket(unix.AF_INET, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
				if err != nil {
					return "error " + err.Error()
				}
				start := time.Now()
				err = unix.Connect(fd, sa)
				total[k] += time.Since(start)
				unix.Close(fd)
				if !errors.Is(err, unix.ECONNREFUSED) {
					return fmt.Sprintf("error: connect %s: %v, want ECONNREFUSED", addr, err)
				}
			}
		}
	}
	return fmt.Sprint(int64(total[0])/int64(max(n, 1)), int64(total[1])/int64(max(n, 1)))
}

// BenchmarkConnect is what the egress allowlist costs a connect(): one
// process alternates between a cgroup with no programs and one under a
// 1,000-entry allowlist (the target allowed). make bench prints the
// ratio.
func BenchmarkConnect(b *testing.B) {
	var rules []api.EgressRule
	for i := range 999 {
		rules = append(rules, api.EgressRule{To: fmt.Sprintf("10.%d.%d.0/24", i/256, i%256), Ports: []api.PortRange{{Low: 443, High: 443}}})
	}
	rules = append(rules, api.EgressRule{To: "127.0.0.1/32", Protocol: "tcp"})
	entries, err := Allowlist(rules, nil)
	if err != nil {
		b.Fatal(err)
	}
	none, guarded := testCgroup(b), testCgroup(b)
	if err := ApplyNetwork(guarded, nil, entries); err != nil {
		b.Fatal(err)
	}
	defer ReleaseNetwork(guarded, entries)
	benchConnects(b, none, guarded, "ns/connect-none", fmt.Sprintf("ns/connect-%d", len(entries)))
}

// benchConnects has one probe process alternate refused connects between
// the cgroups base and other, b.N each, and reports the mean time of
// each as baseName and otherName, and their ratio.
func benchConnects(b *testing.B, base, other, baseName, otherName string) {
	out, err := startProbes(b, base, fmt.Sprintf("bench %s %s 127.0.0.1:1 %d", base, other, b.N)).Output()
	if err != nil {
		b.Fatal(err)
	}
	var ns0, ns1 float64
	if _, err := fmt.Sscan(string(out), &ns0, &ns1); err != nil {
		b.Fatalf("the child: %s", out)
	}
	b.ReportMetric(ns0, baseName)
	b.ReportMetric(ns1, otherName)
	b.ReportMetric(ns1/ns0, "ratio")
}

// BenchmarkConnectDenySet is what the deny set costs a connect(): one
// process alternates between a cgroup under an allowlist of every address
// (0.0.0.0/0, ::/0) with the deny set's entries and host addresses, and
// one under the same rules without them (the allowlist as it was), each
// connect allowed. make bench prints the ratio.
func BenchmarkConnectDenySet(b *testing.B) {
	rules := []api.EgressRule{{To: "0.0.0.0/0"}, {To: "::/0"}}
	host := []netip.Addr{netip.MustParseAddr("192.0.2.2"), netip.MustParseAddr("198.51.100.7")}
	withDeny, err := Allowlist(rules, host)
	if err != nil {
		b.Fatal(err)
	}
	var alone []Entry
	for _, e := range withDeny {
		if len(e.Rules) > 0 {
			alone = append(alone, e)
		}
	}
	if len(alone) == len(withDeny) {
		b.Fatal("the deny set added no entries")
	}
	a, d := testCgroup(b), testCgroup(b)
	for cg, es := range map[string][]Entry{a: alone, d: withDeny} {
		if err := ApplyNetwork(cg, nil, es); err != nil {
			b.Fatal(err)
		}
		defer ReleaseNetwork(cg, es)
	}
	benchConnects(b, a, d, "ns/connect-allowlist", "ns/connect-denyset")
}

var cgroupSeq atomic.Int64

func testCgroup(t testing.TB) string {
	t.Helper()
	base := "/sys/fs/cgroup/unified"
	if _, err := os.Stat(filepath.Join(base, "cgroup.procs")); err != nil {
		base = "/sys/fs/cgroup"
		var st unix.Statfs_t
		if unix.Statfs(base, &st) != nil || st.Type != unix.CGROUP2_SUPER_MAGIC {
			t.Skip("SKIPPED LOUDLY: no cgroup2 hierarchy on this host: the egress allowlist cannot be tested")
		}
	}
	cg := filepath.Join(base, fmt.Sprintf("dsec-policy-test-%d-%d", os.Getpid(), cgroupSeq.Add(1)))
	if err := os.Mkdir(cg, 0o755); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := os.Remove(cg); err != nil {
			t.Errorf("remove the test cgroup: %v", err)
		}
	})
	return cg
}

// probe runs the probes in a child started inside cg.
func probe(t *testing.T, cg string, probes ...string) map[string]string {
	t.Helper()
	out, err := startProbes(t, cg, probes...).Output()
	if err != nil {
		t.Fatalf("probes: %v", err)
	}
	res := map[string]string{}
	for _, l := range strings.Split(strings.TrimSpace(string(out)), "\n") {
		for _, p := range probes {
			if r, ok := strings.CutPrefix(l, p+" "); ok {
				res[p] = r
			}
		}
	}
	return res
}

func startProbes(t testing.TB, cg string, probes ...string) *exec.Cmd {
	dir, err := os.Open(cg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { dir.Close() })
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), "DSEC_NET_PROBES="+strings.Join(probes, ";"))
	cmd.SysProcAttr = &syscall.SysProcAttr{UseCgroupFD: true, CgroupFD: int(dir.Fd())}
	return cmd
}

func listen(t *testing.T, network, addr string) string {
	t.Helper()
	if network == "udp" {
		pc, err := net.ListenPacket("udp", addr)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { pc.Close() })
		return pc.LocalAddr().String()
	}
	l, err := net.Listen("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			c.Close()
		}
	}()
	return l.Addr().String()
}

func port(addr string) uint16 {
	ap := netip.MustParseAddrPort(addr)
	return ap.Port()
}

func TestEgressAllowlist(t *testing.T) {
	cg := testCgroup(t)
	allowed, denied := listen(t, "tcp", "127.0.0.1:0"), listen(t, "tcp", "127.0.0.1:0")
	udpAllowed, udpDenied := listen(t, "udp", "127.0.0.1:0"), listen(t, "udp", "127.0.0.1:0")
	mapped := func(a string) string { return "[::ffff:127.0.0.1]:" + strconv.Itoa(int(port(a))) }
	probes := []string{"tcp " + allowed, "tcp " + denied, "tcp " + mapped(allowed), "tcp " + mapped(denied),
		"udp " + udpAllowed, "udp " + udpDenied}

	// The positive control: no policy, everything connects.
	for p, r := range probe(t, cg, probes...) {
		if r != "ok" {
			t.Fatalf("without a policy, %s: %s", p, r)
		}
	}
	entries, err := Allowlist([]api.EgressRule{
		{To: "127.0.0.1/32", Ports: []api.PortRange{{Low: port(allowed), High: port(allowed)}}, Protocol: "tcp"},
		{To: "127.0.0.1", Ports: []api.PortRange{{Low: port(udpAllowed), High: port(udpAllowed)}}, Protocol: "udp"},
	}, nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := ApplyNetwork(cg, nil, entries); err != nil {
		t.Fatal(err)
	}
	if !NetworkAttached(cg) {
		t.Fatal("the programs are not attached")
	}
	got := probe(t, cg, probes...)
	want := map[string]string{probes[0]: "ok", probes[1]: "EPERM", probes[2]: "ok", probes[3]: "EPERM", probes[4]: "ok", probes[5]: "EPERM"}
	for p, w := range want {
		if got[p] != w {
			t.Errorf("%s: %q, want %q", p, got[p], w)
		}
	}

	// Live: a process retrying the denied port gets through once the
	// list changes under it, without restarting anything.
	cmd := startProbes(t, cg, "until tcp "+denied)
	stdout, _ := cmd.StdoutPipe()
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
	sc := bufio.NewScanner(stdout)
	if !sc.Scan() || sc.Text() != "denied once" {
		t.Fatalf("the retrying child: %q", sc.Text())
	}
	old := entries
	entries, _ = Allowlist([]api.EgressRule{{To: "127.0.0.1/32", Ports: []api.PortRange{{Low: port(denied), High: port(denied)}}}}, nil)
	start := time.Now()
	if err := ApplyNetwork(cg, old, entries); err != nil {
		t.Fatal(err)
	}
	if !sc.Scan() || !strings.Contains(sc.Text(), " ok after ") {
		t.Fatalf("after the update: %q", sc.Text())
	}
	t.Logf("the retrying process connected %v after the update: %s", time.Since(start), sc.Text())
	cmd.Wait()
	if got := probe(t, cg, "tcp "+allowed); got["tcp "+allowed] != "EPERM" {
		t.Fatalf("the old rule still holds after the swap: %v", got)
	}
	if n := keysOf(t, cg); n != len(entries) {
		t.Fatalf("%d allowlist entries for the cgroup after the swap, want the new list's %d", n, len(entries))
	}
	if err := ReleaseNetwork(cg, entries); err != nil {
		t.Fatal(err)
	}
	if n := keysOf(t, cg); n != 0 {
		t.Fatalf("%d allowlist entries left after release", n)
	}
}

// keysOf counts the shared trie's entries for cg (and fails if its
// generation outlived a release).
func keysOf(t *testing.T, cg string) int {
	t.Helper()
	dir, _ := os.Open(cg)
	defer dir.Close()
	id, _ := cgroupID(dir)
	set, err := sharedSet()
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	var key []byte
	it := set.trie.Iterate()
	var val []byte
	for it.Next(&key, &val) {
		if binary.NativeEndian.Uint64(key[4:]) == id {
			n++
		}
	}
	if err := it.Err(); err != nil {
		t.Fatal(err)
	}
	var gen uint32
	if n == 0 && set.gens.Lookup(id, &gen) == nil {
		t.Fatalf("generation %d left for a released cgroup", gen)
	}
	return n
}
