package sdk_test

import (
	"bytes"
	"context"
	"crypto/rand"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"testing"
	"time"

	"github.com/dsec-project/dsec/api"
	"github.com/dsec-project/dsec/internal/layer"
	"github.com/dsec-project/dsec/internal/layer/store"
	"github.com/dsec-project/dsec/internal/runtime/microvm"
	"github.com/dsec-project/dsec/internal/runtime/microvm/microvmtest"
	"github.com/dsec-project/dsec/internal/runtime/runtimetest"
	"github.com/dsec-project/dsec/internal/runtime/worker"
	"github.com/dsec-project/dsec/sdk"
)

// microVMClient is a test worker on busybox layers that runs microVMs,
// configured by cfg besides.
func microVMClient(b *testing.B, cfg runtimetest.Config) (*runtimetest.Worker, *sdk.Client) {
	cfg.MicroVM = microvmtest.Settings(b)
	root := b.TempDir()
	runtimetest.Layers(b, root)
	w := runtimetest.StartWorkerWith(b, root, cfg)
	b.Cleanup(func() { w.Kill(); runtimetest.Clean(root) })
	c, err := sdk.New(sdk.Options{Root: root})
	if err != nil {
		b.Fatal(err)
	}
	return w, c
}

// BenchmarkMicroVM: create to first exec of a microVM booted for the
// create (cold), of one taken from a warm pool (a FnCall call: the
// guest waited booted and paused), and of a container, in rounds that
// take turns; then exec of true in a running microVM and in a running
// container. The accelerator is the host's (metric kvm=1 or tcg=1).
func BenchmarkMicroVM(b *testing.B) {
	vm := api.SandboxSpec{Backend: "microvm", Layers: []string{"bb:1"}, Memory: 512 << 20}
	_, c := microVMClient(b, runtimetest.Config{Admission: worker.Admission{Primed: -1},
		Pools: []worker.PoolConfig{{Name: "vms", Size: 1, Spec: vm}}})
	ctx := context.Background()
	trueCmd := sdk.ExecOptions{Args: []string{"true"}}
	var cold, warm, ctr []time.Duration
	for b.Loop() {
		d, _ := createExecRemove(b, c, api.SandboxSpec{Backend: "microvm", Layers: vm.Layers, Memory: vm.Memory})
		cold = append(cold, d)
		d, _ = createExecRemove(b, c, api.SandboxSpec{Layers: vm.Layers})
		ctr = append(ctr, d)
		b.StopTimer()
		waitWarm(b, c, "vms")
		b.StartTimer()
		t0 := time.Now()
		res, err := c.Call(ctx, sdk.CallOptions{Pool: "vms", ExecOptions: trueCmd})
		if err != nil || !res.Warm || res.ExitCode != 0 {
			b.Fatalf("a call on the warm pool: %+v %v", res, err)
		}
		warm = append(warm, time.Since(t0))
	}
	report(b, "microvm-cold", cold)
	report(b, "microvm-warm", warm)
	report(b, "container", ctr)
	// Exec in a running one of each.
	var vmExec, ctrExec []time.Duration
	v, err := c.Create(ctx, vm)
	if err != nil {
		b.Fatal(err)
	}
	defer v.Remove(ctx, true)
	k, err := c.Create(ctx, api.SandboxSpec{Layers: vm.Layers})
	if err != nil {
		b.Fatal(err)
	}
	defer k.Remove(ctx, true)
	for range max(20, 4*b.N) {
		for _, s := range []struct {
			sb *sdk.Sandbox
			d  *[]time.Duration
		}{{v, &vmExec}, {k, &ctrExec}} {
			t0 := time.Now()
			if res, err := s.sb.Exec(ctx, trueCmd); err != nil || res.ExitCode != 0 {
				b.Fatalf("exec: %+v %v", res, err)
			}
			*s.d = append(*s.d, time.Since(t0))
		}
	}
	report(b, "microvm-exec", vmExec)
	report(b, "container-exec", ctrExec)
	b.ReportMetric(1, microvm.DetectAccel().Name)
}

// waitWarm waits for the pool to hold a warm sandbox.
func waitWarm(b *testing.B, c *sdk.Client, pool string) {
	for deadline := time.Now().Add(2 * time.Minute); time.Now().Before(deadline); time.Sleep(50 * time.Millisecond) {
		ps, err := c.Pools(context.Background())
		if err != nil {
			b.Fatal(err)
		}
		for _, p := range ps {
			if p.Name == pool && p.Warm > 0 {
				return
			}
		}
	}
	b.Fatalf("pool %s never held a warm sandbox", pool)
}

// hostUsed is the host's memory in use, page cache included
// (MemTotal - MemFree), in bytes.
func hostUsed(b *testing.B) int64 { return meminfo(b, "MemTotal") - meminfo(b, "MemFree") }

