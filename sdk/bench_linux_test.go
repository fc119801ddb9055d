package sdk_test

import (
	"context"
	"fmt"
	"io"
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
	w := runtimetest.StartWorker(b, root)
	b.Cleanup(func() { w.Kill(); runtimetest.Clean(root) }) // the worker first: its spares go with it
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
func BenchmarkCreateExecRemove(b *testing.B) { benchCreateExec(b, 0) }

// BenchmarkCreateExecSpaced is BenchmarkCreateExecRemove with 50 ms
// between sandboxes, as a rollout's steps come (a model's turn between
// them): each create meets a worker done with the last one's removal
// and with priming the next.
func BenchmarkCreateExecSpaced(b *testing.B) { benchCreateExec(b, 50*time.Millisecond) }

// BenchmarkFirstExecDelayed: a sandbox's first exec and its second,
// the first coming 0, 5 or 30 ms after the create's answer (an E2B
// client's first command comes a few ms after), the second 100 ms after
// the first. The worker primes the next sandbox 3 ms after the answer,
// or after the first exec if that exec runs then: a first exec 5 or 30
// ms late meets the priming, and against one at once shows its cost.
func BenchmarkFirstExecDelayed(b *testing.B) {
	c, layers := benchClient(b)
	ctx := context.Background()
	for _, delay := range []time.Duration{0, 5 * time.Millisecond, 30 * time.Millisecond} {
		b.Run(fmt.Sprint(delay), func(b *testing.B) {
			var first, second []time.Duration
			for b.Loop() {
				sb, err := c.Create(ctx, api.SandboxSpec{Layers: layers})
				if err != nil {
					b.Fatal(err)
				}
				time.Sleep(delay)
				for i, d := range []*[]time.Duration{&first, &second} {
					if i > 0 {
						time.Sleep(100 * time.Millisecond)
					}
					t0 := time.Now()
					if res, err := sb.Exec(ctx, sdk.ExecOptions{Args: []string{"true"}}); err != nil || res.ExitCode != 0 {
						b.Fatal(res, err)
					}
					*d = append(*d, time.Since(t0))
				}
				if err := sb.Remove(ctx, true); err != nil {
					b.Fatal(err)
				}
				time.Sleep(100 * time.Millisecond)
			}
			report(b, "first-exec", first)
			report(b, "second-exec", second)
		})
	}
}

// benchCreateExec times sandboxes made, run and removed one after the
// other, gap apart.
func benchCreateExec(b *testing.B, gap time.Duration) {
	c, layers := benchClient(b)
	var first, whole []time.Duration
	for b.Loop() {
		f, w := createExecRemove(b, c, api.SandboxSpec{Layers: layers})
		first, whole = append(first, f), append(whole, w)
		time.Sleep(gap)
	}
	report(b, "first-exec", first)
	report(b, "with-rm", whole)
}

// createExecRemove times a sandbox of spec to its first exec done, and
// to its removal.
func createExecRemove(b *testing.B, c *sdk.Client, spec api.SandboxSpec) (first, whole time.Duration) {
	ctx := context.Background()
	t0 := time.Now()
	sb, err := c.Create(ctx, spec)
	if err != nil {
		b.Fatal(err)
	}
	if res, err := sb.Exec(ctx, sdk.ExecOptions{Args: []string{"true"}}); err != nil || res.ExitCode != 0 {
		b.Fatal(res, err)
	}
	first = time.Since(t0)
	if err := sb.Remove(ctx, true); err != nil {
		b.Fatal(err)
	}
	return first, time.Since(t0)
}

// BenchmarkDiskQuota: create to first exec, and to removal, of a sandbox
// with a 10 GiB disk quota (its own ext4 image, loop-mounted) next to one
// without, alternating in one loop.
func BenchmarkDiskQuota(b *testing.B) {
	c, layers := benchClient(b)
	var first, whole [2][]time.Duration
	i := 0
	for b.Loop() {
		spec := api.SandboxSpec{Layers: layers}
		if i%2 == 1 {
			spec.Disk = 10 << 30
		}
		f, w := createExecRemove(b, c, spec)
		first[i%2], whole[i%2] = append(first[i%2], f), append(whole[i%2], w)
		i++
	}
	report(b, "first-exec", first[0])
	report(b, "first-exec-disk", first[1])
	report(b, "with-rm", whole[0])
	report(b, "with-rm-disk", whole[1])
}

// BenchmarkDefaults: create to first exec of a sandbox with the
// worker's default limits (memory, pids) next to one that opts out of
// them (what every sandbox without flags was before issue 36),
// alternating in one loop.
func BenchmarkDefaults(b *testing.B) {
	c, layers := benchClient(b)
	var first [2][]time.Duration
	i := 0
	for b.Loop() {
		spec := api.SandboxSpec{Layers: layers}
		if i%2 == 1 {
			spec.Memory, spec.Pids = api.Unlimited, api.Unlimited
		}
		f, _ := createExecRemove(b, c, spec)
		first[i%2] = append(first[i%2], f)
		i++
	}
	report(b, "defaults", first[0])
	report(b, "unlimited", first[1])
}

// BenchmarkExec: one exec of true into a running sandbox.
func BenchmarkExec(b *testing.B) { benchExec(b, "exec", sdk.ExecOptions{Args: []string{"true"}}) }

// BenchmarkExecOutput: one exec writing 16 MiB to its stdout, which
// the journal keeps and the client gets streamed.
func BenchmarkExecOutput(b *testing.B) {
	b.SetBytes(16 << 20)
	benchExec(b, "exec-16MiB", sdk.ExecOptions{Args: []string{"head", "-c", "16777216", "/dev/zero"}, Stdout: io.Discard})
}

// benchExec times exec of opts into a running sandbox, as name.
func benchExec(b *testing.B, name string, opts sdk.ExecOptions) {
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
		if res, err := sb.Exec(ctx, opts); err != nil || res.ExitCode != 0 {
			b.Fatal(res, err)
		}
		d = append(d, time.Since(t0))
	}
	report(b, name, d)
}

