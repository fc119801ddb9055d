package sdk_test

import (
	"bufio"
	"context"
	"fmt"
	"os"
	goruntime "runtime"
	"strconv"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/dsec-project/dsec/api"
	"github.com/dsec-project/dsec/internal/runtime/runtimetest"
	"github.com/dsec-project/dsec/internal/runtime/worker"
	"github.com/dsec-project/dsec/sdk"
)

// densityClient is a test worker on busybox layers configured by cfg.
func densityClient(b *testing.B, cfg runtimetest.Config) (*sdk.Client, string) {
	root := b.TempDir()
	runtimetest.Layers(b, root)
	w := runtimetest.StartWorkerWith(b, root, cfg)
	b.Cleanup(func() { w.Kill(); runtimetest.Clean(root) })
	c, err := sdk.New(sdk.Options{Root: root})
	if err != nil {
		b.Fatal(err)
	}
	return c, root
}

func execTrue(b *testing.B, sb *sdk.Sandbox) time.Duration {
	t0 := time.Now()
	if res, err := sb.Exec(context.Background(), sdk.ExecOptions{Args: []string{"true"}}); err != nil || res.ExitCode != 0 {
		b.Fatal(res, err)
	}
	return time.Since(t0)
}

// BenchmarkFnCall: a call on a warm pool (true in a fresh sandbox,
// discarded after) vs an exec of true in a running sandbox, alternating.
// Each call waits for the pool to be full again first (untimed): the
// figure is a warm call's, not the refill's.
func BenchmarkFnCall(b *testing.B) {
	tmpl := api.SandboxSpec{Layers: []string{"bb:1"}}
	c, _ := densityClient(b, runtimetest.Config{Pools: []worker.PoolConfig{{Name: "bench", Size: 2, Spec: tmpl}}})
	ctx := context.Background()
	sb, err := c.Create(ctx, tmpl)
	if err != nil {
		b.Fatal(err)
	}
	full := func() {
		for {
			pools, err := c.Pools(ctx)
			if err != nil {
				b.Fatal(err)
			}
			if all, _ := c.ListAll(ctx); pools[0].Warm == 2 && len(all) == 3 { // discarded too
				return
			}
			time.Sleep(time.Millisecond)
		}
	}
	var calls, execs []time.Duration
	for b.Loop() {
		b.StopTimer()
		full()
		b.StartTimer()
		t0 := time.Now()
		res, err := c.Call(ctx, sdk.CallOptions{Pool: "bench", ExecOptions: sdk.ExecOptions{Args: []string{"true"}}})
		if err != nil || res.ExitCode != 0 || !res.Warm {
			b.Fatal(res, err)
		}
		calls = append(calls, time.Since(t0))
		execs = append(execs, execTrue(b, sb))
	}
	report(b, "call", calls)
	report(b, "exec", execs)
}

