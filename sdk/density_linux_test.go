package sdk_test

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"path/filepath"
	goruntime "runtime"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/containerd/errdefs"

	"github.com/dsec-project/dsec/api"
	"github.com/dsec-project/dsec/internal/policy"
	dsecrt "github.com/dsec-project/dsec/internal/runtime"
	"github.com/dsec-project/dsec/internal/runtime/cgroup"
	"github.com/dsec-project/dsec/internal/runtime/runtimetest"
	"github.com/dsec-project/dsec/internal/runtime/worker"
	"github.com/dsec-project/dsec/sdk"
)

// waitFor polls cond until it holds or 20 s pass.
func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	for deadline := time.Now().Add(20 * time.Second); !cond(); time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
	}
}

func warm(t *testing.T, c *sdk.Client, name string) int {
	t.Helper()
	pools, err := c.Pools(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range pools {
		if p.Name == name {
			return p.Warm
		}
	}
	t.Fatalf("no pool %s in %+v", name, pools)
	return 0
}

func call(t *testing.T, c *sdk.Client, opts sdk.CallOptions, script string) (string, sdk.CallResult) {
	t.Helper()
	var out bytes.Buffer
	opts.Args, opts.Stdout, opts.Stderr = []string{"sh", "-c", script}, &out, &out
	res, err := c.Call(context.Background(), opts)
	if err != nil {
		t.Fatalf("call %q: %v", script, err)
	}
	return out.String(), res
}

func TestFnCallNeverLeaksBetweenCalls(t *testing.T) {
	tmpl := api.SandboxSpec{Layers: []string{"ws:1", "bb:1"}, Memory: 64 << 20}
	w, c := setupWith(t, runtimetest.Config{Pools: []worker.PoolConfig{{Name: "p", Size: 2, Spec: tmpl}}})
	ctx := context.Background()
	waitFor(t, "the pool to fill", func() bool { return warm(t, c, "p") == 2 })
	// Every group of the worker's (the pool's sandboxes, its spares)
	// carries the device allowlist.
	names, err := cgroup.NewTree("").List("sb-", dsecrt.CgroupSuffix(w.Root))
	if err != nil || len(names) < 2 {
		t.Fatalf("the worker's groups: %v %v", names, err)
	}
	for _, n := range names {
		if g, err := cgroup.NewTree("").Open(n); err != nil || !policy.DevicesAttached(g.Path()) {
			t.Errorf("group %s: no device allowlist (%v)", n, err)
		}
	}

	// A call leaves a secret in files, a process and shared memory.
	out, first := call(t, c, sdk.CallOptions{Pool: "p"}, `echo s3cret > /tmp/secret; echo s3cret >> /work/hello; echo s3cret > /dev/shm/x 2>/dev/null; (sleep 1000 &); hostname; cat /work/hello`)
	if !first.Warm || first.Pool != "p" || first.ExitCode != 0 || !strings.Contains(out, "s3cret") {
		t.Fatalf("first call: %q %+v", out, first)
	}
	// The next, from the same pool by its template, finds none of it.
	out, second := call(t, c, sdk.CallOptions{Spec: &tmpl}, `cat /tmp/secret /dev/shm/x 2>&1; grep -c s3cret /work/hello; ps | grep -c '[s]leep 1000'; hostname`)
	if !second.Warm || second.Pool != "p" || second.Sandbox == first.Sandbox {
		t.Fatalf("second call did not get another warm sandbox of the pool: %+v after %+v", second.CallInfo, first.CallInfo)
	}
	if strings.Contains(out, "s3cret\n") || !strings.Contains(out, "0\n0\n") || strings.Contains(out, first.Sandbox) {
		t.Fatalf("the second call sees the first's state:\n%s", out)
	}
	// The used sandboxes go; the pool fills up again.
	waitFor(t, "the used sandboxes to be discarded and the pool refilled", func() bool {
		all, _ := c.ListAll(ctx)
		for _, s := range all {
			if s.Name == first.Sandbox || s.Name == second.Sandbox {
				return false
			}
		}
		return len(all) == 2 && warm(t, c, "p") == 2
	})
	if l, _ := c.List(ctx); len(l) != 0 {
		t.Errorf("ps without --all lists warm sandboxes: %+v", l)
	}

	// Exit codes, stdin, and a template no pool has (made for the call).
	res, err := c.Call(ctx, sdk.CallOptions{Pool: "p", ExecOptions: sdk.ExecOptions{Args: []string{"sh", "-c", "exit 7"}}})
	if err != nil || res.ExitCode != 7 {
		t.Fatalf("exit 7: %+v %v", res, err)
	}
	var got bytes.Buffer
	res, err = c.Call(ctx, sdk.CallOptions{Spec: &api.SandboxSpec{Layers: []string{"bb:1"}}, ExecOptions: sdk.ExecOptions{Args: []string{"cat"}, Stdin: strings.NewReader("in\n"), Stdout: &got}})
	if err != nil || res.Warm || res.Pool != "" || got.String() != "in\n" {
		t.Fatalf("a cold call with stdin: %q %+v %v", got.String(), res, err)
	}

	// Bad input.
	if _, err := c.Call(ctx, sdk.CallOptions{Pool: "nope", ExecOptions: sdk.ExecOptions{Args: []string{"true"}}}); !errdefs.IsNotFound(err) {
		t.Errorf("unknown pool: %v", err)
	}
	if _, err := c.ResizePool(ctx, "missing", api.PoolSpec{Size: 1, Spec: &api.SandboxSpec{Layers: []string{"nope:1"}}}); !errdefs.IsNotFound(err) {
		t.Errorf("a pool of a missing layer: %v", err)
	}
	if _, err := c.ResizePool(ctx, "neg", api.PoolSpec{Size: -1, Spec: &tmpl}); !errdefs.IsInvalidArgument(err) {
		t.Errorf("a negative pool size: %v", err)
	}
	if _, err := c.Create(ctx, api.SandboxSpec{Backend: "fncall", Layers: []string{"bb:1"}}); !errdefs.IsInvalidArgument(err) {
		t.Errorf("a persistent sandbox on fncall: %v", err)
	}
	if pools, _ := c.Pools(ctx); len(pools) != 1 {
		t.Errorf("refused pools were kept: %+v", pools)
	}

	// Resize: down to 0, a new pool, and both kept across a restart.
	if _, err := c.ResizePool(ctx, "p", api.PoolSpec{Size: 0}); err != nil {
		t.Fatal(err)
	}
	if _, err := c.ResizePool(ctx, "q", api.PoolSpec{Size: 1, Spec: &api.SandboxSpec{Layers: []string{"bb:1"}, Class: api.SchedBatch}}); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "p to empty", func() bool { all, _ := c.ListAll(ctx); return warm(t, c, "p") == 0 && len(all) == 1 })
	if err := c.RemovePool(ctx, "q"); err != nil {
		t.Fatal(err)
	}
	if all, _ := c.ListAll(ctx); len(all) != 0 {
		t.Fatalf("a removed pool's sandboxes stay: %+v", all)
	}
}

