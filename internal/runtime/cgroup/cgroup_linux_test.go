package cgroup_test

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/dsec-project/dsec/internal/layer/layertest"
	"github.com/dsec-project/dsec/internal/runtime/cgroup"
	"github.com/dsec-project/dsec/internal/runtime/container"
	"github.com/dsec-project/dsec/internal/runtime/driver/microvms/agent"
	"github.com/dsec-project/dsec/internal/runtime/driver/microvms/vmm"
	"github.com/dsec-project/dsec/internal/runtime/microvm/microvmtest"
)

func TestMain(m *testing.M) {
	microvmtest.MaybeGuest(m) // TestOnPureV2Host's guest
	container.MaybeInit()
	vmm.MaybeRun()   // a microVM's shim
	agent.MaybeRun() // its guest's agent
	if os.Getenv(heavyExitEnv) == "1" {
		heavyExit()
	}
	os.Exit(m.Run())
}

// heavyExitEnv makes the test binary a process whose exit takes CPU: it
// touches 512 MiB, says so, and waits to be killed.
const heavyExitEnv = "CGROUP_TEST_HEAVY_EXIT"

func heavyExit() {
	b := make([]byte, 512<<20)
	for i := 0; i < len(b); i += 4096 {
		b[i] = 1
	}
	os.Stdout.WriteString("ready\n")
	select {}
}

// TestKillIdleOnBusyHost: the killed processes of an idle (batch) group
// exit, and the group goes, on a host whose CPUs are all busy: SCHED_IDLE
// tasks under the idle parent got a few thousandths of a CPU to exit
// there (freeing 512 MiB took seconds), and the group's removal gave up
// while they still held it.
func TestKillIdleOnBusyHost(t *testing.T) {
	layertest.RequireRoot(t)
	g, err := tree.New(fmt.Sprintf("test-idle-kill-%d", os.Getpid()), cgroup.Limits{Idle: true})
	if err != nil {
		t.Fatal(err)
	}
	defer g.Remove()
	cmd := exec.Command(os.Args[0])
	cmd.Env = append(os.Environ(), heavyExitEnv+"=1")
	out, _ := cmd.StdoutPipe()
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer cmd.Process.Kill()
	// Its memory touched at normal priority first (a busy host would
	// starve that too), then it runs as a batch sandbox's command does:
	// SCHED_IDLE, in an idle group.
	if _, err := out.Read(make([]byte, 6)); err != nil {
		t.Fatal(err)
	}
	if err := g.Add(cmd.Process.Pid); err != nil {
		t.Fatal(err)
	}
	tasks, _ := os.ReadDir(fmt.Sprintf("/proc/%d/task", cmd.Process.Pid))
	for _, task := range tasks {
		tid, _ := strconv.Atoi(task.Name())
		unix.SchedSetAttr(tid, &unix.SchedAttr{Size: unix.SizeofSchedAttr, Policy: unix.SCHED_IDLE}, 0)
	}
	for range runtime.NumCPU() { // every CPU busy at normal priority
		hog := exec.Command("sh", "-c", "while :; do :; done")
		if err := hog.Start(); err != nil {
			t.Fatal(err)
		}
		defer func() { hog.Process.Kill(); hog.Wait() }()
	}
	time.Sleep(100 * time.Millisecond)
	// As a sandbox's teardown does: kill, then remove, waiting for
	// nothing else.
	t0 := time.Now()
	if err := g.Kill(); err != nil {
		t.Fatalf("kill after %v: %v", time.Since(t0), err)
	}
	if err := g.Remove(); err != nil {
		t.Fatalf("remove %v after the kill: %v", time.Since(t0), err)
	}
	t.Logf("killed and removed in %v", time.Since(t0))
	// Moved out of the group to exit, it did exit, by the kill.
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	select {
	case err := <-done:
		if ws, ok := cmd.ProcessState.Sys().(syscall.WaitStatus); !ok || ws.Signal() != syscall.SIGKILL {
			t.Fatalf("the group's process ended with %v, not killed", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the group's process lives on outside the group 10 s after its kill")
	}
}

func busyboxRoot(t *testing.T) string { return layertest.BusyboxRoot(t, t.TempDir()) }

type result struct {
	code int
	err  error
}

// sandbox runs script in a new sandbox inside a new group; the result
// arrives on the channel.
func sandbox(t *testing.T, l cgroup.Limits, script string) (*cgroup.Group, *container.Conn, <-chan result, *os.File) {
	t.Helper()
	layertest.RequireRoot(t)
	name := fmt.Sprintf("test-%d-%d", os.Getpid(), time.Now().UnixNano())
	g, err := tree.New(name, l)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := g.Kill(); err != nil {
			t.Error(err)
		}
		if err := g.Remove(); err != nil {
			t.Error(err)
		}
	})
	var initErr lockedBuffer // written by the init's log copier while a cleanup reads it
	sb, err := container.Create(container.Spec{Root: busyboxRoot(t), Stderr: &initErr, Setup: g.Add,
		Socket: filepath.Join(t.TempDir(), "init.sock")})
	if err != nil {
		t.Fatalf("%v: %s", err, initErr.String())
	}
	t.Cleanup(func() {
		sb.Destroy()
		if t.Failed() {
			t.Logf("the init's stderr: %s", initErr.String())
		}
	})
	out, _ := os.CreateTemp(t.TempDir(), "out")
	ch := make(chan result, 1)
	finished := make(chan struct{})
	t.Cleanup(func() { // first: the command ends before its output closes
		g.Kill()
		<-finished
		out.Close()
	})
	go func() {
		defer close(finished)
		code, err := sb.Exec(context.Background(), container.Cmd{ID: "test", Args: []string{"/bin/sh", "-c", script}, Env: []string{"PATH=/bin"}, Stdout: out, Stderr: out})
		ch <- result{code, err}
	}()
	return g, sb, ch, out
}