// BenchmarkInterference: exec latency into a latency-class sandbox
// alone, with two batch sandboxes spinning under a 0.5 CPU limit each
// (half the host's 2 CPUs), and with the same load in latency-class
// sandboxes (no class distinction: the mapping off), and alone again.
// The four take turns in rounds of 10 execs, so that drift in the VM's
// speed falls on all alike.
func BenchmarkInterference(b *testing.B) {
	c, _ := densityClient(b, runtimetest.Config{})
	ctx := context.Background()
	lat, err := c.Create(ctx, api.SandboxSpec{Layers: []string{"bb:1"}, Class: api.SchedLatency})
	if err != nil {
		b.Fatal(err)
	}
	load := map[string][]*sdk.Sandbox{}
	for _, class := range []string{api.SchedBatch, api.SchedLatency} {
		for i := 0; i < 2; i++ {
			sb, err := c.Create(ctx, api.SandboxSpec{Layers: []string{"bb:1"}, Class: class, CPU: 0.5})
			if err != nil {
				b.Fatal(err)
			}
			load[class] = append(load[class], sb)
		}
	}
	spin := func(class string, on bool) {
		for _, sb := range load[class] {
			args := []string{"sh", "-c", "while :; do :; done"}
			if !on {
				args = []string{"kill", "-9", "-1"} // all but the init
			}
			if _, err := sb.Exec(ctx, sdk.ExecOptions{Args: args, Detach: on}); err != nil {
				b.Fatal(err)
			}
		}
		if on {
			time.Sleep(100 * time.Millisecond)
		}
	}
	// The fourth condition repeats the first: how far two runs of the
	// same condition differ here is the figure's resolution.
	var alone, mapped, again, unmapped []time.Duration
	phases := []struct {
		name, class string
		into        *[]time.Duration
	}{{"alone", "", &alone}, {"batch-load", api.SchedBatch, &mapped}, {"alone-again", "", &again}, {"unmapped-load", api.SchedLatency, &unmapped}}
	// DSEC_BENCH_TRACE=1 marks each exec in the kernel's trace
	// (scripts/trace-interference.sh reads them).
	var mark *os.File
	if os.Getenv("DSEC_BENCH_TRACE") == "1" {
		if mark, err = os.OpenFile("/sys/kernel/tracing/trace_marker", os.O_WRONLY, 0); err != nil {
			b.Fatal(err)
		}
		defer mark.Close()
	}
	steal0, total0 := cpuTimes(b)
	for b.Loop() {
		for _, ph := range phases {
			if ph.class != "" {
				b.StopTimer()
				spin(ph.class, true)
				b.StartTimer()
			}
			for i := 0; i < 10; i++ {
				time.Sleep(2 * time.Millisecond)
				if mark != nil {
					fmt.Fprintf(mark, "dsecx %s b\n", ph.name)
				}
				*ph.into = append(*ph.into, execTrue(b, lat))
				if mark != nil {
					fmt.Fprintf(mark, "dsecx %s e\n", ph.name)
				}
			}
			if ph.class != "" {
				b.StopTimer()
				spin(ph.class, false)
				b.StartTimer()
			}
		}
	}
	// Time the hypervisor ran something else while a vCPU wanted to run:
	// a run with much of it measured the host's neighbours, not dsec.
	steal1, total1 := cpuTimes(b)
	b.ReportMetric(100*float64(steal1-steal0)/float64(max(1, total1-total0)), "steal-%")
	for _, ph := range phases {
		report(b, ph.name, *ph.into)
		b.ReportMetric(float64(mean(*ph.into).Microseconds())/1000, ph.name+"-mean-ms")
	}
}

// mean is the average of d.
func mean(d []time.Duration) time.Duration {
	var sum time.Duration
	for _, x := range d {
		sum += x
	}
	return sum / time.Duration(max(1, len(d)))
}

// cpuTimes reads the host's stolen and total CPU time (/proc/stat, in
// ticks).
func cpuTimes(b *testing.B) (steal, total int64) {
	data, err := os.ReadFile("/proc/stat")
	if err != nil {
		b.Fatal(err)
	}
	line, _, _ := strings.Cut(string(data), "\n")
	// cpu user nice system idle iowait irq softirq steal guest guest_nice:
	// the guest columns are counted in user and nice already.
	f := strings.Fields(line)
	if len(f) < 9 {
		b.Fatalf("/proc/stat: %q has no steal column", line)
	}
	for i, v := range f[1:9] {
		n, err := strconv.ParseInt(v, 10, 64)
		if err != nil {
			b.Fatalf("/proc/stat: %v", err)
		}
		total += n
		if i == 7 {
			steal = n
		}
	}
	return steal, total
}

// meminfo reads a /proc/meminfo field in bytes.
func meminfo(b *testing.B, field string) int64 {
	f, err := os.Open("/proc/meminfo")
	if err != nil {
		b.Fatal(err)
	}
	defer f.Close()
	s := bufio.NewScanner(f)
	for s.Scan() {
		if v, ok := strings.CutPrefix(s.Text(), field+":"); ok {
			kb, _ := strconv.ParseInt(strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(v), "kB")), 10, 64)
			return kb << 10
		}
	}
	b.Fatalf("no %s in /proc/meminfo", field)
	return 0
}

