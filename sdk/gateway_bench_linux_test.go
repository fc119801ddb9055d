package sdk_test

import (
	"cmp"
	"context"
	"flag"
	"fmt"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/dsec-project/dsec/api"
	"github.com/dsec-project/dsec/internal/auth"
	"github.com/dsec-project/dsec/internal/gateway"
	"github.com/dsec-project/dsec/internal/runtime/runtimetest"
	"github.com/dsec-project/dsec/internal/runtime/worker"
	"github.com/dsec-project/dsec/sdk"
)

// BenchmarkGateway (make bench, scripts/bench-gateway.sh): a gateway
// of three workers on this machine, each figure against its baseline in
// the same run.
//  1. exec of true in one sandbox through the gateway vs straight to its
//     worker, both over TCP with TLS and a token, turn by turn.
//  2. a burst of N creates at once (-gateway.burst, default 60) through
//     the gateway, spread over the three workers, vs the same burst
//     straight to one worker: sandboxes made per second.
//     The same N as one batch (POST /v1/batches), through the gateway
//     and straight to one worker.
//  3. the time from a worker's death (kill -9) to the gateway listing
//     its sandboxes unreachable, and to its taking the worker for down
//     (three heartbeats unanswered; the default heartbeat, 2 s).
func BenchmarkGateway(b *testing.B) {
	ctx := context.Background()
	ws := []*fleetWorker{startFleetWorker(b), startFleetWorker(b), startFleetWorker(b)}
	gwRoot := b.TempDir()
	tok, _, err := auth.Open(gwRoot).Create(auth.Sandboxes, 0)
	if err != nil {
		b.Fatal(err)
	}
	certs := filepath.Dir(ws[0].ca) // the gateway serves with worker 0's certificate: 127.0.0.1, the same CA
	addr, _ := startGatewayWith(b, gateway.Config{Tokens: auth.Open(gwRoot)}, ws,
		worker.TLS{Cert: filepath.Join(certs, auth.ServerFile), Key: filepath.Join(certs, auth.ServerKeyFile)})
	gw, err := sdk.New(sdk.Options{Host: "tcp://" + addr, Token: tok, TLSCA: ws[0].ca})
	if err != nil {
		b.Fatal(err)
	}
	// Straight to worker 0 with a token of its own.
	wtok, _, err := auth.Open(ws[0].w.Root).Create(auth.Sandboxes, 0)
	if err != nil {
		b.Fatal(err)
	}
	direct, err := sdk.New(sdk.Options{Host: ws[0].url, Token: wtok, TLSCA: ws[0].ca})
	if err != nil {
		b.Fatal(err)
	}
	adm, _, err := auth.Open(gwRoot).Create(auth.Admin, 0)
	if err != nil {
		b.Fatal(err)
	}
	admin, err := sdk.New(sdk.Options{Host: "tcp://" + addr, Token: adm, TLSCA: ws[0].ca})
	if err != nil {
		b.Fatal(err)
	}
	cordonOthers := func(on bool) { // the gateway's exec sandbox on worker 0
		for _, w := range ws[1:] {
			if err := admin.Cordon(ctx, w.url, on); err != nil {
				b.Fatal(err)
			}
		}
	}
	cordonOthers(true)
	viaGW, err := gw.Create(ctx, api.SandboxSpec{Name: "bench-gw", Layers: []string{"bb:1"}})
	if err != nil {
		b.Fatal(err)
	}
	cordonOthers(false)
	if viaGW.Info.Node != ws[0].url {
		b.Fatalf("the gateway's sandbox is on %s, not worker 0", viaGW.Info.Node)
	}
	straight, err := direct.Create(ctx, api.SandboxSpec{Name: "bench-direct", Layers: []string{"bb:1"}})
	if err != nil {
		b.Fatal(err)
	}
	through, to := turns(b, viaGW, straight)
	report(b, "gateway", through)
	report(b, "direct", to)
	b.ReportMetric(ms(p50(through))/ms(p50(to)), "gateway/direct-p50")

	// The burst: through the gateway (three workers), then straight to
	// worker 0, each sandbox removed after.
	burst := func(c *sdk.Client, prefix string) float64 {
		t0 := time.Now()
		var wg sync.WaitGroup
		errs := make(chan error, *burstN)
		for i := range *burstN {
			wg.Go(func() {
				if _, err := c.Create(ctx, api.SandboxSpec{Name: fmt.Sprint(prefix, i), Layers: []string{"bb:1"}, Memory: 64 << 20}); err != nil {
					errs <- err
				}
			})
		}
		wg.Wait()
		rate := float64(*burstN) / time.Since(t0).Seconds()
		close(errs)
		for err := range errs {
			b.Fatal(err)
		}
		for i := range *burstN {
			c.Sandbox(fmt.Sprint(prefix, i)).Remove(ctx, true)
		}
		return rate
	}
	gwRate := burst(gw, "g")
	oneRate := burst(direct, "d")
	b.ReportMetric(gwRate, "gateway-burst-per-s")
	b.ReportMetric(oneRate, "one-worker-burst-per-s")
	b.ReportMetric(gwRate/oneRate, "gateway/one-burst")

	// The batch: N sandboxes of one spec in one request (POST
	// /v1/batches), through the gateway (placed over the three), then
	// straight to worker 0.
	batch := func(c *sdk.Client, prefix string) float64 {
		t0 := time.Now()
		var failed error
		err := c.Batch(ctx, api.SandboxSpec{Name: prefix, Layers: []string{"bb:1"}, Memory: 64 << 20}, *burstN, func(it api.BatchItem) {
			if it.Error != nil && failed == nil {
				failed = it.Error
			}
		})
		rate := float64(*burstN) / time.Since(t0).Seconds()
		if err = cmp.Or(err, failed); err != nil {
			b.Fatal(err)
		}
		for i := range *burstN {
			c.Sandbox(fmt.Sprintf("%s-%d", prefix, i)).Remove(ctx, true)
		}
		return rate
	}
	gwBatch := batch(gw, "gb")
	oneBatch := batch(direct, "db")
	b.ReportMetric(gwBatch, "gateway-batch-per-s")
	b.ReportMetric(oneBatch, "one-worker-batch-per-s")
	b.ReportMetric(gwBatch/oneBatch, "gateway/one-batch")

	// A worker's death, seen at the default heartbeat.
	dead := ws[2]
	if _, err := gw.Create(ctx, api.SandboxSpec{Name: "victim", Layers: []string{"bb:1"}}); err != nil {
		b.Fatal(err)
	}
	var on string
	for _, s := range mustList(b, gw) {
		if s.Name == "victim" {
			on = s.Node
		}
	}
	for _, w := range ws {
		if w.url == on {
			dead = w
		}
	}
	t0 := time.Now()
	dead.w.Crash()
	for {
		l := mustList(b, gw)
		seen := false
		for _, s := range l {
			seen = seen || s.Name == "victim" && s.Status == api.StatusUnreachable
		}
		if seen {
			break
		}
		if time.Since(t0) > time.Minute {
			b.Fatal("the victim is not unreachable a minute after its worker's death")
		}
		time.Sleep(50 * time.Millisecond)
	}
	b.ReportMetric(time.Since(t0).Seconds(), "death-to-unreachable-s")
	// And to the gateway's taking it for down (placing nothing there):
	// its heartbeats unanswered for three.
	for {
		up := true
		for _, n := range must(admin.Nodes(ctx)) {
			if n.URL == dead.url {
				up = n.Up
			}
		}
		if !up {
			break
		}
		if time.Since(t0) > time.Minute {
			b.Fatal("the dead worker is not down a minute after its death")
		}
		time.Sleep(50 * time.Millisecond)
	}
	b.ReportMetric(time.Since(t0).Seconds(), "death-to-down-s")
	dead.w = runtimetest.StartWorkerWith(b, dead.w.Root, dead.cfg) // its sandboxes removed as the bench ends
}

