package sdk_test

import (
	"context"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/dsec-project/dsec/api"
	"github.com/dsec-project/dsec/internal/auth"
	"github.com/dsec-project/dsec/sdk"
)

// BenchmarkRemote: exec of true in one sandbox through the Go SDK over
// the unix socket and over TCP with TLS and a token, alternating (the
// ratio is TCP's cost); the same over TCP from the Python SDK, sync and
// asyncio (python/bench.py, after the Go loop, on the same worker); and
// 256 concurrent execs, Go goroutines against asyncio tasks, in steps per
// second.
func BenchmarkRemote(b *testing.B) {
	root, local, addr, certs := remoteWorker(b, false)
	ctx := context.Background()
	tok, _, err := auth.Open(root).Create(auth.Sandboxes, 0)
	if err != nil {
		b.Fatal(err)
	}
	tcp, err := sdk.New(sdk.Options{Host: "tcp://" + addr, Token: tok, TLSCA: filepath.Join(certs, auth.CAFile)})
	if err != nil {
		b.Fatal(err)
	}
	sb, err := tcp.Create(ctx, api.SandboxSpec{Name: "bench", Layers: []string{"bb:1"}})
	if err != nil {
		b.Fatal(err)
	}
	defer sb.Remove(ctx, true)
	// The admin's socket sees every sandbox: the same one.
	lsb := local.Sandbox("bench")
	run := func(s *sdk.Sandbox) time.Duration { return execTrue(b, s) }
	unix, remote := turns(b, lsb, sb)
	report(b, "unix", unix)
	report(b, "tcp-tls", remote)
	b.ReportMetric(ms(p50(remote))/ms(p50(unix)), "tcp/unix-p50")
	t0 := time.Now()
	var wg sync.WaitGroup
	for range 256 {
		wg.Add(1)
		go func() { defer wg.Done(); run(sb) }()
	}
	wg.Wait()
	goRate := 256 / time.Since(t0).Seconds()
	b.ReportMetric(goRate, "go-256-steps/s")

	py := exec.Command("/usr/bin/python3", "../python/bench.py", "bench", "100")
	py.Env = append(os.Environ(), "DSEC_HOST=tcp://"+addr, "DSEC_TOKEN="+tok, "DSEC_TLS_CA="+filepath.Join(certs, auth.CAFile))
	f := figures(b, py)
	b.ReportMetric(f["sync_p50_ms"], "py-sync-p50-ms")
	b.ReportMetric(f["sync_p99_ms"], "py-sync-p99-ms")
	b.ReportMetric(f["aio_p50_ms"], "py-aio-p50-ms")
	b.ReportMetric(f["aio_p99_ms"], "py-aio-p99-ms")
	b.ReportMetric(f["sync_p50_ms"]/ms(p50(remote)), "py-sync/go-p50")
	b.ReportMetric(f["aio_p50_ms"]/ms(p50(remote)), "py-aio/go-p50")
	b.ReportMetric(f["aio_256_steps_per_s"], "py-aio-256-steps/s")
	b.ReportMetric(f["aio_256_steps_per_s"]/goRate, "py/go-256")
}

// figures runs a benchmark script that prints its figures as a JSON
// object.
func figures(b *testing.B, cmd *exec.Cmd) map[string]float64 {
	out, err := cmd.Output()
	if err != nil {
		b.Fatalf("%s: %v: %s", cmd.Args[1], err, out)
	}
	var f map[string]float64
	if err := json.Unmarshal(out, &f); err != nil {
		b.Fatalf("%s said %q: %v", cmd.Args[1], out, err)
	}
	return f
}

func p50(d []time.Duration) time.Duration { // report sorted d
	return d[len(d)/2]
}

func ms(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }

// turns times execs of true in x and in y, turn by turn, while b loops
// (one of each first, untimed).
func turns(b *testing.B, x, y *sdk.Sandbox) (xs, ys []time.Duration) {
	execTrue(b, x)
	execTrue(b, y)
	for b.Loop() {
		xs = append(xs, execTrue(b, x))
		ys = append(ys, execTrue(b, y))
	}
	return xs, ys
}
