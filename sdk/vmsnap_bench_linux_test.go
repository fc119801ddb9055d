package sdk_test

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"slices"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/dsec-project/dsec/api"
	"github.com/dsec-project/dsec/internal/runtime/microvm"
	"github.com/dsec-project/dsec/internal/runtime/microvm/microvmtest"
	"github.com/dsec-project/dsec/internal/runtime/runtimetest"
	"github.com/dsec-project/dsec/internal/runtime/worker"
	"github.com/dsec-project/dsec/sdk"
)

// exec runs script in sb, failing b if it fails.
func execB(b *testing.B, sb *sdk.Sandbox, script string) {
	b.Helper()
	var out bytes.Buffer
	res, err := sb.Exec(context.Background(), sdk.ExecOptions{Args: []string{"sh", "-c", script}, Stdout: &out, Stderr: &out})
	if err != nil || res.ExitCode != 0 {
		b.Fatalf("%s: %+v %v %s", script, res, err, out.String())
	}
}

// BenchmarkMicroVMSnapshot: memory snapshots of 512 MiB guests that
// touched 64 and 256 MiB more than their boot (a file of random bytes
// written, in the guest's page cache and on its disk), how long each
// guest was paused and what the
// snapshot holds; create to first exec of a sandbox restored from a
// memory snapshot versus one booted afresh; and K (DSEC_BENCH_BRANCHES,
// default 16) branches of one memory snapshot, all answering an exec.
func BenchmarkMicroVMSnapshot(b *testing.B) {
	_, c := microVMClient(b, runtimetest.Config{Admission: worker.Admission{Primed: -1, Spares: -1}})
	ctx := context.Background()
	vm := api.SandboxSpec{Backend: "microvm", Layers: []string{"bb:1"}, Memory: 512 << 20}
	tag := 0
	for _, mib := range []int{64, 256} {
		sb, err := c.Create(ctx, vm)
		if err != nil {
			b.Fatal(err)
		}
		// A file of random bytes, in the guest's page cache.
		execB(b, sb, fmt.Sprintf("dd if=/dev/urandom of=/root/fill bs=1M count=%d 2>/dev/null && sync", mib))
		var paused []time.Duration
		var ram, total float64
		for range 3 {
			tag++
			s, err := sb.PackDiff(ctx, api.PackRequest{Tag: fmt.Sprintf("bench:%d", tag), Memory: true})
			if err != nil {
				b.Fatal(err)
			}
			paused = append(paused, time.Duration(s.Memory.PausedSeconds*float64(time.Second)))
			ram = float64(s.Memory.RAMBytes) / (1 << 20)
			total = float64(s.Memory.RAMBytes+s.Memory.DiskBytes+s.Memory.StateBytes+s.Size) / (1 << 20)
		}
		sb.Remove(ctx, true)
		slices.Sort(paused)
		// Reported once b.Loop has reset the metrics.
		defer b.ReportMetric(float64(paused[len(paused)/2].Microseconds())/1000, fmt.Sprintf("paused-%dMiB-ms", mib))
		defer b.ReportMetric(ram, fmt.Sprintf("ram-%dMiB-MiB", mib))
		defer b.ReportMetric(total, fmt.Sprintf("snapshot-%dMiB-MiB", mib))
	}

	// Restore versus boot, each to its first exec.
	src, err := c.Create(ctx, vm)
	if err != nil {
		b.Fatal(err)
	}
	execB(b, src, "true")
	if _, err := src.PackDiff(ctx, api.PackRequest{Tag: "bench:src", Memory: true}); err != nil {
		b.Fatal(err)
	}
	var restore, cold []time.Duration
	for b.Loop() {
		d, _ := createExecRemove(b, c, api.SandboxSpec{Snapshot: "bench:src"})
		restore = append(restore, d)
		d, _ = createExecRemove(b, c, vm)
		cold = append(cold, d)
	}
	report(b, "restore", restore)
	report(b, "cold", cold)

	// K branches, each answering an exec.
	k := 16
	if v, err := strconv.Atoi(os.Getenv("DSEC_BENCH_BRANCHES")); err == nil && v > 0 {
		k = v
	}
	t0 := time.Now()
	brs, err := c.Branch(ctx, api.BranchRequest{Snapshot: "bench:src", N: k})
	if err != nil {
		b.Fatal(err)
	}
	var wg sync.WaitGroup
	for _, br := range brs {
		wg.Add(1)
		go func() { defer wg.Done(); execB(b, br, "true") }()
	}
	wg.Wait()
	b.ReportMetric(float64(time.Since(t0).Milliseconds()), fmt.Sprintf("branch-%d-ms", k))
	for _, br := range brs {
		br.Remove(ctx, true)
	}
	src.Remove(ctx, true)
	b.ReportMetric(1, microvm.DetectAccel().Name)
}