// lockedBuffer is a bytes.Buffer safe for one writer and a reader.
type lockedBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *lockedBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *lockedBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

func output(f *os.File) string {
	b, _ := os.ReadFile(f.Name())
	return string(b)
}

func TestMemoryLimitReportsOOM(t *testing.T) {
	g, sb, ch, out := sandbox(t, cgroup.Limits{MemoryBytes: 32 << 20}, `dd if=/dev/zero of=/dev/null bs=256M count=1`)
	r := <-ch
	if r.err != nil {
		t.Fatal(r.err)
	}
	if r.code != 137 {
		t.Fatalf("a 256 MiB buffer under a 32 MiB limit exited %d: %s", r.code, output(out))
	}
	if g.OOMKills() == 0 {
		t.Fatalf("no OOM kill recorded: %s", output(out))
	}
	// The sandbox survived its command's OOM.
	if code, err := sb.Exec(context.Background(), container.Cmd{ID: "after", Args: []string{"true"}}); err != nil || code != 0 {
		t.Fatalf("sandbox after an OOM: %d %v", code, err)
	}
}

func TestPidsLimit(t *testing.T) {
	// The shell gives up (exit 2) at the first fork the limit refuses.
	g, _, ch, out := sandbox(t, cgroup.Limits{Pids: 16}, `i=0; while [ $i -lt 40 ]; do sleep 10 & i=$((i+1)); done; wait`)
	most := 0
	stop, done := make(chan struct{}), make(chan struct{})
	go func() {
		defer close(done)
		for {
			if pids, err := g.Pids(); err == nil {
				most = max(most, len(pids))
			}
			select {
			case <-stop:
				return
			case <-time.After(2 * time.Millisecond):
			}
		}
	}()
	r := <-ch
	close(stop)
	<-done
	if r.err != nil {
		t.Fatal(r.err)
	}
	if most > 16 || g.PidsLimitHits() == 0 {
		t.Fatalf("pids.max 16: up to %d processes, %d refused forks (exit %d): %s", most, g.PidsLimitHits(), r.code, output(out))
	}
}

