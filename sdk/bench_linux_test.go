package sdk_test

import (
	"context"
	"os"
	"sort"
	"testing"
	"time"

	"github.com/dsec-project/dsec/api"
	"github.com/dsec-project/dsec/internal/runtime/runtimetest"
	"github.com/dsec-project/dsec/sdk"
)

// benchClient is the worker of DSEC_BENCH_ROOT (scripts/bench-run.sh
// runs one on the rootfs it compares with runc) or, without it, a test
// worker on busybox layers.
func benchClient(b *testing.B) (*sdk.Client, []string) {
	if root := os.Getenv("DSEC_BENCH_ROOT"); root != "" {
		c, err := sdk.New(sdk.Options{Root: root})
		if err != nil {
			b.Fatal(err)
		}
		return c, []string{os.Getenv("DSEC_BENCH_LAYER")}
	}
	root := b.TempDir()
	runtimetest.Layers(b, root)
	runtimetest.StartWorker(b, root)
	b.Cleanup(func() { runtimetest.Clean(root) })
	c, err := sdk.New(sdk.Options{Root: root})
	if err != nil {
		b.Fatal(err)
	}
	return c, []string{"bb:1"}
}

func report(b *testing.B, name string, d []time.Duration) {
	sort.Slice(d, func(i, j int) bool { return d[i] < d[j] })
	b.ReportMetric(float64(d[len(d)/2].Microseconds())/1000, name+"-p50-ms")
	b.ReportMetric(float64(d[(len(d)*99+99)/100-1].Microseconds())/1000, name+"-p99-ms")
}

// BenchmarkCreateExecRemove: create a sandbox, run true in it, remove it,
// through the SDK (what a trainer does, without a CLI process per step).
func BenchmarkCreateExecRemove(b *testing.B) {
	c, layers := benchClient(b)
	ctx := context.Background()
	var first, whole []time.Duration
	for b.Loop() {
		t0 := time.Now()
		sb, err := c.Create(ctx, api.SandboxSpec{Layers: layers})
		if err != nil {
			b.Fatal(err)
		}
		if res, err := sb.Exec(ctx, sdk.ExecOptions{Args: []string{"true"}}); err != nil || res.ExitCode != 0 {
			b.Fatal(res, err)
		}
		first = append(first, time.Since(t0))
		if err := sb.Remove(ctx, true); err != nil {
			b.Fatal(err)
		}
		whole = append(whole, time.Since(t0))
	}
	report(b, "first-exec", first)
	report(b, "with-rm", whole)
}

// BenchmarkExec: one exec of true into a running sandbox.
func BenchmarkExec(b *testing.B) {
	c, layers := benchClient(b)
	ctx := context.Background()
	sb, err := c.Create(ctx, api.SandboxSpec{Layers: layers})
	if err != nil {
		b.Fatal(err)
	}
	defer sb.Remove(ctx, true)
	var d []time.Duration
	for b.Loop() {
		t0 := time.Now()
		if res, err := sb.Exec(ctx, sdk.ExecOptions{Args: []string{"true"}}); err != nil || res.ExitCode != 0 {
			b.Fatal(res, err)
		}
		d = append(d, time.Since(t0))
	}
	report(b, "exec", d)
}
