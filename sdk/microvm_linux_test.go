package sdk_test

import (
	"bytes"
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	goruntime "runtime"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/containerd/errdefs"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/dsec-project/dsec/api"
	"github.com/dsec-project/dsec/internal/layer"
	"github.com/dsec-project/dsec/internal/layer/store"
	"github.com/dsec-project/dsec/internal/runtime"
	"github.com/dsec-project/dsec/internal/runtime/initproto"
	"github.com/dsec-project/dsec/internal/runtime/microvm"
	"github.com/dsec-project/dsec/internal/runtime/microvm/microvmtest"
	"github.com/dsec-project/dsec/internal/runtime/runtimetest"
	"github.com/dsec-project/dsec/internal/runtime/worker"
	"github.com/dsec-project/dsec/sdk"
)

// vmSpec is a microVM sandbox's spec on the test layers.
func vmSpec(name string) api.SandboxSpec {
	return api.SandboxSpec{Name: name, Backend: "microvm", Layers: []string{"ws:1", "bb:1"}}
}

// TestMicroVM: what a guest runs on (the worker and inspect say which
// accelerator and kernel), its vCPUs and memory from --cpu and --memory
// (its group holding the guest and QEMU's own), a terminal of the
// guest's of the size asked for, and its layers read through DAX.
func TestMicroVM(t *testing.T) {
	w, c := setupWith(t, runtimetest.Config{MicroVM: microvmtest.Settings(t)})
	ctx := context.Background()
	// A layer with a file of 16 MiB.
	big := t.TempDir()
	os.MkdirAll(filepath.Join(big, "work"), 0o755)
	os.WriteFile(filepath.Join(big, "work", "big"), bytes.Repeat([]byte("0123456789abcdef"), 1<<20), 0o644)
	buildLayer(t, w.Root, "big:1", big)
	v, err := c.Version(ctx)
	if err != nil {
		t.Fatal(err)
	}
	want := microvm.DetectAccel()
	if v.MicroVM == nil || v.MicroVM.Error != "" || v.MicroVM.Accel != want.Name || !strings.Contains(v.MicroVM.Kernel, "amd64") || !strings.Contains(v.MicroVM.QEMU, "QEMU") {
		t.Fatalf("version's microvm: %+v, want accelerator %s", v.MicroVM, want.Name)
	}
	spec := vmSpec("vm")
	spec.Layers = append([]string{"big:1"}, spec.Layers...)
	spec.CPU, spec.Memory = 2, 256<<20
	sb := create(t, c, spec)
	info, err := sb.Inspect(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if info.VM == nil || info.VM.Accel != want.Name || info.VM.Kernel != v.MicroVM.Kernel || info.Backend != "microvm" {
		t.Errorf("inspect: %+v, vm %+v", info, info.VM)
	}
	// The group holds the guest's RAM and QEMU's own memory.
	if info.MemoryLimit <= 256<<20 || info.MemoryLimit > 256<<20+256<<20 {
		t.Errorf("memory limit %d for a 256 MiB guest", info.MemoryLimit)
	}
	out, res := run(t, sb, "machine", "nproc; grep MemTotal /proc/meminfo; uname -r")
	lines := strings.Split(strings.TrimSpace(out), "\n")
	if res.ExitCode != 0 || len(lines) != 3 {
		t.Fatalf("the guest: %q %+v", out, res)
	}
	if lines[0] != "2" {
		t.Errorf("--cpu 2: %s vCPUs", lines[0])
	}
	if kb, _ := strconv.Atoi(strings.Fields(lines[1])[1]); kb < 150<<10 || kb > 256<<10 {
		t.Errorf("--memory 256M: the guest has %s", lines[1])
	}
	if !strings.Contains(v.MicroVM.Kernel, lines[2]) {
		t.Errorf("the guest runs %s, the worker says %s", lines[2], v.MicroVM.Kernel)
	}
	// The layers are read through DAX: the guest reads the host's
	// pages, and its own page cache does not grow (the upper's does).
	out, _ = run(t, sb, "dax", "c() { grep '^Cached:' /proc/meminfo | tr -s ' ' | cut -d' ' -f2; }; a=$(c); cat /work/big > /dev/null; b=$(c); "+
		"head -c 16777216 /work/big > /tmp/copy; cat /tmp/copy > /dev/null; d=$(c); echo $((b-a)) $((d-b))")
	f := strings.Fields(out)
	if len(f) != 2 {
		t.Fatalf("page cache: %q", out)
	}
	layer, upper := must(strconv.Atoi(f[0])), must(strconv.Atoi(f[1]))
	if layer > 4<<10 || upper < 12<<10 {
		t.Errorf("reading 16 MiB of a layer grew the guest's page cache by %d KiB, 16 MiB of its upper by %d KiB: the layer is not read through DAX", layer, upper)
	}
	var tty bytes.Buffer
	res, err = sb.Exec(ctx, sdk.ExecOptions{Args: []string{"sh", "-c", "tty; stty size; test -t 0 && echo stdin-tty"}, TTY: true, Rows: 33, Cols: 101, Stdout: &tty})
	if err != nil || res.ExitCode != 0 {
		t.Fatalf("a terminal: %v %+v", err, res)
	}
	if got := strings.ReplaceAll(tty.String(), "\r", ""); !regexp.MustCompile(`^/dev/pts/\d+\n33 101\nstdin-tty\n$`).MatchString(got) {
		t.Errorf("a terminal in the guest: %q, want one of its own, 33x101", got)
	}
	// The hostname is the sandbox's name, set in the guest.
	if out, _ := run(t, sb, "host", "hostname"); out != "vm\n" {
		t.Errorf("hostname %q", out)
	}
	// Past its memory, the guest's OOM killer takes the command, which
	// says so; the guest lives on.
	out, res = run(t, sb, "hog", `x=$(head -c 300000000 /dev/zero | tr '\0' a); echo ${#x}`)
	if res.ExitCode != 137 || !res.OOM {
		t.Errorf("300 MB in a 256 MiB guest: %q %+v, want an OOM kill it reports", out, res)
	}
	if out, res := run(t, sb, "after-hog", "echo alive"); out != "alive\n" || res.OOM {
		t.Errorf("after the OOM kill: %q %+v", out, res)
	}
	// Class batch: QEMU runs SCHED_IDLE, in the idle parent group.
	bspec := vmSpec("batchvm")
	bspec.Class = api.SchedBatch
	bsb := create(t, c, bspec)
	binfo, err := bsb.Inspect(ctx)
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range qemuPids(t, binfo.Pid) {
		a, err := unix.SchedGetAttr(p, 0)
		if err != nil || a.Policy != unix.SCHED_IDLE {
			t.Errorf("a batch guest's QEMU (pid %d) runs policy %+v %v, want SCHED_IDLE", p, a, err)
		}
	}
}

// qemuPids are the QEMU processes under the shim pid.
func qemuPids(t *testing.T, shim int) []int {
	var out []int
	for _, task := range must(filepath.Glob(filepath.Join("/proc", strconv.Itoa(shim), "task", "*", "children"))) {
		b, _ := os.ReadFile(task)
		for _, p := range strings.Fields(string(b)) {
			if comm, _ := os.ReadFile("/proc/" + p + "/comm"); strings.HasPrefix(string(comm), "qemu") {
				out = append(out, must(strconv.Atoi(p)))
			}
		}
	}
	if len(out) == 0 {
		t.Fatalf("no QEMU under the shim %d", shim)
	}
	return out
}

// TestMicroVMWarm: guests made ahead of need (a FnCall pool's, and the
// sandbox primed on the last create's layers) wait booted and paused,
// their group frozen, and are taken in milliseconds (under TCG too),
// each one once; a call never sees another's files.
func TestMicroVMWarm(t *testing.T) {
	tmpl := vmSpec("")
	tmpl.Memory = 256 << 20
	w, c := setupWith(t, runtimetest.Config{MicroVM: microvmtest.Settings(t), Admission: worker.Admission{Primed: 1},
		Pools: []worker.PoolConfig{{Name: "vms", Size: 1, Spec: tmpl}}})
	ctx := context.Background()
	waitFor(t, "the pool's guest", func() bool { return warm(t, c, "vms") == 1 })
	all, err := c.ListAll(ctx)
	if err != nil || len(all) != 1 || !all[0].Frozen || all[0].Status != api.StatusPaused {
		t.Fatalf("the pool's warm guest: %+v %v, want it paused", all, err)
	}
	t0 := time.Now()
	out, first := call(t, c, sdk.CallOptions{Pool: "vms"}, "echo secret > /work/s; uname -r")
	took := time.Since(t0)
	if !first.Warm || first.ExitCode != 0 || !strings.Contains(out, "amd64") {
		t.Fatalf("a call on the pool: %q %+v", out, first)
	}
	t.Logf("a call on a warm guest: %v (accelerator %s)", took, microvm.DetectAccel().Name)
	waitFor(t, "the pool to refill", func() bool { return warm(t, c, "vms") == 1 })
	out, second := call(t, c, sdk.CallOptions{Pool: "vms"}, "cat /work/s 2>&1; true")
	if !second.Warm || second.Sandbox == first.Sandbox || strings.Contains(out, "secret") {
		t.Fatalf("the second call: %q %+v after %+v", out, second, first)
	}

	// A create primes the next on its layers: taken paused and resumed,
	// named, in well under a boot.
	spec := vmSpec("first")
	spec.Memory = 256 << 20
	create(t, c, spec)
	waitFor(t, "a primed guest", func() bool {
		v, err := c.Version(ctx)
		return err == nil && v.Warm.Primed == 1
	})
	spec.Name = "second"
	t0 = time.Now()
	sb, err := c.Create(ctx, spec)
	took = time.Since(t0)
	if err != nil {
		t.Fatal(err)
	}
	if out, _ := run(t, sb, "who", "hostname; cat /proc/1/comm >/dev/null && echo up"); out != "second\nup\n" {
		t.Errorf("the primed guest taken: %q", out)
	}
	if info, _ := sb.Inspect(ctx); info.Status != api.StatusRunning || info.Frozen || info.VM == nil {
		t.Errorf("the primed guest taken: %+v", info)
	}
	if took > 3*time.Second {
		t.Errorf("a create that took a primed guest took %v", took)
	}
	t.Logf("a create on a primed guest: %v", took)
	_ = w
}

// TestMicroVMNAT: a guest in network mode nat reaches a server outside
// the host through its tap, only where its allowlist lets it (the
// tap's filter: the packets of a denied connection go nowhere), changed
// live by policy apply; with every address allowed it still reaches
// neither the host nor link-local addresses. Removal takes the tap.
func TestMicroVMNAT(t *testing.T) {
	_, c := setupWith(t, runtimetest.Config{MicroVM: microvmtest.Settings(t)})
	runtimetest.Outside(t, "dsecvout", "10.202.0")
	ctx := context.Background()
	rule := func(to string, ports ...uint16) api.EgressRule {
		r := api.EgressRule{To: to}
		for _, p := range ports {
			r.Ports = append(r.Ports, api.PortRange{Low: p, High: p})
		}
		return r
	}
	pol := func(rules ...api.EgressRule) *api.Policy {
		return &api.Policy{APIVersion: api.PolicyVersion, Kind: "Policy", Network: &api.NetworkPolicy{Mode: api.NetworkNAT, Egress: rules}}
	}
	spec := vmSpec("natvm")
	spec.Policy = pol(rule("10.202.0.2", 8080))
	sb := create(t, c, spec)
	info, err := sb.Inspect(ctx)
	if err != nil || info.Address == "" || info.Gateway == "" {
		t.Fatalf("a nat guest's addresses: %+v %v", info, err)
	}
	const dial = "for i in 1 2 3 4 5; do nc -w 2 %s %d </dev/null 2>&1 && exit 0; sleep 0.2; done; exit 1"
	if out, res := run(t, sb, "out", fmt.Sprintf(dial, "10.202.0.2", 8080)); res.ExitCode != 0 || !strings.Contains(out, "hello from outside") {
		t.Fatalf("the allowed server: %q %+v", out, res)
	}
	if out, res := run(t, sb, "eth0", "ip -4 addr show eth0 | grep -c "+info.Address); res.ExitCode != 0 || out != "1\n" {
		t.Errorf("the guest's eth0 does not have %s: %q", info.Address, out)
	}
	// A port the allowlist does not name: its SYN goes nowhere (no
	// server's refusal comes back).
	if out, res := run(t, sb, "denied", "nc -w 2 10.202.0.2 8081 </dev/null 2>&1"); res.ExitCode == 0 || strings.Contains(out, "refused") {
		t.Errorf("a port the allowlist does not name: %q %+v", out, res)
	}
	// Revoked live: a new connection goes nowhere.
	if _, err := sb.ApplyPolicy(ctx, api.PolicyRequest{Policy: pol(rule("10.202.0.3", 8080))}); err != nil {
		t.Fatal(err)
	}
	if out, res := run(t, sb, "revoked", "nc -w 2 10.202.0.2 8080 </dev/null"); res.ExitCode == 0 || strings.Contains(out, "hello") {
		t.Errorf("a revoked rule: %q %+v", out, res)
	}
	// Everything allowed: still not the host, its gateway, nor
	// link-local.
	if _, err := sb.ApplyPolicy(ctx, api.PolicyRequest{Policy: pol(rule("0.0.0.0/0"), rule("10.202.0.0/16"))}); err != nil {
		t.Fatal(err)
	}
	if out, res := run(t, sb, "all", fmt.Sprintf(dial, "10.202.0.2", 8080)); res.ExitCode != 0 || !strings.Contains(out, "hello from outside") {
		t.Fatalf("every address allowed: %q %+v", out, res)
	}
	ln, err := net.Listen("tcp4", "0.0.0.0:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			c.Write([]byte("HOST-SERVICE\n"))
			c.Close()
		}
	}()
	port := ln.Addr().(*net.TCPAddr).Port
	for _, to := range []string{info.Gateway, "10.202.0.1", "169.254.169.254"} {
		if out, _ := run(t, sb, "host-"+to, fmt.Sprintf("nc -w 2 %s %d </dev/null 2>&1", to, port)); strings.Contains(out, "HOST-SERVICE") {
			t.Errorf("the guest reached the host at %s: %q", to, out)
		}
	}
	tap := ""
	if links, err := netlink.LinkList(); err == nil {
		for _, l := range links {
			if addrs, _ := netlink.AddrList(l, netlink.FAMILY_V4); len(addrs) > 0 && addrs[0].IP.String() == info.Gateway {
				tap = l.Attrs().Name
			}
		}
	}
	if tap == "" {
		t.Fatalf("no host interface has the gateway %s", info.Gateway)
	}
	if err := sb.Remove(ctx, true); err != nil {
		t.Fatal(err)
	}
	if _, err := netlink.LinkByName(tap); err == nil {
		t.Errorf("the tap %s is left after remove", tap)
	}
}