var burstN = flag.Int("gateway.burst", 60, "the creates of BenchmarkGateway's burst")

func mustList(b *testing.B, c *sdk.Client) []api.Sandbox {
	l, err := c.List(context.Background())
	if err != nil {
		b.Fatal(err)
	}
	return l
}

// BenchmarkListBrief (scripts/bench-gateway.sh): what a gateway's
// heartbeat costs a worker holding 100 sandboxes: the brief list it asks
// for (what the worker holds) against the full one (what each uses, read
// from its groups and disk), turn by turn.
func BenchmarkListBrief(b *testing.B) {
	_, c := setupWith(b, runtimetest.Config{})
	ctx := context.Background()
	const held = 100
	var wg sync.WaitGroup
	sem := make(chan struct{}, 8)
	for i := range held {
		wg.Add(1)
		sem <- struct{}{}
		go func() {
			defer wg.Done()
			defer func() { <-sem }()
			if _, err := c.Create(ctx, api.SandboxSpec{Name: fmt.Sprintf("held-%d", i), Layers: []string{"ws:1", "bb:1"}, Memory: 32 << 20}); err != nil {
				b.Error(err)
			}
		}()
	}
	wg.Wait()
	var full, brief []time.Duration
	b.ResetTimer()
	for range b.N {
		for _, f := range []struct {
			list func(context.Context) ([]api.Sandbox, error)
			into *[]time.Duration
		}{{c.List, &full}, {c.ListBrief, &brief}} {
			t0 := time.Now()
			sbs, err := f.list(ctx)
			if err != nil || len(sbs) != held {
				b.Fatalf("%d sandboxes listed, %v", len(sbs), err)
			}
			*f.into = append(*f.into, time.Since(t0))
		}
	}
	b.StopTimer()
	b.ReportMetric(ms(p50(full)), "full-p50-ms")
	b.ReportMetric(ms(p50(brief)), "brief-p50-ms")
	for i := range held {
		c.Sandbox(fmt.Sprintf("held-%d", i)).Remove(ctx, true)
	}
}