func TestFreezeThawKill(t *testing.T) {
	g, sb, ch, _ := sandbox(t, cgroup.Limits{CPUMilli: 500}, `i=0; while true; do i=$((i+1)); echo $i > /tmp/count; done`)
	// The counter, read through the init's root: it moves while the
	// group runs, stops while it is frozen, and moves again after thaw.
	count := func() int {
		b, _ := os.ReadFile(fmt.Sprintf("/proc/%d/root/tmp/count", sb.Pid()))
		n, _ := strconv.Atoi(strings.TrimSpace(string(b)))
		return n
	}
	waitMoves := func(from int, what string) int {
		deadline := time.Now().Add(10 * time.Second)
		for {
			if n := count(); n > from {
				return n
			}
			if time.Now().After(deadline) {
				t.Fatalf("the counter stayed at %d %s", from, what)
			}
			time.Sleep(10 * time.Millisecond)
		}
	}
	waitMoves(0, "before the freeze")
	if err := g.Freeze(); err != nil {
		t.Fatal(err)
	}
	if !g.Frozen() {
		t.Fatal("not frozen")
	}
	pids, err := g.Pids()
	if err != nil || len(pids) == 0 {
		t.Fatalf("pids %v, %v", pids, err)
	}
	frozen := count()
	time.Sleep(300 * time.Millisecond) // long enough for thousands of steps of a running loop
	if n := count(); n != frozen {
		t.Fatalf("the counter moved from %d to %d while frozen", frozen, n)
	}
	if err := g.Thaw(); err != nil {
		t.Fatal(err)
	}
	if g.Frozen() {
		t.Fatal("still frozen")
	}
	waitMoves(frozen, "after the thaw")
	if err := g.Kill(); err != nil {
		t.Fatal(err)
	}
	if r := <-ch; r.err == nil {
		t.Fatalf("a killed sandbox's exec returned %d, want ErrSandboxDied", r.code)
	}
	if pids, _ := g.Pids(); len(pids) != 0 {
		t.Fatalf("processes left after kill: %v", pids)
	}
}

// TestBadNames: a name that is not one directory is refused, and so is
// the idle parent's on a unified host (IdleGroup).
func TestBadNames(t *testing.T) {
	for _, n := range []string{"", "a/b", "..", ".", cgroup.IdleGroup} {
		if _, err := tree.New(n, cgroup.Limits{}); err == nil {
			t.Errorf("New(%q) succeeded", n)
		}
	}
}

func readFile(t *testing.T, path string) string {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	return strings.TrimSpace(string(b))
}

// cpuDir finds a group's CPU controller directory from one of its pids.
func cpuDir(t *testing.T, pid int) string {
	t.Helper()
	for _, line := range strings.Split(readFile(t, fmt.Sprintf("/proc/%d/cgroup", pid)), "\n") {
		f := strings.SplitN(line, ":", 3)
		switch {
		case len(f) != 3:
		case isPureV2() && f[0] == "0":
			return filepath.Join(cgroup.Root, f[2])
		case slices.Contains(strings.Split(f[1], ","), "cpu"):
			return filepath.Join(cgroup.Root, "cpu", f[2])
		}
	}
	t.Fatalf("pid %d is in no cpu group", pid)
	return ""
}

func isPureV2() bool {
	_, err := os.Stat(filepath.Join(cgroup.Root, "cgroup.controllers"))
	return err == nil
}

