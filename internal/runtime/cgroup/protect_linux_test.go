package cgroup_test

import (
	"bytes"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime/debug"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/dsec-project/dsec/internal/layer/layertest"
	"github.com/dsec-project/dsec/internal/runtime/cgroup"
	"github.com/dsec-project/dsec/internal/runtime/microvm/microvmtest"
)

// TestOnPureV2Host runs this package's tests again where the memory
// controller is on cgroup2 alone, as on most hosts now: in a guest on
// the microVM backend's kernel (this host bounds memory with v1, so the
// v2 paths would go untested here). Every test runs there but the one
// that needs a busy host's 512 MiB (TestKillIdleOnBusyHost) and the one
// of v1's directories (TestRemoveKeepsGroupFindable).
func TestOnPureV2Host(t *testing.T) {
	layertest.RequireRoot(t)
	if isPureV2() {
		t.Skip("this host is pure cgroup v2: the package's tests ran on it")
	}
	run := "^Test(UnifiedManager|MemoryLimitReportsOOM|PidsLimit|FreezeThawKill|BadNames|BatchAndLatencyGroups|CPUUsageAndReclaim|ReclaimUnreclaimable|ParentBoundsAllSandboxes|ParentBoundsBatch|BatchYieldsToLatency|LimitsLowerThenRaise|Protect)$"
	microvmtest.RunInGuest(t, microvmtest.Guest{Memory: 768 << 20}, "./internal/runtime/cgroup", run)
}

// TestProtect: the worker's memory protection (issue 36). On a host
// whose memory controller is on cgroup2, Protect moves the process into
// a group beside the sandboxes' parent, outside their tree, with
// memory.min and memory.low set; a process it starts after (a fetcher)
// is born there; a sandbox under a parent bounded small is OOM-killed
// while the protected process lives on. On a v1 host it says it cannot.
func TestProtect(t *testing.T) {
	layertest.RequireRoot(t)
	ownParent(t, "protect")
	if _, err := tree.Protect(cgroup.Protection{Min: 2 << 20, Low: 1 << 20}); err == nil || !strings.Contains(err.Error(), "min <= low") {
		t.Fatalf("min over low: %v", err)
	}
	if !cgroup.MemoryV2.Have() {
		_, err := tree.Protect(cgroup.Protection{Min: 16 << 20, Low: 64 << 20})
		if err == nil || !strings.Contains(err.Error(), "v1") {
			t.Fatalf("on a host whose memory is on v1: %v, want an error that says so", err)
		}
		if p, _ := cgroup.Protected(); p != (cgroup.Protection{}) {
			t.Fatalf("protected %+v on v1", p)
		}
		return // TestOnPureV2Host runs it on v2
	}
	before, err := os.ReadFile("/proc/self/cgroup")
	if err != nil {
		t.Fatal(err)
	}
	dir, err := tree.Protect(cgroup.Protection{Min: 16 << 20, Low: 64 << 20})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { tree.Unprotect() }) // a test that stopped half-way
	if want := filepath.Join(cgroup.Root, tree.Parent()+"-worker"); dir != want {
		t.Fatalf("the worker's group is %s, want %s (beside the sandboxes' parent)", dir, want)
	}
	p, in := cgroup.Protected()
	if in != dir || p != (cgroup.Protection{Min: 16 << 20, Low: 64 << 20}) {
		t.Fatalf("in %s protected %+v", in, p)
	}
	// Again (a worker restarted): the same group, the values replaced.
	if dir2, err := tree.Protect(cgroup.Protection{Min: 8 << 20, Low: 32 << 20}); err != nil || dir2 != dir {
		t.Fatalf("again: %s %v", dir2, err)
	}
	if p, _ := cgroup.Protected(); p != (cgroup.Protection{Min: 8 << 20, Low: 32 << 20}) {
		t.Fatalf("again: protected %+v", p)
	}
	fetcher := exec.Command("sleep", "60")
	if err := fetcher.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() {
		fetcher.Process.Kill()
		fetcher.Wait()
	}()
	b, _ := os.ReadFile(fmt.Sprintf("/proc/%d/cgroup", fetcher.Process.Pid))
	if got := strings.TrimSpace(string(b)); got != "0::/"+tree.Parent()+"-worker" {
		t.Fatalf("a process the worker started is in %q, want its group", got)
	}
	// A sandbox that outgrows the sandboxes' parent is killed in it;
	// the protected process and what it started live on.
	if err := tree.LimitParent(cgroup.Limits{MemoryBytes: 48 << 20}); err != nil {
		t.Fatal(err)
	}
	g, _, ch, _ := sandbox(t, cgroup.Limits{}, `dd if=/dev/zero bs=96M count=1 2>/dev/null | sleep 3`)
	if r := <-ch; r.err != nil {
		t.Fatal(r.err)
	}
	if g.OOMKills() == 0 {
		t.Errorf("96 MiB held under a 48 MiB parent: no OOM kill in the sandbox")
	}
	if err := fetcher.Process.Signal(syscall.Signal(0)); err != nil {
		t.Fatalf("the fetcher in the worker's group died: %v", err)
	}
	protectHolds(t, dir)
	// A worker's exit: back to where it started; the group stays while
	// a fetcher lives in it, and goes with the last.
	if err := tree.Unprotect(); err != nil {
		t.Fatal(err)
	}
	if now, _ := os.ReadFile("/proc/self/cgroup"); string(now) != string(before) {
		t.Fatalf("after Unprotect in %q, want %q", now, before)
	}
	if _, err := os.Stat(dir); err != nil {
		t.Fatalf("the group went with a fetcher in it: %v", err)
	}
	fetcher.Process.Kill()
	fetcher.Wait()
	if err := tree.Unprotect(); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(dir); !os.IsNotExist(err) {
		t.Fatalf("the worker's group outlived its last process: %v", err)
	}
}