// TestMicroVMFaults: what a user meets when a microVM cannot be made:
// a one-line error that says why and what to do, and nothing left on
// the host (Leftovers, after each worker).
func TestMicroVMFaults(t *testing.T) {
	vm := microvmtest.Settings(t)
	ctx := context.Background()
	for _, tc := range []struct {
		name  string
		set   func(*microvm.Settings)
		spec  func(*api.SandboxSpec)
		class func(error) bool
		says  []string
	}{
		{"no QEMU", func(s *microvm.Settings) { s.QEMU = "/nonexistent/qemu-system-x86_64" }, nil, errdefs.IsNotImplemented, []string{"microvm cannot run on this host"}},
		{"no kernel", func(s *microvm.Settings) { s.Kernel = "/nonexistent" }, nil, errdefs.IsNotImplemented, []string{"no microVM guest kernel", "make kernel"}},
		{"too little memory", nil, func(s *api.SandboxSpec) { s.Memory = 64 << 20 }, errdefs.IsInvalidArgument, []string{"at least 128 MiB"}},
		{"more memory than the host's", nil, func(s *api.SandboxSpec) { s.Memory = 1 << 50; s.MemoryRequest = 1 << 20 }, nil, []string{"more than this host's memory"}},
		{"a user namespace", nil, func(s *api.SandboxSpec) { s.UserNS = true }, errdefs.IsInvalidArgument, []string{"--userns is for containers"}},
	} {
		t.Run(strings.ReplaceAll(tc.name, " ", "-"), func(t *testing.T) {
			s := vm
			if tc.set != nil {
				tc.set(&s)
			}
			_, c := setupWith(t, runtimetest.Config{MicroVM: s})
			spec := vmSpec("faulty")
			if tc.spec != nil {
				tc.spec(&spec)
			}
			_, err := c.Create(ctx, spec)
			if err == nil || (tc.class != nil && !tc.class(err)) || strings.Contains(err.Error(), "\n") {
				t.Fatalf("create: %v", err)
			}
			for _, w := range tc.says {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("%q does not say %q", err, w)
				}
			}
			if list, _ := c.List(ctx); len(list) != 0 {
				t.Errorf("a sandbox left: %+v", list)
			}
		})
	}
}