// pss is the proportional set size of a process, in bytes.
func pss(pid int) int64 {
	b, _ := os.ReadFile(fmt.Sprintf("/proc/%d/smaps_rollup", pid))
	for _, line := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(line, "Pss:"); ok {
			kb, _ := strconv.ParseInt(strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(v), "kB")), 10, 64)
			return kb << 10
		}
	}
	return 0
}

// sandboxPids lists the host pids of a sandbox's processes but its init.
func sandboxPids(info api.Sandbox) []int {
	b, _ := os.ReadFile(info.Cgroup + "/cgroup.procs")
	var out []int
	for _, f := range strings.Fields(string(b)) {
		if pid, _ := strconv.Atoi(f); pid != info.Pid && pid > 0 {
			out = append(out, pid)
		}
	}
	return out
}

// BenchmarkDensity starts idle stateful sandboxes (each a resident
// sleep and 2 MiB of written files) at 1 CPU requested each, under a
// 500x CPU overcommit, until DSEC_DENSITY_N (default 1000) run or the
// host's available memory falls to its reserve (2 GiB), and reports the
// count and the host memory each takes beyond its own processes'
// proportional set size. Run once (-benchtime 1x).
func BenchmarkDensity(b *testing.B) {
	want := 1000
	if s := os.Getenv("DSEC_DENSITY_N"); s != "" {
		want, _ = strconv.Atoi(s)
	}
	const reserve = 2 << 30
	c, _ := densityClient(b, runtimetest.Config{Admission: worker.Admission{CPUOvercommit: 500, HostReserve: reserve, MaxCreating: 4}})
	ctx := context.Background()
	for b.Loop() {
		dropCaches()
		avail0 := meminfo(b, "MemAvailable")
		t0 := time.Now()
		var sbs []*sdk.Sandbox
		for len(sbs) < want && meminfo(b, "MemAvailable") > reserve {
			sb, err := c.Create(ctx, api.SandboxSpec{Layers: []string{"bb:1"}, CPU: 1, CPURequest: 1, Memory: 64 << 20, MemoryRequest: 16 << 20})
			if err != nil {
				b.Fatalf("sandbox %d: %v", len(sbs)+1, err)
			}
			if res, err := sb.Exec(ctx, sdk.ExecOptions{Args: []string{"sh", "-c", "dd if=/dev/urandom of=/tmp/state bs=1M count=2 2>/dev/null; sleep 100000 &"}}); err != nil || res.ExitCode != 0 {
				b.Fatal(res, err)
			}
			sbs = append(sbs, sb)
		}
		elapsed := time.Since(t0)
		time.Sleep(2 * time.Second) // settle
		dropCaches()
		avail1 := meminfo(b, "MemAvailable")
		var own, charged, initPss int64
		list, err := c.List(ctx)
		if err != nil {
			b.Fatal(err)
		}
		for _, info := range list {
			charged += info.MemoryBytes
			initPss += pss(info.Pid)
			for _, pid := range sandboxPids(info) {
				own += pss(pid)
			}
		}
		n := int64(len(sbs))
		used := avail0 - avail1
		b.ReportMetric(float64(n), "sandboxes")
		b.ReportMetric(float64(n)/float64(goruntime.NumCPU()), "cpu-overcommit")
		b.ReportMetric(float64(used)/float64(n)/(1<<20), "host-MiB/sandbox")
		b.ReportMetric(float64(used-own)/float64(n)/(1<<20), "overhead-MiB/sandbox")
		b.ReportMetric(float64(own)/float64(n)/(1<<20), "own-pss-MiB/sandbox")
		b.ReportMetric(float64(initPss)/float64(n)/(1<<20), "init-pss-MiB/sandbox")
		b.ReportMetric(float64(charged)/float64(n)/(1<<20), "charged-MiB/sandbox")
		b.ReportMetric(elapsed.Seconds()/float64(n)*1000, "start-ms/sandbox")
		for _, sb := range sbs {
			if err := sb.Remove(ctx, true); err != nil {
				b.Fatal(err)
			}
		}
	}
}

// dropCaches writes back and drops clean page cache, so that
// MemAvailable compares like with like.
func dropCaches() {
	unix.Sync()
	os.WriteFile("/proc/sys/vm/drop_caches", []byte("3"), 0)
}