func TestBatchAndLatencyGroups(t *testing.T) {
	_, batch, _, _ := sandbox(t, cgroup.Limits{Idle: true}, `sleep 100`)
	_, lat, _, _ := sandbox(t, cgroup.Limits{Weight: 800}, `sleep 100`)
	bd, ld := cpuDir(t, batch.Pid()), cpuDir(t, lat.Pid())
	// The batch group sits under the idle parent, both marked idle, so
	// that latency groups preempt it (and on a hybrid host, the host's
	// tasks too: there the idle parent is at the top).
	if !strings.HasSuffix(filepath.Dir(bd), "/"+tree.IdleParent()) || filepath.Base(filepath.Dir(ld)) != tree.Parent() {
		t.Fatalf("batch group at %s, latency group at %s", bd, ld)
	}
	for _, d := range []string{bd, filepath.Dir(bd)} {
		if v := readFile(t, filepath.Join(d, "cpu.idle")); v != "1" {
			t.Errorf("%s/cpu.idle = %s", d, v)
		}
	}
	if v := readFile(t, filepath.Join(ld, "cpu.idle")); v != "0" {
		t.Errorf("latency group idle: %s", v)
	}
	file, want := "cpu.shares", "8192"
	if isPureV2() {
		file, want = "cpu.weight", "800"
	}
	if v := readFile(t, filepath.Join(ld, file)); v != want {
		t.Errorf("latency group %s = %s, want %s", file, v, want)
	}
	// A restarted worker finds the batch group again.
	name := filepath.Base(bd)
	g, err := tree.Open(name)
	if err != nil {
		t.Fatal(err)
	}
	if pids, err := g.Pids(); err != nil || len(pids) == 0 {
		t.Fatalf("reopened batch group: pids %v, %v", pids, err)
	}
	// And lists it beside the latency one (a sweep after a dead worker
	// goes by the list).
	names, err := tree.List(fmt.Sprintf("test-%d-", os.Getpid()), "")
	if err != nil || !slices.Contains(names, name) || !slices.Contains(names, filepath.Base(ld)) {
		t.Fatalf("listed %v, %v: want %s and %s", names, err, name, filepath.Base(ld))
	}
}

func TestCPUUsageAndReclaim(t *testing.T) {
	// Spinning (~0.3 s), then 32 MiB of page cache, then idle.
	g, _, ch, out := sandbox(t, cgroup.Limits{}, `i=0; while [ $i -lt 100000 ]; do i=$((i+1)); done; dd if=/dev/zero of=/tmp/cache bs=1M count=32 2>/dev/null; sync; echo done`)
	if r := <-ch; r.err != nil || r.code != 0 {
		t.Fatalf("%v %d: %s", r.err, r.code, output(out))
	}
	used, err := g.CPUUsage()
	if err != nil || used < 100*time.Millisecond {
		t.Fatalf("CPU usage after spinning: %v, %v", used, err)
	}
	before, err := g.MemoryCharged()
	if err != nil || before < 32<<20 {
		t.Fatalf("charged %d bytes after writing 32 MiB, %v", before, err)
	}
	if err := g.Reclaim(); err != nil {
		t.Fatal(err)
	}
	after, _ := g.MemoryCharged()
	if before-after < 28<<20 {
		t.Fatalf("reclaim took charged memory from %d to %d bytes", before, after)
	}
}

// TestReclaimUnreclaimable: a group holding only memory no reclaim can
// take (a root on a tmpfs, and a file in its /dev/shm, with no swap) is
// reclaimed at once, without error, again and again. On cgroup2 the
// kernel answers EAGAIN; written through os.File, which polls cgroup
// files, that EAGAIN could park the write for a readiness that never
// comes (seen once, in a guest, in TestCPUUsageAndReclaim; not
// reproduced at will): the write is a plain write(2) now.
func TestReclaimUnreclaimable(t *testing.T) {
	layertest.RequireRoot(t)
	tmpfs := t.TempDir()
	if err := unix.Mount("tmpfs", tmpfs, "tmpfs", 0, "size=128m"); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unix.Unmount(tmpfs, unix.MNT_DETACH) })
	t.Setenv("TMPDIR", tmpfs) // the sandbox's root, made in a t.TempDir
	g, _, ch, _ := sandbox(t, cgroup.Limits{}, `dd if=/dev/zero of=/dev/shm/f bs=1M count=32 && sync`)
	if r := <-ch; r.err != nil || r.code != 0 {
		t.Fatalf("%v %d", r.err, r.code)
	}
	for i := range 20 { // each finds nothing to take
		done := make(chan error, 1)
		go func() { done <- g.Reclaim() }()
		select {
		case err := <-done:
			if err != nil {
				t.Fatal(err)
			}
		case <-time.After(30 * time.Second):
			t.Fatalf("Reclaim %d of memory it cannot take has not returned after 30 s", i+1)
		}
	}
	if n, _ := g.MemoryCharged(); n < 32<<20 {
		t.Errorf("charged %d after reclaim: a tmpfs's file went without swap", n)
	}
}

