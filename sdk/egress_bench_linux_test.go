package sdk_test

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/dsec-project/dsec/api"
	"github.com/dsec-project/dsec/internal/egress"
	"github.com/dsec-project/dsec/internal/runtime/runtimetest"
	"github.com/dsec-project/dsec/sdk"
)

// BenchmarkDomainEgress: what going by name costs, measured inside
// sandboxes by the web client, against a server outside the host (a
// network namespace of the benchmark's): HTTPS to an allowed name by the
// fast path (port 443, the sandbox having resolved the name: its gate
// reads the hello, the kernel the rest) and through the proxy (port
// 443 from a sandbox that never resolved it: the address is no answer
// of its resolver's), versus the same server on a port a CIDR rule
// allows directly (8443): the time to the first byte of the answer,
// connect and handshake included (DSEC_BENCH_N requests, default 200,
// in blocks taking turns), and the throughput of one connection
// downloading 64 MiB (5 each, in turn: the medians); and a DNS answer through the sandbox's
// resolver versus the upstream asked directly (from a sandbox with no
// domain rules), p50 and p99.
func BenchmarkDomainEgress(b *testing.B) {
	n := 200
	if v, err := strconv.Atoi(os.Getenv("DSEC_BENCH_N")); err == nil && v > 0 {
		n = v
	}
	cfg := runtimetest.Config{DNS: egress.Config{Upstream: []string{"10.207.0.2"}}}
	w, c := setupWith(b, cfg)
	_ = w
	pid := runtimetest.Outside(b, "dsecbweb", "10.207.0")
	serveOutside(b, pid, "10.207.0.2", map[string][]string{"allowed.test.": {"10.207.0.2"}, "*.allowed.test.": {"10.207.0.2"}})
	webOutside(b, pid, "10.207.0.2")
	ctx := context.Background()
	mk := func(name string, rules ...api.EgressRule) *sdk.Sandbox {
		sb, err := c.Create(ctx, api.SandboxSpec{Name: name, Layers: []string{"ws:1", "bb:1"},
			Policy: &api.Policy{APIVersion: api.PolicyVersion, Kind: "Policy", Network: &api.NetworkPolicy{Mode: api.NetworkNAT, Egress: rules}}})
		if err != nil {
			b.Fatal(err)
		}
		return sb
	}
	port := func(p uint16) []api.PortRange { return []api.PortRange{{Low: p, High: p}} }
	rules := []api.EgressRule{{To: "allowed.test", Ports: port(443)}, {To: "*.allowed.test", Ports: port(443)},
		{To: "10.207.0.0/24", Ports: port(8443)}}
	named := mk("named", rules...)
	proxied := mk("proxied", rules...)
	plain := mk("plain", api.EgressRule{To: "10.207.0.0/24", Ports: port(53)})
	putWebclient(b, named, proxied, plain)
	step := 0
	measure := func(sb *sdk.Sandbox, args string) map[string]float64 {
		step++
		var out bytes.Buffer
		res, err := sb.Exec(ctx, sdk.ExecOptions{ID: fmt.Sprint("bench-", step), Args: []string{"sh", "-c", "webclient " + args}, Stdout: &out, Stderr: &out})
		if err != nil || res.ExitCode != 0 {
			b.Fatalf("webclient %s: %v %+v %s", args, err, res, out.String())
		}
		m := map[string]float64{}
		for _, l := range strings.Split(strings.TrimSpace(out.String()), "\n") {
			if k, v, ok := strings.Cut(l, " "); ok {
				m[k], _ = strconv.ParseFloat(v, 64)
			}
		}
		return m
	}
	// The named sandbox resolves the name before each measure (its
	// answer stays learned for a minute); the proxied one never does.
	const learn = "-dns allowed.test 192.0.2.53:53 >/dev/null && webclient "
	b.ResetTimer()
	var fast, proxy, direct []float64
	const blocks = 4
	for range blocks {
		fast = append(fast, measure(named, learn+fmt.Sprintf("-n %d -sni allowed.test 10.207.0.2:443", n/blocks))["ttfb-p50-us"])
		proxy = append(proxy, measure(proxied, fmt.Sprintf("-n %d -sni allowed.test 10.207.0.2:443", n/blocks))["ttfb-p50-us"])
		direct = append(direct, measure(named, fmt.Sprintf("-n %d -sni allowed.test 10.207.0.2:8443", n/blocks))["ttfb-p50-us"])
	}
	mean := func(v []float64) float64 {
		s := 0.0
		for _, x := range v {
			s += x
		}
		return s / float64(len(v))
	}
	b.ReportMetric(mean(fast)/1000, "fast-ttfb-p50-ms")
	b.ReportMetric(mean(proxy)/1000, "proxy-ttfb-p50-ms")
	b.ReportMetric(mean(direct)/1000, "direct-ttfb-p50-ms")
	// One download each in turn, five rounds: the median of each (this
	// machine's throughput drifts more between seconds than the paths
	// differ).
	var tf, tp, td []float64
	for range 5 {
		tf = append(tf, measure(named, learn+"-n 1 -path /big -sni allowed.test 10.207.0.2:443")["bytes-per-second"])
		tp = append(tp, measure(proxied, "-n 1 -path /big -sni allowed.test 10.207.0.2:443")["bytes-per-second"])
		td = append(td, measure(named, "-n 1 -path /big -sni allowed.test 10.207.0.2:8443")["bytes-per-second"])
	}
	median := func(v []float64) float64 { slices.Sort(v); return v[len(v)/2] }
	b.ReportMetric(median(tf)/(1<<20), "fast-MiB/s")
	b.ReportMetric(median(tp)/(1<<20), "proxy-MiB/s")
	b.ReportMetric(median(td)/(1<<20), "direct-MiB/s")
	// (The resolver keeps answers for their TTL, here 1 s: all but the
	// first of these come from its cache, as a sandbox's repeated
	// lookups of one name do.)
	dw := measure(named, fmt.Sprintf("-dns allowed.test -n %d 192.0.2.53:53", n))
	dd := measure(plain, fmt.Sprintf("-dns allowed.test -n %d 10.207.0.2:53", n))
	b.ReportMetric(dw["dns-p50-us"]/1000, "dns-worker-p50-ms")
	b.ReportMetric(dd["dns-p50-us"]/1000, "dns-direct-p50-ms")
	b.ReportMetric(dw["dns-p99-us"]/1000, "dns-worker-p99-ms")
	b.ReportMetric(dd["dns-p99-us"]/1000, "dns-direct-p99-ms")
	// Names never asked before: every answer the upstream's.
	mw := measure(named, fmt.Sprintf("-dns allowed.test -unique -n %d 192.0.2.53:53", n))
	md := measure(plain, fmt.Sprintf("-dns allowed.test -unique -n %d 10.207.0.2:53", n))
	b.ReportMetric(mw["dns-p50-us"]/1000, "dns-miss-worker-p50-ms")
	b.ReportMetric(md["dns-p50-us"]/1000, "dns-miss-direct-p50-ms")
}
