package cgroup

import (
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"

	"golang.org/x/sys/unix"
)

// TestUnifiedManager drives the cgroup2-only manager on a cgroup2 mount
// of the test's own, so that a hybrid host (this one) tests it too: the
// layout, New's preparation, a process moved in, freezing, killing,
// removal. Limits are checked only where the host's cgroup2 hierarchy
// has the memory and pids controllers (a pure v2 host); on a hybrid one
// they are v1's, and the v2 files are absent.
func TestUnifiedManager(t *testing.T) {
	if os.Getuid() != 0 {
		t.Skip("needs root: mounts cgroup2")
	}
	dir := t.TempDir()
	if err := unix.Mount("cgroup2", dir, "cgroup2", 0, ""); err != nil {
		t.Fatalf("mount cgroup2: %v", err)
	}
	t.Cleanup(func() { unix.Unmount(dir, unix.MNT_DETACH) })
	oldRoot := Root
	Root = dir
	t.Cleanup(func() { Root = oldRoot })
	tree := NewTree("dsec-test-unified-" + strconv.Itoa(os.Getpid()))
	Parent := tree.Parent()

	m := unified{Parent}
	b, _ := os.ReadFile(filepath.Join(dir, "cgroup.controllers"))
	controllers := string(b)
	var l Limits
	pure := slices.Contains(strings.Fields(controllers), "memory") && slices.Contains(strings.Fields(controllers), "pids")
	if pure {
		l = Limits{MemoryBytes: 64 << 20, Pids: 100}
		// The parent bounded too. (First in TestOnPureV2Host's guest,
		// whose root hands no controller down yet: the parent's
		// memory.max comes only once the root hands memory down.)
		if err := tree.LimitParent(Limits{MemoryBytes: 256 << 20}); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { tree.LimitParent(Limits{}) })
	}
	g, err := tree.newGroup(m, "t-1", l)
	if err != nil {
		t.Fatal(err)
	}
	if b, _ := os.ReadFile(filepath.Join(dir, Parent, "memory.max")); pure && strings.TrimSpace(string(b)) != "268435456" {
		t.Fatalf("the parent's memory.max is %q, want 268435456", b)
	}
	if want := filepath.Join(dir, Parent, "t-1"); g.v2 != want || g.Path() != want || g.cpuDir() != want || len(g.v1) != 0 {
		t.Fatalf("layout: %+v, want everything at %s", g, want)
	}
	if pure {
		if mem, pids := g.Limits(); mem != l.MemoryBytes || pids != l.Pids {
			t.Fatalf("limits read back %d, %d", mem, pids)
		}
	}
	cmd := exec.Command("sleep", "1000")
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer cmd.Process.Kill()
	if err := g.Add(cmd.Process.Pid); err != nil {
		t.Fatal(err)
	}
	if pids, err := g.Pids(); err != nil || !slices.Equal(pids, []int{cmd.Process.Pid}) {
		t.Fatalf("pids %v %v", pids, err)
	}
	if err := g.Freeze(); err != nil || !g.Frozen() {
		t.Fatalf("freeze: %v, frozen %v", err, g.Frozen())
	}
	if err := g.Thaw(); err != nil || g.Frozen() {
		t.Fatalf("thaw: %v, frozen %v", err, g.Frozen())
	}
	if err := g.Kill(); err != nil {
		t.Fatal(err)
	}
	if err := cmd.Wait(); err == nil {
		t.Fatal("the group's process survived its kill")
	}
	if n := g.OOMKills(); n != 0 {
		t.Fatalf("%d OOM kills", n)
	}
	if err := g.Remove(); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(dir, Parent)); !os.IsNotExist(err) {
		t.Fatalf("the parent outlived its last group: %v", err)
	}
	// An idle group sits under the parent, in its idle parent (its
	// bound holds it), and both go with it.
	if slices.Contains(strings.Fields(controllers), "cpu") {
		g, err := tree.newGroup(m, "t-2", Limits{Idle: true})
		if err != nil {
			t.Fatal(err)
		}
		if want := filepath.Join(dir, Parent, IdleGroup, "t-2"); g.v2 != want {
			t.Fatalf("an idle group at %s, want %s", g.v2, want)
		}
		if b, err := os.ReadFile(filepath.Join(dir, Parent, IdleGroup, "cpu.idle")); err != nil || strings.TrimSpace(string(b)) != "1" {
			t.Fatalf("the idle parent's cpu.idle: %q, %v", b, err)
		}
		if err := g.Remove(); err != nil {
			t.Fatal(err)
		}
		if _, err := os.Stat(filepath.Join(dir, Parent)); !os.IsNotExist(err) {
			t.Fatalf("the parent outlived its last (idle) group: %v", err)
		}
	}
	// An idle group an earlier build made beside the parent (outside
	// its bound) is still found, listed and removed, by a worker that
	// restarts on the new build.
	old := filepath.Join(dir, Parent+IdleSuffix, "t-3")
	if err := os.MkdirAll(old, 0o755); err != nil {
		t.Fatal(err)
	}
	if g, err := tree.Open("t-3"); err != nil || g.v2 != old {
		t.Fatalf("open an earlier build's idle group: %+v, %v", g, err)
	} else if names, err := tree.List("t-", ""); err != nil || !slices.Contains(names, "t-3") {
		t.Fatalf("listed %v, %v: want t-3", names, err)
	} else if err := g.Remove(); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Dir(old)); !os.IsNotExist(err) {
		t.Fatalf("the earlier build's idle parent outlived its last group: %v", err)
	}
	if got := m.parentDirs(); !slices.Equal(got, []string{filepath.Join(dir, Parent)}) {
		t.Fatalf("parent dirs %v", got)
	}
	if mem, pids := m.parentFiles(filepath.Join(dir, Parent)); mem != "memory.max" || pids != "pids.max" {
		t.Fatalf("parent files %s %s", mem, pids)
	}
}

// TestV1Mount: a v1 hierarchy is found by its controllers (or its name)
// among the mounts under Root, whatever else its options say.
func TestV1Mount(t *testing.T) {
	const info = `25 1 0:23 / /sys/fs/cgroup ro,nosuid - tmpfs tmpfs ro,mode=755
26 25 0:24 / /sys/fs/cgroup/unified rw,nosuid - cgroup2 cgroup2 rw,nsdelegate
27 25 0:25 / /sys/fs/cgroup/systemd rw,nosuid - cgroup cgroup rw,xattr,name=systemd
28 25 0:26 / /sys/fs/cgroup/cpu,cpuacct rw,nosuid - cgroup cgroup rw,cpu,cpuacct
29 25 0:27 / /sys/fs/cgroup/net_cls,net_prio rw,nosuid - cgroup cgroup rw,net_cls,net_prio
30 25 0:28 / /sys/fs/cgroup/cpuset rw,nosuid - cgroup cgroup rw,cpuset,clone_children
31 1 0:29 / /mnt/other rw - cgroup cgroup rw,blkio
`
	for _, c := range []struct {
		ctrls []string
		want  string
	}{
		{[]string{"name=systemd"}, "systemd"},
		{[]string{"cpu", "cpuacct"}, "cpu,cpuacct"},
		{[]string{"net_cls", "net_prio"}, "net_cls,net_prio"},
		{[]string{"cpuset"}, "cpuset"},
		{[]string{"blkio"}, ""}, // mounted elsewhere than Root
		{[]string{"hugetlb"}, ""},
	} {
		if got := v1Mount(info, c.ctrls); got != c.want {
			t.Errorf("%v: %q, want %q", c.ctrls, got, c.want)
		}
	}
}