func TestAdmissionQueuesBursts(t *testing.T) {
	// Capacity: the host's CPUs x 1 of requests; one creation at a time.
	// The burst's last waits for five creates: under load (a machine
	// three times slower) each may take most of a second.
	cpus := float64(goruntime.NumCPU())
	const queueTimeout = 5 * time.Second
	_, c := setupWith(t, runtimetest.Config{Admission: worker.Admission{CPUOvercommit: 1, MaxCreating: 1, QueueTimeout: queueTimeout}})
	ctx := context.Background()
	if _, err := c.Create(ctx, api.SandboxSpec{Layers: []string{"bb:1"}, CPURequest: cpus + 1}); !errdefs.IsOutOfRange(err) {
		t.Fatalf("a request beyond the host: %v", err)
	}
	if _, err := c.Create(ctx, api.SandboxSpec{Layers: []string{"bb:1"}, CPU: 1, CPURequest: 2}); !errdefs.IsInvalidArgument(err) {
		t.Fatalf("a request above its limit: %v", err)
	}
	// A burst of 6 creations: one made at a time, the rest queued,
	// none dropped.
	var wg sync.WaitGroup
	errs := make([]error, 6)
	for i := range errs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			_, errs[i] = c.Create(ctx, api.SandboxSpec{Name: fmt.Sprint("burst-", i), Layers: []string{"bb:1"}, CPURequest: 0.01})
		}()
	}
	sawQueued := false
	done := make(chan struct{})
	go func() { wg.Wait(); close(done) }()
	for wait := true; wait; {
		select {
		case <-done:
			wait = false
		case <-time.After(2 * time.Millisecond):
			l, _ := c.List(ctx)
			creating := 0
			for _, s := range l {
				sawQueued = sawQueued || s.Status == api.StatusQueued
				if s.Status == api.StatusCreating {
					creating++
				}
			}
			if creating > 1 {
				t.Errorf("%d sandboxes made at once, admission.max_creating 1", creating)
			}
		}
	}
	for _, err := range errs {
		if err != nil {
			t.Fatal(err)
		}
	}
	if !sawQueued {
		t.Error("no sandbox of the burst was ever listed as queued")
	}
	// Fill the CPU requests: the next waits, is admitted when one goes,
	// and one that waits past the timeout fails as busy.
	full, err := c.Create(ctx, api.SandboxSpec{Name: "full", Layers: []string{"bb:1"}, CPURequest: cpus - 0.06})
	if err != nil {
		t.Fatal(err)
	}
	t0 := time.Now()
	if _, err := c.Create(ctx, api.SandboxSpec{Name: "late", Layers: []string{"bb:1"}, CPURequest: 0.5}); !errdefs.IsResourceExhausted(err) || time.Since(t0) < queueTimeout {
		t.Fatalf("past the queue timeout after %v: %v", time.Since(t0), err)
	}
	created := make(chan error, 1)
	go func() {
		_, err := c.Create(ctx, api.SandboxSpec{Name: "next", Layers: []string{"bb:1"}, CPURequest: 0.5})
		created <- err
	}()
	waitFor(t, "next to be queued", func() bool {
		l, _ := c.List(ctx)
		for _, s := range l {
			if s.Name == "next" {
				return s.Status == api.StatusQueued
			}
		}
		return false
	})
	if err := full.Remove(ctx, true); err != nil {
		t.Fatal(err)
	}
	if err := <-created; err != nil {
		t.Fatalf("queued behind a removed sandbox: %v", err)
	}
	// A stopped sandbox gives its capacity back and takes it to start.
	next := c.Sandbox("next")
	if err := next.Stop(ctx); err != nil {
		t.Fatal(err)
	}
	if _, err := c.Create(ctx, api.SandboxSpec{Name: "big", Layers: []string{"bb:1"}, CPURequest: cpus - 0.06}); err != nil {
		t.Fatal(err)
	}
	if err := next.Start(ctx); !errdefs.IsResourceExhausted(err) {
		t.Fatalf("start beyond capacity: %v", err)
	}
}

