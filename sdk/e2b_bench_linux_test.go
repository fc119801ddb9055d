package sdk_test

import (
	"context"
	"crypto/tls"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/dsec-project/dsec/api"
	"github.com/dsec-project/dsec/internal/auth"
	"github.com/dsec-project/dsec/internal/e2b/e2btest"
	"github.com/dsec-project/dsec/internal/layer"
	"github.com/dsec-project/dsec/internal/layer/layertest"
	"github.com/dsec-project/dsec/internal/layer/store"
	"github.com/dsec-project/dsec/internal/runtime/runtimetest"
	"github.com/dsec-project/dsec/internal/runtime/worker"
	"github.com/dsec-project/dsec/sdk"
)

// BenchmarkE2B: the E2B protocol's cost. On one worker, on a Debian
// layer, the same calls through dsec's Go SDK over its TCP API (the
// baseline) and through the official E2B SDK over the E2B front
// (internal/e2b/testdata/bench.cjs, after the Go loop): create + first
// command p50, a command's p50 (both run bash -l -c true, as the E2B
// SDK does), a stat's p50 (one request each way: what a request costs
// the clients), and 100 sandboxes made at once, 10 commands each.
func BenchmarkE2B(b *testing.B) {
	mods, debian := e2bBench(b)
	root := b.TempDir()
	runtimetest.Layers(b, root)
	s, err := store.Open(filepath.Join(root, "store"))
	if err != nil {
		b.Fatal(err)
	}
	ref, _ := layer.ParseRef("debian:12")
	if _, err := layer.Build(context.Background(), s, layer.BuildOptions{Source: debian, Kind: layer.KindBase, Ref: ref}); err != nil {
		b.Fatal(err)
	}
	api1, front := freeAddr(b), freeAddr(b)
	w := runtimetest.StartWorkerWith(b, root, runtimetest.Config{Listen: []string{"tcp://" + api1},
		E2B: worker.E2B{Listen: front, Templates: map[string]api.SandboxSpec{"base": {Layers: []string{"debian:12"}}}}})
	b.Cleanup(func() { w.Kill(); runtimetest.Clean(root) })
	key, _, err := auth.Open(root).CreateWith(auth.Sandboxes, 0, auth.E2BPrefix)
	if err != nil {
		b.Fatal(err)
	}
	c, err := sdk.New(sdk.Options{Host: "tcp://" + api1, Token: key})
	if err != nil {
		b.Fatal(err)
	}
	ctx := context.Background()
	spec := api.SandboxSpec{Layers: []string{"debian:12"}}
	bash := sdk.ExecOptions{Args: []string{"/bin/bash", "-l", "-c", "true"}}
	exec1 := func(sb *sdk.Sandbox) {
		if res, err := sb.Exec(ctx, bash); err != nil || res.ExitCode != 0 {
			b.Fatal(res, err)
		}
	}
	var first []time.Duration
	for range 10 {
		t0 := time.Now()
		sb, err := c.Create(ctx, spec)
		if err != nil {
			b.Fatal(err)
		}
		exec1(sb)
		first = append(first, time.Since(t0))
		sb.Remove(ctx, true)
	}
	sb, err := c.Create(ctx, spec)
	if err != nil {
		b.Fatal(err)
	}
	exec1(sb)
	var runs []time.Duration
	for b.Loop() {
		t0 := time.Now()
		exec1(sb)
		runs = append(runs, time.Since(t0))
	}
	var stats []time.Duration
	for range 100 {
		t0 := time.Now()
		if _, err := sb.Stat(ctx, "/tmp", false); err != nil {
			b.Fatal(err)
		}
		stats = append(stats, time.Since(t0))
	}
	sb.Remove(ctx, true)
	report(b, "go-stat", stats)
	report(b, "go-create-first", first)
	report(b, "go-run", runs)
	t0 := time.Now()
	sbs := make([]*sdk.Sandbox, 100)
	errs := make([]error, len(sbs))
	var wg sync.WaitGroup
	for i := range sbs {
		wg.Go(func() { sbs[i], errs[i] = c.Create(ctx, spec) })
	}
	wg.Wait()
	created := time.Since(t0)
	removeAll := func() { // each made one goes, also when b.Fatal ends the benchmark first
		for i, sb := range sbs {
			if sb != nil {
				sb.Remove(ctx, true)
				sbs[i] = nil
			}
		}
	}
	b.Cleanup(removeAll)
	if err := errors.Join(errs...); err != nil {
		b.Fatal(err)
	}
	for i, sb := range sbs {
		wg.Go(func() {
			for range 10 {
				if res, err := sb.Exec(ctx, bash); err != nil || res.ExitCode != 0 {
					errs[i] = fmt.Errorf("%v %v", res, err)
					return
				}
			}
		})
	}
	wg.Wait()
	all := time.Since(t0)
	if err := errors.Join(errs...); err != nil {
		b.Fatal(err)
	}
	removeAll()
	goSandboxes, goCommands := 100/created.Seconds(), 1000/(all-created).Seconds()
	b.ReportMetric(goSandboxes, "go-sandboxes/s")
	b.ReportMetric(goCommands, "go-commands/s")

	node := exec.Command("node", "../internal/e2b/testdata/bench.cjs", "base", "100")
	node.Env = append(os.Environ(), "NODE_PATH="+mods, "E2B_API_URL=http://"+front, "E2B_SANDBOX_URL=http://"+front, "E2B_API_KEY="+key)
	f := figures(b, node)
	b.ReportMetric(f["create_first_p50_ms"], "e2b-create-first-p50-ms")
	b.ReportMetric(f["run_p50_ms"], "e2b-run-p50-ms")
	b.ReportMetric(f["stat_p50_ms"], "e2b-stat-p50-ms")
	b.ReportMetric(f["stat_p50_ms"]/ms(p50(stats)), "e2b/go-stat")
	b.ReportMetric(f["sandboxes_per_s"], "e2b-sandboxes/s")
	b.ReportMetric(f["commands_per_s"], "e2b-commands/s")
	b.ReportMetric(f["create_first_p50_ms"]/ms(p50(first)), "e2b/go-create-first")
	b.ReportMetric(f["run_p50_ms"]/ms(p50(runs)), "e2b/go-run")
	b.ReportMetric(f["sandboxes_per_s"]/goSandboxes, "e2b/go-sandboxes")
	b.ReportMetric(f["commands_per_s"]/goCommands, "e2b/go-commands")
}