// TestLimitBelowUnreclaimable: a memory limit below what a group holds
// and the kernel cannot take back (a tmpfs's file, no swap) is refused
// after the tries a busy host's reclaim is given, saying what the group
// uses; the group keeps its limit.
func TestLimitBelowUnreclaimable(t *testing.T) {
	layertest.RequireRoot(t)
	tmpfs := t.TempDir()
	if err := unix.Mount("tmpfs", tmpfs, "tmpfs", 0, "size=128m"); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unix.Unmount(tmpfs, unix.MNT_DETACH) })
	t.Setenv("TMPDIR", tmpfs)
	g, _, ch, _ := sandbox(t, cgroup.Limits{MemoryBytes: 256 << 20}, `dd if=/dev/zero of=/dev/shm/f bs=1M count=32 && sync`)
	if r := <-ch; r.err != nil || r.code != 0 {
		t.Fatalf("%v %d", r.err, r.code)
	}
	t0 := time.Now()
	err := g.SetLimits(cgroup.Limits{MemoryBytes: 8 << 20})
	if err == nil || !strings.Contains(err.Error(), "the group uses") || time.Since(t0) < 200*time.Millisecond {
		t.Errorf("a limit of 8 MiB below 32 MiB of tmpfs: %v after %s, want refused after retries", err, time.Since(t0))
	}
	if m, _ := g.Limits(); m != 256<<20 {
		t.Errorf("the limit after the refusal: %d, want 256 MiB", m)
	}
}

// A v1 directory that will not go keeps the cgroup2 one, by which Open
// finds the group for a second Remove; RemoveLeftover clears what a
// Remove that did not keep it left.
func TestRemoveKeepsGroupFindable(t *testing.T) {
	layertest.RequireRoot(t)
	if isPureV2() {
		t.Skip("pure cgroup v2 host: a group has no v1 directories to be left behind")
	}
	name := fmt.Sprintf("test-%d-%d", os.Getpid(), time.Now().UnixNano())
	freezer := filepath.Join(cgroup.Root, "freezer", tree.Parent(), name)
	g, err := tree.New(name, cgroup.Limits{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.Remove(filepath.Join(freezer, "pin")); tree.RemoveLeftover(name) })
	if err := os.Mkdir(filepath.Join(freezer, "pin"), 0o755); err != nil { // rmdir of the group now fails
		t.Fatal(err)
	}
	if err := g.Remove(); err == nil {
		t.Fatal("Remove of a group whose freezer directory has a child succeeded")
	}
	if _, err := os.Stat(g.Path()); err != nil {
		t.Fatalf("the cgroup2 directory went while a v1 one stayed: %v", err)
	}
	if _, err := os.Stat(filepath.Join(cgroup.Root, "memory", tree.Parent(), name)); err == nil {
		t.Error("the memory directory stayed though it could go")
	}
	if err := os.Remove(filepath.Join(freezer, "pin")); err != nil {
		t.Fatal(err)
	}
	again, err := tree.Open(name)
	if err != nil {
		t.Fatalf("Open after a failed Remove: %v", err)
	}
	if err := again.Remove(); err != nil {
		t.Fatalf("second Remove: %v", err)
	}
	for _, d := range []string{g.Path(), freezer} {
		if _, err := os.Stat(d); err == nil {
			t.Errorf("%s stayed after the second Remove", d)
		}
	}

	// A group an older worker left with only v1 directories.
	g, err = tree.New(name, cgroup.Limits{})
	if err != nil {
		t.Fatal(err)
	}
	if err := os.Remove(g.Path()); err != nil {
		t.Fatal(err)
	}
	if _, err := tree.Open(name); err == nil {
		t.Fatal("Open found a group without its cgroup2 directory")
	}
	if err := tree.RemoveLeftover(name); err != nil {
		t.Fatal(err)
	}
	for _, c := range []string{"memory", "cpu", "pids", "freezer"} {
		if _, err := os.Stat(filepath.Join(cgroup.Root, c, tree.Parent(), name)); err == nil {
			t.Errorf("RemoveLeftover left the %s directory", c)
		}
	}
}