// cgroupFile reads a file of the sandbox's group in controller.
func cgroupFile(t *testing.T, pid int, controller, file string) string {
	t.Helper()
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/cgroup", pid))
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range strings.Split(string(b), "\n") {
		f := strings.SplitN(line, ":", 3)
		if len(f) == 3 && (f[1] == controller || f[0] == "0" && pureV2()) {
			v, err := os.ReadFile(filepath.Join("/sys/fs/cgroup", map[bool]string{true: "", false: controller}[pureV2()], f[2], file))
			if err != nil {
				t.Fatal(err)
			}
			return strings.TrimSpace(string(v))
		}
	}
	t.Fatalf("pid %d has no %s group", pid, controller)
	return ""
}

func pureV2() bool {
	_, err := os.Stat("/sys/fs/cgroup/cgroup.controllers")
	return err == nil
}

func TestClassesReclaimAndFigures(t *testing.T) {
	_, c := setupWith(t, runtimetest.Config{Reclaim: worker.Reclaim{IdleAfter: time.Second, KSM: true}})
	ctx := context.Background()
	lat := create(t, c, api.SandboxSpec{Name: "lat"})
	batch := create(t, c, api.SandboxSpec{Name: "batch", Class: api.SchedBatch})
	if _, err := c.Create(ctx, api.SandboxSpec{Layers: []string{"bb:1"}, Class: "urgent"}); !errdefs.IsInvalidArgument(err) {
		t.Fatalf("unknown class: %v", err)
	}
	// The class's mapping: cgroup settings and the commands' policy.
	for _, k := range []struct {
		sb                  *sdk.Sandbox
		class, idle, policy string
		weightFile, weight  string
	}{
		{lat, api.SchedLatency, "0", "0", "cpu.shares", "8192"},
		{batch, api.SchedBatch, "1", "5", "cpu.shares", "3"}, // the kernel's weight of an idle group
	} {
		info, _ := k.sb.Inspect(ctx)
		if info.Class != k.class {
			t.Errorf("%s: class %q", info.Name, info.Class)
		}
		if pureV2() {
			k.weightFile, k.weight = "cpu.weight", map[string]string{"8192": "800"}[k.weight] // an idle group's: unchecked
		}
		if v := cgroupFile(t, info.Pid, "cpu", "cpu.idle"); v != k.idle {
			t.Errorf("%s: cpu.idle %s", info.Name, v)
		}
		if v := cgroupFile(t, info.Pid, "cpu", k.weightFile); k.weight != "" && v != k.weight {
			t.Errorf("%s: %s %s, want %s", info.Name, k.weightFile, v, k.weight)
		}
		out, _ := run(t, k.sb, "policy", `cut -d' ' -f41 /proc/self/stat; grep ksm_merge_any /proc/self/ksm_stat`)
		if out != k.policy+"\nksm_merge_any: yes\n" {
			t.Errorf("%s: scheduling policy and KSM: %q", info.Name, out)
		}
	}

	// Reclaim: 32 MiB of page cache, then idle past a second. On a slow
	// host lat may have been idle a second already while batch was
	// made, and reclaimed then: only a reclaim after the write counts.
	wrote := time.Now()
	run(t, lat, "busy", `i=0; while [ $i -lt 100000 ]; do i=$((i+1)); done; dd if=/dev/zero of=/tmp/cache bs=1M count=32 2>/dev/null; sync`)
	info, _ := lat.Inspect(ctx)
	if info.MemoryBytes < 32<<20 || info.CPUSeconds < 0.05 || info.IdleSeconds > 1 || info.Reclaimed != nil && info.Reclaimed.After(wrote) {
		t.Fatalf("after writing 32 MiB: memory %d, cpu %gs, idle %gs, reclaimed %v", info.MemoryBytes, info.CPUSeconds, info.IdleSeconds, info.Reclaimed)
	}
	before := info.MemoryBytes
	waitFor(t, "the idle sandbox's memory to be reclaimed", func() bool {
		info, _ = lat.Inspect(ctx)
		return info.Reclaimed != nil && info.Reclaimed.After(wrote)
	})
	// Reclaim takes the page cache (anonymous memory stays: no swap).
	stat := cgroupFile(t, info.Pid, "memory", "memory.stat")
	cache := statValue(stat, map[bool]string{true: "file", false: "total_cache"}[pureV2()])
	if info.IdleSeconds < 1 || cache > 4<<20 || info.MemoryBytes > before-28<<20 {
		t.Fatalf("after reclaim: memory %d bytes (before %d), page cache %d, idle %gs; memory.stat:\n%s", info.MemoryBytes, before, cache, info.IdleSeconds, stat)
	}
	if anon := info.MemoryBytes - cache; anon > 16<<20 {
		t.Logf("after reclaim %d bytes of anonymous memory stay: %s", anon, groupRSS(t, info.Pid))
	}
	// The files are all there, read back from disk.
	if out, _ := run(t, lat, "after", "wc -c < /tmp/cache"); out != strconv.Itoa(32<<20)+"\n" {
		t.Fatalf("after reclaim: %q", out)
	}
}