// BenchmarkApplyPolicy: a running sandbox's egress allowlist changed
// live, alternating between 1,000 rules and one, next to what the change
// costs without live apply: a new sandbox under the new policy, ready
// for its first command (one for every ten applies).
func BenchmarkApplyPolicy(b *testing.B) {
	c, layers := benchClient(b)
	ctx := context.Background()
	many := &api.Policy{APIVersion: api.PolicyVersion, Kind: "Policy", Network: &api.NetworkPolicy{}}
	for i := range 999 {
		many.Network.Egress = append(many.Network.Egress, api.EgressRule{To: fmt.Sprintf("10.%d.%d.0/24", i/256, i%256),
			Ports: []api.PortRange{{Low: 443, High: 443}}})
	}
	many.Network.Egress = append(many.Network.Egress, api.EgressRule{To: "127.0.0.1/32"})
	one := &api.Policy{APIVersion: api.PolicyVersion, Kind: "Policy", Network: &api.NetworkPolicy{Egress: []api.EgressRule{{To: "127.0.0.1/32"}}}}
	sb, err := c.Create(ctx, api.SandboxSpec{Layers: layers, Policy: one})
	if err != nil {
		b.Fatal(err)
	}
	defer sb.Remove(ctx, true)
	var apply, recreate []time.Duration
	i := 0
	for b.Loop() {
		p := many
		if i%2 == 1 {
			p = one
		}
		t0 := time.Now()
		if _, err := sb.ApplyPolicy(ctx, api.PolicyRequest{Policy: p}); err != nil {
			b.Fatal(err)
		}
		apply = append(apply, time.Since(t0))
		if i%10 == 0 {
			t0 = time.Now()
			nb, err := c.Create(ctx, api.SandboxSpec{Layers: layers, Policy: p})
			if err != nil {
				b.Fatal(err)
			}
			if res, err := nb.Exec(ctx, sdk.ExecOptions{Args: []string{"true"}}); err != nil || res.ExitCode != 0 {
				b.Fatal(res, err)
			}
			recreate = append(recreate, time.Since(t0))
			if err := nb.Remove(ctx, true); err != nil {
				b.Fatal(err)
			}
		}
		i++
	}
	report(b, "apply", apply)
	report(b, "recreate", recreate)
}