// ownParent makes the sandboxes' parent group one of the test's own
// (not the host's sandboxes'), dsec-test-WHAT-PID, without limits
// after the test.
func ownParent(t *testing.T, what string) {
	old := tree
	tree = cgroup.NewTree(fmt.Sprintf("dsec-test-%s-%d", what, os.Getpid()))
	t.Cleanup(func() {
		tree.LimitParent(cgroup.Limits{})
		tree = old
	})
}

// tree is the sandboxes' groups the tests make: the host's default
// parent's, or a test's own (ownParent).
var tree = cgroup.NewTree("")

// TestParentBoundsAllSandboxes: LimitParent bounds every sandbox
// together, whatever each may use: three sandboxes with no limits of
// their own, each holding 48 MiB, do not fit a 96 MiB parent; the
// kernel kills inside it, and a process outside it (a canary) lives on
// (issue 36).
func TestParentBoundsAllSandboxes(t *testing.T) {
	layertest.RequireRoot(t)
	ownParent(t, "parent")
	if err := tree.LimitParent(cgroup.Limits{MemoryBytes: 96 << 20, Pids: 512}); err != nil {
		t.Fatal(err)
	}
	// The parent goes with its last group and comes back bounded.
	// The parent's limit files: v1's memory and pids hierarchies, or its
	// one cgroup2 directory on a pure v2 host.
	parentFile := map[string]string{
		"memory": filepath.Join(cgroup.Root, "memory", tree.Parent(), "memory.limit_in_bytes"),
		"pids":   filepath.Join(cgroup.Root, "pids", tree.Parent(), "pids.max"),
	}
	if _, err := os.Stat(filepath.Join(cgroup.Root, "cgroup.controllers")); err == nil {
		parentFile = map[string]string{"memory": filepath.Join(cgroup.Root, tree.Parent(), "memory.max"), "pids": filepath.Join(cgroup.Root, tree.Parent(), "pids.max")}
	}
	memLimit := func() string {
		b, _ := os.ReadFile(parentFile["memory"])
		return strings.TrimSpace(string(b))
	}
	for i := range 2 {
		g, err := tree.New(fmt.Sprintf("test-parent-%d-%d", os.Getpid(), i), cgroup.Limits{})
		if err != nil {
			t.Fatal(err)
		}
		if v := memLimit(); v != "100663296" {
			t.Errorf("made again %d times, the parent's memory limit is %q", i, v)
		}
		if err := g.Remove(); err != nil {
			t.Fatal(err)
		}
		if _, err := os.Stat(filepath.Dir(parentFile["memory"])); !os.IsNotExist(err) {
			t.Fatalf("the parent outlived its last group: %v", err)
		}
	}
	canary := exec.Command("sleep", "60")
	if err := canary.Start(); err != nil {
		t.Fatal(err)
	}
	defer canary.Process.Kill()
	before := tree.ParentOOMKills()
	var chs []<-chan result
	var groups []*cgroup.Group
	for range 3 {
		// The command, not a sandbox's init, is the OOM killer's victim
		// (an init built with -race is larger than dd's 48 MiB).
		g, _, ch, _ := sandbox(t, cgroup.Limits{}, `echo 1000 >/proc/self/oom_score_adj; dd if=/dev/zero bs=48M count=1 2>/dev/null | sleep 3`)
		chs = append(chs, ch)
		groups = append(groups, g)
	}
	for _, ch := range chs {
		if r := <-ch; r.err != nil {
			t.Fatal(r.err)
		}
	}
	if n := tree.ParentOOMKills(); n <= before {
		t.Errorf("144 MiB held under a 96 MiB parent: %d OOM kills in the parent, want some", n-before)
	}
	killed := 0
	for _, g := range groups {
		killed += g.OOMKills() // each sandbox says its command was killed for memory
	}
	if killed == 0 {
		t.Errorf("no sandbox reports an OOM kill")
	}
	for kind, want := range map[string]string{"memory": "100663296", "pids": "512"} {
		if b, err := os.ReadFile(parentFile[kind]); err != nil {
			t.Errorf("the parent's %s limit: %v", kind, err)
		} else if v := strings.TrimSpace(string(b)); v != want {
			t.Errorf("the parent's %s limit is %s, want %s", kind, v, want)
		}
	}
	if err := canary.Process.Signal(syscall.Signal(0)); err != nil {
		t.Fatalf("the canary outside dsec's tree died: %v", err)
	}
}

