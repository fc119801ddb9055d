package sdk_test

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
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
	mods, err := e2btest.Install("2.51.0")
	if err != nil {
		b.Fatal(err)
	}
	debian, err := layertest.DebianRoot()
	if err != nil {
		b.Fatal(err)
	}
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