func TestSandboxesShareTheLayersPageCache(t *testing.T) {
	w, c := setup(t)
	// A layer with a 32 MiB file.
	src := t.TempDir()
	big := bytes.Repeat([]byte("0123456789abcdef"), 2<<20)
	for i := range big {
		big[i] ^= byte(i >> 12)
	}
	os.MkdirAll(filepath.Join(src, "data"), 0o755)
	if err := os.WriteFile(filepath.Join(src, "data", "big"), big, 0o644); err != nil {
		t.Fatal(err)
	}
	buildLayer(t, w.Root, "data:1", src)
	ctx := context.Background()
	charged := func(sb *sdk.Sandbox) int64 { info, _ := sb.Inspect(ctx); return info.MemoryBytes }
	a := create(t, c, api.SandboxSpec{Name: "a", Layers: []string{"data:1", "bb:1"}})
	b := create(t, c, api.SandboxSpec{Name: "b", Layers: []string{"data:1", "bb:1"}})
	a0, b0 := charged(a), charged(b)
	run(t, a, "read", "cat /data/big > /dev/null")
	a1 := charged(a)
	run(t, b, "read", "cat /data/big > /dev/null")
	b1 := charged(b)
	// The first reader is charged the layer's pages; the second reads
	// the same pages: one page cache for every sandbox on the layer.
	if a1-a0 < 28<<20 || b1-b0 > 4<<20 {
		t.Fatalf("reading a 32 MiB layer file: the first sandbox charged %d bytes more, the second %d", a1-a0, b1-b0)
	}
}

// statValue is key's value in a memory.stat.
func statValue(stat, key string) int64 {
	for _, line := range strings.Split(stat, "\n") {
		if k, v, ok := strings.Cut(line, " "); ok && k == key {
			n, _ := strconv.ParseInt(v, 10, 64)
			return n
		}
	}
	return -1
}

// groupRSS lists the resident memory of each process in pid's memory
// cgroup.
func groupRSS(t *testing.T, pid int) string {
	var out []string
	for _, p := range strings.Fields(cgroupFile(t, pid, "memory", "cgroup.procs")) {
		comm, _ := os.ReadFile("/proc/" + p + "/comm")
		status, _ := os.ReadFile("/proc/" + p + "/status")
		rss := ""
		for _, line := range strings.Split(string(status), "\n") {
			if strings.HasPrefix(line, "VmRSS:") {
				rss = strings.Join(strings.Fields(line)[1:], " ")
			}
		}
		out = append(out, fmt.Sprintf("%s %s %s", p, strings.TrimSpace(string(comm)), rss))
	}
	return strings.Join(out, "; ")
}