// BenchmarkMicroVMBalloon: host memory over time of DSEC_BENCH_VMS
// (default 8) microVMs of 512 MiB, each reading 200 MiB of a layer and
// filling then freeing 150 MiB of page cache, then idle: host memory in
// use (MemTotal - MemFree, over what it was before) sampled every 500 ms
// for 60 s, and its mean (the time-accumulated figure DSec reports,
// -21.2% for free page reporting), with the layer on virtio-blk disks or
// pmem devices read through DAX, and with the balloon's free page
// reporting on or off.
func BenchmarkMicroVMBalloon(b *testing.B) {
	n := 8
	if v, err := strconv.Atoi(os.Getenv("DSEC_BENCH_VMS")); err == nil && v > 0 {
		n = v
	}
	settings := microvmtest.Settings(b)
	root := b.TempDir()
	runtimetest.Layers(b, root)
	randomLayer(b, root, "data:1", 1)
	ctx := context.Background()
	const work = "cat /part0 > /dev/null && dd if=/dev/urandom of=/tmp/fill bs=1M count=150 2>/dev/null && sync && rm /tmp/fill"
	measure := func(disks, noReporting bool) (mean, peak float64) {
		cfg := settings
		cfg.LayerDisks, cfg.NoFreePageReporting = disks, noReporting
		c, before, stop := quietWorker(b, root, cfg)
		defer stop()
		var sbs []*sdk.Sandbox
		for range n {
			sb, err := c.Create(ctx, api.SandboxSpec{Backend: "microvm", Layers: []string{"data:1", "bb:1"}, Memory: 512 << 20})
			if err != nil {
				b.Fatal(err)
			}
			sbs = append(sbs, sb)
		}
		defer func() {
			for _, sb := range sbs {
				sb.Remove(ctx, true)
			}
		}()
		var wg sync.WaitGroup
		for _, sb := range sbs {
			wg.Add(1)
			go func() { defer wg.Done(); execB(b, sb, work) }()
		}
		var sum float64
		samples := 0
		for end := time.Now().Add(60 * time.Second); time.Now().Before(end); time.Sleep(500 * time.Millisecond) {
			used := float64(hostUsed(b)-before) / (1 << 20)
			sum += used
			peak = max(peak, used)
			samples++
		}
		wg.Wait()
		return sum / float64(samples), peak
	}
	// The layer's padded image is made by the first guest on it: made
	// now, not measured.
	was := n
	n = 1
	measure(false, false)
	n = was
	for b.Loop() {
		for _, m := range []struct {
			name               string
			disks, noReporting bool
		}{{"blk", true, true}, {"blk-reporting", true, false}, {"dax", false, true}, {"dax-reporting", false, false}} {
			mean, peak := measure(m.disks, m.noReporting)
			b.ReportMetric(mean, m.name+"-mean-MiB")
			b.ReportMetric(peak, m.name+"-peak-MiB")
		}
	}
	b.ReportMetric(float64(n), "vms")
	b.ReportMetric(1, microvm.DetectAccel().Name)
}
