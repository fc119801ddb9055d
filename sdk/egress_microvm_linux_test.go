package sdk_test

import (
	"context"
	"net"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/dsec-project/dsec/api"
	"github.com/dsec-project/dsec/internal/egress"
	"github.com/dsec-project/dsec/internal/runtime/microvm/microvmtest"
	"github.com/dsec-project/dsec/internal/runtime/runtimetest"
)

// TestMicroVMDomainEgress: a microVM's guest resolves through its own
// resolver too (its DNS, sent through its tap, redirected on the host)
// and reaches what the answer gave, only that.
func TestMicroVMDomainEgress(t *testing.T) {
	cfg := runtimetest.Config{MicroVM: microvmtest.Settings(t), DNS: egress.Config{Upstream: []string{"10.205.0.2"}}}
	_, c := setupWith(t, cfg)
	pid := runtimetest.Outside(t, "dsecvdns", "10.205.0")
	auth := serveOutside(t, pid, "10.205.0.2", map[string][]string{"allowed.test.": {"10.205.0.2"}})
	spec := vmSpec("vmnames")
	spec.Policy = &api.Policy{APIVersion: api.PolicyVersion, Kind: "Policy", Network: &api.NetworkPolicy{Mode: api.NetworkNAT,
		Egress: []api.EgressRule{{To: "allowed.test", Ports: []api.PortRange{{Low: 8080, High: 8080}, {Low: 443, High: 443}}},
			{To: "10.205.0.0/24", Ports: []api.PortRange{{Low: 9, High: 9}, {Low: 8090, High: 8090}}}}}}
	sb := create(t, c, spec)
	snis := webOutside(t, pid, "10.205.0.2")
	putWebclient(t, sb)
	const dial = "for i in 1 2 3; do nc -w 2 10.205.0.2 8080 </dev/null 2>&1 && exit 0; sleep 0.2; done; exit 1"
	if out, res := run(t, sb, "before", dial); res.ExitCode == 0 || strings.Contains(out, "hello") {
		t.Fatalf("reached before any answer: %q", out)
	}
	// (No server named: the guest's /etc/resolv.conf, which its layer
	// lacks, was written through its agent.)
	if out, _ := run(t, sb, "lookup", "nslookup allowed.test 2>&1; nslookup evil.test 192.0.2.53 2>&1"); !strings.Contains(out, "10.205.0.2") {
		t.Fatalf("nslookup in the guest: %q", out)
	}
	if out, res := run(t, sb, "after", dial); res.ExitCode != 0 || !strings.Contains(out, "hello from outside") {
		t.Fatalf("not reached after the answer: %q %+v", out, res)
	}
	if auth.asked("evil.test") {
		t.Error("the outside's DNS server was asked evil.test")
	}
	// HTTPS to the answered address goes by the fast path, the
	// guest's packets read by the worker's gate as they leave its tap:
	// the allowed name passes, another on the same address is reset.
	if out, res := run(t, sb, "fast", "webclient -sni allowed.test 10.205.0.2:443 2>&1"); res.ExitCode != 0 || out != "sni=allowed.test host=allowed.test\n" {
		t.Errorf("HTTPS to allowed.test from the guest: %q %+v", out, res)
	}
	if out, res := run(t, sb, "fast-evil", "webclient -sni evil.test 10.205.0.2:443 2>&1"); res.ExitCode == 0 || strings.Contains(out, "sni=") {
		t.Errorf("HTTPS to evil.test from the guest: %q %+v", out, res)
	}
	if fastFlowsMarked(t, "10.205.0.2", 0xd5ec0200) != 1 || fastFlowsMarked(t, "10.205.0.2", 0xd5ec0300) != 1 {
		t.Errorf("the guest's HTTPS did not go by the fast path: %d passed, %d killed",
			fastFlowsMarked(t, "10.205.0.2", 0xd5ec0200), fastFlowsMarked(t, "10.205.0.2", 0xd5ec0300))
	}
	if got := snis(); !slices.Equal(got, []string{"allowed.test"}) {
		t.Errorf("the server got hellos for %q", got)
	}
	// A connection the guest holds to a server that ticks: a policy
	// applied with Reset cuts it (the host forgets the flow; the
	// server's next writes meet a reset).
	var ln net.Listener
	inNetns(t, pid, func() { ln, _ = net.Listen("tcp4", "10.205.0.2:8090") })
	if ln == nil {
		t.Fatal("listen on 10.205.0.2:8090")
	}
	t.Cleanup(func() { ln.Close() })
	cut := make(chan error, 1)
	go func() {
		c, err := ln.Accept()
		if err != nil {
			return
		}
		defer c.Close()
		for {
			if _, err := c.Write([]byte("tick\n")); err != nil {
				cut <- err
				return
			}
			time.Sleep(100 * time.Millisecond)
		}
	}()
	if out, res := run(t, sb, "hold", "(nc 10.205.0.2 8090 >/tmp/ticks </dev/null &); sleep 2; grep -c tick /tmp/ticks"); res.ExitCode != 0 || out == "0\n" {
		t.Fatalf("the held connection: %q %+v", out, res)
	}
	ctx := context.Background()
	none := &api.Policy{APIVersion: api.PolicyVersion, Kind: "Policy", Network: &api.NetworkPolicy{Mode: api.NetworkNAT,
		Egress: []api.EgressRule{{To: "allowed.test", Ports: []api.PortRange{{Low: 8080, High: 8080}}}}}}
	rep, err := sb.ApplyPolicy(ctx, api.PolicyRequest{Policy: none, Reset: true})
	if err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-cut:
		t.Logf("the server's writes after the reset: %v (%v)", err, rep.Now)
	case <-time.After(10 * time.Second):
		t.Errorf("the held connection lives on 10 s after apply --reset: %v", rep.Now)
	}
}