// TestMicroVMGuestFails: a guest whose agent dies (the kernel panics) and
// an accelerator that hangs are errors that say so, with the end of the
// guest's console, and leave nothing behind; so is QEMU killed with -9
// under a running sandbox, which is then dead (an infrastructure
// failure to its clients) and removed whole.
func TestMicroVMGuestFails(t *testing.T) {
	vm := microvmtest.Settings(t)
	ctx := context.Background()
	t.Run("panic", func(t *testing.T) {
		// An agent that exits at once: the kernel panics, as it does
		// when a guest's init dies.
		s := vm
		s.Agent = staticProgram(t, "os.Exit(3)")
		_, c := setupWith(t, runtimetest.Config{MicroVM: s})
		_, err := c.Create(ctx, vmSpec("panics"))
		if !sdk.IsInfra(err) || !strings.Contains(err.Error(), "ended before its guest came up") || !strings.Contains(err.Error(), "Kernel panic") || strings.Contains(err.Error(), "\n") {
			t.Fatalf("a guest whose init exits: %v", err)
		}
	})
	t.Run("hang", func(t *testing.T) {
		// An agent that never answers: the boot's bound ends it.
		s := vm
		s.Agent, s.BootTimeout = staticProgram(t, "for { time.Sleep(time.Hour) }"), 3*time.Second
		_, c := setupWith(t, runtimetest.Config{MicroVM: s})
		t0 := time.Now()
		_, err := c.Create(ctx, vmSpec("hangs"))
		if !sdk.IsInfra(err) || !strings.Contains(err.Error(), "did not come up within 3s (accelerator") || time.Since(t0) > 30*time.Second {
			t.Fatalf("a guest that never comes up: %v after %v", err, time.Since(t0))
		}
	})
	t.Run("pvm", func(t *testing.T) {
		if a := microvm.DetectAccel(); !strings.Contains(a.Why, "PVM") {
			t.Skipf("SKIPPED: needs a host whose /dev/kvm is PVM, which boots no stock guest; this one: %s (%s)", a.Name, a.Why)
		}
		// KVM asked for where it is PVM: QEMU cannot run the guest, and
		// says why.
		s := vm
		s.Accel, s.BootTimeout = microvm.AccelKVM, 10*time.Second
		_, c := setupWith(t, runtimetest.Config{MicroVM: s})
		_, err := c.Create(ctx, vmSpec("pvm"))
		if err == nil || !strings.Contains(err.Error(), "accelerator kvm") || strings.Contains(err.Error(), "\n") {
			t.Fatalf("a guest under PVM's KVM: %v", err)
		}
		t.Logf("KVM on PVM: %v", err)
	})
	t.Run("qemu-killed", func(t *testing.T) {
		_, c := setupWith(t, runtimetest.Config{MicroVM: vm})
		sb := create(t, c, vmSpec("killed"))
		// Written through to its disk (the guest writes back within a
		// second anyway; a kill may come sooner).
		run(t, sb, "before", "echo kept > /work/f; sync")
		info, err := sb.Inspect(ctx)
		if err != nil {
			t.Fatal(err)
		}
		syscall.Kill(qemuPids(t, info.Pid)[0], syscall.SIGKILL)
		var res api.ExecResult
		for deadline := time.Now().Add(20 * time.Second); time.Now().Before(deadline); time.Sleep(50 * time.Millisecond) {
			if res, err = sb.Exec(ctx, sdk.ExecOptions{Args: []string{"true"}}); err != nil {
				break
			}
		}
		// The exec that finds the guest gone is an infrastructure
		// error; one after the worker saw it go (its agent's link ends
		// with it) is told the sandbox is dead.
		if !sdk.IsInfra(err) && !(errdefs.IsFailedPrecondition(err) && strings.Contains(err.Error(), "is dead")) {
			t.Fatalf("an exec once QEMU was killed: %+v %v, want an infrastructure error or the sandbox dead", res, err)
		}
		if info, _ := sb.Inspect(ctx); info.Status != api.StatusDead {
			t.Errorf("status %s, want dead", info.Status)
		}
		// Started again, it has its files.
		if err := sb.Start(ctx); err != nil {
			t.Fatal(err)
		}
		if out, _ := run(t, sb, "after", "cat /work/f"); out != "kept\n" {
			t.Errorf("after a restart: %q", out)
		}
	})
}

