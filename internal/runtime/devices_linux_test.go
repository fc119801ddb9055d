package runtime_test

import (
	"bufio"
	"context"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
	"golang.org/x/sys/unix"

	"github.com/dsec-project/dsec/internal/layer/store"
	"github.com/dsec-project/dsec/internal/policy"
	"github.com/dsec-project/dsec/internal/runtime"
	"github.com/dsec-project/dsec/internal/runtime/cgroup"
	"github.com/dsec-project/dsec/internal/runtime/runtimetest"
)

// diskDevice is the major:minor of the file system mounted at dir.
func diskDevice(t *testing.T, dir string) string {
	t.Helper()
	f, err := os.Open("/proc/self/mountinfo")
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	s := bufio.NewScanner(f)
	for s.Scan() {
		fs := strings.Fields(s.Text())
		if len(fs) > 4 && fs[4] == dir {
			return fs[2]
		}
	}
	t.Fatalf("nothing mounted at %s", dir)
	return ""
}

// TestDeviceIsolation: sandbox A keeps a secret on its disk quota (a
// loop device); a root agent in sandbox B makes a node of that device
// and reads it. B is made every way a sandbox is (its own init, a spare,
// a primed one, a user namespace), started again after a stop and
// re-adopted by a new worker; each time the node is made but never
// opens, on B's own root (nodev: EACCES) nor on a volume mounted without
// nodev (the device allowlist: EPERM), and B's cgroup carries the
// program and, where mounted, the v1 devices controller's list.
func TestDeviceIsolation(t *testing.T) {
	root, s := layers(t)
	ctx := context.Background()
	spares := prepared(runtime.NewDrivers(runtime.DriverConfig{Root: root, Spares: 1}))
	// Three hosts on one root, used one after the other: a plain one,
	// one with a spare init, one with a primed sandbox.
	plain := &runtime.Host{Root: root, Store: s}
	mSpare := &runtime.Host{Root: root, Store: s, Drivers: spares}
	mPrimed := &runtime.Host{Root: root, Store: s}
	primed := mPrimed.StartPrimed(1)
	mPrimed.Primed = primed
	t.Cleanup(func() {
		primed.Close()
		spares.Close()
		runtimetest.Clean(root)
		if l := runtimetest.Leftovers(root); len(l) > 0 {
			t.Errorf("left behind: %v", l)
		}
	})
	create := func(o runtime.Spec, h *runtime.Host) *runtime.Sandbox {
		t.Helper()
		sb, err := h.Create(ctx, o)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { sb.Remove() })
		return sb
	}
	a := create(runtime.Spec{Name: "a", Layers: []string{"bb:1"}, Disk: 32 << 20}, plain)
	if out, code := sh(t, a, "secret", "echo SECRET-OF-A > /secret && sync"); code != 0 {
		t.Fatalf("A: %s", out)
	}
	var major, minor int
	dev := diskDevice(t, filepath.Join(a.Dir(), "disk"))
	fmt.Sscanf(dev, "%d:%d", &major, &minor)
	// The positive control: the host reads the secret through the node.
	node := filepath.Join(t.TempDir(), "l")
	if err := unix.Mknod(node, unix.S_IFBLK|0o600, int(unix.Mkdev(uint32(major), uint32(minor)))); err != nil {
		t.Fatal(err)
	}
	if b, err := os.ReadFile(node); err != nil || !strings.Contains(string(b), "SECRET-OF-A") {
		t.Fatalf("positive control: the host reads A's disk %s: %v", dev, err)
	}

	attack := fmt.Sprintf(`for d in /tmp /mnt/vol; do
  rm -f $d/l; mknod $d/l b %d %d && echo "mknod $d ok"
  if grep -a SECRET $d/l; then echo "read $d"; fi
done 2>&1`, major, minor)
	try := func(how string, sb *runtime.Sandbox, n int) {
		t.Helper()
		st := sb.Current()
		g, err := cgroup.NewTree("").Open(st.CgroupName)
		if err != nil {
			t.Fatalf("%s: %v", how, err)
		}
		if !policy.DevicesAttached(g.Path()) {
			t.Errorf("%s: no device program on %s", how, g.Path())
		}
		if list, err := os.ReadFile(filepath.Join(cgroup.Root, "devices", cgroup.DefaultParent, st.CgroupName, "devices.list")); err == nil {
			if strings.Contains(string(list), "a *:* rwm") || !strings.Contains(string(list), "c 1:3 rw") {
				t.Errorf("%s: v1 devices.list %q", how, list)
			}
		}
		sh(t, sb, fmt.Sprint("mkdir-", n), "mkdir -p /mnt/vol") // as its own root: a user namespace's maps no host id
		mountFSInto(t, st.Pid, "tmpfs", "tmpfs", "/mnt/vol")
		out, _ := sh(t, sb, fmt.Sprint("attack-", n), attack)
		if strings.Contains(out, "SECRET") || strings.Contains(out, "read ") {
			t.Errorf("%s: B read A's disk: %s", how, out)
		}
		if st.UserNS {
			return // its root may make no node at all
		}
		for _, want := range []string{"mknod /tmp ok", "mknod /mnt/vol ok", "/tmp/l: Permission denied", "/mnt/vol/l: Operation not permitted"} {
			if !strings.Contains(out, want) {
				t.Errorf("%s: %q lacks %q", how, out, want)
			}
		}
	}

	own := create(runtime.Spec{Name: "own", Layers: []string{"bb:1"}}, plain)
	try("own init", own, 0)
	before, _ := runtime.Groups(nil, root) // the spare's among them
	spare := create(runtime.Spec{Name: "spare", Layers: []string{"bb:1"}}, mSpare)
	if !slices.Contains(before, spare.Current().CgroupName) {
		t.Errorf("spare: the sandbox did not take a spare: %s", spare.Current().CgroupName)
	}
	try("spare", spare, 1)
	create(runtime.Spec{Name: "prime", Layers: []string{"bb:1"}}, mPrimed)
	primed.Refill() // as the worker does once a create is answered
	ready := waitPrimed(t, primed, root, 1)
	pr := create(runtime.Spec{Name: "primed", Layers: []string{"bb:1"}}, mPrimed)
	if pr.Dir() != ready[0] {
		t.Errorf("primed: the sandbox did not take a primed one: %s", pr.Current().CgroupName)
	}
	try("primed", pr, 2)
	us := create(runtime.Spec{Name: "userns", Layers: []string{"bb:1"}, UserNS: true}, plain)
	try("user namespace", us, 3)

	if err := own.Stop(); err != nil {
		t.Fatal(err)
	}
	if err := own.Start(ctx); err != nil {
		t.Fatal(err)
	}
	try("after stop and start", own, 4)
	own.Close() // the worker goes; a new one adopts the sandbox
	// As an older dsec would have left it: no device program.
	g, err := cgroup.NewTree("").Open(own.Current().CgroupName)
	if err != nil {
		t.Fatal(err)
	}
	detachDevices(t, g.Path())
	if policy.DevicesAttached(g.Path()) {
		t.Fatal("the device program is still attached")
	}
	again, err := (&runtime.Host{Root: root, Store: s}).Load("own")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { again.Remove() })
	try("re-adopted", again, 5)
}