// protectHolds: the protection holds against the host's own memory
// pressure. The worker's group writes a file of 64 MiB and then another
// group one of 16 MiB; processes elsewhere then take memory until half
// the other group's page cache has gone (or the OOM killer takes one,
// or they hold 64 MiB more than was available): without the protection
// the worker's would go too. The worker's page cache, under its
// memory.min, stays; the hogs are gone before it returns.
func protectHolds(t *testing.T, worker string) {
	if _, err := tree.Protect(cgroup.Protection{Min: 96 << 20, Low: 96 << 20}); err != nil {
		t.Fatal(err)
	}
	tmp := t.TempDir()
	// By the test, in the worker's group, a MiB at a time: what the
	// group holds must stay under its min for the min to hold all.
	f, err := os.Create(filepath.Join(tmp, "worker"))
	if err != nil {
		t.Fatal(err)
	}
	chunk := bytes.Repeat([]byte{1}, 1<<20)
	for range 64 {
		if _, err := f.Write(chunk); err != nil {
			t.Fatal(err)
		}
	}
	if err := f.Close(); err != nil {
		t.Fatal(err)
	}
	other := group(t, "other")
	if out, err := inGroup(t, other, "sh", "-c", "dd if=/dev/zero of="+filepath.Join(tmp, "other")+" bs=1M count=16 2>&1 && sync").CombinedOutput(); err != nil {
		t.Fatalf("%v: %s", err, out)
	}
	unix.Sync()
	debug.FreeOSMemory()
	if n := readInt(t, worker, "memory.current"); n > 96<<20 {
		t.Fatalf("the worker's group holds %d MiB, more than its min of 96 MiB: the test cannot tell", n>>20)
	}
	fileOf := func(dir string) int64 { return statOf(t, dir, "file") }
	w0, o0 := fileOf(worker), fileOf(other)
	if w0 < 60<<20 || o0 < 15<<20 {
		t.Fatalf("page cache before: worker's group %d MiB, the other's %d MiB; want 64 and 16", w0>>20, o0>>20)
	}
	// The pressure: processes in a group of their own, each holding its
	// share of memory, started in steps until the other group's page
	// cache has lost half, the OOM killer took one, or they hold 64 MiB
	// more than was available. MemAvailable is the kernel's estimate: one
	// hog of all of it but 8 MiB once left the other's cache at a little
	// over half.
	avail := meminfo(t, "MemAvailable")
	hogs := group(t, "hog")
	// What they hold stays in memory (anon counts no swapped pages), on
	// a host with swap too; a host without swap accounting has no file.
	swapMax := filepath.Join(hogs, "memory.swap.max")
	if _, err := os.Stat(swapMax); err == nil {
		if err := os.WriteFile(swapMax, []byte("0"), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	var held int64
	var started []*exec.Cmd
	defer func() { // all of them, dd and sleep too, before the test goes on unprotected
		if err := os.WriteFile(filepath.Join(hogs, "cgroup.kill"), []byte("1"), 0o644); err != nil {
			t.Error(err)
		}
		for _, c := range started {
			c.Wait()
		}
		for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(10 * time.Millisecond) {
			if b, _ := os.ReadFile(filepath.Join(hogs, "cgroup.events")); strings.Contains(string(b), "populated 0") {
				break
			}
			if time.Now().After(deadline) {
				t.Error("the hogs' group still holds processes 10 s after its kill")
				return
			}
		}
	}()
	hold := func(size int64) {
		hog := inGroup(t, hogs, "sh", "-c", fmt.Sprintf("dd if=/dev/zero bs=%dM count=1 2>/dev/null | sleep 1000", size>>20))
		if err := hog.Start(); err != nil {
			t.Fatal(err)
		}
		started = append(started, hog)
		held += size
		// Until the hogs hold it all, or the OOM killer took one.
		for deadline := time.Now().Add(60 * time.Second); statOf(t, hogs, "anon") < held-(1<<20) && eventOf(t, hogs, "oom_kill") == 0; time.Sleep(50 * time.Millisecond) {
			if time.Now().After(deadline) {
				t.Fatalf("the hogs hold %d MiB of their %d after a minute", statOf(t, hogs, "anon")>>20, held>>20)
			}
		}
	}
	hold(avail - 64<<20)
	for fileOf(other) > o0/2 && eventOf(t, hogs, "oom_kill") == 0 && held < avail+64<<20 {
		hold(8 << 20)
	}
	if w := fileOf(worker); w < w0-4<<20 {
		t.Fatalf("under pressure the worker's page cache went from %d to %d MiB, the other group's from %d to %d: memory.min did not hold",
			w0>>20, w>>20, o0>>20, fileOf(other)>>20)
	}
	if o := fileOf(other); o > o0/2 {
		t.Fatalf("with %d MiB taken of %d available, the other group's page cache went from %d to %d MiB only: too little pressure to tell",
			held>>20, avail>>20, o0>>20, o>>20)
	}
	t.Logf("under pressure (hogs of %d MiB of %d available: %d MiB held, OOM kills %d): the worker's page cache %d -> %d MiB, the other group's %d -> %d MiB",
		held>>20, avail>>20, statOf(t, hogs, "anon")>>20, eventOf(t, hogs, "oom_kill"), w0>>20, fileOf(worker)>>20, o0>>20, fileOf(other)>>20)
}

// group makes a group beside the worker's, for the test's processes.
func group(t *testing.T, name string) string {
	dir := filepath.Join(cgroup.Root, tree.Parent()+"-"+name)
	if err := os.Mkdir(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		os.WriteFile(filepath.Join(dir, "cgroup.kill"), []byte("1"), 0o644)
		for deadline := time.Now().Add(10 * time.Second); os.Remove(dir) != nil && time.Now().Before(deadline); {
			time.Sleep(20 * time.Millisecond)
		}
	})
	return dir
}

// inGroup is a command born in the group at dir.
func inGroup(t *testing.T, dir string, args ...string) *exec.Cmd {
	f, err := os.Open(dir)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { f.Close() })
	cmd := exec.Command(args[0], args[1:]...)
	cmd.SysProcAttr = &syscall.SysProcAttr{UseCgroupFD: true, CgroupFD: int(f.Fd())}
	return cmd
}