// buildLayer builds src into root's store as tag.
func buildLayer(t *testing.T, root, tag, src string) {
	t.Helper()
	s, err := store.Open(filepath.Join(root, "store"))
	if err != nil {
		t.Fatal(err)
	}
	ref, _ := layer.ParseRef(tag)
	if _, err := layer.Build(context.Background(), s, layer.BuildOptions{Source: src, Kind: layer.KindWorkspace, Ref: ref}); err != nil {
		t.Fatal(err)
	}
}

// staticProgram builds a static Go program whose main is body (os
// imported), for a guest's /init.
func staticProgram(t *testing.T, body string) string {
	t.Helper()
	dir := t.TempDir()
	os.WriteFile(filepath.Join(dir, "main.go"), []byte("package main\nimport (\"os\"; \"time\")\nvar _, _ = os.Exit, time.Sleep\nfunc main() { "+body+" }\n"), 0o644)
	os.WriteFile(filepath.Join(dir, "go.mod"), []byte("module prog\n"), 0o644)
	cmd := exec.Command(filepath.Join(goruntime.GOROOT(), "bin", "go"), "build", "-o", "prog", ".")
	cmd.Dir, cmd.Env = dir, append(os.Environ(), "CGO_ENABLED=0")
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("%v %s", err, out)
	}
	return filepath.Join(dir, "prog")
}