// detachDevices takes the device programs off the cgroup2 directory cg.
func detachDevices(t *testing.T, cg string) {
	t.Helper()
	dir, err := os.Open(cg)
	if err != nil {
		t.Fatal(err)
	}
	defer dir.Close()
	q, err := link.QueryPrograms(link.QueryOptions{Target: int(dir.Fd()), Attach: ebpf.AttachCGroupDevice})
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range q.Programs {
		prog, err := ebpf.NewProgramFromID(p.ID)
		if err != nil {
			t.Fatal(err)
		}
		err = link.RawDetachProgram(link.RawDetachProgramOptions{Target: int(dir.Fd()), Program: prog, Attach: ebpf.AttachCGroupDevice})
		prog.Close()
		if err != nil {
			t.Fatal(err)
		}
	}
}

// BenchmarkDevices: create to first exec of a sandbox that starts its own
// init (as a user namespace's or a batch one's does; a spare's group gets
// the allowlist before the create comes), with the device allowlist (the
// cgroup program and the v1 controller's lines) and without, alternating
// in one loop. make bench prints the p50s and their difference.
func BenchmarkDevices(b *testing.B) {
	root := b.TempDir()
	runtimetest.Layers(b, root)
	s, err := store.Open(filepath.Join(root, "store"))
	if err != nil {
		b.Fatal(err)
	}
	defer runtime.SetNoDevices(false)
	var d [2][]time.Duration
	h := &runtime.Host{Root: root, Store: s}
	i := 0
	for b.Loop() {
		runtime.SetNoDevices(i%2 == 1)
		first, _ := createExecRemove(b, h, runtime.Spec{Name: fmt.Sprint("bench-", i), Layers: []string{"bb:1"}})
		d[i%2] = append(d[i%2], first)
		i++
	}
	if l := runtimetest.Leftovers(root); len(l) > 0 {
		b.Fatalf("left behind: %v", l)
	}
	on, off := p50(d[0]), p50(d[1])
	b.ReportMetric(on, "devices-p50-ms")
	b.ReportMetric(off, "none-p50-ms")
	b.ReportMetric(on-off, "added-p50-ms")
}

// p50 is the median of x, in milliseconds (x is sorted).
func p50(x []time.Duration) float64 {
	slices.Sort(x)
	return float64(x[len(x)/2].Microseconds()) / 1000
}

// createExecRemove makes a sandbox, runs true in it and removes it:
// how long until true was done, and until the sandbox was gone.
func createExecRemove(b *testing.B, h *runtime.Host, o runtime.Spec) (first, whole time.Duration) {
	t0 := time.Now()
	sb, err := h.Create(context.Background(), o)
	if err != nil {
		b.Fatal(err)
	}
	e, _, err := sb.Run(context.Background(), runtime.ExecSpec{ID: "true", Args: []string{"/bin/true"}})
	if err != nil {
		b.Fatal(err)
	}
	if res, err := e.Result(context.Background()); err != nil || res.ExitCode != 0 {
		b.Fatal(res, err)
	}
	first = time.Since(t0)
	if err := sb.Remove(); err != nil {
		b.Fatal(err)
	}
	return first, time.Since(t0)
}