// BenchmarkMicroVMIdle: host memory per idle microVM (DSEC_BENCH_VMS,
// default 4, of 512 MiB each, booted, one command run, left 10 s), all
// of it (MemTotal - MemFree) and what their groups are charged, next to
// as many idle containers measured the same way.
func BenchmarkMicroVMIdle(b *testing.B) {
	n := 4
	if v, err := strconv.Atoi(os.Getenv("DSEC_BENCH_VMS")); err == nil && v > 0 {
		n = v
	}
	_, c := microVMClient(b, runtimetest.Config{Admission: worker.Admission{Primed: -1, Spares: -1}})
	ctx := context.Background()
	measure := func(spec api.SandboxSpec) (host, charged float64) {
		dropCaches()
		time.Sleep(time.Second)
		before := hostUsed(b)
		var sbs []*sdk.Sandbox
		for range n {
			sb, err := c.Create(ctx, spec)
			if err != nil {
				b.Fatal(err)
			}
			sbs = append(sbs, sb)
			if res, err := sb.Exec(ctx, sdk.ExecOptions{Args: []string{"true"}}); err != nil || res.ExitCode != 0 {
				b.Fatalf("exec: %+v %v", res, err)
			}
		}
		time.Sleep(10 * time.Second)
		used := hostUsed(b) - before
		var ch int64
		for _, sb := range sbs {
			info, err := sb.Inspect(ctx)
			if err != nil {
				b.Fatal(err)
			}
			ch += info.MemoryBytes
		}
		for _, sb := range sbs {
			sb.Remove(ctx, true)
		}
		return float64(used) / float64(n) / (1 << 20), float64(ch) / float64(n) / (1 << 20)
	}
	for b.Loop() {
		h, ch := measure(api.SandboxSpec{Backend: "microvm", Layers: []string{"bb:1"}, Memory: 512 << 20})
		b.ReportMetric(h, "microvm-host-MiB/sandbox")
		b.ReportMetric(ch, "microvm-charged-MiB/sandbox")
		h, ch = measure(api.SandboxSpec{Layers: []string{"bb:1"}, Memory: 512 << 20})
		b.ReportMetric(h, "container-host-MiB/sandbox")
		b.ReportMetric(ch, "container-charged-MiB/sandbox")
	}
	b.ReportMetric(1, microvm.DetectAccel().Name)
}

// quietWorker starts root's worker, running microVMs with cfg and
// making nothing ahead, then drops the host's caches; it returns its
// client and the host's memory in use then (hostUsed), and stop, which
// ends it.
func quietWorker(b *testing.B, root string, cfg microvm.Settings) (c *sdk.Client, before int64, stop func()) {
	w := runtimetest.StartWorkerWith(b, root, runtimetest.Config{MicroVM: cfg, Admission: worker.Admission{Primed: -1, Spares: -1}})
	stop = func() { w.Kill(); runtimetest.Clean(root) }
	c, err := sdk.New(sdk.Options{Root: root})
	if err != nil {
		stop()
		b.Fatal(err)
	}
	dropCaches()
	time.Sleep(time.Second)
	return c, hostUsed(b), stop
}

// randomLayer builds into root's store the workspace layer tag: files
// /part0, /part1... of 200 MiB of random bytes each (nothing to merge
// or compress).
func randomLayer(b *testing.B, root, tag string, files int) {
	src := b.TempDir()
	defer os.RemoveAll(src)
	buf := make([]byte, 1<<20)
	for i := range files {
		f, err := os.Create(filepath.Join(src, fmt.Sprintf("part%d", i)))
		if err != nil {
			b.Fatal(err)
		}
		for range 200 {
			rand.Read(buf)
			f.Write(buf)
		}
		f.Close()
	}
	s, err := store.Open(filepath.Join(root, "store"))
	if err != nil {
		b.Fatal(err)
	}
	ref, _ := layer.ParseRef(tag)
	if _, err := layer.Build(context.Background(), s, layer.BuildOptions{Source: src, Kind: layer.KindWorkspace, Ref: ref}); err != nil {
		b.Fatal(err)
	}
}

// BenchmarkMicroVMDAX: the host memory DSEC_BENCH_VMS microVMs (default
// 4, of 768 MiB each) take once each has read the same 400 MiB of one
// 600 MiB layer, with the layer on a pmem device read through DAX (every
// guest reads the host's one page-cache copy, caching nothing itself)
// and with the layer on a virtio-blk disk (each guest caches what it
// reads; direct I/O, so the host caches nothing): DSec measured -40.2%
// peak host memory for sharing the page cache so.
func BenchmarkMicroVMDAX(b *testing.B) {
	n := 4
	if v, err := strconv.Atoi(os.Getenv("DSEC_BENCH_VMS")); err == nil && v > 0 {
		n = v
	}
	settings := microvmtest.Settings(b)
	root := b.TempDir()
	runtimetest.Layers(b, root)
	randomLayer(b, root, "big:1", 3)
	ctx := context.Background()
	measure := func(disks bool) float64 {
		cfg := settings
		cfg.LayerDisks = disks
		c, before, stop := quietWorker(b, root, cfg)
		defer stop()
		var sbs []*sdk.Sandbox
		for range n {
			sb, err := c.Create(ctx, api.SandboxSpec{Backend: "microvm", Layers: []string{"big:1", "bb:1"}, Memory: 768 << 20})
			if err != nil {
				b.Fatal(err)
			}
			sbs = append(sbs, sb)
			var out bytes.Buffer
			if res, err := sb.Exec(ctx, sdk.ExecOptions{Args: []string{"sh", "-c", "cat /part0 /part1 > /dev/null"}, Stderr: &out}); err != nil || res.ExitCode != 0 {
				b.Fatalf("read the layer: %+v %v %s", res, err, out.String())
			}
		}
		used := hostUsed(b) - before
		for _, sb := range sbs {
			sb.Remove(ctx, true)
		}
		return float64(used) / (1 << 20)
	}
	// The layer's padded image is made once per host, by the first guest
	// on it: made now, not measured.
	measureOne := n
	n = 1
	measure(false)
	n = measureOne
	for b.Loop() {
		dax := measure(false)
		blk := measure(true)
		b.ReportMetric(dax, "dax-host-MiB")
		b.ReportMetric(blk, "blk-host-MiB")
		b.ReportMetric(dax/blk, "dax/blk")
	}
	b.ReportMetric(float64(n), "vms")
	b.ReportMetric(1, microvm.DetectAccel().Name)
}