func must[T any](v T, err error) T {
	if err != nil {
		panic(err)
	}
	return v
}

// TestMicroVMDeepStack: a stack deeper than a guest has layer devices
// for (a deep image's) runs on a microVM: its deepest layers are folded
// into one base layer, built once and found by the next create; the
// guest sees every layer's files, an upper layer's whiteout included;
// the container backend stacks the same layers unfolded, and a microVM
// on a snapshot of that container folds the deepest under the snapshot.
func TestMicroVMDeepStack(t *testing.T) {
	w, c := setupWith(t, runtimetest.Config{MicroVM: microvmtest.Settings(t)})
	ctx := context.Background()
	n := initproto.MaxLayers + 6
	var layers []string // topmost first, over bb:1
	for i := range n - 1 {
		dir := t.TempDir()
		os.WriteFile(filepath.Join(dir, fmt.Sprintf("f%02d", i)), []byte(fmt.Sprintf("layer %d\n", i)), 0o644)
		if i == n-2 { // the topmost hides the deepest's file
			unix.Mknod(filepath.Join(dir, "f00"), unix.S_IFCHR, 0)
		}
		tag := fmt.Sprintf("deep%02d:1", i)
		buildLayer(t, w.Root, tag, dir)
		layers = append([]string{tag}, layers...)
	}
	layers = append(layers, "bb:1")
	check := func(sb *sdk.Sandbox) {
		t.Helper()
		out, res := run(t, sb, "files", `cat /f01 /f$(printf %02d `+strconv.Itoa(n-2)+`); test -e /f00 || echo hidden; ls /bin/busybox`)
		if want := fmt.Sprintf("layer 1\nlayer %d\nhidden\n/bin/busybox\n", n-2); out != want || res.ExitCode != 0 {
			t.Errorf("%d layers: %q (exit %d), want %q", n, out, res.ExitCode, want)
		}
	}
	vm := create(t, c, api.SandboxSpec{Name: "deep", Backend: "microvm", Layers: layers})
	check(vm)
	info, err := vm.Inspect(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if len(info.Layers) != initproto.MaxLayers || !strings.HasPrefix(info.Layers[len(info.Layers)-1], runtime.FoldedPrefix) || info.Layers[0] != layers[0] {
		t.Fatalf("a microVM on %d layers stands on %v, want the top %d and one folded", n, info.Layers, initproto.MaxLayers-1)
	}
	folded := info.Layers[len(info.Layers)-1]
	s, err := store.Open(filepath.Join(w.Root, "store"))
	if err != nil {
		t.Fatal(err)
	}
	before, err := layer.Resolve(ctx, s, folded)
	if err != nil {
		t.Fatal(err)
	}
	// The next create finds the fold: the same layer, not built again.
	vm2 := create(t, c, api.SandboxSpec{Name: "deep2", Backend: "microvm", Layers: layers})
	check(vm2)
	if info2, _ := vm2.Inspect(ctx); !slices.Equal(info2.Layers, info.Layers) {
		t.Errorf("the second create stands on %v, the first on %v", info2.Layers, info.Layers)
	}
	if after, err := layer.Resolve(ctx, s, folded); err != nil || after.Created != before.Created {
		t.Errorf("the fold was built again: %v %v", after, err)
	}
	// A container stacks them all.
	ct := create(t, c, api.SandboxSpec{Name: "deepct", Layers: layers})
	check(ct)
	if info, _ := ct.Inspect(ctx); len(info.Layers) != n {
		t.Errorf("a container on %d layers stands on %d", n, len(info.Layers))
	}
	// A microVM on a snapshot of it: the snapshot over the top layers,
	// the deepest folded (one more of them: the snapshot is a layer).
	run(t, ct, "mine", "echo mine > /mine")
	if _, err := ct.PackDiff(ctx, api.PackRequest{Tag: "deepsnap:1"}); err != nil {
		t.Fatal(err)
	}
	br := create(t, c, api.SandboxSpec{Name: "deepsnap", Backend: "microvm", Snapshot: "deepsnap:1", Layers: []string{}})
	check(br)
	if out, _ := run(t, br, "mine", "cat /mine"); out != "mine\n" {
		t.Errorf("the snapshot's file: %q", out)
	}
	if info, _ := br.Inspect(ctx); len(info.Layers) != initproto.MaxLayers || info.Layers[0] != "deepsnap:1" || !strings.HasPrefix(info.Layers[len(info.Layers)-1], runtime.FoldedPrefix) {
		t.Errorf("a microVM on the snapshot stands on %v, want it over %d layers, the deepest folded", info.Layers, initproto.MaxLayers-1)
	}
}