// readInt is the number a group's file holds.
func readInt(t *testing.T, dir, file string) int64 {
	b, err := os.ReadFile(filepath.Join(dir, file))
	if err != nil {
		t.Fatal(err)
	}
	n, err := strconv.ParseInt(strings.TrimSpace(string(b)), 10, 64)
	if err != nil {
		t.Fatal(err)
	}
	return n
}

// statOf is key's value in the group's memory.stat; eventOf in its
// memory.events.
func statOf(t *testing.T, dir, key string) int64 { return keyed(t, dir, "memory.stat", key) }

func eventOf(t *testing.T, dir, key string) int64 { return keyed(t, dir, "memory.events", key) }

func keyed(t *testing.T, dir, file, key string) int64 {
	b, err := os.ReadFile(filepath.Join(dir, file))
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(line, key+" "); ok {
			n, _ := strconv.ParseInt(v, 10, 64)
			return n
		}
	}
	t.Fatalf("no %s in %s/%s", key, dir, file)
	return 0
}

// meminfo is key's value in /proc/meminfo, in bytes.
func meminfo(t *testing.T, key string) int64 {
	b, err := os.ReadFile("/proc/meminfo")
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(line, key+":"); ok {
			n, _ := strconv.ParseInt(strings.TrimSuffix(strings.TrimSpace(v), " kB"), 10, 64)
			return n << 10
		}
	}
	t.Fatalf("no %s in /proc/meminfo", key)
	return 0
}