// e2bBench is what the E2B benchmarks need: the E2B JS SDK's modules
// and a Debian tree.
func e2bBench(b *testing.B) (mods, debian string) {
	mods, err := e2btest.Install("2.51.0")
	if err != nil {
		b.Fatal(err)
	}
	if debian, err = layertest.DebianRoot(); err != nil {
		b.Fatal(err)
	}
	return mods, debian
}

// BenchmarkE2BGateway: what a gateway's relay costs the E2B SDK. One
// worker, on a Debian layer, serves E2B's API on its own front (A, the
// baseline) and through a gateway's front (B: each request relayed to
// the worker's front), all over TLS, the official E2B JS SDK's
// requests alternating turn by turn (internal/e2b/testdata/ab.cjs):
// create + the first command, and a command in one sandbox of each.
func BenchmarkE2BGateway(b *testing.B) {
	mods, debian := e2bBench(b)
	tpl := map[string]api.SandboxSpec{"base": {Layers: []string{"debian:12"}}}
	front := freeAddr(b)
	fw := startFleetWorkerWith(b, runtimetest.Config{E2B: worker.E2B{Listen: front, Templates: tpl}})
	s, err := store.Open(filepath.Join(fw.w.Root, "store"))
	if err != nil {
		b.Fatal(err)
	}
	ref, _ := layer.ParseRef("debian:12")
	if _, err := layer.Build(context.Background(), s, layer.BuildOptions{Source: debian, Kind: layer.KindBase, Ref: ref}); err != nil {
		b.Fatal(err)
	}
	keyA, _, err := auth.Open(fw.w.Root).CreateWith(auth.Sandboxes, 0, auth.E2BPrefix)
	if err != nil {
		b.Fatal(err)
	}
	tokens := b.TempDir()
	// The gateway's front over TLS too, with the worker's certificate
	// (the same CA: one NODE_EXTRA_CA_CERTS for both).
	cert, err := tls.LoadX509KeyPair(filepath.Join(filepath.Dir(fw.ca), auth.ServerFile), filepath.Join(filepath.Dir(fw.ca), auth.ServerKeyFile))
	if err != nil {
		b.Fatal(err)
	}
	gw := gatewayFrontsOf(b, tokens, []*fleetWorker{fw}, 1, tpl, &cert)[0]
	keyB, _, err := auth.Open(tokens).CreateWith(auth.Sandboxes, 0, auth.E2BPrefix)
	if err != nil {
		b.Fatal(err)
	}
	time.Sleep(300 * time.Millisecond) // (the gateway's first heartbeats)
	turns := 0
	for b.Loop() { // (so the benchmark runs once: its turns are ab.cjs's)
		turns++
	}
	n := max(turns/5, 20)
	node := exec.Command("node", "../internal/e2b/testdata/ab.cjs", "base", strconv.Itoa(n), "https://"+front, keyA, gw.URL, keyB)
	node.Env = append(os.Environ(), "NODE_PATH="+mods, "NODE_EXTRA_CA_CERTS="+fw.ca)
	var stderr strings.Builder
	node.Stderr = &stderr
	out, err := node.Output()
	if err != nil {
		b.Fatalf("ab.cjs: %v: %s%s", err, out, stderr.String())
	}
	var f map[string]map[string]float64
	if err := json.Unmarshal(out, &f); err != nil {
		b.Fatalf("ab.cjs said %q: %v", out, err)
	}
	for _, k := range []string{"create_first", "run"} {
		b.ReportMetric(f[k]["b_p50_ms"], "gateway-"+k+"-p50-ms")
		b.ReportMetric(f[k]["a_p50_ms"], "worker-"+k+"-p50-ms")
		b.ReportMetric(f[k]["b_a_median_of_turns"], "gateway/worker-"+k)
	}
}