// TestParentBoundsBatch: the parent's bound holds batch sandboxes too,
// on either layout: a batch sandbox alone, its command holding 96 MiB,
// is killed under a 64 MiB parent that it was the first to make. (On a
// host with cgroup v2 only, batch groups once sat beside the parent,
// and the same command ran to its end.)
func TestParentBoundsBatch(t *testing.T) {
	layertest.RequireRoot(t)
	ownParent(t, "batch")
	if err := tree.LimitParent(cgroup.Limits{MemoryBytes: 64 << 20}); err != nil {
		t.Fatal(err)
	}
	before := tree.ParentOOMKills()
	g, _, ch, out := sandbox(t, cgroup.Limits{Idle: true}, `echo 1000 >/proc/self/oom_score_adj; dd if=/dev/zero bs=96M count=1 2>/dev/null | sleep 1`)
	if r := <-ch; r.err != nil {
		t.Fatal(r.err)
	}
	if g.OOMKills() == 0 || tree.ParentOOMKills() <= before {
		t.Fatalf("96 MiB held by a batch sandbox under a 64 MiB parent: %d OOM kills in its group, %d in the parent; output %q",
			g.OOMKills(), tree.ParentOOMKills()-before, output(out))
	}
}

// TestBatchYieldsToLatency: a batch sandbox gets only the CPU a latency
// one leaves. Both spin on one CPU for a second; the batch one gets a
// small part of what the latency one does (SCHED_IDLE's weight is 3
// against a normal group's 1024: the kernel still gives it a tick now
// and then).
func TestBatchYieldsToLatency(t *testing.T) {
	layertest.RequireRoot(t)
	ownParent(t, "yield")
	spin := `while :; do :; done`
	bat, _, _, _ := sandbox(t, cgroup.Limits{Idle: true}, spin)
	lat, _, _, _ := sandbox(t, cgroup.Limits{}, spin)
	var mine, one unix.CPUSet // one CPU of those this test may run on
	if err := unix.SchedGetaffinity(0, &mine); err != nil {
		t.Fatal(err)
	}
	for c := 0; c < 1024; c++ {
		if mine.IsSet(c) {
			one.Set(c)
			break
		}
	}
	for _, g := range []*cgroup.Group{bat, lat} {
		for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(10 * time.Millisecond) {
			pids, _ := g.Pids()
			if len(pids) >= 2 { // the init and its shell
				for _, pid := range pids {
					if err := unix.SchedSetaffinity(pid, &one); err != nil {
						t.Fatal(err)
					}
				}
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("the spinning shell never started: pids %v", pids)
			}
		}
	}
	usage := func(g *cgroup.Group) time.Duration {
		d, err := g.CPUUsage()
		if err != nil {
			t.Fatal(err)
		}
		return d
	}
	b0, l0 := usage(bat), usage(lat)
	time.Sleep(time.Second)
	b, l := usage(bat)-b0, usage(lat)-l0
	// (The latency one's share depends on what else runs there: on a
	// busy host less than the whole second.)
	if l < 50*time.Millisecond || b > l/10 {
		t.Fatalf("on one CPU for a second: the batch sandbox ran %v, the latency one %v", b, l)
	}
	t.Logf("on one CPU for a second: the batch sandbox ran %v, the latency one %v", b, l)
}

// TestLimitsLowerThenRaise: the memory limits of the sandboxes' parent
// and of a sandbox's group go down and up again. cgroup v1 holds
// memory.memsw.limit_in_bytes >= memory.limit_in_bytes at every write:
// a worker whose smaller host reserve lowered the parent's limits to
// 3 GiB left the next one, with the default reserve, unable to raise
// them (EINVAL on the limit, written first), and every create failed
// while a sandbox kept the parent. The same held a sandbox whose policy
// raised its memory. On v1 here (with swap accounting, both files are
// checked); on cgroup2 in TestOnPureV2Host's guest.
func TestLimitsLowerThenRaise(t *testing.T) {
	layertest.RequireRoot(t)
	ownParent(t, "raise")
	// The memory limit files of a group of Parent ("": Parent itself).
	files := func(name string) []string {
		if isPureV2() {
			return []string{filepath.Join(cgroup.Root, tree.Parent(), name, "memory.max")}
		}
		dir := filepath.Join(cgroup.Root, "memory", tree.Parent(), name)
		out := []string{filepath.Join(dir, "memory.limit_in_bytes")}
		if _, err := os.Stat(filepath.Join(dir, "memory.memsw.limit_in_bytes")); err == nil {
			out = append(out, filepath.Join(dir, "memory.memsw.limit_in_bytes"))
		}
		return out
	}
	want := func(name string, n int64) {
		t.Helper()
		for _, f := range files(name) {
			if v := readFile(t, f); v != strconv.FormatInt(n, 10) {
				t.Errorf("%s = %s, want %d", f, v, n)
			}
		}
	}
	group := func(name string, l cgroup.Limits) *cgroup.Group {
		t.Helper()
		g, err := tree.New(fmt.Sprintf("test-raise-%d-%s", os.Getpid(), name), l)
		if err != nil {
			t.Fatalf("a group under the parent: %v", err)
		}
		t.Cleanup(func() { g.Remove() })
		return g
	}
	const low, high = 3 << 30, 20 << 30
	// A worker with a large host reserve, whose sandbox lives on.
	if err := tree.LimitParent(cgroup.Limits{MemoryBytes: low}); err != nil {
		t.Fatal(err)
	}
	group("kept", cgroup.Limits{})
	if !isPureV2() && len(files("")) < 2 {
		t.Log("no memory.memsw.limit_in_bytes here (no swap accounting): only the limit is checked")
	}
	want("", low)
	// The next worker, with the default reserve, and its create.
	if err := tree.LimitParent(cgroup.Limits{MemoryBytes: high}); err != nil {
		t.Fatalf("raising the parent's limit: %v", err)
	}
	want("", high)
	group("next", cgroup.Limits{})
	want("", high)
	// And down again.
	if err := tree.LimitParent(cgroup.Limits{MemoryBytes: low}); err != nil {
		t.Fatalf("lowering the parent's limit: %v", err)
	}
	want("", low)

	// A sandbox's own limit, raised and lowered while it runs.
	g := group("own", cgroup.Limits{MemoryBytes: 64 << 20})
	name := filepath.Base(g.Path())
	want(name, 64<<20)
	for _, n := range []int64{256 << 20, 32 << 20, 128 << 20} {
		if err := g.SetLimits(cgroup.Limits{MemoryBytes: n}); err != nil {
			t.Fatalf("the group's limit to %d MiB: %v", n>>20, err)
		}
		if mem, _ := g.Limits(); mem != n {
			t.Errorf("the group's limit reads %d, want %d", mem, n)
		}
		want(name, n)
	}
}
